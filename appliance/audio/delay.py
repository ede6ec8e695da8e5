"""The echo's delay behind the far end, measured from the two streams themselves, and its drift.

What it is for: on a real appliance the speaker and the microphone run on two crystals (a USB microphone and
an I2S or USB speaker), a few hundred ppm apart, so the echo slides along the far end that the canceller pairs
it with: 300 ppm is 0.3 ms a second, 18 ms a minute. Speex's linear filter cannot follow that (its floors stayed
at -3.7 dB above 1 kHz on a linear speaker drifting 300 ppm, measured here, docs/measurements.md), and nothing
in the service measures it. This module measures it, from audio alone: on a JACK-room run's tap (``appliance
bench interruption --room jack`` reports it as ``echo_delay``), and on the Pi's own speaker and microphone
(``hw-tests/``). With ``echo.follow_drift`` (experimental, off by default) the canceller uses it through
:class:`DriftFollower`: see docs/measurements.md, sessions 19 and 23.

The method is the generalised cross-correlation with the phase transform (GCC-PHAT; Knapp & Carter, IEEE
Trans. ASSP 24(4), 1976): the cross-spectrum of a window of the microphone and of the far end (the window and
``max_lag`` samples before it), whitened to unit magnitude over ``band_hz``, back to the lag domain; its peak is
the echo's direct path whatever the room's reverberation and the speaker's colouring, and a parabola through
the peak and its two neighbours gives the fraction of a sample. Measured here on a JACK-room tap (+300 ppm,
clipping speaker, 0.5 s windows every 0.25 s, 391 windows): 0.26 samples rms (16 µs at 16 kHz) around the room's
own smooth wander.

Units: samples at the streams' rate (16 kHz in the service) in, milliseconds and ppm out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .files import MODEL_RATE
BAND_HZ = (300.0, 4000.0)  # the band the correlation is whitened over: speech, and what a small speaker plays
MIN_PEAK_RATIO = 3.0  # a window whose peak is not this many times the largest value 8 lags or more away is
#   refused (no echo in it, a user over it, or noise)
PEAK_GUARD = 8  # lags either side of the peak that the ratio's "largest other value" does not look at
MIN_SLOPE_S = 3.0  # DriftFollower: the measurements must span this long before it follows a slope (their scatter,
#   0.26 samples rms, over a 1 s span is a slope of 0.3 samples a second: 6 samples off after a 2 s silence)
REPLY_GAP_S = 1.0  # DriftFollower: the far end back after this long a silence is a new reply ...
QUICK_S = 0.15  # ... whose first this-many seconds of echo are measured as soon as they have arrived (a short
#   window, measured here on a JACK-room tap at +300 ppm: within 0.3 samples (p50) of the delay, 0.6 at most, over
#   5 reply starts, where the last measurement before the silence was 1-26 samples off by then)
MAX_TANGENT_S = 2.0  # DriftFollower: how far past its last measurement the fit's tangent is followed, s
ACTIVE_PEAK = 1e-4  # a far-end sample this loud or louder counts as played (about -80 dBFS)


@dataclass
class DelayPoint:
    """One window's measurement: ``t_s`` the window's centre (s from the streams' start), ``delay_ms`` the echo's
    delay behind the far end (ms), ``peak_ratio`` the correlation peak over the largest value away from it."""

    t_s: float
    delay_ms: float
    peak_ratio: float


def gcc_phat_delay(mic: np.ndarray, far: np.ndarray, max_lag: int, rate: int = MODEL_RATE,
                   band_hz: tuple = BAND_HZ) -> Optional[tuple[float, float]]:
    """The echo's delay in ``mic`` behind ``far``, by GCC-PHAT.

    :param mic: float [w] the microphone's window.
    :param far: float [max_lag + w] the far end over the same window and the ``max_lag`` samples before it
        (``far[max_lag + k]`` was played at the instant of ``mic[k]``).
    :param max_lag: the longest delay looked for, samples (the echo's path, the devices' buffers).
    :returns: (delay, peak ratio): the delay in samples (fractional, 1 <= delay < max_lag - 1), the peak over the
        largest value ``PEAK_GUARD`` lags or more from it; None where the far end or the microphone is digital
        silence, or the peak lies at the search's edge.
    :raises ValueError: ``far`` is not ``max_lag`` samples longer than ``mic``.
    """
    w = len(mic)
    if len(far) != w + max_lag:
        raise ValueError(f"far must hold max_lag + len(mic) = {w + max_lag} samples, not {len(far)}")
    n = 1 << int(np.ceil(np.log2(len(far) + w)))
    spec = np.fft.rfft(np.asarray(mic, np.float64), n) * np.conj(np.fft.rfft(np.asarray(far, np.float64), n))
    freqs = np.fft.rfftfreq(n, 1.0 / rate)
    spec[(freqs < band_hz[0]) | (freqs > band_hz[1])] = 0.0
    mag = np.abs(spec)
    if not np.any(mag > 0):
        return None
    cc = np.fft.irfft(spec / (mag + 1e-12 * mag.max()), n)
    # mic[k] ~ far[max_lag + k - d]: the correlation of mic with far shifted by max_lag - d peaks, at index
    # -(max_lag - d) of the circular result
    r = cc[(np.arange(max_lag) - max_lag) % n]
    i = int(np.argmax(r))
    if not 0 < i < max_lag - 1:
        return None
    y0, y1, y2 = r[i - 1], r[i], r[i + 1]
    den = y0 - 2.0 * y1 + y2
    frac = 0.5 * (y0 - y2) / den if den < 0 else 0.0
    away = np.concatenate([r[:max(0, i - PEAK_GUARD)], r[i + PEAK_GUARD + 1:]])
    other = float(np.max(np.abs(away))) if len(away) else 0.0
    return i + frac, float(y1 / other) if other > 0 else float("inf")


def delay_track(mic: np.ndarray, far: np.ndarray, rate: int = MODEL_RATE, window_s: float = 0.5,
                step_s: float = 0.25, max_lag_ms: float = 100.0, min_active: float = 0.6,
                min_peak_ratio: float = MIN_PEAK_RATIO) -> list[DelayPoint]:
    """The echo's delay behind the far end over two streams paired sample by sample (the canceller's own
    pairing: the service's tap, or :class:`~appliance.audio.device.DeviceAudio`'s ``(mic, far)`` blocks).

    :param mic: float32 [n] the microphone at ``rate`` Hz.
    :param far: float32 [n] what was played, paired with ``mic`` sample by sample.
    :param window_s: each measurement's window, s; ``step_s``: between windows, s.
    :param max_lag_ms: the longest delay looked for, ms.
    :param min_active: a window is measured only where at least this share of its far end (and of the
        ``max_lag_ms`` before it) was played (a sample at or above ``ACTIVE_PEAK`` in its 10 ms).
    :param min_peak_ratio: windows whose peak ratio is below this are left out (no echo, a user, noise).
    :returns: one :class:`DelayPoint` a window kept, in time order.
    """
    mic = np.asarray(mic, np.float32).reshape(-1)
    far = np.asarray(far, np.float32).reshape(-1)
    n = min(len(mic), len(far))
    w, step, lag = int(window_s * rate), max(1, int(step_s * rate)), int(max_lag_ms * rate / 1000.0)
    hop = max(1, rate // 100)
    frames = n // hop
    played = np.abs(far[:frames * hop]).reshape(frames, hop).max(axis=1) >= ACTIVE_PEAK
    out: list[DelayPoint] = []
    for end in range(w + lag, n + 1, step):
        f0, f1 = (end - w - lag) // hop, end // hop
        if f1 <= f0 or played[f0:f1].mean() < min_active:
            continue
        got = gcc_phat_delay(mic[end - w:end], far[end - w - lag:end], lag, rate)
        if got is None or got[1] < min_peak_ratio:
            continue
        delay_ms = round(float(got[0]) * 1000.0 / rate, 4)
        out.append(DelayPoint(round((end - w / 2) / rate, 4), delay_ms, round(got[1], 2)))
    return out


def drift_ppm(points: Sequence[DelayPoint]) -> Optional[float]:
    """The rate at which the delay moved, ppm of time (a least-squares line through ``points``; +: the echo
    falls further behind, the speaker's clock slower than the microphone's): ms of delay per s is 1000 ppm.
    None with fewer than 3 points or under 1 s between the first and the last."""
    if len(points) < 3 or points[-1].t_s - points[0].t_s < 1.0:
        return None
    t = np.array([p.t_s for p in points])
    d = np.array([p.delay_ms for p in points])
    return float(np.polyfit(t, d, 1)[0] * 1000.0)


def delay_summary(points: Sequence[DelayPoint], window_s: float = 10.0) -> dict:
    """What a run's delay track says, for a benchmark's JSON: ``n`` windows measured; ``delay_ms`` p5 / p50 / p95;
    ``wander_ms`` (p95 - p5); ``drift_ppm`` over the whole track (:func:`drift_ppm`); ``drift_ppm_peak`` the
    largest magnitude of :func:`drift_ppm` over ``window_s`` spans (a clock drift that wanders, or an adaptive
    resampler's, shows there and not in the whole run's); ``residual_ms_rms`` the points' scatter around those
    spans' lines (the measurement's own noise where the delay moves smoothly). Empty values (None) where there
    is too little to say."""
    out: dict = {"n": len(points), "delay_ms": None, "wander_ms": None, "drift_ppm": None, "drift_ppm_peak": None,
                 "residual_ms_rms": None}
    if not points:
        return out
    d = np.array([p.delay_ms for p in points])
    t = np.array([p.t_s for p in points])
    p5, p50, p95 = np.percentile(d, [5, 50, 95])
    out["delay_ms"] = {"p5": round(float(p5), 3), "p50": round(float(p50), 3), "p95": round(float(p95), 3)}
    out["wander_ms"] = round(float(p95 - p5), 3)
    whole = drift_ppm(points)
    out["drift_ppm"] = None if whole is None else round(whole, 1)
    rates, resid = [], []
    start = 0
    while start < len(points):
        stop = int(np.searchsorted(t, t[start] + window_s))
        ts, ds = t[start:stop], d[start:stop]
        if len(ts) >= 3 and ts[-1] - ts[0] >= max(1.0, window_s / 2):  # (drift_ppm's conditions, and half a span)
            line = np.polyfit(ts, ds, 1)  # drift_ppm's line: its slope is the span's rate
            rates.append(float(line[0] * 1000.0))
            resid.extend(ds - np.polyval(line, ts))
        start = max(stop, start + 1)
    if rates:
        out["drift_ppm_peak"] = round(float(max(rates, key=abs)), 1)
        out["residual_ms_rms"] = round(float(np.sqrt(np.mean(np.square(resid)))), 4)
    return out


class DriftFollower:
    """Keeps the far end on the microphone's clock, causally, for a linear echo canceller: it measures the echo's
    delay behind the far end as the two streams arrive (:func:`gcc_phat_delay` over ``window_s`` windows every
    ``step_s``, while the far end plays, and the first ``QUICK_S`` of each reply's echo as soon as it has arrived:
    over a silence the delay moves where nothing measures it), takes the delay's slope from the last ``fit_s``
    of measurements and its level from the reply's own (:meth:`delay_now`), and hands back the far end delayed
    by ``reserve`` samples plus how far the echo's delay has moved since the first measurement (a fractional
    delay: a Hann-windowed sinc of ``TAPS`` taps). So the echo stays where the canceller's filter found it while
    the speaker's clock wanders against the microphone's.

    The far end is delayed by ``reserve_ms`` from the start, so that an echo that comes sooner (a speaker clock
    faster than the microphone's) can still be followed; where the first measurement finds the echo sooner than
    the reserve and 2 ms, the reserve shrinks to that (a jump the canceller meets while it converges). The delay
    is clamped to [``TAPS`` / 2, 2 ``reserve_ms``]: a drift that moves the echo further than that from where it
    was first found is followed only that far (20 ms: 67 s at a constant 300 ppm; a re-alignment beyond it is
    not built).

    :param rate: Hz of both streams (16 kHz in the service).
    :param window_s, step_s: each measurement's window and the time between them, s (as :func:`delay_track`).
    :param fit_s: the measurements whose slope is followed, s.
    :param reserve_ms: the far end's delay before the echo has moved, ms.
    """

    TAPS = 32  # the fractional delay's windowed sinc

    def __init__(self, rate: int = MODEL_RATE, window_s: float = 0.5, step_s: float = 0.25, fit_s: float = 8.0,
                 max_lag_ms: float = 100.0, reserve_ms: float = 20.0, min_active: float = 0.6):
        self.rate = rate
        self._w, self._step = int(window_s * rate), int(step_s * rate)
        self._lag = int(max_lag_ms * rate / 1000.0)
        self._fit = fit_s * rate
        self._reserve_max = reserve_ms * rate / 1000.0
        self._min_active = min_active
        self._keep = self._w + self._lag + 4 * int(self._reserve_max) + self.TAPS
        # The newest samples of each stream, oldest first: [_end - _keep, _end) of buffers twice as long, moved
        # back to their start when full (a copy every few seconds, not every block).
        self._mic = np.zeros(2 * self._keep, np.float32)
        self._far = np.zeros(2 * self._keep, np.float32)
        self._played = np.zeros(2 * self._keep, bool)
        self._end = self._keep
        self.n = 0  # samples seen
        self._next = self._w + self._lag  # the sample count at which the next window ends
        self.points: list[tuple[float, float]] = []  # (sample at the window's centre, delay in samples)
        self.first: Optional[float] = None  # the first measured delay, samples
        self.reserve = float(int(self._reserve_max))  # the far end's delay at the first measurement, samples
        self._silent = int(REPLY_GAP_S * rate)  # samples since the far end last played
        self._reply_start: Optional[int] = None  # sample count at which the far end returned after REPLY_GAP_S
        self._quick_at: Optional[int] = None  # ... and at which that reply's quick measurement is due

    def delay_now(self) -> Optional[float]:
        """The echo's delay behind the far end now, samples (None before the first measurement): the slope of the
        last ``fit_s`` of measurements (a line, once they span ``MIN_SLOPE_S``; none before), through this
        reply's own measurements where it has some (the delay wanders over silences, where nothing measures
        it), else through the newest and followed for at most ``MAX_TANGENT_S`` past it."""
        if not self.points:
            return None
        pts = [p for p in self.points if p[0] >= self.points[-1][0] - self._fit]
        t = (np.array([p[0] for p in pts]) - self.n) / self.rate  # s before now (<= 0)
        d = np.array([p[1] for p in pts])
        slope = float(np.polyfit(t, d, 1)[0]) if len(pts) >= 8 and t[-1] - t[0] >= MIN_SLOPE_S else 0.0
        here = self._reply_start is not None and pts[-1][0] >= self._reply_start
        if here:
            mine = np.array([p[0] >= self._reply_start for p in pts])
            return float(np.median(d[mine] - slope * t[mine]))
        if slope == 0.0:
            return float(np.median(d))
        newest = float(np.median(d[-8:] - slope * (t[-8:] - t[-1])))  # at the newest measurement
        return newest + slope * min(-t[-1], MAX_TANGENT_S)

    def process(self, mic: np.ndarray, far: np.ndarray) -> np.ndarray:
        """Take a block of both streams, paired sample by sample; return the far end to give the canceller.

        :param mic: float32 [k] the microphone; ``far``: float32 [k] what was played at those instants.
        :returns: float32 [k] the far end, re-timed.
        """
        mic = np.asarray(mic, np.float32).reshape(-1)
        far = np.asarray(far, np.float32).reshape(-1)
        k = len(far)
        if k > self._keep:
            raise ValueError(f"a block of at most {self._keep} samples, not {k}")
        if self._end + k > len(self._far):
            for b in (self._mic, self._far, self._played):
                b[:self._keep] = b[self._end - self._keep:self._end]
            self._end = self._keep
        e = self._end + k
        self._mic[self._end:e], self._far[self._end:e], self._played[self._end:e] = mic, far, np.abs(far) >= ACTIVE_PEAK
        self._end = e
        self.n += k
        on = np.flatnonzero(self._played[e - k:e])
        if len(on):
            if self._silent + on[0] >= REPLY_GAP_S * self.rate:  # a new reply: its own quick measurement
                self._reply_start = self.n - k + int(on[0])
                d = self.delay_now()
                self._quick_at = None if d is None else self._reply_start + int(QUICK_S * self.rate) + int(d) + 1
            self._silent = k - 1 - int(on[-1])
        else:
            self._silent += k
        if self._quick_at is not None and self.n >= self._quick_at:
            self._measure(e - (self.n - self._quick_at), int(QUICK_S * self.rate), e)
            self._quick_at = None
        while self.n >= self._next:
            end = e - (self.n - self._next)
            self._next += self._step
            if self._played[end - self._w - self._lag:end].mean() < self._min_active:
                continue
            got = self._measure(end, self._w, e)
            if got is not None and self.first is None:
                self.first = got
                if got - 2e-3 * self.rate < self.reserve:  # an echo sooner than the reserve: less of it
                    self.reserve = float(max(got - 2e-3 * self.rate, 0.0))
        del self.points[:-int(4 * self._fit / self._step)]
        if self.first is None:
            return self._delayed(int(self.reserve), 0.0, k, e)
        if not self._played[e - k - int(2 * self._reserve_max) - self.TAPS:e].any():
            return np.zeros(k, np.float32)  # nothing played within reach of the delay: silence, with no fit
        d = self.delay_now()
        s = float(np.clip(self.reserve + d - self.first, self.TAPS / 2, 2 * self._reserve_max)) \
            if self.reserve >= self.TAPS / 2 else 0.0
        if s == 0.0:
            return far
        return self._delayed(int(np.floor(s)), s - np.floor(s), k, e)

    def _measure(self, end: int, w: int, e: int) -> Optional[float]:
        """The delay (samples) over the ``w`` samples of the microphone that end at buffer index ``end`` (``e``:
        where the newest sample is), kept in :attr:`points` if the correlation's peak passes ``MIN_PEAK_RATIO``;
        None if it does not."""
        got = gcc_phat_delay(self._mic[end - w:end], self._far[end - w - self._lag:end], self._lag, self.rate)
        if got is None or got[1] < MIN_PEAK_RATIO:
            return None
        self.points.append((self.n - (e - end) - w / 2, got[0]))
        return got[0]

    def _delayed(self, i: int, frac: float, k: int, e: int) -> np.ndarray:
        """The newest ``k`` samples of the far end (ending at buffer index ``e``) delayed by ``i`` + ``frac``
        samples (``frac`` in [0, 1)): float32 [k]."""
        if frac == 0.0:
            return self._far[e - k - i:e - i].copy()
        half = self.TAPS // 2
        taps = np.arange(-half + 1, half + 1)  # far'[n] = sum_j h[j] far[n - i - j], h[j] = sinc(j - frac) window
        h = np.sinc(taps - frac) * np.hanning(self.TAPS + 2)[1:-1]
        h /= h.sum()
        src = self._far[e - k - i - half: e - i + half - 1]  # far[n - i - j] for every n of the block and tap j
        return np.convolve(src, h, mode="valid").astype(np.float32)
