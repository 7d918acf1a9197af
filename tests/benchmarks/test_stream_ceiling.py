"""The ceiling arithmetic of benchmarks/stream_ceiling.py on synthetic losses, margins and logits (no model)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("stream_ceiling", ROOT / "benchmarks" / "stream_ceiling.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["stream_ceiling"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("stream_ceiling", None)


def test_reference_is_the_guards_exponential_quantile(bench):
    losses = [0.1, 0.2, 0.3]
    expected = 0.2 * (1 + 1 / math.sqrt(3)) * math.log(100)  # mean raised by its standard error, 99% quantile
    assert bench.reference(losses) == pytest.approx(expected)
    assert bench.reference([0.0, 0.0, 3.0]) == pytest.approx(max(3.0, 1.0 * (1 + 1 / math.sqrt(3)) * math.log(100)))
    assert bench.reference([]) == math.inf  # nothing measured: every frame is checked


def test_checked_iff_margin_within_the_bound_leave_one_out(bench):
    losses = [0.1] * 9 + [1.0]
    # frames 0-8: the others' mean is 0.2, bound 0.2 * 4/3 * ln 100 = 1.228 >= 1.0; frame 9: the others' mean is 0.1,
    # bound max(0.1, 0.1 * 4/3 * ln 100 = 0.614) < 1.0
    assert bench.checked([1.0] * 10, losses, "loo") == [True] * 9 + [False]
    assert bench.checked([1.3] * 10, losses, "loo") == [False] * 10


def test_checked_causal_uses_only_earlier_frames(bench):
    losses = [0.5, 0.1, 0.1, 0.1]
    margins = [100.0, 0.5 * 2 * math.log(100) - 1e-9, 0.5 * 2 * math.log(100) + 1e-9, 1.0]
    marks = bench.checked(margins, losses, "causal")
    assert marks[0]  # no earlier loss: always checked
    assert marks[1] and not marks[2]  # one earlier loss 0.5: bound 0.5 * (1 + 1) * ln 100
    # frame 3: earlier losses 0.5, 0.1, 0.1: mean 0.2333 * (1 + 1/sqrt 3) * ln 100 = 1.695
    assert marks[3]
    with pytest.raises(ValueError):
        bench.checked([1.0], [1.0, 2.0], "loo")


def _cached(bench, cost: float, flip: bool = False) -> object:
    return bench.FrameRecord("cached", cost, 1.0, 1.0, (0.0,) * 5, flip, False, (1.0,) * 5, (0.0,) * 5)


def test_ceiling_counts_a_full_frame_per_check_and_audit(bench):
    records = [_cached(bench, 0.1), _cached(bench, 0.1, flip=True), _cached(bench, 0.1), _cached(bench, 0.1),
               bench.FrameRecord("keyframe", 1.0, 1.0, 1.0, (0.0,) * 5),
               bench.FrameRecord("full", 1.0, 1.0, 1.0, (0.0,) * 5)]
    costs = bench.total_cost(records, [True, False, False, False])
    # checked cached 0.1 + 1; keyframe 1 + the median cached count 0.1 (its audit's cached run); fallback 1
    assert costs == pytest.approx([1.1, 0.1, 0.1, 0.1, 1.1, 1.0])
    mean_x, median_x = bench.speedups(costs)
    assert mean_x == pytest.approx(6 / 3.5)
    assert median_x == pytest.approx(1 / 0.55)
    rule = bench.apply_rule(records, [True, False, False, False])
    assert rule.checked == pytest.approx(0.25) and rule.missed == 1  # the flip at frame 1 went unchecked
    found = bench.rules(records)
    assert found["oracle"].missed == 0 and found["oracle"].checked == pytest.approx(0.25)
    assert found["oracle"].mean_x == pytest.approx(6 / 3.5)  # it checks frame 1 instead: the same counts
    assert found["none"].missed == 1 and found["none"].mean_x == pytest.approx(6 / 2.5)
    with pytest.raises(ValueError):
        bench.total_cost(records, [True])


def test_record_losses_and_flips(bench):
    full = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0])
    cached = torch.tensor([[4.0, 4.5, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0]])
    r = bench.record(cached, full, "cached", 0.2)
    assert r.flip and not r.outside
    assert r.losses == pytest.approx((1.5, 1.0, 1.0, 1.0, 1.0))  # the top class lost 1, the runner-up gained 0.5
    assert r.margin == pytest.approx(1.0) and r.cached_margin == pytest.approx(0.5)
    assert r.pair_loss == pytest.approx(1.5) and r.rival_loss == pytest.approx(1.5)
    far = bench.record(torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, 6.0]]), full, "cached", 0.2)
    assert far.flip and far.outside  # class 7 was not among the five closest rivals


def _random_records(bench, seed: int):
    """500 ``(full, cached, record)``: random logits of 20 classes, and the same off by unit noise as the cache's."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(500):
        full = torch.randn(20, generator=gen) * 2
        cached = (full + torch.randn(20, generator=gen))[None]
        yield full, cached, bench.record(cached, full, "cached", 0.1)


def test_a_flip_among_the_rivals_is_within_the_rival_loss(bench):
    """The soundness the rival rule rests on: a flipped frame's cached margin is at most its rival loss."""
    flips = 0
    for _, _, r in _random_records(bench, 0):
        if r.flip and not r.outside:
            flips += 1
            assert r.cached_margin <= r.rival_loss + 1e-5
    assert flips > 20


def test_rank_rule_bounds_each_rank_at_a_share_of_the_target(bench):
    # rank 0: losses 0.1 everywhere, rank 1: 1.0 at frame 0, else 0.1; per rank the target is 1 - 0.01 / 2
    leads = [(2.0, 4.0), (2.0, 6.0), (2.0, 6.0), (2.0, 0.5)]
    losses = [(0.1, 1.0), (0.1, 0.1), (-0.1, 0.1), (0.1, -0.1)]
    q = math.log(1 / 0.005)  # the exponential quantile at 99.5%
    assert 0.1 * (1 + 1 / math.sqrt(3)) * q < 2.0  # no rank-0 lead is within its bound
    # rank 1: frame 0's others 0.1 x3 bound it at 0.84 < 4; frames 1-3's others 1.0, 0.1, 0.1 at 0.4 * 1.577 * q = 3.34,
    # above frame 3's lead 0.5 only
    assert bench.checked_by_rank(leads, losses, "loo") == [False, False, False, True]
    assert bench.checked_by_rank([], [], "loo") == []
    # frame 0 has no earlier frame: checked; frame 1's earlier rank-1 loss 1.0: bound 1.0 * 2 * q = 10.6 >= 6;
    # frame 2's earlier 1.0, 0.1: 0.55 * 1.707 * q = 4.97 < 6; frame 3's as above
    assert bench.checked_by_rank(leads, losses, "causal") == [True, True, False, True]


def test_a_flip_among_its_own_rivals_is_within_the_rank_losses(bench):
    """The soundness the rank rule rests on: when full inference's top class is among the cached output's five
    closest rivals, the cache inflated the lead over it by more than the lead itself."""
    flips = 0
    for full, cached, r in _random_records(bench, 1):
        own = cached[0].topk(6).indices[1:].tolist()
        if r.flip and int(full.argmax()) in own:
            flips += 1
            assert any(lead < loss for lead, loss in zip(r.leads, r.lead_losses))
    assert flips > 20


def test_signed_reference_fits_the_positive_losses_only(bench):
    assert bench.signed_reference([]) == math.inf
    # no positive loss: the sizes' unsigned bound
    assert bench.signed_reference([-0.1, -0.2]) == pytest.approx(bench.reference([0.1, 0.2]))
    # two positives of four: they come on (2 + 1) / (4 + 1) of the frames; mean 0.2 raised by 1 / sqrt 2
    expected = 0.2 * (1 + 1 / math.sqrt(2)) * math.log(0.6 / 0.01)
    assert bench.signed_reference([0.2, 0.2, -1.0, -1.0]) == pytest.approx(expected)
    assert expected < bench.reference([0.2, 0.2, 1.0, 1.0])  # the leads taken away no longer count
    # one positive in 199: (1 + 1) / 200 = 1% of the frames, the budget: the largest positive loss bounds it
    assert bench.signed_reference([0.3] + [-0.5] * 198) == pytest.approx(0.3)
    # checked: frame 0 is bound by the four other losses (the case above): a margin of 1.3 is within, 1.5 is not
    losses = [0.0, 0.2, 0.2, -1.0, -1.0]
    bound = bench.signed_reference(losses[1:])
    assert 1.3 < bound < 1.5
    assert bench.checked([1.3, 9, 9, 9, 9], losses, "loo", signed=True)[0]
    assert not bench.checked([1.5, 9, 9, 9, 9], losses, "loo", signed=True)[0]
    assert bench.checked([1.5, 9, 9, 9, 9], losses, "loo")[0]  # unsigned: sizes 0.2, 0.2, 1, 1


def test_rule_marks_dispatch(bench):
    records = [bench.FrameRecord("cached", 0.1, 1.0, margin, (loss, 0.0, 0.0, 0.0, 0.0), flip, False,
                                 (margin,) * 5, (-loss,) * 5)
               for margin, loss, flip in [(0.5, 0.1, False), (0.5, 0.1, False), (0.05, 0.1, True), (3.0, 0.1, False)]]
    assert bench.rule_marks(records, "oracle") == [False, False, True, False]
    assert bench.rule_marks(records, "none") == [False] * 4
    # sizes 0.1 everywhere: bound 0.1 * (1 + 1/sqrt 3) * ln 100 = 0.73 on leave-one-out
    assert bench.rule_marks(records, "pair loo") == [True, True, True, False]
    # the cache took 0.1 of every lead away (signed -0.1): no added lead to fit, the sizes' bound at 99.8% per rank
    assert bench.rule_marks(records, "rank+ loo") == [True, True, True, False]
    assert bench.rule_marks(records, "rank+ causal")[0]  # nothing measured before the first frame
    with pytest.raises(ValueError):
        bench.rule_marks(records, "median loo")
