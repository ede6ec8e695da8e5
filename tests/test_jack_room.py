"""The short JACK-room run (issue 18): ``appliance run`` itself, as a subprocess, on real PortAudio
streams at 48 kHz (so the worker's resampling path runs as on a Pi), in the JACK room of
``appliance bench interruption --room jack``. A JACK dummy server of its own (``appliance-test-room48-<pid>``:
two suites at once on one machine must not share it, since the one that started it stops it) is started and
stopped here; the shared 16 kHz test server is not touched.

Real parts: the service's whole assembly and audio worker, PortAudio, Silero, Piper, the tiny random
Gemma 4 fixture (it hears; its words are nonsense). Mocked: the sound card (a JACK dummy driver) and
the room (a JACK client with an echo path and scripted speech).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from appliance.audio.files import load_audio
from jack_dummy import why_skip_own_server

ROOT = Path(__file__).resolve().parent.parent
SERVER = f"appliance-test-room48-{os.getpid()}"
# Onset to silence as the room hears it. Measured here: 90 ms alone, 614 ms once in the full suite on a
# loaded machine (a late onset). Real time on a shared machine, so as test_interruption.py does: a
# behaviour that is broken fails all three runs; the benchmark measures the latency.
BARGE_IN_MAX_MS = 500.0
# The canceller's ERLE on the service's first reply, from its own streams (the listener's tap). Measured here
# on the bench's first replies (cold, 0 dB, clipping speaker): 39.2 dB at 0 ppm. Without a working canceller
# (or a tap placed wrongly on the room's clock) it is 0-10 dB.
ERLE_MIN_DB = 20.0
REALTIME = pytest.mark.flaky(reruns=2)


pytestmark = pytest.mark.skipif(why_skip_own_server() is not None, reason=str(why_skip_own_server()))


@pytest.fixture(scope="module")
def server():
    """A 48 kHz JACK dummy server of this module's own."""
    from appliance.bench.jack_room import JackServer

    srv = JackServer(SERVER, 48000, 1024).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def running(server, tmp_path_factory):
    """The room on the server (no echo path yet) and the service, listening."""
    from appliance.audio.jack_room import JackRoom
    from appliance.audio.room import synthetic_ir
    from appliance.audio.tap import ENV as TAP_ENV
    from appliance.bench.jack_room import ServiceTap, ServiceUnderTest, service_config
    from appliance.config import Config

    work = tmp_path_factory.mktemp("jack-room")
    room = svc = None
    try:
        room = JackRoom(f"testroom{os.getpid()}", servername=server.name, impulse_response=synthetic_ir(150.0))
        svc = ServiceUnderTest(service_config(Config(), room.name, work / "state", max_reply_tokens=48), work,
                               dict(server.env(), **{TAP_ENV: str(work / "tap.f32")}))
        svc.tap = ServiceTap(work / "tap.f32", room.rate)
        assert svc.wait_state("listening", 120), (work / "service.log").read_text()[-3000:]
        yield room, svc
    finally:
        if svc is not None:
            svc.stop()
        if room is not None:
            room.close()


def _played_and_heard(room, sig: np.ndarray, seconds: float) -> tuple[np.ndarray, np.ndarray, int]:
    """``sig`` (float32, 48 kHz) played into ``room`` by the audio worker for ``seconds``, then the room closed:
    the 16 kHz microphone and far end as the worker pairs them for the canceller, and the room's drift line
    position (:attr:`JackRoom.line_samples`) at the first microphone block."""
    from appliance.audio.device import DeviceAudio

    pos = [0]
    mic, far, first = [], [], []

    def pull(n):
        x = sig[pos[0]:pos[0] + n]
        pos[0] += n
        return np.pad(x, (0, n - len(x)))

    def heard(m, f):
        if not mic:
            first.append(room.line_samples)
        mic.append(m.copy())
        far.append(f.copy())

    dev = DeviceAudio(room.name, room.name, 10, 48000)
    dev.start(pull, heard)
    try:
        assert dev.wait_open(20)
        time.sleep(seconds)
    finally:
        dev.stop()
        room.close()
    return np.concatenate(mic), np.concatenate(far), first[0]


def test_the_far_end_reaches_the_capture_side_whole_and_in_step_at_48khz(server, monkeypatch):
    """The audio worker at 48 kHz hands the capture side as much far end as microphone, and the echo stays
    the same number of samples behind its far end all along: the far end is what the output callbacks
    played, paired with the microphone by count (:class:`appliance.audio.device.host.FarEnd`), so neither
    the output ring's fill (2 blocks, one more after each late block) nor the microphone resampler's bursts
    move it. White noise through a pure 30 ms echo path."""
    from appliance.audio.jack_room import JackRoom

    monkeypatch.setenv("JACK_DEFAULT_SERVER", server.name)
    room = JackRoom(f"farend{os.getpid()}", servername=server.name, echo_gain_db=0.0, noise_dbfs=None)
    rng = np.random.default_rng(5)
    m, f, _ = _played_and_heard(room, (0.1 * rng.standard_normal(48000 * 10)).astype(np.float32), 6.0)
    assert len(m) > 16000 * 4
    assert len(f) == len(m)  # the two 16 kHz streams in step, sample for sample

    def lag(s):  # the canceller pairs the two streams sample by sample from their starts
        a = m[s:s + 8000]
        b = f[s - 3200:s + 8000]  # the far end up to 200 ms earlier
        c = np.correlate(b, a, mode="valid")  # c[k]: a against b[k:], i.e. the echo 3200 - k samples late
        k = int(np.argmax(np.abs(c)))
        corr = float(c[k] / np.sqrt(np.dot(a, a) * np.dot(b[k:k + len(a)], b[k:k + len(a)])))
        return 3200 - k, corr

    (first, c1), (last, c2) = lag(16000), lag(len(m) - 16000)
    # Measured here: 523 samples (32.7 ms: 30 ms of room, one JACK period of the room's loop, the
    # streams' latencies, minus FarEnd's 20 ms lead) from the first second to the last.
    assert c1 > 0.5 and c2 > 0.5, (c1, c2)
    assert first == last and 0 < first < 3200, (first, last)


def test_the_echo_delay_measured_on_real_streams_follows_the_rooms_clock_drift(server, monkeypatch, parts):
    """The appliance's voice through the room at +300 ppm with the clipping speaker, on the audio worker's real
    streams, paired as the canceller pairs them: the delay track (:func:`appliance.audio.delay.delay_track`)
    moves at the rate the room's drift line moved over the same samples (``JackRoom.delay_rate_ppm``), within
    30 ppm, and the windows scatter less than 0.25 ms rms around lines through 4 s spans. Measured here:
    -231.8 ppm against the line's -224.3, 0.02 ms rms."""
    import soxr

    from appliance.audio.delay import delay_summary, delay_track, drift_ppm
    from appliance.audio.jack_room import JackRoom
    from appliance.audio.room import synthetic_ir
    from appliance.bench.audio import fixed_speech

    monkeypatch.setenv("JACK_DEFAULT_SERVER", server.name)
    room = JackRoom(f"drift{os.getpid()}", servername=server.name, echo_gain_db=0.0, drift_ppm=300.0,
                    speaker="clip", impulse_response=synthetic_ir(150.0))
    line = ("A rainbow is an arc of colours in the sky, made by sunlight shining through drops of rain, and each "
            "drop splits the light like a small prism.")
    voice = fixed_speech(parts.tts, line)
    sig = soxr.resample(np.tile(np.concatenate([voice, np.zeros(4000, np.float32)]), 3), 16000, 48000)
    m, f, m0 = _played_and_heard(room, sig.astype(np.float32), 10.0)
    pts = delay_track(m, f)
    assert len(pts) >= 20, len(pts)
    want = room.delay_rate_ppm(m0, m0 + 3 * len(m))  # 48 kHz line samples over the recording
    got = drift_ppm(pts)
    summary = delay_summary(pts, window_s=4.0)
    print(f"measured here: drift {got:.1f} ppm (the room's line: {want:.1f}), {summary}")
    assert got is not None and abs(got - want) < 30.0, (got, want)
    assert summary["residual_ms_rms"] < 0.25, summary


def test_the_rooms_speaker_comes_on_at_the_path_change(server, monkeypatch):
    """``path_change_s`` (``--path-change-s``): a 500 Hz tone at half scale comes back through a linear path first
    (its third harmonic under -50 dB of it), and from the change through the clipping speaker (``tanh(2x)/2``: the
    third harmonic above -30 dB), on the worker's real streams. Measured here: -170.5 and -23.3 dB."""
    from appliance.audio.jack_room import JackRoom

    monkeypatch.setenv("JACK_DEFAULT_SERVER", server.name)
    room = JackRoom(f"change{os.getpid()}", servername=server.name, echo_gain_db=0.0, speaker="clip",
                    drift_ppm=300.0, noise_dbfs=None, path_change_s=2.0)
    sig = (0.5 * np.sin(2 * np.pi * 500.0 * np.arange(5 * 48000) / 48000)).astype(np.float32)
    m, _, m0 = _played_and_heard(room, sig, 4.5)
    at = (room.path_changed - m0) // 3  # the change in the 16 kHz microphone's samples

    def third_harmonic_db(x):
        spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
        f = np.fft.rfftfreq(len(x), 1 / 16000)
        band = lambda hz: spec[np.abs(f - hz) < 20].max()  # noqa: E731
        return 20 * np.log10(band(1500.0) / band(500.0))

    before, after = third_harmonic_db(m[at - 9600:at - 1600]), third_harmonic_db(m[at + 1600:at + 9600])
    print(f"measured here: third harmonic {before:.1f} dB before the change, {after:.1f} dB after")
    assert before < -50.0 and after > -30.0, (before, after)


def _case(kind, label, audio, text, delay=0.6, echo_rel_db=0.0, echo_path=False):
    from appliance.bench.interruption import Case

    return Case(kind, label, audio, text, delay, echo_rel_db, echo_path=echo_path)


def _run(room, svc, case):
    from appliance.bench.jack_room import run_case

    question = load_audio(ROOT / "demo" / "question.wav")
    return run_case(case, room, svc, reply_level=-19.0, question=question, timeout_s=30.0)


@REALTIME
def test_no_pause_on_its_own_echo_when_nobody_talks(running):
    """The whole reply to one question through the room's echo path (30 ms, RT60 150 ms, as loud at the
    microphone as a user), nobody talking over it: the appliance must not pause on its own voice. This is
    the canceller on real streams: its far end is what the worker's output played, paired with the
    microphone by count. Measured here, loaded machine, 10 echo-only replies at 0 and +6 dB each run:
    without drift, 0 paused (this code and the code before it alike); with +300 ppm of drift and the
    clipping speaker 4 paused, 2 flushed (the far end before this: 2 of 10 unloaded in the old room, 3 of
    10 loaded in this one; 3 of 10, 2 flushed, once the room's drift wanders instead of jumping): the
    drift does not hold yet, too randomly for a test: ``appliance bench interruption --room jack
    --echo-only N`` counts it. Here: one reply at 0 dB, linear speaker, no drift, the service's first reply (cold)."""
    room, svc = running
    out = _run(room, svc, _case("echo_only", "nobody talks", None, None, echo_rel_db=0.0, echo_path=True))
    assert out.valid, out.note
    assert any(r["event"] == "turn_end" for r in out.records)
    assert out.interrupted == 0 and not out.flushed, [r["event"] for r in out.records]
    # The service's own streams (its listener's tap) placed on the room's clock by their waveform, and the
    # canceller's ERLE over the reply's echo (ERLE_MIN_DB).
    assert svc.tap.offset is not None and svc.tap.peak > 0.9
    assert out.erle_den > 0 and 10 * np.log10(out.erle_num / out.erle_den) >= ERLE_MIN_DB


@REALTIME
def test_barge_in_through_the_service_on_real_streams(running):
    """No echo path (headphones): the reply plays through the worker's 48 kHz streams, the user's "Wait,
    stop." silences it within the bound as the room hears it, and the reply is dropped."""
    from appliance.bench.jack_room import served_at_onset

    room, svc = running
    wait = load_audio(ROOT / "demo" / "wait.wav")
    for attempt in range(4):
        out = _run(room, svc, _case("short_stop", "Wait, stop.", wait, "Wait, stop."))
        # The random model's reply can be too short to talk over, or between two words at the onset (then
        # there is nothing to silence: the bench counts 0 ms); neither tests the path, so try again.
        if out.valid and out.barge is not None:
            onset = room.frame0 + int(out.barge["onset_t"] * room.rate)
            if np.max(np.abs(room.heard(onset - room.rate // 10, onset))) >= 10 ** (-50 / 20):
                break
    assert out.valid, out.note
    assert out.barge is not None, [r["event"] for r in out.records]
    assert 0.0 < out.barge["output_silent_ms"] <= BARGE_IN_MAX_MS, out.barge
    assert out.flushed, [r["event"] for r in out.records]
    # Where the latency went, from the service's own audio clock: the parts add up to what the room measured.
    # (input_ms is the truth within one JACK period, the clock mapping's error: since the capture path holds back
    #   nothing, its true value is a few ms, and it can come out under 0)
    split = out.barge["split"]
    period_ms = 1000.0 * 1024 / 48000
    assert split is not None and 0.0 < split["vad_ms"] and -period_ms < split["input_ms"] < split["listener_ms"] + 1.0
    assert abs(split["vad_ms"] + split["listener_ms"] + split["output_ms"] - out.barge["output_silent_ms"]) < 0.5
    # What the listener did in between, from the trace beside its tap (the bench's barge_in_cases): its last
    # Silero window is the one that fired (at the split's vad_ms, scored at least the early onsets' 0.2), and
    # each 10 ms frame from the onset on went through the canceller once.
    trace = out.barge["trace"]
    assert trace is not None and trace["vad"], out.barge
    assert abs(trace["vad"][-1][0] - split["vad_ms"]) <= 1.0 and trace["vad"][-1][1] >= 0.2, trace["vad"][-3:]
    frames = [f[0] for f in trace["frames"] if f[0] > -10.0]
    assert sum(trace["serving"].values()) == len(frames) and frames == sorted(set(frames)), trace["serving"]
    assert out.served_by in {"stand_in", "reused", "speex"} and out.served_by == served_at_onset(trace)
