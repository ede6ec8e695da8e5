"""``appliance bench interruption --room jack``: the barge-in suite through the service itself, on real
PortAudio streams, in a room on a JACK server (:class:`appliance.audio.jack_room.JackRoom`).

How it runs:

1. A JACK server of its own: ``jackd -n appliance-room<rate> --no-realtime -d dummy -r RATE -p PERIOD``
   (a dummy driver: no sound card, callbacks paced in real time), started unless one of that name is
   up, and stopped at the end if started here. The shared default server is never touched. The period
   (``--jack-period``, :data:`~appliance.bench.JACK_PERIOD` = 512 frames by default) sets the output's latency: the fade and
   two periods, 8 + 2 x 10.7 = 29 ms at 512 (10.7 ms, what the worker gets from a Pi's ALSA with its 10 ms
   blocks: *projected* on a Pi 8 + 2 x 10 = 28 ms; measured here 24-35 ms, the output part of session 25's
   full runs), 8 + 2 x 21.3 = 51 ms at 1024 (measured 46-57 ms). The default was 1024 until session 25, because
   at 512 on the clipping, drifting speaker Speex took over from the AEC3 stand-in and then let the echo through
   (session 11). It still can (session 25's ``--echo-only 50`` there: 93 of 99 replies paused); 1024 only made it
   rarer, and a Pi's blocks are like 512, so the room now runs as the Pi would (docs/measurements.md).
2. The room: a JACK client on it (``--drift-ppm``, ``--speaker clip|linear``), echo path as the simulated
   room's (30 ms, RT60 150 ms synthetic IR), user speech from the simulated bench's cache.
3. The service: ``python -m appliance -v run --config <generated>`` as a subprocess, its
   ``audio.input``/``audio.output`` the room's client name, ``JACK_DEFAULT_SERVER`` the room's server.
   That is ``appliance run``'s code path whole: its assembly, its audio worker process, its canceller
   from the config. Everything but ``model`` and ``storage`` comes from the config given (``--config``).
   The model is the tiny random-weight Gemma 4 test fixture: ``appliance run`` refuses a text-only model,
   and the fixture hears the microphone (a real audio turn through the projector) and answers with a few
   dozen nonsense tokens that Piper speaks, 2–8 s a reply. What the reply says does not matter to the
   barge-in layer (VAD, canceller, onset gate, turn taker, fades), which is what this suite measures.
4. The service's own events come from its debug timeline on stderr (one JSON record a line), placed on
   the room's clock: the service's session clock is mapped to ``time.monotonic()`` by the smallest
   (arrival − ``t``) over its records, and monotonic time to JACK frames by the room
   (:meth:`JackRoom.monotonic_of`); error about one JACK period. Latencies are measured on the room's
   audio alone; the events only say which silence is the pause and count pauses, flushes and resumes.

Scenarios run one after the other on one service, as a running appliance meets them; the first reply
after the start is the ``first_reply`` case (a cold canceller). Barge-in latency = from the user's true
onset (first sample above −40 dBFS, room clock) to the end of the last sample of the appliance's output
above −50 dBFS as the room hears it, before the pause holds. A self-interruption is an ``interrupted``
event in a reply with nobody talking (after the question has ended).

The service's own streams: the service runs with its listener's tap on (:mod:`appliance.audio.tap`: the
microphone, far end and canceller output it processed), placed on the room's clock by cross-correlating the
tap's microphone with what the room wrote to it (:class:`ServiceTap`). From it: ``erle_db`` (Σ mic² / Σ out²
over the 10 ms frames with a far end and no scripted sound, as the simulated room counts it) and each
barge-in's latency split (:func:`tap_split`; ``barge_in_split_ms`` with ``input_ms``). The tap costs the
service a file write per microphone message (in ``listening_cpu_pct`` and ``speaking_cpu_pct`` here;
``bench idle-cpu`` runs without it) and 192 kB of disk a second, in the run's temporary directory.

Each barge-in as the service met it (``barge_in_cases`` in the JSON, :func:`case_trace`): beside its tap the
tapped listener writes a trace (:func:`appliance.audio.tap.read_trace`): every Silero window's score, every
canceller frame (what served the VAD: the AEC3 stand-in or Speex; the microphone's and the served output's
level; how far the microphone stood over the far end's predicted echo; whether the bypass served the
microphone) and every onset-gate check with its sub-tests (AEC3's own gate, ``_echo_explained``, ``over_echo``,
the tail test). Per case the JSON keeps that from ``TRACE_BEFORE_MS`` before the user's onset to the window that
paused the reply, with the latency split, so a slow barge-in is read from the run itself. The run's directory
(its ``tap.f32``, ``tap.f32.trace.jsonl`` and ``service.log``) is left in place, named on the first line.

CPU: ``listening_cpu_pct`` = CPU time of the service and its descendants (the audio worker) from
``/proc/<pid>/stat``, over a quiet stretch with the service listening, % of one core;
``speaking_cpu_pct`` = the same while the service's state was ``speaking``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import yaml

from ..audio.device.host import capture_stream
from ..audio.echo import FRAME
from ..audio.files import MODEL_RATE
from ..audio.jack_room import SILENT_PEAK, JackRoom
from ..audio.room import synthetic_ir
from ..audio.tap import ENV as TAP_ENV, read_tap, read_trace
from ..vad import WINDOW_MS
from ..config import Config
from ..errors import UserError
from . import interruption as sim
from . import FIXTURE, FIXTURE_GGUF, FIXTURE_MMPROJ, JACK_PERIOD, JACK_RATE

CLK_TCK = os.sysconf("SC_CLK_TCK")
TIMELINE_TAG = " appliance.service: {"
HANDOVER_TAG = "Speex took over from the stand-in at audio_t "  # appliance.pipeline's log line
HANDBACK_TAG = "the stand-in serves again from audio_t "  # ... and the one of a hand-back (Speex lost the echo)


# --- the JACK server ---

class JackServer:
    """A named JACK dummy server of our own (started unless already up; stopped only if started here).

    :param name: the server's name (clients select it with ``JACK_DEFAULT_SERVER``).
    :param rate: Hz. :param period: frames per period.
    :raises UserError: jackd is not installed or the server does not come up in 10 s.
    """

    def __init__(self, name: str, rate: int = JACK_RATE, period: int = JACK_PERIOD):
        self.name, self.rate, self.period = name, int(rate), int(period)
        self.proc: Optional[subprocess.Popen] = None

    def env(self) -> dict:
        return dict(os.environ, JACK_DEFAULT_SERVER=self.name, JACK_NO_START_SERVER="1")

    def up(self) -> bool:
        try:
            return subprocess.run(["jack_lsp"], env=self.env(), capture_output=True, timeout=5).returncode == 0
        except (FileNotFoundError, subprocess.TimeoutExpired):
            return False

    def start(self) -> "JackServer":
        if self.up():
            return self
        if not shutil.which("jackd"):
            raise UserError("jackd is not installed: apt-get install jackd2 (the JACK room needs a JACK server)")
        self.proc = subprocess.Popen(["jackd", "-n", self.name, "--no-realtime", "-d", "dummy", "-r", str(self.rate),
                                      "-p", str(self.period)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env=self.env())
        end = time.monotonic() + 10
        while time.monotonic() < end:
            if self.up():
                return self
            time.sleep(0.2)
        self.stop()
        raise UserError(f"the JACK server {self.name} did not come up in 10 s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
            self.proc = None


# --- CPU of a process tree, from /proc ---

def tree_ticks(root: int) -> int:
    """utime + stime (clock ticks) of ``root`` and all its descendants alive now, from ``/proc``."""
    return sum(tree_ticks_by_pid(root).values())


def tree_ticks_by_pid(root: int) -> dict[int, int]:
    """utime + stime (clock ticks) of ``root`` and of each of its descendants alive now, by pid, from ``/proc``."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read().decode("ascii", "replace")
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
        pid, ppid = int(entry), int(rest[1])
        children.setdefault(ppid, []).append(pid)
        ticks[pid] = int(rest[11]) + int(rest[12])  # utime, stime (fields 14 and 15)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        out[pid] = ticks.get(pid, 0)
        todo.extend(children.get(pid, []))
    return out


# --- the service under test ---

def service_config(base: Config, room_name: str, state_dir: Path, max_reply_tokens: int = 64) -> dict:
    """The config the service runs with: ``base`` with the room as its sound device, the tiny Gemma 4
    fixture as its model, GPIO off and its state in ``state_dir``."""
    if not FIXTURE_GGUF.is_file():
        raise UserError(f"the tiny Gemma 4 fixture is missing ({FIXTURE}); the JACK room runs from a checkout")
    data = base.model_dump(mode="json")
    data["model"].update(gguf=str(FIXTURE_GGUF), mmproj=str(FIXTURE_MMPROJ),
                         n_ctx=1700, history_budget_tokens=512, max_reply_tokens=max_reply_tokens, n_threads=1)
    data["audio"].update(input=room_name, output=room_name, retry_max_s=1.0)
    data["gpio"]["enabled"] = False
    data["storage"]["state_dir"] = str(state_dir)
    return data


class ServiceUnderTest:
    """``python -m appliance -v run --config F`` on the room's server; its timeline records as they arrive.

    :attr:`records`: (arrival ``time.monotonic()``, record) pairs. :attr:`state`: the last state.
    """

    def __init__(self, config: dict, workdir: Path, env: dict):
        self.path = workdir / "config.yaml"
        self.path.write_text(yaml.safe_dump(config))
        self.log = open(workdir / "service.log", "w", encoding="utf-8")
        self.records: list[tuple[float, dict]] = []
        self.tap: Optional[ServiceTap] = None  # the listener's streams, if the service writes them
        self.handovers: list[float] = []  # audio_t (s) of each hand-over from the canceller's stand-in to Speex
        self.handbacks: list[float] = []  # ... and of each hand-back to the stand-in
        self.state = "starting"
        self._lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, "-m", "appliance", "-v", "run", "--config", str(self.path)],
                                     cwd=Path(__file__).resolve().parents[2], env=dict(env, PYTHONUNBUFFERED="1"),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, errors="replace")
        self._thread = threading.Thread(target=self._read, name="service-stderr", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.log.write(line)
            self.take(line, time.monotonic())

    def take(self, line: str, now: float) -> None:
        """One line of the service's stderr, arrived at ``now`` (``time.monotonic()``): a timeline record goes
        to :attr:`records` (and :attr:`state`), a hand-over of the canceller to :attr:`handovers`, a hand-back to
        :attr:`handbacks`."""
        for tag, into in ((HANDOVER_TAG, self.handovers), (HANDBACK_TAG, self.handbacks)):
            h = line.find(tag)
            if h >= 0:
                with self._lock:
                    into.append(float(line[h + len(tag):].split()[0]))
                return
        i = line.find(TIMELINE_TAG)
        if i < 0:
            return
        try:
            rec = json.loads(line[i + len(TIMELINE_TAG) - 1:])
        except ValueError:
            return
        if not isinstance(rec, dict) or "event" not in rec:
            return
        with self._lock:
            self.records.append((now, rec))
            if rec["event"] == "state":
                self.state = rec["state"]

    def t0(self) -> float:
        """``time.monotonic()`` of the service's session clock's zero: min(arrival − t) over its records."""
        with self._lock:
            return min((a - r["t"] for a, r in self.records if isinstance(r.get("t"), (int, float))), default=0.0)

    def since(self, k: int) -> list[dict]:
        with self._lock:
            return [r for _, r in self.records[k:]]

    def count(self) -> int:
        with self._lock:
            return len(self.records)

    def wait_state(self, state: str, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.state == state:
                return True
            if self.proc.poll() is not None:
                raise UserError(f"the service exited ({self.proc.returncode}); see {self.log.name}")
            time.sleep(0.05)
        return self.state == state

    def stop(self) -> int:
        self.proc.terminate()
        try:
            rc = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(10)
        self._thread.join(5)
        self.log.close()
        return rc


class CpuMeter:
    """Samples the service tree's CPU ticks every ``step`` s and files each interval under the service's
    state at its start and end (an interval that changed state is not filed)."""

    def __init__(self, svc: ServiceUnderTest, step: float = 0.5):
        self.svc, self.step = svc, step
        self.by_state: dict[str, list[float]] = {}  # state -> [ticks, seconds]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pid = self.svc.proc.pid
        last = (time.monotonic(), tree_ticks(pid), self.svc.state)
        while not self._stop.wait(self.step):
            now = (time.monotonic(), tree_ticks(pid), self.svc.state)
            if now[2] == last[2]:
                acc = self.by_state.setdefault(now[2], [0.0, 0.0])
                acc[0] += now[1] - last[1]
                acc[1] += now[0] - last[0]
            last = now

    def pct(self, state: str) -> Optional[float]:
        ticks, secs = self.by_state.get(state, (0.0, 0.0))
        return round(100.0 * ticks / CLK_TCK / secs, 2) if secs > 0 else None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)


def idle_cpu_pct(pid: int, seconds: float) -> float:
    """CPU of ``pid``'s tree over ``seconds`` of wall time, % of one core."""
    return idle_cpu_split(pid, seconds)["tree"]


def idle_cpu_split(pid: int, seconds: float) -> dict:
    """CPU of ``pid``'s tree over ``seconds`` of wall time, % of one core (CPU time from ``/proc``, so a
    loaded machine slows the service's work without adding to it much): ``tree`` (``pid`` and every
    descendant alive at the end), ``service`` (``pid`` alone) and ``children`` (the rest: the audio worker)."""
    t0, k0 = time.monotonic(), tree_ticks_by_pid(pid)
    time.sleep(seconds)
    t1, k1 = time.monotonic(), tree_ticks_by_pid(pid)
    pct = lambda ticks: round(100.0 * ticks / CLK_TCK / (t1 - t0), 2)  # noqa: E731
    own = k1.get(pid, 0) - k0.get(pid, 0)
    kids = sum(k - k0.get(q, 0) for q, k in k1.items() if q != pid)  # a child born in the window: all its ticks
    return {"tree": pct(own + kids), "service": pct(own), "children": pct(kids)}


# --- the service's own streams, placed on the room's clock ---

class ServiceTap:
    """The service's listener tap (:mod:`appliance.audio.tap`: its microphone, far end and canceller output at
    16 kHz, sample ``k`` at ``audio_t = k / 16000``) placed on the room's clock: sample ``k`` is what the room
    wrote to the microphone at frame ``offset + k·rate/16000``. The offset is found by cross-correlating the
    tap's microphone with what the room wrote (:meth:`JackRoom.said`) around a loud stretch (the question);
    one JACK clock, so it holds while no microphone block is lost.

    :param path: the tap's file. :param rate: the room's rate, Hz (a multiple of 16 kHz).
    """

    def __init__(self, path: Path, rate: int):
        self.path, self.rate = Path(path), int(rate)
        self.step = self.rate // MODEL_RATE
        self.offset: Optional[int] = None  # room frame of tap sample 0
        self.peak: Optional[float] = None  # the correlation's peak, normalised (1: the same waveform)
        self.offsets: list[int] = []  # every alignment found (one per case): a change means lost blocks

    def read(self, start: int = 0, count: Optional[int] = None) -> np.ndarray:
        """The tap's samples from ``start`` (:func:`read_tap`); none before the service wrote any."""
        if not self.path.exists():
            return np.zeros((0, 3), dtype=np.float32)
        return read_tap(self.path, start, count)

    def align(self, room: JackRoom, f0: int, f1: int) -> Optional[int]:
        """Find the offset from the room's microphone between frames ``f0`` and ``f1`` (a loud stretch, at
        most a few seconds); kept if the normalised correlation peak is above 0.9. The first call searches the whole
        tap (call it on the first sound the service heard: the scenarios repeat their question); later calls look
        within 0.5 s of where the known offset puts it (a check: :attr:`offsets`). :returns: the offset."""
        # (through the service's own capture path to 16 kHz, so that the reference has the tap's filter: the
        #   decimator's phase is not linear)
        ref = capture_stream(self.rate)(room.said(f0, f1))
        base = 0
        if self.offset is not None:  # the same question every case: look only near where it must be
            base = max(0, self.sample_of(f0) - MODEL_RATE // 2)
            tap = self.read(base, len(ref) + MODEL_RATE)[:, 0]
        else:
            tap = self.read()[:, 0]
        if len(tap) < len(ref) or not np.any(ref):
            return self.offset
        n = 1 << int(np.ceil(np.log2(len(tap) + len(ref))))
        corr = np.fft.irfft(np.fft.rfft(tap, n) * np.conj(np.fft.rfft(ref, n)), n)[: len(tap) - len(ref) + 1]
        k = int(np.argmax(corr))
        seg = tap[k: k + len(ref)]
        peak = float(corr[k] / max(np.sqrt(np.dot(seg, seg) * np.dot(ref, ref)), 1e-20))
        if peak > 0.9:
            self.offset, self.peak = f0 - (base + k) * self.step, round(peak, 4)
            self.offsets.append(self.offset)
        return self.offset

    def sample_of(self, frame: int) -> int:
        """The tap's sample for a room frame (:attr:`offset` known)."""
        return (frame - self.offset) // self.step

    def frame_of(self, audio_t: float) -> int:
        """The room frame of the service's audio time ``audio_t`` (s)."""
        return self.offset + int(round(audio_t * MODEL_RATE)) * self.step


def erle_sums(tap: np.ndarray, k0: int, k1: int, busy: list[tuple[int, int]], frame: int = 160) -> tuple[float, float]:
    """ERLE's numerator and denominator over the tap's samples ``k0``..``k1``: Σ mic² and Σ out² over the 10 ms
    frames whose far end is not silent (Σ far² ≥ 1e-6, as the simulated room) and that overlap none of the
    ``busy`` sample ranges (scripted sound in the microphone)."""
    num = den = 0.0
    for a in range(max(0, k0), min(k1, len(tap)) - frame + 1, frame):
        b = a + frame
        if any(lo < b and a < hi for lo, hi in busy):
            continue
        blk = tap[a:b]
        if float(np.dot(blk[:, 1], blk[:, 1])) < 1e-6:
            continue
        num += float(np.dot(blk[:, 0], blk[:, 0]))
        den += float(np.dot(blk[:, 2], blk[:, 2]))
    return num, den


# --- the suite ---

def jack_suite(cache: sim.AudioCache, quick: bool = False, echo_only: int = 0) -> list[sim.Case]:
    """The cases the JACK room runs: the first reply (cold), then the simulated suite's barge-ins, echo-only
    replies, noises, backchannels and short stops (``quick``: a few of each). ``echo_only`` > 0: only the
    first reply and that many echo-only replies at 0 dB and at +6 dB. Not run here: the cold barge-in and
    the reply after a stop word (each needs a restart or a second reply to follow)."""
    cases = [sim.Case("first_reply", "echo +0 dB, the service's first reply", None, None, 0.0, 0.0)]
    if echo_only:
        for rel in (0.0, 6.0):
            cases += [sim.Case("echo_only", f"echo {rel:+.0f} dB #{k + 1}", None, None, 0.0, rel)
                      for k in range(echo_only)]
        return cases
    full = [c for c in sim.build_suite(cache, quick=False) if c.kind in
            ("barge_in", "echo_only", "noise", "backchannel", "short_stop")]
    if quick:
        keep = {"barge_in": 3, "echo_only": 2, "noise": 1, "backchannel": 2, "short_stop": 2}
        seen: dict = {}
        picked = []
        for c in full:
            if seen.get(c.kind, 0) < keep[c.kind] and (c.kind != "echo_only" or
                                                       c.echo_rel_db not in [p.echo_rel_db for p in picked
                                                                             if p.kind == "echo_only"]):
                picked.append(c)
                seen[c.kind] = seen.get(c.kind, 0) + 1
        full = picked
    return cases + full


def last_loud_ms(audio: np.ndarray, rate: int) -> float:
    """The end of the last sample above −50 dBFS, ms from the start of ``audio`` (0: silent throughout)."""
    loud = np.nonzero(np.abs(audio) >= SILENT_PEAK)[0]
    return round((int(loud[-1]) + 1) * 1000.0 / rate, 1) if len(loud) else 0.0


def run_case(case: sim.Case, room: JackRoom, svc: ServiceUnderTest, reply_level: float, question: np.ndarray,
             timeout_s: float = 40.0) -> sim.Outcome:
    """One scenario on the running service: the question, the reply, the scripted sound over it."""
    if not svc.wait_state("listening", 60):
        return sim.Outcome(case, [], valid=False, note=f"the service was {svc.state}, not listening")
    end = time.monotonic() + 10  # the room quiet: nothing left of the previous reply
    while time.monotonic() < end and room.last_loud is not None and room.now() - room.last_loud < room.rate // 2:
        time.sleep(0.05)
    room.set_echo(sim.echo_gain_db(case, reply_level) if case.echo_path else None)
    k0 = svc.count()
    start = room.now() + int(0.3 * room.rate)
    q = room.say_at(start, question, "question", sim.QUESTION[0])
    u = room.say_after_heard(case.delay_s, case.audio, case.label, case.text) if case.audio is not None else None
    deadline = time.monotonic() + timeout_s
    mark = None
    while time.monotonic() < deadline:
        time.sleep(0.05)
        recs = svc.since(k0)
        ended = any(r["event"] in ("turn_end", "flushed") for r in recs)
        if u is None:
            done = q.start is not None and ended
        elif u.start is None:
            if ended:
                break  # the reply ended before the interjection was due: invalid (see evaluate)
            continue
        elif room.now() < u.end:
            continue
        else:
            done = ended or any(r["event"] == "resumed" for r in recs) or svc.state == "listening"
        if done and mark is None:
            mark = time.monotonic()
        if mark is not None and time.monotonic() - mark >= 1.0:
            break
    room.cancel()
    time.sleep(0.2)
    return evaluate(case, room, svc, k0, q, u, start)


def evaluate(case: sim.Case, room: JackRoom, svc: ServiceUnderTest, k0: int, q, u, start: int) -> sim.Outcome:
    """The case's outcome from the service's events (placed on the room's clock) and the room's audio."""
    t0 = svc.t0()
    recs = []
    for r in svc.since(k0):
        if isinstance(r.get("t"), (int, float)):
            r = dict(r, t=round(room.seconds(room.frame_of(t0 + r["t"])), 4))
            if r["event"] == "interrupted" and isinstance(r.get("onset_t"), (int, float)):  # the onset it answered
                r["onset_t"] = round(room.seconds(room.frame_of(t0 + r["onset_t"])), 4)
        recs.append(r)
    speech = []
    if u is not None and u.start is not None:
        speech = [{"event": "user_speech", "t": room.seconds(u.onset), "source": case.label, "text": case.text,
                   "onset_t": round(room.seconds(u.onset), 4), "end_t": round(room.seconds(u.end), 4)}]
    recs = sorted(recs + speech, key=lambda r: r.get("t", 0.0))
    out = sim.Outcome(case, recs, valid=True)
    if case.audio is not None:
        out.valid, out.note = sim.interjection_validity(recs, speech)
    q_end = room.seconds(q.end) if q.end is not None else 0.0
    after = speech[0]["onset_t"] - 0.05 if speech else q_end
    out.interrupted = sum(1 for r in recs if r["event"] == "interrupted" and r["t"] >= after)
    out.flushed = any(r["event"] == "flushed" and r["t"] >= after for r in recs)
    out.self_flushed = sim.self_flushed(case.kind, recs, after) if out.valid else False  # (the JSON's replies_flushed)
    resumed = [r for r in recs if r["event"] == "resumed" and r["t"] >= after]
    out.resumed = bool(resumed) and not out.flushed
    if speech and resumed:
        out.resume_gap_ms = round((resumed[-1]["t"] - speech[0]["end_t"]) * 1000.0, 1)
    if case.kind in ("barge_in", "short_stop") and speech:
        pause = [r for r in recs if r["event"] == "interrupted" and r["t"] >= after]
        if pause:
            detected_ms = round((pause[0]["t"] - speech[0]["onset_t"]) * 1000.0, 1)
            heard = room.heard(u.onset, u.onset + int((max(0.0, detected_ms) / 1000.0 + 0.3) * room.rate))
            out.barge = {"onset_t": speech[0]["onset_t"], "detected_ms": detected_ms,
                         "output_silent_ms": last_loud_ms(heard, room.rate)}
    # A check on the clock mapping: the first output the room heard after the question, after the service
    # said it started speaking (the output's latency: the worker's ring and PortAudio's buffers).
    spoke = [r["t"] for r in recs if r["event"] == "state" and r.get("state") == "speaking" and r["t"] >= q_end]
    if spoke and q.end is not None:
        heard = room.heard(q.end, room.now())
        loud = np.nonzero(np.abs(heard) >= SILENT_PEAK)[0]
        if len(loud):
            out.heard_lag_ms = round((room.seconds(q.end + int(loud[0])) - spoke[0]) * 1000.0, 1)
    if u is None and (room.last_loud is None or q.end is None or room.last_loud < q.end):
        out.valid, out.note = False, "no reply was heard"
    if svc.tap is not None:
        from_tap(out, case, room, svc, q, u, start, recs)
    room.forget_before(start)
    return out


def from_tap(out: sim.Outcome, case: sim.Case, room: JackRoom, svc: ServiceUnderTest, q, u, start: int,
             recs: list[dict]) -> None:
    """What the service's own streams say about a case (:class:`ServiceTap`): the canceller's ERLE over its
    echo-only frames, and a barge-in's latency split (:func:`tap_split`). The tap is placed on the room's clock
    at the question (``q``) and again at the interjection (``u``), since a lost microphone period (a JACK xrun
    of the audio worker: measured here, 5 periods in the first two turns of a quick run on a loaded machine)
    moves it."""
    tap = svc.tap
    if q.start is not None and q.end is not None:
        tap.align(room, q.start + q.onset_offset, min(q.end, q.start + q.onset_offset + 2 * room.rate))
    if tap.offset is None:
        return
    if case.echo_path:
        margin = int(0.05 * room.rate)
        busy = [(tap.sample_of(u.start - margin), tap.sample_of(u.start + len(u.audio) + margin))
                for u in room.played if u.start is not None and u.start + len(u.audio) > start]
        k0, k1 = tap.sample_of(start), tap.sample_of(room.now())
        out.erle_num, out.erle_den = erle_sums(tap.read(k0, k1 - k0), 0, k1 - k0, [(a - k0, b - k0) for a, b in busy])
    if out.barge is not None:
        if u is not None and u.start is not None and u.end is not None:
            tap.align(room, u.onset, min(u.end, u.onset + room.rate))
        out.barge["split"] = tap_split(recs, out.barge, room, tap)
        fired = fired_onset(recs, out.barge)
        if fired is not None:
            onset = tap.sample_of(room.frame0 + int(round(out.barge["onset_t"] * room.rate)))
            end = int(round((fired["audio_t"] + WINDOW_MS / 1000.0) * MODEL_RATE))  # the fired window's end
            out.barge["trace"] = case_trace(tap, onset, end)
            out.served_by = served_at_onset(out.barge["trace"])


SERVED_BY = {"speex": "speex", "reused": "reused", "aec3": "stand_in", "cold": "stand_in",
             "none": "stand_in"}  # trace -> served_by


def served_at_onset(trace: Optional[dict]) -> Optional[str]:
    """Whose output the VAD heard at the user's onset, as the simulated room's
    :func:`appliance.bench.interruption.served_by` says it (``"stand_in"``, ``"reused"``, ``"speex"``), from a
    barge-in's :func:`case_trace`: the serving of the first 10 ms frame that holds the onset (ms > -10). None without a trace."""
    rows = [f for f in (trace or {}).get("frames", []) if f[0] > -1000.0 * FRAME / MODEL_RATE]
    return SERVED_BY.get(rows[0][1], rows[0][1]) if rows else None


def tap_split(recs: list[dict], barge: dict, room: JackRoom, tap: ServiceTap) -> Optional[dict]:
    """Where a barge-in's latency went on the JACK room, ms (``recs``: the service's records, ``t`` on the room's
    clock in s; ``barge``: the outcome's ``onset_t``, ``detected_ms``, ``output_silent_ms``):

    - ``vad_ms``: the user's onset to the end of the VAD window that fired, on the service's audio clock placed
      on the room's (:class:`ServiceTap`): the algorithm, as the simulated room's ``vad_ms``;
    - ``input_ms``: that window's last sample written to the microphone to the ``vad_onset`` record: the input
      path (JACK's period, PortAudio's blocks, the worker, the socket, the 48 → 16 kHz decimator, the
      listener's queue and its canceller and VAD): ± one JACK period (the clock mapping);
    - ``listener_ms``: the window's end to the pause, as the simulated room's (``input_ms`` and the decision);
    - ``output_ms``: the pause to the output's silence as the room heard it (the fade, the worker's and
      PortAudio's blocks, JACK's period).

    None without the pause's ``vad_onset`` record (:func:`fired_onset`)."""
    ev = fired_onset(recs, barge)
    if ev is None:
        return None
    window_end = ev["audio_t"] + WINDOW_MS / 1000.0
    end_frame = tap.frame_of(window_end)
    onset_frame = room.frame0 + int(round(barge["onset_t"] * room.rate))
    vad_ms = 1000.0 * (end_frame - onset_frame) / room.rate
    input_ms = 1000.0 * (ev["t"] - room.seconds(end_frame))
    listener_ms = barge["detected_ms"] - vad_ms
    silent = barge.get("output_silent_ms")
    return {"vad_ms": round(vad_ms, 1), "input_ms": round(input_ms, 1), "listener_ms": round(listener_ms, 1),
            "output_ms": None if silent is None else round(silent - barge["detected_ms"], 1)}


def fired_onset(recs: list[dict], barge: dict) -> Optional[dict]:
    """The ``vad_onset`` record that paused the reply (the one the pause's ``onset_t`` names, on the room's clock;
    ``recs`` and ``barge`` as :func:`tap_split` takes them), or None."""
    paused = [r for r in recs if r["event"] == "interrupted" and r["t"] >= barge["onset_t"] - 0.05]
    if not paused:
        return None
    onsets = [r for r in recs if r["event"] == "vad_onset" and r.get("audio_t") is not None
              and abs(r["t"] - paused[0].get("onset_t", float("nan"))) < 1e-3]
    return onsets[0] if onsets else None


TRACE_BEFORE_MS = 100  # a barge-in's trace (case_trace) starts this long before the user's onset


def case_trace(tap: ServiceTap, onset: int, fired: int) -> Optional[dict]:
    """What the service's listener did between a user's onset and the end of the VAD window that paused the
    reply, from the tap's trace (:func:`appliance.audio.tap.read_trace`; ``onset``, ``fired``: the tap's
    samples). ms are from the onset. None without a trace (a service that writes none).

    - ``onset_sample``, ``fired_sample``: those two samples of the tap (for an offline replay of its streams);
    - ``serving``: frames (10 ms) from the onset to the fired window by what went to the VAD (``aec3``: the
      stand-in, ``speex``, ...; :meth:`appliance.audio.echo.EchoCanceller.trace_rows`);
    - ``mic_served_ms``: the frames among them whose microphone went to the VAD in AEC3's place (over_echo);
    - ``over_first_ms``: the first frame whose microphone stood over the far end's predicted echo by the
      bypass's margin (None: none), and ``over_max_db`` the most it stood over that margin;
    - ``frames``: per frame from ``TRACE_BEFORE_MS`` before the onset, ``[ms, serving, in_db, out_db, over_db,
      served_mic]``: the microphone's and what went to the VAD's power (dBFS), how far the microphone's band most
      over the far end's predicted echo stood over the bypass's margin (dB, None: no prediction), and whether the
      microphone went to the VAD in AEC3's place;
    - ``vad``: ``[ms at the window's end, probability]`` per Silero window from ``TRACE_BEFORE_MS`` before;
    - ``gates``: ``[ms, test, passed, figures]`` per onset-gate check in that span."""
    rows = read_trace(tap.path, onset - TRACE_BEFORE_MS * MODEL_RATE // 1000, fired)
    if not rows:
        return None
    ms = lambda t: round((t - onset) * 1000.0 / MODEL_RATE, 1)  # noqa: E731
    frames = [r for r in rows if r[0] == "frame"]
    after = [r for r in frames if r[1] + FRAME > onset]
    serving: dict = {}
    for r in after:
        serving[r[2]] = serving.get(r[2], 0) + 1
    over = [r for r in after if r[5] is not None and r[5] >= 0]
    return {
        "onset_sample": int(onset), "fired_sample": int(fired), "serving": serving,
        "mic_served_ms": 1000 * FRAME // MODEL_RATE * sum(1 for r in after if r[6]),
        "over_first_ms": ms(over[0][1]) if over else None,
        "over_max_db": max((r[5] for r in after if r[5] is not None), default=None),
        "frames": [[ms(r[1])] + list(r[2:]) for r in frames],
        "vad": [[ms(r[1]), r[2]] for r in rows if r[0] == "vad"],
        "gates": [[ms(r[1]), r[2], r[3], r[4]] for r in rows if r[0] == "gate"],
    }


@contextlib.contextmanager
def service_in_room(cfg: Config, server_name: str, rate: int, period: int, drift_ppm: float, speaker: str,
                    work_prefix: str, settle_s: float, print_line: Callable[[str], None], tap: bool = False,
                    path_change_s: Optional[float] = None):
    """The service (``appliance run``'s code path, :class:`ServiceUnderTest`) on a JACK dummy server of its own
    named ``server_name`` (``rate`` Hz, ``period`` frames), with the room as its sound device; yields
    ``(server, room, svc)`` once the service is ``listening`` and ``settle_s`` more have passed (the worker's
    streams and first blocks), and stops all three on the way out. ``tap``: the service writes its listener's
    streams (:mod:`appliance.audio.tap`) and ``svc.tap`` is their :class:`ServiceTap` (else None).
    ``path_change_s``: the room's speaker and drift come on that late (:class:`~appliance.audio.jack_room.JackRoom`).

    :raises UserError: no jackd, or the service does not reach ``listening`` in 300 s.
    """
    server = JackServer(server_name, rate, period).start()
    work = Path(tempfile.mkdtemp(prefix=work_prefix))
    room = svc = None
    try:
        room = JackRoom(f"room{os.getpid()}", servername=server.name, echo_delay_ms=sim.ECHO_DELAY_MS,
                        impulse_response=synthetic_ir(sim.RT60_MS), drift_ppm=drift_ppm, speaker=speaker,
                        path_change_s=path_change_s)
        env = dict(server.env(), **({TAP_ENV: str(work / "tap.f32")} if tap else {}))
        svc = ServiceUnderTest(service_config(cfg, room.name, work / "state"), work, env)
        svc.tap = ServiceTap(work / "tap.f32", room.rate) if tap else None
        print_line(f"JACK room {room.name} on {server.name} ({room.rate} Hz, {period}-frame periods), drift "
                   f"{drift_ppm:+g} ppm, {speaker} speaker"
                   + (f" from {path_change_s:g} s (linear, one clock before)" if path_change_s is not None else "")
                   + f"; the service's log: {work / 'service.log'}")
        if not svc.wait_state("listening", 300):
            raise UserError(f"the service did not reach listening in 300 s (it is {svc.state}); see {work / 'service.log'}")
        time.sleep(settle_s)
        yield server, room, svc
    finally:
        if svc is not None:
            svc.stop()
        if room is not None:
            room.close()
        server.stop()


def tap_echo_delay(tap: ServiceTap) -> dict:
    """:func:`appliance.audio.delay.delay_summary` of the echo's delay over a run's whole tap (the listener's
    microphone and its far end, paired as the canceller pairs them; replies only, users' speech refused by the
    peak ratio), 10 s spans for ``drift_ppm_peak``."""
    from ..audio.delay import delay_summary, delay_track

    x = tap.read()
    return delay_summary(delay_track(x[:, 0], x[:, 1])) if len(x) else delay_summary([])


def write_summary(summary: dict, json_path: Optional[Path], print_line: Callable[[str], None]) -> None:
    """Print ``summary`` as JSON and write it to ``json_path`` (if given); numpy scalars as Python numbers."""
    text = json.dumps(summary, indent=2, default=lambda x: x.item() if hasattr(x, "item") else str(x))
    print_line(text)
    if json_path:
        Path(json_path).write_text(text + "\n", encoding="utf-8")


def run(cfg: Config, json_path: Optional[Path], cache_dir: Path, quick: bool = False, drift_ppm: float = 0.0,
        speaker: str = "linear", echo_only: int = 0, rate: int = JACK_RATE, period: int = JACK_PERIOD,
        idle_s: Optional[float] = None, print_line: Callable[[str], None] = print,
        server_name: Optional[str] = None, path_change_s: Optional[float] = None) -> dict:
    """Run the suite in the JACK room through the service; print a line per scenario and the summary;
    write the summary as JSON (the simulated bench's keys for the cases run, plus ``room``, ``drift_ppm``,
    ``speaker``, ``path_change_s``, ``listening_cpu_pct``, ``speaking_cpu_pct`` and the room's own counters).
    ``path_change_s``: the speaker and the drift come on that many seconds after the room started (None: from
    the start), so that a canceller that converged on the clean path meets the change."""
    from ..speech import Tts

    tts = Tts(cfg.voice.model, length_scale=cfg.voice.length_scale, volume=cfg.voice.volume)
    cache = sim.AudioCache(cache_dir, tts)
    question = cache.speech(sim.QUESTION[0], "joe")
    reply_level = sim.reply_dbfs(tts)
    cases = jack_suite(cache, quick, echo_only)
    # A server of its own name: a benchmark's room on the shared test server would add its load to it.
    with service_in_room(cfg, server_name or f"appliance-room{rate // 1000}", rate, period, drift_ppm, speaker,
                         "appliance-jack-room-", 3.0, print_line, tap=True,
                         path_change_s=path_change_s) as (server, room, svc):
        idle = idle_cpu_pct(svc.proc.pid, idle_s if idle_s is not None else (10.0 if quick else 30.0))
        print_line(f"listening, idle: {idle} % of one core (service + audio worker)")
        meter = CpuMeter(svc)
        try:
            print_line(f"{len(cases)} scenarios, in real time")
            outcomes = []
            handed_over, handed_back = [], []  # (case, audio_t) of each hand-over from the AEC3 stand-in to Speex, back
            for c in cases:
                seen, seen_back = len(svc.handovers), len(svc.handbacks)
                o = run_case(c, room, svc, reply_level, question)
                outcomes.append(o)
                handed_over += [{"case": f"{c.kind}: {c.label}", "audio_t": t} for t in svc.handovers[seen:]]
                handed_back += [{"case": f"{c.kind}: {c.label}", "audio_t": t} for t in svc.handbacks[seen_back:]]
                silent = o.barge.get("output_silent_ms") if o.barge else None
                print_line(f"{c.kind:13} {c.label[:52]:52} paused={o.interrupted} flushed={o.flushed} "
                           f"resumed={o.resumed} silent_ms={silent} detected_ms="
                           f"{o.barge.get('detected_ms') if o.barge else None} gap_ms={o.resume_gap_ms} "
                           f"heard_after_speaking_ms={getattr(o, 'heard_lag_ms', None)}"
                           + (f" split={o.barge['split']}" if o.barge and o.barge.get("split") else "")
                           + (f" erle_db={10 * np.log10(o.erle_num / o.erle_den):.1f}" if o.erle_den > 0 else "")
                           + ("" if o.valid else " INVALID") + (f" ({o.note})" if o.note else ""))
        finally:
            meter.stop()
        summary = sim.summarise(outcomes, [])
        lags = [o.heard_lag_ms for o in outcomes if getattr(o, "heard_lag_ms", None) is not None]
        summary.update({
            "heard_after_speaking_ms": {"p50": sim.pct(lags, 50), "min": min(lags, default=None),
                                        "max": max(lags, default=None), "n": len(lags)},
            "room": "jack", "drift_ppm": drift_ppm, "speaker": speaker, "path_change_s": path_change_s,
            "listening_cpu_pct": idle, "speaking_cpu_pct": meter.pct("speaking"),
            "jack": {"server": server.name, "rate": room.rate, "period": period, "room_underruns": room.underruns,
                     "drift_wander_ms": room.wander_ms},
            # Which canceller served the VAD: the AEC3 stand-in until Speex showed convergence, then Speex (and the
            # stand-in again from a hand-back, where Speex lost the echo).
            "echo_hand_over": handed_over,
            "echo_hand_back": handed_back,
            # --path-change-s: when the speaker and the drift came on, on the service's audio clock (as audio_t above)
            "path_changed_audio_t": None if path_change_s is None or room.path_changed_frame is None
            or svc.tap.offset is None else round(svc.tap.sample_of(room.path_changed_frame) / MODEL_RATE, 2),
            # Each barge-in as the service met it: its latency split and what the listener did from the user's
            # onset to the window that paused the reply (case_trace).
            "barge_in_cases": [{"kind": o.case.kind, "label": o.case.label, "detected_ms": o.barge.get("detected_ms"),
                                "output_silent_ms": o.barge.get("output_silent_ms"), "split": o.barge.get("split"),
                                "trace": o.barge.get("trace")} for o in outcomes if o.barge],
            "tap": {"offset_frames": svc.tap.offsets[:1] + sorted(set(svc.tap.offsets[1:]) - set(svc.tap.offsets[:1])),
                    "correlation": svc.tap.peak},
            # The echo's delay behind the far end on the service's own streams, and how fast it moved
            # (appliance.audio.delay): the room's drift as the canceller met it.
            "echo_delay": tap_echo_delay(svc.tap),
            "not_run": ["cold_barge_in", "next_reply"],
            "model": "tiny random-weight Gemma 4 test fixture (hears; nonsense replies spoken by Piper)",
            "config": {"echo_backend": cfg.echo.backend if cfg.echo.enabled else None,
                       "classifier": cfg.interruption.classifier, "user_dbfs": sim.USER_DBFS,
                       "echo_delay_ms": sim.ECHO_DELAY_MS, "rt60_ms": sim.RT60_MS,
                       "reply_dbfs": round(reply_level, 1), "quick": quick, "echo_only": echo_only},
        })
        print_line(sim.table(outcomes))
        write_summary(summary, json_path, print_line)
        return summary


# --- idle CPU alone ---

def idle(cfg: Config, json_path: Optional[Path], seconds: float = 30.0, runs: int = 3, drift_ppm: float = 0.0,
         speaker: str = "linear", rate: int = JACK_RATE, period: int = JACK_PERIOD, settle_s: float = 3.0,
         print_line: Callable[[str], None] = print, server_name: Optional[str] = None) -> dict:
    """``appliance bench idle-cpu``: the service started as ``bench interruption --room jack`` starts it (its
    own JACK server, the room as its sound device, the tiny Gemma 4 fixture), nothing played and nobody
    talking; ``listening_cpu_pct`` (:func:`idle_cpu_split`) over ``runs`` consecutive windows of ``seconds``
    each after ``settle_s``. Writes the JSON: each window's tree/service/worker %, their median, min, max.

    :raises UserError: no jackd, or the service does not reach ``listening``.
    """
    if runs < 1 or seconds <= 0:
        raise UserError("bench idle-cpu: --runs must be at least 1 and --seconds above 0")
    with service_in_room(cfg, server_name or f"appliance-idle{rate // 1000}", rate, period, drift_ppm, speaker,
                         "appliance-idle-cpu-", settle_s, print_line) as (server, room, svc):
        windows = []
        for k in range(runs):
            w = idle_cpu_split(svc.proc.pid, seconds)
            w["state"] = svc.state
            windows.append(w)
            print_line(f"window {k + 1}/{runs}: {w['tree']} % of one core (service {w['service']} %, audio worker "
                       f"{w['children']} %), state {w['state']}")
        trees = [w["tree"] for w in windows]
        summary = {
            "listening_cpu_pct": float(np.median(trees)),
            "listening_cpu_pct_min": min(trees), "listening_cpu_pct_max": max(trees),
            "service_cpu_pct": float(np.median([w["service"] for w in windows])),
            "worker_cpu_pct": float(np.median([w["children"] for w in windows])),
            "windows": windows, "seconds": seconds, "runs": runs, "room": "jack", "drift_ppm": drift_ppm,
            "speaker": speaker, "jack": {"server": server.name, "rate": room.rate, "period": period},
            "measure": "CPU time (utime + stime, /proc) of the service and its descendants, % of one core",
            "model": "tiny random-weight Gemma 4 test fixture",
            "config": {"echo_backend": cfg.echo.backend if cfg.echo.enabled else None,
                       "listen_mode": cfg.listen.mode, "end_of_turn": cfg.vad.end_of_turn},
        }
        if any(w["state"] != "listening" for w in windows):
            summary["note"] = "the service left listening during a window: not idle"
        write_summary(summary, json_path, print_line)
        return summary
