"""The LLM engine: one llama.cpp context, the conversation in its KV cache, appended to turn by turn.

KV bookkeeping: the cache always holds ``[system prompt][turn 1]...[turn n]`` at positions
``0..n_past-1``. A turn appends the user's part (audio through the mtmd projector, or text) and the
reply as it is generated; nothing already in the cache is evaluated again on a normal turn. When a reply
is interrupted, the unspoken tail of the reply is rolled back (positions removed from the cache) and the
text that was actually played is evaluated in its place, so the model remembers what the user heard.
A full rebuild (re-prefill of the kept history) happens only when the history passes its token budget.

The context uses ``swa_full=True``: Gemma 3/4 use a sliding-window cache (window 512) that otherwise
discards positions a rollback would need (llama-cpp-python PR #2180, llama.rn #396: "failed to find a
memory slot").

Why one module of about a thousand lines: every method here reads or moves ``n_past`` and the two KV
sequences of one llama.cpp context (a turn, a streamed audio window, a rollback, the background rebuild,
the pruning), and their invariant (the cache holds exactly the kept history, and nothing asks llama.cpp
for a cell that is not free) is checked in one place. The pieces without that state live elsewhere:
``audio_prefill.py`` (streamed encoding), ``mtmd_audio.py`` (the mtmd bindings), ``history.py``.
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from .errors import UserError

log = logging.getLogger(__name__)

AUDIO_MARKER = "<__media__>"  # mtmd_default_marker(): where mtmd puts the audio tokens

_llama_log_state = {"level": logging.DEBUG}


def _route_llama_log() -> None:
    """Send llama.cpp's log lines (ggml.h levels: DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5) to the
    ``logging`` module instead of stderr: WARN as INFO (e.g. "using full-size SWA cache" is expected here),
    ERROR as ERROR. The callback object is kept alive at module level."""
    import ctypes

    import llama_cpp

    levels = {3: logging.INFO, 4: logging.ERROR}
    llama_log = logging.getLogger("llama_cpp")

    @llama_cpp.llama_log_callback
    def callback(level, text, user_data):  # pragma: no cover - called from C
        try:
            if level != 5:
                _llama_log_state["level"] = levels.get(level, logging.DEBUG)
            msg = text.decode("utf-8", "replace").rstrip()
            if msg:
                if _llama_log_state["level"] >= logging.ERROR:
                    errors = _llama_log_state.setdefault("errors", [])
                    errors.append(msg)
                    del errors[:-4]
                llama_log.log(_llama_log_state["level"], "%s", msg)
        except Exception:
            pass

    _llama_log_state["callback"] = callback
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))


@contextlib.contextmanager
def quiet_llama_logs() -> Iterator[Callable[[], str]]:
    """While a model file is being loaded, llama.cpp's and mtmd's log lines print nothing (a bad file
    would otherwise put 2–4 native log lines before our one-line error). Yields ``reason()``: the last
    error lines llama.cpp logged inside the block, joined into one line ("" if none), for that error."""
    from . import mtmd_audio  # its import routes mtmd's and clip's log lines to its logger

    if "callback" not in _llama_log_state:
        _route_llama_log()
    loggers = [logging.getLogger("llama_cpp"), logging.getLogger(mtmd_audio.__name__)]
    saved = [lg.disabled for lg in loggers]
    _llama_log_state["errors"] = []
    mtmd_audio._log_state["errors"] = []
    for lg in loggers:
        lg.disabled = True

    def reason() -> str:
        return " ".join(" ".join(_llama_log_state["errors"] + mtmd_audio._log_state["errors"]).split())[:200]

    try:
        yield reason
    finally:
        for lg, was in zip(loggers, saved):
            lg.disabled = was


class CacheFull(RuntimeError):
    """A decode would need more cells of the shared KV cache than are free (counted over both sequences).
    Raised before llama.cpp is asked, so nothing is half-evaluated; the engine then gives way (drops the
    background rebuild, or prunes the history at once) and tries again."""


class NothingToHear(ValueError):
    """A turn with neither audio the model can hear nor a transcript: a text-only model (the embedded
    test model) given speech the replay's scenario has no words for, such as a fragment of the user's
    speech that the VAD cut off. The turn is dropped, with one line in the log."""


@dataclass(frozen=True)
class ChatFormat:
    """The turn markup of a model family, as in its chat template."""

    turn_start: str  # followed by the role and a newline
    turn_end: str  # the end-of-turn marker, also the stop token
    model_role: str = "model"
    system_role: Optional[str] = None  # None: the system prompt goes into the first user turn

    def user_turn(self, content: str) -> str:
        return f"{self.turn_start}user\n{content}{self.turn_end}\n{self.turn_start}{self.model_role}\n"

    def system_turn(self, content: str) -> str:
        return f"{self.turn_start}{self.system_role}\n{content}{self.turn_end}\n" if self.system_role else ""

    def close_reply(self) -> str:
        return f"{self.turn_end}\n"

    def closed(self, role: str, content: str) -> str:
        """A whole past turn, as it is rebuilt into the cache."""
        name = "user" if role == "user" else self.model_role
        return f"{self.turn_start}{name}\n{content}{self.turn_end}\n"


# Gemma 2/3: <start_of_turn>user ... <end_of_turn>; no system role (Gemma 3 model card, "Prompt formatting").
GEMMA3 = ChatFormat("<start_of_turn>", "<end_of_turn>")
# Gemma 4: <|turn>role ... <turn|>, with a system role (the Gemma 4 chat template in its tokenizer config).
GEMMA4 = ChatFormat("<|turn>", "<turn|>", system_role="system")
FORMATS = {"gemma3": GEMMA3, "gemma2": GEMMA3, "gemma": GEMMA3, "gemma4": GEMMA4}


@dataclass
class Message:
    """One side of an exchange as remembered. ``audio`` (float32 16 kHz) is the user's speech when the
    model heard it; ``text`` is then a placeholder unless a transcript is known."""

    role: str  # "user" or "model"
    text: str
    audio: Optional[np.ndarray] = None
    store_id: Optional[int] = None
    context: str = ""  # a user turn's opening line (the local date and time), as the model read it


@dataclass
class TurnResult:
    """Figures of one turn, for metrics and the benchmark."""

    prefill_tokens: int = 0
    generated_tokens: int = 0
    text: str = ""
    cancelled: bool = False
    input: str = "text"
    prefill_ms: float = 0.0
    first_token_ms: Optional[float] = None
    streamed: bool = False  # the audio was pre-filled while the user spoke (stream_audio), not encoded whole
    audio_tokens_left: Optional[int] = None  # streamed: audio tokens still to decode at the end of the turn
    tail_tokens: Optional[int] = None  # streamed: positions decoded at the end of the turn (audio + template)
    stream_windows: int = 0  # streamed: encoder calls while the user spoke, and at the end of the turn
    stream_encoded_s: float = 0.0  # streamed: seconds of audio through the encoder (windows overlap)
    first_piece_tokens: Optional[int] = None  # tokens generated when the splitter gave its first piece to TTS
    stream_prepared: bool = False  # streamed: the turn's opening was in the cache before the user spoke


_PARAMS_LOCK = threading.Lock()
ACTIVE, SHADOW = 0, 1  # KV sequences: the live conversation, and the cache being rebuilt behind it
USER_AUDIO_PLACEHOLDER = "(spoken)"


def _gguf_architecture(path: Path) -> Optional[str]:
    """``general.architecture`` from the GGUF header (None if it cannot be read: llama.cpp then says why)."""
    from .gguf import read_gguf

    try:
        return str(read_gguf(path).meta.get("general.architecture") or "")
    except Exception:
        return None


def _load_llama(path: Path, **kw):
    """``llama_cpp.Llama`` with two KV sequences in one unified cache (llama-cpp-python 0.3.36 has no
    constructor argument for ``n_seq_max``/``kv_unified``, so its default context parameters are
    adjusted for the duration of the call)."""
    import llama_cpp
    import llama_cpp.llama_cpp as lc

    with _PARAMS_LOCK:
        original = lc.llama_context_default_params
        original_model = lc.llama_model_default_params

        def two_sequences():
            params = original()
            params.n_seq_max = 2
            params.kv_unified = True
            return params

        def no_amx():
            params = original_model()
            params.use_extra_bufts = False
            return params

        lc.llama_context_default_params = two_sequences
        if _cpu_has_amx():
            lc.llama_model_default_params = no_amx
        try:
            return llama_cpp.Llama(model_path=str(path), **kw)
        finally:
            lc.llama_context_default_params = original
            lc.llama_model_default_params = original_model


def _cpu_has_amx() -> bool:
    """True on an x86 CPU with AMX tiles (Intel Sapphire Rapids and later). There, llama.cpp's AMX weight
    buffer (one of its "extra buffer types") crashes in ``ggml_backend_amx_mul_mat`` on the first decode
    of Gemma 3 270M Q4_K_M (SIGSEGV, llama-cpp-python 0.3.36), so the extra buffer types are switched off.
    Elsewhere, e.g. on the Pi 5's Arm cores, they stay on (they hold the repacked Q4_0 weights there)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        pass
    return False


class _Rebuild:
    """A cache being rebuilt in the SHADOW sequence: a queue of messages still to evaluate into it."""

    def __init__(self, messages: list[Message], reason: str):
        self.pending: list[Message] = list(messages)
        self.kept: list[Message] = []  # evaluated into the shadow, in order
        self.n = 0  # positions filled in the shadow
        self.ids: list[int] = []
        self.reason = reason
        self.started = time.perf_counter()
        self.tokens = 0


def _gguf_file(name, key: str, missing: str, what: str) -> Path:
    """The GGUF at ``name``, checked before llama.cpp opens it (its own reasons come cut mid-word: "failed to l").

    :param key: the config key that names the file (``model.gguf``, ``model.mmproj``), for the messages.
    :param missing: the message's text after the path when the file does not exist.
    :param what: what the key should name, for the messages (e.g. "the model's .gguf").
    :raises UserError: not a regular file (a directory, FIFO or device), missing, or empty (0 bytes).
    """
    path = Path(name)
    if path.exists() and not path.is_file():
        raise UserError(f"{path}: is not a regular file (a directory, FIFO or device); set {key} in the config file "
                        f"to {what}")
    if not path.is_file():
        raise UserError(f"{path}: {missing}")
    if path.stat().st_size == 0:
        raise UserError(f"{path}: the file is empty (0 bytes); set {key} in the config file to {what} (an "
                        "interrupted download leaves an empty file: fetch it again)")
    return path


class Engine:
    """One llama.cpp model and context holding the conversation.

    KV sequences: ``ACTIVE`` (0) holds ``[system][turn 1]..[turn n]`` and serves every turn;
    ``SHADOW`` (1) is where a pruned or restored history is rebuilt in small batches while the
    appliance is idle. When the shadow has caught up, it replaces the active sequence in one cheap
    copy, so no turn ever waits for a re-prefill of the history.

    :param gguf: path of the model GGUF.
    :param mmproj: path of the audio projector GGUF, or None for a text-only model (it cannot hear).
    :param kv_cache_type: ``"f16"``, ``"q8_0"`` or ``"q4_0"``; a quantised V cache needs flash attention,
        which is switched on.
    :param history_budget_tokens: when the active sequence passes this many tokens, the oldest exchanges
        are dropped (down to half of it) in a background rebuild. ``n_ctx`` must hold the budget, the
        half-size shadow and one turn.
    :param store: where the history persists (:class:`appliance.history.HistoryStore`), or None.
    :param stream_prefill: pre-fill the user's audio while they speak (:meth:`stream_audio`); False: each
        turn's clip is encoded whole after the turn (for comparison).
    :param stream_left_context_s: audio re-encoded before each streamed window's new tokens, s (default
        :data:`appliance.audio_prefill.LEFT_CONTEXT_S`).
    :param stream_final_at_pause: a feed made at a pause (:meth:`stream_audio` with ``at_pause``) decodes
        its last audio token too, so a turn that ends there has no audio left to encode; False: it is held
        back like every window's last token.
    :raises UserError: a missing or unloadable model file (one line naming the file).
    """

    def __init__(self, gguf: str | Path, mmproj: Optional[str | Path] = None, *, n_ctx: int = 4096,
                 n_threads: int = 4, n_batch: int = 512, kv_cache_type: str = "q4_0",
                 system_prompt: str = "", max_reply_tokens: int = 160, temperature: float = 0.7,
                 top_p: float = 0.95, seed: int = 0, history_budget_tokens: int = 2048,
                 examples: Optional[list[tuple[str, str]]] = None, store=None, one_sentence: bool = False,
                 stream_prefill: bool = True, stream_left_context_s: Optional[float] = None,
                 stream_final_at_pause: bool = True):
        import llama_cpp

        if "callback" not in _llama_log_state:
            _route_llama_log()
        path = _gguf_file(gguf, "model.gguf", "model file not found; set model.gguf in the config file to an existing "
                          "GGUF (`appliance doctor` checks the model files; replay, say and the benches can run on the "
                          "embedded defaults with --embedded)", "the model's .gguf")
        kv_types = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
        if _gguf_architecture(path) == "clip":
            raise UserError(f"{path}: is an audio projector (GGUF architecture clip), not the language model; set "
                            "model.gguf to the model and model.mmproj to this file")
        try:
            with quiet_llama_logs() as reason:
                self.llm = _load_llama(path, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                                       n_batch=n_batch, type_k=kv_types[kv_cache_type], type_v=kv_types[kv_cache_type],
                                       flash_attn=True, swa_full=True, seed=seed, verbose=False)
        except (ValueError, RuntimeError, OSError) as exc:
            why = reason() or str(exc)
            raise UserError(f"{path}: llama.cpp could not load this GGUF ({why}); check model.gguf in config.yaml") from None
        self.model_path = path
        self.kv_cache_type = kv_cache_type
        self.arch = str(self.llm.metadata.get("general.architecture", "")).lower()
        self.fmt = FORMATS.get(self.arch, GEMMA3)
        self.system_prompt = system_prompt
        self.examples = list(examples or [])
        self.one_sentence = one_sentence
        self.max_reply_tokens = max_reply_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.history_budget_tokens = history_budget_tokens
        self.stream_prefill = bool(stream_prefill)
        from .audio_prefill import LEFT_CONTEXT_S

        self.stream_left_context_s = LEFT_CONTEXT_S if stream_left_context_s is None else float(stream_left_context_s)
        self.stream_final_at_pause = bool(stream_final_at_pause)
        self._stream = None  # the StreamedAudioTurn being pre-filled while the user speaks
        self._stream_context = ""
        self._stream_failed = False  # a feed of this utterance failed: the turn is encoded whole
        self.audio = None
        if mmproj:
            from .mtmd_audio import AudioModelError, MtmdAudio

            mpath = _gguf_file(mmproj, "model.mmproj", "audio projector (mmproj) not found; set model.mmproj in "
                               "config.yaml", "the audio projector's .gguf")
            try:
                with quiet_llama_logs():
                    self.audio = MtmdAudio(self.llm, str(mpath), n_threads=n_threads)
            except AudioModelError as exc:
                raise UserError(f"{mpath}: {exc}; set model.mmproj to the projector that belongs to model.gguf") from None
        self._stop_tokens = {self.llm.token_eos()}
        end = self.llm.tokenize(self.fmt.turn_end.encode(), add_bos=False, special=True)
        if len(end) == 1:
            self._stop_tokens.add(end[0])
        self._mem = llama_cpp.llama_get_memory(self.llm._ctx.ctx)
        self._lock = threading.RLock()
        self._cancel = threading.Event()
        self.history: list[Message] = []  # the conversation as remembered (what the next rebuild holds)
        self._reply_start: Optional[int] = None
        self._pending_user: Optional[Message] = None
        self._rebuild: Optional[_Rebuild] = None
        self.rebuilds: list[dict] = []  # the last 100 finished rebuilds: reason, tokens, ms (metrics, tests)
        self.total_prefill_tokens = 0
        self.last = TurnResult()
        self.store = store
        # One sentence of plain English for the embedded model: tokens it must not sample (see _plain_english).
        self._banned = _plain_english_mask(self.llm) if one_sentence else None
        self.decode_failures = 0  # llama_decode calls that failed (none expected: the cells are counted first)
        self.dropped_rebuilds = 0  # background rebuilds given up to make room for a turn
        self._system_ids = self.llm.tokenize(self._system_text().encode(), add_bos=True, special=True)
        if len(self._system_ids) + max_reply_tokens + 32 > n_ctx:
            raise UserError(f"model.system_prompt: {len(self._system_ids)} tokens with max_reply_tokens "
                            f"({max_reply_tokens}) do not fit model.n_ctx ({n_ctx}); shorten the prompt or raise "
                            "n_ctx in config.yaml (`appliance check-config` checks the sizes)")
        self._decode(ACTIVE, self._system_ids, 0)
        if store is not None:
            stored = [Message(m.role, m.text, self._load_audio(m.audio_path), m.id) for m in store.restore()]
            self.history = self._fit(stored, self.history_budget_tokens)
            if self.history:
                self._rebuild = _Rebuild(self.history, reason="restore")

    # --- properties ---
    @property
    def hears_audio(self) -> bool:
        return self.audio is not None

    @property
    def n_past(self) -> int:
        """Positions in the active sequence."""
        return self.llm.n_tokens

    @property
    def busy_rebuilding(self) -> bool:
        return self._rebuild is not None

    def kv_bytes_per_token(self) -> float:
        """Bytes of KV cache state per filled position, from ``llama_state_seq_get_size`` of the active
        sequence (K and V of every layer at the configured cache type)."""
        import llama_cpp

        size = llama_cpp.llama_state_seq_get_size(self.llm._ctx.ctx, ACTIVE)
        return float(size) / max(1, self.n_past)

    # --- public API ---
    def cancel(self) -> None:
        """Stop the running generation at the next token (thread-safe)."""
        self._cancel.set()

    def start_turn(self, audio: Optional[np.ndarray] = None, transcript: Optional[str] = None,
                   context: str = "") -> Iterator[str]:
        """Append the user's turn to the active sequence and stream the reply as text pieces.

        :param audio: float32 mono PCM at 16 kHz, at most 30 s; used when the model hears.
        :param transcript: what was said; used when the model cannot hear (text-only model).
        :param context: a line that opens the user's turn, before the audio or the words (the local date
            and time, :mod:`appliance.assistant`); appended with the turn like the rest of it.
        :yields: decoded text pieces, one per generated token (possibly empty for partial UTF-8).
        :raises NothingToHear: neither usable audio nor a transcript (a ``ValueError``).
        After the iterator is exhausted, :attr:`last` holds the turn's figures.
        """
        self._cancel.clear()
        self.last = TurnResult()
        with self._lock:
            t0 = time.perf_counter()
            use_audio = self.hears_audio and audio is not None and len(audio) > 0
            if not use_audio and not transcript:
                raise NothingToHear("this model cannot hear audio and no transcript was given")
            clip = _whole_tokens(np.asarray(audio, dtype=np.float32)[: 30 * 16000]) if use_audio else None
            stream, self._stream, self._stream_failed = self._stream, None, False
            if stream is not None:
                before = stream.start
                stale = stream.done == 0 and self._stream_context != context  # prepared in another minute
                if use_audio and self.stream_prefill and not stale and self._finish_stream(stream, clip):
                    context = self._stream_context
                else:
                    stream.rollback()
                    stream = None
            ids = None if use_audio else self._tokens(self.fmt.user_turn(_opened(context, transcript)))
            incoming = (self._audio_tokens(clip) + len(context) // 2 + 8) if use_audio else len(ids)
            if stream is None:
                self._make_room(incoming + self.max_reply_tokens + 16)
            for attempt in (1, 2):
                if stream is not None:
                    break
                before = self.n_past
                try:
                    if use_audio:
                        self._room(ACTIVE, before, incoming)
                        self._eval_user_audio(ACTIVE, clip, before, context)
                    else:
                        self._decode(ACTIVE, ids, before)
                    break
                except CacheFull:
                    self._rollback_to(before)
                    if attempt == 2:
                        raise  # reported by the worker (engine_error); the turn is not remembered half-way
                    self._prune_now(incoming + self.max_reply_tokens + 16)
                except Exception:
                    self._rollback_to(before)
                    raise
            if use_audio:
                self.last.input = "audio"
                self._pending_user = Message("user", transcript or USER_AUDIO_PLACEHOLDER, clip, context=context)
            else:
                self._pending_user = Message("user", transcript, context=context)
            self.last.prefill_tokens = self.n_past - before
            self.total_prefill_tokens += self.last.prefill_tokens
            self.last.prefill_ms = (time.perf_counter() - t0) * 1000.0
            self._reply_start = self.n_past
        return self._generate(t0)

    def stream_audio(self, pcm: np.ndarray, context: str = "", at_pause: bool = False) -> int:
        """Pre-fill the user's speech so far while they are still talking (streamed pre-fill).

        The first call opens the user's turn in the active sequence (its opening text, ``context`` and
        ``<|audio>``); each call then encodes the new audio (with the left context chosen in
        :mod:`appliance.audio_prefill`) and appends the embeddings of its final tokens at ``n_past``. The next
        :meth:`start_turn` with the same audio (a clip that begins with what was fed) only decodes the last
        tokens, ``<audio|>`` and the rest of the template; any other turn, or :meth:`drop_streamed_audio`,
        rolls the speculative tokens back. Runs on the engine's thread (:class:`EngineWorker`).

        :param pcm: float32 [n] mono 16 kHz: all of the utterance so far, from its first sample (the same
            samples each call, growing).
        :param context: the turn's opening line (the local date and time), read when the turn opens.
        :param at_pause: the user pauses here and ``pcm`` is the utterance as an end of turn now would hold
            it: with ``stream_final_at_pause``, its last token is decoded too (rolled back and decoded
            again if more audio follows).
        :returns: audio tokens pre-filled so far; 0 when nothing is streamed (the model cannot hear,
            ``stream_prefill`` is off, a reply is still open, or a feed of this utterance failed: then the
            turn is encoded whole, as before).
        """
        with self._lock:
            if not (self.hears_audio and self.stream_prefill) or self._reply_start is not None or self._stream_failed:
                return 0
            from .audio_prefill import SAMPLES_PER_TOKEN

            pcm = np.asarray(pcm, dtype=np.float32)[: 30 * 16000]
            try:
                if self._stream is not None and self._stream.done == 0 and self._stream_context != context:
                    self._drop_stream()  # a prepared opening from another minute
                if self._stream is None:
                    self._open_stream(context)
                    self._stream.prepared = False
                self._room(ACTIVE, self.n_past, max(0, len(pcm) // SAMPLES_PER_TOKEN - self._stream.done))
                return self._stream.feed(pcm, final=at_pause and self.stream_final_at_pause)
            except (CacheFull, RuntimeError) as exc:
                log.warning("streamed pre-fill given up for this utterance (%s); it will be encoded whole", exc)
                self._drop_stream()
                self._stream_failed = True
                return 0

    def prepare_turn(self, context: str = "") -> bool:
        """While idle, pre-fill the opening of the next user turn (its markup, ``context`` and ``<|audio>``)
        so that the first :meth:`stream_audio` of the next utterance only has audio to decode: on a Pi 5 the
        opening's ~20 tokens take about 0.6 s. Nothing happens when the model cannot hear, ``stream_prefill``
        is off, a reply or a rebuild is pending, or the same opening is already there; a prepared opening of
        another ``context`` is replaced. Returns True if an opening is now prepared."""
        with self._lock:
            if not (self.hears_audio and self.stream_prefill) or self._reply_start is not None \
                    or self._rebuild is not None:
                return False
            if self._stream is not None:
                if self._stream.done or self._stream_context == context:
                    return self._stream.done == 0
                self._drop_stream()
            try:
                self._open_stream(context)
            except (CacheFull, RuntimeError) as exc:
                log.info("the next turn's opening was not prepared (%s)", exc)
                self._drop_stream()
                return False
            self._stream.prepared = True
            return True

    def _open_stream(self, context: str) -> None:
        from .audio_prefill import StreamedAudioTurn

        opening = len(self._tokens(self.fmt.user_turn(_opened(context, ""))))
        # Room for a 10 s question and the reply now; start_turn checks the rest at the end.
        self._make_room(opening + 250 + 16 + self.max_reply_tokens + 16)
        self._room(ACTIVE, self.n_past, opening + 1)
        self._stream = StreamedAudioTurn(self.audio, self.fmt.user_turn(_opened(context, AUDIO_MARKER)),
                                         self.n_past, self.stream_left_context_s)
        self._stream_context = context

    def drop_streamed_audio(self) -> bool:
        """The utterance being pre-filled did not become a turn (a blip, a backchannel, an utterance the
        conversation ignored): roll its speculative tokens back, so ``n_past`` is where it was before the
        utterance. Returns True if there was one."""
        with self._lock:
            self._stream_failed = False
            return self._drop_stream()

    def _drop_stream(self) -> bool:
        stream, self._stream = self._stream, None
        if stream is None:
            return False
        stream.rollback()
        return True

    def _finish_stream(self, stream, clip: np.ndarray) -> bool:
        """End a streamed turn with its final clip: True if it is now in the cache, with logits ready; False
        if it must be rolled back (another clip, or no room for the rest and the reply)."""
        if not stream.matches(clip):
            log.info("the turn's audio is not the one pre-filled (an interjection joined to it): encoded whole")
            return False
        need = stream.pending_tokens(clip) + stream.after_tokens + self.max_reply_tokens + 16
        if self.n_past + self._cells(SHADOW) + need > self.n_ctx:
            return False
        at = self.n_past
        try:
            _, left = stream.finish(clip)
        except RuntimeError as exc:
            log.warning("streamed pre-fill failed at the end of the turn (%s): encoded whole", exc)
            return False
        self.last.streamed = True
        self.last.audio_tokens_left = left
        self.last.tail_tokens = self.n_past - at
        self.last.stream_windows = stream.windows
        self.last.stream_encoded_s = round(stream.encoded_s, 3)
        self.last.stream_prepared = bool(getattr(stream, "prepared", False))
        return True

    def _plain_english(self, input_ids: np.ndarray, logits: np.ndarray) -> np.ndarray:
        """llama.cpp custom sampler (first in its chain, so ``logits`` is the whole vocabulary in id order)."""
        logits[self._banned[: len(logits)]] = -np.inf
        return logits

    def _generate(self, t0: float) -> Iterator[str]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        pieces: list[str] = []
        try:
            for _ in range(self.max_reply_tokens):
                if self._cancel.is_set():
                    self.last.cancelled = True
                    break
                with self._lock:
                    if self.n_past + self._cells(SHADOW) >= self.n_ctx - 8:
                        break  # (not reached: start_turn made room for max_reply_tokens)
                    tok = self.llm.sample(temp=self.temperature, top_p=self.top_p, top_k=40,
                                          logits_processor=[self._plain_english] if self._banned is not None else None)
                    if tok in self._stop_tokens:
                        break
                    raw = self.llm.detokenize([tok], special=False)
                    if b"\n" in raw and "".join(pieces).strip():
                        break  # a spoken reply is one paragraph: a line break after some text ends it
                    if self.one_sentence and _ends_sentence("".join(pieces)) and not raw[:1].islower() \
                            and not raw[:1].isdigit():
                        break  # one sentence only (the embedded model: what follows is often a stray word)
                    self._decode(ACTIVE, [tok], self.n_past)
                if self.last.first_token_ms is None:
                    self.last.first_token_ms = (time.perf_counter() - t0) * 1000.0
                piece = decoder.decode(raw)
                pieces.append(piece)
                self.last.generated_tokens += 1
                yield piece
        finally:
            pieces.append(decoder.decode(b"", final=True))
            self.last.text = "".join(pieces)

    def commit_spoken(self, spoken_text: str, complete: bool) -> None:
        """Close the reply in the cache and the history with what the user actually heard.

        :param spoken_text: the text that reached the speaker.
        :param complete: True if the whole reply was played: the generated tokens stay as they are.
            Otherwise the generated tail is removed from the cache and ``spoken_text`` is evaluated in
            its place (the unspoken tail is at most one reply long, so the rollback stays inside the
            sliding window's full-size cache).
        """
        with self._lock:
            if self._reply_start is None:
                return
            text = self.last.text.strip() if complete else spoken_text.strip()
            in_cache = True
            try:
                if not complete:
                    self.llm.n_tokens = self._reply_start
                    if text:
                        self._decode(ACTIVE, self._tokens(text, special=False), self._reply_start)
                    else:
                        self.llm._ctx.kv_cache_seq_rm(ACTIVE, self._reply_start, -1)
                self._decode(ACTIVE, self._tokens(self.fmt.close_reply()), self.n_past)
            except (CacheFull, RuntimeError) as exc:
                # The exchange is remembered all the same; the cache is rebuilt from the history below.
                log.warning("could not close the reply in the cache (%s): rebuilding it from the history", exc)
                in_cache = False
            user, model = self._pending_user, Message("model", text)
            if self.store is not None:  # one transaction: a kill never leaves a question without its answer
                user.store_id, model.store_id = self.store.append_exchange(user.text, user.audio, model.text)
            for m in (user, model):
                self.history.append(m)
                if self._rebuild is not None:
                    self._rebuild.pending.append(m)
            self._pending_user = None
            self._reply_start = None
            if not in_cache:
                self._prune_now(self.max_reply_tokens + 16)
                return
            if self._rebuild is None and self.n_past > self.history_budget_tokens:
                kept = self._fit(self.history, self.history_budget_tokens // 2)
                self._drop_before(kept)
                self._rebuild = _Rebuild(kept, reason="prune")

    def forget(self) -> None:
        """Start a fresh conversation: clear the history, its store and the cache (keeps the system prompt)."""
        with self._lock:
            self._drop_stream()
            self.history.clear()
            self._rebuild = None
            if self.store is not None:
                self.store.clear()
            self.llm._ctx.kv_cache_seq_rm(SHADOW, 0, -1)
            self.llm.n_tokens = len(self._system_ids)
            self.llm._ctx.kv_cache_seq_rm(ACTIVE, self.n_past, -1)
            self._reply_start = None
            self._pending_user = None

    def adopt(self, history: list[Message]) -> None:
        """Take over a conversation (e.g. from the engine of the previous model after a config change):
        the newest exchanges that fit the budget are rebuilt into the cache in the background."""
        with self._lock:
            self.history = self._fit(list(history), self.history_budget_tokens)
            self._rebuild = _Rebuild(self.history, reason="adopt") if self.history else None

    def background_step(self, should_yield: Callable[[], bool]) -> bool:
        """Advance a pending rebuild by at most ``n_batch`` tokens at a time until done or until
        ``should_yield()`` (a turn is waiting). Returns True if nothing is left to do."""
        while True:
            with self._lock:
                rb = self._rebuild
                if rb is None:
                    return True
                if self._stream is not None and self._stream.done == 0:
                    self._drop_stream()  # a prepared opening gives way (prepared again after the rebuild)
                if self._reply_start is not None or self._stream is not None:
                    return False  # a turn is open on the active sequence: resume after its commit
                if not rb.pending:
                    if [id(m) for m in rb.kept] != [id(m) for m in self.history]:
                        self._drop_rebuild("it no longer matches the history")  # never swap in a wrong history
                        return True
                    self._swap(rb)
                    return True
                msg = rb.pending[0]  # taken off the queue only once it is in the cache
                try:
                    if rb.n == 0:
                        self._decode(SHADOW, self._system_ids, 0, track=rb)
                    if msg.role == "user" and msg.audio is not None and self.hears_audio:
                        before = rb.n
                        self._room(SHADOW, rb.n, self._audio_tokens(msg.audio))
                        prompt = self.fmt.closed("user", _opened(msg.context, AUDIO_MARKER))
                        rb.n, _ = self.audio.eval_prompt(prompt, msg.audio, rb.n,
                                                         n_batch=self.n_batch, seq_id=SHADOW, add_special=False)
                        rb.tokens += rb.n - before
                        rb.ids.extend([-1] * (rb.n - before))
                    else:
                        self._decode(SHADOW, self._tokens(self._closed_turn(msg)), rb.n, track=rb)
                except (CacheFull, RuntimeError) as exc:
                    # Give way: the history is intact in self.history; the next prune starts a new rebuild.
                    self._drop_rebuild(f"{exc.__class__.__name__}: {exc}")
                    return True
                rb.pending.pop(0)
                rb.kept.append(msg)
            if should_yield():
                return False

    # --- internals ---
    def _swap(self, rb: _Rebuild) -> None:
        import llama_cpp

        llama_cpp.llama_memory_seq_rm(self._mem, ACTIVE, -1, -1)
        llama_cpp.llama_memory_seq_cp(self._mem, SHADOW, ACTIVE, -1, -1)
        llama_cpp.llama_memory_seq_rm(self._mem, SHADOW, -1, -1)
        self.llm.input_ids[: rb.n] = rb.ids
        self.llm.n_tokens = rb.n
        self._rebuild = None
        ms = (time.perf_counter() - rb.started) * 1000.0
        self.rebuilds.append({"reason": rb.reason, "messages": len(rb.kept), "tokens": rb.tokens, "n_past": rb.n, "ms": round(ms, 1)})
        del self.rebuilds[:-100]
        log.info("cache rebuilt (%s): %d messages, %d tokens, %.0f ms in the background", rb.reason, len(rb.kept), rb.tokens, ms)

    def _decode(self, seq: int, tokens: list[int], pos: int, track: Optional[_Rebuild] = None) -> None:
        """Evaluate ``tokens`` into sequence ``seq`` at ``pos`` (removing anything at or after ``pos``
        in that sequence only), in batches of ``n_batch``; the active sequence keeps ``llm``'s own
        bookkeeping (``n_tokens``, ``input_ids``) so sampling works as usual."""
        from .audio_prefill import decode_tokens

        llm = self.llm
        self._room(seq, pos, len(tokens))
        llm._ctx.kv_cache_seq_rm(seq, pos, -1)

        def tracked(chunk: list[int], at: int) -> None:
            track.ids.extend(chunk)
            track.n = at + len(chunk)
            track.tokens += len(chunk)

        try:
            decode_tokens(llm, tokens, pos, seq, self.n_batch, tracked if seq != ACTIVE and track is not None else None)
        except RuntimeError:
            self.decode_failures += 1
            raise

    def _tokens(self, text: str, special: bool = True) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=special)

    def _closed_turn(self, msg: Message) -> str:
        return self.fmt.closed(msg.role, _opened(msg.context, msg.text) if msg.role == "user" else msg.text)

    def _audio_tokens(self, clip: np.ndarray) -> int:
        from .mtmd_audio import MtmdAudio

        return MtmdAudio.expected_audio_tokens(len(clip)) + 16

    def _eval_user_audio(self, seq: int, clip: np.ndarray, pos: int, context: str = "") -> None:
        self.audio.eval_prompt(self.fmt.user_turn(_opened(context, AUDIO_MARKER)), clip, pos, n_batch=self.n_batch,
                               seq_id=seq, add_special=False)

    def _cost(self, msg: Message) -> int:
        if msg.role == "user" and msg.audio is not None and self.hears_audio:
            return self._audio_tokens(msg.audio)
        return len(self._tokens(self._closed_turn(msg)))

    def _fit(self, messages: list[Message], budget: int) -> list[Message]:
        """The newest whole exchanges (user + model pairs) whose tokens fit in ``budget``."""
        kept: list[Message] = []
        used = len(self._system_ids)
        i = len(messages)
        while i >= 2:
            pair = messages[i - 2 : i]
            cost = sum(self._cost(m) for m in pair)
            if used + cost > budget:
                break
            kept[:0] = pair
            used += cost
            i -= 2
        return kept

    def _drop_before(self, kept: list[Message]) -> None:
        """Forget the history older than ``kept`` (also in the store)."""
        dropped = self.history[: len(self.history) - len(kept)]
        self.history = list(kept)
        ids = [m.store_id for m in dropped if m.store_id is not None]
        if self.store is not None and ids:
            self.store.drop_through(max(ids))

    def _cells(self, seq: int) -> int:
        """Cells of the shared KV cache that sequence ``seq`` holds, from llama.cpp itself (each sequence
        fills positions 0..n-1, one cell each)."""
        import llama_cpp

        return int(llama_cpp.llama_memory_seq_pos_max(self._mem, seq)) + 1

    def _room(self, seq: int, pos: int, n: int) -> None:
        """:raises CacheFull: if ``n`` tokens at ``pos`` in ``seq`` (which drops what ``seq`` holds from
        ``pos`` on) would not fit beside the other sequence's cells in ``n_ctx``."""
        other = self._cells(SHADOW if seq == ACTIVE else ACTIVE)
        if other + pos + n > self.n_ctx:
            raise CacheFull(f"{pos + n} cells for sequence {seq} and {other} for the other exceed n_ctx {self.n_ctx}")

    def _rollback_to(self, pos: int) -> None:
        """Forget what the active sequence holds from ``pos`` on (a turn that could not be evaluated whole)."""
        self.llm._ctx.kv_cache_seq_rm(ACTIVE, pos, -1)
        self.llm.n_tokens = pos

    def _drop_rebuild(self, why: str) -> None:
        """Give up the background rebuild and free its cells (the history itself is unchanged)."""
        rb = self._rebuild
        if rb is None:
            return
        self.llm._ctx.kv_cache_seq_rm(SHADOW, 0, -1)
        self._rebuild = None
        self.dropped_rebuilds += 1
        log.warning("background rebuild (%s) given up after %d of %d messages: %s", rb.reason, len(rb.kept),
                    len(rb.kept) + len(rb.pending), why)

    def _make_room(self, need: int) -> None:
        """Make sure ``need`` more cells fit in the active sequence, counting both sequences' cells. In
        order: nothing to do; finish the background rebuild now if the cache can hold it beside the active
        sequence (the user waits for the rest of it); else give the rebuild up; and if the active sequence
        alone is still too long, prune the history and rebuild it into the active sequence at once. Only
        reached when turns come faster than idle time lets the background rebuild finish."""
        if self.n_past + self._cells(SHADOW) + need <= self.n_ctx:
            return
        rb = self._rebuild
        if rb is not None:
            rest = sum(self._cost(m) for m in rb.pending) + (len(self._system_ids) if rb.n == 0 else 0)
            if self.n_past + rb.n + rest <= self.n_ctx and rb.n + rest + need <= self.n_ctx:
                log.warning("context full at %d tokens: finishing the history rebuild while the user waits", self.n_past)
                rb.reason += "+emergency"
                self.background_step(lambda: False)
            else:
                self._drop_rebuild(f"no room for it beside {self.n_past} tokens and the next turn")
            if self.n_past + self._cells(SHADOW) + need <= self.n_ctx:
                return
            self._drop_rebuild("the next turn still does not fit")
        if self.n_past + need > self.n_ctx:
            self._prune_now(need)

    def _prune_now(self, need: int) -> None:
        """Drop the oldest exchanges (down to half the history budget, fewer if the next ``need`` cells
        require it) and re-evaluate the rest into the active sequence now, while the user waits."""
        t0 = time.perf_counter()
        self._drop_rebuild("pruning at once")
        budget = min(self.history_budget_tokens // 2, self.n_ctx - need)
        kept = self._fit(self.history, budget)
        self._drop_before(kept)
        self._rollback_to(len(self._system_ids))
        tokens = 0
        for msg in kept:
            before = self.n_past
            if msg.role == "user" and msg.audio is not None and self.hears_audio:
                self._room(ACTIVE, before, self._audio_tokens(msg.audio))
                self.audio.eval_prompt(self.fmt.closed("user", AUDIO_MARKER), msg.audio, before,
                                       n_batch=self.n_batch, seq_id=ACTIVE, add_special=False)
            else:
                self._decode(ACTIVE, self._tokens(self._closed_turn(msg)), before)
            tokens += self.n_past - before
        ms = (time.perf_counter() - t0) * 1000.0
        self.rebuilds.append({"reason": "prune-now", "messages": len(kept), "tokens": tokens, "n_past": self.n_past,
                              "ms": round(ms, 1)})
        del self.rebuilds[:-100]
        log.warning("context full: history pruned to %d messages and re-evaluated at once (%d tokens, %.0f ms)",
                    len(kept), tokens, ms)

    def _load_audio(self, path: Optional[str]) -> Optional[np.ndarray]:
        if not path or not self.hears_audio:
            return None
        from .audio.files import load_audio

        try:
            return load_audio(path)
        except UserError:
            log.warning("%s: stored audio of a past turn is unreadable; that turn is remembered as text", path)
            return None

    def _system_text(self) -> str:
        """The fixed prefix: the system prompt, then any example exchanges (a base model needs them to
        answer in turn). Gemma 3 has no system role: its instructions open the first user turn, as its
        model card advises."""
        f = self.fmt
        text = f.system_turn(self.system_prompt) if f.system_role and self.system_prompt else ""
        for i, (q, a) in enumerate(self.examples):
            if i == 0 and not f.system_role and self.system_prompt:
                q = f"{self.system_prompt}\n\n{q}"
            text += f"{f.turn_start}user\n{q}{f.turn_end}\n{f.turn_start}{f.model_role}\n{a}{f.turn_end}\n"
        if not f.system_role and self.system_prompt and not self.examples:
            text += (f"{f.turn_start}user\n{self.system_prompt}{f.turn_end}\n"
                     f"{f.turn_start}{f.model_role}\nOkay.{f.turn_end}\n")
        return text


def _whole_tokens(clip: np.ndarray) -> np.ndarray:
    """``clip`` cut to whole 40 ms audio tokens (640 samples), so a streamed turn and the whole clip hold the
    same tokens (mtmd would round a shorter tail up to a token of its own); a clip under one token is kept."""
    n = len(clip) // 640 * 640
    return clip[:n] if n else clip


def _plain_english_mask(llm) -> np.ndarray:
    """Tokens the embedded model may not sample, as a bool array over its vocabulary: any piece with a
    byte outside ASCII (other scripts, accents, partial UTF-8) or a square bracket (it would copy the
    turn's ``[date and time]`` line as its answer). Special tokens (end of turn) stay allowed."""
    banned = np.zeros(llm.n_vocab(), dtype=bool)
    for tok in range(len(banned)):
        piece = llm.detokenize([tok], special=False)
        banned[tok] = bool(piece) and (max(piece) >= 0x80 or b"[" in piece or b"]" in piece)
    return banned


def _opened(context: str, content: str) -> str:
    """A user turn's content with its context line (if any) before it."""
    return f"{context}\n{content}" if context else content


_ABBREVIATIONS = {"e.g.", "i.e.", "etc.", "vs.", "dr.", "mr.", "mrs.", "ms.", "st.", "no.", "approx."}


def _ends_sentence(text: str) -> bool:
    """``text`` ends with a sentence's closing mark (after at least two words), not an abbreviation's
    full stop ("e.g.") and not inside an open parenthesis."""
    t = text.rstrip().rstrip("\"'\u201d\u2019")
    if t[-1:] not in (".", "!", "?") or len(t.split()) < 2 or t.count("(") > t.count(")"):
        return False
    return t.split()[-1].lstrip("(").lower() not in _ABBREVIATIONS


def text_only_refusal(model_path: Path) -> UserError:
    return UserError(f"{model_path}: this model is text-only (no model.mmproj), so it cannot hear the microphone; "
                     "set model.mmproj to the audio projector, or use `appliance replay` with a scenario transcript")


@dataclass
class EngineWorker:
    """Runs the engine on its own thread: turns, cancellation and commits in order.

    :param engine: the :class:`Engine`.
    :param post: ``post(event, **info)`` to the conversation (``llm_first_token``, ``llm_done``).
    :param on_clause: ``on_clause(reply_id, text)`` for each clause the splitter completes, then
        ``on_clause(reply_id, None)`` at the end of the reply.
    """

    engine: Engine
    post: Callable[..., None]
    on_clause: Callable[[int, Optional[str]], None]
    split: Callable[[], object] = None  # factory of a SentenceSplitter
    _jobs: list = field(default_factory=list)
    context: Optional[Callable[[], str]] = None  # the opening line of each user turn (the date and time)

    def __post_init__(self) -> None:
        import queue

        from .speech import SentenceSplitter

        self.split = self.split or SentenceSplitter
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._cancelled: set[int] = set()
        self._stream_pcm: Optional[np.ndarray] = None  # the newest audio handed to stream_audio
        self._stream_queued = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def configure(self, *, context: Optional[Callable[[], str]] = None) -> None:
        """``context()``: the line that opens each user turn (the local date and time), read per turn."""
        self.context = context
        self.call(self._prepare)

    def submit_turn(self, reply_id: int, audio: Optional[np.ndarray], transcript: Optional[str]) -> None:
        self._q.put(("turn", reply_id, audio, transcript))

    def stream_audio(self, pcm: np.ndarray, at_pause: bool = False) -> None:
        """The user's utterance so far (float32 [n] mono 16 kHz, from its first sample), to pre-fill on the
        engine's thread (:meth:`Engine.stream_audio`; ``at_pause``: fed at a pause). Never blocks: calls
        that arrive while the engine is busy are merged, and only the newest audio is fed."""
        self._stream_pcm = (pcm, at_pause)
        if not self._stream_queued:
            self._stream_queued = True
            self._q.put(("stream", None, None, None))

    def drop_audio(self) -> None:
        """The utterance being pre-filled will not be a turn: roll it back (:meth:`Engine.drop_streamed_audio`)."""
        self._q.put(("call", lambda: (self.engine.drop_streamed_audio(), self._prepare()), None, None))

    def _prepare(self) -> None:
        """Idle: have the next turn's opening ready in the cache (:meth:`Engine.prepare_turn`)."""
        if self.engine.hears_audio and self.engine.stream_prefill and not self.engine.busy_rebuilding:
            self.engine.prepare_turn(self.context() if self.context else "")

    def cancel(self, reply_id: int) -> None:
        self._cancelled.add(reply_id)
        self.engine.cancel()

    def commit(self, reply_id: int, spoken_text: str, complete: bool) -> None:
        self._q.put(("commit", reply_id, spoken_text, complete))

    def forget(self) -> None:
        """Drop the history (a new conversation), on the engine thread after the jobs already queued."""
        self.call(lambda: self.engine.forget())

    def call(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the engine thread after the queued jobs (e.g. a rebuild while idle)."""
        self._q.put(("call", fn, None, None))

    def sync(self, timeout: float = 30.0) -> bool:
        """Wait until every job queued so far has run. Returns False on timeout."""
        done = threading.Event()
        self.call(done.set)
        return done.wait(timeout)

    def stop(self) -> None:
        self._q.put(("stop", None, None, None))
        self._thread.join(timeout=10)

    def _run(self) -> None:
        import queue

        while True:
            try:
                # Idle with a rebuild pending: advance it, yielding as soon as a job arrives. Idle otherwise:
                # keep the next turn's opening ready (its date line changes once a minute).
                item = self._q.get(timeout=0.05 if self.engine.busy_rebuilding else 5.0)
            except queue.Empty:
                try:
                    if not self.engine.busy_rebuilding or self.engine.background_step(lambda: not self._q.empty()):
                        self._prepare()
                except Exception as exc:
                    log.exception("background cache rebuild failed")
                    self.post("engine_error", reason=f"rebuild: {exc.__class__.__name__}: {exc}")
                continue
            kind, a, b, c = item
            try:
                if kind == "stop":
                    return
                if kind == "turn":
                    self._turn(a, b, c)
                elif kind == "stream":
                    self._stream_queued = False
                    fed, self._stream_pcm = self._stream_pcm, None
                    if fed is not None:
                        self.engine.stream_audio(fed[0], self.context() if self.context else "", at_pause=fed[1])
                elif kind == "commit":
                    self.engine.commit_spoken(b, complete=c)
                    if self._q.empty():
                        self._prepare()
                elif kind == "call":
                    a()
            except NothingToHear as exc:  # not a failure: speech with no words a text-only model can take
                log.warning("reply %s dropped: %s", a, exc)
                self.post("engine_error", reason=str(exc))
            except Exception as exc:
                log.exception("engine job %s failed", kind)
                self.post("engine_error", reason=f"{exc.__class__.__name__}: {exc}")

    def _turn(self, reply_id: int, audio: Optional[np.ndarray], transcript: Optional[str]) -> None:
        self._cancelled = {r for r in self._cancelled if r > reply_id - 100}  # replies are numbered in order
        if reply_id in self._cancelled:
            return
        splitter = self.split()
        first = True
        stream = self.engine.start_turn(audio, transcript, context=self.context() if self.context else "")
        for n, piece in enumerate(stream, 1):
            if first:
                self.post("llm_first_token", reply_id=reply_id, prefill_tokens=self.engine.last.prefill_tokens)
                first = False
            if reply_id in self._cancelled:
                self.engine.cancel()
            for clause in splitter.feed(piece):
                if self.engine.last.first_piece_tokens is None:
                    self.engine.last.first_piece_tokens = n
                self.on_clause(reply_id, clause)
        if reply_id not in self._cancelled:
            for clause in splitter.flush():
                self.on_clause(reply_id, clause)
        self.on_clause(reply_id, None)
        r = self.engine.last
        self.post("llm_done", reply_id=reply_id, text=r.text, prefill_tokens=r.prefill_tokens,
                  generated_tokens=r.generated_tokens, cancelled=r.cancelled, input=r.input, streamed=r.streamed,
                  audio_tokens_left=r.audio_tokens_left, first_piece_tokens=r.first_piece_tokens)
