"""The playback buffer between TTS and the audio port: the reply's clauses in order, and the sample-exact
account of what was handed to the speaker (``spoken_text``, ``segments_played``).

It does not fade: pause, resume and flush go to the :class:`~appliance.audio.port.AudioPort`, which fades
where the last samples before the speaker are (a pull port's fader, the sound-device worker's ring). The
port pulls the speaker's samples with :meth:`Playback.take`, once per block, under a lock that no model
code ever holds (TTS and the state machine hold it for a list operation at most).

Accounting: a pull port (the simulated room, the null port) takes exactly what it plays, so ``played`` is
what was heard; a sound device takes up to its ring's 2–8 blocks ahead (20–160 ms at 10 ms blocks), so
``played`` counts those as heard a little early, and a flush drops them unheard.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from .audio.port import AudioPort, NullPort


@dataclass
class Segment:
    """One synthesised clause: float32 mono audio at the playback rate and the text it says."""

    reply_id: int
    audio: np.ndarray
    text: str
    played: int = 0  # samples of it handed to the port

    @property
    def done(self) -> bool:
        return self.played >= len(self.audio)


class Playback:
    """A queue of clause segments that the audio port pulls block by block.

    :param sample_rate: the playback rate, Hz (the port's pull rate).
    :param fade_ms: the fade of the default port, ms (see ``port``).
    :param on_event: called as ``on_event(name, **info)`` from the port's thread for ``"drained"`` (every
        segment of a finished reply has been handed over; ``reply_id``) and ``"silent"`` (a pause or flush
        fade has reached zero). It must not block (e.g. ``queue.SimpleQueue.put``).
    :param port: the audio port that plays this buffer; default a :class:`~appliance.audio.port.NullPort`
        at ``sample_rate`` and ``fade_ms``, started here, whose speaker is :meth:`read`. Another port is
        started by its owner (:meth:`appliance.session.Session.start`) with ``start(playback.take, capture,
        playback.port_silent)``.
    """

    def __init__(self, sample_rate: int, fade_ms: float = 8.0, on_event: Optional[Callable[..., None]] = None,
                 port: Optional[AudioPort] = None):
        self.sample_rate = sample_rate
        self._on_event = on_event or (lambda name, **info: None)
        self._lock = threading.Lock()
        self._queue: list[Segment] = []
        self._history: list[Segment] = []  # segments of the current reply, played or not
        self._reply_id = 0
        self._ended = False
        self._paused = False
        self._drained_sent = False
        self.played_total = 0  # samples handed to the port since start
        if port is None:
            port = NullPort(sample_rate, fade_ms)
            port.start(self.take, lambda mic, far: None, self.port_silent)
        self.port: AudioPort = port

    # --- producer side (TTS thread, state machine) ---
    def begin_reply(self, reply_id: int) -> None:
        """Start accepting segments of ``reply_id``; segments of any other reply are refused from now on."""
        with self._lock:
            self._reply_id = reply_id
            self._ended = False
            self._history = []
            self._paused = False
            self._drained_sent = False

    def enqueue(self, reply_id: int, audio: np.ndarray, text: str) -> bool:
        """Append a clause. Returns False (and drops it) if ``reply_id`` is not the current reply, so audio
        of an interrupted reply can never play again."""
        seg = Segment(reply_id, np.asarray(audio, dtype=np.float32).reshape(-1), text)
        with self._lock:
            if reply_id != self._reply_id or self._ended:
                return False
            self._queue.append(seg)
            self._history.append(seg)
        self.port.wake()  # an idle sound device asks for nothing until told (audio/device/worker.py)
        return True

    def end_reply(self, reply_id: int) -> None:
        """No more segments will come for ``reply_id``; a ``drained`` event follows the last sample."""
        with self._lock:
            if reply_id == self._reply_id:
                self._ended = True
                if not self._queue and not self._paused and not self._drained_sent:
                    self._drained_sent = True
                    self._on_event("drained", reply_id=reply_id)

    def pause(self) -> None:
        """The port fades to silence within its fade time and holds the position; nothing is thrown away.
        Samples the port asks for meanwhile are still answered (a device's ring keeps its place)."""
        self.port.pause()
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        """The port continues exactly after the last sample played, fading in."""
        self.port.resume()
        with self._lock:
            self._paused = False
            if self._ended and not self._queue and self._reply_id >= 0 and not self._drained_sent:
                self._drained_sent = True
                self._on_event("drained", reply_id=self._reply_id)

    def flush(self) -> int:
        """Drop every queued sample of the current reply and refuse further segments of it; the port fades
        out what it holds first. Returns the number of samples dropped (counted before the fade)."""
        with self._lock:
            dropped = sum(len(s.audio) - s.played for s in self._queue)
            self._ended = True
            self._reply_id = -1
            self._paused = False
        self.port.flush()  # a pull port takes its fade's samples from the queue now
        with self._lock:
            self._queue.clear()
        return dropped

    def configure(self, *, fade_ms: Optional[float] = None) -> None:
        """Hand a reloaded ``interruption.fade_ms`` (ms) to the port."""
        self.port.configure(fade_ms=fade_ms)

    def port_silent(self) -> None:
        """The port's fade out reached silence (from the port's thread)."""
        self._on_event("silent")

    # --- accounting ---
    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def pending_samples(self) -> int:
        with self._lock:
            return sum(len(s.audio) - s.played for s in self._queue)

    def spoken_text(self) -> str:
        """The text of the current (or just flushed) reply that reached the speaker: whole clauses that were
        played, plus the words of a partly played clause in proportion to its samples played (an estimate:
        word timing within a clause is taken as uniform)."""
        with self._lock:
            parts = []
            for seg in self._history:
                if seg.done:
                    parts.append(seg.text)
                elif seg.played > 0:
                    words = seg.text.split()
                    n = int(len(words) * seg.played / max(1, len(seg.audio)))
                    if n:
                        parts.append(" ".join(words[:n]))
                    break
                else:
                    break
            return " ".join(parts)

    def segments_played(self) -> list[tuple[int, int]]:
        """``(samples, samples_played)`` of each segment of the current (or just flushed) reply, in order:
        after a reply has drained, every pair is equal (no sample skipped, none played twice)."""
        with self._lock:
            return [(len(s.audio), s.played) for s in self._history]

    def full_text(self) -> str:
        with self._lock:
            return " ".join(s.text for s in self._history)

    # --- consumer side (the port) ---
    def take(self, n: int) -> np.ndarray:
        """The port's pull: the next ``n`` samples (float32 [n] at :attr:`sample_rate`), unfaded, counted as
        played; zeros where there is nothing to play. Emits ``drained`` after a finished reply's last sample.
        Wakes the port (:meth:`AudioPort.wake`) when the samples end in digital silence and more are queued."""
        out = np.zeros(n, dtype=np.float32)
        drained = None
        with self._lock:
            pos = 0
            while pos < n and self._queue:
                seg = self._queue[0]
                k = min(n - pos, len(seg.audio) - seg.played)
                out[pos:pos + k] = seg.audio[seg.played:seg.played + k]
                seg.played += k
                pos += k
                self.played_total += k
                if seg.done:
                    self._queue.pop(0)
            if not self._queue and self._ended and self._reply_id >= 0 and not self._paused and not self._drained_sent:
                self._drained_sent = True
                drained = self._reply_id
            more = bool(self._queue)
        if drained is not None:
            self._on_event("drained", reply_id=drained)
        if more and n and out[-1] == 0.0:
            # Digital silence inside a reply (a clause's padding): a sound device's worker that counted 0.2 s
            # of it would stop asking (idle) with samples still queued here. The wake goes out before the
            # samples, so the worker never counts more silence than one answer holds.
            self.port.wake()
        return out

    def read(self, n: int) -> np.ndarray:
        """The speaker's side of a pull port (the default :class:`NullPort`, a ``RoomPort``): the next ``n``
        faded samples, float32 [n]. :raises AttributeError: the port is a sound device (it pulls :meth:`take`)."""
        return self.port.read(n)  # type: ignore[attr-defined]

    @property
    def fade_samples(self) -> int:
        """The port's fade length, samples (pull ports); read-only: change it with :meth:`configure`."""
        return self.port.fade_samples  # type: ignore[attr-defined]
