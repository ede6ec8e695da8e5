"""The catalogue of events: what is posted to the conversation, and what its observers see.

Every event has a kind, a member of :class:`Ev` (a ``str`` enum, so a record's ``"event"`` compares equal to
its name and is written to JSON as that name). Parts post *inputs* (:data:`INPUTS`) to the conversation with
``conversation.post(Ev.VAD_ONSET, audio_t=…)``; a name that is not in the catalogue, or an event that is not
an input, raises :class:`ValueError` in the poster's thread, so a misspelt event cannot pass unseen.

Observers (LEDs, the timeline, metrics, the mute store, the simulated room) get a *record* for every event:
a dict ``{"t": seconds, "event": Ev, **fields}`` on the conversation's thread (see
:meth:`appliance.conversation.Conversation.subscribe`).

Priority (as Pipecat's system frames skip the queues): :class:`EventQueue` hands the conversation

- :data:`CONTROL` events (the button's stop, mute and new conversation) before anything queued: they
  change what every queued event means (a queued end of turn must not start a reply after a mute);
- :data:`URGENT` events (the speech onset that pauses a reply: the barge-in) before queued events that
  cannot change the state (:data:`INFORMATIONAL`: the model's first token and end, a TTS error, the output's
  silence, the wake-word window's timer). They never overtake an event that can change the state (another
  VAD event, the reply's first audio or its end, an error), because the onset's meaning depends on it: an
  onset that overtook ``tts_first_audio`` would find the appliance still thinking and would not pause.

Otherwise events are handled in the order they were posted.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any


class Ev(str, enum.Enum):
    """Every event's kind. Inputs are posted to the conversation; outputs are only emitted by it (or, for
    :data:`TIMELINE_ONLY`, written to the timeline by the replay and the simulated room)."""

    # --- inputs: the life cycle and the sound devices
    READY = "ready"                    # the audio runs: leave ``starting``
    ERROR = "error"                    # reason: str (a device lost or unavailable)
    RECOVERED = "recovered"            # device: str (the sound device is back)
    # --- inputs: the button (CONTROL)
    MUTE = "mute"                      # muted: bool or absent (toggle); emitted with muted: bool when it changes
    STOP_REPLY = "stop_reply"          # source: str
    NEW_CONVERSATION = "new_conversation"  # source: str
    # --- inputs: the listener (the VAD and the wake word), audio_t: s in the microphone's time
    VAD_ONSET = "vad_onset"            # audio_t: s (microphone time); prob: float
    VAD_START = "vad_start"            # speech_ms: float
    VAD_PROGRESS = "vad_progress"      # speech_ms: float
    VAD_REJECT = "vad_reject"          # speech_ms, audio: float32 [n] 16 kHz, transcript: str | None
    VAD_END = "vad_end"                # speech_ms, silence_ms, audio, transcript, eot_prob
    VAD_SETTLED = "vad_settled"
    WAKE = "wake"                      # word: str
    # --- inputs: the engine, the TTS and the playback buffer
    LLM_FIRST_TOKEN = "llm_first_token"  # reply_id, prefill_tokens
    LLM_DONE = "llm_done"              # reply_id, text, prefill_tokens, generated_tokens, cancelled, input
    ENGINE_ERROR = "engine_error"      # reason: str
    TTS_FIRST_AUDIO = "tts_first_audio"  # reply_id
    TTS_ERROR = "tts_error"            # reason: str
    DRAINED = "drained"                # reply_id: every sample of the reply was played
    SILENT = "silent"                  # the output faded to silence (flushed: bool)
    WINDOW_CHECK = "window_check"      # the wake-word window's timer
    # --- outputs of the conversation
    STATE = "state"                    # state, previous: str; reason, reply_id
    INTERRUPTED = "interrupted"        # onset_t: s; audio_t: s, the onset in the microphone's time (the reply paused for speech)
    RESUMED = "resumed"                # reason, heard, transcript
    FLUSHED = "flushed"                # reason, dropped_samples, spoken, synthesized, remembered
    HELD = "held"                      # speech_ms, stop_command
    STOPPED = "stopped"                # heard, transcript: a stop command alone, no turn
    IGNORED = "ignored"                # reason (wake_word mode)
    LISTEN_WINDOW = "listen_window"    # open: bool, until: s
    OUTPUT_SILENT = "output_silent"
    TURN_END = "turn_end"              # text and the turn's metrics (see appliance.metrics)
    # --- timeline only (the replay and the simulated room write them; never posted)
    USER_SPEECH = "user_speech"        # source, onset_t, end_t, text
    REPLAY_START = "replay_start"
    REPLAY_END = "replay_end"          # stopped: why, when a replay was cut short (Ctrl-C)

    def __str__(self) -> str:  # in logs and f-strings, the name as it is written to the timeline
        return self.value


INPUTS = frozenset({
    Ev.READY, Ev.ERROR, Ev.RECOVERED, Ev.MUTE, Ev.STOP_REPLY, Ev.NEW_CONVERSATION, Ev.VAD_ONSET,
    Ev.VAD_START, Ev.VAD_PROGRESS, Ev.VAD_REJECT, Ev.VAD_END, Ev.VAD_SETTLED, Ev.WAKE, Ev.LLM_FIRST_TOKEN,
    Ev.LLM_DONE, Ev.ENGINE_ERROR, Ev.TTS_FIRST_AUDIO, Ev.TTS_ERROR, Ev.DRAINED, Ev.SILENT, Ev.WINDOW_CHECK,
})
TIMELINE_ONLY = frozenset({Ev.USER_SPEECH, Ev.REPLAY_START, Ev.REPLAY_END})
CONTROL = frozenset({Ev.STOP_REPLY, Ev.MUTE, Ev.NEW_CONVERSATION})
URGENT = frozenset({Ev.VAD_ONSET})
INFORMATIONAL = frozenset({Ev.LLM_FIRST_TOKEN, Ev.LLM_DONE, Ev.TTS_ERROR, Ev.SILENT, Ev.WINDOW_CHECK})


def kind_of(name: "Ev | str") -> Ev:
    """The catalogue's member for ``name``; :class:`ValueError` for a name that is not in it."""
    if isinstance(name, Ev):
        return name
    try:
        return Ev(name)
    except ValueError:
        raise ValueError(f"unknown event {name!r}: not in appliance.events.Ev") from None


@dataclass(frozen=True)
class Event:
    """One posted event: its kind and its fields (``t``: seconds on the conversation's clock)."""

    kind: Ev
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in INPUTS:
            raise ValueError(f"{self.kind.value!r} is emitted by the conversation, not posted to it")


_STOP = object()  # the shutdown marker (not an event)


class EventQueue:
    """The conversation's inbox: FIFO, except that :data:`CONTROL` events overtake everything queued and
    :data:`URGENT` ones overtake queued :data:`INFORMATIONAL` ones (see the module's docstring).

    ``put`` never blocks (callable from audio callbacks); ``get`` blocks until an item is there. Items are
    :class:`Event` or the shutdown marker from :meth:`put_stop`.
    """

    def __init__(self) -> None:
        self._items: deque = deque()
        self._cond = threading.Condition(threading.Lock())

    def put(self, event: Event) -> None:
        with self._cond:
            self._items.insert(self._place(event.kind), event)
            self._cond.notify()

    def put_stop(self) -> None:
        """The shutdown, after everything queued (a replay's last events still reach its timeline)."""
        with self._cond:
            self._items.append(_STOP)
            self._cond.notify()

    def get(self) -> Any:
        with self._cond:
            while not self._items:
                self._cond.wait()
            return self._items.popleft()

    def empty(self) -> bool:
        with self._cond:
            return not self._items

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def _place(self, kind: Ev) -> int:
        if kind in CONTROL:
            return self._after_last(lambda k: k in CONTROL)
        if kind in URGENT:
            return self._after_last(lambda k: k not in INFORMATIONAL)
        return len(self._items)

    def _after_last(self, keeps_place) -> int:
        """The index just after the last queued item for which ``keeps_place(kind)`` is true (0: none)."""
        for i in range(len(self._items) - 1, -1, -1):
            item = self._items[i]
            if keeps_place(item.kind if isinstance(item, Event) else item):
                return i + 1
        return 0
