"""Frames sent to full inference before they are planned after an output whose top-1 margin no sample could clear
(incrinf.stream.guards.QualityGuard.surely_risky): the frame would pay its cached run, its sample and a full check."""

import math

import pytest
import torch
from stream_scenes import frozen_costs, full_inference, still_camera, wide_classifier

from incrinf.stream.agreement import Comparison, OutputKind
from incrinf.stream.config import StreamConfig
from incrinf.stream.guards import QualityGuard
from incrinf.stream.session import StreamSession
from incrinf.stream.stats import Cause

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
                            max_backoff=0, trust_after=1)
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
