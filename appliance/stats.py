"""``appliance stats``: p50/p95 of the per-turn metrics over the last N turns.

Reads what :mod:`appliance.metrics` wrote: ``<storage.state_dir>/metrics.jsonl`` by default, or the
journal (``journal``), or a replay's ``timeline.jsonl`` / ``report.json``.
Percentiles are numpy's ``percentile`` with linear interpolation between the closest ranks.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

# Metrics summarised, with their unit (the order is the table's).
SUMMARISED = (
    ("eot_to_first_token_ms", "ms"),
    ("first_token_to_first_audio_ms", "ms"),
    ("eot_to_first_audio_ms", "ms"),
    ("barge_in_ms", "ms"),
    ("prefill_tokens", "tokens"),
    ("generated_tokens", "tokens"),
    ("xruns", "count"),
    ("output_latency_ms", "ms"),
)


def summarise(turns: list[dict], last: Optional[int] = None) -> dict:
    """Summary of the last ``last`` turns (all if None).

    :returns: ``{"turns": n, "interrupted": k, "metrics": {name: {"unit", "n", "p50", "p95", "max"}}}``;
        a metric with no value in any of these turns is absent (``barge_in_ms`` without barge-ins).
    """
    if last is not None and last > 0:
        turns = turns[-last:]
    out = {"turns": len(turns), "interrupted": sum(1 for t in turns if t.get("interrupted")), "metrics": {}}
    for name, unit in SUMMARISED:
        values = np.array([float(t[name]) for t in turns if isinstance(t.get(name), (int, float))
                           and not isinstance(t.get(name), bool)], dtype=np.float64)
        if not len(values):
            continue
        p50, p95 = np.percentile(values, [50, 95])
        out["metrics"][name] = {"unit": unit, "n": int(len(values)), "p50": round(float(p50), 1),
                                "p95": round(float(p95), 1), "max": round(float(values.max()), 1)}
    return out


def format_summary(summary: dict, source: str) -> str:
    """A plain-text table (fixed-width columns, no colour: it is read over SSH and pasted into threads)."""
    lines = [f"{summary['turns']} turn{'' if summary['turns'] == 1 else 's'} from {source} ({summary['interrupted']} interrupted)"]
    if not summary["metrics"]:
        return lines[0]
    lines.append(f"{'metric':32} {'n':>5} {'p50':>9} {'p95':>9} {'max':>9}  unit")
    for name, m in summary["metrics"].items():
        lines.append(f"{name:32} {m['n']:5d} {m['p50']:9.1f} {m['p95']:9.1f} {m['max']:9.1f}  {m['unit']}")
    return "\n".join(lines)
