"""``appliance bench interruption``: the barge-in layer measured in the simulated room, in real time.

Every scenario is a fresh :class:`~appliance.session.Session` on the loaded parts: the user asks a
question, the appliance answers (real LLM, real Piper, real playback buffer), and while it speaks the room
plays one scripted sound into the microphone together with the appliance's own echo (30 ms + a synthetic
RT60 150 ms room impulse response) at a set level relative to the user's voice. The room runs on the wall
clock, so every latency includes real compute.

Suite (fixed): long barge-ins at three points of a reply and three user levels; echo only at 0 dB and +6 dB
above the user's voice; non-speech sounds (door slam, clap, keyboard, bell, cough-like bursts, music);
backchannels and short interruptions in three voices (Piper ``en_US-joe-medium``, espeak-ng ``en-us+f3``
and ``en-gb+m3``), each short interruption once with the echo at 0 dB and once at +6 dB. Speech is
generated at bench time into a cache directory; the bell and the music come from Debian's
``sound-theme-freedesktop`` when installed (else they are synthesised), the other noises are synthesised
here.

Ground truth: the room knows where each injected sound starts and ends (first/last sample above
−40 dBFS); barge-in latency = the end of the output's last sample above −50 dBFS before the pause holds −
the speech onset (:func:`audible_until_ms`; a natural gap in the reply does not count as the pause).

No hidden warm-up: the canceller starts as the product's does. Each room (an echo level, with or without
the room's impulse response, or no echo path) starts with ``first_reply`` scenarios: a fresh session and a
fresh canceller (the first reply after a start), one question and its whole reply with nobody talking
over it, every pause counted. The rest of the room's scenarios then run, one after the other, on the
canceller those replies left, as a running service's canceller has met the replies before (``later``).
A more reverberant room (RT60 ``REVERB_RT60_MS``) has first replies only (:func:`first_reply_cases`). Between
two scenarios the room rings out into that canceller (:func:`ring_out`): the echo of what was played last
still reaches the microphone after the scenario's session has stopped, as in any room.

Why one module over 500 lines: the suite, one case's run and the summary share the case and outcome
types and the ground truth's conventions (onsets at -40 dBFS, silence at -50 dBFS); the cases and the
summary are plain data, the run is one function.
"""

from __future__ import annotations

import io
import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..audio.backends import open_port
from ..audio.echo import FRAME, HB_MIN_REL_DB
from ..audio.files import MODEL_RATE, load_audio, resample, write_wav
from ..audio.room import RoomSpec, Scenario, ScriptedUtterance, synthetic_ir
from ..config import Config
from ..errors import UserError
from ..pipeline import Parts, Timeline, jsonable
from ..session import Session
from ..vad import WINDOW_MS
from ..replay import audible_until_ms, barge_ins

USER_DBFS = -26.0  # the user's active speech level at the microphone (RMS over samples above -50 dBFS)
ECHO_DELAY_MS = 30.0
RT60_MS = 150.0
FREEDESKTOP = Path("/usr/share/sounds/freedesktop/stereo")
QUESTION = ("Tell me about rainbows and how they form.", "question")
VOICES = ("joe", "en-us+f3", "en-gb+m3")
BACKCHANNELS = ["Uh-huh.", "Yeah.", "Right.", "Okay.", "I see."]
SHORT_STOPS = ["Stop.", "Wait.", "No.", "Hold on."]
# A stop word and a question (the demo's "Wait, stop." alone now gets no reply: stop means stop).
NEXT_REPLY_STOP = "Wait, what about the moon?"
ENDED_BY_ITSELF_S = 0.1  # a reply that ends this soon after the user's onset makes the scenario invalid
ECHO_ONLY_RUNS = 5  # per echo level: a self-interrupt rate of a few percent showed in 1 of 20 extra runs
FIRST_REPLY_LEVELS = (-20.0, -10.0, 0.0, 6.0)  # echo relative to the user's voice, dB, for the cold-start cases
FIRST_REPLY_RUNS = 3  # per level and room (with and without the impulse response, and with no echo path)
REVERB_RT60_MS = 300.0  # a more reverberant room, for first replies only: its echo tail outlasts the 200 ms the gate
REVERB_LEVELS = (0.0, 6.0, 13.0)  # ... once assumed; +13 dB over the user is 6 dB over what is played (a user's room)
LONG_INTERRUPTIONS = ["Wait, I want to ask you something else about the moon.",
                      "No, actually, tell me about the ocean instead please."]


def active_dbfs(x: np.ndarray) -> float:
    """RMS level over samples above −50 dBFS (the active part of a recording), dBFS."""
    a = x[np.abs(x) > 10 ** (-50 / 20)]
    if not len(a):
        return -120.0
    return float(20 * np.log10(np.sqrt(np.mean(a.astype(np.float64) ** 2))))


def at_level(x: np.ndarray, dbfs: float) -> np.ndarray:
    return (x * 10 ** ((dbfs - active_dbfs(x)) / 20)).astype(np.float32)


# --- bench audio, generated into a cache ---

class AudioCache:
    """Speech from Piper and espeak-ng, and the non-speech sounds, cached as 16 kHz WAVs."""

    def __init__(self, root: Path, tts):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.tts = tts

    def _slug(self, text: str, voice: str) -> Path:
        slug = "".join(c if c.isalnum() else "_" for c in text.lower()).strip("_")[:48]
        return self.root / f"{voice.replace('+', '_')}__{slug}.wav"

    def speech(self, text: str, voice: str) -> np.ndarray:
        path = self._slug(text, voice)
        if not path.is_file():
            if voice == "joe":
                audio = resample(np.concatenate(list(self.tts.synthesize(text))), self.tts.sample_rate, MODEL_RATE)
            else:
                audio = espeak(text, voice)
            write_wav(path, audio, MODEL_RATE)
        return at_level(load_audio(path), USER_DBFS)

    def noise(self, name: str) -> np.ndarray:
        path = self.root / f"noise__{name}.wav"
        if not path.is_file():
            write_wav(path, make_noise(name), MODEL_RATE)
        return load_audio(path)


def espeak(text: str, voice: str) -> np.ndarray:
    """Speak with espeak-ng (Debian package ``espeak-ng``) at 160 words a minute; float32 16 kHz."""
    import soundfile as sf

    try:
        wav = subprocess.run(["espeak-ng", "-v", voice, "-s", "160", "--stdout", text], capture_output=True,
                             check=True, timeout=30).stdout
    except FileNotFoundError:
        raise UserError("espeak-ng is not installed: run `apt-get install espeak-ng` (the benchmark's second and "
                        "third voices)") from None
    x, sr = sf.read(io.BytesIO(wav), dtype="float32")
    return resample(x, sr, MODEL_RATE)


NOISES = ("door_slam", "clap", "keyboard", "bell", "cough", "music")


def make_noise(name: str, seed: int = 7) -> np.ndarray:
    """A non-speech sound, float32 16 kHz, peak about −6 dBFS. ``bell`` and ``music`` are the freedesktop
    sound theme's ``bell.oga`` and ``phone-incoming-call.oga`` when installed."""
    rng = np.random.default_rng(seed)
    sr = MODEL_RATE
    t = lambda s: np.arange(int(s * sr)) / sr  # noqa: E731
    if name == "door_slam":  # a low thump and a short rattle
        tt = t(0.5)
        thump = np.sin(2 * np.pi * 55 * tt) * np.exp(-tt / 0.06)
        rattle = np.convolve(rng.standard_normal(len(tt)), np.ones(8) / 8, "same") * np.exp(-tt / 0.03)
        x = thump + 0.6 * rattle
    elif name == "clap":  # two claps: 10 ms noise bursts decaying in 8 ms
        x = np.zeros(int(0.6 * sr))
        for start in (0.0, 0.35):
            s = int(start * sr)
            burst = rng.standard_normal(int(0.05 * sr)) * np.exp(-t(0.05) / 0.008)
            x[s : s + len(burst)] += burst
    elif name == "keyboard":  # a burst of typing: 5 ms clicks 60-160 ms apart
        x = np.zeros(int(1.5 * sr))
        pos = 0.0
        while pos < 1.4:
            s = int(pos * sr)
            click = rng.standard_normal(int(0.005 * sr)) * np.exp(-t(0.005) / 0.0015)
            x[s : s + len(click)] += click
            pos += rng.uniform(0.06, 0.16)
    elif name == "cough":  # two cough-like bursts: broadband noise with a sharp attack, 150-200 ms each
        x = np.zeros(int(0.8 * sr))
        for start, dur in ((0.0, 0.18), (0.35, 0.15)):
            s = int(start * sr)
            n = rng.standard_normal(int(dur * sr))
            n = np.convolve(n, np.array([1.0, -0.7]), "same")  # a little high-frequency tilt
            env = np.minimum(1.0, t(dur) / 0.01) * np.exp(-t(dur) / (dur / 3))
            x[s : s + len(n)] += n * env
    elif name in ("bell", "music"):
        src = FREEDESKTOP / ("bell.oga" if name == "bell" else "phone-incoming-call.oga")
        if src.is_file():
            x = load_audio(src)[: int(3.0 * sr)].astype(np.float64)
        elif name == "bell":
            tt = t(1.2)
            x = sum(np.sin(2 * np.pi * f * tt) * np.exp(-tt / d) for f, d in ((880, 0.5), (2210, 0.3), (3520, 0.2)))
        else:
            notes = [523.25, 659.25, 783.99, 1046.5, 783.99, 659.25]
            x = np.concatenate([np.sin(2 * np.pi * f * t(0.25)) * np.hanning(int(0.25 * sr)) for f in notes])
    else:
        raise ValueError(f"unknown noise {name!r}")
    x = np.asarray(x, dtype=np.float64)
    return (0.5 * x / max(np.max(np.abs(x)), 1e-9)).astype(np.float32)


# --- the suite ---

@dataclass
class Case:
    kind: str  # first_reply | cold_barge_in | barge_in | echo_only | noise | backchannel | short_stop | next_reply
    label: str
    audio: Optional[np.ndarray]
    text: Optional[str]
    delay_s: float = 0.8  # after the appliance starts speaking
    echo_rel_db: float = 0.0  # echo level relative to the user's voice (USER_DBFS)
    user_rel_db: float = 0.0
    echo_path: bool = True  # False: no echo reaches the microphone (headphones; the bundled demo's room)
    room_ir: bool = True  # the room's impulse response (rt60_ms) after the echo delay; False: a pure delay
    rt60_ms: float = RT60_MS  # the impulse response's RT60

    @property
    def cold(self) -> bool:
        """The case starts the product afresh: a new canceller, as after a start."""
        return self.kind in ("first_reply", "cold_barge_in")

    @property
    def room(self) -> tuple:
        """The room the case plays in; the cases of one room share the canceller, as one service would."""
        return (self.echo_rel_db if self.echo_path else None, self.room_ir if self.echo_path else None,
                self.rt60_ms if self.echo_path and self.room_ir else None)


def first_reply_cases(quick: bool = False) -> list[Case]:
    """The cold-start cases: the first reply after a start, nobody talking over it, at each level of
    ``FIRST_REPLY_LEVELS`` with and without the room's impulse response, and with no echo path; and once at
    each of ``REVERB_LEVELS`` in a room with RT60 ``REVERB_RT60_MS`` (quick: its two loudest).

    Why the reverberant room (measured here, offline, 34 first replies with the product's piece gaps, echo
    6 dB over what is played): the AEC3 stand-in removed only 8-10 dB of some windows there, and its tail
    rang on in the silences between the reply's pieces; 9 of them paused on themselves (0 at RT60 150 ms).
    The first two levels are the bench's; the third is that user's room."""
    cases = []
    runs = 1 if quick else FIRST_REPLY_RUNS
    levels = (0.0, 6.0) if quick else FIRST_REPLY_LEVELS
    for ir in (True, False):
        for rel in levels:
            for k in range(runs):
                where = f"echo {rel:+.0f} dB" + ("" if ir else ", no IR")
                cases.append(Case("first_reply", f"{where} #{k + 1}", None, None, 0.0, rel, room_ir=ir))
    if not quick:
        for k in range(runs):
            cases.append(Case("first_reply", f"no echo path #{k + 1}", None, None, 0.0, 0.0, echo_path=False))
    for rel in REVERB_LEVELS[1:] if quick else REVERB_LEVELS:
        cases.append(Case("first_reply", f"echo {rel:+.0f} dB, RT60 {REVERB_RT60_MS:.0f} ms #1", None, None, 0.0, rel,
                          rt60_ms=REVERB_RT60_MS))
    return cases


def build_suite(cache: AudioCache, quick: bool = False) -> list[Case]:
    """Every case, in the order they run: each room's first replies (cold) before its other cases."""
    cases: list[Case] = first_reply_cases(quick)
    # Barge-in while the canceller is still cold (the first reply after a start): what the cold start costs.
    text = LONG_INTERRUPTIONS[1]
    for k, voice in enumerate(VOICES[: 1 if quick else 3]):
        cases.append(Case("cold_barge_in", f"{voice} '{text[:18]}…' at +0.8s, first reply",
                          cache.speech(text, voice), text, 0.8, 0.0))
    points = (0.4, 0.9, 1.4)  # seconds after the reply's first audio (the embedded model's replies run 3-6 s)
    levels = (-6.0, 0.0, 6.0)
    for i, p in enumerate(points):
        for j, lv in enumerate(levels):
            text = LONG_INTERRUPTIONS[(i + j) % len(LONG_INTERRUPTIONS)]
            voice = VOICES[(i + j) % len(VOICES)]
            cases.append(Case("barge_in", f"{voice} '{text[:18]}…' at +{p}s, user {lv:+.0f} dB",
                              cache.speech(text, voice) * 10 ** (lv / 20), text, p, 0.0, lv))
    for rel in (0.0, 6.0):
        for k in range(1 if quick else ECHO_ONLY_RUNS):
            cases.append(Case("echo_only", f"echo {rel:+.0f} dB #{k + 1}", None, None, 0.0, rel))
    for name in NOISES:
        cases.append(Case("noise", name, at_level(cache.noise(name), USER_DBFS), None, 0.8, 0.0))
    for v in VOICES:
        for k, w in enumerate(BACKCHANNELS):
            cases.append(Case("backchannel", f"{v} {w}", cache.speech(w, v), w, 0.6 + 0.3 * (k % 3), 0.0))
        for k, w in enumerate(SHORT_STOPS):  # each twice: echo at 0 dB, then at +6 dB, at two points
            for m, rel in enumerate((0.0, 6.0)):
                cases.append(Case("short_stop", f"{v} {w} echo {rel:+.0f} dB", cache.speech(w, v), w,
                                  0.6 + 0.3 * ((k + m) % 3), rel))
    # A stop word, then the whole of the reply to it: the appliance must not pause that reply on its own
    # echo, with the canceller's filter just through the double talk of the barge-in (the bundled demo's
    # defect, with no echo path at all).
    for v in VOICES:
        for rel in (0.0, 6.0, None):
            where = "no echo path" if rel is None else f"echo {rel:+.0f} dB"
            cases.append(Case("next_reply", f"{v} '{NEXT_REPLY_STOP}' then the next reply, {where}",
                              cache.speech(NEXT_REPLY_STOP, v), NEXT_REPLY_STOP, 0.8, rel or 0.0,
                              echo_path=rel is not None))
    if quick:
        keep = {"barge_in": 3, "echo_only": 2, "noise": 2, "backchannel": 3, "short_stop": 3, "next_reply": 1}
        out, seen = [], {}
        for c in cases:
            if c.cold or seen.get(c.kind, 0) < keep[c.kind]:
                out.append(c)
                seen[c.kind] = seen.get(c.kind, 0) + 1
        cases = out
    return cases


def reply_dbfs(tts) -> float:
    """The active level of the appliance's replies as the playback buffer gets them (Piper through
    :class:`~appliance.speech.Tts`, its volume included), dBFS: over a fixed sentence."""
    text = "A rainbow is an arc of colours in the sky, made by sunlight shining through drops of rain."
    return active_dbfs(np.concatenate(list(tts.synthesize(text))))


def echo_gain_db(case: Case, reply_level_dbfs: float) -> float:
    """The room's echo path gain that puts the appliance's voice at ``USER_DBFS + echo_rel_db`` at the mic."""
    return USER_DBFS + case.echo_rel_db - reply_level_dbfs


def interjection_validity(recs: list[dict], speech: list[dict]) -> tuple[bool, str]:
    """Whether a scenario's interjection met a reply it could interrupt, from the timeline ``recs``
    (seconds) and the room's ``user_speech`` records of it: (valid, why not). Invalid when it never played,
    when the reply was not playing at its onset, or when the reply ended by itself within
    ``ENDED_BY_ITSELF_S`` of the onset, before any pause: that reply finished, it was not interrupted (the
    270M model's replies vary in length from run to run)."""
    if not speech:
        return False, "the interjection never played (no reply?)"
    onset = speech[0]["onset_t"]
    state_at = "listening"
    for r in recs:
        if r["event"] == "state" and r["t"] <= onset:
            state_at = r["state"]
    if state_at not in ("speaking", "interrupted"):
        return False, f"the reply was not playing at the onset ({state_at})"
    ended = [r["t"] for r in recs if r["event"] == "turn_end" and not r.get("interrupted")
             and onset <= r["t"] < onset + ENDED_BY_ITSELF_S]
    paused = [r["t"] for r in recs if r["event"] == "interrupted" and r["t"] >= onset - 0.05]
    if ended and not (paused and paused[0] <= ended[0]):
        return False, (f"the reply ended by itself {1000.0 * (ended[0] - onset):.0f} ms after the onset, "
                       "before a barge-in could be decided")
    return True, ""


def next_reply_start(recs: list[dict], after: float) -> tuple[bool, str, float]:
    """Where the reply to a flushing stop word began to play, from the timeline ``recs`` (seconds), for the
    ``next_reply`` scenarios: (valid, why not, its start). Invalid when the stop word did not flush the reply
    it interrupted (a missed short stop, counted by the ``short_stop`` scenarios), or when no next reply
    played."""
    flushed = [r["t"] for r in recs if r["event"] == "flushed" and r["t"] >= after]
    if not flushed:
        return False, "the stop word did not flush the reply", 0.0
    spoke = [r["t"] for r in recs if r["event"] == "state" and r["state"] == "speaking" and r["t"] > flushed[0]]
    if not spoke:
        return False, "no reply to the stop word played", 0.0
    return True, "", spoke[0]


def self_flushed(kind: str, recs: list[dict], after: float) -> bool:
    """Whether a reply nobody talked over was flushed, from the timeline ``recs`` (seconds): any flush after
    ``after`` (s) for ``echo_only`` and ``first_reply``; for ``next_reply`` only a flush of the reply to the stop
    word (the stop word's own flush of the reply before it is what that scenario does); False for the kinds
    with a user talking over the reply."""
    if kind in ("echo_only", "first_reply"):
        return any(r["event"] == "flushed" and r["t"] >= after for r in recs)
    if kind == "next_reply":
        valid, _, start = next_reply_start(recs, after)
        return valid and any(r["event"] == "flushed" and r["t"] >= start for r in recs)
    return False


def latency_split(recs: list[dict], onset_t: float, silent_ms: Optional[float]) -> Optional[dict]:
    """Where a barge-in's latency went, from the timeline ``recs`` (seconds) and the user's onset
    ``onset_t`` (s): ``vad_ms``, the onset to the end of the VAD window that fired (the algorithm: windows
    refused by the onset gate or scored under threshold); ``listener_ms``, that window's end to the pause
    (the listener and the conversation catching up, in real time); ``output_ms``, the pause to the output's
    silence (``silent_ms``: the fade and the samples the port still held). None without a pause after the
    onset or its ``vad_onset`` record. ms, rounded to 0.1."""
    paused = [r for r in recs if r["event"] == "interrupted" and r["t"] >= onset_t - 0.05]
    if not paused:
        return None
    # The record's own ``t`` is rounded to 0.1 ms (Conversation._emit); ``onset_t`` is the onset's time as posted.
    onset = paused[0].get("onset_t")
    onsets = [r for r in recs if r["event"] == "vad_onset" and onset is not None and abs(r["t"] - onset) < 2e-4
              and r.get("audio_t") is not None]
    if not onsets:
        return None
    window_end = onsets[0]["audio_t"] + WINDOW_MS / 1000.0
    detected = paused[0]["t"] - onset_t
    return {"vad_ms": round((window_end - onset_t) * 1000.0, 1),
            "listener_ms": round((paused[0]["t"] - window_end) * 1000.0, 1),
            "output_ms": None if silent_ms is None else round(silent_ms - detected * 1000.0, 1)}


@dataclass
class Outcome:
    case: Case
    records: list
    valid: bool
    interrupted: int = 0
    flushed: bool = False
    self_flushed: bool = False  # a reply nobody talked over was flushed (echo_only, first_reply, next_reply's next)
    resumed: bool = False
    barge: Optional[dict] = None
    resume_gap_ms: Optional[float] = None
    erle_num: float = 0.0
    erle_den: float = 0.0
    vad_ms: list = field(default_factory=list)
    note: str = ""
    gated: int = 0  # VAD windows above threshold that the echo onset gate refused
    verdicts: list = field(default_factory=list)  # the turn taker's (speech_ms, decision, heard) decisions
    gate_near_onset: list = field(default_factory=list)  # (ms after the onset, ratio dB, threshold dB) refused
    gate_headroom_db: Optional[float] = None  # min over echo-only windows the gate refused: threshold − ratio
    gate_hb_headroom_db: Optional[float] = None  # ... the same for its high-band test, where its level allowed it
    gate_both_headroom_db: Optional[float] = None  # ... for the early-onset test (both bands at once)
    gate_strong_headroom_db: Optional[float] = None  # ... for the strong high-band test, either check, where it was on
    early_onsets: int = 0  # candidates started below Silero's threshold on the strict near-end test
    segments: list = field(default_factory=list)  # (samples, played) per segment of the reply
    output: Optional[np.ndarray] = None
    echo: object = None  # the canceller the case ran with (a room's later cases go on with it)
    stand_in_ms: Optional[float] = None  # of the reply's audio, how much the cold-start stand-in served, ms
    served_by: Optional[str] = None  # whose output the VAD heard at the user's onset: see served_by()
    handed_back: bool = False  # the canceller handed back from Speex to the stand-in in this case (Speex lost the echo)


def run_case(case: Case, parts: Parts, cfg: Config, reply_level: float, echo=None,
             wait_turn_end: bool = False, question: Optional[np.ndarray] = None, until_idle: bool = False) -> Outcome:
    """Run one scenario in real time.

    :param echo: the canceller to go on with (the room's, as a running service's has met the replies
        before); None: a new one from ``cfg``, as after a start (what ``first_reply`` cases get). It is in
        :attr:`Outcome.echo` afterwards.
    :param wait_turn_end: run until the reply has ended (drained or flushed) rather than one second after
        the barge-in decision.
    :param until_idle: run until the conversation has been idle, with no utterance open, for 1 s (so the
        interjection's own turn and its reply are in the records); always so for ``next_reply`` cases.
    """
    parts.engine.forget()
    gain = echo_gain_db(case, reply_level)
    q = QUESTION_AUDIO if question is None else question
    events = [ScriptedUtterance(q, QUESTION[0], "question", at=0.3)]
    if case.audio is not None:
        events.append(ScriptedUtterance(case.audio, case.text, case.label, after="speaking", delay=case.delay_s))
    scenario = Scenario(events, RoomSpec(echo_gain_db=gain if case.echo_path else None, echo_delay_ms=ECHO_DELAY_MS,
                                         impulse_response=synthetic_ir(case.rt60_ms) if case.room_ir else None))
    if echo is not None and hasattr(echo, "clear_records"):
        echo.clear_records()
    timeline = Timeline()
    hears = parts.engine.hears_audio
    port = open_port(cfg, MODEL_RATE, "room", scenario=scenario, on_event=timeline, paced=True)
    session = Session(cfg, parts, port, [timeline], echo=echo, record_echo=True,
                      transcript_at=None if hears else scenario.transcript_at)
    echo = session.listener.echo  # a new one from cfg when none was given (what first_reply cases get)
    frame0 = echo.frames if echo is not None else 0
    stand_in0 = getattr(echo, "stand_in_frames", 0)
    room = port.room
    session.start()
    mark = [None]

    def until() -> bool:
        if case.kind == "next_reply" or until_idle:
            # Until the reply to the interjection has ended (or there is none): idle, with no utterance still
            # open (the end of turn may wait out a pause), for 1 s on end, as replay's end does.
            idle = room.finished_script and session.conversation.idle.is_set() and not session.segmenter.in_speech
            mark[0] = (mark[0] if mark[0] is not None else room.n) if idle else None
            return idle and room.n - mark[0] >= int(1.0 * MODEL_RATE)
        if mark[0] is None:
            if not room.finished_script:
                return False
            recs = timeline.records
            if case.kind in ("echo_only", "first_reply") or wait_turn_end:
                done = any(r["event"] in ("turn_end", "flushed") for r in recs)
            else:
                done = any(r["event"] in ("resumed", "flushed", "turn_end") for r in recs[2:]) \
                    or session.conversation.idle.is_set()
            if done:
                mark[0] = room.n
            return False
        return room.n - mark[0] >= int(1.0 * MODEL_RATE)

    try:
        port.run(until, max_seconds=40.0)
    finally:
        session.stop()
    recs = list(timeline.records)
    output = room.output_audio()
    out = Outcome(case, recs, valid=True, vad_ms=list(session.segmenter.infer_ms),
                  segments=session.playback.segments_played(), output=output, gated=session.segmenter.gated,
                  verdicts=list(session.conversation.turn_taker.verdicts),
                  early_onsets=session.segmenter.early_onsets, echo=echo)
    if echo is not None and hasattr(echo, "stand_in_frames"):
        out.stand_in_ms = 10.0 * (echo.stand_in_frames - stand_in0)
        out.handed_back = getattr(echo, "handback_frame", None) is not None and echo.handback_frame >= frame0
    speech = [r for r in recs if r["event"] == "user_speech" and r["source"] == case.label]
    if case.audio is not None:
        out.valid, out.note = interjection_validity(recs, speech)
    after = speech[0]["onset_t"] - 0.05 if speech else 0.0
    out.interrupted = sum(1 for r in recs if r["event"] == "interrupted" and r["t"] >= after)
    if case.kind == "next_reply" and out.valid:
        out.valid, out.note, next_start = next_reply_start(recs, after)
        # Every pause of the next reply is a self-interruption: the user stopped talking before it began.
        out.interrupted = sum(1 for r in recs if r["event"] == "interrupted" and r["t"] >= next_start) \
            if out.valid else 0
    out.flushed = any(r["event"] == "flushed" and r["t"] >= after for r in recs)
    out.self_flushed = self_flushed(case.kind, recs, after) if out.valid else False
    resumed = [r for r in recs if r["event"] == "resumed" and r["t"] >= after]
    out.resumed = bool(resumed) and not out.flushed
    if speech and resumed:
        out.resume_gap_ms = round((resumed[-1]["t"] - speech[0]["end_t"]) * 1000.0, 1)
    if echo is not None and (getattr(echo, "gate_log", None) or getattr(echo, "clear_log", None)):
        # The onset gate's refusals: near the interjection's onset (ms after it), and the closest the echo
        # alone came to the threshold (headroom, dB) in the whole scenario.
        ms = lambda g: (g.frame - frame0) * 10.0  # noqa: E731  (a GateRow's time in the scenario, ms)
        refused = [g for g in echo.gate_log if not g.passed]
        if speech:
            t_on = speech[0]["onset_t"] * 1000.0
            out.gate_near_onset = [(round(ms(g) - t_on), g.ratio_db, g.threshold_db) for g in refused
                                   if -50 <= ms(g) - t_on <= 300]
        early = [g for g in refused if not speech or ms(g) < speech[0]["onset_t"] * 1000.0 - 50]
        out.gate_headroom_db = round(min(g.threshold_db - g.ratio_db for g in early), 1) if early else None
        # The high-band test only counts over a high band at its usual level (see near_end_present).
        hb_early = [g.hb_threshold_db - g.hb_ratio_db for g in early if g.hb_ratio_db is not None
                    and g.hb_level_db is not None and g.hb_level_db >= HB_MIN_REL_DB and np.isfinite(g.hb_threshold_db)]
        out.gate_hb_headroom_db = round(min(hb_early), 1) if hb_early else None
        # The strict test behind early onsets (near_end_clear) needs both bands: how far the echo alone came
        # from passing both, where the high band's level let it count at all.
        both = [max(g.threshold_db - g.ratio_db, g.hb_threshold_db - g.hb_ratio_db) for g in echo.clear_log
                if (not speech or ms(g) < speech[0]["onset_t"] * 1000.0 - 50)
                and g.hb_ratio_db is not None and g.hb_level_db is not None and g.hb_level_db >= HB_MIN_REL_DB
                and np.isfinite(g.hb_threshold_db)]
        out.gate_both_headroom_db = round(min(both), 1) if both else None
        # The strong high-band test (either check may pass on it alone; EchoCanceller._hb_strong_deficit_db):
        # how far the echo alone came from passing it, where it was on (Speex converged, past the strict period).
        strong = [g.strong_db for g in refused + [c for c in echo.clear_log if not c.passed]
                  if getattr(g, "strong_db", None) is not None
                  and (not speech or ms(g) < speech[0]["onset_t"] * 1000.0 - 50)]
        out.gate_strong_headroom_db = round(min(strong), 1) if strong else None
    if case.kind in ("barge_in", "cold_barge_in") and out.valid and speech and not out.flushed:
        # Why was it missed? (diagnostics for the per-scenario line; the count is unchanged)
        drained = [r for r in recs if r["event"] == "turn_end" and not r.get("interrupted")]
        why = [f"onset gate refused {len(out.gate_near_onset)} window(s) near the onset"]
        if drained:
            why.append(f"the reply ended {1000.0 * (drained[0]['t'] - speech[0]['onset_t']):+.0f} ms after the onset")
        out.note = "; ".join(why)
    if case.kind in ("barge_in", "short_stop", "cold_barge_in") and speech and echo is not None:
        out.served_by = served_by(echo, frame0 + int(round(speech[0]["onset_t"] * MODEL_RATE)) // FRAME)
    if case.kind in ("barge_in", "short_stop", "cold_barge_in") and speech:
        b = [x for x in barge_ins(recs, output) if abs(x["onset_t"] - speech[0]["onset_t"]) < 1e-6]
        out.barge = b[0] if b else None
        if out.barge is not None:
            out.barge["output_silent_ms"] = audible_until_ms(output, speech[0]["onset_t"], out.barge["detected_ms"])
            out.barge["split"] = latency_split(recs, speech[0]["onset_t"], out.barge["output_silent_ms"])
    # ERLE over echo-only blocks: far end playing, no scripted sound in the microphone block.
    if echo is not None and echo.recorded and room.echo:
        n = min(len(echo.recorded), len(room.near_active), len(room.echo))
        for i in range(n):
            near, far, res = echo.recorded[i]
            if room.near_active[i] or float(np.dot(far, far)) < 1e-6:
                continue
            out.erle_num += float(np.dot(near, near))
            out.erle_den += float(np.dot(res, res))
    if echo is not None:
        ring_out(echo, room)
    return out


def served_by(echo, frame: int) -> str:
    """Whose output the VAD heard at the canceller's 10 ms ``frame`` (counted from its first):
    ``"stand_in"`` (Speex not yet handed over to, or handed back from: the WebRTC AEC3 stand-in, or nothing where it
    is missing),
    ``"reused"`` (a Speex adapted by data reuse in the stand-in's place, ``EchoCanceller.reused_active``),
    ``"speex"``, or the backend's name for a canceller with no hand-over (``"webrtc"``)."""
    if getattr(echo, "backend", None) != "speex":
        return str(getattr(echo, "backend", "unknown"))
    back = getattr(echo, "handback_frame", None)
    if back is not None and back <= frame:
        return "stand_in"
    handed = getattr(echo, "handover_frame", None)
    if handed is not None and handed <= frame:
        return "speex"
    reused = getattr(echo, "reused_frame", None)
    return "reused" if reused is not None and reused <= frame else "stand_in"


RING_OUT_S = 0.5  # longer than the echo path's delay and the reverberant room's RT60 (300 ms) together


def ring_out(echo, room) -> None:
    """Hand ``echo``, the canceller the room's next scenario goes on with, what the room still holds once the
    scenario has ended: ``RING_OUT_S`` of the echo's tail with nothing played (:meth:`SimulatedRoom.ring_out`), as
    the listener would (``quiet``: nobody answered, no utterance open). A scenario ends wherever its check is
    met, often with the reply (or the next one) still playing; without this, the canceller saw its far end
    play on while the echo stopped dead, a room no service is ever in. Measured here (offline, bit-exact replays
    of a real-time run's recorded microphone and far end, s14): a long barge-in that ended 240 ms into the reply to
    the interjection left Speex's preprocessor suppressing a later user's onset 7-10 dB more (a canceller carried
    from the room's first reply and that scenario only): en-gb "Wait, I want ..." was heard 98.4 ms after its
    onset, 34.4 ms with that scenario's tail fed; and the next reply paused on its own echo 158 ms in."""
    tail = room.ring_out(RING_OUT_S)
    silent = np.zeros(room.block, dtype=np.float32)
    for i in range(0, len(tail), room.block):
        echo.process(tail[i:i + room.block], silent, quiet=True)


QUESTION_AUDIO: np.ndarray = np.zeros(0, dtype=np.float32)


def pct(xs: list[float], q: float) -> float:
    return round(float(np.percentile(xs, q)), 1) if xs else None


def summarise(outcomes: list[Outcome], classifier_ms: list[float]) -> dict:
    by = lambda k: [o for o in outcomes if o.case.kind == k and o.valid]  # noqa: E731
    barge = by("barge_in")
    def silent_ms(os_: list[Outcome]) -> list[float]:
        """Barge-in latencies, ms; a user's onset in a gap of the reply (the output silent from the onset until
        after the pause took hold: :func:`audible_until_ms` gives 0) says nothing about latency and is
        counted apart (``barge_in_in_reply_gap``), not averaged in as 0 ms."""
        return [o.barge["output_silent_ms"] for o in os_ if o.barge and o.barge.get("output_silent_ms")]

    def in_gap(os_: list[Outcome]) -> int:
        return sum(1 for o in os_ if o.barge and o.barge.get("output_silent_ms") == 0.0)

    def paused(os_: list[Outcome]) -> dict:
        return {"count": sum(1 for o in os_ if o.interrupted), "n": len(os_)}

    lat = silent_ms(barge + by("short_stop"))
    by_canceller: dict[str, list[float]] = {}  # the same latencies by who served the VAD at the onset (served_by)
    for o in barge + by("short_stop"):
        if o.served_by:
            by_canceller.setdefault(o.served_by, []).extend(silent_ms([o]))
    # the same barge-ins' latency, part by part (latency_split)
    split = [o.barge["split"] for o in barge + by("short_stop")
             if o.barge and o.barge.get("output_silent_ms") and o.barge.get("split")]
    part = lambda k: [x[k] for x in split if x.get(k) is not None]  # noqa: E731
    parts = {"long_barge_in": silent_ms(barge)}
    for rel in sorted({o.case.echo_rel_db for o in by("short_stop")}):
        parts[f"short_stop_echo_{rel:+.0f}db"] = silent_ms([o for o in by("short_stop") if o.case.echo_rel_db == rel])
    echo_only, next_reply, first = by("echo_only"), by("next_reply"), by("first_reply")
    later = echo_only + next_reply
    cold_barge = by("cold_barge_in")
    stand_in = [o.stand_in_ms for o in first if o.stand_in_ms is not None]

    def pauses(os_: list[Outcome]) -> dict:
        return {"count": sum(o.interrupted for o in os_), "replies_paused": sum(1 for o in os_ if o.interrupted),
                "replies_flushed": sum(1 for o in os_ if o.self_flushed), "n": len(os_)}

    bc, ss, noise = by("backchannel"), by("short_stop"), by("noise")
    num = sum(o.erle_num for o in outcomes)
    den = sum(o.erle_den for o in outcomes)
    vad = [x for o in outcomes for x in o.vad_ms]
    gaps = [o.resume_gap_ms for o in bc + noise if o.resumed and o.resume_gap_ms is not None]
    return {
        "barge_in_ms": {"p50": pct(lat, 50), "p95": pct(lat, 95), "n": len(lat)},
        "barge_in_ms_by_kind": {k: {"p50": pct(v, 50), "p95": pct(v, 95), "n": len(v)} for k, v in parts.items()},
        # who served the VAD at the user's onset: the cold-start stand-in or Speex (EchoCanceller.handover_frame)
        "barge_in_ms_by_canceller": {k: {"p50": pct(v, 50), "p95": pct(v, 95), "n": len(v)}
                                     for k, v in sorted(by_canceller.items())},
        "barge_in_split_ms": {k: {"p50": pct(part(k), 50), "p95": pct(part(k), 95), "max": max(part(k), default=None),
                                  "n": len(part(k))} for k in ("vad_ms", "listener_ms", "output_ms")
                              + (("input_ms",) if part("input_ms") else ())},
        "barge_in_in_reply_gap": {"count": in_gap(barge + by("short_stop")), "cold": in_gap(cold_barge)},
        "missed_interrupts": {"count": sum(1 for o in barge if not o.flushed), "n": len(barge)},
        # what the cold start costs: the first reply's audio served by the stand-in, and a barge-in on it
        "cold_start": {"stand_in_ms": {"p50": pct(stand_in, 50), "max": max(stand_in, default=None),
                                       "n": len(stand_in)},
                       "barge_in_ms": {"p50": pct(silent_ms(cold_barge), 50), "p95": pct(silent_ms(cold_barge), 95),
                                       "n": len(silent_ms(cold_barge))},
                       "missed_interrupts": {"count": sum(1 for o in cold_barge if not o.flushed),
                                             "n": len(cold_barge)}},
        # the cases in which Speex lost the echo and handed back to the stand-in (EchoCanceller._watch_loss)
        "echo_hand_back": [{"case": f"{o.case.kind}: {o.case.label}"} for o in outcomes if o.handed_back],
        # echo-only replies, and the replies to a stop word (the barge-in's double talk just behind them)
        # every pause of a reply nobody talked over: the first reply after a start (a cold canceller) and the
        # later ones (echo alone, and the reply to a stop word, the barge-in's double talk just behind it)
        "self_interrupts_echo": {"count": sum(o.interrupted for o in first + later),
                                 "replies_paused": sum(1 for o in first + later if o.interrupted),
                                 "n": len(first + later),
                                 "first_reply": {**pauses(first),
                                                 "by_room": {o.case.label: o.interrupted for o in first}},
                                 "later_replies": pauses(later),
                                 "echo_gain_db": max((o.case.echo_rel_db for o in echo_only), default=0.0),
                                 "echo_levels_db": sorted({o.case.echo_rel_db for o in echo_only}),
                                 "echo_only": paused(echo_only), "after_barge_in": paused(next_reply),
                                 "after_barge_in_no_echo_path": paused([o for o in next_reply
                                                                        if not o.case.echo_path])},
        "false_flush_noise": {"count": sum(1 for o in noise if o.flushed), "n": len(noise),
                              "paused": sum(1 for o in noise if o.interrupted)},
        "backchannel_resumed": {"count": sum(1 for o in bc if o.resumed), "n": len(bc)},
        "short_interrupt_flushed": {"count": sum(1 for o in ss if o.flushed), "n": len(ss)},
        "resume_gap_ms": {"p50": pct(gaps, 50), "p95": pct(gaps, 95)},
        "onset_gate_min_headroom_db": min((o.gate_headroom_db for o in outcomes if o.gate_headroom_db is not None),
                                          default=None),
        "onset_gate_high_band_min_headroom_db": min(
            (o.gate_hb_headroom_db for o in outcomes if o.gate_hb_headroom_db is not None), default=None),
        "onset_early_min_headroom_db": min(
            (o.gate_both_headroom_db for o in outcomes if o.gate_both_headroom_db is not None), default=None),
        "onset_strong_min_headroom_db": min(
            (o.gate_strong_headroom_db for o in outcomes if o.gate_strong_headroom_db is not None), default=None),
        "early_onsets": {"count": sum(o.early_onsets for o in outcomes),
                         "barge_in": sum(o.early_onsets for o in barge + ss)},
        "erle_db": round(10 * np.log10(max(num, 1e-20) / max(den, 1e-20)), 1) if den > 0 else None,
        "vad_ms_per_chunk": round(float(np.mean(vad)), 3) if vad else None,
        "classifier_ms_per_interjection": {"p50": pct(classifier_ms, 50), "p95": pct(classifier_ms, 95),
                                           "n": len(classifier_ms)},
        "invalid_scenarios": [f"{o.case.kind}: {o.case.label}: {o.note}" for o in outcomes if not o.valid],
    }


def table(outcomes: list[Outcome]) -> str:
    rows = [f"{'kind':12} {'scenario':52} {'paused':>6} {'flushed':>7} {'resumed':>7} {'silent_ms':>9} {'gap_ms':>7}"]
    for o in outcomes:
        silent = o.barge.get("output_silent_ms") if o.barge else None
        rows.append(f"{o.case.kind:12} {o.case.label[:52]:52} {o.interrupted:>6} {str(o.flushed):>7} "
                    f"{str(o.resumed):>7} {str(silent):>9} {str(o.resume_gap_ms):>7}"
                    + ("" if o.valid else f"  INVALID: {o.note}"))
    return "\n".join(rows)


def run(cfg: Config, parts: Parts, json_path: Optional[Path], cache_dir: Path, quick: bool = False,
        print_line: Callable[[str], None] = print) -> dict:
    """Run the suite; print the per-scenario table and the summary; write the summary as JSON."""
    global QUESTION_AUDIO
    cache = AudioCache(cache_dir, parts.tts)
    QUESTION_AUDIO = cache.speech(QUESTION[0], "joe")
    reply_level = reply_dbfs(parts.tts)
    cases = build_suite(cache, quick)
    print_line(f"{len(cases)} scenarios, in real time (about {len(cases) * 9} s)")
    outcomes = []
    from ..turns import shared_keyword_classifier

    clf = shared_keyword_classifier() if cfg.interruption.classifier == "keywords" else None
    start_costs = len(clf.costs_ms) if clf else 0
    rooms: dict = {}  # room -> the canceller its last case left (a running service's)
    for c in cases:
        o = run_case(c, parts, cfg, reply_level, echo=None if c.cold else rooms.get(c.room))
        if c.kind != "cold_barge_in":
            rooms[c.room] = o.echo
        outcomes.append(o)
        silent = o.barge.get("output_silent_ms") if o.barge else None
        print_line(f"{c.kind:13} {c.label[:52]:52} paused={o.interrupted} stand_in_ms={o.stand_in_ms} served_by={o.served_by} flushed={o.flushed} resumed={o.resumed} "
                   f"silent_ms={silent} detected_ms={o.barge.get('detected_ms') if o.barge else None} split={o.barge.get('split') if o.barge else None} gap_ms={o.resume_gap_ms} gate_refused_at_onset={o.gate_near_onset} echo_headroom_db={o.gate_headroom_db}/{o.gate_hb_headroom_db}/{o.gate_both_headroom_db}/{o.gate_strong_headroom_db} early={o.early_onsets} verdicts={o.verdicts}"
                   + ("" if o.valid else " INVALID") + (f" ({o.note})" if o.note else ""))
    costs = clf.costs_ms[start_costs:] if clf else []
    summary = summarise(outcomes, costs)
    summary["config"] = {"echo_backend": cfg.echo.backend if cfg.echo.enabled else None,
                         "classifier": cfg.interruption.classifier, "user_dbfs": USER_DBFS,
                         "echo_delay_ms": ECHO_DELAY_MS, "rt60_ms": RT60_MS, "reply_dbfs": round(reply_level, 1),
                         "first_reply_reverb": {"rt60_ms": REVERB_RT60_MS, "levels_db": list(REVERB_LEVELS)},
                         "echo_stand_in": bool(cfg.echo.enabled and cfg.echo.stand_in), "quick": quick}
    print_line(table(outcomes))
    # numpy scalars are written as numbers (a summary must never be lost to a type after a 10-minute run)
    text = json.dumps(summary, indent=2, default=jsonable)
    print_line(text)
    if json_path:
        Path(json_path).write_text(text + "\n", encoding="utf-8")
    return summary
