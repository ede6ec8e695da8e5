"""The wake word (``listen.mode: wake_word``): microWakeWord models run by ``pymicro-wakeword``, whose
wheel ships the TensorFlow Lite runtime and four models (``hey_jarvis``, ``okay_nabu``, ``alexa``,
``hey_mycroft``; 50–80 kB each) for x86_64 and aarch64 alike.

The detector takes the echo-cancelled microphone signal (float32 mono 16 kHz, any block size), computes
40 spectral features every 10 ms and runs the model on every third feature frame (30 ms); a detection is
the mean of the model's last ``sliding_window_size`` outputs over its ``probability_cutoff`` (both from
the model's JSON). After a detection the detector is deaf for :data:`REFRACTORY_S`, so one phrase is one
wake.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from .audio.files import MODEL_RATE
from .errors import UserError

WAKE_WORDS = ("hey_jarvis", "okay_nabu", "alexa", "hey_mycroft")
PHRASES = {"hey_jarvis": "Hey Jarvis", "okay_nabu": "Okay Nabu", "alexa": "Alexa", "hey_mycroft": "Hey Mycroft"}
CHUNK = 160  # 10 ms, the feature front end's step
REFRACTORY_S = 1.0


class WakeWordDetector:
    """One wake word on one audio stream. Not thread-safe: one owner (the listener thread) feeds it.

    :param name: one of :data:`WAKE_WORDS`.
    :raises UserError: ``pymicro-wakeword`` is missing or the name is unknown.
    """

    def __init__(self, name: str = "hey_jarvis"):
        if name not in WAKE_WORDS:
            raise UserError(f"listen.wake_word: unknown wake word {name!r}; use one of {', '.join(WAKE_WORDS)}")
        try:
            from pymicro_wakeword import MicroWakeWord, MicroWakeWordFeatures, Model
        except ImportError:
            raise UserError("listen.mode is wake_word but `pymicro-wakeword` is not installed: run `make venv` "
                            "(or `pip install pymicro-wakeword`), or set listen.mode: always") from None
        self.name = name
        self.phrase = PHRASES[name]
        self._model = MicroWakeWord.from_builtin(Model(name))
        self._features = MicroWakeWordFeatures()
        self.cutoff = float(self._model.probability_cutoff)
        self._pending = np.zeros(0, np.int16)
        self._n = 0  # samples consumed
        self._deaf_until = 0
        self.compute_s = 0.0  # time spent in features and the model
        self.audio_s = 0.0  # audio consumed
        self.max_probability = 0.0  # the highest smoothed probability since the last reset_stats()

    def reset(self) -> None:
        """Forget the stream (features, the model's internal state, the pending samples); sample indices
        count from 0 again."""
        self._model.reset()
        self._features.reset()
        self._pending = np.zeros(0, np.int16)
        self._deaf_until = 0
        self._n = 0

    def reset_stats(self) -> None:
        self.compute_s = self.audio_s = self.max_probability = 0.0

    def process(self, audio: np.ndarray) -> list[int]:
        """Feed samples; returns the sample index (since the stream started) of each detection, at the
        end of the 10 ms chunk that completed it.

        :param audio: float32 mono 16 kHz in [-1, 1], any length.
        """
        t0 = time.perf_counter()
        pcm = np.clip(np.round(np.asarray(audio, np.float32) * 32767.0), -32768, 32767).astype(np.int16)
        self._pending = np.concatenate([self._pending, pcm])
        hits: list[int] = []
        n_chunks = len(self._pending) // CHUNK
        for k in range(n_chunks):
            chunk = self._pending[k * CHUNK:(k + 1) * CHUNK]
            self._n += CHUNK
            for features in self._features.process_streaming(chunk.tobytes()):
                prob = self._model.process_streaming_prob(features)
                if prob is None:
                    continue
                self.max_probability = max(self.max_probability, prob)
                if prob > self.cutoff and self._n >= self._deaf_until:
                    hits.append(self._n)
                    self._deaf_until = self._n + int(REFRACTORY_S * MODEL_RATE)
        self._pending = self._pending[n_chunks * CHUNK:]
        self.compute_s += time.perf_counter() - t0
        self.audio_s += len(pcm) / MODEL_RATE
        return hits


def detector_from_config(cfg) -> Optional[WakeWordDetector]:
    """The detector ``cfg.listen`` asks for, or None in ``always`` mode.

    :raises UserError: wake_word mode without ``pymicro-wakeword``.
    """
    if cfg.listen.mode != "wake_word":
        return None
    return WakeWordDetector(cfg.listen.wake_word)
