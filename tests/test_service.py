"""``appliance run`` as systemd runs it: sd_notify (READY/WATCHDOG/STATUS over a real $NOTIFY_SOCKET),
SIGHUP reloads, no sound device at boot, and the mute switch persisted across restarts.

Real parts: the tiny Gemma 4 fixture (it hears), Piper, Silero, PortAudio in the audio worker. Nothing is
mocked; there is simply no sound device matching the config, which is the case under test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "tiny_gemma4"


def _config(tmp_path: Path, **audio) -> Path:
    cfg = {
        "model": {"gguf": str(FIX / "tiny-gemma4.gguf"), "mmproj": str(FIX / "tiny-gemma4-mmproj.gguf"),
                  "n_ctx": 1024, "n_threads": 2, "max_reply_tokens": 8, "history_budget_tokens": 700},
        "audio": {"input": "ReSpeaker", "output": "ReSpeaker", "retry_max_s": 1.0, **audio},
        "gpio": {"enabled": False},
        "echo": {"enabled": False},
        "storage": {"state_dir": str(tmp_path / "state")},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _recv_until(sock, pred, timeout):
    got = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        sock.settimeout(max(0.05, end - time.monotonic()))
        try:
            got.append(sock.recv(4096).decode())
        except socket.timeout:
            break
        if pred(got):
            break
    return got


def _start_service(tmp_path: Path, cfg_path: Path):
    """``appliance run`` as systemd starts it: a real $NOTIFY_SOCKET, a 1 s watchdog, stderr to a file."""
    notify = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    env = dict(os.environ, NOTIFY_SOCKET=str(notify), WATCHDOG_USEC="1000000", PYTHONUNBUFFERED="1")
    env.pop("WATCHDOG_PID", None)
    err = open(tmp_path / "stderr.txt", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "run", "--config", str(cfg_path)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    return proc, sock


def test_run_without_sound_device_notifies_retries_and_reloads(tmp_path):
    cfg_path = _config(tmp_path)
    proc, sock = _start_service(tmp_path, cfg_path)
    try:
        msgs = _recv_until(sock, lambda g: sum("WATCHDOG=1" in m for m in g) >= 3, 90)
        joined = "\n".join(msgs)
        assert "READY=1" in joined, joined
        assert joined.count("WATCHDOG=1") >= 3  # pinged at half of WATCHDOG_USEC while the threads live
        # both missing, both named at once (it named only the output; fresh user, session 11)
        assert "STATUS=error: no input sound device matches audio.input: 'ReSpeaker' (found:" in joined, joined
        assert "; and no output sound device matches audio.output: 'ReSpeaker' (found:" in joined, joined
        time.sleep(2.5)  # several more attempts
        assert proc.poll() is None, "the service must keep retrying, not exit"
        log = (tmp_path / "stderr.txt").read_text()
        assert log.count("sound device matches audio.output: 'ReSpeaker' (found:") == 1, log  # said once

        # An invalid config is rejected whole, in one line, and the service keeps running.
        good = cfg_path.read_text()
        cfg_path.write_text(good.replace("threshold", "x") + "vad:\n  threshold: 7\n")
        proc.send_signal(signal.SIGHUP)
        _recv_until(sock, lambda g: any("READY=1" in m for m in g), 10)
        time.sleep(0.3)
        log = (tmp_path / "stderr.txt").read_text()
        rejected = [l for l in log.splitlines() if "config reload rejected" in l]
        assert len(rejected) == 1 and "vad.threshold" in rejected[0], log
        # A file built to take the parser down (deep nesting: RecursionError; an alias bomb: gigabytes) is
        # rejected the same way, the service stays up, and STATUS= says why.
        hostile = {"nested deeper than 32": "model: " + "[" * 5000 + "]" * 5000 + "\n",
                   "anchors and aliases": "\n".join(
                       ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'] +
                       [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]) + "\n"}
        for n, (why, text) in enumerate(hostile.items(), 2):
            cfg_path.write_text(text)
            proc.send_signal(signal.SIGHUP)
            msgs = _recv_until(sock, lambda g: any("config reload rejected" in m and why in m for m in g), 10)
            assert any("STATUS=" in m and "config reload rejected" in m and why in m for m in msgs), "\n".join(msgs)
            time.sleep(0.3)
            log = (tmp_path / "stderr.txt").read_text()
            rejected = [l for l in log.splitlines() if "config reload rejected" in l]
            assert len(rejected) == n and why in rejected[-1] and len(rejected[-1]) < 1000, log
            assert "Traceback" not in log, log
            assert proc.poll() is None, "the service must keep running on its previous config"
        # A valid one is applied.
        cfg_path.write_text(good + "vad:\n  threshold: 0.6\n")
        proc.send_signal(signal.SIGHUP)
        _recv_until(sock, lambda g: any("READY=1" in m for m in g), 10)
        time.sleep(0.3)
        log = (tmp_path / "stderr.txt").read_text()
        assert "config reloaded" in log and "changed: vad" in log, log
        assert proc.poll() is None
        msgs = _recv_until(sock, lambda g: any("STATUS=" in m for m in g), 3)
        status = [m for m in msgs if "STATUS=" in m]
        assert status and "config reload rejected" not in status[-1], msgs  # a good reload clears the status
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = None
        sock.close()
    assert rc == 0


def test_mute_survives_a_restart(tmp_path, fresh_parts, embedded_cfg):
    from appliance.service import Service

    cfg = embedded_cfg.model_copy(deep=True)
    cfg.audio.input = cfg.audio.output = "no-such-card"
    cfg.storage.state_dir = str(tmp_path)

    def wait(svc, state, timeout=10):
        end = time.monotonic() + timeout
        while time.monotonic() < end and svc.session.conversation.state.value != state:
            time.sleep(0.02)
        return svc.session.conversation.state.value

    svc = Service(cfg, fresh_parts)
    svc.start()
    try:
        svc.session.conversation.post("ready")
        assert wait(svc, "listening") == "listening"
        svc.session.conversation.post("mute", muted=True)
        assert wait(svc, "muted") == "muted"
        time.sleep(0.1)
        assert (tmp_path / "muted").read_text().strip() == "1"
    finally:
        svc.stop()
    svc = Service(cfg, fresh_parts)
    assert svc.session.conversation.muted  # before any audio could flow (the listener reads it per block)
    svc.start()
    try:
        svc.session.conversation.post("ready")
        assert wait(svc, "muted") == "muted"
        svc.session.conversation.post("error", reason="device gone")
        assert wait(svc, "error") == "error"
        svc.session.conversation.post("recovered")
        assert wait(svc, "muted") == "muted"  # a recovered device does not unmute
        svc.session.conversation.post("mute")
        assert wait(svc, "listening") == "listening"
        time.sleep(0.1)
        assert (tmp_path / "muted").read_text().strip() == "0"
    finally:
        svc.stop()


def test_notify_never_blocks_on_a_manager_that_does_not_read(tmp_path):
    """A manager that stops reading fills its socket's queue (Linux: 10 datagrams); the service's sends
    must not block then, or its main loop stalls and SIGTERM is never acted on (CI saw `appliance run`
    hang on exit this way). Dropped ones are counted, and a dropped status is sent again."""
    import threading

    from appliance.service import Notifier

    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    n = Notifier(str(path))
    done = threading.Event()

    def flood():
        for _ in range(100):
            n.notify("WATCHDOG=1")
        n.status("listening")
        done.set()

    threading.Thread(target=flood, daemon=True).start()
    assert done.wait(10), "Notifier.notify blocked on a full queue"
    got = _recv_until(sock, lambda g: False, 0.3)
    assert 1 <= len(got) < 100 and n.dropped == 101 - len(got), (len(got), n.dropped)
    assert all(m == "WATCHDOG=1" for m in got)  # the status was dropped with the queue full...
    n.status("listening")  # ... so the next call sends it, now that there is room
    assert _recv_until(sock, lambda g: True, 2) == ["STATUS=listening"]
    sock.close()


def test_run_without_model_waits_in_a_no_model_state_and_loads_when_it_arrives(tmp_path):
    """An image built with --no-models: the service stays up (READY=1, a "no model" status, watchdog
    pings, one journal line with the fix) instead of exiting, and loads the model once it is copied in."""
    models = tmp_path / "models"
    models.mkdir()
    cfg_path = _config(tmp_path)
    text = cfg_path.read_text().replace(str(FIX), str(models))
    cfg_path.write_text(text)
    proc, sock = _start_service(tmp_path, cfg_path)
    try:
        msgs = _recv_until(sock, lambda g: sum("WATCHDOG=1" in m for m in g) >= 2, 60)
        joined = "\n".join(msgs)
        assert "READY=1" in joined and "STATUS=no model: " in joined, joined
        assert "tiny-gemma4.gguf: model file not found" in joined, joined
        assert proc.poll() is None, "with no model the service must wait, not exit"
        log = (tmp_path / "stderr.txt").read_text()
        assert log.count("no model:") == 1, log

        # The model files arrive (e.g. copied over SSH): it loads them by itself.
        for name in ("tiny-gemma4.gguf", "tiny-gemma4-mmproj.gguf"):
            (models / name).write_bytes((FIX / name).read_bytes())
        msgs = _recv_until(sock, lambda g: any("STATUS=error: no input sound device" in m for m in g), 60)
        joined = "\n".join(msgs)
        assert "STATUS=loading tiny-gemma4.gguf" in joined, joined
        assert "STATUS=error: no input sound device" in joined and "no output sound device" in joined, joined  # now past the model, on to the devices
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        sock.close()


def test_reload_applies_vad_threshold_and_voice_without_losing_the_conversation(tmp_path):
    """SIGHUP's work, in process: a good file changes the VAD threshold and the Piper voice, the history
    stays; a bad file changes nothing. (The sound devices are not started: reload does not need them.)"""
    import shutil

    from appliance.config import load
    from appliance.pipeline import Parts
    from appliance.service import Service
    from appliance.speech import bundled_voice_path

    cfg_path = _config(tmp_path)
    cfg = load(cfg_path)
    parts = Parts.load(cfg)
    svc = Service(cfg, parts)
    try:
        engine = svc.session.engine_worker.engine
        import numpy as np
        speech = np.sin(np.arange(16000) / 16000 * 2 * np.pi * 220).astype(np.float32) * 0.1
        text = "".join(engine.start_turn(speech))
        engine.commit_spoken(text, complete=True)
        history = [(m.role, m.text) for m in engine.history]
        assert len(history) == 2

        voice = tmp_path / "voice" / "en_US-other-medium.onnx"
        voice.parent.mkdir()
        src = bundled_voice_path()
        shutil.copy(src, voice)
        shutil.copy(str(src) + ".json", str(voice) + ".json")
        data = yaml.safe_load(cfg_path.read_text())
        data["vad"] = {"threshold": 0.7}
        data["voice"] = {"model": str(voice), "length_scale": 1.2}
        data["interruption"] = {"classifier": "duration", "interjection_silence_ms": 300, "backchannel_max_ms": 900}
        cfg_path.write_text(yaml.safe_dump(data))
        assert svc.reload(cfg_path) is True
        assert svc.session.segmenter.threshold == 0.7
        assert svc.session.tts_worker.tts.model_path == voice
        assert svc.session.segmenter.interjection_silence_ms == 300
        taker = svc.session.conversation.turn_taker
        assert taker.classifier is None and taker.backchannel_max_ms == 900.0
        assert svc.reloads[-1]["changed"] == ["vad", "interruption", "voice"]
        assert [(m.role, m.text) for m in svc.session.engine_worker.engine.history] == history

        data["vad"] = {"threshold": "high"}
        cfg_path.write_text(yaml.safe_dump(data))
        assert svc.reload(cfg_path) is False
        assert "vad.threshold" in svc.reloads[-1]["reason"]
        assert svc.session.segmenter.threshold == 0.7  # the running config stays, whole
        assert svc.session.tts_worker.tts.model_path == voice
        cfg_path.write_text("vad: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n")
        assert svc.reload(cfg_path) is False
        assert "nested deeper than 32" in svc.reload_problem and svc.session.segmenter.threshold == 0.7
    finally:
        svc.session.stop()


def test_the_service_builds_its_canceller_from_the_config_and_a_new_echo_path_starts_it_cold(tmp_path):
    """The service's canceller comes from ``echo.from_config`` like replay's and the benchmark's (it used to
    build its own, without ``onset_gate_db``, with the webrtc backend as its default). A reload that
    changes ``echo`` and a reopened sound device each give the listener a new, cold canceller, bound to the
    VAD's onset gate. In process; the sound devices are not started."""
    from appliance.config import load
    from appliance.pipeline import Parts
    from appliance.service import Service

    cfg_path = _config(tmp_path)
    data = yaml.safe_load(cfg_path.read_text())
    data["echo"] = {"enabled": True, "backend": "speex", "onset_gate_db": -20.0}
    cfg_path.write_text(yaml.safe_dump(data))
    cfg = load(cfg_path)
    svc = Service(cfg, Parts.load(cfg))
    listener = svc.session.listener

    def settled(old):
        deadline = time.monotonic() + 5
        while listener.echo is old and time.monotonic() < deadline:
            time.sleep(0.01)
        return listener.echo

    try:
        first = listener.echo
        assert first.backend == "speex" and first.gate_db == -20.0 and not first.warm
        assert svc.session.segmenter.onset_gate == first.near_end_present
        data["echo"]["onset_gate_db"] = -15.0
        cfg_path.write_text(yaml.safe_dump(data))
        assert svc.reload(cfg_path) is True and "echo" in svc.reloads[-1]["changed"]
        second = settled(first)
        assert second is not first and second.gate_db == -15.0 and not second.warm
        assert svc.session.segmenter.onset_gate == second.near_end_present
        svc.session.on_port("open", {"output": "card"})  # the first open: ready, same canceller
        assert listener.echo is second
        svc.session.on_port("open", {"output": "card"})  # reopened after a loss: a new echo path
        third = settled(second)
        assert third is not second and third.gate_db == -15.0 and third.frames == 0
    finally:
        svc.session.stop()
