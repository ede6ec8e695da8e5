"""Reload on real PortAudio streams: ``appliance run``'s :class:`~appliance.service.Service` on the JACK dummy
server (tests/jack_dummy.py: the client ``user`` is the sound device), its config file rewritten and reloaded
(``Service.reload``, what SIGHUP runs) key by key, and each new value shown at work in the running service:
in the live echo path, in what the VAD reports, in what the user hears.

Real parts: the tiny Gemma 4 fixture (it hears; its words are nonsense), Piper's bundled voice, Silero VAD,
the Speex/WebRTC cancellers, PortAudio in the audio worker. Mocked: the sound card (JACK's dummy driver).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import yaml

import jack_dummy as jd
from conftest import tiny_gemma4_config
from appliance.audio.files import MODEL_RATE

FIX = Path(__file__).parent / "fixtures" / "tiny_gemma4"
needs_jack = pytest.mark.skipif(jd.why_skip() is not None, reason=str(jd.why_skip()))


@pytest.fixture(scope="module")
def hearing_parts():
    from appliance.pipeline import Parts

    return Parts.load(tiny_gemma4_config())


@pytest.fixture
def user():
    u = jd.User()
    yield u
    u.close()


@pytest.fixture
def service(tmp_path, hearing_parts, user):
    """A started service on the ``user`` device, its config in a file; yields (service, records, write)
    where ``write(**sections)`` rewrites the file with those sections changed and reloads it."""
    from appliance.config import load
    from appliance.service import Service

    data = {
        "model": {"gguf": str(FIX / "tiny-gemma4.gguf"), "mmproj": str(FIX / "tiny-gemma4-mmproj.gguf"),
                  "n_ctx": 1024, "n_threads": 2, "max_reply_tokens": 12, "history_budget_tokens": 700},
        "audio": {"input": "user", "output": "user", "retry_max_s": 1.0},
        "gpio": {"enabled": False},
        "echo": {"enabled": True, "backend": "speex", "onset_gate_db": -20.0},
        "interruption": {"classifier": "duration"},
        "storage": {"state_dir": str(tmp_path / "state")},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    hearing_parts.engine.forget()
    records: list[dict] = []
    svc = Service(load(path), hearing_parts, timeline=records.append)

    def write(**sections):
        for key, value in sections.items():
            data[key] = {**data.get(key, {}), **value}
        path.write_text(yaml.safe_dump(data))
        assert svc.reload(path) is True, svc.reloads[-1]
        return svc.reloads[-1]["changed"]

    svc.start()
    try:
        assert jd.wait_for(lambda: svc.session.conversation.state.value == "listening", 30), records[-5:]
        yield svc, records, write
    finally:
        svc.stop()


def _in_the_live_path(listener, previous=None, timeout=10.0):
    """The listener's canceller once it is not ``previous`` and has processed 20 more frames from the device."""
    assert jd.wait_for(lambda: listener.echo is not previous and listener.echo is not None, timeout)
    echo = listener.echo
    n0 = echo.frames
    assert jd.wait_for(lambda: echo.frames >= n0 + 20, timeout), "the canceller gets no audio from the device"
    return echo


def _turn(user, records, audio, timeout=90.0) -> tuple[int, int]:
    """The user says ``audio``; wait for the reply's end. Returns the ear's (start, end) sample of the turn."""
    n0 = sum(1 for r in records if r["event"] == "turn_end")
    start = len(user.heard())
    user.say(audio)
    assert jd.wait_for(lambda: sum(1 for r in records if r["event"] == "turn_end") > n0, timeout, 0.05), \
        [r["event"] for r in records[-20:]]
    time.sleep(0.3)  # the device's ring and JACK's buffer
    return start, len(user.heard())


def _reply_peak_dbfs(user, span, question_len) -> float:
    heard = user.heard()[span[0] + question_len:span[1]]
    peak = float(np.max(np.abs(heard))) if len(heard) else 0.0
    return 20 * np.log10(max(peak, 1e-9))


@needs_jack
def test_each_reloaded_key_reaches_the_running_service(service, user, question_audio):
    svc, records, write = service
    listener, segmenter = svc.session.listener, svc.session.segmenter

    # echo.onset_gate_db: the service's first canceller honours it (the old assembly built its own at -10 dB)
    first = _in_the_live_path(listener)
    assert first.backend == "speex" and first.gate_db == -20.0
    assert segmenter.onset_gate == first.near_end_present
    assert write(echo={"onset_gate_db": -15.0}) == ["echo"]
    second = _in_the_live_path(listener, first)
    assert second.gate_db == -15.0 and segmenter.onset_gate == second.near_end_present

    # echo.backend
    assert write(echo={"backend": "webrtc"}) == ["echo"]
    third = _in_the_live_path(listener, second)
    assert third.backend == "webrtc"

    # vad.threshold: applied on the listener's thread, then every onset the VAD reports clears it
    span = _turn(user, records, question_audio)
    loud = _reply_peak_dbfs(user, span, len(question_audio))
    assert write(vad={"threshold": 0.9}) == ["vad"]
    assert jd.wait_for(lambda: segmenter.threshold == 0.9, 5)
    n_onsets = sum(1 for r in records if r["event"] == "vad_onset")

    # voice: the next reply is spoken by the new voice (a quarter of the volume: 12 dB down at the ear)
    assert write(voice={"volume": 0.25}) == ["voice"]
    span = _turn(user, records, question_audio)
    onsets = [r for r in records if r["event"] == "vad_onset"][n_onsets:]
    assert onsets and all(r["prob"] >= 0.9 for r in onsets), onsets
    quiet = _reply_peak_dbfs(user, span, len(question_audio))
    print(f"measured here: reply peak {loud:.1f} dBFS at volume 1.0, {quiet:.1f} dBFS at 0.25")
    assert loud > -40.0, "the first reply was not heard"
    assert 8.0 <= loud - quiet <= 16.0  # 20 log10(4) = 12 dB


@needs_jack
def test_a_reloaded_fade_reaches_the_sound_device(service, user):
    """After ``interruption.fade_ms: 50`` (its maximum), a pause fades out over ~50 ms at the user's ear, not 8."""
    svc, records, write = service
    assert write(interruption={"fade_ms": 50.0}) == ["interruption"]
    pb = svc.session.playback
    tone = (0.3 * np.sin(2 * np.pi * 440.0 * np.arange(3 * 48000) / 48000)).astype(np.float32)
    pb.begin_reply(999)  # not the conversation's reply: it only plays
    pb.enqueue(999, tone, "a tone")
    assert jd.wait_for(lambda: np.count_nonzero(user.heard()) > 8000, 15)
    pb.pause()
    time.sleep(0.8)
    heard = user.heard()
    # The fade: from the last block at full level to the first 50 ms of silence.
    env = np.abs(heard)
    silent = np.convolve(env > 0, np.ones(800), mode="valid") == 0
    loud = np.flatnonzero(env > 0.25)
    assert silent.any() and len(loud)
    end = int(np.flatnonzero(silent & (np.arange(len(silent)) > loud[len(loud) // 2]))[0])
    fade = end - int(loud[loud < end][-1])
    print(f"measured here: fade {fade / MODEL_RATE * 1000:.0f} ms at the ear")
    assert fade >= 0.035 * MODEL_RATE  # at least 35 ms of the 50 (the old 8 ms fade: under 10)


@needs_jack
def test_a_reloaded_audio_section_reopens_the_sound_device(service):
    """``audio.output_block_ms`` 10 → 20 and ``retry_max_s`` 1 → 2: the session hands the section to the port
    (``configure(audio=...)``), which reopens its worker with 20 ms blocks and backs off up to 2 s; the
    reopened device's ``open`` gives the listener a new, cold canceller and the conversation ``recovered``."""
    svc, records, write = service
    port = svc.session.port
    assert port.opened == 1 and port.info.out_block == port.info.out_rate * 10 // 1000
    echo = svc.session.listener.echo
    assert write(audio={"output_block_ms": 20, "retry_max_s": 2.0}) == ["audio"]
    assert jd.wait_for(lambda: port.opened == 2 and port.state == "open", 20), (port.state, port.last_error)
    assert port.info.out_block == port.info.out_rate * 20 // 1000 and port.backoff[1] == 2.0
    _in_the_live_path(svc.session.listener, previous=echo)
    assert jd.wait_for(lambda: any(r["event"] == "recovered" for r in records), 10)
    assert svc.session.conversation.state.value == "listening"
