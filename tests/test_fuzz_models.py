"""Fuzzing capture, analysis and occlusion with small random models, operators incrinf does not know included:
each model is captured (or refused with a clear CaptureError), unknown operators are named in the analysis, and
the exact occlusion heat map equals naive re-inference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import naive_occlusion
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import incrinf
from incrinf.analysis import occlusion_grid

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Op(nn.Module):
    """A named function of the tensor (traced through, so its torch calls become graph nodes)."""

    def __init__(self, name: str, fn) -> None:
        super().__init__()
        self.name, self.fn = name, fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)

    def extra_repr(self) -> str:
        return self.name


class Residual(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class DataDependent(nn.Module):
    """Control flow on a tensor's value: torch.fx cannot trace it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x
        return -x


# Operators incrinf has no rule for: each must become a global node (correct, no reuse), whatever it does to
# positions (moves them, mixes them along an axis, reads the whole map).
UNKNOWN = {
    "flip": lambda x: torch.flip(x, dims=[-1]),
    "roll": lambda x: torch.roll(x, shifts=1, dims=-2),
    "cumsum": lambda x: torch.cumsum(x, dim=-1) / x.shape[-1],
    "sort": lambda x: torch.sort(x, dim=-1).values,
    "reflect_pad": lambda x: F.pad(x, (1, 1, 1, 1), mode="reflect"),
    "se_scale": lambda x: x * torch.sigmoid(x.mean(dim=(2, 3), keepdim=True)),
    "upsample": lambda x: F.interpolate(x, scale_factor=2, mode="nearest"),
}
# the tensor node each of them shows up as (fx names nodes after the function called; sort's values are a getattr)
NODE_NAME = {"flip": "flip", "roll": "roll", "cumsum": "cumsum", "sort": "getattr", "reflect_pad": "pad",
             "se_scale": "mean", "upsample": "interpolate"}
POINTWISE = {"relu": nn.ReLU, "relu6": nn.ReLU6, "sigmoid": nn.Sigmoid, "hardswish": nn.Hardswish,
             "gelu": nn.GELU, "tanh": nn.Tanh, "dropout": lambda: nn.Dropout(0.5)}


@st.composite
def models(draw) -> tuple[nn.Module, int, int, list[str], bool]:
    """``(model, input side, channels in, unknown operators used, traceable)``."""
    side = draw(st.integers(12, 24))
    size, channels = side, 3
    layers: list[nn.Module] = []
    unknown: list[str] = []
    traceable = True
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["conv", "conv", "pool", "pointwise", "bn", "residual", "concat", "unknown",
                                     "untraceable"]))
        if kind == "conv":
            k = draw(st.sampled_from([1, 3, 5]))
            stride, dilation = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
            padding = draw(st.sampled_from([0, dilation * (k // 2)]))
            out = draw(st.sampled_from([channels, 4, 8]))
            groups = channels if out == channels and draw(st.booleans()) else 1
            reach = dilation * (k - 1) + 1
            if size + 2 * padding < reach:
                continue
            layers.append(nn.Conv2d(channels, out, k, stride=stride, padding=padding, dilation=dilation, groups=groups))
            size, channels = (size + 2 * padding - reach) // stride + 1, out
        elif kind == "pool" and size >= 4:
            k, stride = draw(st.sampled_from([2, 3])), draw(st.sampled_from([1, 2]))
            pool = nn.MaxPool2d(k, stride, padding=k // 2 if k == 3 else 0) if draw(st.booleans()) else \
                nn.AvgPool2d(k, stride, padding=k // 2 if k == 3 else 0, count_include_pad=draw(st.booleans()))
            layers.append(pool)
            pad = k // 2 if k == 3 else 0
            size = (size + 2 * pad - k) // stride + 1
        elif kind == "pointwise":
            layers.append(POINTWISE[draw(st.sampled_from(sorted(POINTWISE)))]())
        elif kind == "bn":
            bn = nn.BatchNorm2d(channels)
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            layers.append(bn)
        elif kind == "residual":
            layers.append(Residual(nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU())))
        elif kind == "concat" and channels <= 8:
            layers.append(Op("concat", lambda x: torch.cat([x, torch.relu(x)], dim=1)))
            channels *= 2
        elif kind == "unknown" and size <= 24:
            name = draw(st.sampled_from(sorted(UNKNOWN)))
            if name == "reflect_pad" and size < 2:
                continue
            layers.append(Op(name, UNKNOWN[name]))
            unknown.append(name)
            size = size * 2 if name == "upsample" else size + 2 if name == "reflect_pad" else size
        elif kind == "untraceable":
            layers.append(DataDependent())
            traceable = False
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 5)]
    torch.manual_seed(draw(st.integers(0, 1000)))
    model = nn.Sequential(*layers).eval()
    for p in model.parameters():  # re-initialised from the seed above
        nn.init.normal_(p, std=0.5)
    return model, side, 3, unknown, traceable


@FUZZ
@given(case=models(), patch=st.integers(2, 6), stride=st.integers(2, 6))
def test_random_models_capture_analyze_and_occlude_exactly(case, patch, stride):
    model, side, channels, unknown, traceable = case
    shape = (channels, side, side)
    if not traceable:
        with pytest.raises(incrinf.CaptureError, match="torch.fx cannot trace") as info:
            incrinf.capture(model, shape)
        assert "DataDependent" in str(info.value) or "forward" in str(info.value)  # names the construct
        with pytest.raises(incrinf.CaptureError):
            incrinf.occlusion(model, torch.randn(shape), patch=patch, stride=stride, progress=False)
        return
    graph = incrinf.capture(model, shape)
    assert graph.input_shape == (1, *shape)
    report = incrinf.analyze(model, shape, patch=patch)
    assert report.flops_full > 0 and report.theoretical_speedup >= 1.0 - 1e-9
    for name in unknown:  # each such operator is a global node, with the reason in the report
        rows = [r for r in report.rows if NODE_NAME[name] in r.name and r.kind == "global"]
        assert rows and all(r.note for r in rows), (name, report.table())
    image = torch.randn(shape)
    with np.errstate(all="ignore"):
        result = incrinf.occlusion(model, image, patch=patch, stride=stride, progress=False, batch_size=4,
                                   output="logit")
    positions = occlusion_grid((side, side), (patch, patch), (stride, stride))
    naive = naive_occlusion(model, image[None], positions, (patch, patch))
    with torch.no_grad():
        base = model(image[None])[0, result.target]
    expected = (base - naive[:, result.target]).numpy().reshape(result.heatmap.shape)
    scale = max(float(np.abs(expected).max()), float(base.abs()), 1e-3)
    np.testing.assert_allclose(result.heatmap, expected, rtol=0, atol=2e-4 * scale)
