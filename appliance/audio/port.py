"""The audio backend as one interface: :class:`AudioPort`, and the ports that are not sound cards.

A port is where the appliance meets the air. It pulls the speaker's samples from the playback buffer,
delivers microphone blocks (with the far end that was played meanwhile) to the capture side, and pauses,
resumes and flushes the output with a fade (:class:`appliance.audio.fader.Fader`) at the place that holds
the last samples before the speaker. Three kinds implement it, chosen by
:func:`appliance.audio.backends.open_port` or passed in, as gpiozero's pin factories sit behind one
``Factory``; nothing looks for a device with ``if … is None``:

- :class:`appliance.audio.device.DeviceAudio`: real sound cards through PortAudio, in a worker process
  (the fader runs in the worker, on its output ring);
- :class:`appliance.audio.room.RoomPort`: the simulated room of ``appliance replay``, the tests and the
  benchmarks (:class:`appliance.audio.room.SimulatedRoom`), paced on the wall clock or not;
- :class:`NullPort`: no room and no card; whoever calls :meth:`PullPort.read` is the speaker (tests).

Units: the pull rate is the playback buffer's rate (Hz, ``rate``); capture blocks are float32 mono 16 kHz
(:data:`appliance.audio.files.MODEL_RATE`); the far end is float32 mono 16 kHz, possibly empty.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Callable, Optional

import numpy as np

from .fader import Fader, fade_samples

Pull = Callable[[int], np.ndarray]  # pull(n) -> float32 [n] at the port's rate (Playback.take)
Capture = Callable[[np.ndarray, np.ndarray], None]  # capture(mic, far_end), both float32 mono 16 kHz
OnSilent = Callable[[], None]  # a fade out (pause, flush) reached silence; must not block
OnStatus = Callable[[str, dict], None]  # on_status(kind, info): "open", "lost", "unavailable"; must not block
Settled = Callable[[], bool]  # the pipeline has caught up with the audio handed to capture


class AudioPort(ABC):
    """The speaker and the microphone, whatever they are.

    Life cycle: construct (nothing runs), :meth:`start` (threads or processes start; never blocks on a
    device), then the controls from any thread, then :meth:`stop`. The controls never block and are
    no-ops while nothing is open.
    """

    rate: int  # the pull rate, Hz (the playback buffer's rate)
    clock: Optional[Callable[[], float]] = None  # the session timeline's clock, s; None: the wall clock

    @abstractmethod
    def start(self, pull: Pull, capture: Capture, on_silent: Optional[OnSilent] = None, *,
              on_status: Optional[OnStatus] = None, settled: Optional[Settled] = None) -> None:
        """Begin: ``pull(n)`` is asked for the speaker's next ``n`` samples (float32, at :attr:`rate`),
        ``capture(mic, far_end)`` gets each microphone block, ``on_silent()`` is told when a pause's or a
        flush's fade out has reached silence. Callbacks come from the port's own threads and must not block.

        ``on_status(kind, info)`` hears ``"open"`` once the port plays (a port with no device of its own:
        at once, from here; a device: after each open, so a second ``open`` is a reopened device),
        ``"lost"`` (``reason``) and ``"unavailable"`` (``reason``, ``repeated``, …). ``settled()`` is for
        a port that runs faster than real time (the unpaced room): after each capture block it waits until
        ``settled()``, as a person would wait for the reply; real-time ports ignore it."""

    @abstractmethod
    def pause(self) -> None:
        """Fade out within the fade time and hold what has not played yet (nothing is dropped)."""

    @abstractmethod
    def resume(self) -> None:
        """Fade back in where the pause stopped: no sample dropped or repeated."""

    @abstractmethod
    def flush(self) -> None:
        """Fade out and drop what the port holds of the current output (an interrupted reply)."""

    def wake(self) -> None:
        """The playback buffer has new samples (a segment was queued). A port that stops asking while its
        output is idle (a sound device's worker) asks again; ports that pull every block ignore it. Never
        blocks."""

    @abstractmethod
    def configure(self, *, fade_ms: Optional[float] = None, audio=None) -> None:
        """Change settings while running: ``fade_ms`` is the fade out and fade in, ms (the next fade);
        ``audio`` is the config's ``audio`` section (:class:`appliance.config.AudioConfig`: a sound device
        reopens on other device names or block size and takes the new ``retry_max_s``; other ports ignore it)."""

    @abstractmethod
    def stats(self) -> dict:
        """Since the previous call: ``{"xruns": int, "xruns_by_kind": {kind: int}, "output_latency_ms":
        float | None}`` (merged into each turn's metrics)."""

    @abstractmethod
    def stop(self) -> None:
        """Stop and release everything; the port cannot be started again."""

    def observe(self, record: dict) -> None:
        """A conversation observer (the session subscribes it): the simulated room arms its ``after:``
        events on the records; other ports ignore them."""

    def alive(self) -> bool:
        """The port's own threads run (the service's watchdog); True for a port without threads."""
        return True


class PullPort(AudioPort):
    """A port whose speaker pulls: each :meth:`read` takes from the playback buffer exactly the samples it
    plays (through a :class:`Fader`), so the buffer's count of played samples is what was heard.

    :param rate: the pull rate, Hz.
    :param fade_ms: the fade on pause, resume and flush, ms (``interruption.fade_ms``).
    """

    def __init__(self, rate: int, fade_ms: float = 8.0):
        self.rate = int(rate)
        self._fader = Fader(fade_samples(self.rate, fade_ms))
        self._lock = threading.Lock()
        self._pull: Pull = lambda n: np.zeros(n, dtype=np.float32)
        self._capture: Capture = lambda mic, far: None
        self._on_silent: OnSilent = lambda: None

    @property
    def fade_samples(self) -> int:
        """The fade's length, samples at :attr:`rate`."""
        return self._fader.fade_samples

    def start(self, pull: Pull, capture: Capture, on_silent: Optional[OnSilent] = None, *,
              on_status: Optional[OnStatus] = None, settled: Optional[Settled] = None) -> None:
        """As :meth:`AudioPort.start`; reports ``open`` at once (there is no device to wait for)."""
        self._pull, self._capture = pull, capture
        self._on_silent = on_silent or (lambda: None)
        if on_status is not None:
            on_status("open", {})

    def read(self, n: int) -> np.ndarray:
        """The speaker's next ``n`` samples (float32 [n] at :attr:`rate`): pulled, faded, zero-padded."""
        with self._lock:
            need = self._fader.want(n) - self._fader.queued
            if need > 0:
                self._fader.push(np.asarray(self._pull(need), dtype=np.float32)[:need])
            out, res = self._fader.read(n)
        if res.silent:
            self._on_silent()
        return out

    def pause(self) -> None:
        with self._lock:
            self._fader.pause()

    def resume(self) -> None:
        with self._lock:
            self._fader.resume()

    def flush(self) -> None:
        """Fade out what the playback buffer still has (fetched now, before it drops it), then drop."""
        with self._lock:
            self._fader.flush()
            need = self._fader.fade_need()
            if need:
                self._fader.push(np.asarray(self._pull(need), dtype=np.float32)[:need])

    def configure(self, *, fade_ms: Optional[float] = None, audio=None) -> None:
        if fade_ms is not None:
            with self._lock:
                self._fader.set_fade(fade_samples(self.rate, fade_ms))

    def stats(self) -> dict:
        return {"xruns": 0, "xruns_by_kind": {}, "output_latency_ms": 0.0}

    def stop(self) -> None:
        pass


class NullPort(PullPort):
    """No card and no room: the test calls :meth:`read` as the speaker would, and :meth:`hear` to hand
    the capture side a microphone block."""

    def hear(self, mic: np.ndarray, far_end: Optional[np.ndarray] = None) -> None:
        """Deliver ``mic`` (float32 mono 16 kHz) and ``far_end`` (default: empty) to ``capture``."""
        self._capture(np.asarray(mic, dtype=np.float32),
                      np.zeros(0, np.float32) if far_end is None else np.asarray(far_end, np.float32))
