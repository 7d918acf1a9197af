"""Still-camera frames as one changed rectangle per tensor (incrinf.stream.boxes and the executor's box path)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import zoo_model
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from incrinf.graph import capture
from incrinf.stream.boxes import EMPTY, Box, bounding_box, grow_bounds, padded_crop, round_up, union
from incrinf.stream.sparse import SparseExecutor, _grow, _padded_map, _Window

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _window(kernel, stride, dilation, pad_before, view, view_value=0.0, pad_value=0.0) -> _Window:
    taps = tuple(np.arange(0, k * d - d + 1, d) for k, d in zip(kernel, dilation))
    extent = tuple(int(t[-1]) + 1 for t in taps)
    return _Window(source="x", offset=(pad_before[0] + view[0], pad_before[1] + view[2]), view=view,
                   view_value=view_value, pad_value=pad_value, taps=taps, stride=stride, extent=extent,
                   block=(1, 1), op=lambda t: t)


@st.composite
def _geometry(draw):
    kernel = (draw(st.integers(1, 5)), draw(st.integers(1, 5)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    pad = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    view = tuple(draw(st.integers(0, 2)) for _ in range(4))
    hs, ws = draw(st.integers(6, 20)), draw(st.integers(6, 20))
    win = _window(kernel, stride, dilation, pad, view, draw(st.sampled_from([0.0, 1.5])),
                  draw(st.sampled_from([0.0, -2.0])))
    # the map the operator reads: source + views + own padding on both sides
    ho = (hs + view[0] + view[1] + 2 * pad[0] - win.extent[0]) // stride[0] + 1
    wo = (ws + view[2] + view[3] + 2 * pad[1] - win.extent[1]) // stride[1] + 1
    assume(ho >= 1 and wo >= 1)
    win = _Window(**{**win.__dict__, "own_after": (pad[0], pad[1])})
    y0 = draw(st.integers(0, hs - 1))
    x0 = draw(st.integers(0, ws - 1))
    box = (y0, draw(st.integers(y0 + 1, hs)), x0, draw(st.integers(x0 + 1, ws)))
    return win, (hs, ws), (ho, wo), box


@settings(max_examples=150, deadline=None)
@given(_geometry())
def test_grow_bounds_is_the_bounding_box_of_the_grown_mask(geometry):
    win, (hs, ws), (ho, wo), box = geometry
    grown = _grow(Box(box).mask((hs, ws)), win, (ho, wo))
    bounds = grow_bounds(box, win, (ho, wo))
    assert not (grown & ~Box(bounds).mask((ho, wo))).any()  # every output the change reaches is in the box
    if all(len(t) == e for t, e in zip(win.taps, win.extent)):  # undilated: the box is tight
        assert bounds == bounding_box(grown)


@settings(max_examples=150, deadline=None)
@given(_geometry())
def test_padded_crop_equals_the_slice_of_the_padded_map(geometry):
    win, (hs, ws), (ho, wo), box = geometry
    bounds = grow_bounds(box, win, (ho, wo))
    if bounds == EMPTY:
        return
    source = torch.randn(1, 3, hs, ws)
    full = _padded_map(win, source.permute(0, 2, 3, 1).reshape(hs * ws, 3), hs, ws)
    (sy, sx), (ky, kx) = win.stride, win.extent
    r0, c0 = bounds[0] * sy, bounds[2] * sx  # padded-map coords: source coord + offset
    r1, c1 = (bounds[1] - 1) * sy + ky, (bounds[3] - 1) * sx + kx
    expected = full[:, :, r0:r1, c0:c1]
    crop = padded_crop(source, bounds, win)
    assert crop.shape == expected.shape
    torch.testing.assert_close(crop, expected, rtol=0, atol=0)


def test_bounding_box_union_and_round_up():
    mask = np.zeros((6, 8), bool)
    assert bounding_box(mask) == EMPTY
    mask[1, 2] = mask[4, 6] = True
    assert bounding_box(mask) == (1, 5, 2, 7)
    assert union([EMPTY, (1, 3, 2, 4), (2, 6, 0, 3)]) == (1, 6, 0, 4)
    assert union([EMPTY, EMPTY]) == EMPTY
    assert round_up((1, 3, 2, 7), (10, 8), 4) == (1, 5, 0, 8)  # 5 columns -> 8, pushed back from the edge
    assert round_up((7, 9, 0, 4), (10, 8), 4) == (6, 10, 0, 4)
    assert round_up(EMPTY, (10, 8), 4) == EMPTY


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(1, 9), st.data())
def test_round_up_contains_the_box_and_has_quantised_sides(h, w, quantum, data):
    y0 = data.draw(st.integers(0, h - 1))
    x0 = data.draw(st.integers(0, w - 1))
    box = (y0, data.draw(st.integers(y0 + 1, h)), x0, data.draw(st.integers(x0 + 1, w)))
    out = round_up(box, (h, w), quantum)
    assert 0 <= out[0] <= box[0] and box[1] <= out[1] <= h and 0 <= out[2] <= box[2] and box[3] <= out[3] <= w
    for size, side in ((h, out[1] - out[0]), (w, out[3] - out[2])):
        assert side % quantum == 0 or side == size


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
        executor = SparseExecutor(capture(model, x0.shape[1:]))
        executor.boxes = boxes
        executor.full(x0)
        out = executor.cached(x1, changed, np.eye(3))
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
    executor = SparseExecutor(capture(model, x0.shape[1:]))
    executor.full(x0)
    executor.cached(x1, changed, np.eye(3))
    out = executor.cached(x2, (x2 != x1).any(dim=1)[0].numpy(), np.eye(3))
    with torch.no_grad():
        ref = model(x2)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_a_change_that_dies_out_returns_a_copy_of_the_previous_output():
    model = zoo_model("efficientnet_lite0")
    x0, x1, changed = _frames()
    x1 = x0.clone()
    x1[:, :, 30, 30] += 1e-3  # far below a 50% feature threshold: pruned at the first cached tensor
    executor = SparseExecutor(capture(model, x0.shape[1:]), feature_threshold=0.5)
    first = executor.full(x0)
    out = executor.cached(x1, (x1 != x0).any(dim=1)[0].numpy(), np.eye(3))
    torch.testing.assert_close(out, first)
    assert out is not first and out.data_ptr() != first.data_ptr()
    assert executor.last.flops_ratio > 1000  # only the stem ran (the classifier alone would cap this near 27)
    out.add_(1.0)  # the caller owns its copy
    again = executor.cached(x1, np.zeros(changed.shape, bool), np.eye(3))
    torch.testing.assert_close(again, first)


def test_dense_change_through_the_box_path_uses_the_compiled_suffix():
    model = zoo_model("resnet18")
    x0, _, _ = _frames()
    x1 = torch.randn_like(x0)
    executor = SparseExecutor(capture(model, x0.shape[1:]))
    executor.full(x0)
    out = executor.cached(x1, np.ones(x0.shape[-2:], bool), np.eye(3))
    with torch.no_grad():
        ref = model(x1)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    assert executor.last.dense_nodes >= 1
    assert F.mse_loss(out, ref) < 1e-8
