"""Automatic tuning of projective field thresholding (Krypton, seed 002 section 4.3): pick the lowest ``tau``
whose heat maps stay above a target SSIM.

Offline, :func:`tune` computes exact and approximate heat maps of sample images for a few ``tau`` values,
measures their SSIM and fits second-degree curves ``SSIM(tau)``. Online, :meth:`TuningProfile.tau_for` maps a
target SSIM to the lowest ``tau`` that the fitted curve predicts reaches it. Profiles are JSON files.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from tqdm.auto import tqdm

from incrinf.validation import check_image, check_patch, check_stride, check_tau

PROFILE_FORMAT = "incrinf-tuning-profile"
PROFILE_VERSION = 1
DEFAULT_TAUS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4)
TAU_STEP = 0.01  # resolution of the tau returned by tau_for


def heatmap_ssim(exact: np.ndarray, approx: np.ndarray) -> float:
    """SSIM of an approximate heat map against the exact one (scikit-image ``structural_similarity``).

    ``data_range`` is the exact map's range (max - min): the same absolute error counts the same whatever the
    approximation does to its own range, and the measure is symmetric in the sense the tuning needs (exact is
    the reference). The window is 7x7, or the largest odd size that fits a smaller grid.

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


def fit_curve(taus: Sequence[float], values: Sequence[float]) -> list[float]:
    """Least-squares second-degree polynomial ``SSIM(tau)``, coefficients highest degree first."""
    taus = np.asarray(taus, np.float64)
    values = np.asarray(values, np.float64)
    degree = min(2, len(np.unique(taus)) - 1)
    coeffs = np.polyfit(taus, values, degree) if degree >= 0 else np.zeros(1)
    return [float(c) for c in np.concatenate([np.zeros(2 - degree), coeffs])]


@dataclass
class TuningProfile:
    """The result of :func:`tune`: measured SSIMs per image and tau, and the fitted curves.

    Attributes:
        model: model name (the class name unless given).
        signature: captured-graph signature (structure and input shape) the profile was tuned on.
        input_shape: (1, C, H, W) of the tuning images.
        patch: (h, w) occlusion window.
        stride: (sy, sx).
        output: "logit" or "prob".
        taus: tau values measured (descending).
        ssim: per image, SSIM at each tau (``len(images) x len(taus)``).
        coefficients: mean curve: quadratic fit of every (tau, SSIM) point, highest degree first (the seed's).
        lower_coefficients: quadratic fit of the per-tau ``1 - coverage`` quantile of SSIM over images: the
            curve that about ``coverage`` of the images stay above; :meth:`tau_for` uses it by default.
        coverage: share of images meant to reach the target (0.8 in the seed's evaluation).
        target_ssim: the target the profile was tuned for.
        tau: ``tau_for(target_ssim)``.
        images: names of the tuning images.
        seconds: tuning time.
    """

    model: str
    signature: str
    input_shape: list[int]
    patch: list[int]
    stride: list[int]
    output: str
    taus: list[float]
    ssim: list[list[float]]
    coefficients: list[float]
    lower_coefficients: list[float]
    coverage: float
    target_ssim: float
    tau: float
    images: list[str] = field(default_factory=list)
    seconds: float = 0.0

    # --- the curve --------------------------------------------------------------------------------------

    def predict(self, tau: float | np.ndarray, conservative: bool = True) -> float | np.ndarray:
        """Predicted SSIM at ``tau`` from the lower (``conservative``) or the mean curve."""
        coeffs = self.lower_coefficients if conservative else self.coefficients
        out = np.polyval(coeffs, np.asarray(tau, np.float64))
        return float(out) if np.ndim(out) == 0 else out

    def tau_for(self, target_ssim: float | None = None, conservative: bool = True) -> float:
        """The lowest tau whose predicted SSIM reaches ``target_ssim``.

        Walks down from 1 in steps of 0.01 to the smallest tuned tau and stops at the first tau predicted
        below the target (a quadratic fit may rise again further down; that part is not trusted). No
        extrapolation below the tuned range; 1.0 (exact) when even the first step misses the target.

        Args:
            target_ssim: wanted SSIM in (-1, 1] (default: the profile's).
            conservative: use the lower (coverage) curve rather than the mean curve.
        """
        target = self.target_ssim if target_ssim is None else _check_target_ssim(target_ssim)
        if target >= 1.0:
            return 1.0
        lowest = min(self.taus)
        best = 1.0
        steps = int(round((1.0 - lowest) / TAU_STEP))
        for k in range(1, steps + 1):
            tau = round(1.0 - k * TAU_STEP, 6)
            if self.predict(tau, conservative) < target:
                break
            best = tau
        return best

    def mean_ssim(self) -> list[float]:
        """Mean SSIM over the tuning images, per tau."""
        return [float(v) for v in np.mean(np.asarray(self.ssim), axis=0)]

    def summary(self) -> str:
        """A short table: tau, mean and lowest SSIM measured, and the two fitted curves."""
        arr = np.asarray(self.ssim)
        lines = [f"{'tau':>5} {'mean SSIM':>9} {'min SSIM':>8} {'fit':>6} {'lower fit':>9}"]
        for j, tau in enumerate(self.taus):
            lines.append(f"{tau:>5.2f} {arr[:, j].mean():>9.3f} {arr[:, j].min():>8.3f} "
                         f"{self.predict(tau, False):>6.3f} {self.predict(tau, True):>9.3f}")
        lines.append(f"target SSIM {self.target_ssim:g} -> tau {self.tau:g} "
                     f"({len(self.ssim)} images, coverage {self.coverage:g})")
        return "\n".join(lines)

    # --- files ------------------------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **asdict(self)}
        path.write_text(json.dumps(data, indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> TuningProfile:
        """Read and validate a profile written by :meth:`save`.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not JSON, not a profile, a missing field or a field of the wrong type or shape.
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
            raise ValueError(f"{source}: unsupported profile version {data.get('version')!r} "
                             f"(this incrinf reads version {PROFILE_VERSION})")
        missing = [name for name in _FIELDS if name not in data]
        if missing:
            raise ValueError(f"{source}: missing field(s) {', '.join(missing)}")
        values = {}
        for name, check in _FIELDS.items():
            try:
                values[name] = check(data[name])
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{source}: bad field {name!r}: {exc}") from None
        for name in ("images", "seconds"):
            if name in data:
                try:
                    values[name] = [str(v) for v in data[name]] if name == "images" else _number(data[name])
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{source}: bad field {name!r}: {exc}") from None
        profile = cls(**values)
        if any(len(row) != len(profile.taus) for row in profile.ssim) or not profile.ssim:
            raise ValueError(f"{source}: field 'ssim' must hold one row of {len(profile.taus)} values per image")
        return profile


# --- field validators for load ---------------------------------------------------------------------------


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r}")
    return float(value)


def _ints(length: int) -> Any:
    def check(value: Any) -> list[int]:
        if not isinstance(value, list) or len(value) != length or not all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
            raise ValueError(f"expected a list of {length} positive ints, got {value!r}")
        return list(value)
    return check


def _numbers(length: int | None = None) -> Any:
    def check(value: Any) -> list[float]:
        if not isinstance(value, list) or (length is not None and len(value) != length) or not value:
            raise ValueError(f"expected a list of {length or 'some'} numbers, got {value!r}")
        return [_number(v) for v in value]
    return check


def _taus(value: Any) -> list[float]:
    taus = _numbers()(value)
    for t in taus:
        check_tau(t)
    return taus


def _rows(value: Any) -> list[list[float]]:
    if not isinstance(value, list):
        raise ValueError(f"expected a list of rows, got {type(value).__name__}")
    return [_numbers()(row) for row in value]


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _output(value: Any) -> str:
    if value not in ("logit", "prob"):
        raise ValueError(f"expected 'logit' or 'prob', got {value!r}")
    return value


def _coverage(value: Any) -> float:
    value = _number(value)
    if not 0.0 < value < 1.0:
        raise ValueError(f"expected a number in (0, 1), got {value!r}")
    return value


_FIELDS = {
    "model": _text, "signature": _text, "input_shape": _ints(4), "patch": _ints(2), "stride": _ints(2),
    "output": _output, "taus": _taus, "ssim": _rows, "coefficients": _numbers(3),
    "lower_coefficients": _numbers(3), "coverage": _coverage, "target_ssim": lambda v: _check_target_ssim(v),
    "tau": lambda v: check_tau(_number(v)),
}


def _check_target_ssim(value: Any) -> float:
    try:
        target = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"target_ssim must be a number in (-1, 1], got {value!r}") from None
    if isinstance(value, bool) or not -1.0 < target <= 1.0:
        raise ValueError(f"target_ssim must be a number in (-1, 1], got {value!r}")
    return target


def _check_coverage(value: Any) -> float:
    try:
        return _coverage(value)
    except ValueError:
        raise ValueError(f"coverage must be a number in (0, 1), got {value!r}") from None


# --- tuning ----------------------------------------------------------------------------------------------


def profile_from_measurements(taus: Sequence[float], ssim: Sequence[Sequence[float]], target_ssim: float = 0.9,
                              coverage: float = 0.8, **meta: Any) -> TuningProfile:
    """Fit the curves to measured SSIMs and pick tau (the tuning arithmetic, without running a model).

    Args:
        taus: tau values, one per column of ``ssim``.
        ssim: per image, SSIM at each tau.
        target_ssim: wanted SSIM.
        coverage: share of images the lower curve is meant to cover.
        **meta: model, signature, input_shape, patch, stride, output, images, seconds.
    """
    target_ssim = _check_target_ssim(target_ssim)
    coverage = _check_coverage(coverage)
    taus = [check_tau(t) for t in taus]
    arr = np.asarray(ssim, np.float64)
    if arr.ndim != 2 or arr.shape[1] != len(taus) or arr.shape[0] == 0:
        raise ValueError(f"ssim must be (images x {len(taus)}) values, got shape {arr.shape}")
    order = np.argsort(taus)[::-1]
    taus = [taus[i] for i in order]
    arr = arr[:, order]
    points_tau = np.tile(np.asarray(taus), arr.shape[0])
    mean_fit = fit_curve(points_tau, arr.ravel())
    lower_fit = fit_curve(taus, np.quantile(arr, 1.0 - coverage, axis=0))
    defaults: dict[str, Any] = {"model": "model", "signature": "", "input_shape": [1, 3, 1, 1], "patch": [1, 1],
                                "stride": [1, 1], "output": "logit"}
    defaults.update(meta)
    profile = TuningProfile(ssim=arr.tolist(), taus=taus, coefficients=mean_fit, lower_coefficients=lower_fit,
                            coverage=coverage, target_ssim=target_ssim, tau=1.0, **defaults)
    profile.tau = profile.tau_for(target_ssim)
    return profile


def tune(
    model: nn.Module,
    images: Sequence[torch.Tensor],
    target_ssim: float = 0.9,
    taus: Sequence[float] = DEFAULT_TAUS,
    patch: int | tuple[int, int] = 16,
    stride: int | tuple[int, int] = 4,
    baseline: float | torch.Tensor = 0.0,
    output: str = "logit",
    batch_size: int | str = "auto",
    max_memory: str | int = "2GiB",
    coverage: float = 0.8,
    progress: bool = True,
    name: str | None = None,
    image_names: Sequence[str] | None = None,
) -> TuningProfile:
    """Tune ``tau`` for a model on sample images (the seed's offline phase).

    For each image: the exact heat map (tau = 1) and one approximate map per tau, their SSIM
    (:func:`heatmap_ssim`), then second-degree fits of SSIM against tau and the lowest tau predicted to
    reach ``target_ssim``. Tune with the patch, stride and image size you will explain with.

    Args:
        model: a ``torch.fx``-traceable classifier.
        images: sample images, each (3, H, W) or (1, 3, H, W), normalised for the model, all of one size.
        target_ssim: wanted SSIM (0.90-0.95 is nearly imperceptible).
        taus: tau values to measure (1.0 is always included).
        patch, stride, baseline, output, batch_size, max_memory: as in :func:`incrinf.occlusion`.
        coverage: share of images meant to reach the target; the lower curve fits the per-tau
            ``1 - coverage`` quantile of SSIM over the images.
        progress: show a progress bar over (image, tau) runs.
        name: model name stored in the profile (default: the class name).
        image_names: names stored in the profile (default: ``image0``, ``image1``, ...).

    Returns:
        A :class:`TuningProfile` (``profile.tau`` is the tuned tau; ``profile.save(path)`` writes it).

    Raises:
        ValueError: no images, images of different sizes, bad taus, target or coverage.
    """
    from incrinf.explain.occlusion import occlusion
    from incrinf.graph import captured_graph

    target_ssim = _check_target_ssim(target_ssim)
    coverage = _check_coverage(coverage)
    if isinstance(images, torch.Tensor) and images.dim() == 4 and images.shape[0] > 1:
        images = list(images)
    if isinstance(images, torch.Tensor):
        images = [images]
    images = [check_image(img) for img in images]
    if not images:
        raise ValueError("tune needs at least one sample image")
    shapes = {tuple(img.shape) for img in images}
    if len(shapes) > 1:
        raise ValueError(f"tuning images must all have one size, got {sorted(shapes)}")
    taus = sorted({check_tau(t) for t in taus} | {1.0}, reverse=True)
    if len(taus) < 2:
        raise ValueError("taus must include at least one value below 1")
    shape = images[0].shape
    patch_hw = check_patch(patch, (shape[-2], shape[-1]))
    stride_hw = check_stride(stride)
    model = model.eval()
    graph = captured_graph(model, shape[1:])
    start = time.perf_counter()
    rows: list[list[float]] = []
    bar = tqdm(total=len(images) * len(taus), desc="tuning tau", disable=not progress, leave=False)
    for image in images:
        common = {"patch": patch_hw, "stride": stride_hw, "baseline": baseline, "output": output,
                  "batch_size": batch_size, "max_memory": max_memory, "progress": False}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exact = occlusion(model, image, **common)
        bar.update(1)
        row = []
        for tau in taus:
            if tau == 1.0:
                row.append(1.0)
                continue
            approx = occlusion(model, image, target=exact.target, tau=tau, **common)
            row.append(heatmap_ssim(exact.heatmap, approx.heatmap))
            bar.update(1)
        rows.append(row)
    bar.close()
    names = list(image_names) if image_names is not None else [f"image{i}" for i in range(len(images))]
    if len(names) != len(images):
        raise ValueError(f"image_names has {len(names)} names for {len(images)} images")
    return profile_from_measurements(
        taus, rows, target_ssim, coverage, model=name or type(model).__name__, signature=graph.signature,
        input_shape=[int(s) for s in shape], patch=list(patch_hw), stride=list(stride_hw), output=output,
        images=names, seconds=time.perf_counter() - start)


__all__ = ["DEFAULT_TAUS", "TuningProfile", "fit_curve", "heatmap_ssim", "profile_from_measurements", "tune"]
