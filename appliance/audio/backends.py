"""Choosing the audio backend: :func:`open_port`, the one place that builds an
:class:`~appliance.audio.port.AudioPort` from the config (as gpiozero picks its pin factory).

Kept apart from :mod:`appliance.audio.port` so that the interface imports none of its implementations
(the device package and the room import the interface; nothing imports back).
"""

from __future__ import annotations

from .device import DeviceAudio
from .port import AudioPort, NullPort
from .room import RoomPort


def open_port(cfg, rate: int, kind: str = "device", *, on_status=None, scenario=None, on_event=None,
              paced: bool = True) -> AudioPort:
    """The port for ``kind``, configured from ``cfg`` (a :class:`appliance.config.Config`).

    :param rate: the pull rate, Hz (the playback buffer's).
    :param kind: ``"device"`` (``cfg.audio.input``/``output``, ``output_block_ms``, ``retry_max_s``;
        ``on_status(kind, info)`` as :class:`~appliance.audio.device.DeviceAudio` documents), ``"room"``
        (``scenario``, ``on_event``, ``paced``) or ``"null"``.
    :raises ValueError: an unknown ``kind``.
    """
    fade_ms = cfg.interruption.fade_ms
    if kind == "device":
        return DeviceAudio(cfg.audio.input, cfg.audio.output, cfg.audio.output_block_ms, rate, on_status=on_status,
                           backoff=(0.5, cfg.audio.retry_max_s), fade_ms=fade_ms)
    if kind == "room":
        return RoomPort(scenario, on_event or (lambda record: None), paced=paced, rate=rate, fade_ms=fade_ms)
    if kind == "null":
        return NullPort(rate, fade_ms)
    raise ValueError(f"unknown audio port kind {kind!r}; use device, room or null")
