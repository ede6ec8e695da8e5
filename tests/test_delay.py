"""The echo's delay and its drift measured from the two streams (appliance/audio/delay.py): real Piper speech
through the offline JACK-room worst case (appliance.bench.audio.clipping_room: a soft-clipping speaker, a 30 ms
path and RT60 150 ms, a constant clock drift), where the true delay is known sample for sample."""

import numpy as np
import pytest

from appliance.audio.delay import DelayPoint, delay_summary, delay_track, drift_ppm, gcc_phat_delay
from appliance.bench.audio import ECHO_DELAY_MS, clipping_room, fixed_speech

RATE = 16000


@pytest.fixture(scope="module")
def speech(parts):
    """20 s of the appliance's voice (three sentences, with the pauses between them), fixed rendering."""
    lines = ["A rainbow is an arc of colours in the sky, made by sunlight shining through drops of rain.",
             "Hello there. I am happy to help you with questions about science, history, or anything else you like.",
             "The moon is bright tonight, and the stars are out over the quiet hills."]
    gap = np.zeros(RATE // 2, np.float32)
    parts_ = []
    while sum(map(len, parts_)) < 20 * RATE:
        for line in lines:
            parts_ += [fixed_speech(parts.tts, line), gap]
    return np.concatenate(parts_)[: 20 * RATE]


@pytest.mark.parametrize("ppm", [0.0, 300.0, -300.0])
def test_the_delay_and_a_constant_drift_are_measured_on_a_clipping_speaker(speech, ppm):
    """clipping_room reads the far end at position m (1 + ppm 1e-6) - 30 ms: the echo's delay is 30 ms - m ppm
    1e-6 (a faster speaker clock: the delay shrinks), plus the room's direct path. Every window the track keeps
    is within 0.1 ms (1.6 samples) of that line's shape, and the measured drift within 10 ppm of -ppm."""
    mic = clipping_room(speech, 0.0, drift_ppm=ppm)
    pts = delay_track(mic, speech)
    assert len(pts) >= 40, len(pts)
    t = np.array([p.t_s for p in pts])
    d = np.array([p.delay_ms for p in pts])
    want = ECHO_DELAY_MS - t * 1000.0 * ppm * 1e-6  # ms
    offset = float(np.median(d - want))  # the room's direct path inside its impulse response
    assert abs(offset) < 1.0, offset
    assert np.max(np.abs(d - want - offset)) < 0.1, np.max(np.abs(d - want - offset))
    rate = drift_ppm(pts)
    assert rate is not None and abs(rate + ppm) < 10.0, rate
    s = delay_summary(pts)
    assert s["n"] == len(pts) and abs(s["drift_ppm"] + ppm) < 10.0 and s["residual_ms_rms"] < 0.05, s


def test_windows_with_no_echo_in_them_are_left_out(speech):
    """The far end silent, or played into a room that does not hear it (noise only at the microphone): no
    window is measured; a bare single window of noise against speech gives a peak no higher than its sidelobes."""
    noise = (0.01 * np.random.default_rng(1).standard_normal(len(speech))).astype(np.float32)
    assert delay_track(noise, np.zeros_like(speech)) == []
    assert delay_track(noise, speech) == []
    got = gcc_phat_delay(noise[16000:24000], speech[14400:24000], 1600)
    assert got is None or got[1] < 3.0
    with pytest.raises(ValueError, match="max_lag"):
        gcc_phat_delay(noise[:8000], speech[:8000], 1600)


def test_the_summary_finds_a_wandering_drift_that_the_whole_run_hides():
    """A delay that wanders as the JACK room's does (a sine of 60 s whose rate peaks at 300 ppm) moves little
    over a whole period, but its 10 s spans show the peak rate."""
    t = np.arange(0.0, 120.0, 0.25)
    amp_ms = 300e-6 * 60.0 / (2 * np.pi) * 1000.0
    pts = [DelayPoint(float(x), 32.0 - amp_ms * np.sin(2 * np.pi * x / 60.0), 5.0) for x in t]
    s = delay_summary(pts)
    assert abs(s["drift_ppm"]) < 30.0, s
    assert 250.0 < abs(s["drift_ppm_peak"]) <= 300.0, s
    assert abs(s["wander_ms"] - 2 * amp_ms * np.sin(0.45 * np.pi)) < 0.05, s  # p5..p95 of a sine: 2A sin(0.45 pi)


def test_the_jack_bench_reads_the_echo_delay_off_the_services_tap(speech, tmp_path):
    """``appliance bench interruption --room jack`` reports ``echo_delay`` from the listener's tap
    (:func:`appliance.bench.jack_room.tap_echo_delay`): a tap written as the listener writes it, in 30 ms
    blocks, of the drifting clipping room at -300 ppm (the echo falling behind) gives the drift and the delay."""
    from appliance.audio.tap import AudioTap
    from appliance.bench.jack_room import ServiceTap, tap_echo_delay

    mic = clipping_room(speech, 0.0, drift_ppm=-300.0)
    tap = AudioTap(tmp_path / "tap.f32")
    for i in range(0, len(mic), 480):
        tap.write(mic[i:i + 480], speech[i:i + 480], mic[i:i + 480])
    tap.close()
    got = tap_echo_delay(ServiceTap(tmp_path / "tap.f32", 48000))
    assert got["n"] >= 40 and abs(got["drift_ppm"] - 300.0) < 10.0, got
    assert ECHO_DELAY_MS - 1.0 < got["delay_ms"]["p5"] < got["delay_ms"]["p95"] < ECHO_DELAY_MS + 8.0, got
    assert tap_echo_delay(ServiceTap(tmp_path / "none.f32", 48000))["n"] == 0


@pytest.mark.parametrize("ppm", [300.0, -300.0])
def test_the_drift_follower_keeps_the_echo_where_it_was_first_found(speech, ppm):
    """:class:`DriftFollower`, block by block (10 ms) as the canceller feeds it: on the clipping room drifting by
    ``ppm`` (the echo's delay moves 6 ms over the 20 s), the far end it hands back keeps the echo at one delay
    (the first measured, less the reserve) to within 0.05 ms from 5 s on (it follows a slope once its
    measurements span MIN_SLOPE_S, 3 s), and drifts under 5 ppm; the far end as played drifts the full
    ``ppm``."""
    from appliance.audio.delay import DriftFollower

    mic = clipping_room(speech, 0.0, drift_ppm=ppm)
    f = DriftFollower()
    out = np.concatenate([f.process(mic[i:i + 160], speech[i:i + 160]) for i in range(0, len(mic), 160)])
    assert len(out) == len(mic) and f.first is not None and f.reserve == 320.0
    raw = delay_track(mic, speech)
    assert abs(drift_ppm(raw) + ppm) < 10.0
    pts = [p for p in delay_track(mic, out) if p.t_s > 5.0]
    d = np.array([p.delay_ms for p in pts])
    assert len(pts) >= 30, len(pts)
    want = (f.first - f.reserve) * 1000.0 / RATE
    assert np.max(np.abs(d - want)) < 0.15 and np.median(np.abs(d - want)) < 0.05, (want, np.percentile(d, [0, 50, 100]))
    assert abs(drift_ppm(pts)) < 5.0, drift_ppm(pts)


def test_the_drift_follower_hands_back_silence_unchanged_and_refuses_a_block_too_long():
    """Before any echo has been measured the far end comes back delayed by the reserve (20 ms), sample for sample;
    a block longer than the follower keeps is a caller's error."""
    from appliance.audio.delay import DriftFollower

    f = DriftFollower()
    x = np.random.default_rng(0).standard_normal(1600).astype(np.float32) * 0.1
    out = np.concatenate([f.process(np.zeros(160, np.float32), x[i:i + 160]) for i in range(0, 1600, 160)])
    assert f.first is None
    assert np.array_equal(out[320:], x[:-320]) and not out[:320].any()
    with pytest.raises(ValueError, match="at most"):
        f.process(np.zeros(100000, np.float32), np.zeros(100000, np.float32))


def test_the_drift_follower_measures_each_reply_afresh_after_a_silence(speech):
    """The JACK room's drift wanders, and over the silence between two replies the echo's delay moves where
    nothing can measure it. Here it jumps by 20 samples (1.25 ms) in a 2 s silence: 0.3 s into the second
    reply the follower's delay is within a sample of the new one (its quick 0.15 s window), where a fit
    of the first reply's measurements alone would still say the old one."""
    from appliance.audio.delay import DriftFollower

    a, b = speech[:5 * RATE], speech[6 * RATE:10 * RATE]
    gap = np.zeros(2 * RATE, np.float32)
    far = np.concatenate([a, gap, b])
    d1, d2 = 480, 500
    mic = np.zeros(len(far), np.float32)
    mic[d1:len(a) + d1] += 0.5 * a
    b0 = len(a) + len(gap)
    mic[b0 + d2:b0 + d2 + len(b)] += 0.5 * b[:len(mic) - b0 - d2]
    mic += (1e-4 * np.random.default_rng(2).standard_normal(len(mic))).astype(np.float32)
    f = DriftFollower()
    at = b0 + int(0.3 * RATE)
    for i in range(0, at, 160):
        f.process(mic[i:i + 160], far[i:i + 160])
    assert abs(f.first - d1) < 1.0
    assert abs(f.delay_now() - d2) < 1.0, f.delay_now()
