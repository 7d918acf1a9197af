"""The camera-stream benchmark's per-pass breakdown of the session's mean (benchmarks/stream.py)."""

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
stream = pytest.importorskip("stream")

from incrinf.stream.stats import Cause  # noqa: E402


def _frame(cause: Cause, reason: str = "ok") -> SimpleNamespace:
    return SimpleNamespace(cause=cause, reason=reason)


def test_a_pass_mean_is_its_median_plus_what_each_kind_of_frame_adds():
    """Two passes of four timed frames: the breakdown counts the frames of each kind per pass, and the median plus
    the kinds' shares give the pass's mean."""
    cached, check = _frame(Cause.CACHED), _frame(Cause.AUDIT, "audit: near tie, top-1 agreement 1, hold")
    audit, slower = _frame(Cause.AUDIT, "audit: top-1 agreement 1, hold"), _frame(Cause.SLOWER, "predicted ...")
    session = stream.Run(seconds=[0.020, 0.060, 0.020, 0.022, 0.020, 0.064, 0.046, 0.018],
                         stats=[cached, check, cached, cached, cached, audit, slower, cached])
    plain = stream.Run(seconds=[0.050] * 8, outputs=[None] * 10)
    runs = {"full": plain, "full CL": plain, "full CL fold": plain, "session": session}
    lines = stream.pass_breakdown(runs)
    assert len(lines) == 2
    assert "near-tie check 1" in lines[0] and "cached 3" in lines[0] and not re.search(r"\baudit \d", lines[0])
    assert "audit 1" in lines[1] and "slower 1" in lines[1] and "cached 2" in lines[1]
    for line in lines:
        mean, median = (float(v) for v in re.search(r"mean ([\d.]+) ms = median ([\d.]+)", line).groups())
        parts = [float(v) for v in re.findall(r"\d+: ([+-][\d.]+)", line)]
        assert mean == pytest.approx(median + sum(parts), abs=0.15)
