"""The simulated room behind ``appliance replay``, the tests and the benchmarks, and :class:`RoomPort`,
the room as an :class:`~appliance.audio.port.AudioPort`.

It stands where the sound card would: every block (10 ms) it asks the playback buffer for the next
output block, exactly as the output callback does, records it on the timeline (``reply.wav``), and builds
the microphone block from the scripted user speech, the appliance's own output fed back at
``echo_gain_db`` after ``echo_delay_ms`` (the far end leaking into the near end), through a short room
impulse response (a recorded one, or a synthetic exponential decay with ``rt60_ms``), and looped
background noise. It hands the microphone block and the far-end reference to the capture side, as the input
callback does. Paced on the wall clock by default, so every latency it reports includes real compute.

Scenario files (YAML)::

    events:
      - at: 0.5                  # seconds from start
        say: question.wav        # relative to the scenario file; any rate, mono or stereo
        text: "What is a rainbow?"
      - after: speaking          # when the appliance next starts speaking...
        delay: 1.2               # ...plus 1.2 s
        say: wait.wav
        text: "Wait, stop."
      - at: 9.0
        say: doorbell.wav
        speech: false            # not speech (a bell, a door slam): no `text:`, even for a text-only model
    room:
      echo_gain_db: -10          # level of the echo relative to what was played (IR normalised to unit energy)
      echo_delay_ms: 30          # speaker-to-microphone delay before the IR's first tap
      rt60_ms: 150               # optional: a synthetic room IR decaying by 60 dB in this time
      impulse_response: ir.wav   # optional instead: a recorded room IR (16 kHz after resampling)
      noise: fan.wav
      noise_gain_db: -30
"""

from __future__ import annotations

import reprlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..errors import UserError
from .files import MODEL_RATE, first_above, load_audio
from .port import PullPort

BLOCK = 160  # 10 ms at 16 kHz


@dataclass
class ScriptedUtterance:
    """One thing the user says. ``at`` is absolute (s) or None with ``after``/``delay``."""

    audio: np.ndarray
    text: Optional[str]
    source: str
    at: Optional[float] = None
    after: Optional[str] = None
    delay: float = 0.0
    gain_db: float = 0.0
    start_sample: Optional[int] = None  # placed on the timeline when it fires
    speech: bool = True  # False: a noise (a bell, a door slam), which has no transcript

    @property
    def onset_offset(self) -> int:
        """Samples from the start of the file to the first sample above -40 dBFS."""
        i = first_above(self.audio, -40.0)
        return max(0, i)


def synthetic_ir(rt60_ms: float, rate: int = MODEL_RATE, direct_to_reverb_db: float = 6.0,
                 seed: int = 0) -> np.ndarray:
    """A small room's impulse response: a unit direct path followed by exponentially decaying Gaussian
    noise (the Schroeder/Polack statistical model of late reverberation) that falls by 60 dB in
    ``rt60_ms``, truncated there, with the direct path ``direct_to_reverb_db`` above the tail's energy.

    :returns: float32 [n] at ``rate``, normalised to unit energy (Σh² = 1), deterministic for a seed.
    """
    n = max(2, int(rt60_ms * rate / 1000.0))
    rng = np.random.default_rng(seed)
    t = np.arange(1, n) / rate
    tail = rng.standard_normal(n - 1) * np.exp(-6.908 * t / (rt60_ms / 1000.0))  # ln(1000) = 6.908: -60 dB
    tail *= np.sqrt(10 ** (-direct_to_reverb_db / 10.0) / max(np.sum(tail ** 2), 1e-12))
    ir = np.concatenate([[1.0], tail])
    return (ir / np.sqrt(np.sum(ir ** 2))).astype(np.float32)


@dataclass
class RoomSpec:
    """The room's acoustics.

    :param echo_gain_db: level of the appliance's echo at the microphone relative to what it played, dB
        (the IR is normalised to unit energy, so this is the echo path's broadband gain); None = no echo.
    :param echo_delay_ms: pure delay before the IR (speaker-to-microphone distance plus converter latency).
    :param impulse_response: float32 IR at 16 kHz (None: a single tap, i.e. a pure delay).
    """

    echo_gain_db: Optional[float] = None  # None: no echo path (headphones)
    echo_delay_ms: float = 30.0
    noise: Optional[np.ndarray] = None
    noise_gain_db: float = -30.0
    impulse_response: Optional[np.ndarray] = None


# The ranges a scenario's numbers may take: (low, high, unit). Wider would be a typo, not a room: a user's
# voice 40 dB over its recording clips, an echo 20 dB over what was played is no loudspeaker, and a replay
# stops after 180 s (replay's max_seconds).
EVENT_RANGES = {"at": (0.0, 180.0, "seconds"), "delay": (0.0, 180.0, "seconds"), "gain_db": (-60.0, 40.0, "dB")}
ROOM_RANGES = {"echo_gain_db": (-80.0, 20.0, "dB"), "echo_delay_ms": (0.0, 2000.0, "ms"),
               "noise_gain_db": (-80.0, 20.0, "dB"), "rt60_ms": (1.0, 2000.0, "ms")}


def _number(value, what: str, low: float, high: float, unit: str) -> float:
    """A scenario's number: an int or float, or a string that reads as one (YAML 1.1, which PyYAML follows,
    reads ``1e9`` without a dot as text). Raises :class:`UserError` naming ``what`` outside [low, high]."""
    x = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        x = float(value)
    elif isinstance(value, str):
        try:
            x = float(value)
        except ValueError:
            pass
    if x is None or not np.isfinite(x):
        raise UserError(f"{what} must be a number of {unit}, not {reprlib.repr(value)}")
    if not low <= x <= high:
        raise UserError(f"{what} must be between {low:g} and {high:g} {unit}, not {reprlib.repr(value)}")
    return x


EVENT_KEYS = ("at", "after", "delay", "say", "text", "gain_db", "speech")


def _did_you_mean(unknown, allowed) -> str:
    """``" (did you mean 'say'?)"`` for the first unknown key close to an allowed one (difflib), else ``""``."""
    import difflib

    for key in sorted(str(k) for k in unknown):
        close = difflib.get_close_matches(key, list(allowed), n=1)
        if close:
            return f" (did you mean {close[0]!r}?)"
    return ""


def _top(node, key: str):
    """The value node of the top-level ``key`` in a composed YAML mapping ``node``, or None."""
    import yaml

    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if key_node.value == key:
                return value_node
    return None


def _key_lines(node) -> dict[str, int]:
    """The 1-based line of each key of a YAML mapping node ({} for any other node)."""
    import yaml

    return {k.value: k.start_mark.line + 1 for k, _ in node.value} if isinstance(node, yaml.MappingNode) else {}


def _scenario_audio(path: Path, where: str) -> np.ndarray:
    """:func:`load_audio` for a file a scenario names: its error is prefixed with ``where`` (the scenario
    file, line and key) and, for a missing file, says relative paths start at the scenario's folder.

    :raises UserError: one line, as :func:`load_audio`'s.
    """
    try:
        return load_audio(path)
    except UserError as exc:
        hint = " (relative paths in a scenario are relative to the scenario file)" if "not found" in str(exc) else ""
        raise UserError(f"{where}: {exc}{hint}") from None


def _line_prefix(keys, lines: dict[str, int]) -> str:
    """``"line N: "`` for the earliest of ``keys`` in ``lines`` (:func:`_key_lines`), else ``""``: an error about
    several unknown keys points at the first one in the file."""
    found = [lines[str(k)] for k in keys if str(k) in lines]
    return f"line {min(found)}: " if found else ""


def _item_lines(node, key: str) -> list[tuple[int, dict[str, int]]]:
    """For each item of the top-level list ``key`` in a composed YAML mapping node: its 1-based line and its
    keys' lines (:func:`_key_lines`), so that an error names the line of the key at fault, else of the event;
    [] when ``key`` is not a list."""
    import yaml

    items = _top(node, key)
    return [(item.start_mark.line + 1, _key_lines(item)) for item in items.value] \
        if isinstance(items, yaml.SequenceNode) else []


@dataclass
class Scenario:
    events: list[ScriptedUtterance]
    room: RoomSpec = field(default_factory=RoomSpec)
    path: Optional[Path] = None
    files: list[Path] = field(default_factory=list)  # every audio file it reads (say, noise, impulse response)

    @classmethod
    def from_wav(cls, path: str | Path, at: float = 0.5, text: Optional[str] = None) -> "Scenario":
        audio = load_audio(path)
        return cls([ScriptedUtterance(audio, text, str(path), at=at)], path=Path(path), files=[Path(path)])

    @classmethod
    def load(cls, path: str | Path) -> "Scenario":
        """Parse a scenario YAML (bounded like the config: :mod:`appliance.safeyaml`; duplicate keys refused).

        :raises UserError: one line naming the file, the event and the fix, for any problem with it.
        """
        path = Path(path)
        try:
            return cls._load(path)
        except UserError:
            raise
        except Exception as exc:  # whatever the file holds, one line and exit 2, never a traceback
            raise UserError(f"{path}: cannot load the scenario ({exc.__class__.__name__}); check it against the "
                            "scenario format in docs/replay.md") from None

    @classmethod
    def _load(cls, path: Path) -> "Scenario":
        from ..safeyaml import duplicate_keys, load_file

        node, data = load_file(path, "scenario", "check the path",
                               "fix the syntax (see the scenario format in docs/replay.md)")
        dups = duplicate_keys(node)
        if dups:
            line, key, first = dups[0]
            parts = key.split(".")
            if len(parts) > 2 and parts[0] == "events" and parts[1].isdigit():  # name the event as the others do
                key = f"`{'.'.join(parts[2:])}` in event {parts[1]}"
            raise UserError(f"{path}: line {line}: duplicate key {key} (also at line {first}); keep one")
        unknown = set(data) - {"events", "room"} if isinstance(data, dict) else set()
        if unknown:
            raise UserError(f"{path}: {_line_prefix(unknown, _key_lines(node))}unknown top-level key(s) {sorted(unknown, key=str)}"
                            f"{_did_you_mean(unknown, ('events', 'room'))}; only `events` and `room` are allowed")
        if not isinstance(data, dict) or not data.get("events"):
            raise UserError(f"{path}: the scenario has no events; add an `events:` list with at least one `say:` entry")
        if not isinstance(data["events"], list):
            raise UserError(f"{path}: `events` must be a list of entries with `at:` or `after:` and `say:`")
        base = path.parent
        events, files = [], []
        lines = _item_lines(node, "events")
        for i, ev in enumerate(data["events"], 1):
            line, keys = lines[i - 1] if i <= len(lines) else (None, {})
            where = f"{path}: line {line}: event {i}" if line else f"{path}: event {i}"

            def at(*names: str, i: int = i, keys: dict = keys, where: str = where) -> str:
                """The error's place: the line of the first of ``names`` the event has, else the event's."""
                line = next((keys[k] for k in names if k in keys), None)
                return f"{path}: line {line}: event {i}" if line else where

            if not isinstance(ev, dict):
                raise UserError(f"{where}: must be a mapping with `say:` and `at:` or `after:`")
            extra = set(ev) - set(EVENT_KEYS)
            if extra:
                raise UserError(f"{at(*sorted(extra, key=lambda k: keys.get(k, 0)))}: unknown key(s) {sorted(extra)}"
                                f"{_did_you_mean(extra, EVENT_KEYS)}; allowed: {', '.join(EVENT_KEYS)}")
            speech = ev.get("speech", True)
            if not isinstance(speech, bool):
                raise UserError(f"{at('speech')}: `speech` must be true or false (false: a noise, with no `text:`)")
            if not speech and ev.get("text"):
                raise UserError(f"{at('text')}: `speech: false` (a noise) has no transcript; remove `text:`")
            if "say" not in ev or not isinstance(ev["say"], str):
                raise UserError(f"{at('say')}: needs `say: FILE.wav` (a path relative to the scenario file)")
            if ("at" in ev) == ("after" in ev):
                raise UserError(f"{at('after', 'at')}: give exactly one of `at: SECONDS` or `after: speaking` (or "
                                "thinking, or listening)")
            if "after" in ev and ev["after"] not in ("speaking", "thinking", "listening"):
                raise UserError(f"{at('after')}: `after:` must be speaking, thinking or listening, "
                                f"not {str(ev['after'])[:40]!r}")
            if ev.get("after") in ("speaking", "thinking") and not any(e.speech for e in events):
                # nothing before it asks the appliance anything, so it never thinks or speaks: the replay would
                # wait out its 180 s and then blame the audio
                raise UserError(f"{at('after')}: `after: {ev['after']}` can never fire: no event before it is speech "
                                "the appliance answers; start the scenario with an event at `at: SECONDS`")
            for key in ("at", "delay", "gain_db"):
                if key in ev:
                    ev[key] = _number(ev[key], f"{at(key)}: `{key}`", *EVENT_RANGES[key])
            text = ev.get("text")
            if text is not None and not isinstance(text, str):
                raise UserError(f"{at('text')}: `text` must be a string (the transcript)")
            audio = _scenario_audio(base / ev["say"], at('say'))
            files.append(base / ev["say"])
            events.append(ScriptedUtterance(audio, text, ev["say"], at=ev.get("at"), after=ev.get("after"),
                                            delay=float(ev.get("delay", 0.0)), gain_db=float(ev.get("gain_db", 0.0)),
                                            speech=speech))
        room = RoomSpec()
        r = data.get("room") or {}
        if not isinstance(r, dict):
            raise UserError(f"{path}: `room` must be a mapping (echo_gain_db, echo_delay_ms, rt60_ms or impulse_response, "
                            "noise, noise_gain_db; see docs/replay.md)")
        allowed = ["echo_gain_db", "echo_delay_ms", "rt60_ms", "impulse_response", "noise", "noise_gain_db"]
        room_lines = _key_lines(_top(node, "room"))
        line_of = lambda k: _line_prefix([k], room_lines)  # noqa: E731
        extra = set(r) - set(allowed)
        if extra:
            raise UserError(f"{path}: {_line_prefix(extra, room_lines)}room: unknown key(s) {sorted(extra)}"
                            f"{_did_you_mean(extra, allowed)}; allowed: {', '.join(allowed)}")
        r = dict(r)
        for key in ("echo_gain_db", "echo_delay_ms", "noise_gain_db", "rt60_ms"):
            if key in r:
                r[key] = _number(r[key], f"{path}: {line_of(key)}room.{key}", *ROOM_RANGES[key])
        if "echo_gain_db" in r:
            room.echo_gain_db = float(r["echo_gain_db"])
        room.echo_delay_ms = float(r.get("echo_delay_ms", 30.0))
        if r.get("noise"):
            room.noise = _scenario_audio(base / str(r["noise"]), f"{path}: {line_of('noise')}room.noise")
            files.append(base / str(r["noise"]))
        room.noise_gain_db = float(r.get("noise_gain_db", -30.0))
        if "rt60_ms" in r and "impulse_response" in r:
            raise UserError(f"{path}: {_line_prefix(['rt60_ms', 'impulse_response'], room_lines)}room: give either rt60_ms (a synthetic IR) or impulse_response (a file), not both")
        if "rt60_ms" in r:
            room.impulse_response = synthetic_ir(float(r["rt60_ms"]))
        elif r.get("impulse_response"):
            ir = _scenario_audio(base / str(r["impulse_response"]),
                                 f"{path}: {line_of('impulse_response')}room.impulse_response")
            files.append(base / str(r["impulse_response"]))
            energy = float(np.sum(ir.astype(np.float64) ** 2))
            if energy <= 0:
                raise UserError(f"{path}: room.impulse_response is silent; give a recorded room impulse response")
            room.impulse_response = (ir / np.sqrt(energy)).astype(np.float32)
        return cls(events, room, path, files)

    def transcript_at(self, sample: int) -> Optional[str]:
        """The transcript of the scripted utterance that was playing at ``sample`` (16 kHz), if any."""
        best = None
        for ev in self.events:
            if ev.start_sample is None:
                continue
            if ev.start_sample - BLOCK * 50 <= sample <= ev.start_sample + len(ev.audio):
                best = ev
        return best.text if best else None


class SimulatedRoom:
    """Plays the scenario into the pipeline and records what the appliance says.

    :param scenario: what the user says and the room's acoustics.
    :param read_output: ``read_output(n) -> float32 [n]``: the playback buffer's read (the output callback).
    :param capture: ``capture(mic, far_end)``: hands a 10 ms microphone block and the far-end block to the
        capture side (the input callback).
    :param clock: the session clock, seconds.
    :param on_event: ``on_event(record)`` for ground-truth events (``user_speech``), ``t`` in seconds.
    :param paced: True to run in real time on the wall clock.
    """

    def __init__(self, scenario: Scenario, read_output: Callable[[int], np.ndarray],
                 capture: Callable[[np.ndarray, np.ndarray], None], on_event: Callable[[dict], None],
                 paced: bool = True, rate: int = MODEL_RATE):
        self.scenario = scenario
        self.read_output = read_output
        self.capture = capture
        self.on_event = on_event
        self.paced = paced
        self.rate = rate
        self.block = BLOCK
        self.n = 0  # samples elapsed
        self._lock = threading.Lock()
        self._pending = list(scenario.events)
        self._armed: Optional[int] = None  # sample at which the next `after:` event fires
        self._active: list[tuple[int, np.ndarray]] = []
        self.output: list[np.ndarray] = []
        self.mic: list[np.ndarray] = []
        spec = scenario.room
        self._echo_gain = None if spec.echo_gain_db is None else 10 ** (spec.echo_gain_db / 20.0)
        self._echo_delay = int(spec.echo_delay_ms * rate / 1000.0)
        ir = spec.impulse_response if spec.impulse_response is not None else np.ones(1, dtype=np.float32)
        # The whole echo path as one FIR: the delay, then the IR.
        self._echo_fir = np.concatenate([np.zeros(self._echo_delay, dtype=np.float32), np.asarray(ir, np.float32)])
        self._echo_line = np.zeros(len(self._echo_fir) - 1, dtype=np.float32)  # past output samples
        self.near_active: list[bool] = []  # per block: scripted speech present in the microphone block
        self.echo: list[np.ndarray] = []  # per block: the echo component alone (ground truth for ERLE)
        self._noise = spec.noise
        self._noise_gain = 10 ** (spec.noise_gain_db / 20.0)
        self._stop = threading.Event()
        self.t0 = 0.0

    # --- conversation observer: arms `after:` events on state transitions ---
    def observe(self, record: dict) -> None:
        if record.get("event") != "state":
            return
        with self._lock:
            if self._pending and self._pending[0].after == record.get("state") and self._armed is None \
                    and not self._active_speech():
                ev = self._pending[0]
                self._armed = self.n + int(ev.delay * self.rate)

    def _active_speech(self) -> bool:
        return any(start + len(a) > self.n for start, a in self._active)

    @property
    def finished_script(self) -> bool:
        with self._lock:
            return not self._pending and not self._active_speech()

    def stop(self) -> None:
        self._stop.set()

    def run(self, until: Callable[[], bool], max_seconds: float) -> None:
        """Run blocks until ``until()`` is true (checked every block) or ``max_seconds`` of audio."""
        if not self.t0:
            self.t0 = time.monotonic()
        limit = int(max_seconds * self.rate)
        while self.n < limit and not self._stop.is_set():
            if self.paced:
                due = self.t0 + (self.n + self.block) / self.rate
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            self.tick()
            if until():
                break

    def tick(self) -> None:
        n, b = self.n, self.block
        out = np.asarray(self.read_output(b), dtype=np.float32)
        self.output.append(out)
        mic = np.zeros(b, dtype=np.float32)
        with self._lock:
            self._fire(n)
            for start, audio in self._active:
                lo, hi = max(n, start), min(n + b, start + len(audio))
                if hi > lo:
                    mic[lo - n : hi - n] += audio[lo - start : hi - start]
            self._active = [(s, a) for s, a in self._active if s + len(a) > n + b]
        self.near_active.append(bool(np.any(mic != 0.0)))
        echo = self._add_room(mic, out)
        if echo is not None:
            self.echo.append(echo)
        self.mic.append(mic)
        self.n += b
        self.capture(mic, out)

    def _fire(self, n: int) -> None:
        while self._pending:
            ev = self._pending[0]
            if ev.at is not None:
                start = int(ev.at * self.rate)
            elif self._armed is not None:
                start = self._armed
            else:
                return
            if start > n + self.block:
                return
            start = max(start, n)
            self._pending.pop(0)
            self._armed = None
            ev.start_sample = start
            audio = ev.audio * (10 ** (ev.gain_db / 20.0))
            self._active.append((start, audio))
            onset = start + ev.onset_offset
            last = first_above(audio[::-1], -40.0)
            end = start + len(audio) - max(0, last)
            self.on_event({"t": round(onset / self.rate, 4), "event": "user_speech", "source": ev.source,
                           "text": ev.text, "onset_t": round(onset / self.rate, 4),
                           "end_t": round(end / self.rate, 4)})
            if self._pending and self._pending[0].after is None:
                continue
            return

    def ring_out(self, seconds: float) -> np.ndarray:
        """The microphone after the speaker has gone silent: ``seconds`` of what is still in the room, the
        echo path's tail of what was played (its delay and impulse response) plus the room's noise, with
        nothing new played and nobody talking. A room does not go quiet the instant its speaker does; a
        benchmark that hands the canceller on to its next scenario feeds it this, so that the canceller never
        sees its far end stop with the echo cut off at the same sample (a state a real room never produces).
        Advances the room's clock; records nothing in :attr:`output`, :attr:`mic` or :attr:`echo`.

        :returns: float32 [round(seconds * rate) rounded down to whole blocks] at the room's rate.
        """
        blocks, silent = [], np.zeros(self.block, dtype=np.float32)
        for _ in range(int(seconds * self.rate) // self.block):
            mic = np.zeros(self.block, dtype=np.float32)
            self._add_room(mic, silent)
            self.n += self.block
            blocks.append(mic)
        return np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.float32)

    def _add_room(self, mic: np.ndarray, out: np.ndarray) -> Optional[np.ndarray]:
        """Add to ``mic`` (float32 [block], the microphone's samples from :attr:`n`) the echo of ``out`` (what
        was played in that block: delayed, through the impulse response, at the echo's gain), then the room's
        noise; the echo path keeps ``out`` for the blocks after.

        :returns: the echo added (float32 [block]), or None with no echo path.
        """
        echo = None
        if self._echo_gain is not None:
            line = np.concatenate([self._echo_line, out])
            echo = self._echo_gain * np.convolve(line, self._echo_fir, mode="valid").astype(np.float32)
            self._echo_line = line[len(line) - len(self._echo_line):] if len(self._echo_line) else line[:0]
            mic += echo
        if self._noise is not None and len(self._noise):
            mic += self._noise_gain * self._noise[np.arange(self.n, self.n + len(mic)) % len(self._noise)]
        return echo

    def output_audio(self) -> np.ndarray:
        return np.concatenate(self.output) if self.output else np.zeros(0, dtype=np.float32)

    def mic_audio(self) -> np.ndarray:
        return np.concatenate(self.mic) if self.mic else np.zeros(0, dtype=np.float32)


class RoomPort(PullPort):
    """The simulated room as an :class:`~appliance.audio.port.AudioPort`: the room's speaker reads through
    this port's fader, its microphone blocks go to the ``capture`` given to :meth:`start`.

    :param scenario: :class:`Scenario`, what the user says and the room's acoustics.
    :param on_event: ``on_event(record)`` for the room's ground truth (``user_speech``), e.g. the timeline.
    :param paced: True: on the wall clock (latencies include real compute). False (``--fast``): the room's
        sample clock, and after each microphone block the room waits until the ``settled()`` given to
        :meth:`start` says the pipeline has caught up, wherever a person would wait for it.
    :param rate: the pull rate, Hz (the room runs at 16 kHz, :data:`BLOCK` samples a tick).
    :param fade_ms: the fade on pause, resume and flush, ms.
    :param max_wait_s: unpaced: the longest wait for the pipeline per block, s.

    :attr:`room` is the :class:`SimulatedRoom`; :meth:`observe` (the session subscribes it) arms its
    ``after:`` events; :attr:`clock` is the timeline's clock (s since :meth:`start`, or the room's samples
    when unpaced, so the timeline lines up with ``reply.wav``). Drive it with :meth:`run` after :meth:`start`.
    """

    def __init__(self, scenario: Scenario, on_event: Callable[[dict], None], paced: bool = True,
                 rate: int = MODEL_RATE, fade_ms: float = 8.0, max_wait_s: float = 60.0):
        super().__init__(rate, fade_ms)
        self.paced = paced
        self.max_wait_s = max_wait_s
        self._settled: Callable[[], bool] = lambda: True
        self.room = SimulatedRoom(scenario, self.read, self._room_capture, on_event=on_event, paced=paced, rate=rate)
        if paced:
            self.clock = lambda: time.monotonic() - self.room.t0
        else:
            self.clock = lambda: self.room.n / self.room.rate

    def start(self, pull, capture, on_silent=None, *, on_status=None, settled=None) -> None:
        """As :meth:`AudioPort.start`; the wall clock of the timeline starts here; ``settled`` paces an
        unpaced room."""
        self.room.t0 = time.monotonic()
        if settled is not None:
            self._settled = settled
        super().start(pull, capture, on_silent, on_status=on_status)

    def _room_capture(self, mic: np.ndarray, far: np.ndarray) -> None:
        self._capture(mic, far)
        if not self.paced:
            deadline = time.monotonic() + self.max_wait_s
            while not self._settled() and time.monotonic() < deadline:
                time.sleep(0.002)

    def observe(self, record: dict) -> None:
        self.room.observe(record)

    def run(self, until: Callable[[], bool], max_seconds: float) -> None:
        """Play the scenario until ``until()`` or ``max_seconds`` of audio (see :meth:`SimulatedRoom.run`)."""
        self.room.run(until, max_seconds)

    def stop(self) -> None:
        self.room.stop()
