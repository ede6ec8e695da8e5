"""The conversation's state machine in milliseconds: fake engine, playback and TTS through the Protocols the
conversation uses (``EngineControl``, ``PlaybackControl``, the Tts the TTS worker calls), and a classifier
that "hears" the transcript it is given. Modelled on Pipecat's ``run_test(processor, frames_to_send,
expected_down_frames)``: :func:`run_test` hands the conversation a list of events on the test's thread and
compares what its observers saw with the expected list, in order and in full.

The real-model tests (test_conversation.py, test_stop.py, …) stay: these cover every transition fast.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import numpy as np
import pytest

from appliance.conversation import CUT_MARK, Conversation, State
from appliance.events import CONTROL, Ev, Event, EventQueue
from appliance.turns import BargeInDecision, TurnTaker, _decide_words


# --- fakes through the Protocols ---------------------------------------------------------------------------

class FakePlayback:
    """``PlaybackControl``: remembers each call; ``heard`` is what "reached the speaker"."""

    def __init__(self):
        self.calls: list = []
        self.text = ""
        self.heard = ""

    def begin_reply(self, reply_id):
        self.calls.append(("begin_reply", reply_id))
        self.text = self.heard = ""

    def pause(self):
        self.calls.append("pause")

    def resume(self):
        self.calls.append("resume")

    def flush(self):
        self.calls.append("flush")
        return 4800

    def spoken_text(self):
        return self.heard

    def full_text(self):
        return self.text


class FakeEngine:
    """``EngineControl``: remembers turns, cancels, commits, forgets and drops streamed audio."""

    def __init__(self):
        self.calls: list = []

    def submit_turn(self, reply_id, audio, transcript):
        self.calls.append(("turn", reply_id, transcript))

    def cancel(self, reply_id):
        self.calls.append(("cancel", reply_id))

    def commit(self, reply_id, spoken_text, complete):
        self.calls.append(("commit", reply_id, spoken_text, complete))

    def forget(self):
        self.calls.append("forget")

    def drop_audio(self):
        self.calls.append("drop_audio")


class HeardClassifier:
    """A ``BackchannelClassifier`` that hears the audio as the words :func:`say` attached to it."""

    def __init__(self):
        self.last: Optional[str] = None
        self.words: dict[int, str] = {}

    def classify(self, audio, transcript):
        self.last = self.hypothesis(audio) if audio is not None else None
        return _decide_words(self.last) if self.last else None

    def hypothesis(self, audio):
        return self.words.get(len(audio), "")


def say(clf: HeardClassifier, words: str) -> np.ndarray:
    """Audio (silence, 16 kHz) that ``clf`` hears as ``words`` (told apart by length)."""
    n = 3200 + 160 * len(clf.words)
    clf.words[n] = words.lower().strip(" .,!?")
    return np.zeros(n, np.float32)


def make(**configure) -> tuple[Conversation, FakePlayback, FakeEngine, HeardClassifier]:
    pb, eng, clf = FakePlayback(), FakeEngine(), HeardClassifier()
    ticks = iter(range(1, 10 ** 6))
    conv = Conversation(pb, eng, TurnTaker(700.0, clf), clock=lambda: next(ticks) / 100.0,
                        muted=configure.pop("muted", False))
    conv.strict = True
    conv.configure(**configure)
    return conv, pb, eng, clf


def seen(records: list[dict]) -> list[str]:
    """Each record as ``event`` or ``state:<state>``."""
    return [f"state:{r['state']}" if r["event"] == Ev.STATE else r["event"].value for r in records]


def run_test(conv: Conversation, events: list, expected: list[str]) -> list[dict]:
    """Hand ``conv`` each of ``events`` (``(kind, info)``) on this thread; assert the records its observers
    saw are ``expected`` (see :func:`seen`), all of them, in order. Returns the records."""
    records: list[dict] = []
    conv.subscribe(records.append)
    for kind, info in events:
        conv.handle(Event(Ev(kind), {"t": conv.clock(), **info}))
    conv._observers.remove(records.append)
    assert seen(records) == expected
    return records


QUESTION = ("vad_end", {"speech_ms": 900.0, "transcript": "What is a rainbow?"})


def listening(**configure):
    conv, pb, eng, clf = make(**configure)
    run_test(conv, [("ready", {})], ["state:listening"])
    return conv, pb, eng, clf


def thinking(**configure):
    conv, pb, eng, clf = listening(**configure)
    run_test(conv, [QUESTION], ["vad_end", "state:thinking"])
    return conv, pb, eng, clf


def speaking(**configure):
    conv, pb, eng, clf = thinking(**configure)
    run_test(conv, [("llm_first_token", {"reply_id": 1}), ("tts_first_audio", {"reply_id": 1})],
             ["llm_first_token", "tts_first_audio", "state:speaking"])
    pb.text, pb.heard = "A rainbow is light. It bends.", "A rainbow is light,"
    return conv, pb, eng, clf


def interrupted(**configure):
    conv, pb, eng, clf = speaking(**configure)
    run_test(conv, [("vad_onset", {})], ["vad_onset", "interrupted", "state:interrupted"])
    return conv, pb, eng, clf


AT = {"starting": make, "listening": listening, "thinking": thinking, "speaking": speaking,
      "interrupted": interrupted}


# --- every transition ---------------------------------------------------------------------------------------

def test_a_turn_start_to_end():
    conv, pb, eng, _ = make()
    assert conv.state is State.STARTING
    run_test(conv, [("ready", {}), ("vad_onset", {}), ("vad_start", {"speech_ms": 300.0}), QUESTION,
                    ("llm_first_token", {"reply_id": 1}), ("tts_first_audio", {"reply_id": 1}),
                    ("llm_done", {"reply_id": 1, "text": "Light.", "prefill_tokens": 40, "generated_tokens": 3}),
                    ("drained", {"reply_id": 1})],
             ["state:listening", "vad_onset", "vad_start", "vad_end", "state:thinking", "llm_first_token",
              "tts_first_audio", "state:speaking", "llm_done", "turn_end", "state:listening"])
    assert eng.calls == [("turn", 1, "What is a rainbow?"), ("commit", 1, "", True)]
    assert pb.calls == [("begin_reply", 1)]
    turn = conv.turns[-1]
    assert turn["reply_id"] == 1 and turn["prefill_tokens"] == 40 and not turn["interrupted"]
    assert turn["eot_to_first_token_ms"] > 0 and turn["eot_to_first_audio_ms"] > turn["eot_to_first_token_ms"]


def test_a_stale_reply_changes_nothing():
    conv, pb, eng, _ = speaking()
    run_test(conv, [("drained", {"reply_id": 7}), ("tts_first_audio", {"reply_id": 7})], [])
    assert conv.state is State.SPEAKING


def test_barge_in_then_backchannel_resumes():
    conv, pb, eng, clf = interrupted()
    assert pb.calls[-1] == "pause" and conv.interjecting
    run_test(conv, [("vad_end", {"speech_ms": 400.0, "audio": say(clf, "uh-huh")})],
             ["vad_end", "resumed", "state:speaking"])
    assert pb.calls[-1] == "resume" and not conv.interjecting


def test_barge_in_a_noise_resumes():
    conv, pb, eng, _ = interrupted()
    records = run_test(conv, [("vad_reject", {"speech_ms": 64.0})], ["vad_reject", "resumed", "state:speaking"])
    assert records[1]["reason"] == "not speech"


def test_barge_in_long_speech_flushes_and_becomes_the_next_turn():
    conv, pb, eng, _ = interrupted()
    records = run_test(conv, [("vad_progress", {"speech_ms": 800.0}),
                              ("vad_end", {"speech_ms": 1500.0, "transcript": "Tell me about the moon instead."})],
                       ["flushed", "turn_end", "state:listening", "vad_end", "state:thinking"])
    assert records[0]["reason"] == "long speech" and records[0]["remembered"] == f"A rainbow is light{CUT_MARK}"
    assert ("cancel", 1) in eng.calls and ("commit", 1, f"A rainbow is light{CUT_MARK}", False) in eng.calls
    assert eng.calls[-1] == ("turn", 2, "Tell me about the moon instead.")
    assert conv.turns[-1]["interrupted"]


def test_a_stop_command_alone_stops_and_starts_no_turn():
    conv, pb, eng, clf = interrupted()
    run_test(conv, [("vad_end", {"speech_ms": 400.0, "audio": say(clf, "Stop.")}), ("vad_settled", {})],
             ["vad_end", "flushed", "turn_end", "state:listening", "held", "vad_settled", "stopped"])
    assert not any(c[0] == "turn" and c[1] == 2 for c in eng.calls if isinstance(c, tuple))


def test_a_held_interjection_joins_what_follows():
    conv, pb, eng, clf = interrupted()
    run_test(conv, [("vad_end", {"speech_ms": 400.0, "audio": say(clf, "Wait,"), "transcript": "Wait,"}),
                    ("vad_onset", {}),
                    ("vad_end", {"speech_ms": 900.0, "audio": say(clf, "what about the moon"),
                                 "transcript": "what about the moon?"})],
             ["vad_end", "flushed", "turn_end", "state:listening", "held", "vad_onset", "vad_end", "state:thinking"])
    assert eng.calls[-1] == ("turn", 2, "Wait, what about the moon?")


def test_the_user_goes_on_talking_while_it_thinks():
    conv, pb, eng, _ = thinking()
    records = run_test(conv, [("vad_end", {"speech_ms": 600.0, "transcript": "And why?"})],
                       ["vad_end", "flushed", "turn_end", "state:listening", "state:thinking"])
    assert records[1]["reason"] == "user continued" and eng.calls[-1] == ("turn", 2, "And why?")


@pytest.mark.parametrize("state", ["thinking", "speaking", "interrupted"])
def test_stop_reply_while_busy(state):
    conv, pb, eng, _ = AT[state]()
    records = run_test(conv, [("stop_reply", {"source": "button"})], ["flushed", "turn_end", "state:listening"])
    assert records[0]["reason"] == "button" and ("cancel", 1) in eng.calls
    assert eng.calls[-1][0] == "commit" and eng.calls[-1][3] is False


def test_stop_reply_while_listening_does_nothing():
    conv, pb, eng, _ = listening()
    run_test(conv, [("stop_reply", {})], [])
    assert eng.calls == []


@pytest.mark.parametrize("state", ["listening", "thinking", "speaking", "interrupted"])
def test_new_conversation(state):
    conv, pb, eng, _ = AT[state]()
    busy = state != "listening"
    run_test(conv, [("new_conversation", {"source": "button"})],
             (["flushed", "turn_end"] if busy else []) + ["new_conversation"] + (["state:listening"] if busy else []))
    assert eng.calls[-1] == "forget"  # after the cut reply's commit: the engine forgets it too
    assert conv.state is State.LISTENING


@pytest.mark.parametrize("state", ["starting", "listening", "thinking", "speaking", "interrupted"])
def test_mute_in_each_state(state):
    conv, pb, eng, _ = AT[state]()
    busy = state in ("thinking", "speaking", "interrupted")
    expected = ["mute"] + (["flushed", "turn_end"] if busy else []) + ([] if state == "starting" else ["state:muted"])
    records = run_test(conv, [("mute", {"source": "button"})], expected)
    assert records[0]["muted"] is True and conv.muted
    if busy:
        assert records[1]["reason"] == "muted"
    if state == "starting":  # the switch applies when the audio runs
        run_test(conv, [("ready", {})], ["state:muted"])
    # Muted: speech reaches nothing; a second press unmutes.
    run_test(conv, [QUESTION], ["vad_end"])
    run_test(conv, [("mute", {})], ["mute", "state:listening"])
    assert not conv.muted


def test_mute_during_an_error_applies_on_recovery():
    conv, pb, eng, _ = listening()
    run_test(conv, [("error", {"reason": "sound device lost"}), ("mute", {"muted": True}), ("recovered", {})],
             ["error", "state:error", "mute", "recovered", "state:muted"])
    run_test(conv, [("mute", {"muted": True})], [])  # already on: no record, no change


def test_muted_at_start_comes_up_muted():
    conv, *_ = make(muted=True)
    run_test(conv, [("ready", {})], ["state:muted"])


def test_engine_error_drops_the_reply_and_listens():
    conv, pb, eng, _ = thinking()
    run_test(conv, [("engine_error", {"reason": "boom"})], ["engine_error", "flushed", "turn_end", "state:listening"])


def test_error_and_recovery_from_speaking():
    conv, pb, eng, _ = speaking()
    run_test(conv, [("stop_reply", {"source": "device lost"}), ("error", {"reason": "sound device lost"}),
                    ("recovered", {"device": "card"})],
             ["flushed", "turn_end", "state:listening", "error", "state:error", "recovered", "state:listening"])


def test_output_silent_only_when_it_matters():
    conv, pb, eng, _ = interrupted()
    run_test(conv, [("silent", {})], ["output_silent"])
    conv, pb, eng, _ = speaking()
    run_test(conv, [("silent", {}), ("silent", {"flushed": True})], ["output_silent"])


def test_wake_word_mode():
    conv, pb, eng, _ = make(listen_mode="wake_word", follow_up_s=60.0, min_silence_ms=500)
    run_test(conv, [("ready", {})], ["state:listening", "listen_window"])
    run_test(conv, [QUESTION], ["vad_end", "ignored"])  # no wake word
    assert eng.calls == ["drop_audio"]  # no turn: the engine rolls back the audio streamed in of it
    records = run_test(conv, [("wake", {"audio_t": 1.0, "word": "okay_nabu"}), ("vad_onset", {}),
                              ("vad_end", {"speech_ms": 900.0, "audio_t": 3.0, "transcript": "What is it?"})],
                       ["wake", "listen_window", "vad_onset", "vad_end", "state:thinking"])
    assert records[1]["open"] is True
    conv.stop()  # the window's timer


def test_a_reload_while_speaking_takes_effect_at_the_next_event():
    """The session's reload hands the conversation its sections (``configure``) while a reply plays: the
    next interjection is decided by the new turn taker and the new stop policy."""
    conv, pb, eng, clf = speaking()
    conv.configure(turn_taker=TurnTaker(300.0, clf), stop_words_only_silence=False)
    run_test(conv, [("vad_onset", {}), ("vad_progress", {"speech_ms": 350.0})],  # short of 700, over 300
             ["vad_onset", "interrupted", "state:interrupted", "flushed", "turn_end", "state:listening"])
    run_test(conv, [("tts_first_audio", {"reply_id": 1})], [])
    # Stop words no longer end in silence: a held "Stop." becomes the next turn.
    conv, pb, eng, clf = interrupted()
    conv.configure(stop_words_only_silence=False)
    run_test(conv, [("vad_end", {"speech_ms": 250.0, "audio": say(clf, "stop"), "transcript": "Stop."}),
                    ("vad_settled", {})],
             ["vad_end", "flushed", "turn_end", "state:listening", "held", "vad_settled", "state:thinking"])
    assert eng.calls[-1] == ("turn", 2, "Stop.")


# --- the catalogue ------------------------------------------------------------------------------------------

def test_an_unknown_or_output_event_is_an_error_at_post():
    conv, *_ = make()
    with pytest.raises(ValueError, match="unknown event 'vad_onsett'"):
        conv.post("vad_onsett")
    with pytest.raises(ValueError, match="emitted by the conversation"):
        conv.post(Ev.TURN_END)
    assert conv.queue_empty()


def test_every_input_has_a_handler():
    conv, *_ = make()
    from appliance.events import INPUTS

    assert set(conv._handlers) == set(INPUTS)


def test_urgent_events_overtake_only_what_cannot_change_the_state():
    q = EventQueue()
    for kind in (Ev.LLM_FIRST_TOKEN, Ev.TTS_FIRST_AUDIO, Ev.LLM_DONE, Ev.WINDOW_CHECK):
        q.put(Event(kind, {}))
    q.put(Event(Ev.VAD_ONSET, {}))  # overtakes llm_done and window_check, not the reply's first audio
    q.put(Event(Ev.MUTE, {}))  # overtakes everything
    q.put(Event(Ev.STOP_REPLY, {}))  # after the mute: control events keep their order
    q.put_stop()
    got = [q.get() for _ in range(len(q))]
    assert [e.kind if isinstance(e, Event) else "stop" for e in got] == [
        Ev.MUTE, Ev.STOP_REPLY, Ev.LLM_FIRST_TOKEN, Ev.TTS_FIRST_AUDIO, Ev.VAD_ONSET, Ev.LLM_DONE,
        Ev.WINDOW_CHECK, "stop"]
    assert CONTROL == {Ev.STOP_REPLY, Ev.MUTE, Ev.NEW_CONVERSATION}


def test_a_mute_posted_behind_an_end_of_turn_is_handled_first():
    """On the running thread: a queued end of turn must not start a reply after the mute switch."""
    conv, pb, eng, _ = make()
    records = []
    conv.subscribe(records.append)
    gate = threading.Event()
    conv.subscribe(lambda r: gate.wait(5) if r["event"] == Ev.STATE and r["state"] == "listening" else None)
    conv.start()
    try:
        conv.post(Ev.READY)  # its observer holds the thread until the gate opens
        time.sleep(0.05)
        conv.post(Ev.VAD_END, speech_ms=900.0, transcript="What is a rainbow?")
        conv.post(Ev.MUTE, muted=True)
        gate.set()
        deadline = time.monotonic() + 5
        while not conv.queue_empty() and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        conv.stop()
    assert seen(records) == ["state:listening", "mute", "state:muted", "vad_end"]
    assert eng.calls == []


# --- the TTS worker with a fake voice -----------------------------------------------------------------------

class FakeTts:
    """The part of :class:`appliance.speech.Tts` the worker uses: 100 ms of tone per clause, at 22.05 kHz."""

    sample_rate = 22050

    def __init__(self):
        self.said: list[str] = []

    def clean(self, text):
        return text.strip()

    def synthesize(self, text):
        self.said.append(text)
        yield np.full(2205, 0.1, np.float32)


def test_tts_worker_speaks_only_the_current_reply_and_takes_a_new_voice():
    from appliance.pipeline import TtsWorker
    from appliance.playback import Playback

    playback = Playback(16000)
    posted = []
    current = [1]
    old, new = FakeTts(), FakeTts()
    worker = TtsWorker(old, playback, lambda name, **info: posted.append((name, info)), lambda: current[0])
    playback.begin_reply(1)
    worker.on_clause(1, "One.")
    worker.on_clause(1, "Two.")
    worker.start()
    try:
        deadline = time.monotonic() + 5
        while playback.pending_samples < 1600 * 2 and time.monotonic() < deadline:  # both clauses queued, not
            time.sleep(0.005)  # only synthesised: reply 1's audio that reaches the queue after reply 2 began is dropped
        worker.configure(new)
        current[0] = 2
        playback.begin_reply(2)
        worker.on_clause(1, "Stale.")  # the cut reply: never synthesised
        worker.on_clause(2, "Three.")
    finally:
        worker.stop()
    assert old.said == ["One.", "Two."] and new.said == ["Three."]
    assert [(n, i["reply_id"]) for n, i in posted] == [(Ev.TTS_FIRST_AUDIO, 1), (Ev.TTS_FIRST_AUDIO, 2)]
    assert playback.pending_samples == 1600 * 3
