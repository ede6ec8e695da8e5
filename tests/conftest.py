"""Shared fixtures: real parts (Silero, Piper's bundled voice, the embedded Gemma 3 270M GGUF)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "demo"


@pytest.fixture(scope="session")
def embedded_cfg():
    from appliance.pipeline import embedded_config

    return embedded_config()


@pytest.fixture(scope="session")
def parts(embedded_cfg):
    """Loaded once per test session: the real engine, voice and VAD."""
    from appliance.pipeline import Parts

    return Parts.load(embedded_cfg)


@pytest.fixture
def fresh_parts(parts):
    """The session's parts with an empty conversation."""
    parts.engine.forget()
    parts.vad.reset()
    return parts


@pytest.fixture(scope="session")
def question_audio():
    from appliance.audio.files import load_audio

    return load_audio(DEMO / "question.wav")


def tiny_gemma4_config():
    """A config for the tiny random-weight Gemma 4 fixture (it hears 16 kHz audio) in a small cache, with
    Piper's bundled voice and Silero: the tests' model that hears, on real parts."""
    from appliance.config import Config

    fix = Path(__file__).parent / "fixtures" / "tiny_gemma4"
    cfg = Config()
    cfg.model.gguf = str(fix / "tiny-gemma4.gguf")
    cfg.model.mmproj = str(fix / "tiny-gemma4-mmproj.gguf")
    cfg.model.n_ctx = 1024
    cfg.model.n_threads = 2
    cfg.model.max_reply_tokens = 12
    cfg.model.history_budget_tokens = 700
    # No history database: the default state_dir is the Pi's /var/lib/appliance/state, which Parts.load would
    # create and write on the machine that runs the tests (a fresh user found it changed by `make test`).
    cfg.storage.persist_history = False
    return cfg


def tone(seconds: float, freq: float = 440.0, level_dbfs: float = -20.0, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (10 ** (level_dbfs / 20) * np.sqrt(2) * np.sin(2 * np.pi * freq * t)).astype(np.float32)
