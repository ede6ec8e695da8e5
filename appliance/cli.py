"""The ``appliance`` command line (also ``python -m appliance``).

Exit codes: 0 success, 2 a user mistake (one line on stderr naming the file and the fix), 1 a bug.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional

from . import __version__
from .bench import JACK_PERIOD, JACK_RATE
from .config import DEFAULT_CONFIG_PATH, Config, default_config_path, load
from .errors import UserError

log = logging.getLogger("appliance")


def _config(args: argparse.Namespace) -> Config:
    """The config a command runs with: ``--embedded`` selects the built-in defaults explicitly;
    otherwise ``--config`` (default /etc/appliance/config.yaml, or ./config.yaml in a checkout)."""
    from .pipeline import embedded_config

    if getattr(args, "embedded", False):
        if not args.config:
            return embedded_config(Config())
        cfg = load(args.config)  # a broken file is its one-line error, with no note about a config never loaded
        print(f"note: --embedded with --config {args.config}: its model, voice, gpio and history settings are "
              "replaced by the embedded defaults; the rest of it is used", file=sys.stderr)
        return embedded_config(cfg)
    if args.config:
        path = Path(args.config)
    elif args.command == "run":  # run refuses --embedded (its model cannot hear): not offered as a fix
        path = _default_config(RUN_NEEDS_CONFIG)
    else:
        path = _default_config() if hasattr(args, "embedded") else _default_config("give --config FILE")
    args.config_path = path
    return load(path)


RUN_NEEDS_CONFIG = ("give --config FILE naming a model that hears (model.gguf and model.mmproj; the commented "
                    "default is config.yaml in the source tree), or try the embedded parts with `appliance replay` "
                    "(`make demo`)")


def _default_config(ways: str = "give --config FILE, or --embedded for the built-in defaults") -> Path:
    """:func:`appliance.config.default_config_path`, which must exist.

    :param ways: the fixes the error offers (only ones that work for the command at hand).
    :raises UserError: neither place has a config (naming both and ``ways``)."""
    path = default_config_path()
    if path is not None:
        return path
    raise UserError(f"no config file: neither {DEFAULT_CONFIG_PATH} nor ./config.yaml exists; {ways}")


def _name_the_config(message: str, args: argparse.Namespace) -> str:
    """The parts' errors say "set … in config.yaml": name the config file this command actually used."""
    path = getattr(args, "config_path", None) or (Path(args.config) if getattr(args, "config", None) else None)
    if path is None:
        if getattr(args, "embedded", False):  # no config file in use: say where such a setting would go
            message = message.replace("in config.yaml", "in a config file given with --config FILE").replace(
                "`appliance doctor`", "`appliance doctor --embedded`")
        return message
    return message.replace("in config.yaml", f"in {path}").replace("in the config file", f"in {path}").replace(
        "`appliance doctor`", f"`appliance doctor --config {path}`")  # so doctor checks the file in use


def cmd_replay(args: argparse.Namespace) -> int:
    from .pipeline import Parts
    from .replay import OUTPUTS, check_outputs, check_transcripts, load_input, replay, unheard_fix

    cfg = _config(args)
    scenario = load_input(args.input, args.transcript)  # fail fast on bad input, before seconds of model loading
    if not cfg.model.mmproj:
        check_transcripts(scenario, args.input)
    check_outputs(scenario, args.input, args.out)  # before anything in --out is created or removed
    out = Path(args.out)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        what = "is a file, not a directory" if out.is_file() else f"cannot create the output directory ({exc.strerror})"
        raise UserError(f"{out}: {what}; give --out a directory (new, or one whose earlier replay may be replaced)") from None
    # on a terminal, say what the first seconds are spent on (run does, under systemd too); piped or --quiet,
    # stderr stays for the one-line errors
    from contextlib import nullcontext

    from .progress import Progress
    loading = (Progress(f"loading {Path(cfg.model.gguf).name}, the VAD and the voice")
               if sys.stderr.isatty() and not args.quiet else nullcontext())
    try:
        with loading:
            parts = Parts.load(cfg, persist=False)  # a replay is a simulation: it leaves the real history alone
    except BaseException:
        if created and not any(out.iterdir()):
            out.rmdir()  # a failed start leaves no empty output directory behind
        raise
    for name in OUTPUTS:  # a replay into a used directory replaces the previous one's files, never mixes them
        (out / name).unlink(missing_ok=True)
    lines = (lambda s: print(s, flush=True)) if not args.quiet else None
    try:
        report = replay(args.input, args.out, parts, cfg, paced=not args.fast, print_line=lines,
                        transcript=args.transcript, scenario=scenario)
    except KeyboardInterrupt:
        kept = [str(out / n) for n in ("timeline.jsonl", "reply.wav") if (out / n).exists()]
        print(f"replay stopped (Ctrl-C): {' and '.join(kept) or 'nothing'} kept up to then; no report.json",
              file=sys.stderr)
        return 130
    print(f"reply:    {out / 'reply.wav'}")
    print(f"timeline: {out / 'timeline.jsonl'}")
    print(f"report:   {out / 'report.json'}")
    print(f"metrics:  {out / 'metrics.jsonl'}")
    if args.fast:
        print("(--fast: the room waited for the pipeline, so these latencies are in simulated time, not measured)")
    for t in report["turns"]:
        cut = " (interrupted)" if t["interrupted"] else ""
        if args.fast:  # simulated time: the figures would read 0.0 ms, so they are left out
            print(f"turn {t['reply_id']}: answered{cut}")
            continue
        print(f"turn {t['reply_id']}: end of turn → first token {t['eot_to_first_token_ms']} ms, "
              f"→ first audio {t['eot_to_first_audio_ms']} ms{cut}")
    for b in report["barge_ins"]:
        silent = (f"output silent after {b['output_silent_ms']} ms" if b["output_silent_ms"] else
                  "the output was already silent (a gap between clauses)")
        if 0 < b["output_silent_ms"] < b["detected_ms"]:
            silent += " (the reply had fallen quiet between two words before the detection paused it)"
        print(f"barge-in at {b['onset_t']:.2f} s: detected after {b['detected_ms']} ms, {silent}")
    for p in report["self_pauses"]:
        ended = ("flushed" if p["flushed"] else f"resumed after {p['paused_ms']} ms" if p["resumed"] else "not resumed")
        where = f"{p['audio_t']:.2f} s" if p["audio_t"] is not None else f"{p['t']:.2f} s"
        print(f"paused on its own voice (nobody speaking) at {where}: {ended}")
    print(f"pauses: {len(report['barge_ins']) + len(report['self_pauses'])} ({len(report['barge_ins'])} for the "
          f"user's speech, {len(report['self_pauses'])} on its own voice); flushes: {report['flushes']}")
    if report["timed_out"]:
        print("warning: the replay hit its time limit before the conversation went idle", file=sys.stderr)
    if not report["turns"] and any(e.speech for e in scenario.events):
        raise UserError(f"{args.input}: no speech was heard in it, so the appliance never answered (the timeline "
                        f"is in {out / 'timeline.jsonl'}); {unheard_fix(scenario, report['vad_rejects_ms'])}")
    return 0


def cmd_say(args: argparse.Namespace) -> int:
    from .audio.files import write_wav
    from .speech import Tts

    cfg = _config(args)
    tts = Tts(cfg.voice.model, length_scale=cfg.voice.length_scale, volume=cfg.voice.volume)
    import numpy as np

    chunks = list(tts.synthesize(args.text))
    if not chunks:
        raise UserError("nothing to say: give a sentence with words in it")
    audio = np.concatenate(chunks)
    if args.out:
        write_wav(args.out, audio, tts.sample_rate)
        print(f"{args.out}: {len(audio) / tts.sample_rate:.2f} s at {tts.sample_rate} Hz")
        return 0
    from .audio.device import play

    play(audio, tts.sample_rate, cfg.audio.output)
    return 0


class _NameTheConfig(logging.Filter):
    """Log records that say "set … in config.yaml" name the config file the service actually runs with."""

    def __init__(self, args: argparse.Namespace):
        super().__init__()
        self._args = args

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        named = _name_the_config(message, self._args)
        if named != message:
            record.msg, record.args = named, ()
        return True


def cmd_run(args: argparse.Namespace) -> int:
    from .service import run as run_service

    if args.embedded:  # (its model is text-only whatever --config says: embedded_config drops the projector)
        raise UserError("--embedded: the embedded model (Gemma 3 270M) is text-only, so it cannot hear the "
                        "microphone; run with a config whose model.gguf and model.mmproj hear (--config FILE), or "
                        "try the embedded parts with `appliance replay` (`make demo`)")
    cfg = _config(args)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_NameTheConfig(args))
    return run_service(cfg, config_path=None if args.embedded else args.config)


def cmd_devices(args: argparse.Namespace) -> int:
    from .audio.device import describe_devices

    cfg, status = None, 0
    try:
        cfg = _config(args)
    except UserError as exc:
        print(f"error: {_name_the_config(str(exc), args)} (listing the devices without it)", file=sys.stderr)
        status = 2
    text, problems = describe_devices(cfg)
    print(text)
    for line in problems:
        print(f"error: {_name_the_config(line, args)}", file=sys.stderr)
    return 2 if problems else status  # the listing either way; the status says whether the config would run


def cmd_check_config(args: argparse.Namespace) -> int:
    path = Path(args.file or args.config or _default_config("name the file: `appliance check-config FILE`"))
    from .config import ConfigError, check

    try:
        cfg = check(path)  # the schema, then the sizes and the model files' headers
    except ConfigError as exc:
        if exc.complete:
            raise
        for problem in exc.problems:  # too many for one line: every problem and its line, one line each
            print(f"error: {path}: {problem}", file=sys.stderr)
        print(f"{path}: {len(exc.problems)} problems; fix them, then run `appliance check-config {path}`",
              file=sys.stderr)
        return exc.exit_code
    print(f"{path}: valid")
    # The config is valid, but a model file it names may not be on this machine (a config copied from the Pi,
    # or a Pi whose image has not fetched its models): the service would not start, so say so here too.
    # (Piper also needs the voice's config beside it; named when the voice itself is there)
    voice_json = cfg.voice.model and Path(cfg.voice.model).exists() and str(cfg.voice.model) + ".json"
    missing = [f"{key} {p}" for key, p in (("model.gguf", cfg.model.gguf), ("model.mmproj", cfg.model.mmproj),
                                           ("voice.model", cfg.voice.model), ("the voice's config", voice_json))
               if p and not Path(p).exists()]
    if missing:
        print(f"note: not found on this machine: {', '.join(missing)}; `appliance doctor --config {path}` "
              "checks the model files, the voice and the sound devices")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from . import doctor

    checks = doctor.run(args.config, embedded=args.embedded, checksums=args.checksums, capture_s=args.capture_s)
    print(_name_the_config(doctor.to_json(checks) if args.json else doctor.format_table(checks), args))
    return doctor.exit_status(checks)


def cmd_stats(args: argparse.Namespace) -> int:
    from .metrics import METRICS_FILE, read_turns
    from .stats import format_summary, summarise

    source = args.source
    if source is None:
        # The service's metrics log, under the config's state_dir; with no config anywhere (run outside a
        # checkout on a machine that is not the appliance), the defaults' state_dir, else the journal.
        explicit = args.config or default_config_path() is not None
        cfg = _config(args) if explicit else Config()
        path = Path(cfg.storage.state_dir) / METRICS_FILE
        source = str(path) if path.exists() else "journal"
        if not path.exists():
            print(f"note: no {path} (the service's metrics log): reading the journal instead", file=sys.stderr)
    elif Path(source).is_dir():  # a replay's output directory: its metrics log
        if not (Path(source) / METRICS_FILE).is_file():
            raise UserError(f"{source}: is a directory without {METRICS_FILE}; give a metrics.jsonl or a replay's "
                            "timeline.jsonl")
        source = str(Path(source) / METRICS_FILE)
    summary = summarise(read_turns(source), args.last)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary, source))
    if source != "journal" and _replayed_unpaced(Path(source).parent / "timeline.jsonl"):
        print(f"note: {source} is from a replay run with --fast: its latencies are in simulated time, not measured",
              file=sys.stderr)
    return 0


def _replayed_unpaced(timeline: Path) -> bool:
    """Whether ``timeline`` is a replay's timeline whose first event says it ran unpaced (``--fast``)."""
    try:
        with timeline.open(encoding="utf-8") as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and first.get("paced") is False


def _json_out(args: argparse.Namespace) -> Optional[Path]:
    """The bench's ``--json FILE``, checked before minutes of measuring: a file whose directory exists and
    is writable. :raises UserError: otherwise."""
    if not args.json:
        return None
    path = Path(args.json)
    if path.is_dir():
        raise UserError(f"{path}: is a directory; give --json a file name, e.g. {path / 'bench.json'}")
    parent = path.parent
    if not parent.is_dir():
        raise UserError(f"{path}: the directory {parent} does not exist; create it or give --json another path")
    existed = path.exists()
    try:  # open it, as the bench will: access() says yes to root in /proc and on read-only mounts
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise UserError(f"{path}: cannot write it ({exc.strerror}); give --json a path you can write") from None
    if not existed:
        path.unlink(missing_ok=True)
    return path


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from .bench import engine as bench_engine
    from .pipeline import EMBEDDED_EXAMPLES, embedded_model_path

    if args.embedded:
        model, examples = embedded_model_path(), EMBEDDED_EXAMPLES
    else:
        model, examples = Path(_config(args).model.gguf), None
        if not model.is_file():
            raise UserError(f"{model}: model file not found; set model.gguf in config.yaml, or pass --embedded")
    bench_engine.run(model, _json_out(args), n_turns=args.turns, examples=examples,
                     n_threads=args.threads)
    return 0


def cmd_bench_interruption(args: argparse.Namespace) -> int:
    from .bench import interruption
    from .pipeline import Parts

    cfg = _config(args)
    json_out = _json_out(args)
    if args.path_change_s is not None and args.path_change_s < 0:
        raise UserError(f"--path-change-s must be 0 or more seconds, not {args.path_change_s:g}")
    if args.room == "jack":
        from .bench import jack_room

        jack_room.run(cfg, json_out, Path(args.cache), quick=args.quick, drift_ppm=args.drift_ppm,
                      speaker=args.speaker, echo_only=args.echo_only, rate=args.jack_rate, period=args.jack_period,
                      path_change_s=args.path_change_s, print_line=lambda s: print(s, flush=True))
        return 0
    if args.echo_only or args.drift_ppm or args.speaker != "linear" or args.path_change_s is not None:
        raise UserError("--echo-only, --drift-ppm, --speaker and --path-change-s need --room jack (the simulated room "
                        "has one clock and a linear speaker)")
    parts = Parts.load(cfg, persist=False)
    interruption.run(cfg, parts, json_out, Path(args.cache), quick=args.quick,
                     print_line=lambda s: print(s, flush=True))
    return 0


def cmd_bench_idle_cpu(args: argparse.Namespace) -> int:
    from .bench import jack_room

    cfg = _config(args)
    jack_room.idle(cfg, _json_out(args), seconds=args.seconds, runs=args.runs, drift_ppm=args.drift_ppm,
                   speaker=args.speaker, rate=args.jack_rate, period=args.jack_period,
                   print_line=lambda s: print(s, flush=True))
    return 0


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from .bench import latency
    from .pipeline import Parts

    if args.offline:
        return latency.offline_main(["--offline", "--cache", args.cache])
    cfg = _config(args)
    json_out = _json_out(args)
    parts = Parts.load(cfg, persist=False)
    latency.run(cfg, parts, json_out, Path(args.cache), quick=args.quick, print_line=lambda s: print(s, flush=True))
    return 0


def cmd_bench_wake(args: argparse.Namespace) -> int:
    from .bench import wake
    from .speech import Tts

    cfg = _config(args)
    json_out = _json_out(args)
    tts = Tts(cfg.voice.model, length_scale=cfg.voice.length_scale, volume=cfg.voice.volume)
    wake.run(cfg, tts, json_out, max_hours=args.hours, print_line=lambda s: print(s, flush=True))
    return 0


def cmd_bench_soak(args: argparse.Namespace) -> int:
    from .bench import soak

    if args.turns < 1:
        raise UserError(f"--turns {args.turns}: give at least 1 turn")
    if args.fixture and args.embedded:
        raise UserError("--fixture and --embedded: give one of them (the tiny Gemma 4 or the embedded model)")
    cfg = soak.fixture_config() if args.fixture else _config(args)
    json_out = _json_out(args)
    soak.run(cfg, args.turns, json_out, print_line=lambda s: print(s, flush=True))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="appliance", description="Offline voice appliance: hear, think, speak, stop when interrupted.")
    p.add_argument("--version", action="version", version=f"appliance {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, embedded=True):
        sp.add_argument("--config", help="config file (default /etc/appliance/config.yaml, else ./config.yaml)")
        if embedded:
            sp.add_argument("--embedded", action="store_true",
                            help="use the embedded defaults (Gemma 3 270M text model and the Joe voice from PyPI); "
                                 "with --config, they replace its model, voice, gpio and history settings")

    sp = sub.add_parser("run", help="the service on real sound devices",
                        description="The service: listen on audio.input, answer on audio.output, with the model "
                                    "and voice config.yaml names (systemd runs this on the appliance).")
    common(sp, embedded=False)
    # the embedded model is text-only and cannot hear: not offered, but refused with the reason if given
    sp.add_argument("--embedded", action="store_true", help=argparse.SUPPRESS)
    sp.set_defaults(func=cmd_run)

    sp = sub.add_parser("replay", help="run the pipeline on a WAV or scenario file in a simulated room")
    sp.add_argument("input", help="a WAV of speech or a scenario YAML")
    sp.add_argument("--out", required=True, help="output directory for reply.wav, timeline.jsonl, report.json, metrics.jsonl")
    sp.add_argument("--fast", action="store_true",
                    help="do not pace in real time: the room waits for the pipeline instead (latencies are then meaningless)")
    sp.add_argument("--transcript", help="what a WAV input says, for a text-only model that cannot hear it")
    sp.add_argument("--quiet", action="store_true", help="do not print the timeline")
    common(sp)
    sp.set_defaults(func=cmd_replay)

    sp = sub.add_parser("say", help="speak a sentence (checks the TTS and the output device)")
    sp.add_argument("text", help="what to say (quote it)")
    sp.add_argument("--out", help="write a WAV instead of playing")
    common(sp)
    sp.set_defaults(func=cmd_say)

    sp = sub.add_parser("devices", help="list sound devices, marking the ones the config selects")
    common(sp)
    sp.set_defaults(func=cmd_devices)

    sp = sub.add_parser("check-config", help="validate a config file without running (exit 0 or 2); "
                        "default /etc/appliance/config.yaml, else ./config.yaml")
    sp.add_argument("file", nargs="?", help="the config file to check")
    sp.add_argument("--config", help=argparse.SUPPRESS)
    sp.set_defaults(func=cmd_check_config)

    bench = sub.add_parser("bench", help="benchmarks: print a table and write JSON").add_subparsers(dest="bench", required=True)
    sp = bench.add_parser("engine", help="prefill per turn, turn-50/turn-1 latency, cancel-to-idle, KV bytes per token")
    sp.add_argument("--json", help="write the results to this JSON file")
    sp.add_argument("--turns", type=int, default=50, help="turns per model (default 50)")
    sp.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2; 1 on a busy machine)")
    common(sp)
    sp.set_defaults(func=cmd_bench_engine)
    sp = bench.add_parser("soak", help="N turns back to back: replies lost, decode failures, history, RSS growth")
    sp.add_argument("--json", help="write the results to this JSON file")
    sp.add_argument("--turns", type=int, default=500, help="turns to run (default 500)")
    sp.add_argument("--fixture", action="store_true",
                    help="the tiny Gemma 4 test fixture (audio turns) instead of the configured model")
    common(sp)
    sp.set_defaults(func=cmd_bench_soak)
    sp = bench.add_parser("interruption", help="barge-in latency, echo self-interrupts, backchannels, ERLE (real time, minutes)")
    sp.add_argument("--json", help="write the summary to this JSON file")
    sp.add_argument("--cache", default=str(Path.home() / ".cache" / "appliance" / "bench-audio"),
                    help="where generated bench speech is cached (default ~/.cache/appliance/bench-audio)")
    sp.add_argument("--quick", action="store_true", help="a small subset of the suite (a smoke run)")
    sp.add_argument("--room", choices=("sim", "jack"), default="sim",
                    help="sim: the simulated room (fast, deterministic; default); jack: `appliance run` itself on "
                         "real PortAudio streams, in a room on a JACK server of its own")
    sp.add_argument("--drift-ppm", type=float, default=0.0, help="--room jack: the speaker's clock drift, ppm")
    sp.add_argument("--speaker", choices=("linear", "clip"), default="linear",
                    help="--room jack: a linear speaker, or a small one that soft-clips")
    sp.add_argument("--path-change-s", type=float, default=None, metavar="S",
                    help="--room jack: the speaker and the drift come on S seconds into the run (linear and one "
                         "clock before): a canceller that converged on the clean path meets the change")
    sp.add_argument("--echo-only", type=int, default=0, metavar="N",
                    help="--room jack: only N echo-only replies at 0 dB and N at +6 dB, every pause counted")
    sp.add_argument("--jack-rate", type=int, default=JACK_RATE,
                    help=f"--room jack: the JACK server's rate, Hz (default {JACK_RATE})")
    sp.add_argument("--jack-period", type=int, default=JACK_PERIOD, help=f"--room jack: frames per JACK period "
                    f"(default {JACK_PERIOD}, {1000 * JACK_PERIOD / JACK_RATE:.1f} ms: next to the worker's 10 ms blocks, 480 frames)")
    common(sp)
    sp.set_defaults(func=cmd_bench_interruption)

    sp = bench.add_parser("idle-cpu", help="CPU of the listening service and its audio worker, nothing said: "
                                           "`appliance run` on a JACK server of its own, as --room jack starts it",
                          description="Starts `appliance run` with the tiny Gemma 4 test fixture (a checkout's "
                                      "tests/fixtures) on a JACK dummy server of its own (needs jackd2, as "
                                      ".ci/run installs), waits in `listening`, then measures RUNS windows of "
                                      "SECONDS each (about 100 s with the defaults). CPU time from /proc, % of one "
                                      "core, for the service and every descendant.")
    sp.add_argument("--json", help="write the summary to this JSON file")
    sp.add_argument("--seconds", type=float, default=30.0, help="length of each measuring window, s (default 30)")
    sp.add_argument("--runs", type=int, default=3, help="consecutive windows (default 3)")
    sp.add_argument("--drift-ppm", type=float, default=0.0, help="the room's speaker clock drift, ppm")
    sp.add_argument("--speaker", choices=("linear", "clip"), default="linear", help="the room's speaker")
    sp.add_argument("--jack-rate", type=int, default=JACK_RATE, help=f"the JACK server's rate, Hz (default {JACK_RATE})")
    sp.add_argument("--jack-period", type=int, default=JACK_PERIOD, help=f"frames per JACK period (default {JACK_PERIOD})")
    common(sp, embedded=False)
    sp.set_defaults(func=cmd_bench_idle_cpu)

    sp = bench.add_parser("latency", help="end of turn and answer speed: EOT delay, premature EOTs, audio left at "
                                          "EOT, streamed vs whole clip, Pi 5 projection (real time, minutes)")
    sp.add_argument("--json", help="write the summary to this JSON file")
    sp.add_argument("--cache", default=str(Path.home() / ".cache" / "appliance" / "bench-audio"),
                    help="where generated bench speech is cached (default ~/.cache/appliance/bench-audio)")
    sp.add_argument("--quick", action="store_true", help="a small subset of the suite (a smoke run)")
    sp.add_argument("--offline", action="store_true",
                    help="not real time: the end-of-turn and projection levers over the suite's audio with the "
                         "real Silero and Smart Turn, one line each (docs/latency.md; about a minute)")
    common(sp)
    sp.set_defaults(func=cmd_bench_latency)

    sp = bench.add_parser("wake", help="wake word: detection in 5 voices, false wakes per hour on speech, music and "
                                       "TV-like audio, wake-to-listening latency, CPU (offline, tens of minutes)")
    sp.add_argument("--json", help="write the summary to this JSON file")
    sp.add_argument("--hours", type=float, default=None,
                    help="cap the non-wake audio played, hours (default: all the material, twice)")
    common(sp)
    sp.set_defaults(func=cmd_bench_wake)

    sp = sub.add_parser("doctor", help="check config, models, RAM, sound devices, voice, VAD, GPIO, disk, clock")
    sp.add_argument("--checksums", action="store_true", help="also hash the model files against SHA256SUMS beside them (slow)")
    sp.add_argument("--json", action="store_true", help="print the checks as JSON")
    sp.add_argument("--capture-s", type=float, default=1.0, help="length of the test recording, seconds (default 1)")
    common(sp)
    sp.set_defaults(func=cmd_doctor)

    sp = sub.add_parser("stats", help="p50/p95 of the per-turn latencies over the last N turns")
    sp.add_argument("source", nargs="?", help="'journal', a metrics.jsonl, or a replay's timeline.jsonl/report.json "
                    "(default: <storage.state_dir>/metrics.jsonl, else the journal)")
    sp.add_argument("-n", "--last", type=int, default=100, help="summarise the last N turns (0 = all; default 100)")
    sp.add_argument("--json", action="store_true", help="print the summary as JSON")
    common(sp, embedded=False)
    sp.set_defaults(func=cmd_stats)
    return p


class _LowerLevelFormatter(logging.Formatter):
    """``warning: message``: a one-off command's log lines in the style of its ``error:`` lines."""

    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {record.getMessage()}"


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    under_systemd = bool(os.environ.get("INVOCATION_ID") or os.environ.get("JOURNAL_STREAM"))
    handler = logging.StreamHandler()
    if under_systemd:  # journald adds the time
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    elif args.command == "run" or args.verbose:  # a service's log, on a terminal
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    else:  # a one-off command: its warnings read as its errors do ("warning: FILE: what; the fix")
        handler.setFormatter(_LowerLevelFormatter())
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, handlers=[handler])
    try:
        return args.func(args)
    except UserError as exc:
        print(f"error: {_name_the_config(str(exc), args)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`appliance doctor | head -3`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second one at exit's flush
        return 141


if __name__ == "__main__":
    sys.exit(main())
