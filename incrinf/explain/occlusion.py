"""The occlusion front end, :func:`occlusion` (``incrinf.occlusion``): heat maps by batched incremental inference
(Krypton) for 1-D signals, 2-D images and 3-D volumes; sliding windows or the features of a mask; one output
index, every index, or a reducer of the model's output; any occluder (:mod:`incrinf.explain.occluders`); exact,
or approximate with its error measured (projective field thresholding, value-based pruning, adaptive drill-down,
tuning profiles: :mod:`incrinf.explain.approx`).

Every approximate result reports its error (:class:`~incrinf.explain.result.ErrorEstimate`): the SSIM and
absolute errors against the exact heat map with ``measure_quality=True``, otherwise the errors measured on a small
sample of cells (or features) recomputed exactly (:data:`ERROR_SAMPLE_CELLS`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from incrinf.analysis import grid_shape, occlusion_grid
from incrinf.explain import approx
from incrinf.explain.drilldown import DrillDown
from incrinf.explain.heatmaps import TargetRunner, check_batch_size, infer_spatial_dims
from incrinf.explain.quality import estimated_ssim, map_ssim
from incrinf.explain.result import ErrorEstimate, OcclusionResult, OcclusionStats
from incrinf.explain.runner import feature_boxes
from incrinf.explain.targets import check_output
from incrinf.explain.tuning_profile import TuningProfile
from incrinf.validation import (
    check_feature_mask,
    check_feature_threshold,
    check_input,
    check_patch,
    check_stride,
    check_tau,
    parse_bytes,
)

# Cells recomputed exactly to measure an approximate map's error when the full exact map is not asked for:
# a few dozen cells cost well under 2% of a 224-pixel, stride-4 grid.
ERROR_SAMPLE_CELLS = 16


def occlusion(
    model: nn.Module,
    image: torch.Tensor,
    target: Any = None,
    patch: int | tuple[int, ...] = 16,
    stride: int | tuple[int, ...] = 4,
    baseline: Any = 0.0,
    batch_size: int | str = "auto",
    max_memory: str | int = "2GiB",
    output: str = "logit",
    device: str | torch.device | None = None,
    progress: bool = True,
    tau: float = 1.0,
    feature_threshold: float = 0.0,
    drill_down: DrillDown | None = None,
    target_ssim: float | None = None,
    profile: TuningProfile | str | Path | None = None,
    measure_quality: bool = False,
    *,
    feature_mask: Any = None,
    spatial_dims: int | None = None,
) -> OcclusionResult:
    """Occlusion heat map of ``model`` on ``image`` by batched incremental inference, exact or approximate.

    With the default knobs (``tau=1``, ``feature_threshold=0``, no ``drill_down``, no ``target_ssim`` or
    ``profile``) the heat map equals naive re-inference of every occluded input (to float tolerance), for every
    input, target, occluder and feature mask.

    Args:
        model: a ``torch.fx``-traceable model (eval mode is set): a classifier, or any model with a reducer target.
        image: the input without or with a batch axis of 1: (C, L) signals, (C, H, W) images, (C, D, H, W)
            volumes; float, already normalised for the model.
        target: what to explain: None (the predicted class), an int output index, ``"all"`` (a heat map per
            output index from one run), or a callable ``f(output) -> (N,)`` reducing a batch of the model's
            outputs to one value per example (e.g. a segmentation model's class-k logits summed over a region of
            interest: ``lambda out: (out["out"][:, k] * roi).sum((1, 2))``).
        patch: occlusion window size, an int or one per spatial axis.
        stride: window stride, an int or one per spatial axis.
        baseline: what replaces an occluded element: a number, a tensor broadcastable to the input,
            ``"mean_patch"`` (the mean of the occluded elements), ``"mean_img"`` (the input's mean), ``"gaussian"``
            (MONAI's Gaussian blend: multiplied by one minus a Gaussian centred on the window), or a function
            ``f(image, window_values) -> window_values``.
        batch_size: positions per batch, or "auto" to stay under ``max_memory``.
        max_memory: working-memory budget for "auto", e.g. "2GiB".
        output: "logit" or "prob" (softmax over each example's outputs; not with a reducer target).
        device: where to run (default: the input's device).
        progress: show a progress bar.
        tau: projective field threshold in (0, 1]; below 1 is approximate (faster).
        feature_threshold: value-based pruning: a recomputed position whose values moved by at most this share of
            its tensor's mean magnitude stops spreading its change; 0 (the default) is exact.
        drill_down: a :class:`~incrinf.explain.drilldown.DrillDown`: stage one at the stride its target speedup
            needs, stage two at ``stride`` on its fraction of the grid with the largest stage-one drops. Sliding
            windows over a 2-D image with one map (an int, None or a reducer target) only.
        target_ssim: wanted heat-map quality: the knobs are the fastest setting ``profile`` measured holding it
            (:meth:`TuningProfile.choose`). Not with explicit knobs; profiles are tuned on 2-D sliding windows.
        profile: a :class:`TuningProfile` or the path of one saved by ``incrinf tune`` / ``profile.save``. Given
            alone, its chosen setting is used.
        measure_quality: also compute the exact heat map and report the measured SSIM and errors against it
            (costs one exact run).
        feature_mask: occlude the features of this integer mask instead of sliding windows (Captum's
            ``FeatureAblation``): shape ``spatial``, or ``(C or 1, *spatial)``; every element with one id is
            occluded at once; ``patch`` and ``stride`` are then ignored.
        spatial_dims: the input's number of spatial axes (1, 2 or 3); default: that of the model's first
            convolution, else 2 for 3- and 4-axis tensors, 1 for 2-axis and 3 for 5-axis ones.

    Returns:
        An :class:`~incrinf.explain.result.OcclusionResult` with the full fine grid (or one value per feature);
        ``fine`` marks the cells computed at ``stride`` (all without drill-down). Its ``stats``
        (:class:`~incrinf.explain.result.OcclusionStats`) hold the setting used, the counts and speedups, the
        drill-down's stages and the error estimate: measured against the exact map (``measure_quality``), on a
        few cells recomputed exactly (approximate runs), or exact. SSIMs are over the grid's axes, averaged over
        the classes of ``target="all"``; feature maps and grids under 3 cells along an axis have none.

    Raises:
        TypeError / ValueError: bad input, patch, stride, target, reducer output, feature mask, baseline, batch
            size, output, memory budget or knob; an unsupported number of spatial axes; an unreachable drill-down
            target (the message gives the highest reachable speedup); ``target_ssim`` without a profile, a
            profile tuned for another model, a target no tuned setting reaches with a speedup, a profile together
            with explicit knobs; drill-down or a profile with a feature mask or a 1-D/3-D input, drill-down with
            ``target="all"``.
        FileNotFoundError: ``profile`` names no file.
        CaptureError: the model cannot be traced.
    """
    tau, feature_threshold = check_tau(tau), check_feature_threshold(feature_threshold)
    check_output(output)
    check_batch_size(batch_size)
    budget = parse_bytes(max_memory)
    if drill_down is not None and not isinstance(drill_down, DrillDown):
        raise TypeError(f"drill_down must be a DrillDown, got {type(drill_down).__name__}")
    d = infer_spatial_dims(model, image, spatial_dims)
    if profile is not None or target_ssim is not None:
        approx.check_windows_2d("tuning profiles (target_ssim, profile)", d, feature_mask)
    setting, loaded = approx.resolve_setting(tau, feature_threshold, drill_down, target_ssim, profile)
    if loaded is not None:
        approx.check_profile(loaded, model, image, patch, stride, output)
    if setting.drill_down is not None:
        approx.check_windows_2d("drill-down", d, feature_mask)
        if isinstance(target, str) and target == "all":
            raise ValueError("drill-down picks the cells to refine by one heat map's drops; target='all' has one per "
                             "class: explain one class (an int target), or run 'all' without drill-down")
    x = check_input(image, d)
    if device is not None:
        x, model = x.to(device), model.to(device)
    dims = tuple(x.shape[2:])
    mask = None if feature_mask is None else check_feature_mask(feature_mask, x)
    window = None if mask is not None else (check_patch(patch, dims), check_stride(stride, d))
    scoring = TargetRunner.build(model, x, target, output, setting.tau, setting.feature_threshold)
    if setting.drill_down is not None:
        result = approx.drill_down(scoring, setting.drill_down, *window, baseline, scoring.batch_size(batch_size),
                                   progress, budget)
    else:
        result = _heat_map(scoring, mask, window, baseline, batch_size, budget, progress)
    result.stats.setting = setting
    if measure_quality:
        _measure_quality(result, model, x, mask, window, baseline, batch_size, budget, output, target)
    elif setting.approximate:
        _sample_error(result, model, x, target, baseline, output)
    return result


def _heat_map(scoring: TargetRunner, mask: torch.Tensor | None, window: tuple[tuple[int, ...], tuple[int, ...]] | None,
              baseline: Any, batch_size: int | str, budget: int, progress: bool) -> OcclusionResult:
    """The heat map over every window of the grid, or over every feature of ``mask``, at the runner's setting."""
    dims = tuple(scoring.runner.dims)
    if mask is not None:
        ids, corners, sizes = feature_boxes(mask)
        features, heat, run = scoring.features(mask, baseline, scoring.batch_size(batch_size), progress,
                                               desc=f"occlusion of {len(ids)} features", memory=budget)
        return OcclusionResult(heat, corners, scoring.target.label, (), (), dims, OcclusionStats.of_run(run), None,
                               features, mask.cpu().numpy(), scoring.predicted)
    patch, stride = window
    positions = occlusion_grid(dims, patch, stride)
    heat, run = scoring.windows(positions, patch, baseline, scoring.batch_size(batch_size), progress,
                                desc=f"occlusion {'x'.join(map(str, patch))}/{'x'.join(map(str, stride))}",
                                memory=budget)
    grid = grid_shape(dims, patch, stride)
    heat = heat.reshape(-1, *grid) if scoring.target.every else heat.reshape(grid)
    return OcclusionResult(heat, positions, scoring.target.label, patch, stride, dims, OcclusionStats.of_run(run),
                           np.ones(grid, bool), predicted=scoring.predicted)


# --- the error of an approximate map ---------------------------------------------------------------------


def _exact_target(result: OcclusionResult, target: Any) -> Any:
    """The target to recompute ``result`` exactly with: the resolved index (so a None target cannot pick another
    class), else what was asked (``"all"``, a reducer)."""
    return result.target if isinstance(result.target, (int, np.integer)) else target


def _maps(heatmap: np.ndarray, result: OcclusionResult) -> np.ndarray:
    """(K, *grid) view of a heat map: one map, or one per class with ``target="all"``."""
    return heatmap if result.every_class else heatmap[None]


def _measure_quality(result: OcclusionResult, model: nn.Module, image: torch.Tensor, mask: torch.Tensor | None,
                     window: Any, baseline: Any, batch_size: int | str, budget: int, output: str, target: Any) -> None:
    """Compute the exact heat map and record the approximation's SSIM and errors against it."""
    if not result.stats.approximate:  # the exact path: nothing to compare with but itself
        result.stats.error = ErrorEstimate("measured", 0.0, 0.0, 1.0, int(result.heatmap.size), 0.0)
        return
    start = time.perf_counter()
    scoring = TargetRunner.build(model, image, _exact_target(result, target), output, warn=False)
    exact = _heat_map(scoring, mask, window, baseline, batch_size, budget, progress=False)
    err = np.abs(result.heatmap - exact.heatmap)
    ssim = map_ssim(exact.heatmap, result.heatmap, result.every_class, result.features is not None)
    result.stats.error = ErrorEstimate("measured", float(err.max()), float(err.mean()), ssim, int(err.size),
                                       time.perf_counter() - start, float(exact.heatmap.max() - exact.heatmap.min()))


def _sample_error(result: OcclusionResult, model: nn.Module, image: torch.Tensor, target: Any, baseline: Any,
                  output: str) -> None:
    """Recompute a few evenly spread cells (or features) exactly (tau = 1) and record the approximation's error
    there, with the SSIM that error predicts (windows only)."""
    start = time.perf_counter()
    heat = _maps(result.heatmap, result)
    heat = heat.reshape(heat.shape[0], -1)  # (K, cells)
    n = heat.shape[1]
    cells = np.unique(np.linspace(0, n - 1, min(ERROR_SAMPLE_CELLS, n)).round().astype(np.int64))
    scoring = TargetRunner.build(model, image, _exact_target(result, target), output, warn=False)
    if result.features is None:
        exact, _ = scoring.windows(result.positions[cells], result.patch, baseline, batch_size=len(cells))
    else:
        exact = _sampled_features(scoring, result, cells, baseline)
    err = np.abs(heat[:, cells] - exact.reshape(heat.shape[0], -1))
    ssim = None
    if result.features is None:
        ssim = float(np.mean([estimated_ssim(m, float(np.mean(e**2)))
                              for m, e in zip(_maps(result.heatmap, result), err)]))
    result.stats.error = ErrorEstimate("sampled", float(err.max()), float(err.mean()), ssim, len(cells),
                                       time.perf_counter() - start)


def _sampled_features(scoring: TargetRunner, result: OcclusionResult, cells: np.ndarray, baseline: Any
                      ) -> np.ndarray:
    """Exact drops with each sampled feature occluded: the other features become one leftover id, run once and
    dropped (one extra inference instead of one per feature)."""
    mask = torch.from_numpy(result.feature_mask).to(scoring.runner.image.device)
    sampled = torch.from_numpy(result.features[cells]).to(mask.device)
    leftover = int(mask.min()) - 1
    ids, heat, _ = scoring.features(torch.where(torch.isin(mask, sampled), mask, leftover), baseline,
                                    batch_size=len(cells) + 1)
    return heat[..., ids != leftover]


__all__ = ["ERROR_SAMPLE_CELLS", "OcclusionResult", "infer_spatial_dims", "occlusion"]
