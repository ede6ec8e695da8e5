"""On the Pi, with Gemma 4 E2B (the configured model, it hears): how fast the appliance answers, and whether
it understands a question pre-filled while it was spoken as well as one encoded whole.

Both run the appliance's own session in the simulated room in real time on the Pi's CPU (the room knows
where the speech ends, which a microphone cannot tell): every latency includes the Pi's real compute for
the VAD, Smart Turn, the encoder, the pre-fill, the first piece of the reply and Piper.
Run with the config the appliance uses (APPLIANCE_CONFIG, default /etc/appliance/config.yaml).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from appliance.config import load

OUT = Path(__file__).parent / "out"
CFG = os.environ.get("APPLIANCE_CONFIG", "/etc/appliance/config.yaml")
# Questions whose answer must name a word (any of the alternatives), in a Piper and an espeak-ng voice.
UNDERSTAND = [("What is the capital of France?", ("paris",)),
              ("What colour is the sky on a clear day?", ("blue",)),
              ("How many legs does a spider have?", ("eight", "8")),
              ("What is the opposite of hot?", ("cold",))]


def _write(name: str, data: dict) -> None:
    OUT.mkdir(exist_ok=True)
    (OUT / name).write_text(json.dumps(data, indent=2))


def _parts(cfg):
    from appliance.pipeline import Parts

    parts = Parts.load(cfg, persist=False)
    assert parts.engine.hears_audio, f"{cfg.model.gguf}: this check needs the model that hears (model.mmproj)"
    return parts


def test_end_of_speech_to_first_audio_on_the_pi():
    """The latency suite's questions in Piper's voice (with and without a fan), streamed and whole clip:
    the true end of speech → the reply's first audio, measured on the Pi with E2B. Writes latency.json;
    the issue's target is a median of 1.5 s or less for the streamed pre-fill."""
    from appliance.bench import latency

    cfg = load(CFG)
    parts = _parts(cfg)
    cache = latency.AudioCache(OUT / "bench-audio", parts.tts)
    cases = [c for c in latency.build_suite(cache) if c.label.startswith("joe")]
    ear = latency.FixtureEar(cfg.model.stream_left_context_ms / 1000.0, cfg.model.stream_final_at_pause)
    noise = latency.fan_noise()
    result: dict = {"model": Path(cfg.model.gguf).name}
    try:
        for stream in (True, False):
            parts.engine.stream_prefill = stream
            rows = []
            for c in cases:
                o = latency.run_case(c, parts, cfg, ear, noise)
                rows.append({"case": c.label, "seconds": round(c.seconds, 2), "eot_detect_ms": o.eot_detect_ms,
                             "premature": o.premature, "end_of_speech_to_first_audio_ms": o.first_audio_ms,
                             "streamed": parts.engine.last.streamed,
                             "audio_tokens_left": parts.engine.last.audio_tokens_left,
                             "prefill_ms_after_eot": round(parts.engine.last.prefill_ms, 1)})
            ttfa = [r["end_of_speech_to_first_audio_ms"] for r in rows
                    if r["end_of_speech_to_first_audio_ms"] is not None and not r["premature"]]
            result["streamed" if stream else "whole_clip"] = {
                "p50_ms": float(np.percentile(ttfa, 50)) if ttfa else None,
                "p95_ms": float(np.percentile(ttfa, 95)) if ttfa else None, "n": len(ttfa), "cases": rows}
    finally:
        parts.engine.stream_prefill = cfg.model.stream_prefill
        ear.stop()
    _write("latency.json", result)
    streamed = result["streamed"]
    assert streamed["n"] >= len(cases) - 2, result
    assert all(r["streamed"] for r in streamed["cases"] if r["end_of_speech_to_first_audio_ms"] is not None), result
    assert streamed["p50_ms"] <= 1500.0, result


def test_the_pi5_figures_and_the_projection_with_them():
    """The figures the bench's projection assumes for a Pi 5 (published prefill 32 tok/s and generation
    6.4 tok/s, the issue's encoder 0.2 s per audio s and Piper 0.2 s), measured here with E2B and the
    configured voice: a streamed window through the encoder, its new embeddings in one batch, one-token
    decodes, Piper's first piece. Then the bench's end-of-turn suite, offline, projected with them instead.
    Writes pi5_figures.json; fails if that projection's median is over 1.5 s (docs/latency.md says which
    figure would have to change by how much)."""
    from appliance.bench import latency
    from appliance.vad import SileroVad

    cfg = load(CFG)
    parts = _parts(cfg)
    m = cfg.model
    figures = latency.measure_pi_figures(parts.engine, parts.tts, m.stream_left_context_ms / 1000.0,
                                         m.stream_step_ms / 1000.0)
    cases = latency.build_suite(latency.AudioCache(OUT / "bench-audio", parts.tts))
    assert parts.eot is not None, "the projection is for vad.end_of_turn: smart_turn"
    r = latency.offline_eot(cases, SileroVad(), parts.eot.probability, {}, step_ms=m.stream_step_ms,
                            left_context_s=m.stream_left_context_ms / 1000.0, first_piece_tokens=4, pi=figures,
                            final_at_pause=m.stream_final_at_pause)
    _write("pi5_figures.json", {"model": Path(m.gguf).name, "measured": figures, "assumed": latency.PI5,
                                "projected_with_measured": r["pi5_projected_ttfa_ms"], "formula": latency.FORMULA})
    assert r["pi5_projected_ttfa_ms"]["p50"] <= 1500.0, (figures, r["pi5_projected_ttfa_ms"])


def test_e2b_understands_recorded_questions_streamed_and_whole(tmp_path):
    """A few questions, recorded (Piper's and espeak-ng's voices) and replayed through the real model with
    ``appliance replay``'s session: each answer names the expected word, streamed and whole clip alike. The
    only check of the native-audio claim with the real weights, and of the streamed left context."""
    from appliance.bench.interruption import AudioCache
    from appliance.audio.files import write_wav
    from appliance.replay import replay

    cfg = load(CFG)
    parts = _parts(cfg)
    cache = AudioCache(OUT / "bench-audio", parts.tts)
    answers: list = []
    try:
        for stream in (True, False):
            parts.engine.stream_prefill = stream
            for voice in ("joe", "en-us+f3"):
                for i, (question, words) in enumerate(UNDERSTAND):
                    wav = tmp_path / f"{voice}-{i}.wav"
                    write_wav(wav, np.concatenate([np.zeros(8000, np.float32), cache.speech(question, voice)]), 16000)
                    out = tmp_path / f"{'stream' if stream else 'whole'}-{voice}-{i}"
                    parts.engine.forget()  # each question on its own: no earlier answer to lean on
                    replay(wav, out, parts, cfg)
                    recs = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
                    said = " ".join(r.get("text", "") for r in recs if r["event"] == "turn_end").lower()
                    done = [r for r in recs if r["event"] == "llm_done"]
                    answers.append({"streamed_config": stream, "streamed": bool(done and done[-1].get("streamed")),
                                    "voice": voice, "question": question, "answer": said,
                                    "ok": any(w in said for w in words)})
    finally:
        parts.engine.stream_prefill = cfg.model.stream_prefill
    _write("understands.json", {"model": Path(cfg.model.gguf).name, "answers": answers})
    assert all(a["streamed"] == a["streamed_config"] for a in answers), answers
    assert all(a["ok"] for a in answers), [a for a in answers if not a["ok"]]
