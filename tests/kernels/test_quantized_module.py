"""The int8 depthwise module is a local node of the engine: incremental occlusion equals re-inference."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
from conftest import naive_occlusion

from incrinf import NodeKind, capture
from incrinf.explain.runner import OcclusionRunner
from incrinf.kernels.quantized_module import QuantizedDepthwiseConv2d


def _model() -> nn.Module:
    dw = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8)
    q = QuantizedDepthwiseConv2d.from_float(dw, 0.05, 3, 0.04, -2, activation="relu6")
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), q, nn.Conv2d(8, 4, 1), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten()).eval()


def test_quantized_depthwise_is_a_local_node_and_incremental_is_exact() -> None:
    model = _model()
    graph = capture(model, (3, 32, 32))
    node = next(n for n in graph.nodes if "Quantized" in n.op)
    assert node.kind == NodeKind.LOCAL and node.geometry.stride == (2, 2)
    image = torch.randn(1, 3, 32, 32)
    positions = np.array([[0, 0], [10, 13], [26, 26], [5, 20]])
    got, _ = OcclusionRunner(model, image).run(positions, (6, 6), batch_size=3)
    want = naive_occlusion(model, image, positions, (6, 6))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (want - want[:1]).abs().max() > 0
