"""On the Pi: audio loopback through the real card, and CPU timings written as JSON to hw-tests/out/.

Run with the config the appliance uses (APPLIANCE_CONFIG, default /etc/appliance/config.yaml).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from appliance.config import load

OUT = Path(__file__).parent / "out"
CFG = os.environ.get("APPLIANCE_CONFIG", "/etc/appliance/config.yaml")


def _write(name: str, data: dict) -> None:
    OUT.mkdir(exist_ok=True)
    (OUT / name).write_text(json.dumps(data, indent=2))


def test_audio_loopback_latency_and_level():
    """Play a 1 kHz tone burst on the configured speaker and record it on the configured microphone
    (put the mic near the speaker, or loop the card's output to its input)."""
    from appliance.audio.devices import DeviceAudio
    from appliance.audio.files import dbfs

    cfg = load(CFG)
    rate = 48000
    t = np.arange(int(0.3 * rate)) / rate
    burst = (0.3 * np.sin(2 * np.pi * 1000 * t)).astype(np.float32)
    sent = {"at": None, "n": 0}
    mic = []

    def read(n):
        out = np.zeros(n, np.float32)
        if sent["at"] is None and len(mic) > 100:  # ~1 s of input first
            sent["at"] = sum(map(len, mic))
        if sent["at"] is not None and sent["n"] < len(burst):
            chunk = burst[sent["n"]:sent["n"] + n]
            out[:len(chunk)] = chunk
            sent["n"] += n
        return out

    dev = DeviceAudio(cfg.audio.input, cfg.audio.output, cfg.audio.output_block_ms, rate, read,
                      lambda m, f: mic.append(m))
    dev.start()
    try:
        assert dev.wait_open(15), dev.last_error
        time.sleep(3.0)
    finally:
        dev.stop()
    m = np.concatenate(mic)
    start = sent["at"]
    env = np.abs(m[start:])
    hit = np.nonzero(env > 10 ** (-40 / 20))[0]
    assert len(hit), "the tone never reached the microphone"
    latency_ms = 1000.0 * hit[0] / 16000
    level = dbfs(m[start + hit[0]:start + hit[0] + 3200])
    _write("loopback.json", {"latency_ms": latency_ms, "level_dbfs": level, "xruns": dev.xruns,
                             "device": dev.info.__dict__ if dev.info else None})
    assert latency_ms < 500


def test_vad_timing_per_chunk():
    from appliance.vad import SileroVad

    vad = SileroVad()
    chunk = np.zeros(512, np.float32)
    t0 = time.perf_counter()
    n = 300
    for _ in range(n):
        vad.probability(chunk)
    ms = 1000.0 * (time.perf_counter() - t0) / n
    _write("vad.json", {"ms_per_32ms_chunk": ms})
    assert ms < 32


STATES = ["loading", "starting", "listening", "thinking", "speaking", "interrupted", "muted", "error"]


def test_leds_cycle_through_every_state():
    """A person watches the LEDs: each state is shown for 3 s with its name printed (run with -s). The
    sequence shown is written to leds.json; the test fails if the configured LEDs cannot be opened."""
    from appliance import indicators as ind

    cfg = load(CFG)
    assert cfg.gpio.enabled, "gpio.enabled is false in the config: nothing to show"
    leds = ind.create(cfg.gpio, lambda name, **info: None, strict=True)
    shown = []
    try:
        for state in STATES:
            print(f"\nLED state: {state}", flush=True)
            leds.show(state)
            shown.append(state)
            time.sleep(3.0)
    finally:
        leds.close()
    _write("leds.json", {"shown": shown, "seconds_each": 3.0})
    assert shown == STATES


def test_button_press_reaches_the_state_machine():
    """Press the button once within 20 s (run with -s to see the prompt): a short press must arrive as a
    ``mute`` event, as the state machine receives it."""
    import threading

    from appliance import indicators as ind

    cfg = load(CFG)
    assert cfg.gpio.button_pin is not None, "gpio.button_pin is not set in the config"
    got = threading.Event()
    events = []

    def post(name, **info):
        events.append(name)
        if name == "mute":
            got.set()

    buttons = ind.create(cfg.gpio, post, strict=True)
    try:
        print("\nPress the button once (short press) within 20 s ...", flush=True)
        t0 = time.monotonic()
        pressed = got.wait(20.0)
        waited = time.monotonic() - t0
    finally:
        buttons.close()
    _write("button.json", {"events": events, "seconds_to_press": round(waited, 2) if pressed else None})
    assert pressed, f"no press arrived in 20 s (events: {events})"


def test_piper_real_time_factor():
    """Piper's real-time factor on the Pi's CPU for the configured voice (synthesis time / audio time)."""
    from appliance.speech import Tts

    cfg = load(CFG)
    tts = Tts(cfg.voice.model, length_scale=cfg.voice.length_scale)
    text = "A rainbow is sunlight, bent and split by raindrops into its colours."
    list(tts.synthesize("Warm up."))
    t0 = time.perf_counter()
    audio = np.concatenate(list(tts.synthesize(text)))
    synth_s = time.perf_counter() - t0
    rtf = synth_s / (len(audio) / tts.sample_rate)
    _write("piper.json", {"voice": tts.model_path.name, "rtf": round(rtf, 3), "audio_s": round(len(audio) / tts.sample_rate, 2)})
    assert rtf < 1.0, "Piper is slower than real time on this CPU"


def test_llm_prefill_and_generation_speed():
    """The configured model's prefill and generation speed (tokens/s) and the audio encoder's cost per
    second of speech, on the Pi's CPU, through the appliance's own engine."""
    from appliance.engine import Engine

    cfg = load(CFG)
    m = cfg.model
    e = Engine(m.gguf, m.mmproj, n_ctx=m.n_ctx, n_threads=m.n_threads, n_batch=m.n_batch,
               kv_cache_type=m.kv_cache_type, system_prompt=m.system_prompt, max_reply_tokens=48, temperature=0.0)
    question = "Explain in three sentences why the sky is blue, and why sunsets are red."
    t0 = time.perf_counter()
    stream = e.start_turn(transcript=question)
    first = None
    for _ in stream:
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    result = {
        "model": Path(m.gguf).name,
        "prefill_tokens": e.last.prefill_tokens,
        "prefill_tokens_per_s": round(e.last.prefill_tokens / (e.last.prefill_ms / 1000.0), 2),
        "generated_tokens": e.last.generated_tokens,
        "generation_tokens_per_s": round((e.last.generated_tokens - 1) / (end - first), 2) if e.last.generated_tokens > 1 else None,
        "ttft_ms": round((first - t0) * 1000.0, 1) if first else None,
    }
    e.commit_spoken(e.last.text, complete=True)
    if e.hears_audio:
        t = np.arange(3 * 16000) / 16000
        clip = (0.1 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
        t1 = time.perf_counter()
        n_before = e.n_past
        e.audio.eval_prompt(e.fmt.closed("user", "<__media__>"), clip, e.n_past, n_batch=m.n_batch, add_special=False)
        result["audio_3s_prefill_ms"] = round((time.perf_counter() - t1) * 1000.0, 1)
        result["audio_3s_tokens"] = e.n_past - n_before
    _write("llm.json", result)
    assert result["generated_tokens"] > 0
