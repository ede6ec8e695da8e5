"""The one assembly: :class:`Session` builds every part of the appliance from the config, wires them to an
audio port and to the observers, starts and stops their threads, and applies a reloaded config.

``appliance run`` (:mod:`appliance.service`), ``appliance replay`` (:mod:`appliance.replay`) and the
interruption benchmark (:func:`appliance.bench.interruption.run_case`) differ only in the
:class:`~appliance.audio.port.AudioPort` they hand it, built by :func:`appliance.audio.backends.open_port`:
:class:`~appliance.audio.device.DeviceAudio` (the sound devices), :class:`~appliance.audio.room.RoomPort`
(the simulated room) or :class:`~appliance.audio.port.NullPort` (a test reads the playback buffer itself).

This is its own module rather than part of :mod:`appliance.pipeline` so that the parts (pipeline.py: the
listener, the TTS worker, the timeline, the loaded models) import nothing that assembles them, and the
assembly, its ports and its reload read in one place.

Data flow::

    port ──capture(mic, far)──► Listener (echo canceller, VAD, wake word) ──post──► Conversation
    Conversation ──► EngineWorker ──clauses──► TtsWorker ──► Playback ◄──take(n)── port (fades there)
    Conversation ──records──► observers (LEDs, timeline, metrics, the mute store, the listener: a pause that was
                              not speech, to the canceller; port.observe: the room)
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Iterable, Optional

from .audio.port import AudioPort
from .config import Config
from .conversation import Conversation, State
from .errors import UserError
from .events import Ev
from .pipeline import Listener, Parts, TtsWorker, load_end_of_turn
from .playback import Playback
from .vad import VadSegmenter

log = logging.getLogger(__name__)

Observer = Callable[[dict], None]


class Session:
    """One running appliance around loaded :class:`~appliance.pipeline.Parts`: the one place that builds the
    echo canceller (:meth:`build_echo`), the VAD's segmenter, the conversation and its workers, and wires
    the observers.

    :param cfg: the validated config.
    :param parts: the loaded models (the session swaps in a reloaded voice or end-of-turn model).
    :param port: the audio backend, not started yet; the session starts it in :meth:`start` with the playback
        buffer's ``take``, the listener's ``capture``, :meth:`on_port` and :meth:`settled`, reads its ``rate``
        (the playback buffer's) and ``clock`` (the timeline's), subscribes its ``observe``, hands it
        ``interruption.fade_ms`` and the ``audio`` section on reload, and stops it in :meth:`stop`.
    :param observers: each ``observer(record)`` is subscribed to the conversation, in this order, then the
        listener's and the port's. An observer with a ``section`` attribute (``"gpio"``, ``"storage"``) is handed that config
        section by :meth:`apply` through its ``configure(section)``.
    :param muted: the mute switch at start (the service's persisted one).
    :param keep_turns: keep only the newest this many turns' metrics (None: all).
    :param transcript_at: ``f(sample) -> text`` (a scenario's transcript, for a text-only model).
    :param echo: a canceller to go on with (the benchmark's, warm from earlier cases); None: a new one from
        ``cfg.echo`` (:meth:`build_echo`).
    :param record_echo: a new canceller keeps its gate logs (the benchmark reads them).
    """

    def __init__(self, cfg: Config, parts: Parts, port: AudioPort, observers: Iterable[Observer] = (), *,
                 muted: bool = False, keep_turns: Optional[int] = None,
                 transcript_at: Optional[Callable[[int], Optional[str]]] = None, echo=None,
                 record_echo: bool = False):
        from .assistant import turn_context_source
        from .speech import SpokenReply
        from .engine import EngineWorker
        from .turns import turn_taker_from_config
        from .wake import detector_from_config

        self.cfg = cfg
        self.parts = parts
        self.port = port
        self.observers = list(observers)
        self.record_echo = record_echo
        self._opened = False
        self.playback = Playback(port.rate, on_event=self._post, port=port)
        self.engine_worker = EngineWorker(parts.engine, post=self._post, on_clause=self._on_clause, split=SpokenReply)
        self.engine_worker.configure(context=turn_context_source(cfg))
        self.conversation = Conversation(self.playback, self.engine_worker, turn_taker_from_config(cfg),
                                         clock=port.clock, muted=muted, keep_turns=keep_turns,
                                         turn_stats=port.stats)
        self._configure_conversation(cfg)
        self.tts_worker = TtsWorker(parts.tts, self.playback, self._post, lambda: self.conversation.current_reply_id)
        parts.vad.reset()
        self.segmenter = VadSegmenter(parts.vad)
        conv = self.conversation
        replying = (State.THINKING, State.SPEAKING, State.INTERRUPTED)
        self.listener = Listener(self.segmenter, self._post, transcript_at=transcript_at,
                                 muted=lambda: conv.muted, interjecting=lambda: conv.interjecting,
                                 replying=lambda: conv.state in replying)
        self.listener.configure(vad=cfg.vad, interruption=cfg.interruption, end_of_turn=self._end_of_turn(cfg),
                                wake=detector_from_config(cfg),
                                echo=echo if echo is not None else self.build_echo(cfg), **self._stream(parts.engine, cfg.model))
        for observer in [*self.observers, self.listener.observe, port.observe]:  # the one place observers are wired
            conv.subscribe(observer)

    # --- the parts' builders (each the only one of its kind) ---
    def build_echo(self, cfg: Config):
        """A new, cold echo canceller from ``cfg.echo`` (None when disabled).

        :raises UserError: the backend's package is missing.
        """
        from .audio.echo import from_config

        return from_config(cfg, record=self.record_echo)

    def _stream(self, engine, model_section) -> dict:
        """The listener's streamed pre-fill settings for ``engine``: a feed only for a model that hears and
        has ``model.stream_prefill`` on."""
        feed = self._stream_audio if engine.hears_audio and engine.stream_prefill else None
        return {"stream": feed, "stream_step_ms": model_section.stream_step_ms}

    def _stream_audio(self, pcm, at_pause: bool = False) -> None:
        """The listener's feed (its thread): the utterance so far (float32 mono 16 kHz) to the engine, only
        while listening (not over a reply; the conversation's state, read, not copied)."""
        if self.conversation.state is State.LISTENING:
            self.engine_worker.stream_audio(pcm, at_pause)

    def _end_of_turn(self, cfg: Config):
        use = cfg.vad.end_of_turn == "smart_turn" and self.parts.eot is not None
        return self.parts.eot.probability if use else None

    def _configure_conversation(self, cfg: Config, turn_taker=None) -> None:
        self.conversation.configure(turn_taker=turn_taker, stop_words_only_silence=cfg.interruption.stop_words_only_silence,
                                    listen_mode=cfg.listen.mode, follow_up_s=cfg.listen.follow_up_s,
                                    min_silence_ms=cfg.vad.min_silence_ms)

    # Indirections so that the workers can be built before the conversation exists.
    def _post(self, name, **info) -> None:
        self.conversation.post(name, **info)

    def _on_clause(self, reply_id: int, text: Optional[str]) -> None:
        self.tts_worker.on_clause(reply_id, text)

    # --- the port's reports ---
    def on_port(self, kind: str, info: dict) -> None:
        """The audio backend's status: ``open`` (the first: ``ready``; later: a reopened device, so a new echo
        path and a new, cold canceller, and ``recovered``), ``lost``, ``unavailable``."""
        if kind == "open":
            if not self._opened:
                self._opened = True
                self._post(Ev.READY)
            else:
                self.listener.configure(echo=self.build_echo(self.cfg))
                self._post(Ev.RECOVERED, device=info.get("output"))
        elif kind == "lost":
            self._post(Ev.STOP_REPLY, source="device lost")
            self._post(Ev.ERROR, reason=f"sound device lost: {info.get('reason')}")
        elif kind == "unavailable" and not info.get("repeated"):
            self._post(Ev.STOP_REPLY, source="device unavailable")
            self._post(Ev.ERROR, reason=info.get("reason", "no sound device"))

    # --- life cycle ---
    def start(self) -> None:
        """Start the threads: the workers, the conversation, then the port (whose ``open`` makes it ready)."""
        self.tts_worker.start()
        self.listener.start()
        self.conversation.start()
        pb = self.playback
        self.port.start(pb.take, self.listener.capture, pb.port_silent, on_status=self.on_port, settled=self.settled)

    def settled(self) -> bool:
        """The pipeline has caught up with the audio heard so far: every block is through the VAD, the state
        machine has handled what it posted, and, while the appliance thinks or speaks, the next audio of the
        reply exists (a person would be waiting for it in real time). The unpaced room waits on this."""
        if not self.listener.idle() or not self.conversation.queue_empty():
            return False
        if self.conversation.state is State.THINKING:
            return False
        if self.conversation.state is State.SPEAKING and self.playback.pending_samples == 0:
            return False
        return True

    def stop(self) -> None:
        self.port.stop()
        self.listener.stop()
        self.engine_worker.cancel(self.conversation.current_reply_id)
        self.conversation.stop()
        self.tts_worker.stop()
        self.engine_worker.stop()

    def threads_alive(self) -> dict[str, bool]:
        th = {"conversation": self.conversation._thread, "listener": self.listener._thread,
              "engine": self.engine_worker._thread, "tts": self.tts_worker._thread}
        alive = {k: bool(t is not None and t.is_alive()) for k, t in th.items()}
        alive["audio"] = self.port.alive()
        return alive

    # --- reload ---
    def apply(self, new: Config) -> list[str]:
        """Apply a new config, whole, or change nothing: first everything that can fail (load a new voice,
        Smart Turn, PocketSphinx, the wake-word model, check the echo backend), then hand each part its
        section through its ``configure``. ``model`` is not applied here (the service loads a new model in
        the background, then :meth:`use_engine`).

        :returns: the sections that changed, in a fixed order (the gpio pins, which must be released before
            new ones are taken, are swapped last; pins that cannot be had leave the old ones working and
            show in the list as ``gpio (refused: …)``).
        :raises UserError: the new config cannot be applied; nothing changed.
        """
        old = self.cfg
        ready = self._prepare(new)
        changed = []
        if "eot" in ready:
            self.parts.eot = ready["eot"]
        if (new.vad, new.interruption) != (old.vad, old.interruption):
            self.listener.configure(vad=new.vad, interruption=new.interruption, end_of_turn=self._end_of_turn(new))
        if new.vad != old.vad:
            changed.append("vad")
        if (new.interruption, new.listen, new.vad) != (old.interruption, old.listen, old.vad):
            self._configure_conversation(new, ready.get("turn_taker"))
        if new.interruption != old.interruption:
            changed.append("interruption")
        if "wake" in ready:
            self.listener.configure(wake=ready["wake"])
            changed.append("listen")
        if new.assistant != old.assistant:
            from .assistant import turn_context_source

            self.engine_worker.configure(context=turn_context_source(new))
            changed.append("assistant (the time zone and locale now; a new system prompt at the next start)")
        if "tts" in ready:
            self.parts.tts = ready["tts"]
            self.tts_worker.configure(ready["tts"])
            changed.append("voice")
        if (new.audio, new.interruption.fade_ms) != (old.audio, old.interruption.fade_ms):
            # The fade happens at the port (a device's worker, a pull port's fader); a device reopens on
            # other names or block size.
            self.port.configure(fade_ms=new.interruption.fade_ms, audio=new.audio)
            if new.audio != old.audio:
                changed.append("audio")
        if "echo" in ready:
            self.listener.configure(echo=ready["echo"])  # a new canceller: cold, the stand-in serves until it converges
            changed.append("echo")
        for obs in self.observers:
            section = getattr(obs, "section", None)
            if section and getattr(new, section) != getattr(old, section):
                try:
                    obs.configure(getattr(new, section))
                    changed.append(section)
                except UserError as exc:
                    log.error("config reload: %s", exc)
                    changed.append(f"{section} (refused: {exc})")
        self.cfg = new.model_copy(update={"model": old.model})
        return changed

    def _prepare(self, new: Config) -> dict:
        """Everything that can fail, before anything changes; changes nothing (raises :class:`UserError`)."""
        old = self.cfg
        out: dict = {}
        if new.voice != old.voice:
            from .speech import Tts

            try:
                out["tts"] = Tts(new.voice.model, length_scale=new.voice.length_scale, volume=new.voice.volume)
            except UserError:
                raise
            except Exception as exc:
                raise UserError(f"voice: cannot load {new.voice.model} ({exc.__class__.__name__}: {exc})") from None
        if new.model != old.model:
            for key in ("gguf", "mmproj"):
                p = getattr(new.model, key)
                if key == "mmproj" and not p:
                    raise UserError("model.mmproj: a model that hears needs its audio projector; set model.mmproj")
                if p and not Path(p).is_file():
                    raise UserError(f"{p}: model.{key} not found; check the path")
        if new.vad.end_of_turn != old.vad.end_of_turn and self.parts.eot is None:
            out["eot"] = load_end_of_turn(new)  # a missing Smart Turn fails here, before anything changes
        if new.echo != old.echo:
            out["echo"] = self.build_echo(new)  # a missing backend package fails here, before anything changes
        if new.interruption != old.interruption:
            from .turns import turn_taker_from_config

            out["turn_taker"] = turn_taker_from_config(new)  # loads PocketSphinx if it is newly needed
        if new.listen != old.listen:
            from .wake import detector_from_config

            out["wake"] = detector_from_config(new)  # loads the wake-word model if it is newly needed
        return out

    def use_engine(self, engine, model_section) -> None:
        """Take over a newly loaded engine (a reloaded ``model``), with the history, on the engine thread after
        the jobs already queued."""
        worker = self.engine_worker

        def swap() -> None:
            old = worker.engine
            if not engine.history:  # (with a history store, the new engine restored it already)
                engine.adopt(old.history)  # rebuilt into the new model's cache in the background
            worker.engine = engine
            self.parts.engine = engine
            self.cfg = self.cfg.model_copy(update={"model": model_section})
            self.listener.configure(**self._stream(engine, model_section))  # the new model may not hear
            log.warning("model reloaded: %s", model_section.gguf)

        worker.call(swap)

