"""Box regions: N update boxes of one size (one per query), the engine's region for occlusion batches and for a
still camera's change (N = 1).

Per spatial axis a box has a first element ``lo`` and an extent ``size``; ``lo`` is an (N,) array for a batch,
or a plain int for a single box (numpy would cost more than the operators on a camera frame's small crops).
Growth through a window and the bounding box of merged inputs are :mod:`incrinf.geometry`'s functions, the same
that analysis and static plans use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from incrinf.engine.windows import Bounds, WindowSpec, box_rows
from incrinf.geometry import bounding_axis, largest, local_axis, minimum
from incrinf.kernels.gather import from_rows, to_rows


@dataclass
class Boxes:
    """N boxes of one size and their values.

    Attributes:
        lo: per spatial axis, the first element of each box (an (N,) int64 array, or an int for one box).
        size: per spatial axis, the boxes' extent.
        values: (N, C..., *size) the new values inside the boxes (None until computed).
    """

    lo: tuple[Any, ...]
    size: tuple[int, ...]
    values: torch.Tensor | None = None

    @property
    def single(self) -> bool:
        """One box (a camera frame's change) rather than a batch."""
        return not isinstance(self.lo[0], np.ndarray)

    @property
    def n(self) -> int:
        return 1 if self.single else len(self.lo[0])

    @property
    def area(self) -> int:
        """Elements of one box."""
        return math.prod(self.size)

    @property
    def bounds(self) -> Bounds:
        """``(lo0, hi0, lo1, hi1, ...)`` of a single box."""
        out: list[int] = []
        for lo, size in zip(self.lo, self.size):
            out.extend((int(lo), int(lo) + size))
        return tuple(out)

    def start(self) -> np.ndarray:
        """(N, d) first corners."""
        return np.stack([np.broadcast_to(np.asarray(lo, np.int64), (self.n,)) for lo in self.lo], axis=1)

    def same_place(self, other: Boxes) -> bool:
        """Whether both hold the same boxes (their values may differ)."""
        return self.size == other.size and all(
            np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(self.lo, other.lo))

    def covers(self, dims: tuple[int, ...], share: float = 1.0) -> bool:
        """Whether a box covers at least ``share`` of a map of extents ``dims``."""
        return self.area >= share * math.prod(dims)


def grow(boxes: Boxes, spec: WindowSpec, out_dims: tuple[int, ...], tau: float = 1.0, quantum: int = 1) -> Boxes:
    """The outputs of a window step that ``boxes`` (in its source) reaches: Krypton's equations per axis.

    Args:
        boxes: the changed boxes of the window's source.
        spec: the window.
        out_dims: the output's spatial extents.
        tau: projective field threshold: below 1 an output box is capped at ``round(tau * extent)``, centred on
            the change (:func:`incrinf.geometry.local_axis`). The capped outputs still read the whole incoming
            change inside their windows: the seed also cropped the incoming box to the part whose every read lies
            in the cap (``cap * stride - kernel + 1`` elements, one or two on a 7x7 map), which threw most of the
            change away at no saving (the output box, hence the FLOPs, are the same).
        quantum: round box sides up to multiples of this (oneDNN builds a kernel per input shape; a few recurring
            shapes reuse them).

    Returns:
        The output boxes, without values.
    """
    lo, size = [], []
    for a, dim in enumerate(out_dims):
        out_lo, out_size, *_ = local_axis(boxes.lo[a], boxes.size[a], spec.extent[a], spec.stride[a], spec.offset[a],
                                          dim, tau)
        out_size = largest(out_size)
        if quantum > 1:
            out_size = min(dim, -(-out_size // quantum) * quantum)
            out_lo = minimum(out_lo, dim - out_size)
        lo.append(out_lo)
        size.append(out_size)
    return Boxes(tuple(lo), tuple(size))


def union(regions: list[Boxes], dims: tuple[int, ...]) -> Boxes:
    """Per query, the bounding box of several boxes (one size for the batch), inside ``dims``."""
    if len(regions) == 1:
        return Boxes(regions[0].lo, regions[0].size)
    lo, size = [], []
    for a, dim in enumerate(dims):
        out_lo, out_size = bounding_axis([r.lo[a] for r in regions], [r.size[a] for r in regions], dim, True)
        lo.append(out_lo)
        size.append(largest(out_size))
    return Boxes(tuple(lo), tuple(size))


def cut(boxes: Boxes, keep: np.ndarray, quantum: int = 1) -> Boxes | None:
    """``boxes`` cut to the bounding box of the positions ``keep`` marks (value-based pruning).

    Args:
        boxes: boxes with values.
        keep: (N, *size) bool, positions whose values changed enough to matter.
        quantum: round the cut sides up to multiples of this (pruned boxes vary with the data; oneDNN builds a
            kernel per input shape, and a few recurring shapes reuse them).

    Returns:
        The smallest boxes of one size holding every kept position (values cropped from ``boxes``); queries with
        nothing kept keep a box of that size whose values are cropped from their own (their change may go on
        spreading through it, which only costs work); None when no query keeps anything.
    """
    d = len(boxes.size)
    if not keep.any():
        return None
    lo, size = [], []
    for a in range(d):
        along = keep.any(axis=tuple(i + 1 for i in range(d) if i != a))  # (N, size[a])
        has = along.any(axis=1)
        first = np.where(has, along.argmax(axis=1), 0)
        last = np.where(has, boxes.size[a] - along[:, ::-1].argmax(axis=1), 1)
        extent = min(boxes.size[a], -(-int((last - first).max()) // quantum) * quantum)
        lo.append(np.minimum(first, boxes.size[a] - extent))
        size.append(extent)
    if tuple(size) == boxes.size:
        return boxes
    values = boxes.values
    if boxes.single:
        sl = tuple(slice(int(f[0]), int(f[0]) + e) for f, e in zip(lo, size))
        return Boxes(tuple(int(lo_a) + int(f[0]) for lo_a, f in zip(boxes.lo, lo)), tuple(size),
                     values[(..., *sl)])
    # one gather of the kept part of every query's box, as rows (positions by channels)
    index = box_rows(np.stack(lo, axis=1), tuple(size), boxes.size, batch_stride=boxes.area)
    channels = tuple(values.shape[1:values.dim() - d])
    rows = to_rows(values, d).index_select(0, torch.from_numpy(index).to(values.device))
    return Boxes(tuple(lo_a + f for lo_a, f in zip(boxes.lo, lo)), tuple(size),
                 from_rows(rows, boxes.n, tuple(size), channels))
