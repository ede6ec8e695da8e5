"""The message protocol between the service and its audio worker process.

One ``AF_UNIX``/``SOCK_SEQPACKET`` socket pair; every message is one datagram whose first byte is its
:class:`Kind`, followed by its body. Samples are float32 little-endian (native on the Pi and x86), mono
for output, interleaved ``in_channels`` for input, at the device's rates. Integers are little-endian
unsigned 32-bit.

Worker → service: ``INPUT`` (flags, microphone samples, the samples the output played since the previous
``INPUT``), ``REQUEST`` (samples wanted, flags, generation),
``SILENT``, ``READY`` / ``ERROR`` / ``LOST`` (JSON). Service → worker: ``DATA`` (generation, samples),
``PAUSE``, ``RESUME``, ``FLUSH``, ``WAKE``, ``ATTEND`` (on/off), ``CONFIGURE`` (JSON), ``QUIT``.

The generation: every flush starts a new one in the worker, which drops ``DATA`` answering a request made
before it, so samples of an interrupted reply that were on their way can never play after the flush.
"""

from __future__ import annotations

import json
import struct
from enum import Enum, IntFlag

import numpy as np

MAX_MSG = 1 << 20  # bytes: the largest datagram either side reads (1 s of 48 kHz stereo is 384 KiB)


class Kind(bytes, Enum):
    """The first byte of every message."""

    INPUT = b"I"  # worker → service: <flags:u32><frames:u32><dropped:u32> then float32 [frames * in_channels]
    #   (none when flagged DROPPED), then float32 [rest]: what the output callbacks played since the previous
    #   INPUT (the far end, at out_rate); `dropped`: input frames lost since the previous INPUT
    REQUEST = b"O"  # worker → service: <want:u32><flags:u32><generation:u32>: send `want` output samples
    DATA = b"D"  # service → worker: <generation:u32> then float32 [n] output samples at out_rate
    PAUSE = b"P"  # service → worker: fade out the ring and hold it
    RESUME = b"U"  # service → worker: fade back in where the pause stopped
    FLUSH = b"F"  # service → worker: fade out and drop the ring
    WAKE = b"W"  # service → worker: the playback buffer has samples; an idle ring asks for them again
    ATTEND = b"A"  # service → worker: <on:u32>: the VAD hears speech (1) or no longer does (0): while the output
    #   is idle, the microphone's blocks then go fewer to a message (worker.InputBatcher)
    CONFIGURE = b"C"  # service → worker: JSON {"fade_ms": float}
    SILENT = b"S"  # worker → service: a fade out reached silence
    READY = b"R"  # worker → service: JSON, the DeviceInfo fields
    ERROR = b"E"  # worker → service: JSON {kind, message, found?}; the worker exits
    LOST = b"L"  # worker → service: JSON {reason}; the device stopped, the worker exits
    QUIT = b"Q"  # service → worker: exit now


class Flag(IntFlag):
    """Status bits carried by ``INPUT`` and ``REQUEST``: PortAudio's callback flags (portaudio.h:
    paInputUnderflow … paOutputOverflow) and two of ours."""

    NONE = 0
    INPUT_UNDERFLOW = 0x1
    INPUT_OVERFLOW = 0x2
    OUTPUT_UNDERFLOW = 0x4
    OUTPUT_OVERFLOW = 0x8
    LATE = 0x100  # the output ring ran dry: the service did not send samples in time
    DROPPED = 0x200  # an input block was dropped on a full socket (the INPUT message carries no samples)
    IDLE = 0x400  # REQUEST: reserved (workers before WAKE asked for several blocks at once while idle)


XRUN_KEYS = ("input_overflow", "input_underflow", "output_underflow", "output_overflow", "late", "dropped_input")
FLAG_KEYS = ((Flag.INPUT_UNDERFLOW, "input_underflow"), (Flag.INPUT_OVERFLOW, "input_overflow"),
             (Flag.OUTPUT_UNDERFLOW, "output_underflow"), (Flag.OUTPUT_OVERFLOW, "output_overflow"),
             (Flag.LATE, "late"), (Flag.DROPPED, "dropped_input"))

_U32 = struct.Struct("<I")
_REQ = struct.Struct("<III")
_IN = struct.Struct("<III")


def kind_of(msg: bytes) -> Kind | None:
    """The message's kind, or None for an empty message (the peer closed) or an unknown first byte."""
    try:
        return Kind(msg[:1]) if msg else None
    except ValueError:
        return None


def pack_input(flags: int, samples: bytes = b"", played: bytes = b"", frames: int = 0, dropped: int = 0) -> bytes:
    """``samples``: the block's interleaved float32 bytes (``frames`` frames; empty for a dropped block);
    ``played``: float32 bytes the output played since the previous INPUT; ``dropped``: input frames lost
    (on a full socket) since the previous INPUT."""
    return Kind.INPUT.value + _IN.pack(int(flags), int(frames), int(dropped)) + samples + played


def unpack_input(msg: bytes, channels: int = 1) -> tuple[Flag, np.ndarray, np.ndarray, int, int]:
    """(flags, float32 interleaved microphone samples (empty for a dropped block), float32 samples the
    output played since the previous INPUT, the block's frames, input frames dropped before it)."""
    flags, frames, dropped = _IN.unpack_from(msg, 1)
    body = np.frombuffer(msg[1 + _IN.size:], dtype=np.float32)
    n = 0 if flags & Flag.DROPPED else frames * channels
    return Flag(flags), body[:n], body[n:], frames, dropped


def pack_request(want: int, flags: int, generation: int) -> bytes:
    return Kind.REQUEST.value + _REQ.pack(int(want), int(flags), int(generation))


def unpack_request(msg: bytes) -> tuple[int, Flag, int]:
    """(samples wanted, flags, generation)."""
    want, flags, gen = _REQ.unpack_from(msg, 1)
    return want, Flag(flags), gen


def pack_data(generation: int, samples: np.ndarray) -> bytes:
    return Kind.DATA.value + _U32.pack(int(generation)) + np.asarray(samples, dtype=np.float32).tobytes()


def unpack_data(msg: bytes) -> tuple[int, np.ndarray]:
    """(generation, float32 samples: a copy the receiver may keep)."""
    (gen,) = _U32.unpack_from(msg, 1)
    return gen, np.frombuffer(msg[1 + _U32.size:], dtype=np.float32).copy()


def pack_attend(on: bool) -> bytes:
    return Kind.ATTEND.value + _U32.pack(1 if on else 0)


def unpack_attend(msg: bytes) -> bool:
    """Whether the service's VAD hears speech."""
    (on,) = _U32.unpack_from(msg, 1)
    return bool(on)


def pack_json(kind: Kind, obj: dict) -> bytes:
    return kind.value + json.dumps(obj).encode()


def unpack_json(msg: bytes) -> dict:
    """The JSON body (``{}`` when there is none). :raises ValueError: not JSON."""
    return json.loads(msg[1:] or b"{}")
