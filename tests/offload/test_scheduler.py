"""Scheduler: link estimation, back-off, cost model, decisions, switching costs and hysteresis; policies and options;
per-node times and splits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from incrinf.graph import SplitPoint, capture, split_points
from incrinf.offload.client import HTTP_OVERHEAD_BYTES, Backoff, LinkEstimator
from incrinf.offload.policy import (
    LOCAL_CACHED,
    LOCAL_FULL,
    OFFLOAD_CHANGED_PIXELS,
    OFFLOAD_FULL,
    Option,
    Policy,
    hybrid,
)
from incrinf.offload.scheduler import CostModel, Payloads, Scheduler
from incrinf.offload.timing import NodeTimes, SplitRunner, time_nodes

MB = 1e6 / 8  # bytes per second of 1 Mbit/s


def link_at(mbit: float, rtt: float = 0.01) -> LinkEstimator:
    """An estimator fed with exact transfers of a few sizes on a link of ``mbit`` and ``rtt``."""
    est = LinkEstimator()
    for nbytes in (500, 20_000, 60_000, 1_000, 40_000):
        est.add(nbytes, rtt + nbytes / (mbit * MB))
    return est


def profile(per_node: list[float]) -> NodeTimes:
    seconds = np.array(per_node)
    return NodeTimes([f"n{i}" for i in range(len(per_node))], seconds, float(seconds.sum()), seconds)


def make_cost(local_scale: float = 8.0) -> CostModel:
    """10 nodes of 1 ms on the server, ``local_scale`` ms locally; a split after node 6 (20 kB)."""
    local, server = profile([local_scale * 1e-3] * 10), profile([1e-3] * 10)
    split = SplitPoint("n6", 6, (1, 5000), 20_000)
    payloads = Payloads(frame=49_152, output=4000, splits={"n6": 20_000})
    cost = CostModel(local, server, payloads, [split], cache_point=7)
    cost.overhead[OFFLOAD_CHANGED_PIXELS.policy].value = 0.005  # matching + change mask on the client
    return cost


def make_scheduler(**kwargs) -> Scheduler:
    """A scheduler whose local cached engine recomputes everything (like the full-inference stand-in)."""
    sched = Scheduler(make_cost(), **kwargs)
    sched.x[LOCAL_CACHED.policy].value = 1.0
    return sched


# --- link estimation and back-off -----------------------------------------------------------------------


@pytest.mark.parametrize("mbit, rtt", [(1.0, 0.02), (50.0, 0.01), (5.0, 0.002)])
def test_link_estimator_recovers_rtt_and_bandwidth(mbit, rtt):
    est = link_at(mbit, rtt)
    assert est.rtt == pytest.approx(rtt, rel=1e-6, abs=1e-9)
    assert est.bandwidth == pytest.approx(mbit * MB, rel=1e-6)
    assert est.predict(49_152) == pytest.approx(rtt + 49_152 / (mbit * MB), rel=1e-6)


def test_link_estimator_follows_a_drop_with_same_size_transfers():
    est = link_at(50.0)
    for _ in range(3):  # offloading full frames: every sample the same size, now at 5 Mbit/s
        est.add(53_000, 0.01 + 53_000 / (5 * MB))
    assert est.predict(53_000) > 0.6 * (0.01 + 53_000 / (5 * MB))
    for _ in range(6):
        est.add(53_000, 0.01 + 53_000 / (5 * MB))
    assert est.bandwidth == pytest.approx(5 * MB, rel=0.1)


def test_link_estimator_ignores_nonsense():
    est = link_at(10.0)
    before = (est.rtt, est.bandwidth)
    est.add(0, 0.1)
    est.add(1000, float("nan"))
    est.add(1000, -1.0)
    assert (est.rtt, est.bandwidth) == before


def test_backoff_doubles_caps_and_resets():
    b = Backoff(initial=0.1, cap=0.5)
    delays = [b.failure(now=0.0) for _ in range(5)]
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    assert not b.due(now=0.4) and b.due(now=0.5)
    b.success()
    assert b.healthy and b.due(now=0.0) and b.failure(now=0.0) == pytest.approx(0.1)


# --- cost model -----------------------------------------------------------------------------------------


def test_cost_model_terms():
    cost = make_cost()
    link = link_at(10.0)
    assert cost.predict(LOCAL_FULL, 1.0, link).total == pytest.approx(0.080)
    # CacheInf: x of the time before the cache point (nodes 0..7) plus the rest.
    assert cost.predict(LOCAL_CACHED, 0.25, link).local == pytest.approx(0.25 * 0.064 + 0.016)
    full = cost.predict(OFFLOAD_FULL, 1.0, link)
    assert full.server == pytest.approx(0.010)
    assert full.network == pytest.approx(link.predict(49_152 + 4000 + 600 + HTTP_OVERHEAD_BYTES))
    cached = cost.predict(OFFLOAD_CHANGED_PIXELS, 0.2, link)
    assert cached.network < full.network
    assert cached.network == pytest.approx(link.predict(0.2 * 49_152 + 4000 + 664 + HTTP_OVERHEAD_BYTES))
    split = cost.predict(hybrid("n6"), 1.0, link)
    assert split.local == pytest.approx(0.056) and split.server == pytest.approx(0.003)
    assert split.network == pytest.approx(link.predict(20_000 + 4000 + 600 + HTTP_OVERHEAD_BYTES))


def test_cost_model_learns_corrections():
    cost = make_cost()
    for _ in range(30):
        cost.observe_local_full(0.160)  # the device is twice as slow as profiled
        cost.observe_server(0.005, OFFLOAD_FULL)
    link = link_at(10.0)
    assert cost.predict(LOCAL_FULL, 1.0, link).total == pytest.approx(0.160, rel=0.01)
    assert cost.predict(OFFLOAD_FULL, 1.0, link).server == pytest.approx(0.005, rel=0.01)


# --- decisions ------------------------------------------------------------------------------------------


def test_decides_by_bandwidth():
    assert make_scheduler().decide(link_at(100.0), server_up=True).option == OFFLOAD_FULL
    assert make_scheduler().decide(link_at(0.5), server_up=True).option in (LOCAL_FULL, LOCAL_CACHED)
    assert make_scheduler().decide(link_at(100.0), server_up=False).option in (LOCAL_FULL, LOCAL_CACHED)
    # A local cached engine that recomputes a tenth of the frame beats everything on a slow link.
    sched = make_scheduler()
    sched.x[LOCAL_CACHED.policy].value = 0.1
    assert sched.decide(link_at(0.5), server_up=True).option == LOCAL_CACHED


def test_decision_records_every_prediction():
    sched = make_scheduler()
    decision = sched.decide(link_at(20.0), server_up=True)
    assert set(decision.predictions) == {LOCAL_FULL, LOCAL_CACHED, OFFLOAD_FULL, OFFLOAD_CHANGED_PIXELS, hybrid("n6")}
    assert decision.predicted == decision.predictions[decision.option]
    link = link_at(20.0)
    for option, seconds in decision.predictions.items():
        x = sched.predicted_x(option)
        assert seconds == pytest.approx(sched.cost.predict(option, x, link).total)


def test_pinned_policy_and_fallback():
    sched = Scheduler(make_cost(), policy=Policy.OFFLOAD_CHANGED_PIXELS)
    assert sched.decide(link_at(0.1), server_up=True).option == OFFLOAD_CHANGED_PIXELS
    down = sched.decide(link_at(0.1), server_up=False)
    assert down.option == LOCAL_FULL and "unavailable" in down.reason
    with pytest.raises(ValueError, match="unknown policy"):
        Scheduler(make_cost(), policy="teleport")
    only_hybrid = Scheduler(make_cost(), policy="hybrid")
    assert only_hybrid.decide(link_at(5.0), server_up=True).option == hybrid("n6")
    pinned = Scheduler(make_cost(), policy=Policy.HYBRID, split="n6")
    assert not pinned.deciding and pinned.decide(link_at(0.1), server_up=True).option == hybrid("n6")
    with pytest.raises(ValueError, match="not one of the hybrid split nodes"):
        Scheduler(make_cost(), policy=Policy.HYBRID, split="n2")
    with pytest.raises(ValueError, match="not one of the hybrid split nodes"):
        Scheduler(make_cost(), policy=Policy.OFFLOAD_FULL, split="n6")


def test_policy_names_and_options():
    assert Policy.of("offload_full") is Policy.OFFLOAD_FULL and Policy.of(Policy.AUTO) is Policy.AUTO
    assert Policy.OFFLOAD_CHANGED_PIXELS.offloads and not Policy.LOCAL_CACHED.offloads
    assert [p.value for p in Policy if p.keeps_state] == ["local_cached", "offload_changed_pixels"]
    assert OFFLOAD_CHANGED_PIXELS.rebuild == OFFLOAD_FULL and LOCAL_CACHED.rebuild == LOCAL_FULL
    assert hybrid("n6").rebuild == hybrid("n6") and str(hybrid("n6")) == "hybrid at n6"
    with pytest.raises(ValueError, match="'offload_changed_pixels'"):  # the renamed policy names its new name
        Policy.of("offload_cached")
    with pytest.raises(ValueError, match="split='n6'"):  # the split node is its own setting
        Policy.of("hybrid:n6")
    with pytest.raises(ValueError, match="unknown policy 'teleport'; choose one of auto, local_full"):
        Policy.of("teleport")
    with pytest.raises(TypeError):
        Policy.of(3)
    with pytest.raises(ValueError, match="auto is a policy, not an option"):
        Option(Policy.AUTO)
    with pytest.raises(ValueError, match="split node"):
        Option(Policy.HYBRID)
    with pytest.raises(ValueError, match="split node"):
        Option(Policy.LOCAL_FULL, "n6")


def test_switch_into_cold_cache_pays_a_rebuild():
    """Local at 80 ms; offload_changed_pixels slightly faster per frame, but its first frame is a full upload."""
    link = link_at(2.0)
    sched = make_scheduler(lookahead=10, margin=0.0)
    sched.x[OFFLOAD_CHANGED_PIXELS.policy].value = 0.2
    sched.cost.overhead[OFFLOAD_CHANGED_PIXELS.policy].value = 0.0
    sched.committed(LOCAL_FULL, warm_after=False)
    d = sched.decide(link, server_up=True)
    assert d.predictions[OFFLOAD_CHANGED_PIXELS] < d.predictions[LOCAL_FULL]
    rebuild = sched.switch_cost(OFFLOAD_CHANGED_PIXELS, d.predictions, link)
    assert rebuild == pytest.approx(d.predictions[OFFLOAD_FULL] - d.predictions[OFFLOAD_CHANGED_PIXELS])
    assert 10 * (d.predictions[LOCAL_FULL] - d.predictions[OFFLOAD_CHANGED_PIXELS]) < rebuild
    assert d.option in (LOCAL_FULL, LOCAL_CACHED)  # the two local options tie
    # With the cache warm (it holds the previous frame) the same prediction keeps offload_changed_pixels.
    sched.committed(OFFLOAD_CHANGED_PIXELS, warm_after=True)
    assert sched.switch_cost(OFFLOAD_CHANGED_PIXELS, d.predictions, link) == 0.0
    assert sched.decide(link, server_up=True).option == OFFLOAD_CHANGED_PIXELS
    # A long look-ahead amortises the rebuild.
    sched = make_scheduler(lookahead=1000, margin=0.0)
    sched.x[OFFLOAD_CHANGED_PIXELS.policy].value = 0.2
    sched.cost.overhead[OFFLOAD_CHANGED_PIXELS.policy].value = 0.0
    sched.committed(LOCAL_FULL, warm_after=False)
    assert sched.decide(link, server_up=True).option == OFFLOAD_CHANGED_PIXELS


def _best_remote(sched: Scheduler, mbit: float) -> float:
    preds = sched.predictions(link_at(mbit), True)
    return min(v for k, v in preds.items() if k not in (LOCAL_FULL, LOCAL_CACHED))


def test_hysteresis_does_not_flap_near_the_boundary():
    """Bandwidth jitters around the point where offloading and local cost the same: few switches; a real
    change of regime: a switch at once."""
    probe = make_scheduler()
    even = next(m for m in np.linspace(1, 50, 1000) if _best_remote(probe, m) < 0.080)

    def run(sched: Scheduler) -> list:
        rng = np.random.default_rng(0)
        chosen = []
        for _ in range(100):
            option = sched.decide(link_at(even * float(rng.uniform(0.85, 1.15))), server_up=True).option
            sched.committed(option, warm_after=option in (LOCAL_CACHED, OFFLOAD_CHANGED_PIXELS))
            chosen.append(option)
        return chosen

    def switches(chosen: list) -> int:
        return sum(a != b for a, b in zip(chosen, chosen[1:]))

    steady = make_scheduler(lookahead=10, margin=0.1)
    assert switches(run(steady)) <= 2
    assert switches(run(make_scheduler(lookahead=10, margin=0.0))) > 10  # no margin: it flaps
    # A much faster or slower link: the scheduler moves at once.
    steady.committed(LOCAL_FULL, warm_after=False)
    assert steady.decide(link_at(even * 10), server_up=True).option in (OFFLOAD_FULL, OFFLOAD_CHANGED_PIXELS)
    steady.committed(OFFLOAD_FULL, warm_after=False)
    assert steady.decide(link_at(even / 10), server_up=True).option in (LOCAL_FULL, LOCAL_CACHED)


def test_predicted_change_fraction_is_an_ewma():
    sched = Scheduler(make_cost(), x_alpha=0.5, x_prior=0.5)
    sched.observe_x(OFFLOAD_CHANGED_PIXELS, 0.1)
    sched.observe_x(OFFLOAD_CHANGED_PIXELS, 0.1)
    assert sched.predicted_x(OFFLOAD_CHANGED_PIXELS) == pytest.approx(0.5 * 0.25 + 0.1 * 0.75)
    assert sched.predicted_x(OFFLOAD_FULL) == 1.0


# --- profiles and splits --------------------------------------------------------------------------------


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)
        self.c3 = nn.Conv2d(4, 4, 1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.c1(x))
        b = torch.cat([self.c2(a), self.c3(a)], 1)[:, :4]
        return self.fc(b.mean((2, 3)))


def test_split_points_and_halves():
    torch.manual_seed(0)
    model = Branchy().eval()
    graph = capture(model, (3, 16, 16))
    names = [s.name for s in split_points(graph)]
    assert "relu" in names and "c2" not in names and "c3" not in names  # two live tensors inside the branch
    runner = SplitRunner(graph)
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        expected = model(x)
    for name in names:
        mid = runner.prefix(x, name)
        assert tuple(mid.shape) == runner.split(name).shape
        torch.testing.assert_close(runner.suffix(mid, name), expected)
    with pytest.raises(ValueError, match="expects a tensor"):
        runner.suffix(torch.zeros(1, 2), names[0])
    with pytest.raises(KeyError):
        runner.prefix(x, "c2")


def test_time_nodes_sums_to_full_time():
    torch.manual_seed(0)
    graph = capture(Branchy().eval(), (3, 16, 16))
    prof = time_nodes(graph, torch.zeros(1, 3, 16, 16), repeats=2)
    assert prof.names == [n.name for n in graph.nodes]
    assert np.all(prof.seconds >= 0) and prof.full_seconds > 0
    assert prof.seconds.sum() == pytest.approx(prof.full_seconds)
    assert prof.prefix(2) + prof.suffix(2) == pytest.approx(prof.full_seconds)
    again = NodeTimes.from_json(prof.to_json())
    np.testing.assert_allclose(again.seconds, prof.seconds)
    assert prof.scaled(4).full_seconds == pytest.approx(4 * prof.full_seconds)
    with pytest.raises(ValueError):
        NodeTimes.from_json({"names": ["a"], "seconds": [1.0, 2.0], "full_seconds": 3.0})
