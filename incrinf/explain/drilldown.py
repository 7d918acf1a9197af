"""Adaptive drill-down (Krypton, seed 002 section 4.2): a coarse heat map first, the fine stride only where
the coarse map shows the largest drops.

Pure math on grids and heat maps (no model): choosing the stage-one stride ``S1`` from a target speedup,
the speedup bound, upsampling the coarse map to the fine grid and picking the stage-two cells. The runs
themselves are in :mod:`incrinf.explain.approx`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def grid_shape(image_hw: tuple[int, int], patch: tuple[int, int], stride: tuple[int, int]) -> tuple[int, int]:
    """(rows, cols) of the occlusion grid, Captum's count ``ceil((dim - patch) / stride) + 1``."""
    return (-(-(image_hw[0] - patch[0]) // stride[0]) + 1, -(-(image_hw[1] - patch[1]) // stride[1]) + 1)


def drill_down_speedup(stage_one_stride: tuple[int, int], stride: tuple[int, int], fraction: float) -> float:
    """Theoretical speedup of drill-down in re-inference queries, the seed's ``S1^2 / (S2^2 + r S1^2)``
    (with ``S^2`` read as ``Sy * Sx``)."""
    s1 = stage_one_stride[0] * stage_one_stride[1]
    s2 = stride[0] * stride[1]
    return s1 / (s2 + fraction * s1)


def highest_speedup(stride: tuple[int, int], fraction: float, image_hw: tuple[int, int]) -> float:
    """The largest reachable drill-down speedup: stage one at a stride of the whole image, the seed's bound
    ``min(W^2 / (S2^2 + r W^2), 1 / r)`` (the second term is never reached with a finite image)."""
    scale = min(image_hw[0] / stride[0], image_hw[1] / stride[1])
    return min(scale**2 / (1.0 + fraction * scale**2), 1.0 / fraction)


@dataclass(frozen=True)
class DrillDown:
    """Adaptive drill-down settings.

    Attributes:
        fraction: ``r``, the share of the fine grid recomputed in stage two (the largest stage-one drops).
        target_speedup: wanted speedup in re-inference queries over the fine grid; sets ``S1``.
    """

    fraction: float = 0.25
    target_speedup: float = 3.0

    def __post_init__(self) -> None:
        for name in ("fraction", "target_speedup"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"DrillDown.{name} must be a number, got {value!r}")
        if not 0.0 < self.fraction < 1.0:
            raise ValueError(f"DrillDown.fraction must be in (0, 1), got {self.fraction!r}")
        if self.target_speedup <= 0.0:
            raise ValueError(f"DrillDown.target_speedup must be positive, got {self.target_speedup!r}")

    @classmethod
    def from_factor(cls, factor: int, fraction: float) -> DrillDown:
        """Drill-down with stage one at ``factor`` times the stride (its cells are fine cells too) and stage two
        on ``fraction`` of the fine grid: the target speedup ``factor^2 / (1 + fraction factor^2)``."""
        if isinstance(factor, bool) or not isinstance(factor, int) or factor < 2:
            raise ValueError(f"drill-down factor must be an integer >= 2, got {factor!r}")
        return cls(fraction, factor**2 / (1.0 + fraction * factor**2))

    def stage_one_stride(self, stride: tuple[int, int], image_hw: tuple[int, int]) -> tuple[int, int]:
        """``S1 = sqrt(target / (1 - r * target)) * S2`` per axis, rounded up (so the theoretical speedup is
        at least the target) and never below ``S2``.

        Args:
            stride: ``S2``, the user's (sy, sx).
            image_hw: (H, W) of the image.

        Raises:
            ValueError: the target is beyond the seed's bound; the message gives the highest reachable.
        """
        best = highest_speedup(stride, self.fraction, image_hw)
        factor_sq = self.target_speedup / (1.0 - self.fraction * self.target_speedup) \
            if self.fraction * self.target_speedup < 1.0 else math.inf
        s1 = [math.ceil(math.sqrt(factor_sq) * s - 1e-9) if math.isfinite(factor_sq) else math.inf for s in stride]
        if not math.isfinite(factor_sq) or s1[0] > image_hw[0] or s1[1] > image_hw[1]:
            raise ValueError(
                f"drill-down target speedup {self.target_speedup:g} cannot be reached with fraction "
                f"{self.fraction:g}, stride {stride[0]}x{stride[1]} on a {image_hw[0]}x{image_hw[1]} image: the "
                f"highest reachable is {best:.3f} (stage-one stride as large as the image; the bound is "
                f"min(W^2 / (S2^2 + r W^2), 1 / r))")
        return max(int(s1[0]), stride[0]), max(int(s1[1]), stride[1])


def window_centres(corners: np.ndarray, patch: int, dim: int) -> np.ndarray:
    """Centres of windows starting at ``corners`` along one axis, cropped at the far edge as the engine and
    Captum crop them."""
    corners = np.asarray(corners, np.float64)
    return (corners + np.minimum(corners + patch, dim)) / 2.0


def upsample(coarse: np.ndarray, coarse_positions: np.ndarray, fine_positions: np.ndarray,
             image_hw: tuple[int, int], patch: tuple[int, int]) -> np.ndarray:
    """Bilinear interpolation of a coarse heat map at the fine grid's windows, by window centre.

    Fine windows outside the coarse centres' range take the nearest edge value.

    Args:
        coarse: (r1, c1) stage-one heat map.
        coarse_positions: (r1*c1, 2) its window corners (y, x), row-major.
        fine_positions: (r2*c2, 2) fine window corners, row-major.
        image_hw: (H, W).
        patch: (ph, pw).

    Returns:
        (r2, c2) heat map.
    """
    r1, c1 = coarse.shape
    grid = coarse_positions.reshape(r1, c1, 2)
    cy = window_centres(grid[:, 0, 0], patch[0], image_hw[0])
    cx = window_centres(grid[0, :, 1], patch[1], image_hw[1])
    fy = window_centres(np.unique(fine_positions[:, 0]), patch[0], image_hw[0])
    fx = window_centres(np.unique(fine_positions[:, 1]), patch[1], image_hw[1])
    cols = np.stack([np.interp(fx, cx, row) for row in coarse])  # (r1, c2)
    return np.stack([np.interp(fy, cy, col) for col in cols.T], axis=1)  # (r2, c2)


def select_cells(upsampled: np.ndarray, fraction: float) -> np.ndarray:
    """(r2, c2) bool: the ``round(fraction * cells)`` cells (at least one) with the largest drops; ties go to
    the earlier cell in row-major order."""
    flat = upsampled.ravel()
    k = max(1, int(round(fraction * flat.size)))
    order = np.argsort(-flat, kind="stable")[:k]
    mask = np.zeros(flat.size, bool)
    mask[order] = True
    return mask.reshape(upsampled.shape)


def coincident_cells(coarse_positions: np.ndarray, fine_positions: np.ndarray) -> np.ndarray:
    """(r2*c2,) index of the stage-one window at the same corner as each fine window, -1 where none: those
    fine cells are the same query, already computed."""
    lookup = {(int(y), int(x)): i for i, (y, x) in enumerate(coarse_positions)}
    return np.array([lookup.get((int(y), int(x)), -1) for y, x in fine_positions], np.int64)


__all__ = ["DrillDown", "coincident_cells", "drill_down_speedup", "grid_shape", "highest_speedup", "select_cells",
           "upsample", "window_centres"]
