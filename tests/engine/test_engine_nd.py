"""1-D signals and 3-D volumes through the one engine: predicted regions contain every change, read-in windows
suffice (hypothesis over shapes, as for 2-D), and whole CNNs equal naive re-inference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_planned_batches
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from incrinf import CaptureError
from incrinf.analysis import analyze, occlusion_grid
from incrinf.engine import BatchEngine
from incrinf.explain.runner import OcclusionRunner
from incrinf.geometry import RegionKind, input_boxes, propagate
from incrinf.graph import capture

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CONV = {1: nn.Conv1d, 3: nn.Conv3d}
MAX_POOL = {1: nn.MaxPool1d, 3: nn.MaxPool3d}
AVG_POOL = {1: nn.AvgPool1d, 3: nn.AvgPool3d}
BATCH_NORM = {1: nn.BatchNorm1d, 3: nn.BatchNorm3d}
ADAPTIVE = {1: nn.AdaptiveAvgPool1d, 3: nn.AdaptiveAvgPool3d}


@st.composite
def local_layers(draw, d: int):
    kind = draw(st.sampled_from(["conv", "maxpool", "avgpool", "avgpool_excl"]))
    kernel = tuple(draw(st.integers(1, 4)) for _ in range(d))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(d))
    if kind == "conv":
        dilation = tuple(draw(st.integers(1, 2)) for _ in range(d))
        padding = tuple(draw(st.integers(0, 2)) for _ in range(d))
        layer = CONV[d](2, 4, kernel, stride, padding, dilation, groups=draw(st.sampled_from([1, 2])))
    else:
        padding = tuple(draw(st.integers(0, k // 2)) for k in kernel)
        ceil = draw(st.booleans())
        if kind == "maxpool":
            layer = MAX_POOL[d](kernel, stride, padding, ceil_mode=ceil)
        else:
            layer = AVG_POOL[d](kernel, stride, padding, ceil_mode=ceil, count_include_pad=kind == "avgpool")
    # an explicit, possibly asymmetric constant padding in front (F.pad with 2 or 6 values)
    explicit = tuple(draw(st.integers(0, 2)) for _ in range(2 * d)) if draw(st.booleans()) else None
    top = 24 if d == 1 else 9
    dims = tuple(draw(st.integers(max(k, 5), top)) for k in kernel)
    return layer, explicit, dims


class _Padded(nn.Module):
    def __init__(self, layer: nn.Module, explicit: tuple[int, ...] | None) -> None:
        super().__init__()
        self.layer, self.explicit = layer, explicit

    def forward(self, x):
        if self.explicit is not None:
            x = F.pad(x, self.explicit, value=0.5)
        return torch.relu(self.layer(x))


def _boxes_and_values(data, x: torch.Tensor, count: int):
    dims = tuple(x.shape[2:])
    size = tuple(data.draw(st.integers(1, n)) for n in dims)
    corners = np.array([[data.draw(st.integers(0, n - s)) for n, s in zip(dims, size)] for _ in range(count)])
    changed = []
    for corner in corners:
        x2 = x.clone()
        x2[(..., *(slice(c, c + s) for c, s in zip(corner, size)))] = torch.randn(1, x.shape[1], *size)
        changed.append(x2)
    return corners, size, changed


def _inside(region, i: int, shape: tuple[int, ...]) -> torch.Tensor:
    inside = torch.zeros(shape, dtype=torch.bool)
    start, size = region.boxes.start()[i], region.boxes.sizes()[i]
    inside[tuple(slice(int(s), int(s) + int(z)) for s, z in zip(start, size))] = True
    return inside


@SETTINGS
@given(st.sampled_from([1, 3]), st.data())
def test_region_contains_changes_and_read_in_suffices(d: int, data) -> None:
    layer, explicit, dims = data.draw(local_layers(d))
    model = _Padded(layer, explicit).eval()
    x = torch.randn(1, 2, *dims)
    try:
        graph = capture(model, (2, *dims))
    except CaptureError:  # the layer does not fit this input (a dilated kernel larger than the map)
        return
    corners, size, changed = _boxes_and_values(data, x, data.draw(st.integers(1, 3)))
    with torch.no_grad():
        base = model(x)
        want = torch.cat([model(x2) for x2 in changed])
    region = propagate(graph, input_boxes(corners, size, dims), uniform=True).regions[graph.nodes[-2].name]
    if region.kind == RegionKind.BOX:
        for i in range(len(corners)):
            moved = (want[i:i + 1] != base).any(dim=1)[0]
            assert not (moved & ~_inside(region, i, tuple(moved.shape))).any(), "a change outside the region"
    # the engine recomputes only those regions from their read-in windows: results equal full inference
    boxes = input_boxes(corners, size, dims)
    boxes.values = torch.stack([x2[0][(slice(None), *(slice(c, c + s) for c, s in zip(corner, size)))]
                                for x2, corner in zip(changed, boxes.start())])
    got = BatchEngine(graph, x).run(boxes).output
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class SmallCNN(nn.Module):
    """Padding, stride, dilation, batch norm, max and average pools (ceil mode, excluded padding), an
    asymmetric F.pad, a residual add and a channel concatenation, in 1 or 3 spatial dims."""

    def __init__(self, d: int, classes: int = 5) -> None:
        super().__init__()
        self.d = d
        self.stem = CONV[d](2, 6, 3, padding=1)
        self.bn = BATCH_NORM[d](6)
        self.down = CONV[d](6, 6, 3, stride=2, padding=2, dilation=2)
        self.pool = MAX_POOL[d](3, 2, 1, ceil_mode=True)
        self.branch = CONV[d](6, 6, 1)
        self.side = CONV[d](6, 4, 3)
        self.avg = AVG_POOL[d](3, 2, 1, ceil_mode=True, count_include_pad=False)
        self.gap = ADAPTIVE[d](1)
        self.head = nn.Linear(10, classes)

    def forward(self, x):
        x = torch.relu(self.bn(self.stem(x)))
        x = self.pool(self.down(x))
        x = x + self.branch(x)
        side = self.side(F.pad(x, (0, 2) * self.d))  # 'same' size, asymmetric padding
        x = torch.cat([x, side], 1)
        return self.head(self.gap(self.avg(x)).flatten(1))


def _calibrated(d: int) -> nn.Module:
    model = SmallCNN(d).eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    return model


def _naive(model: nn.Module, x: torch.Tensor, corners: np.ndarray, window: tuple[int, ...]) -> torch.Tensor:
    outs = []
    with torch.no_grad():
        for corner in corners:
            x2 = x.clone()
            x2[(..., *(slice(int(c), int(c) + w) for c, w in zip(corner, window)))] = 0.0
            outs.append(model(x2))
    return torch.cat(outs)


@pytest.mark.parametrize("d,dims,window,stride", [(1, (61,), (7,), (5,)), (3, (11, 13, 12), (4, 5, 3), (3, 4, 4))])
def test_small_cnn_equals_naive_re_inference(d, dims, window, stride) -> None:
    model = _calibrated(d)
    x = torch.randn(1, 2, *dims)
    corners = occlusion_grid(dims, window, stride)  # windows cropped at the far edge included
    runner = OcclusionRunner(model, x)
    got, stats = runner.run(corners, window, batch_size=6)
    want = _naive(model, x, corners, window)
    scale = want.abs().max()
    assert ((got - want).abs().max() / scale).item() < 1e-4
    assert ((want - model(x)).abs().amax(dim=1) > 1e-6 * scale).any()  # the occlusions move the output
    assert stats.theoretical_speedup > 1.0 and -(-len(corners) // 6) <= stats.batches <= len(corners) // 3 + 2
    assert_planned_batches(runner, corners, window, 6, stats)


def test_monai_densenet_3d_equals_naive_re_inference() -> None:
    nets = pytest.importorskip("monai.networks.nets")
    torch.manual_seed(0)
    # MONAI's DenseNet (dense blocks of BN-ReLU-conv concatenations, average-pool transitions), a narrow one so the
    # naive reference stays cheap; the zoo's DenseNet121 runs in the CLI test and benchmarks/obe_3d.py
    model = nets.DenseNet(spatial_dims=3, in_channels=1, out_channels=3, init_features=8, growth_rate=8,
                          block_config=(3, 4, 3)).eval()
    x = torch.randn(1, 1, 20, 24, 24)
    corners = np.array([[0, 0, 0], [14, 18, 18], [7, 4, 12], [0, 18, 5]])
    got, stats = OcclusionRunner(model, x).run(corners, (6, 6, 6), batch_size=3)
    want = _naive(model, x, corners, (6, 6, 6))
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    assert (want - model(x)).abs().max() > 0
    assert stats.theoretical_speedup > 1.0


@pytest.mark.parametrize("d", [1, 3])
def test_analyze_counts_flops_in_any_dimension(d) -> None:
    model = _calibrated(d)
    dims = (64,) if d == 1 else (12, 12, 12)
    report = analyze(model, (2, *dims), 4, stride=4, position="all")
    assert report.theoretical_speedup > 1.0 and report.positions == (16 if d == 1 else 27)
    assert "gap" in report.reuse_stops_at or "adaptive" in report.reuse_stops_at


def test_unknown_op_in_3d_stays_global_and_named() -> None:
    model = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.InstanceNorm3d(2), nn.Conv3d(2, 2, 3, padding=1),
                          nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(2, 2)).eval()
    report = analyze(model, (1, 8, 8, 8), 2)
    assert any("InstanceNorm3d" in op for op in report.unknown_ops)
    x = torch.randn(1, 1, 8, 8, 8)
    corners = np.array([[0, 0, 0], [5, 3, 6]])
    got, _ = OcclusionRunner(model, x).run(corners, (2, 2, 2), batch_size=2)
    torch.testing.assert_close(got, _naive(model, x, corners, (2, 2, 2)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("d,dims", [(1, (61,)), (3, (11, 13, 12))])
def test_tau_and_pruning_run_in_any_dimension(d, dims) -> None:
    model = _calibrated(d)
    x = torch.randn(1, 2, *dims)
    window = (3,) * d
    corners = occlusion_grid(dims, window, (4,) * d)
    exact, exact_stats = OcclusionRunner(model, x).run(corners, window, batch_size=8)
    capped, capped_stats = OcclusionRunner(model, x, tau=0.4).run(corners, window, batch_size=8)
    # the cap saves work where a region outgrows it (the 3-D maps here; a 3-wide change in a 61-long signal never does)
    assert capped_stats.theoretical_speedup >= exact_stats.theoretical_speedup * (1.05 if d == 3 else 1.0)
    assert capped.shape == exact.shape and torch.isfinite(capped).all()
    pruned, _ = OcclusionRunner(model, x, feature_threshold=1e-9).run(corners, window, batch_size=8)
    torch.testing.assert_close(pruned, exact, rtol=1e-4, atol=1e-5)  # ... a tiny threshold keeps every change
