"""Real sound devices through sounddevice (PortAudio), in a worker process the service can replace.

- :mod:`.host`: :class:`DeviceAudio`, the :class:`~appliance.audio.port.AudioPort` the service plays
  through, its supervisor and reader threads, and :func:`play`;
- :mod:`.worker`: the child process that owns the PortAudio streams;
- :mod:`.protocol`: the messages between them (:class:`~.protocol.Kind`, :class:`~.protocol.Flag`);
- :mod:`.listing`: devices by name, the stream format each opens at (:func:`probe_format`), the listing.
"""

from .host import DeviceAudio, DeviceInfo, play
from .listing import (DeviceNotFound, default_devices, describe_devices, import_sounddevice, list_devices,
                      match_device, probe_format, query_devices)
from .protocol import XRUN_KEYS

__all__ = ["DeviceAudio", "DeviceInfo", "DeviceNotFound", "XRUN_KEYS", "default_devices", "describe_devices",
           "import_sounddevice", "list_devices", "match_device", "play", "probe_format", "query_devices"]
