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


def test_a_line_that_starts_drifting_late_is_an_exact_delay_until_then_and_does_not_jump():
    """``start`` (the room's ``path_change_s``): up to that sample the line is the exact integer delay of one clock;
    from it the delay wanders as a line started there would, with no step at the change."""
    start = 5 * RATE
    line = _DriftLine(1185, 1 + 300e-6, period=60.0 * RATE, start=start)
    x = np.random.default_rng(3).standard_normal(8 * RATE).astype(np.float32)
    y = _run(line, x)
    assert np.array_equal(y[1185:start], x[:start - 1185])
    m = np.arange(start - RATE, start + 2 * RATE, dtype=np.float64)
    delay = m - line.positions(m)
    assert np.all(delay[:RATE + 1] == 1185)
    assert np.max(np.abs(np.diff(delay))) <= 300e-6 + 1e-9  # no step anywhere, the change included
    fresh = _DriftLine(1185, 1 + 300e-6, period=60.0 * RATE)
    assert np.allclose(delay[RATE:], (m - fresh.positions(m - start))[RATE:] - start, atol=1e-9)
    assert not np.array_equal(y[start + 1185:], x[start:-1185])  # it drifts after the change


def test_the_line_runs_dry_only_when_the_drift_has_used_up_the_delay():
    line = _DriftLine(64, 1 + 0.01)  # 1 %: 64 − 16 samples of margin used up after ~4800 samples
    _run(line, np.ones(20000, dtype=np.float32))
    assert line.dry > 0


def test_the_echo_path_at_48khz_has_the_simulated_rooms_gain_and_delay():
    """The impulse response at the server's rate (:func:`appliance.audio.jack_room.echo_ir`) gives speech-band
    noise the gain the simulated room's gives it at 16 kHz (0 dB: unit energy) and its direct path at the
    same time. Normalised to unit energy at 48 kHz instead, the echo came 4.4 dB louder than set (measured
    here on the service's streams) and its direct path's sinc was cut in half by the array's start."""
    from appliance.audio.files import resample
    from appliance.audio.jack_room import echo_ir
    from appliance.audio.room import synthetic_ir

    ir16 = synthetic_ir(150.0)
    x16 = np.random.default_rng(2).standard_normal(4 * 16000).astype(np.float32)
    x48 = resample(x16, 16000, RATE)
    ir48, lead = echo_ir(ir16, RATE)
    y16 = np.convolve(x16, ir16 / np.sqrt(np.sum(ir16.astype(np.float64) ** 2)))[: len(x16)]
    y48 = np.convolve(x48, ir48)[: len(x48)]
    gain = lambda y, x, skip: 10 * np.log10(np.mean(y[skip:] ** 2) / np.mean(x[skip:] ** 2))  # noqa: E731
    assert abs(gain(y48, x48, 4800) - gain(y16, x16, 1600)) < 0.3
    assert int(np.argmax(np.abs(ir48))) == lead == 48  # the direct path, whole, after the lead the delay loses
