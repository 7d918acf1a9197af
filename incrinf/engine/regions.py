"""Box regions: :class:`~incrinf.geometry.Boxes` of one size (one per query), the engine's region for occlusion
batches and for a still camera's change (N = 1): how they grow through a window step, merge, and are cut by
value-based pruning.

Growth through a window and the bounding box of merged inputs are :mod:`incrinf.geometry`'s functions, the same
that analysis and static plans use.
"""

from __future__ import annotations

import numpy as np
import torch

from incrinf.engine.windows import WindowSpec
from incrinf.geometry import Boxes, bounding_axis, largest, local_axis, minimum
from incrinf.kernels.gather import box_rows, from_rows, to_rows


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
