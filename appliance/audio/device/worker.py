"""The audio worker process: PortAudio lives only here (``python -m appliance.audio.device worker FD PARAMS``).

It opens the two streams by name, shuttles blocks over the socket (:mod:`.protocol`), plays the output
from a :class:`~appliance.audio.fader.Fader` ring, watches for a device that stops calling back, and exits
hard (``os._exit``) so that no PortAudio teardown can hang or crash on a dead device.

- input callback: copy the block and send it without blocking, with what the output callbacks played since
  the previous block (the far end, exactly as the card got it); a full socket drops the block (the next
  ``INPUT`` says how many frames were lost, and carries the played samples kept meanwhile).
- output callback: read ``frames`` samples from the ring (silence, flagged ``LATE``, when it ran dry while
  playing), then ask for as many samples as keep the ring at its target: 2 blocks to start (more when the
  fade is longer: the fade and one block), one more after each late block, up to 8.
- idle (the service has sent only digital silence for ``IDLE_AFTER_S``, and the ring plays): the ring asks
  for nothing at all; it plays out what it holds, then silence by itself (not counted late: the far end
  carries it as played, as always), until the service sends ``WAKE`` (its playback buffer got a segment,
  or handed out digital silence with more queued: :meth:`appliance.audio.port.AudioPort.wake`), or a
  ``RESUME`` or ``FLUSH`` comes; then the next output
  callback asks for the whole target again. The input callback meanwhile sends the microphone's blocks
  several to one ``INPUT`` (each message wakes a thread in each process, and a thread woken cold costs
  several times its work done warm; :class:`InputBatcher`): ``QUIET_INPUT_BLOCKS`` while nobody talks,
  ``FLOOR_MESSAGE_S`` of them (20 blocks of 10 ms) once the room has stayed at its noise floor (every block of the last ``CALM_S``
  within ``FLOOR_MARGIN_DB`` of the quietest block of the last ``FLOOR_S``, learnt over ``FLOOR_S`` of
  idle), and ``LISTEN_INPUT_BLOCKS`` once the service says its VAD hears speech (``ATTEND`` on, from its
  onset to its end or rejection). The first block that rises above the floor's margin goes at once, with
  the blocks held before it; the next ones go ``QUIET_INPUT_BLOCKS`` to a message until the room is at
  its floor again. The price: while idle the start of a user's turn (its onset) reaches the service up to
  ``QUIET_INPUT_BLOCKS`` − 1 blocks later (50 ms at the default 10 ms block; none when it rises out of the
  floor, up to 190 ms (``FLOOR_MESSAGE_S`` less a block) for a sound that stays within the floor's margin), and
  the rest of the turn, its end included, up to ``LISTEN_INPUT_BLOCKS`` − 1 blocks later (20 ms; at 48 kHz
  soxr hands the service 30 ms at a time anyway, so one message of 3 blocks is one capture); the
  utterance loses nothing (the VAD keeps 200 ms before its onset). While the output is not idle (a reply
  plays, or is paused: a barge-in) every block is its own message, and the floor is learnt afresh after it. A reply's first samples are asked for at the first output callback
  after ``WAKE`` (within one block) and, the ring being empty then, play as soon as they arrive (before,
  they queued behind 2–6 blocks of silence). A pause (a barge-in) is never idle.
- ``ATTEND``: the service's VAD hears speech (on) or no longer does (off): the input's batching above.
- ``PAUSE``/``RESUME``/``FLUSH``: the ring's fader fades out over ``fade_ms`` of what it holds and keeps
  the rest (pause) or drops it (flush), and fades back in on resume; ``SILENT`` says a fade out reached
  silence. ``CONFIGURE`` changes ``fade_ms`` while running (a config reload).

PARAMS (JSON): ``input`` (name substring or null), ``output``, ``block_ms``, ``fade_ms`` (default 8),
``idle_s`` (default ``IDLE_AFTER_S``; 0: never idle, for a caller that sends no ``WAKE``),
``stall_s`` (default 1.0: no callback for this long is a lost device), ``grace_s`` (default 3.0: the first
callback must come within this long of opening). Exit codes: 0 asked to quit or the service went away,
3 device not found, 4 could not open, 5 device lost.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from typing import Optional

import numpy as np

from ..fader import FadeState, Fader, fade_samples
from . import protocol as p
from .listing import DeviceNotFound, default_devices, import_sounddevice, match_device, probe_format, query_devices

RING_MIN_BLOCKS, RING_MAX_BLOCKS = 2, 8
IDLE_AFTER_S = 0.2  # digital silence received for this long (more than the ring holds): the output is idle
QUIET_INPUT_BLOCKS = 6  # ... then the ring asks for nothing until WAKE, and the microphone's blocks go this many to
#   a message while nobody talks (InputBatcher) ...
FLOOR_MESSAGE_S = 0.2  # ... this long a message (at least QUIET_INPUT_BLOCKS) while the room stays at its noise
#   floor (a time, not a count: a 100 ms block must not make 2 s datagrams, which a 208 KiB socket buffer refuses) ...
LISTEN_INPUT_BLOCKS = 3  # ... and this many while the service's VAD hears speech (ATTEND on)
FLOOR_S = 3.0  # the room's floor: the quietest block (mean square) of the last FLOOR_S s, learnt while idle
FLOOR_MARGIN_DB = 3.0  # a block louder than the floor by more than this is a sound in the room
CALM_S = 0.5  # no sound for this long (after FLOOR_S idle): the room is at its floor
_FLOOR_SEGMENTS = 6  # the floor's window, in segments of FLOOR_S / _FLOOR_SEGMENTS
WATCH_S = 1.0  # the control loop wakes at least this often with no message (see watch_timeout)


class InputBatcher:
    """The worker's input side: how many microphone blocks go to one ``INPUT`` message.

    Every block is its own message while the output is not idle (a reply plays or is paused: a barge-in
    is heard at once); while it is idle, ``LISTEN_INPUT_BLOCKS`` blocks go to a message while
    :attr:`attentive` (the service's VAD hears speech: the end of the turn is heard as soon as before),
    as many as make ``FLOOR_MESSAGE_S`` (at least ``QUIET_INPUT_BLOCKS``) while the room is at its noise floor
    (:attr:`at_floor`), else
    ``QUIET_INPUT_BLOCKS``. A block that rises out of the floor (its mean square more than
    ``FLOOR_MARGIN_DB`` above the floor's) goes at once with what is held. The floor is learnt only from idle,
    unattended blocks, afresh after a reply or an utterance (as the VAD's own floor is,
    :class:`appliance.vad.VadSegmenter`). Called from the input callback only; :attr:`attentive` is set by
    the control loop (a stale read costs one block's batching).

    :param rate: the microphone's rate, Hz (``FLOOR_S`` and ``CALM_S`` are counted in its frames).
    """

    def __init__(self, rate: int = 48000):
        self.attentive = False
        self._held: list[bytes] = []
        self._flags = 0
        self._frames = 0
        self._margin = 10.0 ** (FLOOR_MARGIN_DB / 10.0)
        self._segment = max(1, int(rate * FLOOR_S / _FLOOR_SEGMENTS))  # frames
        self._learn = int(rate * FLOOR_S)  # frames
        self._calm_needed = int(rate * CALM_S)  # frames
        self._rate = rate
        self._block = 0  # the last block's frames
        self._floor_blocks = QUIET_INPUT_BLOCKS  # blocks to a message at the floor (FLOOR_MESSAGE_S of them)
        self._mins: deque = deque(maxlen=_FLOOR_SEGMENTS)  # the quietest block of each whole segment
        self._forget()

    def _forget(self) -> None:
        """Learn the floor afresh (after a reply or an utterance, or a block of unknown level)."""
        self._mins.clear()
        self._old_min = float("inf")  # the quietest block of the whole segments kept (min of _mins)
        self._seg_min = float("inf")  # the quietest block of the segment under way
        self._seg_frames = 0
        self._learnt = 0  # frames of idle, unattended input the floor has heard
        self._calm = 0  # frames since the last block above the floor's margin

    @property
    def at_floor(self) -> bool:
        """The room has been at its floor for ``CALM_S``, after ``FLOOR_S`` idle to learn it."""
        return self._learnt >= self._learn and self._calm >= self._calm_needed

    def batch(self, idle: bool) -> int:
        """Blocks to a message now."""
        if not idle:
            return 1
        if self.attentive:
            return LISTEN_INPUT_BLOCKS
        return self._floor_blocks if self.at_floor else QUIET_INPUT_BLOCKS

    def _hear(self, power: float, frames: int) -> bool:
        """An idle, unattended block's mean square, learnt by the floor. :returns: it rose out of the floor."""
        was = self.at_floor
        floor = self._seg_min if self._seg_min < self._old_min else self._old_min
        loud = power > floor * self._margin
        self._calm = 0 if loud else self._calm + frames
        self._learnt += frames
        if power < self._seg_min:
            self._seg_min = power
        self._seg_frames += frames
        if self._seg_frames >= self._segment:
            self._mins.append(self._seg_min)
            self._old_min = min(self._mins)
            self._seg_min, self._seg_frames = float("inf"), 0
        return was and loud

    def add(self, data: bytes, frames: int, flags: int, idle: bool,
            power: Optional[float] = None) -> Optional[tuple[bytes, int, int]]:
        """One input block: ``data`` (its interleaved float32 bytes), ``frames`` frames, PortAudio's ``flags``,
        whether the output is idle now, and the block's mean square ``power`` (full scale 1.0; None: not known,
        and the floor is learnt afresh).

        :returns: None (held), or the message's (bytes, the blocks' flags or-ed, frames) once :meth:`batch`
            blocks are held or the block rose out of the floor.
        """
        rise = False
        if frames != self._block and frames > 0:
            self._block = frames
            self._floor_blocks = max(QUIET_INPUT_BLOCKS, int(round(FLOOR_MESSAGE_S * self._rate / frames)))
        if idle and not self.attentive and power is not None:
            rise = self._hear(float(power), frames)
        elif self._learnt:
            self._forget()
        self._held.append(data)
        self._frames += frames
        self._flags |= flags
        if len(self._held) < self.batch(idle) and not rise:
            return None
        out = (b"".join(self._held), self._flags, self._frames)
        self._held.clear()
        self._flags = self._frames = 0
        return out


def watch_timeout(now: float, last: float, started: float, stall_s: float, grace_s: float) -> float:
    """How long the control loop may wait for a message before it checks the device again, s: until the
    first moment a check could fail (``stall_s`` after the last callback at ``last``, or ``grace_s`` after
    opening at ``started`` while no callback has come: ``last`` 0.0), at most ``WATCH_S``, at least 5 ms.
    All times ``time.monotonic()``, s. (A fixed 0.2 s poll woke the worker 5 times a second for nothing.)"""
    due = last + stall_s if last else started + grace_s
    return min(WATCH_S, max(0.005, due - now))


class OutputRing:
    """The worker's output side: the fader ring, the request accounting and the flush generation.

    All methods run under :attr:`lock` (the output callback and the control loop share it).

    :param block: the output block, samples at the device's rate.
    :param fade_n: the fade, samples at the device's rate. The ring's target never drops under the fade and
        one block (:meth:`set_fade`): a pause fades what the ring holds, and a ring holding less than the
        fade would cut the fade short (measured here: a 50 ms fade heard as 33 ms with 30 ms held).
    :param idle_after: samples of digital silence received after which the output is idle (:attr:`idle`);
        0: never idle.
    """

    def __init__(self, block: int, fade_n: int, idle_after: int = 0):
        self.lock = threading.Lock()
        self.fader = Fader(fade_n)
        self.block = block
        self.target = 0  # samples the ring should hold: set_fade
        self.set_fade(fade_n)
        self.requested = 0  # samples asked for and not yet received
        self.generation = 0  # +1 per flush: DATA of an older generation is stale
        self.callbacks = 0
        self.idle_after = idle_after
        self.zeros = 0  # samples of digital silence received since the last non-zero sample
        self.slept = False  # the ring has asked for nothing while idle since the last samples received

    def set_fade(self, fade_n: int) -> None:
        """The fade from the next pause, resume or flush on, samples; the target rises to hold it."""
        self.fader.set_fade(fade_n)
        self.floor = max(RING_MIN_BLOCKS, -(-max(1, int(fade_n)) // self.block) + 1) * self.block
        self.target = max(self.target, self.floor)

    @property
    def idle(self) -> bool:
        """Nothing but digital silence received for ``idle_after`` samples, and the ring plays (not paused
        or fading: a barge-in is under way then)."""
        return 0 < self.idle_after <= self.zeros and self.fader.state is FadeState.PLAYING

    def prime(self) -> int:
        """The first request, before the streams start: the whole target."""
        self.requested = self.target
        return self.target

    def fill(self, out, frames: int) -> tuple[int, int, bool]:
        """One output callback's work: write ``frames`` samples into ``out`` (float32 [frames]).

        Idle (:attr:`idle`): asks for nothing; a ring that runs dry then, or before the first samples after
        a :meth:`wake` arrive, plays silence that is not late (no ``LATE``, the target stays).

        :returns: (samples to request, extra flags (``LATE``), whether a fade out reached silence).
        """
        self.callbacks += 1
        if self.slept and not self.fader.queued and self.idle:
            out[:] = 0.0  # asleep, nothing held: what the lines below give then, without the fader's work
            return 0, 0, False
        flags = 0
        _, res = self.fader.read(frames, out)
        if res.short and self.callbacks > 1 and not self.slept:
            flags |= p.Flag.LATE
            self.target = min(max(RING_MAX_BLOCKS * self.block, self.floor), self.target + self.block)
        want = 0
        if self.fader.state is FadeState.PLAYING:
            if self.idle:
                self.slept = True
            else:
                want = max(0, self.target - self.fader.queued - self.requested)
            self.requested += want
        return want, flags, res.silent

    def unrequest(self, want: int) -> None:
        """A request that could not be sent."""
        self.requested = max(0, self.requested - want)

    def receive(self, generation: int, data) -> None:
        """``DATA`` from the service: kept unless it answers a request made before the last flush."""
        if generation != self.generation:
            return
        self.requested = max(0, self.requested - len(data))
        if len(data):
            self.slept = False
        self.fader.push(data)
        nz = np.flatnonzero(data)
        self.zeros = len(data) - 1 - int(nz[-1]) if len(nz) else self.zeros + len(data)

    def wake(self) -> None:
        """The service has samples to play (``WAKE``): not idle; the next :meth:`fill` asks for the target."""
        self.zeros = 0

    def control(self, kind: p.Kind) -> None:
        """``PAUSE``, ``RESUME``, ``FLUSH`` or ``WAKE``; the last three also end idleness (a resumed reply's
        rest is in the service's playback buffer, which an idle ring would not ask for)."""
        if kind is not p.Kind.PAUSE:
            self.wake()
        if kind is p.Kind.PAUSE:
            self.fader.pause()
        elif kind is p.Kind.RESUME:
            self.fader.resume()
        elif kind is p.Kind.FLUSH:
            self.fader.flush()
            self.generation += 1  # what is on its way belongs to the flushed reply
            self.requested = 0


def run(fd: int, params: dict) -> int:
    """The child's main: never returns normally (exits with ``os._exit``)."""
    ctl = socket.socket(fileno=fd)
    ctl.settimeout(0.2)
    rt = socket.socket(fileno=os.dup(fd))
    rt.setblocking(False)

    def send_json(kind: p.Kind, obj: dict) -> None:
        try:
            ctl.sendall(p.pack_json(kind, obj))
        except OSError:
            pass

    try:
        sd = import_sounddevice()
        devices = query_devices(sd)
        d_in, d_out = default_devices(sd)
        try:
            dout = match_device(devices, params["output"], "output", d_out)
        except DeviceNotFound as exc:
            if params.get("input") is not None:  # both missing: say so at once, not one per restart
                try:
                    match_device(devices, params["input"], "input", d_in)
                except DeviceNotFound as exc_in:
                    raise DeviceNotFound(f"{exc_in}; and {exc}", exc_in.found + exc.found) from None
            raise
        out_rate, out_ch = probe_format(sd, dout, "output")
        din = None
        in_rate, in_ch = out_rate, 1
        if params.get("input") is not None:
            din = match_device(devices, params["input"], "input", d_in)
            in_rate, in_ch = probe_format(sd, din, "input")
    except DeviceNotFound as exc:
        send_json(p.Kind.ERROR, {"kind": "not_found", "message": str(exc), "found": exc.found})
        os._exit(3)
    except Exception as exc:
        send_json(p.Kind.ERROR, {"kind": "open_failed", "message": f"{exc.__class__.__name__}: {exc}"})
        os._exit(4)

    block_ms = float(params["block_ms"])
    in_block = max(16, int(round(in_rate * block_ms / 1000.0)))
    out_block = max(16, int(round(out_rate * block_ms / 1000.0)))
    ring = OutputRing(out_block, fade_samples(out_rate, float(params.get("fade_ms", 8.0))),
                      idle_after=int(float(params.get("idle_s", IDLE_AFTER_S)) * out_rate))
    last_cb = [0.0]
    batcher = InputBatcher(in_rate)

    # What the output callbacks played (after the fader: fades, pauses and late blocks included), handed to
    # the service with the next input block: the canceller's far end, sample-exact and on the device's own
    # clock, whatever the ring held or the service was doing.
    played: deque = deque()
    dropped = [0]  # input frames lost on a full socket since the last INPUT sent

    def on_input(indata, frames, time_info, status):
        last_cb[0] = time.monotonic()
        # ring.idle is read without the lock: a stale answer costs one block
        idle = ring.idle
        power = None  # the block's mean square: only the floor of an idle room reads it
        if idle and not batcher.attentive:
            x = indata.reshape(-1)
            power = float(np.dot(x, x)) / len(x) if len(x) else None
        msg = batcher.add(indata.tobytes(), frames, getattr(status, "_flags", 0), idle, power)
        if msg is None:
            return
        data, flags, n = msg
        chunks = []
        while played:
            chunks.append(played.popleft())
        out = b"".join(c.tobytes() for c in chunks)
        try:
            rt.send(p.pack_input(flags, data, out, n, dropped[0]))
            dropped[0] = 0
        except (BlockingIOError, OSError):
            played.extendleft(reversed(chunks))  # kept for the next block; the output only appends on the right
            dropped[0] += n
            # A service stalled for seconds: keep at most 2 s (a datagram is at most MAX_MSG); what goes here
            # is the far end of frames counted as dropped, so the count shrinks with it and the pairing holds.
            while len(played) * out_block > 2 * out_rate and dropped[0] > 0:
                dropped[0] = max(0, dropped[0] - int(len(played.popleft()) * in_rate / out_rate))

    def on_output(outdata, frames, time_info, status):
        last_cb[0] = time.monotonic()
        flags = getattr(status, "_flags", 0)  # sounddevice.CallbackFlags keeps the PortAudio bits here
        mono = outdata[:, 0]  # a view: the fader writes the card's buffer
        with ring.lock:
            want, more, silent = ring.fill(mono, frames)
            gen = ring.generation
        flags |= more
        if din is not None:
            played.append(mono.copy())
        if outdata.shape[1] > 1:
            outdata[:, 1:] = outdata[:, :1]
        if want > 0 or flags:
            try:
                rt.send(p.pack_request(want, flags, gen))
            except OSError:
                with ring.lock:
                    ring.unrequest(want)
        if silent:
            try:
                rt.send(p.Kind.SILENT.value)
            except OSError:
                pass

    try:
        istream = None
        if din is not None:
            istream = sd.InputStream(device=din["index"], samplerate=in_rate, channels=in_ch, dtype="float32",
                                     blocksize=in_block, latency="low", callback=on_input)
        ostream = sd.OutputStream(device=dout["index"], samplerate=out_rate, channels=out_ch, dtype="float32",
                                  blocksize=out_block, latency="low", callback=on_output)
        with ring.lock:  # prime the ring before the first callback asks
            ctl.sendall(p.pack_request(ring.prime(), 0, ring.generation))
        if istream is not None:
            istream.start()
        ostream.start()
    except Exception as exc:
        send_json(p.Kind.ERROR, {"kind": "open_failed", "message": f"{exc.__class__.__name__}: {exc}"})
        os._exit(4)

    def ms(latency) -> Optional[float]:
        # PortAudio's JACK host API computes latency from a deprecated call and can return garbage.
        v = float(latency)
        return round(v * 1000.0, 2) if 0.0 <= v < 5.0 else None

    send_json(p.Kind.READY, {"input": din["name"] if din else None, "output": dout["name"],
                             "hostapi": dout["hostapi"], "in_rate": in_rate, "out_rate": out_rate,
                             "in_channels": in_ch, "out_channels": out_ch, "in_block": in_block,
                             "out_block": out_block, "input_latency_ms": ms(istream.latency) if istream else None,
                             "output_latency_ms": ms(ostream.latency)})
    started = time.monotonic()
    stall_s = float(params.get("stall_s", 1.0))
    grace_s = float(params.get("grace_s", 3.0))
    while True:
        try:
            msg = ctl.recv(p.MAX_MSG)
        except socket.timeout:
            msg = None
        except OSError:
            os._exit(0)
        if msg is not None:
            kind = p.kind_of(msg)
            if kind is None or kind is p.Kind.QUIT:
                os._exit(0)  # the service went away or asked us to stop
            if kind in (p.Kind.PAUSE, p.Kind.RESUME, p.Kind.FLUSH, p.Kind.WAKE):
                with ring.lock:
                    ring.control(kind)
            elif kind is p.Kind.ATTEND:
                batcher.attentive = p.unpack_attend(msg)
            elif kind is p.Kind.DATA:
                gen, data = p.unpack_data(msg)
                with ring.lock:
                    ring.receive(gen, data)
            elif kind is p.Kind.CONFIGURE:
                fade_ms = p.unpack_json(msg).get("fade_ms")
                if fade_ms is not None:
                    with ring.lock:
                        ring.set_fade(fade_samples(out_rate, float(fade_ms)))
        now = time.monotonic()
        last = last_cb[0]
        reason = None
        if not ostream.active or (istream is not None and not istream.active):
            reason = "the sound device stopped (stream no longer active)"
        elif last == 0.0 and now - started > grace_s:
            reason = f"the sound device gave no audio callback within {grace_s:.1f} s of opening"
        elif last and now - last > stall_s:
            reason = f"the sound device stopped calling back ({now - last:.1f} s without audio)"
        if reason:
            send_json(p.Kind.LOST, {"reason": reason})
            os._exit(5)
        ctl.settimeout(watch_timeout(now, last, started, stall_s, grace_s))

