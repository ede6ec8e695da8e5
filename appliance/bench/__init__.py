"""Benchmarks (``appliance bench ...``): fixed suites run in real time, printing a table and writing JSON."""

from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "tiny_gemma4"
"""The tiny random-weight Gemma 4 test fixture (a checkout's ``tests/fixtures``): the benches' model that hears."""
FIXTURE_GGUF = FIXTURE / "tiny-gemma4.gguf"
FIXTURE_MMPROJ = FIXTURE / "tiny-gemma4-mmproj.gguf"
