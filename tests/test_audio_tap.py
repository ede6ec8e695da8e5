"""The listener's tap (issue 18): what the service's listener processed (microphone, far end, canceller
output), written for the JACK room's benchmark, and the benchmark's use of it (ERLE, the latency split)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np


def test_the_listener_writes_mic_far_and_the_cancellers_output_sample_for_sample(tmp_path, monkeypatch):
    from appliance.audio.echo import EchoCanceller
    from appliance.audio.tap import ENV, read_tap
    from appliance.pipeline import Listener
    from appliance.vad import SileroVad, VadSegmenter

    monkeypatch.setenv(ENV, str(tmp_path / "tap.f32"))
    rng = np.random.default_rng(0)
    far = (0.1 * rng.standard_normal(16000)).astype(np.float32)
    mic = (0.5 * np.concatenate([np.zeros(80), far[:-80]]) + 1e-3 * rng.standard_normal(16000)).astype(np.float32)
    echo = EchoCanceller()
    listener = Listener(VadSegmenter(SileroVad()), lambda *a, **k: None, echo=echo)
    fed = 0
    for n in (480, 333, 480, 1440, 7, 480):  # blocks that are not whole 10 ms frames
        listener._process(mic[fed:fed + n], far[fed:fed + n])
        fed += n
    got = read_tap(tmp_path / "tap.f32")
    whole = fed - fed % 160  # the canceller hands out complete 10 ms frames
    assert got.shape == (whole, 3)
    assert np.array_equal(got[:, 0], mic[:whole]) and np.array_equal(got[:, 1], far[:whole])
    assert np.any(got[:, 2] != got[:, 0])  # the canceller's output, not the microphone
    assert len(read_tap(tmp_path / "tap.f32", start=100, count=50)) == 50
    listener.stop()  # (never started: stop closes the tap all the same)
    assert listener.tap._fh.closed


def test_no_tap_without_the_environment_variable(monkeypatch):
    from appliance.audio.tap import ENV
    from appliance.pipeline import Listener
    from appliance.vad import SileroVad, VadSegmenter

    monkeypatch.delenv(ENV, raising=False)
    assert Listener(VadSegmenter(SileroVad()), lambda *a, **k: None).tap is None


def test_erle_counts_only_frames_with_a_far_end_and_no_scripted_sound():
    from appliance.bench.jack_room import erle_sums

    n = 1600
    tap = np.zeros((n, 3), np.float32)
    tap[:, 1] = 0.1  # far end playing throughout
    tap[:, 0] = 0.1  # echo at the microphone
    tap[:, 2] = 0.001  # 40 dB below after the canceller
    tap[800:960, 2] = 0.1  # a frame with the user talking (busy): not counted
    tap[1440:, 1] = 0.0  # far end silent: not counted
    num, den = erle_sums(tap, 0, n, [(800, 960)])
    assert round(10 * np.log10(num / den), 3) == 40.0
    assert abs(num - 8 * 160 * 0.01) < 1e-4  # 10 frames, less the busy one and the silent one


def test_the_latency_split_adds_up_to_the_barge_ins_latency():
    """Onset at room frame 48000 (1 s); the VAD window that fired ends 40 ms later on the service's audio clock
    (the tap's sample 0 is room frame 4800); the onset is posted 70 ms after that window's last sample was
    written, the pause 1 ms later; the room hears silence 150 ms after the onset."""
    from appliance.bench.jack_room import ServiceTap, tap_split
    from appliance.vad import WINDOW_MS

    room = SimpleNamespace(rate=48000, frame0=0, seconds=lambda f: f / 48000)
    tap = ServiceTap.__new__(ServiceTap)
    tap.rate, tap.step, tap.offset = 48000, 3, 4800
    window_end_frame = 48000 + 40 * 48
    audio_t = (window_end_frame - 4800) / 48000 - WINDOW_MS / 1000.0
    recs = [{"event": "vad_onset", "t": 0.6, "audio_t": audio_t - 0.5},  # an earlier onset, not this pause's
            {"event": "vad_onset", "t": 1.04 + 0.07, "audio_t": audio_t},
            {"event": "vad_onset", "t": 1.1105, "audio_t": audio_t + 0.016},  # a later window, same pause
            {"event": "interrupted", "t": 1.111, "onset_t": 1.11}]
    split = tap_split(recs, {"onset_t": 1.0, "detected_ms": 111.0, "output_silent_ms": 150.0}, room, tap)
    assert split == {"vad_ms": 40.0, "input_ms": 70.0, "listener_ms": 71.0, "output_ms": 39.0}


def test_the_tap_is_placed_on_the_rooms_clock_by_its_waveform_even_when_the_question_repeats(tmp_path):
    """The room wrote the same question twice (as every scenario does); the tap's sample 0 is room frame 30000,
    and its microphone is what the service's capture path made of the room's (48 -> 16 kHz). The first alignment
    finds it from the first question; a later one, made on the second question, must find the same offset
    (searching the whole tap would match the first question again)."""
    from appliance.audio.device.host import capture_stream
    from appliance.audio.files import resample
    from appliance.bench.jack_room import ServiceTap

    rng = np.random.default_rng(1)
    q16 = (0.3 * rng.standard_normal(8000)).astype(np.float32)
    mic16 = np.zeros(5 * 16000, np.float32)
    mic16[16000:24000] = 2 * q16  # louder: a search of the whole tap would match it best
    mic16[56000:64000] = q16
    mic16 += (1e-3 * rng.standard_normal(len(mic16))).astype(np.float32)
    offset = 30000
    mouth = np.concatenate([np.zeros(offset, np.float32), resample(mic16, 16000, 48000)])
    room = SimpleNamespace(said=lambda f0, f1: mouth[f0:f1])
    heard = capture_stream(48000)(mouth[offset:])
    with open(tmp_path / "tap.f32", "wb") as fh:
        fh.write(np.stack([heard, np.zeros_like(heard), heard], axis=1).tobytes())
    tap = ServiceTap(tmp_path / "tap.f32", 48000)
    first = offset + 16000 * 3
    assert abs(tap.align(room, first, first + 24000) - offset) <= 3
    second = offset + 56000 * 3
    assert abs(tap.align(room, second, second + 24000) - offset) <= 3
    assert tap.peak > 0.95 and len(tap.offsets) == 2


def _listener_logs(echo, calls: int, caplog, phrase: str) -> list[str]:
    """The messages holding ``phrase`` that the listener logs over ``calls`` blocks of 30 ms of silence, ``echo``
    its canceller (a fake through the interface the listener uses)."""
    import logging

    from appliance.pipeline import Listener
    from appliance.vad import SileroVad, VadSegmenter

    listener = Listener(VadSegmenter(SileroVad()), lambda *a, **k: None, echo=echo)
    with caplog.at_level(logging.INFO, logger="appliance.pipeline"):
        for _ in range(calls):
            listener._process(np.zeros(480, np.float32), np.zeros(480, np.float32))
    return [r.getMessage() for r in caplog.records if phrase in r.getMessage()]


def test_the_cancellers_hand_over_to_speex_is_logged_and_read_by_the_jack_bench(caplog):
    """The listener logs the canceller's hand-over from its AEC3 stand-in to Speex once, with the audio time;
    the JACK room's bench reads that line from the service's stderr (``echo_hand_over`` in its JSON), so a run
    says which canceller served its replies. Measured here: at 0 ppm, clipping speaker, Speex took over in the
    first reply and its ERLE was then 18-27 dB (the stand-in's 35-48); at +300 ppm it never took over."""
    import threading

    from appliance.bench.jack_room import ServiceUnderTest

    class Echo:  # the canceller's interface the listener uses; hands over at its third call
        handovers = 0
        calls = 0

        def process(self, mic, far, quiet=False):
            self.calls += 1
            self.handovers = int(self.calls >= 3)
            return mic

    lines = _listener_logs(Echo(), 5, caplog, "took over")
    assert lines == ["echo canceller: Speex took over from the stand-in at audio_t 0.090 s"]
    svc = ServiceUnderTest.__new__(ServiceUnderTest)
    svc.records, svc.handovers, svc.handbacks, svc.state, svc._lock = [], [], [], "listening", threading.Lock()
    svc.take("2026-12-01 17:00:00,000 INFO appliance.pipeline: " + lines[0] + "\n", 1.0)
    svc.take('2026-12-01 17:00:00,000 DEBUG appliance.service: {"t": 1.5, "event": "state", "state": "speaking"}\n', 2.0)
    assert svc.handovers == [0.09] and svc.state == "speaking" and len(svc.records) == 1


def test_a_hand_back_to_the_stand_in_is_logged_and_read_by_the_jack_bench(caplog):
    """Where Speex loses the echo after the hand-over (EchoCanceller._watch_loss), the listener warns once, with
    the figures that decided and the audio time, and the JACK bench reads it into ``echo_hand_back``."""
    import threading

    from appliance.audio.echo import LostEcho
    from appliance.bench.jack_room import ServiceUnderTest

    class Echo:  # the canceller's interface the listener uses; hands over at its second call, back at its fourth
        handovers = handbacks = calls = 0
        lost = None

        def process(self, mic, far, quiet=False):
            self.calls += 1
            self.handovers = int(self.calls >= 2)
            self.handbacks = int(self.calls >= 4)
            self.lost = LostEcho(14.2, 0.61, "the last 2 s of reply") if self.handbacks else None
            return mic

    lines = _listener_logs(Echo(), 6, caplog, "lost the echo")
    assert lines == ["echo canceller: Speex lost the echo (median ERLE 14.2 dB over the last 2 s of reply, what it left "
                     "following the far end at r 0.61); the stand-in serves again from audio_t 0.120 s"]
    assert [r.levelname for r in caplog.records if "lost the echo" in r.getMessage()] == ["WARNING"]
    svc = ServiceUnderTest.__new__(ServiceUnderTest)
    svc.records, svc.handovers, svc.handbacks, svc.state, svc._lock = [], [], [], "listening", threading.Lock()
    svc.take("2026-12-07 17:00:00,000 WARNING appliance.pipeline: " + lines[0] + "\n", 1.0)
    assert svc.handbacks == [0.12] and svc.handovers == [] and not svc.records


def test_the_trace_beside_the_tap_holds_every_vad_window_and_canceller_frame_on_the_taps_clock(tmp_path, monkeypatch):
    """The trace (issue 18: the JACK bench's per-case records) says, sample for sample with the tap, what went to
    the VAD: every 10 ms frame once (Speex unconverged at first: the AEC3 stand-in serves while the far end
    plays), every Silero window once (16 ms hops while replying), and a canceller bound later (a device
    reopened) is placed at the samples the VAD had by then."""
    from appliance.audio.echo import EchoCanceller
    from appliance.audio.tap import ENV, read_tap, read_trace
    from appliance.pipeline import Listener
    from appliance.vad import HOP, WINDOW, SileroVad, VadSegmenter

    monkeypatch.setenv(ENV, str(tmp_path / "tap.f32"))
    rng = np.random.default_rng(0)
    far = (0.1 * rng.standard_normal(32000)).astype(np.float32)
    mic = (0.5 * np.concatenate([np.zeros(80), far[:-80]]) + 1e-3 * rng.standard_normal(32000)).astype(np.float32)
    listener = Listener(VadSegmenter(SileroVad()), lambda *a, **k: None, echo=EchoCanceller("speex"))
    fed = 0
    for n in (480, 333, 480, 1440, 7, 480) * 4:
        if fed == 6440:  # a new canceller, as a reopened device gets
            listener.configure(echo=EchoCanceller("speex"))
        listener._process(mic[fed:fed + n], far[fed:fed + n])
        fed += n
    written = len(read_tap(tmp_path / "tap.f32"))
    rows = read_trace(tmp_path / "tap.f32")
    frames = [r for r in rows if r[0] == "frame"]
    vad = [r for r in rows if r[0] == "vad"]
    starts = [r[1] for r in frames]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    assert starts[-1] + 160 <= written and written - (starts[-1] + 160) < 2 * 160  # within the last frames
    assert set(r[2] for r in frames) == {"aec3"} and all(r[3] > -30 for r in frames)
    assert [r[1] for r in vad] == list(range(WINDOW, written + 1, HOP)) and all(0.0 <= r[2] <= 1.0 for r in vad)
    assert len(read_trace(tmp_path / "tap.f32", 1000, 2000)) < len(rows)
    listener.echo.near_end_present(), listener.echo.near_end_clear()  # the gate's checks, as the VAD asks them
    listener._write_trace()
    gates = [r for r in read_trace(tmp_path / "tap.f32") if r[0] == "gate"]
    assert [g[2:4] for g in gates] == [["stand_in", gates[0][3]], ["clear", False]]
    assert set(gates[0][4]) == {"aec3", "explained", "over_echo", "ratio_db", "threshold_db", "too_quiet"}


def test_a_barge_ins_trace_is_read_from_the_users_onset_to_the_window_that_fired(tmp_path):
    from appliance.audio.tap import AudioTap
    from appliance.bench.jack_room import ServiceTap, case_trace, served_at_onset

    tap = AudioTap(tmp_path / "tap.f32")
    onset = 16000
    tap.trace([("frame", onset + 160 * k, "aec3", -30.0, -60.0 if k < 3 else -35.0, -5.0 + 3 * k, k >= 3)
               for k in range(-20, 8)])
    tap.trace([("vad", onset + 256 * k, 0.1 * k) for k in range(-5, 6)])
    tap.trace([("gate", onset + 1280, "stand_in", True, {"aec3": False, "explained": False, "over_echo": True})])
    tap.close()
    t = case_trace(ServiceTap(tmp_path / "tap.f32", 48000), onset, onset + 1280)
    assert t["serving"] == {"aec3": 8} and t["mic_served_ms"] == 50 and t["over_first_ms"] == 20.0
    assert t["over_max_db"] == 16.0
    assert t["frames"][0] == [-100.0, "aec3", -30.0, -60.0, -35.0, False]
    assert t["frames"][-1] == [70.0, "aec3", -30.0, -35.0, 16.0, True]
    assert t["vad"][0] == [-80.0, -0.5] and t["vad"][-1] == [80.0, 0.5]  # (the scores are made up)
    assert t["gates"] == [[80.0, "stand_in", True, {"aec3": False, "explained": False, "over_echo": True}]]
    # whose output the VAD heard at the onset, in the simulated room's words (barge_in_ms_by_canceller)
    assert served_at_onset(t) == "stand_in" and served_at_onset(None) is None
    next(f for f in t["frames"] if f[0] == 0.0)[1] = "speex"  # the frame that holds the onset, as a converged canceller's
    assert served_at_onset(t) == "speex"


def test_the_trace_takes_numpy_scalars():
    """The canceller's figures are often numpy bools and floats (a live run's listener died on the first gate
    check before this)."""
    import tempfile
    from pathlib import Path

    from appliance.audio.tap import AudioTap, read_trace

    with tempfile.TemporaryDirectory() as d:
        tap = AudioTap(Path(d) / "tap.f32")
        tap.trace([("gate", np.int64(5), "stand_in", np.bool_(True), {"too_quiet": np.bool_(False), "r": np.float32(-3.5)})])
        tap.close()
        assert read_trace(Path(d) / "tap.f32") == [["gate", 5, "stand_in", True, {"too_quiet": False, "r": -3.5}]]
