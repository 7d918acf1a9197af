"""What an occlusion run returns: the heat map (:class:`OcclusionResult`) and a typed record of what ran
(:class:`OcclusionStats`: the setting, the error estimate with its method, timings, multiply-adds, positions)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from incrinf.explain.drilldown import DrillDown
from incrinf.explain.pictures import DEFAULT_CMAP, map_title, save_heatmap
from incrinf.explain.runner import RunStats

SettingSource = Literal["argument", "profile"]
ErrorMethod = Literal["exact", "measured", "sampled"]


@dataclass(frozen=True)
class ChosenSetting:
    """The approximation's knobs a run used, and where they came from.

    Attributes:
        tau: projective field threshold in (0, 1] (1: no cap).
        feature_threshold: value-based pruning threshold (0: none).
        drill_down: the drill-down asked for, or None.
        source: ``"argument"`` (the call's knobs) or ``"profile"`` (a tuning profile's setting for a target SSIM).
        target_ssim: the SSIM asked of the profile (profile runs only).
        predicted_ssim: the SSIM the profile's setting held on its tuning images (profile runs only).
        description: the profile setting's description, e.g. ``"feature threshold 0.04"`` (profile runs only).
    """

    tau: float = 1.0
    feature_threshold: float = 0.0
    drill_down: DrillDown | None = None
    source: SettingSource = "argument"
    target_ssim: float | None = None
    predicted_ssim: float | None = None
    description: str | None = None

    @property
    def approximate(self) -> bool:
        """Whether any knob departs from the exact path."""
        return self.tau < 1.0 or self.feature_threshold > 0.0 or self.drill_down is not None


@dataclass(frozen=True)
class ErrorEstimate:
    """How far a heat map is from the exact one, and how that was found.

    Attributes:
        method: ``"exact"`` (the exact path: no error by construction), ``"measured"`` (compared cell by cell
            with the exact map: ``measure_quality``; an exact run measured against itself reports zeros) or
            ``"sampled"`` (a few cells or features recomputed exactly).
        max_abs_error: largest absolute heat difference over the compared cells.
        mean_abs_error: mean absolute heat difference over the compared cells.
        ssim: measured SSIM against the exact map (``"measured"``; 1 for ``"exact"``), or the SSIM the sampled
            error predicts (``"sampled"``, :func:`incrinf.explain.quality.estimated_ssim`); None for feature maps
            and grids under 3 cells along an axis.
        cells: cells (or features) compared: the whole map, or the sample.
        seconds: what the check cost.
        exact_range: the exact heat map's max - min (``"measured"`` only).
    """

    method: ErrorMethod
    max_abs_error: float = 0.0
    mean_abs_error: float = 0.0
    ssim: float | None = None
    cells: int = 0
    seconds: float = 0.0
    exact_range: float | None = None


@dataclass(frozen=True)
class DrillDownStages:
    """What a drill-down run did (Krypton's two stages).

    Attributes:
        stage_one_stride: (sy, sx) stride of the coarse stage.
        stage_two_stride: (sy, sx) the requested (fine) stride.
        stage_one_positions: coarse queries run.
        stage_two_positions: fine queries run (cells coinciding with coarse ones are not rerun).
        fine_positions: cells of the full fine grid.
        fraction: share of the fine grid chosen for stage two.
        target_speedup: the speedup in queries that set the stage-one stride.
        formula_speedup: the seed's ``S1^2 / (S2^2 + r S1^2)``.
        query_speedup: fine cells over queries actually run.
        stage_one_speedup: theoretical incremental speedup of stage one's queries.
        stage_two_speedup: the same for stage two (None when it ran nothing).
        fine_fraction: share of the fine grid holding computed (not interpolated) values.
    """

    stage_one_stride: tuple[int, int]
    stage_two_stride: tuple[int, int]
    stage_one_positions: int
    stage_two_positions: int
    fine_positions: int
    fraction: float
    target_speedup: float
    formula_speedup: float
    query_speedup: float
    stage_one_speedup: float
    stage_two_speedup: float | None
    fine_fraction: float


@dataclass
class OcclusionStats(RunStats):
    """What an occlusion run did: the runner's counts (:class:`~incrinf.explain.runner.RunStats`: ``positions``,
    ``batches``, ``batch_size``, ``seconds``, ``flops_full`` the multiply-adds of one full inference,
    ``theoretical_speedup`` and ``realized_flop_ratio`` over naive re-inference of every cell (a drill-down counts
    its fine grid), ``peak_memory_bytes``, ``extra``) and what the front end adds.

    Attributes:
        setting: the knobs used (:class:`ChosenSetting`).
        error: the error estimate (:class:`ErrorEstimate`; ``method="exact"`` for exact runs).
        drill_down: the stages of a drill-down run, else None.
    """

    setting: ChosenSetting = field(default_factory=ChosenSetting)
    error: ErrorEstimate = field(default_factory=lambda: ErrorEstimate("exact", ssim=1.0))
    drill_down: DrillDownStages | None = None

    @classmethod
    def of_run(cls, run: RunStats) -> OcclusionStats:
        """The record of a runner's counts (the setting and error are the front end's to fill)."""
        counts = {f.name: getattr(run, f.name) for f in fields(RunStats)}
        return cls(**{**counts, "extra": dict(run.extra)})

    @property
    def approximate(self) -> bool:
        """Whether the heat map is approximate (any knob off the exact path)."""
        return self.setting.approximate

    @property
    def seconds_per_position(self) -> float:
        return self.seconds / max(self.positions, 1)

    # --- the flat view (JSON records of dataset runs; reading by the former dictionary keys) ----------------

    def as_dict(self) -> dict[str, Any]:
        """A flat dictionary of plain values (the keys of dataset records)."""
        s, e, drill = self.setting, self.error, self.drill_down
        out: dict[str, Any] = {
            "positions": self.positions, "batches": self.batches, "batch_size": self.batch_size,
            "seconds": self.seconds, "seconds_per_position": self.seconds_per_position, "flops_full": self.flops_full,
            "theoretical_speedup": self.theoretical_speedup, "realized_flop_ratio": self.realized_flop_ratio,
            "peak_memory_bytes": self.peak_memory_bytes, "capture_seconds": self.capture_seconds,
            "executor_seconds": self.executor_seconds, "base_seconds": self.base_seconds,
            "plan_seconds": self.plan_seconds, "plan_hit": self.plan_hit, **self.extra,
            "tau": s.tau, "feature_threshold": s.feature_threshold, "setting_source": s.source,
            "approximate": self.approximate, "stage_one_stride": None if drill is None else drill.stage_one_stride,
        }
        if s.source == "profile":
            out.update(setting=s.description, target_ssim=s.target_ssim, predicted_ssim=s.predicted_ssim)
        if drill is not None:
            out.update(
                stage_two_stride=drill.stage_two_stride, stage_one_positions=drill.stage_one_positions,
                stage_two_positions=drill.stage_two_positions, fine_positions=drill.fine_positions,
                drill_down_fraction=drill.fraction, drill_down_target_speedup=drill.target_speedup,
                drill_down_speedup=drill.formula_speedup, query_speedup=drill.query_speedup,
                incremental_speedup_stage_one=drill.stage_one_speedup,
                incremental_speedup_stage_two=drill.stage_two_speedup, fine_fraction=drill.fine_fraction)
        if e.method == "sampled":
            out.update(sampled_cells=e.cells, sampled_max_abs_error=e.max_abs_error,
                       sampled_mean_abs_error=e.mean_abs_error, error_check_seconds=e.seconds)
            if e.ssim is not None:
                out["estimated_ssim"] = e.ssim
        elif e.method == "measured":
            out.update(max_abs_error=e.max_abs_error, mean_abs_error=e.mean_abs_error, exact_seconds=e.seconds)
            if e.exact_range is not None:
                out["exact_heatmap_range"] = e.exact_range
            if e.ssim is not None:
                out["ssim"] = e.ssim
        return out

    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.as_dict()

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def get(self, key: str, default: Any = None) -> Any:
        return self.as_dict().get(key, default)


@dataclass
class OcclusionResult:
    """An occlusion heat map.

    Attributes:
        heatmap: score of the unoccluded input minus the occluded one (a drop is positive), one value per position
            of the occlusion grid, shape ``grid`` (e.g. (rows, cols); (depth, rows, cols) for volumes); for
            ``target="all"`` one map per output index, ``(K, *grid)``. Feature-mask runs: one value per feature, (F,)
            (or (K, F)), in the order of :attr:`features`.
        positions: (N, d) first corners of the windows, row-major (feature runs: each feature's bounding-box
            corner).
        target: the explained output index, ``"all"``, or the reducer's name.
        patch: (d,) window size (feature runs: ``()``).
        stride: (d,) window stride (feature runs: ``()``).
        image_shape: (d,) spatial extents of the explained input.
        stats: what ran (:class:`OcclusionStats`): positions, batches, seconds, multiply-adds and speedups, peak
            memory, the setting and the error estimate.
        fine: ``(*grid)`` bool, which cells were computed at the requested stride (all, for exact runs).
        features: (F,) the mask's feature ids (feature runs only).
        feature_mask: ``(C or 1, *spatial)`` the feature mask (feature runs only).
        predicted: the output index with the largest unoccluded score (tensor outputs), else None.
    """

    heatmap: np.ndarray
    positions: np.ndarray
    target: int | str
    patch: tuple[int, ...]
    stride: tuple[int, ...]
    image_shape: tuple[int, ...]
    stats: OcclusionStats = field(default_factory=OcclusionStats)
    fine: np.ndarray | None = None
    features: np.ndarray | None = None
    feature_mask: np.ndarray | None = None
    predicted: int | None = None

    @property
    def every_class(self) -> bool:
        """Whether the heat map has a map per output index (``target="all"``)."""
        return self.target == "all"

    def pixel_map(self) -> np.ndarray:
        """Attribution per input element, shape ``image_shape`` (``(K, *image_shape)`` for ``"all"``).

        Windows: the mean heat of the windows covering an element (Captum's averaging). Features: the heat of
        the element's feature (channel-wise masks give ``(C, *image_shape)``).
        """
        heat = self.heatmap if self.every_class else self.heatmap[None]
        heat = heat.reshape(heat.shape[0], -1)
        if self.features is not None:
            index = np.searchsorted(self.features, self.feature_mask)
            out = heat[:, index]  # (K, C or 1, *spatial)
            out = out[:, 0] if self.feature_mask.shape[0] == 1 else out
        else:
            total = np.zeros((heat.shape[0], *self.image_shape), np.float64)
            count = np.zeros(self.image_shape, np.float64)
            for k, corner in enumerate(self.positions):
                window = tuple(slice(int(c), int(c) + p) for c, p in zip(corner, self.patch))
                total[(slice(None), *window)] += heat[:, k].reshape(-1, *([1] * len(window)))
                count[window] += 1
            out = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
        return out if self.every_class else out[0]

    def save(self, path: str | Path, image: np.ndarray | torch.Tensor | None = None, title: str | None = None,
             class_index: int | None = None, cmap: str = DEFAULT_CMAP, centre: float | None = 0.0) -> Path:
        """Write a PNG of the heat map with a colour bar: over the image (2-D), as a curve under the signal
        (1-D), or over a montage of slices (3-D).

        Args:
            path: output file.
            image: the input for display: 2-D an HxWx3 array in [0, 1] or uint8, or a (C, H, W) tensor in [0, 1];
                1-D (C, L); 3-D (C, D, H, W) or (D, H, W).
            title: optional figure title.
            class_index: with ``target="all"``, the class whose map to draw (default: the predicted class).
            cmap: a matplotlib colour map (default: diverging, red where occluding lowered the score, blue where
                it raised it, white at zero).
            centre: the value at the colour map's middle, limits symmetric about it; ``None``: the map spans the
                heat map's minimum to maximum (for a sequential map such as ``"viridis"``).

        Returns:
            The path written.
        """
        pixel = self.pixel_map()
        label = f"drop in {self.target}" if isinstance(self.target, str) else f"drop in class {self.target} score"
        if self.every_class:
            k = self.predicted if class_index is None else int(class_index)
            pixel, label = pixel[k or 0], f"drop in class {k or 0} score"
        if pixel.ndim == len(self.image_shape) + 1:  # a channel-wise feature mask: average the channels
            pixel = pixel.mean(axis=0)
        what = map_title(self.patch, self.stride, self.features is not None)
        return save_heatmap(pixel, path, image, title or what, label, cmap=cmap, centre=centre)


__all__ = ["ChosenSetting", "DrillDownStages", "ErrorEstimate", "ErrorMethod", "OcclusionResult", "OcclusionStats",
           "SettingSource"]
