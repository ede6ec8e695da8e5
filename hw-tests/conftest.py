"""Hardware tests: only on a Raspberry Pi 5 with the appliance's sound card, LED and button attached.
Everywhere else every test here is skipped with the reason."""

from pathlib import Path

import pytest


def _on_pi5() -> bool:
    try:
        return "Raspberry Pi 5" in Path("/proc/device-tree/model").read_text(errors="ignore")
    except OSError:
        return False


def pytest_collection_modifyitems(config, items):
    if _on_pi5():
        return
    skip = pytest.mark.skip(reason="not a Raspberry Pi 5 (/proc/device-tree/model); see hw-tests/README.md")
    for item in items:
        item.add_marker(skip)
