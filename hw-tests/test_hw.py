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
    from appliance.audio.device import DeviceAudio
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

    dev = DeviceAudio(cfg.audio.input, cfg.audio.output, cfg.audio.output_block_ms, rate, idle=False)  # no Playback: no wake
    dev.start(read, lambda m, f: mic.append(m))
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


def test_cold_start_replies_never_pause_on_the_pis_own_speaker():
    """The service's own assembly on the Pi's card, from a cold start: the first reply and 20 more with
    nobody talking (stay quiet: the questions go in as if the VAD had heard them, so the only sound in the
    room is the appliance's own voice through its speaker), every pause counted. The simulated room's echo
    is linear; the Pi's speaker is not. Writes cold_start.json: pauses in the first reply and in the later
    ones, and how much of each reply the cold-start stand-in (AEC3) served."""
    import threading

    from appliance.audio.files import load_audio
    from appliance.pipeline import Parts
    from appliance.service import Service

    cfg = load(CFG)
    question = load_audio(Path(__file__).resolve().parent.parent / "demo" / "question.wav")
    parts = Parts.load(cfg, persist=False)
    records: list = []
    turn_ended = threading.Event()

    def observe(r):
        records.append(r)
        if r.get("event") == "turn_end":
            turn_ended.set()

    svc = Service(cfg, parts, timeline=observe)
    svc.start()
    replies = []
    try:
        assert svc.audio.wait_open(15), svc.audio.last_error
        time.sleep(2.0)
        echo = svc.session.listener.echo
        for i in range(21):
            turn_ended.clear()
            mark, stand_in0 = len(records), getattr(echo, "stand_in_frames", 0)
            svc.session.conversation.post("vad_end", audio_t=0.0, speech_ms=len(question) / 16.0, audio=question,
                                          transcript="What is a rainbow?")
            assert turn_ended.wait(120), f"reply {i + 1} did not end"
            time.sleep(1.5)
            new = records[mark:]
            replies.append({"reply": i + 1,
                            "pauses": sum(1 for r in new if r.get("event") == "interrupted"),
                            "flushed": any(r.get("event") == "flushed" for r in new),
                            "stand_in_ms": 10 * (getattr(echo, "stand_in_frames", 0) - stand_in0)})
    finally:
        svc.stop()
    result = {"first_reply": replies[0], "later_replies": {
        "pauses": sum(r["pauses"] for r in replies[1:]), "replies_paused": sum(1 for r in replies[1:] if r["pauses"]),
        "n": len(replies) - 1}, "replies": replies, "echo_backend": cfg.echo.backend, "stand_in": cfg.echo.stand_in}
    _write("cold_start.json", result)
    assert replies[0]["pauses"] == 0 and not replies[0]["flushed"], result
    assert result["later_replies"]["pauses"] == 0, result


def test_a_persons_barge_in_through_the_pis_speaker_and_microphone():
    """A person talks over the reply (run with -s for the prompt): say "Stop." firmly, about two seconds
    after the reply starts. The canceller records its frames, so the person's onset (the first 10 ms of its
    output above -45 dBFS while the reply plays) and the moment playback stopped (the far end it was handed
    going silent) come from the same timeline. Writes barge_in.json."""
    import threading

    from appliance.audio.echo import FRAME, from_config
    from appliance.audio.files import load_audio
    from appliance.pipeline import Parts
    from appliance.service import Service

    cfg = load(CFG)
    question = load_audio(Path(__file__).resolve().parent.parent / "demo" / "question.wav")
    parts = Parts.load(cfg, persist=False)
    ended = threading.Event()
    svc = Service(cfg, parts, timeline=lambda r: r.get("event") in ("turn_end", "flushed") and ended.set())
    echo = from_config(cfg, record=True)
    svc.session.listener.use_echo(echo)
    svc.start()
    results = []
    try:
        assert svc.audio.wait_open(15), svc.audio.last_error
        for attempt in range(4):  # the first is the cold start's; the later ones meet a converged canceller
            ended.clear()
            echo.clear_records()
            print(f"\nBarge-in {attempt + 1} of 4: say 'Stop.' about two seconds after the reply starts", flush=True)
            svc.session.conversation.post("vad_end", audio_t=0.0, speech_ms=len(question) / 16.0, audio=question,
                                          transcript="What is a rainbow?")
            assert ended.wait(120)
            time.sleep(1.0)
            far = np.array([float(np.dot(f, f)) / FRAME for _, f, _ in echo.recorded])
            out = np.array([float(np.dot(o, o)) / FRAME for _, _, o in echo.recorded])
            playing = np.nonzero(far > 1e-6)[0]
            if not len(playing):
                continue
            talk = [i for i in range(playing[0], len(out)) if out[i] > 10 ** (-45 / 10) and far[i] > 1e-6]
            if not talk:
                results.append({"attempt": attempt + 1, "onset_to_playback_stopped_ms": None})
                continue
            onset = talk[0]
            silent = [i for i in range(onset, len(far) - 3) if far[i:i + 3].max() < 1e-8]
            results.append({"attempt": attempt + 1, "cold": attempt == 0,
                            "onset_to_playback_stopped_ms": 10 * (silent[0] - onset) if silent else None})
    finally:
        svc.stop()
    _write("barge_in.json", {"barge_ins": results})
    assert any(r["onset_to_playback_stopped_ms"] is not None for r in results), results


def test_the_echo_delay_and_the_clock_drift_between_the_pis_speaker_and_microphone():
    """The configured voice played for 40 s on ``audio.output`` and heard on ``audio.input`` (a quiet room, the
    mic where it will live), through the audio worker as the service runs it; the echo's delay behind the far
    end measured every 0.25 s from the two streams as the canceller pairs them (appliance.audio.delay), and how
    fast it moves: the two devices' clock drift, which the simulated room does not have and the JACK room
    only emulates (+-300 ppm there). Writes ``echo_delay.json`` (delay p5/p50/p95 ms, drift ppm over the run and
    over 10 s spans, the measurement's scatter). Needs the mic to hear the speaker (20 windows or more)."""
    out = echo_delay_run(load(CFG), seconds=40.0)
    _write("echo_delay.json", out)
    assert out["n"] >= 20, f"the microphone did not hear the speaker clearly enough to measure the delay: {out}"
    assert out["residual_ms_rms"] is not None and out["residual_ms_rms"] < 0.5, out


def echo_delay_run(cfg, seconds: float, rate: int = 48000) -> dict:
    """Play the configured voice for ``seconds`` through :class:`appliance.audio.device.DeviceAudio` on
    ``cfg.audio``'s devices and return :func:`appliance.audio.delay.delay_summary` of the echo's delay, with the
    device and ``xruns`` (a plain function, so that it also runs on a JACK room off the Pi)."""
    import soxr

    from appliance.audio.delay import delay_summary, delay_track
    from appliance.audio.device import DeviceAudio
    from appliance.speech import Tts

    tts = Tts(cfg.voice.model, length_scale=cfg.voice.length_scale, volume=cfg.voice.volume)
    lines = ["A rainbow is an arc of colours in the sky, made by sunlight shining through drops of rain.",
             "Hello there. I am happy to help you with questions about science, history, or anything else you like.",
             "The moon is bright tonight, and the stars are out over the quiet hills."]
    speech = [np.concatenate(list(tts.synthesize(t))) for t in lines]
    gap = np.zeros(tts.sample_rate // 2, np.float32)
    one = np.concatenate([x for s in speech for x in (s, gap)])
    sig = soxr.resample(np.tile(one, int(np.ceil(seconds * tts.sample_rate / len(one)))), tts.sample_rate, rate)
    pos = [0]
    mic, far = [], []

    def read(n):
        x = sig[pos[0]:pos[0] + n]
        pos[0] += n
        return np.pad(x, (0, n - len(x))).astype(np.float32)

    dev = DeviceAudio(cfg.audio.input, cfg.audio.output, cfg.audio.output_block_ms, rate, idle=False)
    dev.start(read, lambda m, f: (mic.append(m.copy()), far.append(f.copy())))
    try:
        assert dev.wait_open(15), dev.last_error
        info = dev.info
        time.sleep(seconds)
    finally:
        dev.stop()
    m, f = np.concatenate(mic), np.concatenate(far)
    out = delay_summary(delay_track(m, f))
    out.update({"seconds": round(len(m) / 16000, 1), "xruns": dev.xruns, "device": info.__dict__ if info else None})
    return out
