"""Bad input gets one line naming the file and the fix, exit code 2, no traceback."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import DEMO

ROOT = Path(__file__).resolve().parent.parent


def appliance(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "appliance", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [l for l in r.stderr.splitlines() if l.strip() and "llama_kv_cache" not in l]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def test_missing_model_file(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("model:\n  gguf: /nonexistent/model.gguf\n  mmproj: null\n")
    r = appliance("replay", str(DEMO / "barge-in.yaml"), "--out", str(tmp_path / "o"), "--config", str(cfg))
    # doctor is told which config to check (it dropped --config, so doctor checked another file)
    one_line_error(r, "/nonexistent/model.gguf", f"model.gguf in {cfg}", "--embedded", f"`appliance doctor --config {cfg}`")


def test_wav_that_is_not_audio(tmp_path):
    bad = tmp_path / "question.wav"
    bad.write_text("this is not a wav file\n")
    r = appliance("replay", str(bad), "--out", str(tmp_path / "o"), "--embedded")
    one_line_error(r, str(bad), "not a readable audio file")


def test_empty_scenario(tmp_path):
    sc = tmp_path / "empty.yaml"
    sc.write_text("events: []\n")
    r = appliance("replay", str(sc), "--out", str(tmp_path / "o"), "--embedded")
    one_line_error(r, str(sc), "no events")


def test_scenario_with_missing_audio(tmp_path):
    sc = tmp_path / "s.yaml"
    sc.write_text("events:\n  - at: 0.5\n    say: q.wav\n  - at: 3.0\n    say: nowhere.wav\n    text: hi\n")
    (tmp_path / "q.wav").write_bytes((DEMO / "question.wav").read_bytes())
    r = appliance("replay", str(sc), "--out", str(tmp_path / "o"), "--embedded")
    # the scenario, the line of the `say:` at fault and the event's number, the file
    one_line_error(r, f"{sc}: line 5: event 2: ", "nowhere.wav", "not found")


@pytest.mark.parametrize("text, where", [
    ("events:\n  - at: 0.5\n    say: q.wav\n    txet: hi\n", "line 4: event 1: unknown key(s) ['txet']"),
    ("events:\n  - at: 0.5\n    say: q.wav\n    gain_db: loud\n", "line 4: event 1: `gain_db`"),
    ("events:\n  - at: 0.5\n    say: q.wav\n  - at: 1\n    say: q.wav\n    text: 5\n", "line 6: event 2: `text`"),
    ("events:\n  - at: 0.5\n    say: q.wav\nroom:\n  echo_gain_db: 0\n  rt6: 3\n", "line 6: room: unknown key(s)"),
    ("events:\n  - at: 0.5\n    say: q.wav\nroom:\n  rt60_ms: lots\n", "line 5: room.rt60_ms"),
])
def test_a_scenario_error_names_the_line_of_the_key_at_fault(tmp_path, text, where):
    """Not the line where the event starts: the fresh user looked for a bad `gain_db` on the `- at:` line."""
    from appliance.audio.room import Scenario
    from appliance.errors import UserError

    sc = tmp_path / "s.yaml"
    sc.write_text(text)
    (tmp_path / "q.wav").write_bytes((DEMO / "question.wav").read_bytes())
    with pytest.raises(UserError) as e:
        Scenario.load(sc)
    assert str(e.value).startswith(f"{sc}: {where}"), str(e.value)


def test_text_only_model_needs_transcripts(tmp_path):
    sc = tmp_path / "s.yaml"
    sc.write_text(f"events:\n  - at: 0.5\n    say: {DEMO / 'question.wav'}\n")
    r = appliance("replay", str(sc), "--out", str(tmp_path / "o"), "--embedded")
    one_line_error(r, str(sc), "text:")


def test_config_key_of_wrong_type(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("vad:\n  threshold: 0.5\n  min_silence_ms: lots\n")
    r = appliance("check-config", str(cfg))
    line = one_line_error(r, str(cfg), "line 3", "vad.min_silence_ms", "'lots'")


def test_config_unknown_key_suggests(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("vad:\n  treshold: 0.6\n")
    r = appliance("check-config", str(cfg))
    one_line_error(r, "line 2", "vad.treshold", "did you mean 'threshold'")


def test_config_invalid_yaml(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("vad:\n  threshold: [0.5\n")
    r = appliance("check-config", str(cfg))
    one_line_error(r, str(cfg), "invalid YAML")


def test_config_reports_every_problem_at_once(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("vad:\n  threshold: 2\naudio:\n  outptu: x\n")
    line = one_line_error(appliance("check-config", str(cfg)))
    assert "vad.threshold" in line and "audio.outptu" in line


def test_shipped_config_is_valid():
    r = appliance("check-config", str(ROOT / "config.yaml"))
    assert r.returncode == 0, r.stderr


def test_run_refuses_a_text_only_model(tmp_path):
    r = appliance("run", "--embedded")
    # (it said "set model.mmproj", with no config file in use to set it in)
    one_line_error(r, "--embedded", "text-only", "--config FILE", "appliance replay")


def test_say_writes_a_wav(tmp_path):
    out = tmp_path / "hello.wav"
    r = appliance("say", "Hello from the appliance.", "--out", str(out), "--embedded")
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 20000
    assert "note" not in r.stderr


def test_embedded_with_a_config_says_what_it_replaces(tmp_path):
    """``--config F --embedded`` used F's other sections with the embedded model and voice, and said nothing."""
    cfg = tmp_path / "mine.yaml"
    cfg.write_text("vad:\n  threshold: 0.6\n")
    r = appliance("say", "Hello.", "--out", str(tmp_path / "h.wav"), "--config", str(cfg), "--embedded")
    assert r.returncode == 0, r.stderr
    assert f"--config {cfg}" in r.stderr and "replaced by the embedded defaults" in r.stderr


def test_say_into_a_missing_folder(tmp_path):
    out = tmp_path / "nowhere" / "hello.wav"
    r = appliance("say", "Hello.", "--out", str(out), "--embedded")
    one_line_error(r, str(out), "cannot write the WAV file", "folder")


def test_replay_to_an_unwritable_folder_fails_before_loading_models(tmp_path):
    r = appliance("replay", str(DEMO / "barge-in.yaml"), "--out", "/proc/appliance-out", "--embedded")
    one_line_error(r, "/proc/appliance-out", "cannot create the output directory")


def test_replay_out_naming_a_file_says_a_directory_is_needed(tmp_path):
    """A fresh user's --out named an existing file: the error said "(File exists)" and not what --out must be."""
    f = tmp_path / "notes.txt"
    f.write_text("keep me\n")
    r = appliance("replay", str(DEMO / "barge-in.yaml"), "--out", str(f), "--embedded")
    one_line_error(r, str(f), "is a file, not a directory", "give --out a directory")
    assert f.read_text() == "keep me\n"


def test_embedded_with_a_broken_config_gives_its_error_alone(tmp_path):
    """A fresh user's ``--embedded --config F`` with F not valid YAML printed the note about what the embedded
    defaults replace in F before F's error: two lines, one of them about a config never loaded."""
    cfg = tmp_path / "broken.yaml"
    cfg.write_text("vad: [threshold: 0.6\n")
    r = appliance("replay", str(DEMO / "barge-in.yaml"), "--out", str(tmp_path / "o"), "--config", str(cfg),
                  "--embedded")
    one_line_error(r, str(cfg), "invalid YAML")


def test_wav_input_to_a_text_only_model_asks_for_a_transcript(tmp_path):
    r = appliance("replay", str(DEMO / "question.wav"), "--out", str(tmp_path / "o"), "--embedded")
    one_line_error(r, "question.wav", "--transcript")


def test_stats_with_no_source_and_no_config_anywhere(tmp_path):
    """Outside a checkout, on a machine that is not the appliance (no /etc/appliance/config.yaml), `stats` told
    the fresh user that config.yaml was not found; it reads the default place or the journal instead."""
    if Path("/etc/appliance/config.yaml").exists():
        pytest.skip("this machine has the appliance's config")
    r = appliance("stats", cwd=tmp_path)
    assert r.returncode == 0 and "config" not in r.stderr, (r.stdout, r.stderr)
    assert re.search(r"\d+ turns? from", r.stdout), r.stdout
    assert "/var/lib/appliance/state/metrics.jsonl" in r.stderr or "journal" not in r.stdout  # where it looked first


def test_stats_on_a_file_that_holds_no_turns(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("hello\nworld\n")
    r = appliance("stats", str(bad))
    one_line_error(r, str(bad), "no turn metrics")


def test_fast_replay_finishes_the_same_conversation(tmp_path):
    r = appliance("replay", str(DEMO / "barge-in.yaml"), "--out", str(tmp_path / "o"), "--embedded", "--fast", "--quiet")
    assert r.returncode == 0, r.stderr
    import json
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert not report["timed_out"]
    # the summary leaves out the per-turn latencies, which are meaningless here (it printed "first token 0.0 ms")
    assert "turn 1: answered" in r.stdout and "first token" not in r.stdout, r.stdout
    states = report["states"]
    assert states[:5] == ["listening", "thinking", "speaking", "interrupted", "listening"]
    assert states[-1] == "listening"
    # its latencies are in simulated time: `stats` on its output says so (it printed 0 ms without a word)
    s = appliance("stats", str(tmp_path / "o"))
    assert s.returncode == 0 and re.search(r"\d+ turns? from", s.stdout), (s.stdout, s.stderr)
    assert "--fast" in s.stderr and "not measured" in s.stderr


def test_a_missing_model_names_the_config_file_given_and_leaves_no_empty_output(tmp_path):
    cfg = tmp_path / "mine.yaml"
    cfg.write_text("model:\n  gguf: /nonexistent/model.gguf\n  mmproj: /nonexistent/mmproj.gguf\n")
    out = tmp_path / "out"
    r = appliance("replay", str(DEMO / "barge-in.yaml"), "--out", str(out), "--fast", "--config", str(cfg))
    one_line_error(r, "/nonexistent/model.gguf", str(cfg))
    assert not out.exists()


@pytest.mark.parametrize("bench", ["interruption", "engine"])
def test_bench_json_path_is_checked_before_measuring(tmp_path, bench):
    """A bad --json path fails at once, not after minutes of measuring."""
    r = appliance("bench", bench, "--embedded", "--json", str(tmp_path / "missing-dir" / "x.json"))
    one_line_error(r, "missing-dir", "does not exist")
    r = appliance("bench", bench, "--embedded", "--json", str(tmp_path))
    one_line_error(r, str(tmp_path), "is a directory")
    # access() says "writable" to root in /proc: found by a fresh user, after a whole run of measuring
    r = appliance("bench", bench, "--embedded", "--json", "/proc/appliance-bench.json")
    one_line_error(r, "/proc/appliance-bench.json", "cannot write it")


def test_replay_of_a_directory_says_so(tmp_path):
    r = appliance("replay", str(tmp_path), "--out", str(tmp_path / "o"), "--embedded")
    one_line_error(r, str(tmp_path), "is a directory")


def test_devices_and_doctor_name_the_config_file_given(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("vad:\n  threshold: [1\n")
    r = appliance("devices", "--config", str(broken))
    assert r.returncode == 2 and "Traceback" not in r.stderr  # a listing still lists ...
    assert r.stderr.startswith("error: ") and str(broken) in r.stderr  # ... but says the config is broken
    absent = tmp_path / "absent.yaml"
    absent.write_text("audio:\n  input: No Such Microphone XYZ\n")
    r = appliance("devices", "--config", str(absent))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "error:" not in r.stdout
    assert "No Such Microphone XYZ" in r.stderr
    # (with no sound devices at all, the fix is to connect one, not to rename: test_devices.py)
    assert f"set audio.input in {absent}" in r.stderr or "connect the USB sound card" in r.stderr, r.stderr
    mine = tmp_path / "mine.yaml"
    mine.write_text("model:\n  gguf: /nonexistent/model.gguf\n")
    r = appliance("doctor", "--config", str(mine))
    assert f"set model.gguf in {mine}" in r.stdout and "in config.yaml" not in r.stdout


def test_a_replay_stopped_halfway_leaves_no_files_of_an_earlier_run(tmp_path):
    """Found by a fresh user: Ctrl-C during a replay into a used directory left the new partial timeline
    next to the previous run's reply.wav and report.json. And by the next (session 12): it exited 130
    without a word, its timeline ended in an ordinary-looking ``replay_end``, and the reply so far was not
    kept. Now the timeline says it was cut short, ``reply.wav`` is this run's reply up to then, and one line
    says where."""
    import json
    import signal
    import time

    out = tmp_path / "o"
    out.mkdir()
    for name in ("reply.wav", "report.json"):
        (out / name).write_text("from an earlier run\n")
    # (SIGINT back to its default in the child: a shell that starts the suite in the background ignores it,
    # and an ignored SIGINT is inherited, so the replay would not see the Ctrl-C at all)
    p = subprocess.Popen([sys.executable, "-m", "appliance", "replay", str(DEMO / "barge-in.yaml"), "--out", str(out),
                          "--embedded", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        if (out / "timeline.jsonl").exists() and (out / "timeline.jsonl").stat().st_size > 0:
            break
        time.sleep(0.1)
    assert p.poll() is None, "the replay ended before it could be stopped"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in err, err
    assert "replay stopped (Ctrl-C)" in err and str(out / "reply.wav") in err
    assert not (out / "report.json").exists()
    assert (out / "reply.wav").read_bytes()[:4] == b"RIFF"  # this run's, not the earlier run's text
    last = json.loads((out / "timeline.jsonl").read_text().splitlines()[-1])
    assert last["event"] == "replay_end" and "Ctrl-C" in last["stopped"]


def test_a_scenario_of_noises_only_is_replayed_without_an_answer(tmp_path):
    """Every event marked ``speech: false`` (a doorbell alone): no answer is expected, so the replay ends with
    exit 0, not with the "no speech was heard" error meant for a recording that should have been answered."""
    import numpy as np

    from appliance.audio.files import write_wav

    t = np.arange(8000) / 16000
    write_wav(tmp_path / "bell.wav", (0.3 * np.sin(2 * np.pi * 880 * t) * np.exp(-4 * t)).astype(np.float32), 16000)
    scenario = tmp_path / "bell.yaml"
    scenario.write_text("events:\n  - at: 0.3\n    say: bell.wav\n    speech: false\n")
    r = appliance("replay", str(scenario), "--out", str(tmp_path / "o"), "--embedded", "--fast")
    assert r.returncode == 0 and "error" not in r.stderr, r.stderr
    assert (tmp_path / "o" / "timeline.jsonl").is_file()
    speech = tmp_path / "speech.yaml"  # the same with a spoken event that is never heard still says so
    speech.write_text("events:\n  - at: 0.3\n    say: bell.wav\n    text: \"ding\"\n")
    r = appliance("replay", str(speech), "--out", str(tmp_path / "o2"), "--embedded", "--fast")
    assert r.returncode == 2 and "no speech was heard" in r.stderr, r.stderr


def test_bench_room_options_need_the_jack_room():
    """--drift-ppm, --speaker, --path-change-s and --echo-only describe the JACK room: the simulated room refuses
    them at once (one clock, a linear speaker) instead of measuring something else; a path change before the start
    is refused too."""
    r = appliance("bench", "interruption", "--embedded", "--drift-ppm", "300")
    one_line_error(r, "--room jack")
    r = appliance("bench", "interruption", "--embedded", "--path-change-s", "60")
    one_line_error(r, "--room jack")
    r = appliance("bench", "interruption", "--room", "jack", "--embedded", "--path-change-s", "-1")
    one_line_error(r, "--path-change-s must be 0 or more seconds")


def test_say_out_to_a_directory_or_an_odd_name_is_no_traceback(tmp_path):
    """``appliance say --out DIR`` gave soundfile's TypeError as a traceback (the fresh user): a directory is a
    one-line error, and any other name gets a WAV."""
    import soundfile as sf

    from appliance.audio.files import write_wav
    from appliance.errors import UserError

    with pytest.raises(UserError, match="is a directory; give a file name"):
        write_wav(tmp_path, np.zeros(160, np.float32), 16000)
    write_wav(tmp_path / "x.txt", np.full(160, 0.5, np.float32), 16000)
    audio, rate = sf.read(str(tmp_path / "x.txt"))
    assert rate == 16000 and len(audio) == 160 and abs(audio[0] - 0.5) < 1e-3


def test_a_truncated_wav_is_read_with_a_warning_that_says_so(tmp_path, caplog):
    """libsndfile reads a WAV cut short without a word: the fresh user's half-copied question played as
    0.5 s of 0.9 with no hint. Now a warning names the file, what is missing and the fix."""
    from appliance.audio.files import load_audio

    whole = (DEMO / "question.wav").read_bytes()
    cut = tmp_path / "cut.wav"
    cut.write_bytes(whole[: len(whole) // 2])
    with caplog.at_level("WARNING"):
        assert len(load_audio(DEMO / "question.wav")) > 0
        assert not caplog.records
        got = load_audio(cut)
    assert 0 < len(got) < len(load_audio(DEMO / "question.wav"))
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [str(cut)]
    assert "truncated" in caplog.records[0].getMessage()


def test_a_truncated_wav_replayed_is_warned_about_once(tmp_path):
    """The replay read its input twice (once to fail fast before loading the models), so the fresh user saw
    the truncation warning twice."""
    whole = (DEMO / "question.wav").read_bytes()
    cut = tmp_path / "cut.wav"
    cut.write_bytes(whole[: len(whole) // 2])
    r = appliance("replay", str(cut), "--transcript", "What is a rainbow?", "--out", str(tmp_path / "o"),
                  "--embedded", "--fast", "--quiet")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("more bytes of audio than the file holds") == 1, r.stderr


@pytest.mark.parametrize("argv", [["check-config"], ["say", "Hello.", "--out", "h.wav"]])
def test_no_config_anywhere_names_both_places(tmp_path, argv):
    """Run with no config in /etc/appliance or the working directory, a command said only "config.yaml: config
    file not found", not that /etc/appliance/config.yaml was tried first, nor the ways out."""
    if Path("/etc/appliance/config.yaml").exists():
        pytest.skip("this machine has the appliance's config")
    r = appliance(*argv, cwd=tmp_path)
    line = one_line_error(r, "/etc/appliance/config.yaml", "./config.yaml")
    assert "check-config FILE" in line if argv[0] == "check-config" else "--config FILE" in line


def test_a_reader_that_goes_away_is_no_traceback():
    """`appliance check-config | head -1` printed a BrokenPipeError traceback when head left before the note."""
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the command writes a byte
    proc = subprocess.run([sys.executable, "-m", "appliance", "check-config", str(ROOT / "config.yaml")],
                          stdout=w, stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(w)
    assert proc.returncode == 141 and "Traceback" not in proc.stderr, proc.stderr

