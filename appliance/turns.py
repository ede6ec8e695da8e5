"""Turn taking: is speech heard while the appliance talks a barge-in or a backchannel?

Pause first, decide second: the state machine has already paused playback on the first VAD onset; this
module only decides what happens next. The decision is pluggable (:class:`BackchannelClassifier`); the
default is a duration rule plus, where a transcript of the interjection is known, a word list.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np


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
              "actually", "but", "sorry", "excuse me"}


class BackchannelClassifier(Protocol):
    def classify(self, audio: Optional[np.ndarray], transcript: Optional[str]) -> Optional[BargeInDecision]:
        """Return INTERRUPT or RESUME if sure, None to leave it to the duration rule."""


class WordListClassifier:
    """Decides from a transcript of the interjection, when one is known (a scenario's ``text``)."""

    def classify(self, audio: Optional[np.ndarray], transcript: Optional[str]) -> Optional[BargeInDecision]:
        if not transcript:
            return None
        text = re.sub(r"[^a-z' -]", " ", transcript.lower())
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


@dataclass
class TurnTaker:
    """Duration rule plus a pluggable classifier.

    :param backchannel_max_ms: speech longer than this (ms) is an interruption, decided as soon as it is
        exceeded, not at its end.
    """

    backchannel_max_ms: float = 700.0
    classifier: Optional[BackchannelClassifier] = None

    def during(self, speech_ms: float, audio: Optional[np.ndarray]) -> BargeInDecision:
        return BargeInDecision.INTERRUPT if speech_ms >= self.backchannel_max_ms else BargeInDecision.WAIT

    def at_end(self, speech_ms: float, audio: Optional[np.ndarray], transcript: Optional[str]) -> BargeInDecision:
        if self.classifier is not None:
            verdict = self.classifier.classify(audio, transcript)
            if verdict is not None:
                return verdict
        return BargeInDecision.INTERRUPT if speech_ms >= self.backchannel_max_ms else BargeInDecision.RESUME
