"""Which parts of the current frame the warped previous frame does not explain (CacheInf's change mask).

The frame is cut into a grid of ``cell`` x ``cell`` pixel cells (the last row/column may be smaller). A
cell is *changed* when the mean over its pixels and channels of ``|curr - warped_prev|`` reaches
``pixel_threshold``, or when any of its pixels comes from outside the previous frame. Changed cells are
recomputed; the rest are read from the warped cache.

Defaults (cell 16, threshold 10 on 0-255 pixels) instead of CacheInf's ~40 px cells and threshold 100:
a mean over a cell dilutes a change by the fraction of the cell it covers, so the edge strip of an object
moving 4 px/frame averages ~4/cell of its contrast. With 100 (40% of the range as a cell *average*) such
changes, and even moderate-contrast objects covering half a cell, are reused stale. Measured on
:mod:`~incrinf.testing.synthetic` pan+zoom scenes at 224 px with estimated homographies: with no moving object,
thresholds >= 15 flag nothing but the uncovered border (bilinear resampling and sub-pixel homography error
average < 3 levels per pixel, though single edge pixels reach 40-50); with a moving object, cell 16 /
threshold 15 misses ~100-200 truly changed pixels per frame, cell 32 / threshold 25 ~400-600, cell 8 /
threshold 10 ~20-80. No mean-based setting is exact; lower both for tighter reuse. On a real still-camera
clip (carphone, compression noise) threshold 10 keeps the cached output about as close to full inference as
returning the previous frame's output (15 leaves more stale cells; 8 flags noise in most cells).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from incrinf.engine.frame_regions import cluster_boxes
from incrinf.extras import require
from incrinf.geometry import Box
from incrinf.stream.config import StreamConfig

cv2 = require("cv2", "stream", "camera streams")


@dataclass(frozen=True)
class ChangeMask:
    """Cells of a frame that must be recomputed.

    Attributes:
        cells: (gh, gw) bool, True = changed; ``gh = ceil(H / cell)``, ``gw = ceil(W / cell)``.
        cell: cell side in pixels.
        image_size: (H, W) of the frame.
        cell_diff: (gh, gw) float32 mean absolute difference per cell (in input units; NaN-free).
    """

    cells: np.ndarray
    cell: int
    image_size: tuple[int, int]
    cell_diff: np.ndarray

    @functools.cached_property
    def pixel_mask(self) -> np.ndarray:
        """(H, W) bool, the cell mask upsampled to pixels (True = recompute); computed once."""
        h, w = self.image_size
        up = np.repeat(np.repeat(self.cells, self.cell, axis=0), self.cell, axis=1)
        return up[:h, :w]

    @functools.cached_property
    def recompute_fraction(self) -> float:
        """Changed pixels / all pixels (edge cells count only their pixels inside the frame)."""
        # counted per cell, not over the pixel mask: the same integer count, a few hundred cells instead of H x W
        rows, cols = _cell_sides(self.image_size, self.cell, self.cells.shape)
        h, w = self.image_size
        return int(rows @ self.cells.astype(np.int64) @ cols) / (h * w)

    @property
    def cache_ratio(self) -> float:
        """1 - :attr:`recompute_fraction`: the share of the frame served from the cache."""
        return 1.0 - self.recompute_fraction

    @property
    def changed_cell_fraction(self) -> float:
        """Changed cells / all cells (CacheInf falls back to full inference at >= 0.6)."""
        return float(self.cells.mean())

    def clusters(self) -> list[Box]:
        """Pixel boxes ``(y0, y1, x0, x1)`` of the 8-connected clusters of changed cells (a walker each, where
        walkers are apart), clipped to the frame."""
        return cluster_boxes(self.cells, self.cell, self.image_size)

    def boxes(self) -> list[Box]:
        """Changed cells merged into disjoint rectangles, in pixel coords.

        Each grid row is split into runs of changed cells; a run extends the rectangle above it when that
        rectangle spans exactly the same columns, so blocks of cells become one box.

        Returns:
            ``(y0, y1, x0, x1)`` boxes, end-exclusive, clipped to the frame, ordered by (y0, x0).
        """
        return [self._to_pixels(box) for box in merge_cell_boxes(self.cells)]

    def _to_pixels(self, box: Box) -> Box:
        r0, r1, c0, c1 = box
        h, w = self.image_size
        c = self.cell
        return (r0 * c, min(r1 * c, h), c0 * c, min(c1 * c, w))


def merge_cell_boxes(cells: np.ndarray) -> list[Box]:
    """Cover the True entries of a bool grid with disjoint rectangles (row runs merged vertically).

    Args:
        cells: (gh, gw) bool.

    Returns:
        ``(r0, r1, c0, c1)`` boxes in grid units, end-exclusive, ordered by (r0, c0).
    """
    done: list[Box] = []
    open_boxes: dict[tuple[int, int], int] = {}  # (c0, c1) -> first row of a box still growing
    for r, row in enumerate(np.asarray(cells, dtype=bool)):
        padded = np.concatenate([[False], row, [False]])
        edges = np.flatnonzero(padded[1:] != padded[:-1])
        runs = set(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))
        for span in list(open_boxes):
            if span not in runs:
                done.append((open_boxes.pop(span), r, *span))
        for span in runs:
            open_boxes.setdefault(span, r)
    done.extend((r0, len(cells), *span) for span, r0 in open_boxes.items())
    return sorted(done, key=lambda b: (b[0], b[2]))


def _as_hwc(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    """(H, W, C) float64 tensor from a numpy (H, W) / (H, W, C) array or a tensor (H, W) / (C, H, W) /
    (1, C, H, W) (tensors are channel-first, as in PyTorch)."""
    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu", torch.float64)
        if t.ndim == 4:
            if t.shape[0] != 1:
                raise ValueError(f"expected a single frame, got batch of {t.shape[0]}")
            t = t[0]
        if t.ndim == 3:
            t = t.permute(1, 2, 0)
    else:
        # float64 so means of integer pixels compare exactly against thresholds like 25.
        t = torch.from_numpy(np.asarray(x, dtype=np.float64))
    if t.ndim == 2:
        t = t[:, :, None]
    if t.ndim != 3:
        raise ValueError(f"expected a (H, W) or (H, W, C) frame, got shape {tuple(x.shape)}")
    return t


def _cell_sums(values: np.ndarray, cell: int) -> tuple[np.ndarray, np.ndarray]:
    """Sum (float64, over channels too) and pixel count of (H, W) or (H, W, C) values over each ``cell`` x
    ``cell`` block (edge blocks may be smaller; unlike AdaptiveAvgPool's overlapping bins, blocks never
    overlap)."""
    h, w = values.shape[:2]
    gh, gw = -(-h // cell), -(-w // cell)
    if (gh * cell, gw * cell) != (h, w):
        padded = np.zeros((gh * cell, gw * cell, *values.shape[2:]), values.dtype)
        padded[:h, :w] = values
        values = padded
    if values.dtype == np.uint8 and cell * cell * _channels(values) * 255 < 2 ** 31:
        # a stream's frames: cv2 sums each cell row's bytes into int32 (exact; about 6x numpy's strided int64 sum)
        rows_sums = cv2.reduce(values.reshape(gh * cell * gw, -1), 1, cv2.REDUCE_SUM, dtype=cv2.CV_32S)
        sums = rows_sums.reshape(gh, cell, gw).sum(axis=1, dtype=np.int64).astype(np.float64)
    else:
        # one pass: integer sums are exact, float64 keeps ties with the threshold exact for the float path
        dtype = np.int64 if values.dtype.kind in "ub" else np.float64
        sums = values.reshape(gh, cell, gw, -1).sum(axis=(1, 3), dtype=dtype).astype(np.float64)
    rows, cols = _cell_sides((h, w), cell, (gh, gw))
    return sums, np.outer(rows, cols).astype(np.float64)


def _cell_sides(size: tuple[int, int], cell: int, grid: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Pixels inside an (H, W) frame of each row and each column of its (gh, gw) grid of ``cell``-pixel cells
    ((gh,) and (gw,) int: ``cell`` but at the far edges)."""
    (h, w), (gh, gw) = size, grid
    return np.minimum(cell, h - np.arange(gh) * cell), np.minimum(cell, w - np.arange(gw) * cell)


def _channels(values: np.ndarray) -> int:
    return int(np.prod(values.shape[2:], dtype=np.int64))


def _both_uint8(a: object, b: object) -> bool:
    return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == np.uint8
            and b.dtype == np.uint8 and a.shape == b.shape and a.ndim in (2, 3))


def change_mask(
    curr: np.ndarray | torch.Tensor,
    warped_prev: np.ndarray | torch.Tensor,
    cell: int = StreamConfig.cell,
    pixel_threshold: float = StreamConfig.pixel_threshold,
    valid: np.ndarray | torch.Tensor | None = None,
) -> ChangeMask:
    """Mark the cells where the warped previous frame differs from the current one.

    ``diff[cell] = mean over the cell's pixels and channels of |curr - warped_prev|``; a cell is changed
    when ``diff >= pixel_threshold`` (so ``pixel_threshold=0`` marks every cell), or when it holds any pixel with
    ``valid == False``.

    Args:
        curr: current frame, numpy (H, W) / (H, W, C) or tensor (H, W) / (C, H, W) / (1, C, H, W); uint8 or
            float.
        warped_prev: previous frame warped into the current view (e.g.
            :func:`~incrinf.stream.warp.warp_image`), same layout and size as ``curr``.
        cell: cell side in pixels.
        pixel_threshold: in the inputs' units (0-255 for uint8 frames; divide by 255 for [0, 1] floats).
        valid: optional (H, W) bool, False where the warp read from outside the previous frame
            (:func:`~incrinf.stream.warp.warp_valid_mask`).

    Returns:
        A :class:`ChangeMask`.
    """
    if cell < 1:
        raise ValueError(f"cell must be >= 1, got {cell}")
    if _both_uint8(curr, warped_prev):
        # a stream's frames: integer arithmetic (exact like float64, several times faster)
        h, w = curr.shape[:2]
        n_channels = curr.shape[2] if curr.ndim == 3 else 1
        diff_u8 = cv2.absdiff(curr, warped_prev)
        sums, counts = _cell_sums(diff_u8, cell)
    else:
        a, b = _as_hwc(curr), _as_hwc(warped_prev)
        if a.shape != b.shape:
            raise ValueError(f"frames differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
        h, w = a.shape[:2]
        n_channels = a.shape[2]
        sums, counts = _cell_sums((a - b).abs().sum(dim=2).numpy(), cell)
    # Compare sums, not means: integer pixel sums are exact in float64, so ties with the threshold are exact.
    cells = sums >= pixel_threshold * counts * n_channels
    diff = sums / (counts * n_channels)
    if valid is not None:
        valid_np = np.asarray(valid.cpu() if isinstance(valid, torch.Tensor) else valid).astype(bool)
        if valid_np.shape != (h, w):
            raise ValueError(f"valid mask has shape {valid_np.shape}, frame is {(h, w)}")
        cells |= _cell_sums(~valid_np, cell)[0] > 0
    return ChangeMask(
        cells=cells,
        cell=cell,
        image_size=(h, w),
        cell_diff=diff.astype(np.float32),
    )
