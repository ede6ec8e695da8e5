"""Native audio input for Gemma 4 through llama.cpp's multimodal (``mtmd``) path.

:class:`MtmdAudio` evaluates a prompt that contains raw audio into an existing
``llama_cpp.Llama`` context **at a given position, without clearing the KV
cache**, so a conversation can be extended turn by turn.  The stock
``llama_cpp.llama_chat_format.MTMDChatHandler`` / ``Gemma4ChatHandler`` always
reset the context and re-evaluate the whole chat; this wrapper does the
incremental append instead.

It is a thin layer over the ctypes bindings in ``llama_cpp.mtmd_cpp``
(llama-cpp-python 0.3.36) and uses only their public functions.

How a call works
----------------
1. The prompt text carries ``mtmd_default_marker()`` (``"<__media__>"``) where
   the audio goes.  mtmd replaces the marker with ``<|audio>`` + the audio
   embeddings + ``<audio|>`` itself, so the prompt must NOT contain those
   tokens (nor ``<|audio|>``) around the marker.  Example turn::

       "<|turn>user\\n<__media__><turn|>\\n<|turn>model\\n"

2. ``mtmd_bitmap_init_from_audio`` wraps the mono float32 16 kHz PCM;
   ``mtmd_tokenize`` (``parse_special=True``) splits the prompt into
   text / audio chunks; ``mtmd_helper_eval_chunks`` encodes the audio
   (log-mel front end -> conformer -> projector) and decodes every chunk into
   ``llm``'s context starting at ``n_past`` with ``logits_last=True``.
3. The Python-side bookkeeping of ``llm`` is brought up to date (see below).

Audio facts (Gemma 4 ``gemma4a`` projector)
------------------------------------------
* Sample rate: 16000 Hz (``mtmd_get_audio_sample_rate``), mono float32 in
  [-1, 1].
* Tokens: 10 ms mel hop, two stride-2 convolutions -> 40 ms per token,
  i.e. **25 audio tokens per second** (the count is fixed by the front end,
  not by the weights).  Measured with the tiny test fixture
  (``tests/fixtures/tiny_gemma4``): 1.0 s of audio -> 25 audio embedding
  tokens; with the ``<|audio>`` / ``<audio|>`` wrapper that mtmd adds, the
  audio part of a prompt occupies 27 positions.
* Maximum input: **30 s** per clip (Gemma 4's audio limit; mtmd itself would
  split longer input into separate 30 s chunks).  :meth:`MtmdAudio.eval_prompt`
  rejects longer clips with ``ValueError`` (``MAX_AUDIO_SECONDS``).

Keeping ``llm`` consistent after an mtmd evaluation
---------------------------------------------------
mtmd decodes straight into ``llm.ctx`` (the ``llama_context``), bypassing
``Llama.eval``.  ``Llama`` keeps its own Python-side mirror:

* ``llm.n_tokens``  - number of positions in the KV cache; ``Llama.eval``
  first calls ``kv_cache_seq_rm(-1, n_tokens, -1)`` and then decodes at
  positions ``n_tokens, n_tokens+1, ...``.  It MUST equal the new ``n_past``,
  otherwise the next ``llm.eval`` either erases the audio from the cache
  (``n_tokens`` too small) or leaves a hole (too large).
* ``llm.input_ids[:n_tokens]`` - the tokens at those positions; used by
  ``Llama.generate`` / ``create_completion`` for prefix matching and passed to
  Python logits processors.
* ``llm._requires_eval`` - ``False`` once fresh logits exist.
* ``llm.scores`` - only filled when ``logits_all=True``; not needed for
  sampling (``llm.sample()`` reads logits from the C context).

:meth:`MtmdAudio.eval_prompt` therefore does, after a successful evaluation::

    llm.n_tokens = new_n_past
    llm.input_ids[n_past:new_n_past] = <text tokens of the text chunks,
                                        AUDIO_PLACEHOLDER for audio positions>
    llm._requires_eval = False

``AUDIO_PLACEHOLDER`` is the model's ``<|audio|>`` token id (the id Hugging
Face uses for audio soft tokens) when the vocabulary has it, else ``-1``.
The caller then continues with the ordinary ``Llama`` API, no extra steps::

    new_n_past, n = audio.eval_prompt(prompt, pcm, n_past=llm.n_tokens)
    tok = llm.sample(temp=0.0)          # logits of the last prompt position
    while tok not in stop_ids:
        llm.eval([tok])                  # decodes at position llm.n_tokens
        tok = llm.sample(temp=0.0)
    # next user turn: eval_prompt(..., n_past=llm.n_tokens) again

Sampling works because ``logits_last=True`` makes the last prompt token (always
text: mtmd appends ``<audio|>`` after the audio, and the turn template follows)
produce logits, and ``llm.sample()`` / ``llama_sampler_sample(smpl, llm.ctx,
-1)`` read the logits of the last output row of the last decode.

``llm.generate(tokens)`` (and ``create_completion``, which calls it) is only
safe when ``tokens`` is exactly ``llm.input_ids[:llm.n_tokens].tolist()``: that
is an exact cache hit and, because ``_requires_eval`` is ``False``, it samples
from the live logits without re-evaluating (this is what the stock chat
handler relies on).  Any other token list rewinds ``n_tokens`` to the longest
prefix of ``input_ids`` that matches it and re-decodes the rest as plain
tokens, which loses the audio (the placeholder ids are not audio).  Do not call
``llm.reset()`` unless starting over (it sets ``n_tokens = 0``; the next
``eval`` then removes everything from the cache).

Thread safety: one ``MtmdAudio`` per ``Llama``; neither is thread-safe.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import TYPE_CHECKING, Optional

import numpy as np

import llama_cpp
import llama_cpp.mtmd_cpp as mtmd

if TYPE_CHECKING:  # pragma: no cover
    from llama_cpp import Llama

__all__ = ["AudioModelError", "MtmdAudio", "MAX_AUDIO_SECONDS", "MEDIA_MARKER"]

logger = logging.getLogger(__name__)

#: Longest clip accepted by :meth:`MtmdAudio.eval_prompt` (Gemma 4 audio limit).
MAX_AUDIO_SECONDS = 30.0

#: Placeholder that marks where the audio goes in the prompt text.
MEDIA_MARKER: str = mtmd.mtmd_default_marker().decode("utf-8")


class AudioModelError(ValueError):
    """The audio projector (mmproj) could not be loaded or has no audio encoder."""


# --------------------------------------------------------------------------
# mtmd / clip log routing
# --------------------------------------------------------------------------
# mtmd and its clip encoder print to stderr by default.  Route them into the
# ``logging`` module (ggml.h: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5 continues the previous
# line; INFO goes to DEBUG, it is per-call chatter) and remember the last error lines so load failures can
# name the reason.
_GGML_LEVELS = {0: logging.DEBUG, 1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
_log_state = {"level": logging.DEBUG, "errors": []}


@llama_cpp.llama_log_callback
def _mtmd_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:  # pragma: no cover - C callback
    try:
        if level != 5:  # 5 = GGML_LOG_LEVEL_CONT: continuation of previous line
            _log_state["level"] = _GGML_LEVELS.get(level, logging.DEBUG)
        msg = text.decode("utf-8", "replace").rstrip()
        if not msg:
            return
        lvl = _log_state["level"]
        if lvl >= logging.ERROR:
            errors = _log_state["errors"]
            errors.append(msg)
            del errors[:-4]
        logger.log(lvl, "%s", msg)
    except Exception:
        pass


mtmd.mtmd_helper_log_set(_mtmd_log, ctypes.c_void_p(0))


def _one_line(text: str) -> str:
    return " ".join(text.split())


class MtmdAudio:
    """Evaluate prompts containing audio into an existing ``Llama`` context.

    Args:
        llm: a loaded ``llama_cpp.Llama`` (text GGUF of the same model family
            as the projector).
        mmproj_path: the multimodal projector GGUF (``mmproj``) with the
            audio encoder.
        n_threads: CPU threads for the audio encoder.
        warmup: run the encoder once on a dummy clip at load (moves the
            first-call graph allocation out of the first user turn).

    Raises:
        AudioModelError: one-line message naming ``mmproj_path`` if the file
            is missing, cannot be loaded, or has no audio encoder.
    """

    sample_rate: int

    def __init__(self, llm: "Llama", mmproj_path: str, n_threads: int = 2, warmup: bool = True):
        self._llm = llm
        self._ctx: Optional[int] = None
        self.mmproj_path = os.fspath(mmproj_path)
        #: audio embedding tokens (without <|audio>/<audio|>) of the last eval_prompt call
        self.last_audio_tokens = 0

        if not os.path.isfile(self.mmproj_path):
            raise AudioModelError(f"audio projector not found: {self.mmproj_path}")

        params = mtmd.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        params.n_threads = int(n_threads)
        params.warmup = bool(warmup)
        params.flash_attn_type = llm.context_params.flash_attn_type

        _log_state["errors"] = []
        ctx = mtmd.mtmd_init_from_file(self.mmproj_path.encode("utf-8"), llm.model, params)
        if not ctx:
            reason = "; ".join(_log_state["errors"]) or "mtmd_init_from_file failed"
            raise AudioModelError(
                _one_line(f"cannot load audio projector {self.mmproj_path}: {reason}")
            )
        self._ctx = ctx
        if not mtmd.mtmd_support_audio(ctx):
            self.close()
            raise AudioModelError(f"projector has no audio encoder: {self.mmproj_path}")

        self.sample_rate = int(mtmd.mtmd_get_audio_sample_rate(ctx))

        placeholder = llm.tokenize(b"<|audio|>", add_bos=False, special=True)
        #: value written to ``llm.input_ids`` at audio-embedding positions
        self.audio_placeholder = placeholder[0] if len(placeholder) == 1 else -1

        # Free the mtmd context before the model it points to is freed.
        llm._stack.callback(self.close)

    # ------------------------------------------------------------------
    def __enter__(self) -> "MtmdAudio":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Free the mtmd context (idempotent)."""
        if self._ctx is not None:
            mtmd.mtmd_free(self._ctx)
            self._ctx = None

    # ------------------------------------------------------------------
    def eval_prompt(
        self,
        text_with_marker: str,
        audio: np.ndarray,
        n_past: int,
        n_batch: int = 512,
        *,
        add_special: Optional[bool] = None,
        seq_id: int = 0,
    ) -> tuple[int, int]:
        """Decode ``text_with_marker`` with ``audio`` at the marker into ``llm``.

        Args:
            text_with_marker: prompt text containing :data:`MEDIA_MARKER`
                exactly once; control tokens (``<|turn>`` ...) are parsed.
            audio: mono float32 PCM at :attr:`sample_rate` (16 kHz), at most
                :data:`MAX_AUDIO_SECONDS` long.
            n_past: position to start at; normally ``llm.n_tokens``.  Anything
                in the cache at positions ``>= n_past`` is discarded first;
                positions below are kept (no clear).
            n_batch: max tokens per decode call; clamped to the context's
                ``n_batch`` (a larger value would abort inside mtmd).
            add_special: prepend BOS; default: only when ``n_past == 0``.
            seq_id: sequence id in the KV cache. ``llm``'s own bookkeeping
                (``n_tokens``, ``input_ids``) tracks sequence 0 only; for any
                other sequence the caller tracks positions itself.

        Returns:
            ``(new_n_past, n_tokens_evaluated)``.  ``llm.n_tokens`` is set to
            ``new_n_past`` and the logits of the last position are ready for
            ``llm.sample()``.
        """
        if self._ctx is None:
            raise RuntimeError("MtmdAudio is closed")
        llm = self._llm

        if text_with_marker.count(MEDIA_MARKER) != 1:
            raise ValueError(f"prompt must contain the media marker {MEDIA_MARKER!r} exactly once")
        pcm = np.ascontiguousarray(audio, dtype=np.float32)
        if pcm.ndim != 1:
            raise ValueError(f"audio must be mono (1-D), got shape {pcm.shape}")
        if pcm.size == 0:
            raise ValueError("audio is empty")
        if not np.all(np.isfinite(pcm)):
            raise ValueError("audio contains NaN or inf")
        seconds = pcm.size / self.sample_rate
        if seconds > MAX_AUDIO_SECONDS:
            raise ValueError(f"audio is {seconds:.1f} s long; the limit is {MAX_AUDIO_SECONDS:.0f} s")
        n_past = int(n_past)
        if n_past < 0 or (seq_id == 0 and n_past > llm.n_tokens):
            raise ValueError(f"n_past={n_past} is outside 0..llm.n_tokens ({llm.n_tokens})")
        if add_special is None:
            add_special = n_past == 0
        # mtmd adds up to n_batch tokens/embeddings to one llama_batch_ext; more than the
        # context's n_batch aborts the process (GGML_ASSERT in mtmd-helper), so clamp.
        n_batch = max(1, min(int(n_batch), int(llama_cpp.llama_n_batch(llm.ctx))))

        text_bytes = text_with_marker.encode("utf-8")
        inp = mtmd.mtmd_input_text()
        inp.text = text_bytes
        inp.text_len = len(text_bytes)
        inp.add_special = bool(add_special)
        inp.parse_special = True

        bitmap = mtmd.mtmd_bitmap_init_from_audio(pcm.size, pcm.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
        if not bitmap:
            raise RuntimeError("mtmd_bitmap_init_from_audio failed")
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
            rc = mtmd.mtmd_tokenize(self._ctx, chunks, ctypes.byref(inp), bitmaps, 1)
            if rc != 0:
                raise RuntimeError(f"mtmd_tokenize failed (code {rc})")

            ids, n_audio = self._chunk_ids(chunks)
            n_pos = int(mtmd.mtmd_helper_get_n_pos(chunks))
            if n_past + n_pos > llm.n_ctx():
                raise ValueError(f"prompt needs {n_pos} positions at n_past={n_past}; n_ctx is {llm.n_ctx()}")

            # Evaluate at n_past: drop whatever sits at positions >= n_past
            # (as Llama.eval does), keep everything before it.
            llm._ctx.kv_cache_seq_rm(seq_id, n_past, -1)
            new_n_past = llama_cpp.llama_pos(0)
            rc = mtmd.mtmd_helper_eval_chunks(
                self._ctx, llm.ctx, chunks, n_past, seq_id, n_batch, True, ctypes.byref(new_n_past)
            )
            if rc != 0:
                # The cache may hold part of the prompt: roll it back.
                llm._ctx.kv_cache_seq_rm(seq_id, n_past, -1)
                if seq_id == 0:
                    llm.n_tokens = n_past
                raise RuntimeError(f"mtmd_helper_eval_chunks failed (code {rc})")
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)

        end = int(new_n_past.value)
        if end - n_past != len(ids):  # pragma: no cover - would mean an mtmd change
            raise RuntimeError(f"mtmd advanced {end - n_past} positions, expected {len(ids)}")
        if seq_id == 0:
            llm.input_ids[n_past:end] = ids
            llm.n_tokens = end
            llm._requires_eval = False
        self.last_audio_tokens = n_audio
        return end, end - n_past

    # ------------------------------------------------------------------
    def _chunk_ids(self, chunks) -> tuple[list[int], int]:
        """Token ids per position (audio -> placeholder) and the audio token count."""
        ids: list[int] = []
        n_audio = 0
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            kind = mtmd.mtmd_input_chunk_get_type(chunk)
            if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t(0)
                ptr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                ids.extend(ptr[j] for j in range(n.value))
            else:
                n_pos = int(mtmd.mtmd_input_chunk_get_n_pos(chunk))
                n_audio += int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
                ids.extend([self.audio_placeholder] * n_pos)
        return ids, n_audio

    @staticmethod
    def expected_audio_tokens(n_samples: int) -> int:
        """Audio embedding tokens mtmd produces for ``n_samples`` at 16 kHz
        (Gemma 4 front end: 20 ms window, 10 ms hop, two stride-2 convs)."""
        frames = (n_samples + 160 - 321) // 160 + 1
        n = max(frames, 1)
        for _ in range(2):
            n = (n - 1) // 2 + 1
        return n
