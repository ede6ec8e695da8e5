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


def tone(seconds: float, freq: float = 440.0, level_dbfs: float = -20.0, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (10 ** (level_dbfs / 20) * np.sqrt(2) * np.sin(2 * np.pi * freq * t)).astype(np.float32)
