"""A cached classifier output's leads held against what each class pair lost at the audits
(incrinf.stream.agreement.compare's pair_lost, incrinf.stream.guards.QualityGuard.risky): a distant rival that moves
a lot without mattering no longer sends a frame with a clear runner-up margin to a check; a pair the audits did not
measure falls back to the pooled losses."""

import math

import pytest
import torch
from stream_scenes import frozen_costs, still_camera, wide_classifier

from incrinf.stream.agreement import Leads, compare, top_leads
from incrinf.stream.config import StreamConfig
from incrinf.stream.guards import PAIR_AUDITS, QualityGuard
from incrinf.stream.session import StreamSession

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# full output: class 0 leads class 1 by 0.6, classes 2..5 trail by 3 to 4.5 logits
_FULL = torch.tensor([10.0, 9.4, 7.0, 6.5, 6.0, 5.5, 0.0, -1.0])


def _cached(runner_up: float, distant: float) -> torch.Tensor:
    """The full output with the runner-up's and the distant rival's (class 5) logits moved by these amounts."""
    x = _FULL.clone()
    x[1] += runner_up
    x[5] += distant
    return x


def _audited(runner_ups: tuple[float, ...], distant: float = 1.0) -> QualityGuard:
    """A guard after audits whose runner-up moved by ``runner_ups`` and whose distant rival moved by ``distant``."""
    guard = QualityGuard(StreamConfig(target_agreement=0.99, near_tie=0.02, trust_after=1))
    for moved in runner_ups:
        guard.record(compare(_cached(moved, distant)[None], _FULL[None], 0.99), 1)
    return guard


def test_compare_records_the_signed_lead_change_per_pair():
    comparison = compare(_cached(0.1, -0.9)[None], _FULL[None], 0.99)
    pairs = dict(comparison.pair_lost)
    assert list(pairs) == [(0, 1), (0, 2), (0, 3), (0, 4), (0, 5)]  # closest rival first
    assert pairs[(0, 1)] == pytest.approx(0.1, abs=1e-5)  # the runner-up gained: the cached lead is 0.1 smaller
    assert pairs[(0, 5)] == pytest.approx(-0.9, abs=1e-5)  # the distant rival fell back: the cached lead is larger
    assert pairs[(0, 2)] == 0.0
    assert comparison.lead_lost == pytest.approx(0.9, abs=1e-5)  # the pooled statistic is unchanged: largest either way
    leads = top_leads(_cached(0.1, 0.0)[None])
    assert leads.top == 0 and leads.rivals == (1, 2, 3, 4, 5) and leads.margin == pytest.approx(0.5, abs=1e-5)
    assert top_leads(torch.zeros(1, 3, 4, 4)) is None  # a map has no top-1 lead


def test_a_distant_rival_that_moved_a_lot_leaves_a_clear_runner_up_margin_trusted():
    """Audits lost 0.1 of the lead over the runner-up and 1.0 over a rival 4.5 logits behind. A cached frame that
    leads its runner-up by 0.5: the pooled check (the largest loss over any rival, 1.0) calls it risky; the pairs
    say the runner-up moved 0.1 and the distant rival cannot catch up from 4.5."""
    guard = _audited((0.1,) * PAIR_AUDITS)
    leads = top_leads(_cached(-0.1, 0.0)[None])  # lead 0.7 over the runner-up
    assert leads.margin == pytest.approx(0.7, abs=1e-5)
    assert guard.risky(leads.margin, 1)  # a bare margin: pooled, as before
    assert not guard.risky(leads, 1)
    assert not guard.surely_risky(leads) and guard.surely_risky(leads.margin)
    assert not guard.needs_sample(leads, 1)
    # a distant rival whose own lead is within what it moved is still a risk
    close = Leads(0, (1, 5), (0.7, 0.95))
    assert guard.risky(close, 1)


def test_too_few_audits_of_a_pair_fall_back_to_the_pooled_losses():
    """A pair measured by fewer than PAIR_AUDITS audits, a rival never measured and a new top class are held
    against the pooled losses (the largest change over any rival, here 1.0), as a bare margin is."""
    few = _audited((0.1,) * (PAIR_AUDITS - 1))
    assert few.risky(Leads(0, (1, 5), (0.7, 4.5)), 1)
    guard = _audited((0.1,) * PAIR_AUDITS)
    assert guard.risky(Leads(0, (7, 1), (0.7, 2.0)), 1)  # rival 7 never measured against class 0
    assert guard.risky(Leads(3, (1, 5), (0.7, 4.5)), 1)  # class 3 was never the top at an audit
    assert not guard.risky(Leads(3, (1, 5), (1.1, 4.5)), 1)  # beyond every loss measured
    assert guard.surely_risky(Leads(3, (1, 5), (0.7, 4.5)))
    assert not QualityGuard(StreamConfig(near_tie=0)).risky(Leads(3, (1,), (0.0,)), 1)  # checks off


def test_a_runner_up_that_moved_more_than_the_cached_lead_is_still_caught():
    """Runner-up losses 0.1, 0.3, 0.2 at the audits: a cached frame leading by 0.25 may have flipped (an audit
    lost more than that); one leading by 0.35 may not. Scaled by the frames since the full one as the pooled losses
    are (linear growth with audits at one distance): three frames later 0.35 is within 3 * 0.3."""
    guard = _audited((0.1, 0.3, 0.2) + (0.1,) * max(PAIR_AUDITS - 3, 0))
    flipped = _cached(0.3, 0.0)  # the runner-up caught up by 0.3: full lead 0.6 -> cached 0.3
    assert guard.risky(top_leads(_cached(0.35, 0.0)[None]), 1)  # lead 0.25
    assert not guard.risky(top_leads(_cached(0.25, 0.0)[None]), 1)  # lead 0.35
    assert guard.risky(top_leads(_cached(0.25, 0.0)[None]), 3)
    # an audit that caught the runner-up overtaking: the pair's loss now exceeds the full lead
    guard.record(compare(_cached(0.8, 0.0)[None], _FULL[None], 0.99), 1)
    assert guard.risky(top_leads(flipped[None]), 1) and guard.risky(top_leads(_cached(0.0, 0.0)[None]), 1)


def test_the_session_hands_the_guard_the_cached_outputs_leads(monkeypatch):
    """The session checks a cached classifier output by its top class and leads over its rivals, which agree with
    the output itself."""
    session = StreamSession(wide_classifier(), audit_interval=64, keyframe_interval=64, feature_threshold=0.0,
                            sampled_audits=False, max_backoff=0, trust_after=1)
    frames = still_camera(4)
    session(frames[0])
    frozen_costs(session, monkeypatch)
    seen = []
    monkeypatch.setattr(session._quality, "risky", lambda margin, *_: seen.append(margin) or False)
    outs = [session(frame) for frame in frames[1:]]
    cached = [out for out, s in zip(outs, session.stats[1:]) if s.mode == "cached"]
    assert cached and len(seen) >= len(cached)
    for leads in seen:
        assert isinstance(leads, Leads) and len(leads.rivals) == len(leads.leads) > 0
    last = top_leads(cached[-1])
    assert seen[-1] == last and not math.isnan(last.margin)


def test_the_pairs_kept_are_bounded_least_recently_measured_first(monkeypatch):
    """A long stream's scenes bring new top classes: the guard keeps the losses of the most recently measured
    pairs only, and a pair it dropped is checked against the pooled losses again."""
    import incrinf.stream.guards as guards

    monkeypatch.setattr(guards, "_PAIRS_KEPT", 5)
    guard = _audited((0.1,) * PAIR_AUDITS)  # pairs (0, 1) .. (0, 5)
    assert not guard.risky(Leads(0, (1,), (0.7,)), 1)
    shifted = torch.roll(_FULL, 2)  # top class 2: five new pairs
    guard.record(compare(shifted[None], shifted[None], 0.99), 1)
    assert len(guard._pair_lost) == 5 and (0, 1) not in guard._pair_lost
    assert guard.risky(Leads(0, (1,), (0.7,)), 1)  # back to the pooled losses (1.0 at the earlier audits)
