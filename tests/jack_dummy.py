"""The JACK dummy server and a JACK client that plays the user, for the tests on real PortAudio streams.

The server is ``jackd --no-realtime -d dummy -r 16000 -p 512`` (started by ``.ci/run`` through
``.ci/jackd-dummy``): no sound card, correctly paced callbacks. PortAudio shows each JACK client as a
device, so the client named ``user`` below is a sound device the appliance selects by name
(``audio.input: user``, ``audio.output: user``): its ``mouth`` port is the appliance's microphone and its
``ear`` port records what the appliance plays. The client uses the ``JACK-Client`` package, never
sounddevice, so the test process holds no PortAudio stream that a stopped server could wedge.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "jackd-dummy"
PIDFILE = Path(os.environ.get("APPLIANCE_JACKD_PIDFILE", "/tmp/appliance-jackd-dummy.pid"))
RATE = 16000
os.environ.setdefault("JACK_NO_START_SERVER", "1")  # a client must never start a server by itself


def server_up() -> bool:
    if not shutil.which("jack_lsp"):
        return False
    try:
        return subprocess.run(["jack_lsp"], capture_output=True, timeout=5).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def why_skip_own_server() -> Optional[str]:
    """None when a test can start a JACK server of its own (jackd and JACK-Client usable), else why not."""
    if not shutil.which("jackd"):
        return "jackd is not installed (apt-get install jackd2; .ci/run does)"
    try:
        import jack  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"the JACK-Client package is not usable ({exc}); pip install JACK-Client"
    return None


def why_skip() -> Optional[str]:
    """None when the device tests can run on the shared server, else the reason they are skipped."""
    why = why_skip_own_server()
    if why is None and not server_up():
        return "no JACK server is running: start one with `.ci/jackd-dummy start` (.ci/run does)"
    return why


def managed() -> bool:
    """True when the running server was started by .ci/jackd-dummy (so a test may stop and restart it)."""
    return PIDFILE.is_file()


def stop_server() -> None:
    subprocess.run([str(SCRIPT), "stop"], check=True, capture_output=True, timeout=30)


def start_server() -> None:
    subprocess.run([str(SCRIPT), "start"], check=True, capture_output=True, timeout=30)


class User:
    """A JACK client named ``user``: says audio into the appliance's microphone, records what it plays.

    :meth:`say` queues float32 mono audio at 16 kHz; :attr:`heard` is everything the ``ear`` port received.
    """

    def __init__(self, name: str = "user"):
        import jack

        self.client = jack.Client(name, no_start_server=True)
        self.mouth = self.client.outports.register("mouth")
        self.ear = self.client.inports.register("ear")
        self._lock = threading.Lock()
        self._say: list[tuple[np.ndarray, bool]] = []
        self._heard: list[np.ndarray] = []
        self.frames = 0
        self.callbacks = 0
        self.said_at: list[int] = []  # frame at which each say() started playing
        self.down = threading.Event()
        self.client.set_process_callback(self._process)
        self.client.set_shutdown_callback(lambda status, reason: self.down.set())
        self.client.activate()

    def _process(self, frames: int) -> None:
        out = self.mouth.get_array()
        out[:] = 0.0
        with self._lock:
            self._heard.append(self.ear.get_array().copy())
            pos = 0
            while pos < frames and self._say:
                seg, started = self._say[0]
                if not started:
                    self.said_at.append(self.frames + pos)
                take = min(frames - pos, len(seg))
                out[pos:pos + take] = seg[:take]
                if take < len(seg):
                    self._say[0] = (seg[take:], True)
                else:
                    self._say.pop(0)
                pos += take
            self.frames += frames
            self.callbacks += 1

    def say(self, audio: np.ndarray) -> None:
        with self._lock:
            self._say.append((np.asarray(audio, dtype=np.float32), False))

    @property
    def saying(self) -> bool:
        with self._lock:
            return bool(self._say)

    def heard(self) -> np.ndarray:
        with self._lock:
            return np.concatenate(self._heard) if self._heard else np.zeros(0, dtype=np.float32)

    def close(self) -> None:
        try:
            self.client.deactivate()
        except Exception:
            pass
        try:
            self.client.close()
        except Exception:
            pass


def wait_for(pred, timeout: float, step: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())
