"""Real sound devices through sounddevice (PortAudio), in a worker process the service can replace.

Why a worker process: a sound card that disappears (a USB speakerphone unplugged, the sound server
stopped) can leave PortAudio unable to stop, close or terminate its streams: with the JACK host API of
PortAudio 19.6 (Debian 12's ``libportaudio2``), ``Pa_AbortStream``, ``Pa_CloseStream`` and ``Pa_Terminate``
all block once the server is gone (checked here: ``abort()`` had not returned after 25 s). PortAudio only
re-enumerates devices at ``Pa_Initialize``, so a device that comes back cannot be opened again in the same
process either. The streams therefore live in a small child process (``python -m appliance.audio.devices
--worker``); when the device goes away the service kills that child and starts a new one, with back-off,
and the conversation, the models and the KV cache in the service process never notice more than an
``error`` state.

Data path (one ``AF_UNIX``/``SOCK_SEQPACKET`` socket pair, one message per block):

- input callback (worker): copy the block, send it (non-blocking; a full socket drops the block and counts
  it); service side: mix to mono, resample to 16 kHz with a streaming soxr resampler, hand it with the
  far end (what was handed to the output since the previous block, at 16 kHz) to ``capture``.
- output callback (worker): take ``frames`` samples from a small ring of samples the service has already
  sent (silence, counted as ``late``, if the ring ran dry), then ask for as many samples as keep the ring
  at its target (``ring`` = 2 blocks to start; it grows by one block after a late block, up to 8). The
  service answers with ``read_output(n)`` (the playback buffer, resampled from its rate to the device's
  with a streaming soxr resampler when they differ). :attr:`DeviceAudio.output_latency_ms` reports the
  ring plus the device's own latency.
- pause, resume, flush (service → worker, ``P``/``U``/``F``, sent by the playback buffer): the worker fades
  out over ``fade_ms`` of what its ring holds and keeps the rest, so a barge-in is not delayed by the
  ring; a resume fades back in from there (no sample dropped or repeated); a flush also drops the ring.
  The worker says ``S`` when its fade reached silence. Measured here on the JACK dummy server: the ring
  held 672 samples (42 ms at 16 kHz) at a pause, which used to play before the fade.

Devices are chosen by a case-insensitive substring of their name (``audio.input``/``audio.output`` in
config.yaml; ``default`` is PortAudio's default device), never by an index that changes between boots.
Each stream opens at a rate the device accepts (``check_input_settings``/``check_output_settings``),
preferring 16 kHz for the microphone (no resampling before the VAD) and the device's default rate for
the speaker.

Xruns: the callbacks' ``status`` flags (input overflow/underflow, output underflow/overflow) are counted,
as are late output blocks and input blocks dropped on a full socket; see :attr:`DeviceAudio.xruns`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from ..errors import UserError
from .files import MODEL_RATE

log = logging.getLogger(__name__)

# PortAudio callback flags (portaudio.h: paInputUnderflow .. paOutputOverflow).
PA_INPUT_UNDERFLOW, PA_INPUT_OVERFLOW, PA_OUTPUT_UNDERFLOW, PA_OUTPUT_OVERFLOW = 0x1, 0x2, 0x4, 0x8
LATE = 0x100  # our own flag: the output ring ran dry (the service did not send samples in time)
XRUN_KEYS = ("input_overflow", "input_underflow", "output_underflow", "output_overflow", "late", "dropped_input")
_FLAG_KEYS = ((PA_INPUT_UNDERFLOW, "input_underflow"), (PA_INPUT_OVERFLOW, "input_overflow"),
              (PA_OUTPUT_UNDERFLOW, "output_underflow"), (PA_OUTPUT_OVERFLOW, "output_overflow"),
              (LATE, "late"))
RING_MIN_BLOCKS, RING_MAX_BLOCKS = 2, 8
MAX_MSG = 1 << 20
INPUT_RATES = (16000, 48000, 44100, 32000, 22050)  # tried after none: 16 kHz first (the VAD's rate)
OUTPUT_RATES = (48000, 44100, 32000, 22050, 16000)  # tried after the device's default rate


class DeviceNotFound(UserError):
    """No device's name contains the configured substring. ``found`` lists the candidates' names."""

    def __init__(self, message: str, found: list[str]):
        super().__init__(message)
        self.found = found


def match_device(devices: list[dict], name: str, kind: str, default_index: Optional[int] = None) -> dict:
    """The first device whose name contains ``name`` (case-insensitive) and has ``kind`` channels.

    :param devices: dicts with ``index``, ``name``, ``max_input_channels``, ``max_output_channels`` (as
        ``sounddevice.query_devices()`` gives them, plus ``index``).
    :param kind: ``"input"`` or ``"output"``.
    :param default_index: PortAudio's default device of that kind, used for ``name == "default"``.
    :raises DeviceNotFound: nothing matches; the one-line message lists every candidate.
    """
    key = "max_input_channels" if kind == "input" else "max_output_channels"
    candidates = [d for d in devices if d.get(key, 0) > 0]
    if name.strip().lower() == "default":
        for d in candidates:
            if default_index is not None and d["index"] == default_index:
                return d
        for d in candidates:
            if d["name"].lower() == "default":
                return d
        if candidates:
            return candidates[0]
    else:
        for d in candidates:
            if name.lower() in d["name"].lower():
                return d
    found = [d["name"] for d in candidates]
    shown = ", ".join(f"'{n}'" for n in found) or "none"
    raise DeviceNotFound(f"no {kind} sound device matches audio.{kind}: '{name}' (found: {shown}); "
                         f"set audio.{kind} in config.yaml to part of one of these names "
                         f"(`appliance devices` lists them)", found)


# ----------------------------------------------------------------------------------------------------
# The worker process (PortAudio lives only here)
# ----------------------------------------------------------------------------------------------------

def _import_sd():
    try:
        import sounddevice as sd
    except OSError as exc:  # the PortAudio library is missing
        raise UserError(f"PortAudio is not installed ({exc}); run `apt-get install libportaudio2`") from None
    return sd


def _query(sd) -> list[dict]:
    out = []
    apis = sd.query_hostapis()
    for i, d in enumerate(sd.query_devices()):
        out.append({"index": i, "name": d["name"], "hostapi": apis[d["hostapi"]]["name"],
                    "max_input_channels": int(d["max_input_channels"]),
                    "max_output_channels": int(d["max_output_channels"]),
                    "default_samplerate": float(d["default_samplerate"])})
    return out


def _pick(sd, dev: dict, kind: str) -> tuple[int, int]:
    """(rate, channels) the device accepts: mono if it takes mono, else 2 channels."""
    check = sd.check_input_settings if kind == "input" else sd.check_output_settings
    maxch = dev["max_input_channels"] if kind == "input" else dev["max_output_channels"]
    default = int(dev["default_samplerate"])
    rates = INPUT_RATES if kind == "input" else (default,) + OUTPUT_RATES
    if kind == "input":
        rates = rates + (default,)
    errors = []
    for ch in dict.fromkeys((1, min(2, maxch))):
        for rate in dict.fromkeys(rates):
            try:
                check(device=dev["index"], channels=ch, dtype="float32", samplerate=rate)
                return rate, ch
            except Exception as exc:  # sounddevice raises PortAudioError/ValueError
                errors.append(f"{rate} Hz x{ch}: {exc}")
    raise RuntimeError(f"{kind} device '{dev['name']}' accepts none of the rates tried ({'; '.join(errors[:3])})")


def _worker(fd: int, params: dict) -> int:
    """The child: open the two streams, shuttle blocks over the socket, report loss, exit hard.

    Exits with ``os._exit`` so that no PortAudio teardown can hang or crash on a dead device.
    """
    ctl = socket.socket(fileno=fd)
    ctl.settimeout(0.2)
    rt = socket.socket(fileno=os.dup(fd))
    rt.setblocking(False)

    def send_json(kind: bytes, obj: dict) -> None:
        try:
            ctl.sendall(kind + json.dumps(obj).encode())
        except OSError:
            pass

    try:
        sd = _import_sd()
        devices = _query(sd)
        defaults = sd.default.device
        dout = match_device(devices, params["output"], "output", _default_index(defaults[1]))
        out_rate, out_ch = _pick(sd, dout, "output")
        din = None
        in_rate, in_ch = out_rate, 1
        if params.get("input") is not None:
            din = match_device(devices, params["input"], "input", _default_index(defaults[0]))
            in_rate, in_ch = _pick(sd, din, "input")
    except DeviceNotFound as exc:
        send_json(b"E", {"kind": "not_found", "message": str(exc), "found": exc.found})
        os._exit(3)
    except Exception as exc:
        send_json(b"E", {"kind": "open_failed", "message": f"{exc.__class__.__name__}: {exc}"})
        os._exit(4)

    block_ms = float(params["block_ms"])
    in_block = max(16, int(round(in_rate * block_ms / 1000.0)))
    out_block = max(16, int(round(out_rate * block_ms / 1000.0)))
    ring: deque = deque()  # float32 arrays the service sent
    state = {"queued": 0, "requested": 0, "target": RING_MIN_BLOCKS * out_block, "last_cb": 0.0, "n_out": 0,
             # pause/flush at the device: "play", "fade" (fading out what the ring holds), "paused" (holding it)
             "mode": "play", "gain": 1.0, "fade_left": 0, "flush": False}
    fade_n = max(1, int(round(out_rate * float(params.get("fade_ms", 8.0)) / 1000.0)))
    lock = threading.Lock()
    hdr_i = struct.Struct("<I")
    hdr_o = struct.Struct("<II")

    def on_input(indata, frames, time_info, status):
        state["last_cb"] = time.monotonic()
        try:
            rt.send(b"I" + hdr_i.pack(getattr(status, "_flags", 0)) + indata.tobytes())
        except (BlockingIOError, OSError):
            try:
                rt.send(b"I" + hdr_i.pack(0x200))  # an empty block flagged "dropped"
            except OSError:
                pass

    def on_output(outdata, frames, time_info, status):
        state["last_cb"] = time.monotonic()
        state["n_out"] += 1
        flags = getattr(status, "_flags", 0)  # sounddevice.CallbackFlags keeps the PortAudio bits here
        out = outdata[:, 0]
        pos = 0
        silent = False
        with lock:
            while pos < frames and ring and state["mode"] != "paused":
                seg = ring[0]
                take = min(frames - pos, len(seg))
                if state["mode"] == "fade":
                    take = min(take, state["fade_left"])
                g = state["gain"]
                if state["mode"] == "fade" or g < 1.0:  # a fade out (pause, flush) or back in (resume)
                    # Out: fade_n steps that stop short of zero, so every sample taken is heard.
                    step = -1.0 / (fade_n + 1) if state["mode"] == "fade" else 1.0 / fade_n
                    ramp = np.clip(g + step * np.arange(1, take + 1, dtype=np.float32), 0.0, 1.0)
                    out[pos:pos + take] = seg[:take] * ramp
                    state["gain"] = float(ramp[-1]) if take else g
                else:
                    out[pos:pos + take] = seg[:take]
                if take == len(seg):
                    ring.popleft()
                else:
                    ring[0] = seg[take:]
                pos += take
                state["queued"] -= take
                if state["mode"] == "fade":
                    state["fade_left"] -= take
                    if state["fade_left"] <= 0:
                        silent = True
                        _faded_out(state, ring)
            if state["mode"] == "fade" and not ring:  # nothing left to fade: silent at once
                silent = True
                _faded_out(state, ring)
            if pos < frames:
                out[pos:] = 0.0
                if state["n_out"] > 1 and state["mode"] == "play" and not silent:
                    flags |= LATE
                    state["target"] = min(RING_MAX_BLOCKS * out_block, state["target"] + out_block)
            want = state["target"] - state["queued"] - state["requested"] if state["mode"] == "play" else 0
            if want > 0:
                state["requested"] += want
        if outdata.shape[1] > 1:
            outdata[:, 1:] = outdata[:, :1]
        if want > 0 or flags:
            try:
                rt.send(b"O" + hdr_o.pack(max(0, want), flags))
            except OSError:
                with lock:
                    state["requested"] -= max(0, want)
        if silent:
            try:
                rt.send(b"S")
            except OSError:
                pass

    try:
        istream = None
        if din is not None:
            istream = sd.InputStream(device=din["index"], samplerate=in_rate, channels=in_ch, dtype="float32",
                                     blocksize=in_block, latency="low", callback=on_input)
        ostream = sd.OutputStream(device=dout["index"], samplerate=out_rate, channels=out_ch, dtype="float32",
                                  blocksize=out_block, latency="low", callback=on_output)
        # Prime the ring before the first callback asks.
        with lock:
            state["requested"] = state["target"]
        ctl.sendall(b"O" + hdr_o.pack(state["target"], 0))
        if istream is not None:
            istream.start()
        ostream.start()
    except Exception as exc:
        send_json(b"E", {"kind": "open_failed", "message": f"{exc.__class__.__name__}: {exc}"})
        os._exit(4)

    def ms(latency) -> Optional[float]:
        # PortAudio's JACK host API computes latency from a deprecated call and can return garbage.
        v = float(latency)
        return round(v * 1000.0, 2) if 0.0 <= v < 5.0 else None

    send_json(b"R", {"input": din["name"] if din else None, "output": dout["name"], "hostapi": dout["hostapi"],
                     "in_rate": in_rate, "out_rate": out_rate, "in_channels": in_ch, "out_channels": out_ch,
                     "in_block": in_block, "out_block": out_block,
                     "input_latency_ms": ms(istream.latency) if istream else None,
                     "output_latency_ms": ms(ostream.latency)})
    started = time.monotonic()
    stall_s = float(params.get("stall_s", 1.0))
    grace_s = float(params.get("grace_s", 3.0))
    while True:
        try:
            msg = ctl.recv(MAX_MSG)
        except socket.timeout:
            msg = None
        except OSError:
            os._exit(0)
        if msg is not None:
            if not msg or msg[:1] == b"Q":
                os._exit(0)  # the service went away or asked us to stop
            if msg[:1] in (b"P", b"U", b"F"):
                with lock:
                    _control(state, ring, msg[:1], fade_n)
            if msg[:1] == b"D":
                data = np.frombuffer(msg[1:], dtype=np.float32).copy()
                with lock:
                    state["requested"] = max(0, state["requested"] - len(data))
                    if len(data):
                        ring.append(data)
                        state["queued"] += len(data)
        now = time.monotonic()
        last = state["last_cb"]
        reason = None
        if not ostream.active or (istream is not None and not istream.active):
            reason = "the sound device stopped (stream no longer active)"
        elif last == 0.0 and now - started > grace_s:
            reason = f"the sound device gave no audio callback within {grace_s:.1f} s of opening"
        elif last and now - last > stall_s:
            reason = f"the sound device stopped calling back ({now - last:.1f} s without audio)"
        if reason:
            send_json(b"L", {"reason": reason})
            os._exit(5)


def _control(state: dict, ring: deque, cmd: bytes, fade_n: int) -> None:
    """The worker's pause (``P``), resume (``U``) and flush (``F``), under its lock.

    A pause fades out over ``fade_n`` samples of what the ring holds and keeps the rest for the resume,
    which fades back in from there: the ring's 2–8 blocks are not played after a pause, and no sample is
    dropped or repeated. A flush fades out the same way and then drops the ring.
    """
    mode = state["mode"]
    if cmd == b"P" and mode == "play":
        state["mode"], state["fade_left"], state["flush"] = "fade", fade_n, False
    elif cmd == b"U" and mode in ("fade", "paused") and not state["flush"]:
        state["mode"] = "play"  # gain < 1: the output callback ramps it back up
    elif cmd == b"F":
        if mode == "play":
            state["mode"], state["fade_left"] = "fade", fade_n
        state["flush"] = True
        if mode == "paused":  # already silent: drop at once
            _faded_out(state, ring)


def _faded_out(state: dict, ring: deque) -> None:
    """A fade out reached silence: hold the ring (pause), or drop it and play on (flush)."""
    if state["flush"]:
        ring.clear()
        state.update(mode="play", gain=1.0, queued=0, flush=False, fade_left=0)
    else:
        state.update(mode="paused", gain=0.0, fade_left=0)


def _default_index(idx) -> Optional[int]:
    try:
        i = int(idx)
    except (TypeError, ValueError):
        return None
    return i if i >= 0 else None


def _list_main() -> int:
    try:
        sd = _import_sd()
        devs = _query(sd)
        defaults = [_default_index(x) for x in sd.default.device]
    except UserError as exc:
        print(json.dumps({"error": str(exc)}))
        sys.stdout.flush()
        os._exit(0)
    print(json.dumps({"devices": devs, "default_input": defaults[0], "default_output": defaults[1]}))
    sys.stdout.flush()
    os._exit(0)  # no Pa_Terminate: it can hang on a half-dead sound server


# ----------------------------------------------------------------------------------------------------
# The service side
# ----------------------------------------------------------------------------------------------------

def list_devices(timeout: float = 15.0) -> dict:
    """Every PortAudio device, queried in a short-lived worker process.

    :returns: ``{"devices": [{index, name, hostapi, max_input_channels, max_output_channels,
        default_samplerate}], "default_input": int|None, "default_output": int|None}``.
    :raises UserError: PortAudio is missing, or the query hung for ``timeout`` s.
    """
    try:
        res = subprocess.run([sys.executable, "-m", "appliance.audio.devices", "--list"], capture_output=True,
                             text=True, timeout=timeout, env=_child_env())
    except subprocess.TimeoutExpired:
        raise UserError(f"listing sound devices hung for {timeout:.0f} s (a stuck sound server?); "
                        "check `systemctl status` of your sound server") from None
    try:
        data = json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise UserError(f"listing sound devices failed: {res.stderr.strip()[-300:] or 'no output'}") from None
    if "error" in data:
        raise UserError(data["error"])
    return data


def describe_devices(cfg=None) -> tuple[str, list[str]]:
    """A table of sound devices, marking the ones ``cfg.audio.input``/``output`` select, and a line for
    each of those that is not there (none without ``cfg``)."""
    data = list_devices()
    devs = data["devices"]
    chosen: dict[str, Optional[int]] = {}
    notes = []
    if cfg is not None:
        for kind in ("input", "output"):
            try:
                chosen[kind] = match_device(devs, getattr(cfg.audio, kind), kind, data.get(f"default_{kind}"))["index"]
            except DeviceNotFound as exc:
                notes.append(str(exc))
    lines = []
    for d in devs:
        marks = [k for k, v in chosen.items() if v == d["index"]]
        lines.append(f"{d['index']:3d} {d['name']!s:40} {d['hostapi']:<28} in={d['max_input_channels']} "
                     f"out={d['max_output_channels']} default_rate={int(d['default_samplerate'])}"
                     + (f"  <- {', '.join(marks)}" if marks else ""))
    if not lines:
        lines.append("no sound devices found")
    return "\n".join(lines), notes


def _child_env() -> dict:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@dataclass
class DeviceInfo:
    """What the worker opened: names, rates (Hz), channels, block sizes (frames), PortAudio latencies (ms)."""

    input: Optional[str]
    output: str
    hostapi: str
    in_rate: int
    out_rate: int
    in_channels: int
    out_channels: int
    in_block: int
    out_block: int
    input_latency_ms: Optional[float]
    output_latency_ms: Optional[float]


class _Stream:
    """A streaming soxr resampler (float32 mono) that is a no-op at equal rates."""

    def __init__(self, src: int, dst: int):
        self.src, self.dst = src, dst
        self._rs = None
        if src != dst:
            import soxr

            self._rs = soxr.ResampleStream(src, dst, 1, dtype="float32", quality="HQ")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self._rs is None:
            return x
        return self._rs.resample_chunk(x)


@dataclass
class _Link:
    proc: subprocess.Popen
    sock: socket.socket
    info: Optional[DeviceInfo] = None
    thread: Optional[threading.Thread] = None
    closed: threading.Event = field(default_factory=threading.Event)


class DeviceAudio:
    """The microphone and the speaker, by name, kept open across device loss.

    :param input_name: substring of the microphone's device name (``audio.input``), ``"default"``, or
        None for no microphone (playing only).
    :param output_name: substring of the speaker's device name (``audio.output``), or ``"default"``.
    :param block_ms: the output (and input) block, ms (``audio.output_block_ms``; 10–20 ms).
    :param playback_rate: the rate ``read_output`` produces, Hz (the playback buffer's rate).
    :param read_output: ``read_output(n) -> float32 [n]`` at ``playback_rate`` (``Playback.read``).
    :param capture: ``capture(mic, far_end)``: float32 mono 16 kHz microphone block, and the far end
        handed to the output since the previous block (float32 16 kHz, possibly empty).
    :param on_status: ``on_status(kind, info)`` from the reader thread: ``"open"`` (``info`` = the
        :class:`DeviceInfo` as a dict), ``"lost"`` (``reason``), ``"unavailable"`` (``reason``, ``found``:
        device names, ``attempt``, ``retry_in_s``). Must return fast.
    :param backoff: first and longest wait between attempts to open, s (doubling in between).
    :param stall_s: a device that stops calling back for this long counts as lost, s.

    Threads: one reader per worker (answers output requests, delivers input) and one supervisor (starts
    workers, waits out the back-off). Nothing here blocks the caller.
    """

    def __init__(self, input_name: Optional[str], output_name: str, block_ms: float, playback_rate: int,
                 read_output: Callable[[int], np.ndarray],
                 capture: Callable[[np.ndarray, Optional[np.ndarray]], None],
                 on_status: Optional[Callable[[str, dict], None]] = None,
                 backoff: tuple[float, float] = (0.5, 10.0), stall_s: float = 1.0, grace_s: float = 3.0):
        self.log_errors = True  # log a failing device once per distinct reason
        self.input_name = input_name
        self.output_name = output_name
        self.block_ms = block_ms
        self.playback_rate = playback_rate
        self.read_output = read_output
        self.capture = capture
        self.on_status = on_status or (lambda kind, info: None)
        self.backoff = backoff
        self.stall_s = stall_s
        self.grace_s = grace_s
        self.xruns = {k: 0 for k in XRUN_KEYS}
        self.info: Optional[DeviceInfo] = None
        self.state = "closed"  # closed, opening, open, unavailable
        self.attempts = 0
        self.opened = 0  # successful opens since start
        self.last_error: Optional[str] = None
        self._ring_ms = 0.0
        self._link: Optional[_Link] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._sup: Optional[threading.Thread] = None
        self._turn_mark = dict(self.xruns)
        self.fade_ms = 8.0  # the worker's fade on pause, resume and flush (interruption.fade_ms)
        self.on_silent: Callable[[], None] = lambda: None  # the worker's fade out reached silence
        self._paused = False  # the output is paused at the worker (kept across a worker restart)
        self._drop_fifo = False

    # --- public ---
    @property
    def xrun_total(self) -> int:
        """Device xruns (status flags) plus late output blocks and dropped input blocks since start."""
        return sum(self.xruns.values())

    @property
    def output_latency_ms(self) -> Optional[float]:
        """PortAudio's reported output latency plus the worker's sample ring, ms (None while closed). When
        PortAudio reports no usable latency (its JACK host API), one block stands in for the device's part."""
        if self.info is None:
            return None
        dev = self.info.output_latency_ms
        if dev is None:
            dev = 1000.0 * self.info.out_block / self.info.out_rate
        return round(dev + self._ring_ms, 2)

    def stats(self) -> dict:
        """Xruns since the previous call (each key of :attr:`xruns`), and the output latency, for the
        per-turn metrics."""
        with self._lock:
            delta = {k: self.xruns[k] - self._turn_mark.get(k, 0) for k in XRUN_KEYS}
            self._turn_mark = dict(self.xruns)
        return {"xruns": sum(delta.values()), "xruns_by_kind": {k: v for k, v in delta.items() if v},
                "output_latency_ms": self.output_latency_ms}

    # --- pause, resume and flush at the device (the worker's ring) ---
    def pause_output(self) -> None:
        """Fade out within ``fade_ms`` at the worker and hold what its ring still has (2–8 blocks that
        would otherwise play after the pause). Never blocks; a no-op while no worker runs."""
        self._paused = True
        self._send(b"P")

    def resume_output(self) -> None:
        """Fade back in where the pause stopped: the held samples first, none dropped or repeated."""
        self._paused = False
        self._send(b"U")

    def flush_output(self) -> None:
        """Fade out and drop what the worker and the reader hold (the rest of an interrupted reply)."""
        self._paused = False
        self._drop_fifo = True
        self._send(b"F")

    def _send(self, cmd: bytes) -> None:
        link = self._link
        if link is not None:
            try:
                link.sock.send(cmd)
            except OSError:
                pass  # the reader notices a dead worker

    def start(self) -> None:
        self._stop.clear()
        self._sup = threading.Thread(target=self._supervise, name="audio-supervisor", daemon=True)
        self._sup.start()

    def stop(self) -> None:
        self._stop.set()
        self._kick.set()
        self._close_link()
        if self._sup:
            self._sup.join(timeout=5)
        self.state = "closed"

    def reopen(self, input_name: Optional[str] = None, output_name: Optional[str] = None,
               block_ms: Optional[float] = None) -> None:
        """Switch devices (a config reload): close the worker and open with the new names at once."""
        if input_name is not None:
            self.input_name = input_name
        if output_name is not None:
            self.output_name = output_name
        if block_ms is not None:
            self.block_ms = block_ms
        self._close_link()
        self.attempts = 0
        self._kick.set()

    def wait_open(self, timeout: float) -> bool:
        """Wait until the streams are open; False on timeout."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.state == "open":
                return True
            time.sleep(0.02)
        return self.state == "open"

    # --- supervisor ---
    def _supervise(self) -> None:
        while not self._stop.is_set():
            link = self._link
            if link is not None and not link.closed.is_set():
                link.closed.wait(0.2)
                continue
            self.state = "opening"
            self.attempts += 1
            err = self._open_once()
            if err is None:
                self.attempts = 0
                continue  # runs until its `closed` event
            if self._stop.is_set():
                return
            wait = min(self.backoff[1], self.backoff[0] * (2 ** min(self.attempts - 1, 16)))
            self.state = "unavailable"
            reason, found = err
            repeated = reason == self.last_error
            self.last_error = reason
            if not repeated and self.log_errors:
                log.error("%s; retrying every %.1f s at most", reason, self.backoff[1])
            self.on_status("unavailable", {"reason": reason, "found": found, "attempt": self.attempts,
                                           "retry_in_s": round(wait, 2), "repeated": repeated})
            self._kick.clear()
            self._kick.wait(wait)

    def _open_once(self) -> Optional[tuple[str, list]]:
        """Start a worker and wait for ``ready``. Returns None when open, else (reason, found devices)."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        params = {"input": self.input_name, "output": self.output_name, "block_ms": self.block_ms,
                  "stall_s": self.stall_s, "grace_s": self.grace_s, "fade_ms": self.fade_ms}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "appliance.audio.devices", "--worker", str(child.fileno()), json.dumps(params)],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=None if log.isEnabledFor(logging.DEBUG) else subprocess.DEVNULL, env=_child_env())
        finally:
            child.close()
        link = _Link(proc, parent)
        parent.settimeout(max(10.0, self.grace_s + 5.0))
        try:
            # The worker primes its ring (an "O" request) before it says ready.
            pending = []
            while True:
                msg = parent.recv(MAX_MSG)
                if not msg:
                    raise ConnectionError("the audio worker exited without a word")
                if msg[:1] in (b"O", b"I"):
                    pending.append(msg)
                    continue
                body = json.loads(msg[1:] or b"{}")
                if msg[:1] == b"R":
                    link.info = DeviceInfo(**body)
                    break
                if msg[:1] in (b"E", b"L"):
                    self._reap(link)
                    return body.get("message") or body.get("reason", "audio worker failed"), body.get("found", [])
        except (OSError, ValueError, TypeError) as exc:
            self._reap(link)
            return f"the audio worker failed to start ({exc.__class__.__name__}: {exc})", []
        info = link.info
        self.info = info
        self._ring_ms = RING_MIN_BLOCKS * self.block_ms
        link.thread = threading.Thread(target=self._reader, args=(link, pending), name="audio-reader", daemon=True)
        with self._lock:
            self._link = link
        if self._paused:
            self._send(b"P")  # a new worker starts playing: keep a pause that is on
        self.state = "open"
        self.opened += 1
        self.last_error = None
        log.info("sound devices open: input '%s' %d Hz x%d, output '%s' %d Hz x%d (%s), output latency %.1f ms",
                 info.input, info.in_rate, info.in_channels, info.output, info.out_rate, info.out_channels,
                 info.hostapi, self.output_latency_ms or 0.0)
        link.thread.start()
        self.on_status("open", dict(info.__dict__))
        return None

    def _reap(self, link: _Link) -> None:
        try:
            link.sock.close()
        except OSError:
            pass
        if link.proc.poll() is None:
            link.proc.kill()  # our own child; it may be stuck inside PortAudio
        try:
            link.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        link.closed.set()

    def _close_link(self) -> None:
        with self._lock:
            link, self._link = self._link, None
        if link is None:
            return
        try:
            link.sock.send(b"Q")
        except OSError:
            pass
        try:
            link.proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        self._reap(link)
        if link.thread is not None and link.thread is not threading.current_thread():
            link.thread.join(timeout=2)
        self.info = None

    # --- reader (one per worker) ---
    def _reader(self, link: _Link, pending: list) -> None:
        info = link.info
        assert info is not None
        to_dev = _Stream(self.playback_rate, info.out_rate)
        far_rs = _Stream(self.playback_rate, MODEL_RATE)
        mic_rs = _Stream(info.in_rate, MODEL_RATE)
        fifo = np.zeros(0, dtype=np.float32)  # device-rate samples resampled but not yet sent
        far: list[np.ndarray] = []
        hdr_i = struct.Struct("<I")
        hdr_o = struct.Struct("<II")
        sock = link.sock
        sock.settimeout(max(self.stall_s, 0.2) + 1.0)
        reason = None
        step = max(16, int(self.playback_rate * self.block_ms / 1000.0))
        msgs = deque(pending)
        while not self._stop.is_set():
            if msgs:
                msg = msgs.popleft()
            else:
                try:
                    msg = sock.recv(MAX_MSG)
                except socket.timeout:
                    reason = f"the audio worker went silent for {sock.gettimeout():.1f} s"
                    break
                except OSError as exc:
                    reason = f"the audio worker's socket failed ({exc})"
                    break
            if not msg:
                reason = "the audio worker exited"
                break
            kind = msg[:1]
            if self._drop_fifo:
                self._drop_fifo = False
                fifo = fifo[:0]
            if kind == b"S":
                self.on_silent()
            elif kind == b"O":
                want, flags = hdr_o.unpack_from(msg, 1)
                self._count(flags)
                if want:
                    while len(fifo) < want:
                        n = want - len(fifo) if to_dev._rs is None else step
                        block = np.asarray(self.read_output(n), dtype=np.float32)
                        far.append(far_rs(block))
                        fifo = np.concatenate([fifo, to_dev(block)])
                    out, fifo = fifo[:want], fifo[want:]
                    try:
                        sock.sendall(b"D" + out.astype(np.float32).tobytes())
                    except OSError as exc:
                        reason = f"the audio worker's socket failed ({exc})"
                        break
                    self._ring_ms = max(self._ring_ms, 1000.0 * want / info.out_rate)
            elif kind == b"I":
                (flags,) = hdr_i.unpack_from(msg, 1)
                if flags & 0x200:
                    with self._lock:
                        self.xruns["dropped_input"] += 1
                    continue
                self._count(flags)
                raw = np.frombuffer(msg[1 + hdr_i.size:], dtype=np.float32)
                if info.in_channels > 1:
                    raw = raw.reshape(-1, info.in_channels).mean(axis=1)
                mic = mic_rs(raw.astype(np.float32))
                far_end = np.concatenate(far) if far else np.zeros(0, dtype=np.float32)
                far = []
                if len(mic):
                    self.capture(mic, far_end)
            elif kind == b"L":
                try:
                    reason = json.loads(msg[1:]).get("reason", "device lost")
                except ValueError:
                    reason = "device lost"
                break
        with self._lock:
            mine = self._link is link
            if mine:
                self._link = None
        self._reap(link)
        if mine and not self._stop.is_set():
            self.info = None
            self.state = "unavailable"
            log.error("sound device lost: %s; reopening", reason)
            self.on_status("lost", {"reason": reason})

    def _count(self, flags: int) -> None:
        if not flags:
            return
        with self._lock:
            for bit, key in _FLAG_KEYS:
                if flags & bit:
                    self.xruns[key] += 1


def play(audio: np.ndarray, rate: int, output: str = "default", timeout: Optional[float] = None) -> dict:
    """Play float32 mono audio (``rate`` Hz) on the named output device and wait until it has been played.

    :returns: the :class:`DeviceInfo` of the devices used, as a dict.
    :raises UserError: the device is missing (the message lists the devices found) or never opened.
    """
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    pos = [0]
    done = threading.Event()
    status: dict = {}

    def read(n: int) -> np.ndarray:
        out = np.zeros(n, dtype=np.float32)
        chunk = audio[pos[0]:pos[0] + n]
        out[:len(chunk)] = chunk
        pos[0] += n
        if pos[0] >= len(audio) + rate // 5:  # the tail plus 200 ms has been handed over
            done.set()
        return out

    def on_status(kind: str, info: dict) -> None:
        status[kind] = info
        if kind in ("unavailable", "lost"):
            done.set()

    dev = DeviceAudio(None, output, 20, rate, read, lambda mic, far: None, on_status, backoff=(0.5, 0.5))
    dev.log_errors = False  # a one-shot play reports its failure itself, once
    dev.start()
    try:
        done.wait(timeout if timeout is not None else len(audio) / rate + 15.0)
    finally:
        dev.stop()
    if "open" not in status:
        bad = status.get("unavailable") or status.get("lost") or {}
        reason = bad.get("reason", f"could not open the output device '{output}'").split("; retrying")[0]
        raise UserError(f"{reason}; or write a WAV instead with --out FILE")
    return status["open"]


def run_service(cfg, config_path=None) -> int:
    """The appliance on real devices (see :func:`appliance.service.run`)."""
    from ..service import run

    return run(cfg, config_path)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--list":
        _list_main()
    elif len(sys.argv) == 4 and sys.argv[1] == "--worker":
        sys.exit(_worker(int(sys.argv[2]), json.loads(sys.argv[3])))
    else:
        print("usage: python -m appliance.audio.devices --list | --worker FD PARAMS_JSON", file=sys.stderr)
        sys.exit(2)
