"""The service's side of the sound devices: :class:`DeviceAudio`, an :class:`~appliance.audio.port.AudioPort`
whose streams live in a worker process it supervises, and :func:`play` for a one-shot playback.

Why a worker process: a sound card that disappears (a USB speakerphone unplugged, the sound server
stopped) can leave PortAudio unable to stop, close or terminate its streams: with the JACK host API of
PortAudio 19.6 (Debian 12's ``libportaudio2``), ``Pa_AbortStream``, ``Pa_CloseStream`` and ``Pa_Terminate``
all block once the server is gone (checked here: ``abort()`` had not returned after 25 s). PortAudio only
re-enumerates devices at ``Pa_Initialize``, so a device that comes back cannot be opened again in the same
process either. The streams therefore live in a small child process (:mod:`.worker`); when the device goes
away the service kills that child and starts a new one, with back-off, and the conversation, the models
and the KV cache in the service process never notice more than an ``error`` state.

Data path (:mod:`.protocol`): the reader thread answers the worker's output requests with ``pull(n)``
(the playback buffer at ``playback_rate``, resampled to the device's rate with a streaming soxr resampler
when they differ), and hands each input block, mixed to mono and resampled to 16 kHz, to ``capture`` with
the far end: what the output callbacks actually played, paired with the microphone by sample count on the
device's clock (:class:`FarEnd`). Pause, resume and flush
fade at the worker, on its ring (measured here on the JACK dummy server: the ring held 672 samples,
42 ms at 16 kHz, at a pause, which used to play before the fade).

Xruns: the callbacks' ``status`` flags (input overflow/underflow, output underflow/overflow) are counted,
as are late output blocks and input blocks dropped on a full socket; see :attr:`DeviceAudio.xruns`.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from ...errors import UserError
from ..files import MODEL_RATE
from ..port import AudioPort, Capture, OnSilent, OnStatus, Pull
from . import protocol as p
from .listing import child_env
from .worker import RING_MIN_BLOCKS

log = logging.getLogger(__name__)


@dataclass
class DeviceInfo:
    """What the worker opened: names, rates (Hz), channels, block sizes (frames), PortAudio latencies (ms)."""

    input: Optional[str]
    output: str
    hostapi: str
    in_rate: int
    out_rate: int
    in_channels: int
    out_channels: int
    in_block: int
    out_block: int
    input_latency_ms: Optional[float]
    output_latency_ms: Optional[float]


class _Stream:
    """A streaming soxr resampler (float32 mono, ``HQ``) that is a no-op at equal rates.

    ``low_latency``: soxr's variable-rate engine (``vr=True``) at the same fixed ratio, for the capture path to
    16 kHz (the microphone and its far end, which must match). Why (measured here, 48 -> 16 kHz, fed in 1024-,
    512- and 480-sample blocks): soxr's fixed-rate engine hands out its output in bursts and so holds back
    21 ms of the microphone at the median, 35 ms at p95 and 36 ms at most after a block, the variable-rate one
    12.5 ms (17.8 at most, with 1024- and 512-sample blocks), with the same passband (flat to 7.5 kHz, under
    -110 dB from 9 kHz) and 2 samples (0.125 ms) more delay. Every barge-in is heard that much sooner. The
    cost: 0.19 % of one core per 48 kHz stream against 0.04 %. Where the device's rate is a multiple of 16 kHz
    (48 kHz on most USB and HAT cards), :class:`Decimator` takes its place and holds back nothing.
    """

    def __init__(self, src: int, dst: int, low_latency: bool = False):
        self.src, self.dst = src, dst
        self._rs = None
        if src != dst and low_latency and src % dst == 0:
            self._rs = Decimator(src, dst)
        elif src != dst:
            import soxr

            self._rs = soxr.ResampleStream(src, dst, 1, dtype="float32", quality="HQ", vr=low_latency)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self._rs is None:
            return x
        return self._rs.resample_chunk(x)


DECIMATOR_PASS = 0.4375  # the capture decimator's passband edge, as a fraction of the output rate (7 kHz at 16 kHz)
DECIMATOR_STOP_DB = 100.0  # ... its attenuation from the output's Nyquist frequency (8 kHz) up, dB
DECIMATOR_RIPPLE_DB = 0.5  # ... and its passband ripple, dB


class Decimator:
    """Streaming downsampler by an integer ratio (48 -> 16 kHz: 3) for the capture path: a causal elliptic
    low-pass (``scipy.signal.ellipord`` / ``ellip``, second-order sections run by ``sosfilt`` with their state
    carried from block to block), then every ``src // dst``-th sample, counted from the stream's first. float32
    mono in, float32 mono out, any block length; ``len(out)`` is the number of multiples of the ratio in the
    block's sample indices.

    Why not soxr here (measured here, 48 -> 16 kHz): soxr compensates its filter's delay by holding output back,
    12.5 ms with its variable-rate engine and 21-36 ms with the fixed-rate one, and that delay is in every
    barge-in. This filter (order 12: flat within ``DECIMATOR_RIPPLE_DB`` to 7 kHz, ``DECIMATOR_STOP_DB`` down
    from 8 kHz, so nothing aliases into the band) holds nothing back; its group delay is 0.14-0.3 ms under 5 kHz
    (0.75 ms at 6.5 kHz). Its phase is not linear, but the microphone and the far end pass through the same
    filter (:class:`FarEnd`), so the echo path the canceller models is the room's alone.

    The cost of scipy: ``scipy.signal``'s import took 0.69 s and 74 MB of memory here, once a process.
    :class:`DeviceAudio` imports it before a worker runs (:meth:`preload`): imported in the reader as it started,
    the worker's socket overflowed meanwhile, and a question asked at once lost its first 130 ms (measured here,
    the JACK room's test).

    :param src: input rate, Hz; :param dst: output rate, Hz (``src`` a multiple of it).
    :raises ValueError: ``src`` is not a multiple of ``dst``.
    """

    @staticmethod
    def preload():
        """Import ``scipy.signal`` now (0.7 s here), not when the first device opens. :returns: the module."""
        from scipy import signal

        return signal

    def __init__(self, src: int, dst: int):
        signal = self.preload()
        if src % dst or src <= dst:
            raise ValueError(f"Decimator: {src} Hz is not a multiple of {dst} Hz")
        self.ratio = src // dst
        order, wn = signal.ellipord(DECIMATOR_PASS * dst, dst / 2, DECIMATOR_RIPPLE_DB, DECIMATOR_STOP_DB, fs=src)
        self._sos = signal.ellip(order, DECIMATOR_RIPPLE_DB, DECIMATOR_STOP_DB, wn, fs=src, output="sos")
        self._zi = np.zeros((len(self._sos), 2))
        self._sosfilt = signal.sosfilt
        self._phase = 0  # the index, in the next block, of its first sample kept

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if not len(x):
            return np.zeros(0, dtype=np.float32)
        y, self._zi = self._sosfilt(self._sos, x, zi=self._zi)
        out = y[self._phase::self.ratio].astype(np.float32)
        self._phase = (self._phase - len(x)) % self.ratio
        return out

    resample_chunk = __call__  # (soxr.ResampleStream's name for it: _Stream holds either)


def capture_stream(rate: int) -> _Stream:
    """The capture path's resampler from a device's ``rate`` (Hz) to 16 kHz: the microphone's and its far end's
    (the same kind, so the two stay in step sample for sample): :class:`Decimator` where ``rate`` is a multiple of
    16 kHz, else soxr's low-latency engine (see :class:`_Stream`)."""
    return _Stream(rate, MODEL_RATE, low_latency=True)


class FarEnd:
    """The canceller's far end on sound devices: the samples the worker's output callbacks played (after its
    fader, so fades, pauses, flushes and late blocks are in it exactly as the card got them), paired with the
    microphone by sample count on the device's clock, and resampled to 16 kHz in the same chunks as the
    microphone, so that the two 16 kHz streams stay in step sample for sample.

    Pairing: each ``frames`` microphone frames take ``frames·out_rate/in_rate`` played samples from a queue
    that starts with ``lead_blocks`` blocks of silence, so a microphone block whose output callback has not
    run yet (callback order, one period of jitter) still finds its far end. The far end thus leads its echo
    by the output and input latencies plus the acoustic path, minus the lead: a constant while the streams
    run, whatever the output ring holds (2-8 blocks) and however late the service answered it.

    Why (measured here, JACK room, echo 6 dB over the user's voice): the far end used to be what the service
    handed to the worker when it asked for more, so the echo's delay behind it changed with the ring's
    fill: by a block after every late block (the ring's target grows), and by the whole held ring at every
    pause (the canceller consumed what the ring still held as played while the speaker was silent, and the
    resumed samples then played with no far end at all): one pause set off the next.

    :param in_rate: the microphone's rate, Hz. :param out_rate: the speaker's rate, Hz.
    :param in_block: microphone block, frames. :param out_block: output block, frames.
    :param lead_blocks: the queue's initial silence, in the larger of the two blocks.
    :param max_ahead_s: played samples queued beyond the lead by more than this (an output clock faster than
        the microphone's) are dropped down to the lead, s.
    """

    def __init__(self, in_rate: int, out_rate: int, in_block: int, out_block: int, lead_blocks: int = 2,
                 max_ahead_s: float = 0.2):
        self.ratio = out_rate / in_rate
        self.lead = lead_blocks * max(out_block, int(round(in_block * self.ratio)))
        self.max_queue = self.lead + int(max_ahead_s * out_rate)
        self._queue = np.zeros(self.lead, dtype=np.float32)  # played samples not yet paired
        self._frac = 0.0
        self._rs = capture_stream(out_rate)  # as the microphone's (DeviceAudio._reader)
        self.short = 0  # played samples missing at pairing (silence instead; each shifts the alignment)
        self.resynced = 0  # played samples dropped because the output ran ahead
        self.level = (len(self._queue), len(self._queue))  # (min, max) queue length at pairing, samples

    def played(self, x: np.ndarray) -> None:
        """Samples the output played (float32, ``out_rate``)."""
        if len(x):
            self._queue = np.concatenate([self._queue, x])

    def _count(self, frames: int) -> int:
        exact = frames * self.ratio + self._frac
        n = int(exact)
        self._frac = exact - n
        return n

    def _pop(self, frames: int) -> np.ndarray:
        q = len(self._queue)
        self.level = (min(self.level[0], q), max(self.level[1], q))
        n = self._count(frames)
        seg = self._queue[:n]
        self._queue = self._queue[n:]
        if len(seg) < n:
            self.short += n - len(seg)
            seg = np.concatenate([seg, np.zeros(n - len(seg), dtype=np.float32)])
        if len(self._queue) > self.max_queue:
            self.resynced += len(self._queue) - self.lead
            self._queue = self._queue[len(self._queue) - self.lead:]
        return seg

    def drop(self, frames: int) -> None:
        """``frames`` microphone frames were lost: their far end goes too (the resampler is not fed)."""
        self._pop(frames)

    def take(self, frames: int) -> np.ndarray:
        """The far end of the next ``frames`` microphone frames at 16 kHz (as many samples as the microphone's
        resampler gives for them when the rates are equal)."""
        return self._rs(self._pop(frames))


@dataclass
class _Link:
    proc: subprocess.Popen
    sock: socket.socket
    info: Optional[DeviceInfo] = None
    thread: Optional[threading.Thread] = None
    closed: threading.Event = field(default_factory=threading.Event)


class DeviceAudio(AudioPort):
    """The microphone and the speaker, by name, kept open across device loss.

    :param input_name: substring of the microphone's device name (``audio.input``), ``"default"``, or
        None for no microphone (playing only).
    :param output_name: substring of the speaker's device name (``audio.output``), or ``"default"``.
    :param block_ms: the output (and input) block, ms (``audio.output_block_ms``; 10–20 ms).
    :param playback_rate: the rate ``pull`` produces, Hz (the playback buffer's rate).
    :param on_status: ``on_status(kind, info)`` from the reader thread: ``"open"`` (``info`` = the
        :class:`DeviceInfo` as a dict), ``"lost"`` (``reason``), ``"unavailable"`` (``reason``, ``found``:
        device names, ``attempt``, ``retry_in_s``, ``repeated``). Must return fast.
    :param backoff: first and longest wait between attempts to open, s (doubling in between).
    :param stall_s: a device that stops calling back for this long counts as lost, s.
    :param grace_s: the first callback must come within this long of opening, s.
    :param idle: the worker stops asking for output after 0.2 s of digital silence until :meth:`wake`
        (the :class:`~appliance.playback.Playback` buffer calls it); False for a ``pull`` that gets samples
        without telling (:func:`play`).
    :param fade_ms: the worker's fade on pause, resume and flush, ms (``interruption.fade_ms``; change
        it while running with :meth:`configure`).

    :meth:`start` takes ``pull(n) -> float32 [n]`` at ``playback_rate``, ``capture(mic, far_end)`` (float32
    mono 16 kHz blocks; the far end possibly empty) and ``on_silent()``. Threads: one reader per worker
    (answers output requests, delivers input) and one supervisor (starts workers, waits out the back-off).
    Nothing here blocks the caller.
    """

    def __init__(self, input_name: Optional[str], output_name: str, block_ms: float, playback_rate: int,
                 on_status: Optional[Callable[[str, dict], None]] = None,
                 backoff: tuple[float, float] = (0.5, 10.0), stall_s: float = 1.0, grace_s: float = 3.0,
                 fade_ms: float = 8.0, idle: bool = True):
        self.log_errors = True  # log a failing device once per distinct reason
        self.idle = idle
        self.input_name = input_name
        self.output_name = output_name
        self.block_ms = block_ms
        self.rate = self.playback_rate = playback_rate
        self.on_status = on_status or (lambda kind, info: None)
        self.backoff = backoff
        self.stall_s = stall_s
        self.grace_s = grace_s
        self.fade_ms = float(fade_ms)
        self.pull: Pull = lambda n: np.zeros(n, dtype=np.float32)
        self.capture: Capture = lambda mic, far: None
        self.on_silent: OnSilent = lambda: None
        self.xruns = {k: 0 for k in p.XRUN_KEYS}
        self.info: Optional[DeviceInfo] = None
        self.state = "closed"  # closed, opening, open, unavailable
        self.attempts = 0
        self.opened = 0  # successful opens since start
        self.last_error: Optional[str] = None
        self._ring_ms = 0.0
        self._link: Optional[_Link] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._sup: Optional[threading.Thread] = None
        self._turn_mark = dict(self.xruns)
        self._paused = False  # the output is paused at the worker (kept across a worker restart)
        self._attentive = False  # the VAD hears speech: the worker batches fewer input blocks (kept likewise)
        self._drop_fifo = False
        self.far_end: Optional[FarEnd] = None  # the open worker's far-end pairing (its counters)
        Decimator.preload()  # (before any worker runs: see Decimator)

    # --- public ---
    @property
    def xrun_total(self) -> int:
        """Device xruns (status flags) plus late output blocks and dropped input blocks since start."""
        return sum(self.xruns.values())

    @property
    def output_latency_ms(self) -> Optional[float]:
        """PortAudio's reported output latency plus the worker's sample ring, ms (None while closed). When
        PortAudio reports no usable latency (its JACK host API), one block stands in for the device's part."""
        if self.info is None:
            return None
        dev = self.info.output_latency_ms
        if dev is None:
            dev = 1000.0 * self.info.out_block / self.info.out_rate
        return round(dev + self._ring_ms, 2)

    def stats(self) -> dict:
        """Xruns since the previous call (each key of :attr:`xruns`), and the output latency, for the
        per-turn metrics."""
        with self._lock:
            delta = {k: self.xruns[k] - self._turn_mark.get(k, 0) for k in p.XRUN_KEYS}
            self._turn_mark = dict(self.xruns)
        return {"xruns": sum(delta.values()), "xruns_by_kind": {k: v for k, v in delta.items() if v},
                "output_latency_ms": self.output_latency_ms}

    # --- pause, resume, flush and the fade, at the worker's ring ---
    def pause(self) -> None:
        """Fade out within ``fade_ms`` at the worker and hold what its ring still has (2–8 blocks that
        would otherwise play after the pause). Never blocks; a no-op while no worker runs."""
        self._paused = True
        self._send(p.Kind.PAUSE.value)

    def resume(self) -> None:
        """Fade back in where the pause stopped: the held samples first, none dropped or repeated."""
        self._paused = False
        self._send(p.Kind.RESUME.value)

    def flush(self) -> None:
        """Fade out and drop what the worker and the reader hold (the rest of an interrupted reply)."""
        self._paused = False
        self._drop_fifo = True
        self._send(p.Kind.FLUSH.value)

    def wake(self) -> None:
        """The playback buffer has samples: an idle worker (which asks for nothing, worker.py) asks for them at
        its next output callback. Never blocks; a no-op while no worker runs."""
        self._send(p.Kind.WAKE.value)

    def observe(self, record: dict) -> None:
        """A conversation record (the session subscribes the port): from a ``vad_onset`` to the utterance's
        ``vad_end`` or ``vad_reject`` the worker is told (``ATTEND``) that the VAD hears speech, so that while
        its output is idle it sends the microphone ``LISTEN_INPUT_BLOCKS`` (3) blocks to a message instead of
        ``QUIET_INPUT_BLOCKS`` (6): the user's end of turn is heard as soon as before, and only the onset
        waits for a longer message (worker.py). Never blocks."""
        event = record.get("event")
        if event == "vad_onset":
            on = True
        elif event in ("vad_end", "vad_reject"):
            on = False
        else:
            return
        if on != self._attentive:
            self._attentive = on
            self._send(p.pack_attend(on))

    def configure(self, *, fade_ms: Optional[float] = None, audio=None) -> None:
        """``fade_ms``: the worker's fade from the next pause, resume or flush on, ms; kept for the
        workers started later (after a device loss). ``audio`` (the config's ``audio`` section): its
        ``retry_max_s`` is the longest back-off from now on, and other ``input``, ``output`` or
        ``output_block_ms`` reopen the devices (:meth:`reopen`)."""
        if fade_ms is not None:
            self.fade_ms = float(fade_ms)
            self._send(p.pack_json(p.Kind.CONFIGURE, {"fade_ms": self.fade_ms}))
        if audio is not None:
            self.backoff = (self.backoff[0], audio.retry_max_s)
            if (audio.input, audio.output, audio.output_block_ms) != (self.input_name, self.output_name, self.block_ms):
                self.reopen(audio.input, audio.output, audio.output_block_ms)

    def _send(self, msg: bytes) -> None:
        link = self._link
        if link is not None:
            try:
                link.sock.send(msg)
            except OSError:
                pass  # the reader notices a dead worker

    def start(self, pull: Pull, capture: Capture, on_silent: Optional[OnSilent] = None, *,
              on_status: Optional[OnStatus] = None, settled=None) -> None:
        """As :meth:`AudioPort.start`; ``on_status``, if given, replaces the constructor's; ``settled`` is
        ignored (a device runs in real time)."""
        self.pull, self.capture = pull, capture
        self.on_silent = on_silent or (lambda: None)
        if on_status is not None:
            self.on_status = on_status
        self._stop.clear()
        self._sup = threading.Thread(target=self._supervise, name="audio-supervisor", daemon=True)
        self._sup.start()

    def alive(self) -> bool:
        """The supervisor thread runs (for the service's watchdog)."""
        return self._sup is not None and self._sup.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._kick.set()
        self._close_link()
        if self._sup:
            self._sup.join(timeout=5)
        self.state = "closed"

    def reopen(self, input_name: Optional[str] = None, output_name: Optional[str] = None,
               block_ms: Optional[float] = None) -> None:
        """Switch devices (a config reload): close the worker and open with the new names at once."""
        if input_name is not None:
            self.input_name = input_name
        if output_name is not None:
            self.output_name = output_name
        if block_ms is not None:
            self.block_ms = block_ms
        self._close_link()
        self.attempts = 0
        self._kick.set()

    def wait_open(self, timeout: float) -> bool:
        """Wait until the streams are open; False on timeout."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.state == "open":
                return True
            time.sleep(0.02)
        return self.state == "open"

    # --- supervisor ---
    def _supervise(self) -> None:
        while not self._stop.is_set():
            link = self._link
            if link is not None and not link.closed.is_set():
                link.closed.wait(1.0)  # set when the link closes (a loss, stop, reopen): no need to poll
                continue
            self.state = "opening"
            self.attempts += 1
            err = self._open_once()
            if err is None:
                self.attempts = 0
                continue  # runs until its `closed` event
            if self._stop.is_set():
                return
            wait = min(self.backoff[1], self.backoff[0] * (2 ** min(self.attempts - 1, 16)))
            self.state = "unavailable"
            reason, found = err
            repeated = reason == self.last_error
            self.last_error = reason
            if not repeated and self.log_errors:
                log.error("sound device unavailable (waiting; retrying every %.1f s at most): %s", self.backoff[1], reason)
            self.on_status("unavailable", {"reason": reason, "found": found, "attempt": self.attempts,
                                           "retry_in_s": round(wait, 2), "repeated": repeated})
            self._kick.clear()
            self._kick.wait(wait)

    def _open_once(self) -> Optional[tuple[str, list]]:
        """Start a worker and wait for ``READY``. Returns None when open, else (reason, found devices)."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        params = {"input": self.input_name, "output": self.output_name, "block_ms": self.block_ms,
                  "stall_s": self.stall_s, "grace_s": self.grace_s, "fade_ms": self.fade_ms}
        if not self.idle:
            params["idle_s"] = 0.0
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "appliance.audio.device", "worker", str(child.fileno()), json.dumps(params)],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=None if log.isEnabledFor(logging.DEBUG) else subprocess.DEVNULL, env=child_env())
        finally:
            child.close()
        link = _Link(proc, parent)
        parent.settimeout(max(10.0, self.grace_s + 5.0))
        try:
            # The worker primes its ring (a REQUEST) before it says ready.
            pending = []
            while True:
                msg = parent.recv(p.MAX_MSG)
                kind = p.kind_of(msg)
                if kind is None:
                    raise ConnectionError("the audio worker exited without a word")
                if kind in (p.Kind.REQUEST, p.Kind.INPUT):
                    pending.append(msg)
                    continue
                body = p.unpack_json(msg)
                if kind is p.Kind.READY:
                    link.info = DeviceInfo(**body)
                    break
                if kind in (p.Kind.ERROR, p.Kind.LOST):
                    self._reap(link)
                    return body.get("message") or body.get("reason", "audio worker failed"), body.get("found", [])
        except (OSError, ValueError, TypeError) as exc:
            self._reap(link)
            return f"the audio worker failed to start ({exc.__class__.__name__}: {exc})", []
        info = link.info
        self.info = info
        self._ring_ms = RING_MIN_BLOCKS * self.block_ms
        link.thread = threading.Thread(target=self._reader, args=(link, pending), name="audio-reader", daemon=True)
        with self._lock:
            self._link = link
        if self._paused:
            self._send(p.Kind.PAUSE.value)  # a new worker starts playing: keep a pause that is on
        if self._attentive:
            self._send(p.pack_attend(True))  # ... and an utterance the VAD is hearing
        self.state = "open"
        self.opened += 1
        self.last_error = None
        log.info("sound devices open: input '%s' %d Hz x%d, output '%s' %d Hz x%d (%s), output latency %.1f ms",
                 info.input, info.in_rate, info.in_channels, info.output, info.out_rate, info.out_channels,
                 info.hostapi, self.output_latency_ms or 0.0)
        link.thread.start()
        self.on_status("open", dict(info.__dict__))
        return None

    def _reap(self, link: _Link) -> None:
        try:
            link.sock.close()
        except OSError:
            pass
        if link.proc.poll() is None:
            link.proc.kill()  # our own child; it may be stuck inside PortAudio
        try:
            link.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        link.closed.set()

    def _close_link(self) -> None:
        with self._lock:
            link, self._link = self._link, None
        if link is None:
            return
        try:
            link.sock.send(p.Kind.QUIT.value)
        except OSError:
            pass
        try:
            link.proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        self._reap(link)
        if link.thread is not None and link.thread is not threading.current_thread():
            link.thread.join(timeout=2)
        self.info = None

    # --- reader (one per worker) ---
    def _reader(self, link: _Link, pending: list) -> None:
        info = link.info
        assert info is not None
        to_dev = _Stream(self.playback_rate, info.out_rate)
        mic_rs = capture_stream(info.in_rate)  # (and FarEnd's, in step with it)
        fifo = np.zeros(0, dtype=np.float32)  # device-rate samples resampled but not yet sent
        far = FarEnd(info.in_rate, info.out_rate, info.in_block, info.out_block)
        self.far_end = far
        far_wait: list[np.ndarray] = []  # 16 kHz far end waiting for microphone samples
        inputs = 0
        sock = link.sock
        sock.settimeout(max(self.stall_s, 0.2) + 1.0)
        reason = None
        step = max(16, int(self.playback_rate * self.block_ms / 1000.0))
        msgs = deque(pending)
        while not self._stop.is_set():
            if msgs:
                msg = msgs.popleft()
            else:
                try:
                    msg = sock.recv(p.MAX_MSG)
                except socket.timeout:
                    reason = f"the audio worker went silent for {sock.gettimeout():.1f} s"
                    break
                except OSError as exc:
                    reason = f"the audio worker's socket failed ({exc})"
                    break
            if not msg:
                reason = "the audio worker exited"
                break
            kind = p.kind_of(msg)
            if self._drop_fifo:
                self._drop_fifo = False
                fifo = fifo[:0]
            if kind is p.Kind.SILENT:
                self.on_silent()
            elif kind is p.Kind.REQUEST:
                want, flags, gen = p.unpack_request(msg)
                self._count(flags)
                if want:
                    while len(fifo) < want:
                        n = want - len(fifo) if to_dev._rs is None else step
                        block = np.asarray(self.pull(n), dtype=np.float32)
                        fifo = np.concatenate([fifo, to_dev(block)])
                    out, fifo = fifo[:want], fifo[want:]
                    try:
                        sock.sendall(p.pack_data(gen, out))
                    except OSError as exc:
                        reason = f"the audio worker's socket failed ({exc})"
                        break
                    self._ring_ms = max(self._ring_ms, 1000.0 * want / info.out_rate)
            elif kind is p.Kind.INPUT:
                flags, raw, played, frames, dropped = p.unpack_input(msg, info.in_channels)
                far.played(played)
                if dropped:
                    self._count(p.Flag.DROPPED)
                    far.drop(dropped)  # the far end of the lost microphone frames goes with them
                self._count(flags & ~p.Flag.DROPPED)
                if flags & p.Flag.DROPPED or not frames:
                    continue
                if info.in_channels > 1:
                    raw = raw.reshape(-1, info.in_channels).mean(axis=1)
                mic = mic_rs(raw.astype(np.float32))
                far_wait.append(far.take(frames))
                inputs += 1
                if inputs % 1000 == 0 and log.isEnabledFor(logging.DEBUG):
                    log.debug("far end: queue %d..%d samples (lead %d), %d short, %d resynced",
                              far.level[0], far.level[1], far.lead, far.short, far.resynced)
                    far.level = (far.lead, far.lead)
                if len(mic):
                    # A resampler may give its samples in bursts (soxr's fixed-rate engine, 48 -> 16 kHz: nothing
                    # for two 10 ms blocks, then 30 ms); the far end waits with the microphone's.
                    far_end = np.concatenate(far_wait)
                    far_wait = []
                    self.capture(mic, far_end)
            elif kind is p.Kind.LOST:
                try:
                    reason = p.unpack_json(msg).get("reason", "device lost")
                except ValueError:
                    reason = "device lost"
                break
        with self._lock:
            mine = self._link is link
            if mine:
                self._link = None
        self._reap(link)
        if mine and not self._stop.is_set():
            self.info = None
            self.state = "unavailable"
            log.error("sound device lost: %s; reopening", reason)
            self.on_status("lost", {"reason": reason})

    def _count(self, flags: int) -> None:
        if not flags:
            return
        with self._lock:
            for bit, key in p.FLAG_KEYS:
                if flags & bit:
                    self.xruns[key] += 1


def play(audio: np.ndarray, rate: int, output: str = "default", timeout: Optional[float] = None) -> dict:
    """Play float32 mono audio (``rate`` Hz) on the named output device and wait until it has been played.

    :returns: the :class:`DeviceInfo` of the devices used, as a dict.
    :raises UserError: the device is missing (the message lists the devices found) or never opened.
    """
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    pos = [0]
    done = threading.Event()
    status: dict = {}

    def read(n: int) -> np.ndarray:
        out = np.zeros(n, dtype=np.float32)
        chunk = audio[pos[0]:pos[0] + n]
        out[:len(chunk)] = chunk
        pos[0] += n
        if pos[0] >= len(audio) + rate // 5:  # the tail plus 200 ms has been handed over
            done.set()
        return out

    def on_status(kind: str, info: dict) -> None:
        status[kind] = info
        if kind in ("unavailable", "lost"):
            done.set()

    dev = DeviceAudio(None, output, 20, rate, on_status, backoff=(0.5, 0.5), idle=False)  # no Playback: no wake
    dev.log_errors = False  # a one-shot play reports its failure itself, once
    dev.start(read, lambda mic, far: None)
    try:
        done.wait(timeout if timeout is not None else len(audio) / rate + 15.0)
    finally:
        dev.stop()
    if "open" not in status:
        bad = status.get("unavailable") or status.get("lost") or {}
        reason = bad.get("reason", f"could not open the output device '{output}'").split("; retrying")[0]
        raise UserError(f"{reason}; or write a WAV instead with --out FILE")
    return status["open"]
