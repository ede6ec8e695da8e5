"""End of turn (EOT): has the user finished, or only paused? Smart Turn v3.2 on the pause's audio.

The model is Smart Turn v3.2 (Daily, BSD-2-Clause): a Whisper-tiny encoder and a classifier, int8 ONNX,
8.7 MB, shipped inside the PyPI wheel ``pipecat-ai`` as
``pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx`` (installed with ``--no-deps``; see the
Makefile), its SHA-256 pinned below. Input ``input_features`` float32 [1, 80, 800]: Whisper's log-mel
features of the last 8 s of 16 kHz mono audio, zero-padded at the front; output [1, 1], the probability
that the utterance is complete (above 0.5: complete).

The features follow Whisper's feature extractor (OpenAI Whisper, ``audio.py``; Hugging Face's
``WhisperFeatureExtractor``): the waveform normalised to zero mean and unit variance, a 400-point STFT
(periodic Hann window, hop 160 samples = 10 ms, centred with reflection padding), the power spectrum, 80
mel bands on the Slaney scale with Slaney area normalisation from 0 to 8 kHz, ``log10`` with a floor of
1e-10, the last frame dropped, a dynamic range of 8 (in log10 units) below the maximum, then
``(x + 4) / 4``. ``tests/test_eot.py`` checks them against the implementation that ships beside the model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import time
from pathlib import Path
from typing import Optional

import numpy as np

from .audio.files import MODEL_RATE
from .errors import UserError

WINDOW_S = 8  # Smart Turn looks at the last 8 s
N_FFT = 400
HOP = 160
N_MELS = 80
N_FRAMES = WINDOW_S * MODEL_RATE // HOP  # 800
MODEL_FILE = "audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"
MODEL_SHA256 = "2bb026316b14a660486a75b1733cd3fbab8c2fd0314dc9af7be49f8cca967e4f"  # pipecat-ai 1.14.0


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's mel scale (Auditory Toolbox): linear below 1 kHz (3 mels per 200 Hz), logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    return np.where(f < 1000.0, 3.0 * f / 200.0, 15.0 + np.log(np.maximum(f, 1e-9) / 1000.0) * 27.0 / np.log(6.4))


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    return np.where(m < 15.0, 200.0 * m / 3.0, 1000.0 * np.exp((m - 15.0) * np.log(6.4) / 27.0))


def mel_filterbank(n_mels: int = N_MELS, n_fft: int = N_FFT, rate: int = MODEL_RATE) -> np.ndarray:
    """Triangular mel filters on the Slaney scale, each scaled to unit area (``2 / (f_high - f_low)``), from
    0 Hz to ``rate / 2``: float64 [n_fft // 2 + 1, n_mels] (STFT bin × mel band)."""
    bins = np.linspace(0.0, rate / 2.0, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(rate / 2.0), n_mels + 2))
    low, centre, high = edges[:-2], edges[1:-1], edges[2:]
    up = (bins[:, None] - low) / (centre - low)
    down = (high - bins[:, None]) / (high - centre)
    return np.maximum(0.0, np.minimum(up, down)) * (2.0 / (high - low))


_FILTERS = mel_filterbank()
_HANN = (0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(N_FFT) / N_FFT))  # periodic, as Whisper's


def log_mel_features(audio: np.ndarray) -> np.ndarray:
    """Smart Turn's input: Whisper log-mel features of the last 8 s of ``audio`` (see the module notes).

    :param audio: float32 [n] mono at 16 kHz; shorter than 8 s is zero-padded at the front, longer keeps
        the last 8 s.
    :returns: float32 [80, 800] (mel band × 10 ms frame), roughly in [-1, 1].
    """
    x = np.asarray(audio, dtype=np.float32).reshape(-1)[-WINDOW_S * MODEL_RATE:]
    x = np.concatenate([np.zeros(WINDOW_S * MODEL_RATE - len(x), np.float32), x])
    x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
    padded = np.pad(x.astype(np.float64), N_FFT // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP]  # [801, 400]
    power = np.abs(np.fft.rfft(frames * _HANN, axis=1)) ** 2  # [801, 201]
    mel = np.log10(np.maximum(power @ _FILTERS, 1e-10)).T[:, :-1]  # [80, 800]
    mel = np.maximum(mel, mel.max() - 8.0)
    return ((mel + 4.0) / 4.0).astype(np.float32)


def bundled_model_path() -> Path:
    """The ONNX file inside the installed ``pipecat-ai`` package, found without importing it (its
    ``__init__`` needs dependencies the appliance does not install).

    :raises UserError: the package is missing.
    """
    spec = importlib.util.find_spec("pipecat")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("Smart Turn is not installed: run `pip install --no-deps pipecat-ai==1.14.0` (or "
                        "`make venv`), or set vad.end_of_turn: silence")
    path = Path(list(spec.submodule_search_locations)[0]) / MODEL_FILE
    return path


class SmartTurn:
    """Smart Turn v3.2 on onnxruntime, one thread: is the utterance complete?

    :param model_path: the ONNX file (default: :func:`bundled_model_path`).
    :raises UserError: the file is missing, is not the pinned model, or does not load.
    Not thread-safe: one owner (the listener thread) calls :meth:`probability`.
    """

    def __init__(self, model_path: Optional[str | Path] = None):
        from .vad import onnx_session

        path = Path(model_path) if model_path else bundled_model_path()
        if not path.is_file():
            raise UserError(f"{path}: Smart Turn model not found; reinstall with `pip install --no-deps "
                            "pipecat-ai==1.14.0`, or set vad.end_of_turn: silence")
        if model_path is None and hashlib.sha256(path.read_bytes()).hexdigest() != MODEL_SHA256:
            raise UserError(f"{path}: not the pinned Smart Turn v3.2 (SHA-256 differs); install "
                            "`pipecat-ai==1.14.0` with --no-deps, or set vad.end_of_turn: silence")
        self._session = onnx_session(path, "reinstall pipecat-ai, or set vad.end_of_turn: silence")
        self.path = path
        self.infer_ms: list[float] = []  # per call, features included

    def probability(self, audio: np.ndarray) -> float:
        """The probability, in [0, 1], that ``audio`` (float32 [n] mono 16 kHz, the utterance so far, its
        end the pause) ends a complete turn."""
        t0 = time.perf_counter()
        features = log_mel_features(audio)[None]
        p = float(self._session.run(None, {"input_features": features})[0].reshape(-1)[0])
        self.infer_ms.append((time.perf_counter() - t0) * 1000.0)
        del self.infer_ms[:-1024]
        return p
