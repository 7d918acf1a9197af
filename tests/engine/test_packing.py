"""Packing's cost model (multiply-adds and weight reads per batch) and the whole-map window operators: plans that
weigh weight reads merge batches without holding larger ones, and every planned run stays exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import incrinf.engine.packing as packing
from incrinf.analysis import occlusion_grid
from incrinf.cache import runtime_cache
from incrinf.engine import BatchEngine
from incrinf.engine.packing import run_cost
from incrinf.geometry import incremental_flops, input_boxes, propagate
from incrinf.graph import capture
from tests.engine.plan_cases import naive_outputs, planned_outputs

PER_BYTE = packing.MACS_PER_WEIGHT_BYTE  # the default, before any test patches it


class Funnel(nn.Module):
    """Downsamples a small image to a 4x4 map of 256 channels: the last convolutions compute few multiply-adds per
    byte of their weights, the first ones many."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 64, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(128, 256, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU())
        self.fc = nn.Linear(256, 4)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


def _plan(engine: BatchEngine, corners: np.ndarray, window: tuple[int, ...], dims: tuple[int, ...],
          batch_size: int, per_byte: float, monkeypatch):
    monkeypatch.setattr(packing, "MACS_PER_WEIGHT_BYTE", per_byte)
    runtime_cache().clear()  # the plan key does not hold the constant
    region = input_boxes(corners, window, dims)
    plan, _ = engine.plan(region.start(), region.sizes(), batch_size=batch_size)
    runtime_cache().clear()
    return plan


def _cost(engine: BatchEngine, plan, per_byte: float) -> float:
    """What ``plan``'s batches cost by :func:`run_cost`, from their planned boxes."""
    steps = engine.program.steps
    total = 0.0
    for batch in plan.batches:
        for sp in batch.steps:
            step = steps[sp.index]
            if step.flops:
                total += run_cost(batch.n, np.array([float(sp.box.area)]), np.array([step.flops / step.positions]),
                                  np.array([float(step.weight_bytes)]), per_byte)
    return total


@pytest.fixture
def funnel():
    torch.manual_seed(5)
    model = Funnel().eval()
    image = torch.randn(1, 3, 32, 32)
    return model, image, BatchEngine(capture(model, image.shape[1:]), image)


def test_run_cost_counts_weights_once_per_batch():
    positions, per_position, weights = np.array([4.0, 0.0]), np.array([10.0, 10.0]), np.array([100.0, 100.0])
    # a step the batch does not change reads no weights
    assert run_cost(3, positions, per_position, weights, per_byte=2.0) == 3 * 4 * 10 + 100 * 2
    # two batches of one read the weights twice, one batch of two once
    assert run_cost(2, positions, per_position, weights, 2.0) < 2 * run_cost(1, positions, per_position, weights, 2.0)
    assert run_cost(2, positions, per_position, weights, 0.0) == 2 * run_cost(1, positions, per_position, weights, 0.0)


def test_steps_know_their_weight_bytes(funnel):
    _, _, engine = funnel
    convs = [s for s in engine.program.steps if s.head.operator.name == "CONV"]
    assert [s.weight_bytes for s in convs] == [4 * c.weight.numel() for c in engine.graph.module.modules()
                                               if isinstance(c, nn.Conv2d)]
    assert all(s.weight_bytes == 0 for s in engine.program.steps if s not in convs)


def test_weight_reads_merge_batches_without_larger_ones(funnel, monkeypatch):
    _, image, engine = funnel
    dims, window = (32, 32), (6, 6)
    corners = occlusion_grid(dims, window, (2, 2))
    fewest_macs = _plan(engine, corners, window, dims, 16, 0.0, monkeypatch)
    weighed = _plan(engine, corners, window, dims, 16, PER_BYTE, monkeypatch)
    # the weights of the 4x4 stages dominate: fewer batches, none larger than the MAC-cheapest packing's
    assert len(weighed.batches) < len(fewest_macs.batches)
    assert max(b.n for b in weighed.batches) <= max(b.n for b in fewest_macs.batches)
    assert weighed.peak_bytes <= fewest_macs.peak_bytes
    # more multiply-adds (never fewer than the MAC-cheapest packing), bounded by what the weight reads save
    saved = _cost(engine, fewest_macs, PER_BYTE) - _cost(engine, weighed, PER_BYTE)
    assert saved > 0
    assert fewest_macs.macs <= weighed.macs <= fewest_macs.macs + saved
    graph = engine.graph
    exact = incremental_flops(graph, propagate(graph, input_boxes(corners, window, dims), uniform=False)).sum()
    assert weighed.macs >= exact * (1 - 1e-9)
    # every query exactly once
    queries = np.sort(np.concatenate([b.queries for b in weighed.batches]))
    np.testing.assert_array_equal(queries, np.arange(len(corners)))


def test_weightless_steps_pack_as_the_mac_cheapest(funnel, monkeypatch):
    _, _, engine = funnel
    dims, window = (32, 32), (6, 6)
    corners = occlusion_grid(dims, window, (3, 3))
    zero = _plan(engine, corners, window, dims, 8, 0.0, monkeypatch)
    again = _plan(engine, corners, window, dims, 8, 0.0, monkeypatch)
    assert [tuple(b.queries) for b in zero.batches] == [tuple(b.queries) for b in again.batches]
    weighed = _plan(engine, corners, window, dims, 8, PER_BYTE, monkeypatch)
    assert weighed.macs >= zero.macs * (1 - 1e-12)


@pytest.mark.parametrize("name", ["resnet18", "vgg16"])
def test_whole_map_operators_stay_exact(name):
    """Steps over whole maps run the convolution with its own zero padding (not on a padded copy): planned runs
    still equal plain inference on residual and plain architectures, and the whole-map operators did run."""
    from tests.conftest import zoo_model

    model, image, window = zoo_model(name), torch.randn(1, 3, 64, 64), (16, 16)
    engine = BatchEngine(capture(model, image.shape[1:]), image)
    calls = []
    saved = {i: step.whole_op for i, step in enumerate(engine.program.steps) if step.whole_op is not None}
    for i, op in saved.items():
        engine.program.steps[i].whole_op = lambda x, op=op: calls.append(1) or op(x)
    corners = occlusion_grid((64, 64), window, (16, 16))
    try:
        got, _ = planned_outputs(engine, image, corners, window, batch_size=6)
    finally:
        for i, op in saved.items():
            engine.program.steps[i].whole_op = op
    assert calls
    with torch.no_grad():
        want = naive_outputs(model, image, corners, window)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_whole_map_operator_needs_zero_padding():
    """A convolution behind a padding view of another value keeps the padded-copy path."""

    class Padded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.plain = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            return self.plain(self.conv(nn.functional.pad(x, (1, 1, 1, 1), value=2.0))).mean((2, 3))

    model = Padded().eval()
    image = torch.randn(1, 3, 12, 12)
    engine = BatchEngine(capture(model, image.shape[1:]), image)
    ops = {s.head.name: s.whole_op for s in engine.program.steps if s.window is not None}
    assert ops["conv"] is None and ops["plain"] is not None


def _grown_plan(engine: BatchEngine, corners: np.ndarray, window: tuple[int, ...], dims: tuple[int, ...],
                batch_size: int, cap: int, monkeypatch):
    """The plan at ``batch_size`` with batches allowed to grow to at most ``cap`` queries (cap = batch_size: the
    packing without growth)."""
    import incrinf.engine.plans as plans

    monkeypatch.setattr(plans, "CPU_BATCH_CAP", cap)
    runtime_cache().clear()
    region = input_boxes(corners, window, dims)
    plan, _ = engine.plan(region.start(), region.sizes(), batch_size=batch_size)
    runtime_cache().clear()
    return plan


def test_batches_grow_within_naive_memory_and_stay_exact(funnel, monkeypatch):
    """Where weight reads make larger batches cheaper, batches hold more than the batch size, but what the run
    holds beyond the model (made weights, store, index tensors, the largest batch) stays within naive
    re-inference's memory at that batch size; the grown run costs less by the packing's measure and equals plain
    inference."""
    from incrinf.engine.plan_bytes import forward_peak_bytes

    model, _, _ = funnel
    image = torch.randn(1, 3, 128, 128)  # maps large enough that naive re-inference holds more than the store
    engine = BatchEngine(capture(model, image.shape[1:]), image)
    dims, window, batch_size = (128, 128), (6, 6), 8
    corners = occlusion_grid(dims, window, (12, 12))
    plain = _grown_plan(engine, corners, window, dims, batch_size, batch_size, monkeypatch)
    grown = _grown_plan(engine, corners, window, dims, batch_size, 64, monkeypatch)
    assert plain.largest_batch <= batch_size < grown.largest_batch
    assert len(grown.batches) < len(plain.batches)
    held = engine.run_bytes(grown)
    assert held.held + held.batch <= forward_peak_bytes(engine.program, batch_size, 4)
    cost = [p.macs + PER_BYTE * p.weight_bytes for p in (plain, grown)]
    assert cost[1] < cost[0]
    runtime_cache().clear()
    got, plan = planned_outputs(engine, image, corners, window, batch_size=batch_size)
    assert plan.largest_batch > batch_size  # the default cap lets this run grow too
    with torch.no_grad():
        want = naive_outputs(model, image, corners, window)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_batches_do_not_grow_past_a_small_budget(funnel):
    """A memory budget below one query's working memory plans batches of one (no growth), and they stay exact."""
    model, image, engine = funnel
    dims, window = (32, 32), (6, 6)
    corners = occlusion_grid(dims, window, (5, 5))
    region = input_boxes(corners, window, dims)
    runtime_cache().clear()
    plan, _ = engine.plan(region.start(), region.sizes(), memory=1)
    assert plan.batch_size == 1 and plan.largest_batch == 1 and len(plan.batches) == len(corners)
    outputs = torch.zeros(len(corners), *engine.base_output.shape[1:])
    for batch in plan.batches:
        (q,) = batch.queries
        x = image.clone()
        x[..., corners[q][0]:corners[q][0] + 6, corners[q][1]:corners[q][1] + 6] = 0.0
        s = batch.start.start()[0]
        box = x[0, :, s[0]:s[0] + batch.start.size[0], s[1]:s[1] + batch.start.size[1]]
        outputs[q] = engine.run_batch(batch, box[None]).output[0]
    with torch.no_grad():
        want = naive_outputs(model, image, corners, window)
    torch.testing.assert_close(outputs, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    runtime_cache().clear()


def _loop_cheapest(costs, ordered: np.ndarray, smallest: int, largest: int, per_byte: float) -> float:
    """The packing's dynamic program written as its plain definition (every run weighed on its own), for the
    vectorised one to be checked against: the cheapest total cost of cutting ``ordered`` into runs."""
    q = len(ordered)
    best = np.full(q + 1, np.inf)
    best[0] = 0.0
    for end in range(1, q + 1):
        for first in range(max(end - largest, 0), end):
            n = end - first
            if n < smallest and first > 0 and end < q:
                continue
            boxes = ordered[first:end].max(axis=0)
            cost = run_cost(n, boxes.prod(axis=1), costs.per_position, costs.weight_bytes, per_byte)
            best[end] = min(best[end], best[first] + cost * (1 + 1e-9) + 1e-6)
    return float(best[q])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 14), st.integers(1, 4), st.integers(1, 9), st.integers(0, 2**31 - 1),
       st.sampled_from([0.0, 1.0, 16.0]))
def test_cheapest_cuts_match_the_plain_dynamic_program(q, steps, largest, seed, per_byte):
    """Weighing every run that ends at one query at once (a running maximum of the boxes) finds cuts of the same
    cost as weighing each run on its own, and the cuts it returns cost what it says, with runs in bounds."""
    rng = np.random.default_rng(seed)
    costs = packing._StepCosts.__new__(packing._StepCosts)
    costs.per_position = rng.uniform(1, 50, steps)
    costs.weight_bytes = rng.uniform(0, 1000, steps)
    ordered = rng.integers(0, 6, (q, steps, 2))
    smallest = max(1, min(largest // 2, q))
    bounds, cost = packing._cheapest(costs, ordered, smallest, largest, per_byte)
    assert cost == pytest.approx(_loop_cheapest(costs, ordered, smallest, largest, per_byte), rel=1e-9)
    assert bounds[0][0] == 0 and bounds[-1][1] == q and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(0 < end - first <= largest for first, end in bounds)
    again = sum(run_cost(end - first, ordered[first:end].max(axis=0).prod(axis=1), costs.per_position,
                         costs.weight_bytes, per_byte) * (1 + 1e-9) + 1e-6 for first, end in bounds)
    assert again == pytest.approx(cost, rel=1e-9)


def _exact(engine: BatchEngine, corners: np.ndarray, window: tuple[int, ...], dims: tuple[int, ...]):
    return propagate(engine.graph, input_boxes(corners, window, dims), uniform=False)


def test_reach_classes_group_equal_profiles(funnel):
    _, _, engine = funnel
    dims, window = (32, 32), (6, 6)
    corners = occlusion_grid(dims, window, (2, 2))
    exact = _exact(engine, corners, window, dims)
    classes = packing.reach_classes(engine.program, exact, len(corners))
    extents = np.stack(packing._StepCosts(engine.program, exact, len(corners)).extents, axis=1)
    for a in range(2):
        for c in np.unique(classes[:, a]):  # one profile per class, one class per profile
            profiles = np.unique(extents[classes[:, a] == c, :, a], axis=0)
            assert len(profiles) == 1
        totals = [extents[classes[:, a] == c, :, a].sum(axis=1)[0] for c in np.unique(classes[:, a])]
        assert totals == sorted(totals)
    # a grid's rows and columns reach alike: the same classes along both axes, edge rows in their own classes
    np.testing.assert_array_equal(np.sort(np.unique(classes[:, 0])), np.sort(np.unique(classes[:, 1])))
    assert len(np.unique(classes[:, 0])) > 1


def test_banded_orders_waste_less_on_a_grid_and_stay_exact(monkeypatch):
    """On an occlusion grid over a downsampling network, packing in bands of columns of similar reach (walked
    row by row) wastes fewer multiply-adds than packing whole rows sorted by reach: the plan picks the cheaper
    packing by its own measure, computes fewer multiply-adds, and its run equals plain inference."""
    import incrinf.engine.plans as plans
    from tests.conftest import zoo_model

    model, image, window = zoo_model("resnet18"), torch.randn(1, 3, 96, 96), (8, 8)
    engine = BatchEngine(capture(model, image.shape[1:]), image)
    dims = (96, 96)
    corners = occlusion_grid(dims, window, (8, 8))
    region = input_boxes(corners, window, dims)
    runtime_cache().clear()
    chosen, _ = engine.plan(region.start(), region.sizes(), batch_size=16)
    runtime_cache().clear()
    monkeypatch.setattr(plans, "candidate_orders", lambda program, exact, sizes: [
        packing.order_queries(program, exact, sizes)])
    by_reach, _ = engine.plan(region.start(), region.sizes(), batch_size=16)
    runtime_cache().clear()
    monkeypatch.undo()
    assert chosen.macs < 0.98 * by_reach.macs
    assert chosen.macs + PER_BYTE * chosen.weight_bytes < by_reach.macs + PER_BYTE * by_reach.weight_bytes
    assert chosen.peak_bytes <= max(chosen.budget_bytes, by_reach.peak_bytes)
    got, plan = planned_outputs(engine, image, corners, window, batch_size=16)
    assert plan.macs == chosen.macs
    with torch.no_grad():
        want = naive_outputs(model, image, corners, window)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    runtime_cache().clear()
