"""Tuning the approximation to a target heat-map SSIM: measure, on sample images, every setting of the knobs
(projective field cap ``tau``, value threshold ``feature_threshold``, drill-down ``factor``/``fraction``), pick the
fastest one whose SSIM holds the target on most fitting images, and check it on held-out ones.

Per sample image :func:`tune` runs the exact map once and one approximate map per (tau, feature threshold) pair;
drill-down needs no run of its own: its stage-one cells are the approximate map's cells at every ``factor``-th
position and its stage-two cells the same map's values (each query's output does not depend on the others), so
every drill-down setting is read off those maps. Speeds are measured wall times relative to the exact run.
The :class:`~incrinf.explain.tuning_profile.TuningProfile` (JSON) records the graph signature it was tuned
for and refuses another model.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np
import torch
import torch.nn as nn

from incrinf.explain.quality import heatmap_ssim
from incrinf.explain.tuning_profile import Setting, TuningProfile, check_target_ssim, profile_for
from incrinf.progress import progress_bar
from incrinf.validation import check_feature_threshold, check_image, check_patch, check_stride, check_tau

# The projective field cap is measured only when asked for: on real pretrained models its SSIM swings from image to
# image (EfficientNet-Lite0, 96 px, tau 0.9: 0.37-0.89 over five photos), so a cap tuned on some does not hold
# on others; value thresholds follow each image's own change (0.97-1.0 there at 0.05).
DEFAULT_TAUS = (1.0,)
DEFAULT_FEATURE_THRESHOLDS = (0.0, 0.01, 0.02, 0.04, 0.08, 0.16)
DEFAULT_DRILL_DOWNS = ((1, 0.0), (2, 0.1), (2, 0.25))  # (stage-one stride factor, stage-two fraction)


# --- measuring ----------------------------------------------------------------------------------------------


def drill_down_map(approx: np.ndarray, factor: int, fraction: float) -> tuple[np.ndarray, float]:
    """The heat map a drill-down run with stage-one stride ``factor`` x the stride and stage-two ``fraction``
    would return, read off a map computed at the fine stride with the same settings; and its share of queries.

    Stage one takes every ``factor``-th cell (and the last row and column), interpolates the others
    bilinearly by cell index, and stage two takes the fine values of the ``fraction`` of the grid with the
    largest drops (Krypton's choice, :func:`incrinf.explain.drilldown.select_cells`). A real run
    (:func:`incrinf.occlusion`) is close to this but not equal: its stage-one grid is Captum's
    grid at the stage-one stride (its last row and column only where they fall there) and it interpolates by
    window centre, whose far-edge windows are cropped.
    """
    from incrinf.explain.drilldown import select_cells

    rows, cols = approx.shape
    ri = np.unique(np.r_[np.arange(0, rows, factor), rows - 1])
    ci = np.unique(np.r_[np.arange(0, cols, factor), cols - 1])
    coarse = approx[np.ix_(ri, ci)]
    wide = np.stack([np.interp(np.arange(cols), ci, row) for row in coarse])
    out = np.stack([np.interp(np.arange(rows), ri, col) for col in wide.T], axis=1)
    known = np.zeros(approx.shape, bool)
    known[np.ix_(ri, ci)] = True
    out[known] = approx[known]
    if fraction > 0:  # the largest drops of the whole grid; those stage one computed are not run again
        known |= select_cells(out, fraction)
    out[known] = approx[known]
    return out, float(known.mean())


def tune(
    model: nn.Module,
    images: Sequence[torch.Tensor],
    target_ssim: float = 0.9,
    patch: int | tuple[int, int] = 16,
    stride: int | tuple[int, int] = 4,
    taus: Sequence[float] = DEFAULT_TAUS,
    feature_thresholds: Sequence[float] = DEFAULT_FEATURE_THRESHOLDS,
    drill_downs: Sequence[tuple[int, float]] = DEFAULT_DRILL_DOWNS,
    holdout: float = 1 / 3,
    coverage: float = 0.8,
    speed: str = "wall",
    baseline: float | torch.Tensor = 0.0,
    output: str = "logit",
    batch_size: int | str = "auto",
    max_memory: str | int = "2GiB",
    progress: bool = True,
    name: str | None = None,
    image_names: Sequence[str] | None = None,
) -> TuningProfile:
    """Fit the approximation's knobs to a target SSIM on sample images and check the fit on held-out ones.

    Tune with the patch, stride and image size you will explain with, on images of the same kind.

    Args:
        model: a ``torch.fx``-traceable classifier.
        images: sample images, each (3, H, W) or (1, 3, H, W), normalised for the model, all of one size.
        target_ssim: wanted SSIM (0.90-0.95 is nearly imperceptible).
        patch, stride, baseline, output, batch_size, max_memory: as in :func:`incrinf.occlusion`.
        taus: projective field thresholds to measure.
        feature_thresholds: value-based pruning thresholds to measure (every (tau, threshold) pair is run).
        drill_downs: ``(stage-one stride factor, stage-two fraction)`` pairs to read off each run.
        holdout: share of the images kept out of the choice to check it (every k-th image; at least one when
            there are three or more).
        coverage: share of the fitting images a setting must hold the target on.
        speed: ``"wall"``: a setting's speed is the exact run's wall time over its own (what a user gains, noisy
            on a busy machine); ``"flops"``: the ratio of the multiply-adds they computed (repeatable, blind to
            the overheads of pruning).
        progress: show a progress bar over runs.
        name: model name stored in the profile (default: the class name).
        image_names: names stored in the profile (default: ``image0``, ``image1``, ...).

    Returns:
        A :class:`TuningProfile`; ``profile.setting`` is the chosen setting, ``profile.summary()`` the table
        (with the held-out check), ``profile.save(path)`` writes it. When no setting holds the target with a
        speedup the exact setting is recorded as chosen, a warning names the best reachable ones, and
        ``occlusion(profile=...)`` refuses the profile with that message.

    Raises:
        ValueError: no images, images of different sizes, bad settings, target, holdout or coverage.
    """
    from incrinf.explain.occlusion import occlusion
    from incrinf.graph import captured_graph

    target_ssim = check_target_ssim(target_ssim)
    if not 0.0 < coverage < 1.0:
        raise ValueError(f"coverage must be a number in (0, 1), got {coverage!r}")
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout must be a share in [0, 1), got {holdout!r}")
    if speed not in ("wall", "flops"):
        raise ValueError(f"speed must be 'wall' or 'flops', got {speed!r}")
    if isinstance(images, torch.Tensor):
        images = list(images) if images.dim() == 4 and images.shape[0] > 1 else [images]
    images = [check_image(img) for img in images]
    if not images:
        raise ValueError("tune needs at least one sample image")
    if len({tuple(img.shape) for img in images}) > 1:
        raise ValueError(f"tuning images must all have one size, got {sorted({tuple(i.shape) for i in images})}")
    shape = images[0].shape
    patch_hw = check_patch(patch, (shape[-2], shape[-1]))
    stride_hw = check_stride(stride)
    runs = sorted({(check_tau(t), check_feature_threshold(f)) for t in taus for f in feature_thresholds} | {(1.0, 0.0)},
                  key=lambda r: (-r[0], r[1]))
    settings = [Setting(t, f, k, r) for t, f in runs for k, r in drill_downs]
    if (1.0, 0.0, 1, 0.0) not in {(s.tau, s.feature_threshold, s.drill_factor, s.drill_fraction) for s in settings}:
        settings.insert(0, Setting())
    names = list(image_names) if image_names is not None else [f"image{i}" for i in range(len(images))]
    if len(names) != len(images):
        raise ValueError(f"image_names has {len(names)} names for {len(images)} images")
    graph = captured_graph(model.eval(), shape[1:])
    start = time.perf_counter()
    ssim_rows, speed_rows = [], []
    bar = progress_bar(total=len(images) * len(runs), desc="tuning", disable=not progress, leave=False)
    common = {"patch": patch_hw, "stride": stride_hw, "baseline": baseline, "output": output,
              "batch_size": batch_size, "max_memory": max_memory, "progress": False}
    for image in images:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            exact = occlusion(model, image, **common)
            exact_cost = time.perf_counter() - t0 if speed == "wall" else 1.0 / exact.stats.realized_flop_ratio
        maps: dict[tuple[float, float], tuple[np.ndarray, float]] = {(1.0, 0.0): (exact.heatmap, exact_cost)}
        bar.update(1)
        for tau, threshold in runs:
            if (tau, threshold) == (1.0, 0.0):
                continue
            t0 = time.perf_counter()
            approx = occlusion(model, image, target=exact.target, tau=tau, feature_threshold=threshold, **common)
            # the front end's error check (a few cells recomputed exactly) is not the setting's cost
            cost = time.perf_counter() - t0 - approx.stats.error.seconds if speed == "wall" else \
                1.0 / approx.stats.realized_flop_ratio
            maps[(tau, threshold)] = (approx.heatmap, cost)
            bar.update(1)
        ssim_row, speed_row = [], []
        for s in settings:
            fine, cost = maps[(s.tau, s.feature_threshold)]
            heat, queries = drill_down_map(fine, s.drill_factor, s.drill_fraction) if s.drill_factor > 1 \
                else (fine, 1.0)
            ssim_row.append(heatmap_ssim(exact.heatmap, heat))
            speed_row.append(exact_cost / max(cost * queries, 1e-12))
        ssim_rows.append(ssim_row)
        speed_rows.append(speed_row)
    bar.close()
    every = round(1 / holdout) if holdout > 0 and len(images) >= 3 else 0
    check = list(range(every - 1, len(images), every)) if every else []
    profile = TuningProfile(
        model=name or type(model).__name__, signature=graph.signature, input_shape=[int(s) for s in shape],
        patch=list(patch_hw), stride=list(stride_hw), output=output, target_ssim=target_ssim, coverage=coverage,
        settings=[asdict(s) for s in settings], ssim=ssim_rows, speed=speed_rows, check=check, images=names,
        seconds=time.perf_counter() - start, speed_unit=speed)
    profile.chosen = profile.choose()
    if profile.setting.exact:
        warnings.warn(f"{profile.unreached()}: the exact setting is chosen", stacklevel=2)
    checked = profile.check_result()
    if checked is not None and checked[0] < target_ssim:
        warnings.warn(f"the chosen setting ({profile.setting.describe()}) held SSIM {checked[0]:.3f} < {target_ssim:g} "
                      f"on the held-out images: tune with more images, or a higher target", stacklevel=2)
    return profile


__all__ = ["DEFAULT_DRILL_DOWNS", "DEFAULT_FEATURE_THRESHOLDS", "DEFAULT_TAUS", "Setting", "TuningProfile",
           "check_target_ssim", "drill_down_map", "profile_for", "tune"]
