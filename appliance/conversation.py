"""The conversation state machine: the one writer of the appliance's state.

Every other part posts events to it (:meth:`Conversation.post`, non-blocking, callable from any thread,
including audio callbacks); it changes state on its own thread and tells its observers (LEDs, the
timeline, metrics, the simulated room) about every transition and event. Nothing polls it.

States: ``starting`` → ``listening`` → ``thinking`` → ``speaking`` → ``listening``; while speaking, the
first VAD onset pauses playback at once and enters ``interrupted``, then the turn taker decides:
``resumed`` (a backchannel or a noise: back to ``speaking`` where it paused) or ``flushed`` (a real
interruption: the rest of the reply is dropped, generation cancelled, only the spoken text kept, and the
new speech becomes the next user turn). A flushing interjection that the VAD cut after its short silence
("Wait," …) is held until the user has been quiet for ``min_silence_ms`` (``vad_settled``), and joined to
what they say before that ("… stop."), so the turn is the whole utterance. ``muted`` ignores the
microphone; ``error`` is a device or model failure.

Stop means stop (``interruption.stop_words_only_silence``): when the held interjection is a stop command
alone ("Stop.", "Wait, stop.", "Never mind.", as the barge-in classifier heard it) and nothing but stop
words follows it before ``vad_settled``, no turn starts: the conversation emits ``stopped`` and listens.
Any other words before then ("Wait, what about the moon?") make it a turn as before. Either way the cut
reply is remembered as far as it was heard, ending in :data:`CUT_MARK`, so the model knows it was cut.

Listening modes (:meth:`Conversation.configure`): ``always`` answers any speech; ``wake_word`` answers
only speech that starts inside the listening window. The window opens on a ``wake`` event (the wake-word
detector heard its phrase) and again when a reply ends (it was played, flushed or stopped), for
``follow_up_s``; ``listen_window`` events say when it opens and closes. A barge-in during a reply needs no
wake word. An utterance that is only the wake word ("Hey Jarvis." and a pause) opens the window and is not
a turn.

Events are the typed catalogue of :mod:`appliance.events` (an unknown one is refused at ``post``), handled
in order except that the button's events and a barge-in's onset do not wait behind others (see there).

One module of about 580 lines, on purpose: its handlers are the transitions of one state and share it;
split across modules they would no longer read as the one owner of the state.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import numpy as np

from .audio.files import MODEL_RATE
from .events import Ev, Event, EventQueue, kind_of
from .turns import BargeInDecision, TurnTaker

JOIN_GAP_SAMPLES = MODEL_RATE // 10  # 100 ms of silence between a held interjection and what followed it
# How a reply cut short is remembered: the words that were heard, then this (an interrupted utterance, as
# in written dialogue), so the next turn's model knows it did not finish.
CUT_MARK = "—"
# A wake word detected less than this before the end of its utterance's speech, s, was the whole utterance.
WAKE_ONLY_TAIL_S = 0.35
LISTEN_MODES = ("always", "wake_word")

log = logging.getLogger(__name__)


class State(str, enum.Enum):
    STARTING = "starting"
    LISTENING = "listening"
    THINKING = "thinking"
    SPEAKING = "speaking"
    INTERRUPTED = "interrupted"
    MUTED = "muted"
    ERROR = "error"


Observer = Callable[[dict], None]


class PlaybackControl(Protocol):
    def begin_reply(self, reply_id: int) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def flush(self) -> int: ...
    def spoken_text(self) -> str: ...
    def full_text(self) -> str: ...


class EngineControl(Protocol):
    def submit_turn(self, reply_id: int, audio: Optional[np.ndarray], transcript: Optional[str]) -> None: ...
    def cancel(self, reply_id: int) -> None: ...
    def commit(self, reply_id: int, spoken_text: str, complete: bool) -> None: ...
    def forget(self) -> None: ...  # drop the history (after the jobs already queued)
    def drop_audio(self) -> None: ...  # roll back the audio streamed in of an utterance that is no turn


@dataclass
class _Turn:
    reply_id: int
    t_end_of_turn: float
    user_ms: float
    transcript: Optional[str] = None
    t_first_token: Optional[float] = None
    t_first_audio: Optional[float] = None
    t_onset: Optional[float] = None
    generated: str = ""
    interrupted: bool = False
    metrics: dict = field(default_factory=dict)


class Conversation:
    """Owns the state; runs on its own thread.

    :param playback: the playback buffer (pause/resume/flush).
    :param engine: the engine worker (turns, cancel, commit).
    :param turn_taker: decides barge-in vs backchannel.
    :param clock: seconds since the session started (``time.monotonic`` based by default).
    :param muted: the mute switch at start (the service's persisted one): ``ready`` then enters ``muted``.
    :param keep_turns: keep only the newest this many turns' metrics in :attr:`turns` (None: all; the
        service, which runs for months, keeps 100).
    :param turn_stats: optional ``() -> dict`` merged into each turn's metrics (the sound devices' xruns).
    """

    def __init__(self, playback: PlaybackControl, engine: EngineControl, turn_taker: TurnTaker,
                 clock: Optional[Callable[[], float]] = None, *, muted: bool = False,
                 keep_turns: Optional[int] = None, turn_stats: Optional[Callable[[], dict]] = None):
        self.playback = playback
        self.engine = engine
        self.turn_taker = turn_taker
        t0 = time.monotonic()
        self.clock = clock or (lambda: time.monotonic() - t0)
        self.state = State.STARTING
        self._observers: list[Observer] = []
        self._q = EventQueue()
        self._posted = self._handled = 0
        self._thread: Optional[threading.Thread] = None
        self._reply_id = 0
        self._turn: Optional[_Turn] = None
        self._muted_from: Optional[State] = None
        self._barge_audio_t: Optional[float] = None
        # A stop word that flushed the reply, held until the user has really stopped talking (``vad_settled``)
        # or joined to what they say next: (info, audio, transcript).
        self._held: Optional[tuple] = None
        self.turns: list[dict] = []  # each turn's metrics (a replay's report reads them)
        self.keep_turns = keep_turns
        self.idle = threading.Event()
        # The mute switch: part of the state, written only here. It outlives an error (a lost sound card):
        # ``recovered`` returns to ``muted`` while it is on (and a restart, through the MuteStore observer).
        self._muted = bool(muted)
        self.turn_stats = turn_stats
        self.strict = False  # tests: a handler's exception propagates from handle() instead of being logged
        self.stop_words_only_silence = True
        self.listen_mode = "always"
        self.follow_up_s = 8.0
        self.min_silence_s = 0.5
        self._window_until = float("-inf")  # wake_word mode: speech starting before this needs no wake word
        self._window_timer: Optional[threading.Timer] = None
        self._utterance_onset_t: Optional[float] = None
        self._wake_t: Optional[float] = None  # audio time of the last wake word, s
        self._handlers: dict[Ev, Callable[[dict], None]] = {
            Ev.READY: self._on_ready, Ev.ERROR: self._on_error, Ev.ENGINE_ERROR: self._on_engine_error,
            Ev.RECOVERED: self._on_recovered, Ev.MUTE: self._on_mute, Ev.NEW_CONVERSATION: self._on_new_conversation,
            Ev.STOP_REPLY: self._on_stop_reply, Ev.VAD_ONSET: self._on_vad_onset, Ev.VAD_START: self._on_vad_start,
            Ev.VAD_PROGRESS: self._on_vad_progress, Ev.VAD_REJECT: self._on_vad_reject, Ev.VAD_END: self._on_vad_end,
            Ev.VAD_SETTLED: self._on_vad_settled, Ev.LLM_FIRST_TOKEN: self._on_llm_first_token,
            Ev.LLM_DONE: self._on_llm_done, Ev.TTS_FIRST_AUDIO: self._on_tts_first_audio,
            Ev.TTS_ERROR: lambda info: self._emit(Ev.TTS_ERROR, **info), Ev.DRAINED: self._on_drained, Ev.WAKE: self._on_wake,
            Ev.WINDOW_CHECK: self._on_window_check, Ev.SILENT: self._on_silent,
        }

    @property
    def muted(self) -> bool:
        """The mute switch (read from any thread: the listener drops the microphone while it is on)."""
        return self._muted

    @property
    def interjecting(self) -> bool:
        """The reply is paused for the user's speech (read from any thread: the listener's VAD then ends an
        utterance on the short interjection silence)."""
        return self.state is State.INTERRUPTED

    def configure(self, *, turn_taker: Optional[TurnTaker] = None, stop_words_only_silence: Optional[bool] = None,
                  listen_mode: Optional[str] = None, follow_up_s: Optional[float] = None,
                  min_silence_ms: Optional[float] = None) -> None:
        """Set the conversation's policies (from ``interruption``, ``listen`` and ``vad`` in the config);
        safe while running: each is one reference swap, read at the next event.

        :param turn_taker: the barge-in decider (``interruption``), built by the caller (it may load a model).
        :param stop_words_only_silence: a stop command alone flushes the reply and starts no turn.
        :param listen_mode: ``always`` or ``wake_word``.
        :param follow_up_s: wake_word mode: after a reply (or a wake word), speech starting within this many
            seconds needs no wake word.
        :param min_silence_ms: the VAD's end-of-turn silence, ms (where an utterance's speech ended).
        :raises ValueError: an unknown listen mode.
        """
        if turn_taker is not None:
            self.turn_taker = turn_taker
        if stop_words_only_silence is not None:
            self.stop_words_only_silence = bool(stop_words_only_silence)
        if listen_mode is not None:
            if listen_mode not in LISTEN_MODES:
                raise ValueError(f"listen mode must be one of {LISTEN_MODES}, got {listen_mode!r}")
            self.listen_mode = listen_mode
        if follow_up_s is not None:
            self.follow_up_s = float(follow_up_s)
        if min_silence_ms is not None:
            self.min_silence_s = float(min_silence_ms) / 1000.0

    @property
    def window_open(self) -> bool:
        """Speech starting now would be answered (always true in ``always`` mode)."""
        return self.listen_mode == "always" or self.clock() < self._window_until

    # --- wiring ---
    def subscribe(self, observer: Observer) -> None:
        """``observer(event)`` is called on the conversation thread for every event; it must return fast."""
        self._observers.append(observer)

    def post(self, name: "Ev | str", **info: Any) -> None:
        """Queue an event (see :mod:`appliance.events` for the catalogue and the priorities); never blocks.
        ``info['t']`` defaults to now.

        :raises ValueError: ``name`` is not in the catalogue, or is not an input (in the caller's thread).
        """
        event = Event(kind_of(name), info)
        info.setdefault("t", self.clock())
        self._posted += 1
        self._q.put(event)

    def queue_empty(self) -> bool:
        """Every event posted so far has been handled."""
        return self._handled >= self._posted

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="conversation", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._window_timer is not None:
            self._window_timer.cancel()
        self._q.put_stop()
        if self._thread:
            self._thread.join(timeout=5)

    @property
    def current_reply_id(self) -> int:
        return self._reply_id

    # --- the loop ---
    def _run(self) -> None:
        while True:
            event = self._q.get()
            if not isinstance(event, Event):  # the shutdown marker
                return
            self.handle(event)

    def handle(self, event: Event) -> None:
        """Handle one event on the calling thread (the conversation's own; a test may call it directly)."""
        try:
            self._handlers[event.kind](event.info)
        except Exception:  # a bug here must not kill the appliance's only state owner
            if self.strict:
                raise
            log.exception("conversation: handling %s failed", event.kind.value)
        self._handled += 1
        self._update_idle()

    def _update_idle(self) -> None:
        if self.state in (State.LISTENING, State.MUTED, State.ERROR) and self._turn is None and self._held is None \
                and self._q.empty():
            self.idle.set()
        else:
            self.idle.clear()

    def _emit(self, event: Ev, **info: Any) -> None:
        info.setdefault("t", self.clock())
        record = {"t": round(float(info.pop("t")), 4), "event": event, **info}
        for obs in list(self._observers):
            try:
                obs(record)
            except Exception:
                log.exception("observer %r failed on %s", obs, event)

    def _set(self, state: State, t: Optional[float] = None, **info: Any) -> None:
        if state == self.state:
            return
        prev, self.state = self.state, state
        self._emit(Ev.STATE, t=self.clock() if t is None else t, state=state.value, previous=prev.value, **info)

    # --- handlers ---
    def _on_ready(self, info: dict) -> None:
        self._set(State.MUTED if self._muted else State.LISTENING, info["t"])
        if self.listen_mode == "wake_word":
            self._emit(Ev.LISTEN_WINDOW, t=info["t"], open=False)

    def _on_error(self, info: dict) -> None:
        self._held = None
        self._emit(Ev.ERROR, **info)
        self._set(State.ERROR, info["t"], reason=info.get("reason", ""))

    def _on_engine_error(self, info: dict) -> None:
        """A failed turn: log it, drop the reply, keep listening (the next turn may well work)."""
        self._emit(Ev.ENGINE_ERROR, **info)
        if self._turn is not None:
            self._abort_reply(info["t"], reason="engine error")
        if self.state in (State.THINKING, State.SPEAKING, State.INTERRUPTED):
            self._set(State.LISTENING, info["t"])

    def _on_recovered(self, info: dict) -> None:
        self._emit(Ev.RECOVERED, **info)
        if self.state == State.ERROR:
            self._set(State.MUTED if self._muted else State.LISTENING, info["t"])

    def _on_mute(self, info: dict) -> None:
        muted = info.get("muted")
        muted = (not self._muted) if muted is None else bool(muted)
        if muted != self._muted:
            self._muted = muted
            self._emit(Ev.MUTE, t=info["t"], muted=muted, source=info.get("source"))  # the MuteStore keeps it
        if self.state in (State.ERROR, State.STARTING):  # the error stays on show; the switch applies on recovery
            return
        if muted and self.state != State.MUTED:
            self._abort_reply(info["t"], reason="muted")
            self._set(State.MUTED, info["t"])
        elif not muted and self.state == State.MUTED:
            self._set(State.LISTENING, info["t"])

    def _on_new_conversation(self, info: dict) -> None:
        """A long press of the button: stop any reply and forget the history (the engine rebuilds its
        cache with the system prompt only, on its own thread)."""
        self._abort_reply(info["t"], reason="new conversation")
        self.engine.forget()
        self._emit(Ev.NEW_CONVERSATION, **info)
        if self.state in (State.THINKING, State.SPEAKING, State.INTERRUPTED):
            self._set(State.LISTENING, info["t"])

    def _on_stop_reply(self, info: dict) -> None:
        """The button pressed while speaking: stop the reply, keep what was said."""
        if self.state in (State.THINKING, State.SPEAKING, State.INTERRUPTED):
            self._abort_reply(info["t"], reason="button")
            self._set(State.LISTENING, info["t"])

    def _on_vad_onset(self, info: dict) -> None:
        self._emit(Ev.VAD_ONSET, **info)
        if self.state == State.LISTENING:
            self._utterance_onset_t = info["t"]
        if self.state == State.SPEAKING:
            self.playback.pause()
            self._barge_audio_t = info.get("audio_t")
            if self._turn:
                self._turn.t_onset = info["t"]
            self._emit(Ev.INTERRUPTED, t=self.clock(), onset_t=info["t"], audio_t=info.get("audio_t"))
            self._set(State.INTERRUPTED)

    def _on_vad_start(self, info: dict) -> None:
        self._emit(Ev.VAD_START, **info)

    def _on_vad_progress(self, info: dict) -> None:
        if self.state == State.INTERRUPTED:
            decision = self.turn_taker.during(info.get("speech_ms", 0.0), info.get("audio"))
            if decision == BargeInDecision.INTERRUPT:
                self._flush(info["t"], reason="long speech")

    def _on_vad_reject(self, info: dict) -> None:
        audio = info.pop("audio", None)
        transcript = info.pop("transcript", None)
        self._emit(Ev.VAD_REJECT, **info)
        if self.state == State.INTERRUPTED:
            # Too short to be confirmed as speech: a noise, a backchannel, or a short "Stop." — the
            # classifier hears it; only a stop word flushes (and is then the next user turn).
            decision = self.turn_taker.at_end(info.get("speech_ms", 0.0), audio, transcript) \
                if audio is not None else BargeInDecision.RESUME
            if decision != BargeInDecision.INTERRUPT:
                self._resume(info["t"], reason="not speech", heard=self.turn_taker_hypothesis())
                return
            self._flush(info["t"], reason="short interruption")
            self._hold(info, audio, transcript)
            return
        if self._held is not None and self.state == State.LISTENING and self._held[3]:
            # Short speech after a held stop command: more stop words change nothing; other words
            # ("Wait, … why?") make the held interjection a question after all.
            if self.turn_taker.stop_command(info.get("speech_ms", 0.0), audio) is False:
                held_info = self._held[0]
                audio, transcript = self._join_held(audio, transcript)
                self._held = (held_info, audio, transcript, False)

    def _on_vad_end(self, info: dict) -> None:
        audio = info.pop("audio", None)
        transcript = info.pop("transcript", None)
        self._emit(Ev.VAD_END, **info)
        if self.state == State.INTERRUPTED:
            decision = self.turn_taker.at_end(info.get("speech_ms", 0.0), audio, transcript)
            if decision == BargeInDecision.RESUME:
                self._resume(info["t"], reason="backchannel", transcript=transcript, heard=self.turn_taker_hypothesis())
                return
            self._flush(info["t"], reason="interruption")
            self._hold(info, audio, transcript)
            return
        if self._held is not None and self.state == State.LISTENING:
            if self._held[3] and self.stop_words_only_silence \
                    and self.turn_taker.stop_command(info.get("speech_ms", 0.0), audio) is True:
                return self._not_a_turn()  # "Wait," … "stop.": still a stop command alone; ``vad_settled`` decides
            audio, transcript = self._join_held(audio, transcript)
        elif self.state == State.LISTENING and not self._accepts(info):
            return self._not_a_turn()
        if self.state == State.THINKING and self._turn is not None:
            # The user went on talking before we said anything: drop the unsaid reply, take the new words.
            self._abort_reply(info["t"], reason="user continued")
            self._set(State.LISTENING, info["t"])
        self._start_turn(info, audio, transcript)

    def _not_a_turn(self) -> None:
        """The utterance that just ended is no turn: the engine rolls back what it pre-filled of it."""
        self.engine.drop_audio()

    def _on_vad_settled(self, info: dict) -> None:
        """The user stopped talking after an interjection: a held stop word becomes the turn, or, when it
        is a stop command alone and ``stop_words_only_silence`` is on, nothing does."""
        if self._held is not None and self.state == State.LISTENING:
            held_info, audio, transcript, stop_command = self._held
            self._held = None
            self._emit(Ev.VAD_SETTLED, **info)
            if stop_command and self.stop_words_only_silence:
                self._emit(Ev.STOPPED, t=info["t"], heard=self.turn_taker_hypothesis(), transcript=transcript)
                self._open_window(info["t"])
                return
            self._start_turn({**held_info, "t": info["t"]}, audio, transcript)

    def _hold(self, info: dict, audio: Optional[np.ndarray], transcript: Optional[str]) -> None:
        """Keep a flushing interjection ("Wait,") until the user stops or goes on ("… stop.")."""
        stop_command = self.turn_taker.last_was_stop_command()
        self._held = (info, audio, transcript, stop_command)
        self._emit(Ev.HELD, t=info["t"], speech_ms=info.get("speech_ms"), stop_command=stop_command)

    def _join_held(self, audio: Optional[np.ndarray], transcript: Optional[str]):
        """The held interjection, a short gap, then the utterance that followed it: one turn."""
        _, held_audio, held_transcript, _ = self._held
        self._held = None
        if held_audio is not None and audio is not None:
            audio = np.concatenate([held_audio, np.zeros(JOIN_GAP_SAMPLES, np.float32), audio])
        if held_transcript and transcript and held_transcript != transcript:
            transcript = f"{held_transcript} {transcript}"
        else:
            transcript = transcript or held_transcript
        return audio, transcript

    def turn_taker_hypothesis(self) -> Optional[str]:
        """What the barge-in classifier heard last, if it says (for the timeline)."""
        return getattr(self.turn_taker, "hypothesis", None)

    def _start_turn(self, info: dict, audio: Optional[np.ndarray], transcript: Optional[str]) -> None:
        """The user's utterance becomes the next turn (only from ``listening``)."""
        if self.state != State.LISTENING:
            return
        self._reply_id += 1
        self._turn = _Turn(self._reply_id, info["t"], info.get("speech_ms", 0.0), transcript)
        self.playback.begin_reply(self._reply_id)
        self.engine.submit_turn(self._reply_id, audio, transcript)
        self._set(State.THINKING, info["t"], reply_id=self._reply_id)

    def _on_llm_first_token(self, info: dict) -> None:
        if self._turn and info.get("reply_id") == self._turn.reply_id:
            self._turn.t_first_token = info["t"]
            self._emit(Ev.LLM_FIRST_TOKEN, **info)

    def _on_llm_done(self, info: dict) -> None:
        if self._turn and info.get("reply_id") == self._turn.reply_id:
            self._turn.generated = info.get("text", "")
            self._turn.metrics.update({k: info[k] for k in ("prefill_tokens", "generated_tokens", "input", "streamed",
                                                           "audio_tokens_left") if k in info})
        self._emit(Ev.LLM_DONE, **info)

    def _on_tts_first_audio(self, info: dict) -> None:
        if self._turn and info.get("reply_id") == self._turn.reply_id:
            self._turn.t_first_audio = info["t"]
            self._emit(Ev.TTS_FIRST_AUDIO, **info)
            if self.state == State.THINKING:
                self._set(State.SPEAKING, info["t"])

    def _on_drained(self, info: dict) -> None:
        if self._turn and info.get("reply_id") == self._turn.reply_id and self.state in (State.SPEAKING, State.THINKING):
            text = self.playback.full_text()
            self.engine.commit(self._turn.reply_id, text, complete=True)
            self._end_turn(info["t"], text)
            self._set(State.LISTENING, info["t"])
            self._open_window(info["t"])

    # --- listening window (wake_word mode) ---
    def _on_wake(self, info: dict) -> None:
        """The wake-word detector heard its phrase (``audio_t``: where, in the microphone's time, s)."""
        self._emit(Ev.WAKE, **info)
        if self.listen_mode != "wake_word" or self.state in (State.MUTED, State.ERROR):
            return
        self._wake_t = info.get("audio_t")
        self._open_window(info["t"])

    def _on_window_check(self, info: dict) -> None:
        if self.listen_mode == "wake_word" and self._window_timer is not None and self.clock() >= self._window_until:
            self._window_timer = None
            self._emit(Ev.LISTEN_WINDOW, t=info["t"], open=False)

    def _open_window(self, t: float) -> None:
        if self.listen_mode != "wake_word":
            return
        self._window_until = t + self.follow_up_s
        self._emit(Ev.LISTEN_WINDOW, t=t, open=True, until=round(self._window_until, 4))
        if self._window_timer is not None:
            self._window_timer.cancel()
        self._window_timer = threading.Timer(self.follow_up_s + 0.01, lambda: self.post("window_check"))
        self._window_timer.daemon = True
        self._window_timer.start()

    def _accepts(self, info: dict) -> bool:
        """Is this utterance (a ``vad_end`` while listening) a turn? In ``wake_word`` mode: only if it
        started inside the window, or held the wake word with more speech after it. Emits ``ignored``
        or opens the window for an utterance that was only the wake word."""
        if self.listen_mode == "always":
            return True
        onset = self._utterance_onset_t if self._utterance_onset_t is not None else info["t"]
        if onset < self._window_until and self._wake_t is None:
            return True
        wake, self._wake_t = self._wake_t, None
        audio_t = info.get("audio_t")
        if wake is not None and audio_t is not None:
            speech_end = audio_t - self.min_silence_s
            if speech_end - wake < WAKE_ONLY_TAIL_S:
                self._emit(Ev.IGNORED, t=info["t"], reason="the wake word alone: listening for the question")
                return False
            return True
        if onset < self._window_until:
            return True
        self._emit(Ev.IGNORED, t=info["t"], reason="no wake word")
        return False

    def _on_silent(self, info: dict) -> None:
        if self.state == State.INTERRUPTED or info.get("flushed"):
            self._emit(Ev.OUTPUT_SILENT, **info)

    # --- helpers ---
    def _resume(self, t: float, **why: Any) -> None:
        self.playback.resume()
        self._emit(Ev.RESUMED, t=t, **why)
        self._set(State.SPEAKING, t)

    def _flush(self, t: float, reason: str) -> None:
        if self._turn:
            self._turn.interrupted = True
        self._abort_reply(t, reason=reason)
        self._set(State.LISTENING, t)
        self._open_window(t)

    def _abort_reply(self, t: float, reason: str) -> None:
        """Stop the current reply wherever it is: drop unplayed audio, cancel generation, keep only the
        text that reached the speaker in the history. A held interjection is dropped too."""
        self._held = None
        if self._turn is None:
            return
        dropped = self.playback.flush()
        self.engine.cancel(self._turn.reply_id)
        spoken = self.playback.spoken_text()
        remembered = cut_reply(spoken)
        self.engine.commit(self._turn.reply_id, remembered, complete=False)
        self._emit(Ev.FLUSHED, t=t, reason=reason, dropped_samples=dropped, spoken=spoken,
                   synthesized=self.playback.full_text(), remembered=remembered)
        self._end_turn(t, spoken)

    def _end_turn(self, t: float, text: str) -> None:
        turn = self._turn
        if turn is None:
            return
        self._turn = None
        ms = lambda a, b: None if a is None or b is None else round((b - a) * 1000.0, 1)  # noqa: E731
        metrics = {
            "reply_id": turn.reply_id,
            "user_speech_ms": round(turn.user_ms, 1),
            "eot_to_first_token_ms": ms(turn.t_end_of_turn, turn.t_first_token),
            "first_token_to_first_audio_ms": ms(turn.t_first_token, turn.t_first_audio),
            "eot_to_first_audio_ms": ms(turn.t_end_of_turn, turn.t_first_audio),
            "interrupted": turn.interrupted,
            **turn.metrics,
        }
        if turn.transcript is not None:
            metrics["heard_transcript"] = turn.transcript
        if self.turn_stats is not None:
            try:
                metrics.update(self.turn_stats())
            except Exception:
                log.exception("turn_stats failed")
        self.turns.append(metrics)
        if self.keep_turns is not None:
            del self.turns[: -self.keep_turns]
        self._emit(Ev.TURN_END, t=t, text=text, **{k: v for k, v in metrics.items() if k != "reply_id"}, reply_id=turn.reply_id)


def cut_reply(spoken: str) -> str:
    """How a reply cut after the words ``spoken`` is remembered: those words, then :data:`CUT_MARK`
    ("A rainbow is an arc—"); "" when none were heard."""
    text = spoken.strip().rstrip(",;:")
    return f"{text}{CUT_MARK}" if text else ""
