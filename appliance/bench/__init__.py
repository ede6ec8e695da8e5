"""Benchmarks (``appliance bench ...``): fixed suites run in real time, printing a table and writing JSON."""

from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "tiny_gemma4"
"""The tiny random-weight Gemma 4 test fixture (a checkout's ``tests/fixtures``): the benches' model that hears."""
FIXTURE_GGUF = FIXTURE / "tiny-gemma4.gguf"
FIXTURE_MMPROJ = FIXTURE / "tiny-gemma4-mmproj.gguf"
JACK_RATE = 48000  # the JACK rooms' server rate, Hz (``--jack-rate``): a Pi's USB and HAT devices run at 48 kHz
JACK_PERIOD = 512  # ... and frames per JACK period (``--jack-period``): 10.7 ms, next to the worker's 10 ms blocks (480 frames,
#   the block itself: measured once in session 27, docs/measurements.md; see jack_room)
