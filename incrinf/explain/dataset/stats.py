"""Pixel-level views of heat maps for a dataset run: pixel maps, colour overlays, masks, per-class means.

All pictures are (H, W) or (H, W, 3) arrays aligned with the model's input crop.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def pixel_map(heatmap: np.ndarray, positions: np.ndarray, patch: tuple[int, ...], image_shape: tuple[int, ...]
              ) -> np.ndarray:
    """(*image_shape) mean heat of the windows covering each element; equals
    :meth:`incrinf.OcclusionResult.pixel_map`, for images (H, W) and volumes (D, H, W) alike.

    Vectorised with summed-area tables (the method's loop over thousands of windows takes 10-50 ms per map): each
    window adds its value at its 2^d corners with alternating signs, and cumulative sums along every axis spread
    it over exactly the window.

    Args:
        heatmap: (*grid) values, row-major over ``positions``.
        positions: (prod(grid), d) window corners; windows may reach past the input (clipped).
        patch: (d,) window size. image_shape: (d,) spatial extents.
    """
    import itertools

    shape = tuple(int(v) for v in image_shape)
    starts = [positions[:, axis] for axis in range(len(shape))]
    ends = [np.minimum(positions[:, axis] + patch[axis], shape[axis]) for axis in range(len(shape))]
    values = np.asarray(heatmap, np.float64).ravel()

    def cover(weights: np.ndarray) -> np.ndarray:
        corners = np.zeros(tuple(n + 1 for n in shape), np.float64)
        for upper in itertools.product((False, True), repeat=len(shape)):
            index = tuple(end if up else start for up, start, end in zip(upper, starts, ends))
            np.add.at(corners, index, -weights if sum(upper) % 2 else weights)
        for axis in range(len(shape)):
            corners = corners.cumsum(axis)
        return corners[tuple(slice(0, n) for n in shape)]

    total = cover(values)
    count = np.rint(cover(np.ones_like(values)))  # integer counts; rint drops cumsum round-off
    return np.divide(total, count, out=np.zeros(shape), where=count > 0)


def grid_positions(grid: tuple[int, ...], stride: tuple[int, ...]) -> np.ndarray:
    """(prod(grid), d) corners of a regular occlusion grid, row-major (the layout of every heat map)."""
    axes = np.meshgrid(*[np.arange(n) * s for n, s in zip(grid, stride)], indexing="ij")
    return np.stack([a.ravel() for a in axes], axis=1).astype(np.int64)


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
    """Mean pixel (or voxel) map of the inputs explained for one class (with the same input size).

    Attributes:
        target: the class. count: inputs averaged. picture: file name of its PNG (relative to the run's folder;
            a montage of slices for volumes). peak: the mean map's maximum (the colour scale's top).
        volume: volumes only: the mean as a NIfTI file (relative name), with the affine of the class's first scan.
    """

    target: int
    count: int
    picture: str
    peak: float
    volume: str | None = None


def class_means(maps: Iterable[tuple[int, np.ndarray, np.ndarray | None]], out_dir: Path, write_png,
                write_volume=None) -> list[ClassMean]:
    """Average pixel (voxel) maps per class and write one picture per class (and, for volumes, a NIfTI file).

    The mean is taken element by element, so it means something for inputs on one grid: images cropped to one
    size, or scans registered to one template (a class's scans of another shape are left out).

    Args:
        maps: (target, pixel map, affine) triples: (H, W) maps with affine None, or (D, H, W) maps with the
            (4, 4) affine of their scan's grid.
        out_dir: the run's folder; pictures go to ``stats/class-<target>.png``, volumes to
            ``stats/class-<target>.nii.gz``.
        write_png: ``write_png(path, rgb_array)``, an atomic writer.
        write_volume: ``write_volume(path, values, affine)``, an atomic NIfTI writer (needed for volumes).
    """
    from incrinf.explain.dataset.volumes import heat_montage

    sums: dict[int, np.ndarray] = {}
    counts: dict[int, int] = {}
    affines: dict[int, np.ndarray | None] = {}
    for target, pixel, affine in maps:
        if target not in sums:
            sums[target] = np.zeros_like(pixel, np.float64)
            counts[target] = 0
            affines[target] = affine
        if pixel.shape != sums[target].shape:
            continue
        sums[target] += pixel
        counts[target] += 1
    means = []
    for target in sorted(sums):
        mean = sums[target] / counts[target]
        name = f"stats/class-{target}.png"
        volume = None
        if mean.ndim == 3:
            write_png(out_dir / name, heat_montage(heat_colours(mean)))
            volume = f"stats/class-{target}.nii.gz"
            write_volume(out_dir / volume, mean, affines[target])
        else:
            write_png(out_dir / name, heat_colours(mean))
        means.append(ClassMean(target, counts[target], name, float(mean.max()), volume))
    return means
