"""The JACK room's clock drift (:class:`appliance.audio.jack_room._DriftLine`): a smooth, exact fractional
delay, with no gaps. Its soxr predecessor gave its output in bursts, ran its FIFO dry and put zeros and
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


def test_recentre_returns_to_the_nominal_delay():
    ratio = 1 + 300e-6
    line = _DriftLine(1185, ratio)
    _run(line, np.zeros(10 * RATE, dtype=np.float32))  # 10 s: 144 samples of drift
    assert line.recentre()
    x = np.random.default_rng(2).standard_normal(RATE).astype(np.float32)
    y = line(x)
    # Right after the re-centring the echo is 1185 samples late again (the drift since: under a sample).
    c = np.correlate(y[1000:1400 + 4000], x[:4000], mode="valid")
    assert abs(int(np.argmax(c)) + 1000 - 1185) <= 1  # without the re-centring: 1185 − 144

def test_the_line_runs_dry_only_when_the_drift_has_used_up_the_delay():
    line = _DriftLine(64, 1 + 0.01)  # 1 %: 64 − 16 samples of margin used up after ~4800 samples
    _run(line, np.ones(20000, dtype=np.float32))
    assert line.dry > 0
