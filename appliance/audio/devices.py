"""Real sound devices through sounddevice (PortAudio) callbacks.

The input callback copies the block and returns; the output callback pulls one block from the playback
buffer (silence when empty). Devices are chosen by a substring of their name, never by index.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

from ..config import Config
from ..errors import UserError
from .files import MODEL_RATE, resample

log = logging.getLogger(__name__)


def _sd():
    try:
        import sounddevice as sd
    except OSError as exc:  # PortAudio library missing
        raise UserError(f"PortAudio is not installed ({exc}); run `apt-get install libportaudio2`") from None
    return sd


def find_device(name: str, kind: str) -> Optional[int]:
    """Index of the first device whose name contains ``name`` (case-insensitive) and that has ``kind``
    ("input" or "output") channels; ``"default"`` is PortAudio's default device.

    :raises UserError: nothing matches; the message lists the candidates.
    """
    sd = _sd()
    devices = sd.query_devices()
    key = "max_input_channels" if kind == "input" else "max_output_channels"
    candidates = [(i, d["name"]) for i, d in enumerate(devices) if d[key] > 0]
    if name == "default":
        idx = sd.default.device[0 if kind == "input" else 1]
        if idx is not None and idx >= 0:
            return int(idx)
        if candidates:
            return candidates[0][0]
    else:
        for i, dev_name in candidates:
            if name.lower() in dev_name.lower():
                return i
    found = ", ".join(f"'{n}'" for _, n in candidates) or "none"
    raise UserError(f"no {kind} sound device matches audio.{kind}: '{name}' (found: {found}); "
                    f"set audio.{kind} in config.yaml to part of one of these names")


def describe_devices(cfg: Optional[Config] = None) -> str:
    sd = _sd()
    chosen = {}
    if cfg is not None:
        for kind in ("input", "output"):
            try:
                chosen[kind] = find_device(getattr(cfg.audio, kind), kind)
            except UserError:
                chosen[kind] = None
    lines = []
    for i, d in enumerate(sd.query_devices()):
        marks = [k for k, v in chosen.items() if v == i]
        lines.append(f"{i:3d} {d['name']!s:40} in={d['max_input_channels']} out={d['max_output_channels']} "
                     f"default_rate={int(d['default_samplerate'])}" + (f"  <- {', '.join(marks)}" if marks else ""))
    return "\n".join(lines) if lines else "no sound devices found"


def play(audio: np.ndarray, rate: int, output: str = "default") -> None:
    """Play float32 mono audio on the named output device and wait until it has been played."""
    sd = _sd()
    dev = find_device(output, "output")
    dev_rate = int(sd.query_devices(dev)["default_samplerate"])
    sd.play(resample(audio, rate, dev_rate), dev_rate, device=dev, blocking=True)


def run_service(cfg: Config, config_path: Optional[str] = None) -> int:
    """The appliance on real devices, until SIGINT/SIGTERM."""
    from ..engine import text_only_refusal
    from ..pipeline import Parts, Session, Timeline

    if not cfg.model.mmproj:
        raise text_only_refusal(Path(cfg.model.gguf))
    sd = _sd()
    in_dev = find_device(cfg.audio.input, "input")
    out_dev = find_device(cfg.audio.output, "output")
    out_rate = int(sd.query_devices(out_dev)["default_samplerate"])
    in_rate = int(sd.query_devices(in_dev)["default_samplerate"])
    parts = Parts.load(cfg)
    if not parts.engine.hears_audio:
        raise text_only_refusal(Path(cfg.model.gguf))
    session = Session(cfg, parts, out_rate=out_rate)
    session.conversation.subscribe(Timeline(echo=lambda line: print(line, flush=True)))
    out_block = max(16, int(out_rate * cfg.audio.output_block_ms / 1000))
    far_q: "queue.SimpleQueue[np.ndarray]" = queue.SimpleQueue()
    raw_q: "queue.SimpleQueue[np.ndarray]" = queue.SimpleQueue()

    def on_output(outdata, frames, time_info, status):
        block = session.playback.read(frames)
        outdata[:, 0] = block
        far_q.put(block)

    def on_input(indata, frames, time_info, status):
        raw_q.put(indata[:, 0].copy())

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())

    def pump() -> None:
        # Resample to 16 kHz and pair with the far end; runs off the audio threads.
        while not stop.is_set():
            try:
                mic = raw_q.get(timeout=0.2)
            except queue.Empty:
                continue
            far = []
            while True:
                try:
                    far.append(far_q.get_nowait())
                except queue.Empty:
                    break
            mic16 = resample(mic, in_rate, MODEL_RATE)
            far16 = resample(np.concatenate(far), out_rate, MODEL_RATE) if far else None
            session.listener.capture(mic16, far16)

    with sd.OutputStream(device=out_dev, samplerate=out_rate, channels=1, dtype="float32",
                         blocksize=out_block, callback=on_output), \
            sd.InputStream(device=in_dev, samplerate=in_rate, channels=1, dtype="float32",
                           blocksize=int(in_rate * 0.02), callback=on_input):
        threading.Thread(target=pump, name="pump", daemon=True).start()
        session.start()
        try:
            while not stop.is_set():
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        finally:
            stop.set()
            session.stop()
    return 0
