"""The frame engine: a still camera's change as one box (the box walk with N = 1), a moving camera's as blocks;
both equal full inference, and the cache carries into the next frame (incrinf.engine.frames)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import zoo_model
from hypothesis import given, settings
from hypothesis import strategies as st

from incrinf.engine import FrameEngine, Motion
from incrinf.graph import capture

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _frames(size=(64, 72)) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(1, 3, *size, generator=g)
    x1 = x0.clone()
    x1[:, :, 20:31, 41:50] = torch.randn(1, 3, 11, 9, generator=g)
    return x0, x1, (x1 != x0).any(dim=1)[0].numpy()


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "squeezenet1_1", "googlenet", "densenet121",
                                  "shufflenet_v2_x1_0", "regnet_x_400mf", "efficientnet_lite0"])
def test_box_and_position_paths_equal_full_inference(name):
    model = zoo_model(name)
    x0, x1, changed = _frames()
    with torch.no_grad():
        ref = model(x1)
    flops = {}
    for boxes in (True, False):
        executor = FrameEngine(capture(model, x0.shape[1:]))
        executor.boxes = boxes
        executor.full(x0)
        out = executor.cached(x1, changed)
        scale = ref.abs().max().item()
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * scale)
        flops[boxes] = executor.last.flops_ratio
        assert (executor.last.refreshed is not None) == boxes
    assert flops[True] > 1.0  # the box saved work
    with torch.no_grad():
        assert float((ref - model(x0)).abs().max()) > 1e-3 * scale  # the change moved the output


def test_box_path_updates_the_cache_for_the_next_frame():
    model = zoo_model("mobilenet_v2")
    x0, x1, changed = _frames()
    x2 = x1.clone()
    x2[:, :, 5:9, 5:12] += 1.0
    executor = FrameEngine(capture(model, x0.shape[1:]))
    executor.full(x0)
    executor.cached(x1, changed)
    out = executor.cached(x2, (x2 != x1).any(dim=1)[0].numpy())
    with torch.no_grad():
        ref = model(x2)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_a_change_that_dies_out_returns_a_copy_of_the_previous_output():
    model = zoo_model("efficientnet_lite0")
    x0, x1, changed = _frames()
    x1 = x0.clone()
    x1[:, :, 30, 30] += 1e-3  # far below a 50% feature threshold: pruned at the first cached tensor
    executor = FrameEngine(capture(model, x0.shape[1:]))
    first = executor.full(x0)
    out = executor.cached(x1, (x1 != x0).any(dim=1)[0].numpy(), feature_threshold=0.5)
    torch.testing.assert_close(out, first)
    assert out is not first and out.data_ptr() != first.data_ptr()
    assert executor.last.flops_ratio > 1000  # only the stem ran (the classifier alone would cap this near 27)
    out.add_(1.0)  # the caller owns its copy
    again = executor.cached(x1, np.zeros(changed.shape, bool), feature_threshold=0.5)
    torch.testing.assert_close(again, first)


def test_dense_change_through_the_box_path_uses_the_compiled_suffix():
    model = zoo_model("resnet18")
    x0, _, _ = _frames()
    x1 = torch.randn_like(x0)
    executor = FrameEngine(capture(model, x0.shape[1:]))
    executor.full(x0)
    out = executor.cached(x1, np.ones(x0.shape[-2:], bool))
    with torch.no_grad():
        ref = model(x1)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    assert executor.last.dense_steps >= 1
    assert F.mse_loss(out, ref) < 1e-8


def test_moved_cache_equals_full_inference_for_whole_position_shifts():
    # a 32 px shift is whole positions of every cached map (sizes divisible by the largest stride): an exact move
    # through index maps from the caller (the stream computes them from the homography), the uncovered strip
    # and the windows that read padding where the previous frame had content recomputed
    model = zoo_model("mobilenet_v2")
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(1, 3, 64, 128, generator=g)
    x0, x1 = wide[..., :96], wide[..., 32:]  # the view moves 32 px right: content 32 px left
    executor = FrameEngine(capture(model, x0.shape[1:]))
    executor.full(x0)
    motion = Motion()
    for dims in executor.resolutions:
        motion.new_padding[dims] = ("left",)  # windows reading the left padding saw content in x0
        if dims == (64, 96):
            continue
        shift = 32 * dims[1] // 96
        h, w = dims
        cols = np.arange(w) + shift
        index = (np.arange(h)[:, None] * w + np.minimum(cols, w - 1)[None, :]).reshape(-1)
        motion.index[dims] = torch.from_numpy(index)
        invalid = np.zeros(dims, bool)
        invalid[:, cols >= w] = True
        motion.invalid[dims] = invalid
    changed = np.zeros((64, 96), bool)
    changed[:, 64:] = True  # the newly uncovered content
    out = executor.cached(x1, changed, motion)
    with torch.no_grad():
        ref = model(x1)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    assert executor.last.moved >= 1 and executor.last.flops_ratio > 1.0


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(0, 2 ** 16), st.floats(0.0, 1.0))
def test_a_pruned_commit_keeps_the_bounding_box_of_the_moved_positions(h, w, seed, share):
    """Value-based pruning at a commit: the box shrinks to the bounding box of the positions whose values moved
    by more than the threshold (the one-box path and the general cut agree), and only it is written."""
    from incrinf.engine.regions import cut
    from incrinf.engine.stores import FrameCache
    from incrinf.geometry import Boxes

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3))
    engine = FrameEngine(capture(model.eval(), (3, 12, 12)))
    engine.full(torch.randn(1, 3, 12, 12))
    cache: FrameCache = engine.cache
    name = engine.program.cached[0]
    g = torch.Generator().manual_seed(seed)
    before = cache.map(name).clone()
    y, x = 10 - h, 10 - w
    old = before[..., y:y + h, x:x + w]
    moved = torch.rand(h, w, generator=g) < share
    values = (old + 10.0 * moved * (1 + cache.scale(name))).contiguous(memory_format=torch.channels_last)
    region = Boxes((y, x), (h, w), values)
    expected = cut(region, moved.numpy()[None])
    committed = cache.commit(name, region, 0.5)
    after = cache.map(name)
    if expected is None:
        assert committed is None and torch.equal(after, before)
        return
    assert committed.bounds == expected.bounds and torch.equal(committed.values, expected.values)
    a, b, c, d = committed.bounds
    written = before.clone()
    written[..., a:b, c:d] = values[..., a - y:b - y, c - x:d - x]
    assert torch.equal(after, written)
