"""A cached classifier output is trusted unchecked only after ``trust_after`` label audits
(incrinf.stream.guards.QualityGuard.trusting): one audit's lead loss is one draw of a heavy-tailed error, no bound."""

import pytest
import torch
from stream_scenes import H, W, frozen_costs, full_inference, still_camera, wide_classifier

from incrinf.stream.agreement import Comparison, OutputKind
from incrinf.stream.config import StreamConfig
from incrinf.stream.guards import QualityGuard
from incrinf.stream.session import StreamSession
from incrinf.stream.stats import Cause

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _label(lost: float) -> Comparison:
    return Comparison(OutputKind.LABEL, 1.0, 0.01, 0.1, lost)


def test_one_audits_loss_is_no_bound_until_trust_after_audits_measured_the_cache():
    guard = QualityGuard(StreamConfig(target_agreement=0.99, trust_after=2))
    guard.record(_label(0.05), 1)
    # one audit lost 0.05: a margin 200 times that is still checked
    assert not guard.trusting and guard.risky(10.0, 1) and guard.risky(10.0, 1, sampled_error=1e-9)
    guard.record(_label(0.5), 1)
    # the second audit: trusted above the largest loss the two measured, checked within it
    assert guard.trusting and not guard.risky(10.0, 1) and guard.risky(0.45, 1)
    three = QualityGuard(StreamConfig(trust_after=3))
    for lost in (0.05, 0.06):
        three.record(_label(lost), 1)
    assert not three.trusting and three.risky(10.0, 1)
    # a map's audits are counted by its own rule (the share of agreeing positions): one that held is enough
    dense = QualityGuard(StreamConfig(trust_after=2))
    dense.record(Comparison(OutputKind.MAP, 1.0, 0.0, 0.0), 1)
    assert dense.trusting


@pytest.mark.parametrize("trust_after", [1, 2, 3])
def test_the_first_cached_label_frames_are_checked_until_trust_after_audits(trust_after, monkeypatch):
    """Until ``trust_after`` audits, every cached frame runs full inference as well (its output is the full one) and
    such checks are not charged to the cached path (they are the guard's measurements, not near ties)."""
    model = wide_classifier()
    frames = still_camera(2 + trust_after)
    session = StreamSession(model, feature_threshold=0.0, audit_interval=64, keyframe_interval=64,
                            sampled_audits=False, input_size=(H, W), trust_after=trust_after, backoff_after=64)
    frozen_costs(session, monkeypatch)
    for frame in frames:
        torch.testing.assert_close(session(frame), full_inference(model, frame), rtol=1e-4, atol=1e-4)
    checked = session.stats[1:1 + trust_after]
    assert all(s.cause == Cause.AUDIT and s.reason.startswith("audit: near tie") for s in checked)
    assert session._quality.trusting and session._quality.summary.audits == trust_after
    assert session._speed.check_rate == 0.0 and len(session._speed._checks) <= 1
