"""``appliance bench latency``: how fast the appliance knows a question has ended, and how fast a Pi 5 would
answer it, measured in the simulated room in real time.

Suite (fixed): questions of 1–6 s in three voices (Piper ``en_US-joe-medium``, espeak-ng ``en-us+f3`` and
``en-gb+m3``), some with a pause of 300–700 ms in the middle ("I was wondering, … what the capital of France
is."), and the two voice recordings of ``alsa-utils`` (``/usr/share/sounds/alsa``) when installed, each once
with no noise and once under room noise (a fan: pink noise at 20 dB under the voice). Each case is a fresh
session on the loaded parts; the question is asked 0.3 s in, and the case runs until the reply's first audio.

Ground truth: the room knows where the question's speech ends (its last sample above −40 dBFS).

- ``eot_detect_ms``: the true end of speech → the end-of-turn decision (``vad_end``), per case.
- ``premature_eot``: cases whose turn ended before the true end of speech (inside a mid-utterance pause).
- ``smart_turn_ms``: Smart Turn v3.2 per call, features included (``vad.end_of_turn: smart_turn``).
- ``audio_tokens_left_at_eot``: the tiny Gemma 4 fixture (it hears) listens beside whichever model answers:
  it is fed the confirmed utterance as the product's listener feeds its engine (every ``stream_step_ms``
  and at each pause) and ends its turn at the same ``vad_end``; this is the number of audio tokens its
  streamed turn still had to decode then.
- ``streamed_vs_whole``: on the fixture, offline, over the suite's questions in Piper's voice: the smallest
  per-token cosine similarity of streamed (windowed, with ``model.stream_left_context_ms`` of left context)
  vs whole-clip audio embeddings, and the largest absolute difference of the next-token logits after a
  streamed turn vs a whole-clip turn through the engine.
- ``pi5_projected_ttfa_ms``: per case, end of speech → first audio *projected* for Gemma 4 E2B on a Pi 5
  from what was measured here (the end-of-turn delay, the feed schedule, the audio left, the tokens the
  first piece waited for) and published or issue figures for the Pi (:data:`PI5`); the formula is written
  into the JSON. The engine's work while the user speaks is simulated at the Pi's speeds, feeds merged
  while it is busy, as :class:`~appliance.engine.EngineWorker` merges them, so a Pi that cannot keep up
  carries the backlog into the answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..audio.backends import open_port
from ..audio.files import MODEL_RATE, load_audio
from ..audio.room import RoomSpec, Scenario, ScriptedUtterance, synthetic_ir
from ..config import Config
from ..conversation import State
from ..events import Ev
from ..pipeline import Parts, Timeline, jsonable
from ..session import Session
from .interruption import USER_DBFS, AudioCache, active_dbfs, at_level
from . import FIXTURE_GGUF, FIXTURE_MMPROJ

ALSA = Path("/usr/share/sounds/alsa")
ALSA_RECORDINGS = ("Front_Center.wav", "Rear_Center.wav")
VOICES = ("joe", "en-us+f3", "en-gb+m3")
# (text segments, pauses between them in ms): 1-6 s of speech; three have a pause mid-utterance.
QUESTIONS: list[tuple[tuple[str, ...], tuple[int, ...]]] = [
    (("What time is it?",), ()),
    (("What is the capital of France?",), ()),
    (("How far away is the moon from the earth?",), ()),
    (("Can you tell me how a rainbow forms after the rain?",), ()),
    (("I was wondering,", "what the capital of France is."), (500,)),
    (("So the thing is,", "I need to know how long to boil an egg."), (700,)),
    (("What should I cook tonight", "if I only have rice, eggs and some spinach?"), (300,)),
    (("Could you explain to me why the sky looks blue during the day, but red and orange at sunset?",), ()),
]
QUICK = [0, 4]  # the quick run: a short question and one with a pause, Piper's voice, with and without noise
NOISE_SNR_DB = 20.0  # the fan's level under the user's voice
ONSET_S = 0.3

# The Pi 5 figures the projection uses (not measured here). Gemma 4 E2B Q4_K_M in llama.cpp on a Pi 5:
# prefill and generation speeds as published (potato-os/core docs/spikes/268-ik-llama-gemma4-benchmark.md);
# the audio encoder's cost per second of audio from the budget (0.6 s for a 3 s question); Piper's
# first clause from the issue's budget. AFTER_TOKENS: <audio|> <turn|> \n <|turn> model \n in Gemma 4's
# vocabulary (the fixture's tiny tokenizer splits "model" into 4 pieces).
PI5 = {"prefill_tok_s": 32.0, "gen_tok_s": 6.4, "encoder_s_per_audio_s": 0.2, "piper_first_piece_s": 0.2,
       "audio_tok_s": 25.0, "after_tokens": 6, "opening_tokens": 20}
FORMULA = ("ttfa = eot_detect (measured here: true end of speech -> end-of-turn decision) "
           "+ backlog (the Pi's streaming work still running at the decision: each feed the listener made here, "
           "at the time it made it, costs enc*(window s) + batch(new_tokens), feeds merged while busy; a feed at a "
           "pause also decodes its last token, redone if more audio follows) "
           "+ [tokens_left > 0] enc*(left_context + tokens_left*0.04 s) + batch(tokens_left + after_tokens) "
           "+ (first_piece_tokens - 1)/gen + piper_first_piece; "
           "batch(n) = max(n/prefill, 1/gen) (one llama_decode is no faster than one generation step); "
           "enc=0.2 s per audio s, prefill=32 tok/s, gen=6.4 tok/s, piper_first_piece=0.2 s, after_tokens=6 "
           "(Pi 5 figures: published llama.cpp speeds and the issue's budget); tokens_left, first_piece_tokens, "
           "the feed schedule and eot_detect measured here per case")


@dataclass
class Case:
    label: str
    audio: np.ndarray
    text: str
    noise: bool
    pauses_ms: tuple = ()
    seconds: float = 0.0


@dataclass
class Outcome:
    case: Case
    eot_detect_ms: Optional[float] = None
    premature: bool = False
    first_audio_ms: Optional[float] = None  # end of speech -> first audio, measured here (the model answering)
    tokens_left: list = field(default_factory=list)  # the fixture's, per turn it ended
    feeds: list = field(default_factory=list)  # (t s, samples, at a pause?) of each feed, session clock
    end_t: float = 0.0
    eot_t: Optional[float] = None
    eot_first_t: Optional[float] = None  # the first "complete" of the pause that ended the turn (offline only)
    final_samples: int = 0
    first_piece_tokens: Optional[int] = None
    prepared: bool = False  # the fixture's turn opening was in its cache before the question
    projected_ms: Optional[float] = None
    budget: dict = field(default_factory=dict)  # the projection's terms, ms
    whole_projected_ms: Optional[float] = None
    note: str = ""


def fan_noise(seconds: float = 4.0, seed: int = 3) -> np.ndarray:
    """A fan's noise: pink noise (1/f power, by filtering white noise in the frequency domain), float32."""
    rng = np.random.default_rng(seed)
    n = int(seconds * MODEL_RATE)
    spec = np.fft.rfft(rng.standard_normal(n))
    f = np.fft.rfftfreq(n, 1 / MODEL_RATE)
    spec[1:] /= np.sqrt(f[1:])
    spec[0] = 0
    x = np.fft.irfft(spec, n)
    return (x / np.sqrt(np.mean(x ** 2))).astype(np.float32)


def _trim(x: np.ndarray) -> np.ndarray:
    """``x`` without its leading and trailing silence (below −40 dBFS)."""
    idx = np.nonzero(np.abs(x) > 10 ** (-40 / 20))[0]
    return x[idx[0] : idx[-1] + 1] if len(idx) else x


def build_suite(cache: AudioCache, quick: bool = False) -> list[Case]:
    """Every case in the order they run."""
    cases = []
    questions = [QUESTIONS[i] for i in QUICK] if quick else QUESTIONS
    voices = VOICES[:1] if quick else VOICES
    for voice in voices:
        for segments, pauses in questions:
            parts = [_trim(cache.speech(s, voice)) for s in segments]
            audio = parts[0]
            for p, nxt in zip(pauses, parts[1:]):
                audio = np.concatenate([audio, np.zeros(int(p * MODEL_RATE / 1000), np.float32), nxt])
            audio = at_level(audio, USER_DBFS)
            text = " ".join(segments)
            for noise in (False, True):
                cases.append(Case(f"{voice} '{text[:34]}'" + (" +fan" if noise else ""), audio, text, noise, pauses,
                                  len(audio) / MODEL_RATE))
    if not quick:
        for name in ALSA_RECORDINGS:
            if (ALSA / name).is_file():
                audio = at_level(_trim(load_audio(ALSA / name)), USER_DBFS)
                text = name[:-4].replace("_", " ")
                for noise in (False, True):
                    cases.append(Case(f"alsa {name}" + (" +fan" if noise else ""), audio, text, noise, (),
                                      len(audio) / MODEL_RATE))
    return cases


class FixtureEar:
    """The tiny Gemma 4 (it hears) fed as the product feeds its engine, beside whichever model answers."""

    def __init__(self, left_context_s: float, final_at_pause: bool = True):
        from ..engine import Engine, EngineWorker

        self.engine = Engine(FIXTURE_GGUF, FIXTURE_MMPROJ, n_ctx=4096,
                             n_threads=1, max_reply_tokens=1, temperature=0.0, kv_cache_type="f16",
                             system_prompt="Be brief.", stream_prefill=True, stream_left_context_s=left_context_s,
                             stream_final_at_pause=final_at_pause)
        self.results: list[dict] = []
        self.worker = EngineWorker(self.engine, post=self._post, on_clause=lambda rid, text: None)
        self.worker.configure(context=None)  # prepares the next turn's opening while idle, as the product's does
        self._reply = 0

    def _post(self, name: str, **info) -> None:
        if name == "llm_done":
            self.results.append({**info, "stream_prepared": self.engine.last.stream_prepared})
            self.worker.commit(info["reply_id"], info.get("text", ""), complete=True)

    def turn(self, audio: np.ndarray) -> None:
        self._reply += 1
        self.worker.submit_turn(self._reply, audio, None)

    def reset(self) -> None:
        self.worker.sync()
        self.worker.call(self.engine.forget)
        self.worker.call(self.worker._prepare)
        self.worker.sync()
        self.results = []

    def stop(self) -> None:
        self.worker.stop()


def run_case(case: Case, parts: Parts, cfg: Config, ear: FixtureEar, noise: np.ndarray) -> Outcome:
    """One question in real time; the session runs until its reply's first audio (or 8 s after the question)."""
    parts.engine.forget()
    ear.reset()
    noise_db = active_dbfs(case.audio) - NOISE_SNR_DB
    spec = RoomSpec(echo_gain_db=-10.0, echo_delay_ms=30.0, impulse_response=synthetic_ir(150.0),
                    noise=noise * 10 ** (noise_db / 20) if case.noise else None, noise_gain_db=0.0)
    scenario = Scenario([ScriptedUtterance(case.audio, case.text, "question", at=ONSET_S)], spec)
    timeline = Timeline()
    hears = parts.engine.hears_audio
    port = open_port(cfg, MODEL_RATE, "room", scenario=scenario, on_event=timeline, paced=True)
    session = Session(cfg, parts, port, [timeline], transcript_at=None if hears else scenario.transcript_at)
    clock = port.clock
    out = Outcome(case)
    listener = session.listener
    product_stream, product_post = listener.stream, listener.post

    def listening() -> bool:
        return session.conversation.state is State.LISTENING

    def stream(pcm: np.ndarray, at_pause: bool = False) -> None:
        if listening():
            out.feeds.append((clock(), len(pcm), at_pause))
            ear.worker.stream_audio(pcm, at_pause)
        if product_stream is not None:
            product_stream(pcm, at_pause)

    def post(name, **info) -> None:
        if name == Ev.VAD_END and info.get("audio") is not None and listening():
            ear.turn(info["audio"])
            out.final_samples = len(info["audio"])
        product_post(name, **info)

    # The bench's taps, beside the product's: the ear hears every feed, and the final clip of each turn
    # (vad_end's audio is not in the conversation's records, so the listener's post is wrapped).
    listener.configure(stream=stream)
    listener.post = post
    room = port.room
    session.start()
    limit = ONSET_S + case.seconds + 8.0

    def until() -> bool:
        recs = timeline.records
        first = [r for r in recs if r["event"] == "tts_first_audio"]
        return bool(first) and room.n / MODEL_RATE >= first[0]["t"] + 0.2

    try:
        port.run(until, max_seconds=limit)
    finally:
        session.stop()
        ear.worker.sync()
    recs = list(timeline.records)
    speech = [r for r in recs if r["event"] == "user_speech"]
    if not speech:
        out.note = "the question never played"
        return out
    end_t = speech[0]["end_t"]
    out.end_t = end_t
    ends = [r["t"] for r in recs if r["event"] == "vad_end"]
    out.premature = any(t < end_t for t in ends)
    after = [t for t in ends if t >= end_t]
    if after:
        out.eot_t = after[0]
        out.eot_detect_ms = round((after[0] - end_t) * 1000.0, 1)
    else:
        out.note = "no end of turn after the speech"
    first = [r["t"] for r in recs if r["event"] == "tts_first_audio"]
    if first and first[0] >= end_t:
        out.first_audio_ms = round((first[0] - end_t) * 1000.0, 1)
    if first and parts.engine.last.first_piece_tokens:
        out.first_piece_tokens = int(parts.engine.last.first_piece_tokens)
    out.tokens_left = [r["audio_tokens_left"] for r in ear.results if r.get("audio_tokens_left") is not None]
    out.prepared = bool(ear.results) and bool(ear.results[0].get("stream_prepared"))
    return out


def project_pi5(out: Outcome, left_context_s: float, first_piece_tokens: int, pi: dict = PI5,
                final_at_pause: bool = False, early_start: bool = False) -> Optional[dict]:
    """End of speech → first audio on a Pi 5 for one case (*projected*; see :data:`FORMULA`): its terms in ms
    and their ``total``, or None when the case has no end of turn after its speech.

    ``out.feeds``: ``(t s, samples)`` or ``(t s, samples, at_pause)`` per feed. ``final_at_pause``: a feed
    made at a pause decodes its last token too (no hold-back, the clip ends there as the turn's would); a
    later feed rolls that token back and decodes it again (one token of pre-fill), and a turn whose clip is
    that feed's has no audio left (``model.stream_final_at_pause``). ``early_start``: the answer's work after
    the decision (the tail and the first piece) may start at ``out.eot_first_t``, the first "complete" of the
    pause that ended the turn, and its audio plays at the decision at the earliest (a what-if: not built)."""
    if out.eot_t is None or not out.final_samples:
        return None
    enc, pre, tok = pi["encoder_s_per_audio_s"], pi["prefill_tok_s"], 1.0 / pi["audio_tok_s"]

    def batch(n: int) -> float:  # one llama_decode of n tokens: no faster than one generation step
        return max(n / pre, 1.0 / pi["gen_tok_s"])

    left = int(round(left_context_s / tok))
    free, done, opened, i, whole = float("-inf"), 0, out.prepared, 0, None
    feeds = [f for f in out.feeds if f[0] <= out.eot_t]
    while i < len(feeds):
        start = max(free, feeds[i][0])
        while i + 1 < len(feeds) and feeds[i + 1][0] <= start:  # merged while the engine was busy
            i += 1
        n = feeds[i][1] // 640
        final = final_at_pause and len(feeds[i]) > 2 and bool(feeds[i][2])
        upto = n if final else n - 1
        if whole is not None and n > whole:  # the last feed's final token is rolled back and decoded again
            done, whole = whole - 1, None
        if upto > done:
            first = max(0, min(done, n - 1) - left)
            work = (0.0 if opened else pi["opening_tokens"] / pre) + enc * (n - first) * tok + batch(upto - done)
            opened, done, free = True, upto, start + work
            whole = n if final else None
        i += 1
    n_final = out.final_samples // 640
    if whole is not None and whole == n_final:  # the turn's clip is the one decoded whole at the pause
        tail_enc, tail_tokens = 0.0, 0
    else:
        done = min(done, max(0, n_final - 1), whole - 1 if whole is not None else done)  # a final token redone
        first = max(0, done - left)
        tail_enc, tail_tokens = enc * (n_final - first) * tok, n_final - done
    terms = {"eot_detect": out.eot_t - out.end_t, "backlog": max(0.0, free - out.eot_t),
             "tail_encoder": tail_enc,
             "tail_prefill": batch(tail_tokens + pi["after_tokens"]) + (0.0 if opened else pi["opening_tokens"] / pre),
             "first_piece": max(0, first_piece_tokens - 1) / pi["gen_tok_s"], "piper": pi["piper_first_piece_s"]}
    if early_start and out.eot_first_t is not None and out.eot_first_t < out.eot_t:
        work = terms["tail_encoder"] + terms["tail_prefill"] + terms["first_piece"] + terms["piper"]
        ready = max(out.eot_first_t, free) + work
        terms["early_start"] = -max(0.0, (out.eot_t + terms["backlog"] + work) - max(out.eot_t, ready))
    terms = {k: round(v * 1000.0, 1) for k, v in terms.items()}
    terms["total"] = round(sum(terms.values()), 1)
    return terms


def project_pi5_whole(out: Outcome, first_piece_tokens: int, pi: dict = PI5, silence_s: float = 0.5) -> float:
    """The same for the appliance before this work (*projected*): 500 ms of silence, then the whole clip
    encoded and pre-filled, then the same first piece and Piper."""
    n = out.final_samples // 640 or int(out.case.seconds * pi["audio_tok_s"])
    s = silence_s + pi["encoder_s_per_audio_s"] * n / pi["audio_tok_s"] \
        + (pi["opening_tokens"] + n + pi["after_tokens"]) / pi["prefill_tok_s"] \
        + max(0, first_piece_tokens - 1) / pi["gen_tok_s"] + pi["piper_first_piece_s"]
    return round(s * 1000.0, 1)


def streamed_vs_whole(questions: list[np.ndarray], left_context_s: float, step_s: float,
                      sweep: tuple = (0.0, 0.24, 0.48, 0.96, 1.92)) -> tuple[dict, list[dict]]:
    """Streamed vs whole-clip on the tiny Gemma 4, offline: the JSON's ``streamed_vs_whole`` at
    ``left_context_s``, and the same figures for each left context of ``sweep`` (printed)."""
    from ..audio_prefill import SAMPLES_PER_TOKEN, AudioEncoder
    from ..engine import Engine

    def engine(stream: bool, left: float) -> Engine:
        return Engine(FIXTURE_GGUF, FIXTURE_MMPROJ, n_ctx=2048, n_threads=2,
                      max_reply_tokens=1, temperature=0.0, kv_cache_type="f16", system_prompt="Be brief.",
                      stream_prefill=stream, stream_left_context_s=left)

    import llama_cpp

    def logits(e: Engine) -> np.ndarray:
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(e.llm.model))
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(e.llm.ctx, -1), shape=(n_vocab,)).copy()

    whole_e = engine(False, 0.0)
    encoder = AudioEncoder(whole_e.audio)
    step = int(step_s * MODEL_RATE)
    rows = []
    for left_s in sorted(set(sweep) | {left_context_s}):
        cos_min, diff_max, rel_max = 1.0, 0.0, 0.0
        stream_e = engine(True, left_s)
        left = int(round(left_s * 25))
        for q in questions:
            q = q[: len(q) // SAMPLES_PER_TOKEN * SAMPLES_PER_TOKEN]
            whole = encoder.encode(q)
            total, done, parts = len(q) // SAMPLES_PER_TOKEN, 0, []
            ends = [n // SAMPLES_PER_TOKEN for n in range(step, len(q), step)] + [total]
            for end in ends:
                upto = end if end == total else end - 1
                if upto <= done:
                    continue
                first = max(0, done - left)
                parts.append(encoder.encode(q[first * SAMPLES_PER_TOKEN : end * SAMPLES_PER_TOKEN])[done - first : upto - first])
                done = upto
            streamed = np.concatenate(parts)
            cos = np.sum(streamed * whole, axis=1) / (np.linalg.norm(streamed, axis=1) * np.linalg.norm(whole, axis=1))
            cos_min = min(cos_min, float(cos.min()))
            for n in range(step, len(q), step):
                stream_e.stream_audio(q[:n])
            it = stream_e.start_turn(q, None)  # the prompt is in the cache: its next-token logits are ready
            got, streamed_ok = logits(stream_e), stream_e.last.streamed
            list(it)
            stream_e.forget()
            it = whole_e.start_turn(q, None)
            want = logits(whole_e)
            list(it)
            whole_e.forget()
            if not streamed_ok:
                raise RuntimeError("the fixture's turn was not streamed: the comparison would be of two whole clips")
            diff_max = max(diff_max, float(np.max(np.abs(got - want))))
            rel_max = max(rel_max, float(np.max(np.abs(got - want)) / max(1e-9, np.max(np.abs(want)))))
        rows.append({"left_context_ms": round(left_s * 1000), "embd_cosine_min": round(cos_min, 6),
                     "logits_max_abs_diff": round(diff_max, 6), "logits_rel_diff": round(rel_max, 6)})
    chosen = next(r for r in rows if r["left_context_ms"] == round(left_context_s * 1000))
    return ({k: chosen[k] for k in ("embd_cosine_min", "logits_max_abs_diff", "left_context_ms")}, rows)


def measure_pi_figures(engine, tts, left_context_s: float = 0.48, step_s: float = 0.5, repeats: int = 3) -> dict:
    """The figures :data:`PI5` assumes, measured on this machine with ``engine`` (a model that hears) and
    ``tts`` (Piper), in :data:`PI5`'s keys, so that :func:`offline_eot` can project with them (``pi=``):

    - ``encoder_s_per_audio_s``: one streamed window (``left_context_s`` + ``step_s`` + 40 ms of noise-like
      audio) through the projector's encoder, s per audio s (median of ``repeats``);
    - ``prefill_tok_s``: a window's new audio embeddings (``step_s`` × 25) decoded in one batch, tokens/s;
    - ``gen_tok_s``: single-token decodes, tokens/s;
    - ``piper_first_piece_s``: Piper's time to the first audio of a three-word piece.

    Also ``tail_6_tokens_s`` (six template tokens in one batch: the end of a turn's pre-fill). The cache is
    left as it was (what is decoded here is rolled back). Runs on the caller's thread: use it while the
    appliance is not running.
    """
    import time

    from ..audio_prefill import SAMPLES_PER_TOKEN, AudioEncoder, decode_embeddings, decode_tokens

    def median_time(fn) -> float:
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    engine.drop_streamed_audio()
    llm, pos = engine.llm, engine.n_past
    rng = np.random.default_rng(0)
    window_s = left_context_s + step_s + 0.04
    pcm = (rng.standard_normal(int(window_s * MODEL_RATE)) * 0.05).astype(np.float32)
    pcm = pcm[: len(pcm) // SAMPLES_PER_TOKEN * SAMPLES_PER_TOKEN]
    encoder = AudioEncoder(engine.audio)
    embd = encoder.encode(pcm)
    enc_s = median_time(lambda: encoder.encode(pcm))
    new = embd[: int(round(step_s * 25))]

    def rollback() -> None:
        llm._ctx.kv_cache_seq_rm(0, pos, -1)
        llm.n_tokens = pos

    def prefill() -> None:
        decode_embeddings(llm, new, pos)
        rollback()

    tokens = llm.tokenize(b"the the the the the the", add_bos=False, special=False)[:6]

    def tail() -> None:
        decode_tokens(llm, tokens, pos)
        rollback()

    def one() -> None:
        decode_tokens(llm, tokens[:1], pos)
        rollback()

    try:
        pre_s, tail_s, gen_s = median_time(prefill), median_time(tail), median_time(one)
    finally:
        rollback()
    piper = median_time(lambda: next(iter(tts.synthesize("Paris, of course."))))
    return {"encoder_s_per_audio_s": round(enc_s / (len(pcm) / MODEL_RATE), 4),
            "prefill_tok_s": round(len(new) / pre_s, 2), "gen_tok_s": round(1.0 / gen_s, 2),
            "piper_first_piece_s": round(piper, 3), "tail_6_tokens_s": round(tail_s, 4),
            "audio_tok_s": 25.0, "after_tokens": PI5["after_tokens"], "opening_tokens": PI5["opening_tokens"]}


def pct(xs: list, q: float) -> Optional[float]:
    return round(float(np.percentile(xs, q)), 1) if xs else None


def summarise(outcomes: list[Outcome], smart_turn_ms: list[float], svw: dict) -> dict:
    """The JSON: exactly the issue's keys."""
    eot = [o.eot_detect_ms for o in outcomes if o.eot_detect_ms is not None]
    left = [x for o in outcomes for x in o.tokens_left]
    ttfa = [o.projected_ms for o in outcomes if o.projected_ms is not None and not o.premature]
    return {
        "eot_detect_ms": {"p50": pct(eot, 50), "p95": pct(eot, 95), "n": len(eot)},
        "premature_eot": {"count": sum(1 for o in outcomes if o.premature), "n": len(outcomes)},
        "audio_tokens_left_at_eot": {"p50": pct(left, 50), "p95": pct(left, 95)},
        "smart_turn_ms": {"p50": pct(smart_turn_ms, 50), "p95": pct(smart_turn_ms, 95)},
        "streamed_vs_whole": svw,
        "pi5_projected_ttfa_ms": {"p50": pct(ttfa, 50), "p95": pct(ttfa, 95), "formula": FORMULA},
    }


def run(cfg: Config, parts: Parts, json_path: Optional[Path], cache_dir: Path, quick: bool = False,
        print_line: Callable[[str], None] = print, limit: Optional[int] = None) -> dict:
    """Run the suite (its first ``limit`` cases, for a test); print a line per case, the left-context sweep
    and the before/after budgets; write the JSON."""
    cache = AudioCache(cache_dir, parts.tts)
    cases = build_suite(cache, quick)[:limit]
    left_s = cfg.model.stream_left_context_ms / 1000.0
    step_s = cfg.model.stream_step_ms / 1000.0
    print_line(f"{len(cases)} cases, in real time (about {int(sum(c.seconds + 2.5 for c in cases))} s)")
    final = cfg.model.stream_final_at_pause
    ear = FixtureEar(left_s, final)
    noise = fan_noise()
    eot_calls0 = len(parts.eot.infer_ms) if parts.eot is not None else 0
    outcomes = []
    try:
        for c in cases:
            o = run_case(c, parts, cfg, ear, noise)
            outcomes.append(o)
            print_line(f"{c.label[:48]:48} {c.seconds:4.1f}s eot_detect_ms={o.eot_detect_ms} premature={o.premature} "
                       f"first_audio_ms(here)={o.first_audio_ms} tokens_left={o.tokens_left} feeds={len(o.feeds)} "
                       f"first_piece_tokens={o.first_piece_tokens}" + (f" ({o.note})" if o.note else ""))
    finally:
        ear.stop()
    smart = list(parts.eot.infer_ms[eot_calls0:]) if parts.eot is not None else []
    pieces = [o.first_piece_tokens for o in outcomes if o.first_piece_tokens]
    k = int(np.median(pieces)) if pieces else 5
    for o in outcomes:
        o.budget = project_pi5(o, left_s, o.first_piece_tokens or k, final_at_pause=final) or {}
        o.projected_ms = o.budget.get("total")
        o.whole_projected_ms = project_pi5_whole(o, o.first_piece_tokens or k)
    for o in outcomes:
        print_line(f"{o.case.label[:48]:48} Pi 5 projected (ms): {o.budget} | whole clip: {o.whole_projected_ms}")
    questions = [c.audio for c in cases if not c.noise][:4]
    svw, sweep = streamed_vs_whole(questions, left_s, step_s)
    summary = summarise(outcomes, smart, svw)
    print_line("left context sweep (tiny Gemma 4, measured here): " + json.dumps(sweep))
    about3 = [o for o in outcomes if 2.0 <= o.case.seconds <= 4.0 and not o.premature]
    for name, os_ in (("all", [o for o in outcomes if not o.premature]), ("questions of 2-4 s", about3)):
        after = [o.projected_ms for o in os_ if o.projected_ms is not None]
        before = [o.whole_projected_ms for o in os_ if o.whole_projected_ms is not None]
        print_line(f"Pi 5 projected end of speech -> first audio, {name} (n {len(after)}): streamed + Smart Turn "
                   f"p50 {pct(after, 50)} / p95 {pct(after, 95)} ms; whole clip after 500 ms of silence "
                   f"p50 {pct(before, 50)} / p95 {pct(before, 95)} ms; first piece waited for {k} tokens (median)")
    for alt in sorted({0.48, 0.96, 1.92} - {left_s}):  # the same turns at another left context (same feeds)
        alt_ms = [b["total"] for o in outcomes if not o.premature
                  for b in [project_pi5(o, alt, o.first_piece_tokens or k, final_at_pause=final)] if b]
        print_line(f"Pi 5 projected with a left context of {alt * 1000:.0f} ms instead: p50 {pct(alt_ms, 50)} / "
                   f"p95 {pct(alt_ms, 95)} ms")
    text = json.dumps(summary, indent=2, default=jsonable)
    print_line(text)
    if json_path:
        Path(json_path).write_text(text + "\n", encoding="utf-8")
    return summary


def offline_eot(cases: list[Case], vad, end_of_turn: Optional[Callable[[np.ndarray], float]], settings: dict,
                noise: Optional[np.ndarray] = None, call_ms: float = 0.0, step_ms: int = 500,
                left_context_s: float = 0.48, first_piece_tokens: int = 5, pi: Optional[dict] = None,
                final_at_pause: bool = True, early_start: bool = False) -> dict:
    """End of turn, OFFLINE (not real time): each case's microphone signal (0.3 s of quiet, the question,
    2 s of quiet; the fan under it for ``+fan`` cases, as in the room) through a :class:`VadSegmenter` with
    the real Silero VAD and ``end_of_turn`` (Smart Turn's ``probability``, or None for the silence rule),
    the segmenter's own decision logic, with ``settings`` (its fields: ``short_stop_ms``,
    ``end_of_turn_threshold``, ``end_of_turn_confirm_ms``, ``max_silence_ms``, ...). The room's echo path
    is silent during a question and the echo canceller passes the near end through, so it is left out.

    The decision time is the end of the window that decided, plus ``call_ms`` per Smart Turn call that the
    decision waited for (the last one; 0: the model's time left out). Returns ``premature_eot``
    ({count, n}), ``eot_detect_ms`` ({p50, p95, n}, from the true end of speech, its last sample above
    −40 dBFS), ``premature`` (the labels), ``calls`` (Smart Turn calls in all) and
    ``pi5_projected_ttfa_ms`` ({p50, p95, n, p50_2_4s}, *projected* with :func:`project_pi5`, over the
    cases not ended early): the feeds are made by the listener's rule (``pipeline.Listener._feed_stream``:
    every ``step_ms`` of new confirmed speech and at each pause of 96 ms, with the decision's clock), the
    turn opening was prepared while idle, no audio token is left at the end of the turn beyond what the
    last feed left (as measured in real time: 1), and the first piece waits for ``first_piece_tokens``;
    ``pi``: the Pi 5 figures (default :data:`PI5`).
    """
    from ..audio.room import first_above
    from ..vad import VadSegmenter

    noise = fan_noise() if noise is None else noise
    premature, detect, calls, ttfa = [], [], 0, []
    for c in cases:
        vad.reset()
        seg = VadSegmenter(vad)
        for k, v in settings.items():
            setattr(seg, k, v)
        seg.use_end_of_turn(end_of_turn)
        x = np.concatenate([np.zeros(int(ONSET_S * MODEL_RATE), np.float32), c.audio, np.zeros(2 * MODEL_RATE, np.float32)])
        if c.noise:
            level = 10 ** ((active_dbfs(c.audio) - NOISE_SNR_DB) / 20)
            x = x + (noise[np.arange(len(x)) % len(noise)] * level).astype(np.float32)
        true_end = ONSET_S + (len(c.audio) - max(0, first_above(c.audio[::-1], -40.0))) / MODEL_RATE
        ends, feeds, fed, final, firsts, first_t = [], [], 0, 0, {}, None
        step = step_ms * MODEL_RATE // 1000
        for i in range(0, len(x), 512):
            for ev in seg.push(x[i : i + 512]):
                if ev.kind == "end":
                    ends.append(seg._n / MODEL_RATE + (call_ms / 1000.0 if ev.eot_prob is not None else 0.0))
                    if not final and ev.eot_prob is not None:
                        first_t = firsts.get(seg._last_voice)
                    final = final or len(ev.audio)
            asked = seg._eot_asked  # a first "complete" waiting for its confirming call: when it was known
            if asked is not None and not asked[2] and asked[0] not in firsts:
                firsts[asked[0]] = seg._n / MODEL_RATE + call_ms / 1000.0
            if not seg.confirmed:
                fed = 0
                continue
            n = seg.utterance_samples()
            if n - fed >= step or (n > fed and seg.silence_ms >= 96):
                fed = n
                feeds.append((seg._n / MODEL_RATE, n, seg.silence_ms >= 96))
        calls += len(seg.eot_calls)
        if any(t < true_end for t in ends):
            premature.append(c.label)
        after = [t for t in ends if t >= true_end]
        if after:
            detect.append((after[0] - true_end) * 1000.0)
            if not any(t < true_end for t in ends):
                o = Outcome(c, eot_t=after[0], end_t=true_end, final_samples=final, prepared=True, feeds=feeds,
                            eot_first_t=first_t)
                b = project_pi5(o, left_context_s, first_piece_tokens, pi or PI5, final_at_pause, early_start)
                if b:
                    ttfa.append((c.seconds, b["total"], b))
    about3 = [b for s_, _, b in ttfa if 2.0 <= s_ <= 4.0]
    return {"premature_eot": {"count": len(premature), "n": len(cases)},
            "eot_detect_ms": {"p50": pct(detect, 50), "p95": pct(detect, 95), "n": len(detect)},
            "premature": premature, "calls": calls,
            "pi5_projected_ttfa_ms": {"p50": pct([t for _, t, _ in ttfa], 50), "p95": pct([t for _, t, _ in ttfa], 95),
                                      "n": len(ttfa), "p50_2_4s": pct([b["total"] for b in about3], 50),
                                      "terms_p50_2_4s": {k: pct([b.get(k, 0.0) for b in about3], 50)
                                                         for k in dict.fromkeys(k for b in about3 for k in b)}}}


# The levers docs/latency.md reports (offline, appliance bench latency --offline): segmenter fields.
OFFLINE_LEVERS: list[tuple[str, dict]] = [
    ("one call at 200 ms, max silence 1500 ms (before)", {"end_of_turn_confirm_ms": 0, "max_silence_ms": 1500}),
    ("one call at 150 ms", {"short_stop_ms": 150, "end_of_turn_confirm_ms": 0}),
    ("one call at 400 ms", {"short_stop_ms": 400, "end_of_turn_confirm_ms": 0}),
    ("one call at 200 ms, threshold 0.9", {"end_of_turn_threshold": 0.9, "end_of_turn_confirm_ms": 0}),
    ("200 ms, confirmed at 300 ms (default)", {}),
    ("200 ms, confirmed at 400 ms", {"end_of_turn_confirm_ms": 400}),
    ("150 ms, confirmed at 300 ms", {"short_stop_ms": 150, "end_of_turn_confirm_ms": 300}),
    ("200 ms, confirmed at 300 ms, max silence 1500 ms", {"max_silence_ms": 1500}),
    ("speech only heard, one call at 200 ms", {"end_of_turn_input": "speech", "end_of_turn_confirm_ms": 0}),
    ("speech only heard, one call at 100 ms", {"end_of_turn_input": "speech", "short_stop_ms": 100,
                                               "end_of_turn_confirm_ms": 0}),
    ("speech only heard, one call at 300 ms", {"end_of_turn_input": "speech", "short_stop_ms": 300,
                                               "end_of_turn_confirm_ms": 0}),
    ("silence rule 500 ms (no model)", {"_silence": True, "min_silence_ms": 500}),
    ("silence rule 800 ms (no model)", {"_silence": True, "min_silence_ms": 800}),
]


# (name, offline_eot keywords): the streaming levers, projected for a Pi 5 over the same turns.
PROJECTION_LEVERS: list[tuple[str, dict]] = [
    ("left 480, step 500, 4 tokens, last token held back (before)", {"first_piece_tokens": 4, "final_at_pause": False}),
    ("left 480, step 500, 4 tokens, final at a pause (now)", {"first_piece_tokens": 4}),
    ("  + step 200 ms", {"first_piece_tokens": 4, "step_ms": 200}),
    ("  + step 1000 ms", {"first_piece_tokens": 4, "step_ms": 1000}),
    ("  + left 320 ms", {"first_piece_tokens": 4, "left_context_s": 0.32}),
    ("  + first piece 3 tokens", {"first_piece_tokens": 3}),
    ("  + answer started at the first 'complete'", {"first_piece_tokens": 4, "early_start": True}),
    # What the Pi would have to do (the published 32 tok/s decides the backlog):
    ("  + encoder 0.1 s per audio s", {"first_piece_tokens": 4, "pi": {**PI5, "encoder_s_per_audio_s": 0.1}}),
    ("  + prefill 48 tok/s", {"first_piece_tokens": 4, "pi": {**PI5, "prefill_tok_s": 48.0}}),
    ("  + prefill 64 tok/s", {"first_piece_tokens": 4, "pi": {**PI5, "prefill_tok_s": 64.0}}),
    ("  + prefill 64 tok/s, answer started at the first 'complete'",
     {"first_piece_tokens": 4, "early_start": True, "pi": {**PI5, "prefill_tok_s": 64.0}}),
    ("  + prefill 44 tok/s, first piece 3 tokens", {"first_piece_tokens": 3, "pi": {**PI5, "prefill_tok_s": 44.0}}),
]


def offline_main(argv: Optional[list] = None) -> int:
    """``appliance bench latency --offline`` (or ``python -m appliance.bench.latency --offline [--cache DIR]
    [--call-ms MS]``): the end-of-turn levers
    over the suite, offline, one line each (seconds per lever, not real time)."""
    import argparse

    from ..eot import SmartTurn
    from ..vad import SileroVad
    from .interruption import AudioCache

    ap = argparse.ArgumentParser(prog="python -m appliance.bench.latency")
    ap.add_argument("--offline", action="store_true", required=True, help="required: this entry point is offline only")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "appliance" / "bench-audio"),
                    help="the bench's speech cache (what is missing is generated with Piper and espeak-ng)")
    ap.add_argument("--call-ms", type=float, default=0.0, help="Smart Turn's time per call to add, ms")
    args = ap.parse_args(argv)

    from ..speech import Tts

    cases = build_suite(AudioCache(Path(args.cache), Tts()))  # Piper's bundled voice, for what is not cached
    vad, smart = SileroVad(), SmartTurn()

    def line(name: str, r: dict) -> str:
        t = r["pi5_projected_ttfa_ms"]
        return (f"{name:44} premature {r['premature_eot']['count']}/{r['premature_eot']['n']}  eot_detect_ms p50 "
                f"{r['eot_detect_ms']['p50']} p95 {r['eot_detect_ms']['p95']}  calls {r['calls']}  Pi 5 projected "
                f"p50 {t['p50']} (2-4 s: {t['p50_2_4s']}) p95 {t['p95']}  premature: {'; '.join(r['premature'])}")

    print("End-of-turn levers (projection: left context 480 ms, step 500 ms, final at a pause, first piece "
          "5 tokens):", flush=True)
    for name, settings in OFFLINE_LEVERS:
        settings = dict(settings)
        silence = settings.pop("_silence", False)
        r = offline_eot(cases, vad, None if silence else smart.probability, settings, call_ms=args.call_ms)
        print(line(name, r), flush=True)
    print("Projection levers (the default end of turn; p50 of each term for questions of 2-4 s):", flush=True)
    for name, kw in PROJECTION_LEVERS:
        r = offline_eot(cases, vad, smart.probability, {}, call_ms=args.call_ms, **kw)
        print(line(name, r), flush=True)
        print(f"{'':44} terms {json.dumps(r['pi5_projected_ttfa_ms']['terms_p50_2_4s'])}", flush=True)
    return 0

if __name__ == "__main__":
    import sys

    sys.exit(offline_main())
