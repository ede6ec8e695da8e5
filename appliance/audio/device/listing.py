"""Finding sound devices: by a substring of their name, the stream format each accepts, and the listing.

Devices are chosen by a case-insensitive substring of their name (``audio.input``/``audio.output`` in
config.yaml; ``default`` is PortAudio's default device), never by an index that changes between boots.
Each stream opens at a rate the device accepts (``check_input_settings``/``check_output_settings``),
preferring 16 kHz for the microphone (no resampling before the VAD) and the device's default rate for
the speaker (:func:`probe_format`, which ``appliance doctor`` uses too).

PortAudio is imported only in child processes (the worker, ``--list``, the doctor's audio child): it can
hang on a half-dead sound server, and only a process that is killed gets out of that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

from ...errors import UserError

INPUT_RATES = (16000, 48000, 44100, 32000, 22050)  # Hz, tried in order: 16 kHz first (the VAD's rate)
OUTPUT_RATES = (48000, 44100, 32000, 22050, 16000)  # Hz, tried after the device's default rate


class DeviceNotFound(UserError):
    """No device's name contains the configured substring. ``found`` lists the candidates' names."""

    def __init__(self, message: str, found: list[str]):
        super().__init__(message)
        self.found = found


def match_device(devices: list[dict], name: str, kind: str, default_index: Optional[int] = None) -> dict:
    """The first device whose name contains ``name`` (case-insensitive) and has ``kind`` channels.

    :param devices: dicts with ``index``, ``name``, ``max_input_channels``, ``max_output_channels`` (as
        :func:`query_devices` gives them).
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
    if not found:  # nothing to choose from: renaming audio.{kind} cannot help
        raise DeviceNotFound(f"no {kind} sound device found at all (audio.{kind}: '{name}'); connect the USB sound card "
                             "or HAT (`arecord -l` and `aplay -l` list what the system sees; a HAT needs its dtoverlay)",
                             found)
    shown = ", ".join(f"'{n}'" for n in found)
    raise DeviceNotFound(f"no {kind} sound device matches audio.{kind}: '{name}' (found: {shown}); "
                         f"set audio.{kind} in config.yaml to part of one of these names "
                         f"(`appliance devices` lists them)", found)


def import_sounddevice():
    """The ``sounddevice`` module (loads PortAudio). :raises UserError: libportaudio2 is missing."""
    try:
        import sounddevice as sd
    except OSError as exc:  # the PortAudio library is missing
        raise UserError(f"PortAudio is not installed ({exc}); run `apt-get install libportaudio2`") from None
    return sd


def query_devices(sd) -> list[dict]:
    """Every PortAudio device: ``{index, name, hostapi, max_input_channels, max_output_channels,
    default_samplerate (Hz)}``."""
    out = []
    apis = sd.query_hostapis()
    for i, d in enumerate(sd.query_devices()):
        out.append({"index": i, "name": d["name"], "hostapi": apis[d["hostapi"]]["name"],
                    "max_input_channels": int(d["max_input_channels"]),
                    "max_output_channels": int(d["max_output_channels"]),
                    "default_samplerate": float(d["default_samplerate"])})
    return out


def default_devices(sd) -> tuple[Optional[int], Optional[int]]:
    """PortAudio's default (input, output) device indexes, None where there is none."""
    return default_index(sd.default.device[0]), default_index(sd.default.device[1])


def probe_format(sd, dev: dict, kind: str) -> tuple[int, int]:
    """(rate Hz, channels) a float32 stream of ``kind`` (``"input"``/``"output"``) on ``dev`` opens at, as
    the service opens it: mono if the device takes mono, else 2 channels; rates in the order above.

    :raises RuntimeError: the device accepts none of the rates tried (the message names up to three reasons).
    """
    check = sd.check_input_settings if kind == "input" else sd.check_output_settings
    maxch = dev["max_input_channels"] if kind == "input" else dev["max_output_channels"]
    default = int(dev["default_samplerate"])
    rates = INPUT_RATES + (default,) if kind == "input" else (default,) + OUTPUT_RATES
    errors = []
    for ch in dict.fromkeys((1, min(2, maxch))):
        for rate in dict.fromkeys(rates):
            try:
                check(device=dev["index"], channels=ch, dtype="float32", samplerate=rate)
                return rate, ch
            except Exception as exc:  # sounddevice raises PortAudioError/ValueError
                errors.append(f"{rate} Hz x{ch}: {exc}")
    raise RuntimeError(f"{kind} device '{dev['name']}' accepts none of the rates tried ({'; '.join(errors[:3])})")


def default_index(idx) -> Optional[int]:
    try:
        i = int(idx)
    except (TypeError, ValueError):
        return None
    return i if i >= 0 else None


def child_env() -> dict:
    """The environment for a child ``python -m appliance...``: this package first on ``PYTHONPATH``."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def list_devices(timeout: float = 15.0) -> dict:
    """Every PortAudio device, queried in a short-lived child process.

    :returns: ``{"devices": [{index, name, hostapi, max_input_channels, max_output_channels,
        default_samplerate}], "default_input": int|None, "default_output": int|None}``.
    :raises UserError: PortAudio is missing, or the query hung for ``timeout`` s.
    """
    try:
        res = subprocess.run([sys.executable, "-m", "appliance.audio.device", "list"], capture_output=True,
                             text=True, timeout=timeout, env=child_env())
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


def list_main() -> None:
    """``python -m appliance.audio.device list``: print the listing as one JSON line and exit hard."""
    try:
        sd = import_sounddevice()
        devs = query_devices(sd)
        defaults = default_devices(sd)
    except UserError as exc:
        print(json.dumps({"error": str(exc)}))
        sys.stdout.flush()
        os._exit(0)
    print(json.dumps({"devices": devs, "default_input": defaults[0], "default_output": defaults[1]}))
    sys.stdout.flush()
    os._exit(0)  # no Pa_Terminate: it can hang on a half-dead sound server

