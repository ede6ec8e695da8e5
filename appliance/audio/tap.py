"""A benchmark's tap on the listener: every microphone block the service's listener processes, with its far
end and the canceller's output, appended to a raw file, so that a benchmark outside the service (the JACK
room, :mod:`appliance.bench.jack_room`) can place the service's audio clock on its own and measure the
canceller (ERLE) on the service's own streams.

Turned on by the environment variable :data:`ENV` (a file path) in the service's process; unset, nothing is
written and nothing is imported. The file: float32 triples ``(mic, far, out)`` per 16 kHz sample,
interleaved (12 bytes a sample), in the listener's sample order (sample ``k`` is ``audio_t = k / 16000``
of the VAD's events while the microphone was never muted). ``far`` is zero where the block had no far end;
``out`` is ``mic`` where no canceller ran. 192 kB/s of audio; for benchmarks only.

Beside it, the trace (:func:`trace_path`): one JSON array a line, what the listener decided on that audio,
on the same sample clock: ``["vad", t, p]`` per Silero window (``t`` the sample after its end, ``p`` its
probability), and the canceller's rows (:meth:`appliance.audio.echo.EchoCanceller.trace_rows`) with their
frame count turned into that clock: ``["frame", t, serving, in_db, out_db, over_db, served_mic]`` (``t`` the
frame's first sample) and ``["gate", t, test, passed, figures]`` (``t`` the end of the audio the canceller
had processed). About 15 kB/s while the far end plays.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import numpy as np

ENV = "APPLIANCE_AUDIO_TAP"


class AudioTap:
    """Appends ``(mic, far, out)`` blocks to ``path`` (unbuffered: a reader sees each block once written).

    :param path: the file (created or truncated).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fh = open(self.path, "wb", buffering=0)
        self._buf = [np.zeros(0, np.float32) for _ in range(3)]  # mic, far, out not written yet
        self._trace = open(trace_path(self.path), "w", encoding="utf-8", buffering=1)

    @classmethod
    def from_env(cls) -> Optional["AudioTap"]:
        """A tap on the file named by :data:`ENV`, or None when it is unset or empty."""
        path = os.environ.get(ENV)
        return cls(Path(path)) if path else None

    def write(self, mic: np.ndarray, far: Optional[np.ndarray], out: np.ndarray) -> None:
        """One block as the listener saw it: ``mic`` float32 [n] at 16 kHz, ``far`` (None or any length) and the
        canceller's ``out`` (its complete 10 ms frames so far: may lag ``mic`` by less than a frame). The three
        streams are buffered and written sample for sample as far as all are known; a far end shorter than
        the microphone is zero-padded, as the canceller pads it."""
        self._buf[0] = np.concatenate([self._buf[0], np.asarray(mic, np.float32)])
        if far is not None and len(far):
            self._buf[1] = np.concatenate([self._buf[1], np.asarray(far, np.float32)])
        self._buf[2] = np.concatenate([self._buf[2], np.asarray(out, np.float32)])
        n = min(len(self._buf[0]), len(self._buf[2]))
        if n == 0:
            return
        if len(self._buf[1]) < n:
            self._buf[1] = np.concatenate([self._buf[1], np.zeros(n - len(self._buf[1]), np.float32)])
        self._fh.write(np.stack([b[:n] for b in self._buf], axis=1).tobytes())
        self._buf = [b[n:] for b in self._buf]

    def trace(self, rows: list) -> None:
        """Append trace rows (lists or tuples of JSON values, see the module's notes), one a line."""
        if rows:
            self._trace.write("".join(json.dumps(list(r), separators=(",", ":"), default=_plain) + "\n" for r in rows))

    def close(self) -> None:
        self._fh.close()
        self._trace.close()


def _plain(x):
    """A numpy scalar as the Python number or bool it holds (for the trace's JSON)."""
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON: {type(x).__name__}")


def trace_path(path: Path) -> Path:
    """The trace's file beside the tap ``path``: ``<path>.trace.jsonl``."""
    return Path(str(path) + ".trace.jsonl")


def read_trace(path: Path, t0: int = 0, t1: Optional[int] = None) -> list[list]:
    """The trace rows beside the tap ``path`` (:func:`trace_path`) whose sample ``t`` (the second field) is
    within ``t0``..``t1`` (None: to the end); a partly written last line is left out; [] with no trace."""
    try:
        text = trace_path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r[1] >= t0 and (t1 is None or r[1] <= t1):
            rows.append(r)
    return rows


def read_tap(path: Path, start: int = 0, count: Optional[int] = None) -> np.ndarray:
    """What a tap has written so far, from sample ``start`` (``count`` samples at most; None: all): float32
    [n, 3] (``mic``, ``far``, ``out`` columns; a partly written last sample is left out)."""
    with open(path, "rb") as fh:
        fh.seek(12 * max(0, int(start)))
        raw = fh.read(-1 if count is None else 12 * int(count))
    raw = raw[: len(raw) - len(raw) % 12]
    return np.frombuffer(raw, dtype=np.float32).reshape(-1, 3)
