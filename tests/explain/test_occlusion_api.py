"""incrinf.occlusion: results, heat-map images, bad input."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import assert_planned_batches, naive_occlusion, zoo_model

import incrinf
from incrinf.analysis import occlusion_grid
from incrinf.explain.runner import OcclusionRunner


def test_heatmap_equals_naive_drop_in_target_score() -> None:
    model = zoo_model("resnet18")
    image = torch.randn(3, 64, 64)
    result = incrinf.occlusion(model, image, patch=12, stride=10, progress=False, batch_size=5)
    positions = occlusion_grid((64, 64), (12, 12), (10, 10))
    assert result.heatmap.shape == (7, 7) and np.array_equal(result.positions, positions)
    with torch.no_grad():
        base = model(image[None])[0]
    assert result.target == int(base.argmax())
    want = (base[result.target] - naive_occlusion(model, image[None], positions, (12, 12))[:, result.target])
    np.testing.assert_allclose(result.heatmap.ravel(), want.numpy(), rtol=1e-4, atol=1e-4 * float(base.abs().max()))
    s = result.stats
    assert s["positions"] == 49 and 10 <= s["batches"] <= 49 // 2 + 2 and s["seconds"] > 0
    assert_planned_batches(OcclusionRunner(model, image[None]), positions, (12, 12), 5, s)
    assert s["theoretical_speedup"] >= 1 and s["realized_flop_ratio"] >= 1 and s["peak_memory_bytes"] > 0


def test_probabilities_and_explicit_target() -> None:
    model = zoo_model("mobilenet_v2")
    result = incrinf.occlusion(model, torch.randn(1, 3, 64, 64), target=7, patch=16, stride=16, output="prob",
                               progress=False)
    assert result.target == 7 and np.abs(result.heatmap).max() <= 1.0


def test_save_writes_png(tmp_path) -> None:
    result = incrinf.occlusion(zoo_model("resnet18"), torch.rand(3, 64, 64), patch=16, stride=16, progress=False)
    path = result.save(tmp_path / "heat.png", image=torch.rand(3, 64, 64))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.pixel_map().shape == (64, 64)


def test_model_without_spatial_layers_warns_and_works() -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 4)).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = incrinf.occlusion(model, torch.randn(3, 16, 16), patch=4, stride=4, progress=False)
    assert any("no spatial" in str(w.message) for w in caught)
    assert result.heatmap.shape == (4, 4)


@pytest.mark.parametrize("image,kwargs,error,match", [
    (torch.randn(64, 64), {}, ValueError, "shape"),
    (torch.randn(2, 3, 64, 64), {}, ValueError, "shape"),
    (torch.randn(1, 4, 64, 64), {}, Exception, ""),
    (np.zeros((3, 64, 64), np.float32), {}, TypeError, "torch.Tensor"),
    (torch.full((3, 64, 64), float("nan")), {}, ValueError, "NaN"),
    (torch.randn(3, 64, 64), {"patch": 65}, ValueError, "larger than"),
    (torch.randn(3, 64, 64), {"stride": 0}, ValueError, "stride"),
    (torch.randn(3, 64, 64), {"target": 1000}, ValueError, "out of range"),
    (torch.randn(3, 64, 64), {"output": "softmax"}, ValueError, "output"),
    (torch.randn(3, 64, 64), {"batch_size": 0}, ValueError, "batch_size"),
    (torch.randn(3, 64, 64), {"max_memory": "lots"}, ValueError, "max_memory"),
])
def test_bad_input(image, kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        incrinf.occlusion(zoo_model("resnet18"), image, progress=False, **kwargs)
