"""Pixel-level views of heat maps for a dataset run: pixel maps, colour overlays, masks, per-class means.

All pictures are (H, W) or (H, W, 3) arrays aligned with the model's input crop.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def pixel_map(heatmap: np.ndarray, positions: np.ndarray, patch: tuple[int, int], image_shape: tuple[int, int]
              ) -> np.ndarray:
    """(H, W) mean heat of the windows covering each pixel; equals :meth:`incrinf.OcclusionResult.pixel_map`.

    Vectorised with summed-area tables (the method's loop over thousands of windows takes 10-50 ms per map).

    Args:
        heatmap: (rows, cols) values, row-major over ``positions``.
        positions: (rows*cols, 2) window corners (y, x); windows may reach past the image (clipped).
        patch: (h, w) window size. image_shape: (H, W).
    """
    h, w = image_shape
    ys, xs = positions[:, 0], positions[:, 1]
    y1, x1 = np.minimum(ys + patch[0], h), np.minimum(xs + patch[1], w)
    values = np.asarray(heatmap, np.float64).ravel()

    def cover(weights: np.ndarray) -> np.ndarray:
        corners = np.zeros((h + 1, w + 1), np.float64)
        np.add.at(corners, (ys, xs), weights)
        np.add.at(corners, (ys, x1), -weights)
        np.add.at(corners, (y1, xs), -weights)
        np.add.at(corners, (y1, x1), weights)
        return corners.cumsum(0).cumsum(1)[:h, :w]

    total = cover(values)
    count = np.rint(cover(np.ones_like(values)))  # integer counts; rint drops cumsum round-off
    return np.divide(total, count, out=np.zeros((h, w)), where=count > 0)


def grid_positions(grid: tuple[int, int], stride: tuple[int, int]) -> np.ndarray:
    """(rows*cols, 2) corners of a regular occlusion grid, row-major (the layout of every heat map)."""
    rows, cols = grid
    ys, xs = np.meshgrid(np.arange(rows) * stride[0], np.arange(cols) * stride[1], indexing="ij")
    return np.stack([ys.ravel(), xs.ravel()], axis=1).astype(np.int64)


def heat_colours(pixel: np.ndarray, vmax: float | None = None) -> np.ndarray:
    """(H, W, 3) uint8 jet colours of the positive heat (drops), 0 to ``vmax`` (default: the map's maximum)."""
    from matplotlib import colormaps

    top = float(vmax if vmax is not None else pixel.max())
    scaled = np.clip(pixel / top, 0.0, 1.0) if top > 0 else np.zeros_like(pixel)
    return (colormaps["jet"](scaled)[..., :3] * 255).round().astype(np.uint8)


def blend(image: np.ndarray, pixel: np.ndarray, alpha: float = 0.5) -> np.ndarray:
    """(H, W, 3) uint8 heat colours over ``image`` (uint8), as the overlay PNG draws them."""
    mixed = (1 - alpha) * image.astype(np.float32) + alpha * heat_colours(pixel).astype(np.float32)
    return mixed.round().astype(np.uint8)


def thumbnail(picture: np.ndarray, size: int = 160) -> np.ndarray:
    """``picture`` scaled so that its longer side is at most ``size`` (antialiased)."""
    from PIL import Image

    h, w = picture.shape[:2]
    if max(h, w) <= size:
        return picture
    scale = size / max(h, w)
    img = Image.fromarray(picture).resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.LANCZOS)
    return np.asarray(img)


def load_mask(path: Path, normalization: str, size: int) -> np.ndarray:
    """(size, size) bool mask aligned with the model's input: resized and cropped as the image was.

    Any non-black pixel is inside. Runs the image's own preprocessing (so the geometry cannot drift from it)
    and thresholds the result at half.
    """
    from incrinf import models
    from incrinf.explain.dataset.inputs import decode_rgb

    rgb = decode_rgb(Path(path).read_bytes(), str(path))
    binary = (rgb.max(axis=2) > 0).astype(np.float32)
    x = models.preprocess(np.repeat(binary[..., None], 3, axis=2), normalization, size=size)
    return models.unnormalize(x, normalization).mean(axis=2) > 0.5


def inside_share(pixel: np.ndarray, mask: np.ndarray) -> float | None:
    """Share of the positive heat (drops) that falls inside ``mask``; None when there is no positive heat."""
    positive = np.clip(pixel, 0.0, None)
    total = float(positive.sum())
    if total <= 0:
        return None
    return float(positive[mask].sum() / total)


@dataclass(frozen=True)
class ClassMean:
    """Mean pixel map of the inputs explained for one class (with the same input size).

    Attributes:
        target: the class. count: inputs averaged. picture: file name of its PNG (relative to the run's folder).
        peak: the mean map's maximum (the colour scale's top).
    """

    target: int
    count: int
    picture: str
    peak: float


def class_means(maps: Iterable[tuple[int, np.ndarray]], out_dir: Path, write_png) -> list[ClassMean]:
    """Average pixel maps per class and write one picture per class.

    Args:
        maps: (target, pixel map) pairs; maps whose shape differs from the class's first are left out (only
            aligned images are averaged).
        out_dir: the run's folder; pictures go to ``stats/class-<target>.png``.
        write_png: ``write_png(path, rgb_array)``, an atomic writer.
    """
    sums: dict[int, np.ndarray] = {}
    counts: dict[int, int] = {}
    for target, pixel in maps:
        if target not in sums:
            sums[target] = np.zeros_like(pixel, np.float64)
            counts[target] = 0
        if pixel.shape != sums[target].shape:
            continue
        sums[target] += pixel
        counts[target] += 1
    means = []
    for target in sorted(sums):
        mean = sums[target] / counts[target]
        name = f"stats/class-{target}.png"
        write_png(out_dir / name, heat_colours(mean))
        means.append(ClassMean(target, counts[target], name, float(mean.max())))
    return means
