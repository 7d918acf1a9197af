"""A program's steps bound once for the frame walk (incrinf.engine.frame_steps), and the commit's pruning test."""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from incrinf.engine import FrameEngine
from incrinf.engine.frame_regions import run_box, run_pointwise
from incrinf.engine.frame_steps import bind_step, in_place_activation
from incrinf.geometry import Boxes
from incrinf.graph import capture

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Functional(nn.Module):
    """Activations written as functions and methods, after 1x1 and 3x3 convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 1)
        self.c = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.d = nn.Conv2d(8, 8, 1, bias=False)

    def forward(self, x):
        x = F.relu6(self.a(x))
        x = torch.sigmoid(self.b(x))
        x = self.c(x).relu()
        return F.leaky_relu(self.d(x), 0.2)  # not one of the activations bound in place


def _module_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU6(), nn.Conv2d(8, 16, 1), nn.Hardswish(),
                         nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.SiLU(), nn.Conv2d(16, 8, 1), nn.ReLU(),
                         nn.Hardtanh(-1.0, 2.0), nn.Conv2d(8, 8, 3, padding=1), nn.GELU(), nn.ReLU()).eval()


def _engine(model: nn.Module, size=(3, 16, 20)) -> FrameEngine:
    engine = FrameEngine(capture(model.eval(), size))
    engine.full(torch.randn(1, *size, generator=torch.Generator().manual_seed(0)))
    return engine


@pytest.mark.parametrize("model", [_module_model(), _Functional()], ids=["modules", "functions"])
def test_bound_activations_are_the_chain_in_place(model):
    engine = _engine(model)
    for step in engine.program.steps:
        bound = bind_step(step, engine.program.graph)
        assert bound.in_place <= len(step.chain)
        x = torch.randn(1, *step.channels, 5, 6).contiguous(memory_format=torch.channels_last)
        for k in range(bound.in_place):
            fresh = x.clone()
            out = bound.functions[k](fresh)
            assert out.data_ptr() == fresh.data_ptr()  # in place: no new tensor
            assert torch.equal(out, step.functions[k](x))  # the same arithmetic
        # what is not bound in place is the captured chain itself
        assert bound.functions[bound.in_place:] == step.functions[bound.in_place:]
    kinds = [[type(n.fx_node.graph.owning_module.get_submodule(n.fx_node.target)).__name__
              if n.fx_node.op == "call_module" else str(n.fx_node.target) for n, _ in s.chain]
             for s in engine.program.steps]
    bound = [bind_step(s, engine.program.graph).in_place for s in engine.program.steps]
    if isinstance(model, nn.Sequential):
        # GELU has no in-place form here: it, and the ReLU after it, run as captured
        assert kinds[-1] == ["GELU", "ReLU"] and bound[-1] == 0
        assert bound[:-1] == [len(k) for k in kinds[:-1]] and sum(bound) >= 5
    else:
        assert bound == [1, 1, 1, 0]  # relu6, sigmoid, .relu(); leaky_relu with a slope is left as captured


def test_activation_forms_without_an_in_place_twin_are_left_alone():
    graph = capture(nn.Sequential(nn.Conv2d(3, 3, 1), nn.GELU(), nn.ReLU6()).eval(), (3, 4, 4))
    gelu, relu6 = graph.by_name["_1"], graph.by_name["_2"]
    assert in_place_activation(gelu, graph) is None
    x = torch.randn(1, 3, 4, 4) * 8
    assert torch.equal(in_place_activation(relu6, graph)(x.clone()), F.relu6(x))


@pytest.mark.parametrize("bias", [True, False])
def test_a_bound_one_by_one_convolution_equals_the_captured_step(bias):
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 12, 1, bias=bias), nn.ReLU6(),
                          nn.Conv2d(12, 4, 3, padding=1)).eval()
    engine = _engine(model)
    program = engine.program
    index = next(i for i, s in enumerate(program.steps) if s.linear is not None)
    step = program.steps[index]
    bound = engine.geometry.bound[index]
    assert bound.weight_t is not None and (bound.bias is not None) == bias and bound.in_place == 1
    g = torch.Generator().manual_seed(1)
    values = torch.randn(1, 8, 5, 7, generator=g).contiguous(memory_format=torch.channels_last)
    source = Boxes((2, 3), (5, 7), values)
    plain, fast = run_pointwise(program, step, source), run_pointwise(program, step, source, bound)
    assert torch.equal(fast.values, plain.values) and fast.bounds == plain.bounds
    assert torch.equal(values, source.values)  # the step's input is read, never overwritten
    # a window step: the in-place chain leaves the cache it reads untouched
    first = program.steps[0]
    before = engine.cache.map(program.graph.input.name).clone()
    box = run_box(program, engine.cache, first, {}, (2, 7, 3, 10), engine.geometry.bound[0])
    assert torch.equal(box.values, run_box(program, engine.cache, first, {}, (2, 7, 3, 10)).values)
    assert torch.equal(engine.cache.map(program.graph.input.name), before)


def test_the_commits_pruning_test_is_the_mean_over_channels_against_the_threshold():
    """The commit compares each position's mean absolute change over the channels with the threshold (a channel sum
    divided in numpy): the same float32 decision as torch's mean, position by position, on values drawn around
    the threshold."""
    model = nn.Sequential(nn.Conv2d(3, 24, 3, padding=1), nn.ReLU(), nn.Conv2d(24, 4, 3)).eval()
    engine = _engine(model, (3, 24, 24))
    cache = engine.cache
    name = engine.program.cached[0]
    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        old = cache.map(name)[..., 4:14, 6:18].clone()
        values = (old + torch.randn(old.shape, generator=g) * 0.3).contiguous(memory_format=torch.channels_last)
        means = (values - old).abs().mean(dim=1)[0]
        threshold = float(means.median()) / cache.scale(name)  # about half the positions moved
        eps = np.float32(threshold * cache.scale(name))
        moved = means.numpy() > eps
        committed = cache.commit(name, Boxes((4, 6), (10, 12), values), threshold)
        ys, xs = np.nonzero(moved.any(axis=1))[0], np.nonzero(moved.any(axis=0))[0]
        assert committed.bounds == (4 + ys[0], 4 + ys[-1] + 1, 6 + xs[0], 6 + xs[-1] + 1)


@pytest.mark.parametrize("bias", [True, False])
def test_a_bound_product_of_a_pruned_boxs_crop_equals_the_captured_step(bias):
    """A pruned box's values are a crop of its step's values (not channels-last dense): the bound product reads
    them through the rows the captured step reads, and both give the same bits; a dense box of one row or one
    column is read through the strided view."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 12, 1, bias=bias), nn.ReLU6(),
                          nn.Conv2d(12, 4, 3, padding=1)).eval()
    engine = _engine(model)
    program = engine.program
    index = next(i for i, s in enumerate(program.steps) if s.linear is not None)
    step, bound = program.steps[index], engine.geometry.bound[index]
    g = torch.Generator().manual_seed(2)
    whole = torch.randn(1, 8, 9, 11, generator=g).contiguous(memory_format=torch.channels_last)
    for values in (whole[..., 2:7, 3:8], whole[..., 4:5, :], whole[..., :, 6:7], whole[..., 3:4, 5:6]):
        before = whole.clone()
        source = Boxes((1, 2), tuple(values.shape[-2:]), values)
        plain, fast = run_pointwise(program, step, source), run_pointwise(program, step, source, bound)
        assert torch.equal(fast.values, plain.values) and fast.values.shape == plain.values.shape
        assert fast.values.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(whole, before)  # the box it read is untouched


class _Residual(nn.Module):
    """Merges of two maps in the forms a traced model writes them, and ones bound otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.c = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        a = self.a(x)
        b = self.b(a)
        s = a + b  # operator.add: bound
        p = torch.mul(s, b)  # a function: bound
        q = self.c(p).add(p)  # a method: bound
        r = torch.add(q, s, alpha=2.0)  # a keyword: through the step's operators
        return torch.cat([r, q], dim=1)  # a list of tensors: through the step's operators


def test_a_bound_merge_is_the_captured_merge_and_leaves_the_cache_alone():
    engine = _engine(_Residual())
    program, cache = engine.program, engine.cache
    merges = [(i, s) for i, s in enumerate(program.steps) if s.window is None and len(s.inputs) == 2]
    bound = [engine.geometry.bound[i].merge is not None for i, _ in merges]
    assert bound == [True, True, True, False, False]
    for index, step in merges:
        maps = {name: cache.map(name).clone() for name in step.inputs}
        fast = run_box(program, cache, step, {}, (3, 9, 2, 13), engine.geometry.bound[index])
        plain = run_box(program, cache, step, {}, (3, 9, 2, 13))
        assert torch.equal(fast.values, plain.values)
        assert all(torch.equal(cache.map(name), before) for name, before in maps.items())


def test_an_in_place_merge_is_not_bound():
    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            a = self.a(x)
            b = self.b(a)
            b = b.add_(a)  # overwrites an input that the cache holds: the captured path clones it first
            return torch.relu(b)

    engine = _engine(InPlace())
    merges = [i for i, s in enumerate(engine.program.steps) if s.window is None and len(s.inputs) == 2]
    assert merges and all(engine.geometry.bound[i].merge is None for i in merges)


def test_crop_view_is_the_slice():
    from incrinf.engine.windows import crop_view

    t = torch.randn(1, 5, 9, 11).contiguous(memory_format=torch.channels_last)[..., 1:8, :]
    for y, x, h, w in [(0, 0, 7, 11), (2, 3, 4, 5), (6, 10, 1, 1), (5, 8, 4, 6), (3, 3, 0, 2)]:
        view, sliced = crop_view(t, y, x, h, w), t[..., y:y + h, x:x + w]  # the last two: clipped, empty
        assert view.shape == sliced.shape and view.stride() == sliced.stride()
        assert view.storage_offset() == sliced.storage_offset() and torch.equal(view, sliced)


class _Grouped(nn.Module):
    """Grouped and depthwise convolutions of several kernels, strides and dilations, each followed by another
    activation (or none), and convolutions the prepacked path leaves alone."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)  # no groups: PyTorch picks its kernel by size
        self.dw3 = nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=16)
        self.dw5 = nn.Conv2d(16, 16, 5, padding=4, dilation=2, groups=16)
        self.g4 = nn.Conv2d(16, 32, 3, padding=1, groups=4, bias=False)
        self.dw1 = nn.Conv2d(32, 32, 1, groups=32)  # a 1x1 one on one thread is not oneDNN's
        self.dw7 = nn.Conv2d(32, 32, (3, 5), padding=(1, 2), groups=32)
        self.dws = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.clip = nn.Hardtanh(-1.0, 2.0)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        x = F.relu6(self.dw3(x))
        x = self.clip(self.dw5(x))
        x = self.g4(x).relu()
        x = torch.sigmoid(self.dw1(x))
        x = F.gelu(self.dw7(x))  # no clamp to fuse: the convolution alone, then the chain
        return self.dws(x)


def test_a_prepacked_window_is_the_captured_step_bit_for_bit():
    engine = _engine(_Grouped(), (3, 21, 26))
    program, cache = engine.program, engine.cache
    windows = [(i, s) for i, s in enumerate(program.steps) if s.window is not None]
    bound = [engine.geometry.bound[i] for i, _ in windows]
    # the 1x1 depthwise convolution is no window step (and never prepacked: see prepacked_window)
    assert [b.window is not None for b in bound] == [False, True, True, True, True, True]
    assert [b.fused for b in bound] == [0, 1, 1, 1, 0, 0]
    for (_, step), b in zip(windows, bound):
        h, w = step.dims
        source = cache.map(step.window.source).clone()
        # boxes inside the map and at each border (their windows are padded crops)
        for box in [(0, h, 0, w), (1, h - 1, 1, w - 1), (0, 2, 0, 3), (h - 2, h, w - 3, w), (h // 2, h // 2 + 1,
                                                                                            w // 2, w // 2 + 1)]:
            fast = run_box(program, cache, step, {}, box, b)
            plain = run_box(program, cache, step, {}, box)
            assert fast.values.shape == plain.values.shape and torch.equal(fast.values, plain.values)
            assert fast.values.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(cache.map(step.window.source), source)  # the windows it read are untouched
