"""The engine's KV bookkeeping on real GGUFs: the tiny random Gemma 4 with its audio projector (audio turns
through llama.cpp's mtmd path) and the embedded Gemma 3 270M (text turns).

The real Gemma 4 E2B (3 GB) cannot be fetched here; the fixture has the same architecture, special tokens
and audio token rate (25 per second), so the mechanics are the same code path.
"""

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from appliance.engine import Engine, EngineWorker, TurnResult
from appliance.history import HistoryStore
from appliance.mtmd_audio import MtmdAudio

from conftest import DEMO

FIX = Path(__file__).parent / "fixtures" / "tiny_gemma4"
GGUF, MMPROJ = FIX / "tiny-gemma4.gguf", FIX / "tiny-gemma4-mmproj.gguf"


def tiny(store=None, **kw):
    args = dict(n_ctx=4096, n_threads=2, system_prompt="Be brief.", max_reply_tokens=10, temperature=0.0,
                history_budget_tokens=1200)
    args.update(kw)
    return Engine(GGUF, MMPROJ, store=store, **args)


def turn(engine, audio=None, transcript=None, complete=True, cut=None):
    text = "".join(engine.start_turn(audio, transcript))
    engine.commit_spoken(text if cut is None else text[:cut], complete=complete)
    while not engine.background_step(lambda: False):
        pass
    return text


@pytest.fixture(scope="module")
def speech(question_audio):
    return question_audio


def test_fifty_audio_turns_prefill_only_their_own_tokens(speech):
    e = tiny()
    assert e.hears_audio and e.arch == "gemma4"
    # The user's part of a turn: the audio tokens mtmd makes of the clip cut to whole 40 ms tokens (as a
    # streamed turn holds them), its <|audio> <audio|> pair, and the turn markup.
    markup = len(e._tokens(e.fmt.user_turn(""))) + 2
    expected = MtmdAudio.expected_audio_tokens(len(speech) // 640 * 640) + markup
    per_turn = []
    for i in range(50):
        turn(e, audio=speech * (0.5 + i / 100), complete=(i % 4 != 1), cut=7)
        per_turn.append(e.last.prefill_tokens)
    assert per_turn == [expected] * 50
    assert e.rebuilds and all(r["reason"] == "prune" for r in e.rebuilds)  # the budget was passed and pruned
    assert e.n_past <= e.history_budget_tokens + 2 * expected + 60


def test_interrupted_reply_keeps_exactly_the_spoken_text(speech):
    e = tiny(max_reply_tokens=24, temperature=0.8)
    full = "".join(e.start_turn(speech))
    spoken = "Rainbows are"  # what the playback buffer says reached the speaker
    e.commit_spoken(spoken, complete=False)
    assert e.history[-1].role == "model" and e.history[-1].text == spoken
    # The cache ends with exactly the spoken words and the end of the turn, not the generated tail.
    tail = e._tokens(spoken, special=False) + e._tokens(e.fmt.close_reply())
    assert list(e.llm.input_ids[e.n_past - len(tail): e.n_past]) == tail
    # And the next turn still works from there.
    turn(e, audio=speech)
    assert [m.role for m in e.history] == ["user", "model", "user", "model"]


def test_cancel_stops_within_one_token(speech):
    e = tiny(max_reply_tokens=200)
    stream = e.start_turn(speech)
    got = []
    for piece in stream:
        got.append(piece)
        if len(got) == 3:
            e.cancel()
    assert len(got) == 3 and e.last.cancelled
    e.commit_spoken("".join(got), complete=False)
    turn(e, audio=speech)  # usable for the next turn
    assert e.last.prefill_tokens > 0 and not e.last.cancelled


def test_restart_restores_the_conversation_in_the_background(tmp_path, speech):
    e = tiny(store=HistoryStore(tmp_path))
    for i in range(4):
        turn(e, audio=speech, cut=5, complete=(i != 2))
    texts = [(m.role, m.text) for m in e.history]
    n_before = e.n_past
    del e
    e2 = tiny(store=HistoryStore(tmp_path))
    assert [(m.role, m.text) for m in e2.history] == texts
    assert e2.busy_rebuilding and e2.n_past < n_before  # serving already, the old turns come back behind it
    assert all(m.audio is not None for m in e2.history if m.role == "user")  # re-heard, not just text
    while not e2.background_step(lambda: False):
        pass
    assert e2.rebuilds[-1]["reason"] == "restore"
    # The rebuilt cache holds every remembered reply, in order (its token count differs from the original
    # by how generated tokens re-tokenize: a few per reply).
    ph = e2.audio.audio_placeholder
    ids = [int(t) for t in e2.llm.input_ids[: e2.n_past] if t >= 0 and t != ph]
    cached = e2.llm.detokenize(ids, special=True).decode("utf-8", "replace")
    pos = 0
    for role, text in texts:
        if role == "model":
            pos = cached.index(text, pos) + len(text)
    assert abs(e2.n_past - n_before) <= 4 * len(texts)
    e2.forget()
    assert e2.history == [] and HistoryStore(tmp_path).messages() == []


def test_a_turn_during_a_background_rebuild_is_not_delayed(tmp_path, speech):
    e = tiny(store=HistoryStore(tmp_path))
    for _ in range(6):
        turn(e, audio=speech)
    del e
    e2 = tiny(store=HistoryStore(tmp_path))
    assert e2.busy_rebuilding
    # A step yields as soon as a turn is waiting: at most one message is evaluated.
    e2.background_step(lambda: True)
    assert e2.busy_rebuilding
    turn_text = "".join(e2.start_turn(speech))
    e2.commit_spoken(turn_text, complete=True)
    while not e2.background_step(lambda: False):
        pass
    # The turn taken during the rebuild is in the rebuilt cache too.
    assert len(e2.history) == 14 and e2.rebuilds[-1]["messages"] == 14


def test_text_turns_on_the_embedded_model(fresh_parts):
    e = fresh_parts.engine
    assert not e.hears_audio
    saved, e.max_reply_tokens = e.max_reply_tokens, 16
    prefills = []
    for i in range(12):
        q = f"Question number {i}: what is {i} plus {i}?"
        turn(e, transcript=q, complete=(i % 3 != 0), cut=6)
        prefills.append(e.last.prefill_tokens)
        assert e.last.prefill_tokens == len(e._tokens(e.fmt.user_turn(q)))
    assert max(prefills) - min(prefills) <= 4  # flat: only the new question is pre-filled
    assert len(e.history) == 24
    assert e.history[0].text.startswith("Question number 0")
    with pytest.raises(ValueError):
        e.start_turn(audio=np.zeros(16000, np.float32))  # a text model cannot hear
    e.max_reply_tokens = saved


def test_speech_a_text_model_cannot_take_drops_the_turn_with_one_log_line(fresh_parts, caplog):
    """A fragment of speech with no transcript (a replay's VAD cut the user's words where the scenario has
    none) given to the text-only model: one warning line, no traceback, and the conversation hears of it."""
    posted = []
    worker = EngineWorker(fresh_parts.engine, post=lambda ev, **info: posted.append((ev, info)),
                          on_clause=lambda *a: None)
    try:
        with caplog.at_level("WARNING", logger="appliance.engine"):
            worker.submit_turn(7, np.zeros(8000, np.float32), None)
            assert worker.sync()
    finally:
        worker.stop()
    assert posted == [("engine_error", {"reason": "this model cannot hear audio and no transcript was given"})]
    [rec] = [r for r in caplog.records if r.name == "appliance.engine"]
    assert rec.levelname == "WARNING" and rec.exc_info is None and "reply 7 dropped" in rec.getMessage()


def _roles_alternate(messages) -> bool:
    roles = [m.role for m in messages]
    return len(roles) % 2 == 0 and roles == ["user", "model"] * (len(roles) // 2)


def test_back_to_back_turns_never_overflow_the_shared_cache_and_lose_no_turn(tmp_path, speech):
    """No idle time at all: a rebuild starts at every prune and gets at most one message per turn, so the
    active and shadow sequences compete for one small cache. Every cell is counted before each decode,
    the rebuild gives way, and the history is pruned at once instead: nothing fails, nothing is lost."""
    store = HistoryStore(tmp_path)
    e = tiny(store=store, n_ctx=640, history_budget_tokens=320, max_reply_tokens=12)
    committed = []
    for i in range(40):
        text = "".join(e.start_turn(speech))
        e.commit_spoken(text, complete=True)
        committed.append(text.strip())
        if i % 3 == 0:
            e.background_step(lambda: True)  # a sliver of idle time: one message into the shadow, then yield
        cells = e._cells(0) + e._cells(1)
        assert cells <= e.n_ctx, (i, cells)
        assert _roles_alternate(e.history) and _roles_alternate(store.messages())
        assert e.history[-1].text == text.strip()  # this turn's reply is the newest remembered one
    assert e.decode_failures == 0
    assert e.dropped_rebuilds > 0 and any(r["reason"] == "prune-now" for r in e.rebuilds)  # both ways out were taken
    # What is remembered is the newest replies, in order, with none missing in between.
    kept = [m.text for m in e.history if m.role == "model"]
    assert kept == committed[-len(kept):]
    assert [m.text for m in store.messages() if m.role == "model"] == kept


def test_an_exchange_is_stored_in_one_transaction(tmp_path):
    """If the reply's row cannot be written, the question's row is not kept either (a real SQLite
    trigger stands in for the kill between the two rows)."""
    store = HistoryStore(tmp_path)
    store.append_exchange("first question", None, "first answer")
    store.db.execute("CREATE TRIGGER refuse BEFORE INSERT ON messages WHEN NEW.role = 'model' "
                     "BEGIN SELECT RAISE(ABORT, 'killed'); END")
    with pytest.raises(Exception, match="killed"):
        store.append_exchange("second question", None, "second answer")
    assert [(m.role, m.text) for m in store.messages()] == [("user", "first question"), ("model", "first answer")]


def test_restore_repairs_a_history_that_does_not_alternate(tmp_path, speech):
    """Rows left by a version that committed user and model separately and was killed in between:
    u m u u m m u. The restore keeps the whole exchanges, deletes the strays, and the engine serves it."""
    store = HistoryStore(tmp_path)
    for role, text in [("user", "q1"), ("model", "a1"), ("user", "q2 lost its answer"), ("user", "q3"),
                       ("model", "a3"), ("model", "a orphan"), ("user", "q4 killed before its answer")]:
        store.append(role, text)
    kept = store.restore()
    assert [(m.role, m.text) for m in kept] == [("user", "q1"), ("model", "a1"), ("user", "q3"), ("model", "a3")]
    assert [(m.role, m.text) for m in HistoryStore(tmp_path).messages()] == [(m.role, m.text) for m in kept]
    e = tiny(store=HistoryStore(tmp_path))
    assert _roles_alternate(e.history) and [m.text for m in e.history] == ["q1", "a1", "q3", "a3"]
