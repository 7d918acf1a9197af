"""A real torchvision segmentation network explained for a region of interest: the reducer target (class k's
logits summed inside an ROI mask of the output map) equals naive re-inference, and Captum with the same reducer
wrapped around the model agrees."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torchvision

from incrinf.analysis import analyze, occlusion_grid
from incrinf.explain.occlusion import occlusion

SIZE, PATCH, STRIDE, CLASS = 48, 12, 12, 2


@pytest.fixture(scope="module")
def segmenter() -> torch.nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torchvision.models.segmentation.lraspp_mobilenet_v3_large(weights=None, weights_backbone=None,
                                                                            num_classes=4)
    return model.eval()


def _roi() -> torch.Tensor:
    roi = torch.zeros(SIZE, SIZE)
    roi[14:30, 20:40] = 1.0
    return roi


def roi_logits(out: dict) -> torch.Tensor:
    """Class CLASS's logits summed inside the region of interest: one value per example."""
    return (out["out"][:, CLASS] * _roi()).sum((1, 2))


def test_roi_reducer_equals_naive_re_inference(segmenter) -> None:
    x = torch.randn(1, 3, SIZE, SIZE)
    result = occlusion(segmenter, x, target=roi_logits, patch=PATCH, stride=STRIDE, progress=False, batch_size=8)
    corners = occlusion_grid((SIZE, SIZE), (PATCH, PATCH), (STRIDE, STRIDE))
    with torch.no_grad():
        base = roi_logits(segmenter(x))
        want = []
        for y, x0 in corners:
            x2 = x.clone()
            x2[..., y:y + PATCH, x0:x0 + PATCH] = 0
            want.append(float(base - roi_logits(segmenter(x2))))
    want = np.array(want)
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(result.heatmap.ravel(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert result.heatmap.shape == (4, 4) and result.stats["theoretical_speedup"] >= 1.0


def test_captum_with_a_wrapped_model_agrees(segmenter) -> None:
    captum_attr = pytest.importorskip("captum.attr")
    x = torch.randn(1, 3, SIZE, SIZE)
    ours = occlusion(segmenter, x, target=roi_logits, patch=PATCH, stride=PATCH, progress=False)
    wrapped = captum_attr.Occlusion(lambda t: roi_logits(segmenter(t)))
    theirs = wrapped.attribute(x, (3, PATCH, PATCH), strides=(3, PATCH, PATCH), perturbations_per_eval=8)
    scale = float(theirs.abs().max())
    np.testing.assert_allclose(ours.pixel_map(), theirs[0, 0].numpy(), rtol=1e-4, atol=1e-4 * scale)


def test_reuse_stops_at_a_named_global_operator(segmenter) -> None:
    report = analyze(segmenter, (3, SIZE, SIZE), PATCH)
    assert report.theoretical_speedup >= 1.0
    # MobileNetV3's squeeze-and-excitation pools stop reuse; the final upsampling is unknown, hence global
    assert "adaptive pooling" in report.reuse_stops_at
    assert any(op.startswith("interpolate") for op in report.unknown_ops)
