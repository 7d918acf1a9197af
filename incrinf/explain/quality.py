"""Heat-map quality: SSIM of an approximate heat map against the exact one, the SSIM a sampled error predicts,
and Krypton's measure (SSIM of the rendered overlays). One window rule and one data-range rule for all of them.

SSIM here is scikit-image's ``structural_similarity`` over the grid's axes (1, 2 or 3) with a 7-wide window (or
the largest odd width that fits a smaller grid), and ``data_range`` the exact map's max - min: the same absolute
error counts the same whatever the approximation does to its own range.
"""

from __future__ import annotations

import numpy as np

# SSIM's window width along each grid axis (scikit-image's default), cut to the grid when it is smaller.
SSIM_WINDOW = 7


def ssim_window(shape: tuple[int, ...]) -> int:
    """The SSIM window width for a grid of ``shape``: :data:`SSIM_WINDOW`, or the largest odd width that fits
    (under 3: the grid is too small for SSIM)."""
    side = min(shape)
    return min(SSIM_WINDOW, side if side % 2 else side - 1)


def ssim_data_range(exact: np.ndarray, approx: np.ndarray) -> float:
    """The exact map's max - min; for a flat exact map, the approximation's largest departure from it."""
    data_range = float(exact.max() - exact.min())
    if data_range <= 0.0:
        data_range = max(float(np.abs(approx - exact).max()), 1e-12)
    return data_range


def grid_ssim(exact: np.ndarray, approx: np.ndarray) -> float | None:
    """SSIM of an approximate heat map against the exact one over a grid of 1, 2 or 3 axes; None for a grid
    under 3 cells along an axis.

    Args:
        exact: ``(*grid)`` exact heat map.
        approx: ``(*grid)`` approximate heat map on the same grid.

    Raises:
        ValueError: the shapes differ.
    """
    from skimage.metrics import structural_similarity

    exact = np.asarray(exact, np.float64)
    approx = np.asarray(approx, np.float64)
    if exact.shape != approx.shape:
        raise ValueError(f"heat maps must have one shape, got {exact.shape} and {approx.shape}")
    if np.array_equal(exact, approx):
        return 1.0
    win = ssim_window(exact.shape)
    if win < 3:
        return None
    return float(structural_similarity(exact, approx, win_size=win, data_range=ssim_data_range(exact, approx)))


def heatmap_ssim(exact: np.ndarray, approx: np.ndarray) -> float:
    """SSIM of an approximate 2-D heat map against the exact one (:func:`grid_ssim`, strict about the shape).

    Args:
        exact: (rows, cols) exact heat map.
        approx: (rows, cols) approximate heat map on the same grid.

    Returns:
        SSIM in [-1, 1]; 1 for identical maps.

    Raises:
        ValueError: shapes differ, or the grid is smaller than 3x3.
    """
    exact = np.asarray(exact, np.float64)
    approx = np.asarray(approx, np.float64)
    if exact.shape != approx.shape or exact.ndim != 2:
        raise ValueError(f"heat maps must be 2-D and of one shape, got {exact.shape} and {approx.shape}")
    ssim = grid_ssim(exact, approx)
    if ssim is None:
        raise ValueError(f"SSIM needs a heat map of at least 3x3 cells, got {exact.shape[0]}x{exact.shape[1]}")
    return ssim


def map_ssim(exact: np.ndarray, approx: np.ndarray, every_class: bool = False, features: bool = False
             ) -> float | None:
    """SSIM of an approximate occlusion map against the exact one: the mean over the classes of
    ``target="all"``; None for feature maps (no neighbourhoods) and grids under 3 cells along an axis.

    Args:
        exact, approx: ``(*grid)`` heat maps, or ``(K, *grid)`` with ``every_class``.
        every_class: the maps hold one map per class.
        features: the maps hold one value per feature.
    """
    if features:
        return None
    pairs = zip(exact, approx) if every_class else [(exact, approx)]
    values = [grid_ssim(e, a) for e, a in pairs]
    return None if any(v is None for v in values) else float(np.mean(values))


def estimated_ssim(approx: np.ndarray, error_power: float) -> float:
    """The SSIM against the exact map that an approximate map would have if its error were noise of power
    ``error_power`` (mean squared error, e.g. measured on a few cells recomputed exactly), uncorrelated with the
    map: per window, SSIM's contrast-structure term ``(2 s^2 + C2) / (2 s^2 + e + C2)``, ``s^2`` the exact map's
    variance there (the approximate map's less ``e``; the luminance term is about 1: the error has no mean).

    Args:
        approx: ``(*grid)`` approximate heat map over 1, 2 or 3 grid axes.
        error_power: mean squared error of the approximation.

    Returns:
        The estimate, the mean over windows as :func:`grid_ssim` takes it; NaN for a grid under 3 cells along
        an axis.
    """
    from scipy.ndimage import uniform_filter

    win = ssim_window(approx.shape)
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


def overlay_ssim(exact_overlay: np.ndarray, approx_overlay: np.ndarray) -> float:
    """Krypton's quality measure: SSIM of two rendered heat-map overlays (H, W, 3) images in [0, 1] or uint8,
    channels compared separately, data range that of the image type (1 or 255).

    Raises:
        ValueError: the images differ in shape or are not (H, W, 3).
    """
    from skimage.metrics import structural_similarity

    if exact_overlay.shape != approx_overlay.shape or exact_overlay.ndim != 3 or exact_overlay.shape[2] != 3:
        raise ValueError(f"overlays must be two (H, W, 3) images of one shape, got {exact_overlay.shape} and "
                         f"{approx_overlay.shape}")
    data_range = 255.0 if exact_overlay.dtype == np.uint8 else 1.0
    return float(structural_similarity(np.asarray(exact_overlay, np.float64), np.asarray(approx_overlay, np.float64),
                                       channel_axis=2, data_range=data_range))


__all__ = ["SSIM_WINDOW", "estimated_ssim", "grid_ssim", "heatmap_ssim", "map_ssim", "overlay_ssim",
           "ssim_data_range", "ssim_window"]
