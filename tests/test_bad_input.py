"""Hostile and broken files, through the real command line: each gets one line on stderr naming the file,
exit 2, no traceback, within 10 s and 500 MB (the child's own peak RSS, VmHWM).

Classes: config (check-config), scenario and audio (replay, which reads its input before loading any
model), model (replay with a config naming bad model files: the real llama.cpp and mtmd loaders), stats.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "tiny_gemma4"
GGUF, MMPROJ = FIX / "tiny-gemma4.gguf", FIX / "tiny-gemma4-mmproj.gguf"
QUESTION = ROOT / "demo" / "question.wav"
LIMIT_S, LIMIT_MB = 10.0, 500.0

BOMB = "\n".join([f'l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'] + [
    f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 10)]) + "\n"
DEEP = "[" * 5000 + "]" * 5000


def _hwm_kb(pid: int) -> int:
    """The process's peak resident set so far (``VmHWM`` in /proc/PID/status), KB; 0 once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_cli(args: list[str], cwd: Path) -> tuple[int, str, float, float]:
    """``python -m appliance ARGS``: (exit code, stderr, seconds, peak RSS of the child in MB).

    The peak is the child's own ``VmHWM``, polled every 5 ms until it exits: ``wait4``'s ``ru_maxrss``
    also counts the pytest process the child was forked from (Linux keeps the high-water mark across
    ``exec``), and read 611 MB for a 50 MB program once other tests had loaded models here."""
    err = cwd / "stderr.txt"
    t0 = time.monotonic()
    peak_kb = 0
    with open(err, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "appliance", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=fh, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        deadline = t0 + 60
        while True:
            peak_kb = max(peak_kb, _hwm_kb(proc.pid))
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.005)
        proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, err.read_text(), time.monotonic() - t0, (peak_kb or usage.ru_maxrss) / 1024.0


def _config(tmp: Path, text: str) -> Path:
    p = tmp / "config.yaml"
    p.write_text(text)
    return p


def _scenario(tmp: Path, text: str | bytes) -> Path:
    p = tmp / "scenario.yaml"
    (p.write_bytes if isinstance(text, bytes) else p.write_text)(text)
    return p


def _fifo(tmp: Path, name: str) -> Path:
    p = tmp / name
    os.mkfifo(p)
    return p


def _wav(tmp: Path, name: str, audio: np.ndarray, rate: int = 16000, subtype: str = "FLOAT") -> Path:
    p = tmp / name
    sf.write(str(p), audio, rate, subtype=subtype)
    return p


def _models(tmp: Path, gguf, mmproj) -> Path:
    return _config(tmp, f"model:\n  gguf: {gguf}\n  mmproj: {mmproj}\n  n_ctx: 2048\n"
                        f"  history_budget_tokens: 512\n  max_reply_tokens: 16\n"
                        f"gpio:\n  enabled: false\nstorage:\n  state_dir: {tmp / 'state'}\n  persist_history: false\n")


def _replay(path: Path, tmp: Path, *extra) -> list[str]:
    return ["replay", str(path), "--out", str(tmp / "out"), "--fast", "--quiet", *extra]


def _nan_wav(tmp):
    audio = np.zeros(16000, np.float32)
    audio[100:200] = np.nan
    audio[300] = np.inf
    return _wav(tmp, "nan.wav", audio)


# (id, build(tmp) -> (argv, the file the error must name), words the line must hold)
CASES = [
    # config
    ("config-deep-nesting", lambda t: (["check-config", str(p := _config(t, "model: " + DEEP + "\n"))], p),
     "nested deeper than 32"),
    ("config-alias-bomb", lambda t: (["check-config", str(p := _config(t, BOMB))], p), "anchors and aliases"),
    ("config-duplicate-key", lambda t: (["check-config", str(p := _config(t, "vad:\n  threshold: 0.5\n  threshold: 0.6\n"))], p),
     "duplicate key"),
    ("config-huge", lambda t: (["check-config", str(p := _config(t, "# x\n" * 200_000))], p), "too large"),
    ("config-huge-number", lambda t: (["check-config", str(p := _config(t, "vad:\n  threshold: " + "9" * 200_000 + "\n"))], p),
     "cannot parse it (ValueError: Exceeds the limit"),
    ("config-huge-text", lambda t: (["check-config", str(p := _config(t, "vad:\n  threshold: " + "x" * 200_000 + "\n"))], p),
     "vad.threshold: expected a number, found 'xxx"),
    ("config-not-utf8", lambda t: (["check-config", str(p := t / "c.yaml")], p.write_bytes(b"vad:\n  x: \xff\n") and p),
     "not UTF-8"),
    ("config-fifo", lambda t: (["check-config", str(p := _fifo(t, "fifo.yaml"))], p), "not a regular file"),
    ("config-context-too-small", lambda t: (["check-config", str(p := _config(
        t, f"model:\n  gguf: {GGUF}\n  mmproj: {MMPROJ}\n  n_ctx: 2048\n  history_budget_tokens: 1024\n"))], p),
     "model.n_ctx: 2048 tokens cannot hold"),
    ("config-projector-as-model", lambda t: (["check-config", str(p := _config(
        t, f"model:\n  gguf: {MMPROJ}\n  mmproj: {MMPROJ}\n"))], p), "is an audio projector"),
    ("config-prompt-too-long", lambda t: (["check-config", str(p := _config(
        t, f"model:\n  gguf: {GGUF}\n  mmproj: {MMPROJ}\n  system_prompt: '{'Be brief. ' * 900}'\n"))], p),
     "model.system_prompt:"),
    # scenario (read before any model is loaded)
    ("scenario-deep-nesting", lambda t: (_replay(p := _scenario(t, "events: " + DEEP + "\n"), t, "--embedded"), p),
     "nested deeper than 32"),
    ("scenario-alias-bomb", lambda t: (_replay(p := _scenario(t, BOMB), t, "--embedded"), p), "anchors and aliases"),
    ("scenario-duplicate-key", lambda t: (_replay(p := _scenario(
        t, f"events:\n  - at: 0.5\n    at: 1.0\n    say: {QUESTION}\n    text: hi\n"), t, "--embedded"), p),
     "line 3: duplicate key `at` in event 1 (also at line 2)"),
    ("scenario-not-utf8", lambda t: (_replay(p := _scenario(t, b"events:\n  - say: caf\xe9.wav\n"), t, "--embedded"), p),
     "iconv"),
    # it was silently ignored (the scenario's own text: was used)
    ("scenario-with-transcript", lambda t: (_replay(p := _scenario(
        t, f"events:\n  - at: 0.5\n    say: {QUESTION}\n    text: hi\n"), t, "--embedded", "--transcript", "hi"), p),
     "--transcript is for a WAV input"),
    # it waited the full 180 s, then blamed the audio
    ("scenario-first-event-after-speaking", lambda t: (_replay(p := _scenario(
        t, f"events:\n  - after: speaking\n    say: {QUESTION}\n    text: hi\n"), t, "--embedded"), p),
     "line 2: event 1: `after: speaking` can never fire"),
    ("scenario-after-thinking-behind-a-noise", lambda t: (_replay(p := _scenario(
        t, f"events:\n  - at: 0.5\n    say: {QUESTION}\n    speech: false\n"
           f"  - after: thinking\n    say: {QUESTION}\n    text: hi\n"), t, "--embedded"), p),
     "line 5: event 2: `after: thinking` can never fire"),
    ("scenario-rt60-and-impulse-response", lambda t: (_replay(p := _scenario(
        t, f"events:\n  - at: 0.5\n    say: {QUESTION}\n    text: hi\nroom:\n  rt60_ms: 150\n"
           f"  impulse_response: {QUESTION}\n"), t, "--embedded"), p), "line 6: room: give either rt60_ms"),
    ("scenario-fifo", lambda t: (_replay(p := _fifo(t, "s.yaml"), t, "--embedded"), p), "not a regular file"),
    # audio
    ("audio-nan-inf", lambda t: (_replay(p := _nan_wav(t), t, "--embedded", "--transcript", "hi"), p), "NaN or infinite"),
    ("audio-no-speech", lambda t: (_replay(p := _wav(t, "silence.wav", np.zeros(32000, np.float32), subtype="PCM_16"),
                                           t, "--embedded", "--transcript", "hi"), p), "no speech"),
    # speech that starts after the 180 s a replay reads was reported as "holds no speech"
    ("audio-speech-after-180-s", lambda t: (_replay(p := _wav(t, "long.wav", np.concatenate([
        np.zeros(16000 * 185, np.float32), 0.3 * np.sin(np.arange(16000) / 16000 * 2 * np.pi * 300)]).astype(np.float32),
        subtype="PCM_16"), t, "--embedded", "--transcript", "hi"), p), "at most the first 180 s"),
    ("audio-fifo", lambda t: (_replay(p := _fifo(t, "a.wav"), t, "--embedded", "--transcript", "hi"), p),
     "not a regular file"),
    ("audio-not-audio", lambda t: (_replay(p := t / "x.wav", t, "--embedded", "--transcript", "hi"),
                                   p.write_text("hello") and p), "not a readable audio file"),
    ("audio-empty-file", lambda t: (_replay(p := t / "empty.wav", t, "--embedded", "--transcript", "hi"),
                                    p.write_bytes(b"") or p), "is empty (0 bytes)"),
    # model (the real loaders)
    ("model-projector-as-model", lambda t: (_replay(QUESTION, t, "--config", str(_models(t, MMPROJ, MMPROJ))), MMPROJ),
     "is an audio projector"),
    ("model-text-model-as-projector", lambda t: (_replay(QUESTION, t, "--config", str(_models(t, GGUF, GGUF))), GGUF),
     "projector"),
    ("model-truncated-projector", lambda t: (_replay(QUESTION, t, "--config", str(_models(
        t, GGUF, p := t / "cut-mmproj.gguf"))), p.write_bytes(MMPROJ.read_bytes()[: MMPROJ.stat().st_size // 2]) and p),
     "projector"),
    ("model-not-a-gguf", lambda t: (_replay(QUESTION, t, "--config", str(_models(t, p := t / "m.gguf", MMPROJ))),
                                    p.write_text("not a model") and p), "could not load"),
    # llama.cpp's reason came cut mid-word: "(… llama_model_load_from_file_impl: failed to l)"
    ("model-empty-gguf", lambda t: (_replay(QUESTION, t, "--config", str(_models(t, p := t / "e.gguf", MMPROJ))),
                                    p.write_bytes(b"") or p), "the file is empty (0 bytes)"),
    ("model-empty-projector", lambda t: (_replay(QUESTION, t, "--config", str(_models(t, GGUF, p := t / "e-mmproj.gguf"))),
                                         p.write_bytes(b"") or p), "the file is empty (0 bytes)"),
    # it said "audio projector (mmproj) not found" of a directory that is there
    ("model-projector-a-directory", lambda t: (_replay(QUESTION, t, "--config", str(_models(t, GGUF, p := t / "mmdir"))),
                                               p.mkdir() or p), "is not a regular file"),
    # stats
    # it said "cannot read it (UnicodeDecodeError); check the path and its permissions"
    ("stats-a-wav", lambda t: (["stats", str(QUESTION)], QUESTION), "give a metrics.jsonl, a replay's timeline.jsonl"),
    ("stats-turns-a-number", lambda t: (["stats", str(p := t / "report.json")], p.write_text(json.dumps({"turns": 5})) and p),
     "`turns` is not a list"),
    ("stats-turns-a-string", lambda t: (["stats", str(p := t / "report.json")], p.write_text('{"turns": "many"}') and p),
     "`turns` is not a list"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_one_line_and_exit_2_quickly(tmp_path, case):
    name, build, words = case
    argv, named = build(tmp_path)
    rc, stderr, seconds, rss_mb = run_cli(argv, tmp_path)
    lines = stderr.splitlines()
    assert rc == 2, (rc, stderr[-2000:])
    assert "Traceback" not in stderr, stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-2000:]
    assert str(named) in lines[0], lines[0]
    assert words in lines[0], lines[0]
    assert len(lines[0]) <= 800, len(lines[0])
    assert seconds <= LIMIT_S, f"{name}: {seconds:.1f} s"
    assert rss_mb <= LIMIT_MB, f"{name}: {rss_mb:.0f} MB"


def test_a_one_hour_wav_is_streamed_not_loaded(tmp_path):
    """A replay hears at most 180 s: a one-hour 48 kHz stereo file costs no more than that (the whole file
    as float32 would be 1.4 GB)."""
    path = tmp_path / "hour.wav"
    block = (np.random.default_rng(0).standard_normal((48000 * 60, 2)) * 3000).astype(np.int16)
    with sf.SoundFile(str(path), "w", 48000, 2, subtype="PCM_16") as f:
        for _ in range(60):
            f.write(block)
    code = ("import resource, sys, numpy, soundfile, soxr; from appliance.audio.files import load_audio; "
            "peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024; base = peak(); "
            f"a = load_audio({str(path)!r}); "
            "print(len(a), base, peak())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    n, base_mb, peak_mb = map(int, out.stdout.split())
    assert n == 180 * 16000
    # 180 s of 48 kHz mono float32 is 35 MB, read in blocks, then concatenated and resampled.
    assert peak_mb - base_mb <= 150, (base_mb, peak_mb)


def _cli_in(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m appliance ARGS`` run from ``cwd`` (this checkout's package, whatever the directory)."""
    return subprocess.run([sys.executable, "-m", "appliance", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_run_without_a_config_offers_only_fixes_run_takes(tmp_path):
    """`appliance run` with no config anywhere offered --embedded, which run then refuses (text-only model)."""
    if Path("/etc/appliance/config.yaml").exists():
        pytest.skip("this machine has /etc/appliance/config.yaml")
    r = _cli_in(tmp_path, "run")
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "no config file" in lines[0] and "--config FILE" in lines[0], lines[0]
    assert "--embedded" not in lines[0], lines[0]


@pytest.mark.parametrize("where", ["wav", "say", "noise"])
def test_replay_refuses_to_overwrite_its_own_input(tmp_path, where):
    """A WAV given as DIR/reply.wav with --out DIR (or a scenario's say: or noise: file there) was replaced by
    the reply: refused in one line, before anything in DIR is touched."""
    out = tmp_path / "out"
    out.mkdir()
    victim = out / "reply.wav"
    victim.write_bytes(QUESTION.read_bytes())
    (out / "report.json").write_text("{}\n")  # an earlier run's report: kept too
    if where == "wav":
        argv, named = _replay(victim, tmp_path, "--embedded", "--transcript", "What is a rainbow?"), victim
    else:
        line = "  - at: 0.5\n    say: out/reply.wav\n    text: hi\n" if where == "say" else \
            f"  - at: 0.5\n    say: {QUESTION}\n    text: hi\nroom:\n  noise: out/reply.wav\n"
        argv, named = _replay(_scenario(tmp_path, "events:\n" + line), tmp_path, "--embedded"), "out/reply.wav"
    rc, stderr, _, _ = run_cli(argv, tmp_path)
    lines = stderr.splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert str(named) in lines[0] and "overwrite" in lines[0] and "--out" in lines[0], lines[0]
    assert victim.read_bytes() == QUESTION.read_bytes()
    assert (out / "report.json").read_text() == "{}\n"


def test_clipped_speech_is_not_told_to_be_louder(tmp_path):
    """question.wav x20 (about 30 % of its samples at full scale): the VAD rejects each onset as too short, and
    the error said "louder if need be". It names the clipping instead (the real VAD, --fast)."""
    audio, rate = sf.read(str(QUESTION), dtype="float32")
    loud = _wav(tmp_path, "loud20.wav", np.clip(audio * 20, -1.0, 1.0), rate, subtype="PCM_16")
    rc, stderr, _, _ = run_cli(_replay(loud, tmp_path, "--embedded", "--transcript", "What is a rainbow?"), tmp_path)
    lines = stderr.splitlines()
    assert rc == 2 and "Traceback" not in stderr, stderr
    assert len(lines) == 1 and str(loud) in lines[0], stderr
    assert "clipped" in lines[0] and "lower level" in lines[0] and "louder" not in lines[0], lines[0]


def test_unheard_fix_names_short_fragments_when_not_clipped():
    """Not clipped, yet only fragments under vad.min_speech_ms were heard: said so, with their lengths."""
    from appliance.audio.room import Scenario, ScriptedUtterance
    from appliance.replay import unheard_fix

    audio, _ = sf.read(str(QUESTION), dtype="float32")
    scenario = Scenario([ScriptedUtterance(audio, "hi", "q", at=0.5)])
    fix = unheard_fix(scenario, [128.0, 96.0])
    assert "2 short fragment(s) (128, 96 ms)" in fix and "clipped" not in fix, fix
    assert unheard_fix(scenario, []) == "give a recording of someone speaking, louder if need be"


MANY = ("model:\n  n_ctx: 512\n"                   # valid on its own; too small for the history (cross-field)
        "listen:\n  mode: wakeword\n"             # line 4
        "vad:\n  threshold: -1\n"                 # line 6
        "gpio:\n  enabled: true\n  led_kind: rgb\n  rgb_pins: [5, 6]\n"  # line 10
        "audio:\n  input: 7\n"                    # line 12
        "  output: 8\n"                            # line 13
        "storage:\n  state_dir: 5\n")             # line 15


def test_check_config_lists_every_problem_with_its_line(tmp_path):
    """It showed 4 problems, then "and 2 more, at assistant.timezone, audio.input" with no lines, and the
    cross-field checks only once those were fixed: now one line per problem, with the n_ctx check too (its
    fields, in `model`, are valid)."""
    p = _config(tmp_path, MANY)
    rc, stderr, _, _ = run_cli(["check-config", str(p)], tmp_path)
    lines = stderr.splitlines()
    assert rc == 2 and "Traceback" not in stderr, stderr
    for line_no, key in [(2, "model.n_ctx"), (4, "listen.mode"), (6, "vad.threshold"), (10, "gpio.rgb_pins"),
                         (12, "audio.input"), (13, "audio.output"), (15, "storage.state_dir")]:
        assert any(l.startswith(f"error: {p}: line {line_no}: {key}: ") for l in lines), (key, stderr)
    assert lines[-1] == f"{p}: 7 problems; fix them, then run `appliance check-config {p}`", lines[-1]


def test_two_model_file_problems_are_both_listed(tmp_path):
    """Model and projector swapped: both named, each with its line (it said only "and 1 more, at model.mmproj")."""
    p = _config(tmp_path, f"model:\n  gguf: {MMPROJ}\n  mmproj: {GGUF}\n")
    rc, stderr, _, _ = run_cli(["check-config", str(p)], tmp_path)
    lines = stderr.splitlines()
    assert rc == 2 and len(lines) == 3, stderr
    assert lines[0].startswith(f"error: {p}: line 2: model.gguf: ") and "is an audio projector" in lines[0], lines
    assert lines[1].startswith(f"error: {p}: line 3: model.mmproj: "), lines


def test_a_replay_with_many_config_problems_names_the_rest_by_line(tmp_path):
    """A replay's error stays one line; the problems it cannot show in full are named by line and key."""
    p = _config(tmp_path, MANY)
    rc, stderr, _, _ = run_cli(_replay(QUESTION, tmp_path, "--config", str(p)), tmp_path)
    lines = stderr.splitlines()
    assert rc == 2 and len(lines) == 1, stderr
    assert "line 15 storage.state_dir" in lines[0] and lines[0].endswith(f"`appliance check-config {p}`)"), lines[0]
