"""Rectangular update regions for still-camera frames: box algebra and padded crops.

When the camera does not move, every cached map is read in place, so a frame's change can be carried
through the local part as one rectangle per tensor (its bounding box) instead of a set of positions. Each
operator then runs densely on a crop of its merged input (a view: no index tables, no gathers) and its output
is written back into the cache with one slice copy. That trades the few positions a rectangle covers in vain
for far fewer, larger operator calls, which is what a CPU's per-call overhead rewards when the change is one
compact region (a person moving in front of a still camera).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # pragma: no cover
    from incrinf.stream.sparse import _Window

Bounds = tuple[int, int, int, int]  # y0, y1, x0, x1 (half-open)


@dataclass
class Box:
    """The changed rectangle of one tensor in this frame and its new values.

    Attributes:
        bounds: (y0, y1, x0, x1), rows y0:y1 and columns x0:x1 of the tensor's map; empty when y0 >= y1.
        values: (1, C, y1 - y0, x1 - x0) the new values there (None when empty).
    """

    bounds: Bounds
    values: torch.Tensor | None = None

    @property
    def empty(self) -> bool:
        y0, y1, x0, x1 = self.bounds
        return y0 >= y1 or x0 >= x1

    @property
    def area(self) -> int:
        y0, y1, x0, x1 = self.bounds
        return 0 if self.empty else (y1 - y0) * (x1 - x0)

    def mask(self, hw: tuple[int, int]) -> np.ndarray:
        """(h, w) bool: True inside the box."""
        out = np.zeros(hw, bool)
        if not self.empty:
            y0, y1, x0, x1 = self.bounds
            out[y0:y1, x0:x1] = True
        return out


EMPTY: Bounds = (0, 0, 0, 0)


def bounding_box(mask: np.ndarray) -> Bounds:
    """Bounds of the True entries of an (h, w) bool mask (:data:`EMPTY` when there are none)."""
    rows = np.flatnonzero(mask.any(axis=1))
    if not len(rows):
        return EMPTY
    cols = np.flatnonzero(mask.any(axis=0))
    return int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1


def union(bounds: list[Bounds]) -> Bounds:
    """Smallest box containing every non-empty box of ``bounds``."""
    live = [b for b in bounds if b[0] < b[1] and b[2] < b[3]]
    if not live:
        return EMPTY
    return (min(b[0] for b in live), max(b[1] for b in live), min(b[2] for b in live), max(b[3] for b in live))


def grow_bounds(bounds: Bounds, win: _Window, out_hw: tuple[int, int]) -> Bounds:
    """Output positions of a window operator whose window overlaps the source box ``bounds``.

    An output ``o`` reads source rows ``o * stride - offset`` to ``o * stride - offset + extent - 1``, so it
    overlaps rows ``y0:y1`` when ``(y0 + offset - extent + 1) / stride <= o <= (y1 - 1 + offset) / stride``.
    Dilated kernels are treated as dense (a superset: recomputing extra positions stays exact).
    """
    out = []
    for (lo, hi), stride, extent, offset, size in zip(((bounds[0], bounds[1]), (bounds[2], bounds[3])), win.stride,
                                                      win.extent, win.offset, out_hw):
        first = max(0, -(-(lo + offset - extent + 1) // stride))
        last = min(size, (hi - 1 + offset) // stride + 1)
        out.extend((first, last))
    y0, y1, x0, x1 = out
    return (y0, y1, x0, x1) if y0 < y1 and x0 < x1 else EMPTY


def round_up(bounds: Bounds, hw: tuple[int, int], quantum: int) -> Bounds:
    """``bounds`` grown to sides that are multiples of ``quantum`` (or the whole axis), staying inside ``hw``.

    oneDNN builds (JIT-compiles) a kernel per input shape and caches it: boxes of a few recurring sizes reuse
    those kernels, where exact sizes would make nearly every frame's shapes new (about as costly as the
    convolution itself on a small box).
    """
    if bounds == EMPTY or quantum <= 1:
        return bounds
    out = []
    for lo, hi, size in ((bounds[0], bounds[1], hw[0]), (bounds[2], bounds[3], hw[1])):
        n = min(size, -(-(hi - lo) // quantum) * quantum)
        hi = min(size, lo + n)
        out.extend((hi - n, hi))
    return out[0], out[1], out[2], out[3]


def padded_crop(source: torch.Tensor, bounds: Bounds, win: _Window) -> torch.Tensor:
    """The read-in window of the output box ``bounds``: a crop of ``source`` (1, C, hs, ws), padded where it
    reaches beyond the map (first the PAD views' border value, then the operator's own padding value).

    Returns:
        (1, C, (y1 - y0 - 1) * sy + ky, (x1 - x0 - 1) * sx + kx) ready for the operator with padding 0.
    """
    hs, ws = source.shape[-2:]
    (sy, sx), (ky, kx), (oy, ox) = win.stride, win.extent, win.offset
    r0, r1 = bounds[0] * sy - oy, (bounds[1] - 1) * sy - oy + ky
    c0, c1 = bounds[2] * sx - ox, (bounds[3] - 1) * sx - ox + kx
    crop = source[:, :, max(r0, 0):min(r1, hs), max(c0, 0):min(c1, ws)]
    need = (max(0, -r0), max(0, r1 - hs), max(0, -c0), max(0, c1 - ws))  # top, bottom, left, right
    if not any(need):
        return crop
    view = tuple(min(n, v) for n, v in zip(need, win.view))
    own = tuple(n - v for n, v in zip(need, view))
    if any(view):
        crop = F.pad(crop, (view[2], view[3], view[0], view[1]), value=win.view_value)
    if any(own):
        crop = F.pad(crop, (own[2], own[3], own[0], own[1]), value=win.pad_value)
    return crop
