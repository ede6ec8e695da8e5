"""The state machine, driven by posted events, around the real engine (embedded GGUF), Piper and playback.

The output callback is played by this test (``playback.read``), as the sound card would.
"""

import contextlib
import threading
import time

import numpy as np
import pytest

from appliance.audio.port import NullPort
from appliance.session import Session


class Recorder:
    def __init__(self):
        self.records = []
        self.cond = threading.Condition()

    def __call__(self, r):
        with self.cond:
            self.records.append(r)
            self.cond.notify_all()

    def states(self):
        return [r["state"] for r in self.records if r["event"] == "state"]

    def wait_for(self, pred, timeout=30.0):
        deadline = time.monotonic() + timeout
        with self.cond:
            while not pred(self.records):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out; saw {[(r['event'], r.get('state')) for r in self.records]}")
                self.cond.wait(left)

    def wait_state(self, state, timeout=30.0):
        self.wait_for(lambda rs: any(r["event"] == "state" and r["state"] == state for r in rs), timeout)


class Speaker(threading.Thread):
    """Stands in for the output callback: reads 10 ms blocks in real time."""

    def __init__(self, playback):
        super().__init__(daemon=True)
        self.playback = playback
        self.out = []
        self.running = True

    def run(self):
        while self.running:
            self.out.append(self.playback.read(160))
            time.sleep(0.01)


@contextlib.contextmanager
def running(cfg, parts):
    """A started :class:`Session` on ``cfg`` with a recorder and a speaker reading its playback, listening."""
    s = Session(cfg, parts, NullPort(16000, cfg.interruption.fade_ms))
    rec = Recorder()
    s.conversation.subscribe(rec)
    spk = Speaker(s.playback)
    spk.start()
    s.start()
    rec.wait_state("listening")
    try:
        yield s, rec
    finally:
        spk.running = False
        s.stop()


@pytest.fixture
def session(fresh_parts, embedded_cfg):
    with running(embedded_cfg, fresh_parts) as sr:
        yield sr


def interjection(s, text):
    """Piper speech at 16 kHz with the VAD's 192 ms lead-in, as the listener hands an interjection over."""
    from appliance.audio.files import resample

    audio = resample(np.concatenate(list(s.parts.tts.synthesize(text))), s.parts.tts.sample_rate, 16000)
    return np.concatenate([np.zeros(3072, np.float32), audio])


def user_turn(s, text):
    s.conversation.post("vad_onset")
    s.conversation.post("vad_start", speech_ms=300.0)
    s.conversation.post("vad_end", speech_ms=900.0, audio=np.zeros(16000, np.float32), transcript=text)


def interrupt_the_reply(s, rec, question, after_s=0.0):
    """Ask ``question``, let the reply play for ``after_s`` seconds, then a VAD onset pauses it."""
    user_turn(s, question)
    rec.wait_state("speaking", timeout=60)
    time.sleep(after_s)
    s.conversation.post("vad_onset")
    rec.wait_state("interrupted")


def test_a_turn_goes_listening_thinking_speaking_listening(session):
    s, rec = session
    user_turn(s, "What is a rainbow?")
    rec.wait_for(lambda rs: any(r["event"] == "turn_end" for r in rs), timeout=60)
    assert rec.states() == ["listening", "thinking", "speaking", "listening"]
    end = [r for r in rec.records if r["event"] == "turn_end"][0]
    assert end["text"] and not end["interrupted"]
    assert end["eot_to_first_token_ms"] > 0 and end["eot_to_first_audio_ms"] >= end["eot_to_first_token_ms"]
    # The engine's history holds the whole exchange.
    assert s.engine_worker.sync()
    hist = s.parts.engine.history
    assert [m.role for m in hist] == ["user", "model"] and hist[0].text == "What is a rainbow?"


def test_barge_in_pauses_then_flushes_and_keeps_only_spoken_text(session):
    s, rec = session
    interrupt_the_reply(s, rec, "Tell me about rainbows.", after_s=0.4)
    assert s.playback.paused
    s.conversation.post("vad_progress", speech_ms=800.0)  # longer than backchannel_max_ms: an interruption
    # (the flush is recorded before the state goes back to listening: wait for both)
    rec.wait_for(lambda rs: any(r["event"] == "flushed" for r in rs)
                 and [r["state"] for r in rs if r["event"] == "state"][-1:] == ["listening"])
    flushed = [r for r in rec.records if r["event"] == "flushed"][0]
    assert rec.states()[-3:] == ["speaking", "interrupted", "listening"]
    assert s.engine_worker.sync()  # the engine thread commits after the cancel
    reply = s.parts.engine.history[-1]
    # Remembered as far as it was heard, and marked as cut ("A rainbow is—"; nothing if no word was heard).
    assert reply.role == "model" and reply.text == flushed["remembered"]
    assert reply.text == (flushed["spoken"].strip() + "—" if flushed["spoken"].strip() else "")
    assert len(flushed["spoken"]) < len(flushed["synthesized"]) or flushed["dropped_samples"] > 0


def test_a_noise_while_speaking_resumes(session):
    s, rec = session
    interrupt_the_reply(s, rec, "Tell me about the sea.", after_s=0.2)
    s.conversation.post("vad_reject", speech_ms=64.0)
    rec.wait_for(lambda rs: any(r["event"] == "resumed" for r in rs))
    assert rec.states()[-2:] == ["interrupted", "speaking"]
    assert not s.playback.paused


class _NotedEcho:
    """A canceller through the listener's protocol (``process`` passes the microphone through) that records
    each ``note_false_onset`` and the thread it came on: what the listener tells the real one is the point."""

    def __init__(self):
        self.notes: list[str] = []
        self.noted = threading.Event()

    def process(self, mic, far_end, quiet=False):
        return mic

    def note_false_onset(self) -> bool:
        self.notes.append(threading.current_thread().name)
        self.noted.set()
        return False


def test_a_pause_that_was_not_speech_is_told_to_the_canceller_on_the_listeners_thread(session):
    """The session subscribes the listener to the conversation: a reply resumed as "not speech" reaches the
    canceller's ``note_false_onset``, on the listener's own thread; one resumed as a backchannel does not."""
    s, rec = session
    echo = _NotedEcho()
    s.listener.configure(echo=echo)
    interrupt_the_reply(s, rec, "Tell me about the sea.", after_s=0.2)
    s.conversation.post("vad_reject", speech_ms=64.0)
    rec.wait_for(lambda rs: any(r["event"] == "resumed" for r in rs))
    assert echo.noted.wait(5.0)
    assert echo.notes == ["listener"]
    s.conversation.post("vad_onset")
    rec.wait_for(lambda rs: rec.states().count("interrupted") == 2)
    s.conversation.post("vad_end", speech_ms=400.0, audio=interjection(s, "Uh-huh."), transcript="uh-huh")
    rec.wait_for(lambda rs: [r.get("reason") for r in rs if r["event"] == "resumed"] == ["not speech", "backchannel"])
    # A block captured now is processed after anything the backchannel's record queued (one queue, in order).
    s.listener.capture(np.zeros(160, np.float32), np.zeros(160, np.float32))
    deadline = time.monotonic() + 5.0
    while not s.listener.idle() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.listener.idle() and echo.notes == ["listener"]


def test_backchannel_resumes_but_stop_flushes(session):
    s, rec = session
    # The barge-in classifier hears the audio (PocketSphinx), so the interjections are real speech (Piper).
    uh_huh, stop = interjection(s, "Uh-huh."), interjection(s, "Stop.")
    interrupt_the_reply(s, rec, "Tell me about the sea.")
    s.conversation.post("vad_end", speech_ms=400.0, audio=uh_huh, transcript="uh-huh")
    rec.wait_for(lambda rs: any(r["event"] == "resumed" for r in rs))
    s.conversation.post("vad_onset")
    rec.wait_for(lambda rs: rec.states().count("interrupted") == 2)
    s.conversation.post("vad_end", speech_ms=400.0, audio=stop, transcript="Stop.")
    rec.wait_for(lambda rs: any(r["event"] == "flushed" for r in rs))
    # "Stop." is as short as "uh-huh" but is an interruption; once the user has stopped talking
    # (min_silence_ms after it: the VAD says ``settled``), a stop command alone ends there: no new turn.
    rec.wait_for(lambda rs: any(r["event"] == "held" for r in rs))
    time.sleep(0.3)
    assert rec.states().count("thinking") == 1  # held, not yet a turn
    s.conversation.post("vad_settled")
    rec.wait_for(lambda rs: any(r["event"] == "stopped" for r in rs))
    time.sleep(0.3)
    assert rec.states().count("thinking") == 1 and rec.states()[-1] == "listening"


def test_a_stop_word_and_what_follows_it_are_one_turn(session):
    """"Wait," cut by the short interjection silence, then "… what about the moon?": one user turn with both."""
    s, rec = session
    from appliance.conversation import JOIN_GAP_SAMPLES

    submitted = []
    submit = s.engine_worker.submit_turn

    def spy(reply_id, audio, transcript):  # records what the engine is given, then gives it
        submitted.append((audio, transcript))
        return submit(reply_id, audio, transcript)

    s.engine_worker.submit_turn = spy
    wait = interjection(s, "Wait.")
    rest = np.full(8000, 0.01, np.float32)
    interrupt_the_reply(s, rec, "Tell me about the sea.")
    s.conversation.post("vad_end", speech_ms=400.0, audio=wait, transcript="Wait,")
    rec.wait_for(lambda rs: any(r["event"] == "held" for r in rs))
    s.conversation.post("vad_onset")
    s.conversation.post("vad_end", speech_ms=500.0, audio=rest, transcript="what about the moon?")
    rec.wait_for(lambda rs: rec.states().count("thinking") == 2, timeout=60)
    s.conversation.post("vad_settled")  # comes later, with nothing held: no third turn
    time.sleep(0.3)
    assert rec.states().count("thinking") == 2
    audio, transcript = submitted[-1]
    assert transcript == "Wait, what about the moon?"
    assert len(audio) == len(wait) + JOIN_GAP_SAMPLES + len(rest)
    assert np.array_equal(audio[:len(wait)], wait) and np.array_equal(audio[-len(rest):], rest)


def test_mute_ignores_speech(session):
    s, rec = session
    s.conversation.post("mute", muted=True)
    rec.wait_state("muted")
    user_turn(s, "Are you there?")
    time.sleep(0.5)
    assert rec.states() == ["listening", "muted"]
    assert s.conversation.muted  # the listener drops the microphone while it is on
    s.conversation.post("mute", muted=False)
    rec.wait_for(lambda rs: rec.states()[-1] == "listening")
