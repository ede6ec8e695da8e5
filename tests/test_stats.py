"""Per-turn metrics lines and `appliance stats`: a replayed conversation on the real parts writes one
record per turn, and stats prints p50/p95 per metric from it."""

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.errors import UserError
from appliance.metrics import TurnMetrics, format_line, parse_line, read_turns
from appliance.stats import format_summary, summarise

from conftest import DEMO

ROOT = Path(__file__).resolve().parent.parent
LATENCIES = ("eot_to_first_token_ms", "first_token_to_first_audio_ms", "eot_to_first_audio_ms")


@pytest.fixture(scope="module")
def three_turns(tmp_path_factory, parts, embedded_cfg):
    """Three questions, each asked once the previous answer is over, replayed in real time through the
    whole pipeline on the real parts."""
    from appliance.replay import replay

    out = tmp_path_factory.mktemp("three")
    scenario = out / "three.yaml"
    ask = f"    say: {DEMO / 'question.wav'}\n    text: \"What is a rainbow?\"\n"
    scenario.write_text("events:\n  - at: 0.5\n" + ask + ("  - after: listening\n    delay: 0.5\n" + ask) * 2)
    parts.engine.forget()
    report = replay(scenario, out / "run", parts, embedded_cfg, max_seconds=150)
    return out / "run", report


def test_one_metrics_record_per_turn(three_turns):
    run, report = three_turns
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(report["turns"]) == 3
    assert [r["reply_id"] for r in records] == [t["reply_id"] for t in report["turns"]]
    for rec, turn in zip(records, report["turns"]):
        for k in LATENCIES + ("prefill_tokens", "generated_tokens", "interrupted"):
            assert rec[k] == turn[k], k
        assert rec["xruns"] == 0 and rec["barge_ins"] == 0 and "barge_in_ms" not in rec
        assert rec["ts"].endswith("+00:00")


def test_stats_prints_p50_p95_of_a_replayed_conversation(three_turns):
    run, report = three_turns
    r = subprocess.run([sys.executable, "-m", "appliance", "stats", str(run / "timeline.jsonl")],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"3 turns from {run / 'timeline.jsonl'} (0 interrupted)"
    assert lines[1].split() == ["metric", "n", "p50", "p95", "max", "unit"]
    table = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    for name in LATENCIES + ("prefill_tokens", "generated_tokens"):
        values = sorted(t[name] for t in report["turns"])
        # Linear interpolation between closest ranks: with 3 values p50 is the middle one and p95 lies
        # 90 % of the way from the middle one to the largest.
        p95 = values[1] + 0.9 * (values[2] - values[1])
        n, p50_s, p95_s, max_s, _unit = table[name]
        assert int(n) == 3
        assert float(p50_s) == pytest.approx(values[1], abs=0.051)
        assert float(p95_s) == pytest.approx(p95, abs=0.051)
        assert float(max_s) == pytest.approx(values[2], abs=0.051)
    # The same numbers from the metrics file and from report.json.
    for other in ("metrics.jsonl", "report.json"):
        s = summarise(read_turns(run / other))
        assert s["turns"] == 3
        assert s["metrics"]["eot_to_first_audio_ms"] == summarise(read_turns(run / "timeline.jsonl"))["metrics"]["eot_to_first_audio_ms"]


def test_barge_in_and_xruns_are_measured_per_turn():
    out = io.StringIO()
    # xruns of turn 1: 1 in turn_end (Conversation.turn_stats: the sound devices' count over the turn)
    m = TurnMetrics(stream=out, timestamps=False)
    events = [
        {"t": 1.0, "event": "vad_onset"},
        {"t": 4.0, "event": "interrupted", "onset_t": 4.0},
        {"t": 4.5, "event": "resumed"},  # a backchannel: the pause counts, the turn goes on
        {"t": 6.0, "event": "interrupted", "onset_t": 5.98},
        {"t": 6.0235, "event": "output_silent"},
        {"t": 7.0, "event": "turn_end", "reply_id": 1, "eot_to_first_token_ms": 250.0, "eot_to_first_audio_ms": 700.04,
         "first_token_to_first_audio_ms": 450.0, "prefill_tokens": 40, "generated_tokens": 12, "interrupted": True,
         "user_speech_ms": 900.0, "text": "It is", "xruns": 1, "output_latency_ms": 23.44},
        {"t": 9.0, "event": "turn_end", "reply_id": 2, "eot_to_first_token_ms": 200.0, "interrupted": False},
    ]
    for e in events:
        m(e)
    first, second = out.getvalue().splitlines()
    assert first == ("turn_metrics reply_id=1 eot_to_first_token_ms=250.0 first_token_to_first_audio_ms=450.0 "
                     "eot_to_first_audio_ms=700.0 prefill_tokens=40 generated_tokens=12 interrupted=true "
                     "barge_in_ms=43.5 barge_ins=2 xruns=1 user_speech_ms=900.0 output_latency_ms=23.4")
    assert second == "turn_metrics reply_id=2 eot_to_first_token_ms=200.0 interrupted=false barge_ins=0 xruns=0"
    assert parse_line("Nov 29 10:00:01 pi appliance[812]: " + first) == {
        "reply_id": 1, "eot_to_first_token_ms": 250.0, "first_token_to_first_audio_ms": 450.0,
        "eot_to_first_audio_ms": 700.0, "prefill_tokens": 40, "generated_tokens": 12, "interrupted": True,
        "barge_in_ms": 43.5, "barge_ins": 2, "xruns": 1, "user_speech_ms": 900.0, "output_latency_ms": 23.4}
    assert parse_line("INFO something else") is None


def test_no_timestamp_of_our_own_under_systemd(monkeypatch):
    record = {"t": 1.0, "event": "turn_end", "reply_id": 1, "eot_to_first_token_ms": 100.0}
    monkeypatch.setenv("INVOCATION_ID", "0123456789abcdef")
    out = io.StringIO()
    TurnMetrics(stream=out)(record)
    assert out.getvalue() == "turn_metrics reply_id=1 eot_to_first_token_ms=100.0 barge_ins=0 xruns=0\n"
    monkeypatch.delenv("INVOCATION_ID")
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    out = io.StringIO()
    TurnMetrics(stream=out)(record)
    stamp, rest = out.getvalue().split(" ", 1)
    assert rest.startswith("turn_metrics reply_id=1") and stamp[4] == "-" and "T" in stamp


def test_metrics_file_appends_and_rotates(tmp_path, monkeypatch):
    import appliance.metrics as metrics

    path = tmp_path / "state" / "metrics.jsonl"
    m = TurnMetrics(path, stream=None)
    for i in range(3):
        m({"t": float(i), "event": "turn_end", "reply_id": i + 1, "eot_to_first_audio_ms": 500.0 + i})
    assert [r["reply_id"] for r in read_turns(path)] == [1, 2, 3]
    monkeypatch.setattr(metrics, "ROTATE_BYTES", 10)
    m({"t": 4.0, "event": "turn_end", "reply_id": 4, "eot_to_first_audio_ms": 504.0})
    assert (tmp_path / "state" / "metrics.jsonl.1").is_file()
    assert [r["reply_id"] for r in read_turns(path)] == [1, 2, 3, 4]  # the rotated file is read first


def test_stats_from_a_saved_journal(tmp_path):
    lines = [f"Nov 29 10:00:{i:02d} pi appliance[812]: " + format_line(
        {"reply_id": i, "eot_to_first_audio_ms": float(100 * i), "interrupted": i == 10}) for i in range(1, 11)]
    dump = tmp_path / "journal.txt"
    dump.write_text("\n".join(["Nov 29 09:59:59 pi systemd[1]: Started appliance.service."] + lines) + "\n")
    s = summarise(read_turns(dump))
    m = s["metrics"]["eot_to_first_audio_ms"]
    assert (s["turns"], s["interrupted"], m["n"]) == (10, 1, 10)
    assert (m["p50"], m["p95"], m["max"]) == (550.0, 955.0, 1000.0)
    last5 = summarise(read_turns(dump), last=5)["metrics"]["eot_to_first_audio_ms"]
    assert (last5["n"], last5["p50"]) == (5, 800.0)
    table = format_summary(s, str(dump)).splitlines()
    assert table[0] == f"10 turns from {dump} (1 interrupted)"
    assert table[2].split() == ["eot_to_first_audio_ms", "10", "550.0", "955.0", "1000.0", "ms"]


def test_bad_sources_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="no such metrics file"):
        read_turns(tmp_path / "metrics.jsonl")
    cut = tmp_path / "cut.jsonl"
    cut.write_text('{"reply_id": 1, "eot_to_first_audio_ms": 5}\n{"reply_id": 2, "eot_')
    with pytest.raises(UserError, match="line 2 is not valid JSON"):
        read_turns(cut)
    r = subprocess.run([sys.executable, "-m", "appliance", "stats", str(tmp_path / "none.jsonl")],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {tmp_path / 'none.jsonl'}: no such metrics file")
    assert len(r.stderr.splitlines()) == 1


def test_a_journal_with_timeline_and_metrics_lines_counts_each_turn_once(tmp_path):
    """The service prints its timeline (JSON, turn_end included) and the turn_metrics lines to the journal."""
    turn_end = {"t": 3.0, "event": "turn_end", "reply_id": 1, "eot_to_first_audio_ms": 612.0}
    dump = tmp_path / "journal.txt"
    dump.write_text(json.dumps({"t": 0.1, "event": "state", "state": "listening"}) + "\n" + json.dumps(turn_end)
                    + "\n" + format_line({"reply_id": 1, "eot_to_first_audio_ms": 612.0}) + "\n")
    assert read_turns(dump) == [{"reply_id": 1, "eot_to_first_audio_ms": 612.0}]
    timeline_only = tmp_path / "timeline.jsonl"
    timeline_only.write_text(json.dumps(turn_end) + "\n")
    assert read_turns(timeline_only) == [{"reply_id": 1, "eot_to_first_audio_ms": 612.0, "barge_ins": 0, "xruns": 0}]
