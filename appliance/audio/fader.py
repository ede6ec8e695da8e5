"""One buffer that pauses, resumes and flushes the speaker's samples with a short linear fade.

The same :class:`Fader` runs in two places:

- in the sound-device worker process (:mod:`appliance.audio.device.worker`), where it *is* the output ring:
  the service pushes samples ahead of time and the output callback reads a block at a time, so a pause
  fades out what the ring holds and keeps the rest for the resume (the ring's 2–8 blocks do not play after
  a barge-in);
- in the pull ports (:class:`appliance.audio.port.PullPort`: the simulated room and the null port), where
  it pulls from the playback buffer exactly as many samples as it plays, so the buffer's account of what
  reached the speaker stays exact.

The fade, at ``fade_samples`` = F samples:

- out (pause, flush): the samples taken get gains ``g - k/(F+1)`` for k = 1, 2, … while that stays above
  zero (F samples from full gain, fewer from a fade in that was cut short). Every sample taken is heard,
  so a pause and its resume neither drop nor repeat a sample. Then the buffer is silent: a pause holds
  what it still has, a flush drops it and plays on at full gain.
- in (resume): gains ``g + k/F`` up to 1 (F samples from silence).

Samples are float32 mono at whatever rate the owner runs (the device's output rate in the worker, the
playback rate in a pull port); the fader has no clock and no lock: its owner calls it under its own lock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import Enum

import numpy as np


class FadeState(Enum):
    PLAYING = "playing"  # at full gain, or fading in after a resume
    FADING_OUT = "fading_out"  # a pause or flush is fading out what the buffer holds
    PAUSED = "paused"  # silent, holding what is left for the resume


@dataclass
class ReadResult:
    """What one :meth:`Fader.read` did.

    :param taken: samples consumed from the buffer (the rest of the block is zeros).
    :param silent: a fade out reached silence in this read (a pause now holds, a flush has dropped).
    :param short: samples of the block left as zeros because the buffer ran dry while playing (an
        underrun of the owner's supply, not of a fade or pause).
    """

    taken: int
    silent: bool
    short: int


def fade_samples(rate: int, fade_ms: float) -> int:
    """The fade length in samples for ``fade_ms`` at ``rate`` Hz (at least 1)."""
    return max(1, int(round(rate * float(fade_ms) / 1000.0)))


class Fader:
    """A FIFO of float32 mono samples with pause, resume and flush faded over ``fade_samples`` samples.

    :param fade_samples: F, the fade's length in samples (≥ 1); change it with :meth:`set_fade` (the next
        fade uses it; a fade under way keeps its length).

    Not thread-safe: the owner serialises :meth:`push`, :meth:`read` and the controls.
    """

    def __init__(self, fade_samples: int):
        self._fade = max(1, int(fade_samples))
        self._fifo: deque[np.ndarray] = deque()
        self.queued = 0  # samples held
        self.state = FadeState.PLAYING
        self.gain = 1.0
        self.fade_left = 0  # samples the fade out under way will still take
        self._flush = False  # the fade out under way ends in a drop

    # --- configuration ---
    @property
    def fade_samples(self) -> int:
        return self._fade

    def set_fade(self, n: int) -> None:
        """Fade length for the next pause, resume or flush, samples (clamped to ≥ 1)."""
        self._fade = max(1, int(n))

    # --- data ---
    def push(self, samples: np.ndarray) -> None:
        """Append float32 mono samples (copied only if they are not float32 already)."""
        x = np.asarray(samples, dtype=np.float32).reshape(-1)
        if len(x):
            self._fifo.append(x)
            self.queued += len(x)

    def want(self, n: int) -> int:
        """How many samples a :meth:`read` of ``n`` would consume, at most: 0 while paused, what is left of
        the fade while fading out, else ``n``. A pull port fetches ``want(n) - queued`` before reading."""
        if self.state is FadeState.PAUSED:
            return 0
        if self.state is FadeState.FADING_OUT:
            return min(n, self.fade_left)
        return n

    def read(self, n: int, out: np.ndarray | None = None) -> tuple[np.ndarray, ReadResult]:
        """The next ``n`` samples for the speaker, faded as the state says, zero-padded.

        :param out: optional float32 [n] array to write into (the device callback's buffer).
        :returns: (float32 [n], :class:`ReadResult`).
        """
        if out is None:
            out = np.zeros(n, dtype=np.float32)
        pos = 0
        silent = False
        while pos < n and self._fifo and self.state is not FadeState.PAUSED:
            seg = self._fifo[0]
            take = min(n - pos, len(seg))
            fading = self.state is FadeState.FADING_OUT
            if fading:
                take = min(take, self.fade_left)
            g = self.gain
            if take and (fading or g < 1.0):
                step = -1.0 / (self._fade + 1) if fading else 1.0 / self._fade
                ramp = np.clip(g + step * np.arange(1, take + 1, dtype=np.float32), 0.0, 1.0)
                out[pos:pos + take] = seg[:take] * ramp
                self.gain = float(ramp[-1])
            else:
                out[pos:pos + take] = seg[:take]
            if take == len(seg):
                self._fifo.popleft()
            else:
                self._fifo[0] = seg[take:]
            pos += take
            self.queued -= take
            if fading:
                self.fade_left -= take
                if self.fade_left <= 0:
                    silent = True
                    self._faded_out()
        if self.state is FadeState.FADING_OUT and not self._fifo:  # nothing (more) to fade: silent now
            silent = True
            self._faded_out()
        out[pos:] = 0.0
        short = n - pos if self.state is FadeState.PLAYING and not silent else 0
        return out, ReadResult(pos, silent, short)

    # --- controls ---
    def pause(self) -> None:
        """Fade out what is held and keep the rest (no-op unless playing)."""
        if self.state is FadeState.PLAYING:
            self._fade_out(flush=False)

    def resume(self) -> None:
        """Fade back in from where the pause stopped (no-op while a flush fades out, or when playing)."""
        if self.state is not FadeState.PLAYING and not self._flush:
            self.state = FadeState.PLAYING  # gain < 1: read() ramps it back up

    def flush(self) -> None:
        """Fade out, then drop everything held and play on at full gain; at once when already silent."""
        if self.state is FadeState.PLAYING:
            self._fade_out(flush=True)
        elif self.state is FadeState.FADING_OUT:
            self._flush = True
        else:  # paused: already silent
            self._flush = True
            self._faded_out()

    def fade_need(self) -> int:
        """Samples the fade out under way will still take beyond what is held (what a pull port fetches
        when a flush starts, before its source drops them); 0 when not fading out."""
        if self.state is not FadeState.FADING_OUT:
            return 0
        return max(0, self.fade_left - self.queued)

    def clear(self) -> None:
        """Drop every held sample at once (no fade); the state and gain stay."""
        self._fifo.clear()
        self.queued = 0

    def _fade_out(self, flush: bool) -> None:
        self.state = FadeState.FADING_OUT
        self._flush = flush
        # Steps of 1/(F+1) from the current gain, each sample above zero: F samples from full gain.
        self.fade_left = max(0, math.ceil(self.gain * (self._fade + 1) - 1e-6) - 1)

    def _faded_out(self) -> None:
        self.fade_left = 0
        if self._flush:
            self.clear()
            self._flush = False
            self.state = FadeState.PLAYING
            self.gain = 1.0
        else:
            self.state = FadeState.PAUSED
            self.gain = 0.0
