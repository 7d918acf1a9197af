"""Update-region geometry: how a changed input box flows through a captured graph (pure math).

Follows Krypton (seeds 001/002): a local operator maps an input box to an output box and a read-in window;
pointwise operators keep it; merges take the bounding box; global operators make it the whole tensor.
Projective field thresholding (``tau``) caps a box at ``round(tau * output size)``, centre-cropped.

All functions work on a batch of N positions at once with numpy arrays. With ``uniform=True`` (what the
engine needs to pack a batch) every position's box has the same size, shifted inwards at the far edge as
in the seed's edge equations; with ``uniform=False`` each position keeps its exact size (for analysis).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from incrinf.graph import Graph, LocalGeometry, Node, NodeKind


class RegionKind(str, Enum):
    NONE = "none"  # unchanged for every position
    BOX = "box"  # a box per position
    FULL = "full"  # the whole tensor may change


@dataclass
class Region:
    """Update region of one tensor for N positions.

    Attributes:
        kind: none, box or full.
        y, x: (N,) int64 top-left corners (box only).
        h, w: (N,) int64 sizes (box only); all equal when the region is uniform.
        reason: for FULL, why the whole tensor changes.
    """

    kind: RegionKind
    y: np.ndarray | None = None
    x: np.ndarray | None = None
    h: np.ndarray | None = None
    w: np.ndarray | None = None
    reason: str = ""

    @staticmethod
    def none() -> Region:
        return Region(RegionKind.NONE)

    @staticmethod
    def full(reason: str) -> Region:
        return Region(RegionKind.FULL, reason=reason)

    def area(self) -> np.ndarray:
        return self.h * self.w


@dataclass
class LocalStep:
    """How a local node computes its output box from its input box.

    Attributes:
        crop_y, crop_x: offsets of the (tau-)cropped input box inside the incoming box.
        crop_h, crop_w: size of the cropped input box.
        read_y, read_x: (N,) read-in window corners in the node's *padded* input coordinates.
        read_h, read_w: read-in window size.
    """

    crop_y: int
    crop_x: int
    crop_h: int
    crop_w: int
    read_y: np.ndarray
    read_x: np.ndarray
    read_h: int
    read_w: int


@dataclass
class Propagation:
    """Regions of every node, and for local nodes the read-in windows."""

    regions: dict[str, Region]
    steps: dict[str, LocalStep]
    n: int


def _ceil_div(a: np.ndarray | int, b: int) -> np.ndarray:
    return -((-np.asarray(a)) // b)


def _tau_cap(out_dim: int, tau: float) -> int:
    return max(int(round(tau * out_dim)), 1)


def local_axis(
    start: np.ndarray, size: np.ndarray, kernel: int, stride: int, pad: int, in_dim: int, out_dim: int,
    tau: float = 1.0, uniform: bool = True,
) -> tuple[np.ndarray, np.ndarray, int, np.ndarray, np.ndarray]:
    """Krypton's equations along one axis.

    Args:
        start, size: (N,) input box start and size.
        kernel: effective kernel extent (dilation included).
        stride, pad: stride and padding before the first element.
        in_dim, out_dim: input and output extents.
        tau: projective field threshold in (0, 1].
        uniform: keep every output box the same size (shifting at the far edge).

    Returns:
        ``(out_start, out_size, crop_offset, in_start, in_size)``: the output box, the tau crop offset applied
        to the input box (0 without truncation) and the (possibly cropped) input box.
    """
    start = np.asarray(start, dtype=np.int64)
    size = np.asarray(size, dtype=np.int64)
    out_size = np.minimum(_ceil_div(size + kernel - 1, stride), out_dim)
    crop = 0
    cap = _tau_cap(out_dim, tau)
    if tau < 1.0 and out_size.max() > cap:
        # projective field thresholding (seed 002, eqs. 14-19): centre-crop the input box
        over = out_size > cap
        new_in = np.maximum(cap * stride - kernel + 1, 1)
        shrink = np.where(over, np.maximum(size - new_in, 0), 0)
        crop_arr = shrink // 2
        if uniform:
            crop = int(crop_arr.max())
        start = start + crop_arr
        size = size - shrink
        out_size = np.minimum(_ceil_div(size + kernel - 1, stride), out_dim)
    lo = np.maximum(_ceil_div(start + pad - kernel + 1, stride), 0)
    if not uniform or tau >= 1.0:
        # the exact reach: fewer outputs at the edges (corners cost less than the centre)
        hi = np.minimum((start + size - 1 + pad) // stride, out_dim - 1)
        lo = np.minimum(lo, hi)
        out_size = np.maximum(hi - lo + 1, 1)
    if uniform:
        # one size for the batch, boxes shifted inwards at the far edge (seed 002). Exact runs take the
        # largest exact reach (each box still contains its own), so a batch of edge positions keeps the
        # edges' saving; truncated runs (tau < 1) keep the seed's size, which their crops are defined on.
        out_size = np.full_like(out_size, out_size.max())
        lo = np.minimum(lo, out_dim - out_size)
    return lo, out_size, crop, start, size


def _bounding(starts: list[np.ndarray], sizes: list[np.ndarray], dim: int, uniform: bool
              ) -> tuple[np.ndarray, np.ndarray]:
    lo = np.min(np.stack(starts), axis=0)
    hi = np.max(np.stack([s + z for s, z in zip(starts, sizes)]), axis=0)
    size = hi - lo
    if uniform:
        size = np.full_like(size, min(int(size.max()), dim))
    lo = np.minimum(lo, dim - size)
    return lo, size


def input_region(positions: np.ndarray, patch: tuple[int, int], image_hw: tuple[int, int]) -> Region:
    """Box of each occlusion position, kept inside the image with a uniform size.

    Args:
        positions: (N, 2) top-left corners (y, x); a window may reach past the image edge (it is cropped,
            as in Captum), in which case the box is shifted inwards.
        patch: (ph, pw) window size.
        image_hw: (H, W).
    """
    positions = np.asarray(positions, dtype=np.int64).reshape(-1, 2)
    n = len(positions)
    ph, pw = min(patch[0], image_hw[0]), min(patch[1], image_hw[1])
    y = np.minimum(positions[:, 0], image_hw[0] - ph)
    x = np.minimum(positions[:, 1], image_hw[1] - pw)
    return Region(RegionKind.BOX, y, x, np.full(n, ph, np.int64), np.full(n, pw, np.int64))


def propagate(graph: Graph, start: Region, tau: float = 1.0, uniform: bool = True) -> Propagation:
    """Flow the input region through every node of ``graph``.

    Args:
        graph: captured graph.
        start: region of the graph input (see :func:`input_region`).
        tau: projective field threshold in (0, 1]; 1 is exact.
        uniform: one box size per node for the whole batch (the engine needs it).

    Returns:
        The region of every node and the read-in windows of local nodes.
    """
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"tau must be in (0, 1], got {tau}")
    n = len(start.y)
    regions: dict[str, Region] = {}
    steps: dict[str, LocalStep] = {}
    for node in graph.nodes:
        regions[node.name] = _node_region(graph, node, start, regions, steps, tau, uniform)
    return Propagation(regions, steps, n)


def _changed_inputs(node: Node, regions: dict[str, Region]) -> list[tuple[str, Region]]:
    return [(name, regions[name]) for name in node.inputs if regions[name].kind != RegionKind.NONE]


def _node_region(graph: Graph, node: Node, start: Region, regions: dict[str, Region],
                 steps: dict[str, LocalStep], tau: float, uniform: bool) -> Region:
    if node.kind == NodeKind.INPUT:
        return start
    if node.kind in (NodeKind.CONSTANT, NodeKind.META):
        return Region.none()
    changed = _changed_inputs(node, regions)
    if not changed:
        return Region.none()
    full = [r for _, r in changed if r.kind == RegionKind.FULL]
    if node.kind in (NodeKind.GLOBAL, NodeKind.OUTPUT):
        if full:
            return Region.full(full[0].reason)
        return Region.full(node.reason or "an operator that mixes all positions")
    if full:
        return Region.full(full[0].reason)
    shape = node.shape
    if node.kind == NodeKind.POINTWISE:
        return changed[0][1]
    if node.kind == NodeKind.PAD:
        r = changed[0][1]
        return _maybe_full(Region(RegionKind.BOX, r.y + node.shift[0], r.x + node.shift[1], r.h, r.w), shape)
    if node.kind == NodeKind.MERGE:
        boxes = [r for _, r in changed]
        y, h = _bounding([b.y for b in boxes], [b.h for b in boxes], shape[-2], uniform)
        x, w = _bounding([b.x for b in boxes], [b.w for b in boxes], shape[-1], uniform)
        return _maybe_full(Region(RegionKind.BOX, y, x, h, w), shape)
    if node.kind == NodeKind.LOCAL:
        region, step = _local_region(graph, node, changed[0][1], tau, uniform)
        steps[node.name] = step
        return region
    raise AssertionError(f"unhandled node kind {node.kind}")


def _local_region(graph: Graph, node: Node, r: Region, tau: float, uniform: bool) -> tuple[Region, LocalStep]:
    g: LocalGeometry = node.geometry
    in_shape = graph.by_name[node.inputs[0]].shape
    (ih, iw), (oh, ow) = in_shape[-2:], node.shape[-2:]
    y, h, crop_y, in_y, in_h = local_axis(r.y, r.h, g.kernel[0], g.stride[0], g.pad_before[0], ih, oh, tau, uniform)
    x, w, crop_x, in_x, in_w = local_axis(r.x, r.w, g.kernel[1], g.stride[1], g.pad_before[1], iw, ow, tau, uniform)
    read_h = g.kernel[0] + (int(h.max()) - 1) * g.stride[0]
    read_w = g.kernel[1] + (int(w.max()) - 1) * g.stride[1]
    step = LocalStep(crop_y, crop_x, int(in_h.max()), int(in_w.max()), y * g.stride[0], x * g.stride[1],
                     read_h, read_w)
    return _maybe_full(Region(RegionKind.BOX, y, x, h, w), node.shape), step


def _maybe_full(region: Region, shape: tuple[int, ...]) -> Region:
    """A box that covers the whole map is the whole map (no gather needed)."""
    if (region.h >= shape[-2]).all() and (region.w >= shape[-1]).all():
        return Region.full("the update region covers the whole map")
    return region


def incremental_flops(graph: Graph, prop: Propagation) -> np.ndarray:
    """(N,) FLOPs of incremental inference per position (full-cost for nodes whose region is the whole map)."""
    total = np.zeros(prop.n, dtype=np.float64)
    for node in graph.nodes:
        region = prop.regions[node.name]
        if node.flops == 0 or region.kind == RegionKind.NONE:
            continue
        if region.kind == RegionKind.FULL or node.shape is None or len(node.shape) < 3:
            total += node.flops
        else:
            total += node.flops * region.area() / (node.shape[-2] * node.shape[-1])
    return total


def full_flops(graph: Graph) -> int:
    """FLOPs of one full inference."""
    return int(sum(n.flops for n in graph.nodes))
