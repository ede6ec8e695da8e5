"""Streamed pre-fill of an audio turn through llama.cpp's mtmd, on the tiny Gemma 4 fixture (real encoder,
real projector, real decode; random weights): the pieces must give what the whole clip gives."""

from pathlib import Path

import numpy as np
import pytest

import llama_cpp

from appliance.audio.files import load_audio
from appliance.audio_prefill import SAMPLES_PER_TOKEN, AudioEncoder, StreamedAudioTurn
from appliance.engine import _load_llama
from appliance.mtmd_audio import MEDIA_MARKER, MtmdAudio

from conftest import DEMO

FIX = Path(__file__).parent / "fixtures" / "tiny_gemma4"
PROMPT = f"<|turn>user\n{MEDIA_MARKER}<turn|>\n<|turn>model\n"


@pytest.fixture(scope="module")
def model():
    llm = _load_llama(FIX / "tiny-gemma4.gguf", n_ctx=2048, n_threads=2, verbose=False, flash_attn=True)
    return llm, MtmdAudio(llm, str(FIX / "tiny-gemma4-mmproj.gguf"))


@pytest.fixture(scope="module")
def speech():
    pcm = np.concatenate([load_audio(DEMO / "question.wav"), load_audio(DEMO / "wait.wav")])
    return pcm[: len(pcm) // SAMPLES_PER_TOKEN * SAMPLES_PER_TOKEN]  # whole 40 ms tokens: 2.6 s, 64 tokens


def _logits(llm):
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm.model))
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,)).copy()


def _windows(encoder, pcm, step, left, lookahead):
    """Embeddings of ``pcm`` encoded window by window, as the streamed pre-fill does."""
    total, done, out = len(pcm) // SAMPLES_PER_TOKEN, 0, []
    for end in list(range(step, total, step)) + [total]:
        upto = end if end == total else end - lookahead
        first = max(0, done - left)
        out.append(encoder.encode(pcm[first * SAMPLES_PER_TOKEN : end * SAMPLES_PER_TOKEN])[done - first : upto - first])
        done = upto
    return np.concatenate(out)


def test_windows_with_left_context_and_one_token_held_back_give_the_whole_clips_embeddings(model, speech):
    llm, audio = model
    encoder = AudioEncoder(audio)
    whole = encoder.encode(speech)
    assert whole.shape == (len(speech) // SAMPLES_PER_TOKEN, encoder.n_embd)
    for step in (12, 25):  # 0.48 s and 1 s of new audio per window
        streamed = _windows(encoder, speech, step=step, left=24, lookahead=1)
        assert np.max(np.abs(streamed - whole)) < 1e-6
    # Without the token held back, the last token of each window lacks the frames after it.
    cut = _windows(encoder, speech, step=12, left=24, lookahead=0)
    cos = np.sum(cut * whole, axis=1) / (np.linalg.norm(cut, axis=1) * np.linalg.norm(whole, axis=1))
    assert cos.min() < 0.999
    # With too little left context, the first tokens of each window lack what came before them (measured
    # here: 1e-3 of difference with 12-14 tokens, 0.07 with 6, none from 24 on).
    assert np.max(np.abs(_windows(encoder, speech, step=12, left=12, lookahead=1) - whole)) > 1e-4


@pytest.mark.parametrize("left_s,agrees", [(0.96, True), (0.0, False)])
def test_a_streamed_turn_ends_where_the_whole_clip_does(model, speech, left_s, agrees):
    """The same positions, the same token ids, and the same next-token logits (to 5e-3 of their scale,
    the difference of batching the decode) as ``eval_prompt`` on the whole clip; 3 audio tokens left at
    the end of the turn when fed every 0.5 s."""
    llm, audio = model
    end_whole, _ = audio.eval_prompt(PROMPT, speech, 0, add_special=False)
    want_ids, want_logits = list(llm.input_ids[:end_whole]), _logits(llm)
    turn = StreamedAudioTurn(audio, PROMPT, 0, left_context_s=left_s)
    for n in range(8000, len(speech), 8000):
        turn.feed(speech[:n])
    end, left = turn.finish(speech)
    assert end == end_whole and list(llm.input_ids[:end]) == want_ids and llm.n_tokens == end
    assert left <= 13  # at most a 0.5 s step and the token held back
    diff = np.max(np.abs(_logits(llm) - want_logits)) / np.max(np.abs(want_logits))
    assert (diff < 5e-3) == agrees, diff


def test_a_blip_is_rolled_back_out_of_the_cache(model, speech):
    llm, audio = model
    audio.eval_prompt(PROMPT, speech[:16000], 0, add_special=False)
    start = llm.n_tokens
    turn = StreamedAudioTurn(audio, PROMPT, start)
    turn.feed(speech[:12800])
    assert llm.n_tokens > start and turn.done == 19  # 20 tokens, one held back
    turn.rollback()
    assert llm.n_tokens == start
    mem = llama_cpp.llama_get_memory(llm.ctx)
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == start - 1  # nothing of the blip is left
