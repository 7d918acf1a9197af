"""The plan layer: plans built once per key and shared (inputs, engines, threads), their multiply-adds equal to the
geometry's count, their bytes a bound on what a run keeps alive (below naive re-inference at the same batch
size), executors shared per graph and rebuilt when weights change, and planned runs equal to naive inference."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn as nn

import incrinf.engine.batches as batches
from incrinf.analysis import occlusion_grid
from incrinf.cache import LookupStatus, runtime_cache
from incrinf.engine import BatchEngine, Boxes
from incrinf.engine.plans import forward_peak_bytes
from incrinf.geometry import incremental_flops, input_boxes, propagate
from incrinf.graph import capture
from incrinf.testing.memory import TensorMemory
from tests.engine.plan_cases import naive_outputs, planned_outputs


class DenseBlock3d(nn.Module):
    """A small 3-D DenseNet: dense layers (BN, ReLU in place, 1x1 and 3x3 convolutions, concatenations), a
    transition with average pooling, a classifier."""

    def __init__(self, growth: int = 6, layers: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(1, 8, 3, stride=2, padding=1), nn.BatchNorm3d(8), nn.ReLU(inplace=True),
                                  nn.MaxPool3d(3, 2, 1))
        self.layers = nn.ModuleList()
        channels = 8
        for _ in range(layers):
            self.layers.append(nn.Sequential(nn.BatchNorm3d(channels), nn.ReLU(inplace=True),
                                             nn.Conv3d(channels, 12, 1, bias=False), nn.BatchNorm3d(12),
                                             nn.ReLU(inplace=True), nn.Conv3d(12, growth, 3, padding=1, bias=False)))
            channels += growth
        self.transition = nn.Sequential(nn.BatchNorm3d(channels), nn.ReLU(inplace=True),
                                        nn.Conv3d(channels, 8, 1), nn.AvgPool3d(2, 2))
        self.head = nn.Sequential(nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(8, 3))

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = torch.cat([x, layer(x)], 1)
        return self.head(self.transition(x))


class Residual2d(nn.Module):
    """A residual block whose shortcut is activated in place after the main branch read it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.b = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.act = nn.ReLU(inplace=True)
        self.down = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        y = self.a(x)
        z = self.b(y)  # reads y before ...
        y = self.act(y)  # ... it is overwritten in place: the store must keep the value b read
        return self.fc(self.down(z + y).mean((2, 3)))


def _calibrated(model: nn.Module, shape: tuple[int, ...]) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.momentum = None
    model.train()
    with torch.no_grad():
        model(torch.randn(4, *shape))
    return model.eval()


@pytest.fixture
def dense3d():
    torch.manual_seed(3)
    model = _calibrated(DenseBlock3d(), (1, 20, 24, 28))
    return model, torch.randn(1, 1, 20, 24, 28)


def test_planned_runs_equal_naive_inference(dense3d):
    model, image = dense3d
    engine = BatchEngine(capture(model, image.shape[1:]), image)
    corners = occlusion_grid((20, 24, 28), (6, 6, 6), (5, 6, 7))
    got, plan = planned_outputs(engine, image, corners, (6, 6, 6), batch_size=5)
    with torch.no_grad():
        torch.testing.assert_close(got, naive_outputs(model, image, corners, (6, 6, 6)), rtol=1e-4, atol=1e-4)
    assert any(sp.assemble for b in plan.batches for sp in b.steps)  # concatenations written in place
    assert any(sp.dense for b in plan.batches for sp in b.steps)  # whole-map steps without gathers


def test_in_place_merges_read_the_values_before_they_were_overwritten():
    torch.manual_seed(4)
    model = _calibrated(Residual2d(), (3, 20, 20))
    image = torch.randn(1, 3, 20, 20)
    engine = BatchEngine(capture(model, image.shape[1:]), image)
    assert engine.executor.mutated  # a's output is overwritten by the in-place ReLU
    corners = occlusion_grid((20, 20), (5, 5), (3, 3))
    got, _ = planned_outputs(engine, image, corners, (5, 5), batch_size=7)
    with torch.no_grad():
        torch.testing.assert_close(got, naive_outputs(model, image, corners, (5, 5)), rtol=1e-4, atol=1e-4)


def test_a_plan_is_built_once_per_key_and_shared(dense3d, monkeypatch):
    model, image = dense3d
    runtime_cache().clear()
    calls = []
    real = batches.build_plan
    monkeypatch.setattr(batches, "build_plan", lambda *a: calls.append(a[2]) or real(*a))
    graph = capture(model, image.shape[1:])
    engines = [BatchEngine(graph, image), BatchEngine(graph, torch.randn_like(image))]  # another volume
    assert engines[0].executor is engines[1].executor  # one executor per graph and device
    box_a = input_boxes(occlusion_grid((20, 24, 28), (6, 6, 6), (7, 9, 11)), (6, 6, 6), (20, 24, 28))
    box_b = input_boxes(occlusion_grid((20, 24, 28), (8, 8, 8), (6, 8, 10)), (8, 8, 8), (20, 24, 28))
    first, status = engines[0].plan(box_a.start(), box_a.sizes(), batch_size=4)
    assert status is LookupStatus.MISS and len(calls) == 1
    again, status = engines[1].plan(box_a.start(), box_a.sizes(), batch_size=4)
    assert status is LookupStatus.HIT and again is first and len(calls) == 1
    engines[0].plan(box_b.start(), box_b.sizes(), batch_size=4)  # another key: built
    third, _ = engines[1].plan(box_a.start(), box_a.sizes(), batch_size=4)  # A, B, A: the first is still there
    assert third is first and len(calls) == 2
    engines[0].plan(box_a.start(), box_a.sizes(), batch_size=3)  # another batch size: another plan
    assert len(calls) == 3


def test_threads_share_one_build(dense3d, monkeypatch):
    model, image = dense3d
    runtime_cache().clear()
    graph = capture(model, image.shape[1:])
    engine = BatchEngine(graph, image)
    calls = []
    gate = threading.Event()
    real = batches.build_plan

    def slow(*args):
        calls.append(1)
        gate.wait(5)
        return real(*args)

    monkeypatch.setattr(batches, "build_plan", slow)
    region = input_boxes(occlusion_grid((20, 24, 28), (6, 6, 6), (5, 5, 5)), (6, 6, 6), (20, 24, 28))
    plans = []
    starts, sizes = region.start(), region.sizes()
    threads = [threading.Thread(target=lambda: plans.append(engine.plan(starts, sizes, batch_size=8)[0]))
               for _ in range(6)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(plans) == 6 and all(p is plans[0] for p in plans)


@pytest.mark.parametrize("name", ["dense3d", "resnet18", "mobilenet_v2"])
def test_plan_multiply_adds_equal_the_geometry(name, dense3d):
    if name == "dense3d":
        model, image = dense3d
        window = (6, 6, 6)
    else:
        from tests.conftest import zoo_model

        model, image, window = zoo_model(name), torch.randn(1, 3, 64, 64), (12, 12)
    graph = capture(model, image.shape[1:])
    engine = BatchEngine(graph, image)
    dims = tuple(image.shape[2:])
    region = input_boxes(occlusion_grid(dims, window, tuple(max(1, d // 4) for d in dims)), window, dims)
    exact = incremental_flops(graph, propagate(graph, region, uniform=False))
    single, _ = engine.plan(region.start(), region.sizes(), batch_size=1)
    np.testing.assert_allclose(single.query_macs, exact, rtol=1e-12)
    # a batch of one query computes exactly its own boxes: the plan counts the geometry's multiply-adds
    np.testing.assert_allclose(single.macs, exact.sum(), rtol=1e-9)
    np.testing.assert_allclose(single.planned_speedup, single.theoretical_speedup, rtol=1e-9)
    packed, _ = engine.plan(region.start(), region.sizes(), batch_size=8)
    assert packed.macs >= exact.sum() * (1 - 1e-9)  # packing computes each query on the batch's largest boxes
    assert packed.planned_speedup <= packed.theoretical_speedup * (1 + 1e-9)


def test_plans_are_immutable(dense3d):
    model, image = dense3d
    engine = BatchEngine(capture(model, image.shape[1:]), image)
    region = input_boxes(np.array([[0, 0, 0], [7, 9, 11]]), (6, 6, 6), (20, 24, 28))
    plan, _ = engine.plan(region.start(), region.sizes(), batch_size=2)
    batch = plan.batches[0]
    with pytest.raises((AttributeError, TypeError)):
        batch.macs = 0.0  # frozen dataclasses
    with pytest.raises(ValueError):
        batch.queries[0] = 1  # read-only arrays
    with pytest.raises(ValueError):
        batch.steps[0].box.lo[0][0] = 5


def test_executor_is_rebuilt_when_weights_change_in_place(dense3d):
    model, image = dense3d
    graph = capture(model, image.shape[1:])
    first = BatchEngine(graph, image)
    with torch.no_grad():
        model.stem[0].weight.mul_(1.5)  # the folded batch norms and the store must follow
    second = BatchEngine(graph, image)
    assert second.executor is not first.executor
    corners = np.array([[4, 4, 4], [10, 12, 14]])
    got, _ = planned_outputs(second, image, corners, (6, 6, 6), batch_size=2)
    with torch.no_grad():
        torch.testing.assert_close(got, naive_outputs(model, image, corners, (6, 6, 6)), rtol=1e-4, atol=1e-4)


def test_a_3d_run_stays_under_its_planned_memory(dense3d):
    """What a planned 3-D batch keeps alive (every tensor counted, exactly) stays under the plan's bound, which
    itself stays under what naive re-inference holds at the same batch size (DenseNet's concatenations
    included)."""
    model, image = dense3d
    engine = BatchEngine(capture(model, image.shape[1:]), image)
    corners = occlusion_grid((20, 24, 28), (6, 6, 6), (4, 5, 6))
    region = input_boxes(corners, (6, 6, 6), (20, 24, 28))
    for batch_size in (4, 12):
        plan, _ = engine.plan(region.start(), region.sizes(), batch_size=batch_size)
        naive = forward_peak_bytes(engine.program, batch_size, 4)
        assert plan.peak_bytes <= naive
        for batch in plan.batches:
            values = torch.zeros(batch.n, 1, *batch.start.size)
            with TensorMemory() as memory:
                engine.run_batch(batch, values)
            index = 0 if batch.index is not None else batch.index_bytes
            assert memory.peak <= batch.peak_bytes + index, (memory.peak, batch.peak_bytes)


def test_memory_budget_sizes_the_batches(dense3d):
    model, image = dense3d
    engine = BatchEngine(capture(model, image.shape[1:]), image)
    region = input_boxes(occlusion_grid((20, 24, 28), (6, 6, 6), (2, 3, 3)), (6, 6, 6), (20, 24, 28))
    small, _ = engine.plan(region.start(), region.sizes(), memory=2 * 2**20)
    large, _ = engine.plan(region.start(), region.sizes(), memory=64 * 2**20)
    assert small.batch_size < large.batch_size
    assert small.peak_bytes <= 2 * 2**20 or small.batch_size == 1


def test_unplanned_walk_and_plan_agree(dense3d):
    model, image = dense3d
    engine = BatchEngine(capture(model, image.shape[1:]), image)
    region = input_boxes(np.array([[0, 0, 0], [14, 18, 22], [7, 3, 11]]), (6, 6, 6), (20, 24, 28))
    plan, _ = engine.plan(region.start(), region.sizes(), batch_size=3)
    batch = plan.batches[0]
    values = torch.randn(batch.n, 1, *batch.start.size)
    planned = engine.run_batch(batch, values).output
    walked = engine.run(Boxes(batch.start.lo, batch.start.size, values)).output
    torch.testing.assert_close(planned, walked, rtol=1e-5, atol=1e-5)


class WideHead2d(nn.Module):
    """Two convolutions and a large fully connected classifier (VGG's shape: the tail reads many weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 12 * 12, 64), nn.ReLU(), nn.Linear(64, 5))

    def forward(self, x):
        return self.head(self.features(x))


def test_batches_share_tail_runs_within_naive_memory():
    """Consecutive batches' boundary tensors join for one run of the tail: the outputs equal naive inference, and
    the plan's bound (boundary tensors waiting included) stays under naive re-inference at the same batch size."""
    torch.manual_seed(5)
    model = WideHead2d().eval()
    image = torch.randn(1, 3, 24, 24)
    engine = BatchEngine(capture(model, image.shape[1:]), image)
    corners = occlusion_grid((24, 24), (5, 5), (3, 3))
    region = input_boxes(corners, (5, 5), (24, 24))
    plan, _ = engine.plan(region.start(), region.sizes(), batch_size=4)
    assert plan.batch_size < plan.tail_queries <= len(corners)
    assert plan.peak_bytes <= forward_peak_bytes(engine.program, 4, 4)
    outputs = torch.zeros(len(corners), 5)
    waiting, queries = [], []
    for batch in plan.batches:
        values = torch.stack([engine.store.input[0, :, s0:s0 + batch.start.size[0], s1:s1 + batch.start.size[1]]
                              for s0, s1 in batch.start.start()])
        for k, q in enumerate(batch.queries):  # the occluded window inside the batch's box
            o0, o1 = corners[q] - batch.start.start()[k]
            values[k, :, max(o0, 0):o0 + 5, max(o1, 0):o1 + 5] = 0.0
        result = engine.run_to_tail(batch, values)
        assert not result.unchanged
        waiting.append(result.output)
        queries.extend(batch.queries)
    shared = engine.tail([torch.cat(parts) for parts in zip(*waiting)])
    outputs[torch.tensor(queries)] = shared
    with torch.no_grad():
        torch.testing.assert_close(outputs, naive_outputs(model, image, corners, (5, 5)), rtol=1e-4, atol=1e-4)
