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
"""

from __future__ import annotations

import codecs
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


# Gemma 2/3: <start_of_turn>user ... <end_of_turn>; no system role (Gemma 3 model card, "Prompt formatting").
GEMMA3 = ChatFormat("<start_of_turn>", "<end_of_turn>")
# Gemma 4: <|turn>role ... <turn|>, with a system role (the Gemma 4 chat template in its tokenizer config).
GEMMA4 = ChatFormat("<|turn>", "<turn|>", system_role="system")
FORMATS = {"gemma3": GEMMA3, "gemma2": GEMMA3, "gemma": GEMMA3, "gemma4": GEMMA4}


@dataclass
class Message:
    role: str  # "user" or "model"
    text: str
    audio_ref: Optional[str] = None


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


class Engine:
    """One llama.cpp model and context holding the conversation.

    :param gguf: path of the model GGUF.
    :param mmproj: path of the audio projector GGUF, or None for a text-only model (it cannot hear).
    :param kv_cache_type: ``"f16"``, ``"q8_0"`` or ``"q4_0"``; a quantised V cache needs flash attention,
        which is switched on.
    :raises UserError: a missing or unloadable model file (one line naming the file).
    """

    def __init__(self, gguf: str | Path, mmproj: Optional[str | Path] = None, *, n_ctx: int = 4096,
                 n_threads: int = 4, n_batch: int = 512, kv_cache_type: str = "q4_0",
                 system_prompt: str = "", max_reply_tokens: int = 160, temperature: float = 0.7,
                 top_p: float = 0.95, seed: int = 0, history_budget_tokens: int = 3072,
                 examples: Optional[list[tuple[str, str]]] = None):
        import llama_cpp

        path = Path(gguf)
        if not path.is_file():
            raise UserError(f"{path}: model file not found; set model.gguf in config.yaml, or run with --embedded")
        kv_types = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
        try:
            self.llm = llama_cpp.Llama(
                model_path=str(path), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                n_batch=n_batch, type_k=kv_types[kv_cache_type], type_v=kv_types[kv_cache_type],
                flash_attn=True, swa_full=True, seed=seed, verbose=False)
        except (ValueError, RuntimeError) as exc:
            raise UserError(f"{path}: llama.cpp could not load this GGUF ({exc}); check model.gguf in config.yaml") from None
        self.model_path = path
        self.kv_cache_type = kv_cache_type
        self.arch = str(self.llm.metadata.get("general.architecture", "")).lower()
        self.fmt = FORMATS.get(self.arch, GEMMA3)
        self.system_prompt = system_prompt
        self.examples = list(examples or [])
        self.max_reply_tokens = max_reply_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.history_budget_tokens = min(history_budget_tokens, n_ctx - max_reply_tokens - 64)
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.audio = None
        if mmproj:
            from .mtmd_audio import MtmdAudio

            mpath = Path(mmproj)
            if not mpath.is_file():
                raise UserError(f"{mpath}: audio projector (mmproj) not found; set model.mmproj in config.yaml")
            self.audio = MtmdAudio(self.llm, str(mpath), n_threads=n_threads)
        self._stop_tokens = {self.llm.token_eos()}
        end = self.llm.tokenize(self.fmt.turn_end.encode(), add_bos=False, special=True)
        if len(end) == 1:
            self._stop_tokens.add(end[0])
        self.history: list[Message] = []
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._reply_start: Optional[int] = None
        self._reply_tokens: list[int] = []
        self._pending_user: Optional[Message] = None
        self._lengths: list[int] = []  # tokens each history message occupies in the cache
        self.total_prefill_tokens = 0
        self._prefill_system()

    # --- properties ---
    @property
    def hears_audio(self) -> bool:
        return self.audio is not None

    @property
    def n_past(self) -> int:
        return self.llm.n_tokens

    def kv_bytes_per_token(self) -> float:
        """Bytes of KV cache per token at the configured cache type (from llama.cpp's memory size)."""
        import llama_cpp

        size = llama_cpp.llama_state_get_size(self.llm._ctx.ctx)
        return float(size) / max(1, self.n_ctx)

    # --- public API ---
    def cancel(self) -> None:
        """Stop the running generation at the next token (thread-safe)."""
        self._cancel.set()

    def start_turn(self, audio: Optional[np.ndarray] = None, transcript: Optional[str] = None,
                   audio_ref: Optional[str] = None) -> Iterator[str]:
        """Append the user's turn and stream the reply as text pieces.

        :param audio: float32 mono PCM at 16 kHz, at most 30 s; used when the model hears.
        :param transcript: what was said; used when the model cannot hear (text-only model).
        :yields: decoded text pieces, one per generated token (possibly empty for partial UTF-8).
        :raises ValueError: neither usable audio nor a transcript.
        The iterator's ``result`` attribute is not used; read :attr:`last` after it is exhausted.
        """
        self._cancel.clear()
        self.last = TurnResult()
        with self._lock:
            t0 = time.perf_counter()
            use_audio = self.hears_audio and audio is not None and len(audio) > 0
            if not use_audio and not transcript:
                raise ValueError("this model cannot hear audio and no transcript was given")
            text = transcript or ""
            before = self.n_past
            if use_audio:
                self._ensure_room(int(25 * len(audio) / 16000) + 32)  # Gemma 4: 25 audio tokens per second
                before = self.n_past
                prompt = self.fmt.user_turn(AUDIO_MARKER)
                clip = np.asarray(audio, dtype=np.float32)[: 30 * 16000]
                new_n_past, _ = self.audio.eval_prompt(prompt, clip, self.n_past, n_batch=self.n_batch)
                self.llm.n_tokens = new_n_past
                self.last.input = "audio"
                text = transcript or "(spoken audio)"
            else:
                self._ensure_room(len(text) // 2 + 32)
                before = self.n_past
                prompt = self.fmt.user_turn(text)
                toks = self.llm.tokenize(prompt.encode(), add_bos=self.n_past == 0, special=True)
                self.llm.eval(toks)
            self._pending_user = Message("user", text, audio_ref)
            self._user_len = self.n_past - before
            self.last.prefill_tokens = self.n_past - before
            self.total_prefill_tokens += self.last.prefill_tokens
            self.last.prefill_ms = (time.perf_counter() - t0) * 1000.0
            self._reply_start = self.n_past
            self._reply_tokens = []
        return self._generate(t0)

    def _generate(self, t0: float) -> Iterator[str]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        pieces = []
        for _ in range(self.max_reply_tokens):
            if self._cancel.is_set():
                self.last.cancelled = True
                break
            with self._lock:
                if self.n_past >= self.n_ctx - 8:
                    break
                tok = self.llm.sample(temp=self.temperature, top_p=self.top_p, top_k=40)
                if tok in self._stop_tokens:
                    break
                raw = self.llm.detokenize([tok], special=False)
                if b"\n" in raw and "".join(pieces).strip():
                    break  # a spoken reply is one paragraph: a line break after some text ends it
                self.llm.eval([tok])
                self._reply_tokens.append(tok)
            if self.last.first_token_ms is None:
                self.last.first_token_ms = (time.perf_counter() - t0) * 1000.0
            piece = decoder.decode(raw)
            pieces.append(piece)
            self.last.generated_tokens += 1
            yield piece
        pieces.append(decoder.decode(b"", final=True))
        self.last.text = "".join(pieces)

    def commit_spoken(self, spoken_text: str, complete: bool) -> None:
        """Close the reply in the cache and the history with what the user actually heard.

        :param spoken_text: the text that reached the speaker.
        :param complete: True if the whole reply was played: the generated tokens stay as they are.
        """
        with self._lock:
            if self._reply_start is None:
                return
            if complete:
                text = self.last.text.strip()
            else:
                text = spoken_text.strip()
                # Roll back the generated tail and put the spoken words in its place.
                self.llm.n_tokens = self._reply_start
                self.llm._ctx.kv_cache_seq_rm(-1, self._reply_start, -1)
                if text:
                    self.llm.eval(self.llm.tokenize(text.encode(), add_bos=False, special=False))
            self.llm.eval(self.llm.tokenize(self.fmt.close_reply().encode(), add_bos=False, special=True))
            if self._pending_user is not None:
                self.history.append(self._pending_user)
                self._lengths.append(self._user_len)
            self.history.append(Message("model", text))
            self._lengths.append(self.n_past - self._reply_start)
            self._pending_user = None
            self._reply_start = None

    def forget(self) -> None:
        """Start a fresh conversation: clear the history and the cache (keeps the system prompt)."""
        with self._lock:
            self.history.clear()
            self._lengths.clear()
            self._rebuild()

    # --- internals ---
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

    def _prefill_system(self) -> None:
        self.llm.n_tokens = 0
        self.llm._ctx.kv_cache_clear()
        toks = self.llm.tokenize(self._system_text().encode(), add_bos=True, special=True)
        self.llm.eval(toks)
        self._system_len = len(toks)

    def _rebuild(self) -> None:
        """Re-prefill the system prompt and the kept history (text of both sides)."""
        self._prefill_system()
        self._lengths = []
        for msg in self.history:
            before = self.n_past
            if msg.role == "user":
                s = f"{self.fmt.turn_start}user\n{msg.text}{self.fmt.turn_end}\n"
            else:
                s = f"{self.fmt.turn_start}{self.fmt.model_role}\n{msg.text}{self.fmt.turn_end}\n"
            self.llm.eval(self.llm.tokenize(s.encode(), add_bos=False, special=True))
            self._lengths.append(self.n_past - before)

    def _ensure_room(self, incoming: int) -> None:
        """Drop the oldest exchanges (keeping the system prompt) when the history would pass its budget."""
        used = self.n_past + incoming + self.max_reply_tokens
        if used <= self.history_budget_tokens + self._system_len:
            return
        while self.history and sum(self._lengths) + incoming + self.max_reply_tokens > self.history_budget_tokens:
            self.history.pop(0)
            self._lengths.pop(0)
        self._rebuild()


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

    def __post_init__(self) -> None:
        import queue

        from .speech import SentenceSplitter

        self.split = self.split or SentenceSplitter
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._cancelled: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def submit_turn(self, reply_id: int, audio: Optional[np.ndarray], transcript: Optional[str]) -> None:
        self._q.put(("turn", reply_id, audio, transcript))

    def cancel(self, reply_id: int) -> None:
        self._cancelled.add(reply_id)
        self.engine.cancel()

    def commit(self, reply_id: int, spoken_text: str, complete: bool) -> None:
        self._q.put(("commit", reply_id, spoken_text, complete))

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
        while True:
            kind, a, b, c = self._q.get()
            try:
                if kind == "stop":
                    return
                if kind == "turn":
                    self._turn(a, b, c)
                elif kind == "commit":
                    self.engine.commit_spoken(b, complete=c)
                elif kind == "call":
                    a()
            except Exception as exc:
                log.exception("engine job %s failed", kind)
                self.post("engine_error", reason=f"{exc.__class__.__name__}: {exc}")

    def _turn(self, reply_id: int, audio: Optional[np.ndarray], transcript: Optional[str]) -> None:
        if reply_id in self._cancelled:
            return
        splitter = self.split()
        first = True
        stream = self.engine.start_turn(audio, transcript)
        for piece in stream:
            if first:
                self.post("llm_first_token", reply_id=reply_id, prefill_tokens=self.engine.last.prefill_tokens)
                first = False
            if reply_id in self._cancelled:
                self.engine.cancel()
            for clause in splitter.feed(piece):
                self.on_clause(reply_id, clause)
        if reply_id not in self._cancelled:
            for clause in splitter.flush():
                self.on_clause(reply_id, clause)
        self.on_clause(reply_id, None)
        r = self.engine.last
        self.post("llm_done", reply_id=reply_id, text=r.text, prefill_tokens=r.prefill_tokens,
                  generated_tokens=r.generated_tokens, cancelled=r.cancelled, input=r.input)
