"""Acoustic echo cancellation of the appliance's own voice on the microphone path, around a maintained
canceller: Speex's MDF canceller with its preprocessor's residual echo suppression (through ``pyaec``, the
default) or WebRTC's AEC3 (through the ``livekit`` package's ``rtc.AudioProcessingModule``). Both take
10 ms frames at 16 kHz.

Why Speex by default (measured here, Piper speech through a 30 ms + RT60 150 ms echo path at 0 and +6 dB
above the user's voice): AEC3 cancels more (ERLE 40–59 dB) and never let the echo through to the VAD, but
its suppressor holds back the first 100–200 ms of the user's speech while the far end is active, so a
barge-in was detected 110–190 ms late (p50–p95); Speex with the onset gate (:meth:`near_end_present`)
detected it 70–125 ms after onset with no false onsets (32 ms VAD hop).

The onset gate (measured here on the bench's scenarios): the output/input energy ratio of the VAD window
is about −33 dB on echo alone, but the canceller falls behind for a window now and then and the ratio of
such a window reached −15 dB in real time (one self-interrupt at +6 dB echo with a −15 dB threshold),
while a user's first phoneme under louder echo sits at −22 to −15 dB for 20–80 ms. So a window passes at
``gate_db`` (−10 dB) at once, or within ``GATE_SOFT_DB`` of it in two consecutive checks 16 ms apart (the
echo's excursions last one window, a user's onset does not); the threshold is raised while the canceller
is unconverged (:meth:`EchoCanceller.gate_threshold_db`). A second test looks above 2 kHz only, where a
user's consonants stand out from a cancelled echo long before the user's vowel does, and a strong form of
it passes a high band that is mostly not echo even where it is quieter than usual, as a nasal's or a quiet
"st"'s is under louder echo (see :meth:`EchoCanceller.near_end_present`).

An output frame more than ``OVER_DB`` louder than its input is the filter's own estimate of an echo that
is not there (after double talk, or when the echo path goes away): it is scaled down to the input, and the
onset gate stays shut over it (:func:`_never_louder`).

Cold start. Speex's adaptive filter needs seconds of the appliance's own speech to converge (2.5-3.5 s of
a Piper reply here), and until it has, its output/input ratio cannot tell the user from the echo: the
first reply after a start paused itself on its own voice. So convergence is measured, not assumed: per
band (``BAND_EDGES_HZ``), over the frames in which the far end played in that band, the echo floor
(:meth:`EchoCanceller.band_floors_db`) and the echo path's gain (:meth:`EchoCanceller.band_return_loss_db`,
to tell a band with no echo from an unconverged one). A window whose energy sits in bands not shown
converged is cold (:meth:`EchoCanceller.is_cold`) and, before the first convergence, never passes the
Speex onset gate. Until every band has converged (:meth:`EchoCanceller.converged`), WebRTC AEC3 stands in
(:attr:`EchoCanceller.stand_in_active`): it processes the same frames and serves the VAD and the gate; its
suppressor keeps our echo out from its first frame, and holds back a user's onset. Then Speex takes over
once convergence has held through 0.5 s of far end (``HANDOVER_FAR_FRAMES``) and only within the first
20 s of far end (``HANDOVER_DEADLINE_FAR_FRAMES``): on a drifting, clipping speaker the floors look converged for
moments, and Speex taken over at such a moment passed its own echo (sessions 16-17, docs/measurements.md); a path it
has not learnt by then keeps the stand-in. And where Speex loses the echo after the hand-over (the median ERLE
of its newest 2 s of reply under 20 dB, or of a new reply's first 300 ms under 14 dB, and what it leaves following
the far end's level, or two pauses within 3 s on onsets that were not speech with the 300 ms before each lost so:
:meth:`EchoCanceller.note_false_onset`), the stand-in serves again, for good (:meth:`EchoCanceller._watch_loss`); it is kept beside Speex
for that, fed while the far end plays. A new reply whose start the gain follower fitted poorly (a changed echo path,
or a user over it) holds Speex's gate until that reply's first 300 ms are judged.
A new echo path (a device reopened, a reload) gets a new canceller.
A first reply too short for Speex to converge on (1-1.5 s) is not wasted: in the silence after it, a second
Speex adapts on it and its echo three times over, and where the floors of a fourth pass show convergence it serves,
with the strict gate of the hand-over's first seconds, in AEC3's place from the next reply's first frame until the
live Speex hands over (data reuse,
:meth:`EchoCanceller._advance_reuse`); without it the next reply's first second was AEC3's, and a user barging in
there was heard 100-1080 ms late (measured here, offline, ``tools/standin-eval``). Just after the hand-over,
Speex's onset gate is stricter for 2 s of the reply of the hand-over and never passes a window far quieter than the echo's
usual level: a freshly converged Speex's residual still sounds like speech to Silero (see
:meth:`EchoCanceller.near_end_present`). A chime at start-up was
measured as the other cure and rejected: Speex converged on the chime's bands reads as converged while speech bands are not,
and a noise burst left the filter worse for speech than no sound at all.

The far end is what the output callback actually played; the near end is the microphone. On the
simulated room the far-end block handed with each microphone block is exactly the block that was played
at that instant. On sound devices it is what the worker's output callbacks played (after its fader),
paired with the microphone by sample count on the device's clock
(:class:`appliance.audio.device.host.FarEnd`), so the echo stays a constant delay behind it (32.7 ms in
the 48 kHz JACK room, measured here) whatever the output ring holds; that delay and any clock drift
between the two devices are left to the canceller (Speex models ``tail_ms`` of echo path; AEC3
estimates the delay; nothing calls :meth:`EchoCanceller.set_delay_ms`).

Clock drift (measured here, the 48 kHz JACK room at +300 ppm with the clipping speaker, the service's own
streams replayed offline through this canceller): the echo's delay behind the far end wandered 29.7-35.6 ms
and moved 0.2-1.4 ms over each silence between replies. Speex never showed convergence, so AEC3 served; adapted
on the reply before, it removed only 2-23 dB of a reply's first second, and the replies paused themselves
there. So AEC3 starts afresh when the far end returns after a second of silence
(:meth:`EchoCanceller._restart_due`): 34-43 dB over every reply's first second. Tried and not kept, on the
same streams: ``set_stream_delay_ms(33)`` (ERLE over the echo-only frames 22.3 -> 22.0 dB: AEC3 keeps its own
estimate), feeding AEC3 through the silences (22.2 dB), and a far end delayed by the echo delay's change as
cross-correlation measured it causally, 0.3-0.5 s windows (21.4-26.9 dB: a reply's new delay is known only
from its echo; the same with the change known in advance: 49.0 dB).

Why Speex never shows convergence there (measured here, offline, the tests' Piper reply three times through
30 ms + RT60 150 ms): two causes, each enough alone. A linear speaker with +300 ppm of constant drift left its
floors at -3.7 dB (1-2 kHz) and -2.3 dB (above 2 kHz), against the -24 dB of the hand-over; with the far end
resampled by the same known ratio the hand-over came at 3.1 s, as at 0 ppm. A clipping speaker (``tanh(2x)/2``)
at 0 ppm left them at -14 and -17 dB, and re-aligning the far end changed nothing there. On a live JACK tap
(+300 ppm, clip) the echo's delay was measured to 0.4 samples rms (0.5 s windows, the room's 60 s wander fitted),
and the far end re-aligned by it still gave no hand-over (floors -6.7 dB at 1-2 kHz). So a drift compensator
would bring Speex back on a linear speaker that drifts, but not on one that clips.

Both together (``echo.follow_drift`` and ``echo.speaker_curve: auto``, experimental, off by default; session 23,
measured here): the far end Speex gets is kept on the microphone's clock by
:class:`appliance.audio.delay.DriftFollower` and passed through a soft-clipping curve (:func:`_curve`), one of
``SPEAKER_DRIVES`` chosen by Speex's own residual from a cold start (:meth:`EchoCanceller._try_curves`); the
AEC3 stand-in keeps the far end as played. Offline, the tests' reply three times through ``clipping_room``
(``tanh(2x)/2``, +300 ppm): the third reply's ERLE 6.3 dB as played, 20.0 following the drift, 25.7 with the
curves too (1.5 chosen), 28.0 with the room's own curve; a linear speaker keeps the linear curve (35.3 -> 36.0).
On the live JACK room, whose drift wanders (a 60 s sine) over the silences between replies, Speex handed over
(48 s) and the follower, measuring each reply afresh, kept the echo aligned; but in ten echo-only replies at
each of 0 and +6 dB 19 of 20 paused on their own voice (6 flushed), ERLE 13.5 dB: on that speaker Speex, re-timed
and curved, still loses the echo for moments (windows where it removed some 5 dB), at reply starts and within
replies (docs/measurements.md, sessions 19 and 23). Hence off by default.

The stand-in's bypass (:meth:`EchoCanceller.over_echo`). While the stand-in serves through whole replies (Speex
never converges at +300 ppm with the clipping speaker), AEC3's suppressor, fresh at each reply, took 35-40 dB of a
user's first 100-250 ms (measured here, the 48 kHz JACK room, the service's own streams replayed offline: Silero
scored AEC3's output 0.02-0.1 over "Hold on." while Speex's output scored it 0.85 at 40 ms; Speex's output was no
evidence either, its residual scored as speech all through the replies). So the far end itself predicts the
echo: per band, the far end's energy smeared by the room's decay and delayed 20-50 ms, times the echo path's gain
measured as the floors are (the microphone over the prediction, last 2 s of far end), plus the room's noise. A
band more than ``OVER_ECHO_DB`` over it (the high band ``OVER_ECHO_HB_EXTRA_DB`` more) in two frames running is
the user's: where AEC3 took ``OVER_ECHO_SUPPRESSED_DB`` or more of such a frame, the microphone goes to the VAD
in its place, and the onset gate passes. Measured here, offline, on 17 barge-ins of one JACK run (+300 ppm,
clip): onset -> the window that fired p50 / p95 / max 60 / 212 / 248 ms -> 60 / 111 / 139 ms; on 18 recorded
runs' streams with 200+ echo-only replies (0 and +300 ppm), the same echo onsets as without it (see
docs/measurements.md). Tried and not kept: Silero on Speex's output (86+ echo windows passed at any setting fast
enough), the microphone served for 250 ms after a pass (6 echo onsets in 29 replies instead of 1), a slower decay
(RT60 400 ms: p95 139 ms). The decay is the bench room's (RT60 150 ms), or the room's own where it is measured
slower (below).

What the live bench showed of it (session 14, the JACK room at +300 ppm with the clipping speaker; each
barge-in's trace, ``barge_in_cases`` of ``appliance bench interruption --room jack``): in 16 barge-ins over 4
runs (1024- and 512-frame periods) the stand-in served every one (onset -> the window that fired p50 / p95 131 /
204 ms), and the slow ones were AEC3's suppressor. It kept what went to the VAD 20 dB or more under the
microphone for the user's first 0-170 ms (p50 70 ms; Silero scored it 0.01-0.05 there). The microphone rose
over the far end's predicted echo by the bypass's margin in 12 of the 16, but mostly where AEC3 had already
let the user through or taken less than 20 dB: the bypass served the microphone in 3. In 8 of them AEC3's own
gate refused a window that Silero scored 0.5 or more and whose microphone stood over that prediction, AEC3
having taken 11-20 dB of it (16-30 ms each). Letting the gate pass on the bypass's test there (without the
20 dB): offline, the same onsets for 38 barge-ins through the tests' drifting, clipping room, and 3 more echo
onsets in 9 recorded JACK runs; not kept. In a fifth run (that variant) a user as loud as the echo was refused
twice as explained (:meth:`_echo_explained`), 32 ms.

A more reverberant room (RT60 300 ms, the echo 6 dB over what is played: a user's room). AEC3's linear filter
covers about 50 ms of the echo path past its delay (its default length, 13 blocks of 64 samples, as WebRTC's
EchoCanceller3Config sets it; not measured here), and there it removed only 8-10 dB of some windows of the
first reply, most of them right after the silence between two pieces of the reply, and its gate passed them;
and the echo's tail rang on past the 200 ms that the gate took the far end to be recent. So (measured here,
offline, 34 first replies with the product's piece gaps: 9 paused, 0 now; see
:meth:`EchoCanceller._echo_explained`):

- the room's decay is measured in the far end's silences (:attr:`EchoCanceller.tail_decay_db`), and in a
  silence the tail is predicted from the microphone's own bands at its start; the gate holds until a band
  rises over that prediction or it has decayed 60 dB (:meth:`EchoCanceller._tail_test`);
- while the stand-in serves, a window that the far end's predicted echo explains in every band is refused
  whatever AEC3 left of it (:meth:`EchoCanceller._echo_explained`).

Measured here (x86_64, 2 cores, linear echo path, Piper speech as far end): see ``appliance bench
interruption`` (``erle_db``) and ``tests/test_echo.py``.

Why one module over 500 lines: the onset gate, the cold-start bookkeeping and the stand-in all read the
per-frame energies (broadband, per band, far end) that :meth:`EchoCanceller.process` computes once per
10 ms frame; split apart, each would recompute them or reach into another's fields.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Optional

import numpy as np

from ..errors import UserError
from .delay import DriftFollower
from .pathgain import EchoGainFollower
from .files import MODEL_RATE

FRAME = 160  # 10 ms at 16 kHz: the frame both libraries require
FAR_SILENT = FRAME * 10 ** (-100 / 10)  # a far-end frame's energy at or under this (-100 dBFS) is silence: on real
#   streams the capture path's resampler leaves values of 1e-43 between replies, not zeros (see process)
FAR_ACTIVE = 10 ** (-50 / 10)  # mean far-end power above which a frame counts as "far end active" (−50 dBFS)
LT_FRAMES = 200  # the echo floor's memory: 2 s of far-active frames
FLOOR_LAG_FRAMES = 30  # ... but the newest 300 ms, where a user's onset would be (see _floor_db)
FLOOR_HOLD_FRAMES = 10  # after the gate passed: the frames kept out of the floors while the pause takes hold
GATE_MARGIN_DB = 12.0  # onset gate: at least this far above the echo floor (echo-only windows that the VAD took
# for speech sat up to 12 dB above it, p95 9 dB, in 10 offline runs of Piper replies at 0/+6 dB, measured here)
GATE_SOFT_DB = 6.0  # ... or within this of it in two consecutive checks (see near_end_present)
GATE_MAX_DB = -6.0  # ... and never stricter than this (the user at least a quarter of the microphone's energy)
GATE_NO_FLOOR_DB = -8.0  # ... and this, with no soft pass, before the echo floor is known (see near_end_present)
OVER_DB = 3.0  # ... and at most this: an output louder than the input is the canceller's own estimate (_never_louder)
HB_HZ = 2000.0  # the high band of the second test: fricatives and bursts live there, a vowel's energy does not
HB_GATE_DB = -16.0  # high-band test: output/input energy ratio above HB_HZ at least this (an echo-only window
#   reached -16.8 dB in real time and paused the reply when this was -20; users' first windows: -16 to +3 dB) ...
HB_MARGIN_DB = 22.0  # ... and at least this far above the high band's own echo floor (a distorting speaker's)
HB_MAX_DB = -6.0  # a threshold above this (a floor above -28 dB: the canceller leaves much of the high band) turns it off
HB_MIN_POWER = 10 ** (-80 / 10)  # ... over a high band with at least this mean power per sample (−80 dBFS)
HB_MIN_REL_DB = -10.0  # ... and at most this far below the microphone's usual high band while the far end plays
HB_STRONG_DB = 10.0  # the strong high-band test (Speex, converged): the high band's ratio this far above its threshold
HB_STRONG_MIN_REL_DB = -18.0  # ... over a high band at most this far below its usual level (a nasal "No." starts at
#   -13 to -17 dB under louder echo) ...
HB_STRONG_MIN_RATIO_DB = -22.0  # ... and a broadband ratio at least this (see EchoCanceller._hb_strong_deficit_db) ...
HB_STRONG_HELD_MIN_RATIO_DB = -30.0  # ... or at least this, where the window HB_STRONG_HELD_FRAMES earlier passed too
HB_STRONG_HELD_FRAMES = 2  # ... 20 ms earlier: about one VAD hop (16 ms), in whole frames
CLEAR_SOFT_FRAMES = 2  # near_end_clear's soft broadband pass: the window this many frames (20 ms) earlier within
#   GATE_SOFT_DB of the threshold too (see near_end_clear)
HB_SURE_DB = 6.0  # the onset gate (a window the VAD took for speech): the strong test's high band this far above its
#   threshold is enough, with no broadband condition (see EchoCanceller._hb_strong_deficit_db)
DEEP_FLOOR_MAX_DB = -34.0  # the onset gate's deep form (EchoCanceller._deep_pass): only where the echo floor is this
#   low (Speex removes at least 34 dB of its echo) ...
DEEP_MARGIN_DB = 20.0  # ... a window this far above the floor ...
DEEP_HB_MIN_DB = -36.0  # ... with a high-band ratio at least this (the cancelled echo's high band sits near -45 dB) ...
DEEP_PRE_FRAMES = (10, 20)  # ... and where Speex's residual just before, the 20 frames that ended 10 frames (100 ms)
#   earlier (before a user's onset that the gate has refused for up to 90 ms), ...
DEEP_PRE_DB = 10.0  # ... sat at most this far above the floor: after a volume step the whole reply's residual is up
DEEP_LEVEL_MAX_DB = 3.0  # ... and its newest 20 ms at most this far above the microphone's usual level (and at most
#   -GATE_MIN_LEVEL_DB under it): a loud moment of the echo is where Speex's residual jumps
GATE_MIN_LEVEL_DB = -18.0  # Speex's broadband test: the window's newest LEVEL_SAMPLES at most this far below the
#   microphone's usual level while the far end plays (EchoCanceller.level_db; see near_end_present)
LEVEL_SAMPLES = 2 * FRAME  # ... measured over the newest 20 ms of the VAD window, where a user's onset is
STRICT_FRAMES = LT_FRAMES  # after the hand-over, Speex's broadband gate is strict (GATE_MAX_DB, no soft pass) for
#   this many far-active frames (2 s of the reply: a whole echo floor's memory); see near_end_present ...
NEW_REPLY_FRAMES = 20  # Speex's gate is strict (as STRICT_FRAMES) for a reply's first 200 ms of far end after a
#   second's silence (_restart_due): the echo's gain may have changed over the silence (see near_end_present)
STRICT_GAP_FRAMES = 100  # ... within the reply of the hand-over: a far-end silence this long (1 s) ends it
AEC3_MIN_LEVEL_DB = -25.0  # ... and for WebRTC AEC3's broadband test (the stand-in, or echo.backend webrtc): the
#   whole VAD window at most this far below that level (see EchoCanceller._too_quiet)
BAND_EDGES_HZ = (0.0, 500.0, 1000.0, HB_HZ, MODEL_RATE / 2 + 1)  # the bands whose convergence is measured one by one
FAR_BAND_ACTIVE = 10 ** (-65 / 10)  # mean far-end power per sample in a band above which the band counts as played
COLD_DB = GATE_MAX_DB - GATE_MARGIN_DB  # a window whose expected residual echo is above this is "cold" (-18 dB):
#   the broadband threshold (floor + margin) would exceed its cap, so the ratio cannot tell the user from the echo
NO_ECHO_DB = -40.0  # a band whose microphone energy stays this far under the far end's has no echo to cancel
#   (headphones, a speaker in another room): echo there would sit 60 dB under a -20 dBFS reply, under Silero's notice
WARM_DB = COLD_DB - 6.0  # ... and every band's floor at or below this (-24 dB) hands over from the stand-in
HANDOVER_FAR_FRAMES = 50  # ... once it has held through this many far-active frames (0.5 s) in a row: on a drifting,
#   clipping speaker the floors touched -24 dB for a moment, and Speex took over and passed its own echo (session 16)
HANDOVER_DEADLINE_FAR_FRAMES = 2000  # ... and only within this many far-active frames (20 s) of a new canceller: the
#   simulated rooms' Speex converged within 3.4-5.4 s of far end; on the JACK room's drifting, clipping speaker it
#   had not after 300 s (its high band's floor -8 dB), and then looked converged for 0.7 s at a +6 dB volume step,
#   took over and paused 47 of the next 50 replies (session 17). A path Speex has not learnt by then is one it
#   cannot model: the stand-in serves on, until the next new echo path (a device reopened, a reload). Counted
#   over the far-active frames that stayed in the floors: those of a user's onset, which the gate passed, do not
#   count (_keep_onset_out), so an owner who barges in on every early reply does not use it up.
LOST_FRAMES = 200  # Speex lost the echo (EchoCanceller._watch_loss): judged over its newest this many far-active frames
#   (2 s) after the hand-over, a passed onset's too (unlike the floors: the echo that passes the gate is the evidence) ...
LOST_ERLE_DB = 20.0  # ... where the median of their per-frame ERLE (microphone over Speex's output, 10 ms) is under
#   this (a converged Speex: 30-38 dB on the JACK room at 0 ppm) ...
LOST_CORR = 0.5  # ... and the levels of Speex's output and of the microphone both follow the far end's: the correlation
#   of their per-frame dB with the far end's (the loudest of OVER_ECHO_DELAY_FRAMES earlier: its echo), at least this.
#   What is left is then our own echo, not a user or a noise over it (those leave the median under 20 dB too, but do
#   not follow the far end), nor an echo path gone away (the microphone does not follow the far end then).
#   Measured here, offline, on session 25's taps of the 48 kHz JACK room: where Speex had handed over on the
#   drifting, clipping speaker (+300 ppm) and lost the echo 1.4 s later, windows with the median under 20 dB
#   followed the far end at 0.60-0.78 (p5-p95; the microphone 0.67 or more), and the test held 3.6 s after the
#   hand-over; at 0 ppm (two full suites, one 50-reply echo-only run, 6400 windows of 2 s) the median went under 20 dB
#   only under the bell's and the music's noise over a reply, what was left following the far end at 0.27 at most.
LOST_REPLY_FRAMES = 30  # ... or over a new reply's first this many far-active frames (300 ms), all served by Speex,
LOST_REPLY_ERLE_DB = 14.0  # ... the median under this (and LOST_CORR as above). Measured here, offline, on the taps
#   of six 0 ppm JACK runs (430 reply starts that Speex served, barge-ins and noises included): the median over a
#   reply's first 300 ms was 18.1 dB at the lowest; on three session 27 path-change runs, the replies after the change
#   and before the 2 s test's hand-back: 6.2-15.2 dB (docs/measurements.md, session 28)
FALSE_ONSET_WITHIN_FRAMES = 300  # Speex lost the echo in the middle of a reply (EchoCanceller.note_false_onset): two
#   pauses that resumed as "not speech" within this many frames (3 s), each with the newest LOST_REPLY_FRAMES of
#   far end lost as a reply's start is judged (LOST_REPLY_ERLE_DB, LOST_CORR). Measured here, offline, session 29: at
#   the live "not speech" resumes of eight healthy 0 ppm JACK runs, one of 35 had such frames, never two within 3 s;
#   on five runs whose speaker turned clipping and drifting in the middle of a reply, the 2nd-4th resume after the
#   change had them, two within 3 s on four of the five, 1.6-1.9 s after the change, against 2.8-7.8 s for the 2 s test
DOUBT_FIT = 0.7  # a new reply whose start the gain follower fitted under this (EchoGainFollower's fit: the share of
#   the microphone its prediction explains) is in doubt: Speex's gate is held until LOST_REPLY_FRAMES are judged.
#   Measured here, offline: 15 of 505 reply starts that Speex served on healthy JACK runs (a user or noise there, or no
#   echo path) fitted under it; the replies after a path change into clipping and drift 0.02-0.65
SPEAKER_DRIVES = (0.0, 1.5, 3.0)  # the speaker's curves tried from a cold start (speaker_drive; 0: linear; see _try_curves)
CURVE_WINDOW_FAR_FRAMES = 200  # ... their residuals compared over the newest 2 s of far-active frames ...
CURVE_MIN_FAR_FRAMES = 300  # ... from 3 s of them on ...
CURVE_MAX_FAR_FRAMES = 1500  # ... until 15 s of them, or the live Speex's hand-over ...
CURVE_MIN_GAIN_DB = 1.5  # ... and the best takes over where it left at least this much less than the live one
_HANN = np.hanning(FRAME).astype(np.float32)
_FREQS = np.fft.rfftfreq(FRAME, 1.0 / MODEL_RATE)
N_BANDS = len(BAND_EDGES_HZ) - 1


def _band_matrix(edges) -> np.ndarray:
    """float64 [bins, bands]: 1 where an FFT bin of a frame (``_FREQS``) falls in a band of ``edges`` (Hz, ascending)."""
    of_bin = np.digitize(_FREQS, edges[1:-1])
    return (of_bin[:, None] == np.arange(len(edges) - 1)[None, :]).astype(np.float64)


_BAND_MATRIX = _band_matrix(BAND_EDGES_HZ)
BACKENDS = ("webrtc", "speex")
UNBANDED_FRAMES = 64  # idle frames whose bands are computed when read: as many as the per-frame lists keep
BYPASS_REWARM_FRAMES = 20  # the bypassed frames Speex processes when it is needed again (EchoCanceller._rewarm)
BYPASS_AFTER_FRAMES = 300  # ... and none before Speex has processed this many frames (3 s) since it was built: its
#   preprocessor's noise estimate learns the room first, so a cold start (the question often comes within the first
#   seconds, and the first reply after it is the one most at risk of pausing itself) runs exactly as with no bypass
OVER_ECHO_DB = 15.0  # the stand-in's bypass (EchoCanceller.over_echo): a band of the microphone this far above the echo
#   the far end predicts (and the room's noise), in two consecutive 10 ms frames, is the user's, not our echo ...
OVER_ECHO_HB_EXTRA_DB = 10.0  # ... and this much further in the high band (>= HB_HZ), where a clipping speaker's
#   harmonics sit over a far end that has little there: echo alone reached 17 dB over the prediction
OVER_ECHO_DELAY_FRAMES = (2, 6)  # ... the echo predicted from the far end 20-50 ms earlier (the loudest of them) ...
OVER_ECHO_DECAY_DB = 4.0  # ... smeared by the room's decay, dB per 10 ms frame (RT60 150 ms) ...
OVER_ECHO_NOISE_FRAMES = 300  # ... plus the room's noise: the 5th percentile of the microphone's bands over these frames,
OVER_ECHO_FLOOR_DB = -30.0  # ... or this far under the band's usual level while the far end plays, if that is more
OVER_ECHO_SUPPRESSED_DB = 20.0  # ... and only in a frame that AEC3 took at least this much of (its suppressor at work)
OVER_ECHO_NEW_FRAMES = 50  # the first far-active frames of a reply (the far end back after RESTART_SILENCE_S) ...
OVER_ECHO_NEW_DB = 6.0  # ... need this much more: the echo's level may have changed over the silence (a volume step)
OVER_ECHO_BAND_EDGES_HZ = BAND_EDGES_HZ  # the bands in which over_echo predicts the echo (nested in BAND_EDGES_HZ's;
#   _echo_explained sums them back into those). Its own constant because finer bands hear a user sooner: measured here,
#   offline (tools/standin-eval, full, 272 barge-ins 0.2-0.6 s into a reply after a short one, all on the stand-in),
#   16 bands (250 Hz under 2 kHz) missed 22 instead of 47, p50 146.5 vs 168.4 ms, with 0 echo onsets; but the tests'
#   clipping, drifting room stood up to 25 dB over their prediction at 1-2 kHz on echo alone (16.9 dB over these 4)
#   and paused 18 of 36 echo-only replies, and a fixed extra margin there made 1 case of 272 slower (171 -> 699 ms).
#   Not changed until a per-band margin that adapts to the room is measured (docs/measurements.md, session 15).
_OE_MATRIX = _band_matrix(OVER_ECHO_BAND_EDGES_HZ)
N_OE_BANDS = len(OVER_ECHO_BAND_EDGES_HZ) - 1
_OE_HB = np.asarray(OVER_ECHO_BAND_EDGES_HZ[:-1]) >= HB_HZ  # the prediction's bands in the high band (>= HB_HZ)
_OE_BROAD = np.digitize(np.asarray(OVER_ECHO_BAND_EDGES_HZ[:-1]), BAND_EDGES_HZ[1:-1])  # each one's BAND_EDGES_HZ band
TAIL_DECAY_DB = 1.0  # the echo's tail (EchoCanceller.tail_decay_db): its decay, dB per 10 ms frame, before any is
#   measured (RT60 600 ms: a longer room than most, so the tail is held too long rather than too short) ...
TAIL_DECAY_RANGE_DB = (1.0, 6.0)  # ... and the measured decay kept within this (RT60 600 down to 100 ms) ...
TAIL_ANCHOR_FRAMES = 5  # ... measured and predicted from this many frames after the far end stopped (past the echo's
#   delay, 20-50 ms: the tail is anchored on the loudest of the microphone's bands over those frames) ...
TAIL_FIT_FRAMES = 40  # ... measured over at most this many frames after them ...
TAIL_FIT_SPAN_DB = 40.0  # ... while the microphone is at most this far under its level at the anchor ...
TAIL_FIT_MIN_FRAMES = 5  # ... in silences that gave at least this many such frames ...
TAIL_SILENCES = 8  # ... the median of the last this many silences' decays
TAIL_FAR_SILENT = 10 ** (-75 / 10)  # mean far-end power per sample under which a frame counts for the measurement,
#   and may break the tail (see EchoCanceller._follow_tail)
TAIL_MARGIN_DB = 10.0  # a band of the microphone this far above the tail predicted there is not the tail
TAIL_LENGTH_DB = 60.0  # the tail is over once the prediction has decayed this far from its anchor ...
TAIL_MAX_FRAMES = 60  # ... or after this many frames of silence (before UNBANDED_FRAMES: the bands of idle frames are
#   not computed, so the tail must be over before a silence can become idle)
TAIL_MIN_POWER = 10 ** (-85 / 10)  # mean power per sample under which a band cannot break the tail
EXPLAINED_DB = 6.0  # the stand-in's gate: a window whose every band sits within this of the echo the far end predicts
#   there (over_echo's prediction) is our own echo, whatever AEC3 left of it (EchoCanceller._echo_explained)
REUSE_PASSES = 3  # data reuse (EchoCanceller._advance_reuse): while Speex has not shown convergence, a second Speex
#   adapts on the cold frames kept (the replies played so far and their echo) this many times over, then once more
#   while its residual is measured (measured here, offline, the simulated room at 0 and +6 dB, Speex without its
#   preprocessor: a 0.8-1.5 s first reply adapted on 3 times left 16.4-22.5 dB of ERLE on the next reply's first
#   0.5 s, against 8.0-15.1 dB adapted on once and 25.2-25.6 dB after a 3.6 s reply; docs/measurements.md) ...
REUSE_RING_FRAMES = 500  # ... the cold frames kept: the newest 5 s that Speex processed before the hand-over ...
REUSE_MIN_FAR_FRAMES = 50  # ... with at least this many far-active frames among them (0.5 s of reply) ...
REUSE_SPEED = 20  # ... processed at this many frames per live frame (all four passes over 5 s of frames: 1 s of silence)
RESTART_SILENCE_S = 1.0  # AEC3 (the backend or the stand-in) starts afresh when the far end returns after this long
#   a silence (see EchoCanceller.restart_after_silence_s)


def _to_i16(x: np.ndarray) -> np.ndarray:
    return (np.clip(x, -1.0, 1.0) * 32767.0).astype(np.int16)


class _WebRtcAec3:
    """WebRTC audio processing (AEC3, optional noise suppression and high-pass filter) via livekit."""

    def __init__(self, noise_suppression: bool, high_pass_filter: bool):
        try:
            from livekit import rtc
        except ImportError:
            raise UserError("echo.backend is webrtc but the `livekit` package is not installed; "
                            "run `pip install livekit` (or `make venv`), or set echo.backend: speex") from None
        self._rtc = rtc
        self._apm = rtc.AudioProcessingModule(echo_cancellation=True, noise_suppression=noise_suppression,
                                              high_pass_filter=high_pass_filter, auto_gain_control=False)

    def set_delay_ms(self, ms: int) -> None:
        self._apm.set_stream_delay_ms(int(max(0, ms)))

    def frame(self, near: np.ndarray, far: np.ndarray) -> np.ndarray:
        rtc = self._rtc
        far_f = rtc.AudioFrame(_to_i16(far).tobytes(), MODEL_RATE, 1, FRAME)
        self._apm.process_reverse_stream(far_f)
        near_f = rtc.AudioFrame(_to_i16(near).tobytes(), MODEL_RATE, 1, FRAME)
        self._apm.process_stream(near_f)
        return np.frombuffer(bytes(near_f.data), dtype=np.int16).astype(np.float32) / 32767.0


class _SpeexMdf:
    """Speex MDF echo canceller (plus Speex preprocessing: residual echo and noise suppression) via pyaec.

    :param tail_ms: the echo tail the adaptive filter covers, ms (the filter length).
    """

    def __init__(self, tail_ms: float, preprocess: bool):
        try:
            from pyaec import Aec
        except ImportError:
            raise UserError("echo.backend is speex but the `pyaec` package is not installed; "
                            "run `pip install pyaec`, or set echo.backend: webrtc") from None
        self._aec = Aec(FRAME, int(tail_ms * MODEL_RATE / 1000), MODEL_RATE, preprocess)
        # pyaec's own C entry point on the arrays' buffers: bit-exact with ``Aec.cancel_echo``, which copies
        # each frame through Python lists (233 -> 112 µs a frame measured here, about 1.2 % of a core at
        # 100 frames/s, idle or not). It needs pyaec's state handle (``Aec._aec``, pyaec 1.x); without it
        # (another pyaec), the public method serves.
        import ctypes

        from pyaec import lib

        self._handle = getattr(self._aec, "_aec", None)
        self._c_cancel = getattr(lib, "AecCancelEcho", None) if self._handle is not None else None
        self._ptr = ctypes.POINTER(ctypes.c_int16)

    def set_delay_ms(self, ms: int) -> None:
        pass  # the MDF filter covers the delay within its tail

    def frame(self, near: np.ndarray, far: np.ndarray) -> np.ndarray:
        rec, echo = _to_i16(near), _to_i16(far)
        if self._c_cancel is None:
            return np.asarray(self._aec.cancel_echo(rec.tolist(), echo.tolist()), dtype=np.float32) / 32767.0
        out = np.empty(len(rec), dtype=np.int16)
        ptr = self._ptr
        self._c_cancel(self._handle, rec.ctypes.data_as(ptr), echo.ctypes.data_as(ptr), out.ctypes.data_as(ptr),
                       len(rec))
        return out.astype(np.float32) / 32767.0


class EchoCanceller:
    """Removes the far end (what the speaker played) from the near end (the microphone).

    :param backend: ``"speex"`` (default in config) or ``"webrtc"`` (AEC3).
    :param gate_db: :meth:`near_end_present` threshold, dB (output/input energy over a VAD window); see
        :meth:`gate_threshold_db` and the module's notes for how it is applied.
    :param noise_suppression: also run the backend's noise suppressor (WebRTC NS / Speex preprocessor).
    :param high_pass_filter: WebRTC's high-pass filter (ignored by Speex).
    :param tail_ms: Speex filter length, ms (ignored by WebRTC, whose AEC3 estimates the delay itself).
    :param record: keep every processed frame (near in, far, out) for ERLE measurements; memory grows by
        3 × 640 bytes per 10 ms, so only for benchmarks and tests (:meth:`clear_records`).
    :param stand_in: with Speex, let WebRTC AEC3 serve the VAD and the onset gate until Speex has shown
        convergence (:attr:`stand_in_active`); False: the onset gate refuses every window until then.
    :param skip_idle_bands: while the far end is silent, compute the per-band figures only when read (False:
        every frame; the same answers, for comparison).
    :param bypass_idle: with Speex, pass quiet blocks through unprocessed (:meth:`process`'s ``quiet``; False:
        never; for comparison).
    :param restart_after_silence_s: WebRTC AEC3 (the ``webrtc`` backend, or Speex's stand-in) starts afresh,
        state and all, when the far end returns after at least this many seconds of digital silence (None:
        never; for comparison). Why: see :meth:`_restart_due`.
    :param over_echo_db: the stand-in's bypass (:meth:`over_echo`): how far a microphone band must stand over
        the echo the far end predicts, dB (None: off; for comparison; the prediction still serves
        :meth:`_echo_explained`).
    :param reuse_passes: with Speex, data reuse before the hand-over (:meth:`_advance_reuse`): how many times a new
        Speex adapts on the cold frames kept before it is measured (0: no reuse; for comparison).
    :param follow_drift: with Speex, its far end kept on the microphone's clock (:class:`~appliance.audio.delay.
        DriftFollower`; experimental, see the module's notes on clock drift).
    :param speaker_drive: with Speex, its far end through the speaker's curve ``tanh(d x) / d`` (0: linear).
    :param speaker_drives: with Speex, the drives tried from a cold start (:meth:`_try_curves`; the
        ``speaker_drive`` one serves first; fewer than two: none tried).
    :param follow_gain: with Speex, the echo path's gain measured at each new reply's start
        (:class:`~appliance.audio.pathgain.EchoGainFollower`) and a step handed to Speex (:meth:`_speex_frame`,
        :attr:`echo_scale`, :attr:`gain_measurements`); the reply's first ``MEASURE_S`` (150 ms) are held back meanwhile.
    :raises UserError: an unknown backend or its package is missing.

    :attr:`trace`: None, or a list that a benchmark sets to have every frame and onset-gate check recorded
    (:meth:`trace_rows`; the listener's tap writes them, :mod:`appliance.audio.tap`).

    :meth:`process` takes blocks of any length, float32 mono 16 kHz in [-1, 1], and returns the cancelled
    near end for the complete 10 ms frames buffered so far (so the output lags the input by less than one
    frame when blocks are not multiples of 10 ms, and not at all when they are; with ``follow_gain``, a new
    reply's first 150 ms come out together once its echo's gain is measured). Not thread-safe: one
    owner (the listener thread) calls it.
    """

    def __init__(self, backend: str = "webrtc", noise_suppression: bool = False, high_pass_filter: bool = True,
                 tail_ms: float = 200.0, record: bool = False, gate_db: float = -10.0, stand_in: bool = True,
                 skip_idle_bands: bool = True, bypass_idle: bool = True,
                 restart_after_silence_s: Optional[float] = RESTART_SILENCE_S,
                 over_echo_db: Optional[float] = OVER_ECHO_DB, reuse_passes: int = REUSE_PASSES,
                 follow_drift: bool = False, speaker_drive: float = 0.0, speaker_drives: tuple = (),
                 follow_gain: bool = False):
        self._webrtc_args = (noise_suppression, high_pass_filter)
        self._speex_args = (tail_ms, noise_suppression)
        if backend == "webrtc":
            self._impl = _WebRtcAec3(noise_suppression, high_pass_filter)
        elif backend == "speex":
            self._impl = _SpeexMdf(tail_ms, noise_suppression)
        else:
            raise UserError(f"echo.backend: unknown canceller {backend!r}; use one of {', '.join(BACKENDS)}")
        self.backend = backend
        # The cold-start stand-in (see stand_in_active): WebRTC AEC3 beside Speex until Speex has shown, band
        # by band, that it cancels the echo. Without it (stand_in False, or no livekit), cold windows are
        # refused by the onset gate.
        self._stand_in: Optional[EchoCanceller] = None
        self._stand_in_ready = bool(stand_in) and backend == "speex"  # wanted (False once it proved unavailable)
        self.stand_in_frames = 0  # frames the stand-in's output went to the VAD
        self.handovers = 0  # stand-in -> Speex hand-overs
        self.handover_frame: Optional[int] = None  # the first frame (10 ms, counted from this canceller's first) Speex served
        self.handback_frame: Optional[int] = None  # the first frame (as handover_frame) the stand-in served again,
        #   once Speex lost the echo (_watch_loss): at most one hand-back (see handbacks)
        self._server: Optional[str] = None  # who serves the VAD: "aec3" (the stand-in), "reused" or "speex" ...
        self._served_since = -(10**9)  # ... since this frame (near_end_present: the VAD's window after a switch;
        #   the first server serves from the start, no switch)
        self.lost: Optional[LostEcho] = None  # what the hand-back judged (see handbacks)
        self._false_onset_frame: Optional[int] = None  # the last note_false_onset whose frames showed the echo lost
        self._loss: list[tuple[float, float, float, float]] = []  # after the hand-over, per far-active frame: (ERLE
        #   dB, Speex's output dB (as _never_louder left it), the microphone's dB, the far end's dB
        #   OVER_ECHO_DELAY_FRAMES earlier); see _watch_loss
        self.warm = backend == "webrtc"  # Speex starts cold (see _update_mode)
        # The far end counts as recent for this long after its last sample: its echo still rings (the path's
        # delay and the room's reverberation), so the gate stays on. The Speex filter's length is the echo
        # tail it models; 200 ms for WebRTC, whose AEC3 does not say.
        self._tail = int((tail_ms if backend == "speex" else 200.0) * MODEL_RATE / 1000)
        self._near = np.zeros(0, dtype=np.float32)
        self._far = np.zeros(0, dtype=np.float32)
        self.frames = 0
        self.busy_s = 0.0  # compute time spent in the library, s
        self.clamped = 0  # frames whose output was more than OVER_DB louder than their input, scaled down
        self.record = record
        self.recorded: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.gate_db = gate_db
        self.gate_margin_db = GATE_MARGIN_DB
        self._ratio_in: list[float] = []  # per frame: near-end energy in, out, and far-end energy
        self._ratio_out: list[float] = []
        self._ratio_far: list[float] = []
        self._hb_in: list[float] = []  # per frame: high-band (>= HB_HZ) energy in and out
        self._hb_out: list[float] = []
        # Energy in and out over recent frames with the far end active: the canceller's current echo return
        # loss enhancement, the baseline of the onset gate.
        self._lt_in: list[float] = []
        self._lt_out: list[float] = []
        self._lt_hb_in: list[float] = []
        self._lt_hb_out: list[float] = []
        # Per band (BAND_EDGES_HZ): the microphone's band energy of recent frames, and energy in and out over
        # recent frames in which the far end played in that band: each band's own echo floor.
        self._band_in: list[np.ndarray] = []
        self._band_far: list[np.ndarray] = []
        self._lt_band_in: list[list[float]] = [[] for _ in range(N_BANDS)]
        self._lt_band_out: list[list[float]] = [[] for _ in range(N_BANDS)]
        self._lt_band_far: list[list[float]] = [[] for _ in range(N_BANDS)]
        self._lt_band_new = np.zeros(N_BANDS, dtype=int)  # per band: frames its floor took since the gate last passed
        self.gate_log: list[GateRow] = []  # if record
        self.clear_log: list[GateRow] = []  # the same for near_end_clear (passed = both tests), if record
        self.cold_log: list[tuple] = []  # (frame, expected residual dB) of the cold windows the gate refused, if record
        self._last_soft: Optional[int] = None  # frame of the last gate check within GATE_SOFT_DB of the threshold
        self._floor_hold_until = 0  # frames before this one stay out of the floors (see _keep_onset_out)
        self._lt_new = 0  # far-end frames the floors took since the gate last passed (see _keep_onset_out)
        self._far_frames = 0  # far-active frames processed (as the floors count them)
        self._deadline_far = 0  # ... less those a passed onset took back out of the floors (the hand-over's deadline)
        self._handover_far = 0  # ... at the hand-over
        self._converged_far: Optional[int] = None  # ... when converged() last became true (None: it is not)
        # Idle (the far end digital silence in every frame kept): the microphone's and the output's bands are
        # computed only when the far end returns or a reader asks (see process, _fill_bands). False: every frame.
        self.skip_idle_bands = skip_idle_bands
        self._unbanded: list[tuple[int, np.ndarray, np.ndarray]] = []  # (frame number, near, out) [FRAME] each
        # Quiet (process(quiet=True): nobody heard, nothing played): Speex is bypassed once the far end has
        # been digital silence for its tail and a frame more (its far-end history all zeros), and re-warmed
        # on the last bypassed frames when it is needed again (_rewarm). False: never.
        self.bypass_idle = bypass_idle
        self._bypass_after = self._tail // FRAME + 2  # far-silent frames before a block may be bypassed
        self._far_silent_run = 0  # consecutive far-silent frames processed so far
        self._bypassed: list[tuple[int, np.ndarray]] = []  # (frame number, near) of the last bypassed frames
        self.bypassed_frames = 0
        self._restart_frames = int(round(restart_after_silence_s * MODEL_RATE / FRAME)) if restart_after_silence_s else 0
        self.restarts = 0  # AEC3 restarts after a silence (see _restart_due)
        self._restart_pending = False  # a restart of the stand-in is due when it is next fed
        # The stand-in's bypass (over_echo): the echo the far end predicts, band by band, while the stand-in may serve.
        self.over_echo_db = over_echo_db
        self.over_echo_frames = 0  # frames whose microphone went to the VAD in place of the stand-in's output
        self._oe_smear = np.zeros(N_OE_BANDS)  # the far end's bands (OVER_ECHO_BAND_EDGES_HZ), smeared by the room's decay
        self._oe_smeared: list[np.ndarray] = []  # ... per frame, the newest OVER_ECHO_DELAY_FRAMES[1]
        self._oe_in: list[np.ndarray] = []  # per frame: the microphone's bands and the predicted echo's (unscaled)
        self._oe_pred: list[np.ndarray] = []
        self._oe_lt_in: list[np.ndarray] = []  # ... over far-active frames (the echo path's gain, as the floors)
        self._oe_lt_pred: list[np.ndarray] = []
        self._oe_quiet: list[np.ndarray] = []  # the microphone's bands of the last OVER_ECHO_NOISE_FRAMES banded frames
        self._oe_frame: list[bool] = []  # per frame: some band over the prediction by over_echo_db
        self._oe_pass: list[bool] = []  # per frame: ... in this frame and the one before, and served (kept 64)
        self._oe_reply_frames = 0  # far-active frames since the far end returned after a silence (_restart_due)
        self._reply_doubt = False  # the gain follower's fit of this reply's start was poor: Speex's gate held until judged
        self._reply_far = 1 << 30  # the same count whoever serves (_oe_reply_frames: only while the stand-in predicts),
        #   and "long ago" until a first silence; NEW_REPLY_FRAMES reads it
        # The echo's tail in the far end's silences (see _follow_tail): the room's decay, measured, and the tail
        # predicted from the microphone's own bands.
        self._tail_k = TAIL_MAX_FRAMES  # far-silent frames since the far end last played (0: it plays; none yet: over)
        self._tail_anchor: Optional[np.ndarray] = None  # the microphone's bands at the tail's start (their maximum)
        self._tail_broken = False  # a band rose TAIL_MARGIN_DB over the predicted tail in this silence
        self._tail_fit: list[tuple[int, float]] = []  # (frame in the silence, microphone dB) for the decay's measurement
        self._tail_decays: list[float] = []  # dB per frame, one per silence measured (the newest TAIL_SILENCES)
        self._tail_decay = TAIL_DECAY_DB  # ... their median, within TAIL_DECAY_RANGE_DB (tail_decay_db)
        # Data reuse before the hand-over (_advance_reuse): the frames Speex processed while cold, a reuse under way.
        self.reuse_passes = int(reuse_passes) if backend == "speex" else 0
        self._ring: list[tuple[np.ndarray, np.ndarray, float, bool]] = []  # (near, far, far energy, kept out of floors)
        self._ring_far_new = 0  # far-active frames the ring took since the last reuse began
        self._reuse: Optional[_Reuse] = None
        self._reused: Optional[EchoCanceller] = None  # the reused Speex that serves (reused_active), if any
        self.reused_frame: Optional[int] = None  # the first frame (as handover_frame) a reused Speex served
        self.reuses = 0  # reuses completed
        self._reused_floors = False  # this canceller is a reused Speex (its floors from its last pass): strict gate
        self.reuse_frames = 0  # frames the reuses processed (their cost: about 0.1 ms each here)
        # A benchmark's trace (see trace_rows): None (the default) records nothing and costs nothing.
        self.trace: Optional[list] = None
        self._oe_over: list[Optional[float]] = []  # traced: per frame of this call, over_db (trace_rows)
        # The far end as Speex gets it (_speex_far): re-timed to the microphone's clock, through the speaker's curve.
        self._follower = DriftFollower() if follow_drift and backend == "speex" else None
        # The echo path's gain since Speex adapted (follow_gain): a volume step between replies, measured at the new
        # reply's start (pathgain.py), is handed to Speex by scaling what it gets (see _speex_frame).
        self._gain = EchoGainFollower() if follow_gain and backend == "speex" else None
        self.echo_scale = 1.0
        self._gain_fed = 0  # samples of the buffered microphone already given to the gain follower
        self.speaker_drive = float(speaker_drive) if backend == "speex" else 0.0
        # The speaker's curves tried (_try_curves): (drive, its Speex or None for the live one, residual energy).
        self._curves = [[float(d), None if float(d) == self.speaker_drive else _SpeexMdf(*self._speex_args), []]
                        for d in speaker_drives] if len(speaker_drives) > 1 and backend == "speex" else None
        self._curve_far = 0  # far-active frames the curves have processed
        self.curve_switched_frame: Optional[int] = None  # the frame at which another curve took over, if one did
        self.curve_residual_db: dict = {}  # drive -> residual energy (dB) over the frames compared, at a switch

    def clear_records(self) -> None:
        """Forget what ``record`` kept (frames and gate logs); the canceller's state is untouched."""
        self.recorded.clear()
        self.gate_log.clear()
        self.clear_log.clear()
        self.cold_log.clear()

    def set_delay_ms(self, ms: float) -> None:
        """The delay from a far-end frame being handed over to its echo reaching the canceller, ms (only
        WebRTC uses it; see :func:`stream_delay_ms`)."""
        self._impl.set_delay_ms(int(round(ms)))

    def process(self, mic: np.ndarray, far_end: Optional[np.ndarray], quiet: bool = False) -> np.ndarray:
        """Cancel the echo of ``far_end`` in ``mic``.

        :param mic: float32 [n] near end, 16 kHz.
        :param far_end: float32 [m] samples played since the previous call, 16 kHz (None or short: the
            missing far end counts as silence, so the canceller never waits for it).
        :param quiet: the caller hears nobody and plays nothing (the listener: listening, its VAD in no
            utterance): with Speex, a block whose far end has been digital silence for longer than the
            filter's tail passes through unprocessed (see :meth:`_rewarm`). False: every frame is processed.
        :returns: float32 [k] cancelled near end, k = the complete 10 ms frames now buffered.
        """
        self._near = np.concatenate([self._near, np.asarray(mic, dtype=np.float32).reshape(-1)])
        if far_end is not None and len(far_end):
            self._far = np.concatenate([self._far, np.asarray(far_end, dtype=np.float32).reshape(-1)])
        n = len(self._near) // FRAME
        if n == 0:
            return np.zeros(0, dtype=np.float32)
        need = n * FRAME
        if len(self._far) < need:
            self._far = np.concatenate([self._far, np.zeros(need - len(self._far), dtype=np.float32)])
        fit = None  # the fit of a new reply's start measured in this call (see _reply_doubt)
        if self._gain is not None:
            step = self._gain.push(self._near[self._gain_fed:need], self._far[self._gain_fed:need])
            self._gain_fed = need
            if step is not None:
                fit = step.fit
                if step.applied:  # (the follower keeps the steps' total within its MAX_STEP_DB)
                    self.echo_scale *= step.factor
            if self._gain.measuring:
                return np.zeros(0, dtype=np.float32)  # a new reply's start, held back until its echo's gain is known
            self._gain_fed = 0  # (every frame buffered is processed below)
        out = np.empty(need, dtype=np.float32)
        near, far = self._near[:need].reshape(n, FRAME), self._far[:need].reshape(n, FRAME)
        e_far = _energy(far)
        loud = np.flatnonzero(e_far > FAR_SILENT)
        before = self._far_silent_run  # far-silent frames before this block's first
        self._far_silent_run = before + n if not len(loud) else n - 1 - int(loud[-1])
        if self._far_silent_run >= STRICT_GAP_FRAMES:
            self._handover_far = -STRICT_FRAMES  # the reply of a hand-over is over: no strict gate after it
        bypass = quiet and self.bypass_idle and self.backend == "speex" and not len(loud) and \
            before + 1 >= self._bypass_after and self.frames - self.bypassed_frames >= BYPASS_AFTER_FRAMES
        if self._restart_due(before, loud):
            if self.backend == "webrtc":
                self._restart_aec3()
            else:
                self._restart_pending = True  # the stand-in's, when it is next fed (its far end may be too quiet now)
            self._oe_reply_frames = 0  # a new reply: its echo's gain not re-measured yet (see _predict_echo)
            self._reply_far = 0
            self._reply_doubt = False
        if fit is not None:
            self._reply_doubt = self.warm and self._stand_in_ready and fit < DOUBT_FIT
        t0 = time.perf_counter()
        aligned = self._aligned_far(need)
        spk = _curve(aligned, self.speaker_drive)
        if bypass:
            out[:] = self._near[:need]
            self._bypassed.extend((self.frames + i, near[i].copy()) for i in range(n))
            del self._bypassed[:-BYPASS_REWARM_FRAMES]
            self.bypassed_frames += n
        else:
            if self._bypassed:
                self._rewarm()
            for i in range(n):
                sl = slice(i * FRAME, (i + 1) * FRAME)
                out[sl] = self._speex_frame(self._near[sl], spk[sl])
            if self._curves is not None:
                self._try_curves(n, out, e_far, aligned)
            if self.reuse_passes and not self.warm:
                held = self._floor_hold_until
                self._ring.extend((near[i].copy(), spk[i * FRAME:(i + 1) * FRAME].copy(), float(e_far[i]),
                                   self.frames + i < held)
                                  for i in range(n))
                self._ring_far_new += int(np.count_nonzero(e_far >= FAR_ACTIVE * FRAME))
                del self._ring[:-REUSE_RING_FRAMES]
        self.busy_s += time.perf_counter() - t0
        out_f = out.reshape(n, FRAME)
        e_in, e_out = _energy(near), _energy(out_f)  # the canceller's own output, before _never_louder
        clamped = _never_louder(out_f, e_out, e_in)
        self.clamped += int(clamped.sum())
        # Idle: the far end digital silence in this block and in every frame kept (64, more than the onset
        # gate's look-back of the window and the echo tail). Then the bands of the microphone and of the
        # output are read by nobody: the gate reads them only while the far end is recent, and the bands'
        # floors only over far-active frames. They are kept as zeros and computed when the far end returns
        # or a reader asks (_fill_bands), for every frame the per-frame lists still hold.
        far_silent = not len(loud)
        idle = self.skip_idle_bands and far_silent and not any(e > FAR_SILENT for e in self._ratio_far)
        if not idle and self._unbanded:
            self._fill_bands()
        if idle:
            b_in = b_out = np.zeros((n, N_BANDS))
            self._unbanded += [(self.frames + i, near[i].copy(), out_f[i].copy()) for i in range(n)]
            del self._unbanded[:-UNBANDED_FRAMES]
        else:
            p_in = _power(near)
            b_in, b_out = p_in @ _BAND_MATRIX, _band_energies(out_f)
        hb_in, hb_out = b_in[:, -1], b_out[:, -1]  # the last band is the high band (>= HB_HZ)
        # The far end's bands serve the cold start (band floors, hand-over) and, with a stand-in, over_echo's
        # prediction, kept while Speex serves too (the spare of a hand-back): without one, no FFT of it once warm.
        # While nothing plays the far end is digital silence: its bands are zero without an FFT.
        predict = self._stand_in_ready  # over_echo's prediction: kept while Speex serves too (a hand-back's spare)
        p_far = None if (self.warm and not predict) or far_silent else _power(far)
        b_far = None if self.warm else (np.zeros((n, N_BANDS)) if far_silent else p_far @ _BAND_MATRIX)
        grew = False  # a band's floor got a frame (only then can the hand-over become due)
        oe_stats = None  # the echo path's gain and the room's noise for over_echo, once a call (see _over_echo_stats)
        if predict:
            if idle:  # nothing played for the frames kept: nothing to predict, nothing to serve in place of AEC3
                self._restart_prediction()
                self._oe_pass += [False] * n
                del self._oe_pass[:-64]
            else:
                oe_stats = self._over_echo_stats()
                o_in = p_in @ _OE_MATRIX  # the prediction's own bands (OVER_ECHO_BAND_EDGES_HZ)
                o_far = np.zeros((n, N_OE_BANDS)) if far_silent else p_far @ _OE_MATRIX
        watch = False  # Speex served a far-active frame since the hand-over: _watch_loss has a new one to judge
        for i in range(n):
            self._ratio_in.append(float(e_in[i]))
            self._ratio_out.append(float(e_out[i]))
            self._ratio_far.append(float(e_far[i]))
            self._hb_in.append(float(hb_in[i]))
            self._hb_out.append(float(hb_out[i]))
            if self._ratio_far[-1] >= FAR_ACTIVE * FRAME and self.frames + i >= self._floor_hold_until:
                self._lt_in.append(self._ratio_in[-1])
                self._lt_out.append(self._ratio_out[-1])
                self._lt_hb_in.append(self._hb_in[-1])
                self._lt_hb_out.append(self._hb_out[-1])
                self._lt_new += 1
                self._far_frames += 1
                self._deadline_far += 1
            if self._ratio_far[-1] >= FAR_ACTIVE * FRAME:
                self._reply_far += 1
                if self.warm and self._stand_in_ready:
                    lo, hi = OVER_ECHO_DELAY_FRAMES
                    served = float(e_in[i] if clamped[i] else e_out[i])  # (as _never_louder left the frame)
                    watch = True
                    self._loss.append((_ratio_db(e_in[i], served), _ratio_db(served, FRAME), _ratio_db(e_in[i], FRAME),
                                       _ratio_db(max(self._ratio_far[-hi:-lo], default=0.0), FRAME)))
            self._follow_tail(float(e_in[i]), float(e_far[i]), b_in[i])
            if oe_stats is not None:
                self._predict_echo(o_in[i], o_far[i], self._ratio_far[-1] >= FAR_ACTIVE * FRAME, oe_stats)
            if b_far is None:
                continue  # the bands' floors only decide the hand-over, which is done
            self._band_in.append(b_in[i])
            self._band_far.append(b_far[i])
            if far_silent or self.frames + i < self._floor_hold_until:
                continue  # no band played, or the user's onset is still held out (_keep_onset_out)
            for b in np.nonzero(b_far[i] >= FAR_BAND_ACTIVE * FRAME)[0]:
                self._lt_band_in[b].append(float(b_in[i, b]))
                self._lt_band_out[b].append(float(b_out[i, b]))
                self._lt_band_far[b].append(float(b_far[i, b]))
                self._lt_band_new[b] += 1
                grew = True
        for buf in (self._ratio_in, self._ratio_out, self._ratio_far, self._hb_in, self._hb_out, self._band_in,
                    self._band_far):
            del buf[:-64]
        for buf in (self._lt_in, self._lt_out, self._lt_hb_in, self._lt_hb_out, *self._lt_band_in,
                    *self._lt_band_out, *self._lt_band_far):
            del buf[:-LT_FRAMES]
        if watch:
            self._watch_loss()
        self._update_mode(n, grew)
        if self.reuse_passes:
            t0 = time.perf_counter()
            self._advance_reuse(n, bool(len(loud)))
            self.busy_s += time.perf_counter() - t0
        fed = self._stand_in_fed()
        serves = False  # the stand-in's output goes to the VAD (else it is the spare, kept current: _stand_in_fed)
        served = []  # frames of this call whose microphone went to the VAD in the stand-in's place (over_echo)
        reused = self.reused_active
        if reused:
            t0 = time.perf_counter()
            out = self._reused.process(self._near[:need], spk)
            self.busy_s += time.perf_counter() - t0
        elif fed:
            if self._restart_pending and self._stand_in.frames:
                self._stand_in._restart_aec3()
                self.restarts += 1
            self._restart_pending = False
            spare = self._stand_in.process(self._near[:need], self._far[:need])
            serves = self.stand_in_active
        if serves:
            out = spare
            self.stand_in_frames += n
            for i in np.flatnonzero(self._oe_pass[-n:]) if len(self._oe_pass) >= n else ():
                sl = slice(i * FRAME, (i + 1) * FRAME)
                if float(np.dot(out[sl], out[sl])) <= float(e_in[i]) * 10 ** (-OVER_ECHO_SUPPRESSED_DB / 10):
                    out[sl] = self._near[sl]  # the user, held back by AEC3's suppressor: see over_echo
                    self.over_echo_frames += 1
                    served.append(int(i))
                else:
                    self._oe_pass[len(self._oe_pass) - n + i] = False  # AEC3 lets it through: its output serves
        server = "reused" if reused else "aec3" if self.stand_in_active else "speex"
        if server != self._server:
            if self._server is not None:  # (the first call's server is no switch)
                self._served_since = self.frames
            self._server = server
        if self.trace is not None:
            self._trace_frames(n, e_in, out, "bypass" if bypass else "reused" if reused else "aec3" if serves
                               else "speex" if self.warm
                               else "none" if self._stand_in is None else "cold", served)
        if self.record:
            for i in range(n):
                sl = slice(i * FRAME, (i + 1) * FRAME)
                self.recorded.append((self._near[sl].copy(), self._far[sl].copy(), out[sl].copy()))
        self.frames += n
        self._near = self._near[need:]
        # A far end that runs ahead of the near end (device clocks differ) is kept at most 200 ms.
        self._far = self._far[need:][-int(0.2 * MODEL_RATE):]
        return out

    @property
    def gain_measurements(self) -> list:
        """Every echo gain measurement at a new reply's start (``follow_gain``; empty without it), oldest first,
        the last 64 (:class:`appliance.audio.pathgain.GainStep`: samples fed to the follower, step dB, fit 0-1,
        applied), as :attr:`appliance.audio.pathgain.EchoGainFollower.steps`."""
        return self._gain.steps if self._gain is not None else []

    def _speex_frame(self, near: np.ndarray, far: np.ndarray) -> np.ndarray:
        """One 10 ms frame through the live canceller, with the echo path's gain since it adapted
        (:attr:`echo_scale`, ``follow_gain``) taken out: an echo ``s`` times louder is met by the microphone divided
        by ``s`` (and the output multiplied back), a quieter one by the far end times ``s``, so that neither input
        grows (Speex takes 16-bit samples: a far end doubled clipped, measured here, offline, and left 21-28 dB of
        ERLE over the first second after a +6 dB step where the microphone halved left 38-40)."""
        s = self.echo_scale
        if s == 1.0:
            return self._impl.frame(near, far)
        if s > 1.0:
            return self._impl.frame(near / s, far) * s
        return self._impl.frame(near, far * s)

    def _aligned_far(self, need: int) -> np.ndarray:
        """The far end of the next ``need`` samples kept on the microphone's clock by the drift follower
        (``follow_drift``; as played without it), float32 [need], 16 kHz: Speex gets it through the speaker's
        curve (:func:`_curve`), so that what is left between it and the echo is a linear path."""
        far = self._far[:need]
        return far if self._follower is None else self._follower.process(self._near[:need], far)

    def _try_curves(self, n: int, out: np.ndarray, e_far: np.ndarray, aligned: np.ndarray) -> None:
        """From a cold start, Speex is run with each of ``speaker_drives``' curves on the same frames (``n`` frames
        of this call; ``out``: the live Speex's output, float32 [n FRAME]; ``e_far``: the far end's frame energies;
        ``aligned``: the far end before the curve, :meth:`_aligned_far`),
        and their residual energies kept over the newest ``CURVE_WINDOW_FAR_FRAMES`` far-active frames. From
        ``CURVE_MIN_FAR_FRAMES`` of them on, a curve whose residual there is ``CURVE_MIN_GAIN_DB`` under the live
        one's takes over (its Speex serves from then on, adapted as long as the live one) and the others are
        dropped; at ``CURVE_MAX_FAR_FRAMES``, or once the live Speex has handed over, they are dropped too. The
        reuse under way and a reused Speex, made with the old curve, go with it."""
        near = self._near[:n * FRAME]
        active = np.flatnonzero(e_far >= FAR_ACTIVE * FRAME)
        for c in self._curves:
            if c[1] is None:
                o = out
            else:
                far = _curve(aligned, c[0])
                o = np.concatenate([c[1].frame(near[i * FRAME:(i + 1) * FRAME], far[i * FRAME:(i + 1) * FRAME])
                                    for i in range(n)])
            c[2].extend(_energy(o.reshape(n, FRAME))[active])
            del c[2][:-CURVE_WINDOW_FAR_FRAMES]
        self._curve_far += len(active)
        if self.warm or self._curve_far >= CURVE_MAX_FAR_FRAMES:
            self._curves = None
            return
        if self._curve_far < CURVE_MIN_FAR_FRAMES:
            return
        res = {c[0]: 10 * np.log10(max(sum(c[2]), 1e-20)) for c in self._curves}
        live = next(c for c in self._curves if c[1] is None)
        best = min(self._curves, key=lambda c: res[c[0]])
        if best is not live and res[best[0]] <= res[live[0]] - CURVE_MIN_GAIN_DB:
            self.curve_residual_db = {d: round(r, 1) for d, r in res.items()}
            self._impl, self.speaker_drive = best[1], best[0]
            self._ring, self._ring_far_new, self._reuse, self._reused = [], 0, None, None
            self.curve_switched_frame = self.frames + n
            self._curves = None

    def _trace_frames(self, n: int, e_in: np.ndarray, out: np.ndarray, serving: str, served: list) -> None:
        """This call's frames in :attr:`trace` (see :meth:`trace_rows`)."""
        e_out = _energy(out.reshape(n, FRAME))
        over = self._oe_over[-n:] if len(self._oe_over) >= n else [None] * n
        self._oe_over = []
        db = lambda e: round(10.0 * np.log10(float(e) / FRAME + 1e-20), 1)  # noqa: E731
        for i in range(n):
            self.trace.append(("frame", self.frames + i, serving, db(e_in[i]), db(e_out[i]), over[i], i in served))

    def _trace_gate(self, test: str, passed: bool, **figures) -> None:
        """One onset-gate check in :attr:`trace` (see :meth:`trace_rows`)."""
        if self.trace is not None:
            self.trace.append(("gate", self.frames, test, bool(passed),
                               {k: (round(float(v), 1) if isinstance(v, (float, np.floating))
                                    else bool(v) if isinstance(v, np.bool_) else v) for k, v in figures.items()}))

    def record_trace(self, on: bool) -> None:
        """Start (``True``: an empty :attr:`trace`) or stop (``False``: None, nothing kept) recording the
        rows :meth:`trace_rows` hands out; for a benchmark's trace only."""
        self.trace = [] if on else None

    def trace_rows(self) -> list:
        """What :attr:`trace` (a list while :meth:`record_trace` is on; None: nothing kept) holds, taken out of it: rows
        ``("frame", k, serving, in_db, out_db, over_db, served_mic)`` per 10 ms frame ``k`` (this canceller's
        frame count, 160 samples each from its first), ``serving`` what went to the VAD (``"aec3"``: the
        stand-in; ``"speex"``; ``"cold"``: Speex unconverged and the stand-in not fed, nothing played; ``"none"``:
        no stand-in; ``"bypass"``: Speex skipped, quiet), ``in_db``/``out_db`` the microphone's and the served
        output's mean power (dBFS), ``over_db`` how far the microphone's band most over the far end's predicted
        echo stood over :meth:`over_echo`'s margin (dB; >= 0: that frame was over; None: no prediction),
        ``served_mic`` the microphone went to the VAD in AEC3's place; and ``("gate", k, test, passed,
        figures)`` per onset-gate check (:meth:`near_end_present`, :meth:`near_end_clear`) after frame ``k``
        - 1, ``test`` the branch that decided (``"tail"``, ``"stand_in"``, ``"speex"``, ``"clear"``) and
        ``figures`` its inputs (dB, or the sub-tests' verdicts)."""
        rows, self.trace[:] = list(self.trace or []), []
        return rows

    def _restart_due(self, before: int, loud: np.ndarray) -> bool:
        """Whether this block's far end returns after a silence of ``restart_after_silence_s`` or more
        (``before``: far-silent frames before the block; ``loud``: its far-active frames' indices), so that
        AEC3 (the ``webrtc`` backend, or the stand-in) should start afresh on it (:meth:`_restart_aec3`).

        Why (measured here, the 48 kHz JACK room at +300 ppm with the clipping speaker, the service's own
        streams replayed offline through this canceller): the echo's delay behind the far end moved by 0.2-1.4 ms
        over the 4-5 s silences between replies. AEC3, adapted on the reply before, trusted its linear filter
        and removed 2-23 dB in the first second of the next reply (5 dB on its loudest 100 ms), and those
        windows paused the reply (6 onsets in 10 replies); a new AEC3 starts with its suppressor cautious and
        converges within the reply: 34-43 dB over the first second of every reply, 0 onsets, ERLE over all
        echo-only frames 22.3 -> 38.9 dB. The cost: within a reply a new AEC3 removed 39 dB (median half
        second) against 51 dB adapted, and at 0 ppm a reply's first second has 36 dB instead of 50.
        (A far end delayed by the delay's change, known in advance, did better, 49 dB; estimated causally from
        the echo it did not: see the module's notes.)"""
        if not self._restart_frames or not len(loud):
            return False
        return before + int(loud[0]) >= self._restart_frames and self.frames > 0

    def _restart_aec3(self) -> None:
        """A new AEC3 in place of this canceller's (``webrtc`` backend only): its filter, delay estimate and
        suppressor state start afresh; the floors and the gate's figures stay."""
        self._impl = _WebRtcAec3(*self._webrtc_args)
        if self.backend == "webrtc":
            self.restarts += 1

    def _rewarm(self) -> None:
        """Speex again after a bypass (:meth:`process` with ``quiet``): the last ``BYPASS_REWARM_FRAMES``
        bypassed frames go through it first (the far end digital silence, as it was), their output dropped,
        so that its short memories (the DC notch and pre-emphasis, the preprocessor's overlap and its noise
        estimate) are the room's of just now and the next frame comes out without a seam; and what those
        frames would have given is written into the per-frame figures the onset gate reads (in place of
        the bypass's 0 dB), as if Speex had processed them.

        The filter itself (what the echo path is, learnt during replies) is untouched by a bypass: with a
        far end silent for longer than the tail, Speex's far-end history is all zeros, so it estimates no
        echo and its gradient is zero. What a bypass does change: the slow averages Speex keeps of the far
        end's power and of its residual (0.6–1 s time constants) follow the idle room only from the re-warm
        on; the listener bypasses only while nothing plays and its VAD hears no utterance, so Speex has
        run through the whole of a user's turn (its onset re-warms it) before a reply starts.
        """
        frames, near = zip(*self._bypassed)
        self._bypassed = []
        zero = np.zeros(FRAME, dtype=np.float32)
        outs = np.stack([self._speex_frame(x, zero) for x in near])
        e_in, e_out = _energy(np.stack(near)), _energy(outs)
        _never_louder(outs, e_out, e_in)  # (the lists keep the energy before it, the bands after it)
        unbanded = {f: k for k, (f, _, _) in enumerate(self._unbanded)}
        b_out = None
        for j, f in enumerate(frames):
            back = self.frames - f  # 1: the newest frame in the lists
            if back > len(self._ratio_out):
                continue
            self._ratio_out[-back] = float(e_out[j])
            if f in unbanded:
                k = unbanded[f]
                self._unbanded[k] = (f, self._unbanded[k][1], outs[j])
            elif back <= len(self._hb_out):
                if b_out is None:
                    b_out = _band_energies(outs)
                self._hb_out[-back] = float(b_out[j, -1])

    def _fill_bands(self) -> None:
        """The bands of the idle frames the per-frame lists hold (``_unbanded``), computed now that the far
        end plays again or a reader asks for them, in their places in those lists."""
        if not self._unbanded:
            return
        frames, near, out = zip(*self._unbanded)
        self._unbanded = []
        b_in, b_out = _band_energies(np.stack(near)), _band_energies(np.stack(out))
        for j, f in enumerate(frames):
            back = self.frames - f  # 1: the newest frame in the lists
            if back > len(self._hb_in):
                continue
            self._hb_in[-back], self._hb_out[-back] = float(b_in[j, -1]), float(b_out[j, -1])
            if not self.warm and back <= len(self._band_in):
                self._band_in[-back] = b_in[j]

    # --- convergence, band by band, and the cold-start stand-in ---

    def band_floors_db(self) -> list[Optional[float]]:
        """Each band's echo floor (BAND_EDGES_HZ), dB: :func:`_floor_db` over the frames in which the far end
        played in that band; None for a band with less than 0.5 s of such frames (not shown converged)."""
        return [_floor_db(o, i) for o, i in zip(self._lt_band_out, self._lt_band_in)]

    def band_return_loss_db(self) -> list[Optional[float]]:
        """Each band's microphone-to-far-end energy ratio over the same frames as :meth:`band_floors_db`, dB:
        an upper bound of the echo path's gain in that band (noise and a user only add to the microphone);
        None where the floor is None."""
        return [_floor_db(i, f) for i, f in zip(self._lt_band_in, self._lt_band_far)]

    def _band_residuals(self) -> np.ndarray:
        """Per band, the share of the microphone's energy expected to be left as echo: the floor as a power
        ratio, 1 for a band not shown converged, 0 for a band with no echo path (``NO_ECHO_DB``)."""
        res = np.ones(N_BANDS)
        for b, (floor, erl) in enumerate(zip(self.band_floors_db(), self.band_return_loss_db())):
            if erl is not None and erl <= NO_ECHO_DB:
                res[b] = 0.0
            elif floor is not None:
                res[b] = 10 ** (floor / 10)
        return res

    def expected_residual_db(self, n: int = 512) -> Optional[float]:
        """What the canceller, as measured so far, should leave of the echo in the last ``n`` samples, relative
        to the microphone's energy, dB (until the hand-over; the bands are not followed after it): each band's
        expected residual (its floor, 0 dB for a band not yet
        shown converged, nothing for a band with no echo path; :meth:`band_floors_db`,
        :meth:`band_return_loss_db`) weighted by the microphone's energy in that band (by the far end's where
        the microphone is digitally silent). None before any frame or when neither carries any energy."""
        if not self._band_in:
            return None
        self._fill_bands()
        k = max(1, n // FRAME)
        weights = np.sum(self._band_in[-k:], axis=0)
        if weights.sum() < 1e-12:
            weights = np.sum(self._band_far[-k:], axis=0)
            if weights.sum() < 1e-12:
                return None
        return _ratio_db(float(np.dot(self._band_residuals(), weights)), float(weights.sum()))

    def is_cold(self, n: int = 512) -> bool:
        """True when the canceller has not shown, on live far-end audio, that it removes the echo of the last
        ``n`` samples: their :meth:`expected_residual_db` is above ``COLD_DB`` (after a start, before 0.5 s
        of the far end in the bands the window's energy is in, and until those bands converge). The
        output/input ratio cannot then tell the user from the echo: before the first convergence the onset
        gate refuses the window (after it, the converged gate decides, as a user's speech raises the floors
        too)."""
        e = self.expected_residual_db(n)
        return e is not None and e > COLD_DB

    def converged(self) -> bool:
        """Speex has shown, band by band on live far-end audio, that it cancels the echo: every band's
        expected residual (:meth:`_band_residuals`) is known and at or below ``WARM_DB``."""
        floors = self.band_floors_db()
        return all(f is not None for f in floors) and bool(np.all(self._band_residuals() <= 10 ** (WARM_DB / 10)))

    @property
    def stand_in_active(self) -> bool:
        """True while the cold-start stand-in (WebRTC AEC3) serves the VAD and the onset gate in place of
        Speex: from the start until :meth:`converged`. AEC3 keeps our own
        echo out of the VAD from its first frame (its suppressor starts conservative), at the price of
        holding back a user's first 100-200 ms, so a barge-in is slower until the hand-over but the reply
        never pauses on itself."""
        return not self.warm and self._stand_in is not None

    def _update_mode(self, n: int, grew: bool = True) -> None:
        """Hand over from the stand-in to Speex once :meth:`converged` has held through ``HANDOVER_FAR_FRAMES``
        far-active frames in a row, begun within the first ``HANDOVER_DEADLINE_FAR_FRAMES`` kept in the floors
        (from this call's frames on: :attr:`handover_frame`): from then on the converged onset gate keeps Speex's
        residual out. Not back on the floors (a user talking over the reply raises them for seconds, and sending
        the VAD back to AEC3 then held back the next barge-in, measured here), only where Speex's residual is our
        own echo (:meth:`_watch_loss`), and then never over again. A new echo path gets a new canceller: a device
        reopened, a reload. ``grew``: a band's
        floor took a frame in this call (convergence is asked only then: nothing else moves it)."""
        if self.warm:
            return
        if grew and not self.handbacks and self._deadline_far <= HANDOVER_DEADLINE_FAR_FRAMES + HANDOVER_FAR_FRAMES:
            if not self.converged():
                self._converged_far = None
            elif self._converged_far is None:
                self._converged_far = self._far_frames
            if self._converged_far is not None and self._far_frames - self._converged_far >= HANDOVER_FAR_FRAMES:
                self.warm = True  # (the stand-in is kept, fed beside Speex: the spare of a hand-back, _watch_loss)
                self.handovers += 1
                self.handover_frame = self.frames  # process() serves this call's frames from Speex already
                self._handover_far = self._far_frames
                return
        if self._stand_in is None and self._stand_in_ready:
            try:
                self._stand_in = EchoCanceller("webrtc", noise_suppression=False, high_pass_filter=True,
                                               gate_db=self.gate_db, stand_in=False, restart_after_silence_s=None)
            except UserError:
                self._stand_in_ready = False  # no livekit: cold windows are refused by the onset gate

    def _watch_loss(self) -> None:
        """After the hand-over, hand back to the stand-in where Speex has lost the echo: over its newest
        ``LOST_FRAMES`` far-active frames (2 s), the median per-frame ERLE is under ``LOST_ERLE_DB`` (20 dB), and
        the level of what it leaves (as :func:`_never_louder` leaves it) and the microphone's both follow the far
        end's (their per-frame dB correlated with its at ``LOST_CORR``, 0.5, or more): our own echo is there and
        gets through, not a user or a noise over the reply (what is left does not follow the far end) nor an echo
        path gone away (nor does the microphone: Speex's own estimate of an echo that is not there, in a room with
        no echo path, followed the far end at 0.51). Or sooner, at a new reply's start (the far end back after a
        second's silence): over its first ``LOST_REPLY_FRAMES`` far-active frames (300 ms), all served by Speex, the
        median under ``LOST_REPLY_ERLE_DB`` (14 dB) and the same correlations; judged once a reply, and the end of
        :attr:`_reply_doubt`'s hold. From this call's frames on the stand-in serves (:attr:`handback_frame`), for
        good: no further hand-over nor data reuse on this echo path (a new one gets a new canceller), as for a path
        Speex never learnt within the hand-over's deadline. Speex learns on beside it. The stand-in that serves is
        the one of the cold start, kept and fed beside Speex while the far end plays (:meth:`_stand_in_fed`): it has
        followed the reply under way (and starts afresh with each reply, as it does while it serves), as has the far
        end's predicted echo (:meth:`over_echo`, :meth:`_echo_explained`).

        Why the reply's start (session 28, measured here): on the live path-change runs (the JACK room's speaker
        turned clipping and drifting in a silence, ``--path-change-s``) the 2 s test alone handed back 5-13 s after
        the change, and 0-2 replies of 20 flushed themselves before it (session 27: the classifier heard a stop word
        in 160-176 ms of leaked echo). With the reply's start judged, its gate held in doubt, and the stand-in current:
        2.4-7.8 s after the change, and 0 replies flushed in seven runs (docs/measurements.md). A new AEC3 made at
        the hand-back, mid-reply, let a window of the echo through and paused the reply at once (one run). A change
        in the middle of a reply was left to the 2 s test, which its pauses starve (each stops the far end it counts):
        5-8 pauses in that reply, and in 2 of 6 such runs one of them flushed it (sessions 28-29); the pauses
        themselves are now evidence (:meth:`note_false_onset`).

        Why: the floors can look converged for a moment on a path Speex cannot model. On the 48 kHz JACK room
        with the drifting (+300 ppm, a 60 s wander), clipping speaker, Speex handed over 45 s into a 50-reply
        echo-only run (session 25), its echo's delay then slid, and 93 of 99 replies paused on their own voice
        (42 flushed), ERLE 13.3 dB. (Session 16 handed back when the floors rose: a user talking over a reply
        raises them too, and the next barge-in was held back by the stand-in.) See ``LOST_CORR`` for the
        figures behind the test."""
        del self._loss[:-LOST_FRAMES]
        if not self.warm:
            return
        judged = None  # the frames judged: the newest LOST_FRAMES, or a reply's first LOST_REPLY_FRAMES in doubt
        if self._reply_doubt and self._reply_far >= LOST_REPLY_FRAMES:
            self._reply_doubt = False  # (judged once: the gate's hold ends either way)
            if len(self._loss) >= self._reply_far:  # (all of the reply's frames served by Speex)
                judged, limit = self._loss[len(self._loss) - self._reply_far:][:LOST_REPLY_FRAMES], LOST_REPLY_ERLE_DB
        lost = self._lost(judged, limit) if judged is not None else None
        over = "a reply's first 300 ms"
        if lost is None and len(self._loss) >= LOST_FRAMES:
            lost, over = self._lost(self._loss, LOST_ERLE_DB), "the last 2 s of reply"
        if lost is not None:
            self._hand_back(LostEcho(*lost, over))

    def _hand_back(self, lost: "LostEcho") -> None:
        """The stand-in serves the VAD again from this call's frames (or the next call's, between calls), for good;
        ``lost``: what was judged, kept in :attr:`lost`."""
        self.warm, self.handback_frame, self.lost = False, self.frames, lost
        self._loss = []
        self._oe_reply_frames = 0

    def note_false_onset(self) -> bool:
        """The reply paused on an onset that proved not to be speech (the conversation resumed it as "not speech":
        the VAD rejected it and the classifier heard no stop word). After the hand-over, such a pause is evidence
        that Speex lets our own echo through, where :meth:`_watch_loss`'s 2 s test is starved (each pause stops the
        far end it counts): the echo path changed in the middle of a reply. If Speex's newest ``LOST_REPLY_FRAMES``
        far-active frames (300 ms, those before the pause) show the echo lost as a reply's start is judged (median
        ERLE under ``LOST_REPLY_ERLE_DB``, 14 dB, what it leaves and the microphone following the far end at
        ``LOST_CORR`` or more: :meth:`_lost`), and so did those of an earlier note within
        ``FALSE_ONSET_WITHIN_FRAMES`` (3 s), the stand-in serves from the next call's frames on, for good, as after
        :meth:`_watch_loss`'s hand-back. Call it between two :meth:`process` calls, on their thread (the listener's).

        :returns: True if this note handed back."""
        if not self.warm or self.handback_frame is not None or len(self._loss) < LOST_REPLY_FRAMES:
            return False
        lost = self._lost(self._loss[-LOST_REPLY_FRAMES:], LOST_REPLY_ERLE_DB)
        if lost is None:
            return False
        earlier, self._false_onset_frame = self._false_onset_frame, self.frames
        if earlier is None or self.frames - earlier > FALSE_ONSET_WITHIN_FRAMES:
            return False
        self._hand_back(LostEcho(*lost, "the 300 ms before a second pause on it"))
        return True

    @property
    def handbacks(self) -> int:
        """Speex -> stand-in hand-backs (:meth:`_watch_loss`): 0 or 1, a hand-back being for good."""
        return int(self.handback_frame is not None)

    @staticmethod
    def _lost(rows: list, limit_db: float) -> Optional[tuple[float, float]]:
        """Whether ``rows`` (:attr:`_loss`'s: ERLE, Speex's output, the microphone and the far end, dB per frame) show
        our own echo getting through Speex: their median ERLE under ``limit_db`` and both the output's and the
        microphone's levels following the far end's (correlation ``LOST_CORR`` or more). :returns: (the median ERLE
        dB, the output's correlation) if so, else None."""
        erle, out_db, mic_db, far_db = np.array(rows).T
        median = float(np.median(erle))
        if median >= limit_db or min(np.std(out_db), np.std(mic_db), np.std(far_db)) < 1e-6:
            return None
        r, r_mic = np.corrcoef([out_db, mic_db, far_db])[2, :2]
        if r < LOST_CORR or r_mic < LOST_CORR:
            return None
        return round(median, 1), round(float(r), 2)

    def _restart_prediction(self) -> None:
        """:meth:`over_echo`'s prediction of the echo starts afresh: the far end's smeared bands and the last
        frames' bands and verdicts forgotten (its gain and noise statistics kept)."""
        self._oe_smeared.clear(), self._oe_in.clear(), self._oe_pred.clear(), self._oe_frame.clear()
        self._oe_smear = np.zeros(N_OE_BANDS)

    def _advance_reuse(self, n: int, far_plays: bool) -> None:
        """Data reuse before the hand-over: while Speex has not shown convergence, a second Speex adapts on the
        cold frames kept (:data:`REUSE_RING_FRAMES`: the replies played so far, their echo and the silences
        around them) ``REUSE_PASSES`` times over and once more while its residual is measured; where
        :meth:`converged` holds on that pass and the one before, it serves the VAD and the onset gate in the
        AEC3 stand-in's place (:attr:`reused_active`) until the live Speex hands over, which learns and hands
        over exactly as without it. So a first reply too short for the live Speex to converge on (1-1.5 s)
        still gives the next reply a converged canceller from its first frame.

        Run in the far end's silences, at ``REUSE_SPEED`` frames per live frame (``n``: this call's frames);
        ``far_plays``: the far end played in this call, which abandons a reuse under way (the next silence
        starts another, on more frames). It starts once the far end has been silent for the filter's tail and a
        frame more (the kept frames then end in silence, so that each pass follows the one before without a
        seam), when the kept frames hold ``REUSE_MIN_FAR_FRAMES`` of far end more than at the last reuse, within
        the hand-over's deadline. Each new one replaces the last.

        Why not in the live one's place (tried, measured here offline with ``tools/standin-eval --quick``): a
        Speex adapted four times on a 0.8-1.5 s reply cancels the next reply's first half second better (see
        ``REUSE_PASSES``), but with its preprocessor its output stayed 3-9 dB behind a Speex that had converged
        live on a 3.6 s reply, 1-5 s into the next reply, and the early onset (:meth:`near_end_clear`) took a
        word's onset after a pause 3.8 s into it for the user in 3 of 60 echo-only replies (0 on the code
        before). Serving only until the live hand-over, the reused Speex is never the one that does. And while it
        serves, its gate is the strict one of the hand-over's first seconds (:meth:`_just_handed_over`: the
        broadband test at ``GATE_MAX_DB`` with no soft pass, no strong high-band or deep test): with the
        converged gate, its residual passed at -7.5 dB 1.2 s into the next reply in 1 of 60 echo-only replies
        and on a volume step in another; strict, 0 of 60, the barge-ins p50 / p95 52.4 / 113.2 -> 67.1 / 115.6 ms
        (92, none missed; AEC3 there: 160.6 / 713.1, 15 missed)."""
        if self.warm or not self.reuse_passes:
            self._reuse, self._ring, self._reused = None, [], None
            return
        if far_plays:
            self._reuse = None
            return
        if self._reuse is None:
            if (self._far_silent_run < self._bypass_after or self._ring_far_new < REUSE_MIN_FAR_FRAMES
                    or self._deadline_far > HANDOVER_DEADLINE_FAR_FRAMES):
                return
            first = next((j for j, f in enumerate(self._ring) if f[2] <= FAR_SILENT), None)
            if first is None:
                return
            self._reuse = _Reuse(_SpeexMdf(*self._speex_args), self._ring[first:])
            self._ring_far_new = 0
        r = self._reuse
        for _ in range(REUSE_SPEED * n):
            near, far = r.frames[r.pos][:2]
            out = r.speex.frame(near, far)
            if r.passes >= self.reuse_passes - 1:
                r.outs[r.passes - self.reuse_passes + 1].append(out)
            r.pos += 1
            self.reuse_frames += 1
            if r.pos == len(r.frames):
                r.pos, r.passes = 0, r.passes + 1
                if r.passes > self.reuse_passes:
                    self._finish_reuse(r)
                    return

    def _finish_reuse(self, r: "_Reuse") -> None:
        """A canceller around the reused Speex ``r``, its floors those of its last pass (the frames the live floors
        kept out stay out), in :attr:`_reused` if :meth:`converged` holds there and on the pass before, its gate
        strict (see :meth:`_advance_reuse`)."""
        self._reuse = None
        self.reuses += 1
        ec = EchoCanceller("speex", noise_suppression=self._speex_args[1], tail_ms=self._speex_args[0],
                           gate_db=self.gate_db, stand_in=False, reuse_passes=0)
        near, far = (np.stack([f[i] for f in r.frames]) for i in (0, 1))
        e_far = np.array([f[2] for f in r.frames])
        free = ~np.array([f[3] for f in r.frames]) & (e_far > FAR_SILENT)  # as process() takes frames into the floors
        idx = np.flatnonzero(free & (e_far >= FAR_ACTIVE * FRAME))[-LT_FRAMES:]
        b_far = _band_energies(far)
        bands = [np.flatnonzero(free & (b >= FAR_BAND_ACTIVE * FRAME))[-LT_FRAMES:] for b in b_far.T]
        b_in, e_in = _band_energies(near), _energy(near)
        held = True
        for outs in (np.stack(o) for o in r.outs):
            e_out = _energy(outs)
            _never_louder(outs, e_out, e_in)
            b_out = _band_energies(outs)
            ec._set_floors(e_in[idx], e_out[idx], b_in[idx, -1], b_out[idx, -1],
                           [(b_in[ib, b], b_out[ib, b], b_far[ib, b]) for b, ib in enumerate(bands)])
            held = held and ec.converged()
        if not held:
            return
        ec._serve_reused(r.speex, self._far_silent_run, self._reply_far)
        if self._reused is None:
            self.reused_frame = self.frames
        self._reused = ec

    def _set_floors(self, e_in: np.ndarray, e_out: np.ndarray, hb_in: np.ndarray, hb_out: np.ndarray,
                    bands: list) -> None:
        """Put these frames' energies in the floors' place (data reuse, :meth:`_finish_reuse`): broadband and high
        band in and out (float64 [k] each, the far-active frames), and per band of ``BAND_EDGES_HZ`` (in, out, far)
        (float64 [k_b] each, the frames in which the far end played in that band); the newest ``LT_FRAMES`` kept."""
        keep = lambda x: [float(v) for v in x[-LT_FRAMES:]]  # noqa: E731
        self._lt_in, self._lt_out, self._lt_hb_in, self._lt_hb_out = keep(e_in), keep(e_out), keep(hb_in), keep(hb_out)
        for b, (b_in, b_out, b_far) in enumerate(bands):
            self._lt_band_in[b], self._lt_band_out[b], self._lt_band_far[b] = keep(b_in), keep(b_out), keep(b_far)

    def _serve_reused(self, speex: _SpeexMdf, far_silent_run: int, reply_far: int) -> None:
        """Become the reused Speex that serves in the stand-in's place (:meth:`_advance_reuse`): ``speex``'s filter,
        converged, with the strict gate for as long as it serves (:meth:`_just_handed_over` reads
        ``_reused_floors``: its floors are measured on the frames it adapted on, deeper than on new ones) and no deep
        form; ``far_silent_run`` and ``reply_far`` (frames) carry the live canceller's silence so far over, so
        that a reply after it is a new reply (``NEW_REPLY_FRAMES``)."""
        self._impl = speex
        self.warm, self.handovers, self._handover_far, self._reused_floors = True, 1, -STRICT_FRAMES, True
        self._far_silent_run, self._reply_far = far_silent_run, reply_far

    @property
    def reused_active(self) -> bool:
        """True while a Speex adapted by data reuse (:meth:`_advance_reuse`) serves the VAD and the onset gate in
        the AEC3 stand-in's place: from a reuse whose floors showed convergence until the live Speex hands over."""
        return not self.warm and self._reused is not None

    def _over_echo_stats(self) -> tuple:
        """(the echo path's gain per band: the microphone's energy over the predicted echo's, summed over the
        far-active frames kept but the newest ``FLOOR_LAG_FRAMES``, as the floors; the room's noise per band:
        the 5th percentile of the microphone's band energy over the frames kept), float64 [N_BANDS] each,
        or (None, None) before ``LT_FRAMES // 4`` such frames."""
        if len(self._oe_lt_in) - FLOOR_LAG_FRAMES < LT_FRAMES // 4:
            return None, None
        kept = self._oe_lt_in[:-FLOOR_LAG_FRAMES]
        mic = np.sum(kept, axis=0)
        gain = mic / (np.sum(self._oe_lt_pred[:-FLOOR_LAG_FRAMES], axis=0) + 1e-12)
        quiet = np.maximum(np.percentile(self._oe_quiet, 5, axis=0), mic / len(kept) * 10 ** (OVER_ECHO_FLOOR_DB / 10))
        return gain, quiet

    def _predict_echo(self, b_in: np.ndarray, b_far: np.ndarray, far_active: bool, stats: tuple) -> None:
        """One frame of :meth:`over_echo`'s bookkeeping (``b_in``, ``b_far``: the frame's band energies,
        float64 [N_OE_BANDS]; ``far_active``: the far end played in it; ``stats``: :meth:`_over_echo_stats`)."""
        lo, hi = OVER_ECHO_DELAY_FRAMES
        # (the room's decay where it is measured slower than the bench's: the prediction must not fall faster
        #   than the tail)
        decay = min(OVER_ECHO_DECAY_DB, self.tail_decay_db)
        self._oe_smear = np.maximum(b_far, self._oe_smear * 10 ** (-decay / 10))
        self._oe_smeared.append(self._oe_smear)
        del self._oe_smeared[:-hi]
        pred = np.max(self._oe_smeared[:-lo], axis=0) if len(self._oe_smeared) > lo else np.zeros(N_OE_BANDS)
        self._oe_in.append(b_in)
        self._oe_pred.append(pred)
        del self._oe_in[:-3], self._oe_pred[:-3]
        if far_active:
            self._oe_reply_frames += 1
            self._oe_lt_in.append(b_in)
            self._oe_lt_pred.append(pred)
            del self._oe_lt_in[:-LT_FRAMES], self._oe_lt_pred[:-LT_FRAMES]
        self._oe_quiet.append(b_in)
        del self._oe_quiet[:-OVER_ECHO_NOISE_FRAMES]
        over = False
        gain, noise = stats
        if gain is not None and len(self._oe_in) == 3 and self.over_echo_db is not None:
            echo = gain * np.sum(self._oe_pred, axis=0) + 3 * noise
            margin = np.full(N_OE_BANDS, self.over_echo_db)
            margin[_OE_HB] += OVER_ECHO_HB_EXTRA_DB
            if self._oe_reply_frames < OVER_ECHO_NEW_FRAMES:
                margin += OVER_ECHO_NEW_DB
            over = bool(np.any(np.sum(self._oe_in, axis=0) >= 10 ** (margin / 10) * (echo + 1e-10)))
            if self.trace is not None:
                self._oe_over.append(round(float(np.max(10 * np.log10((np.sum(self._oe_in, axis=0) + 1e-20)
                                                                      / (echo + 1e-10)) - margin)), 1))
        elif self.trace is not None:
            self._oe_over.append(None)
        self._oe_pass.append(over and bool(self._oe_frame and self._oe_frame[-1]))
        self._oe_frame.append(over)
        del self._oe_frame[:-2], self._oe_pass[:-64]

    def over_echo(self, frames: int = 2) -> bool:
        """While the stand-in serves: the microphone, in some band, is more than ``over_echo_db`` above the echo
        that the far end predicts there, in two consecutive 10 ms frames, within the newest ``frames`` frames."""
        return any(self._oe_pass[-frames:])

    def _follow_tail(self, e_in: float, e_far: float, b_in: np.ndarray) -> None:
        """One frame of the echo tail's bookkeeping (``e_in``, ``e_far``: the frame's microphone and far-end
        energy; ``b_in``: the microphone's band energies, float64 [N_BANDS]): in a far-end silence, the tail is
        anchored on the microphone's bands over its first ``TAIL_ANCHOR_FRAMES`` and predicted to decay by
        :attr:`tail_decay_db` a frame from there; a band ``TAIL_MARGIN_DB`` over the prediction breaks it (see
        :meth:`_tail_test`); and the decay is measured (a line fit to the microphone's dB over the frames after
        the anchor, see :attr:`tail_decay_db`)."""
        if e_far >= FAR_ACTIVE * FRAME:
            self._end_tail_fit()
            self._tail_k, self._tail_anchor, self._tail_broken = 0, None, False
            return
        if self._tail_k >= TAIL_MAX_FRAMES:
            return  # the tail is over (or the far end has not played since this canceller was built)
        self._tail_k += 1
        k = self._tail_k
        if k <= TAIL_ANCHOR_FRAMES:
            self._tail_anchor = b_in.copy() if self._tail_anchor is None else np.maximum(self._tail_anchor, b_in)
            return
        if self._tail_anchor is None:
            return  # the tail is over (or the silence began before this canceller's first frame)
        decay = self.tail_decay_db
        if (k - TAIL_ANCHOR_FRAMES) * decay >= TAIL_LENGTH_DB and k - TAIL_ANCHOR_FRAMES > TAIL_FIT_FRAMES \
                or k >= TAIL_MAX_FRAMES:
            self._end_tail_fit()
            self._tail_anchor = None  # nothing more to follow until the far end plays again (idle: no work)
            return
        pred = self._tail_anchor * 10 ** (-decay * (k - TAIL_ANCHOR_FRAMES) / 10)
        quiet_far = e_far < TAIL_FAR_SILENT * FRAME  # (a far end between this and FAR_ACTIVE still has an echo)
        if quiet_far and np.any((b_in >= pred * 10 ** (TAIL_MARGIN_DB / 10)) & (b_in >= TAIL_MIN_POWER * FRAME)):
            self._tail_broken = True
        if k - TAIL_ANCHOR_FRAMES <= TAIL_FIT_FRAMES and quiet_far and not self._tail_broken:
            level = 10.0 * np.log10(e_in + 1e-20)
            if not self._tail_fit or level >= self._tail_fit[0][1] - TAIL_FIT_SPAN_DB:
                self._tail_fit.append((k, level))
        elif k - TAIL_ANCHOR_FRAMES > TAIL_FIT_FRAMES:
            self._end_tail_fit()

    def _end_tail_fit(self) -> None:
        """A silence's measurement is complete: its decay (the slope of a line through its frames' dB, negated)
        joins the newest ``TAIL_SILENCES``, if it had ``TAIL_FIT_MIN_FRAMES`` frames (and the microphone was not
        digitally silent)."""
        if not self._tail_fit:
            return
        fit, self._tail_fit = self._tail_fit, []
        if len(fit) < TAIL_FIT_MIN_FRAMES or fit[0][1] < 10.0 * np.log10(TAIL_MIN_POWER * FRAME):
            return
        k, level = np.array(fit).T
        self._tail_decays.append(float(-np.polyfit(k, level, 1)[0]))
        del self._tail_decays[:-TAIL_SILENCES]
        lo, hi = TAIL_DECAY_RANGE_DB
        self._tail_decay = float(min(hi, max(lo, np.median(self._tail_decays))))

    @property
    def tail_decay_db(self) -> float:
        """The echo tail's decay in the far end's silences, dB per 10 ms frame (60 dB over RT60 / 10 ms): the
        median of the newest ``TAIL_SILENCES`` silences' measurements (a user talking into one measures it
        slower, which only holds the gate longer), within ``TAIL_DECAY_RANGE_DB``; ``TAIL_DECAY_DB`` before
        any."""
        return self._tail_decay

    def _tail_test(self) -> Optional[bool]:
        """In the echo's tail (the far end silent for more than ``TAIL_ANCHOR_FRAMES``, and the predicted tail
        not yet ``TAIL_LENGTH_DB`` under its anchor nor ``TAIL_MAX_FRAMES`` long): whether some band of the
        microphone has risen ``TAIL_MARGIN_DB`` over the tail predicted there in this silence (True: not the
        tail alone). None outside the tail: while the far end plays or within its first frames (the echo's delay), and once the
        tail has died away.

        Why: the tail of the room's reverberation follows one exponential decay whatever was said, and a
        user does not. Measured here, offline: in a room with RT60 300 ms and the echo 6 dB louder than what
        is played, the first reply after a start paused itself in the far end's silence after "Sure. I can",
        on a window of its own tail that the AEC3 stand-in had not reduced at all (+2.3 dB out over in); and
        the tail outlasts the 200 ms after which the gate took the far end for silent (60 dB in 300 ms)."""
        k = self._tail_k - TAIL_ANCHOR_FRAMES
        if k <= 0 or self._tail_anchor is None or k * self.tail_decay_db >= TAIL_LENGTH_DB \
                or self._tail_k >= TAIL_MAX_FRAMES:
            return None
        return self._tail_broken

    def _echo_explained(self) -> bool:
        """While the far end plays (or within ``TAIL_ANCHOR_FRAMES`` of its stop, the echo's delay): every band of
        the microphone's newest 3 frames sits within ``EXPLAINED_DB``
        of the echo that the far end predicts there (:meth:`over_echo`'s prediction: its gain measured, plus the
        room's noise), so nothing in them is not our own echo. False where the prediction is not known yet.

        Why: in a room with RT60 300 ms the AEC3 stand-in, whose linear filter covers about 50 ms of the echo
        path, removed only 8-10 dB of some windows of the first reply (above 2 kHz 2-13 dB), often right after
        a silence between two pieces, and its gate passed them (measured here, offline, 34 first replies with
        the echo 6 dB louder than what is played: 9 paused). Those windows sat at most 2.5 dB above the
        prediction in any band."""
        if self._tail_k > TAIL_ANCHOR_FRAMES:
            return False  # past the echo's delay into a silence: the tail test's (_tail_test), or no echo at all
        gain, noise = self._over_echo_stats() if self._oe_lt_in else (None, None)
        if gain is None or len(self._oe_in) < 3:
            return False
        echo = gain * np.sum(self._oe_pred, axis=0) + 3 * noise
        # (summed into BAND_EDGES_HZ's bands whatever the prediction's own: over 16 finer bands, "every band within
        #   EXPLAINED_DB" let a window of the RT60 300 ms, +6 dB first reply through, measured here, offline, s15)
        mic = np.bincount(_OE_BROAD, np.sum(self._oe_in, axis=0), N_BANDS)
        echo = np.bincount(_OE_BROAD, echo, N_BANDS)
        return bool(np.all(mic < 10 ** (EXPLAINED_DB / 10) * (echo + 1e-10)))

    def _stand_in_fed(self) -> bool:
        """Whether the stand-in processes the frames now: while the far end played within the frames kept
        (0.64 s; there is no echo to keep out otherwise, and AEC3 costs CPU), whether it serves
        (:attr:`stand_in_active`) or Speex does (then as the spare of a hand-back, :meth:`_watch_loss`: 0.09 ms
        per 10 ms frame in AEC3 and 0.14 ms with its bookkeeping, measured here, while a reply plays)."""
        return self._stand_in is not None and self._far_energy_recent(MODEL_RATE) >= 1e-9

    def near_end_ratio_db(self, n: int = 512, ago: int = 0) -> Optional[float]:
        """Output-to-input energy ratio over the last ``n`` processed samples, dB: about −ERLE while only
        echo reaches the microphone, near 0 dB when the near end (the user) dominates. None before any frame.
        ``ago`` > 0: over the ``n``-sample window that ended that many 10 ms frames before the newest (None
        unless the frames kept hold all of it)."""
        k = max(1, n // FRAME)
        if not self._ratio_in or ago and len(self._ratio_in) < k + ago:
            return None
        return _ratio_db(sum(_span(self._ratio_out, k, ago)), sum(_span(self._ratio_in, k, ago)))

    def echo_floor_db(self) -> Optional[float]:
        """The output-to-input energy ratio of the last 2 s of frames with the far end active but the
        newest 300 ms, dB (:func:`_floor_db`): about −ERLE, the canceller's current performance, and not
        moved by a user's onset. None before 0.5 s of such frames."""
        return _floor_db(self._lt_out, self._lt_in)

    def gate_threshold_db(self) -> float:
        """The onset gate's threshold, dB: ``gate_db``, raised to ``echo_floor_db() + gate_margin_db`` while
        the canceller removes less than that (unconverged: after boot, or after the echo path changed),
        and at most ``GATE_MAX_DB``. Converged (ERLE 33–36 dB, measured here) it is ``gate_db``."""
        floor = self.echo_floor_db()
        if floor is None:
            return self.gate_db
        return float(min(GATE_MAX_DB, max(self.gate_db, floor + self.gate_margin_db)))

    def high_band_ratio_db(self, n: int = 512, ago: int = 0) -> Optional[float]:
        """Like :meth:`near_end_ratio_db` (``ago`` too) over the band above ``HB_HZ`` only, dB; None before any
        frame or when the microphone's high band is quieter than ``HB_MIN_POWER`` (the ratio would be noise)."""
        if not self._hb_in:
            return None
        self._fill_bands()
        k = max(1, n // FRAME)
        if ago and len(self._hb_in) < k + ago:
            return None
        e_in = sum(_span(self._hb_in, k, ago))
        if e_in < HB_MIN_POWER * k * FRAME:
            return None
        return _ratio_db(sum(_span(self._hb_out, k, ago)), e_in)

    def high_band_level_db(self, n: int = 512, ago: int = 0) -> Optional[float]:
        """The microphone's high-band power over the last ``n`` samples (``ago``: as :meth:`near_end_ratio_db`)
        relative to its mean over the last 2 s of far-end frames but the newest 300 ms, dB; None before 0.5 s
        of those."""
        if len(self._lt_hb_in) - FLOOR_LAG_FRAMES < LT_FRAMES // 4 or not self._hb_in:
            return None
        self._fill_bands()
        k = max(1, n // FRAME)
        if ago and len(self._hb_in) < k + ago:
            return None
        now = sum(_span(self._hb_in, k, ago)) / k
        kept = self._lt_hb_in[:-FLOOR_LAG_FRAMES]  # not the newest 300 ms, as for the floor (_floor_db)
        usual = sum(kept) / len(kept)
        return 10.0 * np.log10((now + 1e-20) / (usual + 1e-20))

    def level_db(self, n: int = LEVEL_SAMPLES) -> Optional[float]:
        """The microphone's mean power per frame over the last ``n`` samples (whole 10 ms frames, at least
        one) relative to its mean over the last 2 s of far-active frames but the newest 300 ms (the echo's
        usual level, noise included, as :meth:`echo_floor_db` takes them), dB; None before 0.5 s of those.
        Broadband; :meth:`high_band_level_db` is the same above ``HB_HZ``."""
        if len(self._lt_in) - FLOOR_LAG_FRAMES < LT_FRAMES // 4 or not self._ratio_in:
            return None
        k = max(1, n // FRAME)
        now = sum(self._ratio_in[-k:]) / k
        kept = self._lt_in[:-FLOOR_LAG_FRAMES]
        return 10.0 * np.log10((now + 1e-20) / (sum(kept) / len(kept) + 1e-20))

    def high_band_floor_db(self) -> Optional[float]:
        """Like :meth:`echo_floor_db` over the band above ``HB_HZ`` only, dB; None before 0.5 s of far end."""
        return _floor_db(self._lt_hb_out, self._lt_hb_in)

    def high_band_threshold_db(self) -> float:
        """The high-band test's threshold, dB: ``HB_GATE_DB``, raised to the high band's echo floor (its
        output/input ratio over the last 2 s of far-end frames, :func:`_floor_db`) + ``HB_MARGIN_DB`` when
        that is higher:
        a speaker's harmonic distortion or the room's noise, which the canceller cannot remove, raise the
        floor and so the threshold. Above ``HB_MAX_DB``, and before 0.5 s of far-end frames, the high band
        cannot be trusted and the test is off (``inf``)."""
        floor = self.high_band_floor_db()
        if floor is None:
            return float("inf")
        threshold = max(HB_GATE_DB, floor + HB_MARGIN_DB)
        return float(threshold) if threshold <= HB_MAX_DB else float("inf")

    def near_end_present(self, n: int = 512) -> bool:
        """Double-talk test for the VAD's onset gate: True when the last ``n`` samples are not mostly
        cancelled echo, or when the far end has been silent for the echo tail (200 ms) and the window. Four
        tests, any one passes:

        - broadband: the output/input ratio at or above :meth:`gate_threshold_db` (or within
          ``GATE_SOFT_DB`` of it in two consecutive checks);
        - high band (above ``HB_HZ``): the ratio there at or above :meth:`high_band_threshold_db`, over a
          high band no more than ``HB_MIN_REL_DB`` below its usual level (:meth:`high_band_level_db`). A
          user's fricative, plosive or breath ("stop", "hold on") is quiet next to the echo's vowels, so the
          broadband ratio stays low until the user's own vowel, but above 2 kHz the canceller leaves little
          of a linear echo, and the user's consonant fills that band;
        - strong high band (:meth:`_hb_strong_deficit_db`, Speex converged, not in the strict period below): the
          ratio there ``HB_STRONG_DB`` above that threshold, over a high band down to 18 dB under its usual
          level, or here, where the VAD has taken the window for speech, ``HB_SURE_DB`` above it;
        - deep (:meth:`_deep_pass`, Speex converged to a floor of -34 dB or lower): the broadband ratio 20 dB
          over that floor, outside a loud moment of the echo and a volume step.

        In the far end's silences, while the echo's tail still rings (:meth:`_tail_test`: the far end silent
        past the echo's delay, the tail not yet decayed ``TAIL_LENGTH_DB`` at the measured decay), a window
        passes only once some band has risen over the tail predicted there: at once while the stand-in serves,
        after the echo tail and the window (``tail_ms``) with Speex (which cancels that much of the tail itself).
        While the stand-in serves, a window that the far end's predicted echo explains (:meth:`_echo_explained`)
        does not pass on AEC3's figures.

        A reply's first ``NEW_REPLY_FRAMES`` (200 ms) of far end after a second of silence get the strict
        broadband test and no high-band test (here and in :meth:`near_end_clear`), nor the deep one: the echo's
        gain may have changed over the silence (a volume step), and Speex, adapted to the old gain, is behind for
        the reply's first words. Measured here, the 48 kHz JACK room at 0 ppm with a linear speaker, whose echo-only run steps the
        echo from 0 to +6 dB between two replies on the running service: Speex removed only 16-20 dB of the
        louder reply's first 60 ms, its high band passed the high-band test (-12.3 and -8.8 dB against -16) and
        the reply paused on itself in each of 3 live runs; replayed offline through this canceller (the live
        gate decisions reproduced, 509 checks of 2 runs), none of those windows passes now. The simulated room
        never steps the echo's gain on a running canceller, and the suites' barge-ins (0.4 s into a reply or
        later) did not move (99 cases x 2 renderings, offline). On real streams this needs ``FAR_SILENT``: the
        far end between replies there is 1e-43, not zeros, and no reply started afresh (``restarts`` 0 over a
        whole run, replayed).

        At a switch of who serves the VAD (the hand-over, a reused Speex's start and end, the hand-back), nothing passes
        until the new canceller has served the VAD's whole window (``n`` samples: 4 frames of 10 ms at 512): until
        then the window holds the old one's output while the figures are the new one's.

        In doubt (Speex serves, and the gain follower fitted this new reply's start under ``DOUBT_FIT``: the echo
        path may have changed over the silence, or a user talks over the reply's start), no window passes until
        :meth:`_watch_loss` has judged the reply's first ``LOST_REPLY_FRAMES`` (300 ms of far end): then either the
        stand-in serves, or Speex with its usual gate. Here and in :meth:`near_end_clear`.

        Neither passes when the broadband ratio, taken before :func:`_never_louder`, is above ``OVER_DB``
        (+3 dB): the canceller's estimate of the echo is then at least as loud as the microphone (a user's
        speech adds to the input as much as to the output, so it stays near 0 dB), and what the VAD heard
        is the far end that the canceller itself put there. Measured here, offline: after the echo path
        vanished from a converged Speex filter, 64 windows of the next reply over a −70 dBFS noise floor
        scored 0.5 or more and passed the gate; with the clamp and this test, 8 scored 0.5 and none passed.

        Measured here, offline (the bench's voices, echo path and canceller, not paced in real time):
        227 echo-only windows that Silero took for speech, in 30 Piper replies each at 0 and +6 dB echo, reached a
        high-band ratio of −17.5 dB, but only over a high band 22–31 dB below its usual level (the canceller
        is briefly behind where the echo has almost no high band, e.g. the first 200 ms of a reply); none
        passed both conditions. On 144 barge-ins (3 voices, 4 short stops and 2 long interruptions, users
        at −6 and 0 dB, echo at 0 and +6 dB) the user's first windows sat at −16 to +3 dB, and the barge-in
        p50/p95 went from 99/176 ms (broadband test alone) to 68/116 ms.

        Speex just after the hand-over from the stand-in (the first reply after a start). Every band has
        shown convergence then, but Speex's residual still scores as speech to Silero (0.5-0.9) for
        seconds. Two ways it still got through, measured here, offline, on 14 fixed Piper replies x 3
        start offsets x echo gains -20..+6 dB x IR on/off (and on the bench's own cold first replies):

        - A quiet window: where the reply pauses or ends, the microphone holds only the echo's tail and
          noise, the window's ratio rises to -10..0 dB, and the broadband test passed it. Such windows sat
          21-44 dB below the microphone's usual level (:meth:`level_db`, over the newest 20 ms), the users'
          first windows that the broadband test passed at -12.6 dB or above (99 bench barge-ins and 84
          right after the hand-over, users 6 dB under the echo at the quietest). So that test does not
          count for a window more than ``-GATE_MIN_LEVEL_DB`` (18 dB) below that level (the high-band test
          still does, over its own level condition). AEC3's gate never passed such a window here, and while
          it serves (the reply's first seconds, the usual level taken from its first loud words) users'
          first windows sat down to -17 dB: it gets a looser bound of its own (:meth:`_too_quiet`).
        - A window of the running reply: Speex's residual reached -9.9 dB, or -11.7 and -14.3 dB in two
          consecutive checks (the soft pass), 0.5-1.3 s after the hand-over, never later. So for
          ``STRICT_FRAMES`` of far end after the hand-over the broadband test asks for ``GATE_MAX_DB``
          (-6 dB) with no soft pass, within the reply of the hand-over (a far-end silence of
          ``STRICT_GAP_FRAMES``, 1 s, ends it). The cost, on 84 barge-ins 0.15-1.2 s after the hand-over: 14
          detected 10-50 ms later, p50 68-77 -> 76-79 ms, p95 unchanged. Carried over into the next reply
          (the first form), it held back the bench's first barge-ins after the first replies: a user 6 dB
          under the echo 0.4 s into the next reply was heard 706 ms late (measured here, the full bench).
        """
        tail = self._tail_test()
        # The VAD's window still holds what the canceller served before a switch (the hand-over, the reused Speex's
        # start and end, the hand-back) while the gate's figures are the new one's, of its own output: no window
        # passes until the new one has served all of it. Measured live (session 28): the first check after a
        # hand-back passed on AEC3's high band and paused the reply on the echo that Speex had let through.
        switched = self.frames - self._served_since < -(-n // FRAME)
        if self.reused_active:
            passed = self._reused.near_end_present(n) and not switched
            if passed and self._echo_recent(n):
                self._keep_onset_out()  # (as while the stand-in serves: the live Speex's floors decide the hand-over)
            self._trace_gate("reused", passed, ratio_db=self._reused.near_end_ratio_db(n))
            return passed
        if self.stand_in_active and self._stand_in.frames:
            if tail is not None:
                self._trace_gate("tail", tail)
                return tail
            aec3 = self._stand_in.near_end_present(n)
            explained = aec3 and self._echo_explained()
            over = self.over_echo()
            passed = ((aec3 and not explained) or over) and not switched
            if passed and self._echo_recent(n):
                # (a user over our echo: Speex learns on, and its floors decide the hand-over; not while the far end
                #   is silent, where AEC3's gate passes every window and there is no onset in the floors to take out)
                self._keep_onset_out()
            if self.trace is not None:
                self._trace_gate("stand_in", passed, aec3=aec3, explained=explained, over_echo=over,
                                 ratio_db=self._stand_in.near_end_ratio_db(n),
                                 threshold_db=self._stand_in.gate_threshold_db(), too_quiet=self._stand_in._too_quiet(n))
            return passed
        t = self._band_tests(n)
        if t is None:
            self._trace_gate("tail" if tail is not None else "no_echo", True if tail is None else tail)
            return True if tail is None else tail
        r, threshold, hb, hb_threshold, level, hb_passed = t
        if not self.warm and self.is_cold(n):
            self._last_soft = None
            self._trace_gate("cold", False)
            if self.record:
                self.cold_log.append((self.frames, round(float(self.expected_residual_db(n)), 1)))
            return False
        # A ratio just under the threshold passes when the previous check, one VAD hop (16 ms) earlier, was
        # also within GATE_SOFT_DB of it: a user's onset under louder echo keeps the ratio up from window to
        # window, while the echo's excursions (the canceller momentarily behind) last one window.
        soft = r >= threshold - GATE_SOFT_DB
        if self._just_handed_over():
            # Speex has just taken over from the stand-in (see the notes above): strict for STRICT_FRAMES.
            threshold, soft = max(threshold, GATE_MAX_DB), False
        new_reply = self._reply_far < NEW_REPLY_FRAMES
        if new_reply:
            threshold, soft = max(threshold, GATE_MAX_DB), False
        if self.echo_floor_db() is None:
            # The floor is not known yet (the first 0.8 s of far end): the AEC3 stand-in removes only 7-14 dB
            # of the reply's first words then, and its gate passed them at -14..-7 dB (measured here, offline,
            # in 5-6 of 390 cold first replies, all in the reply's first 0.85 s).
            threshold, soft = max(threshold, GATE_NO_FLOOR_DB), False
        passed = r >= threshold or (soft and self._last_soft is not None and self.frames - self._last_soft <= 2)
        self._last_soft = self.frames if soft else None
        if passed and self._too_quiet(n):
            passed = False
        strong = self._hb_strong_deficit_db(t, n, sure=True)  # the gate sees only windows the VAD took for speech
        if new_reply:
            hb_passed, strong = False, None
        deep = not new_reply and self._deep_pass(r, hb)
        passed = (passed or hb_passed or deep or (strong is not None and strong <= 0.0)) and r <= OVER_DB
        doubt = self._reply_doubt
        if passed:
            self._keep_onset_out()  # (in doubt too: a user's onset held back stays out of the floors all the same)
        if doubt or switched:
            passed = False
        if self.record:
            self.gate_log.append(self._log_row((r, threshold) + t[2:], passed, strong))
        if self.trace is not None:
            self._trace_gate("speex", passed, ratio_db=r, threshold_db=threshold, hb_db=hb,
                             hb_threshold_db=hb_threshold, hb_passed=hb_passed, strong_db=strong, deep=deep, doubt=doubt)
        return passed

    def _deep_pass(self, r: float, hb: Optional[float]) -> bool:
        """The onset gate's deep form, for a window the VAD took for speech (Silero at its threshold or more):
        Speex converged and deep (its echo floor at most ``DEEP_FLOOR_MAX_DB``, -34 dB; not in the strict period
        after the hand-over), the window's broadband ratio ``r`` (dB) at least ``DEEP_MARGIN_DB`` (20 dB) above
        that floor, its high-band ratio ``hb`` (dB) at least ``DEEP_HB_MIN_DB`` (-36 dB), the newest 20 ms
        (:meth:`level_db`) between ``GATE_MIN_LEVEL_DB`` (-18 dB) and ``DEEP_LEVEL_MAX_DB`` (+3 dB) of the
        microphone's usual level, and Speex's residual over the 200 ms that ended 100 ms earlier
        (``DEEP_PRE_FRAMES``) at most ``DEEP_PRE_DB`` (10 dB) above the floor. The caller leaves a new reply's
        first ``NEW_REPLY_FRAMES`` out. Never on a reused Speex (:meth:`_advance_reuse`: strict for as long as it serves,
        its floors come from the frames it adapted on; it passed a reply's own echo at -13.9 dB over a training floor
        under -34 dB).

        Why: a nasal "No." under echo 6 dB louder than the user comes out of a converged Speex at -27 to -15 dB
        broadband (its murmur is quiet next to the echo's vowels, and has too little high band for the high-band
        tests), while :meth:`gate_threshold_db` is ``onset_gate_db`` (-10 dB) however deep the floor: the gate
        refused the user's first 30-90 ms, and in the simulated bench "No." at +6 dB was the slowest short stop,
        110-117 ms in each voice in session 19's run (87-127 ms in sessions 16-18). The bounds: Speex's residual
        on echo alone reaches 20-24 dB over its floor at a loud moment of the reply (the microphone 9-11 dB over
        its usual level) and in a reverberant room with no high band left (-42 to -49 dB there); and after a
        volume step over a silence the whole reply's residual is up, which the floor, 2 s long, does not show
        yet (a 100-reply JACK-room tap at 0 ppm, replayed: the reply after its 0 -> +6 dB step came out at
        -13 dB, Silero 0.8-1.0, and without the residual test this form passed it 100 ms before the gate's other
        tests did).

        Measured here, offline, with ``tools/gate-eval`` (the simulated room, a converged Speex, fixed Piper replies;
        docs/measurements.md, session 20): over 132 echo-only replies (11 replies x echo -10, 0, +6, +10 dB x RT60
        150 ms, none and 300 ms) this form passed 395 windows on its figures and Silero scored none of them over
        0.25 (the gate sees 0.5 or more); over 44 replies after a +6 dB step, 98 windows, at most 0.44 (in a reply
        the gate's other tests had paused 0.17 s in). The replies' onsets were the same as without this form (1
        at +10 dB; 17 after the step, see NEW_REPLY_FRAMES). "No." at +6 dB (3 voices x 4 points x 3 replies):
        p50 / p95 / max 59 / 100 / 103 -> 55 / 85 / 99 ms; "Wait." 57 / 86 / 93 -> 54 / 84 / 93; the others
        unchanged.
        """
        if self.backend != "speex" or not self.warm or self._just_handed_over() or hb is None or hb < DEEP_HB_MIN_DB:
            return False
        floor = self.echo_floor_db()
        if floor is None or floor > DEEP_FLOOR_MAX_DB or r < floor + DEEP_MARGIN_DB:
            return False
        level = self.level_db(LEVEL_SAMPLES)
        if level is None or not GATE_MIN_LEVEL_DB <= level <= DEEP_LEVEL_MAX_DB:
            return False
        ago, k = DEEP_PRE_FRAMES
        pre = self.near_end_ratio_db(k * FRAME, ago)
        return pre is not None and pre <= floor + DEEP_PRE_DB

    def _just_handed_over(self) -> bool:
        """Speex has taken over from the stand-in less than ``STRICT_FRAMES`` far-active frames ago, and the
        far end has not been silent for ``STRICT_GAP_FRAMES`` since (the reply of the hand-over still plays); or
        this is a reused Speex (:meth:`_advance_reuse`), strict for as long as it serves."""
        return self._reused_floors or \
            self.handovers > 0 and self.warm and self._far_frames - self._handover_far < STRICT_FRAMES

    def _too_quiet(self, n: int = 512) -> bool:
        """The broadband test does not count for a window far below the microphone's usual level while the
        far end plays (:meth:`level_db`): what is left there is the echo's quiet end or its tail, not a user.

        - Speex: the window's newest ``LEVEL_SAMPLES`` more than ``-GATE_MIN_LEVEL_DB`` (18 dB) below (see
          :meth:`near_end_present`).
        - WebRTC AEC3 (the stand-in, or ``echo.backend: webrtc``): the whole window (``n`` samples) more than
          ``-AEC3_MIN_LEVEL_DB`` (25 dB) below. Measured here, the 48 kHz JACK room at +300 ppm (the service's
          own streams replayed offline): as a reply's first phrase ended, its echo's reverberant tail, 26 dB
          under the echo's usual level, came out of a freshly started AEC3 as loud as it went in (+1.8 dB),
          Silero scored it 0.83 and the reply paused. While the stand-in serves, users' first windows sat
          down to -17 dB (offline, the simulated room), so AEC3 gets the looser bound over the longer window.
        """
        if self.backend == "speex":
            level = self.level_db(LEVEL_SAMPLES)
            return level is not None and level < GATE_MIN_LEVEL_DB
        level = self.level_db(n)
        return level is not None and level < AEC3_MIN_LEVEL_DB

    def near_end_clear(self, n: int = 512) -> bool:
        """The strict double-talk test, for a window the VAD is unsure of while the far end plays: True when
        both of :meth:`near_end_present`'s first two tests pass at once, the broadband ratio at or above
        :meth:`gate_threshold_db` (no soft pass) and the high-band test, or when the strong high-band test
        (:meth:`_hb_strong_deficit_db`, plain or held) passes. False while the far end is silent or before any
        frame: then there is no echo to tell the user from, and the VAD alone decides.

        Why both (measured here, offline, on the bench's voices, echo path and canceller, with the floors'
        first form and the high band at −20 dB): over 48 echo-only replies (5.6 min, echo at 0, +6 and
        +10 dB), windows that Silero scored 0.2 or more came within 7.0 dB of passing both tests at the
        closest, while either test alone passed in places (by up to 10 dB broadband, 13 dB high band). In
        two full bench runs of this code the closest was 10.9 and 15.2 dB (``onset_early_min_headroom_db``).
        A user's "s" or "st" passes both within 20–60 ms of its onset, while Silero still scores it
        0.05–0.45, until the vowel 100–150 ms later.

        The broadband test here has a soft pass of its own (:meth:`_soft_twice`): within ``GATE_SOFT_DB`` of
        the threshold in this window and in the window 20 ms earlier (the gate's soft pass asks its previous
        check, which a window scored under 0.5 never was). A glide or a "w" under louder echo keeps the ratio
        just under the threshold for tens of ms while the high band is already the user's (measured here,
        offline: en-us "Stop." 2.0 s into the tests' reply under echo 6 dB louder was taken 40 ms in instead of
        104). Echo-only windows that Silero scored 0.2-0.5 came 7.6 dB short of this form at the closest
        (measured here, offline, over 1302 echo-only replies and 156 barge-ins' echo; figures in
        docs/measurements.md).
        """
        if not self.warm:
            self._trace_gate("clear", False, stand_in=self.stand_in_active)
            return False  # no early onsets until Speex has shown convergence
        t = self._band_tests(n)
        if t is None:
            return False
        r, threshold, _, _, _, hb_passed = t
        broadband = threshold <= r or self._soft_twice(r, threshold, n)
        strong = self._hb_strong_deficit_db(t, n)
        passed = bool((broadband and hb_passed or strong is not None and strong <= 0.0) and r <= OVER_DB) and \
            self._reply_far >= NEW_REPLY_FRAMES and not self._reply_doubt
        if passed:
            self._keep_onset_out()
        if self.record:
            self.clear_log.append(self._log_row(t, passed, strong))
        if self.trace is not None:
            self._trace_gate("clear", passed, ratio_db=r, threshold_db=threshold, hb_passed=hb_passed,
                             strong_db=strong, doubt=self._reply_doubt)
        return passed

    def _soft_twice(self, r: float, threshold: float, n: int = 512) -> bool:
        """:meth:`near_end_clear`'s soft broadband pass: the window's ratio ``r`` (dB) and that of the window
        ``CLEAR_SOFT_FRAMES`` (20 ms) earlier both within ``GATE_SOFT_DB`` of ``threshold`` (dB); never in the
        strict period after the hand-over, before the echo floor is known, or for a window too quiet for the
        broadband test to count (:meth:`_too_quiet`), as the gate's own soft pass."""
        if r < threshold - GATE_SOFT_DB or self._just_handed_over() or self.echo_floor_db() is None:
            return False
        before = self.near_end_ratio_db(n, CLEAR_SOFT_FRAMES)
        return before is not None and before >= threshold - GATE_SOFT_DB and not self._too_quiet(n)

    def _hb_strong_deficit_db(self, t: tuple, n: int = 512, sure: bool = False) -> Optional[float]:
        """How far the strong high-band test is from passing, dB (0 or less: it passes), on
        :meth:`_band_tests`' figures ``t`` over the last ``n`` samples; None where it is off: not Speex, not
        converged, in the strict period after the hand-over (:meth:`_just_handed_over`), or no high band to
        judge (its ratio, level or threshold unknown). It passes in any of three forms:

        - plain: the high band's ratio at least ``HB_STRONG_DB`` (10 dB) above
          :meth:`high_band_threshold_db`, over a high band at most ``-HB_STRONG_MIN_REL_DB`` (18 dB) below its
          usual level, and a broadband ratio of at least ``HB_STRONG_MIN_RATIO_DB`` (-22 dB);
        - held: the same high band with a broadband ratio down to ``HB_STRONG_HELD_MIN_RATIO_DB`` (-30 dB),
          where the window ``HB_STRONG_HELD_FRAMES`` (20 ms) earlier passed the plain form;
        - sure (``sure``: the onset gate, on a window the VAD scored at its threshold or more): the high band
          ``HB_SURE_DB`` (6 dB) above its threshold over the same level, with no broadband condition.

        Why: under echo louder than the user, a short stop's broadband ratio stays under the threshold until
        its vowel, and the plain high-band test waits for a high band near its usual level, which a nasal
        ("No.") or a quiet "st" reaches only with the vowel: the gate refused the user's first 50-100 ms. A
        high band that is mostly not echo (its ratio near 0 dB; the cancelled echo's sits near -35 dB) is
        the user's even where it is quieter than the echo's usual high band. Measured here, offline (the
        bench's voices, echo path and canceller; 1302 echo-only first and later replies at echo -20 to
        +10 dB, with and without the IR, and the echo before 156 barge-ins), for the plain form: outside the
        strict period, the echo-only windows that Silero scored 0.1 or more came 4.4 dB short of passing at
        the closest (a window at -26.4 dB broadband had a high band 7.6 dB above its threshold, hence the
        broadband condition); within it, one passed by 2.5 dB, hence off there. The users' first windows
        that it passed: high band 10-17 dB above the threshold, broadband -22 to -2 dB.

        The held and sure forms (measured here, offline, the same harness, the bench's barge-ins over 7 Piper
        renderings of the replies): an "st" that Silero scored under 0.2 while it passed the plain form, then
        0.2 at -24.6 dB broadband 86 ms in, waited 60 ms more for its vowel; a nasal "No." under louder echo,
        which Silero scored 0.5-0.9 for 30-50 ms, had a high band 6-10 dB above its threshold and 10-15 dB under
        its usual level, at -38 to -18 dB broadband. The echo-only windows that Silero scored 0.2 or more
        outside the strict period (the 1302 replies and 156 barge-ins above) came 6.8 dB short of the plain
        form at the closest (the grid's +6 dB room), 9.4 dB short of the held form (set by its window 20 ms
        earlier: any broadband bound from -26 dB down left the same margin), and the 27 that Silero scored
        0.5 or more 14.7 dB short of the sure form.
        """
        if self.backend != "speex" or not self.warm or self._just_handed_over():
            return None
        r, _, hb, hb_threshold, level, _ = t
        if hb is None or level is None or not np.isfinite(hb_threshold):
            return None
        hb_short = hb_threshold + HB_STRONG_DB - hb
        level_short = HB_STRONG_MIN_REL_DB - level
        d = max(hb_short, level_short, HB_STRONG_MIN_RATIO_DB - r)
        before = self._window_db(n, HB_STRONG_HELD_FRAMES)
        if before is not None:
            r0, hb0, level0 = before
            d0 = max(hb_threshold + HB_STRONG_DB - hb0, HB_STRONG_MIN_REL_DB - level0, HB_STRONG_MIN_RATIO_DB - r0)
            d = min(d, max(hb_short, level_short, HB_STRONG_HELD_MIN_RATIO_DB - r, d0))
        if sure:
            d = min(d, max(hb_threshold + HB_SURE_DB - hb, level_short))
        return float(d)

    def _window_db(self, n: int, ago: int) -> Optional[tuple]:
        """The broadband ratio, high-band ratio and high-band level (dB, as :meth:`near_end_ratio_db`,
        :meth:`high_band_ratio_db` and :meth:`high_band_level_db` take them) of the ``n``-sample window that
        ended ``ago`` frames before the newest; None where one of them is unknown there."""
        if len(self._ratio_in) < max(1, n // FRAME) + ago:
            return None
        figures = (self.near_end_ratio_db(n, ago), self.high_band_ratio_db(n, ago), self.high_band_level_db(n, ago))
        return None if None in figures else figures

    def _keep_onset_out(self) -> None:
        """The gate has just taken the last window for the user: take the newest ``FLOOR_LAG_FRAMES`` of
        far-end frames (the frames the floors have not used yet, where the user's onset is) out of the
        broadband and high-band floors and the bands' (whose floors decide the hand-over), and keep the next
        ``FLOOR_HOLD_FRAMES`` out too (the reply plays on until the pause takes hold); they no longer count
        towards the hand-over's deadline either. Whoever serves: while the stand-in does, Speex learns on.

        Why: the lag keeps a user's onset out of the floor only for 300 ms. Then it entered the floors and
        stayed there for the next 2 s of far end, that is into the next reply: measured here, offline, on
        the bench's barge-ins (each on the canceller the room's earlier cases left, as a service's), the
        high-band floor that the previous barge-in's "s" or "st" left put the high-band test's threshold
        above ``HB_MAX_DB`` (the test off) in nearly every case, and with it the early onsets, so that
        "Stop." waited for Silero's vowel (146–186 ms). A false pass only costs the floors 300 ms of
        history. (The floors then leave out those frames' echo as well: they move by a dB or two.)

        The bands' floors, while the stand-in serves (measured here, offline, closed loop: a user barging in
        0.6 s into each reply, which stopped 60 ms after the pass, echo -6 to +6 dB re the user, the simulated
        room): with the user's speech in them, Speex never showed convergence (floors -14 to -5 dB after 30
        such replies, 20 s of far end: the deadline then kept the stand-in for good); without it, Speex took
        over at the 6th or 7th reply, and the barge-ins after it were heard 30-60 ms after the onset against
        110-240 before."""
        k = min(self._lt_new, FLOOR_LAG_FRAMES, len(self._lt_in))  # (a pass right after a pass: only the new ones)
        if k:
            for buf in (self._lt_in, self._lt_out, self._lt_hb_in, self._lt_hb_out):
                del buf[-k:]
            self._deadline_far -= k
        for b in range(N_BANDS):
            kb = min(int(self._lt_band_new[b]), FLOOR_LAG_FRAMES, len(self._lt_band_in[b]))
            if kb:
                for buf in (self._lt_band_in[b], self._lt_band_out[b], self._lt_band_far[b]):
                    del buf[-kb:]
        self._lt_new = 0
        self._lt_band_new[:] = 0
        self._floor_hold_until = self.frames + FLOOR_HOLD_FRAMES
        for j in range(max(0, len(self._ring) - FLOOR_LAG_FRAMES), len(self._ring)):
            self._ring[j] = self._ring[j][:3] + (True,)  # (data reuse measures its floors as these do)

    def _band_tests(self, n: int) -> Optional[tuple]:
        """The two bands' figures over the last ``n`` samples: (broadband ratio, its threshold, high-band
        ratio or None, its threshold, high-band level or None, whether the high-band test passes), dB;
        None before any frame, or when the far end has been silent for the echo tail and the window (no
        echo to tell the user from)."""
        if not self._echo_recent(n):
            return None
        r = self.near_end_ratio_db(n)
        if r is None:
            return None
        hb = self.high_band_ratio_db(n)
        hb_threshold = self.high_band_threshold_db()
        level = self.high_band_level_db(n)
        hb_passed = bool(hb is not None and hb >= hb_threshold and level is not None and level >= HB_MIN_REL_DB)
        return r, self.gate_threshold_db(), hb, hb_threshold, level, hb_passed

    def _log_row(self, t: tuple, passed: bool, strong: Optional[float] = None) -> "GateRow":
        """A row of :attr:`gate_log` or :attr:`clear_log` from :meth:`_band_tests`' figures and the strong
        high-band test's shortfall (:meth:`_hb_strong_deficit_db`)."""
        r, threshold, hb, hb_threshold, level, _ = t
        rnd = lambda x: None if x is None else round(float(x), 1)  # noqa: E731
        return GateRow(self.frames, rnd(r), rnd(threshold), passed, rnd(hb), rnd(hb_threshold), rnd(level),
                       rnd(self.level_db(LEVEL_SAMPLES)), rnd(strong))

    def _echo_recent(self, n: int) -> bool:
        """The far end played within the echo tail and the last ``n`` samples: there is an echo to tell a user from."""
        return self._far_energy_recent(n + self._tail) >= 1e-7

    def _far_energy_recent(self, n: int) -> float:
        """Mean far-end power per sample over the last ``n`` samples (at most the 64 frames kept)."""
        k = max(1, n // FRAME)
        return sum(self._ratio_far[-k:]) / (k * FRAME)

    @property
    def ms_per_frame(self) -> Optional[float]:
        """Mean compute time per 10 ms frame that went through the library, ms (measured here; the
        re-warms after a bypass included, the bypassed frames not), or None before any such frame."""
        done = self.frames - self.bypassed_frames
        return self.busy_s * 1000.0 / done if done > 0 else None


class _Reuse:
    """A data reuse under way (:meth:`EchoCanceller._advance_reuse`): the new Speex, the frames it adapts on, where
    it is (frame ``pos`` of pass ``passes``, counted from 0) and the last pass's output frames."""

    def __init__(self, speex: _SpeexMdf, frames: list):
        self.speex, self.frames = speex, frames
        self.pos = self.passes = 0
        self.outs: tuple[list, list] = ([], [])  # the output frames of the last two passes


class LostEcho(NamedTuple):
    """What a hand-back from Speex to the stand-in judged (:attr:`EchoCanceller.lost`)."""

    erle_db: float  # the median per-frame ERLE of the frames judged, dB
    corr: float  # the correlation of Speex's output level with the far end's over them
    over: str  # which frames: "a reply's first 300 ms", "the last 2 s of reply" (EchoCanceller._watch_loss) or
    #   "the 300 ms before a second pause on it" (EchoCanceller.note_false_onset)


class GateRow(NamedTuple):
    """One onset-gate check (a row of :attr:`EchoCanceller.gate_log` or ``clear_log``), dB rounded to 0.1."""

    frame: int  # the canceller's frame count at the check (10 ms frames)
    ratio_db: Optional[float]  # output/input energy of the window (-ERLE on echo alone)
    threshold_db: Optional[float]
    passed: bool
    hb_ratio_db: Optional[float]  # the same above HB_HZ
    hb_threshold_db: Optional[float]
    hb_level_db: Optional[float]  # the high band's level relative to its usual level
    level_db: Optional[float] = None  # the newest 20 ms's level relative to the usual level (EchoCanceller.level_db)
    strong_db: Optional[float] = None  # how far the strong high-band test was from passing (<= 0: it passed); None:
    #   the test was off (EchoCanceller._hb_strong_deficit_db)


def _span(frames: list, k: int, ago: int) -> list:
    """The ``k`` per-frame figures that ended ``ago`` frames before the newest (fewer where the list is short)."""
    return frames[max(0, len(frames) - k - ago):len(frames) - ago]


def _curve(far: np.ndarray, drive: float) -> np.ndarray:
    """A loudspeaker driven into soft clipping, as the far end's model of it: ``tanh(drive x) / drive`` (unity gain
    for small signals); ``drive`` 0: linear. float32 [n] in and out."""
    return far if drive <= 0 else (np.tanh(drive * far) / drive).astype(np.float32)


def _ratio_db(e_out: float, e_in: float) -> float:
    """Output-to-input energy ratio, dB (−ERLE on echo alone)."""
    return float(10.0 * np.log10((e_out + 1e-12) / (e_in + 1e-12)))


def _floor_db(lt_out: list, lt_in: list) -> Optional[float]:
    """The echo floor: :func:`_ratio_db` over the far-end frames kept (the last 2 s) but the newest
    ``FLOOR_LAG_FRAMES``, dB; None before 0.5 s of them.

    Why the lag: the frames kept include the user's first frames as soon as they talk over the reply, and
    30–50 ms of a user over the echo carry more output energy than 2 s of cancelled echo, so the floor rose
    with the very onset the gate must pass (measured here, espeak-ng en-us+f3 "Stop." under echo 6 dB
    louder: the high-band threshold went from −20 dB to −6.9 dB 27 ms into the "s", and the test switched
    itself off at 47 ms; the barge-in waited for the vowel, 157 ms, instead of 47 ms). The lag keeps the
    onset out of the floor until the barge-in has long been decided (p95 under 100 ms), while the floor
    still follows what the canceller cannot remove, such as a distorting speaker, with a 300 ms delay.
    (A median of the frames' ratios is not moved by an onset either, but it does not follow a speaker's
    distortion, which sits in the loudest frames: measured here, offline, with a tanh loudspeaker at
    −24 dB of distortion, the appliance paused on its own echo in 17 of 32 replies, against 9 with the lag,
    and 3 once the high band's margin was 22 dB.)
    """
    if len(lt_in) - FLOOR_LAG_FRAMES < LT_FRAMES // 4:
        return None
    return _ratio_db(sum(lt_out[:-FLOOR_LAG_FRAMES]), sum(lt_in[:-FLOOR_LAG_FRAMES]))


def _energy(frames: np.ndarray) -> np.ndarray:
    """``sum(x**2)`` of each row of ``frames`` (float32 [n, FRAME]), float64 [n]."""
    x = frames.astype(np.float64)
    return np.einsum("ij,ij->i", x, x)


def _never_louder(out: np.ndarray, e_out: np.ndarray, e_in: np.ndarray) -> np.ndarray:
    """Scale each row of ``out`` (float32 [n, FRAME], in place) whose energy ``e_out`` exceeds the energy
    ``e_in`` of the canceller's input for that frame by more than ``OVER_DB`` down to the input's energy;
    returns which rows it scaled (bool [n]). The onset gate sees the ratio before this (``OVER_DB``).

    Why: a canceller only takes away. An output louder than its input is the adaptive filter's own estimate
    of an echo that is not there (the filter adapted during double talk, or the echo path changed), that is
    the far end, filtered, put into the near end by the canceller itself. Measured here, in the bundled
    demo (a room with no echo path): Speex's filter adapted on the user's "Wait, stop." over the reply, and
    on the next reply it wrote that reply's speech into a digitally silent microphone signal at −45 to
    −60 dBFS; Silero scored it 0.53–0.55, the onset gate saw an output/input ratio of +98 dB, and the reply
    paused on itself in 3 of 15 runs. (A smaller excess is the estimate's error as an echo dies away, at
    −50 to −95 dBFS: clamping those frames too changed which echo-only windows Silero scored 0.5.)
    """
    over = e_out > e_in * 10 ** (OVER_DB / 10)
    if over.any():
        out[over] *= np.sqrt(e_in[over] / e_out[over])[:, None].astype(np.float32)
    return over


def _band_energies(frames: np.ndarray) -> np.ndarray:
    """Energy of each row of ``frames`` (float32 [n, FRAME]) in each band of ``BAND_EDGES_HZ``, Hann-windowed,
    scaled so that a white signal's band energy is its share of ``sum(x**2)``; float64 [n, N_BANDS]. The
    last band is the high band (>= ``HB_HZ``) of the onset gate's second test."""
    return _power(frames) @ _BAND_MATRIX


def _power(frames: np.ndarray) -> np.ndarray:
    """Each row of ``frames`` (float32 [n, FRAME]) as power per FFT bin (``_FREQS``), Hann-windowed and scaled as
    :func:`_band_energies` says; float64 [n, FRAME // 2 + 1]."""
    spec = np.fft.rfft(frames * _HANN, axis=1)
    return (spec.real ** 2 + spec.imag ** 2) * (2.0 / (FRAME * 0.375))


def erle_db(near: np.ndarray, out: np.ndarray, mask: Optional[np.ndarray] = None) -> Optional[float]:
    """Echo return loss enhancement, dB: 10·log10(Σ near² / Σ out²) over the samples where ``mask`` is True
    (use a mask of echo-only samples: far end active, no near-end speech or noise). None if no samples."""
    near = np.asarray(near, dtype=np.float64)
    out = np.asarray(out, dtype=np.float64)
    if mask is not None:
        near, out = near[mask], out[mask]
    if not len(near):
        return None
    return float(10.0 * np.log10(max(np.sum(near ** 2), 1e-20) / max(np.sum(out ** 2), 1e-20)))


def stream_delay_ms(out_dac_time: float, out_callback_time: float, in_adc_time: float,
                    in_process_time: float) -> float:
    """The delay WebRTC wants (``set_stream_delay_ms``) from the sounddevice callbacks' own timing, ms:
    ``(t_render - t_analyze) + (t_process - t_capture)``, where ``t_render`` is ``outputBufferDacTime`` of the
    output block, ``t_analyze`` the stream time when that block was handed over as far end
    (``currentTime`` of the output callback), ``t_capture`` the input block's ``inputBufferAdcTime`` and
    ``t_process`` the stream time when the canceller receives it. All in seconds on the PortAudio stream
    clock (``Stream.time``)."""
    return max(0.0, ((out_dac_time - out_callback_time) + (in_process_time - in_adc_time)) * 1000.0)


def from_config(cfg, record: bool = False) -> Optional[EchoCanceller]:
    """The canceller ``config.echo`` describes, or None when ``echo.enabled`` is false."""
    e = cfg.echo
    if not e.enabled:
        return None
    return EchoCanceller(e.backend, noise_suppression=e.noise_suppression, high_pass_filter=e.high_pass_filter,
                         record=record, gate_db=e.onset_gate_db, stand_in=e.stand_in, follow_drift=e.follow_drift,
                         follow_gain=e.follow_gain,
                         speaker_drives=SPEAKER_DRIVES if e.speaker_curve == "auto" else ())
