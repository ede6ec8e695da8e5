"""Progress of long work: plain lines under systemd (no timestamps of our own), a tqdm bar on a terminal."""

import io

import pytest

from appliance.progress import Progress


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_plain_lines_under_systemd(monkeypatch):
    monkeypatch.setenv("INVOCATION_ID", "0123456789abcdef")
    out = Tty()  # even on a terminal: systemd's journal wants lines, not a bar
    with Progress("rebuilding KV cache", total=300, unit="tokens", stream=out, interval_s=0.0) as p:
        p.update(100)
        p.update(200)
    lines = out.getvalue().splitlines()
    assert lines[:3] == ["progress: rebuilding KV cache 0/300 tokens (0%)",
                         "progress: rebuilding KV cache 100/300 tokens (33%)",
                         "progress: rebuilding KV cache 300/300 tokens (100%)"]
    assert lines[3].startswith("progress: rebuilding KV cache done in ") and lines[3].endswith(" s")
    assert len(lines) == 4


def test_unknown_length_and_failure(monkeypatch):
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    out = io.StringIO()  # not a terminal: plain lines
    with pytest.raises(RuntimeError):
        with Progress("loading model", stream=out):
            raise RuntimeError("bad file")
    first, last = out.getvalue().splitlines()
    assert first == "progress: loading model..."
    assert last.startswith("progress: loading model failed in ")


def test_lines_are_rate_limited(monkeypatch):
    monkeypatch.setenv("INVOCATION_ID", "x")
    out = io.StringIO()
    p = Progress("copying", total=1000, unit="B", stream=out, interval_s=3600)
    for _ in range(1000):
        p.update(1)
    p.close()
    assert len(out.getvalue().splitlines()) == 2  # the start and the end only


def test_bar_on_a_terminal(monkeypatch):
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    out = Tty()
    with Progress("rebuilding KV cache", total=50, unit="tokens", stream=out) as p:
        for _ in range(50):
            p.update(1)
    text = out.getvalue()
    assert "rebuilding KV cache:" in text and "/50 [" in text and "\r" in text  # a tqdm bar, redrawn in place
    assert text.rstrip().splitlines()[-1].startswith("progress: rebuilding KV cache done in ")
