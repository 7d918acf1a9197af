"""Capture: trace a model with ``torch.fx`` and type every node (local, pointwise, merge, global).

The captured :class:`Graph` holds, per node, its kind, the geometry of local operators (kernel, stride,
padding, dilation) and the output shape for one input shape. Everything downstream (geometry, plans,
engine) reads this graph; nothing downstream looks at ``torch.fx`` directly except the engine, which
executes the traced module's nodes.
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.passes.shape_prop import ShapeProp

from incrinf.errors import CaptureError


class NodeKind(str, Enum):
    """How a node moves update regions (DESIGN.md)."""

    INPUT = "input"
    LOCAL = "local"  # conv / pool: region grows by the Krypton equations
    PAD = "pad"  # constant padding: region shifts
    POINTWISE = "pointwise"  # region unchanged
    MERGE = "merge"  # add / mul / concat of aligned maps: bounding box
    GLOBAL = "global"  # everything else: region becomes the whole tensor
    CONSTANT = "constant"  # does not depend on the input (parameters, buffers)
    META = "meta"  # produces no tensor (sizes, shapes): re-evaluated, never a region
    OUTPUT = "output"


@dataclass(frozen=True)
class LocalGeometry:
    """Geometry of a sliding-window operator along (height, width).

    Attributes:
        kernel: effective kernel extent ``dilation * (k - 1) + 1`` per axis.
        stride: stride per axis.
        pad_before: padding before the first element (top, left).
        pad_after: padding after the last element (bottom, right), including the extra
            right/bottom reach of ``ceil_mode`` windows.
        dilation: dilation per axis.
        pad_value: value the padded border holds (0 for conv and avg pool, -inf for max pool).
    """

    kernel: tuple[int, int]
    stride: tuple[int, int]
    pad_before: tuple[int, int]
    pad_after: tuple[int, int]
    dilation: tuple[int, int] = (1, 1)
    pad_value: float = 0.0


@dataclass
class Node:
    """One captured node.

    Attributes:
        name: the fx node name (unique).
        kind: how the node moves regions.
        op: short human description of the operation.
        inputs: names of the nodes whose tensors this node reads.
        shape: output shape for the captured input shape (``None`` for non-tensors).
        geometry: sliding-window geometry for LOCAL nodes.
        shift: (top, left) offset for PAD nodes.
        reason: why a node is GLOBAL (or why reuse stops there).
        flops: multiply-accumulates (or element operations) of one full evaluation, batch 1.
    """

    name: str
    kind: NodeKind
    op: str
    inputs: list[str]
    shape: tuple[int, ...] | None
    geometry: LocalGeometry | None = None
    shift: tuple[int, int] = (0, 0)
    reason: str = ""
    flops: int = 0
    fx_node: torch.fx.Node | None = field(default=None, repr=False)


@dataclass
class Graph:
    """A captured model: typed nodes in topological order plus the traced module."""

    module: torch.fx.GraphModule
    nodes: list[Node]
    input_shape: tuple[int, ...]
    signature: str

    def __post_init__(self) -> None:
        self.by_name = {n.name: n for n in self.nodes}

    @property
    def input(self) -> Node:
        return self.nodes[0]

    @property
    def output(self) -> Node:
        return self.nodes[-1]

    def unknown_ops(self) -> list[Node]:
        """GLOBAL nodes that are global only because incrinf does not know them."""
        return [n for n in self.nodes if n.kind == NodeKind.GLOBAL and n.reason.startswith("unknown")]


# --- op tables -------------------------------------------------------------------------------------------

_POINTWISE_MODULES: tuple[type[nn.Module], ...] = (
    nn.BatchNorm2d, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Hardswish,
    nn.Hardsigmoid, nn.GELU, nn.ELU, nn.SELU, nn.CELU, nn.PReLU, nn.Mish, nn.Softplus, nn.Hardtanh,
    nn.Identity, nn.Dropout, nn.Dropout2d, nn.AlphaDropout, nn.LocalResponseNorm,
)
_POINTWISE_FUNCTIONS: set[Any] = {
    F.relu, F.relu6, F.leaky_relu, F.silu, F.gelu, F.elu, F.selu, F.hardswish, F.hardsigmoid,
    F.hardtanh, F.sigmoid, F.tanh, F.mish, F.softplus, F.dropout, F.dropout2d, F.batch_norm,
    torch.relu, torch.sigmoid, torch.tanh, torch.exp, torch.neg, torch.abs, torch.clamp, torch.clip,
    operator.neg, F.local_response_norm,
}
_POINTWISE_METHODS = {
    "relu", "relu_", "sigmoid", "sigmoid_", "tanh", "clamp", "clamp_", "clip", "contiguous", "exp",
    "neg", "abs", "float", "half", "to", "type_as", "detach", "clone",
}
_ARITH_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.iadd, operator.imul,
    torch.add, torch.sub, torch.mul, torch.div,
}
_ARITH_METHODS = {"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_"}
_CAT_FUNCTIONS = {torch.cat, torch.concat}
_RESHAPE_METHODS = {"view", "reshape"}
_PERMUTE_METHODS = {"transpose", "permute"}


def _pair(value: Any) -> tuple[int, int]:
    if isinstance(value, (tuple, list)):
        return (int(value[0]), int(value[1])) if len(value) == 2 else (int(value[0]), int(value[0]))
    return int(value), int(value)


def _is_tensor_shape(meta: Any) -> bool:
    return meta is not None and hasattr(meta, "shape")


def _node_shape(node: torch.fx.Node) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta")
    return tuple(int(s) for s in meta.shape) if _is_tensor_shape(meta) else None


def _window_geometry(
    in_hw: tuple[int, int],
    out_hw: tuple[int, int],
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    pad_value: float,
) -> LocalGeometry:
    """Geometry whose padded input holds exactly the windows of every output (also for ceil_mode)."""
    eff = tuple(d * (k - 1) + 1 for k, d in zip(kernel, dilation))
    after = tuple(
        max((o - 1) * s + e - i - p, 0) for o, s, e, i, p in zip(out_hw, stride, eff, in_hw, padding)
    )
    return LocalGeometry(eff, stride, padding, after, dilation, pad_value)  # type: ignore[arg-type]


def _conv_flops(in_channels: int, groups: int, kernel: tuple[int, int], out_shape: tuple[int, ...]) -> int:
    return (in_channels // groups) * kernel[0] * kernel[1] * math.prod(out_shape[1:])


# --- the classifier --------------------------------------------------------------------------------------


class _Classifier:
    """Types each fx node of a shape-propagated GraphModule."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.nodes: dict[str, Node] = {}

    def _tensor_inputs(self, fx_node: torch.fx.Node) -> list[str]:
        return [a.name for a in fx_node.all_input_nodes]

    def _spatial_inputs(self, fx_node: torch.fx.Node) -> list[torch.fx.Node]:
        """Inputs that carry input-dependent spatial maps (not constants, not sizes)."""
        out = []
        for a in fx_node.all_input_nodes:
            node = self.nodes[a.name]
            if node.kind not in (NodeKind.CONSTANT, NodeKind.META) and node.shape is not None:
                out.append(a)
        return out

    def classify(self, fx_node: torch.fx.Node) -> Node:
        shape = _node_shape(fx_node)
        inputs = self._tensor_inputs(fx_node)
        base = Node(fx_node.name, NodeKind.GLOBAL, str(fx_node.target), inputs, shape, fx_node=fx_node)
        if fx_node.op == "placeholder":
            base.kind, base.op = NodeKind.INPUT, "input"
            return base
        if fx_node.op == "output":
            base.kind, base.op = NodeKind.OUTPUT, "output"
            return base
        if fx_node.op == "get_attr":
            base.kind, base.op = NodeKind.CONSTANT, f"parameter {fx_node.target}"
            return base
        dependent = [
            self.nodes[a.name] for a in fx_node.all_input_nodes
            if self.nodes[a.name].kind != NodeKind.CONSTANT
        ]
        if not dependent:
            base.kind, base.op = NodeKind.CONSTANT, _describe(fx_node, self.gm)
            return base
        if shape is None and not _yields_tensors(fx_node):
            base.kind, base.op = NodeKind.META, _describe(fx_node, self.gm)
            return base
        base.op = _describe(fx_node, self.gm)
        if fx_node.op == "call_module":
            self._module(fx_node, self.gm.get_submodule(str(fx_node.target)), base)
        elif fx_node.op == "call_function":
            self._function(fx_node, base)
        elif fx_node.op == "call_method":
            self._method(fx_node, base)
        return base

    # each handler sets kind/geometry/flops on `node`; anything unhandled stays GLOBAL with a reason

    def _module(self, fx_node: torch.fx.Node, mod: nn.Module, node: Node) -> None:
        in_shape = _node_shape(fx_node.args[0]) if fx_node.args else None
        if isinstance(mod, nn.Conv2d):
            if mod.padding_mode != "zeros":
                node.reason = f"conv padding_mode={mod.padding_mode!r} reads reflected values"
                return
            pad = _conv_padding(mod.padding, mod.kernel_size, mod.dilation)
            self._set_local(node, in_shape, _pair(mod.kernel_size), _pair(mod.stride), pad,
                            _pair(mod.dilation), 0.0)
            node.flops = _conv_flops(mod.in_channels, mod.groups, _pair(mod.kernel_size), node.shape)
        elif isinstance(mod, nn.MaxPool2d):
            if mod.return_indices:
                node.reason = "max pool returning indices"
                return
            self._set_local(node, in_shape, _pair(mod.kernel_size), _pair(mod.stride or mod.kernel_size),
                            (_pair(mod.padding), _pair(mod.padding)), _pair(mod.dilation), float("-inf"))
            node.flops = _pool_flops(node)
        elif isinstance(mod, nn.AvgPool2d):
            stride = mod.stride if mod.stride else mod.kernel_size
            self._set_local(node, in_shape, _pair(mod.kernel_size), _pair(stride),
                            (_pair(mod.padding), _pair(mod.padding)), (1, 1), 0.0)
            node.flops = _pool_flops(node)
        elif isinstance(mod, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)):
            self._adaptive(node, in_shape, isinstance(mod, nn.AdaptiveMaxPool2d))
        elif callable(getattr(mod, "without_padding", None)) and hasattr(mod, "kernel_size"):
            self._custom_local(mod, node, in_shape)
        elif isinstance(mod, (nn.ZeroPad2d, nn.ConstantPad2d)):
            self._set_pad(node, mod.padding)
        elif isinstance(mod, _POINTWISE_MODULES):
            self._set_pointwise(fx_node, node)
        elif isinstance(mod, (nn.Linear, nn.Flatten, nn.Softmax, nn.LogSoftmax)):
            node.reason = f"{type(mod).__name__} mixes all positions"
            node.flops = _linear_flops(mod, node)
        else:
            node.reason = f"unknown module {type(mod).__name__}"

    def _custom_local(self, mod: nn.Module, node: Node, in_shape: tuple[int, ...] | None) -> None:
        """A module that declares its window geometry and offers an unpadded twin (``without_padding()``),
        e.g. :class:`incrinf.quantized.QuantizedDepthwiseConv2d`."""
        pad = tuple(int(p) for p in mod.padding) if not isinstance(mod.padding, str) else None
        if pad is None or len(pad) != 4:
            node.reason = f"{type(mod).__name__} padding {mod.padding!r} is not (top, bottom, left, right)"
            return
        top, bottom, left, right = pad
        self._set_local(node, in_shape, _pair(mod.kernel_size), _pair(mod.stride),
                        ((top, left), (bottom, right)), _pair(getattr(mod, "dilation", 1)), 0.0)
        groups = int(getattr(mod, "groups", 1))
        node.flops = _conv_flops(in_shape[1] if in_shape else 0, groups, _pair(mod.kernel_size), node.shape)

    def _function(self, fx_node: torch.fx.Node, node: Node) -> None:
        fn = fx_node.target
        args, kwargs = fx_node.args, fx_node.kwargs
        in_shape = _node_shape(args[0]) if args and isinstance(args[0], torch.fx.Node) else None
        if fn in (F.conv2d, torch.conv2d):
            weight_shape = _node_shape(_arg(args, kwargs, 1, "weight"))
            kernel = (weight_shape[2], weight_shape[3])
            dilation = _pair(_arg(args, kwargs, 5, "dilation", 1))
            pad = _conv_padding(_arg(args, kwargs, 4, "padding", 0), kernel, dilation)
            self._set_local(node, in_shape, kernel, _pair(_arg(args, kwargs, 3, "stride", 1)), pad,
                            dilation, 0.0)
            node.flops = _conv_flops(in_shape[1], int(_arg(args, kwargs, 6, "groups", 1)), kernel, node.shape)
        elif fn in (F.max_pool2d, torch.max_pool2d):
            if _arg(args, kwargs, 6, "return_indices", False):
                node.reason = "max pool returning indices"
                return
            kernel = _pair(_arg(args, kwargs, 1, "kernel_size"))
            stride = _arg(args, kwargs, 2, "stride", None) or kernel
            padding = _pair(_arg(args, kwargs, 3, "padding", 0))
            self._set_local(node, in_shape, kernel, _pair(stride), (padding, padding),
                            _pair(_arg(args, kwargs, 4, "dilation", 1)), float("-inf"))
            node.flops = _pool_flops(node)
        elif fn in (F.avg_pool2d, torch._C._nn.avg_pool2d):
            kernel = _pair(_arg(args, kwargs, 1, "kernel_size"))
            stride = _arg(args, kwargs, 2, "stride", None) or kernel
            padding = _pair(_arg(args, kwargs, 3, "padding", 0))
            self._set_local(node, in_shape, kernel, _pair(stride), (padding, padding), (1, 1), 0.0)
            node.flops = _pool_flops(node)
        elif fn in (F.adaptive_avg_pool2d, F.adaptive_max_pool2d):
            self._adaptive(node, in_shape, fn is F.adaptive_max_pool2d)
        elif fn is F.pad:
            mode = _arg(args, kwargs, 2, "mode", "constant")
            pads = _arg(args, kwargs, 1, "pad")
            if mode != "constant" or len(pads) != 4:
                node.reason = f"pad mode {mode!r} with {len(pads)} values"
                return
            self._set_pad(node, tuple(pads))
        elif fn in _ARITH_FUNCTIONS:
            self._set_arith(fx_node, node)
        elif fn in _CAT_FUNCTIONS:
            dim = _arg(args, kwargs, 1, "dim", 0)
            self._set_cat(fx_node, node, dim)
        elif fn in _POINTWISE_FUNCTIONS or _is_eval_stochastic_depth(fn, args, kwargs):
            self._set_pointwise(fx_node, node)
        elif fn is operator.getitem:
            self._set_getitem(fx_node, node)
        elif fn in (torch.transpose, torch.permute):
            self._set_permute(fx_node, node, fn.__name__)
        elif fn is torch.reshape:
            self._set_reshape(fx_node, node, "reshape")
        elif fn in (torch.chunk, torch.split):
            self._set_split(fx_node, node, fn.__name__)
        elif fn is torch.flatten or fn in (torch.mean, torch.sum, torch.amax):
            node.reason = f"{getattr(fn, '__name__', fn)} mixes all positions"
        else:
            node.reason = f"unknown function {getattr(fn, '__name__', str(fn))}"

    def _method(self, fx_node: torch.fx.Node, node: Node) -> None:
        name = str(fx_node.target)
        if name in _POINTWISE_METHODS:
            self._set_pointwise(fx_node, node)
        elif name in _ARITH_METHODS:
            self._set_arith(fx_node, node)
        elif name in _RESHAPE_METHODS:
            self._set_reshape(fx_node, node, name)
        elif name in _PERMUTE_METHODS:
            self._set_permute(fx_node, node, name)
        elif name in ("chunk", "split"):
            self._set_split(fx_node, node, name)
        elif name in ("mean", "sum", "amax", "max", "flatten", "softmax"):
            node.reason = f"{name} mixes all positions"
        else:
            node.reason = f"unknown method {name}"

    # --- setters -----------------------------------------------------------------------------------------

    def _set_reshape(self, fx_node: torch.fx.Node, node: Node, name: str) -> None:
        in_shape = _node_shape(fx_node.args[0])
        if in_shape and node.shape and len(in_shape) >= 4 and len(node.shape) >= 4 \
                and in_shape[-2:] == node.shape[-2:] and in_shape[0] == node.shape[0]:
            node.kind = NodeKind.POINTWISE  # channel regrouping keeps every position in place
            self._check_single_spatial(fx_node, node)
        else:
            node.reason = f"{name} moves spatial positions"

    def _set_permute(self, fx_node: torch.fx.Node, node: Node, name: str) -> None:
        ndim = len(node.shape or ())
        raw = fx_node.args[1:]
        if len(raw) == 1 and isinstance(raw[0], (tuple, list)):
            raw = tuple(raw[0])
        dims = [int(d) % ndim for d in raw] if ndim else []
        moved = dims if name == "transpose" else [i for i, d in enumerate(dims) if i != d]
        if ndim >= 4 and moved and all(0 < d < ndim - 2 for d in moved):
            node.kind = NodeKind.POINTWISE  # channel shuffle: spatial axes stay last
            self._check_single_spatial(fx_node, node)
        else:
            node.reason = f"{name} moves spatial positions"

    def _set_split(self, fx_node: torch.fx.Node, node: Node, name: str) -> None:
        dim = _arg(fx_node.args, fx_node.kwargs, 2, "dim", 0)
        in_shape = _node_shape(fx_node.args[0])
        if in_shape and len(in_shape) == 4 and int(dim) in (1, -3):
            node.kind = NodeKind.POINTWISE
        else:
            node.reason = f"{name} along dim {dim}"

    def _set_local(self, node: Node, in_shape: tuple[int, ...] | None, kernel: tuple[int, int],
                   stride: tuple[int, int], padding: Any, dilation: tuple[int, int], pad_value: float) -> None:
        if in_shape is None or node.shape is None or len(in_shape) != 4 or len(node.shape) != 4:
            node.reason = "sliding window over a tensor that is not N x C x H x W"
            return
        before, after_min = padding if isinstance(padding[0], tuple) else (padding, padding)
        geom = _window_geometry(in_shape[2:], node.shape[2:], kernel, stride, before, dilation, pad_value)
        # explicit asymmetric padding ('same' convs) may exceed what the output needs: keep the larger
        after = (max(geom.pad_after[0], after_min[0]), max(geom.pad_after[1], after_min[1]))
        node.kind = NodeKind.LOCAL
        node.geometry = LocalGeometry(geom.kernel, geom.stride, geom.pad_before, after, dilation, pad_value)

    def _set_pad(self, node: Node, padding: Any) -> None:
        pads = tuple(padding) if isinstance(padding, (tuple, list)) else (padding,) * 4
        left, right, top, bottom = (int(p) for p in pads)
        if min(left, right, top, bottom) < 0:
            node.reason = "negative padding crops the map"
            return
        node.kind = NodeKind.PAD
        node.shift = (top, left)

    def _set_pointwise(self, fx_node: torch.fx.Node, node: Node) -> None:
        node.kind = NodeKind.POINTWISE
        self._check_single_spatial(fx_node, node)
        if node.kind == NodeKind.POINTWISE and node.shape is not None:
            node.flops = math.prod(node.shape[1:])

    def _check_single_spatial(self, fx_node: torch.fx.Node, node: Node) -> None:
        spatial = self._spatial_inputs(fx_node)
        if len(spatial) > 1:
            self._set_arith(fx_node, node)

    def _set_arith(self, fx_node: torch.fx.Node, node: Node) -> None:
        spatial = self._spatial_inputs(fx_node)
        if node.shape is None or len(node.shape) < 3:
            node.reason = "arithmetic on a non-spatial tensor"
            return
        hw = node.shape[-2:]
        aligned = [s for s in spatial if (_node_shape(s) or ())[-2:] == hw and len(_node_shape(s)) >= 3]
        node.flops = math.prod(node.shape[1:])
        if len(spatial) == 1 and aligned:
            node.kind = NodeKind.POINTWISE
        elif len(aligned) == len(spatial):
            node.kind = NodeKind.MERGE
        else:
            # e.g. squeeze-and-excitation: a map times scales that depend on the whole map
            node.kind = NodeKind.GLOBAL
            others = [s.name for s in spatial if s not in aligned]
            node.reason = f"combines the map with {', '.join(others)}, which depends on the whole input"

    def _set_cat(self, fx_node: torch.fx.Node, node: Node, dim: Any) -> None:
        if node.shape is not None and len(node.shape) == 4 and int(dim) in (1, -3):
            node.kind = NodeKind.MERGE
        else:
            node.reason = f"concatenation along dim {dim}"

    def _set_getitem(self, fx_node: torch.fx.Node, node: Node) -> None:
        source = fx_node.args[0]
        index = fx_node.args[1]
        if isinstance(index, int) and _node_shape(source) is None:
            node.kind = NodeKind.POINTWISE  # picks one tensor out of a chunk/split tuple
        elif isinstance(index, tuple) and len(index) >= 2 and index[0] == slice(None) \
                and all(i == slice(None) for i in index[2:]) and isinstance(index[1], slice):
            node.kind = NodeKind.POINTWISE  # channel slice
        else:
            node.reason = "indexing that may move positions"

    def _adaptive(self, node: Node, in_shape: tuple[int, ...] | None, is_max: bool) -> None:
        if in_shape and node.shape and len(in_shape) == 4 and len(node.shape) == 4:
            (ih, iw), (oh, ow) = in_shape[2:], node.shape[2:]
            if ih % oh == 0 and iw % ow == 0 and (oh > 1 or ow > 1 or (ih == 1 and iw == 1)):
                # an adaptive pool whose bins tile the input exactly is an ordinary pool
                kernel = (ih // oh, iw // ow)
                self._set_local(node, in_shape, kernel, kernel, ((0, 0), (0, 0)), (1, 1),
                                float("-inf") if is_max else 0.0)
                node.flops = _pool_flops(node)
                return
        node.reason = "adaptive pooling to a small grid mixes all positions"
        node.flops = math.prod(in_shape[1:]) if in_shape else 0


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _conv_padding(padding: Any, kernel: Any, dilation: Any) -> tuple[tuple[int, int], tuple[int, int]]:
    """(before, after) padding for a conv's ``padding`` argument, including the string forms."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0), (0, 0)
        kernel, dilation = _pair(kernel), _pair(dilation)
        total = [d * (k - 1) for k, d in zip(kernel, dilation)]
        before = (total[0] // 2, total[1] // 2)
        return before, (total[0] - before[0], total[1] - before[1])
    pad = _pair(padding)
    return pad, pad


def _pool_flops(node: Node) -> int:
    g = node.geometry
    k = (g.kernel[0] // max(g.dilation[0], 1), g.kernel[1] // max(g.dilation[1], 1)) if g else (1, 1)
    return k[0] * k[1] * math.prod(node.shape[1:]) if node.shape else 0


def _linear_flops(mod: nn.Module, node: Node) -> int:
    if isinstance(mod, nn.Linear):
        return mod.in_features * mod.out_features
    return 0


def _is_eval_stochastic_depth(fn: Any, args: tuple, kwargs: dict) -> bool:
    if getattr(fn, "__name__", "") != "stochastic_depth":
        return False
    return not bool(_arg(args, kwargs, 3, "training", True))


def _yields_tensors(fx_node: torch.fx.Node) -> bool:
    """True for nodes returning tuples of tensors (chunk/split), which ShapeProp leaves shapeless."""
    meta = fx_node.meta.get("tensor_meta")
    return isinstance(meta, (tuple, list)) and any(_is_tensor_shape(m) for m in meta)


def _describe(fx_node: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
    if fx_node.op == "call_module":
        return repr(gm.get_submodule(str(fx_node.target))).split("\n")[0][:80]
    target = fx_node.target
    return getattr(target, "__name__", str(target))


# --- capture ---------------------------------------------------------------------------------------------


def parse_input_shape(input_shape: Any) -> tuple[int, int, int, int]:
    """Normalise ``(C, H, W)``, ``(N, C, H, W)`` or ``"3x224x224"`` to ``(1, C, H, W)``.

    Raises:
        ValueError: for anything else.
    """
    if isinstance(input_shape, str):
        try:
            input_shape = tuple(int(p) for p in input_shape.lower().split("x"))
        except ValueError:
            raise ValueError(f"input_shape {input_shape!r} must look like 3x224x224") from None
    try:
        dims = tuple(int(d) for d in input_shape)
    except TypeError:
        raise ValueError(f"input_shape must be (C, H, W) or (1, C, H, W), got {input_shape!r}") from None
    if len(dims) == 3:
        dims = (1, *dims)
    if len(dims) != 4 or dims[0] != 1 or min(dims) < 1:
        raise ValueError(f"input_shape must be (C, H, W) or (1, C, H, W) with positive sizes, got {input_shape!r}")
    return dims  # type: ignore[return-value]


class _Tracer(torch.fx.Tracer):
    """Keeps modules that declare their own window geometry (``without_padding``) as leaves."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return callable(getattr(m, "without_padding", None)) or super().is_leaf_module(m, module_qualified_name)


def trace(model: nn.Module | Callable) -> torch.fx.GraphModule:
    """Symbolically trace ``model``.

    Raises:
        CaptureError: naming the construct ``torch.fx`` could not trace.
    """
    if isinstance(model, torch.fx.GraphModule):
        return model
    if not isinstance(model, nn.Module):
        raise CaptureError(f"expected a torch.nn.Module, got {type(model).__name__}")
    try:
        graph = _Tracer().trace(model)
        return torch.fx.GraphModule(model, graph, type(model).__name__)
    except Exception as exc:  # fx raises many types; all mean "cannot capture"
        where = _innermost_frame(exc)
        raise CaptureError(
            f"torch.fx cannot trace {type(model).__name__}: {type(exc).__name__}: {exc}{where}. "
            "Data-dependent control flow (if/for on tensor values) and non-torch calls on tensors "
            "cannot be captured; wrap such code in a leaf module or make it shape-only."
        ) from exc


def _innermost_frame(exc: BaseException) -> str:
    tb = exc.__traceback__
    last = None
    while tb is not None:
        if "torch/fx" not in tb.tb_frame.f_code.co_filename:
            last = tb
        tb = tb.tb_next
    if last is None:
        return ""
    code = last.tb_frame.f_code
    return f" (in {code.co_name}, {code.co_filename}:{last.tb_lineno})"


def capture(model: nn.Module, input_shape: Any) -> Graph:
    """Trace ``model`` and type every node for one input shape.

    Args:
        model: any ``nn.Module`` that ``torch.fx`` can trace. It is put in eval mode.
        input_shape: ``(C, H, W)``, ``(1, C, H, W)`` or ``"CxHxW"``.

    Returns:
        The typed :class:`Graph`.

    Raises:
        CaptureError: the model cannot be traced or fails on an input of that shape.
        ValueError: malformed ``input_shape``.
    """
    shape = parse_input_shape(input_shape)
    if not isinstance(model, nn.Module):
        raise CaptureError(f"expected a torch.nn.Module, got {type(model).__name__}")
    model.eval()  # before tracing: some ops (stochastic depth) bake the training flag into the graph
    gm = trace(model)
    gm.eval()
    param = next(iter(gm.parameters()), None)
    example = torch.zeros(shape, dtype=param.dtype if param is not None else torch.float32,
                          device=param.device if param is not None else "cpu")
    try:
        with torch.no_grad():
            ShapeProp(gm).propagate(example)
    except Exception as exc:
        raise CaptureError(f"the model fails on an input of shape {shape}: {type(exc).__name__}: {exc}") from exc
    classifier = _Classifier(gm)
    nodes: list[Node] = []
    for fx_node in gm.graph.nodes:
        node = classifier.classify(fx_node)
        classifier.nodes[node.name] = node
        nodes.append(node)
    placeholders = [n for n in nodes if n.kind == NodeKind.INPUT]
    if len(placeholders) != 1:
        raise CaptureError(f"expected a model with one input tensor, found {len(placeholders)}")
    return Graph(gm, nodes, shape, _signature(nodes, shape))


def _signature(nodes: list[Node], shape: tuple[int, ...]) -> str:
    """Structure-and-shape hash: two models of one architecture share it (weights do not enter)."""
    h = hashlib.sha1(repr(shape).encode())
    for n in nodes:
        h.update(repr((n.name, n.kind.value, n.op, n.inputs, n.shape, n.geometry, n.shift)).encode())
    return h.hexdigest()[:16]
