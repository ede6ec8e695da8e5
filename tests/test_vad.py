"""Silero VAD (the real ONNX model) on real speech, silence and noise."""

from pathlib import Path

import numpy as np
import pytest

from appliance.audio.files import load_audio
from appliance.vad import WINDOW, SileroVad, VadSegmenter

ALSA_VOICE = Path("/usr/share/sounds/alsa/Front_Center.wav")  # a human voice, Debian's alsa-utils


def run(audio, **kw):
    seg = VadSegmenter(SileroVad(), **kw)
    events = []
    for i in range(0, len(audio), 160):  # 10 ms blocks, as the audio callbacks deliver them
        events += seg.push(audio[i:i + 160])
    events += seg.push(np.zeros(16000, dtype=np.float32))  # trailing silence to close the turn
    return events


def kinds(events):
    return [e.kind for e in events]


def test_speech_gives_one_turn(question_audio):
    events = run(question_audio)
    assert kinds(events) == ["onset", "start", "end"]
    end = events[-1]
    # The utterance handed on holds the speech: about the length of the words (0.9-1.3 s here).
    assert 0.7 < len(end.audio) / 16000 < 2.0
    assert end.speech_ms >= 250


@pytest.mark.skipif(not ALSA_VOICE.exists(), reason="alsa-utils' voice recordings are not installed")
def test_human_recording_is_speech():
    events = run(load_audio(ALSA_VOICE))
    assert "start" in kinds(events) and "end" in kinds(events)


def test_silence_is_not_speech():
    assert run(np.zeros(3 * 16000, dtype=np.float32)) == []


@pytest.mark.parametrize("level", [-40.0, -20.0])
def test_white_noise_is_not_speech(level):
    rng = np.random.default_rng(1)
    noise = (rng.standard_normal(3 * 16000) * 10 ** (level / 20)).astype(np.float32)
    assert "start" not in kinds(run(noise))


def test_window_size_is_enforced():
    with pytest.raises(ValueError):
        SileroVad().probability(np.zeros(WINDOW - 1, dtype=np.float32))


def test_speech_probability_separates(question_audio):
    vad = SileroVad()
    probs = [vad.probability(question_audio[i:i + WINDOW]) for i in range(0, len(question_audio) - WINDOW, WINDOW)]
    assert max(probs) > 0.9
    vad.reset()
    assert vad.probability(np.zeros(WINDOW, dtype=np.float32)) < 0.1
