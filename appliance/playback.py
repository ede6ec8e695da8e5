"""The playback buffer between TTS and the output callback: pause, resume, flush, fade, and the
sample-exact account of what reached the speaker.

The output callback calls :meth:`Playback.read` once per block; it only copies samples under a lock that
no model code ever holds (TTS and the state machine hold it for a list operation at most).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np


@dataclass
class Segment:
    """One synthesised clause: float32 mono audio at the playback rate and the text it says."""

    reply_id: int
    audio: np.ndarray
    text: str
    played: int = 0  # samples of it that reached the speaker

    @property
    def done(self) -> bool:
        return self.played >= len(self.audio)


class Playback:
    """A queue of clause segments read block by block by the output callback.

    :param sample_rate: the output rate, Hz.
    :param fade_ms: length of the fade-out on pause/flush and fade-in on resume, ms (5–10 ms is inaudible
        as a click and well within one 10 ms output block).
    :param on_event: called as ``on_event(name, **info)`` from the output callback for ``"drained"``
        (every segment of a finished reply has been played; ``reply_id``) and ``"silent"`` (a pause or flush
        fade has reached zero). It must not block (e.g. ``queue.SimpleQueue.put``).
    """

    def __init__(self, sample_rate: int, fade_ms: float = 8.0, on_event: Optional[Callable[..., None]] = None):
        self.sample_rate = sample_rate
        self.fade_samples = max(1, int(sample_rate * fade_ms / 1000.0))
        self._on_event = on_event or (lambda name, **info: None)
        self._lock = threading.Lock()
        self._queue: list[Segment] = []
        self._history: list[Segment] = []  # segments of the current reply, played or not
        self._reply_id = 0
        self._ended = False
        self._paused = False
        self._gain = 1.0  # current output gain, ramps between 0 and 1
        self._target = 1.0
        self._flush_after_fade = False
        self._drained_sent = False
        self.played_total = 0  # samples of speech (non-silence) sent to the speaker since start
        # Optional sound device with pause_output/resume_output/flush_output (DeviceAudio): its worker holds
        # a ring of samples already read from here, so it pauses, fades and flushes there, and this buffer
        # only keeps its place (see pause()).
        self.device = None

    # --- producer side (TTS thread, state machine) ---
    def begin_reply(self, reply_id: int) -> None:
        """Start accepting segments of ``reply_id``; segments of any other reply are refused from now on."""
        with self._lock:
            self._reply_id = reply_id
            self._ended = False
            self._history = []
            self._paused = False
            self._gain = self._target = 1.0
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
        """Fade to silence within ``fade_ms`` and hold the position; nothing is thrown away.

        With a :attr:`device`, the device fades and holds (the samples it already has are the next to
        play), and this buffer goes on answering the reads that were already on their way, unfaded."""
        if self.device is not None:
            self.device.pause_output()
        with self._lock:
            self._paused = True
            if self.device is None:
                self._target = 0.0

    def resume(self) -> None:
        """Continue exactly after the last sample played, fading in over ``fade_ms``."""
        if self.device is not None:
            self.device.resume_output()
        with self._lock:
            self._paused = False
            self._target = 1.0
            if self._ended and not self._queue and self._reply_id >= 0 and not self._drained_sent:
                self._drained_sent = True
                self._on_event("drained", reply_id=self._reply_id)

    def flush(self) -> int:
        """Drop every queued sample of the current reply and refuse further segments of it. Fades out first
        if audio is still audible. Returns the number of samples dropped."""
        with self._lock:
            dropped = sum(len(s.audio) - s.played for s in self._queue)
            if self.device is not None:
                self._queue.clear()
            elif self._gain > 0.0 and self._queue:
                self._flush_after_fade = True
                self._target = 0.0
            else:
                self._queue.clear()
            self._ended = True
            self._reply_id = -1
            self._paused = False
        if self.device is not None:
            # After the queue is empty: the device fades out, drops what it holds, and plays on from here.
            self.device.flush_output()
        return dropped

    def device_silent(self) -> None:
        """The device's fade out reached silence (from its reader thread)."""
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

    # --- consumer side (output callback) ---
    def read(self, n: int) -> np.ndarray:
        """Return the next ``n`` samples for the speaker (float32), silence when there is nothing to play."""
        out = np.zeros(n, dtype=np.float32)
        events = []
        with self._lock:
            pos = 0
            while pos < n and self._queue and (self._gain > 0.0 or self._target > 0.0):
                seg = self._queue[0]
                take = min(n - pos, len(seg.audio) - seg.played)
                chunk = seg.audio[seg.played : seg.played + take]
                if self._gain != self._target:
                    # Every sample consumed during a fade is heard at a non-zero gain, so a pause and
                    # its resume neither drop nor repeat a sample.
                    step = 1.0 / self.fade_samples
                    if self._target < self._gain:
                        ramp = self._gain - step * np.arange(0, take, dtype=np.float32)
                        ended = np.nonzero(ramp <= 1e-6)[0]
                        if len(ended):
                            take = int(ended[0])
                        new_gain = 0.0 if len(ended) else float(ramp[-1] - step)
                        if new_gain <= 1e-6:
                            new_gain = 0.0
                    else:
                        ramp = np.minimum(1.0, self._gain + step * np.arange(1, take + 1, dtype=np.float32))
                        full = np.nonzero(ramp >= 1.0)[0]
                        if len(full):
                            take = int(full[0]) + 1
                        new_gain = float(ramp[take - 1]) if take else self._gain
                    chunk, ramp = chunk[:take], ramp[:take]
                    out[pos : pos + take] = chunk * ramp
                    self._gain = new_gain
                else:
                    out[pos : pos + take] = chunk
                seg.played += take
                pos += take
                self.played_total += take
                if seg.done:
                    self._queue.pop(0)
                if self._gain == 0.0 and self._target == 0.0:
                    events.append(("silent", {}))
                    if self._flush_after_fade:
                        self._queue.clear()
                        self._flush_after_fade = False
                    break
            if self._flush_after_fade and (self._gain == 0.0 or not self._queue):
                self._queue.clear()
                self._flush_after_fade = False
            if not self._queue and self._gain > 0.0 and self._target == 0.0:
                self._gain = 0.0
                events.append(("silent", {}))
            if not self._queue and self._ended and self._reply_id >= 0 and not self._paused and not self._drained_sent:
                self._drained_sent = True
                events.append(("drained", {"reply_id": self._reply_id}))
        for name, info in events:
            self._on_event(name, **info)
        return out
