"""The read-in windows of a sliding-window step, in the coordinates of the tensor it reads.

Constant-padding nodes that feed only windows (EfficientNet's "static same" padding) are not run: a window
reads their source with their padding as a *view* in front of its own. A window's padded source is therefore
``source`` padded first by the views' value, then by the operator's own padding value; :func:`padded_map`
builds it whole, :func:`padded_crop` only around one output box (a view of the source where no padding is
needed), and :func:`padded_rows` as a row table for gathers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from incrinf.geometry import Box
from incrinf.graph import Graph, Node, NodeKind, Operator
from incrinf.kernels.gather import to_rows


@dataclass
class WindowSpec:
    """A sliding-window step's geometry in its source's coordinates (padding views resolved).

    Attributes:
        source: the tensor the window reads (behind any padding views).
        offset: (d,) padding before the first element: views plus the operator's own (source coord =
            ``out * stride + tap - offset``).
        view_before, view_after: (d,) extent of the padding views around the source.
        view_value: value of the views' border.
        pad_value: value of the operator's own padding, outside the views.
        own_after: (d,) the operator's own padding after the views.
        extent: (d,) effective kernel extent.
        stride: (d,) stride.
        dilation: (d,) dilation.
        cheap: a pool or depthwise convolution (about one multiply-add per element and tap).
    """

    source: str
    offset: tuple[int, ...]
    view_before: tuple[int, ...]
    view_after: tuple[int, ...]
    view_value: float
    pad_value: float
    own_after: tuple[int, ...]
    extent: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    cheap: bool
    tables: dict = field(default_factory=dict, repr=False)  # per block size, built once (see block_table)

    @property
    def pads(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """``(view_before, view_after, own_before, own_after)`` per axis."""
        own_before = tuple(o - v for o, v in zip(self.offset, self.view_before))
        return self.view_before, self.view_after, own_before, self.own_after

    def read_size(self, out_size: tuple[int, ...]) -> tuple[int, ...]:
        """Read-in window extent of ``out_size`` outputs."""
        return tuple((n - 1) * s + e for n, s, e in zip(out_size, self.stride, self.extent))


def window_spec(graph: Graph, node: Node) -> WindowSpec:
    """The :class:`WindowSpec` of a LOCAL node, reading through any chain of padding nodes in front of it."""
    g = node.geometry
    d = graph.spatial_dims
    source = node.inputs[0]
    before, after = [0] * d, [0] * d
    view_value = 0.0
    while graph.by_name[source].kind == NodeKind.PAD:
        pad = graph.by_name[source]
        in_dims = graph.by_name[pad.inputs[0]].shape[-d:]
        for a in range(d):
            before[a] += pad.shift[a]
            after[a] += pad.shape[-d + a] - in_dims[a] - pad.shift[a]
        view_value = pad.pad_value
        source = pad.inputs[0]
    cheap = node.operator in (Operator.MAX_POOL, Operator.AVG_POOL, Operator.ADAPTIVE_MAX_POOL,
                              Operator.ADAPTIVE_AVG_POOL) or node.is_depthwise
    return WindowSpec(source, tuple(b + p for b, p in zip(before, g.pad_before)), tuple(before), tuple(after),
                      view_value, g.pad_value, tuple(g.pad_after), tuple(g.kernel), tuple(g.stride),
                      tuple(g.dilation), cheap)


def _pad_args(before: tuple[int, ...], after: tuple[int, ...]) -> list[int]:
    """``F.pad``'s argument: (before, after) pairs from the last axis backwards."""
    out: list[int] = []
    for b, a in zip(reversed(before), reversed(after)):
        out.extend((b, a))
    return out


def padded_map(spec: WindowSpec, source: torch.Tensor) -> torch.Tensor:
    """The whole source (N, C, *dims) padded for the window: views' value first, then the operator's own."""
    view_before, view_after, own_before, own_after = spec.pads
    return pad_map(source, view_before, view_after, spec.view_value, own_before, own_after, spec.pad_value)


def pad_map(source: torch.Tensor, view_before: tuple[int, ...], view_after: tuple[int, ...], view_value: float,
            own_before: tuple[int, ...], own_after: tuple[int, ...], pad_value: float) -> torch.Tensor:
    """``source`` (N, C, *dims) padded by ``view_*`` with ``view_value``, then by ``own_*`` with ``pad_value``."""
    if any(view_before) or any(view_after):
        source = F.pad(source, _pad_args(view_before, view_after), value=view_value)
    if any(own_before) or any(own_after):
        source = F.pad(source, _pad_args(own_before, own_after), value=pad_value)
    return source


def padded_rows(spec: WindowSpec, source: torch.Tensor) -> torch.Tensor:
    """:func:`padded_map` as rows (one per padded position, channels-last), for gathering windows."""
    return to_rows(padded_map(spec, source)).contiguous()


def crop_view(tensor: torch.Tensor, y: int, x: int, h: int, w: int) -> torch.Tensor:
    """``tensor[..., y:y + h, x:x + w]`` of a tensor (..., H, W), as one ``as_strided`` view where the crop lies
    inside it (the two slices cost two operator calls and the indexing's parsing; a frame crops every step's
    windows and commits this way); the slices otherwise (they clip)."""
    shape = tensor.shape
    if 0 <= y and y + h <= shape[-2] and 0 <= x and x + w <= shape[-1] and h > 0 and w > 0:
        stride = tensor.stride()
        return tensor.as_strided((*shape[:-2], h, w), stride,
                                 tensor.storage_offset() + y * stride[-2] + x * stride[-1])
    return tensor[..., y:y + h, x:x + w]


def padded_crop(spec: WindowSpec, source: torch.Tensor, bounds: Box) -> torch.Tensor:
    """The read-in window of the output box ``bounds``: a crop (a view) of ``source`` (1, C, *dims), padded where
    it reaches beyond the map (first the views' value, then the operator's own).

    Returns:
        (1, C, *read_size) ready for the operator with padding 0.
    """
    d = len(spec.stride)
    dims = source.shape[-d:]
    lo = [bounds[2 * a] * spec.stride[a] - spec.offset[a] for a in range(d)]
    hi = [(bounds[2 * a + 1] - 1) * spec.stride[a] - spec.offset[a] + spec.extent[a] for a in range(d)]
    if d == 2 and lo[0] >= 0 and lo[1] >= 0 and hi[0] <= dims[0] and hi[1] <= dims[1]:
        # inside the map (most crops of a camera frame): a view
        return crop_view(source, lo[0], lo[1], hi[0] - lo[0], hi[1] - lo[1])
    # clamped so that a window lying wholly in the padding is an empty crop (a negative end would wrap around)
    starts = [min(max(lo[a], 0), dims[a]) for a in range(d)]
    ends = [max(min(hi[a], dims[a]), starts[a]) for a in range(d)]
    if d == 2:
        crop = crop_view(source, starts[0], starts[1], ends[0] - starts[0], ends[1] - starts[1])
    else:
        crop = source[(..., *(slice(starts[a], ends[a]) for a in range(d)))]
    if all(lo[a] >= 0 and hi[a] <= dims[a] for a in range(d)):  # inside the map: the common case, no padding
        return crop

    def count(a0: int, a1: int, b0: int, b1: int) -> int:  # size of [a0, a1) & [b0, b1)
        return max(0, min(a1, b1) - max(a0, b0))

    # padded coordinates: [own before][view before][map][view after][own after]; views' padding is inner
    view_b = tuple(count(lo[a], hi[a], -spec.view_before[a], 0) for a in range(d))
    view_a = tuple(count(lo[a], hi[a], dims[a], dims[a] + spec.view_after[a]) for a in range(d))
    own_b = tuple(count(lo[a], hi[a], lo[a], -spec.view_before[a]) for a in range(d))
    own_a = tuple(count(lo[a], hi[a], dims[a] + spec.view_after[a], hi[a]) for a in range(d))
    if any(view_b) or any(view_a):
        crop = F.pad(crop, _pad_args(view_b, view_a), value=spec.view_value)
    if any(own_b) or any(own_a):
        crop = F.pad(crop, _pad_args(own_b, own_a), value=spec.pad_value)
    return crop


@dataclass
class BlockTable:
    """Read-in windows of every output block of a window step, built once: a frame only picks rows.

    Attributes:
        index: (blocks, prod(read)) source row of each window element (0 on padding).
        codes: (blocks, prod(read)) int8: 0 inside the source, 1 on a padding view, 2 on the operator's own padding.
        border: (blocks,) bool, whether the block's window touches any padding.
    """

    index: torch.Tensor
    codes: np.ndarray
    border: np.ndarray


def block_table(spec: WindowSpec, grid: tuple[int, ...], block: tuple[int, ...], source_dims: tuple[int, ...],
                device: torch.device) -> BlockTable:
    """The :class:`BlockTable` of ``grid`` blocks of ``block`` outputs each, reading a source of ``source_dims``."""
    d = len(grid)
    read = spec.read_size(block)
    coords = np.unravel_index(np.arange(math.prod(grid)), grid)
    inside = in_view = True
    index = 0
    for a in range(d):
        shape = [-1] + [1] * d
        shape[a + 1] = read[a]
        first = (coords[a] * block[a] * spec.stride[a] - spec.offset[a]).reshape(-1, *([1] * d))
        c = first + np.arange(read[a]).reshape(shape)
        inside = inside & (c >= 0) & (c < source_dims[a])
        in_view = in_view & (c >= -spec.view_before[a]) & (c < source_dims[a] + spec.view_after[a])
        index = index * source_dims[a] + np.clip(c, 0, source_dims[a] - 1)
    inside, in_view = np.broadcast_arrays(inside, in_view)
    codes = np.where(inside, 0, np.where(in_view, 1, 2)).astype(np.int8).reshape(len(coords[0]), -1)
    index = np.where(inside, np.broadcast_to(index, inside.shape), 0).reshape(len(coords[0]), -1)
    return BlockTable(torch.from_numpy(index).to(device), codes, (codes != 0).any(axis=1))
