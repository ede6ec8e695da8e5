"""Per-turn metrics: one structured line per turn, and reading those lines back.

:class:`TurnMetrics` is a conversation observer (``conversation.subscribe(TurnMetrics(...))``). At every
``turn_end`` it writes

* one ``key=value`` line (logfmt) to a stream, stdout by default, starting with the word ``turn_metrics``.
  Under systemd (``$INVOCATION_ID`` or ``$JOURNAL_STREAM`` set) the line carries no timestamp of its own:
  journald stamps it. ``journalctl -u appliance -o cat | grep turn_metrics`` shows them;
* one JSON object to an append-only JSONL file (``<storage.state_dir>/metrics.jsonl`` on the device),
  with a wall-clock ``ts`` (ISO 8601, UTC). The file is rotated to ``metrics.jsonl.1`` past 4 MiB
  (about 15,000 turns, measured here at ~270 bytes a turn).

The metrics of a turn (ms are milliseconds on the conversation clock):

=================================  =============================================================
``eot_to_first_token_ms``          end of the user's turn (VAD end of speech) → first LLM token (TTFT)
``first_token_to_first_audio_ms``  first token → first synthesised audio queued for playback
``eot_to_first_audio_ms``          end of turn → first audio (TTFA)
``prefill_tokens``                 tokens evaluated before the first generated one (KV cache prefill)
``generated_tokens``               tokens generated (including those cut by a barge-in)
``interrupted``                    the reply was cut by the user (barge-in that flushed it)
``barge_in_ms``                    VAD speech onset while speaking → output faded to silence, for
                                   the last barge-in of the turn (absent when there was none)
``barge_ins``                      pauses of the reply during the turn, resumed ones included (the
                                   service cannot tell the user's speech from its own echo taken
                                   for it; ``appliance replay``'s report can, as ``self_pauses``)
``xruns``                          audio xruns (over/underflows, late output blocks) since the
                                   previous turn ended
``user_speech_ms``                 length of the user's turn
``output_latency_ms``              the output path's latency (PortAudio's + the device ring), when
                                   the audio backend reports it
=================================  =============================================================

:func:`read_turns` reads those records back from a ``metrics.jsonl``, a replay's ``timeline.jsonl`` or
``report.json``, a text dump of the journal, or the journal itself.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterable, Optional, TextIO

from .errors import UserError
from .events import Ev

MARKER = "turn_metrics"
METRICS_FILE = "metrics.jsonl"
ROTATE_BYTES = 4 * 1024 * 1024

# The keys of a line, in order. Numbers not known for a turn (no first audio, no barge-in) are left out.
KEYS = ("reply_id", "eot_to_first_token_ms", "first_token_to_first_audio_ms", "eot_to_first_audio_ms",
        "prefill_tokens", "generated_tokens", "interrupted", "barge_in_ms", "barge_ins", "xruns",
        "user_speech_ms", "output_latency_ms")


def under_systemd() -> bool:
    """True when started by systemd (it sets ``INVOCATION_ID``; ``JOURNAL_STREAM`` when stdout is the journal)."""
    return bool(os.environ.get("INVOCATION_ID") or os.environ.get("JOURNAL_STREAM"))


def _fmt(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def format_line(metrics: dict) -> str:
    """``turn_metrics key=value ...`` (logfmt; values never contain spaces)."""
    parts = [MARKER] + [f"{k}={_fmt(metrics[k])}" for k in KEYS if metrics.get(k) is not None]
    return " ".join(parts)


def parse_line(line: str) -> Optional[dict]:
    """The metrics of one ``turn_metrics`` line (anything before the marker, e.g. a journal prefix, is
    ignored), or None if the line is not one."""
    _, sep, rest = line.partition(MARKER + " ")
    if not sep:
        return None
    out: dict = {}
    for token in rest.split():
        key, eq, raw = token.partition("=")
        if not eq:
            continue
        if raw in ("true", "false"):
            out[key] = raw == "true"
            continue
        try:
            out[key] = int(raw)
        except ValueError:
            try:
                out[key] = float(raw)
            except ValueError:
                out[key] = raw
    return out


class TurnMetrics:
    """Conversation observer writing one metrics line (and JSONL record) per ``turn_end``.

    :param path: JSONL file to append to (its directory is created), or None for none.
    :param stream: where the ``turn_metrics`` line goes (default ``sys.stdout``), or None for nowhere.
    :param timestamps: prefix the line with local time; default: only when not under systemd.
    :param keep: how many turns :attr:`turns` keeps: None all (reading a file back), 0 none (the
        service, which runs for months: a list of every turn would grow without end).

    Runs on the conversation thread: it only formats and appends a line. A failing write is reported
    once on stderr and never raised (metrics must not stop the appliance).
    """

    def __init__(self, path: Optional[str | Path] = None, stream: Optional[TextIO] = sys.stdout,
                 timestamps: Optional[bool] = None, keep: Optional[int] = None):
        self.path = Path(path) if path else None
        self.stream = stream
        self.timestamps = (not under_systemd()) if timestamps is None else timestamps
        self._pause_onset: Optional[float] = None
        self._barge_in_ms: Optional[float] = None
        self._barge_ins = 0
        self._warned = False
        self._lock = threading.Lock()
        self.keep = keep  # turns kept in self.turns: None = all (reading a file back), 0 = none (the service)
        self.turns: list[dict] = []

    def __call__(self, record: dict) -> None:
        event = record.get("event")
        if event == Ev.INTERRUPTED:
            self._pause_onset = float(record.get("onset_t", record["t"]))
            self._barge_ins += 1
        elif event == Ev.OUTPUT_SILENT and self._pause_onset is not None:
            self._barge_in_ms = round((float(record["t"]) - self._pause_onset) * 1000.0, 1)
            self._pause_onset = None
        elif event == Ev.TURN_END:
            self._turn_end(record)

    def _turn_end(self, record: dict) -> None:
        xruns = int(record.get("xruns") or 0)  # the sound devices' count (the port's stats, in turn_end)
        metrics = {k: record.get(k) for k in KEYS}
        metrics.update(barge_in_ms=self._barge_in_ms, barge_ins=self._barge_ins, xruns=xruns)
        self._barge_in_ms, self._barge_ins, self._pause_onset = None, 0, None
        metrics = {k: v for k, v in metrics.items() if v is not None}
        if self.keep is None or self.keep > 0:
            self.turns.append(metrics)
            if self.keep is not None:
                del self.turns[: -self.keep]
        self._write(metrics)

    def _write(self, metrics: dict) -> None:
        with self._lock:
            try:
                if self.stream is not None:
                    line = format_line(metrics)
                    if self.timestamps:
                        line = f"{_dt.datetime.now().isoformat(timespec='seconds')} {line}"
                    print(line, file=self.stream, flush=True)
                if self.path is not None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    if self.path.exists() and self.path.stat().st_size > ROTATE_BYTES:
                        self.path.replace(self.path.with_name(self.path.name + ".1"))
                    stamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")
                    with open(self.path, "a", encoding="utf-8") as fh:
                        fh.write(json.dumps({"ts": stamp, **metrics}) + "\n")
            except OSError as exc:
                if not self._warned:
                    self._warned = True
                    print(f"warning: cannot write turn metrics to {self.path}: {exc.strerror}", file=sys.stderr)


# --- reading back ---------------------------------------------------------------------------------------

def _from_records(records: Iterable[dict]) -> list[dict]:
    """Turn records from JSON objects: metrics.jsonl records as they are, timeline records only when
    ``event == "turn_end"``; a timeline's barge-ins are paired with their turn as the observer does."""
    observer = TurnMetrics(stream=None)
    plain = []
    timeline = False
    for r in records:
        if "event" in r:
            timeline = True
            if "t" in r:
                observer(r)
        elif any(k in r for k in KEYS):
            plain.append(r)
    return observer.turns if timeline else plain


def _journal(unit: str = "appliance", lines: int = 50000) -> str:
    try:
        out = subprocess.run(["journalctl", "-u", unit, "-o", "cat", "--no-pager", "-n", str(lines)],
                             capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise UserError("journalctl not found: pass a metrics file instead "
                        f"(e.g. /var/lib/appliance/state/{METRICS_FILE})") from None
    except subprocess.TimeoutExpired:
        raise UserError("journalctl took longer than 30 s: pass a metrics file instead") from None
    if out.returncode != 0:
        why = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"
        raise UserError(f"journalctl -u {unit}: {why}; run as root or a member of systemd-journal, "
                        "or pass a metrics file")
    return out.stdout


def read_turns(source: str | Path) -> list[dict]:
    """Per-turn metrics, oldest first.

    :param source: ``"journal"`` (``journalctl -u appliance -o cat``), a ``metrics.jsonl`` (with its
        rotated ``.1`` read first), a replay's ``timeline.jsonl`` or ``report.json``, or a text file of
        ``turn_metrics`` lines (e.g. a saved journal).
    :returns: one dict per turn with the keys of :data:`KEYS` that were known.
    :raises UserError: the file is missing, unreadable or not one of these formats.
    """
    if str(source) == "journal":
        return [m for m in map(parse_line, _journal().splitlines()) if m is not None]
    path = Path(source)
    files = [path]
    rotated = path.with_name(path.name + ".1")
    if path.suffix == ".jsonl" and rotated.is_file():
        files.insert(0, rotated)
    text = ""
    for f in files:
        try:
            text += f.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UserError(f"{f}: no such metrics file; the service writes <storage.state_dir>/{METRICS_FILE}, "
                            "a replay writes timeline.jsonl; or use `journal`") from None
        except UnicodeDecodeError:  # a WAV, a GGUF: readable, but not text
            raise UserError(f"{f}: not a text file (not UTF-8); give a metrics.jsonl, a replay's timeline.jsonl or "
                            "report.json, a saved journal, or `journal`") from None
        except OSError as exc:
            raise UserError(f"{f}: cannot read it ({exc.__class__.__name__}); check the path and its permissions") from None
    stripped = text.lstrip()
    if stripped.startswith("{") and path.suffix == ".json":
        try:
            report = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not valid JSON (line {exc.lineno}); give a report.json or a metrics file") from None
        turns = report.get("turns", []) if isinstance(report, dict) else []
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise UserError(f"{path}: `turns` is not a list of turn objects; give a report.json that "
                            "`appliance replay` wrote, or a metrics file")
        return _from_records(turns)
    records, lines = [], []
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s:
            continue
        if s.startswith("{"):
            try:
                records.append(json.loads(s))
            except json.JSONDecodeError:
                raise UserError(f"{path}: line {n} is not valid JSON; is the file cut short?") from None
        else:
            lines.append(s)
    marked = [m for m in map(parse_line, lines) if m is not None]
    if lines and not marked and not records:
        raise UserError(f"{path}: holds no turn metrics; give a metrics.jsonl, a replay's timeline.jsonl or "
                        "report.json, a saved journal, or `journal`")
    # A journal holds both the service's timeline (JSON) and the turn_metrics lines: count turns once.
    return marked if marked else _from_records(records)
