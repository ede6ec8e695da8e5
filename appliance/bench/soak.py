"""``appliance bench soak``: a long day's conversation, back to back, with nothing lost and memory flat.

Runs ``N`` turns with no pause between them (the next question is asked the moment the previous reply
has been synthesised and committed; the engine gets no idle time beyond what Piper takes): the real
engine through its worker thread (so the background history rebuild competes with turns exactly as in
the service), the real Piper voice synthesising every clause of every reply, and the conversation
persisted in a real history database (in a temporary directory). It reports, as JSON::

    {"turns": N, "replies_lost": 0, "decode_failures": 0, "history_alternates": true,
     "rss_mb": {"start": ..., "peak": ..., "end": ...}, "rss_growth_mb_per_turn_after_20": ...}

- ``replies_lost``: turns whose reply never arrived (an engine error, or no ``llm_done`` within 120 s), or
  whose question and reply are not the newest exchange of the engine's history after the commit;
- ``decode_failures``: ``llama_decode`` calls that failed (:attr:`Engine.decode_failures`) plus engine
  errors reported for turns;
- ``history_alternates``: after every turn, the engine's history and the database both read user, model,
  user, model, …;
- ``rss_mb``: resident memory of this process in MB (2**20 bytes) after the models are loaded (``start``),
  its high-water mark ``VmHWM`` (``peak``, which includes loading), and after the last turn (``end``);
- ``rss_growth_mb_per_turn_after_20``: least-squares slope of RSS against turn number over turns 21..N,
  MB per turn (null with fewer than 22 turns).

Models: ``--embedded`` runs Gemma 3 270M on text turns (the questions below); ``--fixture`` runs the tiny
random Gemma 4 in ``tests/fixtures/tiny_gemma4`` on audio turns (``demo/question.wav``, heard through
the real mtmd path).
"""

from __future__ import annotations

import json
import queue
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..config import Config
from . import FIXTURE_GGUF, FIXTURE_MMPROJ

ROOT = Path(__file__).resolve().parents[2]
QUESTION_WAV = ROOT / "demo" / "question.wav"
QUESTIONS = ["What is a rainbow?", "Why is the sky blue?", "How far away is the moon?", "What do bees eat?",
             "Tell me a fact about whales.", "How hot is the sun?", "What is rain made of?",
             "Why do cats purr?", "What is the tallest mountain?", "How do birds fly?", "What is a volcano?"]
REPLY_TIMEOUT_S = 120.0


def fixture_config() -> Config:
    """The tiny Gemma 4 fixture, sized by the rule ``check-config`` applies (n_ctx ≥ 1.5 × budget + reply
    + one 30 s turn: 768 + 32 + 766 = 1566)."""
    cfg = Config()
    cfg.model.gguf = str(FIXTURE_GGUF)
    cfg.model.mmproj = str(FIXTURE_MMPROJ)
    cfg.model.n_ctx = 1600
    cfg.model.history_budget_tokens = 512
    cfg.model.max_reply_tokens = 32
    cfg.model.n_threads = 2
    cfg.gpio.enabled = False
    return cfg


def _rss_mb(field: str = "VmRSS") -> float:
    """``field`` of /proc/self/status (VmRSS: resident now; VmHWM: the high-water mark), MB."""
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def _alternates(roles: list[str]) -> bool:
    return len(roles) % 2 == 0 and all(r == ("user" if i % 2 == 0 else "model") for i, r in enumerate(roles))


def run(cfg: Config, n_turns: int, json_out: Optional[Path] = None,
        print_line: Callable[[str], None] = print, label: str = "") -> dict:
    """Run the soak on ``cfg``'s model and voice (the history goes to a temporary directory).

    :param n_turns: turns to run, ≥ 1.
    :param json_out: where to write the result (the keys above, nothing else), or None.
    :returns: the result dict, as written.
    """
    from ..engine import EngineWorker
    from ..pipeline import Parts

    with tempfile.TemporaryDirectory(prefix="appliance-soak-") as state:
        cfg = cfg.model_copy(deep=True)
        cfg.storage.state_dir = state
        cfg.storage.persist_history = True
        parts = Parts.load(cfg, persist=True)
        engine, tts = parts.engine, parts.tts
        audio = None
        if engine.hears_audio:
            from ..audio.files import load_audio

            audio = load_audio(QUESTION_WAV)

        events: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        clauses: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        spoken: dict[int, threading.Event] = {}
        samples = [0]
        tts_errors: list[str] = []

        def post(name: str, **info) -> None:
            events.put((name, info))

        def on_clause(reply_id: int, text: Optional[str]) -> None:
            clauses.put((reply_id, text))

        def speak() -> None:  # the TTS worker: every clause through the real Piper voice
            while True:
                reply_id, text = clauses.get()
                if reply_id < 0:
                    return
                if text is None:
                    spoken[reply_id].set()
                    continue
                try:
                    for chunk in tts.synthesize(text):
                        samples[0] += len(chunk)
                except Exception as exc:  # as the service's TTS worker: the clause is dropped, the rest goes on
                    tts_errors.append(f"{exc.__class__.__name__}: {exc}")

        tts_thread = threading.Thread(target=speak, name="soak-tts", daemon=True)
        tts_thread.start()
        worker = EngineWorker(engine, post, on_clause)
        lost = errors = 0
        alternates = True
        rss: list[float] = []
        start = _rss_mb()
        t_start = time.perf_counter()
        try:
            for i in range(1, n_turns + 1):
                spoken[i] = threading.Event()
                question = QUESTIONS[(i - 1) % len(QUESTIONS)]
                worker.submit_turn(i, audio, None if audio is not None else question)
                done = None
                deadline = time.monotonic() + REPLY_TIMEOUT_S
                while done is None and time.monotonic() < deadline:
                    try:
                        name, info = events.get(timeout=1.0)
                    except queue.Empty:
                        continue
                    if name == "llm_done" and info.get("reply_id") == i:
                        done = info
                    elif name == "engine_error":
                        errors += 1
                        print_line(f"turn {i}: engine error: {info.get('reason')}")
                        break
                if done is None:
                    lost += 1
                    spoken.pop(i, None)
                    continue
                spoken[i].wait(REPLY_TIMEOUT_S)
                spoken.pop(i, None)
                worker.commit(i, done["text"], True)
                worker.sync(REPLY_TIMEOUT_S)
                h = engine.history
                if len(h) < 2 or h[-1].role != "model" or h[-1].text != done["text"].strip() or h[-2].role != "user":
                    lost += 1
                roles_ok = _alternates([m.role for m in h]) and _alternates([m.role for m in engine.store.messages()])
                alternates = alternates and roles_ok
                rss.append(_rss_mb())
                if i % 50 == 0 or i == n_turns:
                    print_line(f"{label}turn {i}: rss {rss[-1]:.0f} MB, history {len(h)} messages, n_past "
                               f"{engine.n_past}, rebuilds {len(engine.rebuilds)} (dropped {engine.dropped_rebuilds}), "
                               f"{time.perf_counter() - t_start:.0f} s")
        finally:
            clauses.put((-1, None))
            worker.stop()
            tts_thread.join(timeout=30)
        growth = None
        if len(rss) >= 22:
            x = np.arange(21, len(rss) + 1, dtype=np.float64)
            growth = round(float(np.polyfit(x, np.asarray(rss[20:], dtype=np.float64), 1)[0]), 3)
        result = {
            "turns": n_turns,
            "replies_lost": lost,
            "decode_failures": engine.decode_failures + errors,
            "history_alternates": alternates,
            "rss_mb": {"start": round(start, 1), "peak": round(_rss_mb("VmHWM"), 1), "end": round(_rss_mb(), 1)},
            "rss_growth_mb_per_turn_after_20": growth,
        }
        kinds: dict[str, int] = {}
        for r in engine.rebuilds:
            kinds[r["reason"]] = kinds.get(r["reason"], 0) + 1
        print_line(f"{label}{json.dumps(result)}")
        print_line(f"{label}rebuilds (the last 100): {kinds or 'none'}; given up: {engine.dropped_rebuilds}; "
                   f"audio synthesised: {samples[0] / tts.sample_rate:.0f} s; TTS errors: {len(tts_errors)} "
                   f"{tts_errors[:3] if tts_errors else ''}; {time.perf_counter() - t_start:.0f} s")
        engine.store.close()
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=2) + "\n")
    return result
