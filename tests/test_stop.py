"""Stop means stop, on real parts: the bundled demo (its "Wait, stop." over the reply) and the same question
interrupted by "Wait, what about the moon?" (Piper's Joe), replayed through the simulated room with real
Silero, the real PocketSphinx classifier, real Piper and the embedded Gemma 3 270M.

Unpaced (``--fast``): the VAD and the classifier decide on the audio's own time, as in real time.
"""

import json

import numpy as np

from appliance.audio.files import MODEL_RATE, load_audio, write_wav
from appliance.conversation import CUT_MARK
from appliance.replay import replay

from conftest import DEMO


def run(tmp_path, scenario, parts, cfg):
    parts.engine.forget()
    out = tmp_path / "out"
    report = replay(scenario, out, parts, cfg, paced=False)
    records = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    return report, records, load_audio(out / "reply.wav")


def events(records, name):
    return [r for r in records if r["event"] == name]


def test_wait_stop_leaves_it_silent_and_listening(tmp_path, parts, embedded_cfg):
    report, records, output = run(tmp_path, DEMO / "barge-in.yaml", parts, embedded_cfg)
    (flushed,) = events(records, "flushed")
    (held,) = events(records, "held")
    assert held["stop_command"], held
    (stopped,) = events(records, "stopped")
    assert stopped["t"] > flushed["t"]
    # One turn only (the question), no reply to "Wait, stop.": never thinking again, silent to the end.
    assert [r["state"] for r in events(records, "state")].count("thinking") == 1
    assert len(report["turns"]) == 1 and report["turns"][0]["interrupted"]
    assert report["states"][-1] == "listening" and not report["timed_out"]
    after = output[int((flushed["t"] + 0.1) * MODEL_RATE):]
    assert len(after) > MODEL_RATE and np.max(np.abs(after)) < 10 ** (-50 / 20)
    # The history remembers the reply as far as it was heard, marked as cut, and nothing after it.
    hist = parts.engine.history
    assert [m.role for m in hist] == ["user", "model"]
    # (a trailing comma of the heard words goes: "A rainbow is a flat,—" would read oddly; conversation.cut_reply)
    assert hist[1].text == flushed["remembered"] == flushed["spoken"].strip().rstrip(",;:") + CUT_MARK


def test_wait_what_about_the_moon_is_answered(tmp_path, parts, embedded_cfg):
    audio = np.concatenate(list(parts.tts.synthesize("Wait, what about the moon?")))
    write_wav(tmp_path / "moon.wav", audio, parts.tts.sample_rate)
    write_wav(tmp_path / "question.wav", load_audio(DEMO / "question.wav"), MODEL_RATE)
    (tmp_path / "s.yaml").write_text(
        "events:\n"
        "  - {at: 0.5, say: question.wav, text: \"What is a rainbow?\"}\n"
        "  - {after: speaking, delay: 1.2, say: moon.wav, text: \"Wait, what about the moon?\"}\n")
    report, records, output = run(tmp_path, tmp_path / "s.yaml", parts, embedded_cfg)
    assert events(records, "flushed") and not events(records, "stopped")
    assert len(report["turns"]) == 2 and not report["turns"][1]["interrupted"]
    assert events(records, "turn_end")[-1]["text"]
    hist = parts.engine.history
    assert [m.role for m in hist] == ["user", "model", "user", "model"]
    assert hist[2].text == "Wait, what about the moon?" and hist[1].text.endswith(CUT_MARK)
    second = [r["t"] for r in events(records, "tts_first_audio")][-1]
    assert np.max(np.abs(output[int(second * MODEL_RATE):])) > 0.05  # the answer was spoken


def test_with_the_switch_off_a_stop_command_is_answered(tmp_path, parts, embedded_cfg):
    cfg = embedded_cfg.model_copy(deep=True)
    cfg.interruption.stop_words_only_silence = False
    report, records, _ = run(tmp_path, DEMO / "barge-in.yaml", parts, cfg)
    assert not events(records, "stopped") and len(report["turns"]) == 2
