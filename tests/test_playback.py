"""The playback buffer: fades, pause/resume without losing or repeating a sample, flush with no stale audio."""

import numpy as np

from appliance.playback import Playback


def ramp(n, start=0):
    # A signal whose every sample is distinct, so repeats and skips are visible.
    return (np.arange(start, start + n, dtype=np.float32) / 1e6) + 0.1


def collect(pb, blocks, n=160):
    return np.concatenate([pb.read(n) for _ in range(blocks)])


def test_plays_then_reports_drained():
    events = []
    pb = Playback(16000, on_event=lambda name, **i: events.append((name, i)))
    pb.begin_reply(1)
    pb.enqueue(1, ramp(1000), "Hello.")
    pb.end_reply(1)
    out = collect(pb, 10)
    np.testing.assert_array_equal(out[:1000], ramp(1000))
    assert ("drained", {"reply_id": 1}) in events


def test_pause_fades_within_one_block_and_resume_continues_exactly():
    pb = Playback(16000, fade_ms=8.0)
    pb.begin_reply(1)
    sig = np.full(16000, 0.5, dtype=np.float32)
    pb.enqueue(1, sig, "x")
    before = collect(pb, 10)  # 100 ms played
    pb.pause()
    fade = pb.read(160)
    assert fade[0] > 0.45 and fade[127] > 0 and np.all(fade[128:] == 0.0)  # 8 ms = 128 samples of fade, then silence
    assert np.all(np.diff(fade[:128]) <= 0)  # monotonic ramp: no click
    assert np.all(collect(pb, 20) == 0.0)  # paused: silence, nothing consumed
    pb.resume()
    after = collect(pb, 200)
    total = len(before) + np.count_nonzero(fade) + np.count_nonzero(after)
    assert total == len(sig)  # not a sample repeated or skipped


def test_flush_drops_everything_and_refuses_stale_audio():
    pb = Playback(16000)
    pb.begin_reply(1)
    pb.enqueue(1, np.full(16000, 0.5, np.float32), "First clause.")
    collect(pb, 10)
    pb.flush()
    out = collect(pb, 50)
    assert np.count_nonzero(out) <= pb.fade_samples  # only the fade-out, then silence
    # Audio of the flushed reply that TTS was still synthesising must never play.
    assert pb.enqueue(1, np.full(800, 0.5, np.float32), "Late clause.") is False
    assert not np.any(collect(pb, 10))
    pb.begin_reply(2)
    assert pb.enqueue(2, np.full(800, 0.5, np.float32), "New reply.")
    assert np.any(collect(pb, 10))


def test_spoken_text_counts_only_what_was_played():
    pb = Playback(16000)
    pb.begin_reply(1)
    pb.enqueue(1, np.full(8000, 0.5, np.float32), "Rainbows are light.")
    pb.enqueue(1, np.full(16000, 0.5, np.float32), "They have seven colours in a bow.")
    collect(pb, 50 + 50)  # all of the first clause, half of the second
    pb.pause()
    assert pb.spoken_text() == "Rainbows are light. They have seven"
    pb.flush()
    assert pb.spoken_text() == "Rainbows are light. They have seven"
