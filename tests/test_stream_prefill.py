"""Streamed pre-fill in the engine, on the tiny Gemma 4 through mtmd (real encoder, projector and decode;
random weights): a turn pre-filled while it was spoken ends where the whole clip's turn does, and an
utterance that is no turn leaves nothing behind.

Each test fails with the feature switched off: ``stream_prefill=False`` makes ``stream_audio`` a no-op,
so ``last.streamed`` stays False and nothing is pre-filled to roll back."""

from pathlib import Path

import numpy as np
import pytest

import llama_cpp

from appliance.audio.files import load_audio
from appliance.audio_prefill import template_around_audio
from appliance.engine import AUDIO_MARKER, Engine, EngineWorker, _opened

from conftest import DEMO

FIX = Path(__file__).parent / "fixtures" / "tiny_gemma4"
GGUF, MMPROJ = FIX / "tiny-gemma4.gguf", FIX / "tiny-gemma4-mmproj.gguf"
CONTEXT = "[Tuesday, December 1, 2026, 11:50 AM]"


def tiny(**kw):
    args = dict(n_ctx=4096, n_threads=2, system_prompt="Be brief.", max_reply_tokens=8, temperature=0.0,
                history_budget_tokens=1200, kv_cache_type="f16")
    args.update(kw)
    return Engine(GGUF, MMPROJ, **args)


@pytest.fixture(scope="module")
def speech():
    # 2.6 s of speech with a trailing part that is not a whole 40 ms token (the engine cuts it)
    return np.concatenate([load_audio(DEMO / "question.wav"), load_audio(DEMO / "wait.wav")])[:41900]


def _logits(e):
    llm = e.llm
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm.model))
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,)).copy()


def _one_turn(e, speech, stream_every=None):
    """A turn; with ``stream_every`` samples, fed as the listener would while the user speaks. Returns the
    cache's token ids, the next-token logits, the reply, and ``e.last``."""
    if stream_every:
        for n in range(stream_every, len(speech), stream_every):
            e.stream_audio(speech[:n], CONTEXT)
    it = e.start_turn(speech, None, context=CONTEXT)
    ids, logits, last = list(e.llm.input_ids[: e.n_past]), _logits(e), e.last
    text = "".join(it)
    return ids, logits, text, last


def test_a_streamed_turn_agrees_with_the_whole_clip_in_the_engine(speech):
    whole_e, stream_e = tiny(stream_prefill=False), tiny(stream_prefill=True, stream_left_context_s=0.96)
    w_ids, w_logits, w_text, w_last = _one_turn(whole_e, speech)
    s_ids, s_logits, s_text, s_last = _one_turn(stream_e, speech, stream_every=8000)
    assert not w_last.streamed
    assert s_last.streamed  # switched off, the turn would be encoded whole here
    assert s_ids == w_ids and s_last.prefill_tokens == w_last.prefill_tokens
    # Only the last tokens are left for the end of the turn: at most a 0.5 s step and the one held back.
    assert s_last.audio_tokens_left <= 14 and s_last.tail_tokens < s_last.prefill_tokens // 2
    scale = float(np.max(np.abs(w_logits)))
    assert float(np.max(np.abs(s_logits - w_logits))) < 5e-3 * scale
    assert int(np.argmax(s_logits)) == int(np.argmax(w_logits)) and s_text == w_text
    # The next turn after a streamed one is unaffected: both engines still agree.
    whole_e.commit_spoken(w_text, complete=True)
    stream_e.commit_spoken(s_text, complete=True)
    w2 = _one_turn(whole_e, speech[: 16000 * 2])
    s2 = _one_turn(stream_e, speech[: 16000 * 2], stream_every=8000)
    assert s2[3].streamed and s2[0] == w2[0] and s2[2] == w2[2]


def test_whole_clip_encoding_stays_available():
    e = tiny(stream_prefill=False)
    before = e.n_past
    assert e.stream_audio(np.zeros(16000, np.float32), CONTEXT) == 0 and e.n_past == before


def test_a_blip_that_is_no_turn_is_rolled_back_and_the_next_turn_is_unaffected(speech):
    e, ref = tiny(), tiny(stream_prefill=False)
    start = e.n_past
    blip = speech[: 12800]
    assert e.stream_audio(blip, CONTEXT) == 19  # 20 tokens, one held back
    assert e.n_past > start + 19
    assert e.drop_streamed_audio()
    assert e.n_past == start
    mem = llama_cpp.llama_get_memory(e.llm.ctx)
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == start - 1  # nothing of the blip is left
    ids, logits, text, _ = _one_turn(e, speech, stream_every=8000)
    r_ids, r_logits, r_text, _ = _one_turn(ref, speech)
    assert ids == r_ids and text == r_text
    assert float(np.max(np.abs(logits - r_logits))) < 5e-3 * float(np.max(np.abs(r_logits)))


def test_another_clip_at_the_end_of_the_turn_is_encoded_whole(speech):
    """An interjection joined to what followed it is not the audio that was pre-filled: the speculative
    tokens go, and the turn is the whole clip's."""
    e, ref = tiny(), tiny(stream_prefill=False)
    e.stream_audio(speech[16000:], CONTEXT)
    ids, _, text, last = _one_turn(e, speech)
    r_ids, _, r_text, _ = _one_turn(ref, speech)
    assert not last.streamed and ids == r_ids and text == r_text


def test_the_worker_pre_fills_on_its_thread_and_rolls_back_what_the_conversation_drops(speech):
    e = tiny()
    posted = []
    w = EngineWorker(e, post=lambda name, **kw: posted.append((name, kw)), on_clause=lambda rid, text: None)
    try:
        start = e.n_past
        for n in range(8000, 32000, 8000):
            w.stream_audio(speech[:n])  # never blocks; merged while the engine is busy
        assert w.sync()
        assert e._stream is not None and e._stream.done >= 36 and e.n_past > start + 36
        w.drop_audio()
        assert w.sync()
        # The blip's audio is gone; the idle engine has the next turn's opening ready again (no audio in it).
        opening = e._stream.pos - e._stream.start
        assert e._stream.prepared and e._stream.done == 0 and e.n_past == start + opening
        mem = llama_cpp.llama_get_memory(e.llm.ctx)
        assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == e.n_past - 1
        # A streamed turn through the worker: the turn job claims the pre-filled audio, on the prepared opening.
        for n in range(8000, len(speech), 8000):
            w.stream_audio(speech[:n])
        w.submit_turn(1, speech, None)
        assert w.sync()
        done = [kw for name, kw in posted if name == "llm_done"]
        assert done and done[-1]["streamed"] is True and done[-1]["audio_tokens_left"] <= 14
        assert e.last.stream_prepared
    finally:
        w.stop()


def test_thinking_mode_is_off():
    """Gemma 4 thinks only when its system turn starts with ``<|think|>`` (its chat template); the engine's
    prompt never has that token, so a reply starts with its words, not a thought block."""
    e = tiny()
    think = e.llm.tokenize(b"<|think|>", add_bos=False, special=True)
    assert len(think) == 1  # one special token in the Gemma 4 vocabulary
    assert think[0] not in list(e.llm.input_ids[: e.n_past])  # the system prompt as evaluated
    turn = e._tokens(e.fmt.user_turn(CONTEXT + "\nHello"))
    assert think[0] not in turn and "<|think|>" not in e._system_text()


def test_streamed_turns_in_a_small_cache_make_room_and_lose_no_turn(speech):
    """Issue 17's room rules hold for streamed turns: a prepared opening and a streamed utterance in a cache
    that fills every few turns; the history is pruned and rebuilt behind them, and no turn is lost."""
    e = tiny(n_ctx=640, history_budget_tokens=320, max_reply_tokens=12)
    streamed = 0
    for i in range(24):
        clip = speech[: 16000 + 8000 * (i % 3)]
        e.prepare_turn(CONTEXT)
        for n in range(8000, len(clip), 8000):
            e.stream_audio(clip[:n], CONTEXT)
        text = "".join(e.start_turn(clip, None, context=CONTEXT))
        streamed += e.last.streamed
        assert e.last.prefill_tokens > 0
        e.commit_spoken(text, complete=i % 4 != 1)
        while not e.background_step(lambda: False):
            pass
    assert streamed >= 20 and e.decode_failures == 0 and e.rebuilds
    assert [m.role for m in e.history] == ["user", "model"] * (len(e.history) // 2)


@pytest.mark.parametrize("final_at_pause", [True, False])
def test_a_turn_that_ends_at_its_pause_feed_has_no_audio_left(speech, final_at_pause):
    """``model.stream_final_at_pause``: the listener's feed at a pause is the clip an end of turn there holds;
    its last token is decoded too, so the turn that ends there only decodes the template, and still agrees
    with the whole clip. Switched off, the held-back token is left for the end of the turn."""
    # What the segmenter hands over is what was fed at the pause, its part of a token included (the engine
    # cuts it from the turn's clip; the encoder never saw it in the feed either).
    clip = speech[: 40 * 640 + 384]
    whole_e = tiny(stream_prefill=False)
    e = tiny(stream_left_context_s=0.96, stream_final_at_pause=final_at_pause)
    for n in range(8000, len(clip), 8000):
        e.stream_audio(clip[:n], CONTEXT)
    e.stream_audio(clip, CONTEXT, at_pause=True)
    ids, logits, text, last = _one_turn(e, clip)
    w_ids, w_logits, w_text, _ = _one_turn(whole_e, clip)
    assert last.streamed and ids == w_ids and text == w_text
    assert last.audio_tokens_left == (0 if final_at_pause else 1)
    after = template_around_audio(e.audio, e.fmt.user_turn(_opened(CONTEXT, AUDIO_MARKER)))[1]
    assert last.tail_tokens == len(after) + last.audio_tokens_left  # the template, and the held-back token if off
    assert float(np.max(np.abs(logits - w_logits))) < 5e-3 * float(np.max(np.abs(w_logits)))


def test_speech_after_a_pause_feed_redoes_only_its_last_token(speech, monkeypatch):
    """The user goes on after a pause: the final token of the pause feed is rolled back and decoded again
    with the audio after it, so every audio position ends up with the whole clip's embedding (0.96 s is the
    exact left context on the fixture; the pause feed's last token, encoded at the end of its window,
    differs) and the turn agrees with the whole clip."""
    import appliance.audio_prefill as ap

    decoded = {}  # position -> the last embedding decoded there
    real = ap.decode_embeddings

    def spy(llm, embd, pos, *a, **kw):
        for j, row in enumerate(embd):
            decoded[pos + j] = row.copy()
        return real(llm, embd, pos, *a, **kw)

    monkeypatch.setattr(ap, "decode_embeddings", spy)
    whole_e, e = tiny(stream_prefill=False), tiny(stream_left_context_s=0.96)
    pause = 30 * 640
    e.stream_audio(speech[:16000], CONTEXT)
    e.stream_audio(speech[:pause], CONTEXT, at_pause=True)
    start = e._stream._audio_start
    assert e._stream.done == 30  # all of it, the last token too
    at_pause = decoded[start + 29].copy()
    e.stream_audio(speech[:36000], CONTEXT)  # the user went on
    assert e._stream.redone == 1 and e._stream.done == 36000 // 640 - 1
    ids, logits, text, last = _one_turn(e, speech)
    w_ids, w_logits, w_text, _ = _one_turn(whole_e, speech)
    assert last.streamed and ids == w_ids and text == w_text
    whole = ap.AudioEncoder(whole_e.audio).encode(speech[: len(speech) // 640 * 640])
    streamed = np.stack([decoded[start + i] for i in range(len(whole))])
    assert np.allclose(streamed, whole, atol=1e-4)
    assert not np.allclose(at_pause, whole[29], atol=1e-4)  # what a token without its redo would have kept
    assert float(np.max(np.abs(logits - w_logits))) < 5e-3 * float(np.max(np.abs(w_logits)))
