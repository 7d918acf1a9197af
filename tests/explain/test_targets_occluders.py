"""The exact front end beyond one class of a 2-D image: every class at once, reducer targets, occluder modes,
feature masks, 1-D and 3-D inputs, and clear errors for bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from incrinf.analysis import occlusion_grid
from incrinf.explain.occluders import gaussian_multiplier
from incrinf.explain.occlusion import occlusion

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
POOL = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}


def classifier(d: int = 2, classes: int = 5) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(CONV[d](3, 8, 3, padding=1), nn.ReLU(), CONV[d](8, 8, 3, stride=2, padding=1), nn.ReLU(),
                         CONV[d](8, 8, 3, padding=1), POOL[d](1), nn.Flatten(), nn.Linear(8, classes)).eval()


def _occlude(x: torch.Tensor, corner, window, baseline) -> torch.Tensor:
    """``x`` with one window occluded the way each baseline mode defines it (the reference)."""
    x2 = x.clone()
    sl = (slice(None), slice(None), *(slice(int(c), int(c) + w) for c, w in zip(corner, window)))
    patch = x2[sl]
    if isinstance(baseline, torch.Tensor):
        x2[sl] = torch.broadcast_to(baseline, x.shape)[sl]
    elif baseline == "mean_patch":
        x2[sl] = patch.mean()
    elif baseline == "mean_img":
        x2[sl] = x.mean()
    elif baseline == "gaussian":  # a window cropped at the far edge keeps the kernel's first part
        x2[sl] = patch * gaussian_multiplier(window)[tuple(slice(0, n) for n in patch.shape[2:])]
    else:
        x2[sl] = baseline
    return x2


def _naive_heat(model, x, corners, window, baseline, score) -> np.ndarray:
    with torch.no_grad():
        base = score(model(x))
        return np.array([(base - score(model(_occlude(x, c, window, baseline)))).item() for c in corners])


@pytest.mark.parametrize("baseline", [0.5, "tensor", "mean_patch", "mean_img", "gaussian"])
def test_every_occluder_equals_naive_re_inference(baseline) -> None:
    model = classifier()
    x = torch.randn(1, 3, 18, 22)
    if baseline == "tensor":
        baseline = torch.randn(3, 18, 22)
    result = occlusion(model, x, target=1, patch=(5, 7), stride=(4, 5), baseline=baseline, progress=False,
                       batch_size=4)
    want = _naive_heat(model, x, result.positions, (5, 7), baseline, lambda out: out[0, 1])
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(result.heatmap.ravel(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_gaussian_multiplier_equals_monai() -> None:
    occlusion_sensitivity = pytest.importorskip("monai.visualize").OcclusionSensitivity
    for window in [(16, 16), (1, 1), (1, 5), (7,), (5, 6, 7)]:
        mul, _ = occlusion_sensitivity.gaussian_occlusion(torch.zeros(1, 2, *window), window)
        torch.testing.assert_close(gaussian_multiplier(window), mul[0, 0], rtol=0, atol=1e-7)


def test_all_classes_equal_one_run_per_class() -> None:
    model = classifier(classes=4)
    x = torch.randn(3, 16, 20)
    every = occlusion(model, x, target="all", patch=6, stride=5, progress=False)
    assert every.heatmap.shape == (4, 3, 4) and every.target == "all" and every.every_class
    for k in range(4):
        one = occlusion(model, x, target=k, patch=6, stride=5, progress=False)
        np.testing.assert_allclose(every.heatmap[k], one.heatmap, rtol=1e-6, atol=1e-7)
    assert every.pixel_map().shape == (4, 16, 20)
    probs = occlusion(model, x, target="all", patch=6, stride=5, output="prob", progress=False)
    assert np.abs(probs.heatmap.sum(axis=0)).max() < 1e-5  # probabilities: the drops of all classes cancel


def test_reducer_target_on_a_dict_output() -> None:
    class Dense(nn.Module):  # a dense model returning a dict, like torchvision's segmentation models
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 3, 3, padding=1))

        def forward(self, x):
            return {"out": self.body(x)}

    torch.manual_seed(0)
    model = Dense().eval()
    x = torch.randn(1, 3, 20, 20)
    roi = torch.zeros(20, 20)
    roi[5:12, 8:15] = 1

    def roi_score(out):
        return (out["out"][:, 2] * roi).sum((1, 2))

    result = occlusion(model, x, target=roi_score, patch=4, stride=3, progress=False, batch_size=5)
    assert result.target == "roi_score"
    want = _naive_heat(model, x, result.positions, (4, 4), 0.0, roi_score)
    np.testing.assert_allclose(result.heatmap.ravel(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # windows whose reach misses the region of interest change nothing there
    assert np.abs(result.heatmap).min() == 0 and np.abs(want).max() > 0


def test_feature_mask_equals_captum_feature_ablation() -> None:
    captum_attr = pytest.importorskip("captum.attr")
    model = classifier()
    x = torch.randn(1, 3, 24, 28)
    mask = torch.zeros(24, 28, dtype=torch.long)
    mask[:10, :14] = 1
    mask[10:, 5:20] = 2
    mask[3:6, 20:] = 7
    mask[20:, 25:] = 3
    mask[0, 27] = 9  # a one-pixel feature
    result = occlusion(model, x, target=2, feature_mask=mask, baseline=0.25, progress=False, batch_size=2)
    assert list(result.features) == [0, 1, 2, 3, 7, 9] and result.heatmap.shape == (6,)
    want = captum_attr.FeatureAblation(model).attribute(x, baselines=0.25, target=2, feature_mask=mask[None, None])
    assert want.abs().max() > 0
    np.testing.assert_allclose(result.pixel_map(), want[0, 0].numpy(), rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    every = occlusion(model, x, target="all", feature_mask=mask, baseline=0.25, progress=False)
    np.testing.assert_allclose(every.heatmap[2], result.heatmap, rtol=1e-6, atol=1e-7)


def test_channel_wise_feature_mask_and_mean_patch() -> None:
    model = classifier()
    x = torch.randn(1, 3, 12, 12)
    mask = torch.arange(3 * 4 * 4).view(3, 4, 4).repeat_interleave(3, 1).repeat_interleave(3, 2)  # 3x3 cells
    result = occlusion(model, x, target=0, feature_mask=mask, baseline="mean_patch", progress=False)
    assert result.pixel_map().shape == (3, 12, 12)
    with torch.no_grad():
        base = model(x)[0, 0]
        for f in (0, 17, 40):
            x2 = x.clone()
            chosen = (mask == f)[None]
            x2[chosen] = x[chosen].mean()
            assert abs(result.heatmap[f] - float(base - model(x2)[0, 0])) < 1e-5


@pytest.mark.parametrize("d,dims,patch,stride", [(1, (50,), 7, 6), (3, (9, 10, 11), (3, 4, 4), (3, 3, 4))])
def test_signals_and_volumes(d, dims, patch, stride, tmp_path) -> None:
    model = classifier(d)
    x = torch.randn(3, *dims)  # no batch axis
    result = occlusion(model, x, target=3, patch=patch, stride=stride, baseline="gaussian", progress=False)
    window = (patch,) * d if isinstance(patch, int) else patch
    steps = (stride,) * d if isinstance(stride, int) else stride
    corners = occlusion_grid(dims, window, steps)
    assert np.array_equal(result.positions, corners) and result.image_shape == dims
    want = _naive_heat(model, x[None], corners, window, "gaussian", lambda out: out[0, 3])
    np.testing.assert_allclose(result.heatmap.ravel(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert result.pixel_map().shape == dims
    path = result.save(tmp_path / "heat.png", image=x)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_targets_masks_and_dimensions() -> None:
    model = classifier()
    x = torch.randn(3, 16, 16)
    with pytest.raises(ValueError, match="one value per example"):
        occlusion(model, x, target=lambda out: out, progress=False)
    with pytest.raises(TypeError, match="one value per example"):
        occlusion(model, x, target=lambda out: 3.0, progress=False)
    with pytest.raises(ValueError, match="target must be"):
        occlusion(model, x, target="every", progress=False)
    with pytest.raises(ValueError, match="reducer"):
        occlusion(model, x, target=lambda out: out[:, 0], output="prob", progress=False)
    with pytest.raises(ValueError, match="spatial shape 16x16"):
        occlusion(model, x, feature_mask=torch.zeros(15, 16, dtype=torch.long), progress=False)
    with pytest.raises(ValueError, match="channel axis of 1 or 3"):
        occlusion(model, x, feature_mask=torch.zeros(2, 16, 16, dtype=torch.long), progress=False)
    with pytest.raises(TypeError, match="integer feature ids"):
        occlusion(model, x, feature_mask=torch.zeros(16, 16), progress=False)
    with pytest.raises(ValueError, match="cannot occlude"):
        occlusion(model, x, feature_mask=torch.zeros(16, 16, dtype=torch.long), baseline="gaussian", progress=False)
    with pytest.raises(ValueError, match="baseline"):
        occlusion(model, x, baseline="blur", progress=False)
    with pytest.raises(ValueError, match="does not broadcast"):
        occlusion(model, x, baseline=torch.zeros(2, 16, 16), progress=False)
    with pytest.raises(ValueError, match="1, 2 or 3 spatial axes"):
        occlusion(model, x, spatial_dims=4, progress=False)
    with pytest.raises(ValueError, match="1, 2 or 3 spatial axes"):
        occlusion(nn.Flatten(), torch.zeros(1, 1, 2, 2, 2, 2), progress=False)
    with pytest.raises(ValueError, match=r"\(C, D, H, W\)"):
        occlusion(classifier(3), torch.randn(3, 8, 8), progress=False)
    with pytest.raises(TypeError, match="callable target"):  # a dict output has no class scores
        occlusion(_DictModel().eval(), x, progress=False)


class _DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        return {"out": self.conv(x)}
