"""Turn taking: is speech heard while the appliance talks a barge-in or a backchannel?

Pause first, decide second: the state machine has already paused playback on the first VAD onset; this
module only decides what happens next. The rule is:

- speech longer than ``backchannel_max_ms`` is an interruption, decided as soon as the limit is passed;
- a shorter interjection is handed to a pluggable :class:`BackchannelClassifier` working from the audio:
  a stop word ("stop", "wait", "no", …) flushes however short it is, a backchannel ("uh-huh", "yeah",
  "okay", …) resumes; when the classifier has no verdict, short speech resumes.

The default classifier, :class:`KeywordClassifier`, decodes the interjection with PocketSphinx (the PyPI
package ``pocketsphinx`` bundles its US English acoustic model and dictionary) against a JSGF grammar of
the stop words and backchannels plus two filler words for noise and unknown speech.
"""

from __future__ import annotations

import enum
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Protocol

import numpy as np

from .audio.files import MODEL_RATE
from .errors import UserError


class BargeInDecision(str, enum.Enum):
    WAIT = "wait"  # not decided yet: stay paused
    INTERRUPT = "interrupt"  # flush the reply, the speech is the next user turn
    RESUME = "resume"  # a backchannel or a noise: continue where playback paused


# Words that only acknowledge (from the backchannel literature's common English tokens, e.g. Ward & Tsukahara
# 2000, "Prosodic features which cue back-channel responses in English and Japanese").
BACKCHANNEL_WORDS = {"uh-huh", "uhhuh", "mhm", "mm-hmm", "mmhmm", "hmm", "yeah", "yes", "yep", "right", "okay",
                     "ok", "sure", "i see", "got it", "alright", "cool", "wow", "oh", "ah", "nice"}
# Words that want the floor, however short.
STOP_WORDS = {"stop", "wait", "no", "hold on", "hang on", "shut up", "quiet", "pause", "cancel", "enough",
              "actually", "but", "sorry", "excuse me", "never mind", "never", "be quiet", "that's enough"}
# The stop words that are a whole command when nothing follows them: "Stop." wants silence, not an answer
# (``interruption.stop_words_only_silence``). "Actually", "sorry", "excuse me" and "no actually" want the
# floor, so they are not among them: said alone they still become a turn and get an answer.
STOP_COMMANDS = {"stop", "stop it", "wait", "wait stop", "hold on", "hang on", "cancel", "pause", "no", "no no",
                 "quiet", "be quiet", "never mind", "never", "that's enough", "enough", "shut up", "stop talking"}
# ("never": the forward search's partial path through "never mind", the only way the classifier hears it
# alone: espeak-ng en-gb's "Never mind." came back as "never" in 2 of 12 captures, measured here.)


class BackchannelClassifier(Protocol):
    def classify(self, audio: Optional[np.ndarray], transcript: Optional[str]) -> Optional[BargeInDecision]:
        """Return INTERRUPT or RESUME if sure, None to leave it to the duration rule.

        :param audio: the interjection, float32 mono 16 kHz (VAD lead-in included), or None.
        :param transcript: a known transcript (scenarios only), or None.
        """


class WordListClassifier:
    """Decides from a transcript of the interjection, when one is known (a scenario's ``text``).

    For unit tests of the state machine only: the appliance never has a transcript of what it hears
    (Gemma hears audio directly), so the appliance uses :class:`KeywordClassifier`.
    """

    def classify(self, audio: Optional[np.ndarray], transcript: Optional[str]) -> Optional[BargeInDecision]:
        if not transcript:
            return None
        return _decide_words(transcript)


def _decide_words(text: str) -> Optional[BargeInDecision]:
    text = re.sub(r"[^a-z' -]", " ", text.lower())
    text = re.sub(r"\s+", " ", text).strip()
    if any(re.search(rf"\b{re.escape(w)}\b", text) for w in STOP_WORDS):
        return BargeInDecision.INTERRUPT
    words = text.split()
    rest = text
    for w in sorted(BACKCHANNEL_WORDS, key=len, reverse=True):
        rest = re.sub(rf"\b{re.escape(w)}\b", " ", rest)
    if words and not rest.strip():
        return BargeInDecision.RESUME
    return None


# The grammar the keyword classifier decodes against. Every word must be in PocketSphinx's bundled
# cmudict-en-us.dict (or be added in KeywordClassifier.EXTRA_WORDS). Left out because PocketSphinx confused
# them with the other class (measured here): "enough" (Piper's "Mm-hmm." heard as it), "got it" (Piper's
# "Stop." heard as "got") and "shut up" (the espeak-ng and Piper "Uh-huh." heard as it, in 4 of 27 echo-path
# captures).
_STOP_PHRASES = ["stop", "stop it", "wait", "wait stop", "no", "no actually", "no no", "hold on", "hang on",
                 "cancel", "actually", "pause", "sorry", "excuse me", "be quiet", "never mind", "that's enough"]
_BACK_PHRASES = ["uh-huh", "mm-hmm", "mhm", "hmm", "mm", "uh", "oh", "yeah", "yes", "yep", "right", "okay",
                 "ok", "i see", "sure", "alright", "cool"]
_FILLERS = ["noiseword", "speechword"]  # +NSN+ and +SPN+: a noise, and speech that is none of the above


DITHER_LSB = 2  # ± this many 16-bit steps of uniform noise (see KeywordClassifier)
DITHER_SEED = 0
# A stop word heard by the first of these decodes of the interjection flushes unless another hears a backchannel:
# (dither seed, samples dropped at its start: 80 = 5 ms, half of the front end's 10 ms frame shift). See
# KeywordClassifier.
AGREEMENT = ((DITHER_SEED, 0), (1, 0), (DITHER_SEED, 80), (1, 80))


class KeywordClassifier:
    """Stop word or backchannel, from the audio, with PocketSphinx and a JSGF grammar.

    Built lazily on first use (loading its two decoders takes about 0.6 s, measured here) or by
    :meth:`load`. Thread-safe (the decoders behind one lock). ``costs_ms`` keeps the compute time of every
    call (measured here on x86_64: 5–30 ms per interjection of 0.3–1.5 s).

    :param max_s: only the first ``max_s`` seconds of an interjection are decoded (cost bound).
    :param skip_s: seconds skipped at the start of the audio (the VAD's lead-in: 160 ms before the onset
        window, :class:`~appliance.vad.VadSegmenter`). The appliance skips nothing (:data:`LEAD_IN_SKIP_S`).
    :raises UserError: ``pocketsphinx`` is not installed.

    Every call decodes independently of the ones before, so a given interjection always gets the same
    verdict. PocketSphinx carries two kinds of state across utterances: its noise estimate (``-remove_noise``,
    turned off here; the canceller already removed the echo) and the generator of its ``-dither``. So the
    dither is ours: ±2 LSB of uniform noise added to the 16-bit samples, from a generator seeded afresh
    on every call. Without any dither the canceller's runs of exact digital silence (the cancelled echo
    rounds to zero; a paused reply leaves nothing to cancel) collapse the front end's log energy, and the
    search ends on the silence path with no word at all. Leading and trailing silence is cut to 0.2 s
    first (:func:`trim_silence`).

    When the lattice's best path reaches no final state (it returns nothing), the same audio goes through
    a second decoder with the same grammar that keeps the forward search's best hypothesis
    (``bestpath=False``). Measured here on interjections captured offline through the simulated room's
    echo path and the canceller (3 voices × 3 replies × 3 positions; 4 stop words, 5 backchannels; about
    7 % came back empty from the lattice, mostly espeak-ng en-gb "Okay." and "Hold on."):

    ==================================  ====================  ======================
    decoder                             stop words missed     backchannels flushed
    ==================================  ====================  ======================
    lattice only, echo 0 dB             5/108                 2/135
    lattice only, echo +6 dB            5/108                 6/135
    with the fallback, echo 0 dB        0/108                 2/135
    with the fallback, echo +6 dB       2/108                 6/135
    ==================================  ====================  ======================

    An earlier set (216 captures, 3 stop words, echo 0 dB) compared front ends: PocketSphinx's own dither
    with noise removal missed 3–4/81 stop words and flushed 5–9/135 backchannels, depending on what it had
    decoded before; no dither and no noise removal, 9/81 and 2/135; this dither, 1/81 and 1–4/135 over 4
    seeds. The backchannels still flushed are Piper's "Uh-huh.", which its phone decoding hears as "oh",
    "aw n" or "d eh p" and the grammar as "no". Cost per interjection p50/p95 13/27 ms.

    **A stop word must not be heard as a backchannel too.** On Piper's one-syllable "Uh-huh." under echo the
    verdict is marginal: the same capture came back as "no" for some dither seeds and as "uh" or "mm-hmm"
    for others. A stop word flushes the reply, which nothing brings back, while a stop word taken for a
    backchannel only lets the reply go on until the user says more. So a stop word heard by the first
    decode flushes unless one of three more decodes of :data:`AGREEMENT` (another dither seed; the audio 5 ms
    later, which moves the 10 ms frame grid by half a frame) hears a phrase of the grammar's backchannels
    ("uh", "mm", "hmm" and "oh" included); then there is no verdict, and the duration rule resumes short
    speech. A backchannel or nothing on the first decode ends the call there, so the extra decodes cost only
    where the reply is already paused for a stop word. A decode that hears other words or a noise does not
    hold a stop word back: a run that asked three of four to hear the stop word missed a clipping speaker's
    "Stop." heard as "stop it" twice and "that's" twice (a partial "that's enough", which Piper's "Uh-huh."
    gives as often). Measured here, offline: on the 540 captures of ``tools/classifier-eval`` (3 voices,
    echo 0 and +6 dB) backchannels flushed 10 -> 2 of 300 and stop words missed 1 -> 1 of 240; on the
    interjections of three runs of the simulated bench's backchannels and short stops, 2 -> 0 of 46 and 0 -> 0
    of 64. The decodes' variety is what matters, not these four: over all 455 sets of four of sixteen
    decodes (seeds 0-3, shifts 0, 40, 80 and 120 samples) that include the first, asking all four to hear
    the stop word flushed 1-6 (2 or 3 in most) and missed 1-2 on classifier-eval's captures.
    """

    # The backchannels' other common realisations (nasalised "unh-hunh", an open or rounded vowel, a vowel
    # between the m's), as alternative pronunciations: with cmudict's one each, PocketSphinx took Piper's
    # "Mm-hmm." for "never mind" and its "Uh-huh." for "no" or "stop it". Measured here, offline, on 432
    # interjections captured through the simulated room, the canceller and the segmenter (3 voices; 6
    # stop words and 6 backchannels; echo at 0 and +6 dB; 6 positions), with "never" below: backchannels
    # flushed 8 -> 3 of 216, stop words missed 12 -> 11 of 216, every one now espeak-ng en-gb's "That's
    # enough." (heard as "i see", "oh" or "mm-hmm": 10 of its 12 captures missed before, 11 now).
    EXTRA_WORDS = {"noiseword": "+NSN+", "speechword": "+SPN+", "mm-hmm": "M HH M", "ok": "OW K EY",
                   "uh-huh(2)": "AH HH AH N", "uh-huh(3)": "AA HH AA", "uh-huh(4)": "OW HH OW",
                   "mm-hmm(2)": "AH M HH M", "mm-hmm(3)": "M AH M", "mhm(2)": "M HH M M"}

    def __init__(self, max_s: float = 2.0, skip_s: float = 0.0):
        self.max_s = max_s
        self.skip_s = skip_s
        self._decoder = None
        self._fallback = None  # the same grammar, forward search only (see the class notes)
        self._lock = threading.Lock()
        self.costs_ms: list[float] = []
        self.last: Optional[str] = None  # the last hypothesis, for the timeline

    def load(self) -> "KeywordClassifier":
        with self._lock:
            if self._decoder is None:
                self._decoder = self._build(bestpath=True)
                self._fallback = self._build(bestpath=False)
        return self

    @staticmethod
    def grammar() -> str:
        stop = " | ".join(_STOP_PHRASES)
        back = " | ".join(_BACK_PHRASES)
        other = " | ".join(_FILLERS)
        return ("#JSGF V1.0;\ngrammar bargein;\npublic <utt> = <stop> | <back> | <other>;\n"
                f"<stop> = {stop};\n<back> = {back};\n<other> = {other};\n")

    def _build(self, bestpath: bool):
        try:
            import pocketsphinx as ps
        except ImportError:
            raise UserError("interruption.classifier is keywords but `pocketsphinx` is not installed; run "
                            "`pip install pocketsphinx` (or `make venv`), or set interruption.classifier: duration") from None
        import os

        model = ps.get_model_path()
        ps.set_loglevel("FATAL")
        dec = ps.Decoder(hmm=os.path.join(model, "en-us", "en-us"), dict=os.path.join(model, "en-us", "cmudict-en-us.dict"),
                         samprate=MODEL_RATE, loglevel="FATAL", dither=False, bestpath=bestpath)
        # The acoustic model's feat.params override these two at construction, hence the re-init.
        dec.config["remove_noise"] = False
        dec.config["cmn"] = "batch"
        dec.reinit_feat()
        for word, phones in self.EXTRA_WORDS.items():
            if dec.lookup_word(word) is None:
                dec.add_word(word, phones, False)
        dec.add_jsgf_string("bargein", self.grammar())
        dec.activate_search("bargein")
        return dec

    def hypothesis(self, audio: np.ndarray, seed: int = DITHER_SEED, shift: int = 0) -> str:
        """The decoded words (grammar phrases or fillers), "" when the decoder reached no final state.

        :param audio: float32 mono 16 kHz.
        :param seed: the dither's seed.
        :param shift: samples dropped after the silence is trimmed (moves the front end's frame grid).
        """
        self.load()
        skip = int(self.skip_s * MODEL_RATE)
        audio = np.asarray(audio, dtype=np.float32)
        if len(audio) - skip >= 1600:
            audio = audio[skip:]
        audio = trim_silence(audio)[shift:]
        pcm = np.round(np.clip(audio[: int(self.max_s * MODEL_RATE)], -1.0, 1.0) * 32767.0).astype(np.int32)
        pcm += np.random.default_rng(seed).integers(-DITHER_LSB, DITHER_LSB + 1, len(pcm))
        data = np.clip(pcm, -32768, 32767).astype(np.int16).tobytes()
        with self._lock:
            text = _decode(self._decoder, data)
            if not text:  # the lattice reached no final state: take the forward search's best path
                text = _decode(self._fallback, data)
        return text

    def classify(self, audio: Optional[np.ndarray], transcript: Optional[str] = None) -> Optional[BargeInDecision]:
        """What the first decode of :data:`AGREEMENT` hears: INTERRUPT (a stop word, unless another decode hears
        a backchannel: then None), RESUME (a backchannel) or None (fillers only, or other words). ``last``
        becomes the first decode's words; ``costs_ms`` gains the call's compute time, all its decodes, in ms."""
        if audio is None or len(audio) < 1600:  # under 100 ms: nothing to decode
            return None
        t0 = time.perf_counter()
        first, backchannel = None, False
        for i, (seed, shift) in enumerate(AGREEMENT):
            text = self.hypothesis(audio, seed, shift)
            words = " ".join(w for w in text.split() if w not in _FILLERS)
            if i == 0:
                self.last = text
                first = _decide_words(words) if words else None
                if first != BargeInDecision.INTERRUPT:
                    break
            elif words and (words in _BACK_PHRASES or _decide_words(words) == BargeInDecision.RESUME):
                backchannel = True
                break
        self.costs_ms.append((time.perf_counter() - t0) * 1000.0)
        if len(self.costs_ms) > 4096:
            del self.costs_ms[:2048]
        return None if backchannel else first


SILENCE_DBFS = -60.0  # samples below this are silence for trim_silence
KEEP_SILENCE_S = 0.2


def trim_silence(audio: np.ndarray, keep_s: float = KEEP_SILENCE_S) -> np.ndarray:
    """Shorten leading and trailing silence (every sample under :data:`SILENCE_DBFS`) to ``keep_s``.

    The decoder normalises the cepstrum by the whole utterance's mean (``-cmn batch``), and half a second
    of the canceller's digital silence on each side shifts that mean enough to turn espeak-ng en-gb "No."
    into "oh" (measured here).

    :param audio: float32 mono 16 kHz.
    :returns: a view of ``audio`` (the whole of it when nothing is above the level).
    """
    loud = np.flatnonzero(np.abs(audio) > 10.0 ** (SILENCE_DBFS / 20.0))
    if len(loud) == 0:
        return audio
    keep = int(keep_s * MODEL_RATE)
    return audio[max(0, loud[0] - keep): loud[-1] + 1 + keep]


def _decode(dec, pcm: bytes) -> str:
    """One whole utterance (16-bit mono 16 kHz PCM) through a PocketSphinx decoder: its words, or ""."""
    dec.start_utt()
    dec.process_raw(pcm, full_utt=True)
    dec.end_utt()
    hyp = dec.hyp()
    return hyp.hypstr if hyp is not None else ""


MIN_STOP_SPEECH_MS = 128.0  # a stop word heard in less speech than this does not flush the reply. Measured here
#   (session 24, the JACK room's full suite, 4 runs): the stop commands that flushed held 192-400 ms of speech; a door
#   slam's 80 ms burst, heard by PocketSphinx as "pause", flushed the reply it interrupted.


@dataclass
class TurnTaker:
    """Duration rule plus a pluggable classifier.

    :param backchannel_max_ms: speech longer than this (ms) is an interruption, decided as soon as it is
        exceeded, not at its end.
    :param classifier: decides short interjections from their audio; None = the duration rule alone
        (short speech always resumes, so a short "Stop." would not stop the reply).
    """

    backchannel_max_ms: float = 700.0
    classifier: Optional[BackchannelClassifier] = None
    verdicts: list = field(default_factory=list)  # (speech_ms, verdict, hypothesis) of every decision

    def during(self, speech_ms: float, audio: Optional[np.ndarray]) -> BargeInDecision:
        return BargeInDecision.INTERRUPT if speech_ms >= self.backchannel_max_ms else BargeInDecision.WAIT

    def at_end(self, speech_ms: float, audio: Optional[np.ndarray], transcript: Optional[str]) -> BargeInDecision:
        """The interjection is over: INTERRUPT (long speech, or a stop word heard in at least
        ``MIN_STOP_SPEECH_MS`` of speech) or RESUME (anything else: a backchannel, a noise, nothing heard).

        :param speech_ms: the interjection's speech, ms (the VAD's windows over its threshold).
        :param audio: float32 mono 16 kHz, or None. :param transcript: a transcript if one exists, or None.
        """
        if speech_ms >= self.backchannel_max_ms:
            decision = BargeInDecision.INTERRUPT
        else:
            verdict = self.classifier.classify(audio, transcript) if self.classifier is not None else None
            if verdict == BargeInDecision.INTERRUPT and speech_ms < MIN_STOP_SPEECH_MS:
                verdict = None  # a word needs more speech than that: a noise the classifier took for one
            decision = verdict if verdict is not None else BargeInDecision.RESUME
        self.verdicts.append((round(speech_ms, 1), decision.value, getattr(self.classifier, "last", None)))
        del self.verdicts[:-256]
        return decision

    @property
    def hypothesis(self) -> Optional[str]:
        """What the classifier heard last (for the timeline), if it says."""
        return getattr(self.classifier, "last", None)

    def last_was_stop_command(self) -> bool:
        """The last :meth:`at_end` flushed because the classifier heard a stop command alone ("Stop.",
        "Wait, stop.", "Never mind."), not because the speech was long. False without a classifier."""
        if not self.verdicts:
            return False
        speech_ms, verdict, heard = self.verdicts[-1]
        return (verdict == BargeInDecision.INTERRUPT.value and speech_ms < self.backchannel_max_ms
                and is_stop_command(heard))

    def stop_command(self, speech_ms: float, audio: Optional[np.ndarray]) -> Optional[bool]:
        """Whether short speech that followed a held stop word is a stop command too ("Wait," … "stop."):
        True, False (other words: the utterance is a question), or None (a noise, nothing heard).

        :param speech_ms: the speech's length, ms; as long as ``backchannel_max_ms`` or more is never a
            stop command.
        :param audio: float32 mono 16 kHz, or None.
        """
        if speech_ms >= self.backchannel_max_ms:
            return False
        hypothesis = getattr(self.classifier, "hypothesis", None)
        if audio is None or hypothesis is None or len(audio) < 1600:
            return None
        heard = hypothesis(audio)
        words = " ".join(w for w in heard.split() if w != "noiseword")
        if not words:
            return None
        return is_stop_command(words)


def is_stop_command(heard: Optional[str]) -> bool:
    """``heard`` (a keyword-classifier hypothesis) is one of :data:`STOP_COMMANDS` and nothing else."""
    if not heard:
        return False
    words = " ".join(w for w in heard.lower().split() if w not in _FILLERS)
    return words in STOP_COMMANDS


LEAD_IN_SKIP_S = 0.0  # of the VAD's lead-in (see KeywordClassifier's skip_s and its measurements)
_shared: Optional[KeywordClassifier] = None
_shared_lock = threading.Lock()


def shared_keyword_classifier() -> KeywordClassifier:
    """One loaded :class:`KeywordClassifier` per process (loading takes about 0.6 s, measured here; it
    must not happen during the first interjection)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = KeywordClassifier(skip_s=LEAD_IN_SKIP_S).load()
        return _shared


def turn_taker_from_config(cfg) -> TurnTaker:
    """The turn taker ``config.interruption`` describes (``classifier``: ``keywords`` or ``duration``).

    :raises UserError: ``keywords`` without the ``pocketsphinx`` package.
    """
    ic = cfg.interruption
    kind = getattr(ic, "classifier", "keywords")
    classifier = shared_keyword_classifier() if kind == "keywords" else None
    return TurnTaker(float(ic.backchannel_max_ms), classifier)
