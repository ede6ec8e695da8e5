"""config.yaml: every kind of bad config gets its exact one-line message and exit 2; the shipped file,
the schema's defaults and the docs agree."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.config import Config, ConfigError, GpioConfig, parse

ROOT = Path(__file__).resolve().parent.parent


def check_config(path):
    return subprocess.run([sys.executable, "-m", "appliance", "check-config", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def tail(path):
    return f" (fix it, then run `appliance check-config {path}`)"


BAD = {
    "wrong type": ("vad:\n  threshold: 0.5\n  min_silence_ms: lots\n",
                   "line 3: vad.min_silence_ms: expected a whole number, found 'lots' (text)"),
    "quoted number": ("model:\n  n_threads: \"4\"\n",
                      "line 2: model.n_threads: expected a whole number, found '4' (text)"),
    "bool for int": ("model:\n  n_threads: true\n",
                     "line 2: model.n_threads: expected a whole number, found true (true/false)"),
    "out of range": ("model:\n  n_ctx: 100\n",
                     "line 2: model.n_ctx: expected a value >= 256 and <= 131072, found 100 (integer)"),
    "not one of": ("model:\n  kv_cache_type: q5\n",
                   "line 2: model.kv_cache_type: expected one of 'f16', 'q8_0' or 'q4_0', found 'q5' (text)"),
    "unknown key": ("vad:\n  treshold: 0.6\n",
                    "line 2: vad.treshold: unknown key; did you mean 'threshold'?"),
    "unknown section": ("vda:\n  threshold: 0.6\n",
                        "line 1: vda: unknown key; did you mean 'vad'?"),
    "section not a mapping": ("vad: 3\n",
                              "line 1: vad: expected a section (a mapping of keys), found 3 (integer)"),
    "bad pin": ("gpio:\n  led_pin: 1\n",
                "line 2: gpio.led_pin: expected a BCM GPIO number from 2 to 27 (0 and 1 belong to the HAT "
                "EEPROM), found 1 (integer)"),
    "pin past the header": ("gpio:\n  button_pin: 28\n",
                            "line 2: gpio.button_pin: expected a BCM GPIO number from 2 to 27 (0 and 1 belong "
                            "to the HAT EEPROM), found 28 (integer)"),
    "pin used twice": ("gpio:\n  led_pin: 17\n  button_pin: 17\n",
                       "line 3: gpio.button_pin: pin 17 is already used by gpio.led_pin; give each key its own pin"),
    "duplicate key": ("vad:\n  threshold: 0.5\n  threshold: 0.6\n",
                      "line 3: vad.threshold: duplicate key (also at line 2; only this one would count); keep one"),
    "invalid YAML": ("vad:\n  threshold: [0.5\n",
                     "line 3: invalid YAML: expected ',' or ']', but got '<stream end>' (while parsing a "
                     "flow sequence that began at line 2)"),
    "tab indentation": ("vad:\n\tthreshold: 0.5\n",
                        "line 2: invalid YAML: found character '\\t' that cannot start any token"),
    "led kind without its pins": ("gpio:\n  led_kind: rgb\n",  # nothing would light, without a word
                                  "line 2: gpio.led_kind: rgb needs gpio.rgb_pins; give rgb_pins"),
    "pins for another led kind": ("gpio:\n  led_kind: per_state\n  led_pin: 17\n",
                                  "line 2: gpio.led_kind: per_state needs gpio.state_leds, but gpio.led_pin is "
                                  "given; set led_kind: single, or give state_leds"),
    "tilde path": ("storage:\n  state_dir: ~/state\n",  # check-config and the service would expand it apart
                   "line 2: storage.state_dir: '~' is not expanded here (the service runs as its own user, whose "
                   "home is not yours); give the absolute path, found '~/state' (text)"),
    "not a mapping": ("- vad\n", "line 1: (top): expected a mapping of sections, found ['vad'] (list)"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_config_gets_its_exact_message_and_exit_2(tmp_path, kind):
    text, problem = BAD[kind]
    cfg = tmp_path / "config.yaml"
    cfg.write_text(text)
    r = check_config(cfg)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == ""
    assert r.stderr == f"error: {cfg}: {problem}{tail(cfg)}\n"


def test_missing_config_file(tmp_path):
    cfg = tmp_path / "nowhere.yaml"
    r = check_config(cfg)
    assert r.returncode == 2
    assert r.stderr == (f"error: {cfg}: config file not found; check the path (the commented default is "
                        "config.yaml in the source tree)\n")


def test_config_that_is_not_utf8(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_bytes(b"vad:\n  threshold: 0.5 \xff\n")
    r = check_config(cfg)
    assert r.returncode == 2
    assert r.stderr == (f"error: {cfg}: not UTF-8 text (byte 22, line 2); save it as UTF-8, e.g. "
                        "`iconv -f latin1 -t utf-8 config.yaml > fixed.yaml`\n")


def test_every_problem_at_once_sorted_by_line(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("audio:\n  outptu: x\nvad:\n  threshold: 2\ngpio:\n  led_pin: 0\n")
    r = check_config(cfg)
    assert r.returncode == 2
    assert r.stderr == (f"error: {cfg}: line 2: audio.outptu: unknown key; did you mean 'output'?; "
                        "line 4: vad.threshold: expected a value > 0.0 and < 1.0, found 2 (integer); "
                        "line 6: gpio.led_pin: expected a BCM GPIO number from 2 to 27 (0 and 1 belong to the "
                        f"HAT EEPROM), found 0 (integer){tail(cfg)}\n")


def test_problems_are_structured():
    with pytest.raises(ConfigError) as e:
        parse("vad:\n  min_silence_ms: lots\n  treshold: 1\n", Path("c.yaml"))
    assert [(p.line, p.path) for p in e.value.problems] == [(2, "vad.min_silence_ms"), (3, "vad.treshold")]


def test_valid_config_exit_0(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("gpio:\n  led_pin: 17\n  button_pin: 27\nvad:\n  min_silence_ms: 600\n")
    r = check_config(cfg)
    assert (r.returncode, r.stderr) == (0, "")
    # the default model paths are the Pi's: valid, with a note that they are not here and who checks them
    assert r.stdout.startswith(f"{cfg}: valid\nnote: not found on this machine: model.gguf /var/lib/appliance/models/")
    assert f"`appliance doctor --config {cfg}`" in r.stdout
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    cfg.write_text(f"model:\n  gguf: {gguf}\n  mmproj: null\n")
    r = check_config(cfg)
    assert (r.returncode, r.stdout, r.stderr) == (0, f"{cfg}: valid\n", "")
    # a voice that is not here is named too (it was left out), and then its config beside it
    voice = tmp_path / "v.onnx"
    cfg.write_text(f"model:\n  gguf: {gguf}\n  mmproj: null\nvoice:\n  model: {voice}\n")
    assert check_config(cfg).stdout.startswith(f"{cfg}: valid\nnote: not found on this machine: voice.model {voice};")
    voice.write_bytes(b"")
    assert f"the voice's config {voice}.json;" in check_config(cfg).stdout


def test_empty_file_is_all_defaults():
    assert parse("", Path("c.yaml")) == Config()
    assert parse("# only comments\n", Path("c.yaml")) == Config()


def test_pins_twice_checks_every_pin_key():
    """The duplicate-pin rule covers every ``*_pin`` key the section has, including ones added later."""
    pin_keys = [n for n in GpioConfig.model_fields if n.endswith("_pin")]
    assert len(pin_keys) >= 2
    data = {"gpio": {pin_keys[0]: 22, pin_keys[-1]: 22}}
    with pytest.raises(ConfigError) as e:
        parse("gpio:\n" + "".join(f"  {k}: {v}\n" for k, v in data["gpio"].items()), Path("c.yaml"))
    assert f"already used by gpio.{pin_keys[0]}" in str(e.value)


def test_shipped_config_is_the_defaults():
    """config.yaml shows every default: parsing it gives exactly the schema's defaults."""
    assert parse((ROOT / "config.yaml").read_text(), ROOT / "config.yaml") == Config()


def _key_paths(model, prefix=""):
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and hasattr(ann, "model_fields"):
            yield from _key_paths(ann, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_every_key_is_in_config_yaml_with_a_comment():
    """Every schema key appears in the shipped config.yaml, with a comment on its line or just above."""
    lines = (ROOT / "config.yaml").read_text().splitlines()
    section = None
    seen = {}
    for i, line in enumerate(lines):
        m = re.match(r"^(\w+):\s*(#.*)?$", line)
        if m:
            section = m.group(1)
            continue
        m = re.match(r"^  (\w+):", line)
        if m and section:
            above = lines[i - 1].strip() if i else ""
            seen[f"{section}.{m.group(1)}"] = "#" in line or above.startswith("#")
    for key in _key_paths(Config):
        assert key in seen, f"{key} is not in config.yaml"
    undocumented = [k for k in _key_paths(Config) if not seen[k]]
    # Self-explanatory sampling keys share the comment of the block they sit in.
    assert not [k for k in undocumented if k not in {"model.temperature", "model.top_p", "model.seed"}], undocumented


def test_every_key_is_in_the_docs():
    doc = (ROOT / "docs" / "config.md").read_text()
    missing = [k for k in _key_paths(Config) if f"`{k}`" not in doc]
    assert not missing, f"docs/config.md lacks {missing}"


def test_range_and_length_messages_give_both_bounds_in_plain_words():
    """One bound was given ("< 1.0" for 1.7, "> 0.0" for -1), and pydantic's "list should have at least 3 items
    after validation, not 2" showed through."""
    with pytest.raises(ConfigError) as e:
        parse("vad:\n  threshold: -1\naudio:\n  output_block_ms: 500\ngpio:\n  rgb_pins: [5, 6]\n", Path("c.yaml"))
    text = str(e.value)
    assert "vad.threshold: expected a value > 0.0 and < 1.0, found -1" in text, text
    assert "audio.output_block_ms: expected a value >= 2 and <= 100, found 500" in text, text
    assert "gpio.rgb_pins: expected a list of exactly 3 items, found [5, 6]" in text, text
    assert "validation" not in text, text


def test_shipped_config_states_the_bounds_the_validator_applies():
    """config.yaml said output_block_ms (10-20) while the validator takes 2-100."""
    from appliance.config import AudioConfig

    field = AudioConfig.model_fields["output_block_ms"]
    low = next(m.ge for m in field.metadata if getattr(m, "ge", None) is not None)
    high = next(m.le for m in field.metadata if getattr(m, "le", None) is not None)
    line = next(l for l in (ROOT / "config.yaml").read_text().splitlines() if l.strip().startswith("output_block_ms:"))
    assert f"({low}-{high})" in line, line
