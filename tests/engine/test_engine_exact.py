"""Exactness: incremental occlusion equals naive re-inference on every zoo architecture."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_planned_batches, naive_occlusion, zoo_model

from incrinf.analysis import occlusion_grid
from incrinf.explain.runner import OcclusionRunner

ZOO = ["vgg16", "resnet18", "resnet50", "inception_v3", "googlenet", "densenet121", "mobilenet_v2",
       "mobilenet_v3_small", "squeezenet1_1", "shufflenet_v2_x1_0", "efficientnet_b0", "regnet_x_400mf",
       "efficientnet_lite0"]


def _check(model, image, positions, window, batch_size, baseline=0.0) -> None:
    runner = OcclusionRunner(model, image)
    got, stats = runner.run(positions, window, baseline, batch_size=batch_size)
    want = naive_occlusion(model, image, positions, window, baseline)
    scale = want.abs().max()
    assert ((got - want).abs().max() / scale).item() < 1e-4
    # the occlusions really change the output (the comparison is not vacuous)
    base = runner.base_output
    assert ((want - base).abs().amax(dim=1) > 1e-6 * scale).any()
    # packed in runs of half to the full batch size (the plan picks the cheapest; a partial run at either end)
    assert -(-len(positions) // batch_size) <= stats.batches <= len(positions) // max(1, batch_size // 2) + 2
    assert_planned_batches(runner, positions, window, batch_size, stats)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_corners_edges_centre(name: str) -> None:
    h, w = (96, 104) if name == "inception_v3" else (64, 72)  # non-square
    image = torch.randn(1, 3, h, w)
    p = 11
    positions = np.array([[0, 0], [0, w - p], [h - p, 0], [h - p, w - p], [(h - p) // 2, (w - p) // 2],
                          [0, 30], [h - p, 17], [23, 0], [31, w - p]])
    _check(zoo_model(name), image, positions, (p, p), batch_size=4)  # 9 positions: several batches, one partial


@pytest.mark.parametrize("patch,stride", [(1, 13), (3, 7), (16, 9), (33, 15), (64, 5)])
def test_patch_sizes_and_odd_strides(patch: int, stride: int) -> None:
    image = torch.randn(1, 3, 64, 80)
    positions = occlusion_grid((64, 80), (patch, patch), (stride, stride))
    if len(positions) > 24:
        positions = positions[np.linspace(0, len(positions) - 1, 24).astype(int)]
    _check(zoo_model("resnet18"), image, positions, (patch, patch), batch_size=7)


def test_windows_cropped_at_the_edge_and_tensor_baseline() -> None:
    image = torch.randn(1, 3, 64, 64)
    # Captum-style grid whose last window reaches past the edge
    positions = occlusion_grid((64, 64), (10, 10), (8, 8))
    assert positions.max() + 10 > 64
    model = zoo_model("mobilenet_v2")
    baseline = torch.randn(1, 3, 64, 64)
    runner = OcclusionRunner(model, image)
    got, _ = runner.run(positions, (10, 10), baseline, batch_size=16)
    occluded = image.repeat(len(positions), 1, 1, 1)
    for i, (y, x) in enumerate(positions):
        occluded[i, :, y:y + 10, x:x + 10] = baseline[0, :, y:y + 10, x:x + 10]
    with torch.no_grad():
        want = model(occluded)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
