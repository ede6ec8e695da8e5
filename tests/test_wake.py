"""listen.mode: wake_word, on real parts: the microWakeWord detector (pymicro-wakeword's bundled okay_nabu)
on Piper speech, the conversation's follow-up window, the LEDs that show it, and a replay in the simulated
room where only speech after the wake word or inside the window is answered."""

import json
import time

import numpy as np
import pytest
from gpiozero.pins.mock import MockFactory, MockPWMPin

from appliance.audio.files import MODEL_RATE, load_audio, resample, write_wav
from appliance.config import GpioConfig
from appliance.indicators import DIM, Indicators
from appliance.replay import replay
from appliance.wake import WakeWordDetector

from conftest import DEMO
from test_conversation import running, user_turn


def piper(parts, text):
    return resample(np.concatenate(list(parts.tts.synthesize(text))), parts.tts.sample_rate, MODEL_RATE)


def test_the_detector_hears_its_phrase_and_not_other_speech(parts):
    det = WakeWordDetector("okay_nabu")
    pad = np.zeros(MODEL_RATE // 2, np.float32)
    phrase = piper(parts, "Okay Nabu.")
    hits = det.process(np.concatenate([pad, phrase, pad]))
    assert len(hits) == 1
    # Detected after the phrase's last syllable began, and within half a second of its end.
    end = len(pad) + len(phrase)
    assert end - MODEL_RATE // 2 < hits[0] < end + MODEL_RATE // 2
    det.reset()
    assert det.process(np.concatenate([pad, piper(parts, "Okay, what is a rainbow? Tell me about the moon."), pad])) == []
    assert 0 < det.compute_s / det.audio_s < 0.2  # CPU per second of audio, measured by the bench


@pytest.fixture
def wake_session(fresh_parts, embedded_cfg):
    cfg = embedded_cfg.model_copy(deep=True)
    cfg.listen.mode = "wake_word"
    cfg.listen.follow_up_s = 2.0
    with running(cfg, fresh_parts) as sr:
        yield sr


def test_only_speech_after_the_wake_word_or_in_the_window_is_answered(wake_session):
    s, rec = wake_session
    count = lambda name: sum(1 for r in rec.records if r["event"] == name)  # noqa: E731
    thinking = lambda: rec.states().count("thinking")  # noqa: E731
    assert [r["open"] for r in rec.records if r["event"] == "listen_window"] == [False]
    user_turn(s, "What is a rainbow?")  # no wake word: ignored
    rec.wait_for(lambda rs: count("ignored") == 1)
    assert thinking() == 0
    s.conversation.post("wake", audio_t=1.0, word="okay_nabu")
    user_turn(s, "What is a rainbow?")  # after the wake word: answered
    rec.wait_for(lambda rs: count("turn_end") == 1, timeout=60)
    rec.wait_for(lambda rs: [r.get("open") for r in rs if r["event"] == "listen_window"][-1] is True)
    user_turn(s, "And the moon?")  # a follow-up inside the window: no wake word needed
    rec.wait_for(lambda rs: count("turn_end") == 2, timeout=60)
    # The window closes follow_up_s after the reply; then speech is ignored again.
    rec.wait_for(lambda rs: [r.get("open") for r in rs if r["event"] == "listen_window"][-1] is False, timeout=10)
    user_turn(s, "Tell me a joke.")
    rec.wait_for(lambda rs: count("ignored") == 2)
    time.sleep(0.3)
    assert thinking() == 2


def test_the_leds_show_the_window():
    factory = MockFactory(pin_class=MockPWMPin)
    try:
        ind = Indicators(GpioConfig(led_pin=12), post=lambda *a, **k: None, pin_factory=factory)
        led = ind.leds.devices["led"]
        ind.observe({"event": "state", "state": "listening"})
        assert led.value == pytest.approx(DIM)  # always mode: no window events, plain listening
        ind.observe({"event": "listen_window", "open": False})
        assert ind.shown == "wake_word" and led.value == 0
        ind.observe({"event": "listen_window", "open": True})
        assert ind.shown == "listening" and led.value == pytest.approx(DIM)
        ind.observe({"event": "state", "state": "thinking"})
        assert ind.shown == "thinking"
        ind.close()
    finally:
        factory.reset()


def test_replay_wake_word_follow_up_and_outside_the_window(tmp_path, parts, embedded_cfg):
    cfg = embedded_cfg.model_copy(deep=True)
    cfg.listen.mode = "wake_word"
    cfg.listen.follow_up_s = 6.0
    for name, text in [("wake", "Okay Nabu, what is a rainbow?"), ("moon", "What about the moon?"),
                       ("joke", "Tell me a joke.")]:
        write_wav(tmp_path / f"{name}.wav", piper(parts, text), MODEL_RATE)
    write_wav(tmp_path / "question.wav", load_audio(DEMO / "question.wav"), MODEL_RATE)
    (tmp_path / "s.yaml").write_text(
        "events:\n"
        "  - {at: 0.5, say: question.wav, text: \"What is a rainbow?\"}\n"  # no wake word: ignored
        "  - {at: 3.0, say: wake.wav, text: \"Okay Nabu, what is a rainbow?\"}\n"
        "  - {after: speaking, delay: 6.0, say: moon.wav, text: \"What about the moon?\"}\n"
        # 8 s after the second reply ends: outside its 6 s window whatever the reply's length (16 s after it began
        # was inside it once the tiny model's reply ran 10.2 s)
        "  - {after: listening, delay: 8.0, say: joke.wav, text: \"Tell me a joke.\"}\n")
    parts.engine.forget()
    report = replay(tmp_path / "s.yaml", tmp_path / "out", parts, cfg, paced=False, max_seconds=90)
    records = [json.loads(line) for line in (tmp_path / "out" / "timeline.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records].count("wake") == 1
    heard = [t.get("heard_transcript") for t in report["turns"]]
    assert heard == ["Okay Nabu, what is a rainbow?", "What about the moon?"], heard
    # (with Smart Turn, "Okay Nabu," and its pause may end a turn of its own: "the wake word alone", which
    # opens the window for the question that follows; only speech with no wake word is refused)
    refused = [r["reason"] for r in records if r["event"] == "ignored" and "wake word alone" not in r["reason"]]
    assert refused == ["no wake word", "no wake word"]


def test_doctor_describes_both_listening_modes_and_the_stop_behaviour(tmp_path):
    from appliance.doctor import PASS, Doctor

    for text, want in [("listen:\n  mode: always\n", "answers anyone who speaks"),
                       ("listen:\n  mode: wake_word\n", "answers after 'Okay Nabu', and for 8 s after each reply")]:
        (tmp_path / "c.yaml").write_text(text)
        d = Doctor(tmp_path / "c.yaml", embedded=True)
        d.check_config()
        row = d.check_listening()
        assert row.status == PASS and want in row.detail and "stops the reply and starts no new one" in row.detail
