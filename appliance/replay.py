"""``appliance replay``: the whole pipeline driven by the simulated room instead of sound devices.

Writes ``DIR/reply.wav`` (everything the appliance said, on the input's timeline, 16 kHz),
``DIR/timeline.jsonl`` and ``DIR/report.json`` (per-turn latencies in ms).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from .audio.backends import open_port
from .audio.files import MAX_SECONDS, MODEL_RATE, first_above, write_wav
from .audio.room import Scenario
from .config import Config
from .errors import UserError
from .events import Ev
from .pipeline import Parts, Timeline
from .session import Session

SILENT_PEAK = 10 ** (-50 / 20)  # below -50 dBFS peak counts as silence


def load_input(path: str | Path, transcript: Optional[str] = None) -> Scenario:
    """A scenario YAML, or a WAV (any rate, mono or stereo) played at 0.5 s, with ``transcript`` as its
    text (used only by a model that cannot hear)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: is a directory; give a WAV of speech or a scenario .yaml")
    if path.suffix.lower() in (".yaml", ".yml"):
        if transcript is not None:  # it would be silently ignored: a scenario's words are in its events
            raise UserError(f"{path}: --transcript is for a WAV input; in a scenario, give each event's words as its "
                            "`text:` (see the scenario format in docs/replay.md), and drop --transcript")
        return Scenario.load(path)
    scenario = Scenario.from_wav(path, text=transcript)
    if first_above(scenario.events[0].audio, -40.0) < 0:
        if _duration_s(path) > MAX_SECONDS:  # what comes after 180 s was never read: say so, not "no speech"
            raise UserError(f"{path}: holds no speech in its first {MAX_SECONDS:.0f} s (no sample above -40 dBFS), and a "
                            f"replay hears at most the first {MAX_SECONDS:.0f} s; cut the file so the speech starts "
                            "in them")
        raise UserError(f"{path}: holds no speech (no sample above -40 dBFS); give a recording of someone speaking")
    return scenario


OUTPUTS = ("reply.wav", "timeline.jsonl", "report.json", "metrics.jsonl")  # what a replay writes into --out


def check_outputs(scenario: Scenario, input_path: str | Path, out_dir: str | Path) -> None:
    """Refuse a replay that would overwrite its own input: ``input_path`` (a WAV or the scenario) or a file the
    scenario reads (say, noise, impulse response) is one of :data:`OUTPUTS` in ``out_dir``. Call it before
    anything is created or removed.

    :raises UserError: one line naming the file and the fix.
    """
    outputs = {(Path(out_dir) / name).resolve(): name for name in OUTPUTS}
    for f in [Path(input_path), *scenario.files]:
        name = outputs.get(f.resolve())
        if name is not None:
            raise UserError(f"{f}: the replay would overwrite it with its {name}; give another --out DIR, or move "
                            "the file out of it")


CLIPPED_LEVEL = 0.98  # |sample| at or above this (of full scale) counts as clipped
CLIPPED_FRACTION = 0.02  # this share of a file's speech samples (above -40 dBFS) clipped: too loud to be heard


def clipped_fraction(audio: np.ndarray) -> float:
    """The share of ``audio``'s samples above −40 dBFS (float, full scale 1.0) that sit at full scale
    (≥ :data:`CLIPPED_LEVEL`), 0.0–1.0; 0.0 when none are above −40 dBFS."""
    loud = np.abs(audio[np.abs(audio) >= 0.01])
    return float(np.mean(loud >= CLIPPED_LEVEL)) if len(loud) else 0.0


def unheard_fix(scenario: Scenario, fragments_ms: list[float]) -> str:
    """What to tell the user when a replay whose input holds speech got no answer: the input is clipped
    (:data:`CLIPPED_FRACTION` of some utterance's speech at full scale), or the VAD heard only fragments shorter
    than ``vad.min_speech_ms`` (``fragments_ms``: their lengths, ms, the report's ``vad_rejects_ms``), else
    "louder"."""
    clipped = max((clipped_fraction(e.audio) for e in scenario.events if e.speech), default=0.0)
    fragments = list(fragments_ms)
    heard = (f"the VAD heard only {len(fragments)} short fragment(s) "
             f"({', '.join(f'{ms:.0f}' for ms in fragments if ms is not None)} ms), each shorter than vad.min_speech_ms"
             if fragments else "")
    if clipped >= CLIPPED_FRACTION:
        return (f"{clipped:.0%} of its speech is clipped (at full scale){', and ' + heard if heard else ''}; record it "
                "again at a lower level")
    if heard:
        return f"{heard}; give a recording with longer stretches of speech, or lower vad.min_speech_ms"
    return "give a recording of someone speaking, louder if need be"


def _duration_s(path: Path) -> float:
    """The audio file's length, s, from its header (0.0 when the header does not say)."""
    import soundfile as sf

    try:
        info = sf.info(str(path))
        return info.frames / info.samplerate if info.samplerate else 0.0
    except Exception:  # it was read a moment ago; a header that will not say is not this check's error
        return 0.0


def audible_until_ms(output: np.ndarray, onset_t: float, detected_ms: float) -> float:
    """Barge-in latency from the recorded output, ms: the end of the last output sample above −50 dBFS
    between the speech onset and 100 ms after the pause decision, relative to the onset (0 when the reply
    was already silent). Unlike the first 20 ms of silence after the onset, a natural pause of the reply
    (between clauses or words) that ends before the pause takes hold does not count as the barge-in."""
    start = int(onset_t * MODEL_RATE)
    stop = int((onset_t + max(0.0, detected_ms) / 1000.0 + 0.1) * MODEL_RATE)
    loud = np.nonzero(np.abs(output[start:stop]) >= SILENT_PEAK)[0]
    return round((int(loud[-1]) + 1) * 1000.0 / MODEL_RATE, 1) if len(loud) else 0.0


SPEECH_SLACK_S = 0.1  # an onset this far outside the injected file's speech (s) is not that speech's


def pauses(records: list[dict]) -> list[dict]:
    """Each ``interrupted`` event (the reply paused) with what caused it, from the timeline alone.

    A pause is the user's when the VAD onset behind it lies in the microphone's time (``audio_t``, s, the
    room's clock) within an injected utterance, ±:data:`SPEECH_SLACK_S`; otherwise the reply paused on its own
    voice (echo) or a noise with nobody speaking. Timelines written before ``interrupted`` carried ``audio_t``
    fall back to the last ``vad_onset`` before the pause, and then to "the last utterance that began".

    :returns: one dict per pause, in order: ``t`` (s, the pause), ``audio_t`` (s or None), ``speech`` (the
        ``user_speech`` record or None), ``resumed`` / ``flushed`` (what ended the pause, else False) and
        ``resume`` (the ``resumed`` record or None).
    """
    speech = [r for r in records if r["event"] == "user_speech"]
    result: list[dict] = []
    last_onset_audio_t = None
    for r in records:
        ev = r["event"]
        if ev == "vad_onset":
            last_onset_audio_t = r.get("audio_t")
        elif ev == "interrupted":
            audio_t = r.get("audio_t", last_onset_audio_t)
            if audio_t is not None:
                cause = [s for s in speech
                         if s["onset_t"] - SPEECH_SLACK_S <= audio_t <= s.get("end_t", s["onset_t"]) + SPEECH_SLACK_S]
            else:
                cause = [s for s in speech if s["onset_t"] <= r["t"] + 0.05]
            result.append({"t": r["t"], "audio_t": audio_t, "speech": cause[-1] if cause else None,
                           "resumed": False, "flushed": False, "resume": None})
        elif ev in ("resumed", "flushed") and result and not (result[-1]["resumed"] or result[-1]["flushed"]):
            result[-1][ev] = True
            if ev == "resumed":
                result[-1]["resume"] = r
    return result


def barge_ins(records: list[dict], output: np.ndarray) -> list[dict]:
    """The pauses the user's speech caused (:func:`pauses`), each measured against that speech: detection and
    the output's silence (ground truth from the recorded output, 16 kHz) relative to the speech onset (ground
    truth from the injected file), ms."""
    result = []
    for p in pauses(records):
        if p["speech"] is None:
            continue
        onset = p["speech"]["onset_t"]
        detected_ms = round((p["t"] - onset) * 1000.0, 1)
        result.append({
            "onset_t": onset,
            "detected_ms": detected_ms,
            "output_silent_ms": audible_until_ms(output, onset, detected_ms),
        })
    return result


def self_pauses(records: list[dict]) -> list[dict]:
    """The pauses with nobody speaking (:func:`pauses`): the reply paused on its own voice or a noise. Each:
    ``t`` and ``audio_t`` (s), ``resumed`` / ``flushed`` (bool) and ``paused_ms`` (from pause to resume, ms,
    or None)."""
    return [{"t": p["t"], "audio_t": p["audio_t"], "resumed": p["resumed"], "flushed": p["flushed"],
             "paused_ms": round((p["resume"]["t"] - p["t"]) * 1000.0, 1) if p["resume"] is not None else None}
            for p in pauses(records) if p["speech"] is None]


def resumes(records: list[dict]) -> list[dict]:
    """Each resume after a pause the user's speech caused (:func:`pauses`), with that interjection: the gap
    from its end (last sample above −40 dBFS of the injected file) to the resume, ms, and what the
    classifier heard. Resumes after a pause on the reply's own voice are in :func:`self_pauses`."""
    result = []
    for p in pauses(records):
        if p["speech"] is None or not p["resumed"]:
            continue
        r = p["resume"]
        end_t = p["speech"]["end_t"]
        result.append({"end_t": end_t, "gap_ms": round((r["t"] - end_t) * 1000.0, 1),
                       "reason": r.get("reason"), "heard": r.get("heard")})
    return result


def check_transcripts(scenario: Scenario, input_path: str | Path) -> None:
    """A text-only model needs the text of every utterance (an event marked ``speech: false``, a noise, has
    none and needs none: if the VAD takes it for a turn, the engine drops it with one warning). Raises
    :class:`UserError` naming the fix."""
    missing = [i for i, e in enumerate(scenario.events, 1) if e.speech and not e.text]
    if not missing:
        return
    if Path(input_path).suffix.lower() not in (".yaml", ".yml"):
        raise UserError(f"{input_path}: the model is text-only and cannot hear this WAV; pass --transcript "
                        "\"what it says\" (or give a model with an audio projector)")
    raise UserError(f"{input_path}: the model is text-only and event(s) {missing} have no `text:` transcript; "
                    "add `text:` to each event, or `speech: false` to an event that is a noise (or give a model "
                    "with an audio projector)")


def replay(input_path: str | Path, out_dir: str | Path, parts: Parts, cfg: Config, *, paced: bool = True,
           echo=None, print_line: Optional[Callable[[str], None]] = None, max_seconds: float = 180.0,
           idle_tail_s: float = 1.0, transcript: Optional[str] = None, scenario: Optional[Scenario] = None) -> dict:
    """Run the scenario through a :class:`Session` in the simulated room and write the outputs.

    :param paced: True: the room runs on the wall clock, so latencies include real compute. False
        (``--fast``): the room does not sleep, and instead waits for the pipeline wherever a person would
        be waiting for it (while it thinks, and for each clause's audio), so the conversation is the same
        but its latencies mean nothing.
    :param transcript: the text of a WAV input, for a model that cannot hear.
    :param scenario: ``input_path`` already loaded (:func:`load_input`); None loads it here.
    :returns: the report (also written to ``report.json``).
    :raises UserError: bad input (scenario, audio files) or a text-only model with no transcript.
    """
    scenario = scenario if scenario is not None else load_input(input_path, transcript)
    check_outputs(scenario, input_path, out_dir)
    hears = parts.engine.hears_audio
    if not hears:
        check_transcripts(scenario, input_path)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{out}: cannot create the output directory ({exc.strerror})") from None
    timeline = Timeline(out / "timeline.jsonl", echo=print_line)
    from .metrics import METRICS_FILE, TurnMetrics  # one record per turn, as the service writes them
    (out / METRICS_FILE).unlink(missing_ok=True)
    port = open_port(cfg, MODEL_RATE, "room", scenario=scenario, on_event=timeline, paced=paced)
    session = Session(cfg, parts, port, [timeline, TurnMetrics(out / METRICS_FILE, stream=None)], echo=echo,
                      transcript_at=None if hears else scenario.transcript_at)
    room = port.room
    idle_since = [None]

    def done() -> bool:
        idle = room.finished_script and session.conversation.idle.is_set() and not session.segmenter.in_speech
        if not idle:
            idle_since[0] = None
            return False
        if idle_since[0] is None:
            idle_since[0] = room.n
        return (room.n - idle_since[0]) >= idle_tail_s * MODEL_RATE

    stopped = False
    try:
        timeline({"t": 0.0, "event": Ev.REPLAY_START, "input": str(input_path), "model": parts.engine.model_path.name,
                  "hears_audio": hears, "heard_as": "audio" if hears else "transcript (text-only model)",
                  "paced": paced})
        session.start()
        port.run(done, max_seconds=max_seconds)
    except KeyboardInterrupt:  # Ctrl-C: keep what was heard and said so far, marked as cut short
        stopped = True
        raise
    finally:
        session.stop()
        timeline({"t": round(room.n / MODEL_RATE, 4), "event": Ev.REPLAY_END,
                  **({"stopped": "interrupted by the user (Ctrl-C)"} if stopped else {})})
        timeline.close()
        if stopped:
            write_wav(out / "reply.wav", room.output_audio(), MODEL_RATE)
    output = room.output_audio()
    write_wav(out / "reply.wav", output, MODEL_RATE)
    states = [r["state"] for r in timeline.records if r["event"] == "state"]
    report = {
        "input": str(input_path),
        "model": parts.engine.model_path.name,
        "heard_as": "audio" if hears else "transcript",
        "duration_s": round(room.n / MODEL_RATE, 3),
        "turns": session.conversation.turns,
        "barge_ins": barge_ins(timeline.records, output),
        "resumes": resumes(timeline.records),
        "self_pauses": self_pauses(timeline.records),
        "flushes": sum(1 for r in timeline.records if r["event"] == "flushed"),
        "vad_rejects_ms": [r.get("speech_ms") for r in timeline.records if r["event"] == Ev.VAD_REJECT],
        "echo_ms_per_frame": round(session.listener.echo.ms_per_frame, 3)
        if getattr(session.listener.echo, "ms_per_frame", None) else None,
        "states": states,
        "timed_out": room.n >= int(max_seconds * MODEL_RATE),
        "vad_ms_per_chunk": round(float(np.mean(session.segmenter.infer_ms)), 3) if session.segmenter.infer_ms else None,
        "tts_rtf": round(session.tts_worker.synth_s / session.tts_worker.audio_s, 3) if session.tts_worker.audio_s else None,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    return report
