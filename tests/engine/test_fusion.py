"""The frame engine's generated modules without the work inference does not need (incrinf.engine.fusion): batch
norms after convolutions folded into them, symmetric zero paddings done by the convolutions; the full frame, the
cached tensors and the cached frames still equal the model's."""

import collections

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import zoo_model
from torch.utils._python_dispatch import TorchDispatchMode

from incrinf.engine import FrameEngine
from incrinf.graph import capture

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Ops(TorchDispatchMode):
    """Counts the operators dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _padded_net() -> nn.Module:
    """Convolutions behind padding modules (symmetric, and asymmetric as a 'same' stride-2 padding is), each
    followed by a batch norm with moved statistics, a batch norm after an add (nothing to fold it into)."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.ZeroPad2d(1), nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU6(),
        nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(8, 16, 3, stride=2), nn.BatchNorm2d(16), nn.ReLU(),
        nn.ZeroPad2d(2), nn.Conv2d(16, 16, 5, groups=16), nn.BatchNorm2d(16),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
    return net.eval()


def test_generated_full_frame_runs_no_batch_norm_or_symmetric_pad():
    model = _padded_net()
    x = torch.randn(1, 3, 40, 48)
    engine = FrameEngine(capture(model, x.shape[1:]))
    with torch.no_grad():
        ref = model(x)
        with _Ops() as plain:
            model(x)
        with _Ops() as fused:
            out = engine.full(x)
    assert plain.counts["native_batch_norm"] == 3 and plain.counts["constant_pad_nd"] == 3
    assert fused.counts["native_batch_norm"] == 0  # every batch norm here follows a convolution
    assert fused.counts["constant_pad_nd"] == 1  # the stride-2 'same' padding is one-sided: it stays
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


class _FunctionalPads(nn.Module):
    """Paddings written as ``F.pad`` calls: symmetric zeros (the convolution takes it over), reflection and a
    nonzero constant (both stay)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b, self.c = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3), nn.Conv2d(8, 8, 3)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.a(F.pad(x, (1, 1, 1, 1))))
        x = torch.relu(self.b(F.pad(x, (1, 1, 1, 1), mode="reflect")))
        x = self.c(F.pad(x, (1, 1, 1, 1), value=0.5))
        return self.head(x.mean(dim=(2, 3)))


def test_functional_zero_pad_is_done_by_the_convolution():
    model = _FunctionalPads().eval()
    x = torch.randn(1, 3, 24, 32)
    engine = FrameEngine(capture(model, x.shape[1:]))
    with torch.no_grad():
        ref = model(x)
        with _Ops() as fused:
            out = engine.full(x)
        x1 = x.clone()
        x1[..., 5:9, 20:26] += 1.0
        cached = engine.cached(x1, (x1 != x).any(dim=1)[0].numpy())
        ref1 = model(x1)
    assert fused.counts["constant_pad_nd"] == 1 and fused.counts["reflection_pad2d"] == 1
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cached, ref1, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["efficientnet_lite0", "resnet18", "mobilenet_v2"])
def test_fused_engine_full_and_cached_frames_equal_the_model(name):
    model = zoo_model(name)
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(1, 3, 64, 72, generator=g)
    x1 = x0.clone()
    x1[:, :, 10:19, 30:41] = torch.randn(1, 3, 9, 11, generator=g)
    engine = FrameEngine(capture(model, x0.shape[1:]))
    with torch.no_grad():
        for x in (x0, x1):
            ref = model(x)
            scale = ref.abs().max().item()
            out = engine.full(x) if x is x0 else engine.cached(x, (x1 != x0).any(dim=1)[0].numpy())
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * scale)
        with _Ops() as ops:
            engine.full(x1)
    assert ops.counts["native_batch_norm"] == 0
