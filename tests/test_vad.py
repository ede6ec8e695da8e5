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


def test_interjection_ends_early_then_settles(question_audio):
    """While interjecting, 200 ms of silence ends the utterance; ``settled`` follows only once the user has
    been quiet for min_silence_ms, counted from the end of whatever they said after it."""
    seg = VadSegmenter(SileroVad(), interjection_silence_ms=200, min_silence_ms=500)
    seg.follow(interjecting=True, both_streams=True)
    loud = np.flatnonzero(np.abs(question_audio) > 0.01)  # the words, without the file's own silences
    words = question_audio[loud[0]:loud[-1] + 1]
    gap = np.zeros(int(0.3 * 16000), np.float32)  # a pause longer than 200 ms, shorter than 500 ms
    audio = np.concatenate([words, gap, words, np.zeros(16000, np.float32)])
    events, at = [], {}
    for i in range(0, len(audio), 160):
        for e in seg.push(audio[i:i + 160]):
            events.append(e)
            at.setdefault(e.kind, []).append(i + 160)
            if e.kind == "end":
                seg.follow(interjecting=False, both_streams=True)  # the reply was flushed: back to listening
    assert kinds(events) == ["onset", "start", "end", "onset", "start", "end", "settled"]
    # The first utterance ended 200 ms into a silence, the second (not interjecting) 500 ms into one;
    # settled came once more than 500 ms had passed since the second one's last voiced window.
    assert at["end"][0] < len(words) + len(gap)
    assert at["settled"][0] >= at["end"][1]
    assert at["settled"][0] - (at["end"][1] - 500 * 16) >= 500 * 16


def test_no_settled_without_an_interjection(question_audio):
    assert "settled" not in kinds(run(question_audio))
