"""``appliance bench wake``: the wake word in the simulated room, offline (the detector is fed as fast as
it computes; its decisions depend only on the samples, so rates and latencies are those of real time).

- **Detection**: the bundled phrase ("Okay Nabu") in five voices (Piper's Joe at three speeds, espeak-ng's
  en-us+f3, en-gb+m3, en-us+m7 and en-gb+f4 at three speeds and pitches), three sentence forms, in four
  room conditions (close and clean; a 300 ms reverberant room with fan-like noise at 20 dB SNR; far away,
  10 dB quieter, in a 500 ms room; over music at 10 dB SNR). A detection is a wake between the phrase's
  start and 1 s after its end.
- **False wakes**: hours of audio with no wake word, played through the room without stopping: speech
  (espeak-ng reading the licence texts in /usr/share/common-licenses, voices rotating by paragraph), music
  (the Ogg tracks of the Debian package ``wesnoth-1.16-music``) and TV-like audio (that speech over that
  music). Each is played twice: close and clean, and in the reverberant room with noise.
- **Wake-to-listening latency**: from the end of the phrase (its last sample above −40 dBFS) to the
  detection; the conversation opens the window on the event it is handed then.
- **CPU**: the detector's compute time per second of audio (features and model), on this machine.
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from ..audio.files import MODEL_RATE, resample
from ..audio.room import synthetic_ir
from ..errors import UserError
from ..wake import PHRASES, WakeWordDetector
from .interruption import at_level

LICENSES = Path("/usr/share/common-licenses")
MUSIC = Path("/usr/share/games/wesnoth/1.16/data/core/music")
MUSIC_PACKAGE = "wesnoth-1.16-music"
ESPEAK_VOICES = ("en-us+f3", "en-gb+m3", "en-us+m7", "en-gb+f4")
USER_DBFS = -26.0
TV_DBFS = -30.0


def fft_convolve(x: np.ndarray, h: np.ndarray) -> np.ndarray:
    n = len(x) + len(h) - 1
    size = 1 << (n - 1).bit_length()
    return np.fft.irfft(np.fft.rfft(x, size) * np.fft.rfft(h, size), size)[:len(x)].astype(np.float32)


def pink_noise(n: int, seed: int) -> np.ndarray:
    """Fan-like noise: white noise with a 1/f power spectrum, unit RMS."""
    rng = np.random.default_rng(seed)
    spec = np.fft.rfft(rng.standard_normal(n))
    f = np.arange(len(spec), dtype=np.float64)
    f[0] = 1.0
    x = np.fft.irfft(spec / np.sqrt(f), n)
    return (x / (np.sqrt(np.mean(x ** 2)) + 1e-12)).astype(np.float32)


def rms_db(x: np.ndarray) -> float:
    return 10 * np.log10(np.mean(np.asarray(x, np.float64) ** 2) + 1e-20)


def room(x: np.ndarray, condition: str, seed: int, music: Optional[np.ndarray] = None,
         level_db: Optional[float] = None) -> np.ndarray:
    """``x`` as the microphone hears it in ``condition``: ``clean``, ``noisy_room`` (RT60 300 ms, pink
    noise 20 dB under the speech), ``far`` (10 dB quieter, RT60 500 ms, as much reverb as direct sound)
    or ``music`` (music 10 dB under the speech). The background runs through the whole of ``x``.

    :param level_db: the speech's level, dB RMS (default: the RMS of ``x``).
    """
    ref = rms_db(x) if level_db is None else level_db
    if condition == "clean":
        return x
    if condition == "noisy_room":
        y = fft_convolve(x, synthetic_ir(300.0, seed=seed))
        return y + pink_noise(len(y), seed) * 10 ** ((ref - 20.0) / 20.0)
    if condition == "far":
        return fft_convolve(x * 10 ** (-10 / 20), synthetic_ir(500.0, seed=seed, direct_to_reverb_db=0.0))
    if condition == "music":
        m = np.resize(music, len(x))
        return x + m * 10 ** ((ref - 10.0 - rms_db(m)) / 20.0)
    raise ValueError(condition)


CONDITIONS = ("clean", "noisy_room", "far", "music")


def _piper(tts, text: str, length_scale: float) -> np.ndarray:
    from piper import SynthesisConfig

    cfg = SynthesisConfig(length_scale=length_scale)
    audio = np.concatenate([np.asarray(c.audio_float_array, np.float32) for c in tts.voice.synthesize(text, syn_config=cfg)])
    return resample(audio, tts.sample_rate, MODEL_RATE)


def _espeak(text: str, voice: str, speed: int, pitch: int) -> np.ndarray:
    import io

    import soundfile as sf

    try:
        wav = subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-p", str(pitch), "--stdout", text],
                             capture_output=True, check=True, timeout=120).stdout
    except FileNotFoundError:
        raise UserError("espeak-ng is not installed: run `apt-get install espeak-ng`") from None
    x, sr = sf.read(io.BytesIO(wav), dtype="float32")
    return resample(x, sr, MODEL_RATE)


def renditions(tts, phrase: str) -> Iterator[tuple[str, str, np.ndarray]]:
    """(voice, variant, audio) of the wake phrase in three sentence forms per voice and three
    speeds/pitches."""
    forms = [f"{phrase}.", f"{phrase}, what time is it?", f"{phrase}, turn it down."]
    for scale in (0.85, 1.0, 1.15):
        for form in forms:
            yield "joe", f"length {scale} '{form}'", _piper(tts, form, scale)
    for voice in ESPEAK_VOICES:
        for speed, pitch in ((140, 40), (160, 50), (185, 60)):
            for form in forms:
                yield voice, f"{speed} wpm pitch {pitch} '{form}'", _espeak(form, voice, speed, pitch)


def phrase_end(x: np.ndarray, phrase_only: np.ndarray) -> int:
    """Sample where the wake phrase ends in ``x`` (which starts with it): the last sample above −40 dBFS
    of ``phrase_only``."""
    loud = np.flatnonzero(np.abs(phrase_only) > 10 ** (-40 / 20))
    return int(loud[-1]) + 1 if len(loud) else len(phrase_only)


def detection(det: WakeWordDetector, tts, music: np.ndarray, say: Callable[[str], None]) -> dict:
    pad = int(0.7 * MODEL_RATE)
    per_voice: dict[str, dict] = {}
    latencies: list[float] = []
    misses: list[str] = []
    phrase = PHRASES[det.name]
    k = 0
    phrase_audio: dict[tuple[str, str], np.ndarray] = {}
    for voice, variant, audio in renditions(tts, phrase):
        # The phrase alone, in the same voice and variant, marks where the phrase ends in the sentence.
        key = (voice, variant.split(" '")[0])
        if key not in phrase_audio:
            phrase_audio[key] = _piper(tts, f"{phrase}.", float(variant.split()[1])) if voice == "joe" else \
                _espeak(f"{phrase}.", voice, *[int(v) for v in variant.split()[:4:3]])
        end_in_audio = min(len(audio), phrase_end(audio, phrase_audio[key]))
        if variant.endswith(f"'{phrase}.'"):
            end_in_audio = phrase_end(audio, audio)
        dry = at_level(audio, USER_DBFS)
        padded = np.concatenate([np.zeros(pad, np.float32), dry, np.zeros(MODEL_RATE, np.float32)])
        for condition in CONDITIONS:
            k += 1
            sig = room(padded, condition, seed=k, music=music, level_db=rms_db(dry))
            det.reset()
            hits = det.process(sig)
            end = pad + end_in_audio
            good = [h for h in hits if pad <= h <= end + MODEL_RATE]
            v = per_voice.setdefault(voice, {"detected": 0, "n": 0})
            v["n"] += 1
            if good:
                v["detected"] += 1
                latencies.append((good[0] - end) * 1000.0 / MODEL_RATE)
            else:
                misses.append(f"{voice} {variant} {condition}")
        say(f"  {voice:9s} {variant:55s} {per_voice[voice]['detected']}/{per_voice[voice]['n']}")
    for v in per_voice.values():
        v["rate"] = round(v["detected"] / v["n"], 3)
    n = sum(v["n"] for v in per_voice.values())
    hit = sum(v["detected"] for v in per_voice.values())
    return {"per_voice": per_voice, "detected": hit, "n": n, "rate": round(hit / n, 3), "misses": misses,
            "conditions": list(CONDITIONS), "latencies_ms": latencies}


def paragraphs(limit_chars: Optional[int] = None) -> list[str]:
    if not LICENSES.is_dir():
        raise UserError(f"{LICENSES}: no licence texts to read aloud (Debian's base-files provides them)")
    out, total = [], 0
    for path in sorted(p for p in LICENSES.iterdir() if p.is_file()):
        text = path.read_text(encoding="utf-8", errors="replace")
        for para in text.split("\n\n"):
            para = " ".join(para.split())
            if len(para) > 40:
                out.append(para)
                total += len(para)
                if limit_chars and total >= limit_chars:
                    return out
    return out


def music_tracks() -> list[Path]:
    tracks = sorted(MUSIC.glob("*.ogg")) if MUSIC.is_dir() else []
    if not tracks:
        raise UserError(f"{MUSIC}: no music to play; run `apt-get install {MUSIC_PACKAGE}` (Ogg tracks the "
                        "benchmark plays as TV-like audio)")
    return tracks


def load_track(path: Path) -> np.ndarray:
    import soundfile as sf

    x, sr = sf.read(str(path), dtype="float32", always_2d=True)
    return resample(x.mean(axis=1), sr, MODEL_RATE)


def false_wakes(det: WakeWordDetector, max_hours: Optional[float], say: Callable[[str], None]) -> dict:
    """Every stream through the detector without a reset inside a stream; returns wakes and hours."""
    budget_s = max_hours * 3600 if max_hours else None
    played = {"speech": 0.0, "music": 0.0, "tv": 0.0}
    wakes = {"speech": [], "music": [], "tv": []}
    distinct = {"speech": 0.0, "music": 0.0}
    paras = paragraphs(int(budget_s * 2.5) if budget_s else None)  # ~15 characters a second of speech
    tracks = music_tracks()

    def speech_chunks():
        for i, para in enumerate(paras):
            yield _espeak(para, ESPEAK_VOICES[i % len(ESPEAK_VOICES)], 150 + 10 * (i % 4), 40 + 5 * (i % 5))

    speech_cache: list[np.ndarray] = []

    def speech_once():
        for chunk in speech_chunks():
            if len(speech_cache) < 400:  # about 30 minutes, for the TV-like mix
                speech_cache.append(chunk)
            distinct["speech"] += len(chunk) / MODEL_RATE
            yield chunk

    def speech_again():
        for i, para in enumerate(paras):
            yield _espeak(para, ESPEAK_VOICES[(i + 1) % len(ESPEAK_VOICES)], 150 + 10 * (i % 4), 40 + 5 * (i % 5))

    # Speech: read once per condition with voices rotating (the second pass shifts the rotation).
    for condition, gen in (("clean", speech_once), ("noisy_room", speech_again)):
        det.reset()
        t = 0.0
        for i, chunk in enumerate(gen()):
            x = room(at_level(chunk, USER_DBFS if condition == "clean" else TV_DBFS), condition, seed=i)
            for h in det.process(x):
                wakes["speech"].append(f"licence paragraph {i} {condition} at {t + h / MODEL_RATE:.1f} s")
            t += len(x) / MODEL_RATE
            played["speech"] += len(x) / MODEL_RATE
            if budget_s and played["speech"] >= budget_s * 0.3 * (1 if condition == "clean" else 2):
                break
            if i % 50 == 0:
                say(f"  speech {condition:10s} {played['speech'] / 3600:6.2f} h played, {len(wakes['speech'])} false wakes")
    # Music, then TV-like audio: the cached speech over the music.
    speech_tv = np.concatenate(speech_cache) if speech_cache else np.zeros(MODEL_RATE, np.float32)
    pos = 0
    for condition in ("clean", "noisy_room"):
        det.reset()
        for j, track in enumerate(tracks):
            m = load_track(track)
            if condition == "clean":
                distinct["music"] += len(m) / MODEL_RATE
            x = room(at_level(m, TV_DBFS), condition, seed=j)
            for h in det.process(x):
                wakes["music"].append(f"{track.name} {condition} at {h / MODEL_RATE:.1f} s")
            played["music"] += len(x) / MODEL_RATE
            s = np.resize(np.roll(speech_tv, -pos), len(m))
            pos = (pos + len(m)) % len(speech_tv)
            tv = at_level(m, TV_DBFS - 6) + at_level(s, TV_DBFS)
            x = room(tv, condition, seed=100 + j)
            for h in det.process(x):
                wakes["tv"].append(f"{track.name} + speech {condition} at {h / MODEL_RATE:.1f} s")
            played["tv"] += len(x) / MODEL_RATE
        say(f"  music+tv {condition:10s} {(played['music'] + played['tv']) / 3600:6.2f} h played, "
            f"{len(wakes['music']) + len(wakes['tv'])} false wakes")
    total_h = sum(played.values()) / 3600
    n = sum(len(w) for w in wakes.values())
    return {
        "hours_played": {k: round(v / 3600, 3) for k, v in played.items()} | {"total": round(total_h, 3)},
        "hours_distinct_material": {"speech": round(distinct["speech"] / 3600, 3),
                                    "music": round(distinct["music"] / 3600, 3)},
        "false_wakes": {k: len(v) for k, v in wakes.items()} | {"total": n},
        "false_wakes_per_10_hours": round(n / total_h * 10, 3) if total_h else None,
        "where": [w for v in wakes.values() for w in v],
    }


def run(cfg, tts, json_path: Optional[Path], max_hours: Optional[float] = None,
        print_line: Callable[[str], None] = print) -> dict:
    """Run the benchmark; print a summary; write ``json_path`` if given. Returns the summary."""
    name = cfg.listen.wake_word
    det = WakeWordDetector(name)
    tracks = music_tracks()
    music = at_level(load_track(tracks[0])[: 60 * MODEL_RATE], USER_DBFS)
    t0 = time.perf_counter()
    print_line(f"wake word {name} ('{det.phrase}'), cutoff {det.cutoff}: detection")
    det.reset_stats()
    found = detection(det, tts, music, print_line)
    lat = found.pop("latencies_ms")
    print_line("false wakes on speech, music and TV-like audio with no wake word")
    fw = false_wakes(det, max_hours, print_line)
    cpu_ms = det.compute_s / det.audio_s * 1000.0 if det.audio_s else None
    pct = lambda q: round(float(np.percentile(lat, q)), 1) if lat else None  # noqa: E731
    summary = {
        "wake_word": name, "phrase": det.phrase, "probability_cutoff": det.cutoff,
        "detection": found,
        "false_wakes": fw,
        "wake_to_listening_ms": {"p50": pct(50), "p95": pct(95), "max": round(max(lat), 1) if lat else None,
                                 "n": len(lat), "measured_from": "the end of the phrase (last sample above -40 dBFS)"},
        "cpu_ms_per_s_of_audio": round(cpu_ms, 2) if cpu_ms else None,
        "audio_s_processed": round(det.audio_s, 1),
        "wall_s": round(time.perf_counter() - t0, 1),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}; shared with other jobs",
        "offline": "the detector was fed as fast as it computes; its decisions depend only on the samples",
    }
    d = found
    print_line(f"detection: {d['detected']}/{d['n']} ({d['rate']:.1%}); per voice: " +
               ", ".join(f"{v} {x['detected']}/{x['n']}" for v, x in d["per_voice"].items()))
    print_line(f"false wakes: {fw['false_wakes']['total']} in {fw['hours_played']['total']:.2f} h played "
               f"({fw['false_wakes_per_10_hours']} per 10 h)")
    print_line(f"wake to listening: p50 {pct(50)} ms, p95 {pct(95)} ms; CPU {summary['cpu_ms_per_s_of_audio']} ms "
               "per second of audio")
    if json_path is not None:
        json_path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        print_line(f"wrote {json_path}")
    return summary
