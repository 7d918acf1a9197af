"""Near ties checked by a sample of the frame first: a full check only when the sampled drift leaves the margin at
risk (incrinf.stream.guards.QualityGuard.risky, incrinf.stream.session)."""

import math

import pytest
import torch
import torch.nn as nn
from stream_scenes import frozen_costs, full_inference, still_camera, wide_classifier

from incrinf.stream.agreement import Comparison, OutputKind
from incrinf.stream.config import StreamConfig
from incrinf.stream.guards import CAUTIOUS_GROWTH, QualityGuard
from incrinf.stream.session import StreamSession
from incrinf.stream.stats import Cause

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_frames_own_sample_replaces_the_extrapolation_by_frames():
    """One audit lost 0.4 of the lead one frame after a full one, its sample measured 0.1 at the probe. Five frames
    later, without a sample of its own, a frame is scaled by the frames (linear growth with one audit): 2.0, so a
    margin of 0.9 is a near tie. With a sample that measured the same drift as the audit's, the frame is as far off
    as the audit was, not five times: 0.9 is safe; with twice the drift, it is not. Never below the audit's loss."""
    guard = QualityGuard(StreamConfig(target_agreement=0.99, near_tie=0.02, trust_after=1))
    guard.record(Comparison(OutputKind.LABEL, 1.0, 0.01, 0.1, 0.4), 1)
    guard.probe_error(0.1)
    assert guard.measured_loss(5) == pytest.approx(2.0)
    assert guard.risky(0.9, 5)
    assert guard.measured_loss(5, sampled_error=0.1) == pytest.approx(0.4)
    assert not guard.risky(0.9, 5, sampled_error=0.1)
    assert guard.measured_loss(5, sampled_error=0.3) == pytest.approx(1.2) and guard.risky(0.9, 5, sampled_error=0.3)
    assert guard.measured_loss(5, sampled_error=0.01) == pytest.approx(0.4)  # never narrower than the audit's own
    unsampled = QualityGuard(StreamConfig(target_agreement=0.99, trust_after=1))
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
    guard = QualityGuard(StreamConfig(target_agreement=0.99, near_tie=0.02, trust_after=1))
    for lost, probe in ((0.4, 0.25), (0.4, 0.05)):
        guard.record(Comparison(OutputKind.LABEL, 1.0, 0.01, 0.1, lost), 1)
        guard.probe_error(probe)
    assert guard.measured_loss(3, sampled_error=0.15) == pytest.approx(0.4)
    assert not guard.risky(0.6, 3, sampled_error=0.15)
    assert guard.measured_loss(3, sampled_error=0.3) == pytest.approx(0.8)  # twice the pooled drift: twice the loss


def _guard_with_one_audit() -> QualityGuard:
    """An audit lost 0.4 of the lead one frame after a full one; its sample measured 0.1 at the probe."""
    guard = QualityGuard(StreamConfig(target_agreement=0.99, near_tie=0.02, trust_after=1))
    guard.record(Comparison(OutputKind.LABEL, 1.0, 0.01, 0.1, 0.4), 1)
    guard.probe_error(0.1)
    return guard


def test_recent_samples_that_show_a_flat_drift_stand_in_for_a_frames_own():
    """Without samples a frame nine frames after the full one is scaled by the frames (0.4 * 9): a margin of 0.9 is
    at risk and needs a sample. Once eight samples at 2..9 frames measured 0.08-0.12 (the audit's drift, no trend),
    the frame is taken to be as far off as the largest of them (0.12: a loss of 0.48), so 0.9 is trusted without a
    sample and 0.45 is not; seven samples are not enough."""
    guard = _guard_with_one_audit()
    assert guard.risky(0.9, 9) and math.isnan(guard.expected_drift(9))
    errors = (0.09, 0.12, 0.08, 0.1, 0.11, 0.09, 0.1, 0.12)
    for d, error in zip(range(2, 9), errors):
        guard.drift_sampled(d, error)
    assert math.isnan(guard.expected_drift(9)) and guard.risky(0.9, 9)
    guard.drift_sampled(9, errors[-1])
    assert guard.expected_drift(9) == pytest.approx(0.12) and guard.expected_drift(5) == pytest.approx(0.12)
    assert not guard.risky(0.9, 9) and not guard.needs_sample(0.9, 9)
    assert guard.risky(0.45, 9)
    assert guard.risky(0.9, 9, sampled_error=0.3)  # a frame's own sample still decides for it


def test_samples_whose_drift_grows_extrapolate_beyond_the_farthest():
    """Samples whose error grows in proportion to the frames since the full one (slope 1) put a frame twice as far
    as the farthest sample at twice its error: 0.36, a loss of 1.44, so a margin of 0.9 is at risk there although it
    is safe within the samples' reach; samples all taken at one distance extrapolate at the cautious growth."""
    guard = _guard_with_one_audit()
    for d in range(2, 10):
        guard.drift_sampled(d, 0.02 * d)
    assert guard.expected_drift(9) == pytest.approx(0.18)
    assert guard.expected_drift(18) == pytest.approx(0.36, rel=1e-6)
    assert not guard.risky(0.9, 9) and guard.risky(0.9, 18) and guard.needs_sample(0.9, 18)
    one_distance = _guard_with_one_audit()
    for _ in range(8):
        one_distance.drift_sampled(3, 0.1)
    assert one_distance.expected_drift(6) == pytest.approx(0.1 * 2 ** CAUTIOUS_GROWTH)


def test_a_level_change_forgets_the_sampled_drift():
    """Other thresholds, other drift: a miss tightens one level and the samples taken at the old one no longer stand
    in for a frame's own."""
    guard = _guard_with_one_audit()
    for d in range(2, 10):
        guard.drift_sampled(d, 0.1)
    assert not math.isnan(guard.expected_drift(9))
    guard.record(Comparison(OutputKind.LABEL, 0.0, 0.01, 0.1, 0.9), 9)
    assert guard.level == 1 and math.isnan(guard.expected_drift(9)) and guard.risky(0.9, 9)


def test_sample_seed_sets_the_tile_draws():
    """The same ``sample_seed`` gives the same draws of tiles, another seed other draws (a benchmark quotes several);
    a negative or fractional seed is refused."""
    frame = still_camera(1)[0]
    model = wide_classifier()

    def draws(seed: int) -> list[float]:
        session = StreamSession(model, sample_seed=seed, sample_budget=0.8, max_backoff=0)
        session(frame)  # the first frame profiles the engine and picks the sampled audits' probe
        (sampler,) = session._samplers.values()
        return sampler.rng.random(4).tolist()

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)
    for bad in (-1, 1.5, "2"):
        with pytest.raises(ValueError, match="sample_seed"):
            StreamConfig(sample_seed=bad)
