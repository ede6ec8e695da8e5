"""LEDs and the button on gpiozero's MockFactory (``MockPWMPin`` for PWM and RGB LEDs): the only mocked
part is the Pi's GPIO hardware. The conversation is real (the embedded Gemma 3 270M, Piper, Silero)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from gpiozero.pins.mock import MockFactory, MockPWMPin

from appliance.config import GpioConfig
from appliance.indicators import DEFAULT_PATTERNS, Indicators

STATES = list(DEFAULT_PATTERNS)


@pytest.fixture
def factory():
    f = MockFactory(pin_class=MockPWMPin)
    yield f
    f.reset()


def _sample(read, seconds=1.3, step=0.01):
    vals = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        vals.append(read())
        time.sleep(step)
    return np.array(vals, dtype=float)


def _classify(v: np.ndarray) -> str:
    if np.all(v == 0):
        return "off"
    if np.all(v == v[0]):
        return "steady" if v[0] >= 0.99 else "dim"
    if np.any((v > 0.05) & (v < 0.95)):
        return "pulse"
    on = np.mean(v > 0.5)
    changes = int(np.sum(np.diff(v > 0.5) != 0))
    if on < 0.2:
        return "blip"
    return "fast_blink" if changes >= 6 else "blink"


@pytest.mark.parametrize("state", STATES)
def test_single_led_pattern_for_every_state(factory, state):
    ind = Indicators(GpioConfig(led_pin=17), lambda *a, **k: None, pin_factory=factory)
    try:
        ind.observe({"event": "state", "state": state})
        pin = factory.pin(17)
        seen = _classify(_sample(lambda: pin.state, 2.2 if DEFAULT_PATTERNS[state][0] == "blip" else 1.3))
        assert seen == DEFAULT_PATTERNS[state][0]
    finally:
        ind.close()


def test_rgb_led_colours_and_patterns(factory):
    ind = Indicators(GpioConfig(led_kind="rgb", rgb_pins=[5, 6, 13]), lambda *a, **k: None, pin_factory=factory)
    try:
        r, g, b = (factory.pin(p) for p in (5, 6, 13))
        ind.observe({"event": "state", "state": "listening"})
        assert (r.state, g.state, b.state) == (0, 1, 0)  # steady green
        ind.observe({"event": "state", "state": "muted"})
        assert (r.state, g.state, b.state) == (1, 0, 0)  # steady red
        ind.observe({"event": "state", "state": "error"})
        assert _classify(_sample(lambda: r.state)) == "blink" and g.state == 0
        ind.flash("config_error", 1.0)
        assert _classify(_sample(lambda: r.state, 0.8)) == "fast_blink"
        time.sleep(0.4)
        assert _classify(_sample(lambda: r.state)) == "blink"  # back to the conversation's state
    finally:
        ind.close()


def test_per_state_leds_light_only_the_current_state(factory):
    leds = {"listening": 20, "thinking": 21, "speaking": 22, "muted": 23, "error": 24}
    ind = Indicators(GpioConfig(led_kind="per_state", state_leds=leds), lambda *a, **k: None, pin_factory=factory)
    try:
        for state in ("listening", "speaking", "muted"):
            ind.observe({"event": "state", "state": state})
            lit = {s for s, p in leds.items() if factory.pin(p).state}
            assert lit == {state}
    finally:
        ind.close()


def test_button_debounce_short_and_long_press(factory):
    posted = []
    ind = Indicators(GpioConfig(button_pin=26, long_press_s=0.5, debounce_ms=50),
                     lambda name, **info: posted.append(name), pin_factory=factory)
    pin = factory.pin(26)
    try:
        ind.observe({"event": "state", "state": "listening"})
        pin.drive_low(); time.sleep(0.01); pin.drive_high()  # 10 ms: contact bounce
        time.sleep(0.1)
        assert posted == []
        pin.drive_low(); time.sleep(0.12); pin.drive_high()
        assert posted == ["mute"]
        time.sleep(0.1)
        ind.observe({"event": "state", "state": "speaking"})
        pin.drive_low(); time.sleep(0.12); pin.drive_high()
        assert posted == ["mute", "stop_reply"]
        time.sleep(0.1)
        pin.drive_low(); time.sleep(0.8); pin.drive_high()
        assert posted == ["mute", "stop_reply", "new_conversation"]  # no short press after a long one
    finally:
        ind.close()


def test_button_on_the_real_conversation(factory, fresh_parts, embedded_cfg, question_audio):
    """Mute: nothing reaches the VAD. Stop while speaking. Long press: a fresh conversation."""
    from appliance.audio.port import NullPort
    from appliance.session import Session

    s = Session(embedded_cfg, fresh_parts, NullPort(16000))
    ind = Indicators(GpioConfig(button_pin=26, long_press_s=0.5), s.conversation.post, pin_factory=factory)
    s.conversation.subscribe(ind.observe)
    pin = factory.pin(26)

    def press(hold):
        pin.drive_low(); time.sleep(hold); pin.drive_high(); time.sleep(0.1)

    def wait_state(st, timeout=30):
        end = time.monotonic() + timeout
        while time.monotonic() < end and s.conversation.state.value != st:
            time.sleep(0.02)
        return s.conversation.state.value

    s.start()
    try:
        assert wait_state("listening") == "listening"
        press(0.1)
        assert wait_state("muted") == "muted"
        consumed = s.segmenter._n
        for i in range(0, len(question_audio), 160):
            s.listener.capture(question_audio[i:i + 160])
        time.sleep(0.5)
        assert s.segmenter._n == consumed  # not one sample reached Silero
        press(0.1)
        assert wait_state("listening") == "listening"
        s.conversation.post("vad_end", speech_ms=900.0, audio=None, transcript="What is the moon?")
        assert wait_state("speaking", 60) == "speaking"  # nobody reads the playback: it stays speaking
        press(0.1)
        assert wait_state("listening") == "listening"
        s.engine_worker.sync()
        assert len(fresh_parts.engine.history) == 2
        press(0.8)
        s.engine_worker.sync()
        assert fresh_parts.engine.history == []
        assert ind.presses == ["mute", "mute", "stop_reply", "new_conversation"]
    finally:
        ind.close()
        s.stop()


def test_a_reload_moves_the_leds_and_a_refused_one_leaves_them_lit(factory, tmp_path, fresh_parts, embedded_cfg):
    """``Session.apply`` first prepares what can fail and changes nothing (it used to close the live LEDs
    while preparing); the pins move only once the rest is ready, and pins that cannot be had leave the old
    ones lit."""
    from gpiozero import LED

    from appliance.errors import UserError
    from appliance.indicators import DIM, Panel
    from appliance.audio.port import NullPort
    from appliance.session import Session

    panel = Panel(GpioConfig(enabled=True, led_pin=12), lambda *a, **k: None, pin_factory=factory)
    s = Session(embedded_cfg, fresh_parts, NullPort(16000), [panel])
    s.start()
    try:
        end = time.monotonic() + 10
        while s.conversation.state.value != "listening" and time.monotonic() < end:
            time.sleep(0.02)
        led = panel.inner.leds.devices["led"]
        assert led.value == pytest.approx(DIM)  # listening

        bad = embedded_cfg.model_copy(deep=True)
        bad.gpio = GpioConfig(enabled=True, led_pin=13)
        bad.voice.model = str(tmp_path / "no-such-voice.onnx")
        with pytest.raises(UserError):
            s.apply(bad)
        assert panel.inner.leds.devices["led"] is led and not led.closed and led.value == pytest.approx(DIM)

        good = embedded_cfg.model_copy(deep=True)
        good.gpio = GpioConfig(enabled=True, led_pin=13)
        assert s.apply(good) == ["gpio"]
        assert led.closed and factory.pin(13).state == pytest.approx(DIM)

        other = LED(5, pin_factory=factory)  # someone else holds pin 5
        taken = embedded_cfg.model_copy(deep=True)
        taken.gpio = GpioConfig(enabled=True, led_pin=5)
        changed = s.apply(taken)
        assert len(changed) == 1 and changed[0].startswith("gpio (refused: gpio: the new pins cannot be used")
        assert factory.pin(13).state == pytest.approx(DIM)  # back on the old pin, showing the state
        other.close()
    finally:
        s.stop()
        panel.close()
