"""Tuning the approximation to a target heat-map SSIM: measure, on sample images, every setting of the knobs
(projective field cap ``tau``, value threshold ``feature_threshold``, drill-down ``factor``/``fraction``), pick the
fastest one whose SSIM holds the target on most fitting images, and check it on held-out ones.

Per sample image :func:`tune` runs the exact map once and one approximate map per (tau, feature threshold) pair;
drill-down needs no run of its own: its stage-one cells are the approximate map's cells at every ``factor``-th
position and its stage-two cells the same map's values (each query's output does not depend on the others), so
every drill-down setting is read off those maps. Speeds are measured wall times relative to the exact run.
The :class:`TuningProfile` (JSON) records the graph signature it was tuned for and refuses another model.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from incrinf.progress import progress_bar
from incrinf.validation import check_feature_threshold, check_image, check_patch, check_stride, check_tau

PROFILE_FORMAT = "incrinf-tuning-profile"
PROFILE_VERSION = 2
# The projective field cap is measured only when asked for: on real pretrained models its SSIM swings from image to
# image (EfficientNet-Lite0, 96 px, tau 0.9: 0.37-0.89 over five photos), so a cap tuned on some does not hold
# on others; value thresholds follow each image's own change (0.97-1.0 there at 0.05).
DEFAULT_TAUS = (1.0,)
DEFAULT_FEATURE_THRESHOLDS = (0.0, 0.01, 0.02, 0.04, 0.08, 0.16)
DEFAULT_DRILL_DOWNS = ((1, 0.0), (2, 0.1), (2, 0.25))  # (stage-one stride factor, stage-two fraction)
# A setting counts as faster than the exact run only beyond this (wall times on a shared machine vary by ~10%).
MIN_SPEEDUP = 1.1


def heatmap_ssim(exact: np.ndarray, approx: np.ndarray) -> float:
    """SSIM of an approximate heat map against the exact one (scikit-image ``structural_similarity``).

    ``data_range`` is the exact map's range (max - min): the same absolute error counts the same whatever the
    approximation does to its own range. The window is 7x7, or the largest odd size that fits a smaller grid.

    Args:
        exact: (rows, cols) exact heat map.
        approx: (rows, cols) approximate heat map on the same grid.

    Returns:
        SSIM in [-1, 1]; 1 for identical maps.

    Raises:
        ValueError: shapes differ, or the grid is smaller than 3x3.
    """
    from skimage.metrics import structural_similarity

    exact = np.asarray(exact, np.float64)
    approx = np.asarray(approx, np.float64)
    if exact.shape != approx.shape or exact.ndim != 2:
        raise ValueError(f"heat maps must be 2-D and of one shape, got {exact.shape} and {approx.shape}")
    if np.array_equal(exact, approx):
        return 1.0
    side = min(exact.shape)
    if side < 3:
        raise ValueError(f"SSIM needs a heat map of at least 3x3 cells, got {exact.shape[0]}x{exact.shape[1]}")
    win = min(7, side if side % 2 else side - 1)
    data_range = float(exact.max() - exact.min())
    if data_range <= 0.0:  # a flat exact map: fall back on the approximation's spread
        data_range = max(float(np.abs(approx - exact).max()), 1e-12)
    return float(structural_similarity(exact, approx, win_size=win, data_range=data_range))


@dataclass(frozen=True)
class Setting:
    """One setting of the approximation's knobs.

    Attributes:
        tau: projective field threshold in (0, 1] (1: no cap).
        feature_threshold: value-based pruning threshold (0: none).
        drill_factor: drill-down stage-one stride as a multiple of the stride (1: no drill-down).
        drill_fraction: drill-down stage-two share of the fine grid (0 with factor 1).
    """

    tau: float = 1.0
    feature_threshold: float = 0.0
    drill_factor: int = 1
    drill_fraction: float = 0.0

    def __post_init__(self) -> None:
        check_tau(self.tau)
        check_feature_threshold(self.feature_threshold)
        if isinstance(self.drill_factor, bool) or not isinstance(self.drill_factor, int) or self.drill_factor < 1:
            raise ValueError(f"drill_factor must be an integer >= 1, got {self.drill_factor!r}")
        if (self.drill_factor == 1 and self.drill_fraction != 0.0) or \
                (self.drill_factor > 1 and not 0.0 < self.drill_fraction < 1.0):
            raise ValueError(f"drill_fraction must be in (0, 1) with drill-down and 0 without; got "
                             f"{self.drill_fraction!r}")

    @property
    def exact(self) -> bool:
        return self.tau == 1.0 and self.feature_threshold == 0.0 and self.drill_factor == 1

    def describe(self) -> str:
        parts = [f"tau {self.tau:g}"] if self.tau < 1.0 else []
        if self.feature_threshold > 0:
            parts.append(f"feature threshold {self.feature_threshold:g}")
        if self.drill_factor > 1:
            parts.append(f"drill-down x{self.drill_factor} r={self.drill_fraction:g}")
        return ", ".join(parts) or "exact"


@dataclass
class TuningProfile:
    """What :func:`tune` measured, and the setting it chose.

    Attributes:
        model: model name (the class name unless given).
        signature: captured-graph signature (structure and input shape) the profile was tuned for.
        input_shape: (1, C, H, W) of the tuning images.
        patch: (h, w) occlusion window.
        stride: (sy, sx).
        output: "logit" or "prob".
        target_ssim: the target the profile was tuned for.
        coverage: share of the fitting images a setting must hold the target on.
        settings: every setting measured (``asdict(Setting)`` each).
        ssim: per image, SSIM of each setting against the exact map.
        speed: per image, the exact run's cost over the setting's (wall time, or multiply-adds: ``speed_unit``).
        check: indices of the held-out images (used only to check the chosen setting).
        chosen: index of the chosen setting (the exact one when none reaches the target with a speedup).
        images: names of the tuning images.
        seconds: tuning time.
    """

    model: str
    signature: str
    input_shape: list[int]
    patch: list[int]
    stride: list[int]
    output: str
    target_ssim: float
    coverage: float
    settings: list[dict]
    ssim: list[list[float]]
    speed: list[list[float]]
    check: list[int]
    chosen: int = 0
    images: list[str] = field(default_factory=list)
    seconds: float = 0.0
    speed_unit: str = "wall"

    # --- choosing --------------------------------------------------------------------------------------

    @property
    def setting(self) -> Setting:
        """The chosen setting."""
        return Setting(**self.settings[self.chosen])

    def _fit(self) -> list[int]:
        return [i for i in range(len(self.ssim)) if i not in set(self.check)] or list(range(len(self.ssim)))

    def quality(self, index: int, images: Sequence[int] | None = None) -> float:
        """The SSIM a setting holds on ``coverage`` of the images (default: the fitting ones)."""
        rows = np.asarray(self.ssim)[list(images) if images is not None else self._fit(), index]
        return float(np.quantile(rows, 1.0 - self.coverage))

    def median_speed(self, index: int, images: Sequence[int] | None = None) -> float:
        """Median speed of a setting over the images (default: the fitting ones)."""
        return float(np.median(np.asarray(self.speed)[list(images) if images is not None else self._fit(), index]))

    def choose(self, target_ssim: float | None = None) -> int:
        """Index of the fastest setting whose SSIM holds ``target_ssim`` on ``coverage`` of the fitting images
        and that is faster than the exact run (by :data:`MIN_SPEEDUP`); the exact setting when none is (the
        exact path holds any target; :meth:`unreached` says why nothing faster did).

        Raises:
            ValueError: a bad target, or a profile without the exact setting.
        """
        target = self.target_ssim if target_ssim is None else check_target_ssim(target_ssim)
        candidates = [i for i, s in enumerate(self.settings) if not Setting(**s).exact
                      and self.quality(i) >= target and self.median_speed(i) > MIN_SPEEDUP]
        if candidates:
            return max(candidates, key=self.median_speed)
        exact = [i for i, s in enumerate(self.settings) if Setting(**s).exact]
        if not exact:
            raise ValueError(f"the profile has no exact setting to fall back on: {self.unreached(target)}")
        return exact[0]

    def unreached(self, target_ssim: float | None = None) -> str:
        """Why no approximate setting holds ``target_ssim`` with a speedup: the best reachable ones."""
        target = self.target_ssim if target_ssim is None else check_target_ssim(target_ssim)
        approximate = [i for i, s in enumerate(self.settings) if not Setting(**s).exact]
        if not approximate:
            return "the profile holds no approximate setting"
        best_quality = max(approximate, key=self.quality)
        faster = [i for i in approximate if self.median_speed(i) > MIN_SPEEDUP]
        best_fast = max(faster, key=self.quality) if faster else None
        reach = (f"; the best faster one is {self._label(best_fast)}" if best_fast is not None else
                 "; no approximate setting was faster than the exact run")
        return (f"no tuned setting holds SSIM {target:g} on {self.coverage:.0%} of the tuning images with a "
                f"speedup: the highest SSIM is {self._label(best_quality)}{reach}")

    def _label(self, index: int) -> str:
        return (f"{Setting(**self.settings[index]).describe()} (SSIM {self.quality(index):.3f}, "
                f"{self.median_speed(index):.2f}x)")

    def check_result(self) -> tuple[float, float] | None:
        """``(SSIM held on coverage of the held-out images, their median speed)`` of the chosen setting."""
        if not self.check or Setting(**self.settings[self.chosen]).exact:
            return None
        return self.quality(self.chosen, self.check), self.median_speed(self.chosen, self.check)

    def summary(self) -> str:
        """A table of every setting: SSIM held (fitting images), median speed, and the choice with its check."""
        lines = [f"{'setting':<44} {'SSIM held':>9} {'speed':>7}"]
        for i, s in enumerate(self.settings):
            mark = " <- chosen" if i == self.chosen else ""
            lines.append(f"{Setting(**s).describe():<44} {self.quality(i):>9.3f} {self.median_speed(i):>6.2f}x{mark}")
        fit = len(self._fit())
        lines.append(f"target SSIM {self.target_ssim:g} on {self.coverage:.0%} of {fit} fitting images -> "
                     f"{self.setting.describe()}")
        checked = self.check_result()
        if checked is not None:
            lines.append(f"held out ({len(self.check)} images): SSIM {checked[0]:.3f} on {self.coverage:.0%} of them, "
                         f"{checked[1]:.2f}x" + ("" if checked[0] >= self.target_ssim else
                                                 " -- BELOW the target: the setting did not hold on unseen images"))
        return "\n".join(lines)

    # --- files ------------------------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **asdict(self)}, indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> TuningProfile:
        """Read and validate a profile written by :meth:`save`.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not JSON, not a profile, another version, or a field of the wrong type or shape.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tuning profile not found: {path}")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not a tuning profile (not valid JSON: {exc})") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: Any, source: str = "profile") -> TuningProfile:
        """Build a profile from its JSON dictionary, validating every field."""
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{source} is not an incrinf tuning profile (no \"format\": \"{PROFILE_FORMAT}\")")
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"{source}: unsupported profile version {data.get('version')!r} (this incrinf reads "
                             f"version {PROFILE_VERSION}; tune again with incrinf tune)")
        try:
            values = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
            profile = cls(**values)
            settings = [Setting(**s) for s in profile.settings]
            ssim, speed = np.asarray(profile.ssim, np.float64), np.asarray(profile.speed, np.float64)
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"{source}: malformed profile ({exc})") from None
        if ssim.ndim != 2 or ssim.shape != speed.shape or ssim.shape[1] != len(settings) or not len(settings):
            raise ValueError(f"{source}: 'ssim' and 'speed' must hold one value per image and setting")
        if not np.isfinite(ssim).all() or not (speed > 0).all() or not 0 <= profile.chosen < len(settings):
            raise ValueError(f"{source}: non-finite SSIMs, non-positive speeds or a bad 'chosen' index")
        profile.target_ssim = check_target_ssim(profile.target_ssim)
        return profile


def check_target_ssim(value: Any) -> float:
    """A target SSIM in (-1, 1]."""
    try:
        target = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"target_ssim must be a number in (-1, 1], got {value!r}") from None
    if isinstance(value, bool) or not -1.0 < target <= 1.0:
        raise ValueError(f"target_ssim must be a number in (-1, 1], got {value!r}")
    return target


# --- measuring ----------------------------------------------------------------------------------------------


def drill_down_map(approx: np.ndarray, factor: int, fraction: float) -> tuple[np.ndarray, float]:
    """The heat map a drill-down run with stage-one stride ``factor`` x the stride and stage-two ``fraction``
    would return, read off a map computed at the fine stride with the same settings; and its share of queries.

    Stage one takes every ``factor``-th cell (and the last row and column), interpolates the others
    bilinearly by cell index, and stage two takes the fine values of the ``fraction`` of the grid with the
    largest drops (Krypton's choice, :func:`incrinf.explain.drilldown.select_cells`). A real run
    (:func:`incrinf.explain.approx.occlusion`) is close to this but not equal: its stage-one grid is Captum's
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
            exact_cost = time.perf_counter() - t0 if speed == "wall" else 1.0 / exact.stats["realized_flop_ratio"]
        maps: dict[tuple[float, float], tuple[np.ndarray, float]] = {(1.0, 0.0): (exact.heatmap, exact_cost)}
        bar.update(1)
        for tau, threshold in runs:
            if (tau, threshold) == (1.0, 0.0):
                continue
            t0 = time.perf_counter()
            approx = occlusion(model, image, target=exact.target, tau=tau, feature_threshold=threshold, **common)
            cost = time.perf_counter() - t0 if speed == "wall" else 1.0 / approx.stats["realized_flop_ratio"]
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


def profile_for(profile: TuningProfile | str | Path) -> TuningProfile:
    """A profile object from a profile or the path of one."""
    if isinstance(profile, TuningProfile):
        return profile
    if not isinstance(profile, (str, Path)):
        raise TypeError(f"profile must be a TuningProfile or a path, got {type(profile).__name__}")
    return TuningProfile.load(profile)


__all__ = ["DEFAULT_DRILL_DOWNS", "DEFAULT_FEATURE_THRESHOLDS", "DEFAULT_TAUS", "Setting", "TuningProfile",
           "check_target_ssim", "drill_down_map", "heatmap_ssim", "profile_for", "tune"]
