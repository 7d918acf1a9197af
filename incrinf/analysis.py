"""Static analysis: Krypton's theoretical speedup of incremental inference, before anything runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.nn as nn

from incrinf.geometry import Region, RegionKind, full_flops, incremental_flops, input_region, propagate
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


def occlusion_grid(image_hw: tuple[int, int], patch: tuple[int, int], stride: tuple[int, int]) -> np.ndarray:
    """(N, 2) top-left corners of every occlusion window, Captum's grid: ceil((dim - patch) / stride) + 1."""
    ny = -(-(image_hw[0] - patch[0]) // stride[0]) + 1
    nx = -(-(image_hw[1] - patch[1]) // stride[1]) + 1
    ys, xs = np.meshgrid(np.arange(ny) * stride[0], np.arange(nx) * stride[1], indexing="ij")
    return np.stack([ys.ravel(), xs.ravel()], axis=1).astype(np.int64)


def _positions(position: Any, image_hw: tuple[int, int], patch: tuple[int, int], stride: tuple[int, int]
               ) -> np.ndarray:
    if isinstance(position, str):
        if position == "center":
            return np.array([[(image_hw[0] - patch[0]) // 2, (image_hw[1] - patch[1]) // 2]], np.int64)
        if position == "all":
            return occlusion_grid(image_hw, patch, stride)
        raise ValueError(f"position must be 'center', 'all' or (y, x), got {position!r}")
    try:
        y, x = (int(v) for v in position)
    except (TypeError, ValueError):
        raise ValueError(f"position must be 'center', 'all' or (y, x), got {position!r}") from None
    if not (0 <= y <= image_hw[0] - patch[0] and 0 <= x <= image_hw[1] - patch[1]):
        raise ValueError(f"position {(y, x)} puts the patch outside the {image_hw[0]}x{image_hw[1]} input")
    return np.array([[y, x]], np.int64)


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
    image_hw = (shape[2], shape[3])
    patch_hw = check_patch(patch, image_hw)
    stride_hw = check_stride(stride)
    check_tau(tau)
    graph = model if isinstance(model, Graph) else _captured(model, shape)
    positions = _positions(position, image_hw, patch_hw, stride_hw)
    prop = propagate(graph, input_region(positions, patch_hw, image_hw), tau=tau, uniform=False)
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
    area = node.shape[-2] * node.shape[-1] if node.shape and len(node.shape) >= 3 else 1
    if region.kind == RegionKind.NONE:
        text, incr = "unchanged", 0.0
    elif region.kind == RegionKind.FULL:
        text, incr = "whole", float(node.flops)
    else:
        h, w = float(region.h.mean()), float(region.w.mean())
        text = f"{h:.0f}x{w:.0f}" if region.h.size == 1 else f"~{h:.1f}x{w:.1f}"
        incr = float((node.flops * region.area() / area).mean())
    return NodeRow(node.name, node.kind.value, node.op, node.shape, text, float(node.flops), incr, node.reason)


def _reuse_stop(graph: Graph, regions: dict[str, Region]) -> str:
    for node in graph.nodes:
        region = regions[node.name]
        is_map = node.shape is not None and len(node.shape) >= 3 and node.shape[-2] * node.shape[-1] > 1
        if region.kind == RegionKind.FULL and is_map:
            return f"{node.name}: {region.reason}"
    return "never (the output itself is a map)"
