"""Who the appliance is (``assistant`` in config.yaml): its system prompt, and the local date and time it
is told at each turn.

The date and time go into each turn's context, not into the system prompt: the system prompt is the start
of the KV cache, and rewriting it would mean re-pre-filling the whole conversation. Each user turn opens
with one bracketed line, e.g. ``[Tuesday, December 1, 2026, 8:41 AM]``, which is appended to the cache
with the turn, like the user's words.
"""

from __future__ import annotations

from datetime import datetime, tzinfo
from typing import Callable, Optional

WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")


def system_prompt(cfg) -> str:
    """The system prompt a config asks for: ``model.system_prompt`` when set (the key configs had before
    the ``assistant`` section), otherwise ``assistant.system_prompt``; ``{name}`` becomes
    ``assistant.name``."""
    text = cfg.model.system_prompt if cfg.model.system_prompt is not None else cfg.assistant.system_prompt
    return text.replace("{name}", cfg.assistant.name)


def zone(name: str) -> Optional[tzinfo]:
    """``assistant.timezone`` as a tzinfo: None for ``local`` (the system's zone, /etc/localtime)."""
    if name == "local":
        return None
    from zoneinfo import ZoneInfo

    return ZoneInfo(name)


def spoken_time(now: datetime, locale: str = "en_US") -> str:
    """The date and time as the model is told them: ``Tuesday, December 1, 2026, 8:41 AM`` for en_US
    (month first, 12-hour clock), ``Tuesday 1 December 2026, 08:41`` for every other locale (day first,
    24-hour clock). English names: the model is told, it does not read them aloud."""
    day = WEEKDAYS[now.weekday()]
    month = MONTHS[now.month - 1]
    if locale == "en_US":
        hour = now.hour % 12 or 12
        return f"{day}, {month} {now.day}, {now.year}, {hour}:{now.minute:02d} {'AM' if now.hour < 12 else 'PM'}"
    return f"{day} {now.day} {month} {now.year}, {now.hour:02d}:{now.minute:02d}"


def turn_context(now: datetime, locale: str = "en_US") -> str:
    """The line that opens a user turn: ``[<spoken_time>]``."""
    return f"[{spoken_time(now, locale)}]"


def turn_context_source(cfg, clock: Optional[Callable[[], datetime]] = None) -> Callable[[], str]:
    """A function that returns the current turn context for ``cfg.assistant`` (time zone and locale).

    :param clock: returns an aware or naive ``datetime`` (tests); default ``datetime.now`` in the zone.
    """
    a = cfg.assistant
    tz = zone(a.timezone)
    now = clock or (lambda: datetime.now(tz).astimezone(tz) if tz else datetime.now().astimezone())
    return lambda: turn_context(now(), a.locale)
