"""Test audio for the echo benches, tests and tools: the appliance's voice rendered the same every time, and a
reply played through a room (the simulated room's linear echo path, or the JACK room's worst case computed
offline). All float32 mono at 16 kHz (``MODEL_RATE``)."""
from __future__ import annotations

from typing import Iterator, Optional

import numpy as np

from ..audio.echo import FRAME
from ..audio.files import resample
from ..audio.room import RoomSpec, Scenario, SimulatedRoom, synthetic_ir
from ..speech import HEADROOM
from ..vad import SileroVad, VadSegmenter
from .interruption import ECHO_DELAY_MS, RT60_MS  # the interruption bench's rooms: the echo's delay and RT60, ms

RATE = 16000  # Hz, every signal here


def fixed_speech(tts, text: str) -> np.ndarray:
    """Piper's rendering of ``text`` with no noise, so the same samples every time (by default Piper draws its
    noise inside the ONNX graph and each rendering differs), at the speech module's ``HEADROOM``.
    :param tts: an :class:`appliance.speech.PiperTts`. :returns: float32 [n] at 16 kHz."""
    from piper import SynthesisConfig

    fixed = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0, volume=HEADROOM)
    audio = np.concatenate([c.audio_float_array for c in tts.voice.synthesize(text, syn_config=fixed)])
    return resample(audio.astype(np.float32), tts.sample_rate, RATE)


def through_room(far: np.ndarray, gain_db: Optional[float], ir: Optional[np.ndarray] = synthetic_ir(RT60_MS),
                 delay_ms: float = ECHO_DELAY_MS) -> tuple[np.ndarray, SimulatedRoom]:
    """Play ``far`` (float32 [n], 16 kHz) in the simulated room, unpaced, with an echo path of ``gain_db`` (dB
    re what is played; None: no echo path), ``delay_ms`` and the impulse response ``ir`` (None: a pure delay).
    :returns: the microphone (float32 [n // FRAME * FRAME]) and the room (``room.output``: what was played, one
    ``FRAME``-sample block per tick)."""
    pos = [0]

    def read(n):
        x = far[pos[0] : pos[0] + n]
        pos[0] += n
        return np.pad(x, (0, n - len(x)))

    room = SimulatedRoom(Scenario([], RoomSpec(echo_gain_db=gain_db, echo_delay_ms=delay_ms, impulse_response=ir)),
                         read, lambda mic, f: None, on_event=lambda r: None, paced=False)
    for _ in range(len(far) // FRAME):
        room.tick()
    return room.mic_audio(), room


def clipping_room(far: np.ndarray, gain_db: float = 0.0, drift_ppm: float = 300.0, drive: float = 2.0,
                  noise_dbfs: float = -70.0, seed: int = 0, band_limited: bool = False) -> np.ndarray:
    """``far`` (float32 [n], 16 kHz) through the JACK room's worst case, offline: a soft-clipping speaker
    (``tanh(drive x) / drive``; 2 as the JACK room's ``--speaker clip``), with ``band_limited`` the JACK room's
    small-speaker response after it (:func:`appliance.audio.jack_room.small_speaker_fir` at 16 kHz, 300 Hz-6.5 kHz,
    its group delay taken out), ``drift_ppm`` of clock drift (the echo resampled by ``1 + drift_ppm 1e-6``, linear
    interpolation), ``ECHO_DELAY_MS`` and the synthetic ``RT60_MS`` impulse response, ``gain_db``, then white room
    noise at ``noise_dbfs`` (dBFS RMS, from ``seed``). :returns: the microphone, float32 [n]."""
    y = (np.tanh(drive * far) / drive).astype(np.float32)
    if band_limited:
        from ..audio.jack_room import small_speaker_fir

        bp = small_speaker_fir(RATE)
        y = np.convolve(y, bp)[(len(bp) - 1) // 2 :][: len(far)].astype(np.float32)
    y = np.interp(np.arange(len(y)) * (1 + drift_ppm * 1e-6), np.arange(len(y)), y).astype(np.float32)
    y = np.concatenate([np.zeros(int(ECHO_DELAY_MS * RATE / 1000), np.float32), y])[: len(far)]
    mic = np.convolve(y, synthetic_ir(RT60_MS))[: len(far)] * 10 ** (gain_db / 20)
    noise = 10 ** (noise_dbfs / 20) * np.random.default_rng(seed).standard_normal(len(far))
    return (mic + noise).astype(np.float32)


def replying_segmenter(cfg, echo) -> VadSegmenter:
    """The listener's VAD segmenter as it runs while a reply plays (not interjecting, both Silero streams, no
    skipping at the noise floor: :meth:`appliance.pipeline.Listener`'s ``follow`` then), configured from ``cfg``'s
    ``vad`` and ``interruption`` sections and gated by ``echo``'s onset tests (an
    :class:`~appliance.audio.echo.EchoCanceller`): for offline replays of the canceller and the VAD together."""
    seg = VadSegmenter(SileroVad())
    seg.configure(cfg.vad, cfg.interruption)
    seg.use_gate(echo.near_end_present, echo.near_end_clear)
    seg.follow(interjecting=False, both_streams=True, skip_floor=False)
    return seg


def cancel_and_segment(cfg, mic: np.ndarray, far: np.ndarray, echo=None, segmenter: Optional[VadSegmenter] = None,
                       quiet: frozenset = frozenset()) -> Iterator[tuple[int, list]]:
    """The listener's microphone path while a reply plays, offline: ``FRAME`` (10 ms) blocks of ``mic`` (float32
    [n], 16 kHz) through the echo canceller with ``far`` (float32 [>= n], what was played) as its far end, then the
    VAD's segmenter. ``echo`` (an :class:`~appliance.audio.echo.EchoCanceller`) defaults to ``from_config(cfg)``
    and ``segmenter`` to :func:`replying_segmenter` on it; pass your own to look at them while the loop runs.
    ``quiet``: the first samples of the blocks the canceller gets with ``quiet=True`` (as the live listener
    marked them: a run's trace, :func:`appliance.audio.tap.read_trace`). Yields (block index, the segmenter's events for that block); an event's ``t_sample`` is its window's first
    sample (the window is 512 samples). Stop iterating whenever you have what you need."""
    from ..audio.echo import from_config

    echo = from_config(cfg) if echo is None else echo
    segmenter = replying_segmenter(cfg, echo) if segmenter is None else segmenter
    for i in range(len(mic) // FRAME):
        sl = slice(i * FRAME, (i + 1) * FRAME)
        yield i, segmenter.push(echo.process(mic[sl], far[sl], quiet=i * FRAME in quiet))
