"""The JACK room's clock drift (:class:`appliance.audio.jack_room._DriftLine`): a smooth, exact fractional
delay that wanders, with no gaps and no jumps. Its soxr predecessor gave its output in bursts, ran its FIFO dry and put zeros and
delay jumps into the echo (337 samples' worth in a 2.5 min bench run, measured here)."""

import numpy as np

from appliance.audio.jack_room import _DriftLine

RATE = 48000


def _run(line, x, block=1024):
    return np.concatenate([line(x[i:i + block]) for i in range(0, len(x), block)])


def test_no_drift_is_an_exact_integer_delay():
    x = np.random.default_rng(1).standard_normal(RATE).astype(np.float32)
    y = _run(_DriftLine(1185, 1.0), x)
    assert np.array_equal(y[1185:], x[:-1185]) and not y[:1185].any()


def test_drift_shrinks_the_delay_smoothly_and_accurately():
    """+300 ppm: output sample m is the input at m·1.0003 − 1185, within −90 dB for a 6 kHz tone, and
    over 20 s (longer than any reply) the line never runs dry."""
    ratio = 1 + 300e-6
    n = np.arange(20 * RATE)
    x = np.sin(2 * np.pi * 6000.0 * n / RATE).astype(np.float32)
    line = _DriftLine(1185, ratio)
    y = _run(line, x, 1000)  # blocks of any length
    pos = n * ratio - 1185
    ref = np.sin(2 * np.pi * 6000.0 * pos / RATE)
    s = slice(2000, None)
    err_db = 10 * np.log10(np.mean((y[s] - ref[s]) ** 2) / np.mean(ref[s] ** 2))
    assert err_db < -90.0, err_db
    assert line.dry == 0


def test_the_wander_is_smooth_bounded_and_peaks_at_the_drift_rate():
    """+300 ppm over a 60 s period: the delay shrinks at 300 µs/s at first, stays within ±2.9 ms of the
    nominal 1185 samples, and never jumps (what the room does instead of re-centring in silence)."""
    line = _DriftLine(1185, 1 + 300e-6, period=60.0 * RATE)
    m = np.arange(0, 120 * RATE, 480, dtype=np.float64)
    delay = m - line.positions(m)
    assert abs(line.amplitude / RATE - 300e-6 * 60 / (2 * np.pi)) < 1e-9  # 2.86 ms
    assert np.max(np.abs(delay - 1185)) <= line.amplitude + 1e-6
    rate = -np.diff(delay) / 480  # change of the delay per sample
    assert abs(rate[0] - 300e-6) < 1e-6 and np.max(np.abs(rate)) <= 300e-6 + 1e-9
    x = np.sin(2 * np.pi * 1000.0 * np.arange(20 * RATE) / RATE).astype(np.float32)
    y = _run(line, x)
    ref = np.sin(2 * np.pi * 1000.0 * line.positions(np.arange(20 * RATE, dtype=np.float64)) / RATE)
    assert np.max(np.abs(y[2000:] - ref[2000:])) < 1e-3 and line.dry == 0


def test_the_line_runs_dry_only_when_the_drift_has_used_up_the_delay():
    line = _DriftLine(64, 1 + 0.01)  # 1 %: 64 − 16 samples of margin used up after ~4800 samples
    _run(line, np.ones(20000, dtype=np.float32))
    assert line.dry > 0
