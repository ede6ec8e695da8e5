"""Each turn's input carries the local date and time, appended to the KV cache with the turn (the system
prompt and everything before the turn stay as they were); the assistant section of the config."""

from datetime import datetime, timezone
from pathlib import Path

import pytest

from appliance.assistant import spoken_time, system_prompt, turn_context, turn_context_source
from appliance.config import Config, ConfigError, parse
from appliance.engine import EngineWorker


def test_spoken_time_by_locale():
    t = datetime(2026, 12, 1, 20, 5)
    assert spoken_time(t, "en_US") == "Tuesday, December 1, 2026, 8:05 PM"
    assert spoken_time(t.replace(hour=0), "en_US") == "Tuesday, December 1, 2026, 12:05 AM"
    assert spoken_time(t, "en_GB") == "Tuesday 1 December 2026, 20:05"
    assert turn_context(t) == "[Tuesday, December 1, 2026, 8:05 PM]"


def test_the_time_zone_is_applied():
    cfg = Config()
    cfg.assistant.timezone = "Asia/Tokyo"
    utc = datetime(2026, 12, 1, 20, 5, tzinfo=timezone.utc)
    ctx = turn_context_source(cfg, clock=lambda: utc.astimezone(__import__("zoneinfo").ZoneInfo("Asia/Tokyo")))
    assert ctx() == "[Wednesday, December 2, 2026, 5:05 AM]"
    with pytest.raises(ConfigError) as e:
        parse("assistant:\n  timezone: Mars/Olympus\n", Path("c.yaml"))
    assert "line 2: assistant.timezone: expected local or an IANA time zone name" in str(e.value)


def test_system_prompt_old_key_still_wins_and_name_is_filled_in():
    cfg = Config()
    assert "{name}" not in system_prompt(cfg) and cfg.assistant.name in system_prompt(cfg)
    cfg.model.system_prompt = "Be terse."
    assert system_prompt(cfg) == "Be terse."


def test_each_turn_carries_the_date_and_time_and_the_cache_is_only_appended_to(fresh_parts, embedded_cfg):
    e = fresh_parts.engine
    saved, e.max_reply_tokens = e.max_reply_tokens, 12
    times = iter([datetime(2026, 12, 1, 8, 41), datetime(2026, 12, 1, 9, 30), datetime(2026, 12, 2, 7, 0)])
    posted = []
    worker = EngineWorker(e, post=lambda ev, **info: posted.append(ev), on_clause=lambda *a: None)
    worker.configure(context=turn_context_source(embedded_cfg, clock=lambda: next(times)))
    system = list(e.llm.input_ids[: e.n_past])
    try:
        for i, q in enumerate(["What day is it?", "And what time?", "Good morning."]):
            before = e.n_past
            cached_before = list(e.llm.input_ids[:before])
            worker.submit_turn(i + 1, None, q)
            worker.commit(i + 1, "", complete=True)
            assert worker.sync()
            # Nothing before the turn was evaluated again or changed: the cache was only appended to.
            assert list(e.llm.input_ids[:before]) == cached_before
            assert list(e.llm.input_ids[: len(system)]) == system
            turn = e.llm.detokenize(list(e.llm.input_ids[before: before + e.last.prefill_tokens]), special=True)
            want = ["Tuesday, December 1, 2026, 8:41 AM", "Tuesday, December 1, 2026, 9:30 AM",
                    "Wednesday, December 2, 2026, 7:00 AM"][i]
            assert f"[{want}]\n{q}".encode() in turn, turn
            assert e.last.prefill_tokens == len(e._tokens(e.fmt.user_turn(f"[{want}]\n{q}")))
        # The history keeps each turn's time with it (a rebuilt cache says when things were said).
        assert [m.context for m in e.history if m.role == "user"] == [
            "[Tuesday, December 1, 2026, 8:41 AM]", "[Tuesday, December 1, 2026, 9:30 AM]",
            "[Wednesday, December 2, 2026, 7:00 AM]"]
    finally:
        worker.stop()
        e.max_reply_tokens = saved
