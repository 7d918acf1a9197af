"""Frames sent to full inference before they are planned: when a recent plan of a change no larger than its own was
predicted slower than a full frame (incrinf.stream.decisions.SpeedGuard.slower_by_share), and after an output whose
top-1 margin no sample could clear (incrinf.stream.guards.QualityGuard.surely_risky)."""

import math
from collections import deque

import cv2
import numpy as np
import pytest
import skimage.data
import torch
from stream_scenes import H, W, frozen_costs, full_inference, still_camera, wide_classifier

from incrinf.stream.agreement import Comparison, OutputKind
from incrinf.stream.config import StreamConfig
from incrinf.stream.decisions import Prediction, SpeedGuard
from incrinf.stream.guards import QualityGuard
from incrinf.stream.session import StreamSession
from incrinf.stream.stats import Cause

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_share_no_smaller_than_a_slow_plans_is_rejected_unless_a_probe_is_due():
    guard = SpeedGuard()
    guard.record_plan(0.3, Prediction(1.0, 1.2))  # slower than full on its own
    assert guard.slower_by_share(0.35, 1.0) and guard.slower_by_share(0.3, 1.0)
    assert not guard.slower_by_share(0.2, 1.0)  # a smaller change: planned
    guard.record_plan(0.1, Prediction(1.0, 0.6, 0.5))  # slower only with half a frame of expected checks
    assert not guard.slower_by_share(0.15, 1.0)  # no checks expected: it would pay
    guard._checks.extend([True, False] * 4)
    assert guard.slower_by_share(0.15, 1.0)
    guard.record_plan(0.05, Prediction(1.0, 0.1))  # a plan that pays: the scene moved on, the bound is forgotten
    assert not guard.slower_by_share(0.5, 1.0)
    rejecting = SpeedGuard()
    rejecting.record_plan(0.1, Prediction(1.0, 2.0))
    rejected = 0
    while rejecting.slower_by_share(0.5, 1.0):
        rejected += 1
    assert rejected == rejecting.probe_every - 1  # the frame a probe is due on is planned


def _frames() -> list:
    """A still camera alternating between a photo and the photo with its upper half replaced (every frame changes
    half the frame against the previous one), then the photo with a small square (a small change)."""
    photo = cv2.resize(skimage.data.chelsea(), (W, H), interpolation=cv2.INTER_AREA)
    half = photo.copy()
    half[: H // 2] = 255 - half[: H // 2]
    small = photo.copy()
    small[20:28, 30:38] = 250
    return [photo, half, photo, half, photo, small]


def test_a_frame_with_a_change_as_large_as_a_slow_plans_is_not_planned(monkeypatch):
    """Half the frame changes on every frame while the expected near-tie checks cost half a frame: the first such
    frame is planned and rejected, the following ones are rejected without planning (the planner is not called),
    and a frame with a small change is planned again and runs cached. Every output equals full inference."""
    model = wide_classifier()
    session = StreamSession(model, quality_guard=False, max_backoff=0)
    frames = _frames()
    session(frames[0])
    frozen_costs(session, monkeypatch)
    engine = next(iter(session._engines.values()))
    calls = []
    plan = engine.plan
    monkeypatch.setattr(engine, "plan", lambda *args: calls.append(session._index) or plan(*args))
    session._speed._checks = deque([True, False] * 4)  # half a full frame of checks expected per cached frame
    for frame in frames[1:]:
        out = session(frame, homography=np.eye(3))
        torch.testing.assert_close(out, full_inference(model, frame), rtol=1e-4, atol=1e-4)
    stats = session.stats
    assert [s.cause for s in stats[1:5]] == [Cause.SLOWER] * 4
    assert calls[:1] == [1] and 2 not in calls and 3 not in calls and 4 not in calls
    assert all(s.times.plan < 0.05 for s in stats[2:5]) and "recent plan" in stats[2].reason
    # the stats carry the bounding plan's prediction
    assert all(s.predicted_cached + 0.5 * s.predicted_full >= s.predicted_full > 0 for s in stats[2:5])
    assert 5 in calls and stats[5].cause == Cause.CACHED


def test_a_margin_within_the_unscaled_losses_is_surely_at_risk():
    """No sample can clear a margin within the largest loss an audit measured: the frames since the full one and the
    frame's own sample only scale the audits' losses up."""
    guard = QualityGuard(StreamConfig(target_agreement=0.99, near_tie=0.02))
    assert not guard.surely_risky(0.01)  # nothing measured yet
    for lost in (0.04, 0.14, 0.07):
        guard.record(Comparison(OutputKind.LABEL, 1.0, 0.01, 0.1, lost), 1)
    assert guard.surely_risky(0.13) and not guard.surely_risky(0.15)
    assert guard.risky(0.13, 1, sampled_error=1e-9) and guard.risky(0.13, 5)  # whatever the sample or distance
    assert not guard.surely_risky(math.nan) and not QualityGuard(StreamConfig(near_tie=0)).surely_risky(0.0)


@pytest.mark.parametrize("near_tie", [True, False])
def test_after_a_sure_near_tie_the_next_frame_is_not_planned_even_with_samples(near_tie, monkeypatch):
    """With sampled audits ready, a frame after an output whose margin no sample could clear would pay its cached
    run, its sample and a full check: it runs plain without matching, mask or plan (a probe now and then)."""
    model = wide_classifier()
    frames = still_camera(8)
    session = StreamSession(model, audit_interval=64, keyframe_interval=64, feature_threshold=0.0, sample_budget=0.8,
                            max_backoff=0)
    session(frames[0])
    frozen_costs(session, monkeypatch)
    session(frames[1])  # the first cached frame: checked in full (the first audit), after which samples stand in
    assert next(iter(session._samplers.values())).ready
    monkeypatch.setattr(session._quality, "surely_risky", lambda margin: near_tie)
    for frame in frames[2:6]:
        torch.testing.assert_close(session(frame), full_inference(model, frame), rtol=1e-4, atol=1e-4)
    later = session.stats[2:6]
    if near_tie:
        assert all(s.cause == Cause.SLOWER and s.times.plan == s.times.match == 0 for s in later)
    else:
        assert any(s.mode == "cached" for s in later)
