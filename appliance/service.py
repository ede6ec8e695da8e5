"""``appliance run``: the service systemd starts (``Type=notify``, ``WatchdogSec``).

- ``READY=1`` once the pipeline's threads run (also when no sound device is there yet: the service then
  sits in ``error``, says why in ``STATUS=``, and keeps trying to open it with back-off).
- ``WATCHDOG=1`` every ``$WATCHDOG_USEC / 2`` from the main loop, and only while the pipeline's threads
  (conversation, listener, engine, TTS, audio supervisor) are alive; a hung service is restarted by systemd.
- ``STATUS=...`` on every state change worth a look in ``systemctl status``.
- ``SIGHUP`` (``systemctl reload``) reloads config.yaml: a valid new config is applied without dropping
  the conversation (the engine keeps its history): sound devices reopened, the echo canceller rebuilt
  (cold: see audio/echo.py), VAD thresholds, barge-in
  timing, voice, LED and button pins (:meth:`appliance.session.Session.apply`); a new model loads in the
  background and takes over, with the history, when ready. An invalid config is rejected as a whole: the
  running config stays, the log says why in one line, and the LEDs show ``config_error`` for a few seconds.
  The one exception: new LED or button pins that cannot be had (in use, no such pin) once the rest has been
  applied leave the old pins working, and the log and the LEDs say so (the old pins must be released
  before new ones that overlap them can be taken, so they cannot be tried beforehand).
- The mute switch (a privacy control) is kept in ``storage.state_dir/muted`` and survives restarts.

sd_notify is the documented datagram protocol over the ``AF_UNIX`` socket in ``$NOTIFY_SOCKET``
(``sd_notify(3)``): a few lines here rather than a dependency.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Optional

from .config import DEFAULT_CONFIG_PATH, Config, load
from .errors import UserError, one_line
from .events import Ev

PLAYBACK_RATE = 48000  # the playback buffer's rate, Hz: most cards' native rate (no resampling there)

log = logging.getLogger(__name__)

CONFIG_ERROR_FLASH_S = 4.0


class Notifier:
    """sd_notify(3) over ``$NOTIFY_SOCKET``; silent when not started by systemd.

    Sends never block: a datagram the manager's queue has no room for is dropped (and counted in
    :attr:`dropped`). A blocking send to a full queue (Linux queues 10 unread datagrams per socket by
    default, ``net.unix.max_dgram_qlen``) would stall the service's main loop, and with it SIGTERM: the
    handler runs, but the loop never gets back to see it.
    """

    def __init__(self, address: Optional[str] = None):
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET")
        self.address = None
        self._sock = None
        if address:
            self.address = "\0" + address[1:] if address.startswith("@") else address
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._last_status = None
        self.dropped = 0  # datagrams not sent (the manager's queue full, or no manager there)

    def notify(self, *lines: str) -> bool:
        """Send one datagram of ``KEY=value`` lines. Returns whether it was sent."""
        if self._sock is None:
            return False
        try:
            self._sock.sendto("\n".join(lines).encode(), socket.MSG_DONTWAIT, self.address)
            return True
        except OSError as exc:  # BlockingIOError when the queue is full
            self.dropped += 1
            log.debug("sd_notify failed: %s", exc)
            return False

    def status(self, text: str) -> None:
        """``STATUS=text`` when it changed (a dropped one is sent again on the next call)."""
        if text != self._last_status and self.notify(f"STATUS={text}"):
            self._last_status = text


class MuteStore:
    """The mute switch on disk (``state_dir/muted`` holds ``1`` or ``0``): a conversation observer that
    keeps each ``mute`` change the conversation emits. The conversation owns the switch; this only
    persists it, so it survives a restart (:attr:`value` is the switch to start with)."""

    section = "storage"  # Session.apply hands this observer the config's ``storage`` section

    def __init__(self, state_dir: str | Path):
        self.path = Path(state_dir) / "muted"
        self.value = self.load()

    def __call__(self, record: dict) -> None:
        if record.get("event") == Ev.MUTE and "muted" in record:
            self.save(bool(record["muted"]))

    def configure(self, storage) -> None:
        """A new ``storage.state_dir``: keep the switch there from now on."""
        self.path = Path(storage.state_dir) / "muted"
        self.save(self.value, force=True)

    def load(self) -> bool:
        try:
            return self.path.read_text().strip() == "1"
        except OSError:
            return False

    def save(self, muted: bool, force: bool = False) -> None:
        if muted == self.value and self.path.exists() and not force:
            return
        self.value = muted
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("1\n" if muted else "0\n")
            os.replace(tmp, self.path)  # atomic: a power cut leaves the old or the new value
        except OSError as exc:
            log.error("cannot save the mute switch to %s (%s); it will not survive a restart", self.path, exc)


class Service:
    """The appliance on sound devices around loaded :class:`~appliance.pipeline.Parts`: a
    :class:`~appliance.session.Session` on the sound devices (:class:`~appliance.audio.device.DeviceAudio`
    from :func:`~appliance.audio.backends.open_port`, at :data:`PLAYBACK_RATE`), with the LEDs, the
    persisted mute switch and one metrics line per turn as observers. What is left here: the status line
    for ``STATUS=``, reload (the session applies it; the model loads here, in the background) and the
    life cycle.

    :param cfg: the validated config.
    :param parts: the loaded engine, voice and VAD (kept across reloads and device loss).
    :param pin_factory: gpiozero pin factory for the LEDs and button (``MockFactory`` in tests).
    :param indicators: a :class:`~appliance.indicators.Panel` already showing ``loading`` (from :func:`run`),
        or None to create one.
    :param timeline: an optional extra observer (the debug log's timeline; the tests' recorder).
    """

    def __init__(self, cfg: Config, parts, pin_factory=None, indicators=None, timeline=None):
        from .indicators import Panel
        from .metrics import METRICS_FILE, TurnMetrics
        from .audio.backends import open_port
        from .session import Session

        self.parts = parts
        self.indicators = indicators if indicators is not None else Panel(cfg.gpio, self._post, pin_factory)
        self.mute = MuteStore(cfg.storage.state_dir)
        observers = [self.indicators, self._observe, self.mute,
                     TurnMetrics(Path(cfg.storage.state_dir) / METRICS_FILE, keep=0)]  # one journal line per turn
        if timeline is not None:
            observers.append(timeline)
        self.port = open_port(cfg, PLAYBACK_RATE, "device")
        # The service runs for months: no list of every turn.
        self.session = Session(cfg, parts, self.port, observers, muted=self.mute.value, keep_turns=100)
        self.status = "starting"
        self.reloads: list[dict] = []
        self.reload_problem: Optional[str] = None  # why the last reload was refused (shown in STATUS=)
        self._model_thread: Optional[threading.Thread] = None

    @property
    def cfg(self) -> Config:
        return self.session.cfg

    @property
    def audio(self):
        """The sound devices (:class:`~appliance.audio.device.DeviceAudio`, the session's port)."""
        return self.port

    def _post(self, name, **info) -> None:
        self.session.conversation.post(name, **info)

    def _observe(self, record: dict) -> None:
        if record.get("event") == Ev.STATE:
            s = record["state"]
            self.status = f"{s}: {record['reason']}" if s == "error" and record.get("reason") else s

    # --- life cycle ---
    def start(self) -> None:
        self.session.start()

    def stop(self) -> None:
        self.session.stop()
        self.indicators.close()

    def threads_alive(self) -> dict[str, bool]:
        return self.session.threads_alive()

    def healthy(self) -> bool:
        return all(self.threads_alive().values())

    # --- reload ---
    def reload(self, path: str | Path) -> bool:
        """Re-read the config file and apply it whole (:meth:`Session.apply`), or reject it whole. A new
        ``model`` loads in the background and takes over when ready. Returns True if applied."""
        old = self.cfg
        try:
            new = load(path)
            changed = self.session.apply(new)
        except Exception as exc:  # whatever is wrong with the file, the running service keeps its config
            reason = str(exc) if isinstance(exc, UserError) else one_line(f"{path}: {exc.__class__.__name__}: {exc}")
            log.error("config reload rejected, keeping the running config: %s", reason)
            self.indicators.flash("config_error", CONFIG_ERROR_FLASH_S)
            self.reloads.append({"applied": False, "reason": reason})
            self.reload_problem = f"config reload rejected, running on the previous config: {reason}"
            return False
        self.reload_problem = None
        if any("refused" in c for c in changed):
            self.indicators.flash("config_error", CONFIG_ERROR_FLASH_S)
        if new.model != old.model:
            self._reload_model(new)
            changed.append("model (loading in the background)")
        log.info("config reloaded from %s (changed: %s)", path, ", ".join(changed) or "nothing")
        self.reloads.append({"applied": True, "changed": changed})
        return True

    def _reload_model(self, new: Config) -> None:
        from .engine import Engine
        from .pipeline import Parts

        def work() -> None:
            try:
                parts = Parts.load(new.model_copy(update={"voice": self.cfg.voice}))
                engine: Engine = parts.engine
                if not engine.hears_audio:
                    raise UserError(f"{new.model.gguf}: this model cannot hear (no audio projector)")
            except Exception as exc:
                log.error("model reload failed, keeping the running model: %s", exc)
                self.indicators.flash("config_error", CONFIG_ERROR_FLASH_S)
                return
            self.session.use_engine(engine, new.model)

        self._model_thread = threading.Thread(target=work, name="model-reload", daemon=True)
        self._model_thread.start()


def run(cfg: Config, config_path: Optional[str | Path] = None, pin_factory=None) -> int:
    """The service loop, until SIGTERM/SIGINT. Returns the exit code."""
    from .engine import text_only_refusal
    from .indicators import Panel
    from .pipeline import Timeline

    logging.getLogger("appliance").setLevel(min(logging.getLogger("appliance").getEffectiveLevel(), logging.INFO))
    if not cfg.model.mmproj:
        raise text_only_refusal(Path(cfg.model.gguf))
    if config_path is None and DEFAULT_CONFIG_PATH.exists():
        config_path = DEFAULT_CONFIG_PATH
    notifier = Notifier()
    stop = threading.Event()
    hup = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    signal.signal(signal.SIGHUP, lambda *a: hup.set())

    post_box: list = []
    early = Panel(cfg.gpio, lambda name, **info: post_box and post_box[0](name, **info), pin_factory)
    wd_usec = os.environ.get("WATCHDOG_USEC")
    wd_pid = os.environ.get("WATCHDOG_PID")
    interval = None
    if wd_usec and (not wd_pid or wd_pid == str(os.getpid())):
        interval = max(0.05, int(wd_usec) / 2e6)
    loaded = _load_parts_or_wait(cfg, config_path, early, notifier, stop, hup, interval)
    if loaded is None:  # stopped while waiting for a model
        notifier.notify("STOPPING=1")
        early.close()
        return 0
    parts, cfg = loaded
    # The full event timeline goes to the debug log (`appliance -v run`); the journal gets one metrics
    # line per turn.
    svc = Service(cfg, parts, pin_factory=pin_factory, indicators=early,
                  timeline=Timeline(echo=lambda line: log.debug("%s", line), keep=False))
    post_box.append(svc._post)
    svc.start()
    notifier.notify("READY=1", f"STATUS={svc.status}")
    next_ping = 0.0
    try:
        while not stop.is_set():
            stop.wait(min(interval or 1.0, 1.0))
            if hup.is_set():
                hup.clear()
                notifier.notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
                if config_path is None:
                    log.error("config reload: no config file to reload (started without --config)")
                else:
                    svc.reload(config_path)
                notifier.notify("READY=1")
            notifier.status(f"{svc.status}; {svc.reload_problem}" if svc.reload_problem else svc.status)
            if interval is not None and time.monotonic() >= next_ping:
                alive = svc.threads_alive()
                if all(alive.values()):
                    notifier.notify("WATCHDOG=1")
                    next_ping = time.monotonic() + interval
                else:
                    dead = ", ".join(k for k, v in alive.items() if not v)
                    notifier.status(f"pipeline thread(s) died: {dead}; waiting for the watchdog")
    finally:
        notifier.notify("STOPPING=1")
        svc.stop()
    return 0


def _load_parts_or_wait(cfg: Config, config_path, indicators, notifier, stop: threading.Event,
                        hup: threading.Event, watchdog_s: Optional[float]):
    """Load the models. If they are missing or unusable (an image built with ``--no-models``, a typo in
    ``model.gguf``), stay up in a clear "no model" state instead of exiting: the error LED, one journal
    line with the fix, ``READY=1`` with that status (so systemd does not restart-loop), the watchdog kept
    alive, and a new attempt when the files change or on SIGHUP (``systemctl reload appliance``).

    :returns: ``(parts, cfg)``: the loaded :class:`~appliance.pipeline.Parts` and the config they were
        loaded with (a reload while waiting may have changed it), or None if stopped.
    """
    from .config import load
    from .engine import text_only_refusal
    from .pipeline import Parts
    from .progress import Progress

    announced = False
    last_seen = None
    while not stop.is_set():
        indicators.show("loading")
        notifier.status(f"loading {Path(cfg.model.gguf).name}")
        try:
            with Progress(f"loading {Path(cfg.model.gguf).name}"):
                parts = Parts.load(cfg)
            if not parts.engine.hears_audio:
                raise text_only_refusal(Path(cfg.model.gguf))
            if announced:
                log.warning("model loaded: %s", cfg.model.gguf)
            return parts, cfg
        except UserError as exc:
            reason = str(exc)
        except Exception as exc:  # llama.cpp or the voice failing in a way we did not foresee: wait, do not crash
            log.debug("model load failed", exc_info=True)
            reason = one_line(f"{cfg.model.gguf}: cannot load ({exc.__class__.__name__}: {exc})")
        indicators.show("error")
        log.error("no model: %s (waiting; `systemctl reload appliance` after fixing it)", reason)
        if not announced:
            notifier.notify("READY=1")
            announced = True
        notifier.status(f"no model: {reason}")
        last_seen = _model_files_stamp(cfg)
        while not stop.is_set():
            stop.wait(min(watchdog_s or 2.0, 2.0))
            if watchdog_s is not None:
                notifier.notify("WATCHDOG=1")
            if hup.is_set():
                hup.clear()
                if config_path is not None:
                    try:
                        new = load(config_path)
                        if not new.model.mmproj:
                            raise text_only_refusal(Path(new.model.gguf))
                        cfg = new
                    except Exception as exc:
                        log.error("config reload rejected: %s", exc if isinstance(exc, UserError) else one_line(
                            f"{config_path}: {exc.__class__.__name__}: {exc}"))
                        continue
                break
            if _model_files_stamp(cfg) != last_seen:
                break
    return None


def _model_files_stamp(cfg: Config) -> tuple:
    """What changes when a model file is copied in, replaced or removed."""
    stamp = []
    for p in (cfg.model.gguf, cfg.model.mmproj):
        try:
            st = Path(p).stat() if p else None
            stamp.append((st.st_size, st.st_mtime_ns) if st else None)
        except OSError:
            stamp.append(None)
    return tuple(stamp)
