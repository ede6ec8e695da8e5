"""Pre-fill a user's audio turn into the KV cache while it is being spoken (streamed pre-fill).

``MtmdAudio.eval_prompt`` encodes a whole clip after the turn has ended and decodes it: on a Pi 5 that is
seconds of work left for after the user stops. :class:`StreamedAudioTurn` does the same work in pieces
while the user talks: the turn's opening text and ``<|audio>`` first, then, every ``step`` of new audio,
the audio tokens that have become final, and at the end of the turn only the last tokens, ``<audio|>``
and the rest of the template. The token sequence in the cache is the one ``eval_prompt`` produces (the
text chunks come from ``mtmd_tokenize`` of the same prompt).

Why the pieces equal the whole clip's embeddings (Gemma 4's ``gemma4a`` encoder, llama.cpp mtmd):

- Audio token ``i`` stands for samples ``[640 i, 640 (i + 1))`` (10 ms mel hop, two stride-2 convolutions:
  25 tokens per second), and a window of ``640 k`` samples gives exactly ``k`` tokens.
- Each conformer layer looks back a limited number of tokens (its attention's left context,
  ``conf_attention_context_left`` = 13 in Hugging Face's ``Gemma4AudioConfig``, plus its causal
  convolution) and not forward; the encoder's receptive field is that times the number of layers.
  Re-encoding a window that starts ``left_context_s`` before its first new token reproduces that token
  when the left context covers the receptive field.
- The last token of a window lacks the frames after it (the front end's convolutions), so it is held
  back (``LOOKAHEAD_TOKENS``) until the next window, or the end of the turn, supplies them.
- Except at a pause (``feed(..., final=True)``): the listener feeds the utterance as an end of turn now
  would hold it, so the turn's clip is usually that very audio, and its last token, encoded at the end of
  the window, is what the whole clip gives it. It is decoded too; if more audio follows, only that one
  token is rolled back and decoded again with the next window. A turn that ends with the clip of its last
  pause has no audio left to encode: on a Pi 5 that saves a window of left context at the end of the turn
  (0.2 s/audio s × 0.52 s ≈ 0.1 s, *projected*; docs/latency.md).

Measured here on the tiny Gemma 4 fixture (1 conformer layer), windows of 0.48 s and 1 s: with 1 token held
back and 24 tokens (0.96 s) or more of left context, streamed embeddings equal the whole clip's exactly;
with 12-14 tokens they differ by about 1e-3 in each window's first 4 tokens, with 6 by 0.07; without the
hold-back the last token of each window differed (cosine 0.955-0.994). The next-token logits after a
streamed turn match the whole clip's to 1e-3 of their scale (the decode's batching). See
``tests/test_audio_prefill.py``. The real E2B has more layers, so its exact receptive field is longer
(``LEFT_CONTEXT_S``: how the left context was chosen); whether it understands streamed turns as well as
whole clips can only be checked with its weights (``hw-tests/test_latency.py``).

The engine drives it (:meth:`appliance.engine.Engine.stream_audio`, ``prepare_turn``, ``start_turn``,
``drop_streamed_audio``); ``appliance bench latency`` measures it.
"""

from __future__ import annotations

import ctypes
import time
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

import llama_cpp
import llama_cpp.mtmd_cpp as mtmd

from .mtmd_audio import MEDIA_MARKER, MtmdAudio

if TYPE_CHECKING:  # pragma: no cover
    from llama_cpp import Llama

SAMPLES_PER_TOKEN = 640  # 40 ms at 16 kHz
LOOKAHEAD_TOKENS = 1  # held back from each window until the next one (the front end's right context)
# Left context re-encoded before each window's first new token, s (``model.stream_left_context_ms``). On the
# fixture's one conformer layer, 0.96 s gives the whole clip's embeddings exactly and 0.48 s cosine 0.99996
# (measured here, ``appliance bench latency``). Gemma 4 E2B's conformer has 12 layers (Gemma4AudioConfig's
# default in transformers 5.24.0, each with attention_context_left 13 and conv_kernel_size 5), so its exact
# receptive field is up to 12 times longer, about 11.5 s (*projected*). That much cannot be re-encoded on a
# Pi 5: at the encoder's 0.2 s per audio second (the budget) each window would cost 2.3 s, and the
# encoder and pre-fill of new audio alone already take 0.98 s per second of speech there (docs/latency.md).
# So the left context is the fixture's exact one, 0.96 s: the deeper layers see less of the past than with
# the whole clip. Whether E2B still understands is checked on a Pi with its weights (hw-tests).
LEFT_CONTEXT_S = 0.96


class AudioEncoder:
    """The projector's encoder on its own: PCM in, audio embeddings out.

    :param audio: a loaded :class:`~appliance.mtmd_audio.MtmdAudio` (its mtmd context and model).
    """

    def __init__(self, audio: MtmdAudio):
        self.audio = audio
        self.n_embd = int(llama_cpp.llama_model_n_embd(audio._llm.model))

    def encode(self, pcm: np.ndarray) -> np.ndarray:
        """Encode ``pcm`` (float32 [n] mono 16 kHz, n ≥ 640) into float32 [n // 640, n_embd] embeddings.

        :raises RuntimeError: mtmd failed to tokenize or encode.
        """
        ctx = self.audio._ctx
        pcm = np.ascontiguousarray(pcm, dtype=np.float32)
        text = MEDIA_MARKER.encode()
        inp = mtmd.mtmd_input_text()
        inp.text, inp.text_len, inp.add_special, inp.parse_special = text, len(text), False, True
        bitmap = mtmd.mtmd_bitmap_init_from_audio(pcm.size, pcm.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            if mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(inp), (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) != 0:
                raise RuntimeError("mtmd_tokenize failed on an audio window")
            for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                chunk = mtmd.mtmd_input_chunks_get(chunks, i)
                if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    continue
                n = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
                if mtmd.mtmd_encode_chunk(ctx, chunk) != 0:
                    raise RuntimeError("mtmd_encode_chunk failed on an audio window")
                out = mtmd.mtmd_get_output_embd(ctx)
                return np.ctypeslib.as_array(out, shape=(n * self.n_embd,)).reshape(n, self.n_embd).copy()
            raise RuntimeError("mtmd found no audio in the window")
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)


def template_around_audio(audio: MtmdAudio, text_with_marker: str) -> tuple[list[int], list[int]]:
    """The token ids mtmd puts before and after the audio of ``text_with_marker`` (its ``<|audio>`` and
    ``<audio|>`` included), from ``mtmd_tokenize`` itself with a one-token clip."""
    ctx = audio._ctx
    text = text_with_marker.encode()
    inp = mtmd.mtmd_input_text()
    inp.text, inp.text_len, inp.add_special, inp.parse_special = text, len(text), False, True
    pcm = np.zeros(SAMPLES_PER_TOKEN, np.float32)
    bitmap = mtmd.mtmd_bitmap_init_from_audio(pcm.size, pcm.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
    chunks = mtmd.mtmd_input_chunks_init()
    before: list[int] = []
    after: list[int] = []
    try:
        if mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(inp), (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) != 0:
            raise RuntimeError("mtmd_tokenize failed on the turn's template")
        seen_audio = False
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(chunk) != mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                seen_audio = True
                continue
            n = ctypes.c_size_t(0)
            ptr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            (after if seen_audio else before).extend(ptr[j] for j in range(n.value))
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
    return before, after


def decode_embeddings(llm: "Llama", embd: np.ndarray, pos: int, seq_id: int = 0, logits_last: bool = False) -> int:
    """Decode float32 [n, n_embd] embeddings into ``llm``'s context at positions ``pos..pos+n-1`` of
    ``seq_id``, in batches of the context's ``n_batch``; returns ``pos + n``.

    :raises RuntimeError: ``llama_decode`` failed (the positions decoded so far stay in the cache).
    """
    n, n_embd = embd.shape
    step = max(1, int(llama_cpp.llama_n_batch(llm.ctx)))
    for i in range(0, n, step):
        part = np.ascontiguousarray(embd[i : i + step], dtype=np.float32)
        k = len(part)
        batch = llama_cpp.llama_batch_init(k, n_embd, 1)
        try:
            ctypes.memmove(batch.embd, part.ctypes.data, part.nbytes)
            for j in range(k):
                batch.pos[j] = pos + i + j
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = seq_id
                batch.logits[j] = bool(logits_last and i + j == n - 1)
            batch.n_tokens = k
            rc = llama_cpp.llama_decode(llm.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} on audio embeddings")
        finally:
            llama_cpp.llama_batch_free(batch)
    return pos + n


def decode_tokens(llm: "Llama", tokens: list[int], pos: int, seq_id: int = 0, n_batch: Optional[int] = None,
                  on_batch: Optional[Callable[[list[int], int], None]] = None) -> int:
    """Decode token ids into ``llm``'s context at positions ``pos..pos+n-1`` of ``seq_id``, in batches of
    ``n_batch`` (default and at most the context's ``n_batch``), with logits for the last token of each batch
    (so the last one is ready for ``llm.sample()``). For sequence 0, ``llm``'s own bookkeeping
    (``n_tokens``, ``input_ids``) follows each batch. ``on_batch(chunk, pos)`` is called after each batch.
    Returns ``pos + n``. Nothing is removed from the cache first (the caller does that).

    :raises RuntimeError: ``llama_decode`` failed (the batches before it stay in the cache).
    """
    step = max(1, min(int(n_batch or 1 << 30), int(llama_cpp.llama_n_batch(llm.ctx))))
    b = llm._batch.batch
    for i in range(0, len(tokens), step):
        chunk = tokens[i : i + step]
        b.n_tokens = len(chunk)
        for j, t in enumerate(chunk):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = t, pos + j, 1, False
            b.seq_id[j][0] = seq_id
        b.logits[len(chunk) - 1] = True
        llm._ctx.decode(llm._batch)
        if seq_id == 0:
            llm.input_ids[pos : pos + len(chunk)] = chunk
            llm.n_tokens = pos + len(chunk)
        if on_batch is not None:
            on_batch(chunk, pos)
        pos += len(chunk)
    return pos


class StreamedAudioTurn:
    """One user turn of audio, pre-filled into the KV cache as it arrives.

    :param audio: the model's :class:`~appliance.mtmd_audio.MtmdAudio`.
    :param text_with_marker: the turn's prompt with :data:`~appliance.mtmd_audio.MEDIA_MARKER` where the
        audio goes, exactly as :meth:`MtmdAudio.eval_prompt` would get it.
    :param n_past: the position the turn starts at (``llm.n_tokens`` for sequence 0).
    :param left_context_s: audio re-encoded before each window's first new token, s.
    :param seq_id: the KV sequence.

    Use: :meth:`feed` with all the audio so far, as often as wanted (it decodes only what became final);
    :meth:`finish` at the end of the turn; or :meth:`rollback` if the speech was a blip, a backchannel or
    noise. Not thread-safe: the engine's thread owns it.
    """

    def __init__(self, audio: MtmdAudio, text_with_marker: str, n_past: int, left_context_s: float = LEFT_CONTEXT_S,
                 seq_id: int = 0):
        self.audio = audio
        self.llm = audio._llm
        self.encoder = AudioEncoder(audio)
        self.seq_id = seq_id
        self.start = int(n_past)
        self.left_tokens = int(round(left_context_s * 1000 / 40))
        before, self._after = template_around_audio(audio, text_with_marker)
        self.done = 0  # audio tokens decoded so far
        self.encoded_s = 0.0  # seconds of audio run through the encoder (windows overlap)
        self.windows = 0  # encoder calls
        self.encode_s = self.decode_s = 0.0  # wall time in the encoder and in llama_decode, s
        self._fed: Optional[np.ndarray] = None  # the audio of the last feed (its decoded part must not change)
        self._whole: Optional[int] = None  # tokens of the last feed if it was final (its last token has no lookahead)
        self.redone = 0  # final tokens rolled back because more audio followed
        self.prepared = False  # opened before the user spoke (Engine.prepare_turn)
        self.llm._ctx.kv_cache_seq_rm(seq_id, self.start, -1)
        self.pos = decode_tokens(self.llm, before, self.start, seq_id)
        self._audio_start = self.pos

    @property
    def after_tokens(self) -> int:
        """Template tokens after the audio (``<audio|>`` and the rest of the turn), decoded at :meth:`finish`."""
        return len(self._after)

    def matches(self, pcm: np.ndarray) -> bool:
        """True if ``pcm`` (the turn's final audio) begins with the audio decoded so far: the same samples
        up to the end of the last decoded token and its held-back right context (none after a final feed).
        If not (another clip: an interjection joined to what followed it), the turn must be rolled back and
        encoded whole."""
        if self._fed is None or self.done == 0:
            return True
        # The samples the decoded tokens were encoded from: up to the held-back token's end (a final feed:
        # its last token's), never the last feed's part of a token, which the encoder did not see.
        ahead = 0 if self._whole is not None else LOOKAHEAD_TOKENS
        n = min(len(self._fed) // SAMPLES_PER_TOKEN, self.done + ahead) * SAMPLES_PER_TOKEN
        return len(pcm) >= max(n, self.done * SAMPLES_PER_TOKEN) and np.array_equal(pcm[:n], self._fed[:n])

    def _decode_audio(self, pcm: np.ndarray, upto: int) -> None:
        """Encode the window that ends at token ``available`` and decode tokens ``[done, upto)``."""
        available = len(pcm) // SAMPLES_PER_TOKEN
        if upto <= self.done:
            return
        first = max(0, self.done - self.left_tokens)
        window = pcm[first * SAMPLES_PER_TOKEN : available * SAMPLES_PER_TOKEN]
        t0 = time.perf_counter()
        embd = self.encoder.encode(window)
        t1 = time.perf_counter()
        self.encoded_s += len(window) / 16000.0
        self.windows += 1
        new = embd[self.done - first : upto - first]
        self.pos = decode_embeddings(self.llm, new, self.pos, self.seq_id)
        self.encode_s += t1 - t0
        self.decode_s += time.perf_counter() - t1
        if self.seq_id == 0:
            self.llm.input_ids[self.pos - len(new) : self.pos] = self.audio.audio_placeholder
            self.llm.n_tokens = self.pos
        self.done = upto

    def _truncate(self, keep: int) -> None:
        """Roll the audio tokens from ``keep`` on out of the cache."""
        self.llm._ctx.kv_cache_seq_rm(self.seq_id, self._audio_start + keep, -1)
        self.done, self.pos = keep, self._audio_start + keep
        if self.seq_id == 0:
            self.llm.n_tokens = self.pos

    def feed(self, pcm: np.ndarray, final: bool = False) -> int:
        """Decode the audio tokens of ``pcm`` (float32 [n], all the turn's audio so far, 16 kHz) that are
        final: all but the last ``LOOKAHEAD_TOKENS`` of its whole 40 ms tokens, or all of them with
        ``final`` (the utterance pauses here: ``pcm`` is what an end of turn now would hold). A final feed's
        last token is rolled back and decoded again when a later feed brings more audio. Returns the
        tokens decoded so far.

        :raises RuntimeError: the encoder or ``llama_decode`` failed (roll the turn back).
        """
        available = len(pcm) // SAMPLES_PER_TOKEN
        upto = available if final else available - LOOKAHEAD_TOKENS
        if upto > self.done or (final and self._whole is not None and available != self._whole):
            if self._whole is not None and self.done >= self._whole:  # its last token lacked what follows
                self._truncate(min(self.done, self._whole - 1))
                self.redone += 1
            self._whole = None
            self._fed = pcm
            self._decode_audio(pcm, upto)
            if final and self.done == available:
                self._whole = available
        return self.done

    def pending_tokens(self, pcm: np.ndarray) -> int:
        """Audio tokens of ``pcm`` that :meth:`finish` would still decode (the end of turn's share)."""
        return len(pcm) // SAMPLES_PER_TOKEN - self._keep(len(pcm) // SAMPLES_PER_TOKEN)

    def _keep(self, available: int) -> int:
        """Audio tokens already decoded that a turn of ``available`` tokens keeps: all of them if its clip
        is the last final feed's, else not the held-back or final token."""
        if self._whole is not None and available == self._whole:
            return self.done
        keep = min(self.done, max(0, available - LOOKAHEAD_TOKENS))
        return min(keep, self._whole - 1) if self._whole is not None else keep

    def finish(self, pcm: np.ndarray) -> tuple[int, int]:
        """The end of the turn: decode the remaining audio tokens of ``pcm`` (the whole turn's audio, which
        :meth:`matches` what was fed; whole 40 ms tokens, a shorter tail is dropped), then ``<audio|>`` and
        the rest of the template, with logits for sampling. If ``pcm`` ends before what was already decoded
        and its held-back token (the utterance was cut where its speech ended, and a feed had gone on into
        the pause), the tokens past its end are rolled back first. Returns ``(new n_past, audio tokens left
        at the end of turn)``.

        :raises RuntimeError: the encoder or ``llama_decode`` failed (roll the turn back).
        """
        available = len(pcm) // SAMPLES_PER_TOKEN
        keep = self._keep(available)  # all of it when the clip is the last final feed's
        if keep < self.done:
            self._truncate(keep)
        self._whole = None
        left = available - self.done
        self._decode_audio(pcm, available)
        self.pos = decode_tokens(self.llm, self._after, self.pos, self.seq_id)
        if self.seq_id == 0:
            self.llm._requires_eval = False
        self.audio.last_audio_tokens = self.done
        return self.pos, left

    def rollback(self) -> None:
        """Take the turn out of the cache again (the speech was a blip, a backchannel, noise)."""
        self.llm._ctx.kv_cache_seq_rm(self.seq_id, self.start, -1)
        if self.seq_id == 0:
            self.llm.n_tokens = self.start
        self.pos, self.done, self._whole = self.start, 0, None
