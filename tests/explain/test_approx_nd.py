"""The public ``incrinf.occlusion`` (the one front end) with the N-D front end's keywords: 1-D and 3-D inputs,
``target="all"`` and reducers, occluder modes, feature masks; alone (the exact path, forwarded) and with the
approximate knobs (tau, feature threshold, drill-down, measure_quality, the sampled error report)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import incrinf
from incrinf.explain.drilldown import DrillDown
from incrinf.explain.occlusion import ERROR_SAMPLE_CELLS
from incrinf.explain.occlusion import occlusion as exact_occlusion
from incrinf.explain.quality import estimated_ssim

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
POOL = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}
QUIET = {"progress": False}


def classifier(d: int, classes: int = 4) -> nn.Module:
    """Enough strided layers for tau < 1 to cap a region, small enough for a few dozen positions."""
    torch.manual_seed(1)
    return nn.Sequential(CONV[d](2, 6, 3, padding=1), nn.ReLU(), CONV[d](6, 8, 3, stride=2, padding=1), nn.ReLU(),
                         CONV[d](8, 8, 3, padding=1), nn.ReLU(), CONV[d](8, 8, 3, padding=1), POOL[d](1),
                         nn.Flatten(), nn.Linear(8, classes)).eval()


def signal_input(d: int) -> torch.Tensor:
    shape = {1: (2, 40), 2: (2, 20, 24), 3: (2, 10, 12, 12)}[d]
    return torch.randn(*shape, generator=torch.Generator().manual_seed(d))


def _occluded(x: torch.Tensor, corner, window) -> torch.Tensor:
    x2 = x.clone()
    x2[(slice(None), slice(None), *(slice(int(c), int(c) + w) for c, w in zip(corner, window)))] = 0.0
    return x2


# --- the exact path: every keyword forwarded ----------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 3])
def test_1d_and_3d_inputs_equal_naive_re_inference(d: int) -> None:
    model, x = classifier(d), signal_input(d)
    result = incrinf.occlusion(model, x, target=2, patch=5, stride=4, **QUIET)
    assert result.heatmap.ndim == d and result.stats["approximate"] is False
    with torch.no_grad():
        base = model(x[None])[0, 2]
        want = np.array([(base - model(_occluded(x[None], c, result.patch))[0, 2]).item() for c in result.positions])
    np.testing.assert_allclose(result.heatmap.ravel(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("options", [
    {"target": "all", "baseline": "gaussian"},
    {"target": None, "baseline": "mean_patch", "output": "prob"},
    {"target": 1, "baseline": "mean_img", "patch": 3, "stride": 5},
])
def test_new_keywords_are_the_exact_front_end(d: int, options: dict) -> None:
    model, x = classifier(d), signal_input(d)
    options = {"patch": 4, "stride": 4, **options}
    ours = incrinf.occlusion(model, x, **options, **QUIET)
    exact = exact_occlusion(model, x, **options, **QUIET)
    assert np.array_equal(ours.heatmap, exact.heatmap) and ours.target == exact.target
    assert ours.predicted == exact.predicted and ours.stats["stage_one_stride"] is None


def test_reducer_target_and_feature_mask_are_forwarded() -> None:
    model, x = classifier(3), signal_input(3)
    mask = torch.arange(3 * 3 * 3).reshape(3, 3, 3).repeat_interleave(4, 0).repeat_interleave(4, 1) \
        .repeat_interleave(4, 2)[:10, :12, :12]

    def margin(out: torch.Tensor) -> torch.Tensor:
        return out[:, 0] - out[:, 1]

    for kwargs in ({"target": margin, "patch": 4, "stride": 4},
                   {"target": "all", "feature_mask": mask, "baseline": "mean_patch"},
                   {"target": margin, "feature_mask": mask[None]}):
        ours = incrinf.occlusion(model, x, **kwargs, **QUIET)
        exact = exact_occlusion(model, x, **kwargs, **QUIET)
        assert np.array_equal(ours.heatmap, exact.heatmap)
    assert ours.target == "margin" and np.array_equal(ours.features, np.arange(27))


# --- approximate knobs with the new inputs and targets ------------------------------------------------------


@pytest.mark.parametrize("d,target", [(3, 0), (1, "all"), (2, "reducer")])
def test_measure_quality_compares_with_the_exact_map(d: int, target) -> None:
    model, x = classifier(d), signal_input(d)
    if target == "reducer":
        target = lambda out: out[:, 3]  # noqa: E731
    result = incrinf.occlusion(model, x, target=target, patch=3, stride=2, feature_threshold=0.3,
                               measure_quality=True, **QUIET)
    exact = exact_occlusion(model, x, target=target, patch=3, stride=2, **QUIET)
    err = np.abs(result.heatmap - exact.heatmap)
    assert result.stats["approximate"] and err.max() > 0  # the threshold changed something
    assert result.stats["max_abs_error"] == pytest.approx(float(err.max()))
    assert result.stats["mean_abs_error"] == pytest.approx(float(err.mean()))
    assert -1.0 <= result.stats["ssim"] < 1.0


@pytest.mark.parametrize("d", [1, 3])
def test_sampled_error_is_the_error_at_the_sampled_cells(d: int) -> None:
    model, x = classifier(d), signal_input(d)
    result = incrinf.occlusion(model, x, target="all", patch=3, stride=2, tau=0.5, feature_threshold=0.3, **QUIET)
    exact = exact_occlusion(model, x, target="all", patch=3, stride=2, **QUIET)
    n = exact.heatmap[0].size
    cells = np.unique(np.linspace(0, n - 1, min(ERROR_SAMPLE_CELLS, n)).round().astype(np.int64))
    err = np.abs(result.heatmap.reshape(4, -1) - exact.heatmap.reshape(4, -1))[:, cells]
    assert result.stats["sampled_cells"] == len(cells) and err.max() > 0
    assert result.stats["sampled_max_abs_error"] == pytest.approx(float(err.max()), rel=1e-5)
    assert result.stats["sampled_mean_abs_error"] == pytest.approx(float(err.mean()), rel=1e-5)
    assert 0.0 < result.stats["estimated_ssim"] <= 1.0


def test_sampled_error_of_a_feature_mask_run() -> None:
    """Sampled features are recomputed exactly with the rest of the mask merged into one leftover feature."""
    model, x = classifier(2), signal_input(2)
    mask = (torch.arange(20)[:, None] // 3) * 10 + torch.arange(24)[None] // 4  # 7 x 6 = 42 features
    result = incrinf.occlusion(model, x, target=0, feature_mask=mask, feature_threshold=0.3, baseline="mean_patch",
                               **QUIET)
    exact = exact_occlusion(model, x, target=0, feature_mask=mask, baseline="mean_patch", **QUIET)
    cells = np.unique(np.linspace(0, 41, ERROR_SAMPLE_CELLS).round().astype(np.int64))
    err = np.abs(result.heatmap - exact.heatmap)[cells]
    assert result.stats["sampled_cells"] == len(cells) and err.max() > 0
    assert result.stats["sampled_max_abs_error"] == pytest.approx(float(err.max()), rel=1e-5)
    assert "estimated_ssim" not in result.stats  # features have no neighbourhoods
    quality = incrinf.occlusion(model, x, target=0, feature_mask=mask, feature_threshold=0.3, baseline="mean_patch",
                                measure_quality=True, **QUIET)
    assert quality.stats["max_abs_error"] == pytest.approx(float(np.abs(result.heatmap - exact.heatmap).max()))
    assert "ssim" not in quality.stats


def test_estimated_ssim_over_1d_and_3d_grids() -> None:
    rng = np.random.default_rng(0)
    for shape in [(40,), (9, 9, 9)]:
        heat = rng.normal(size=shape)
        assert estimated_ssim(heat, 0.0) == pytest.approx(1.0)
        assert estimated_ssim(heat, 1.0) < estimated_ssim(heat, 0.1) < 1.0
    assert np.isnan(estimated_ssim(np.zeros((2, 9, 9)), 0.1))


def test_drill_down_with_a_reducer_target() -> None:
    model, x = classifier(2), torch.randn(2, 40, 40, generator=torch.Generator().manual_seed(5))

    def third(out: torch.Tensor) -> torch.Tensor:
        return out[:, 3]

    result = incrinf.occlusion(model, x, target=third, patch=8, stride=4, drill_down=DrillDown(0.3, 2.0), **QUIET)
    exact = exact_occlusion(model, x, target=3, patch=8, stride=4, **QUIET)
    assert result.target == "third" and result.heatmap.shape == exact.heatmap.shape
    assert 0 < result.fine.sum() < result.fine.size
    np.testing.assert_allclose(result.heatmap[result.fine], exact.heatmap[result.fine], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    ({"d": 3, "drill_down": DrillDown(0.25, 2.0)}, "2-D image; this input has 3 spatial axes"),
    ({"d": 1, "target_ssim": 0.9, "profile": "missing.json"}, "tuning profiles .* 2-D image"),
    ({"d": 2, "drill_down": DrillDown(0.25, 2.0), "feature_mask": True}, "not a feature mask"),
    ({"d": 2, "profile": "missing.json", "feature_mask": True}, "not a feature mask"),
    ({"d": 2, "drill_down": DrillDown(0.25, 2.0), "target": "all"}, "target='all'"),
])
def test_unsupported_combinations_are_clear_errors(kwargs: dict, match: str) -> None:
    d = kwargs.pop("d")
    model, x = classifier(d), signal_input(d)
    if kwargs.pop("feature_mask", None):
        kwargs["feature_mask"] = torch.zeros(x.shape[1:], dtype=torch.long)
    with pytest.raises(ValueError, match=match):
        incrinf.occlusion(model, x, patch=4, stride=4, **kwargs, **QUIET)
