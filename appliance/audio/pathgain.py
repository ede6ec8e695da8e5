"""The echo path's gain, measured at the start of each reply, so that a volume step between two replies reaches the
canceller at once instead of being re-learned.

What it is for: the echo's level at the microphone follows whatever sits after the far end the canceller is given:
a speaker's own volume knob, an ALSA mixer, the amplifier. When it steps between two replies, Speex's adapted filter
is 6 dB off for a 6 dB step, and Speex takes seconds to re-learn it: measured here, offline (the simulated room,
two fixed Piper replies then a third after a 2 s gap, echo 6 dB up or down from the gap on), the third reply's ERLE
over its first second was 10-26 dB against 38-40 without a step, and 4 of 8 such replies paused on their own voice
(0.14-0.26 s in). Told the step, Speex cancels as before at once: 34-41 dB over the first second, no pause
(docs/measurements.md, session 24). The JACK room's suite steps the echo by 6 dB between many of its cases (each
case sets the room's echo to 0 or +6 dB over the user), which is where its short stops' and backchannels' ERLE of
10-24 dB came from (session 24's full runs).

How: the echo path's response is estimated from the far end and the microphone while replies play (the
cross-spectrum over the auto-spectrum, ``N``-sample Hann windows every ``HOP`` samples, forgetting over
``FORGET_S``), and at the start of a new reply (after a far-end silence) the first ``MEASURE_S`` of the microphone
are fitted, by least squares, to the echo that response predicts from the reply's far end: the factor is the step.
Least squares against a prediction is unbiased by a user talking over the reply (their speech is not correlated
with the far end); it only makes the fit worse, and a fit that explains less than ``MIN_FIT`` of the microphone's
energy changes nothing (Speex then re-learns on its own, as without this).

Units: float32 samples at 16 kHz in; dB and factors of amplitude out.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
from scipy.signal import fftconvolve

from .files import MODEL_RATE

N = 4096  # samples per analysis window (256 ms at 16 kHz): long next to the echo's delay, so that a window of the
#   microphone holds the echo of most of the far end's window (a 1024-sample window at a 30 ms delay explained 2-4 %
#   of the microphone's energy, measured here on white noise; this one 86 %)
HOP = 640  # samples between two windows of the response's estimate (40 ms)
TAPS = 2048  # the predicting response's length, samples (128 ms: the delay and the room's early reverberation)
FORGET_S = 4.0  # the response's estimate forgets over this long of far end, s
FRAME = 160  # samples per frame (10 ms)
RING = -(-N // FRAME) * FRAME  # samples kept of each stream: N, rounded up to whole frames
FAR_SILENT = FRAME * 1e-10  # a far-end frame's energy at or under this (-100 dBFS) is silence (as EchoCanceller's)
REPLY_GAP_FRAMES = 100  # the far end back after this many silent frames (1 s) is a new reply
MIN_REF_HOPS = 25  # windows of far end (1 s) the estimate needs before it predicts
MEASURE_S = 0.15  # the new reply's first this-many seconds are fitted, s (its first 200 ms are judged strictly by
#   the onset gate anyway: EchoCanceller's NEW_REPLY_FRAMES)
MIN_FIT = 0.9  # the fitted prediction must explain this share of the microphone's energy over those seconds. Measured
#   here: true +-6 dB steps fitted 0.93-0.999 offline (the simulated room, linear or the JACK room's clipping speaker,
#   no drift) and 0.98-1.00 live (the JACK room at 0 ppm); at +300 ppm (the echo's delay wandering against a response
#   estimated over 4 s) 153 measurements of two full runs fitted 0.00-0.85 and gave noise for a step: a bound of 0.5
#   let 3-4 a run through there, every one "upward" (+2.1 to +7.7 dB; the suite steps both ways). docs/measurements.md
MIN_STEP_DB = 2.0  # a smaller change is left to the canceller's own adaptation
MAX_STEP_DB = 20.0  # a larger one is not a volume step (nor is a total beyond it): left alone


def _lag_taper(n: int, taps: int) -> np.ndarray:
    """How much a Hann window of ``n`` samples shrinks a response at lags 0..taps-1 in a cross-spectral estimate:
    sum(w[i] w[i + lag]) / sum(w[i]^2)."""
    w = np.hanning(n)
    full = np.correlate(w, w, mode="full")[n - 1:n - 1 + taps]
    return full / full[0]


class GainStep(NamedTuple):
    """One measurement of the echo path's gain at a new reply's start (:meth:`EchoGainFollower.push`)."""

    n: int  # samples fed to the follower when it was made (the end of the reply's first MEASURE_S)
    step_db: float  # the echo's amplitude over its amplitude in the estimate, dB (0.0 where nothing could be fitted)
    fit: float  # how much of the microphone's energy the estimate's prediction, so scaled, explains: 0-1
    applied: bool  # taken into the estimate: the canceller's far end is scaled by :attr:`factor` from here on

    @property
    def factor(self) -> float:
        """The step as an amplitude factor (``10 ** (step_db / 20)``)."""
        return 10.0 ** (self.step_db / 20.0)


class EchoGainFollower:
    """Follows the echo path's gain from reply to reply (see the module's notes).

    Feed it every 10 ms frame with :meth:`push`; it returns its measurement (:class:`GainStep`) when it has made one
    at a new reply's start, else None. While it measures (:attr:`measuring`, a reply's first
    ``MEASURE_S``) the canceller holds those frames back, so that Speex meets them already told (given the step
    after the measurement, Speex had adapted half-way in those 150 ms and was off the other way: no better than
    without, measured here, offline). ``steps`` keeps the newest 64 measurements.
    """

    def __init__(self):
        self._win = np.hanning(N).astype(np.float32)
        self._taper = _lag_taper(N, TAPS)
        self._a = float(np.exp(-HOP / (FORGET_S * MODEL_RATE)))
        self._mic = np.zeros(RING, np.float32)  # the newest RING samples of each stream, rings: the oldest at _pos
        self._far = np.zeros(RING, np.float32)
        self._pos = 0
        self._sxy: Optional[np.ndarray] = None
        self._sxx: Optional[np.ndarray] = None
        self._ref_hops = 0
        self._silent = 0  # far-silent frames in a row
        self._since_hop = 0
        self._n = 0
        self._measure: Optional[list] = None  # (far history, [mic blocks], [far blocks]) during a reply's start
        self.steps: list[GainStep] = []
        self.total_db = 0.0  # the steps applied so far, summed, dB (at most MAX_STEP_DB either way)

    @property
    def measuring(self) -> bool:
        """A new reply's first ``MEASURE_S`` are being measured: the canceller holds them back until it knows."""
        return self._measure is not None

    def push(self, mic: np.ndarray, far: np.ndarray) -> Optional[GainStep]:
        """Whole 10 ms frames of the two streams, paired sample for sample.

        :param mic: float32 [160 k] the microphone, 16 kHz.
        :param far: float32 [160 k] the far end the canceller pairs with it.
        :returns: the measurement made in these frames (at the end of a new reply's first ``MEASURE_S``), applied
            or not; else None.
        """
        got = None
        for i in range(0, len(mic) - FRAME + 1, FRAME):
            g = self._frame(np.asarray(mic[i:i + FRAME], np.float32), np.asarray(far[i:i + FRAME], np.float32))
            got = g if g is not None else got
        return got

    def _frame(self, mic: np.ndarray, far: np.ndarray) -> Optional[GainStep]:
        self._n += FRAME
        active = float(np.dot(far, far)) > FAR_SILENT
        if active and self._silent >= REPLY_GAP_FRAMES and self._sxy is not None and self._ref_hops >= MIN_REF_HOPS:
            self._measure = [self._newest(self._far)[-TAPS:], [], []]  # a new reply: measure its start
        self._silent = 0 if active else self._silent + 1
        self._mic[self._pos:self._pos + FRAME] = mic
        self._far[self._pos:self._pos + FRAME] = far
        self._pos = (self._pos + FRAME) % RING
        if self._measure is not None:
            self._measure[1].append(mic)
            self._measure[2].append(far)
            return self._finish() if len(self._measure[1]) * FRAME >= int(MEASURE_S * MODEL_RATE) else None
        self._since_hop += FRAME
        if self._since_hop >= HOP and active:
            self._since_hop = 0
            x = np.fft.rfft(self._newest(self._far) * self._win)
            y = np.fft.rfft(self._newest(self._mic) * self._win)
            if self._sxy is None:
                self._sxy, self._sxx = np.conj(x) * y, (x * np.conj(x)).real
            else:
                self._sxy = self._a * self._sxy + np.conj(x) * y
                self._sxx = self._a * self._sxx + (x * np.conj(x)).real
            self._ref_hops += 1
        return None

    def _newest(self, ring: np.ndarray) -> np.ndarray:
        """A ring's newest N samples, oldest first (a copy)."""
        return np.concatenate([ring[self._pos:], ring[:self._pos]])[-N:]

    def _finish(self) -> GainStep:
        hist, mics, fars = self._measure
        self._measure = None
        mic, far = np.concatenate(mics), np.concatenate(fars)
        h = np.fft.irfft(self._sxy / (self._sxx + 1e-12 * (np.max(self._sxx) + 1e-30)), N)[:TAPS] / self._taper
        pred = fftconvolve(np.concatenate([hist, far]), h)[TAPS:TAPS + len(mic)]
        pp, my, mm = float(np.dot(pred, pred)), float(np.dot(mic, pred)), float(np.dot(mic, mic))
        if pp <= 0.0 or mm <= 0.0 or my <= 0.0:
            step = GainStep(self._n, 0.0, 0.0, False)
        else:
            g = my / pp
            fit = my * my / (pp * mm)
            step_db = float(20.0 * np.log10(g))
            ok = fit >= MIN_FIT and MIN_STEP_DB <= abs(step_db) and abs(self.total_db + step_db) <= MAX_STEP_DB
            step = GainStep(self._n, step_db, float(fit), bool(ok))
            if ok:
                self._sxy = self._sxy * g  # the estimate is of the new path from now on
                self.total_db += step_db
        self.steps.append(step)
        del self.steps[:-64]
        return step
