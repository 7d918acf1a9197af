"""Approximate occlusion: projective field thresholding (tau, tuned by a target SSIM) and adaptive drill-down.

:func:`occlusion` has the exact front end's signature (1-D/2-D/3-D inputs, targets, occluders, feature masks)
plus ``drill_down``, ``target_ssim``, ``profile`` and ``measure_quality``. Without them (and with tau = 1) it *is*
the exact path: the call is forwarded unchanged. tau, the feature threshold and the error report work with every
input, target and occluder; drill-down and tuning profiles need sliding windows over a 2-D image. Every
approximate result reports its error: the SSIM and absolute errors against the exact heat map with
``measure_quality=True``, otherwise the errors measured on a small sample of cells (or features) recomputed
exactly (:data:`ERROR_SAMPLE_CELLS`).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from incrinf.analysis import occlusion_grid
from incrinf.explain import targets
from incrinf.explain.drilldown import (
    DrillDown,
    coincident_cells,
    drill_down_speedup,
    grid_shape,
    select_cells,
    upsample,
)
from incrinf.explain.occlusion import (
    OcclusionResult,
    _batch_size,
    _drops,
    _predicted,
    _warn_if_no_reuse,
    infer_spatial_dims,
)
from incrinf.explain.occlusion import occlusion as exact_occlusion
from incrinf.explain.runner import OcclusionRunner, RunStats
from incrinf.explain.tuning import Setting, TuningProfile, check_target_ssim, heatmap_ssim, profile_for
from incrinf.validation import (
    check_feature_threshold,
    check_image,
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
    """Occlusion heat map, exact or approximate (Krypton's projective field thresholding and drill-down).

    With ``tau=1``, no ``drill_down`` and no ``target_ssim`` this is exactly
    :func:`incrinf.explain.occlusion.occlusion` (same code path, bit-for-bit the same heat map), for every input
    (1-D (C, L), 2-D (C, H, W), 3-D (C, D, H, W)), target, occluder and feature mask.

    Args:
        model, image, target, patch, stride, baseline: as in the exact :func:`incrinf.explain.occlusion.occlusion`
            (``target`` an int, None, ``"all"`` or a reducer; ``baseline`` a number, a tensor or an occluder mode).
        batch_size, max_memory, output, device, progress, feature_mask, spatial_dims: as in the exact front end.
        tau: projective field threshold in (0, 1]; below 1 is approximate (faster).
        feature_threshold: value-based pruning (see :func:`incrinf.explain.occlusion.occlusion`); above 0 is
            approximate (faster).
        drill_down: a :class:`DrillDown`: stage one at the stride ``S1`` that its target speedup needs, stage
            two at ``stride`` on its fraction of the grid with the largest stage-one drops. Sliding windows over a
            2-D image with one map (an int, None or a reducer target) only.
        target_ssim: wanted heat-map quality: the knobs (tau, feature threshold, drill-down) are the fastest
            setting ``profile`` measured holding it (:meth:`TuningProfile.choose`). Cannot be combined with
            explicit knobs. Profiles are tuned on 2-D sliding windows: not with feature masks or 1-D/3-D inputs.
        profile: a :class:`TuningProfile` or the path of one saved by ``incrinf tune`` / ``profile.save``. Given
            alone, its chosen setting is used.
        measure_quality: also compute the exact heat map and report the measured SSIM and errors against it
            (costs one exact run).

    Returns:
        An :class:`OcclusionResult` with the full fine grid (or one value per feature). ``fine`` marks the cells
        computed at ``stride`` (all without drill-down). ``stats`` adds ``tau``, ``feature_threshold``,
        ``setting_source``, ``approximate``, ``stage_one_stride`` (``None`` without drill-down), drill-down
        counts and speedups, and the error: ``ssim``, ``max_abs_error``, ``mean_abs_error`` (measure_quality),
        or for approximate maps the error measured on a few cells recomputed exactly (``sampled_cells``,
        ``sampled_max_abs_error``, ``sampled_mean_abs_error``, ``estimated_ssim``: the mean SSIM of the sampled
        7x7 windows, ``error_check_seconds``); with a profile also ``predicted_ssim`` (what the setting held when
        tuned). SSIMs are over the grid's axes (7-wide windows, or the largest odd width that fits), averaged
        over the classes of ``target="all"``; a feature map, or a grid under 3 cells along an axis, has none
        (the errors are still reported).

    Raises:
        TypeError / ValueError: as the exact front end; bad drill-down, unreachable drill-down target
            (the message gives the highest reachable speedup), ``target_ssim`` without a profile, a profile
            tuned for another model, a target no tuned setting reaches with a speedup (the message names the
            best reachable), ``target_ssim``/``profile`` together with explicit knobs, or drill-down or a profile
            with a feature mask, a 1-D/3-D input or (drill-down) ``target="all"``.
        FileNotFoundError: ``profile`` names no file.
    """
    feature_threshold = check_feature_threshold(feature_threshold)
    if drill_down is not None and not isinstance(drill_down, DrillDown):
        raise TypeError(f"drill_down must be a DrillDown, got {type(drill_down).__name__}")
    d = infer_spatial_dims(model, image, spatial_dims)
    if profile is not None or target_ssim is not None:
        _check_windows_2d("tuning profiles (target_ssim, profile)", d, feature_mask)
    tau, feature_threshold, drill_down, tau_info = _resolve_setting(check_tau(tau), feature_threshold, drill_down,
                                                                    target_ssim, profile)
    loaded = tau_info.pop("_profile", None)
    if loaded is not None:
        _check_profile(loaded, model, image, patch, stride, output)
    if drill_down is not None:
        _check_windows_2d("drill-down", d, feature_mask)
        if isinstance(target, str) and target == "all":
            raise ValueError("drill-down picks the cells to refine by one heat map's drops; target='all' has one per "
                             "class: explain one class (an int target), or run 'all' without drill-down")
    common = {"target": target, "patch": patch, "stride": stride, "baseline": baseline, "batch_size": batch_size,
              "feature_threshold": feature_threshold,
              "max_memory": max_memory, "output": output, "device": device, "progress": progress}
    if drill_down is None:
        result = exact_occlusion(model, image, tau=tau, feature_mask=feature_mask, spatial_dims=d, **common)
        result.stats["stage_one_stride"] = None
    else:
        result = _drill_down(model, image, tau, drill_down, **common)
    result.stats.update(tau_info)
    result.stats["feature_threshold"] = feature_threshold
    approximate = tau < 1.0 or drill_down is not None or feature_threshold > 0
    result.stats["approximate"] = approximate
    if measure_quality:
        _measure_quality(result, model, image, approximate, dict(common, feature_mask=feature_mask, spatial_dims=d))
    elif approximate:
        _sample_error(result, model, image, target, baseline, output, device, d)
    return result


def _check_windows_2d(what: str, d: int, feature_mask: Any) -> None:
    """Drill-down and tuning profiles work on a 2-D grid of sliding windows: anything else is a clear error."""
    if feature_mask is not None:
        raise ValueError(f"{what} needs sliding windows, not a feature mask: use tau or feature_threshold with "
                         "feature masks")
    if d != 2:
        raise ValueError(f"{what} needs a 2-D image; this input has {d} spatial axes: use tau or "
                         "feature_threshold with 1-D signals and 3-D volumes")


# --- the knobs from arguments or a profile -----------------------------------------------------------------


def _resolve_setting(tau: float, feature_threshold: float, drill_down: DrillDown | None, target_ssim: float | None,
                     profile: TuningProfile | str | Path | None
                     ) -> tuple[float, float, DrillDown | None, dict[str, Any]]:
    info: dict[str, Any] = {"tau": tau}
    if profile is None and target_ssim is None:
        return tau, feature_threshold, drill_down, {**info, "setting_source": "argument"}
    if profile is None:
        raise ValueError("target_ssim needs a tuning profile (profile=...): run incrinf.tune(model, images) "
                         "or `incrinf tune` first")
    if tau < 1.0 or feature_threshold > 0 or drill_down is not None:
        raise ValueError("give either explicit knobs (tau, feature_threshold, drill_down) or target_ssim/profile, "
                         "not both")
    profile = profile_for(profile)
    target = profile.target_ssim if target_ssim is None else check_target_ssim(target_ssim)
    index = profile.chosen if target_ssim is None else profile.choose(target)
    setting = Setting(**profile.settings[index])
    if setting.exact:  # tune() recorded that nothing faster holds the target: asking for it is an error
        raise ValueError(f"{profile.unreached(target)}. Run the exact path (no target_ssim or profile) or ask "
                         "for a lower target_ssim")
    drill = DrillDown.from_factor(setting.drill_factor, setting.drill_fraction) if setting.drill_factor > 1 else None
    return setting.tau, setting.feature_threshold, drill, {
        "tau": setting.tau, "setting_source": "profile", "setting": setting.describe(), "target_ssim": target,
        "predicted_ssim": profile.quality(index), "_profile": profile}


def _check_profile(profile: TuningProfile, model: nn.Module, image: torch.Tensor, patch: Any, stride: Any,
                   output: str) -> None:
    """A profile from another architecture (graph signature: structure and input shape, not weights) is an
    error; other sizes or settings only weaken the prediction (a warning)."""
    from incrinf.graph import captured_graph

    image = check_image(image)
    shape = [int(s) for s in image.shape]
    if shape == list(profile.input_shape):
        signature = captured_graph(model, shape[1:]).signature
        if profile.signature and signature != profile.signature:
            raise ValueError(f"the tuning profile was made for another model ({profile.model}); tune this one "
                             "with incrinf.tune")
    differences = []
    if shape != list(profile.input_shape):
        differences.append(f"input {shape[-2]}x{shape[-1]} (tuned at "
                           f"{profile.input_shape[-2]}x{profile.input_shape[-1]})")
    hw = (shape[-2], shape[-1])
    if list(check_patch(patch, hw)) != list(profile.patch):
        differences.append(f"patch {patch} (tuned with {profile.patch})")
    if list(check_stride(stride)) != list(profile.stride):
        differences.append(f"stride {stride} (tuned with {profile.stride})")
    if output != profile.output:
        differences.append(f"output {output!r} (tuned with {profile.output!r})")
    if differences:
        warnings.warn("the tuning profile was made with other settings: " + ", ".join(differences) +
                      "; the SSIM it predicts may not hold", stacklevel=3)


# --- drill-down ------------------------------------------------------------------------------------------


def _drill_down(model: nn.Module, image: torch.Tensor, tau: float, drill: DrillDown, target: int | None,
                patch: Any, stride: Any, baseline: Any, batch_size: Any, max_memory: Any, output: str,
                device: Any, progress: bool, feature_threshold: float) -> OcclusionResult:
    image = check_image(image)
    if device is not None:
        image = image.to(device)
        model = model.to(device)
    hw = (image.shape[-2], image.shape[-1])
    patch_hw = check_patch(patch, hw)
    stride_hw = check_stride(stride)
    if output not in ("logit", "prob"):
        raise ValueError(f"output must be 'logit' or 'prob', got {output!r}")
    budget = parse_bytes(max_memory)
    s1 = drill.stage_one_stride(stride_hw, hw)
    runner = OcclusionRunner(model, image, tau=tau, feature_threshold=check_feature_threshold(feature_threshold))
    _warn_if_no_reuse(runner)
    spec = targets.resolve(target, runner.base_output, output)
    base = spec.scores(runner.base_output)[0]
    bs = _batch_size(batch_size, runner, patch_hw, budget, tau)
    start = time.perf_counter()

    coarse_pos = occlusion_grid(hw, patch_hw, s1)
    out1, stats1 = runner.run(coarse_pos, patch_hw, baseline, batch_size=bs, progress=progress,
                              desc=f"drill-down stage 1 ({s1[0]}x{s1[1]})", reduce=spec.scores)
    coarse = _drops(base, out1)
    coarse = coarse.reshape(grid_shape(hw, patch_hw, s1))

    fine_pos = occlusion_grid(hw, patch_hw, stride_hw)
    rows, cols = grid_shape(hw, patch_hw, stride_hw)
    heat = upsample(coarse, coarse_pos, fine_pos, hw, patch_hw).reshape(-1)
    repeat = coincident_cells(coarse_pos, fine_pos)
    already = repeat >= 0
    heat[already] = coarse.reshape(-1)[repeat[already]]  # the same query: take its value, do not rerun
    chosen = select_cells(heat.reshape(rows, cols), drill.fraction).reshape(-1)
    to_run = np.flatnonzero(chosen & ~already)
    stats2 = RunStats(tau=tau)
    if len(to_run):
        out2, stats2 = runner.run(fine_pos[to_run], patch_hw, baseline, batch_size=bs, progress=progress,
                                  desc=f"drill-down stage 2 ({stride_hw[0]}x{stride_hw[1]})", reduce=spec.scores)
        heat[to_run] = _drops(base, out2)
    fine = (chosen | already).reshape(rows, cols)
    stats = _drill_stats(stats1, stats2, len(fine_pos), s1, stride_hw, drill, time.perf_counter() - start, bs)
    stats["fine_fraction"] = float(fine.mean())
    return OcclusionResult(heat.reshape(rows, cols), fine_pos, spec.label, patch_hw, stride_hw, hw, stats, fine,
                           predicted=_predicted(runner.base_output))


def _drill_stats(one: RunStats, two: RunStats, n_fine: int, s1: tuple[int, int], s2: tuple[int, int],
                 drill: DrillDown, seconds: float, batch_size: int) -> dict[str, Any]:
    """Both stages' counts, and speedups over naive re-inference of the full fine grid."""
    full = one.flops_full
    incr = sum(s.positions * full / s.theoretical_speedup for s in (one, two) if s.positions)
    realized = sum(s.positions * full / s.realized_flop_ratio for s in (one, two) if s.positions)
    run = one.positions + two.positions
    return {
        "positions": run,
        "batches": one.batches + two.batches,
        "batch_size": batch_size,
        "seconds": seconds,
        "seconds_per_position": seconds / max(run, 1),
        "flops_full": full,
        # FLOPs of naive re-inference of every fine cell over the FLOPs actually planned
        "theoretical_speedup": n_fine * full / max(incr, 1.0),
        "realized_flop_ratio": n_fine * full / max(realized, 1.0),
        "peak_memory_bytes": max(one.peak_memory_bytes, two.peak_memory_bytes),
        "tau": one.tau,
        "stage_one_stride": s1,
        "stage_two_stride": s2,
        "stage_one_positions": one.positions,
        "stage_two_positions": two.positions,
        "fine_positions": n_fine,
        "drill_down_fraction": drill.fraction,
        "drill_down_target_speedup": drill.target_speedup,
        "drill_down_speedup": drill_down_speedup(s1, s2, drill.fraction),  # the seed's formula
        "query_speedup": n_fine / max(run, 1),  # counted queries
        "incremental_speedup_stage_one": one.theoretical_speedup,
        "incremental_speedup_stage_two": two.theoretical_speedup if two.positions else None,
    }


# --- measured error --------------------------------------------------------------------------------------


def _measure_quality(result: OcclusionResult, model: nn.Module, image: torch.Tensor, approximate: bool,
                     common: dict[str, Any]) -> None:
    if not approximate:  # the exact path: nothing to compare with but itself
        result.stats.update(ssim=1.0, max_abs_error=0.0, mean_abs_error=0.0, exact_seconds=0.0)
        return
    options = dict(common, target=_exact_target(result, common["target"]), progress=False, feature_threshold=0.0)
    start = time.perf_counter()
    exact = exact_occlusion(model, image, tau=1.0, **options)
    err = np.abs(result.heatmap - exact.heatmap)
    result.stats.update(max_abs_error=float(err.max()), mean_abs_error=float(err.mean()),
                        exact_seconds=time.perf_counter() - start,
                        exact_heatmap_range=float(exact.heatmap.max() - exact.heatmap.min()))
    ssim = map_ssim(exact.heatmap, result.heatmap, result)
    if ssim is not None:
        result.stats["ssim"] = ssim


def _exact_target(result: OcclusionResult, target: Any) -> Any:
    """The target to recompute ``result`` exactly with: the resolved index (so a None target cannot pick another
    class), else what was asked (``"all"``, a reducer)."""
    return result.target if isinstance(result.target, (int, np.integer)) else target


def _maps(heatmap: np.ndarray, result: OcclusionResult) -> np.ndarray:
    """(K, *grid) view of a heat map: one map, or one per class with ``target="all"``."""
    return heatmap if result.every_class else heatmap[None]


def map_ssim(exact: np.ndarray, approx: np.ndarray, result: OcclusionResult) -> float | None:
    """SSIM of an approximate heat map against the exact one over the grid's axes (1, 2 or 3), the mean over
    the classes of ``target="all"``; None for feature maps (no neighbourhoods) and grids under 3 cells along an
    axis (2-D: :func:`incrinf.explain.tuning.heatmap_ssim`, which raises for those).

    Args:
        exact, approx: heat maps of ``result``'s shape: (*grid), or (K, *grid) for ``"all"``.
        result: the approximate result (what kind of map it is).
    """
    if result.features is not None:
        return None
    values = [_grid_ssim(e, a) for e, a in zip(_maps(exact, result), _maps(approx, result))]
    return None if any(v is None for v in values) else float(np.mean(values))


def _grid_ssim(exact: np.ndarray, approx: np.ndarray) -> float | None:
    if exact.ndim == 2:
        return heatmap_ssim(exact, approx)
    from skimage.metrics import structural_similarity

    side = min(exact.shape)
    if side < 3:
        return None
    if np.array_equal(exact, approx):
        return 1.0
    exact, approx = np.asarray(exact, np.float64), np.asarray(approx, np.float64)
    data_range = float(exact.max() - exact.min())
    if data_range <= 0.0:  # as heatmap_ssim: a flat exact map falls back on the approximation's spread
        data_range = max(float(np.abs(approx - exact).max()), 1e-12)
    win = min(7, side if side % 2 else side - 1)
    return float(structural_similarity(exact, approx, win_size=win, data_range=data_range))


def _sample_error(result: OcclusionResult, model: nn.Module, image: torch.Tensor, target: Any, baseline: Any,
                  output: str, device: Any, spatial_dims: int) -> None:
    """Recompute a few evenly spread cells (or features) exactly (tau = 1) and report the approximation's error
    there."""
    start = time.perf_counter()
    image = check_input(image, spatial_dims)
    if device is not None:
        image = image.to(device)
    heat = _maps(result.heatmap, result)
    heat = heat.reshape(heat.shape[0], -1)  # (K, cells)
    n = heat.shape[1]
    cells = np.unique(np.linspace(0, n - 1, min(ERROR_SAMPLE_CELLS, n)).round().astype(np.int64))
    runner = OcclusionRunner(model, image, tau=1.0)
    spec = targets.resolve(_exact_target(result, target), runner.base_output, output)
    base = spec.scores(runner.base_output)[0]
    if result.features is None:
        out, _ = runner.run(result.positions[cells], result.patch, baseline, batch_size=len(cells),
                            reduce=spec.scores)
    else:
        out = _sampled_features(runner, result, cells, baseline, spec)
    exact = _drops(base, out).reshape(heat.shape[0], -1)
    err = np.abs(heat[:, cells] - exact)
    result.stats.update(sampled_cells=len(cells), sampled_max_abs_error=float(err.max()),
                        sampled_mean_abs_error=float(err.mean()), error_check_seconds=time.perf_counter() - start)
    if result.features is None:
        estimates = [estimated_ssim(m, float(np.mean(e**2))) for m, e in zip(_maps(result.heatmap, result), err)]
        result.stats["estimated_ssim"] = float(np.mean(estimates))


def _sampled_features(runner: OcclusionRunner, result: OcclusionResult, cells: np.ndarray, baseline: Any,
                      spec: targets.Target) -> torch.Tensor:
    """Exact outputs with each sampled feature occluded: the other features become one leftover id, run once and
    dropped (one extra inference instead of one per feature)."""
    mask = torch.from_numpy(result.feature_mask).to(runner.image.device)
    sampled = torch.from_numpy(result.features[cells]).to(mask.device)
    leftover = int(mask.min()) - 1
    ids, out, _ = runner.run_features(torch.where(torch.isin(mask, sampled), mask, leftover), baseline,
                                      batch_size=len(cells) + 1, reduce=spec.scores)
    return out[torch.from_numpy(ids != leftover).to(out.device)]


def estimated_ssim(approx: np.ndarray, error_power: float) -> float:
    """The SSIM against the exact map that an approximate map would have if its error were noise of power
    ``error_power`` (mean squared error, e.g. measured on a few cells recomputed exactly), uncorrelated with the
    map: per 7-wide window, SSIM's contrast-structure term ``(2 s^2 + C2) / (2 s^2 + e + C2)``, ``s^2`` the exact
    map's variance there (the approximate map's less ``e``; the luminance term is about 1: the error has no
    mean).

    Args:
        approx: (*grid) approximate heat map over 1, 2 or 3 grid axes.
        error_power: mean squared error of the approximation.

    Returns:
        The estimate, the mean over windows as :func:`heatmap_ssim` takes it; NaN for a grid under 3 cells along
        an axis.
    """
    from scipy.ndimage import uniform_filter

    side = min(approx.shape)
    win = min(7, side if side % 2 else side - 1)
    if win < 3:
        return float("nan")
    heat = np.asarray(approx, np.float64)
    mean = uniform_filter(heat, win)
    cells = win**heat.ndim
    variance = np.maximum(uniform_filter(heat * heat, win) - mean * mean, 0.0) * cells / (cells - 1)
    c2 = (0.03 * max(float(heat.max() - heat.min()), 1e-12)) ** 2
    pad = win // 2
    signal = np.maximum(variance - error_power, 0.0)
    ratio = (2 * signal + c2) / (2 * signal + error_power + c2)
    return float(ratio[tuple(slice(pad, n - pad) for n in heat.shape)].mean())


__all__ = ["DrillDown", "OcclusionResult", "estimated_ssim", "occlusion"]
