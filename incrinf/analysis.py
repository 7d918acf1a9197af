"""Static analysis: Krypton's theoretical speedup of incremental inference, before anything runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.nn as nn

from incrinf.geometry import Region, RegionKind, full_flops, incremental_flops, input_boxes, propagate
from incrinf.graph import Graph, NodeKind, parse_input_shape
from incrinf.validation import check_patch, check_stride, check_tau


@dataclass
class NodeRow:
    """One row of the analysis table."""

    name: str
    kind: str
    op: str
    shape: tuple[int, ...] | None
    region: str
    flops_full: float
    flops_incremental: float
    note: str


@dataclass
class AnalysisReport:
    """Per-node update regions and FLOPs, and the totals.

    Attributes:
        rows: one row per tensor-producing node.
        flops_full: FLOPs (multiply-accumulates) of one full inference.
        flops_incremental: FLOPs of incremental inference for the analysed position(s) (mean for "all").
        theoretical_speedup: ``flops_full / flops_incremental``.
        reuse_stops_at: first node after which the update region is the whole tensor, and why.
        unknown_ops: nodes treated as global because incrinf does not know them.
        positions: number of positions analysed.
    """

    rows: list[NodeRow]
    flops_full: float
    flops_incremental: float
    theoretical_speedup: float
    reuse_stops_at: str
    unknown_ops: list[str]
    positions: int
    tau: float

    def table(self) -> str:
        """The per-node table and the totals as text."""
        lines = [f"{'node':<34} {'kind':<9} {'output shape':<18} {'update region':<18} "
                 f"{'MFLOPs full':>11} {'MFLOPs incr':>11}"]
        for r in self.rows:
            shape = "x".join(str(s) for s in r.shape) if r.shape else "-"
            lines.append(f"{r.name[:34]:<34} {r.kind:<9} {shape:<18} {r.region:<18} "
                         f"{r.flops_full / 1e6:>11.2f} {r.flops_incremental / 1e6:>11.2f}")
        lines.append("")
        lines.append(f"flops_full          {self.flops_full / 1e9:.3f} GFLOPs")
        lines.append(f"flops_incremental   {self.flops_incremental / 1e9:.3f} GFLOPs "
                     f"(mean over {self.positions} position{'s' if self.positions > 1 else ''}, tau={self.tau})")
        lines.append(f"theoretical_speedup {self.theoretical_speedup:.2f}x")
        lines.append(f"reuse stops at      {self.reuse_stops_at}")
        if self.unknown_ops:
            lines.append(f"unknown ops (treated as global): {', '.join(self.unknown_ops)}")
        return "\n".join(lines)


def grid_shape(dims: tuple[int, ...], patch: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...]:
    """Windows per spatial axis, Captum's count: ``ceil((dim - patch) / stride) + 1``."""
    return tuple(-(-(n - p) // s) + 1 for n, p, s in zip(dims, patch, stride))


def occlusion_grid(dims: tuple[int, ...], patch: tuple[int, ...], stride: tuple[int, ...]) -> np.ndarray:
    """(N, d) first corners of every occlusion window (Captum's grid), row-major."""
    axes = [np.arange(n) * s for n, s in zip(grid_shape(dims, patch, stride), stride)]
    corners = np.meshgrid(*axes, indexing="ij")
    return np.stack([c.ravel() for c in corners], axis=1).astype(np.int64)


def _positions(position: Any, dims: tuple[int, ...], patch: tuple[int, ...], stride: tuple[int, ...]
               ) -> np.ndarray:
    if isinstance(position, str):
        if position == "center":
            return np.array([[(n - p) // 2 for n, p in zip(dims, patch)]], np.int64)
        if position == "all":
            return occlusion_grid(dims, patch, stride)
        raise ValueError(f"position must be 'center', 'all' or a corner {tuple('zyx'[3 - len(dims):])}, "
                         f"got {position!r}")
    try:
        corner = tuple(int(v) for v in position)
    except (TypeError, ValueError):
        corner = ()
    if len(corner) != len(dims):
        raise ValueError(f"position must be 'center', 'all' or a corner of {len(dims)} ints, got {position!r}")
    if not all(0 <= c <= n - p for c, n, p in zip(corner, dims, patch)):
        raise ValueError(f"position {corner} puts the patch outside the {'x'.join(map(str, dims))} input")
    return np.array([corner], np.int64)


def analyze(
    model: nn.Module | Graph,
    input_shape: Any,
    patch: int | tuple[int, int],
    stride: int | tuple[int, int] = 1,
    tau: float = 1.0,
    position: str | tuple[int, int] = "center",
) -> AnalysisReport:
    """Theoretical speedup of incremental inference for an occlusion patch.

    Args:
        model: the model (traced with ``torch.fx``) or an already captured :class:`Graph`.
        input_shape: ``(C, H, W)``, ``(1, C, H, W)`` or ``"3x224x224"``.
        patch: occlusion patch size (int or (h, w)).
        stride: occlusion stride, used with ``position="all"``.
        tau: projective field threshold in (0, 1]; 1 is exact.
        position: ``"center"``, ``(y, x)`` top-left corner, or ``"all"`` (mean over the occlusion grid).

    Returns:
        An :class:`AnalysisReport`.

    Raises:
        ValueError: malformed shape, patch larger than the input, stride below 1, tau outside (0, 1].
        CaptureError: the model cannot be traced.
    """
    shape = parse_input_shape(input_shape)
    dims = shape[2:]
    patch_size = check_patch(patch, dims)
    stride_size = check_stride(stride, len(dims))
    check_tau(tau)
    graph = model if isinstance(model, Graph) else _captured(model, shape)
    positions = _positions(position, dims, patch_size, stride_size)
    prop = propagate(graph, input_boxes(positions, patch_size, dims), tau=tau, uniform=False)
    incr = incremental_flops(graph, prop)
    full = full_flops(graph)
    rows = [_row(graph, node, prop.regions[node.name]) for node in graph.nodes
            if node.kind not in (NodeKind.CONSTANT, NodeKind.META, NodeKind.OUTPUT) and node.shape is not None]
    mean_incr = float(incr.mean())
    return AnalysisReport(
        rows=rows,
        flops_full=float(full),
        flops_incremental=mean_incr,
        theoretical_speedup=float(full / mean_incr) if mean_incr > 0 else float("inf"),
        reuse_stops_at=_reuse_stop(graph, prop.regions),
        unknown_ops=[f"{n.name} ({n.reason})" for n in graph.unknown_ops()],
        positions=len(positions),
        tau=tau,
    )


def _captured(model: nn.Module, shape: tuple[int, ...]) -> Graph:
    from incrinf.graph import captured_graph  # cached capture, shared with the engine

    return captured_graph(model, shape[1:])


def _row(graph: Graph, node, region: Region) -> NodeRow:
    d = graph.spatial_dims
    area = int(np.prod(node.shape[-d:])) if graph.is_map(node.shape) else 1
    if region.kind == RegionKind.NONE:
        text, incr = "unchanged", 0.0
    elif region.kind == RegionKind.FULL:
        text, incr = "whole", float(node.flops)
    else:
        sizes = region.boxes.sizes()
        mean = sizes.mean(axis=0)
        text = "x".join(f"{m:.0f}" for m in mean) if len(sizes) == 1 else "~" + "x".join(f"{m:.1f}" for m in mean)
        incr = float(np.mean(node.flops * region.boxes.area / area))
    return NodeRow(node.name, node.kind.value, node.op, node.shape, text, float(node.flops), incr, node.reason)


def _reuse_stop(graph: Graph, regions: dict[str, Region]) -> str:
    d = graph.spatial_dims
    full = [n for n in graph.nodes if regions[n.name].kind == RegionKind.FULL]
    # the first map of several positions that is whole (a squeeze-excitation multiply, not its side branch's
    # pool); failing that, the first global operator (a classifier's global pool: its output is one position)
    maps = [n for n in full if graph.is_map(n.shape) and int(np.prod(n.shape[-d:])) > 1]
    stop = maps[0] if maps else next((n for n in full if n.kind == NodeKind.GLOBAL), None)
    if stop is not None:
        return f"{stop.name}: {regions[stop.name].reason}"
    return "never (the output itself is a map)"
