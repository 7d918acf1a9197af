"""Engine: materialize every node's output once, then run batches of update regions through the graph.

For a batch of N positions each node is in one of three states: unchanged (the materialized base value),
box (an (N, C, h, w) tensor of each position's update region) or full (an (N, ...) tensor). Local nodes
gather each position's read-in window from their pre-padded base input, overlay the incoming region and run
the node's own operator with padding 0 on the packed batch; merges align their inputs on the bounding box;
global nodes receive full projections. The engine knows nothing about occlusion or cameras.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from incrinf.geometry import RegionKind
from incrinf.graph import Graph, Node, NodeKind
from incrinf.kernels import dispatch
from incrinf.kernels.gather import from_rows, to_rows
from incrinf.plan import BatchPlan, NodePlan


class IncrementalEngine:
    """Materialized base values of one input, and batched incremental runs over them.

    Args:
        graph: captured graph.
        base_input: (1, C, H, W) the unchanged input.
    """

    def __init__(self, graph: Graph, base_input: torch.Tensor) -> None:
        self.graph = graph
        self.gm = graph.module
        self.base = _materialize(graph.module, base_input)
        self._padded_rows: dict[str, torch.Tensor] = {}
        self._rows: dict[str, torch.Tensor] = {}
        self._unpadded = {n.name: _unpadded_op(self.gm, n, self.base) for n in graph.nodes if n.kind == NodeKind.LOCAL}
        self._divisors: dict[str, torch.Tensor | None] = {}
        self._last_use = _last_uses(graph)
        self.last_peak_bytes = 0  # largest sum of live batch tensors during the last run

    @property
    def base_output(self) -> Any:
        """The model's output for the unchanged input."""
        return self.base[self.graph.output.name]

    # --- cached views of base maps -----------------------------------------------------------------------

    def padded_rows(self, node: Node, source: str) -> torch.Tensor:
        """(Hp*Wp, C) rows of ``source``'s base map padded for ``node``'s windows."""
        rows = self._padded_rows.get(node.name)
        if rows is None:
            g = node.geometry
            x = self.base[source]
            pad = (g.pad_before[1], g.pad_after[1], g.pad_before[0], g.pad_after[0])
            if any(pad):
                x = F.pad(x, pad, value=g.pad_value)
            rows = self._padded_rows[node.name] = to_rows(x).contiguous()
        return rows

    def rows(self, name: str) -> torch.Tensor:
        """(H*W, C) rows of a base map."""
        rows = self._rows.get(name)
        if rows is None:
            rows = self._rows[name] = to_rows(self.base[name]).contiguous()
        return rows

    # --- running a batch ---------------------------------------------------------------------------------

    @torch.no_grad()
    def run(self, plan: BatchPlan, input_region: torch.Tensor) -> Any:
        """Run one batch.

        Args:
            plan: the batch's plan (see :func:`incrinf.plan.build_plan`).
            input_region: (N, C, h, w) new values of each position's input box (the plan's input region).

        Returns:
            The graph output for every position, batch dimension N (full tensors).
        """
        values: dict[str, Any] = {}
        states: dict[str, RegionKind] = {}
        n = plan.n
        peak = 0
        for index, node in enumerate(self.graph.nodes):
            node_plan = plan.nodes[node.name]
            if node.kind == NodeKind.INPUT:
                values[node.name] = input_region.contiguous(memory_format=torch.channels_last)
                states[node.name] = node_plan.state
            elif node.kind == NodeKind.OUTPUT:
                self.last_peak_bytes = peak
                return self._call(node, values, states, node_plan, n)
            elif node_plan.state == RegionKind.NONE or node.kind == NodeKind.CONSTANT:
                states[node.name] = RegionKind.NONE
                if node.kind == NodeKind.META:
                    values[node.name] = self._call(node, values, states, node_plan, n)
            else:
                values[node.name] = self._node(node, node_plan, values, states, n)
                states[node.name] = node_plan.state
                peak = max(peak, _live_bytes(values))
            for name in self._last_use.get(index, ()):
                values.pop(name, None)
        raise AssertionError("graph has no output node")

    def _node(self, node: Node, plan: NodePlan, values: dict, states: dict, n: int) -> Any:
        if plan.windowings and node.kind == NodeKind.LOCAL:
            (source, windowing), = plan.windowings.items()
            window = self._window(node, source, windowing, values, states, n, padded=True)
            out = self._unpadded[node.name](window)
            if plan.out_index is not None:
                out = self._divide(node, out, plan)
            return out
        if node.kind == NodeKind.PAD and states.get(node.inputs[0]) == RegionKind.BOX:
            return values[node.inputs[0]]  # a box just moves: same values, shifted coordinates
        if node.kind == NodeKind.MERGE and plan.windowings or (
                plan.state == RegionKind.BOX and node.kind in (NodeKind.MERGE, NodeKind.POINTWISE)):
            aligned = dict(values)
            for source, windowing in plan.windowings.items():
                aligned[source] = self._window(node, source, windowing, values, states, n, padded=False)
            return self._invoke(node, lambda name: aligned[name] if name in aligned else self.base[name])
        return self._call(node, values, states, plan, n)

    def _window(self, node: Node, source: str, windowing, values: dict, states: dict, n: int,
                padded: bool) -> torch.Tensor:
        base_rows = self.padded_rows(node, source) if padded else self.rows(source)
        region = None
        if windowing.dest is not None and states.get(source) == RegionKind.BOX:
            region = to_rows(values[source])
        # one pass: gather + overlay (a single Triton kernel on CUDA, index_select + index_copy_ elsewhere)
        rows = dispatch.prepare_windows(base_rows, windowing.read_index, windowing.dest, region, windowing.source,
                                        windowing.combined)
        return from_rows(rows, n, windowing.hr, windowing.wr)

    def _divide(self, node: Node, out: torch.Tensor, plan: NodePlan) -> torch.Tensor:
        divisor = self._divisors.get(node.name, ...)
        if divisor is ...:
            divisor = self._divisors[node.name] = _avg_pool_correction(self.gm, node, self.base)
        if divisor is None:
            return out
        factors = divisor.index_select(0, plan.out_index).view(out.shape[0], 1, out.shape[2], out.shape[3])
        return out * factors

    def _call(self, node: Node, values: dict, states: dict, plan: NodePlan, n: int) -> Any:
        """Run the node's original operator on full tensors (box inputs projected, base inputs expanded)."""
        def value(name: str) -> Any:
            src = self.graph.by_name[name]
            if src.kind == NodeKind.META and node.kind != NodeKind.META:
                # sizes feeding a full-state op must describe full tensors, not boxes
                return self._full_meta(src, n)
            state = states.get(name, RegionKind.NONE)
            if name in plan.scatters:
                scatter = plan.scatters[name]
                src = self.graph.by_name[name]
                hh, ww = src.shape[-2:]
                rows = dispatch.project(self.rows(name), n, scatter.dest, to_rows(values[name]), scatter.source,
                                        scatter.combined)
                return from_rows(rows, n, hh, ww, tuple(src.shape[1:-2]))
            if state == RegionKind.NONE:
                if name in values:  # sizes and shapes recomputed for this batch
                    return values[name]
                base = self.base[name]
                src = self.graph.by_name[name]
                if isinstance(base, torch.Tensor) and src.kind not in (NodeKind.CONSTANT, NodeKind.META) \
                        and base.dim() >= 1 and base.shape[0] == 1 and n > 1 and node.kind != NodeKind.META:
                    return base.expand(n, *base.shape[1:])
                return base
            return values[name]

        return self._invoke(node, value)

    def _full_meta(self, node: Node, n: int) -> Any:
        """A META node (sizes, shapes) evaluated as if every input were a full batch of N."""
        def shape_only(name: str) -> Any:
            src = self.graph.by_name[name]
            if src.kind == NodeKind.META:
                return self._full_meta(src, n)
            base = self.base[name]
            if isinstance(base, torch.Tensor) and src.kind != NodeKind.CONSTANT and base.dim() >= 1:
                return torch.empty((n, *base.shape[1:]), dtype=base.dtype, device="meta")
            return base

        return self._invoke(node, shape_only)

    def _invoke(self, node: Node, value: Callable[[str], Any]) -> Any:
        fx_node = node.fx_node
        args = torch.fx.node.map_arg(fx_node.args, lambda a: value(a.name))
        kwargs = torch.fx.node.map_arg(fx_node.kwargs, lambda a: value(a.name))
        if fx_node.op == "call_module":
            return self.gm.get_submodule(str(fx_node.target))(*args, **kwargs)
        if fx_node.op == "call_function":
            return fx_node.target(*args, **kwargs)
        if fx_node.op == "call_method":
            return getattr(args[0], str(fx_node.target))(*args[1:], **kwargs)
        if fx_node.op == "output":
            return args[0]
        raise AssertionError(f"cannot invoke {fx_node.op}")


# --- helpers ---------------------------------------------------------------------------------------------


def _materialize(gm: torch.fx.GraphModule, x: torch.Tensor) -> dict[str, Any]:
    """Every node's output for input ``x``."""
    env: dict[str, Any] = {}

    class _Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            env[n.name] = out
            return out

    with torch.no_grad():
        _Recorder(gm).run(x)
    return env


def _live_bytes(values: dict[str, Any]) -> int:
    return sum(v.untyped_storage().nbytes() for v in values.values() if isinstance(v, torch.Tensor))


def _last_uses(graph: Graph) -> dict[int, list[str]]:
    """Node index -> names whose values are no longer needed after that node."""
    last: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        for name in node.inputs:
            last[name] = i
    out: dict[int, list[str]] = {}
    for name, i in last.items():
        out.setdefault(i, []).append(name)
    return out


def _module_or_args(gm: torch.fx.GraphModule, node: Node, base: dict) -> tuple[nn.Module | None, list, dict]:
    fx_node = node.fx_node
    args = list(torch.fx.node.map_arg(fx_node.args, lambda a: base[a.name]))
    kwargs = dict(torch.fx.node.map_arg(fx_node.kwargs, lambda a: base[a.name]))
    mod = gm.get_submodule(str(fx_node.target)) if fx_node.op == "call_module" else None
    return mod, args, kwargs


def _arg(args: list, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _unpadded_op(gm: torch.fx.GraphModule, node: Node, base: dict) -> Callable[[torch.Tensor], torch.Tensor]:
    """The node's operator with padding 0 (its input windows arrive pre-padded)."""
    mod, args, kwargs = _module_or_args(gm, node, base)
    in_shape = base[node.inputs[0]].shape if node.inputs else None
    if isinstance(mod, nn.Conv2d):
        return lambda x: F.conv2d(x, mod.weight, mod.bias, mod.stride, 0, mod.dilation, mod.groups)
    if isinstance(mod, nn.MaxPool2d):
        return lambda x: F.max_pool2d(x, mod.kernel_size, mod.stride, 0, mod.dilation)
    if isinstance(mod, nn.AvgPool2d):
        stride = mod.stride or mod.kernel_size
        return lambda x: F.avg_pool2d(x, mod.kernel_size, stride, 0)
    if isinstance(mod, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)) or node.fx_node.target in (
            F.adaptive_avg_pool2d, F.adaptive_max_pool2d):
        kernel = (in_shape[2] // node.shape[2], in_shape[3] // node.shape[3])
        if isinstance(mod, nn.AdaptiveMaxPool2d) or node.fx_node.target is F.adaptive_max_pool2d:
            return lambda x: F.max_pool2d(x, kernel, kernel)
        return lambda x: F.avg_pool2d(x, kernel, kernel)
    if mod is not None and hasattr(mod, "without_padding"):
        return mod.without_padding()
    fn = node.fx_node.target
    if fn in (F.conv2d, torch.conv2d):
        weight, bias = _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")
        stride, dilation = _arg(args, kwargs, 3, "stride", 1), _arg(args, kwargs, 5, "dilation", 1)
        groups = _arg(args, kwargs, 6, "groups", 1)
        return lambda x: F.conv2d(x, weight, bias, stride, 0, dilation, groups)
    if fn in (F.max_pool2d, torch.max_pool2d):
        kernel = _arg(args, kwargs, 1, "kernel_size")
        stride = _arg(args, kwargs, 2, "stride", None) or kernel
        dilation = _arg(args, kwargs, 4, "dilation", 1)
        return lambda x: F.max_pool2d(x, kernel, stride, 0, dilation)
    if fn in (F.avg_pool2d, torch._C._nn.avg_pool2d):
        kernel = _arg(args, kwargs, 1, "kernel_size")
        stride = _arg(args, kwargs, 2, "stride", None) or kernel
        return lambda x: F.avg_pool2d(x, kernel, stride, 0)
    raise AssertionError(f"no unpadded form for local node {node.name} ({node.op})")


def _avg_pool_correction(gm: torch.fx.GraphModule, node: Node, base: dict) -> torch.Tensor | None:
    """(out_h*out_w, 1) factors turning a plain k*k average into the node's true average (which may divide
    by fewer elements at the border: count_include_pad=False, ceil_mode overhang, divisor_override)."""
    mod, args, kwargs = _module_or_args(gm, node, base)
    if mod is not None and isinstance(mod, nn.AvgPool2d):
        kernel, stride, padding = mod.kernel_size, mod.stride or mod.kernel_size, mod.padding
        ceil_mode, include_pad, override = mod.ceil_mode, mod.count_include_pad, mod.divisor_override
    elif node.fx_node.target in (F.avg_pool2d, torch._C._nn.avg_pool2d):
        kernel = _arg(args, kwargs, 1, "kernel_size")
        stride = _arg(args, kwargs, 2, "stride", None) or kernel
        padding = _arg(args, kwargs, 3, "padding", 0)
        ceil_mode = _arg(args, kwargs, 4, "ceil_mode", False)
        include_pad = _arg(args, kwargs, 5, "count_include_pad", True)
        override = _arg(args, kwargs, 6, "divisor_override", None)
    else:
        return None  # adaptive pools whose bins tile the input: plain averages
    in_shape = base[node.inputs[0]].shape
    ref = torch.ones(1, 1, *in_shape[-2:], dtype=base[node.name].dtype, device=base[node.name].device)
    true = F.avg_pool2d(ref, kernel, stride, padding, ceil_mode, include_pad, override)
    # a window of ones averaged over what the node divides by, versus over k*k: their ratio is the factor
    plain = F.avg_pool2d(F.pad(ref, _pads(node)), kernel, stride, 0)
    plain = plain[..., : true.shape[-2], : true.shape[-1]]
    factors = true / plain.clamp_min(1e-12)
    if torch.allclose(factors, torch.ones_like(factors)):
        return None
    return factors.reshape(-1, 1)


def _pads(node: Node) -> tuple[int, int, int, int]:
    g = node.geometry
    return (g.pad_before[1], g.pad_after[1], g.pad_before[0], g.pad_after[0])


def unpadded_operator(gm: torch.fx.GraphModule, node: Node, values: dict[str, Any]
                      ) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A LOCAL node's operator with padding 0, for executors that gather pre-padded windows themselves.

    Args:
        gm: the module whose submodules and parameters the operator uses.
        node: a LOCAL node of a graph captured from ``gm``'s architecture.
        values: every input of ``node`` (and ``node`` itself) by name, e.g. one materialized run.

    Returns:
        ``op(windows (N, C, hr, wr)) -> (N, C', h, w)``, or None for an average pool whose border outputs
        divide by fewer elements than the kernel (a per-output correction the caller would have to apply).
    """
    if _avg_pool_correction(gm, node, values) is not None:
        return None
    return _unpadded_op(gm, node, values)
