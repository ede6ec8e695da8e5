"""A room on a JACK server: a JACK client that is the appliance's microphone and hears its speaker, for
the barge-in and echo benchmark on real PortAudio streams (``appliance bench interruption --room jack``)
and its short test.

The client (``JACK-Client``, never sounddevice: this process holds no PortAudio stream) registers two
ports. PortAudio shows the client as a sound device, so the appliance opens it by name
(``audio.input``/``audio.output`` = the client's name): ``mouth`` is the appliance's microphone, ``ear``
gets what the appliance plays. Every JACK period the room

1. reads the ``ear`` block (what the appliance played: the ground truth of its output),
2. passes it through the loudspeaker: ``linear``, or ``clip`` (a 3 W speaker driven hard: ``tanh`` soft
   clipping, then a band-limited small-speaker response, 300 Hz–6.5 kHz, windowed-sinc FIR),
3. through the clock drift and the pure delay: a delay line read at a varying rate with windowed-sinc
   interpolation (:class:`_DriftLine`). The echo's delay wanders smoothly around ``echo_delay_ms``,
   ``delay + A·sin(2πt/T)`` with ``T`` = :data:`WANDER_S`, so that its rate of change peaks at
   ``drift_ppm`` (300 ppm: the delay shrinks or grows by up to 300 µs a second, ±2.9 ms around the nominal
   delay over 60 s). Speaker and microphone on one JACK clock cannot show the drift in their sample
   counts (as two real crystals would), so an endless drift would run the echo ahead of the sound that
   makes it; a bounded smooth wander is what an adaptive resampler between two clocks leaves. (Before:
   a streaming soxr resampler into a FIFO, re-centred to the nominal delay after each second of
   silence. soxr gives its output in bursts of 820 or 1640 samples per 1024 in, so the FIFO ran dry:
   337 samples of zeros in a 2.5 min run, measured here, each a gap in the echo and a jump in its delay;
   and every re-centring made the next reply's echo jump by the drift of the one before, up to 2.4 ms: a
   discontinuity no real room has, at the start of the replies where the service paused.)
4. through the room's echo path: ``echo_delay_ms`` of pure delay, then the room impulse response the
   simulated room uses (:func:`appliance.audio.room.synthetic_ir`, resampled to the server's rate with its
   gain kept, :func:`echo_ir`), at ``echo_gain_db`` (FFT overlap-save convolution),
5. adds the scripted user speech and a microphone noise floor (white, ``noise_dbfs``), and writes the
   sum to ``mouth``.

The loop (appliance output -> ``ear`` -> ``mouth`` -> appliance input) is a cycle in JACK's graph, so it
adds one period: measured here with an impulse, the echo reaches ``mouth`` ``echo_delay_ms`` + one period
(30 + 21.3 ms at 48 kHz, 1024 frames) after it was played, at the set gain.

Ground truth, on JACK's own clock (frame times, :attr:`JackRoom.rate` Hz): each scripted utterance's start,
onset (first sample above −40 dBFS) and end (last sample above −40 dBFS) frame, and every output sample
the appliance played (:meth:`JackRoom.heard`), so that silence of the output is measured as the room
hears it. :meth:`JackRoom.frame_of` maps a ``time.monotonic()`` reading to a frame time (from the
callbacks around it: a callback is never early), to place the service's own events on that clock.

Pick the server with ``servername`` (or the ``JACK_DEFAULT_SERVER`` environment variable); the room never
starts a server by itself.
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .files import MODEL_RATE, first_above, resample

SILENT_PEAK = 10 ** (-50 / 20)  # below -50 dBFS peak: silence (as replay's SILENT_PEAK)
SPEAKERS = ("linear", "clip")


def small_speaker_fir(rate: int, low_hz: float = 300.0, high_hz: float = 6500.0, taps: int = 511) -> np.ndarray:
    """A small loudspeaker's band: a linear-phase band-pass FIR (Blackman-windowed sinc), unity gain at
    1 kHz. float32 [taps] at ``rate`` Hz; its group delay is ``(taps - 1) / 2`` samples."""
    high_hz = min(high_hz, 0.45 * rate)
    n = np.arange(taps) - (taps - 1) / 2
    h = (2 * high_hz / rate) * np.sinc(2 * high_hz / rate * n) - (2 * low_hz / rate) * np.sinc(2 * low_hz / rate * n)
    h *= np.blackman(taps)
    gain = abs(np.sum(h * np.exp(-2j * np.pi * 1000.0 / rate * np.arange(taps))))
    return (h / gain).astype(np.float32)


IR_LEAD = 16  # samples of silence (at 16 kHz) put before the impulse response before it is resampled (see echo_ir)


def echo_ir(ir16: np.ndarray, rate: int) -> tuple[np.ndarray, int]:
    """The room's impulse response (float32 at 16 kHz) at ``rate`` Hz with the gain it has at 16 kHz: scaled to
    unit energy at 16 kHz (as the simulated room uses it), led by ``IR_LEAD`` samples of silence (so that the
    resampler keeps the whole of a direct path at the first sample: cut at the array's start, half its sinc went,
    and 2.2 dB of the gain with it), resampled, and scaled by ``16000 / rate`` (a resampled filter's taps are as
    large as the original's but ``rate / 16000`` times as many, so its gain below 8 kHz grows by that much).
    :returns: (float32 at ``rate``, the lead in samples at ``rate``: the caller takes it off the pure delay).

    Why (measured here): normalised to unit energy at 48 kHz instead, the echo reached the microphone 4.4 dB
    louder than ``echo_gain_db`` said (a reply at -19.3 dBFS came back at -21.9 dBFS at "0 dB", -26 dBFS
    intended), and at "+6 dB" it drove the microphone to +6.8 dBFS peaks: a clipping microphone, which no
    linear canceller models."""
    ir16 = np.asarray(ir16, dtype=np.float64)
    ir16 = np.concatenate([np.zeros(IR_LEAD), ir16 / np.sqrt(max(float(np.sum(ir16 ** 2)), 1e-20))])
    ir = resample(ir16.astype(np.float32), MODEL_RATE, rate) * (MODEL_RATE / rate)
    return ir.astype(np.float32), int(round(IR_LEAD * rate / MODEL_RATE))


def soft_clip(x: np.ndarray, drive: float) -> np.ndarray:
    """``tanh(drive·x)/drive``: unity gain for small signals, a peak of 0.5 comes out at
    ``tanh(drive/2)/drive`` (drive 2: 0.38, −2.3 dB, with odd harmonics)."""
    return (np.tanh(drive * x) / drive).astype(np.float32)


class _OverlapSave:
    """Streaming FIR convolution by FFT overlap-save: ``y = h ⊛ x`` block by block, any block length."""

    def __init__(self, h: np.ndarray, max_block: int = 8192):
        self.h = np.asarray(h, dtype=np.float32)
        self._hist = np.zeros(len(self.h) - 1, dtype=np.float32)
        self._ffts: dict[int, tuple[int, np.ndarray]] = {}
        self.max_block = max_block

    def __call__(self, x: np.ndarray) -> np.ndarray:
        n = len(x)
        if len(self.h) == 1:
            return (self.h[0] * x).astype(np.float32)
        if n not in self._ffts:
            size = 1 << int(np.ceil(np.log2(len(self.h) - 1 + n)))
            self._ffts[n] = (size, np.fft.rfft(self.h, size))
        size, hf = self._ffts[n]
        line = np.concatenate([self._hist, x])
        y = np.fft.irfft(np.fft.rfft(line, size) * hf, size)[len(self.h) - 1: len(line)]
        self._hist = line[len(line) - len(self._hist):]
        return y.astype(np.float32)

    def set_kernel(self, h: np.ndarray) -> None:
        """Convolve with ``h`` from the next block on (as long as the kernel before: the history stays valid).

        :raises ValueError: ``h`` has another length."""
        if len(h) != len(self.h):
            raise ValueError(f"the kernel must keep its length, {len(self.h)} taps, not {len(h)}")
        self.h = np.asarray(h, dtype=np.float32)
        self._ffts.clear()


WANDER_S = 60.0  # the period of the echo delay's wander, s (see the module docstring)


class _DriftLine:
    """A delay line read at a varying rate: the output's sample ``m`` is the input at position
    ``m − delay + A·sin(2πm/period)`` (fractional), by windowed-sinc interpolation (``taps`` taps, Kaiser
    window; at 48 kHz its error is under −90 dB at 6 kHz). ``A = (ratio − 1)·period/2π``, so the reading
    rate peaks at ``ratio`` input samples per output sample (at ``m = 0``: the delay starts shrinking);
    ``period`` None: the rate is ``ratio`` throughout, ``m·ratio − delay``. An integer position (ratio 1)
    is an exact integer delay. Streaming, one block in and one block of the same length out.

    :param delay: the nominal delay, samples (more than ``A + taps // 2``).
    :param start: the output sample from which the line drifts (``m`` above counts from it); before it, a fixed
        ``delay`` (the delay is continuous there).
    """

    def __init__(self, delay: int, ratio: float, period: Optional[float] = None, taps: int = 32, start: int = 0):
        self.start = int(start)
        self.ratio = float(ratio)
        self.period = period
        self.amplitude = 0.0 if period is None else (self.ratio - 1.0) * period / (2 * np.pi)
        self.half = taps // 2
        self._kaiser = np.kaiser(taps, 8.0)
        self.delay = int(delay)
        self._line = np.zeros(self.delay + int(abs(self.amplitude)) + 2 * taps, dtype=np.float32)
        self._start = -len(self._line)  # the input index of _line[0]
        self._written = 0  # input samples written (= output samples made)
        self.dry = 0  # output samples that would have needed input not yet written (read as the newest)

    def positions(self, m: np.ndarray) -> np.ndarray:
        """The input positions read for output samples ``m``."""
        d = np.maximum(np.asarray(m, dtype=np.float64) - self.start, 0.0)  # how long the line has drifted
        if self.period is None:
            return m - self.delay + d * (self.ratio - 1.0)
        return m - self.delay + self.amplitude * np.sin(2 * np.pi * d / self.period)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        n = len(x)
        m = self._written + np.arange(n, dtype=np.float64)
        self._line = np.concatenate([self._line, np.asarray(x, dtype=np.float32)])
        self._written += n
        pos = self.positions(m)
        newest = self._written - 1 - self.half  # the last position whose kernel is all written
        late = pos > newest
        if late.any():
            self.dry += int(late.sum())
            pos = np.minimum(pos, newest)
        base = np.floor(pos)
        frac = pos - base
        if not frac.any():
            y = self._line[(base - self._start).astype(np.int64)]
        else:
            k = np.arange(-self.half + 1, self.half + 1)  # taps around the position
            w = np.sinc(k[None, :] - frac[:, None]) * self._kaiser[None, :]
            w /= w.sum(axis=1, keepdims=True)  # unity gain at DC whatever the fraction
            idx = (base - self._start).astype(np.int64)[:, None] + k[None, :]
            y = np.einsum("ij,ij->i", self._line[idx], w).astype(np.float32)
        # Keep what the next blocks can still read: the delay plus the wander's amplitude and a kernel.
        keep = len(self._line) - (self.delay + int(abs(self.amplitude)) + 2 * self.half + 2)
        if keep > 0:
            self._line = self._line[keep:]
            self._start += keep
        return y


@dataclass
class Utterance:
    """A scripted sound and its ground truth, frame times of the room's server (None until it plays)."""

    label: str
    text: Optional[str]
    audio: np.ndarray  # float32 at the server's rate
    start: Optional[int] = None
    onset_offset: int = 0
    end_offset: int = 0
    after_delay: Optional[int] = None  # armed: starts this many frames after the appliance is next heard

    @property
    def onset(self) -> Optional[int]:
        return None if self.start is None else self.start + self.onset_offset

    @property
    def end(self) -> Optional[int]:
        return None if self.start is None else self.start + self.end_offset


class JackRoom:
    """The appliance's room on a JACK server (see the module docstring).

    :param name: the JACK client's name (the appliance's ``audio.input``/``audio.output``).
    :param servername: the JACK server (None: ``JACK_DEFAULT_SERVER`` or the default server).
    :param echo_gain_db: the echo's level at the microphone relative to what was played, dB; None: no
        echo path. Change it between scenarios with :meth:`set_echo`.
    :param echo_delay_ms: pure delay before the impulse response, ms.
    :param impulse_response: float32 at 16 kHz (unit energy after resampling); None: a single tap.
    :param drift_ppm: the speaker's clock relative to the microphone's at its fastest, ppm: the peak rate of
        the echo delay's wander (0: one clock; see the module docstring).
    :param speaker: ``"linear"`` or ``"clip"``.
    :param clip_drive: the soft clipper's drive (``clip`` only).
    :param noise_dbfs: the microphone's noise floor, white, dBFS RMS (None: digital silence).
    :param path_change_s: the speaker and the drift come on this many seconds (of the room's frames) after it
        started: before, a linear speaker on one clock with the same delay; then the echo path changes at once, as
        when the owner turns the volume up into the speaker's clipping (for a canceller that converged on the clean
        path and must notice it lost the echo). None: from the start.
    :raises jack.JackError: no server to connect to.
    """

    def __init__(self, name: str = "room", servername: Optional[str] = None, echo_gain_db: Optional[float] = None,
                 echo_delay_ms: float = 30.0, impulse_response: Optional[np.ndarray] = None, drift_ppm: float = 0.0,
                 speaker: str = "linear", clip_drive: float = 2.0, noise_dbfs: Optional[float] = -70.0,
                 seed: int = 0, path_change_s: Optional[float] = None):
        import jack

        if speaker not in SPEAKERS:
            raise ValueError(f"speaker must be one of {SPEAKERS}, not {speaker!r}")
        self.client = jack.Client(name, no_start_server=True, servername=servername)
        self.name = name
        self.rate = int(self.client.samplerate)
        self.mouth = self.client.outports.register("mouth")
        self.ear = self.client.inports.register("ear")
        self.drift_ppm = float(drift_ppm)
        self.speaker = speaker
        self.clip_drive = float(clip_drive)
        self.echo_delay_ms = float(echo_delay_ms)
        self._change = 0 if path_change_s is None else max(0, int(round(path_change_s * self.rate)))  # line samples
        self.path_changed: Optional[int] = None  # the drift line's sample at which the speaker came on (path_change_s)
        self.path_changed_frame: Optional[int] = None  # ... and the server's frame time of it
        self._rng = np.random.default_rng(seed)
        self._noise = None if noise_dbfs is None else 10 ** (noise_dbfs / 20.0)
        self._lock = threading.Lock()
        self._pending: list[Utterance] = []
        self._active: list[Utterance] = []
        self.played: list[Utterance] = []
        self._heard: list[tuple[int, np.ndarray]] = []
        self._said: list[tuple[int, np.ndarray]] = []  # what went into the microphone (echo, speech, noise)
        self.frame0: Optional[int] = None
        self.frames = 0  # the last callback's frame time + its frames
        self.last_loud: Optional[int] = None  # the last frame the appliance was heard (peak ≥ −50 dBFS)
        self.underruns = 0  # echo samples the drift ran ahead of what was played (never with the wander)
        self.callbacks = 0
        self._cycles: list[tuple[float, float, int]] = []  # (monotonic − frame/rate, monotonic, frame) a callback
        self._gain: Optional[float] = None
        self._ir16 = impulse_response
        self._build_path(echo_gain_db)
        self.client.set_process_callback(self._process)
        self.down = threading.Event()
        self.client.set_shutdown_callback(lambda status, reason: self.down.set())
        self.client.activate()

    # --- the echo path ---
    def _build_path(self, echo_gain_db: Optional[float]) -> None:
        rate = self.rate
        ir, lead = (np.ones(1, dtype=np.float32), 0) if self._ir16 is None else echo_ir(self._ir16, rate)
        delay = max(0, int(round(self.echo_delay_ms * rate / 1000.0)) - lead)
        self._ir_after = None  # the path's kernel once the speaker comes on (path_change_s)
        if self.speaker == "clip":
            bp = small_speaker_fir(rate)
            ir_clip = np.convolve(bp, ir)
            delay = max(0, delay - (len(bp) - 1) // 2)  # the band-pass's group delay is part of the path
            if self._change:  # until then: the band-pass's group delay alone, so the delay stays put
                flat = np.zeros(len(bp), dtype=np.float32)
                flat[(len(bp) - 1) // 2] = 1.0
                self._ir_after, ir = ir_clip, np.convolve(flat, ir)
            else:
                ir = ir_clip
        self._fir = _OverlapSave(ir.astype(np.float32))
        self._delay = delay
        self._line = _DriftLine(delay, 1.0 + self.drift_ppm * 1e-6, period=WANDER_S * rate if self.drift_ppm else None,
                                start=self._change)
        self.wander_ms = round(1000.0 * abs(self._line.amplitude) / rate, 2)
        self._gain = None if echo_gain_db is None else 10 ** (echo_gain_db / 20.0)

    @property
    def line_samples(self) -> int:
        """Samples (at :attr:`rate`) the echo path's drift line has made so far: its position ``m``."""
        return self._line._written

    def delay_rate_ppm(self, m0: int, m1: int) -> float:
        """The mean rate at which the echo's delay moved between the drift line's positions ``m0`` and ``m1``
        (:attr:`line_samples`), ppm (+: the echo falls further behind; 0 without drift): the ground truth of
        :func:`appliance.audio.delay.drift_ppm`. The delay is ``delay - A sin(2 pi (m - start) / P)`` from the line's
        ``start`` on (:class:`_DriftLine`)."""
        line = self._line
        if m1 == m0:
            m0, m1 = m0 - 0.5, m0 + 0.5
        delay = lambda m: m - float(line.positions(np.float64(m)))  # noqa: E731
        return float((delay(m1) - delay(m0)) / (m1 - m0) * 1e6)

    def set_echo(self, echo_gain_db: Optional[float]) -> None:
        """The echo's level from the next period on, dB (None: no echo path); the echo path's state stays."""
        with self._lock:
            self._gain = None if echo_gain_db is None else 10 ** (echo_gain_db / 20.0)

    # --- the script ---
    def _utterance(self, audio16: np.ndarray, label: str, text: Optional[str]) -> Utterance:
        audio = resample(np.asarray(audio16, dtype=np.float32), MODEL_RATE, self.rate)
        on = max(0, first_above(audio, -40.0))
        last = max(0, first_above(audio[::-1], -40.0))
        return Utterance(label, text, audio, onset_offset=on, end_offset=len(audio) - last)

    def say_at(self, frame: int, audio16: np.ndarray, label: str, text: Optional[str] = None) -> Utterance:
        """Say ``audio16`` (float32 mono 16 kHz) into the microphone from JACK frame ``frame`` on (at the
        next period if that has passed). :returns: its :class:`Utterance` (ground truth once it plays)."""
        u = self._utterance(audio16, label, text)
        u.start = int(frame)
        with self._lock:
            self._pending.append(u)
        return u

    def say_after_heard(self, delay_s: float, audio16: np.ndarray, label: str, text: Optional[str] = None) -> Utterance:
        """Say ``audio16`` ``delay_s`` after the appliance is next heard (its output's first sample above
        −50 dBFS from now on): an interjection while it speaks."""
        u = self._utterance(audio16, label, text)
        u.after_delay = int(delay_s * self.rate)
        with self._lock:
            self._pending.append(u)
        return u

    @property
    def saying(self) -> bool:
        """A scripted utterance is pending or playing."""
        with self._lock:
            return bool(self._pending or self._active)

    def cancel(self) -> None:
        """Drop what is pending (an armed interjection whose reply never came)."""
        with self._lock:
            self._pending = []

    # --- clocks and recordings ---
    def now(self) -> int:
        """The frame time at the end of the last period."""
        return self.frames

    def seconds(self, frame: int) -> float:
        """Seconds since the room's first period, for a frame time."""
        return (frame - (self.frame0 or 0)) / self.rate

    def _offset(self, value: float, field: int) -> float:
        """``time.monotonic() − frame/rate`` near a monotonic time (``field`` 1) or a frame time (``field``
        2): the smallest over the callbacks within a second of it (a callback is never early, often late).
        Local, because a dummy driver's frame clock falls behind the wall clock on a loaded machine
        (measured here: seconds over a minute)."""
        cycles = self._cycles
        if not cycles:
            return 0.0
        span = 1.0 if field == 1 else float(self.rate)
        i = bisect.bisect_left(cycles, value - span, key=lambda c: c[field])
        j = bisect.bisect_right(cycles, value + span, key=lambda c: c[field])
        near = cycles[i:j] or [cycles[min(i, len(cycles) - 1)]]
        return min(c[0] for c in near)

    def monotonic_of(self, frame: int) -> float:
        """``time.monotonic()`` of a frame time (± one period; see :meth:`_offset`)."""
        return self._offset(frame, 2) + frame / self.rate

    def frame_of(self, monotonic: float) -> int:
        """The frame time of a ``time.monotonic()`` reading (± one period)."""
        return int(round((monotonic - self._offset(monotonic, 1)) * self.rate))

    def heard(self, f0: int, f1: int) -> np.ndarray:
        """What the appliance played from frame ``f0`` to ``f1``, float32 at :attr:`rate` (zeros where
        the room missed a period)."""
        return self._span(self._heard, f0, f1)

    def said(self, f0: int, f1: int) -> np.ndarray:
        """What the room wrote to the microphone (``mouth``: echo, scripted sound and noise) from frame ``f0``
        to ``f1``, float32 at :attr:`rate` (zeros where the room missed a period)."""
        return self._span(self._said, f0, f1)

    def _span(self, rec: list, f0: int, f1: int) -> np.ndarray:
        out = np.zeros(max(0, f1 - f0), dtype=np.float32)
        with self._lock:
            blocks = list(rec)
        for start, x in blocks:
            lo, hi = max(f0, start), min(f1, start + len(x))
            if hi > lo:
                out[lo - f0: hi - f0] = x[lo - start: hi - start]
        return out

    def forget_before(self, frame: int) -> None:
        """Drop the recording before ``frame`` (a long run keeps only what it still needs)."""
        with self._lock:
            self._heard = [(s, x) for s, x in self._heard if s + len(x) > frame]
            self._said = [(s, x) for s, x in self._said if s + len(x) > frame]
            keep = bisect.bisect_left(self._cycles, frame - 60 * self.rate, key=lambda c: c[2])
            del self._cycles[:keep]  # the clock mapping keeps a minute before it

    def close(self) -> None:
        for step in (self.client.deactivate, self.client.close):
            try:
                step()
            except Exception:
                pass

    # --- the JACK process callback ---
    def _process(self, frames: int) -> None:
        t = time.monotonic()
        f0 = self.client.last_frame_time
        self._cycles.append((t - f0 / self.rate, t, f0))
        if self.frame0 is None:
            self.frame0 = f0
        ear = np.array(self.ear.get_array(), dtype=np.float32)
        out = self.mouth.get_array()
        loud = np.nonzero(np.abs(ear) >= SILENT_PEAK)[0]
        with self._lock:
            self.callbacks += 1
            self._heard.append((f0, ear))
            if len(loud):
                first_loud = f0 + int(loud[0])
                for u in self._pending:
                    if u.start is None and u.after_delay is not None:
                        u.start = first_loud + u.after_delay
                self.last_loud = f0 + int(loud[-1])
            gain = self._gain
            mic = self._echo(ear, f0, frames, gain)
            if self._noise is not None:
                mic += self._noise * self._rng.standard_normal(frames).astype(np.float32)
            keep = []
            for u in self._pending:
                if u.start is not None and u.start < f0 + frames:
                    u.start = max(u.start, f0)
                    self._active.append(u)
                    self.played.append(u)
                else:
                    keep.append(u)
            self._pending = keep
            for u in self._active:
                lo, hi = max(f0, u.start), min(f0 + frames, u.start + len(u.audio))
                if hi > lo:
                    mic[lo - f0: hi - f0] += u.audio[lo - u.start: hi - u.start]
            self._active = [u for u in self._active if u.start + len(u.audio) > f0 + frames]
            self.frames = f0 + frames
            self._said.append((f0, mic))
        out[:] = mic

    def _echo(self, ear: np.ndarray, f0: int, frames: int, gain: Optional[float]) -> np.ndarray:
        x = ear
        if self.path_changed is None and self._line._written + frames > self._change:
            self.path_changed = max(self._line._written, self._change)
            self.path_changed_frame = f0 + self.path_changed - self._line._written
            if self._ir_after is not None:
                self._fir.set_kernel(self._ir_after)
        if self.speaker == "clip" and self.path_changed is not None:
            x = soft_clip(x, self.clip_drive)
        take = self._line(x)
        self.underruns = self._line.dry
        y = self._fir(take)
        if gain is None:
            return np.zeros(frames, dtype=np.float32)
        return (gain * y).astype(np.float32)
