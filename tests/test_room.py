"""The simulated room: echo path (delay + impulse response + gain), near-end ground truth, scenario keys."""

import re

import numpy as np
import pytest

from appliance.audio.files import write_wav
from appliance.audio.room import RoomSpec, Scenario, ScriptedUtterance, SimulatedRoom, synthetic_ir
from appliance.errors import UserError

from conftest import DEMO


def test_synthetic_ir_has_unit_energy_and_decays_60_db_in_rt60():
    ir = synthetic_ir(150.0)
    assert ir.dtype == np.float32 and len(ir) == int(0.150 * 16000)
    assert np.sum(ir.astype(np.float64) ** 2) == pytest.approx(1.0, rel=1e-4)
    assert np.argmax(np.abs(ir)) == 0  # the direct path first
    head = np.sum(ir[1:400] ** 2)
    tail = np.sum(ir[-400:] ** 2)
    assert 10 * np.log10(head / tail) > 30  # decays by tens of dB along the response


def test_echo_path_is_delay_then_ir_times_gain():
    rng = np.random.default_rng(1)
    played = (0.1 * rng.standard_normal(16000)).astype(np.float32)
    pos = [0]

    def read(n):
        x = played[pos[0] : pos[0] + n]
        pos[0] += n
        return x

    ir = synthetic_ir(100.0)
    captured = []
    room = SimulatedRoom(Scenario([], RoomSpec(echo_gain_db=-6.0, echo_delay_ms=30.0, impulse_response=ir)),
                         read, lambda mic, far: captured.append((mic, far)), on_event=lambda r: None, paced=False)
    for _ in range(100):
        room.tick()
    mic = np.concatenate([m for m, _ in captured])
    far = np.concatenate([f for _, f in captured])
    expected = 10 ** (-6 / 20) * np.convolve(played, np.concatenate([np.zeros(480), ir]))[:16000]
    assert np.max(np.abs(mic - expected)) < 1e-5
    assert np.array_equal(far, played)  # the far end handed over is exactly what was played
    assert not any(room.near_active)


def test_near_end_ground_truth_marks_scripted_speech(question_audio):
    ev = ScriptedUtterance(question_audio, "What is a rainbow?", "q", at=0.2)
    records = []
    room = SimulatedRoom(Scenario([ev]), lambda n: np.zeros(n, np.float32), lambda m, f: None,
                         on_event=records.append, paced=False)
    for _ in range(300):
        room.tick()
    (speech,) = [r for r in records if r["event"] == "user_speech"]
    first = room.near_active.index(True)
    # Not before the file starts at 0.2 s (block 20), not after its first sample above -40 dBFS.
    assert 20 <= first <= int(speech["onset_t"] * 100)
    assert speech["onset_t"] >= 0.2 and speech["end_t"] > speech["onset_t"]


def test_scenario_room_keys(tmp_path):
    (tmp_path / "q.wav").write_bytes((DEMO / "question.wav").read_bytes())
    write_wav(tmp_path / "ir.wav", synthetic_ir(80.0) * 0.5, 16000)
    base = "events:\n  - at: 0.5\n    say: q.wav\n"
    p = tmp_path / "a.yaml"
    p.write_text(base + "room:\n  echo_gain_db: 0\n  rt60_ms: 120\n")
    sc = Scenario.load(p)
    assert len(sc.room.impulse_response) == int(0.12 * 16000)
    p.write_text(base + "room:\n  echo_gain_db: 0\n  impulse_response: ir.wav\n")
    sc = Scenario.load(p)
    assert np.sum(sc.room.impulse_response.astype(np.float64) ** 2) == pytest.approx(1.0, rel=1e-3)
    p.write_text(base + "room:\n  rt60_ms: 120\n  impulse_response: ir.wav\n")
    with pytest.raises(UserError, match="not both"):
        Scenario.load(p)
    p.write_text(base + "room:\n  reverb: 3\n")
    with pytest.raises(UserError, match="unknown key"):
        Scenario.load(p)


@pytest.mark.parametrize("room, event, needle", [
    ("  echo_delay_ms: -30\n", "", "room.echo_delay_ms must be between 0 and 2000 ms"),
    ("  rt60_ms: 0\n", "", "room.rt60_ms must be between 1 and 2000 ms"),
    ("  echo_gain_db: 0\n", "    delay: -1\n", "`delay` must be between 0 and 180 seconds, not -1"),
    ("  echo_gain_db: 50\n", "", "room.echo_gain_db must be between -80 and 20 dB, not 50"),
    ("  noise_gain_db: -200\n", "", "room.noise_gain_db must be between -80 and 20 dB"),
    ("  echo_gain_db: 0\n", "    gain_db: 200\n", "event 1: `gain_db` must be between -60 and 40 dB, not 200"),
    ("  echo_gain_db: 0\n", "    delay: 1e9\n", "`delay` must be between 0 and 180 seconds, not '1e9'"),
    ("  echo_gain_db: 0\n", "    delay: soon\n", "`delay` must be a number of seconds, not 'soon'"),
    ("  echo_gain_db: .nan\n", "", "room.echo_gain_db must be a number of dB, not nan"),
])
def test_scenario_values_out_of_range_are_user_errors(tmp_path, room, event, needle):
    """Found by a fresh user: a negative echo delay crashed the room, a negative delay ran anyway."""
    (tmp_path / "q.wav").write_bytes((DEMO / "question.wav").read_bytes())
    p = tmp_path / "a.yaml"
    # (`at:`: a first event `after: speaking` is itself refused, as it can never fire)
    p.write_text("events:\n  - at: 0.5\n    say: q.wav\n" + event + "room:\n" + room)
    with pytest.raises(UserError, match=re.escape(needle)):
        Scenario.load(p)


def test_scenario_numbers_yaml_reads_as_text_and_a_misspelt_events_key(tmp_path):
    """``1e3`` with no dot is text to YAML 1.1 (PyYAML), yet a number to whoever wrote it; a misspelt
    ``events:`` is an unknown key, not "no events"."""
    (tmp_path / "q.wav").write_bytes((DEMO / "question.wav").read_bytes())
    p = tmp_path / "a.yaml"
    p.write_text("events:\n  - at: 5e-1\n    say: q.wav\nroom:\n  echo_delay_ms: 3e1\n")
    sc = Scenario.load(p)
    assert sc.events[0].at == 0.5 and sc.room.echo_delay_ms == 30.0
    p.write_text("evnts:\n  - at: 0.5\n    say: q.wav\n")
    # with its line and the key it is close to, as the events' and the room's keys are named
    with pytest.raises(UserError, match=re.escape("line 1: unknown top-level key(s) ['evnts'] (did you mean 'events'?)")):
        Scenario.load(p)


def test_a_scenario_yaml_error_names_where_the_construct_began(tmp_path):
    """PyYAML reports an unclosed quote where the file ends; the line where it was opened is the fix."""
    p = tmp_path / "a.yaml"
    p.write_text('events:\n  - at: 0.5\n    say: "q.wav\n')
    with pytest.raises(UserError, match=re.escape("invalid YAML at line 4: found unexpected end of stream "
                                                  "(while scanning a quoted scalar that began at line 3)")):
        Scenario.load(p)


def test_a_misspelt_scenario_key_names_its_line_and_the_key_meant(tmp_path):
    """A fresh user's ``sya:`` in the second event: the message names the line, the event and ``say``."""
    (tmp_path / "q.wav").write_bytes((DEMO / "question.wav").read_bytes())
    p = tmp_path / "a.yaml"
    p.write_text("events:\n  - at: 0.5\n    say: q.wav\n  - at: 3.0\n    sya: q.wav\nroom:\n  echo_gian_db: 0\n")
    with pytest.raises(UserError, match=re.escape("line 5: event 2: unknown key(s) ['sya'] (did you mean 'say'?)")):
        Scenario.load(p)
    p.write_text("events:\n  - at: 0.5\n    say: q.wav\nroom:\n  echo_gian_db: 0\n")
    with pytest.raises(UserError, match=re.escape("room: unknown key(s) ['echo_gian_db'] (did you mean 'echo_gain_db'?)")):
        Scenario.load(p)


def test_a_missing_room_file_names_the_scenario_its_line_and_key(tmp_path):
    """The fresh user's missing ``room.impulse_response`` named only the WAV it looked for (session 12); a
    missing ``say:`` file named the scenario, its line and the event. Both now do, and only they say that
    relative paths start at the scenario's folder (a WAV given to ``replay`` itself is no scenario)."""
    (tmp_path / "q.wav").write_bytes((DEMO / "question.wav").read_bytes())
    p = tmp_path / "a.yaml"
    p.write_text("events:\n  - at: 0.5\n    say: q.wav\nroom:\n  echo_gain_db: 0\n  impulse_response: ir.wav\n")
    with pytest.raises(UserError, match=re.escape(f"{p}: line 6: room.impulse_response: {tmp_path / 'ir.wav'}: "
                                                  "audio file not found; check the path (relative paths in a "
                                                  "scenario are relative to the scenario file)")):
        Scenario.load(p)
    p.write_text("events:\n  - at: 0.5\n    say: q.wav\nroom:\n  noise: hum.wav\n")
    with pytest.raises(UserError, match=re.escape(f"{p}: line 5: room.noise: {tmp_path / 'hum.wav'}: audio file")):
        Scenario.load(p)
    from appliance.audio.files import load_audio
    with pytest.raises(UserError) as exc:
        load_audio(tmp_path / "nosuch.wav")
    assert "scenario" not in str(exc.value)
