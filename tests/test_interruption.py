"""Barge-in, end to end in the simulated room, in real time: real Silero, real Piper (the appliance's voice
and the user's), real Speex echo canceller, real PocketSphinx classifier, the embedded Gemma 3 270M.

Each scenario: the user asks a question; while the appliance answers, the room plays one sound into the
microphone together with the appliance's own echo (30 ms + RT60 150 ms, at 0 or +6 dB relative to the
user's voice). Latency bounds carry a margin over the benchmark's targets because this machine is shared
(the benchmark, ``appliance bench interruption``, measures the real numbers).
"""

from pathlib import Path

import numpy as np
import pytest

from appliance.audio.files import MODEL_RATE, load_audio
from appliance.bench import interruption as bench
from appliance import turns
from appliance.turns import AGREEMENT, BargeInDecision, KeywordClassifier, TurnTaker
from appliance.vad import SileroVad, VadSegmenter


@pytest.fixture(scope="module")
def ctx(tmp_path_factory, parts, embedded_cfg):
    cache = bench.AudioCache(tmp_path_factory.mktemp("bench-audio"), parts.tts)
    question = cache.speech(bench.QUESTION[0], "joe")
    return cache, bench.reply_dbfs(parts.tts), question, {}  # {}: each room's canceller, as a service keeps it


# The real-time scenarios depend on what the 270M model happens to say (its replies differ in length and
# content from run to run, and with them the echo and where the interjection lands): each is retried twice
# (pytest-rerunfailures). A behaviour that is broken fails both runs; the benchmark counts every run.
REALTIME = pytest.mark.flaky(reruns=2)


def run(ctx, parts, cfg, case, **kw):
    """Run ``case`` as the benchmark does: a cold case on a fresh canceller; any other on the canceller its
    room's earlier replies left, the first of them a first reply after a start (no hidden warm-up)."""
    cache, level, question, rooms = ctx
    echo = None if case.cold else rooms.get(case.room)
    if echo is None and not case.cold:
        first = bench.Case("first_reply", "the room's first reply", None, None, 0.0, case.echo_rel_db,
                           echo_path=case.echo_path, room_ir=case.room_ir)
        echo = bench.run_case(first, parts, cfg, level, question=question).echo
    out = bench.run_case(case, parts, cfg, level, echo=echo, question=question, **kw)
    if not case.cold:
        rooms[case.room] = out.echo
    assert out.valid, out.note
    return out


def events(out, name):
    return [r for r in out.records if r["event"] == name]


@REALTIME
def test_long_barge_in_goes_silent_fast_and_flushes(ctx, parts, embedded_cfg):
    cache = ctx[0]
    text = bench.LONG_INTERRUPTIONS[0]
    # The user talks 1.4 s into the reply, or later when the output was silent at the onset: a reply falls
    # silent after its first piece until the next one is generated and synthesised, for longer on a loaded
    # machine (at 0.8 s more often than not, measured here; at 1.4 s the fresh user's loaded run, 3 of 3), and
    # a barge-in into silence measures nothing (output_silent_ms 0). The one measured case is asserted.
    for at in (1.4, 2.2, 3.0):
        out = run(ctx, parts, embedded_cfg, bench.Case("barge_in", "long", cache.speech(text, "joe"), text, at, 6.0),
                  until_idle=True)  # the rest of the user's words end their turn seconds after the flush
        if not (out.barge and out.barge.get("output_silent_ms") == 0.0):
            break
    else:
        pytest.fail("the reply was silent at all three onsets: nothing measured")
    assert out.interrupted >= 1 and out.flushed
    assert out.barge is not None and 0 < out.barge["output_silent_ms"] <= 200  # target 100 (benchmark)
    # Only what reached the speaker is kept, and the interruption is the next user turn.
    flushed = events(out, "flushed")[0]
    assert len(flushed["spoken"]) < len(flushed["synthesized"])
    states = [r["state"] for r in events(out, "state")]
    assert states[:5] == ["listening", "thinking", "speaking", "interrupted", "listening"]
    assert "thinking" in states[5:]


@REALTIME
@pytest.mark.parametrize("rel_db,ir,rt60_ms", [(6.0, True, bench.RT60_MS), (0.0, False, bench.RT60_MS),
                                               (13.0, True, bench.REVERB_RT60_MS)])
def test_the_first_reply_after_a_start_never_pauses_on_its_own_voice(ctx, parts, embedded_cfg, rel_db, ir, rt60_ms):
    """A fresh session and a fresh canceller, one question, an echo path, nobody talking over the reply:
    not one pause. Before the per-band convergence test, the cold canceller let the reply through to the
    VAD within its first 0.1 s (the first reply paused 2-9 times, or flushed itself). The third room is a
    user's (RT60 300 ms, the echo 6 dB over what is played), where the AEC3 stand-in passed windows of the
    reply right after the silence between its pieces (see test_echo.py's reverberant-room test)."""
    out = run(ctx, parts, embedded_cfg, bench.Case("first_reply", f"echo {rel_db:+.0f} dB", None, None, 0.0, rel_db,
                                                   room_ir=ir, rt60_ms=rt60_ms))
    assert events(out, "turn_end"), "the reply should play to its end"
    assert out.interrupted == 0 and not out.flushed, [r for r in out.records if r["event"] == "interrupted"]
    assert out.stand_in_ms and out.stand_in_ms >= 1000.0  # the stand-in served its first second at least


@REALTIME
def test_own_echo_louder_than_the_user_never_interrupts(ctx, parts, embedded_cfg):
    out = run(ctx, parts, embedded_cfg, bench.Case("echo_only", "echo +6 dB", None, None, 0.0, 6.0))
    assert events(out, "turn_end"), "the reply should play to its end"
    assert out.interrupted == 0 and not out.flushed
    # ... and the canceller removed most of the echo on the way to the VAD.
    assert out.erle_den > 0 and 10 * np.log10(out.erle_num / out.erle_den) >= 25.0
    # The strong high-band test's closest echo-only window (gate_strong_headroom_db; None when Silero scored
    # no window of the echo 0.2 or more, so that nothing was checked) stayed short of passing.
    strong = [g.strong_db for g in out.echo.gate_log + out.echo.clear_log if g.strong_db is not None]
    assert out.gate_strong_headroom_db == (round(min(strong), 1) if strong else None)
    assert out.gate_strong_headroom_db is None or out.gate_strong_headroom_db > 0.0
    assert bench.summarise([out], [])["onset_strong_min_headroom_db"] == out.gate_strong_headroom_db


@REALTIME
def test_the_reply_to_a_stop_word_does_not_pause_on_itself(ctx, parts, embedded_cfg):
    """The bundled demo in the bench's terms: "Wait, stop." flushes the reply, then the reply to it plays
    to its end with no pause. With no echo path, as in the demo, the canceller's filter, adapted on the
    barge-in's double talk, used to write that reply into the microphone signal (see test_echo.py)."""
    cache = ctx[0]
    text = bench.NEXT_REPLY_STOP
    out = run(ctx, parts, embedded_cfg, bench.Case("next_reply", "no echo path", cache.speech(text, "joe"), text,
                                                   0.8, 0.0, echo_path=False))
    assert events(out, "flushed") and len(events(out, "turn_end")) >= 2
    assert out.interrupted == 0, [r for r in out.records if r["event"] in ("interrupted", "resumed", "flushed")]


@REALTIME
def test_backchannel_resumes_without_replaying_or_skipping(ctx, parts, embedded_cfg):
    """The resume mechanics. "Yeah.", because the keyword classifier now decodes deterministically, and
    Piper's "Uh-huh." is its known weak spot (taken for "no" in 3 of 9 captures; the benchmark and
    test_keyword_classifier_hears_stop_words_and_backchannels measure the classifier)."""
    cache = ctx[0]
    out = run(ctx, parts, embedded_cfg,
              bench.Case("backchannel", "yeah", cache.speech("Yeah.", "joe"), "Yeah.", 0.6, 0.0),
              wait_turn_end=True)
    after_reply = [f'{r["t"]:.2f} {r["event"]} {r.get("state") or r.get("reason") or ""}'.strip()
                   for r in out.records if r["event"] not in ("user_speech", "vad_start")][5:]
    assert out.interrupted >= 1 and out.resumed and not out.flushed, "; ".join(after_reply)[:600]
    assert out.resume_gap_ms is not None and out.resume_gap_ms <= 600  # target 400 (benchmark)
    # The reply played to its end: every sample of every clause once, none skipped, none twice.
    assert events(out, "turn_end") and not events(out, "turn_end")[0]["interrupted"]
    assert out.segments and all(n == played for n, played in out.segments)


@REALTIME
def test_short_stop_flushes_and_no_stale_audio_plays_again(ctx, parts, embedded_cfg):
    cache = ctx[0]
    # "Wait." (0.4 s): flushed in every voice in both benchmark runs here; "Stop." and "No." are the
    # classifier's weak spots (see the benchmark's short_interrupt_flushed).
    out = run(ctx, parts, embedded_cfg, bench.Case("short_stop", "wait", cache.speech("Wait.", "joe"), "Wait.", 0.6, 0.0),
              wait_turn_end=True)
    assert out.flushed, [(r["event"], r.get("heard")) for r in out.records if r["event"] in ("resumed", "vad_reject")]
    flushed = events(out, "flushed")[0]
    silent = [r for r in events(out, "output_silent") if r["t"] >= flushed["t"] - 0.2]
    # From the flush until a new reply starts, the speaker stays silent: the old reply never comes back.
    new_audio = [r["t"] for r in events(out, "tts_first_audio") if r["t"] > flushed["t"]]
    end = int((new_audio[0] if new_audio else len(out.output) / MODEL_RATE) * MODEL_RATE)
    start = int((flushed["t"] + 0.05) * MODEL_RATE)
    assert np.max(np.abs(out.output[start:end])) < 10 ** (-50 / 20)
    assert silent or np.max(np.abs(out.output[start - 800:start])) < 10 ** (-50 / 20)


@REALTIME
def test_a_door_slam_never_flushes(ctx, parts, embedded_cfg):
    cache = ctx[0]
    out = run(ctx, parts, embedded_cfg,
              bench.Case("noise", "door_slam", bench.at_level(cache.noise("door_slam"), bench.USER_DBFS), None, 0.6, 0.0))
    assert not out.flushed
    if out.interrupted:
        assert out.resumed


# --- the parts, offline ---

@pytest.fixture(scope="module")
def utterances(ctx):
    cache = ctx[0]
    words = {BargeInDecision.INTERRUPT: ["Stop.", "Wait.", "No."],
             BargeInDecision.RESUME: ["Uh-huh.", "Yeah.", "Right.", "Okay.", "I see."]}
    return [(w, v, want, cache.speech(w, v)) for want, ws in words.items() for w in ws for v in bench.VOICES]


def test_keyword_classifier_hears_stop_words_and_backchannels(utterances):
    clf = KeywordClassifier().load()
    right = 0
    wrong_flush = []
    for text, voice, want, audio in utterances:
        got = clf.classify(audio) or BargeInDecision.RESUME  # no verdict: the duration rule resumes short speech
        right += got == want
        if want == BargeInDecision.RESUME and got == BargeInDecision.INTERRUPT:
            wrong_flush.append((text, voice, clf.last))
    assert right / len(utterances) >= 0.8, (right, len(utterances))
    assert len(wrong_flush) <= 2, wrong_flush
    assert float(np.percentile(clf.costs_ms, 95)) < 100.0  # per interjection, measured here: ~10-40 ms


def test_turn_taker_duration_rule_and_classifier():
    class Says:
        def __init__(self, v):
            self.v = v

        def classify(self, audio, transcript):
            return self.v

    tt = TurnTaker(700.0, Says(BargeInDecision.RESUME))
    assert tt.during(800.0, None) == BargeInDecision.INTERRUPT
    assert tt.during(300.0, None) == BargeInDecision.WAIT
    assert tt.at_end(900.0, None, None) == BargeInDecision.INTERRUPT  # long speech, whatever is heard
    assert tt.at_end(300.0, None, None) == BargeInDecision.RESUME
    assert TurnTaker(700.0, Says(BargeInDecision.INTERRUPT)).at_end(300.0, None, None) == BargeInDecision.INTERRUPT
    assert TurnTaker(700.0, Says(None)).at_end(300.0, None, None) == BargeInDecision.RESUME
    # A stop word in a burst too short to be one (a door slam's 80 ms, heard as "pause" on the JACK room) resumes;
    # the shortest stop commands there held 192 ms of speech.
    assert TurnTaker(700.0, Says(BargeInDecision.INTERRUPT)).at_end(80.0, None, None) == BargeInDecision.RESUME
    assert TurnTaker(700.0, Says(BargeInDecision.INTERRUPT)).at_end(192.0, None, None) == BargeInDecision.INTERRUPT


def test_segmenter_short_end_while_interjecting_and_gate(utterances):
    audio = [a for t, v, _, a in utterances if t == "Uh-huh." and v == "joe"][0]
    signal = np.concatenate([np.zeros(8000, np.float32), audio, np.zeros(16000, np.float32)])

    def end_after_speech(interjecting):
        seg = VadSegmenter(SileroVad(), interjecting=interjecting)
        evs = seg.push(signal)
        ends = [e for e in evs if e.kind in ("end", "reject")]
        assert ends and ends[0].audio is not None
        last_voice = 8000 + len(audio) - int(np.argmax(np.abs(audio[::-1]) > 0.01))
        return (ends[0].t_sample - last_voice) * 1000 / 16000

    assert end_after_speech(True) < 330 < end_after_speech(False)
    gated = VadSegmenter(SileroVad(), onset_gate=lambda: False)
    assert not [e for e in gated.push(signal) if e.kind == "onset"] and gated.gated > 0


def test_early_onset_needs_the_strict_near_end_test_and_keeps_the_word_whole(utterances):
    """With the echo canceller's strict test passing (``onset_evidence``; here a constant, since these
    words play without a reply), a Silero score of 0.2 starts the candidate: never later than Silero's 0.5,
    sooner on some words; refused, it changes nothing. While interjecting, each word stays one candidate
    (no reject between its first consonant and its vowel), so the classifier hears it whole."""
    gains = []
    for text, voice, _, audio in utterances:
        signal = np.concatenate([np.zeros(8000, np.float32), audio, np.zeros(16000, np.float32)])

        def run(evidence, interjecting=False):
            seg = VadSegmenter(SileroVad(), onset_evidence=evidence, interjecting=interjecting)
            return [(e.kind, e.t_sample) for e in seg.push(signal)], seg.early_onsets

        plain, _ = run(None)
        refused, n_refused = run(lambda: False)
        early, n_early = run(lambda: True, interjecting=True)
        assert refused == plain and n_refused == 0
        onset = lambda evs: [t for k, t in evs if k == "onset"][0]  # noqa: E731
        assert onset(early) <= onset(plain), (text, voice)
        gains.append(onset(plain) - onset(early))
        assert [k for k, _ in early].count("onset") == 1, (text, voice, early)
        assert (n_early == 1) == (onset(early) < onset(plain))
    assert max(gains) >= 512  # measured here: up to 32 ms sooner on clean speech (more under echo, see vad.py)


def test_half_hop_vad_is_two_silero_streams_on_back_to_back_windows(ctx):
    """Every hop of 256 samples gets a probability, and each of the two streams sees exactly Silero's
    reference input (its own back-to-back 512-sample windows, the second stream shifted by 256 samples)."""
    question = ctx[2][: 3 * 16000]
    seg = VadSegmenter(SileroVad(), hop=256)
    seen = [[], []]
    for k, stream in enumerate(seg._streams):
        def rec(w, _p=stream.probability, _k=k):
            p = _p(w)
            seen[_k].append(p)
            return p
        stream.probability = rec
    seg.push(question)
    ref = SileroVad()
    want_a = [ref.probability(question[i:i + 512]) for i in range(0, len(question) - 511, 512)]
    ref.reset()
    want_b = [ref.probability(question[i:i + 512]) for i in range(256, len(question) - 511, 512)]
    assert np.allclose(seen[0], want_a, atol=1e-6) and np.allclose(seen[1], want_b, atol=1e-6)
    assert abs(len(seen[0]) + len(seen[1]) - len(question) // 256) <= 1


def test_half_hop_onset_is_never_later_than_the_single_stream(utterances):
    # Stream 0 of the half hop is the single stream itself, so its onset can only come earlier. How much
    # earlier depends on Silero's scores near its threshold, which differ in the last digits between CPUs
    # (here 0 or 16 ms on the bench's voices; CI once saw 48 ms on en-us joe "Stop."), so only "some" is asserted.
    gains = []
    for text, voice, _, audio in utterances:
        signal = np.concatenate([np.zeros(8000 + 16 * len(gains) % 512, np.float32), audio, np.zeros(8000, np.float32)])
        onsets = {}
        for hop in (512, 256):
            evs = VadSegmenter(SileroVad(), hop=hop).push(signal)
            onsets[hop] = [e.t_sample + 512 for e in evs if e.kind == "onset"][0]  # window end
        assert onsets[256] <= onsets[512], (text, voice, onsets)
        gains.append(onsets[512] - onsets[256])
    assert max(gains) >= 256  # some onsets came at least one hop (16 ms) earlier


def test_keyword_classifier_hears_words_between_digital_silence(utterances):
    """The canceller's output is exact zeros once the echo is gone (a paused reply). Dither keeps such
    silence from swallowing the word (espeak-ng en-gb "No." was decoded as nothing without it), and
    trimming it keeps half a second of it from turning "No." into "oh" (the utterance-wide cepstral mean)."""
    clf = KeywordClassifier().load()
    heard = []
    for pad_s in (0.2, 0.5):
        pad = np.zeros(int(pad_s * 16000), np.float32)
        for text, voice, want, audio in utterances:
            if text == "No.":
                heard.append((voice, pad_s, clf.classify(np.concatenate([pad, audio, pad])), clf.last))
    assert all(d == BargeInDecision.INTERRUPT for _, _, d, _ in heard), heard


def test_keyword_classifier_verdict_does_not_depend_on_history(utterances):
    """The dither is seeded on every call: the same audio gets the same words whatever came before."""
    clf = KeywordClassifier().load()
    first = [clf.hypothesis(a) for _, _, _, a in utterances]
    again = [clf.hypothesis(a) for _, _, _, a in reversed(utterances)][::-1]
    assert first == again


@pytest.mark.parametrize("name, want", [("engb_hold_on_echo0.wav", "hold on"), ("engb_no_echo6.wav", "no")])
def test_keyword_classifier_falls_back_to_the_forward_search(name, want):
    """Two interjections captured through the simulated room and the canceller (espeak-ng en-gb "Hold on."
    under echo at 0 dB, "No." at +6 dB) on which the lattice's best path reaches no final state: the
    forward search's hypothesis still hears the stop word."""
    audio = load_audio(Path(__file__).parent / "fixtures" / "captured" / name)
    clf = KeywordClassifier().load()
    fallback = clf._fallback
    clf._fallback = clf._decoder  # the lattice alone
    assert clf.hypothesis(audio) == ""
    clf._fallback = fallback
    assert clf.classify(audio) == BargeInDecision.INTERRUPT and clf.last == want


@pytest.mark.parametrize("name, want", [
    ("joe_uh_huh_echo6.wav", None),  # Piper's "Uh-huh." under echo 6 dB louder: was heard as "no"
    ("joe_mm_hmm_echo0.wav", BargeInDecision.RESUME),  # Piper's "Mm-hmm.": was heard as "never mind"
    ("engb_never_mind_echo0.wav", BargeInDecision.INTERRUPT),  # espeak-ng en-gb "Never mind.": heard as "never"
    ("joe_no_echo6.wav", BargeInDecision.INTERRUPT),
    ("engb_stop_echo6.wav", BargeInDecision.INTERRUPT),
    ("usf3_stop_echo6.wav", BargeInDecision.INTERRUPT),
    # Piper's "Stop." in the JACK room at +300 ppm with the clipping speaker (rebuilt from the run's tap): heard as
    # "stop it" by two decodes and "that's" by two; missed when three of four had to hear the stop word
    ("joe_stop_clip300ppm.wav", BargeInDecision.INTERRUPT),
])
def test_keyword_classifier_on_captured_backchannels_and_stop_words(name, want):
    """Interjections as the listener hands them over: the bench's speech played over a reply through the
    simulated room (echo 30 ms + RT60 150 ms), cancelled by Speex and cut by the segmenter from its onset
    to its end, the reply paused at the onset. The backchannels must not flush (None: the duration rule
    resumes) and the stop words must (real PocketSphinx). The first three failed before the backchannels'
    alternative pronunciations and "never"."""
    audio = load_audio(Path(__file__).parent / "fixtures" / "captured" / name)
    clf = KeywordClassifier().load()
    got = clf.classify(audio)
    assert got == want, (got, clf.last)


@pytest.mark.parametrize("name, first", [("joe_uh_huh_no_echo6.wav", "no"), ("joe_uh_huh_pause_echo6.wav", "pause")])
def test_a_stop_word_that_another_decode_hears_as_a_backchannel_does_not_flush(name, first):
    """Piper's "Uh-huh." under echo 6 dB louder, captured by tools/classifier-eval: the first decode hears a stop
    word (which flushed the reply before), another dither seed or the frame grid moved by 5 ms hears a backchannel.
    No verdict then, so the duration rule resumes the reply (real PocketSphinx)."""
    audio = load_audio(Path(__file__).parent / "fixtures" / "captured" / name)
    clf = KeywordClassifier().load()
    assert clf.hypothesis(audio) == first
    heard = {clf.hypothesis(audio, seed, shift) for seed, shift in AGREEMENT}
    assert len(heard) > 1, heard
    assert clf.classify(audio) is None and clf.last == first


@pytest.mark.parametrize("heard, want, decodes", [
    (["wait stop", "wait stop", "speechword", "stop"], BargeInDecision.INTERRUPT, 4),  # one decode heard a noise
    (["stop it", "stop it", "that's", "that's"], BargeInDecision.INTERRUPT, 4),  # ... or other words (the JACK room's)
    (["no", "mm-hmm", "no", "no"], None, 2),  # a backchannel in any decode holds the stop word back
    (["no", "no", "no", "uh"], None, 4),  # "uh" is one of the grammar's backchannels
    (["pause", "pause", "speechword", "oh"], None, 4),
    (["uh-huh", "no", "no", "no"], BargeInDecision.RESUME, 1),  # the first decode decides anything but a stop word
    (["noiseword", "stop", "stop", "stop"], None, 1),
])
def test_a_stop_word_flushes_unless_another_decode_hears_a_backchannel(heard, want, decodes):
    """The agreement rule alone: the decoder is replaced by the hypotheses listed, one per decode of AGREEMENT."""
    class Heard(KeywordClassifier):
        def hypothesis(self, audio, seed=0, shift=0):
            self.calls.append((seed, shift))
            return heard[len(self.calls) - 1]

    clf = Heard()
    clf.calls = []
    assert clf.classify(np.zeros(4000, np.float32)) == want
    assert clf.calls == list(AGREEMENT[:decodes]) and clf.last == heard[0]


def test_a_reply_that_ends_by_itself_right_after_the_onset_is_not_a_missed_barge_in():
    """The benchmark's validity rule on timeline records (seconds): a reply that finishes within 100 ms of
    the user's onset, before any pause, was never interrupted; one that was paused first, or that ends
    later, counts."""
    speech = [{"event": "user_speech", "onset_t": 2.0}]
    playing = [{"event": "state", "t": 1.0, "state": "speaking"}]
    ended = lambda t: [{"event": "turn_end", "t": t, "interrupted": False}]  # noqa: E731
    assert bench.interjection_validity(playing + ended(2.056), speech) == (
        False, "the reply ended by itself 56 ms after the onset, before a barge-in could be decided")
    assert bench.interjection_validity(playing + ended(2.3), speech) == (True, "")
    paused = [{"event": "interrupted", "t": 2.05}]
    assert bench.interjection_validity(playing + paused + ended(2.08), speech) == (True, "")
    assert not bench.interjection_validity([{"event": "state", "t": 1.0, "state": "listening"}], speech)[0]
    assert not bench.interjection_validity(playing, [])[0]


def test_barge_in_latency_is_split_into_vad_listener_and_output():
    """``latency_split`` on timeline records (seconds): the user's onset at 2.000 s, the VAD window that
    fired began at 2.040 (ends at 2.072), the listener posted it at 2.080, the pause at 2.081, and the
    output fell silent 87 ms after the onset; and ``summarise`` reports the parts over the barge-ins. As the
    conversation records them: its own ``t`` rounded to 0.1 ms, the pause's ``onset_t`` as posted (the first
    version matched them exactly and found no split in a real run)."""
    recs = [{"event": "vad_onset", "t": 2.08, "audio_t": 2.040, "prob": 0.9},
            {"event": "interrupted", "t": 2.081, "onset_t": 2.0800321}]
    split = bench.latency_split(recs, 2.0, 87.0)
    assert split == {"vad_ms": 72.0, "listener_ms": 9.0, "output_ms": 6.0}
    assert bench.latency_split(recs[:1], 2.0, 87.0) is None  # no pause
    case = bench.Case("short_stop", "x", None, "Stop.")
    outs = [bench.Outcome(case, [], True, barge={"output_silent_ms": 87.0, "detected_ms": 81.0, "split": split}),
            bench.Outcome(case, [], True, barge={"output_silent_ms": 0.0, "detected_ms": 40.0,  # in a gap: left out
                                                  "split": {"vad_ms": 30.0, "listener_ms": 10.0, "output_ms": -40.0}})]
    got = bench.summarise(outs, [])["barge_in_split_ms"]
    assert got["vad_ms"] == {"p50": 72.0, "p95": 72.0, "max": 72.0, "n": 1}
    assert got["output_ms"]["p50"] == 6.0 and got["listener_ms"]["n"] == 1
    # ... and by who served the VAD at the onset (the stand-in, or Speex after its hand-over)
    outs[0].served_by = "stand_in"
    outs.append(bench.Outcome(case, [], True, served_by="speex",
                              barge={"output_silent_ms": 41.0, "detected_ms": 35.0, "split": split}))
    assert bench.summarise(outs, [])["barge_in_ms_by_canceller"] == {
        "speex": {"p50": 41.0, "p95": 41.0, "n": 1}, "stand_in": {"p50": 87.0, "p95": 87.0, "n": 1}}


def test_the_next_reply_starts_where_it_first_plays_after_the_flush():
    """The ``next_reply`` scenarios' rule on timeline records (seconds)."""
    flushed = [{"event": "flushed", "t": 2.3}]
    speaking = lambda t: [{"event": "state", "t": t, "state": "speaking"}]  # noqa: E731
    assert bench.next_reply_start(speaking(1.0) + flushed + speaking(3.4) + speaking(3.9), 2.0) == (True, "", 3.4)
    assert bench.next_reply_start(speaking(1.0), 2.0) == (False, "the stop word did not flush the reply", 0.0)
    assert bench.next_reply_start(speaking(1.0) + flushed, 2.0)[:2] == (False, "no reply to the stop word played")


def test_a_reply_counts_as_flushed_on_its_own_echo_only_when_nobody_talked_over_it():
    """``later_replies.replies_flushed`` counted the stop word's own flush of the reply before the next reply
    (nine in every full run); only a flush of a reply nobody talked over counts (timeline seconds)."""
    speaking = lambda t: [{"event": "state", "t": t, "state": "speaking"}]  # noqa: E731
    users_flush = speaking(1.0) + [{"event": "flushed", "t": 2.3}] + speaking(3.4)
    assert not bench.self_flushed("next_reply", users_flush, 2.0)
    assert bench.self_flushed("next_reply", users_flush + [{"event": "flushed", "t": 5.0}], 2.0)
    assert bench.self_flushed("echo_only", speaking(1.0) + [{"event": "flushed", "t": 2.3}], 0.0)
    assert not bench.self_flushed("echo_only", speaking(1.0), 0.0)
    assert not bench.self_flushed("barge_in", users_flush, 2.0)  # the user's flush is the point there


def test_the_room_rings_out_with_the_echo_of_what_was_played():
    """``SimulatedRoom.ring_out``: once the speaker is silent the microphone still holds the echo path's tail of
    what was played; the same samples as a room ticking on with silence played, 30 ms delay and IR included."""
    from appliance.audio.room import RoomSpec, Scenario, SimulatedRoom, synthetic_ir

    played = np.random.default_rng(3).standard_normal(16000).astype(np.float32) * 0.1

    def room(silent_after: int):
        pos = [0]

        def read(n):
            x = played[pos[0]:pos[0] + n] if pos[0] < silent_after else np.zeros(0, np.float32)
            pos[0] += n
            return np.pad(x, (0, n - len(x)))

        return SimulatedRoom(Scenario([], RoomSpec(echo_gain_db=-6.0, echo_delay_ms=30.0,
                                                   impulse_response=synthetic_ir(150.0))),
                             read, lambda mic, far: None, on_event=lambda r: None, paced=False)

    a, b = room(8000), room(8000)
    for _ in range(50):  # 0.5 s played
        a.tick()
        b.tick()
    for _ in range(30):  # b: the room goes on with nothing played
        b.tick()
    tail = a.ring_out(0.3)
    assert len(tail) == 4800 and a.n == b.n
    assert np.array_equal(tail, np.concatenate(b.mic[50:]))
    assert np.sqrt(np.mean(tail[:480] ** 2)) > 0.01 > np.sqrt(np.mean(tail[-480:] ** 2))  # it rings, then decays
    assert len(a.mic) == 50 and len(a.output) == 50  # the scenario's own recordings are untouched


def test_the_canceller_a_scenario_hands_on_has_heard_its_room_ring_out(parts, embedded_cfg, tmp_path):
    """The benchmark's scenarios share their room's canceller, and a scenario ends wherever its check is met:
    in a real-time run (s14) 22 of 73 ended with a reply still playing (all 15 backchannels, 4 of 9 long
    barge-ins, 3 of 6 noises), and the session stopped there. Handed on as it was, the canceller had seen its
    far end play on while the echo stopped dead, which no room does, and Speex then suppressed the user's onset
    in later replies: the run's "Wait, I want ..." (en-gb, 0 dB, 0.9 s in), on a canceller carried from the room's
    first reply and such a scenario, was heard 98.4 ms after its onset, 34.4 ms with that scenario's tail fed
    (bit-exact offline replays of the run's recorded input).

    Here, with real parts and fixed renderings: a reply played whole, then one cut 0.24 s in, then that user
    0.9 s into the next reply. The canceller the benchmark hands on (:func:`bench.ring_out`) hears the user
    44.4 ms after the onset; handed on with no tail (the benchmark before s14), 76.4 ms (measured here)."""
    from appliance.audio.echo import FRAME, from_config
    from appliance.audio.files import first_above
    from appliance.audio.room import RoomSpec, Scenario, SimulatedRoom, synthetic_ir
    from appliance.bench.audio import fixed_speech

    far = fixed_speech(parts.tts, "A rainbow is an arc of colours in the sky. It appears when sunlight passes "
                                  "through drops of rain, and each drop splits the light like a small prism.")
    user = bench.AudioCache(tmp_path, parts.tts).speech(bench.LONG_INTERRUPTIONS[0], "en-gb+m3")
    gain = bench.USER_DBFS - bench.active_dbfs(far)  # the echo at the user's level (0 dB)
    ec = from_config(embedded_cfg)
    seg = VadSegmenter(SileroVad())

    def play(x: np.ndarray, seconds: float, at: int = -1) -> tuple:
        pos = [0]

        def read(n):
            y = x[pos[0]:pos[0] + n]
            pos[0] += n
            return np.pad(y, (0, n - len(y)))

        room = SimulatedRoom(Scenario([], RoomSpec(echo_gain_db=gain, echo_delay_ms=bench.ECHO_DELAY_MS,
                                                   impulse_response=synthetic_ir(bench.RT60_MS))),
                             read, lambda mic, f: None, on_event=lambda r: None, paced=False)
        onsets = []
        for i in range(int(seconds * 16000) // FRAME):
            room.tick()
            mic = room.mic[-1].copy()
            if at >= 0 and i * FRAME + FRAME > at:
                lo = max(i * FRAME, at)
                mic[lo - i * FRAME:] += user[lo - at:(i + 1) * FRAME - at]
            onsets += [e.t_sample + 512 for e in seg.push(ec.process(mic, room.output[-1])) if e.kind == "onset"]
        return room, onsets

    play(far, len(far) / 16000 + 1.0)  # a reply that ended by itself, and its echo's tail
    cut, _ = play(far, 0.24)  # the next, cut 0.24 s in: the scenario's session stopped there
    bench.ring_out(ec, cut)
    seg.reset()
    seg.use_gate(ec.near_end_present, ec.near_end_clear)
    lead = np.zeros(24000, np.float32)  # the next question's 1.5 s, nothing played
    at = len(lead) + int(0.9 * 16000)
    _, onsets = play(np.concatenate([lead, far]), at / 16000 + 0.6, at)
    onset = at + first_above(user, -40.0)
    assert onsets and onsets[0] >= onset - FRAME, onsets  # nothing on the echo before the user
    assert (onsets[0] - onset) / 16.0 <= 56.0
