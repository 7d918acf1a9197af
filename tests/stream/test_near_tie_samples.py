"""Near ties checked by a sample of the frame first: a full check only when the sampled drift leaves the margin at
risk (incrinf.stream.guards.QualityGuard.risky, incrinf.stream.session)."""

import math

import pytest
import torch
import torch.nn as nn
from stream_scenes import frozen_costs, full_inference, still_camera, wide_classifier

from incrinf.stream.agreement import Comparison, OutputKind
from incrinf.stream.config import StreamConfig
from incrinf.stream.guards import QualityGuard
from incrinf.stream.session import StreamSession
from incrinf.stream.stats import Cause

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_frames_own_sample_replaces_the_extrapolation_by_frames():
    """One audit lost 0.4 of the lead one frame after a full one, its sample measured 0.1 at the probe. Five frames
    later, without a sample of its own, a frame is scaled by the frames (linear growth with one audit): 2.0, so a
    margin of 0.9 is a near tie. With a sample that measured the same drift as the audit's, the frame is as far off
    as the audit was, not five times: 0.9 is safe; with twice the drift, it is not. Never below the audit's loss."""
    guard = QualityGuard(StreamConfig(target_agreement=0.99, near_tie=0.02))
    guard.record(Comparison(OutputKind.LABEL, 1.0, 0.01, 0.1, 0.4), 1)
    guard.probe_error(0.1)
    assert guard.measured_loss(5) == pytest.approx(2.0)
    assert guard.risky(0.9, 5)
    assert guard.measured_loss(5, sampled_error=0.1) == pytest.approx(0.4)
    assert not guard.risky(0.9, 5, sampled_error=0.1)
    assert guard.measured_loss(5, sampled_error=0.3) == pytest.approx(1.2) and guard.risky(0.9, 5, sampled_error=0.3)
    assert guard.measured_loss(5, sampled_error=0.01) == pytest.approx(0.4)  # never narrower than the audit's own
    unsampled = QualityGuard(StreamConfig(target_agreement=0.99))
    unsampled.record(Comparison(OutputKind.LABEL, 1.0, 0.01, 0.1, 0.4), 1)  # no probe error: frames scale it
    assert unsampled.measured_loss(5, sampled_error=0.1) == pytest.approx(2.0)




def test_a_near_tie_is_sampled_before_it_is_checked_in_full(monkeypatch):
    """Every cached frame's margin is at risk unless the frame's own sample says otherwise: the first is checked in
    full (no audit has held yet, so no sample can stand in), the later ones by a sample each (a fraction of a
    frame) and returned from the cache; the outputs stay exact (no pruning)."""
    model = wide_classifier()
    frames = still_camera(10)
    session = StreamSession(model, audit_interval=64, keyframe_interval=64, feature_threshold=0.0, sample_budget=0.8,
                            max_backoff=0)
    session._quality.risky = lambda margin, since=1, sampled=math.nan: math.isnan(sampled)
    session(frames[0])  # profiles the engine and picks the sampled audits' probe
    frozen_costs(session, monkeypatch)  # from here on the plans alone decide (no wall clock)
    for frame in frames[1:]:
        torch.testing.assert_close(session(frame), full_inference(model, frame), rtol=1e-4, atol=1e-4)
    stats = session.stats[1:]
    assert stats[0].cause == Cause.AUDIT and stats[0].reason.startswith("audit: near tie")
    later = stats[1:]
    assert all(s.mode == "cached" and not math.isnan(s.sampled_error) for s in later), [s.reason for s in later]


def test_a_map_audit_that_held_without_room_tightens_and_checks_the_next_frames():
    """A dense output's agreement varies from frame to frame around what one audit sees: an audit at 99.3% against
    a 99% target (more than half the budget of disagreeing positions used) leaves the frames between audits on
    both sides of the target. It tightens one level (not a miss: no suspension, no back-off) and the next cached
    frames are checked until an audit holds with room; one at 99.8% settles it and relaxes as before."""
    from incrinf.stream.guards import Verdict

    guard = QualityGuard(StreamConfig(target_agreement=0.99))
    assert guard.risky(math.nan)  # the first cached frame of a map is checked
    verdict = guard.record(Comparison(OutputKind.MAP, 0.993, 0.01, 0.7), 1)
    assert verdict == Verdict.TIGHTEN and guard.level == 1 and not guard.suspended
    assert guard.summary.misses == 0 and guard.interval == guard.min_interval
    assert guard.risky(math.nan, 1)
    verdict = guard.record(Comparison(OutputKind.MAP, 0.998, 0.01, 0.2), 1)
    assert verdict in (Verdict.HOLD, Verdict.RELAX) and guard.level == 1
    assert not guard.risky(math.nan, 1)
    label = QualityGuard(StreamConfig(target_agreement=0.99))  # a classifier's audits do not tighten on a hold
    assert label.record(Comparison(OutputKind.LABEL, 1.0, 0.01, 0.7, 0.1), 1) != Verdict.TIGHTEN
    assert label.level == 0


def test_a_dense_models_first_cached_frame_is_checked_on_the_spot():
    """Nothing has measured the configured thresholds on a dense model before its first audit: its first cached
    frame runs full inference as well and is compared (a check, returned from full inference), not answered from
    the cache unverified until the first due audit."""
    torch.manual_seed(3)
    layers = []
    for c_in, c_out in ((3, 32), (32, 32), (32, 32)):
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Conv2d(32, 4, 1)).eval()
    frames = still_camera(10)
    session = StreamSession(model, speed_guard=False)
    outputs = [session(frame) for frame in frames[:3]]
    first = session.stats[1]
    assert first.audit and first.reason.startswith("audit: check, pixels agreement"), first.reason
    assert first.agreement is not None and session.agreement.audits == 1
    x = torch.from_numpy(frames[1]).permute(2, 0, 1)[None].float() / 255.0
    torch.testing.assert_close(outputs[1], model((x - 0.5) / 0.5), rtol=1e-4, atol=1e-4)  # full inference's


def test_the_sampled_scale_is_taken_against_the_audits_pooled_samples():
    """Two audits lost about the same lead; one audit's own sample drew low (0.05 against 0.25: a sample of four
    tiles varies by a factor of several from draw to draw). A frame whose sample measured 0.15 is scaled against
    the audits' mean sample (0.15: by 1), not against the low draw (by 3), so a margin of 0.6 is no near tie."""
    guard = QualityGuard(StreamConfig(target_agreement=0.99, near_tie=0.02))
    for lost, probe in ((0.4, 0.25), (0.4, 0.05)):
        guard.record(Comparison(OutputKind.LABEL, 1.0, 0.01, 0.1, lost), 1)
        guard.probe_error(probe)
    assert guard.measured_loss(3, sampled_error=0.15) == pytest.approx(0.4)
    assert not guard.risky(0.6, 3, sampled_error=0.15)
    assert guard.measured_loss(3, sampled_error=0.3) == pytest.approx(0.8)  # twice the pooled drift: twice the loss
