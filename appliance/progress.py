"""Progress of long work (model loading, KV cache rebuild, first-boot steps).

On a terminal: a ``tqdm`` bar on stderr. Under systemd, or when stderr is not a terminal: plain lines
``progress: <what> <done>/<total> <unit> (<pct>%)`` at most every ``interval_s`` seconds, then
``progress: <what> done in <s> s`` (journald adds the time; we add none). ``total=None`` is work of
unknown length (loading a GGUF): only the start and end lines.

Usage::

    with Progress("loading model", total=None):
        Llama(...)
    with Progress("rebuilding KV cache", total=n_tokens, unit="tokens") as p:
        for batch in batches:
            ...; p.update(len(batch))
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from .metrics import under_systemd


class Progress:
    """One long step.

    :param what: what is being done, e.g. ``"loading model gemma-4-E2B-it-Q4_K_M.gguf"``.
    :param total: amount of work (in ``unit``), or None when unknown.
    :param unit: unit of ``total`` and :meth:`update` (``"tokens"``, ``"B"``, ``"steps"``).
    :param stream: where it goes (default stderr, so stdout stays for results and metrics lines).
    :param bar: force the tqdm bar (True) or plain lines (False); default: a bar only on a terminal and
        not under systemd.
    :param interval_s: least time between two plain progress lines.
    """

    def __init__(self, what: str, total: Optional[float] = None, unit: str = "", stream: Optional[TextIO] = None,
                 bar: Optional[bool] = None, interval_s: float = 5.0):
        self.what, self.total, self.unit = what, total, unit
        self.stream = stream or sys.stderr
        if bar is None:
            bar = not under_systemd() and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval_s = interval_s
        self.done = 0.0
        self._t0 = time.monotonic()
        self._last = self._t0
        self._bar = None
        if bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=what, unit=unit or "it", file=self.stream, leave=False,
                             unit_scale=unit == "B", dynamic_ncols=True)
        else:
            self._line(f"{what}..." if total is None else f"{what} 0/{self._n(total)} {unit} (0%)".rstrip())

    def _n(self, x: float) -> str:
        return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"

    def _line(self, text: str) -> None:
        print(f"progress: {text}", file=self.stream, flush=True)

    def update(self, n: float = 1) -> None:
        """``n`` more units done."""
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if self.total and now - self._last >= self.interval_s:
            self._last = now
            pct = 100.0 * self.done / self.total
            self._line(f"{self.what} {self._n(self.done)}/{self._n(self.total)} {self.unit} ({pct:.0f}%)".replace("  ", " "))

    def close(self, ok: bool = True) -> float:
        """End the step; returns its duration in seconds."""
        dt = time.monotonic() - self._t0
        if self._bar is not None:
            self._bar.close()
        self._line(f"{self.what} {'done' if ok else 'failed'} in {dt:.1f} s")
        return dt

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)
