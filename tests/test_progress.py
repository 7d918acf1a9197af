"""Progress bars: live (carriage-return redraws) on a terminal, a few whole lines in a log or a pipe."""

from __future__ import annotations

import io
import sys

import pytest

from incrinf import progress
from incrinf.progress import progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_bar(monkeypatch, stream: io.StringIO, steps: int = 2000, **kwargs) -> str:
    monkeypatch.setattr(sys, "stderr", stream)
    bar = progress_bar(total=steps, desc="positions", unit="pos", **kwargs)
    for _ in range(steps):
        bar.update(1)
    bar.close()
    return stream.getvalue()


def test_a_log_gets_a_few_whole_lines_ending_at_the_total(monkeypatch) -> None:
    text = run_bar(monkeypatch, io.StringIO())
    lines = text.splitlines()
    assert "\r" not in text and text.endswith("\n")
    assert 1 <= len(lines) <= 3, lines  # the start, maybe one in between, and the end: not one per update
    assert "positions" in lines[-1] and "2000/2000" in lines[-1]


def test_a_log_skips_short_transient_bars_and_cursor_moves(monkeypatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    outer = progress_bar(total=3, desc="inputs", position=0)
    for _ in range(3):
        inner = progress_bar(total=100, desc="positions", leave=False)  # nested: tqdm places it with escapes
        for _ in range(100):
            inner.update(1)
        inner.close()
        outer.update(1)
    outer.close()
    lines = stream.getvalue().splitlines()
    assert "\x1b" not in stream.getvalue() and not any("positions" in line for line in lines)
    assert len(lines) <= 3 and "3/3" in lines[-1]


def test_a_log_gets_a_line_per_interval(monkeypatch) -> None:
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)
    text = run_bar(monkeypatch, io.StringIO(), steps=50)
    assert len(text.splitlines()) >= 25  # the interval decides how often, nothing else


def test_a_terminal_gets_a_live_bar(monkeypatch) -> None:
    text = run_bar(monkeypatch, Terminal(), leave=True)
    assert "\r" in text and "2000/2000" in text


@pytest.mark.parametrize("stream", [io.StringIO, Terminal])
def test_disabled_writes_nothing(monkeypatch, stream) -> None:
    assert run_bar(monkeypatch, stream(), disable=True) == ""
