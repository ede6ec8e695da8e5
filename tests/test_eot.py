"""End of turn with Smart Turn v3.2 (the real ONNX model from the pipecat-ai wheel) on real speech: Piper's
voice and espeak-ng's, and the segmenter that asks it at each pause."""

import importlib.util

import numpy as np
import pytest

from appliance.audio.files import load_audio, resample
from appliance.bench.interruption import espeak
from appliance.eot import SmartTurn, bundled_model_path, log_mel_features
from appliance.vad import SileroVad, VadSegmenter

from conftest import DEMO

COMPLETE = ["What is the capital of France?", "Tell me a joke.", "Set a timer for ten minutes."]
INCOMPLETE = ["What's the weather like in", "So the thing is, I need"]


@pytest.fixture(scope="module")
def smart_turn():
    return SmartTurn()


@pytest.fixture(scope="module")
def voices(parts):
    def piper(text):
        tts = parts.tts
        return resample(np.concatenate(list(tts.synthesize(text))), tts.sample_rate, 16000)

    return {"piper": piper, "en-us+f3": lambda t: espeak(t, "en-us+f3"), "en-gb+m3": lambda t: espeak(t, "en-gb+m3")}


def test_features_match_the_reference_that_ships_with_the_model():
    """Our log-mel features against the numpy implementation inside the pipecat-ai wheel (loaded by path:
    the package's __init__ needs loguru), on speech shorter than 8 s, on noise longer than 8 s."""
    ref_path = bundled_model_path().parent.parent / "_whisper_features.py"
    spec = importlib.util.spec_from_file_location("smart_turn_reference", ref_path)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    speech = load_audio(DEMO / "question.wav")
    noise = (0.05 * np.random.default_rng(2).standard_normal(9 * 16000)).astype(np.float32)
    for audio in (speech, noise):
        last8 = np.concatenate([np.zeros(max(0, 128000 - len(audio)), np.float32), audio])[-128000:]
        want = ref.compute_whisper_log_mel_features(last8, do_normalize=True)
        got = log_mel_features(audio)
        assert got.shape == (80, 800) and got.dtype == np.float32
        assert np.max(np.abs(got - want)) < 1e-4


def test_smart_turn_hears_finished_and_unfinished_sentences(smart_turn, voices):
    """Real speech, 200 ms of silence after it (the short stop): a finished question is complete, a phrase
    cut before its end is not, in all three voices."""
    pause = np.zeros(3200, np.float32)
    for text in COMPLETE:
        for name, say in voices.items():
            assert smart_turn.probability(np.concatenate([say(text), pause])) > 0.5, (text, name)
    for text in INCOMPLETE:
        for name, say in voices.items():
            assert smart_turn.probability(np.concatenate([say(text), pause])) < 0.5, (text, name)
    assert np.median(smart_turn.infer_ms) < 500


def _end_of(audio, eot=None):
    """Push ``audio`` then 2 s of silence through a segmenter: the ``end`` events as (sample, silence ms)."""
    seg = VadSegmenter(SileroVad())
    seg.use_end_of_turn(eot)
    signal = np.concatenate([np.zeros(8000, np.float32), audio, np.zeros(32000, np.float32)])
    ends = []
    for i in range(0, len(signal), 160):
        ends += [(e.t_sample, e.silence_ms) for e in seg.push(signal[i:i + 160]) if e.kind == "end"]
    return ends, seg


def _fixed_piper(tts, text):
    """Piper with no noise: the same samples every run (Piper draws its noise inside the ONNX graph)."""
    from piper import SynthesisConfig

    cfg = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)
    audio = np.concatenate([c.audio_float_array for c in tts.voice.synthesize(text, syn_config=cfg)])
    return resample(audio.astype(np.float32), tts.sample_rate, 16000)


def test_a_finished_question_ends_at_the_short_stop_and_a_mid_sentence_pause_is_waited_out(smart_turn, parts):
    question = _fixed_piper(parts.tts, "What is the capital of France?")
    ends, seg = _end_of(question, smart_turn.probability)
    assert len(ends) == 1 and ends[0][1] <= 400  # complete at 200 ms and again at 300 ms (+ a hop), not 500 ms
    assert len(seg.eot_calls) == 2 and min(p for _, p in seg.eot_calls) > 0.5
    silence_only, _ = _end_of(question)
    assert len(silence_only) == 1 and silence_only[0][1] >= 500  # without the model: the silence rule
    # "What's the weather like in ... Paris tomorrow?": a 700 ms pause inside one turn.
    halting = np.concatenate([_fixed_piper(parts.tts, "What's the weather like in"), np.zeros(11200, np.float32),
                              _fixed_piper(parts.tts, "Paris tomorrow?")])
    ends, seg = _end_of(halting, smart_turn.probability)
    assert len(ends) == 1, (ends, seg.eot_calls)  # one turn: the pause did not end it
    assert seg.eot_calls[0][1] < 0.5  # asked at the pause: incomplete
    assert ends[0][0] > 8000 + len(halting) - 16000  # ... and the turn ended after the last words:
    complete = seg.eot_calls[-1][1] > 0.5  # at the short stop if the model calls the whole complete,
    assert ends[0][1] <= 400 if complete else ends[0][1] >= 1000  # else after max_silence_ms


def test_a_first_complete_must_be_confirmed_at_the_second_call(parts):
    """Smart Turn says complete at 200 ms of a pause, then not at 300 ms: the turn goes on (off: it ends)."""
    question = _fixed_piper(parts.tts, "What is the capital of France?")
    answers = iter([0.9, 0.2] + [0.2] * 50)
    ends, seg = _end_of(question, lambda audio: next(answers))
    assert len(ends) == 1 and ends[0][1] >= 1000, (ends, seg.eot_calls)  # max_silence_ms ended it
    assert [p for _, p in seg.eot_calls] == [0.9, 0.2]
    assert 200 <= seg.eot_calls[0][0] < 300 <= seg.eot_calls[1][0]
    answers = iter([0.9, 0.2] + [0.2] * 50)
    seg = VadSegmenter(SileroVad(), end_of_turn_confirm_ms=0)
    seg.use_end_of_turn(lambda audio: next(answers))
    signal = np.concatenate([np.zeros(8000, np.float32), question, np.zeros(32000, np.float32)])
    ends = [e.silence_ms for i in range(0, len(signal), 160) for e in seg.push(signal[i:i + 160]) if e.kind == "end"]
    assert len(ends) == 1 and ends[0] < 300  # one call decides


def test_offline_end_of_turn_counts_a_turn_ended_inside_a_pause(parts):
    """The offline evaluator (real Silero, the segmenter's logic) finds the premature end it is shown."""
    from appliance.bench.latency import Case, offline_eot

    first, rest = _fixed_piper(parts.tts, "I was wondering,"), _fixed_piper(parts.tts, "what the capital of France is.")
    audio = np.concatenate([first, np.zeros(8000, np.float32), rest])  # a 500 ms pause
    case = Case("paused", audio, "I was wondering, what the capital of France is.", False, (500,), len(audio) / 16000)
    eager = offline_eot([case], SileroVad(), lambda a: 1.0, {"end_of_turn_confirm_ms": 0})
    assert eager["premature_eot"] == {"count": 1, "n": 1} and eager["premature"] == ["paused"]
    patient = offline_eot([case], SileroVad(), None, {"min_silence_ms": 800})
    assert patient["premature_eot"]["count"] == 0 and 800 <= patient["eot_detect_ms"]["p50"] < 1000
