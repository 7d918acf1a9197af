"""Host memory between batches: freed memory is handed back to the system only when the run's resident growth
would pass the plan's budget (naive re-inference's memory at the same batch size, or the caller's budget)."""

from __future__ import annotations

import mmap

import numpy as np
import torch
import torch.nn as nn

import incrinf.engine.memory as memory
from incrinf.analysis import occlusion_grid
from incrinf.engine import BatchEngine
from incrinf.engine.plans import forward_peak_bytes
from incrinf.geometry import input_boxes
from incrinf.graph import capture
from tests.engine.plan_cases import run_zeroed_windows


def test_settle_hands_back_only_past_the_budget(monkeypatch):
    resident = [100]
    released = []
    monkeypatch.setattr(memory, "resident_memory", lambda: resident[0])
    monkeypatch.setattr(memory, "release_free_memory", lambda: released.append(True))
    host = memory.HostMemory()
    resident[0] = 160  # grew by 60 bytes
    assert not host.settle(budget=100, coming=40)
    assert not released
    assert host.settle(budget=100, coming=41)
    assert host.settle(budget=0, coming=0)  # no budget: always
    resident[0] = None
    assert host.settle(budget=10**9, coming=0)  # growth unknown: always
    assert len(released) == host.releases == 3


def test_resident_memory_reads_this_process():
    # A fresh anonymous mapping, every page written: new resident pages. (A tensor allocation may reuse pages the
    # allocator already holds resident from earlier tests in the same worker, and then the resident set stays put.)
    size = 64 * 2**20
    before = memory.resident_memory()
    block = mmap.mmap(-1, size)
    block.write(b"\x01" * size)
    after = memory.resident_memory()
    block.close()
    assert before is not None and after is not None
    assert after - before >= 32 * 2**20


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2, padding=1),
                                  nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    def forward(self, x):
        return self.body(x)


def test_batches_settle_within_the_plans_budget(monkeypatch):
    """The plan's budget is naive re-inference's memory at its batch size, its operators' working memory on plain
    channels-first batches included (or the caller's budget), and every check a run makes compares against it,
    with the batch's planned peak still to come."""
    torch.manual_seed(0)
    image = torch.randn(1, 3, 32, 32)
    engine = BatchEngine(capture(Small().eval(), image.shape[1:]), image)
    region = input_boxes(occlusion_grid((32, 32), (6, 6), (4, 4)), (6, 6), (32, 32))
    plan, _ = engine.plan(region.start(), region.sizes(), batch_size=8)
    assert plan.budget_bytes == max(forward_peak_bytes(engine.program, 8, 4, channels_last=False), plan.peak_bytes)
    budgeted, _ = engine.plan(region.start(), region.sizes(), memory=3 * 2**20)
    assert budgeted.budget_bytes == max(3 * 2**20, budgeted.peak_bytes)
    assert all(b.budget_bytes == plan.budget_bytes for b in plan.batches)
    calls = []
    monkeypatch.setattr(engine.host, "settle", lambda budget, coming: calls.append((budget, coming)))
    for batch in plan.batches:
        engine.run_batch(batch, torch.zeros(batch.n, 3, *batch.start.size))
    assert calls and all(budget == plan.budget_bytes for budget, _ in calls)
    assert {coming for _, coming in calls} <= {b.peak_bytes for b in plan.batches}


class Dense3d(nn.Module):
    """A small 3-D DenseNet-style network: concatenations whose parts stay live, a transition, a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(1, 16, 3, padding=1), nn.BatchNorm3d(16), nn.ReLU(inplace=True))
        self.layers = nn.ModuleList(
            nn.Sequential(nn.BatchNorm3d(16 + 8 * i), nn.ReLU(inplace=True), nn.Conv3d(16 + 8 * i, 8, 3, padding=1))
            for i in range(3))
        self.head = nn.Sequential(nn.Conv3d(40, 16, 3, stride=2, padding=1), nn.AdaptiveAvgPool3d(1), nn.Flatten(),
                                  nn.Linear(16, 2))

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = torch.cat([x, layer(x)], 1)
        return self.head(x)


def _sampled_growth(fn):
    """``(peak resident growth, result)`` of ``fn()``, the resident set sampled every millisecond."""
    import threading

    origin = memory.resident_memory()
    peak = [origin]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            peak[0] = max(peak[0], memory.resident_memory())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    result = fn()
    done.set()
    sampler.join()
    return max(peak[0], memory.resident_memory()) - origin, result


def _peak_growth_of_a_run() -> tuple[int, int, int]:
    """In a fresh process: the peak resident growth of a 3-D occlusion run on a second volume (the executor and
    plan made on a first), sampled every millisecond, and the plan's budget and its check interval."""

    from incrinf.engine.memory import TRIM_BYTES

    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model = Dense3d().eval()
    graph = capture(model, (1, 32, 32, 32))
    region = input_boxes(occlusion_grid((32, 32, 32), (8, 8, 8), (8, 8, 8)), (8, 8, 8), (32, 32, 32))

    def run(image: torch.Tensor):
        engine = BatchEngine(graph, image)
        plan, _ = engine.plan(region.start(), region.sizes(), batch_size=8)
        for batch in plan.batches:
            engine.run_batch(batch, torch.zeros(batch.n, 1, *batch.start.size))
        return plan

    run(torch.randn(1, 1, 32, 32, 32))  # executor, plan, oneDNN's primitives
    image = torch.randn(1, 1, 32, 32, 32)
    growth, plan = _sampled_growth(lambda: run(image))
    assert np.isfinite(plan.budget_bytes)
    return growth, plan.budget_bytes, TRIM_BYTES


def test_a_3d_runs_resident_peak_stays_under_its_plans_budget():
    """The resident memory a 3-D run adds (store, index tensors, batches, what the allocator holds freed), measured
    in a fresh process, stays under the plan's budget (naive re-inference's memory at the batch size) plus the
    bytes freed between two checks."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        growth, budget, interval = pool.apply(_peak_growth_of_a_run)
    assert growth <= budget + interval, (growth >> 20, budget >> 20, interval >> 20)


def test_a_batch_leaves_no_tensor_in_reference_cycles():
    """Every value a planned batch makes is freed by reference counting when its last reader is done: a tensor
    held in a reference cycle (a self-calling closure over a concatenation's inputs, say) lives until Python's
    cycle collector happens to run, and a 3-D DenseNet's batches then held hundreds of MiB above their plan."""
    import gc

    torch.manual_seed(0)
    image = torch.randn(1, 1, 16, 16, 16)
    engine = BatchEngine(capture(Dense3d().eval(), image.shape[1:]), image)
    region = input_boxes(occlusion_grid((16, 16, 16), (6, 6, 6), (5, 5, 5)), (6, 6, 6), (16, 16, 16))
    plan, _ = engine.plan(region.start(), region.sizes(), batch_size=4)
    gc.collect()
    flags = gc.get_debug()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds is kept in gc.garbage instead of freed
    try:
        for batch in plan.batches:
            engine.run_batch(batch, torch.zeros(batch.n, 1, *batch.start.size))
        gc.collect()
        cycled = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
        gc.enable()
    assert not cycled, [tuple(t.shape) for t in cycled[:5]]


def test_a_concatenation_holds_its_parts_values_once():
    """The parts of a concatenation that the store keeps are column slices of the concatenation's table, also
    when a padded window reads the concatenation (its padded table then holds them): no tensor's values are
    stored twice, and the store's bytes are those of its distinct tables."""
    torch.manual_seed(0)
    image = torch.randn(1, 1, 12, 12, 12)
    engine = BatchEngine(capture(Dense3d().eval(), image.shape[1:]), image)
    layout, store = engine.executor.layout, engine.store
    whole = layout.reads["cat_2"].table
    parts = ["stem_2", "layers_0_2", "layers_1_2", "layers_2_2", "cat", "cat_1"]
    assert all(layout.reads[p].table == whole for p in parts), {p: layout.reads[p] for p in parts}
    assert [layout.reads[p].columns for p in ("stem_2", "layers_0_2", "layers_1_2", "layers_2_2")] == \
        [(0, 16), (16, 8), (24, 8), (32, 8)]
    sources = [t.source for t in layout.tables.values()]
    assert len(sources) == len(set(sources))  # one padding per source here: one table each
    assert store.nbytes == sum(t.rows * store.tables[k].shape[1] * 4 for k, t in layout.tables.items())
    for p in parts:  # the values read back are the base's
        assert torch.equal(store.plain(p), engine.base[p])


def test_the_weights_a_program_makes_are_counted():
    """A run's byte model counts the weights its program made beyond the model's own (folded batch norms,
    channels-last copies): every tensor the steps hold that the model does not."""
    torch.manual_seed(0)
    image = torch.randn(1, 1, 12, 12, 12)
    model = Dense3d().eval()
    engine = BatchEngine(capture(model, image.shape[1:]), image)
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    held: dict[int, int] = {}

    def visit(value, depth=0):
        if isinstance(value, torch.Tensor):
            if value.untyped_storage().data_ptr() not in own:
                held[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
        elif isinstance(value, (list, tuple)) and depth < 3:
            for v in value:
                visit(v, depth + 1)
        elif callable(value) and getattr(value, "__closure__", None) and depth < 3:
            for cell in value.__closure__:
                visit(cell.cell_contents, depth + 1)

    for step in engine.program.steps:
        visit(step.op)
        visit(step.linear)
    assert held and engine.program.ops.made_bytes >= sum(held.values())
    assert engine.run_bytes(engine.plan(np.zeros((1, 3), np.int64), np.full((1, 3), 4), batch_size=1)[0]).weights \
        == engine.program.ops.made_bytes


def _growth_of_a_whole_run(n: int, batch_size: int) -> tuple[int, int, int]:
    """In a fresh process: the peak resident growth of a 3-D occlusion run that builds its executor, base and store
    (oneDNN started beforehand on another convolution), sampled every millisecond, and its byte model's predicted
    peak and bound."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    nn.Conv3d(1, 4, 3)(torch.randn(1, 1, 8, 8, 8))  # the runtime's own first-use memory, outside the measurement
    image = torch.randn(1, 1, n, n, n)
    graph = capture(Dense3d().eval(), image.shape[1:])
    region = input_boxes(occlusion_grid((n,) * 3, (8,) * 3, (8,) * 3), (8,) * 3, (n,) * 3)
    growth, predicted = _sampled_growth(lambda: run_zeroed_windows(graph, image, region, batch_size))
    return growth, predicted.peak, predicted.bound


def test_a_3d_densenet_runs_fresh_process_peak_lies_between_its_predicted_peak_and_bound():
    """The byte model of a plan predicts a 3-D DenseNet-style run's resident growth, executor and base included:
    at least its predicted peak (weights made, store, base forward, largest batch: nothing counted that the run
    does not hold) and at most its bound (the budget the allocator may fill with freed blocks, plus the freed
    bytes between two checks)."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        growth, peak, bound = pool.apply(_growth_of_a_whole_run, (40, 16))
    assert peak <= growth <= bound, (growth >> 20, peak >> 20, bound >> 20)
