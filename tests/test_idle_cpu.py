"""What the service costs while it waits (issue 18, item 4): the CPU meter of ``appliance bench idle-cpu``
(``appliance.bench.jack_room``) on a process tree, and the mode itself on a JACK server of its own.

Real parts: ``/proc``, the service's whole assembly and audio worker on PortAudio at 48 kHz, Silero,
Speex, the tiny Gemma 4 fixture. Mocked: the sound card (a JACK dummy driver) and the room.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from appliance.bench import jack_room

BURN = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time\\nend = time.process_time() + 1.5\\nwhile time.process_time() < end: pass"])
child.wait()
time.sleep(5)
"""


def test_the_meter_splits_a_tree_into_the_process_and_its_children():
    """A parent that sleeps while its child spins: the child's CPU is counted in the tree and as a child's."""
    proc = subprocess.Popen([sys.executable, "-c", BURN])
    try:
        time.sleep(0.3)  # the child is running
        split = jack_room.idle_cpu_split(proc.pid, 1.0)
    finally:
        proc.kill()
        proc.wait()
    assert split["children"] >= 20.0, split  # one spinning core, even on a loaded machine
    assert split["service"] <= 10.0, split  # the parent only waits
    assert abs(split["tree"] - split["service"] - split["children"]) <= 0.02, split
    assert jack_room.tree_ticks(proc.pid) == 0  # gone: nothing left to count


def _why_skip():
    if not shutil.which("jackd"):
        return "jackd is not installed (apt-get install jackd2; .ci/run does)"
    try:
        import jack  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"the JACK-Client package is not usable ({exc})"
    return None


@pytest.mark.skipif(_why_skip() is not None, reason=str(_why_skip()))
def test_bench_idle_cpu_measures_the_listening_service_and_its_worker(tmp_path):
    """``bench idle-cpu`` on a server of its own: the service listens through every window, its audio worker
    is counted, and the whole stays far from a busy loop (the figure itself is the benchmark's)."""
    from conftest import tiny_gemma4_config

    out = tmp_path / "idle.json"
    summary = jack_room.idle(tiny_gemma4_config(), out, seconds=3.0, runs=2, settle_s=1.0,
                             print_line=lambda s: None, server_name="appliance-test-idle48")
    assert out.is_file()
    assert [w["state"] for w in summary["windows"]] == ["listening", "listening"]
    for w in summary["windows"]:
        assert w["children"] > 0.0, w  # the audio worker's callbacks run and are counted
        assert abs(w["tree"] - w["service"] - w["children"]) <= 0.02, w
    assert summary["listening_cpu_pct_min"] <= summary["listening_cpu_pct"] <= summary["listening_cpu_pct_max"]
    assert summary["listening_cpu_pct"] < 25.0, summary  # measured here 6.7-7.5 % before issue 18's cuts
