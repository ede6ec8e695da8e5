"""MtmdAudio on the real llama.cpp mtmd path, with the tiny random-weight Gemma 4 fixture.

The fixture (tests/fixtures/tiny_gemma4) has real Gemma 4 tensor layouts and a real ``gemma4a``
audio conformer, so every call below runs mtmd's log-mel front end, the audio encoder, the
projector and llama_decode of the embeddings. Weights are random: only shapes, positions and
cache behaviour are checked, never the text.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from appliance.mtmd_audio import MAX_AUDIO_SECONDS, MEDIA_MARKER, AudioModelError, MtmdAudio  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "tiny_gemma4"
MODEL = FIXTURES / "tiny-gemma4.gguf"
MMPROJ = FIXTURES / "tiny-gemma4-mmproj.gguf"
SR = 16000
TOKENS_PER_SECOND = 25  # Gemma 4 audio: 40 ms per token
TURN = f"<|turn>user\n{MEDIA_MARKER}<turn|>\n<|turn>model\n"


def tone(seconds: float = 1.0, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(SR * seconds)) / SR
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def noise(seconds: float = 1.0, seed: int = 0) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(int(SR * seconds))).astype(np.float32)


def new_llm():
    return llama_cpp.Llama(
        model_path=str(MODEL), n_ctx=2048, n_threads=2, n_threads_batch=2,
        type_k=llama_cpp.GGML_TYPE_Q4_0, type_v=llama_cpp.GGML_TYPE_Q4_0,
        flash_attn=True, verbose=False,
    )


def last_logits(llm) -> np.ndarray:
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def kv_range(llm) -> tuple[int, int]:
    mem = llama_cpp.llama_get_memory(llm.ctx)
    return llama_cpp.llama_memory_seq_pos_min(mem, 0), llama_cpp.llama_memory_seq_pos_max(mem, 0)


def n_text_tokens(llm, text: str, bos: bool) -> int:
    """Tokens of ``text`` with the marker replaced by the <|audio><audio|> pair mtmd adds around audio."""
    wrapped = text.replace(MEDIA_MARKER, "<|audio><audio|>")
    return len(llm.tokenize(wrapped.encode(), add_bos=bos, special=True))


@pytest.fixture
def llm():
    m = new_llm()
    yield m
    m.close()


@pytest.fixture
def audio(llm):
    a = MtmdAudio(llm, str(MMPROJ), n_threads=2)
    yield a
    a.close()


def test_fixture_files_are_small():
    for p in (MODEL, MMPROJ):
        assert p.is_file(), p
        assert 0 < p.stat().st_size < 5 * 1024 * 1024


def test_loads_projector_with_audio(llm, audio):
    assert audio.sample_rate == SR
    assert audio.audio_placeholder == llm.tokenize(b"<|audio|>", add_bos=False, special=True)[0]
    # the control tokens are single tokens, not split into bytes
    for tok in ("<|turn>", "<turn|>", "<|audio>", "<audio|>"):
        assert len(llm.tokenize(tok.encode(), add_bos=False, special=True)) == 1, tok


def test_one_second_of_audio_appends_25_tokens(llm, audio):
    n_text = n_text_tokens(llm, TURN, bos=True)
    new_n_past, n_eval = audio.eval_prompt(TURN, tone(1.0), n_past=0)

    assert audio.last_audio_tokens == TOKENS_PER_SECOND
    assert new_n_past == n_text + TOKENS_PER_SECOND
    assert n_eval == new_n_past
    assert llm.n_tokens == new_n_past
    assert kv_range(llm) == (0, new_n_past - 1)
    ids = llm.input_ids[:new_n_past].tolist()
    assert ids[0] == llm.token_bos()
    assert ids.count(audio.audio_placeholder) == TOKENS_PER_SECOND
    # the prompt ends with text, so there are logits to sample from
    logits = last_logits(llm)
    assert np.all(np.isfinite(logits)) and logits.std() > 0


def test_second_turn_appends_without_clearing(llm, audio):
    n1, _ = audio.eval_prompt(TURN, tone(1.0), n_past=0)
    n_text2 = n_text_tokens(llm, TURN, bos=False)  # no BOS after position 0
    n2, n_eval2 = audio.eval_prompt(TURN, noise(1.0), n_past=n1)

    assert n_eval2 == n_text2 + TOKENS_PER_SECOND
    assert n2 == n1 + n_eval2
    assert llm.n_tokens == n2
    assert kv_range(llm) == (0, n2 - 1)  # turn 1 still in the cache
    ids = llm.input_ids[:n2].tolist()
    assert ids.count(llm.token_bos()) == 1
    assert ids.count(audio.audio_placeholder) == 2 * TOKENS_PER_SECOND


def test_second_turn_attends_to_first_turn():
    """Same second turn at the same position, different first turn -> different logits."""
    results = []
    for first in (tone(1.0), noise(1.0, seed=1)):
        m = new_llm()
        a = MtmdAudio(m, str(MMPROJ))
        n1, _ = a.eval_prompt(TURN, first, n_past=0)
        a.eval_prompt(TURN, tone(0.5, 880.0), n_past=n1)
        results.append((m.n_tokens, last_logits(m)))
        a.close()
        m.close()
    (n_a, logits_a), (n_b, logits_b) = results
    assert n_a == n_b
    assert not np.allclose(logits_a, logits_b)


def test_audio_content_reaches_the_model(llm, audio):
    audio.eval_prompt(TURN, tone(1.0), n_past=0)
    with_tone = last_logits(llm)
    audio.eval_prompt(TURN, np.zeros(SR, dtype=np.float32), n_past=0)  # re-evaluate from 0
    with_silence = last_logits(llm)
    assert llm.n_tokens == kv_range(llm)[1] + 1
    assert not np.allclose(with_tone, with_silence)


def test_text_decoding_continues_after_audio(llm, audio):
    n_past, _ = audio.eval_prompt(TURN, tone(1.0), n_past=0)
    generated = []
    for _ in range(5):
        tok = llm.sample(temp=0.0)
        assert 0 <= tok < llm.n_vocab()
        generated.append(tok)
        llm.eval([tok])
    assert llm.n_tokens == n_past + 5
    assert kv_range(llm) == (0, n_past + 4)
    assert llm.input_ids[n_past:n_past + 5].tolist() == generated
    # and another audio turn can follow the generated text
    n3, _ = audio.eval_prompt(TURN, noise(1.0), n_past=llm.n_tokens)
    assert n3 > n_past + 5 and kv_range(llm) == (0, n3 - 1)


def test_llm_eval_after_audio_matches_one_shot_prompt():
    """Bookkeeping check: eval_prompt(turn) + llm.eval(text) == eval_prompt(turn + text)."""
    suffix = "hello how are you"
    m1 = new_llm()
    a1 = MtmdAudio(m1, str(MMPROJ))
    a1.eval_prompt(TURN, tone(1.0), n_past=0)
    m1.eval(m1.tokenize(suffix.encode(), add_bos=False, special=True))
    split_n, split_logits = m1.n_tokens, last_logits(m1)

    m2 = new_llm()
    a2 = MtmdAudio(m2, str(MMPROJ))
    a2.eval_prompt(TURN + suffix, tone(1.0), n_past=0)
    joint_n, joint_logits = m2.n_tokens, last_logits(m2)

    assert split_n == joint_n
    assert m1.input_ids[:split_n].tolist() == m2.input_ids[:joint_n].tolist()
    np.testing.assert_allclose(split_logits, joint_logits, rtol=0, atol=1e-3)
    assert int(np.argmax(split_logits)) == int(np.argmax(joint_logits))
    for a, m in ((a1, m1), (a2, m2)):
        a.close()
        m.close()


def test_generate_with_exact_cached_prompt_keeps_audio(llm, audio):
    """llm.generate() given exactly input_ids[:n_tokens] samples from the live logits (no re-eval)."""
    import itertools

    n_past, _ = audio.eval_prompt(TURN, tone(1.0), n_past=0)
    expected_first = int(np.argmax(last_logits(llm)))
    prompt = llm.input_ids[:llm.n_tokens].tolist()
    out = list(itertools.islice(llm.generate(prompt, temp=0.0), 3))
    assert out[0] == expected_first
    assert llm.n_tokens == n_past + 2  # the 3rd token is sampled but not yet evaluated
    assert kv_range(llm) == (0, n_past + 1)


@pytest.mark.parametrize("seconds", [0.25, 1.0, 2.3, 7.0])
def test_token_count_formula_matches_mtmd(llm, audio, seconds):
    n_text = n_text_tokens(llm, TURN, bos=True)
    pcm = noise(seconds)
    n, _ = audio.eval_prompt(TURN, pcm, n_past=0)
    assert audio.last_audio_tokens == MtmdAudio.expected_audio_tokens(pcm.size)
    assert n == n_text + audio.last_audio_tokens
    assert abs(audio.last_audio_tokens - TOKENS_PER_SECOND * seconds) <= 1


def test_wrong_mmproj_path_is_one_line_error(llm, tmp_path):
    missing = tmp_path / "no-such-mmproj.gguf"
    with pytest.raises(AudioModelError) as exc:
        MtmdAudio(llm, str(missing))
    msg = str(exc.value)
    assert isinstance(exc.value, ValueError)
    assert str(missing) in msg and "\n" not in msg


def test_text_model_as_mmproj_is_one_line_error(llm):
    with pytest.raises(AudioModelError) as exc:
        MtmdAudio(llm, str(MODEL))
    msg = str(exc.value)
    assert str(MODEL) in msg and "\n" not in msg


def test_bad_inputs_are_rejected_and_leave_state_alone(llm, audio):
    n1, _ = audio.eval_prompt(TURN, tone(1.0), n_past=0)
    too_long = np.zeros(int(SR * (MAX_AUDIO_SECONDS + 1)), dtype=np.float32)
    bad = [
        (TURN, too_long, n1),                                   # > 30 s
        ("<|turn>user\nhi<turn|>\n", tone(1.0), n1),            # no marker
        (TURN + MEDIA_MARKER, tone(1.0), n1),                   # two markers
        (TURN, np.stack([tone(1.0), tone(1.0)], axis=1), n1),   # stereo
        (TURN, np.zeros(0, dtype=np.float32), n1),              # empty
        (TURN, tone(1.0), n1 + 1),                              # gap after the cache
    ]
    for text, pcm, n_past in bad:
        with pytest.raises(ValueError):
            audio.eval_prompt(text, pcm, n_past=n_past)
        assert llm.n_tokens == n1
        assert kv_range(llm) == (0, n1 - 1)


def test_context_overflow_is_rejected():
    m = llama_cpp.Llama(model_path=str(MODEL), n_ctx=256, verbose=False)
    a = MtmdAudio(m, str(MMPROJ))
    with pytest.raises(ValueError, match="n_ctx"):
        a.eval_prompt(TURN, tone(10.0), n_past=0)  # 250 audio tokens + text > 256
    assert m.n_tokens == 0
    a.close()
    m.close()


def test_n_batch_larger_than_context_batch_is_clamped():
    """n_batch=512 on a context with n_batch=16 would abort inside mtmd without the clamp."""
    m = llama_cpp.Llama(model_path=str(MODEL), n_ctx=512, n_batch=16, n_ubatch=16, verbose=False)
    a = MtmdAudio(m, str(MMPROJ))
    n, _ = a.eval_prompt(TURN, tone(1.0), n_past=0, n_batch=512)
    assert a.last_audio_tokens == TOKENS_PER_SECOND
    assert m.n_tokens == n == n_text_tokens(m, TURN, bos=True) + TOKENS_PER_SECOND
    a.close()
    m.close()


def test_close_is_idempotent_and_blocks_use(llm):
    a = MtmdAudio(llm, str(MMPROJ))
    a.close()
    a.close()
    with pytest.raises(RuntimeError):
        a.eval_prompt(TURN, tone(1.0), n_past=0)


def test_marker_is_mtmd_default():
    import llama_cpp.mtmd_cpp as mtmd

    assert MEDIA_MARKER == mtmd.mtmd_default_marker().decode()
    assert ctypes.sizeof(ctypes.c_float) == 4
