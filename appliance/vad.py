"""Silero VAD (ONNX, run with onnxruntime on one thread) and the speech/silence hysteresis.

Model facts (Silero VAD v5/v6 ONNX, the file ``silero_vad.onnx`` shipped in the PyPI package
``silero-vad``): input ``input`` float32 [1, 576] = 64 samples of context (the tail of the previous window)
+ 512 new samples at 16 kHz; ``state`` float32 [2, 1, 128]; ``sr`` int64 scalar; outputs ``output``
[1, 1] speech probability and ``stateN`` (the next state).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from .audio.files import MODEL_RATE
from .errors import UserError

WINDOW = 512  # samples per VAD window at 16 kHz = 32 ms
CONTEXT = 64  # samples of left context the model expects before each window
WINDOW_MS = WINDOW * 1000 / MODEL_RATE
HOP = WINDOW // 2  # the segmenter's default hop: two phase-shifted Silero streams, one result every 16 ms
FLOOR_S = 3.0  # skip_floor: the room's noise floor is the quietest window of the last FLOOR_S seconds ...
FLOOR_MARGIN_DB = 2.0  # ... a window at most this far above it is not run ...
FLOOR_SETTLE_S = 3.0  # ... once the first stream has run this long on windows at the floor, back to back
FLOOR_MAX_DBFS = -55.0  # ... while that floor is at most this loud (mean square of the window, dBFS)


def bundled_model_path() -> Path:
    """Path of ``silero_vad.onnx`` inside the installed ``silero-vad`` package (without importing it: its
    ``__init__`` imports torch)."""
    import importlib.util

    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("silero-vad is not installed: run `pip install --no-deps silero-vad` (or `make venv`)")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "silero_vad.onnx"


def onnx_session(path: Path, fix: str):
    """An onnxruntime CPU session on one thread (the audio path's models run one call at a time, beside
    llama.cpp's threads), quiet below errors, with onnxruntime's ``session.x64quantprecision`` on: an 8-bit
    quantized model (Smart Turn v3.2) has its u8s8 products computed as u8u8 where the CPU is x86 without VNNI
    (SSE4.1, AVX2, AVX-512 without VNNI), whose u8s8 kernels saturate 16-bit pair sums (onnxruntime's option;
    nothing changes elsewhere: ARM, the Pi 5, or a float model such as Silero). Measured here (AMD EPYC, AVX2, no
    VNNI; session 30): Smart Turn gave espeak-ng's en-us+f3 "So the thing is, I need" 0.75 (complete) without it,
    0.14 with it, 0.33 with the quantized nodes left unfused; 125 ms an inference either way.

    :raises UserError: the file does not load, with ``fix`` as the remedy.
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.x64quantprecision", "1")
    try:
        return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types
        raise UserError(f"{path}: not a loadable ONNX model ({exc.__class__.__name__}); {fix}") from None


class SileroVad:
    """One Silero VAD stream: feed 512-sample windows, get speech probabilities.

    Not thread-safe: one owner calls :meth:`probability`.
    """

    def __init__(self, model_path: Optional[str | Path] = None):
        path = Path(model_path) if model_path else bundled_model_path()
        if not path.is_file():
            raise UserError(f"{path}: Silero VAD model not found; reinstall with `pip install --no-deps silero-vad`")
        self._session = onnx_session(path, "reinstall silero-vad")
        self._sr = np.array(MODEL_RATE, dtype=np.int64)
        self.reset()

    def fork(self) -> "SileroVad":
        """A second stream on the same loaded model (its own recurrent state and context), e.g. for a
        phase-shifted window sequence. The streams must not run concurrently (one thread owns both)."""
        other = object.__new__(SileroVad)
        other._session, other._sr = self._session, self._sr
        other.reset()
        return other

    def reset(self) -> None:
        """Forget the recurrent state and the context (start of a new stream)."""
        self._state = np.zeros((2, 1, 128), dtype=np.float32)
        self._context = np.zeros(CONTEXT, dtype=np.float32)
        self.last = 0.0  # the last probability returned

    def probability(self, window: np.ndarray) -> float:
        """Speech probability of one window.

        :param window: float32 [512] mono PCM at 16 kHz in [-1, 1].
        :returns: probability in [0, 1].
        :raises ValueError: if the window is not 512 samples.
        """
        if window.shape != (WINDOW,):
            raise ValueError(f"VAD window must be {WINDOW} samples, got {window.shape}")
        x = np.concatenate([self._context, window.astype(np.float32, copy=False)])[None, :]
        out, self._state = self._session.run(None, {"input": x, "state": self._state, "sr": self._sr})
        self._context = x[0, -CONTEXT:].copy()
        self.last = float(out[0, 0])
        return self.last

    def skip(self, window: np.ndarray) -> float:
        """A window not run (:attr:`VadSegmenter.skip_floor`): scored 0.0; its tail is the next window's
        context, as if it had run; the recurrent state stays where the last run left it.

        :param window: float32 [512] mono PCM at 16 kHz. :returns: 0.0.
        """
        self._context = np.asarray(window[-CONTEXT:], dtype=np.float32).copy()
        self.last = 0.0
        return 0.0


@dataclass
class VadEvent:
    """What the segmenter saw in one window.

    ``kind`` is one of:
    - ``"onset"``: the first window above threshold after silence (a candidate; used for an instant pause);
    - ``"start"``: speech confirmed (``min_speech_ms`` of speech since the onset);
    - ``"reject"``: the candidate ended before it was confirmed (a click, a bump, or a very short word such
      as "Stop."); ``audio`` holds the candidate (float32 mono 16 kHz) so that it can still be classified;
    - ``"end"``: end of turn, ``min_silence_ms`` of silence after confirmed speech (or, with an end-of-turn
      model, a pause it called complete, see :class:`VadSegmenter`); ``audio`` holds the utterance,
      float32 mono 16 kHz, from the onset (plus a little lead-in) to the end of speech;
    - ``"settled"``: ``min_silence_ms`` of silence after an interjection (an utterance that ended while
      :attr:`VadSegmenter.interjecting`) and whatever followed it: the user has stopped talking. A stop
      word that flushed a reply waits for this (or for the next ``"end"``) before it becomes a turn.
    ``t_sample`` is the index, in samples at 16 kHz since the stream started, of the window's first sample.
    """

    kind: str
    t_sample: int
    prob: float
    audio: Optional[np.ndarray] = None
    speech_ms: float = 0.0
    eot_prob: Optional[float] = None  # "end": the end-of-turn model's last probability, if it was asked
    silence_ms: float = 0.0  # "end": the pause that ended the turn, ms


@dataclass
class VadSegmenter:
    """Hysteresis over Silero probabilities: onset, confirmed start, end of turn.

    Defaults (threshold 0.5, speech start after 250 ms, end after 500 ms of silence) follow Silero's
    reference ``get_speech_timestamps``; the end threshold is ``threshold - 0.15`` as there.

    ``hop``: a probability every ``hop`` samples (default 256 = 16 ms) over the last 512. Silero is
    recurrent and trained on back-to-back windows, so a 16 ms hop runs two streams on the same model
    (:meth:`SileroVad.fork`), each on its own back-to-back 512-sample windows, the second shifted by 256
    samples; every hop takes the probability of the stream whose window just completed. That halves the
    wait for a window to complete (the barge-in onset comes 0–16 ms after a window's speech instead of
    0–32 ms) for twice the inference cost (one 512-sample window every 16 ms: about 0.6 ms each on x86_64
    here, measured). ``hop=512`` is the single stream of Silero's reference.

    ``both_streams`` False (the listener sets it while the appliance is not replying): the second stream
    is not run, and its hops reuse the first stream's last probability, so every hop still advances the
    hysteresis (silence, the end-of-turn calls, the utterance's audio) but a probability is new only every
    32 ms, at half the inference cost. Events come at most one hop (16 ms) away from both streams' (their
    kinds the same on the tests' speech); the barge-in's early onset needs both. When it is set again the
    second stream starts afresh (:meth:`SileroVad.reset`, as the reference starts a stream), not from the
    state it had before the gap.

    ``skip_floor`` (the listener sets it while nobody is answered; it needs ``both_streams`` False): windows
    at the room's noise floor are not run at all. The floor is the quietest window (mean square) of the last
    3 s; a window at most 2 dB above it, while that floor is −55 dBFS or quieter, is scored 0.0 without
    inference (:meth:`SileroVad.skip`: its tail is the next window's context), once the stream has run 3 s
    of such windows back to back since the last sound. A voice raises a window's energy well above a quiet
    room's floor (speech 15 dB above it: +15 dB), so such windows are run. What it does not keep: Silero's
    recurrent state, which keeps drifting for tens of seconds over plain noise (measured here: the state
    after 10 s of −70 dBFS noise is 3.4 from the state after 60 s, after 1 s 14.3, norm 28), stays where the
    3 s left it, so a later onset is scored from a state that heard the room for 3 s, not for minutes.
    Measured here, offline, with the demo's question and "Wait." and a human recording at −55 to −30 dBFS
    over −70 and −60 dBFS floors, 3.5–18 s apart: every onset without the gate had one with it at the same
    window or earlier (up to 2 windows earlier at −55/−50 dBFS, where Silero without it split some into
    onset, reject, onset), none later, and at −55 dBFS over −60 some quiet "Wait."s that it missed
    were heard; the bench's non-speech sounds (−30 to 0 dB) started no candidate either way. Skipped: two
    thirds of the windows of that speech scene, all but the 3 s after each sound in a quiet room.

    While :attr:`interjecting` is True (the appliance has paused its reply for the user's speech), an
    utterance ends after ``interjection_silence_ms`` of silence instead of ``min_silence_ms``, so that a
    backchannel is decided, and the reply resumed, within 400 ms of its end (200 ms of silence + at most one
    32 ms window + the classifier). Such an early end may only be a pause ("Wait, … stop."), so
    ``min_silence_ms`` after it (counted from the end of whatever speech follows), a ``"settled"`` event
    says that the user has really stopped. While interjecting, a candidate that was never confirmed also
    waits ``interjection_silence_ms`` before it is rejected (96 ms otherwise): an early onset (below)
    starts it on the "s" of "Stop.", and Silero may score that "s" and the "t"'s closure as silence for
    100 ms or more before the vowel.

    Early onsets (barge-in only): Silero scores a fricative low until the vowel (espeak-ng's "Stop." under
    the appliance's echo: 0.05–0.45 for 100–150 ms). While the appliance talks, the echo canceller can
    tell such a window from its own echo (``onset_evidence``), and then a score of
    ``onset_low_threshold`` (0.2) starts the candidate, and so the pause. Measured here, offline, on the
    bench's barge-ins (3 voices, 4 short stops at 0 and +6 dB echo, 2 long ones at −6 and 0 dB, 4 replies,
    144 in all): onset → window end p50/p95/max 54/100/146 ms without it, 49/79/100 ms with it; over 48
    echo-only replies (5.6 min, echo at 0, +6 and +10 dB) none started. The cost: some non-speech sounds
    now pause the reply briefly (the bench's bell, in 1 of 6 noises, resumed after 120–200 ms).
    """

    vad: SileroVad
    threshold: float = 0.5
    min_speech_ms: int = 250
    min_silence_ms: int = 500
    max_utterance_s: float = 30.0
    lead_in_ms: int = 200
    interjection_silence_ms: int = 200
    infer_ms: list = field(default_factory=list)
    interjecting: bool = False
    # Optional check of a window above threshold before it may start a candidate (e.g. the echo
    # canceller's double-talk test: is the near end, not the echo, what the VAD heard?).
    onset_gate: Optional[Callable[[], bool]] = None
    gated: int = 0  # windows above threshold that the gate refused
    # Optional strict near-end test (the echo canceller's near_end_clear: both of its bands say "the user,
    # not the echo", which only happens while the appliance talks): with it, a window scored at least
    # ``onset_low_threshold`` starts a candidate too. See the class notes.
    onset_evidence: Optional[Callable[[], bool]] = None
    onset_low_threshold: float = 0.2
    early_onsets: int = 0  # candidates started by onset_evidence below threshold
    hop: int = HOP
    both_streams: bool = True  # False: the second stream is skipped (see the class notes)
    skip_floor: bool = False  # with both_streams False: windows at the room's noise floor are not run (notes)
    floor_skipped: int = 0  # windows not run because of skip_floor
    # Optional end-of-turn model (appliance.eot): ``end_of_turn(utterance) -> probability`` that the user has
    # finished. With it, a confirmed utterance (not an interjection) ends when the model, asked at a pause of
    # ``short_stop_ms`` and again at ``end_of_turn_confirm_ms`` of the same pause, says complete both times
    # (``end_of_turn_confirm_ms`` 0: the first answer decides); else after ``max_silence_ms`` of silence.
    # Why two calls: measured offline over the latency bench's 52 questions (``python -m
    # appliance.bench.latency --offline``, docs/latency.md), one call at 200 ms ended 14 turns inside a
    # mid-utterance pause (eot_detect p50 310 ms); with a second "complete" required at 300 ms, 6 (p50 420).
    end_of_turn: Optional[Callable[[np.ndarray], float]] = None
    short_stop_ms: int = 200
    end_of_turn_threshold: float = 0.5
    max_silence_ms: int = 1000
    end_of_turn_confirm_ms: int = 300
    # What the end-of-turn model hears: "pause", the utterance with the pause so far (as Pipecat hands Smart
    # Turn the audio up to its VAD's stop, 200 ms of silence with its recommended settings); "speech", the
    # utterance cut 64 ms after Silero's end of speech (the same audio at every call of a pause).
    end_of_turn_input: str = "pause"
    eot_calls: list = field(default_factory=list)  # (silence ms at the call, probability) of each call
    # Optional observer of every window (a benchmark's trace, appliance.audio.tap): ``on_window(start, p)``,
    # the window's first sample (on the pushed audio's clock) and its probability, before the window's events.
    on_window: Optional[Callable[[int, float], None]] = None

    def __post_init__(self) -> None:
        if self.hop not in (WINDOW, WINDOW // 2):
            raise ValueError(f"VAD hop must be {WINDOW} or {WINDOW // 2} samples, got {self.hop}")
        if not hasattr(self, "_streams"):
            self._streams = [self.vad] if self.hop == WINDOW else [self.vad, self.vad.fork()]
        self._buf = np.zeros(0, dtype=np.float32)
        self._window_buf = np.zeros(WINDOW, dtype=np.float32)  # the last 512 samples
        self._hops = 0  # hops consumed
        self._n = 0  # samples consumed
        self._in_speech = False
        self._confirmed = False
        self._onset = 0
        self._last_voice = 0
        self._utt: list[np.ndarray] = []
        self._history: list[np.ndarray] = []  # recent windows for lead-in
        self._settle_from: Optional[int] = None  # end of the last speech after an interjection, samples
        self._eot_asked: Optional[tuple] = None  # (_last_voice, probability, final?) of this pause's EOT call(s)
        self._second_skipped = False  # the second stream missed windows (both_streams was False)
        self._floor = np.full(int(FLOOR_S * MODEL_RATE / WINDOW), np.inf)  # mean squares of the last 3 s of windows
        self._floor_i = 0
        self._floor_n = 0  # windows tracked
        self._floor_run = 0  # windows at the floor in a row

    def follow(self, interjecting: bool, both_streams: bool, skip_floor: bool = False) -> None:
        """The conversation's moment, given by the listener before each block: ``interjecting`` (the reply is
        paused for the user: ``interjection_silence_ms`` ends the speech), ``both_streams`` (a barge-in may
        come: both Silero streams every 16 ms hop; False: one, every 32 ms) and ``skip_floor`` (nobody is
        answered: windows at the room's noise floor need not run; see the class notes). Takes effect from
        the next window."""
        self.interjecting, self.both_streams, self.skip_floor = interjecting, both_streams, skip_floor

    def configure(self, vad, interruption) -> None:
        """Take new hysteresis settings from the next window on: the config's ``vad`` section
        (:class:`appliance.config.VadConfig`: ``threshold``, ``min_speech_ms``, ``min_silence_ms``,
        ``max_utterance_s``, ``short_stop_ms``, ``end_of_turn_threshold``, ``max_silence_ms``) and the
        ``interruption`` section's ``interjection_silence_ms`` (:class:`appliance.config.InterruptionConfig`).
        Call from the thread that pushes audio, or between pushes."""
        self.threshold, self.min_speech_ms, self.min_silence_ms = vad.threshold, vad.min_speech_ms, vad.min_silence_ms
        self.max_utterance_s, self.interjection_silence_ms = vad.max_utterance_s, interruption.interjection_silence_ms
        self.short_stop_ms, self.end_of_turn_threshold = vad.short_stop_ms, vad.end_of_turn_threshold
        self.max_silence_ms = vad.max_silence_ms

    def use_end_of_turn(self, end_of_turn: Optional[Callable[[np.ndarray], float]]) -> None:
        """Take an end-of-turn model (:class:`appliance.eot.SmartTurn`'s ``probability``), or None for the
        silence rule alone."""
        self.end_of_turn = end_of_turn

    def observe(self, on_window: Optional[Callable[[int, float], None]]) -> None:
        """Have ``on_window(start, p)`` called for every window from now on (None: no observer): the
        window's first sample on the pushed audio's clock (16 kHz samples) and its Silero probability, before
        the window's events; for a benchmark's trace (:mod:`appliance.audio.tap`)."""
        self.on_window = on_window

    def use_gate(self, onset_gate: Optional[Callable[[], bool]],
                 onset_evidence: Optional[Callable[[], bool]] = None) -> None:
        """Take the echo canceller's double-talk tests (:attr:`onset_gate`, :attr:`onset_evidence`), or none.
        Call from the thread that pushes audio."""
        self.onset_gate = onset_gate
        self.onset_evidence = onset_evidence

    def reset(self) -> None:
        for v in self._streams:
            v.reset()
        self.__post_init__()

    @property
    def in_speech(self) -> bool:
        return self._in_speech

    @property
    def confirmed(self) -> bool:
        """True between a ``start`` and its ``end``."""
        return self._in_speech and self._confirmed

    @property
    def speech_ms(self) -> float:
        """Speech so far in the current candidate or utterance, ms."""
        return (self._last_voice - self._onset) * 1000.0 / MODEL_RATE if self._in_speech else 0.0

    def _keep(self) -> int:
        """Hops of the utterance so far up to where its speech ended, plus 64 ms (what an ``end`` holds)."""
        hop_ms = self.hop * 1000.0 / MODEL_RATE
        return max(1, len(self._utt) - int((self._n - self._last_voice) / self.hop) + int(64 / hop_ms))

    @property
    def silence_ms(self) -> float:
        """Silence since the current utterance's last speech, ms (0 outside speech)."""
        return (self._n - self._last_voice) * 1000.0 / MODEL_RATE if self._in_speech else 0.0

    def utterance_samples(self) -> int:
        """Length of :meth:`utterance_audio`, samples, without building it."""
        return min(self._keep(), len(self._utt)) * self.hop if self._in_speech else 0

    def utterance_audio(self) -> np.ndarray:
        """The utterance so far as an ``end`` now would hold it: float32 [n] mono 16 kHz from its onset (and
        lead-in) to 64 ms after its last speech. Each call's audio begins with the previous call's (the
        streamed pre-fill relies on it); empty outside speech."""
        return np.concatenate(self._utt[: self._keep()]) if self._in_speech and self._utt else np.zeros(0, np.float32)

    def push(self, block: np.ndarray) -> list[VadEvent]:
        """Feed float32 mono 16 kHz samples of any length; returns the events of completed windows."""
        self._buf = np.concatenate([self._buf, block.astype(np.float32, copy=False)])
        events: list[VadEvent] = []
        h = self.hop
        while len(self._buf) >= h:
            new, self._buf = self._buf[:h], self._buf[h:]
            self._window_buf = np.concatenate([self._window_buf[h:], new])
            self._hops += 1
            if self._hops * h < WINDOW:  # the first window is not complete yet
                self._n += h
                continue
            k = self._hops % len(self._streams)
            stream = self._streams[k]
            if not k and self._at_floor(self._window_buf):
                stream = _Skipped(stream)
            elif k and not self.both_streams:
                stream, self._second_skipped = _Held(self._streams[0]), True
            elif k and self._second_skipped:
                stream.reset()  # it missed windows: a fresh stream, not one resumed across a gap
                self._second_skipped = False
            events.extend(self._window(self._window_buf, new, stream))
        return events

    def _at_floor(self, w: np.ndarray) -> bool:
        """Track the room's noise floor on the first stream's windows (back to back, 32 ms) and say whether
        this one may be skipped: :attr:`skip_floor`, one stream, no utterance under way, ``FLOOR_S`` of
        windows heard, the quietest of them at most ``FLOOR_MAX_DBFS``, this one within ``FLOOR_MARGIN_DB``
        of it, and the stream has run ``FLOOR_SETTLE_S`` of such windows in a row since the last that was
        not (so after every sound, reply or utterance)."""
        e = float(np.dot(w, w)) / len(w)
        floor = float(self._floor.min())
        self._floor[self._floor_i] = e
        self._floor_i = (self._floor_i + 1) % len(self._floor)
        self._floor_n += 1
        if not self.skip_floor or self.both_streams or self._in_speech or self._floor_n <= len(self._floor):
            self._floor_run = 0
            return False
        if floor > 10 ** (FLOOR_MAX_DBFS / 10) or e > floor * 10 ** (FLOOR_MARGIN_DB / 10):
            self._floor_run = 0
            return False
        self._floor_run += 1
        if self._floor_run * WINDOW <= FLOOR_SETTLE_S * MODEL_RATE:
            return False
        self.floor_skipped += 1
        return True

    def _window(self, w: np.ndarray, new: np.ndarray, stream: SileroVad) -> list[VadEvent]:
        """One probability over the window ``w`` (the last 512 samples), whose last ``hop`` samples,
        ``new``, have not been seen before."""
        t0 = time.perf_counter()
        p = stream.probability(w)
        if not isinstance(stream, (_Held, _Skipped)):
            self.infer_ms.append((time.perf_counter() - t0) * 1000.0)
        if len(self.infer_ms) > 4096:
            del self.infer_ms[:2048]
        self._n += len(new)
        start = self._n - WINDOW  # the window's first sample
        if self.on_window is not None:
            self.on_window(start, p)
        hop_ms = len(new) * 1000.0 / MODEL_RATE
        events: list[VadEvent] = []
        if not self._in_speech:
            if self._settle_from is not None and self._n - self._settle_from >= self.min_silence_ms * MODEL_RATE // 1000:
                self._settle_from = None
                events.append(VadEvent("settled", start, p))
            self._history.append(new)
            lead = max(1, int(self.lead_in_ms / hop_ms))
            del self._history[:-lead]
            early = bool(self.threshold > p >= self.onset_low_threshold and self.onset_evidence is not None
                         and self.onset_evidence())
            if p >= self.threshold and self.onset_gate is not None and not self.onset_gate():
                self.gated += 1
            elif p >= self.threshold or early:
                self.early_onsets += early
                self._in_speech, self._confirmed = True, False
                self._onset = self._last_voice = start
                self._utt = list(self._history)
                events.append(VadEvent("onset", start, p))
            return events
        self._utt.append(new)
        if p >= self.threshold - 0.15:
            self._last_voice = start + WINDOW
        speech_ms = (self._last_voice - self._onset) * 1000.0 / MODEL_RATE
        silence_ms = (self._n - self._last_voice) * 1000.0 / MODEL_RATE
        if not self._confirmed and speech_ms >= self.min_speech_ms:
            self._confirmed = True
            events.append(VadEvent("start", start, p, speech_ms=speech_ms))
        too_long = (self._n - self._onset) / MODEL_RATE >= self.max_utterance_s
        end_silence = self.interjection_silence_ms if self.interjecting else self.min_silence_ms
        eot_prob = None
        if self._confirmed and not self.interjecting and self.end_of_turn is not None:
            end_silence = self.max_silence_ms
            eot_prob = self._ask_end_of_turn(silence_ms)
            if eot_prob is not None and eot_prob > self.end_of_turn_threshold:
                end_silence = silence_ms  # complete: end now
        if silence_ms >= end_silence or too_long:
            audio = np.concatenate(self._utt[: self._keep()])
            kind = "end" if self._confirmed else "reject"
            events.append(VadEvent(kind, start, p, audio=audio, speech_ms=speech_ms, eot_prob=eot_prob,
                                   silence_ms=silence_ms))
            self._after_speech()
            self._in_speech = self._confirmed = False
            self._utt, self._history = [], []
        elif not self._confirmed and silence_ms >= (end_silence if self.interjecting else 96):
            # A candidate that fell silent before it was confirmed: not speech (a click, a knock), or a word
            # too short to confirm; the audio goes along for the barge-in classifier.
            events.append(VadEvent("reject", start, p, audio=np.concatenate(self._utt), speech_ms=speech_ms))
            self._after_speech()
            self._in_speech = False
            self._utt, self._history = [], []
        return events

    def _ask_end_of_turn(self, silence_ms: float) -> Optional[float]:
        """The end-of-turn model's verdict on the pause so far: None before ``short_stop_ms`` of silence;
        else the probability that the user has finished, from the call at ``short_stop_ms`` (the utterance
        so far, its end the pause) and, once the pause reaches ``end_of_turn_confirm_ms`` (if not 0), the
        smaller of that and a second call's: both must say complete. Until the second call, a first
        "complete" is reported as the threshold itself (not above it: the turn goes on). At most two calls
        per pause; the last answer stands for the rest of the pause.

        Why a second call rather than one later call: Smart Turn's answer to one phrase moves with the
        pause (on Piper's and espeak-ng's voices cut at a comma, 0.1-0.3 at 200 ms and up to 0.9 at
        400-600 ms, measured here), and a question that already sounds complete ("What should I cook
        tonight … if I only have rice?") scores complete at any pause: requiring two answers 100 ms apart
        waits out pauses shorter than the second call and needs the model to agree with itself."""
        if silence_ms < self.short_stop_ms:
            return None
        asked = self._eot_asked if self._eot_asked is not None and self._eot_asked[0] == self._last_voice else None
        if asked is not None:
            if asked[2]:
                return asked[1]
            if silence_ms < self.end_of_turn_confirm_ms:
                return self.end_of_turn_threshold  # complete once: waiting for the confirming call
        heard = self._utt if self.end_of_turn_input == "pause" else self._utt[: self._keep()]
        prob = float(self.end_of_turn(np.concatenate(heard)))
        self.eot_calls.append((round(silence_ms, 1), round(prob, 3)))
        del self.eot_calls[:-256]
        if asked is not None:  # the confirming call: both must say complete
            prob = min(prob, asked[1])
        elif prob > self.end_of_turn_threshold and silence_ms < self.end_of_turn_confirm_ms:
            self._eot_asked = (self._last_voice, prob, False)
            return self.end_of_turn_threshold
        self._eot_asked = (self._last_voice, prob, True)
        return prob

    def _after_speech(self) -> None:
        """An utterance or candidate ended: after an interjection, start (again) counting toward ``settled``."""
        if self.interjecting or self._settle_from is not None:
            self._settle_from = self._last_voice


class _Held:
    """A hop without inference (``VadSegmenter.both_streams`` False): the given stream's last probability."""

    def __init__(self, stream: SileroVad):
        self._stream = stream

    def probability(self, window: np.ndarray) -> float:
        return self._stream.last


class _Skipped:
    """A window at the room's noise floor (``VadSegmenter.skip_floor``): not run, scored 0.0
    (:meth:`SileroVad.skip`)."""

    def __init__(self, stream: SileroVad):
        self._stream = stream

    def probability(self, window: np.ndarray) -> float:
        return self._stream.skip(window)
