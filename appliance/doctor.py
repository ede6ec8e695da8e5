"""``appliance doctor``: every check a support thread would ask for, as a pass/fail table with fixes.

Checks, in order: the config file; the model GGUF and the audio projector (present, readable, a GGUF
whose tensor table fits in the file, optional SHA-256 against a ``SHA256SUMS`` beside them); RAM for the
model, projector and KV cache at ``model.n_ctx``; the input and output sound devices (found, sample
rates the stream needs, a short capture that is not digital silence); the Piper voice (loads,
real-time factor); Silero VAD (loads, ms per 32 ms window); the GPIO pins (free); disk space for the
history under ``storage.state_dir``; the clock (not before 2025, NTP synchronisation); the service.

Nothing here loads the LLM itself (seconds, and gigabytes of RAM on the device): the GGUF header is
read with ggml's own parser (:mod:`appliance.gguf`).
The whole run takes a few seconds (the capture is 1 s).

Over 500 lines on purpose: one method per row of the table, in the order the table prints them, so
a support reply ("the `ram` row says…") finds its code by reading down; the GGUF parser is in
:mod:`appliance.gguf` and the device probing in :mod:`appliance.audio.device.listing`.

Status per check: ``pass``, ``warn`` (works, but look), ``fail`` (the appliance will not work; the row
says the fix), ``skip`` (not applicable: e.g. GPIO disabled). Exit status 2 if any check failed, else 0.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from .config import DEFAULT_CONFIG_PATH, Config, ConfigError, default_config_path, load
from .audio.files import MODEL_RATE
from .errors import UserError
from .gguf import KV_KEYS as _KV_KEYS
from .gguf import GgufInfo, kv_cache_bytes, read_gguf

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"

# RAM the appliance needs beyond the model files and the KV cache: Python, onnxruntime with Silero and
# Piper, llama.cpp compute buffers. Measured here: the embedded parts (Gemma 3 270M at n_ctx 2048, Joe
# voice, Silero) reach 505 MiB RSS, 264 MiB beyond the 241 MiB model file (llama.cpp reserves a 514 MiB
# compute buffer for n_batch 512 × a 262k vocabulary, mostly untouched); the allowance doubles the 264.
RUNTIME_ALLOWANCE = 512 * 2**20
OS_RESERVE = 256 * 2**20  # left for the OS, sshd and journald
# Bytes per KV cache element: ggml block layouts (ggml-common.h): q8_0 = 32 int8 + fp16 scale = 34 B
# per 32, q4_0 = 16 B of nibbles + fp16 scale = 18 B per 32.
VAD_WINDOW_MS = 32.0  # 512 samples at 16 kHz: the real-time budget of one Silero window
CLOCK_FLOOR = _dt.datetime(2025, 1, 1, tzinfo=_dt.timezone.utc)  # older means the clock was never set
DISK_FAIL = 64 * 2**20
DISK_WARN = 512 * 2**20
COMMON_RATES = (16000, 22050, 44100, 48000)
SILENCE_PEAK = 1e-5  # a capture whose peak is below -100 dBFS is digital silence


@dataclass
class Check:
    """One row of the table. ``fix`` is set for every ``fail`` and ``warn``."""

    name: str
    status: str
    detail: str
    fix: str = ""
    seconds: float = 0.0


# --- helpers -----------------------------------------------------------------------------------------

def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _service_active(unit: str = "appliance") -> Optional[str]:
    """``systemctl is-active`` of the unit ("active", "failed", ...), or None without systemd."""
    if not shutil.which("systemctl"):
        return None
    try:
        r = subprocess.run(["systemctl", "is-active", unit], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = r.stdout.strip()
    return state or None


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _split_fix(message: str) -> tuple[str, str]:
    """A UserError message is "<problem>; <fix>": split it for the table."""
    problem, sep, fix = message.partition("; ")
    return (problem, fix) if sep else (message, "")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _expected_sha(path: Path) -> Optional[str]:
    """The SHA-256 of ``path`` listed in a ``SHA256SUMS`` (``sha256sum`` format) beside it, if any."""
    sums = path.parent / "SHA256SUMS"
    try:
        for line in sums.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("*") == path.name:
                return parts[0].lower()
    except OSError:
        return None
    return None


# --- the checks --------------------------------------------------------------------------------------

class Doctor:
    """Runs the checks for one config.

    :param config_path: the config file to check (None: /etc/appliance/config.yaml, else ./config.yaml).
    :param embedded: check the embedded defaults (text model and voice from PyPI, no projector, no GPIO).
    :param checksums: hash the model files against ``SHA256SUMS`` (reads every byte: ~1 min for 3 GB on
        an SD card).
    :param capture_s: length of the test capture, seconds.
    :param pin_factory: a gpiozero pin factory (tests pass ``MockFactory``); None = gpiozero's default.
    """

    def __init__(self, config_path: Optional[str | Path] = None, embedded: bool = False,
                 checksums: bool = False, capture_s: float = 1.0, pin_factory=None):
        self.config_path = Path(config_path) if config_path else (default_config_path() or Path("config.yaml"))
        self.explicit_config = config_path is not None
        self.embedded = embedded
        self.checksums = checksums
        self.capture_s = capture_s
        self.pin_factory = pin_factory
        self.cfg = Config()
        self.service = _service_active()
        self.results: list[Check] = []

    def _add(self, fn: Callable[[], list[Check] | Check]) -> None:
        t0 = time.perf_counter()
        try:
            got = fn()
        except Exception as exc:  # a check that crashes is a failed check, not a crashed doctor
            name = fn.__name__.lstrip("_").replace("check_", "")
            got = Check(name, FAIL, f"the check itself failed: {exc.__class__.__name__}: {exc}",
                        "report this with the output of `appliance doctor`")
        rows = got if isinstance(got, list) else [got]
        dt = (time.perf_counter() - t0) / max(1, len(rows))
        for r in rows:
            r.seconds = round(dt, 2)
        self.results.extend(rows)

    def run(self) -> list[Check]:
        for fn in (self.check_config, self.check_model, self.check_ram, self.check_audio, self.check_voice,
                   self.check_vad, self.check_end_of_turn, self.check_listening, self.check_gpio, self.check_disk,
                   self.check_clock, self.check_service):
            self._add(fn)
        return self.results

    # config
    def check_config(self) -> Check:
        from .pipeline import embedded_config

        path = self.config_path
        try:
            if self.embedded and not self.explicit_config:
                self.cfg = embedded_config(Config())
                return Check("config", PASS, "embedded defaults (--embedded)")
            cfg = load(path)
            self.cfg = embedded_config(cfg) if self.embedded else cfg
            return Check("config", PASS, f"{path}: valid" + (" (+ embedded defaults)" if self.embedded else ""))
        except ConfigError as exc:
            self.cfg = embedded_config(Config()) if self.embedded else Config()
            problems = "; ".join(str(p) for p in exc.problems)
            return Check("config", FAIL, f"{path}: {problems} (the other checks use the defaults)",
                         f"edit {path}, then `appliance check-config {path}`")
        except UserError:
            self.cfg = embedded_config(Config()) if self.embedded else Config()
            if not path.exists():
                factory = Path("/usr/share/appliance/config.yaml.default")  # the image's copy (build-image.sh)
                if self.explicit_config:
                    fix = "check the path given to --config"
                elif factory.exists():
                    fix = f"restore the factory config: sudo cp {factory} {DEFAULT_CONFIG_PATH}"
                else:
                    fix = (f"give one with --config FILE (neither {DEFAULT_CONFIG_PATH} nor ./config.yaml exists), "
                           "or --embedded for the built-in defaults")
                return Check("config", FAIL, f"{path}: not found (the other checks use the defaults)", fix)
            return Check("config", FAIL, f"{path}: not readable (the other checks use the defaults)",
                         f"sudo chmod a+r {path}")

    # model files
    def _gguf_row(self, name: str, key: str, path: Path, audio: bool = False) -> Check:
        try:
            info = read_gguf(path, _KV_KEYS)
        except FileNotFoundError:
            return Check(name, FAIL, f"{path}: not found",
                         f"copy the file to {path.parent}/ (see docs/image.md), or set {key} in config.yaml")
        except PermissionError:
            return Check(name, FAIL, f"{path}: not readable by {os.environ.get('USER', 'this user')}",
                         f"sudo chmod a+r {path}")
        except IsADirectoryError:
            return Check(name, FAIL, f"{path}: is a directory", f"set {key} to the .gguf file inside it")
        except (ValueError, OSError) as exc:
            return Check(name, FAIL, f"{path}: not a GGUF ({exc})", f"replace it with a complete GGUF download, or fix {key}")
        if info.truncated:
            return Check(name, FAIL, f"{path}: truncated: {info.file_bytes:,} bytes, its tensors need {info.needed_bytes:,}",
                         "the copy or download was cut short: copy it again")
        arch = info.meta.get("general.architecture") or "?"
        detail = f"{path.name}: GGUF v{info.version}, {arch}, {info.n_tensors} tensors, {_mib(info.file_bytes)}"
        if not audio and arch == "clip":
            return Check(name, FAIL, detail + ": an audio projector, not the language model",
                         f"set {key} to the model GGUF; this file belongs in model.mmproj")
        if audio and not info.meta.get("clip.has_audio_encoder"):
            return Check(name, FAIL, detail + ", no audio encoder",
                         f"{key} must be the model's audio projector (mmproj with an audio encoder)")
        want = _expected_sha(path)
        if self.checksums:
            if want is None:
                return Check(name, WARN, detail + "; no SHA256SUMS entry to compare with",
                             f"put `sha256sum {path.name}` output in {path.parent}/SHA256SUMS")
            got = _sha256(path)
            if got != want:
                return Check(name, FAIL, detail + f"; SHA-256 {got[:12]}… differs from SHA256SUMS {want[:12]}…",
                             "the file is corrupt: copy it again")
            detail += ", SHA-256 matches"
        elif want is not None:
            detail += " (SHA-256 not checked: --checksums)"
        self._gguf[name] = info
        return Check(name, PASS, detail)

    def check_model(self) -> list[Check]:
        m = self.cfg.model
        self._gguf: dict[str, GgufInfo] = {}
        rows = [self._gguf_row("model", "model.gguf", Path(m.gguf))]
        if m.mmproj:
            rows.append(self._gguf_row("projector", "model.mmproj", Path(m.mmproj), audio=True))
        elif self.embedded:
            rows.append(Check("projector", SKIP, "none: the embedded model is text-only (replay with transcripts)"))
        else:
            rows.append(Check("projector", FAIL, "model.mmproj is null: a text-only model cannot hear",
                              "set model.mmproj to the audio projector GGUF"))
        return rows

    def check_ram(self) -> Check:
        m = self.cfg.model
        info = self._gguf.get("model")
        if info is None:
            return Check("ram", SKIP, "no readable model to size")
        kv = kv_cache_bytes(info.meta, m.n_ctx, m.kv_cache_type)
        proj = self._gguf["projector"].file_bytes if "projector" in self._gguf else 0
        need = info.file_bytes + proj + kv + RUNTIME_ALLOWANCE
        mem = _meminfo()
        total, avail = mem.get("MemTotal", 0), mem.get("MemAvailable", 0)
        detail = (f"need ~{_mib(need)} (model {_mib(info.file_bytes)} + projector {_mib(proj)} + KV cache "
                  f"{_mib(kv)} at n_ctx {m.n_ctx} {m.kv_cache_type} + runtime {_mib(RUNTIME_ALLOWANCE)}); "
                  f"total {_mib(total)}, available {_mib(avail)}")
        if not total:
            return Check("ram", WARN, detail, "cannot read /proc/meminfo")
        if need > total - OS_RESERVE:
            return Check("ram", FAIL, detail, "lower model.n_ctx, use kv_cache_type q4_0, or a smaller quantisation")
        if need > avail and self.service != "active":
            return Check("ram", WARN, detail, "something else is using the memory: see `top -o %MEM`")
        return Check("ram", PASS, detail)

    # audio
    def check_audio(self) -> list[Check]:
        """Runs :func:`_audio_checks` in a child process: PortAudio can hang on a stuck sound server, and
        only a process that is killed gets out of that (see :mod:`appliance.audio.device.host`)."""
        params = {"input": self.cfg.audio.input, "output": self.cfg.audio.output,
                  "capture_s": self.capture_s, "service": self.service}
        timeout = self.capture_s + 15.0
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            r = subprocess.run([sys.executable, "-m", "appliance.doctor", "--audio-worker", json.dumps(params)],
                               capture_output=True, text=True, timeout=timeout, env=env)
            rows = json.loads(r.stdout.strip().splitlines()[-1])
        except subprocess.TimeoutExpired:
            return [Check("audio", FAIL, f"the sound system did not answer within {timeout:.0f} s",
                          "a stuck sound server or USB device: replug the sound card, or reboot")]
        except (IndexError, json.JSONDecodeError):
            return [Check("audio", FAIL, f"the audio check crashed: {r.stderr.strip()[-300:] or 'no output'}",
                          "report this with the output of `appliance doctor`")]
        return [Check(**row) for row in rows]

    # models that run on the CPU next to the LLM
    def check_voice(self) -> Check:
        from .speech import Tts

        v = self.cfg.voice
        t0 = time.perf_counter()
        try:
            tts = Tts(v.model, length_scale=v.length_scale, volume=v.volume)
        except UserError as exc:
            problem, fix = _split_fix(str(exc))
            return Check("piper voice", FAIL, problem, fix)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        audio = np.concatenate(list(tts.synthesize("The appliance can speak.")) or [np.zeros(0, np.float32)])
        synth_s = time.perf_counter() - t0
        if not len(audio):
            return Check("piper voice", FAIL, f"{tts.model_path.name}: loads but produced no audio",
                         "check voice.model is a Piper voice for a language with an espeak-ng voice")
        rtf = synth_s / (len(audio) / tts.sample_rate)
        detail = f"{tts.model_path.name}: {tts.sample_rate} Hz, loaded in {load_s:.1f} s, RTF {rtf:.2f}"
        if rtf >= 1.0:
            return Check("piper voice", WARN, detail + " (slower than real time)",
                         "use a smaller voice (*-low or *-medium), or lower model.n_threads to leave it a core")
        return Check("piper voice", PASS, detail)

    def check_vad(self) -> Check:
        from .vad import SileroVad, WINDOW

        t0 = time.perf_counter()
        try:
            vad = SileroVad()
        except UserError as exc:
            problem, fix = _split_fix(str(exc))
            return Check("vad", FAIL, problem, fix)
        load_s = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        windows = (rng.standard_normal((32, WINDOW)) * 0.01).astype(np.float32)  # ~1 s of low noise
        vad.probability(windows[0])  # the first run allocates
        t0 = time.perf_counter()
        for w in windows[1:]:
            vad.probability(w)
        ms = (time.perf_counter() - t0) * 1000.0 / (len(windows) - 1)
        detail = f"Silero loaded in {load_s:.2f} s; {ms:.2f} ms per {VAD_WINDOW_MS:.0f} ms window"
        if ms >= VAD_WINDOW_MS:
            return Check("vad", FAIL, detail + " (slower than real time)",
                         "the CPU is saturated: lower model.n_threads, check `top`")
        if ms >= VAD_WINDOW_MS / 2:
            return Check("vad", WARN, detail + " (little headroom)", "lower model.n_threads to leave the VAD a core")
        return Check("vad", PASS, detail)

    def check_end_of_turn(self) -> Check:
        """Smart Turn loads (the pinned file from pipecat-ai) and how long one call takes (features included)."""
        if self.cfg.vad.end_of_turn != "smart_turn":
            return Check("end of turn", SKIP, f"vad.end_of_turn is {self.cfg.vad.end_of_turn}: the silence rule")
        from .eot import SmartTurn

        try:
            model = SmartTurn()
        except UserError as exc:
            problem, fix = _split_fix(str(exc))
            return Check("end of turn", FAIL, problem, fix)
        speech = (np.random.default_rng(0).standard_normal(3 * MODEL_RATE) * 0.01).astype(np.float32)
        model.probability(speech)  # the first run allocates
        model.probability(speech)
        ms = model.infer_ms[-1]
        detail = f"Smart Turn v3.2: {ms:.0f} ms per call (at most two per pause)"
        if ms >= 200:
            return Check("end of turn", WARN, detail + " (slow: each answer waits for it)",
                         "lower model.n_threads to leave it a core, or set vad.end_of_turn: silence")
        return Check("end of turn", PASS, detail)

    # listening mode and the stop behaviour
    def check_listening(self) -> Check:
        """How the appliance decides to answer (``listen``) and what a stop command does."""
        c = self.cfg
        stop = ("a stop command alone (\"Stop.\", \"Wait, stop.\", \"Never mind.\") stops the reply and starts "
                "no new one" if c.interruption.stop_words_only_silence else
                "a stop command stops the reply and is answered (interruption.stop_words_only_silence: false)")
        if c.listen.mode == "always":
            return Check("listening", PASS, f"listen.mode always: answers anyone who speaks; {stop}")
        from .wake import WakeWordDetector

        try:
            det = WakeWordDetector(c.listen.wake_word)
        except UserError as exc:
            problem, fix = _split_fix(str(exc))
            return Check("listening", FAIL, problem, fix)
        det.process(np.zeros(16000, np.float32))  # 1 s of silence: the detector's cost
        ms = det.compute_s / det.audio_s * 1000.0
        detail = (f"listen.mode wake_word: answers after '{det.phrase}', and for {c.listen.follow_up_s:g} s after "
                  f"each reply without it (a barge-in never needs it); detector {ms:.1f} ms per second of audio; "
                  f"{stop}")
        if ms >= 500.0:
            return Check("listening", WARN, detail + " (little headroom)", "the CPU is saturated: check `top`")
        return Check("listening", PASS, detail)

    # GPIO
    def check_gpio(self) -> Check:
        g = self.cfg.gpio
        if not g.enabled:
            return Check("gpio", SKIP, "gpio.enabled is false")
        pins: dict[int, str] = {}
        for name in type(g).model_fields:  # *_pin, *_pins and maps of pins (state_leds)
            value = getattr(g, name)
            if name.endswith("_pin") or name.endswith("_pins"):
                for p in value if isinstance(value, (list, tuple)) else [value]:
                    if p is not None:
                        pins[int(p)] = name
            elif isinstance(value, dict) and value and all(type(v) is int for v in value.values()):
                for key, p in value.items():
                    pins[int(p)] = f"{name}.{key}"
        if not pins:
            return Check("gpio", PASS, "no pins configured")
        import warnings

        from gpiozero import InputDevice
        from gpiozero.exc import BadPinFactory, GPIOPinInUse

        busy, free = [], []
        for pin, name in sorted(pins.items()):
            try:
                with warnings.catch_warnings():  # gpiozero warns for each backend it falls back from
                    warnings.simplefilter("ignore")
                    dev = InputDevice(pin, pin_factory=self.pin_factory)
                dev.close()
                free.append(f"{pin} ({name})")
            except BadPinFactory as exc:
                return Check("gpio", FAIL, f"no GPIO here ({exc})", "on a machine without GPIO set gpio.enabled: "
                             "false; on a Pi: sudo apt-get install python3-lgpio")
            except GPIOPinInUse:
                busy.append(f"{pin} ({name}): in use in this process")
            except Exception as exc:  # lgpio.error "GPIO busy" from another process, ...
                busy.append(f"{pin} ({name}): {exc}")
        if busy:
            detail = "busy: " + "; ".join(busy) + (f"; free: {', '.join(free)}" if free else "")
            if self.service == "active":
                return Check("gpio", WARN, detail + " (the appliance service is running and holds its pins)",
                             "to test the pins: sudo systemctl stop appliance, then run doctor again")
            return Check("gpio", FAIL, detail, "another program holds the pin (`gpioinfo` shows which): stop it, "
                         "or choose another pin in the gpio section")
        return Check("gpio", PASS, "free: " + ", ".join(free))

    # disk and clock
    def check_disk(self) -> Check:
        state = Path(self.cfg.storage.state_dir)
        probe = state
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        usage = shutil.disk_usage(probe)
        free = f"{_mib(usage.free)} free on {probe}"
        if not state.exists():
            return Check("disk", FAIL, f"{state}: does not exist ({free})",
                         f"sudo install -d -o appliance -g appliance -m 750 {state}")
        if not state.is_dir():
            return Check("disk", FAIL, f"{state}: not a directory", "set storage.state_dir to a directory")
        if usage.free < DISK_FAIL:
            return Check("disk", FAIL, f"{state}: {free}", "free space: `sudo journalctl --vacuum-size=50M`, "
                         "remove old files under it")
        if usage.free < DISK_WARN:
            return Check("disk", WARN, f"{state}: {free}", "free some space soon (`du -sh /var/lib/appliance/*`)")
        return Check("disk", PASS, f"{state}: {free}")

    def check_clock(self) -> Check:
        now = _dt.datetime.now(_dt.timezone.utc)
        synced = None
        if shutil.which("timedatectl"):
            try:
                r = subprocess.run(["timedatectl", "show", "-p", "NTPSynchronized", "--value"],
                                   capture_output=True, text=True, timeout=5)
                if r.returncode == 0 and r.stdout.strip() in ("yes", "no"):
                    synced = r.stdout.strip() == "yes"
            except (OSError, subprocess.TimeoutExpired):
                pass
        detail = f"{now:%Y-%m-%d %H:%M} UTC, NTP synchronised: {'unknown' if synced is None else 'yes' if synced else 'no'}"
        if now < CLOCK_FLOOR:
            return Check("clock", FAIL, detail + " (before 2025: never set)",
                         "connect to a network once (systemd-timesyncd sets it), or `sudo date -s 'YYYY-MM-DD HH:MM'`")
        if synced is False:
            return Check("clock", WARN, detail, "timestamps in the history may drift: connect to a network, "
                         "or add an RTC battery")
        return Check("clock", PASS, detail)

    def check_service(self) -> Check:
        if self.service is None:
            return Check("service", SKIP, "no systemd here")
        if self.service == "active":
            return Check("service", PASS, "appliance.service is active")
        if self.service == "failed":
            return Check("service", FAIL, "appliance.service has failed",
                         "see `journalctl -u appliance -n 50`; fix the fails above, then `sudo systemctl restart appliance`")
        return Check("service", WARN, f"appliance.service is {self.service}", "sudo systemctl start appliance")


# --- audio, in a child process ------------------------------------------------------------------------

def _audio_checks(params: dict) -> list[Check]:
    """The sound-device rows: input and output found, the rate and channels each stream would open at
    (the service's own choice, :func:`appliance.audio.device.probe_format`), and a capture that is not
    digital silence. Runs in the ``--audio-worker`` child."""
    from .audio.device import DeviceNotFound, default_devices, import_sounddevice, match_device, probe_format, query_devices

    try:
        sd = import_sounddevice()
    except UserError as exc:
        problem, fix = _split_fix(str(exc))
        return [Check("audio", FAIL, problem, fix)]
    devices = query_devices(sd)
    if not devices:
        fix = ("connect the USB sound card or HAT (check `arecord -l` and `aplay -l`; a HAT needs its "
               "dtoverlay in /boot/firmware/config.txt)")
        return [Check("audio input", FAIL, "no sound devices found", fix),
                Check("audio output", FAIL, "no sound devices found", fix),
                Check("capture", SKIP, "no input device")]
    defaults = default_devices(sd)
    rows, opened = [], {}
    for n, kind in enumerate(("input", "output")):
        name = params[kind]
        try:
            dev = match_device(devices, name, kind, defaults[n])
        except DeviceNotFound as exc:
            problem, fix = _split_fix(str(exc))
            rows.append(Check(f"audio {kind}", FAIL, problem, fix))
            continue
        check = sd.check_input_settings if kind == "input" else sd.check_output_settings
        ok = []
        for rate in sorted(set(COMMON_RATES) | {int(dev["default_samplerate"])}):
            try:
                check(device=dev["index"], samplerate=rate, channels=1, dtype="float32")
                ok.append(rate)
            except Exception:  # PortAudioError/ValueError: not supported
                pass
        channels = dev[f"max_{kind}_channels"]
        detail = (f"'{dev['name']}' (#{dev['index']}, {dev['hostapi']}, for '{name}'): {channels} ch, "
                  f"mono at {', '.join(str(r) for r in ok) or 'no common rate'} Hz")
        try:
            rate, ch = probe_format(sd, dev, kind)
        except RuntimeError as exc:
            rows.append(Check(f"audio {kind}", FAIL, f"{detail}; {exc}",
                              f"pick another device in audio.{kind} (`appliance devices` lists them)"))
            continue
        opened[kind] = (dev, rate, ch)
        rows.append(Check(f"audio {kind}", PASS, f"{detail}; opens at {rate} Hz x{ch}"))
    if "input" not in opened:
        rows.append(Check("capture", SKIP, "no input device"))
    else:
        rows.append(_capture_row(sd, *opened["input"], params["capture_s"], params.get("service")))
    return rows


def _capture_row(sd, dev: dict, rate: int, channels: int, seconds: float, service: Optional[str]) -> Check:
    blocks: list[np.ndarray] = []
    done = threading.Event()
    want = int(rate * seconds)

    def on_input(indata, frames, time_info, status):
        blocks.append(indata.mean(axis=1).copy())
        if sum(len(b) for b in blocks) >= want:
            done.set()

    try:
        with sd.InputStream(device=dev["index"], samplerate=rate, channels=channels, dtype="float32",
                            callback=on_input):
            got = done.wait(seconds + 3.0)
    except Exception as exc:  # sounddevice.PortAudioError and friends
        if service == "active":
            return Check("capture", WARN, f"cannot open the input ({exc}); the appliance service is running and "
                         "holds it", "sudo systemctl stop appliance, run doctor, then sudo systemctl start appliance")
        return Check("capture", FAIL, f"cannot open the input: {exc}",
                     "is another program recording? (`fuser -v /dev/snd/*`); check `arecord -l`")
    if not got:
        return Check("capture", FAIL, f"the input delivered {sum(len(b) for b in blocks)} of {want} samples in "
                     f"{seconds + 3.0:.0f} s", "the device stalls: replug it, or pick another in audio.input")
    x = np.concatenate(blocks)[:want].astype(np.float64)
    peak = float(np.max(np.abs(x)))
    rms = float(np.sqrt(np.mean(x ** 2)))
    db = lambda v: "-inf" if v <= 0 else f"{20 * np.log10(v):.1f}"  # noqa: E731
    detail = f"{seconds:.1f} s at {rate} Hz: RMS {db(rms)} dBFS, peak {db(peak)} dBFS"
    if peak < SILENCE_PEAK:
        return Check("capture", FAIL, detail + " (digital silence)",
                     "the microphone sends nothing: is it plugged in, its capture switch on and gain up "
                     "(`alsamixer`, F4)?")
    if peak >= 0.999:
        return Check("capture", WARN, detail + " (clipping)", "lower the capture gain in `alsamixer` (F4)")
    return Check("capture", PASS, detail)


def _audio_worker_main(argv: list[str]) -> None:
    rows = _audio_checks(json.loads(argv[0]))
    print(json.dumps([asdict(r) for r in rows]))
    sys.stdout.flush()
    os._exit(0)  # no Pa_Terminate: it can hang on a half-dead sound server


def run(config_path: Optional[str | Path] = None, embedded: bool = False, checksums: bool = False,
        capture_s: float = 1.0, pin_factory=None) -> list[Check]:
    """Run every check; see :class:`Doctor`."""
    return Doctor(config_path, embedded, checksums, capture_s, pin_factory).run()


def exit_status(checks: list[Check]) -> int:
    """2 if any check failed, else 0."""
    return 2 if any(c.status == FAIL for c in checks) else 0


def format_table(checks: list[Check]) -> str:
    """The table: one row per check, and a ``fix:`` line under each fail and warn."""
    width = max(len(c.name) for c in checks) if checks else 5
    lines = [f"{'check':{width}}  {'result':6}  detail"]
    for c in checks:
        lines.append(f"{c.name:{width}}  {c.status.upper():6}  {c.detail}")
        if c.fix and c.status in (FAIL, WARN):
            lines.append(f"{'':{width}}  {'':6}  fix: {c.fix}")
    counts = {s: sum(1 for c in checks if c.status == s) for s in (PASS, WARN, FAIL, SKIP)}
    total_s = sum(c.seconds for c in checks)
    lines.append(f"{len(checks)} checks: {counts[PASS]} pass, {counts[WARN]} warn, {counts[FAIL]} fail, "
                 f"{counts[SKIP]} skipped ({total_s:.1f} s)")
    return "\n".join(lines)


def to_json(checks: list[Check]) -> str:
    return json.dumps([asdict(c) for c in checks], indent=2)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--audio-worker":
        _audio_worker_main(sys.argv[2:])
    print("usage: python -m appliance.doctor --audio-worker PARAMS_JSON (use `appliance doctor`)", file=sys.stderr)
    sys.exit(2)
