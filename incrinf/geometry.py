"""Update-region geometry: how a changed input box flows through a captured graph (pure math, no tensors).

Follows Krypton (seeds 001/002): a local operator maps an input box to an output box and a read-in window;
pointwise operators keep it; merges take the bounding box; global operators make it the whole tensor.
Projective field thresholding (``tau``) caps a box at ``round(tau * output size)``, centre-cropped.

A :data:`Box` is one box's half-open bounds ``(lo0, hi0, lo1, hi1, ...)``, outermost axis first (``(y0, y1, x0,
x1)`` in 2-D); :class:`Boxes` are N boxes (one per query) as per-axis starts and sizes, with their values once
computed; a :class:`Region` says whether a tensor is unchanged, changed inside :class:`Boxes`, or changed whole.
Boxes have one axis per spatial dimension of the input (1, 2 or 3). Functions work on a batch of N positions at
once: per axis, starts are (N,) arrays. With ``uniform=True`` (what a packed batch needs)
every position's box has the same size, shifted inwards at the far edge as in the seed's edge equations; with
``uniform=False`` each position keeps its exact size (for analysis). :func:`window_reach` is the one formula
of a window's reach; it works on Python ints as on arrays, so a single still-camera box uses it too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from incrinf.graph import Graph, LocalGeometry, Node, NodeKind

if TYPE_CHECKING:
    import torch

Int = TypeVar("Int", int, np.ndarray)

Box = tuple[int, ...]  # (lo0, hi0, lo1, hi1, ...): half-open per spatial axis, outermost first; (y0, y1, x0, x1)


@dataclass
class Boxes:
    """N boxes (one per query; one box for a still camera's change) and, once computed, their values.

    Attributes:
        lo: per spatial axis, the first element of each box: an (N,) int64 array, or an int for one box (numpy
            would cost more than the operators on a camera frame's small crops).
        size: per spatial axis, the extent: an int (one size for the batch: what a packed batch needs), or an
            (N,) array of each box's own extent (analysis, and features of different sizes before batching).
        values: (N, C..., *size) the new values inside the boxes (None until computed; uniform sizes only).
    """

    lo: tuple[Any, ...]
    size: tuple[Any, ...]
    values: torch.Tensor | None = None

    @property
    def single(self) -> bool:
        """One box (a camera frame's change) rather than a batch."""
        return not isinstance(self.lo[0], np.ndarray)

    @property
    def n(self) -> int:
        return 1 if self.single else len(self.lo[0])

    @property
    def area(self) -> Any:
        """Elements of one box (an int), or of each box ((N,) array) when their sizes differ."""
        return math.prod(self.size)

    @property
    def bounds(self) -> Box:
        """The :data:`Box` of a single box."""
        lo, size = self.lo, self.size
        if len(lo) == 2 and type(lo[0]) is int and type(lo[1]) is int and type(size[0]) is int \
                and type(size[1]) is int:  # a camera frame's box, asked for at every step of its walk
            return lo[0], lo[0] + size[0], lo[1], lo[1] + size[1]
        out: list[int] = []
        for lo, size in zip(self.lo, self.size):
            out.extend((int(lo), int(lo) + int(size)))
        return tuple(out)

    def start(self) -> np.ndarray:
        """(N, d) first corners."""
        return np.stack([np.broadcast_to(np.asarray(lo, np.int64), (self.n,)) for lo in self.lo], axis=1)

    def sizes(self) -> np.ndarray:
        """(N, d) extents."""
        return np.stack([np.broadcast_to(np.asarray(size, np.int64), (self.n,)) for size in self.size], axis=1)

    def same_place(self, other: Boxes) -> bool:
        """Whether both hold the same boxes (their values may differ)."""
        return self.size == other.size and all(
            np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(self.lo, other.lo))

    def covers(self, dims: tuple[int, ...], share: float = 1.0) -> bool:
        """Whether a box covers at least ``share`` of a map of extents ``dims``."""
        return self.area >= share * math.prod(dims)


class RegionKind(str, Enum):
    NONE = "none"  # unchanged for every position
    BOX = "box"  # a box per position
    FULL = "full"  # the whole tensor may change


@dataclass
class Region:
    """Update region of one tensor for N positions: unchanged, changed inside boxes, or changed whole.

    Attributes:
        kind: none, box or full.
        boxes: the boxes (box only); one size for the batch when the propagation is uniform.
        reason: for FULL, why the whole tensor changes.
    """

    kind: RegionKind
    boxes: Boxes | None = None
    reason: str = ""

    @staticmethod
    def none() -> Region:
        return Region(RegionKind.NONE)

    @staticmethod
    def full(reason: str) -> Region:
        return Region(RegionKind.FULL, reason=reason)


@dataclass
class LocalStep:
    """How a local node computes its output box from its input box (uniform batches).

    Attributes:
        crop: (d,) offset of the (tau-)cropped input box inside the incoming box (0 without truncation).
        crop_size: (d,) size of the cropped input box.
        read_start: (N, d) read-in window starts in the node's *padded* input coordinates.
        read_size: (d,) read-in window size.
    """

    crop: np.ndarray
    crop_size: np.ndarray
    read_start: np.ndarray
    read_size: np.ndarray


@dataclass
class Propagation:
    """Regions of every node, and for local nodes the read-in windows."""

    regions: dict[str, Region]
    steps: dict[str, LocalStep]
    n: int


def window_reach(lo: Int, hi: Int, extent: int, stride: int, offset: int) -> tuple[Int, Int]:
    """Outputs of a sliding window whose read-in windows overlap source elements ``lo:hi`` (half-open).

    Output ``o`` reads source elements ``o * stride - offset`` to ``o * stride - offset + extent - 1``, so it
    overlaps ``lo:hi`` when ``(lo + offset - extent + 1) / stride <= o <= (hi - 1 + offset) / stride``. Dilated
    kernels are treated as dense (a superset: recomputing extra outputs stays exact).

    Args:
        lo, hi: first and one-past-last changed source element (ints, or arrays of them).
        extent: effective kernel extent (dilation included).
        stride: window stride.
        offset: padding before the first element (the node's own and any padding views in front of it).

    Returns:
        ``(first, last)`` outputs, half-open and not clipped to the output map.
    """
    return -((extent - 1 - lo - offset) // stride), (hi - 1 + offset) // stride + 1


def _tau_cap(out_dim: int, tau: float) -> int:
    return max(int(round(tau * out_dim)), 1)


# Boxes are batches of (N,) arrays, or plain ints for a single box (a camera frame's change), which numpy would
# slow down tenfold; these keep one code path for both.
def maximum(a: Int, b: Int) -> Int:
    return np.maximum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else max(a, b)


def minimum(a: Int, b: Int) -> Int:
    return np.minimum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else min(a, b)


def largest(a: Int) -> int:
    return int(a.max()) if isinstance(a, np.ndarray) else a


def local_axis(start: Int, size: Int, kernel: int, stride: int, pad: int, out_dim: int, tau: float = 1.0,
               uniform: bool = True) -> tuple[Int, Int, int, Int, Int]:
    """Krypton's equations along one axis.

    Args:
        start, size: input box start and size: (N,) arrays, or ints for one box.
        kernel: effective kernel extent (dilation included).
        stride, pad: stride and padding before the first element (views included).
        out_dim: output extent.
        tau: projective field threshold in (0, 1].
        uniform: keep every output box the same size (shifting at the far edge).

    Returns:
        ``(out_start, out_size, crop_offset, in_start, in_size)``: the output box, the tau crop offset applied
        to the input box (0 without truncation) and the (possibly cropped) input box.
    """
    crop = 0
    if tau < 1.0:
        out_size = minimum(-(-(size + kernel - 1) // stride), out_dim)
        cap = _tau_cap(out_dim, tau)
        if largest(out_size) > cap:
            # projective field thresholding (seed 002, eqs. 14-19): centre-crop the input box
            new_in = max(cap * stride - kernel + 1, 1)
            shrink = np.where(out_size > cap, np.maximum(size - new_in, 0), 0) if isinstance(size, np.ndarray) \
                else max(size - new_in, 0)
            crop_arr = shrink // 2
            crop = largest(crop_arr) if uniform else 0
            start, size = start + crop_arr, size - shrink
        out_size = minimum(-(-(size + kernel - 1) // stride), out_dim)
    first, last = window_reach(start, start + size, kernel, stride, pad)
    lo = maximum(first, 0)
    if not uniform or tau >= 1.0:
        # the exact reach: fewer outputs at the edges (corners cost less than the centre)
        hi = minimum(last, out_dim)
        lo = minimum(lo, hi - 1)
        out_size = maximum(hi - lo, 1)
    if uniform:
        # one size for the batch, boxes shifted inwards at the far edge (seed 002). Exact runs take the
        # largest exact reach (each box still contains its own), so a batch of edge positions keeps the
        # edges' saving; truncated runs (tau < 1) keep the seed's size, which their crops are defined on.
        biggest = largest(out_size)
        out_size = np.full_like(out_size, biggest) if isinstance(out_size, np.ndarray) else biggest
        lo = minimum(lo, out_dim - biggest)
    return lo, out_size, crop, start, size


def bounding_axis(starts: list[Int], sizes: list[Int], dim: int, uniform: bool) -> tuple[Int, Int]:
    """Along one axis, each position's bounding box of several boxes, kept inside ``dim`` (uniform: one size)."""
    lo, hi = starts[0], starts[0] + sizes[0]
    for start, size in zip(starts[1:], sizes[1:]):
        lo, hi = minimum(lo, start), maximum(hi, start + size)
    size = hi - lo
    if uniform:
        biggest = min(largest(size), dim)
        size = np.full_like(size, biggest) if isinstance(size, np.ndarray) else biggest
    return minimum(lo, dim - size), size


def input_boxes(positions: np.ndarray, patch: tuple[int, ...], dims: tuple[int, ...]) -> Boxes:
    """Box of each occlusion position, kept inside the input with a uniform size.

    Args:
        positions: (N, d) first corners; a window may reach past the input's far edge (it is cropped, as in
            Captum), in which case the box is shifted inwards.
        patch: (d,) window size.
        dims: (d,) the input's spatial extents.
    """
    d = len(dims)
    positions = np.asarray(positions, dtype=np.int64).reshape(-1, d)
    size = np.minimum(np.asarray(patch, np.int64), dims)
    start = np.minimum(positions, np.asarray(dims) - size)
    return Boxes(tuple(start[:, a] for a in range(d)), tuple(int(z) for z in size))


def propagate(graph: Graph, start: Boxes, tau: float = 1.0, uniform: bool = True) -> Propagation:
    """Flow the input region through every node of ``graph``.

    Args:
        graph: captured graph.
        start: the changed boxes of the graph input (see :func:`input_boxes`).
        tau: projective field threshold in (0, 1]; 1 is exact.
        uniform: one box size per node for the whole batch (a packed batch needs it).

    Returns:
        The region of every node and the read-in windows of local nodes.
    """
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"tau must be in (0, 1], got {tau}")
    regions: dict[str, Region] = {}
    steps: dict[str, LocalStep] = {}
    for node in graph.nodes:
        regions[node.name] = _node_region(graph, node, start, regions, steps, tau, uniform)
    return Propagation(regions, steps, start.n)


def _node_region(graph: Graph, node: Node, start: Boxes, regions: dict[str, Region],
                 steps: dict[str, LocalStep], tau: float, uniform: bool) -> Region:
    if node.kind == NodeKind.INPUT:
        return Region(RegionKind.BOX, start)
    if node.kind in (NodeKind.CONSTANT, NodeKind.META):
        return Region.none()
    changed = [regions[name] for name in node.inputs if regions[name].kind != RegionKind.NONE]
    if not changed:
        return Region.none()
    full = [r for r in changed if r.kind == RegionKind.FULL]
    # (a split's tuple of maps has no shape of its own: it moves no position)
    if node.kind in (NodeKind.GLOBAL, NodeKind.OUTPUT) or (node.shape is not None and not graph.is_map(node.shape)):
        return Region.full(full[0].reason if full else node.reason or "an operator that mixes all positions")
    if full:
        return Region.full(full[0].reason)
    if node.kind == NodeKind.POINTWISE:
        return changed[0]
    dims = node.shape[-graph.spatial_dims:]
    if node.kind == NodeKind.PAD:
        boxes = changed[0].boxes
        return _maybe_full(Boxes(tuple(lo + shift for lo, shift in zip(boxes.lo, node.shift)), boxes.size), dims)
    if node.kind == NodeKind.MERGE:
        axes = [bounding_axis([r.boxes.lo[a] for r in changed], [r.boxes.size[a] for r in changed], dims[a], uniform)
                for a in range(len(dims))]
        return _maybe_full(Boxes(tuple(ax[0] for ax in axes), tuple(_one_size(ax[1], uniform) for ax in axes)), dims)
    if node.kind == NodeKind.LOCAL:
        region, step = _local_region(graph, node, changed[0], tau, uniform)
        steps[node.name] = step
        return region
    raise AssertionError(f"unhandled node kind {node.kind}")


def _local_region(graph: Graph, node: Node, r: Region, tau: float, uniform: bool) -> tuple[Region, LocalStep]:
    g: LocalGeometry = node.geometry
    d = graph.spatial_dims
    out_dims = node.shape[-d:]
    axes = [local_axis(r.boxes.lo[a], r.boxes.size[a], g.kernel[a], g.stride[a], g.pad_before[a], out_dims[a], tau,
                       uniform) for a in range(d)]
    boxes = Boxes(tuple(ax[0] for ax in axes), tuple(_one_size(ax[1], uniform) for ax in axes))
    crop = np.array([ax[2] for ax in axes], np.int64)
    crop_size = np.array([int(np.max(ax[4])) for ax in axes], np.int64)
    stride, kernel = np.asarray(g.stride), np.asarray(g.kernel)
    read_size = kernel + (boxes.sizes().max(axis=0) - 1) * stride
    step = LocalStep(crop, crop_size, boxes.start() * stride, read_size)
    return _maybe_full(boxes, out_dims), step


def _one_size(size: Int, uniform: bool) -> Int:
    """A uniform batch's extent as one int (the functions above return it broadcast to the batch)."""
    return largest(size) if uniform else size


def _maybe_full(boxes: Boxes, dims: tuple[int, ...]) -> Region:
    """A box that covers the whole map is the whole map (no gather needed)."""
    if all(np.all(np.asarray(size) >= dim) for size, dim in zip(boxes.size, dims)):
        return Region.full("the update region covers the whole map")
    return Region(RegionKind.BOX, boxes)


def incremental_flops(graph: Graph, prop: Propagation) -> np.ndarray:
    """(N,) FLOPs of incremental inference per position (full cost for nodes whose region is the whole map)."""
    total = np.zeros(prop.n, dtype=np.float64)
    d = graph.spatial_dims
    for node in graph.nodes:
        region = prop.regions[node.name]
        if node.flops == 0 or region.kind == RegionKind.NONE:
            continue
        if region.kind == RegionKind.FULL or not graph.is_map(node.shape):
            total += node.flops
        else:
            total += node.flops * region.boxes.area / np.prod(node.shape[-d:])
    return total


def full_flops(graph: Graph) -> int:
    """FLOPs of one full inference."""
    return graph.full_flops()
