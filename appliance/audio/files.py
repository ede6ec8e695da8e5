"""Reading and writing audio files, with one-line errors for bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import UserError

MODEL_RATE = 16000  # the VAD's and Gemma 4's audio rate (Silero VAD; mtmd_get_audio_sample_rate)


def resample(audio: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Resample float32 mono audio with soxr (VHQ); returns float32."""
    if src_rate == dst_rate:
        return np.asarray(audio, dtype=np.float32)
    import soxr

    return soxr.resample(np.asarray(audio, dtype=np.float32), src_rate, dst_rate).astype(np.float32)


MAX_SECONDS = 180.0  # a replay runs at most 180 s (replay's max_seconds): longer input is never heard
BLOCK_FRAMES = 65536  # frames read at a time: memory stays bounded whatever the file's length and channels


def load_audio(path: str | Path, rate: int = MODEL_RATE, max_seconds: float = MAX_SECONDS) -> np.ndarray:
    """Read any WAV/FLAC/OGG that libsndfile reads, mix to mono, resample to ``rate``.

    The file is streamed in blocks and only its first ``max_seconds`` are read, so a one-hour recording
    costs no more memory than three minutes of it (a 16 kHz mono result of 180 s is 11.5 MB).

    :returns: float32 [n] in [-1, 1] at ``rate`` Hz, n ≤ ``max_seconds`` × ``rate``.
    :raises UserError: missing file, not a regular file (a FIFO is never opened), not audio, empty audio,
        or NaN/infinite samples (one line naming the file and the fix).
    """
    import soundfile as sf

    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: is a directory; give an audio file (WAV, FLAC or OGG)")
    if path.exists() and not path.is_file():
        raise UserError(f"{path}: is not a regular file (a FIFO, socket or device); save the audio to a file "
                        "(WAV, FLAC or OGG) and give that")
    if not path.is_file():
        raise UserError(f"{path}: audio file not found; check the path")
    if path.stat().st_size == 0:
        raise UserError(f"{path}: the file is empty (0 bytes); record or generate some speech into it")
    try:
        with sf.SoundFile(str(path)) as f:
            sr = int(f.samplerate)
            left = int(min(f.frames if f.frames > 0 else 0, max_seconds * sr)) if f.seekable() else int(max_seconds * sr)
            blocks = []
            while left > 0:
                block = f.read(min(BLOCK_FRAMES, left), dtype="float32", always_2d=True)
                if not len(block):
                    break
                left -= len(block)
                blocks.append(block.mean(axis=1, dtype=np.float32))
    except (RuntimeError, sf.LibsndfileError, TypeError, ValueError, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise UserError(f"{path}: not a readable audio file ({reason[:120]}); give a WAV, FLAC or OGG recording") from None
    mono = np.concatenate(blocks) if blocks else np.zeros(0, np.float32)
    short = _wav_missing_bytes(path)
    if short:
        import logging

        logging.getLogger(__name__).warning(
            "%s: truncated: its header declares %d more bytes of audio than the file holds; using the %.2f s that "
            "are there (copy or export the recording again for all of it)", path, short, mono.size / sr)
    if mono.size == 0:
        raise UserError(f"{path}: the audio file holds no samples; record or generate some speech into it")
    bad = int(np.count_nonzero(~np.isfinite(mono)))
    if bad:
        raise UserError(f"{path}: {bad} sample{'s are' if bad != 1 else ' is'} NaN or infinite (a broken float WAV); "
                        "re-export it, e.g. as 16-bit PCM (`sox in.wav -b 16 out.wav`)")
    return resample(mono, sr, rate)


def _wav_missing_bytes(path: Path) -> int:
    """For a RIFF/WAVE file: how many bytes its ``data`` chunk declares beyond the end of the file (a copy or
    download cut short, which libsndfile reads without a word); 0 for a whole file or any other format."""
    import struct

    try:
        with open(path, "rb") as fh:
            head = fh.read(12)
            if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
                return 0
            size = path.stat().st_size
            pos = 12
            for _ in range(64):  # chunks before "data": fmt, fact, LIST, ... (a bound, not a real limit)
                fh.seek(pos)
                hdr = fh.read(8)
                if len(hdr) < 8:
                    return 0
                cid, n = hdr[:4], struct.unpack("<I", hdr[4:])[0]
                if cid == b"data":
                    return max(0, pos + 8 + n - size) if n != 0xFFFFFFFF else 0  # (0xFFFFFFFF: a stream)
                pos += 8 + n + (n & 1)
    except OSError:
        return 0
    return 0


def write_wav(path: str | Path, audio: np.ndarray, rate: int) -> None:
    """Write float32 mono audio as 16-bit PCM WAV.

    :raises UserError: the file cannot be written (one line naming it)."""
    import soundfile as sf

    if Path(path).is_dir():
        raise UserError(f"{path}: is a directory; give a file name, e.g. {Path(path) / 'out.wav'}")
    try:  # (WAV whatever the name ends with: soundfile would guess the format from the extension, or fail)
        sf.write(str(path), np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0), rate, subtype="PCM_16",
                 format="WAV")
    except (OSError, RuntimeError, TypeError, sf.LibsndfileError) as exc:
        reason = getattr(exc, "strerror", None) or exc.__class__.__name__
        raise UserError(f"{path}: cannot write the WAV file ({reason}); check that its folder exists and is writable") from None


def dbfs(x: np.ndarray) -> float:
    """RMS level in dB relative to full scale (a full-scale square wave is 0 dBFS)."""
    rms = float(np.sqrt(np.mean(np.square(x, dtype=np.float64)))) if len(x) else 0.0
    return 20.0 * np.log10(max(rms, 1e-10))


def first_above(x: np.ndarray, threshold_dbfs: float = -40.0) -> int:
    """Index of the first sample whose magnitude is above ``threshold_dbfs`` (peak), or -1."""
    idx = np.nonzero(np.abs(x) > 10 ** (threshold_dbfs / 20.0))[0]
    return int(idx[0]) if len(idx) else -1
