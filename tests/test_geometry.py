"""Property tests: predicted update regions contain every changed output, and read-in windows hold every
input the recomputed outputs need (checked by running the engine on them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from incrinf import CaptureError
from incrinf.engine import BatchEngine
from incrinf.geometry import RegionKind, input_boxes, local_axis, propagate
from incrinf.graph import capture

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def local_layers(draw):
    kind = draw(st.sampled_from(["conv", "maxpool", "avgpool", "avgpool_excl"]))
    kh, kw = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    sh, sw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    if kind == "conv":
        dil = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
        pad = (draw(st.integers(0, 3)), draw(st.integers(0, 3)))
        layer = nn.Conv2d(3, 6, (kh, kw), (sh, sw), pad, dil, groups=draw(st.sampled_from([1, 3])))
    else:
        pad = (draw(st.integers(0, kh // 2)), draw(st.integers(0, kw // 2)))
        ceil = draw(st.booleans())
        if kind == "maxpool":
            layer = nn.MaxPool2d((kh, kw), (sh, sw), pad, ceil_mode=ceil)
        else:
            layer = nn.AvgPool2d((kh, kw), (sh, sw), pad, ceil_mode=ceil, count_include_pad=kind == "avgpool")
    explicit = draw(st.tuples(*[st.integers(0, 2)] * 4)) if draw(st.booleans()) else None
    h, w = draw(st.integers(max(kh, 6), 20)), draw(st.integers(max(kw, 6), 20))
    return layer, explicit, (h, w)


def _model(layer, explicit):
    parts = [nn.ZeroPad2d(explicit)] if explicit else []
    return nn.Sequential(*parts, layer, nn.ReLU()).eval()


def _run_engine(graph, x, positions, window, values):
    """The engine's outputs for N changed copies of ``x`` (boxes at ``positions``, new values ``values``)."""
    start = input_boxes(positions, window, x.shape[-2:])
    start.values = values
    return BatchEngine(graph, x).run(start).output


def _inside(region, i, shape):
    inside = torch.zeros(shape, dtype=torch.bool)
    (y, x), (h, w) = region.boxes.start()[i], region.boxes.sizes()[i]
    inside[y:y + h, x:x + w] = True
    return inside


def _changed(model, x, boxes):
    with torch.no_grad():
        base = model(x)
        outs = []
        for (y, xx, h, w) in boxes:
            x2 = x.clone()
            x2[..., y:y + h, xx:xx + w] = torch.randn(1, 3, h, w)
            outs.append((x2, model(x2)))
    return base, outs


@SETTINGS
@given(local_layers(), st.data())
def test_region_contains_changes_and_read_in_suffices(layer_spec, data) -> None:
    layer, explicit, (h, w) = layer_spec
    model = _model(layer, explicit)
    x = torch.randn(1, 3, h, w)
    try:
        graph = capture(model, (3, h, w))
    except CaptureError:  # the layer does not fit this input (e.g. dilated kernel larger than the map)
        return
    n = data.draw(st.integers(1, 3))
    bh, bw = data.draw(st.integers(1, h)), data.draw(st.integers(1, w))
    boxes = [(data.draw(st.integers(0, h - bh)), data.draw(st.integers(0, w - bw)), bh, bw) for _ in range(n)]
    positions = np.array([[b[0], b[1]] for b in boxes])
    base, outs = _changed(model, x, boxes)
    prop = propagate(graph, input_boxes(positions, (bh, bw), (h, w)), uniform=True)
    out_node = graph.nodes[-2]
    region = prop.regions[out_node.name]
    for i, (_, out2) in enumerate(outs):
        changed = (out2 != base).any(dim=1)[0]
        if region.kind == RegionKind.BOX:
            inside = _inside(region, i, changed.shape)
            assert not (changed & ~inside).any(), "a changed output lies outside the predicted region"
    # the engine recomputes only those regions from their read-in windows: results equal full inference
    values = torch.stack([x2[0, :, y:y + bh, xx:xx + bw] for (x2, _), (y, xx, _, _) in zip(outs, boxes)])
    got = _run_engine(graph, x, positions, (bh, bw), values)
    want = torch.cat([o for _, o in outs])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class TwoBranch(nn.Module):
    def __init__(self, k1: int, k2: int, mode: str) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, k1, padding=k1 // 2)
        self.b = nn.Sequential(nn.Conv2d(3, 4, k2, padding=k2 // 2), nn.Conv2d(4, 4, 3, padding=1))
        self.mode = mode

    def forward(self, x):
        a, b = self.a(x), self.b(x)
        return torch.cat([a, b], 1) if self.mode == "cat" else (a + b if self.mode == "add" else a * b)


@SETTINGS
@given(st.sampled_from([1, 3, 5]), st.sampled_from([1, 3, 5]), st.sampled_from(["cat", "add", "mul"]), st.data())
def test_merge_bounding_box(k1: int, k2: int, mode: str, data) -> None:
    h, w = 12, 15
    model = TwoBranch(k1, k2, mode).eval()
    graph = capture(model, (3, h, w))
    x = torch.randn(1, 3, h, w)
    bh, bw = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 6))
    boxes = [(data.draw(st.integers(0, h - bh)), data.draw(st.integers(0, w - bw)), bh, bw) for _ in range(2)]
    base, outs = _changed(model, x, boxes)
    positions = np.array([[b[0], b[1]] for b in boxes])
    prop = propagate(graph, input_boxes(positions, (bh, bw), (h, w)), uniform=True)
    merge = next(n for n in graph.nodes if n.kind.value == "merge")
    region = prop.regions[merge.name]
    for i, (_, out2) in enumerate(outs):
        changed = (out2 != base).any(dim=1)[0]
        if region.kind == RegionKind.BOX:
            assert not (changed & ~_inside(region, i, changed.shape)).any()
    values = torch.stack([x2[0, :, y:y + bh, xx:xx + bw] for (x2, _), (y, xx, _, _) in zip(outs, boxes)])
    got = _run_engine(graph, x, positions, (bh, bw), values)
    torch.testing.assert_close(got, torch.cat([o for _, o in outs]), rtol=1e-5, atol=1e-5)


def test_krypton_equations_centre_and_edges() -> None:
    # 3x3 conv, stride 1, pad 1 on a 10-wide map: a 2-wide box at 4 grows to 4 wide starting at 3
    start, size, *_ = local_axis(np.array([4]), np.array([2]), 3, 1, 1, 10)
    assert (start[0], size[0]) == (3, 4)
    # boxes at the edges reach fewer outputs (3: padding reads nothing new) ...
    start, size, *_ = local_axis(np.array([0, 8]), np.array([2, 2]), 3, 1, 1, 10)
    assert list(size) == [3, 3] and list(start) == [0, 7]
    # ... and with a centre box in the batch they take its size, shifted inwards at the far edge
    start, size, *_ = local_axis(np.array([4, 8]), np.array([2, 2]), 3, 1, 1, 10)
    assert list(size) == [4, 4] and list(start) == [3, 6]
    start, size, *_ = local_axis(np.array([0, 8]), np.array([2, 2]), 3, 1, 1, 10, uniform=False)
    assert list(size) == [3, 3] and list(start) == [0, 7]
    # one box as plain ints (a camera frame's change) goes through the same equations
    assert local_axis(8, 2, 3, 1, 1, 10)[:2] == (7, 3)
    # stride 2: ceil((2 + 3 - 1) / 2) = 2 outputs
    start, size, *_ = local_axis(np.array([4]), np.array([2]), 3, 2, 1, 5)
    assert (start[0], size[0]) == (2, 2)


def test_tau_caps_region_centre_cropped() -> None:
    start, size, crop, in_start, in_size = local_axis(np.array([10]), np.array([8]), 3, 1, 1, 30, tau=0.2)
    assert size[0] == round(0.2 * 30)
    assert in_size[0] == size[0] * 1 - 3 + 1 and crop == (8 - in_size[0]) // 2
    assert in_start[0] == 10 + crop


@pytest.mark.parametrize("tau", [0.0, 1.5, -1])
def test_tau_out_of_range(tau) -> None:
    graph = capture(nn.Conv2d(3, 3, 3), (3, 8, 8))
    with pytest.raises(ValueError, match="tau"):
        propagate(graph, input_boxes(np.array([[0, 0]]), (2, 2), (8, 8)), tau=tau)
