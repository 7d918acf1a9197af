"""Capture: node kinds, where reuse stops, unknown ops, untraceable models."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import zoo_model

from incrinf import CaptureError, NodeKind, capture


class SEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Conv2d(8, 8, 1)
        self.after = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        s = torch.sigmoid(self.fc(F.adaptive_avg_pool2d(y, 1)))
        return self.after(y * s)


class Shuffle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        b, c, h, w = y.size()
        y = y.view(b, 2, c // 2, h, w).transpose(1, 2).contiguous().view(b, c, h, w)
        return F.relu(y)


class Untraceable(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return x
        return -x


class Unknown(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.up = nn.Upsample(scale_factor=2)

    def forward(self, x):
        return self.up(self.conv(x))


def kinds(graph):
    return {n.name: n.kind for n in graph.nodes}


def test_kinds_of_a_small_cnn() -> None:
    model = nn.Sequential(nn.ZeroPad2d((1, 2, 0, 1)), nn.Conv2d(3, 4, 3, stride=2), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.MaxPool2d(2, ceil_mode=True), nn.Flatten(), nn.LazyLinear(5))
    model(torch.zeros(1, 3, 32, 32))
    graph = capture(model, (3, 32, 32))
    assert [n.kind for n in graph.nodes] == [
        NodeKind.INPUT, NodeKind.PAD, NodeKind.LOCAL, NodeKind.POINTWISE, NodeKind.POINTWISE, NodeKind.LOCAL,
        NodeKind.GLOBAL, NodeKind.GLOBAL, NodeKind.OUTPUT]
    pad = graph.nodes[1]
    assert pad.shift == (0, 1)
    conv = graph.nodes[2].geometry
    assert conv.kernel == (3, 3) and conv.stride == (2, 2) and conv.pad_before == (0, 0)
    pool = graph.nodes[5].geometry
    assert pool.pad_value == float("-inf")
    # ceil_mode on an odd map reaches one element past the end
    assert graph.nodes[5].shape[-2:] == (8, 9) and graph.nodes[4].shape[-2:] == (16, 17)
    assert pool.pad_after == (0, 1)


def test_squeeze_excitation_stops_reuse_and_says_why() -> None:
    from incrinf import analyze

    graph = capture(SEBlock(), (3, 32, 32))
    mul = next(n for n in graph.nodes if n.name == "mul")
    assert mul.kind == NodeKind.GLOBAL
    assert "depends on the whole input" in mul.reason
    report = analyze(graph, (3, 32, 32), 4)
    assert report.reuse_stops_at.startswith("mul")
    after = next(r for r in report.rows if r.name == "after")
    assert after.region == "whole"


def test_channel_shuffle_is_pointwise() -> None:
    graph = capture(Shuffle(), (3, 16, 16))
    for name in ("view", "transpose", "contiguous", "view_1", "relu"):
        assert graph.by_name[name].kind == NodeKind.POINTWISE, name


def test_unknown_op_is_global_and_reported() -> None:
    from incrinf import analyze

    graph = capture(Unknown(), (3, 16, 16))
    assert graph.by_name["up"].kind == NodeKind.GLOBAL
    report = analyze(Unknown(), (3, 16, 16), 4)
    assert any("Upsample" in u for u in report.unknown_ops)


def test_untraceable_model_raises_capture_error_naming_the_construct() -> None:
    with pytest.raises(CaptureError) as info:
        capture(Untraceable(), (3, 8, 8))
    message = str(info.value)
    assert "Untraceable" in message and "forward" in message


def test_non_module_is_rejected() -> None:
    with pytest.raises(CaptureError):
        capture(lambda x: x, (3, 8, 8))  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(3, 0, 8), (1, 2, 3, 8, 8), "axbxc", (3,), None])
def test_malformed_input_shape(shape) -> None:
    with pytest.raises(ValueError, match="input_shape"):
        capture(nn.Conv2d(3, 3, 3), shape)


@pytest.mark.parametrize("shape", [(1, 3, 8, 8), "3x8", (3, 8)])
def test_input_shape_of_another_rank_names_the_axes(shape) -> None:
    # (1, 3, 8, 8) is a 3-D volume with one channel: the batch axis is never part of input_shape
    with pytest.raises(CaptureError, match="spatial axes"):
        capture(nn.Conv2d(3, 3, 3), shape)


def test_signature_depends_on_structure_not_weights() -> None:
    a = capture(nn.Sequential(nn.Conv2d(3, 4, 3)), (3, 16, 16))
    b = capture(nn.Sequential(nn.Conv2d(3, 4, 3)), (3, 16, 16))
    c = capture(nn.Sequential(nn.Conv2d(3, 4, 3)), (3, 18, 16))
    assert a.signature == b.signature != c.signature


ZOO = ["vgg16", "resnet18", "resnet50", "inception_v3", "googlenet", "densenet121", "mobilenet_v2",
       "mobilenet_v3_small", "squeezenet1_1", "shufflenet_v2_x1_0", "efficientnet_b0", "regnet_x_400mf",
       "efficientnet_lite0"]


@pytest.mark.parametrize("name", ZOO)
def test_capture_zoo(name: str) -> None:
    size = 96 if name == "inception_v3" else 64
    graph = capture(zoo_model(name), (3, size, size))
    local = [n for n in graph.nodes if n.kind == NodeKind.LOCAL]
    assert len(local) >= 5
    assert not graph.unknown_ops(), [n.reason for n in graph.unknown_ops()]
