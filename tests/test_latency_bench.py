"""``appliance bench latency`` on a tiny suite, and the product's streamed pre-fill through the whole
pipeline in the simulated room (listener → engine worker → engine, on the tiny Gemma 4 that hears)."""

import json

import pytest

from appliance.bench import latency
from appliance.engine import Engine
from appliance.pipeline import Parts

KEYS = {"eot_detect_ms": {"p50", "p95", "n"}, "premature_eot": {"count", "n"},
        "audio_tokens_left_at_eot": {"p50", "p95"}, "smart_turn_ms": {"p50", "p95"},
        "streamed_vs_whole": {"embd_cosine_min", "logits_max_abs_diff", "left_context_ms"},
        "pi5_projected_ttfa_ms": {"p50", "p95", "formula"}}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-audio")


def test_the_bench_writes_the_issues_keys_with_sane_values(parts, embedded_cfg, cache, tmp_path):
    out = tmp_path / "latency.json"
    lines = []
    latency.run(embedded_cfg, parts, out, cache, quick=True, print_line=lines.append, limit=2)
    got = json.loads(out.read_text())
    assert {k: set(v) for k, v in got.items()} == KEYS
    eot, left, pi = got["eot_detect_ms"], got["audio_tokens_left_at_eot"], got["pi5_projected_ttfa_ms"]
    assert eot["n"] == 2 and 50 <= eot["p50"] <= eot["p95"] <= 2500  # a short stop, Smart Turn, at most max_silence
    assert got["premature_eot"] == {"count": 0, "n": 2}  # "What time is it?" has no pause to end in
    assert 0 <= left["p50"] <= left["p95"] <= 15  # fed at each pause: little is left at the end of the turn
    assert 0 < got["smart_turn_ms"]["p50"] < 1000
    svw = got["streamed_vs_whole"]
    assert svw["left_context_ms"] == 480 and svw["embd_cosine_min"] > 0.999 and 0 <= svw["logits_max_abs_diff"] < 0.01
    # The projection adds the Pi's own work to the end-of-turn delay measured here: more than it, not absurd.
    assert eot["p50"] + 500 < pi["p50"] <= pi["p95"] < 10000 and "prefill" in pi["formula"]
    # The sweep printed beside it: with no left context the streamed embeddings are far off.
    sweep = json.loads(next(s for s in lines if s.startswith("left context sweep")).split(": ", 1)[1])
    assert next(r for r in sweep if r["left_context_ms"] == 0)["embd_cosine_min"] < 0.9


@pytest.mark.parametrize("stream", [True, False])
def test_a_question_in_the_room_is_pre_filled_while_it_is_spoken(parts, embedded_cfg, cache, stream):
    """The product's path: a hearing model (the tiny Gemma 4) answers in the room; with streaming on, its
    turn was pre-filled while the question was spoken and only a few audio tokens were left at its end."""
    tiny = Engine(latency.FIXTURE / "tiny-gemma4.gguf", latency.FIXTURE / "tiny-gemma4-mmproj.gguf", n_ctx=2048,
                  n_threads=1, max_reply_tokens=6, temperature=0.0, kv_cache_type="f16", system_prompt="Be brief.",
                  stream_prefill=stream)
    hearing = Parts(tiny, parts.tts, parts.vad, parts.eot)
    case = latency.build_suite(latency.AudioCache(cache, parts.tts), quick=True)[0]
    ear = latency.FixtureEar(0.96)
    try:
        out = latency.run_case(case, hearing, embedded_cfg, ear, latency.fan_noise())
    finally:
        ear.stop()
    assert out.eot_detect_ms is not None and out.feeds
    assert tiny.last.input == "audio" and tiny.last.streamed is stream
    if stream:
        assert tiny.last.audio_tokens_left <= 15 and tiny.last.stream_prepared
        assert tiny.last.tail_tokens < tiny.last.prefill_tokens // 2
