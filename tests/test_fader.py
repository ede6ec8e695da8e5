"""The one fader (audio/fader.py) that the sound-device worker and the pull ports share: pause, resume and
flush with a linear fade, no sample dropped or repeated across a pause, nothing of a flush played after it."""

import numpy as np

from appliance.audio.fader import FadeState, Fader, fade_samples


def ramp(n):
    # Every sample distinct, so a repeat or a skip shows.
    return (np.arange(n, dtype=np.float32) / 1e6 + 0.1).astype(np.float32)


def test_fade_samples_from_ms():
    assert fade_samples(16000, 8.0) == 128
    assert fade_samples(48000, 8.0) == 384
    assert fade_samples(16000, 0.0) == 1  # never zero: a fade of one sample is a cut


def test_plays_unfaded_and_reports_a_short_block():
    f = Fader(128)
    f.push(ramp(100))
    out, res = f.read(160)
    np.testing.assert_array_equal(out[:100], ramp(100))
    assert not out[100:].any()
    assert (res.taken, res.silent, res.short) == (100, False, 60)


def test_pause_fades_out_over_f_samples_then_holds_and_resume_fades_in():
    f = Fader(128)
    sig = np.full(4000, 0.5, np.float32)
    f.push(sig)
    before, _ = f.read(320)
    f.pause()
    out, res = f.read(320)
    assert res.taken == 128 and res.silent and res.short == 0
    assert f.state is FadeState.PAUSED and f.queued == 4000 - 320 - 128
    fade = out[:128]
    assert np.all(fade > 0) and np.all(np.diff(fade) < 0) and not out[128:].any()
    np.testing.assert_allclose(fade[[0, -1]], 0.5 * np.array([128 / 129, 1 / 129]), rtol=1e-5)
    held, res = f.read(320)
    assert not held.any() and res.taken == 0 and res.short == 0  # a pause is not an underrun
    f.resume()
    back, res = f.read(320)
    np.testing.assert_allclose(back[:128], 0.5 * np.arange(1, 129) / 128, rtol=1e-5)  # fade in from silence
    assert np.all(back[128:] == 0.5)
    rest, _ = f.read(4000)
    assert np.count_nonzero(before) + np.count_nonzero(fade) + np.count_nonzero(back) + np.count_nonzero(rest) == 4000


def test_pause_and_resume_neither_drop_nor_repeat_a_sample():
    f = Fader(64)
    sig = ramp(3000)
    f.push(sig)
    parts = []
    for step in range(40):
        if step in (3, 17):
            f.pause()
        if step in (9, 25):
            f.resume()
        if step == 18:  # a pause cut short by a resume, then paused again mid fade in
            f.resume()
        if step == 19:
            f.pause()
        if step == 22:
            f.resume()
        out, _ = f.read(100)
        parts.append(out)
    played = np.concatenate(parts)
    nz = played[played != 0]
    assert len(nz) == len(sig)  # every sample heard once, at a gain above zero
    # Unfaded stretches name their own index: in order, none repeated.
    exact = nz[np.isin(nz, sig)]
    assert np.all(np.diff(exact) > 0)


def test_pause_during_a_fade_in_fades_out_from_the_gain_it_reached():
    f = Fader(100)
    f.push(np.full(1000, 1.0, np.float32))
    f.pause()
    f.read(200)  # faded out, paused
    f.resume()
    f.read(40)  # fade in to gain 0.4
    assert abs(f.gain - 0.4) < 1e-5
    f.pause()
    out, res = f.read(200)
    assert res.silent and 0 < res.taken <= 41 and np.all(out[:res.taken] > 0) and np.all(out[:res.taken] < 0.4)


def test_flush_fades_out_then_drops_and_plays_on_at_full_gain():
    f = Fader(128)
    f.push(np.full(2000, 0.5, np.float32))
    f.read(160)
    f.flush()
    out, res = f.read(400)
    assert res.silent and res.taken == 128 and np.count_nonzero(out) == 128
    assert f.queued == 0 and f.state is FadeState.PLAYING and f.gain == 1.0
    f.resume()  # a resume after a flush changes nothing
    f.push(np.full(100, 0.25, np.float32))
    out, _ = f.read(100)
    assert np.all(out == 0.25)


def test_flush_while_paused_drops_at_once_and_resume_cannot_revive_a_flush():
    f = Fader(128)
    f.push(np.full(2000, 0.5, np.float32))
    f.pause()
    f.read(200)
    f.flush()
    assert f.queued == 0 and f.state is FadeState.PLAYING
    f2 = Fader(128)
    f2.push(np.full(2000, 0.5, np.float32))
    f2.flush()
    f2.resume()  # the flush's fade goes on
    out, res = f2.read(400)
    assert res.silent and np.count_nonzero(out) == 128 and f2.queued == 0


def test_an_empty_buffer_goes_silent_at_once_and_want_follows_the_state():
    f = Fader(128)
    assert f.want(160) == 160
    f.pause()
    assert f.want(160) == 128 and f.fade_need() == 128
    _, res = f.read(160)
    assert res.silent and res.taken == 0 and f.state is FadeState.PAUSED and f.want(160) == 0


def test_set_fade_changes_the_next_fade():
    f = Fader(128)
    f.push(np.full(3000, 0.5, np.float32))
    f.set_fade(320)
    f.pause()
    out, res = f.read(1000)
    assert res.taken == 320 and np.count_nonzero(out) == 320
