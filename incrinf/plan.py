"""Region plans: per-node read-in windows and gather/scatter index tensors for one batch of positions.

A plan depends only on (graph signature, input shape, window size, positions, tau, device): it is built once
by :func:`build_plan` through the process-wide :class:`~incrinf.cache.RuntimeCache` and reused for every
image of that size.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn

from incrinf.cache import runtime_cache
from incrinf.geometry import Propagation, Region, RegionKind, input_region, propagate
from incrinf.graph import Graph, Node, NodeKind, capture
from incrinf.kernels.dispatch import fuse_scatter_index, fuse_window_index, wants_fused_index


@dataclass
class Windowing:
    """How to build one input's packed windows: gather from its base map, then overlay its region.

    Attributes:
        read_index: (N*hr*wr,) rows of the input's (padded) base map.
        dest: (K,) rows of the window batch that receive region values (``None``: nothing to overlay).
        source: (K,) rows of the incoming region to copy (``None``: all rows, in order).
        hr, wr: window size.
        combined: (N*hr*wr,) gather and overlay fused into one index over ``[base rows; region rows]``
            (:func:`~incrinf.kernels.dispatch.fuse_window_index`), for the GPU kernel; ``None`` on CPU.
    """

    read_index: torch.Tensor
    dest: torch.Tensor | None
    source: torch.Tensor | None
    hr: int
    wr: int
    combined: torch.Tensor | None = None


@dataclass
class Scatter:
    """Full projection of a region into N copies of its base map (rows ``dest`` of (N*H*W, C))."""

    dest: torch.Tensor
    source: torch.Tensor | None
    combined: torch.Tensor | None = None  # (N*H*W,) fused projection index (GPU kernel), None on CPU


@dataclass
class NodePlan:
    """What the engine does at one node for one batch."""

    state: RegionKind
    h: int = 0
    w: int = 0
    windowings: dict[str, Windowing] = field(default_factory=dict)
    scatters: dict[str, Scatter] = field(default_factory=dict)
    out_index: torch.Tensor | None = None  # (N*h*w,) rows of the output map (avg-pool divisor lookup)


@dataclass
class BatchPlan:
    """Plan for N positions."""

    n: int
    nodes: dict[str, NodePlan]
    flops_incremental: float
    prop: Propagation = field(repr=False)


# --- captured graphs are cached per model object and shape ----------------------------------------------

_GRAPHS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, Graph]] = weakref.WeakKeyDictionary()


def captured_graph(model: nn.Module, input_shape: tuple[int, ...]) -> Graph:
    """:func:`~incrinf.graph.capture`, cached per model object and input shape."""
    per_model = _GRAPHS.setdefault(model, {})
    key = tuple(input_shape)
    if key not in per_model:
        per_model[key] = capture(model, input_shape)
    return per_model[key]


# --- plan building ---------------------------------------------------------------------------------------


def positions_digest(positions: np.ndarray) -> str:
    """Hash of a positions array, so plan keys hold no arrays."""
    return hashlib.sha1(np.ascontiguousarray(positions, dtype=np.int64).tobytes()).hexdigest()


def build_plan(graph: Graph, positions: np.ndarray, window: tuple[int, int], tau: float = 1.0,
               device: torch.device | str = "cpu") -> BatchPlan:
    """The plan for one batch of positions, from the runtime cache when it was built before.

    Args:
        graph: captured graph.
        positions: (N, 2) top-left corners (y, x) of the changed window.
        window: (h, w) size of the changed window.
        tau: projective field threshold.
        device: where the index tensors live.

    Returns:
        The :class:`BatchPlan`.
    """
    key = ("plan", graph.signature, tuple(window), positions_digest(positions), len(positions), float(tau),
           str(device))
    plan, _ = runtime_cache().get_or_create(key, lambda _key: _build(graph, positions, window, tau, device))
    return plan


def box_rows(y: np.ndarray, x: np.ndarray, h: int, w: int, width: int, batch_stride: int = 0
                   ) -> np.ndarray:
    """Row index of every element of N boxes in a row-major map of ``width`` columns: (N*h*w,)."""
    n = len(y)
    ii = np.arange(h)[None, :, None]
    jj = np.arange(w)[None, None, :]
    rows = (y[:, None, None] + ii) * width + (x[:, None, None] + jj)
    rows = rows + (np.arange(n) * batch_stride)[:, None, None]
    return rows.reshape(-1)


def _overlay(region: Region, oy: np.ndarray, ox: np.ndarray, hr: int, wr: int,
             crop: tuple[int, int, int, int] | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Rows of the window batch receiving the region (placed at (oy, ox) inside each window), and the source
    rows of the region; elements falling outside their window are dropped."""
    n = len(region.y)
    h, w = int(region.h[0]), int(region.w[0])
    cy, cx, ch, cw = crop if crop is not None else (0, 0, h, w)
    ii = np.arange(ch)[None, :, None]
    jj = np.arange(cw)[None, None, :]
    wy = oy[:, None, None] + ii
    wx = ox[:, None, None] + jj
    valid = (wy >= 0) & (wy < hr) & (wx >= 0) & (wx < wr)
    nn_ = np.arange(n)[:, None, None]
    dest = nn_ * (hr * wr) + wy * wr + wx
    source = nn_ * (h * w) + (cy + ii) * w + (cx + jj)
    dest, source, valid = np.broadcast_arrays(dest, source, valid)
    if valid.all() and (cy, cx, ch, cw) == (0, 0, h, w):
        return dest.reshape(-1), None
    return dest[valid], source[valid]


def _t(a: np.ndarray | None, device: torch.device | str) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)


def _build(graph: Graph, positions: np.ndarray, window: tuple[int, int], tau: float,
           device: torch.device | str) -> BatchPlan:
    image_hw = graph.input_shape[-2:]
    prop = propagate(graph, input_region(positions, window, image_hw), tau=tau, uniform=True)
    n = len(positions)
    plans: dict[str, NodePlan] = {}
    regions = prop.regions
    for node in graph.nodes:
        region = regions[node.name]
        if region.kind == RegionKind.NONE:
            plans[node.name] = NodePlan(RegionKind.NONE)
            continue
        plan = NodePlan(region.kind)
        if region.kind == RegionKind.BOX:
            plan.h, plan.w = int(region.h[0]), int(region.w[0])
        in_regions = {name: regions[name] for name in node.inputs}
        box_inputs = [name for name, r in in_regions.items() if r.kind == RegionKind.BOX]
        if node.kind == NodeKind.LOCAL and box_inputs:
            _plan_local(graph, node, prop, plan, device)
        elif node.kind == NodeKind.MERGE and box_inputs and not any(
                r.kind == RegionKind.FULL for r in in_regions.values()):
            _plan_merge(graph, node, prop, plan, device)
        elif region.kind == RegionKind.FULL:
            for name in box_inputs:
                plan.scatters[name] = _scatter(graph.by_name[name], regions[name], device)
        plans[node.name] = plan
    from incrinf.geometry import incremental_flops

    flops = float(incremental_flops(graph, prop).mean())
    return BatchPlan(n, plans, flops, prop)


def _plan_local(graph: Graph, node: Node, prop: Propagation, plan: NodePlan, device) -> None:
    g = node.geometry
    src = node.inputs[0]
    r_in = prop.regions[src]
    step = prop.steps[node.name]
    ih, iw = graph.by_name[src].shape[-2:]
    wp = iw + g.pad_before[1] + g.pad_after[1]
    read = box_rows(step.read_y, step.read_x, step.read_h, step.read_w, wp)
    oy = r_in.y + step.crop_y + g.pad_before[0] - step.read_y
    ox = r_in.x + step.crop_x + g.pad_before[1] - step.read_x
    crop = (step.crop_y, step.crop_x, step.crop_h, step.crop_w)
    dest, source = _overlay(r_in, oy, ox, step.read_h, step.read_w, crop)
    hp = ih + g.pad_before[0] + g.pad_after[0]
    plan.windowings[src] = _windowing(read, dest, source, step.read_h, step.read_w, hp * wp, device)
    if plan.state == RegionKind.FULL:
        plan.h, plan.w = node.shape[-2:]
    if "avg" in node.op.lower():
        region = prop.regions[node.name]
        if region.kind == RegionKind.BOX:
            out_rows = box_rows(region.y, region.x, plan.h, plan.w, node.shape[-1])
        else:
            out_rows = np.tile(np.arange(plan.h * plan.w), prop.n)
        plan.out_index = _t(out_rows, device)


def _plan_merge(graph: Graph, node: Node, prop: Propagation, plan: NodePlan, device) -> None:
    region = prop.regions[node.name]
    n = prop.n
    if region.kind == RegionKind.FULL:  # bounding box of the whole map
        y = np.zeros(n, np.int64)
        x = np.zeros(n, np.int64)
        plan.h, plan.w = node.shape[-2:]
    else:
        y, x = region.y, region.x
    for name in node.inputs:
        r_in = prop.regions[name]
        src_node = graph.by_name[name]
        if src_node.kind == NodeKind.CONSTANT or src_node.shape is None or len(src_node.shape) < 3:
            continue
        if r_in.kind == RegionKind.BOX and np.array_equal(r_in.y, y) and np.array_equal(r_in.x, x) \
                and int(r_in.h[0]) == plan.h and int(r_in.w[0]) == plan.w:
            continue  # already aligned with the bounding box
        width = src_node.shape[-1]
        read = box_rows(y, x, plan.h, plan.w, width)
        dest = source = None
        if r_in.kind == RegionKind.BOX:
            dest, source = _overlay(r_in, r_in.y - y, r_in.x - x, plan.h, plan.w)
        n_base = src_node.shape[-2] * src_node.shape[-1]
        plan.windowings[name] = _windowing(read, dest, source, plan.h, plan.w, n_base, device)


def _windowing(read: np.ndarray, dest: np.ndarray | None, source: np.ndarray | None, hr: int, wr: int,
               n_base_rows: int, device) -> Windowing:
    read_t, dest_t, source_t = _t(read, device), _t(dest, device), _t(source, device)
    combined = None
    if dest_t is not None and wants_fused_index(device):
        combined = fuse_window_index(read_t, dest_t, source_t, n_base_rows)
    return Windowing(read_t, dest_t, source_t, hr, wr, combined)


def _scatter(src_node: Node, r_in: Region, device) -> Scatter:
    hh, ww = src_node.shape[-2:]
    h, w = int(r_in.h[0]), int(r_in.w[0])
    dest = _t(box_rows(r_in.y, r_in.x, h, w, ww, batch_stride=hh * ww), device)
    combined = fuse_scatter_index(dest, None, len(r_in.y), hh * ww) if wants_fused_index(device) else None
    return Scatter(dest, None, combined)
