"""The approximation's settings and the drill-down run (Krypton's projective field thresholding, value-based
pruning and adaptive drill-down), used by the one occlusion front end :func:`incrinf.explain.occlusion.occlusion`.

A setting comes from the call's knobs or from a tuning profile's setting for a target SSIM
(:func:`resolve_setting`); a profile made for another model is an error, one made with other sizes a warning
(:func:`check_profile`). Drill-down (:func:`drill_down`) runs a coarse grid, then the requested stride on the
share of cells with the largest coarse drops.
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
from incrinf.explain.drilldown import (
    DrillDown,
    coincident_cells,
    drill_down_speedup,
    grid_shape,
    select_cells,
    upsample,
)
from incrinf.explain.heatmaps import TargetRunner
from incrinf.explain.result import ChosenSetting, DrillDownStages, OcclusionResult, OcclusionStats
from incrinf.explain.runner import RunStats
from incrinf.explain.tuning_profile import Setting, TuningProfile, check_target_ssim, profile_for
from incrinf.validation import check_image, check_patch, check_stride


def check_windows_2d(what: str, d: int, feature_mask: Any) -> None:
    """Drill-down and tuning profiles work on a 2-D grid of sliding windows: anything else is a clear error."""
    if feature_mask is not None:
        raise ValueError(f"{what} needs sliding windows, not a feature mask: use tau or feature_threshold with "
                         "feature masks")
    if d != 2:
        raise ValueError(f"{what} needs a 2-D image; this input has {d} spatial axes: use tau or "
                         "feature_threshold with 1-D signals and 3-D volumes")


# --- the knobs from arguments or a profile -----------------------------------------------------------------


def resolve_setting(tau: float, feature_threshold: float, drill_down: DrillDown | None, target_ssim: float | None,
                    profile: TuningProfile | str | Path | None) -> tuple[ChosenSetting, TuningProfile | None]:
    """The setting to run: the checked knobs, or the profile's fastest setting holding ``target_ssim`` (its
    chosen one without a target); and the loaded profile (None without one).

    Raises:
        ValueError: ``target_ssim`` without a profile, a profile together with explicit knobs, or a target no
            tuned setting reaches with a speedup (the message names the best reachable).
    """
    if profile is None and target_ssim is None:
        return ChosenSetting(tau, feature_threshold, drill_down), None
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
    chosen = ChosenSetting(setting.tau, setting.feature_threshold, drill, "profile", target, profile.quality(index),
                           setting.describe())
    return chosen, profile


def check_profile(profile: TuningProfile, model: nn.Module, image: torch.Tensor, patch: Any, stride: Any,
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


def drill_down(scoring: TargetRunner, drill: DrillDown, patch: tuple[int, int], stride: tuple[int, int],
               baseline: Any, batch_size: int | None, progress: bool, memory: int | None = None) -> OcclusionResult:
    """Krypton's adaptive drill-down on a 2-D image: stage one at the stride ``drill`` needs, stage two at
    ``stride`` on the fraction of cells with the largest (upsampled) stage-one drops.

    Args:
        scoring: the runner for the image and a one-map target (not ``"all"``).
        patch, stride: the checked (h, w) window and fine stride.
        batch_size: positions per batch, or None to fill ``memory`` bytes of working memory.

    Returns:
        The full fine grid (interpolated where stage two did not run; ``fine`` marks computed cells) with
        :class:`~incrinf.explain.result.DrillDownStages` in its stats.
    """
    hw = tuple(scoring.runner.dims)
    s1 = drill.stage_one_stride(stride, hw)
    start = time.perf_counter()
    coarse_pos = occlusion_grid(hw, patch, s1)
    coarse, one = scoring.windows(coarse_pos, patch, baseline, batch_size, progress,
                                  desc=f"drill-down stage 1 ({s1[0]}x{s1[1]})", memory=memory)
    coarse = coarse.reshape(grid_shape(hw, patch, s1))

    fine_pos = occlusion_grid(hw, patch, stride)
    rows, cols = grid_shape(hw, patch, stride)
    heat = upsample(coarse, coarse_pos, fine_pos, hw, patch).reshape(-1)
    repeat = coincident_cells(coarse_pos, fine_pos)
    already = repeat >= 0
    heat[already] = coarse.reshape(-1)[repeat[already]]  # the same query: take its value, do not rerun
    chosen = select_cells(heat.reshape(rows, cols), drill.fraction).reshape(-1)
    to_run = np.flatnonzero(chosen & ~already)
    two = RunStats(tau=one.tau)
    if len(to_run):
        heat[to_run], two = scoring.windows(fine_pos[to_run], patch, baseline, batch_size, progress,
                                            desc=f"drill-down stage 2 ({stride[0]}x{stride[1]})", memory=memory)
    fine = (chosen | already).reshape(rows, cols)
    stats = _drill_stats(one, two, len(fine_pos), s1, stride, drill, time.perf_counter() - start, float(fine.mean()))
    return OcclusionResult(heat.reshape(rows, cols), fine_pos, scoring.target.label, patch, stride, hw, stats, fine,
                           predicted=scoring.predicted)


def _drill_stats(one: RunStats, two: RunStats, n_fine: int, s1: tuple[int, int], s2: tuple[int, int],
                 drill: DrillDown, seconds: float, fine_fraction: float) -> OcclusionStats:
    """Both stages' counts, and speedups over naive re-inference of the full fine grid."""
    full = one.flops_full
    incr = sum(s.positions * full / s.theoretical_speedup for s in (one, two) if s.positions)
    realized = sum(s.positions * full / s.realized_flop_ratio for s in (one, two) if s.positions)
    run = one.positions + two.positions
    stats = OcclusionStats.of_run(one)
    stats.positions = run
    stats.batches = one.batches + two.batches
    stats.seconds = seconds
    # multiply-adds of naive re-inference of every fine cell over those actually planned
    stats.theoretical_speedup = n_fine * full / max(incr, 1.0)
    stats.realized_flop_ratio = n_fine * full / max(realized, 1.0)
    stats.peak_memory_bytes = max(one.peak_memory_bytes, two.peak_memory_bytes)
    stats.drill_down = DrillDownStages(
        stage_one_stride=s1, stage_two_stride=s2, stage_one_positions=one.positions,
        stage_two_positions=two.positions, fine_positions=n_fine, fraction=drill.fraction,
        target_speedup=drill.target_speedup, formula_speedup=drill_down_speedup(s1, s2, drill.fraction),
        query_speedup=n_fine / max(run, 1), stage_one_speedup=one.theoretical_speedup,
        stage_two_speedup=two.theoretical_speedup if two.positions else None, fine_fraction=fine_fraction)
    return stats


__all__ = ["check_profile", "check_windows_2d", "drill_down", "resolve_setting"]
