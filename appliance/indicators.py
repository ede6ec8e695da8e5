"""The appliance's face: status LEDs and the one button, through gpiozero.

The LEDs observe the conversation (they subscribe to its events, nothing polls it) and show its state with
a pattern readable across a room; the button posts events to the conversation:

- a short press toggles mute (``mute``); while a reply is being thought or spoken it stops the reply
  instead (``stop_reply``);
- a press held for ``gpio.long_press_s`` (default 3 s) starts a fresh conversation (``new_conversation``).

Presses are debounced in software (``gpio.debounce_ms``): an edge closer than that to the previous one is
contact bounce and ignored, the same on every pin factory (gpiozero's ``MockPin`` ignores ``bounce_time``).

Three LED set-ups (``gpio.led_kind``): one LED (``PWMLED`` on ``led_pin``; a pin without PWM falls back to
on/off patterns), an RGB LED (``RGBLED`` on ``rgb_pins``), or one plain LED per state (``state_leds``).
The default state → pattern table is :data:`DEFAULT_PATTERNS` (documented in the README, "LEDs and the button"); config keys
``gpio.patterns`` and ``gpio.colors`` override it per state.

Without GPIO hardware (a laptop, CI) the appliance runs without them and says so once in the log; tests
use gpiozero's ``MockFactory`` (``MockPWMPin`` for PWM and RGB LEDs).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from .events import Ev

log = logging.getLogger(__name__)

# state: (pattern on a single LED, pattern on an RGB LED, colour on an RGB LED). Patterns:
# steady = full on; dim = 15 %; pulse = fade in 1 s / out 1 s; blink = 0.5 s on / 0.5 s off;
# fast_blink = 0.1 s / 0.1 s; blip = 0.1 s on every 2 s; off.
DEFAULT_PATTERNS: dict[str, tuple[str, str, str]] = {
    "starting": ("pulse", "pulse", "#ffffff"),
    "loading": ("pulse", "pulse", "#0000ff"),
    "listening": ("dim", "steady", "#00ff00"),
    "thinking": ("blink", "pulse", "#00ffff"),
    "speaking": ("steady", "steady", "#00ffff"),
    "interrupted": ("off", "steady", "#ffff00"),
    "muted": ("blip", "steady", "#ff0000"),
    "error": ("fast_blink", "blink", "#ff0000"),
    "config_error": ("fast_blink", "fast_blink", "#ff8000"),
    "wake_word": ("off", "off", "#000000"),  # listen.mode wake_word, outside the follow-up window
}
# Blink timings (on_time, off_time), s, and pulse fades (in, out), s.
TIMINGS = {"blink": (0.5, 0.5), "fast_blink": (0.1, 0.1), "blip": (0.1, 1.9)}
PULSE = (1.0, 1.0)
DIM = 0.15
BUSY = ("thinking", "speaking", "interrupted")


class _Leds:
    """Drives one LED set-up; ``show(state)`` sets the pattern and returns at once (gpiozero animates
    blinks and pulses on its own background thread)."""

    def __init__(self, gpio, factory):
        from gpiozero import LED, PWMLED, RGBLED
        from gpiozero.exc import PinPWMUnsupported

        self.kind = gpio.led_kind
        self.devices: dict[str, object] = {}
        self.pwm = True
        pat = {s: (p[1] if self.kind == "rgb" else p[0]) for s, p in DEFAULT_PATTERNS.items()}
        pat.update(gpio.patterns)
        self.patterns = pat
        self.colors = {s: p[2] for s, p in DEFAULT_PATTERNS.items()}
        self.colors.update(gpio.colors)
        if self.kind == "single" and gpio.led_pin is not None:
            try:
                self.devices["led"] = PWMLED(gpio.led_pin, pin_factory=factory)
            except PinPWMUnsupported:
                self.pwm = False
                self.devices["led"] = LED(gpio.led_pin, pin_factory=factory)
        elif self.kind == "rgb" and gpio.rgb_pins:
            r, g, b = gpio.rgb_pins
            self.devices["rgb"] = RGBLED(r, g, b, active_high=gpio.rgb_active_high, pwm=True, pin_factory=factory)
        elif self.kind == "per_state":
            for state, pin in gpio.state_leds.items():
                self.devices[state] = LED(pin, pin_factory=factory)
            self.pwm = False

    @property
    def empty(self) -> bool:
        return not self.devices

    def show(self, state: str) -> None:
        pattern = self.patterns.get(state, "off")
        if self.kind == "single" and "led" in self.devices:
            self._single(self.devices["led"], pattern)
        elif self.kind == "rgb" and "rgb" in self.devices:
            self._rgb(self.devices["rgb"], pattern, self.colors.get(state, "white"))
        elif self.kind == "per_state":
            for s, led in self.devices.items():
                self._single(led, pattern if s == state else "off")

    def _single(self, led, pattern: str) -> None:
        if pattern == "off":
            led.off()
        elif pattern == "steady":
            led.on()
        elif pattern == "dim":
            if self.pwm and hasattr(led, "pulse"):
                led.value = DIM
            else:
                led.on()
        elif pattern == "pulse":
            if self.pwm and hasattr(led, "pulse"):
                led.pulse(*PULSE)
            else:
                led.blink(*PULSE)
        else:
            on, off = TIMINGS[pattern]
            led.blink(on, off)

    def _rgb(self, led, pattern: str, color: str) -> None:
        from colorzero import Color

        c = Color(color)
        if pattern == "off":
            led.off()
        elif pattern == "steady":
            led.color = c
        elif pattern == "dim":
            led.color = Color(*(DIM * v for v in c.rgb))
        elif pattern == "pulse":
            led.pulse(*PULSE, on_color=c, off_color=(0, 0, 0))
        else:
            on, off = TIMINGS[pattern]
            led.blink(on, off, on_color=c, off_color=(0, 0, 0))

    def close(self) -> None:
        for d in self.devices.values():
            try:
                d.close()
            except Exception:
                pass
        self.devices.clear()


class Indicators:
    """The LEDs (a conversation observer) and the button (a poster of conversation events).

    :param gpio: the ``gpio`` section of the config (:class:`appliance.config.GpioConfig`).
    :param post: the conversation's ``post(event, **info)``.
    :param pin_factory: a gpiozero pin factory (``MockFactory`` in tests); None = gpiozero's default.
    :raises gpiozero.GPIOZeroError: the pins cannot be used (see :func:`create` for the fallback).
    """

    def __init__(self, gpio, post: Callable[..., None], pin_factory=None):
        self.post = post
        self.factory = pin_factory
        self.gpio = gpio
        self.state = "starting"
        self.window_open = True  # listen.mode wake_word: the follow-up window (``listen_window`` events)
        self._override: Optional[tuple[str, float]] = None
        self._timer: Optional[threading.Timer] = None
        self._lock = threading.RLock()
        self.leds = _Leds(gpio, pin_factory)
        self.button = None
        self._press_t: Optional[float] = None
        self._release_t = 0.0
        self._held = False
        self.presses: list[str] = []  # what each press did, for the log and the tests
        if gpio.button_pin is not None:
            from gpiozero import Button

            self.button = Button(gpio.button_pin, pull_up=True, hold_time=gpio.long_press_s,
                                 pin_factory=pin_factory)
            self.button.when_pressed = self._on_pressed
            self.button.when_released = self._on_released
            self.button.when_held = self._on_held
        self.leds.show(self.state)

    # --- LEDs ---
    def observe(self, record: dict) -> None:
        """Conversation observer: follow ``state`` and ``listen_window`` events. While listening with the
        window closed (``listen.mode: wake_word``) the LEDs show ``wake_word``."""
        event = record.get("event")
        if event in (Ev.STATE, Ev.LISTEN_WINDOW):
            with self._lock:
                if event == Ev.STATE:
                    self.state = record["state"]
                else:
                    self.window_open = bool(record.get("open"))
                if self._override is None:
                    self.leds.show(self.shown)

    @property
    def shown(self) -> str:
        """The state the LEDs show: the conversation's, or ``wake_word`` while it listens for the wake word."""
        return "wake_word" if self.state == "listening" and not self.window_open else self.state

    def show(self, state: str) -> None:
        """Show a state that the conversation does not own (``loading`` while the model loads)."""
        with self._lock:
            self.state = state
            if self._override is None:
                self.leds.show(state)

    def flash(self, state: str, seconds: float) -> None:
        """Show ``state`` (e.g. ``config_error``) for ``seconds``, then the conversation's state again."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._override = (state, time.monotonic() + seconds)
            self.leds.show(state)
            self._timer = threading.Timer(seconds, self._end_flash)
            self._timer.daemon = True
            self._timer.start()

    def _end_flash(self) -> None:
        with self._lock:
            self._override = None
            self.leds.show(self.shown)

    # --- button ---
    def _on_pressed(self) -> None:
        now = time.monotonic()
        if now - self._release_t < self.gpio.debounce_ms / 1000.0:
            return  # bounce right after a release
        self._press_t = now
        self._held = False

    def _on_held(self) -> None:
        if self._press_t is None:
            return
        self._held = True
        self.presses.append("new_conversation")
        log.info("button: long press: new conversation")
        self.post(Ev.NEW_CONVERSATION, source="button")

    def _on_released(self) -> None:
        now = time.monotonic()
        pressed, self._press_t = self._press_t, None
        if pressed is None:
            return
        if now - pressed < self.gpio.debounce_ms / 1000.0:
            return  # a glitch shorter than the debounce time
        self._release_t = now
        if self._held:
            return
        if self.state in BUSY:
            self.presses.append("stop_reply")
            self.post(Ev.STOP_REPLY, source="button")
        else:
            self.presses.append("mute")
            self.post(Ev.MUTE, source="button")  # toggles

    def close(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self.leds.close()
            if self.button is not None:
                self.button.close()
                self.button = None


class _NoIndicators:
    """Stands in when GPIO is off or unavailable."""

    state = "starting"

    def observe(self, record: dict) -> None:
        pass

    def show(self, state: str) -> None:
        pass

    def flash(self, state: str, seconds: float) -> None:
        pass

    def close(self) -> None:
        pass


class Panel:
    """The LEDs and the button for the running service, across reloads: a conversation observer
    (``panel(record)``) whose pins :meth:`configure` can change.

    :param gpio: the ``gpio`` section; :func:`create` decides between real devices and none.
    :param post: the conversation's ``post(event, **info)`` (the button's presses).
    :param pin_factory: a gpiozero pin factory (``MockFactory`` in tests); None = gpiozero's default.
    """

    section = "gpio"  # Session.apply hands this observer the config's ``gpio`` section

    def __init__(self, gpio, post: Callable[..., None], pin_factory=None):
        self.gpio = gpio
        self.post = post
        self.factory = pin_factory
        self.inner = create(gpio, post, pin_factory)
        self._state: Optional[str] = None  # the conversation's last state, shown again on new pins

    def __call__(self, record: dict) -> None:
        if record.get("event") == "state":
            self._state = record["state"]
        self.inner.observe(record)

    observe = __call__

    @property
    def state(self) -> str:
        return self.inner.state

    def show(self, state: str) -> None:
        self.inner.show(state)

    def flash(self, state: str, seconds: float) -> None:
        self.inner.flash(state, seconds)

    def close(self) -> None:
        self.inner.close()

    def configure(self, gpio) -> None:
        """Move to the pins of a new ``gpio`` section. The old devices are released first (the new pins may
        overlap them); if the new ones cannot be had, the old ones are taken again and shown as before.

        :raises UserError: the new pins cannot be used (the old ones are in use again).
        """
        from .errors import UserError

        self.inner.close()
        try:
            self.inner = create(gpio, self.post, self.factory, strict=True)
            self.gpio = gpio
        except Exception as exc:
            self.inner = create(self.gpio, self.post, self.factory)
            raise UserError(f"gpio: the new pins cannot be used ({exc.__class__.__name__}: {exc}); "
                            "keeping the old ones") from None
        finally:
            if self._state is not None:
                self.inner.observe({"event": "state", "state": self._state})


_warned: set[str] = set()


def create(gpio, post: Callable[..., None], pin_factory=None, strict: bool = False):
    """Indicators for ``gpio``, or a no-op stand-in when ``gpio.enabled`` is false, no pin is configured,
    or the machine has no usable GPIO (logged once, with the reason; ``strict`` raises instead)."""
    if not gpio.enabled:
        return _NoIndicators()
    if gpio.led_pin is None and not gpio.rgb_pins and not gpio.state_leds and gpio.button_pin is None:
        _once("gpio: no LED or button pins configured (gpio.led_pin, gpio.rgb_pins, gpio.state_leds, "
              "gpio.button_pin); running without them")
        return _NoIndicators()
    try:
        return Indicators(gpio, post, pin_factory)
    except Exception as exc:  # gpiozero: BadPinFactory on a laptop, PinInUse, permissions, ...
        if strict:
            raise
        _once(f"gpio: not available here ({exc.__class__.__name__}: {exc}); running without LEDs and button "
              "(set gpio.enabled: false to silence this)")
        return _NoIndicators()


def _once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)
