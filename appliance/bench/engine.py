"""``appliance bench engine``: does a turn cost the same at turn 1 and turn 50?

Runs the real engine for 50 turns on two models and reports, per model:

- ``prefill_tokens``: tokens evaluated for the user's part of turns 1, 10 and 50 (flat = only the new
  tokens are pre-filled; nothing already in the KV cache is evaluated again);
- ``turn_latency_ratio_50_to_1``: time to first token at turn 50 over turn 1, measured in the same run
  (each the median of three turns, 48-50 and 1-3; with ``--turns N``, the keys say N and the last three);
- ``cancel_to_idle_ms``: from ``cancel()`` during generation to the engine being idle with the reply
  committed (p50/p95 over several cancellations);
- ``kv_bytes_per_token``: KV cache bytes per position for an f16 and a q4_0 cache
  (``llama_state_seq_get_size`` of the conversation's sequence / positions);
- ``audio_encoder_ms_per_s``: milliseconds to encode and decode one second of audio through mtmd
  (audio model only);
- ``full_reprefill_at_last_turn``: what re-pre-filling the whole conversation would cost at the last turn
  (what a handler that clears the cache every turn pays), against this engine's time to first token.

Models: ``audio_model`` is the tiny random Gemma 4 fixture (audio turns through the real mtmd path;
its figures are mechanics, not the speed of the real 2B model); ``text_model`` is the configured text
model (``--embedded``: Gemma 3 270M), text turns.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..audio.files import MODEL_RATE
from ..engine import Engine
from . import FIXTURE_GGUF, FIXTURE_MMPROJ

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = ["What is a rainbow?", "Why is the sky blue?", "How far away is the moon?", "What do bees eat?",
             "Tell me a fact about whales.", "How hot is the sun?", "What is rain made of?"]


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(np.floor(k)), int(np.ceil(k))
    return float(xs[lo] + (xs[hi] - xs[lo]) * (k - lo))


def _run_turns(engine: Engine, n_turns: int, make_input: Callable[[int], dict]) -> tuple[dict, list[float], list[float]]:
    prefill, ttft, total = {}, [], []
    for i in range(1, n_turns + 1):
        t0 = time.perf_counter()
        stream = engine.start_turn(**make_input(i))
        first = None
        text = ""
        for piece in stream:
            if first is None:
                first = time.perf_counter() - t0
            text += piece
        if first is None:
            first = time.perf_counter() - t0
        engine.commit_spoken(text, complete=True)
        total.append((time.perf_counter() - t0) * 1000.0)
        ttft.append(first * 1000.0)
        while not engine.background_step(lambda: False):  # idle time between turns
            pass
        if i in (1, 10, 50):
            prefill[f"turn_{i}"] = engine.last.prefill_tokens
    return prefill, ttft, total


def _cancel_to_idle(engine: Engine, make_input: Callable[[int], dict], trials: int = 12) -> list[float]:
    out = []
    for i in range(trials):
        engine.max_reply_tokens, saved = 400, engine.max_reply_tokens
        stream = engine.start_turn(**make_input(i))
        text = ""
        t_cancel = None
        for n, piece in enumerate(stream):
            text += piece
            if n == 3:
                t_cancel = time.perf_counter()
                engine.cancel()
        if t_cancel is None:  # the reply ended before the 4th token: nothing to cancel
            engine.commit_spoken(text, complete=True)
            engine.max_reply_tokens = saved
            continue
        engine.commit_spoken(text, complete=False)
        out.append((time.perf_counter() - t_cancel) * 1000.0)
        engine.max_reply_tokens = saved
    return out


def _kv_bytes(path: Path, mmproj: Optional[Path], make_input, n_ctx: int, n_threads: int) -> dict:
    result = {}
    for kv in ("f16", "q4_0"):
        e = Engine(path, mmproj, n_ctx=n_ctx, n_threads=n_threads, kv_cache_type=kv, max_reply_tokens=8,
                   system_prompt="Be brief.", temperature=0.0)
        for i in range(3):
            text = "".join(e.start_turn(**make_input(i)))
            e.commit_spoken(text, complete=True)
        result[kv] = round(e.kv_bytes_per_token(), 1)
        del e
    return result


def bench_model(path: Path, mmproj: Optional[Path], audio: bool, n_turns: int = 50, n_ctx: int = 8192,
                system_prompt: str = "Be brief.", examples=None, progress: Callable[[str], None] = print,
                n_threads: int = 2) -> dict:
    rng = np.random.default_rng(0)
    speech = None
    if audio:
        from ..audio.files import load_audio

        speech = load_audio(ROOT / "demo" / "question.wav")

    def make_input(i: int) -> dict:
        if audio:
            gain = 0.5 + 0.5 * rng.random()
            return {"audio": (speech * gain).astype(np.float32)}
        return {"transcript": QUESTIONS[i % len(QUESTIONS)]}

    # Budget large enough that 50 turns need no pruning: this measures the append-only path.
    engine = Engine(path, mmproj, n_ctx=n_ctx, n_threads=n_threads, kv_cache_type="q4_0", max_reply_tokens=24,
                    system_prompt=system_prompt, temperature=0.0, history_budget_tokens=n_ctx // 2,
                    examples=examples)
    progress(f"{path.name}: {n_turns} {'audio' if audio else 'text'} turns")
    prefill, ttft, total = _run_turns(engine, n_turns, make_input)
    # What a handler that clears the cache every turn (the stock multimodal chat handler) pays at this turn:
    # the whole conversation pre-filled again (here through the engine's own background rebuild).
    from ..engine import _Rebuild

    engine._rebuild = _Rebuild(engine.history, reason="bench")
    t = time.perf_counter()
    while not engine.background_step(lambda: False):
        pass
    reprefill_ms = (time.perf_counter() - t) * 1000.0
    reprefill_tokens = engine.rebuilds[-1]["tokens"]
    cancels = _cancel_to_idle(engine, make_input)
    result = {
        "model": path.name,
        "turns": n_turns,
        "input": "audio" if audio else "text",
        "prefill_tokens": prefill,
        # Turn latency = time to first token (the user's wait). One turn is noisy on a shared machine, so
        # each end is the median of three turns: 1-3 and 48-50 (the keys name the turns of a --turns run).
        f"turn_latency_ratio_{n_turns}_to_1": round(statistics.median(ttft[-3:]) / statistics.median(ttft[:3]), 3)
        if len(ttft) >= 6 else None,
        "ttft_ms": {f"turns_1_to_{min(3, n_turns)}": [round(x, 1) for x in ttft[:3]],
                    f"turns_{max(1, n_turns - 2)}_to_{n_turns}": [round(x, 1) for x in ttft[-3:]],
                    "median_all": round(statistics.median(ttft), 1)},
        "n_past_after": engine.n_past,
        "full_reprefill_at_last_turn": {"tokens": reprefill_tokens, "ms": round(reprefill_ms, 1),
                                        "vs_median_ttft": round(reprefill_ms / statistics.median(ttft[-3:]), 1)},
        "cancel_to_idle_ms": {"p50": round(_pct(cancels, 0.5), 2), "p95": round(_pct(cancels, 0.95), 2), "n": len(cancels)},
    }
    if audio and engine.audio is not None:
        t = time.perf_counter()
        clip = np.tile(speech, 4)[: 4 * 16000]
        engine.audio.eval_prompt(engine.fmt.closed("user", "<__media__>"), clip, engine.n_past, seq_id=0, add_special=False)
        result["audio_encoder_ms_per_s"] = round((time.perf_counter() - t) * 1000.0 / (len(clip) / MODEL_RATE), 2)
    del engine
    progress(f"{path.name}: KV bytes per token, f16 vs q4_0")
    result["kv_bytes_per_token"] = _kv_bytes(path, mmproj, make_input, n_ctx=2048, n_threads=n_threads)
    result["n_threads"] = n_threads
    return result


def run(text_model: Path, json_path: Optional[Path], n_turns: int = 50, examples=None, n_threads: int = 2) -> dict:
    """Bench both models. ``n_threads``: llama.cpp threads; on a machine shared with other work, 1 avoids
    the stalls of llama.cpp's spinning thread pool when a core is taken away."""
    report = {
        "audio_model": bench_model(FIXTURE_GGUF, FIXTURE_MMPROJ, audio=True,
                                   n_turns=n_turns, n_threads=n_threads),
        "text_model": bench_model(Path(text_model), None, audio=False, n_turns=n_turns, examples=examples,
                                  n_threads=n_threads),
        "measured": "here (x86_64, 2 cores); see the README for what to expect on a Pi 5",
    }
    print(format_table(report))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def format_table(report: dict) -> str:
    """The figures that answer the bench's questions, one row each per model (fixed-width, read over SSH):
    prefill tokens at turn 1 and the last turn (the KV cache grows, nothing is re-evaluated), the TTFT's
    growth over the turns, the full re-prefill a cache-clearing handler would pay, cancel → idle, KV bytes
    per token. All measured here; the JSON (``--json``) holds the rest."""
    rows = [f"{'model':28} {'input':5} {'prefill 1st/last':>16} {'TTFT last/1st':>13} {'re-prefill':>12} "
            f"{'cancel p95':>10} {'KV B/tok q4_0':>13}"]
    for m in (report["audio_model"], report["text_model"]):
        pre = list(m["prefill_tokens"].values())
        ratio = next((v for k, v in m.items() if k.startswith("turn_latency_ratio_")), None)
        rows.append(f"{m['model'][:28]:28} {m['input']:5} {f'{pre[0]} / {pre[-1]}':>16} "
                    f"{'-' if ratio is None else f'{ratio:.2f}x':>13} "
                    f"{m['full_reprefill_at_last_turn']['ms'] / 1000:>10.1f} s {m['cancel_to_idle_ms']['p95']:>7.1f} ms "
                    f"{m['kv_bytes_per_token']['q4_0']:>13.1f}")
    return "\n".join(rows)
