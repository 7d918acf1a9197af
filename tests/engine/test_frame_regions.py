"""A still camera's change as several boxes per tensor, planned from their cost (incrinf.engine.frame_regions), and
the cost coefficients that price the plans (incrinf.engine.costs)."""

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import zoo_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from incrinf.engine import FrameEngine
from incrinf.engine.frame_regions import area, bounding, cluster_boxes, grow_box, merge_by_cost
from incrinf.graph import capture

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SIZE = (96, 128)


def _two_walkers(size=SIZE, seed=3) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, list]:
    """A frame and the next, changed in two distant places (two walkers on either side of a street)."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(1, 3, *size, generator=g)
    x1 = x0.clone()
    boxes = [(6, 18, 4, 14), (size[0] - 20, size[0] - 8, size[1] - 16, size[1] - 4)]
    for y0, y1, a, b in boxes:
        x1[:, :, y0:y1, a:b] = torch.randn(1, 3, y1 - y0, b - a, generator=g)
    return x0, x1, (x1 != x0).any(dim=1)[0].numpy(), boxes


def _close(out, ref):
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "efficientnet_lite0", "googlenet", "densenet121"])
def test_two_distant_changes_are_two_regions_cheaper_than_their_bounding_box_and_exact(name):
    model = zoo_model(name)
    x0, x1, changed, boxes = _two_walkers()
    engine = FrameEngine(capture(model, x0.shape[1:]))
    engine.full(x0)
    plan = engine.plan_boxes(engine.clusters(changed))
    around = engine.plan_boxes([(boxes[0][0], boxes[1][1], boxes[0][2], boxes[1][3])])
    assert plan.regions == 2 and around.regions == 1
    assert plan.flops < around.flops  # the street between them is not computed (multiply-adds from the plan)
    out = engine.cached(x1, changed, plan=plan)
    assert engine.last.regions == 2 and engine.last.flops == pytest.approx(plan.flops)
    with torch.no_grad():
        ref = model(x1)
    _close(out, ref)
    # the cache now stands for x1: the next frame goes on from it
    x2 = x1.clone()
    x2[:, :, 40:48, 60:70] += 1.0
    out = engine.cached(x2, (x2 != x1).any(dim=1)[0].numpy())
    with torch.no_grad():
        _close(out, model(x2))


def test_boxes_whose_grown_extents_overlap_see_each_others_values():
    # two changes a few pixels apart: their boxes meet after a few windows, where each must read the other's new
    # values (one image), whether the plan keeps them apart or merges them
    model = zoo_model("resnet18")
    g = torch.Generator().manual_seed(8)
    x0 = torch.randn(1, 3, *SIZE, generator=g)
    x1 = x0.clone()
    x1[:, :, 30:40, 30:40] += 2.0
    x1[:, :, 30:40, 52:62] -= 2.0
    changed = (x1 != x0).any(dim=1)[0].numpy()
    engine = FrameEngine(capture(model, x0.shape[1:]))
    for break_even in (0.0, 1e9):  # never merge (beyond overlaps), always merge
        engine.full(x0)
        for cost in engine.costs.steps:
            cost.box_call = break_even * cost.per_position
        plan = engine.plan_boxes(engine.clusters(changed))
        out = engine.cached(x1, changed, plan=plan)
        with torch.no_grad():
            _close(out, model(x1))
        assert plan.regions == (2 if break_even == 0 else 1)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 80), st.integers(1, 16), st.integers(0, 112), st.integers(1, 16)),
                min_size=1, max_size=4), st.integers(0, 2 ** 16))
def test_any_set_of_changed_boxes_equals_full_inference(mobilenet_engine, boxes, seed):
    engine, model, x0 = mobilenet_engine
    g = torch.Generator().manual_seed(seed)
    x1 = x0.clone()
    for y, h, x, w in boxes:
        x1[:, :, y:y + h, x:x + w] = torch.randn(1, 3, min(h, SIZE[0] - y), min(w, SIZE[1] - x), generator=g)
    changed = (x1 != x0).any(dim=1)[0].numpy()
    engine.full(x0)
    out = engine.cached(x1, changed)
    with torch.no_grad():
        _close(out, model(x1))


@pytest.fixture(scope="module")
def mobilenet_engine():
    model = zoo_model("mobilenet_v2")
    x0 = torch.randn(1, 3, *SIZE, generator=torch.Generator().manual_seed(1))
    return FrameEngine(capture(model, x0.shape[1:])), model, x0


def test_clusters_and_merging_by_cost():
    cells = np.zeros((6, 8), bool)
    cells[0:2, 0:2] = True
    cells[2, 2] = True  # touches the first cluster diagonally
    cells[4:6, 6:8] = True
    assert cluster_boxes(cells, 16, (90, 128)) == [(0, 48, 0, 48), (64, 90, 96, 128)]
    a, b = (0, 10, 0, 10), (0, 10, 20, 30)
    assert merge_by_cost([a, b], break_even=0) == [a, b]  # the merged box would add 100 positions
    assert merge_by_cost([a, b], break_even=100) == [bounding(a, b)]
    assert merge_by_cost([a, (2, 8, 2, 8)], break_even=0) == [a]  # a box inside another is computed once
    merged = merge_by_cost([a, b, (40, 50, 40, 50), (0, 10, 8, 22)], break_even=30)
    for box in (a, b, (40, 50, 40, 50)):
        assert any(m[0] <= box[0] and box[1] <= m[1] and m[2] <= box[2] and box[3] <= m[3] for m in merged)
    for i, m in enumerate(merged):  # no pair left that one box would do cheaper
        assert all(area(bounding(m, n)) - area(m) - area(n) > 30 for n in merged[i + 1:])



def _greedy_merges(boxes: list, break_even: float) -> list:
    """The merge rule written out pair by pair: while some pair's bounding box adds at most ``break_even``
    positions, merge the pair that saves most (the first in list order on a tie) and put the merged box last."""
    boxes = list(dict.fromkeys(boxes))
    while len(boxes) > 1:
        pairs = [(break_even + area(boxes[i]) + area(boxes[j]) - area(bounding(boxes[i], boxes[j])), i, j)
                 for i in range(len(boxes)) for j in range(i + 1, len(boxes))]
        best = max((p for p in pairs if p[0] >= 0), key=lambda p: p[0], default=None)
        if best is None:
            break
        _, i, j = next(p for p in pairs if p[0] == best[0])
        boxes = [b for k, b in enumerate(boxes) if k not in (i, j)] + [bounding(boxes[i], boxes[j])]
    return boxes


_corner = st.tuples(st.integers(0, 120), st.integers(1, 24), st.integers(0, 120), st.integers(1, 24))


@settings(max_examples=150, deadline=None)
@given(st.lists(_corner, min_size=0, max_size=40),
       st.one_of(st.integers(0, 300), st.floats(0, 1e4), st.just(float("inf"))))
def test_merging_many_boxes_makes_the_greedy_choices(corners, break_even):
    """Many boxes (a high-resolution frame's clusters) are merged with array arithmetic: the same boxes, in the
    same order, as the pair-by-pair rule."""
    boxes = [(y, y + h, x, x + w) for y, h, x, w in corners]
    assert merge_by_cost(boxes, break_even) == _greedy_merges(boxes, break_even)

def test_grow_box_matches_the_batched_geometry():
    from incrinf.engine.regions import grow
    from incrinf.geometry import Boxes

    engine = FrameEngine(capture(zoo_model("resnet18"), (3, *SIZE)))
    rng = np.random.default_rng(0)
    for step in [s for s in engine.program.steps if s.window is not None]:
        dims = engine.program.dims(step.window.source)
        for _ in range(5):
            y, x = int(rng.integers(0, dims[0])), int(rng.integers(0, dims[1]))
            h, w = int(rng.integers(1, dims[0] - y + 1)), int(rng.integers(1, dims[1] - x + 1))
            ref = grow(Boxes((y, x), (h, w)), step.window, step.dims, quantum=4).bounds
            assert grow_box((y, y + h, x, x + w), step.window, step.dims, 4) == ref


def _convs() -> nn.Module:
    """A model whose cost is known: four 3x3 convolutions of 32 channels (the multiply-adds dominate)."""
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 32, 3, padding=1), nn.ReLU()]
    for _ in range(3):
        layers += [nn.Conv2d(32, 32, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).eval()

# the known-cost model's injected coefficients: seconds per multiply-add of a step, per box call, the tail, a frame
KNOWN_COSTS = (1e-10, 3e-5, 2e-4, 1e-4)


def _known_cost_engine() -> tuple[FrameEngine, torch.nn.Module, torch.Tensor, tuple[int, int]]:
    """A frame engine on :func:`_convs` at 96x128 after one full frame ``x0`` (1, 3, 96, 128), its cost coefficients
    injected as a profile sets them (:data:`KNOWN_COSTS`): ``(engine, model, x0, size)``."""
    size = (96, 128)
    model = _convs()
    x0 = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(2))
    engine = FrameEngine(capture(model, x0.shape[1:]))
    engine.full(x0)
    costs, steps = engine.costs, engine.program.steps
    per_flop, call, tail, frame = KNOWN_COSTS
    costs.set_profile([s.flops * per_flop for s in steps], [call] * len(steps), [call] * len(steps), tail,
                      costs.move, frame)
    return engine, model, x0, size



def test_the_cost_model_tracks_measured_times():
    """On a model whose cost is known (four 3x3 convolutions of 32 channels), with coefficients set as a profile
    sets them (a step over its map in proportion to its multiply-adds, a fixed cost per box, the tail, a frame's
    fixed cost), a box plan's prediction is exactly the coefficients' sum over what it computes, ordered as its
    multiply-adds, and is what the frame ran (no pruning); step times and full frames measured at a scale move
    every prediction by that scale, a load spike none. The times are injected, so this holds at any load."""
    from incrinf.engine.costs import SAMPLES, RegionKind

    engine, model, x0, size = _known_cost_engine()
    program, costs = engine.program, engine.costs
    steps, n = program.steps, len(program.steps)
    per_flop, call, tail, frame = KNOWN_COSTS
    assert costs.dense_total == pytest.approx(sum(s.flops for s in steps) * per_flop + tail)

    def known(plan) -> tuple[float, float]:
        """(seconds, multiply-adds) of the plan from the injected coefficients and the steps' multiply-adds."""
        last = n if plan.switch is None else next(i for i, s in enumerate(steps) if s.out == plan.switch) + 1
        seconds, flops = frame, 0.0
        for step, boxes in zip(steps[:last], plan.steps[:last]):
            for b in boxes:
                seconds += call + step.flops * per_flop * area(b) / step.positions
                flops += step.flops * area(b) / step.positions
        rest = sum(s.flops for s in steps[last:])
        return seconds + rest * per_flop + tail, flops + rest + program.tail_flops

    plans, frames = [], []
    for side in (8, 24, 48, 96):
        box = (0, side, 0, min(side * 4 // 3, size[1]))
        x1 = x0.clone()
        x1[:, :, box[0]:box[1], box[2]:box[3]] += 1.0
        changed = (x1 != x0).any(dim=1)[0].numpy()
        plan = engine.plan_boxes([box])
        assert (plan.seconds, plan.flops) == pytest.approx(known(plan))
        engine.full(x0)
        out = engine.cached(x1, changed, plan=plan)
        assert engine.last.predicted == pytest.approx(plan.seconds)  # no pruning: the plan is what ran
        assert engine.last.flops == pytest.approx(plan.flops)
        with torch.no_grad():
            _close(out, model(x1))
        plans.append(plan)
        frames.append((box, engine.last.step_samples))
    assert [p.seconds for p in plans] == sorted(p.seconds for p in plans)
    assert [p.flops for p in plans] == sorted(p.flops for p in plans) and plans[0].flops < plans[-1].flops
    # the steps measured at 2.5 times their coefficients, full frames at 1.5 times the profile's, one spike each
    for _ in range(SAMPLES):
        for _, samples in frames:
            costs.record_steps(RegionKind.BOXES, [(c, a, 2.5 * (c + a)) for c, a, _ in samples])
        costs.record_full(1.5 * costs.dense_total)
    costs.record_steps(RegionKind.BOXES, [(c, a, 40.0 * (c + a)) for c, a, _ in frames[0][1]])
    costs.record_full(40.0 * costs.dense_total)
    assert costs.call_ratio(RegionKind.BOXES) == pytest.approx(2.5)
    assert costs.compute_ratio(RegionKind.BOXES) == pytest.approx(2.5)
    assert costs.full_seconds == pytest.approx(1.5 * costs.dense_total)
    for (box, _), before in zip(frames, plans):
        plan = engine.plan_boxes([box])
        seconds, _ = known(plan)
        dense = costs.suffix_parts(plan.switch) if plan.switch is not None else tail
        regional = seconds - frame - dense
        assert plan.seconds == pytest.approx(frame + 2.5 * regional + 1.5 * dense)
        assert plan.seconds > before.seconds


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "efficientnet_lite0", "googlenet"])
def test_bucketed_boxes_equal_full_inference_and_repeated_frames_reuse_their_plans(name):
    """Box sides rounded up to a bucket step recompute the extra positions exactly (the output still equals full
    inference), and a frame whose change falls in the same boxes as an earlier one reuses that frame's plan (the
    plan builder runs once per box set)."""
    model = zoo_model(name)
    x0, x1, changed, _ = _two_walkers()
    engine = FrameEngine(capture(model, x0.shape[1:]))
    for quantum in (1, 3, 8):
        engine.box_quantum = quantum
        engine.full(x0)
        built = engine.plans.stats()
        for frame in (x1, x0, x1):  # the change comes and goes in the same places: the same boxes every frame
            plan = engine.plan_boxes(engine.clusters(changed))
            out = engine.cached(frame, changed, plan=plan)
            with torch.no_grad():
                _close(out, model(frame))
            for step, boxes in zip(engine.program.steps, plan.steps):
                if step.window is not None:  # a window step's boxes: bucket-step sides, or the whole map's
                    assert all((b[1] - b[0]) % quantum == 0 or b[1] - b[0] == step.dims[0] for b in boxes)
                    assert all((b[3] - b[2]) % quantum == 0 or b[3] - b[2] == step.dims[1] for b in boxes)
        counts = engine.plans.stats()
        misses = sum(c["misses"] for c in counts.values()) - sum(c["misses"] for c in built.values())
        hits = sum(c["hits"] for c in counts.values()) - sum(c["hits"] for c in built.values())
        assert misses == 1 and hits == 2, counts
        assert engine.last_plan_status.value == "hit"


def test_a_reused_plan_is_priced_with_the_current_calibration():
    from incrinf.engine.costs import RegionKind
    from incrinf.engine.frame_regions import plan_regions

    model = zoo_model("mobilenet_v2")
    x0, _, changed, _ = _two_walkers()
    engine = FrameEngine(capture(model, x0.shape[1:]))
    engine.full(x0)
    boxes = engine.clusters(changed)
    first = engine.plan_boxes(boxes)
    # a drift of the calibration within one key step keeps the plan, priced as a fresh plan would be
    for _ in range(3):  # three frames
        engine.costs.record_steps(RegionKind.BOXES, [(0.0, 1.0, 1.01)] * 3)
    again = engine.plan_boxes(boxes)
    fresh = plan_regions(engine.geometry, boxes)
    assert engine.last_plan_status.value == "hit" and again.steps == first.steps == fresh.steps
    assert again.seconds == pytest.approx(fresh.seconds, rel=1e-9) and again.seconds != first.seconds
    # boxes that take twice as long as measured: a new state, planned again
    for _ in range(9):
        engine.costs.record_steps(RegionKind.BOXES, [(0.0, 1.0, 2.0)] * 3)
    engine.plan_boxes(boxes)
    assert engine.last_plan_status.value == "miss"


def test_the_prediction_tracks_what_pruned_frames_computed():
    """Under value-based pruning, on the model whose cost is known (coefficients injected as a profile sets them):
    a change over the whole frame is planned to switch to the dense rest after the first convolution (its boxes
    cost more than the dense steps), but a change too faint to move any feature dies at the first commit, and the
    walk then computes the first step alone. Once such frames ran, the plan of the same change is predicted at
    exactly what their walks computed (the coefficients' sum over their work, no timing); frames whose change
    carried on (new content, nothing pruned) ran the plan's switch and its dense rest, and the prediction is the
    median frame's: it follows the latest frames as the mix of the two kinds changes."""
    engine, model, x0, size = _known_cost_engine()
    program, costs = engine.program, engine.costs
    steps = program.steps
    per_flop, call, tail, frame = KNOWN_COSTS
    box, changed = (0, size[0], 0, size[1]), np.ones(size, bool)
    noise = torch.Generator().manual_seed(5)

    def run(kind: str) -> tuple[float, float]:
        """(the plan's prediction, the coefficients' seconds of what its walk computed) of one frame."""
        x1 = x0 + 1e-6 if kind == "faint" else torch.randn(1, 3, *size, generator=noise)
        engine.full(x0)
        plan = engine.plan_boxes([box])
        out = engine.cached(x1, changed, feature_threshold=0.35, plan=plan)
        if kind == "new":  # nothing pruned: the plan's switch, exact
            with torch.no_grad():
                _close(out, model(x1))
        return plan.seconds, engine.last.predicted

    unpruned, carried = run("new")
    assert engine.plan_boxes([box]).switch == steps[0].out
    assert unpruned == pytest.approx(carried) == pytest.approx(frame + call + steps[0].flops * per_flop
                                                               + costs.dense_total - steps[0].flops * per_flop)
    _, died = run("faint")
    assert died == pytest.approx(frame + call + steps[0].flops * per_flop)  # the first step only
    assert died < 0.1 * carried
    predicted = [run(kind)[0] for kind in ("faint", "faint", "new", "new", "new")]
    # profiles: new, faint, faint | faint, new, new, new: the median frame's walk
    assert predicted[:2] == pytest.approx([(died + carried) / 2, died])
    assert predicted[2] == pytest.approx(died)  # new, faint, faint, faint
    assert predicted[3] == pytest.approx(died)  # 2 carried of 5
    assert predicted[4] == pytest.approx((died + carried) / 2)  # 3 of 6: the median of an even count
    assert engine.plan_boxes([box]).seconds == pytest.approx(carried)  # 4 of 7 carried on


@pytest.mark.parametrize("start", [[(40, 42, 60, 62)], [(6, 18, 4, 14), (76, 88, 112, 124)],
                                   [(0, 8, 0, 8), (4, 12, 4, 12), (50, 60, 30, 40), (90, 96, 120, 128)]])
def test_a_plans_steps_are_priced_as_their_boxes(mobilenet_engine, start):
    """A plan's per-step parts and flops are those of its boxes (:meth:`Geometry.parts`, each step's multiply-adds per
    position), and each step's boxes are the geometry's for the boxes before it (one box passes through unmerged,
    several are merged by cost), whatever shortcuts the planning takes."""
    engine = mobilenet_engine[0]
    geometry, program = engine.geometry, engine.program
    plan = engine.plan_boxes(start)
    regions = {program.graph.input.name: plan.start}
    flops = 0.0
    for index, (step, boxes) in enumerate(zip(program.steps, plan.steps)):
        if index >= len(plan.parts.steps):
            assert not boxes
            continue
        assert plan.parts.steps[index] == geometry.parts(index, boxes)
        assert boxes == geometry.out_boxes(index, step, regions)  # the walk's geometry, as a pruned walk asks it
        grown = [grow_box(b, step.window, step.dims, geometry.quantum) for b in regions.get(step.window.source, ())] \
            if step.window is not None else None
        if grown is not None and len(grown) > 1:
            assert boxes == merge_by_cost(grown, geometry.break_even(index))
        elif grown:
            assert boxes == grown
        if plan.switch is None or index <= geometry.step_of[plan.switch]:
            flops += sum(step.flops * area(b) / step.positions for b in boxes)
        if boxes:
            regions[step.out] = boxes
    assert plan.flops == pytest.approx(flops + program.tail_flops + (
        program.suffix_flops(plan.switch) if plan.switch is not None else 0.0))


def test_the_same_boxes_reuse_their_plan_while_a_ratio_wavers_about_a_key_step():
    """A calibration median that moves back and forth across the boundary of two key steps (the frames' noise about
    a ratio between them) keeps the key: the same boxes are planned once, not once per crossing; a ratio that moved
    a whole step on is a new key."""
    from incrinf.engine.costs import PLAN_STEPS, RegionKind

    model = zoo_model("mobilenet_v2")
    x0, _, changed, _ = _two_walkers()
    engine = FrameEngine(capture(model, x0.shape[1:]))
    engine.full(x0)
    boxes = engine.clusters(changed)
    costs = engine.costs

    def calibrate(ratio: float) -> None:
        for _ in range(9):  # every sample of the median: the ratio is exactly this
            costs.record_steps(RegionKind.BOXES, [(0.0, 1.0, ratio)] * 3)

    below, above = 2 ** (0.45 / PLAN_STEPS), 2 ** (0.55 / PLAN_STEPS)  # either side of the boundary of steps 0, 1
    assert round(math.log2(below) * PLAN_STEPS) == 0 and round(math.log2(above) * PLAN_STEPS) == 1
    calibrate(below)
    engine.plan_boxes(boxes)
    before = engine.plans.stats()
    for ratio in (above, below, above, below):
        calibrate(ratio)
        engine.plan_boxes(boxes)
        assert engine.last_plan_status.value == "hit"
    after = engine.plans.stats()
    assert sum(c["misses"] for c in after.values()) == sum(c["misses"] for c in before.values())
    calibrate(2 ** (1.2 / PLAN_STEPS))  # a whole step from the key's step 0
    engine.plan_boxes(boxes)
    assert engine.last_plan_status.value == "miss"
