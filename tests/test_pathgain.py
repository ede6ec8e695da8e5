"""The echo path's gain followed from reply to reply (appliance/audio/pathgain.py), on the real Piper voice through
the simulated room, and Speex told of a volume step (EchoCanceller's follow_gain)."""

from __future__ import annotations

import numpy as np
import pytest

from appliance.audio.echo import FRAME, EchoCanceller, erle_db
from appliance.audio.pathgain import MAX_STEP_DB, MEASURE_S, MIN_STEP_DB, EchoGainFollower
from appliance.bench.audio import fixed_speech, through_room

RATE = 16000


@pytest.fixture(scope="module")
def replies(parts):
    """Two replies with 1.5 s of silence between them (1e-43, as a real far end between replies), and where the
    second starts."""
    first = fixed_speech(parts.tts, "A rainbow is an arc of colours in the sky. It appears when sunlight passes "
                                    "through drops of rain, and each drop splits the light like a small prism.")
    second = fixed_speech(parts.tts, "The moon is the only natural satellite of the Earth, and it turns around us "
                                     "about once a month.")
    gap = np.full(RATE * 3 // 2, 1e-43, np.float32)
    return np.concatenate([first, gap, second]), len(first) + len(gap)


def _mic(far, start, step_db, user=None):
    mic, _ = through_room(far, 0.0)
    mic = mic.copy()
    mic[start:] *= 10 ** (step_db / 20)  # the volume stepped in the gap (the first reply's echo has died away)
    if user is not None:
        mic[start : start + len(user)] += user[: len(mic) - start]
    return mic


@pytest.mark.parametrize("step_db", [6.0, -6.0, 3.0, 0.0])
def test_a_volume_step_between_replies_is_measured_at_the_next_reply(replies, step_db):
    far, start = replies
    mic = _mic(far, start, step_db)
    f = EchoGainFollower()
    got = [f.push(mic[i : i + FRAME], far[i : i + FRAME]) for i in range(0, len(mic) - FRAME + 1, FRAME)]
    returned = [(i * FRAME, g) for i, g in enumerate(got) if g is not None]
    (n, measured_db, fit, ok), = f.steps  # one measurement: the second reply's start (the first has no estimate)
    assert abs(n - (start + MEASURE_S * RATE)) <= 2 * FRAME
    assert abs(measured_db - step_db) < 0.3 and fit > 0.9, f.steps
    assert ok == (abs(step_db) >= MIN_STEP_DB)
    assert [g for _, g in returned] == f.steps  # returned when made, applied or not
    assert abs(returned[0][0] + FRAME - n) <= FRAME  # (in the frame that ended the measurement)
    assert not ok or abs(20 * np.log10(returned[0][1].factor) - step_db) < 0.3


def test_a_user_over_the_replys_start_is_not_taken_for_a_step(parts, replies):
    """Least squares against the far end's prediction: the user's speech, not correlated with the far end, only
    makes the fit worse; over the measured 150 ms at the echo's level, nothing changes."""
    far, start = replies
    user = fixed_speech(parts.tts, "Wait, I want to ask something else.")
    user *= np.sqrt(np.mean(far[start : start + RATE] ** 2) / np.mean(user[:RATE] ** 2))
    mic = _mic(far, start, 0.0, user)
    f = EchoGainFollower()
    got = [f.push(mic[i : i + FRAME], far[i : i + FRAME]) for i in range(0, len(mic) - FRAME + 1, FRAME)]
    assert [g for g in got if g is not None] == f.steps and not any(g.applied for g in f.steps), f.steps
    (_, measured_db, fit, ok), = f.steps  # it was measured, and left alone
    assert not ok and (fit < 0.5 or abs(measured_db) < 2.0), f.steps


def test_steps_that_would_take_the_total_past_its_bound_are_refused(replies):
    """Four +6 dB steps in a row: the first three are applied (+18 dB), the fourth would make +24 dB, more than any
    volume knob's step from where Speex adapted (MAX_STEP_DB), and is measured but left alone."""
    far, start = replies
    gap_and_second = far[start - RATE * 3 // 2:]
    far = np.concatenate([far] + [gap_and_second] * 3)
    mic, _ = through_room(far, -20.0)  # (quiet enough that +24 dB does not clip)
    mic = mic.copy()
    for k in range(4):  # each reply after the first 6 dB louder than the one before
        mic[start + k * len(gap_and_second) - RATE // 2:] *= 10 ** (6.0 / 20)
    f = EchoGainFollower()
    got = [f.push(mic[i : i + FRAME], far[i : i + FRAME]) for i in range(0, len(mic) - FRAME + 1, FRAME)]
    assert [round(db) for _, db, _, _ in f.steps] == [6, 6, 6, 6], f.steps
    assert [ok for *_, ok in f.steps] == [True, True, True, False]
    assert sum(g is not None and g.applied for g in got) == 3 and abs(f.total_db - 18.0) < 1.0 and f.total_db < MAX_STEP_DB


@pytest.mark.parametrize("step_db", [6.0, -6.0])
def test_speex_told_of_a_volume_step_cancels_the_next_reply_at_once(replies, step_db):
    """Without it Speex re-learns the step over seconds (the second reply's first second: 10-25 dB of ERLE, measured
    here); told, it cancels as before the step. The reply's first 150 ms are held back while the step is measured."""
    far, start = replies
    mic = _mic(far, start, step_db)

    def run(follow):
        ec = EchoCanceller("speex", noise_suppression=True, gate_db=-10.0, follow_gain=follow)
        out = np.concatenate([ec.process(mic[i : i + FRAME], far[i : i + FRAME])
                              for i in range(0, len(mic) - FRAME + 1, FRAME)])
        assert len(out) == len(mic) // FRAME * FRAME  # what was held back came out
        return ec, out

    second = slice(start, start + RATE)
    ec, out = run(True)
    _, before = run(False)
    assert [round(db) for _, db, _, applied in ec.gain_measurements if applied] == [round(step_db)]
    told, untold = erle_db(mic[second], out[second]), erle_db(mic[second], before[second])
    assert told >= 30.0 and told - untold >= 8.0, (told, untold)
