"""Sound devices on real PortAudio streams: the JACK dummy server (``.ci/jackd-dummy``) stands in for the
sound card, and a JACK client named ``user`` (tests/jack_dummy.py) is the device the appliance opens by
name: its ``mouth`` is the microphone, its ``ear`` records the speaker. The conversation runs on the tiny
random-weight Gemma 4 fixture (it hears; its words are nonsense), Piper's bundled voice and Silero VAD.

Mocked: nothing but the sound card itself (a JACK dummy driver) and the user (a JACK client).
Skipped with a reason when no JACK server runs (``make test`` on a laptop); ``.ci/run`` starts one.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

import jack_dummy as jd
from conftest import tiny_gemma4_config
from appliance.audio.device import DeviceAudio, DeviceNotFound, match_device
from appliance.audio.files import dbfs

FIX = Path(__file__).parent / "fixtures" / "tiny_gemma4"
needs_jack = pytest.mark.skipif(jd.why_skip() is not None, reason=str(jd.why_skip()))


def test_match_device_by_substring_and_error_lists_candidates():
    devs = [{"index": 0, "name": "bcm2835 Headphones: - (hw:0,0)", "max_input_channels": 0, "max_output_channels": 2},
            {"index": 1, "name": "seeed-2mic-voicecard: (hw:1,0)", "max_input_channels": 2, "max_output_channels": 2},
            {"index": 2, "name": "default", "max_input_channels": 32, "max_output_channels": 32}]
    assert match_device(devs, "SEEED", "input")["index"] == 1
    assert match_device(devs, "headphones", "output")["index"] == 0
    assert match_device(devs, "default", "input", default_index=2)["index"] == 2
    with pytest.raises(DeviceNotFound) as e:
        match_device(devs, "ReSpeaker", "input")
    msg = str(e.value)
    assert "audio.input: 'ReSpeaker'" in msg and "'seeed-2mic-voicecard: (hw:1,0)'" in msg and "'default'" in msg
    assert "bcm2835" not in msg  # it has no input channels
    assert "\n" not in msg


def test_no_devices_at_all_says_connect_one_not_rename():
    """With nothing to choose from, "(found: none); set audio.output … to part of one of these names" could not
    help: it says to connect the sound card."""
    with pytest.raises(DeviceNotFound) as e:
        match_device([], "default", "output")
    msg = str(e.value)
    assert "no output sound device found at all" in msg and "connect the USB sound card or HAT" in msg, msg
    assert "part of one of these names" not in msg and "\n" not in msg


def test_device_errors_name_the_config_in_use_and_doctor_checks_that_one():
    """Under --embedded with no config file, "set audio.output in config.yaml" named a file not in use; the
    hint to run doctor dropped --config F, so doctor checked another file."""
    import argparse

    from appliance.cli import _name_the_config

    line = "no output …; set audio.output in config.yaml to part of one of these names (`appliance doctor` checks)"
    embedded = _name_the_config(line, argparse.Namespace(config=None, embedded=True))
    assert "in a config file given with --config FILE" in embedded and "`appliance doctor --embedded`" in embedded
    given = _name_the_config(line, argparse.Namespace(config="mine.yaml", embedded=False))
    assert "set audio.output in mine.yaml" in given and "`appliance doctor --config mine.yaml`" in given


@pytest.fixture
def user():
    u = jd.User()
    yield u
    u.close()


def _sine(seconds, freq, amp, rate=16000):
    t = np.arange(int(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


@needs_jack
def test_streams_open_by_name_carry_audio_both_ways(user):
    """A tone from the user reaches ``capture`` at 16 kHz at its level; a tone from the playback side
    (48 kHz, resampled by soxr to the device's 16 kHz) reaches the user's ear; callbacks are paced."""
    tone48 = _sine(2.0, 440.0, 0.3, 48000)
    pos = [0]

    def read(n):
        out = np.zeros(n, dtype=np.float32)
        chunk = tone48[pos[0]:pos[0] + n]
        out[:len(chunk)] = chunk
        pos[0] += n
        return out

    mic, far, events = [], [], []
    dev = DeviceAudio("user", "user", 10, 48000, lambda k, i: events.append((k, i)))
    dev.start(read, lambda m, f: (mic.append(m), far.append(f)))
    try:
        assert dev.wait_open(15), events
        info = dev.info
        assert (info.input, info.output, info.in_rate, info.out_rate) == ("user", "user", 16000, 16000)
        user.say(_sine(1.0, 300.0, 0.2))
        t0 = time.monotonic()
        assert jd.wait_for(lambda: sum(map(len, mic)) >= 2.5 * 16000, 15)
        elapsed = time.monotonic() - t0
    finally:
        dev.stop()
    m = np.concatenate(mic)
    loud = m[np.abs(m) > 0.05]
    assert len(loud) > 0.5 * 16000, "the user's tone did not reach the microphone side"
    first = int(np.nonzero(np.abs(m) > 0.05)[0][0])
    level = dbfs(m[first + 800:first + 8800])  # 0.5 s inside the tone
    assert abs(level - dbfs(_sine(1.0, 300, 0.2))) < 1.0, level
    assert 1.5 < elapsed < 12.0  # paced by the server's clock (2.5 s of audio), not unpaced like ALSA's null PCM
    heard = user.heard()
    assert dbfs(heard[np.abs(heard) > 0.01]) > dbfs(tone48) - 2.0, "the playback tone did not reach the ear"
    assert sum(map(len, far)) > 1.5 * 16000  # the far end goes with the microphone, at 16 kHz
    assert set(dev.xruns) >= {"input_overflow", "output_underflow", "late"}
    assert dev.output_latency_ms is None  # closed now
    assert events[0][0] == "open"


def _reply_through_device(audio):
    """A one-clause reply (16 kHz) playing through the ``user`` device, the playback buffer wired to pause,
    resume and flush at the device as the service wires it. Returns (playback, device, silent event)."""
    from appliance.playback import Playback

    dev = DeviceAudio(None, "user", 10, 16000, fade_ms=8.0)
    silent = threading.Event()
    pb = Playback(16000, port=dev, on_event=lambda name, **i: silent.set() if name == "silent" else None)
    pb.begin_reply(1)
    pb.enqueue(1, audio, "a reply")
    dev.start(pb.take, lambda m, f: None, pb.port_silent)
    return pb, dev, silent


@needs_jack
def test_pause_holds_the_device_ring_and_resume_neither_drops_nor_repeats_a_sample(user):
    """A pause fades out at the audio worker within fade_ms, so the 2-8 blocks its ring already holds do not
    play after a barge-in; the resume plays them next. The signal is a ramp, so every unfaded sample the
    ear hears names its own index."""
    n = 3 * 16000
    step = np.float32(0.8 / n)
    ramp = (np.float32(0.1) + step * np.arange(n, dtype=np.float32)).astype(np.float32)
    pb, dev, silent = _reply_through_device(ramp)
    try:
        assert dev.wait_open(15)
        assert jd.wait_for(lambda: len(user.heard()) > 0 and np.count_nonzero(user.heard()) > 8000, 15)
        handed = pb.played_total  # samples read from the buffer when the pause comes
        pb.pause()
        assert silent.wait(2), "the worker never reported silence"
        time.sleep(0.3)
        pb.resume()
        assert jd.wait_for(lambda: pb.pending_samples == 0, 15)
        time.sleep(0.5)
    finally:
        dev.stop()
    heard = user.heard()
    idx = np.round((heard.astype(np.float64) - 0.1) / float(step)).astype(np.int64)
    exact = (np.abs(heard) > 0) & (np.abs(ramp[np.clip(idx, 0, n - 1)] - heard) == 0) & (idx >= 0) & (idx < n)
    # ... and its neighbour names the next or previous index (a faded sample may match some index by chance)
    nxt = np.zeros_like(exact)
    nxt[:-1] = exact[:-1] & exact[1:] & (np.diff(idx) == 1)
    prv = np.zeros_like(exact)
    prv[1:] = nxt[:-1]
    k = np.flatnonzero(nxt | prv)
    jumps = np.flatnonzero(np.diff(idx[k]) != 1)
    assert len(jumps) == 1, f"expected one break (the pause), got {len(jumps)}"
    before, after = k[jumps[0]], k[jumps[0] + 1]
    last, first = idx[before], idx[after]
    between = heard[before + 1:after]
    faded = np.count_nonzero(between)
    assert first - last - 1 == faded, (last, first, faded)  # every sample in between played once, faded
    assert np.count_nonzero(between == 0) >= int(0.25 * 16000)  # and the pause was silent
    assert 0 < faded <= 2 * 128 + 2  # a fade out and a fade in of 8 ms each at 16 kHz
    held = handed - (last + 1 + 128)
    print(f"held by the ring at the pause: {held} samples ({held / 16:.1f} ms)")
    assert held > 0, f"the ring's samples played after the pause ({handed=}, {last=})"
    assert idx[k[-1]] == n - 1  # the ramp played to its end


@needs_jack
def test_flush_after_a_pause_drops_what_the_device_held(user):
    """A barge-in that flushes: after the pause's fade nothing of the reply plays again, neither the
    worker's ring nor the samples the reader had resampled but not sent."""
    pb, dev, silent = _reply_through_device(_sine(3.0, 440.0, 0.3))
    try:
        assert dev.wait_open(15)
        assert jd.wait_for(lambda: np.count_nonzero(user.heard()) > 8000, 15)
        pb.pause()
        assert silent.wait(2)
        mark = len(user.heard())
        time.sleep(0.3)  # paused for a while (the classifier decides), then the flush
        pb.flush()
        time.sleep(0.6)
    finally:
        dev.stop()
    # The ear lags the worker by the server's buffering, so the pause's fade may still arrive after `mark`;
    # from the first 200 ms of silence (the pause) on, nothing may play.
    after = user.heard()[mark:]
    quiet = np.convolve(np.abs(after) > 0, np.ones(3200), mode="valid") == 0
    assert quiet.any(), "the pause never went silent"
    rest = after[int(np.argmax(quiet)):]
    assert len(rest) > 0.3 * 16000 and not np.any(rest), "audio of the flushed reply played again"


@needs_jack
def test_missing_device_names_found_devices_and_keeps_retrying():
    events = []
    dev = DeviceAudio("ReSpeaker", "system", 10, 48000, lambda k, i: events.append((k, i)), backoff=(0.2, 0.4))
    dev.start(lambda n: np.zeros(n, np.float32), lambda m, f: None)
    try:
        assert jd.wait_for(lambda: len(events) >= 3, 20)
    finally:
        dev.stop()
    kinds = {k for k, _ in events}
    assert kinds == {"unavailable"}
    first = events[0][1]
    assert "audio.input: 'ReSpeaker'" in first["reason"] and "'system'" in first["reason"]
    assert "system" in first["found"]
    assert [i["repeated"] for _, i in events[:3]] == [False, True, True]  # said once, then quietly retried
    assert events[2][1]["attempt"] == 3


@needs_jack
def test_a_missing_device_is_logged_as_waiting_and_retrying(caplog):
    """`appliance run` logged the device error once, with "retrying" at the end of a long line: it now says at
    the start that it waits and retries, as the model-error line does."""
    events = []
    dev = DeviceAudio("ReSpeaker", "system", 10, 48000, lambda k, i: events.append((k, i)), backoff=(0.2, 0.4))
    with caplog.at_level("ERROR", logger="appliance.audio.device.host"):
        dev.start(lambda n: np.zeros(n, np.float32), lambda m, f: None)
        try:
            assert jd.wait_for(lambda: len(events) >= 2, 20)
        finally:
            dev.stop()
    lines = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(lines) == 1, lines  # once, not once per attempt
    assert lines[0].startswith("sound device unavailable (waiting; retrying every 0.4 s at most): "), lines[0]
    assert "audio.input: 'ReSpeaker'" in lines[0], lines[0]


# --- a conversation through the real streams -------------------------------------------------------

@pytest.fixture(scope="module")
def hearing_parts():
    """Tiny Gemma 4 (random weights, hears 16 kHz audio), Piper's bundled voice, Silero VAD."""
    from appliance.pipeline import Parts

    cfg = tiny_gemma4_config()
    cfg.gpio.enabled = False
    return cfg, Parts.load(cfg)


def _service(hearing_parts, tmp_path):
    from appliance.service import Service

    cfg, parts = hearing_parts
    cfg = cfg.model_copy(deep=True)
    cfg.audio.input = "user"
    cfg.audio.output = "user"
    cfg.audio.retry_max_s = 1.0
    cfg.storage.state_dir = str(tmp_path)
    cfg.echo.enabled = False
    parts.engine.forget()
    parts.vad.reset()
    records = []
    svc = Service(cfg, parts, timeline=records.append)
    return svc, records


def _turn(user, records, question_audio, timeout=60.0):
    n0 = sum(1 for r in records if r["event"] == "turn_end")
    user.say(question_audio)
    ok = jd.wait_for(lambda: sum(1 for r in records if r["event"] == "turn_end") > n0, timeout, 0.05)
    return ok


def _history(svc):
    svc.session.engine_worker.sync()  # the commit of the reply runs on the engine thread
    return [(m.role, m.text) for m in svc.parts.engine.history]


@needs_jack
def test_conversation_through_real_streams(hearing_parts, tmp_path, user, question_audio):
    """The user's question goes through the JACK streams into Silero and the model; the reply's turn
    metrics carry the xrun count and the output latency."""
    svc, records = _service(hearing_parts, tmp_path)
    svc.start()
    try:
        assert jd.wait_for(lambda: svc.session.conversation.state.value == "listening", 20), records[-5:]
        assert _turn(user, records, question_audio), [r["event"] for r in records]
        states = [r["state"] for r in records if r["event"] == "state"]
        assert states[:3] == ["listening", "thinking", states[2]] and "thinking" in states
        turn = svc.session.conversation.turns[-1]
        assert turn["input"] == "audio"  # the model heard the microphone, not a transcript
        assert "xruns" in turn and turn["output_latency_ms"] > 0
        assert [r for r, _ in _history(svc)] == ["user", "model"]
    finally:
        svc.stop()


@needs_jack
@pytest.mark.skipif(jd.why_skip() is None and not jd.managed(), reason="the JACK server was not started by .ci/jackd-dummy, so this "
                                              "test will not stop it (run `.ci/jackd-dummy start`)")
def test_device_disappears_and_returns_without_losing_the_conversation(hearing_parts, tmp_path, question_audio):
    """Stop the sound server mid-conversation: the state goes to ``error``, the service keeps trying, and
    when the server (and the device) return it listens again with the history intact."""
    user = jd.User()
    svc, records = _service(hearing_parts, tmp_path)
    svc.start()
    try:
        assert jd.wait_for(lambda: svc.session.conversation.state.value == "listening", 20)
        assert _turn(user, records, question_audio)
        history = _history(svc)
        assert len(history) == 2
        user.close()
        jd.stop_server()
        assert jd.wait_for(lambda: svc.session.conversation.state.value == "error", 10), records[-5:]
        err = [r for r in records if r["event"] == "state" and r["state"] == "error"][-1]
        assert "sound device" in err["reason"] or "no input" in err["reason"] or "no output" in err["reason"]
        time.sleep(1.5)  # a few attempts while nothing is there
        assert svc.audio.state in ("unavailable", "opening")
        jd.start_server()
        user = jd.User()
        t0 = time.monotonic()
        assert jd.wait_for(lambda: svc.session.conversation.state.value == "listening", 20), records[-5:]
        recovered_s = time.monotonic() - t0
        assert any(r["event"] == "recovered" for r in records)
        assert _history(svc) == history  # the conversation survived
        assert _turn(user, records, question_audio)
        assert _history(svc)[:2] == history and len(_history(svc)) == 4
        print(f"measured here: recovered {recovered_s:.2f} s after the server returned")
    finally:
        svc.stop()
        user.close()
        if not jd.server_up():
            jd.start_server()


def _fade_heard(user, pb, seconds=0.6):
    """Pause the playing constant-level reply and count the samples the ear hears part-faded (between 1 %
    and 99 % of the level): the fade out's length at the device, samples at 16 kHz."""
    mark = len(user.heard())
    pb.pause()
    time.sleep(seconds)
    after = np.abs(user.heard()[mark:])
    return int(np.count_nonzero((after > 0.01 * 0.3) & (after < 0.99 * 0.3))), after


@needs_jack
def test_a_reload_of_fade_ms_reaches_the_audio_worker(hearing_parts, tmp_path, user):
    """``interruption.fade_ms`` reloaded while the service runs on real streams: the next pause fades over
    the new time at the device. (Before the audio port, the reload set only the playback buffer's own
    fade, which a device does not use, and the worker kept the 8 ms it started with.)"""
    import yaml

    svc, records = _service(hearing_parts, tmp_path)
    svc.start()
    pb = svc.session.playback
    try:
        assert jd.wait_for(lambda: svc.session.conversation.state.value == "listening", 20), records[-5:]
        pb.begin_reply(10_000)  # a reply of the buffer's own, not the conversation's: a constant level
        pb.enqueue(10_000, np.full(20 * 48000, 0.3, np.float32), "a long constant tone")
        assert jd.wait_for(lambda: np.count_nonzero(user.heard()) > 8000, 15)
        before, _ = _fade_heard(user, pb)
        pb.resume()
        time.sleep(0.5)
        data = svc.cfg.model_dump(mode="json")
        data["interruption"]["fade_ms"] = 40.0
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(data))
        assert svc.reload(path), svc.reloads
        assert svc.reloads[-1]["changed"] == ["interruption"]
        after, heard = _fade_heard(user, pb)
        pb.flush()
    finally:
        svc.stop()
    print(f"measured here: fade out heard {before} samples at 8 ms, {after} after a reload to 40 ms (16 kHz)")
    assert 100 <= before <= 135  # 8 ms = 128 samples at the device's 16 kHz
    assert 600 <= after <= 650, after  # 40 ms = 640 samples
    assert np.all(heard[-1600:] == 0)  # and the pause held


@needs_jack
def test_an_idle_device_asks_for_nothing_and_a_queued_reply_wakes_it(user):
    """After 0.2 s of digital silence the audio worker stops asking for output (it plays silence itself);
    a reply queued later wakes it (``Playback.enqueue`` -> ``WAKE``) and plays whole, nothing counted late.
    ``play()`` (no playback buffer, so no wake) keeps asking: 0.4 s of leading silence still plays its tone."""
    from appliance.audio.device import play
    from appliance.playback import Playback

    dev = DeviceAudio(None, "user", 10, 16000, fade_ms=8.0)
    pb = Playback(16000, port=dev)
    asked = []
    dev.start(lambda n: (asked.append(time.monotonic()), pb.take(n))[1], lambda m, f: None, pb.port_silent)
    tone = _sine(1.0, 440.0, 0.3)
    try:
        assert dev.wait_open(15)
        time.sleep(0.6)
        n_idle, late0 = len(asked), dev.xruns["late"]
        time.sleep(0.5)
        assert len(asked) == n_idle, "the idle worker still asked for output"
        pb.begin_reply(1)
        t0 = time.monotonic()
        pb.enqueue(1, tone, "a reply")
        assert jd.wait_for(lambda: pb.pending_samples == 0, 5)
        first = [t for t in asked if t >= t0][0] - t0
        print(f"the reply's first samples asked for {1000 * first:.1f} ms after queueing")
        assert first < 0.05  # within a block or two (10 ms blocks), a loaded machine's scheduling aside
        assert jd.wait_for(lambda: np.count_nonzero(np.abs(user.heard()) > 0.01) > 0.9 * 16000 * 0.63, 5)
        time.sleep(0.3)
        late = dev.xruns["late"] - late0
        print("late before the reply", late0, "after", late)
    finally:
        dev.stop()
    assert late == 0, late
    heard = user.heard()
    loud = np.flatnonzero(np.abs(heard) > 0.01)
    assert abs(dbfs(heard[loud[0]:loud[-1] + 1]) - dbfs(tone)) < 1.0  # the whole tone, unbroken
    assert loud[-1] - loud[0] > 0.98 * len(tone)

    before = len(user.heard())
    play(np.concatenate([np.zeros(6400, np.float32), tone]), 16000, "user", timeout=10)
    heard = user.heard()[before:]
    assert np.count_nonzero(np.abs(heard) > 0.01) > 0.5 * len(tone)
