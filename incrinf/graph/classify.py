"""Typing traced nodes: local, pad, pointwise, merge, global, constant, meta (the Krypton/CacheInf taxonomy).

Works for any number of spatial dimensions: the graph's spatial axes are the input's last ``d`` axes (1 for
signals, 2 for images, 3 for volumes), and a tensor is a *map* when it keeps them as its last ``d`` axes
behind a batch axis and one or more channel axes (ShuffleNet's channel shuffle makes 5-D maps of a 2-D input).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from incrinf.graph.nodes import LocalGeometry, Node, NodeKind, Operator

_CONV_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_MAX_POOL_MODULES = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)
_AVG_POOL_MODULES = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)
_ADAPTIVE_AVG_MODULES = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)
_ADAPTIVE_MAX_MODULES = (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)
_PAD_MODULES = (nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d, nn.ZeroPad1d, nn.ZeroPad2d, nn.ZeroPad3d)
_BATCH_NORM_MODULES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_POINTWISE_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Hardsigmoid, nn.GELU, nn.ELU,
    nn.SELU, nn.CELU, nn.PReLU, nn.Mish, nn.Softplus, nn.Hardtanh, nn.Identity, nn.Dropout, nn.Dropout1d,
    nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
)


def preserves_shape(module: nn.Module) -> bool:
    """Whether a module's output has its (one) input's shape and dtype: activations, dropouts, batch norms."""
    return isinstance(module, _POINTWISE_MODULES + _BATCH_NORM_MODULES)


_CONV_FUNCTIONS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3, torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3}
_MAX_POOL_FUNCTIONS = {F.max_pool1d: 1, F.max_pool2d: 2, F.max_pool3d: 3, torch.max_pool1d: 1, torch.max_pool2d: 2,
                       torch.max_pool3d: 3}
_AVG_POOL_FUNCTIONS = {F.avg_pool1d: 1, F.avg_pool2d: 2, F.avg_pool3d: 3, torch._C._nn.avg_pool2d: 2,
                       torch._C._nn.avg_pool3d: 3}
_ADAPTIVE_FUNCTIONS = {F.adaptive_avg_pool1d: False, F.adaptive_avg_pool2d: False, F.adaptive_avg_pool3d: False,
                       F.adaptive_max_pool1d: True, F.adaptive_max_pool2d: True, F.adaptive_max_pool3d: True}
_POINTWISE_FUNCTIONS: set[Any] = {
    F.relu, F.relu6, F.leaky_relu, F.silu, F.gelu, F.elu, F.selu, F.hardswish, F.hardsigmoid,
    F.hardtanh, F.sigmoid, F.tanh, F.mish, F.softplus, F.dropout, F.dropout1d, F.dropout2d, F.dropout3d,
    torch.relu, torch.sigmoid, torch.tanh, torch.exp, torch.neg, torch.abs, torch.clamp, torch.clip, operator.neg,
}
_POINTWISE_METHODS = {
    "relu", "relu_", "sigmoid", "sigmoid_", "tanh", "clamp", "clamp_", "clip", "contiguous", "exp",
    "neg", "abs", "float", "half", "to", "type_as", "detach", "clone",
}
_ARITH_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.iadd, operator.imul, operator.isub,
    operator.itruediv, torch.add, torch.sub, torch.mul, torch.div,
}
WINDOW_MODULES = _CONV_MODULES + _MAX_POOL_MODULES + _AVG_POOL_MODULES
WINDOW_FUNCTIONS = set(_CONV_FUNCTIONS) | set(_MAX_POOL_FUNCTIONS) | set(_AVG_POOL_FUNCTIONS)
_INPLACE_FUNCTIONS = {operator.iadd, operator.imul, operator.isub, operator.itruediv}
_ARITH_METHODS = {"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_"}
_CAT_FUNCTIONS = {torch.cat, torch.concat}
_RESHAPE_METHODS = {"view", "reshape"}
_PERMUTE_METHODS = {"transpose", "permute"}
_MIXING_METHODS = {"mean", "sum", "amax", "max", "flatten", "softmax"}


def expand(value: Any, d: int) -> tuple[int, ...]:
    """An int or a sequence as a ``d``-tuple of ints (a single-element sequence is repeated)."""
    if isinstance(value, (tuple, list)):
        values = [int(v) for v in value]
        return tuple(values) if len(values) == d else tuple(values[:1] * d)
    return (int(value),) * d


def _shape(node: torch.fx.Node) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None
    return tuple(int(s) for s in meta.shape) if meta is not None and hasattr(meta, "shape") else None


def _yields_tensors(fx_node: torch.fx.Node) -> bool:
    """True for nodes returning tuples of tensors (chunk/split), which ShapeProp leaves shapeless."""
    meta = fx_node.meta.get("tensor_meta")
    return isinstance(meta, (tuple, list)) and any(m is not None and hasattr(m, "shape") for m in meta)


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _describe(fx_node: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
    if fx_node.op == "call_module":
        return repr(gm.get_submodule(str(fx_node.target))).split("\n")[0][:80]
    return getattr(fx_node.target, "__name__", str(fx_node.target))


def _is_inplace(fx_node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    if fx_node.op == "call_function":
        # torch's in-place functions end in an underscore (torch.relu_, F.relu_)
        return fx_node.target in _INPLACE_FUNCTIONS or bool(fx_node.kwargs.get("inplace", False)) \
            or getattr(fx_node.target, "__name__", "").endswith("_") and not \
            getattr(fx_node.target, "__name__", "").startswith("_")
    if fx_node.op == "call_method":
        return str(fx_node.target).endswith("_")
    if fx_node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(fx_node.target)), "inplace", False))
    return False


def conv_padding(padding: Any, kernel: tuple[int, ...], dilation: tuple[int, ...]
                 ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(before, after)`` padding per axis of a convolution's ``padding`` argument, string forms included."""
    d = len(kernel)
    if isinstance(padding, str):
        if padding == "valid":
            return (0,) * d, (0,) * d
        total = [dl * (k - 1) for k, dl in zip(kernel, dilation)]
        before = tuple(t // 2 for t in total)
        return before, tuple(t - b for t, b in zip(total, before))
    pad = expand(padding, d)
    return pad, pad


class Classifier:
    """Types each fx node of a shape-propagated GraphModule.

    Args:
        gm: the traced module, shapes propagated (``ShapeProp``).
        spatial_dims: number of spatial axes of the model input.
    """

    def __init__(self, gm: torch.fx.GraphModule, spatial_dims: int) -> None:
        self.gm = gm
        self.d = spatial_dims
        self.nodes: dict[str, Node] = {}

    def classify(self, fx_node: torch.fx.Node) -> Node:
        """The typed :class:`Node` of ``fx_node`` (its inputs must have been classified before)."""
        node = self._classify(fx_node)
        node.inplace = node.kind not in (NodeKind.INPUT, NodeKind.OUTPUT) and _is_inplace(fx_node, self.gm)
        self.nodes[node.name] = node
        return node

    def _classify(self, fx_node: torch.fx.Node) -> Node:
        shape = _shape(fx_node)
        inputs = [a.name for a in fx_node.all_input_nodes]
        node = Node(fx_node.name, NodeKind.GLOBAL, str(fx_node.target), inputs, shape, fx_node=fx_node)
        if fx_node.op == "placeholder":
            node.kind, node.operator, node.op = NodeKind.INPUT, Operator.INPUT, "input"
            return node
        if fx_node.op == "output":
            node.kind, node.operator, node.op = NodeKind.OUTPUT, Operator.OUTPUT, "output"
            return node
        if fx_node.op == "get_attr":
            node.kind, node.operator, node.op = NodeKind.CONSTANT, Operator.CONSTANT, f"parameter {fx_node.target}"
            return node
        node.op = _describe(fx_node, self.gm)
        if all(self.nodes[a].kind == NodeKind.CONSTANT for a in inputs):
            node.kind, node.operator = NodeKind.CONSTANT, Operator.CONSTANT
            return node
        if shape is None and not _yields_tensors(fx_node):
            node.kind = NodeKind.META
            return node
        if fx_node.op == "call_module":
            self._module(fx_node, self.gm.get_submodule(str(fx_node.target)), node)
        elif fx_node.op == "call_function":
            self._function(fx_node, node)
        elif fx_node.op == "call_method":
            self._method(fx_node, node)
        return node

    def _is_map(self, shape: tuple[int, ...] | None) -> bool:
        return shape is not None and len(shape) >= self.d + 2

    def _spatial_inputs(self, fx_node: torch.fx.Node) -> list[torch.fx.Node]:
        """Inputs that carry input-dependent tensors (not constants, not sizes)."""
        return [a for a in fx_node.all_input_nodes
                if self.nodes[a.name].kind not in (NodeKind.CONSTANT, NodeKind.META) and self.nodes[a.name].shape]

    # each handler sets kind/geometry/flops on `node`; anything unhandled stays GLOBAL with a reason

    def _module(self, fx_node: torch.fx.Node, mod: nn.Module, node: Node) -> None:
        in_shape = _shape(fx_node.args[0]) if fx_node.args else None
        d = self.d
        if isinstance(mod, _CONV_MODULES):
            if mod.padding_mode != "zeros":
                node.reason = f"conv padding_mode={mod.padding_mode!r} reads reflected values"
                return
            kernel, dilation = expand(mod.kernel_size, d), expand(mod.dilation, d)
            self._set_conv(node, in_shape, kernel, expand(mod.stride, d), conv_padding(mod.padding, kernel, dilation),
                           dilation, mod.groups)
        elif isinstance(mod, _MAX_POOL_MODULES):
            if mod.return_indices:
                node.reason = "max pool returning indices"
                return
            pad = expand(mod.padding, d)
            self._set_pool(node, in_shape, Operator.MAX_POOL, expand(mod.kernel_size, d),
                           expand(mod.stride or mod.kernel_size, d), (pad, pad), expand(mod.dilation, d))
        elif isinstance(mod, _AVG_POOL_MODULES):
            pad = expand(mod.padding, d)
            self._set_pool(node, in_shape, Operator.AVG_POOL, expand(mod.kernel_size, d),
                           expand(mod.stride or mod.kernel_size, d), (pad, pad), (1,) * d)
        elif isinstance(mod, _ADAPTIVE_AVG_MODULES + _ADAPTIVE_MAX_MODULES):
            self._adaptive(node, in_shape, isinstance(mod, _ADAPTIVE_MAX_MODULES))
        elif callable(getattr(mod, "without_padding", None)) and hasattr(mod, "kernel_size"):
            self._windowed(mod, node, in_shape)
        elif isinstance(mod, _PAD_MODULES):
            self._set_pad(node, mod.padding, float(getattr(mod, "value", 0.0)))
        elif isinstance(mod, _BATCH_NORM_MODULES):
            self._set_pointwise(fx_node, node)
            if node.kind == NodeKind.POINTWISE and not mod.training and mod.running_mean is not None:
                node.operator = Operator.BATCH_NORM
        elif isinstance(mod, _POINTWISE_MODULES):
            self._set_pointwise(fx_node, node)
        elif isinstance(mod, nn.LocalResponseNorm) and d == 2:
            self._set_pointwise(fx_node, node)  # across channels at one position
        elif isinstance(mod, (nn.Linear, nn.Flatten, nn.Softmax, nn.LogSoftmax)):
            node.reason = f"{type(mod).__name__} mixes all positions"
            node.flops = mod.in_features * mod.out_features if isinstance(mod, nn.Linear) else 0
        else:
            node.reason = f"unknown module {type(mod).__name__}"

    def _windowed(self, mod: nn.Module, node: Node, in_shape: tuple[int, ...] | None) -> None:
        """A module that declares its window geometry and offers an unpadded twin (``without_padding()``),
        e.g. :class:`incrinf.kernels.quantized_module.QuantizedDepthwiseConv2d`; 2-D only."""
        pad = tuple(int(p) for p in mod.padding) if not isinstance(mod.padding, str) else None
        if self.d != 2 or pad is None or len(pad) != 4:
            node.reason = f"{type(mod).__name__} padding {mod.padding!r} is not (top, bottom, left, right)"
            return
        top, bottom, left, right = pad
        self._set_local(node, in_shape, expand(mod.kernel_size, 2), expand(mod.stride, 2),
                        ((top, left), (bottom, right)), expand(getattr(mod, "dilation", 1), 2), 0.0)
        node.operator = Operator.WINDOWED
        node.groups = int(getattr(mod, "groups", 1))
        node.in_channels = in_shape[1] if in_shape else 0
        node.flops = _conv_flops(node.in_channels, node.groups, expand(mod.kernel_size, 2), node.shape)

    def _function(self, fx_node: torch.fx.Node, node: Node) -> None:
        fn = fx_node.target
        args, kwargs = fx_node.args, fx_node.kwargs
        in_shape = _shape(args[0]) if args else None
        d = self.d
        if fn in _CONV_FUNCTIONS:
            weight_shape = _shape(_arg(args, kwargs, 1, "weight"))
            if weight_shape is None or _CONV_FUNCTIONS[fn] != d:
                node.reason = f"{fn.__name__} on a {d}-D input"
                return
            kernel = tuple(weight_shape[2:])
            dilation = expand(_arg(args, kwargs, 5, "dilation", 1), d)
            pad = conv_padding(_arg(args, kwargs, 4, "padding", 0), kernel, dilation)
            self._set_conv(node, in_shape, kernel, expand(_arg(args, kwargs, 3, "stride", 1), d), pad, dilation,
                           int(_arg(args, kwargs, 6, "groups", 1)))
        elif fn in _MAX_POOL_FUNCTIONS:
            if _arg(args, kwargs, 6, "return_indices", False):
                node.reason = "max pool returning indices"
                return
            kernel = expand(_arg(args, kwargs, 1, "kernel_size"), d)
            stride = _arg(args, kwargs, 2, "stride", None) or kernel
            pad = expand(_arg(args, kwargs, 3, "padding", 0), d)
            self._set_pool(node, in_shape, Operator.MAX_POOL, kernel, expand(stride, d), (pad, pad),
                           expand(_arg(args, kwargs, 4, "dilation", 1), d))
        elif fn in _AVG_POOL_FUNCTIONS:
            kernel = expand(_arg(args, kwargs, 1, "kernel_size"), d)
            stride = _arg(args, kwargs, 2, "stride", None) or kernel
            pad = expand(_arg(args, kwargs, 3, "padding", 0), d)
            self._set_pool(node, in_shape, Operator.AVG_POOL, kernel, expand(stride, d), (pad, pad), (1,) * d)
        elif fn in _ADAPTIVE_FUNCTIONS:
            self._adaptive(node, in_shape, _ADAPTIVE_FUNCTIONS[fn])
        elif fn is F.pad:
            mode = _arg(args, kwargs, 2, "mode", "constant")
            if mode != "constant":
                node.reason = f"pad mode {mode!r} reads the map's own values"
                return
            self._set_pad(node, tuple(_arg(args, kwargs, 1, "pad")), float(_arg(args, kwargs, 3, "value", 0.0) or 0.0))
        elif fn in _ARITH_FUNCTIONS:
            self._set_arith(fx_node, node)
        elif fn in _CAT_FUNCTIONS:
            self._set_cat(node, _arg(args, kwargs, 1, "dim", 0))
        elif fn in (F.batch_norm, F.local_response_norm) or fn in _POINTWISE_FUNCTIONS \
                or _is_eval_stochastic_depth(fn, args, kwargs):
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
        elif name in _MIXING_METHODS:
            node.reason = f"{name} mixes all positions"
        else:
            node.reason = f"unknown method {name}"

    # --- setters -----------------------------------------------------------------------------------------

    def _set_conv(self, node: Node, in_shape: tuple[int, ...] | None, kernel: tuple[int, ...],
                  stride: tuple[int, ...], padding: tuple[tuple[int, ...], tuple[int, ...]],
                  dilation: tuple[int, ...], groups: int) -> None:
        self._set_local(node, in_shape, kernel, stride, padding, dilation, 0.0)
        if node.kind == NodeKind.LOCAL:
            node.operator = Operator.CONV
            node.groups = groups
            node.in_channels = in_shape[1]
            node.flops = _conv_flops(in_shape[1], groups, kernel, node.shape)

    def _set_pool(self, node: Node, in_shape: tuple[int, ...] | None, op: Operator, kernel: tuple[int, ...],
                  stride: tuple[int, ...], padding: tuple[tuple[int, ...], tuple[int, ...]],
                  dilation: tuple[int, ...]) -> None:
        is_max = op in (Operator.MAX_POOL, Operator.ADAPTIVE_MAX_POOL)
        self._set_local(node, in_shape, kernel, stride, padding, dilation, float("-inf") if is_max else 0.0)
        if node.kind == NodeKind.LOCAL:
            node.operator = op
            node.flops = math.prod(kernel) * math.prod(node.shape[1:])

    def _set_local(self, node: Node, in_shape: tuple[int, ...] | None, kernel: tuple[int, ...],
                   stride: tuple[int, ...], padding: tuple[tuple[int, ...], tuple[int, ...]],
                   dilation: tuple[int, ...], pad_value: float) -> None:
        d = self.d
        if in_shape is None or node.shape is None or len(in_shape) != d + 2 or len(node.shape) != d + 2:
            node.reason = f"sliding window over a tensor that is not N x C x {' x '.join('DHW'[3 - d:])}"
            return
        before, after_min = padding
        extent = tuple(dl * (k - 1) + 1 for k, dl in zip(kernel, dilation))
        # the padded input must hold every output's window (ceil_mode reaches past the map), and explicit
        # asymmetric padding ('same' convolutions) may exceed what the outputs need: keep the larger
        after = tuple(max((o - 1) * s + e - i - p, a, 0) for o, s, e, i, p, a
                      in zip(node.shape[2:], stride, extent, in_shape[2:], before, after_min))
        node.kind = NodeKind.LOCAL
        node.geometry = LocalGeometry(extent, tuple(stride), tuple(before), after, tuple(dilation), pad_value)

    def _adaptive(self, node: Node, in_shape: tuple[int, ...] | None, is_max: bool) -> None:
        d = self.d
        if in_shape and node.shape and len(in_shape) == d + 2 and len(node.shape) == d + 2:
            ins, outs = in_shape[2:], node.shape[2:]
            if all(i % o == 0 for i, o in zip(ins, outs)) and (any(o > 1 for o in outs) or all(i == 1 for i in ins)):
                # an adaptive pool whose bins tile the input exactly is an ordinary pool
                kernel = tuple(i // o for i, o in zip(ins, outs))
                op = Operator.ADAPTIVE_MAX_POOL if is_max else Operator.ADAPTIVE_AVG_POOL
                self._set_pool(node, in_shape, op, kernel, kernel, ((0,) * d, (0,) * d), (1,) * d)
                return
        node.reason = "adaptive pooling to a small grid mixes all positions"
        node.flops = math.prod(in_shape[1:]) if in_shape else 0

    def _set_pad(self, node: Node, padding: Any, value: float) -> None:
        d = self.d
        pads = tuple(int(p) for p in padding) if isinstance(padding, (tuple, list)) else (int(padding),) * (2 * d)
        if len(pads) != 2 * d:
            node.reason = f"padding {pads} does not pad the {d} spatial axes"
            return
        if min(pads) < 0:
            node.reason = "negative padding crops the map"
            return
        node.kind, node.operator, node.pad_value = NodeKind.PAD, Operator.PAD, value
        # F.pad lists (before, after) pairs from the last axis backwards
        node.shift = tuple(pads[2 * (d - 1 - axis)] for axis in range(d))

    def _set_pointwise(self, fx_node: torch.fx.Node, node: Node) -> None:
        if len(self._spatial_inputs(fx_node)) > 1:
            self._set_arith(fx_node, node)
            return
        node.kind = NodeKind.POINTWISE
        if node.shape is not None:
            node.flops = math.prod(node.shape[1:])

    def _set_arith(self, fx_node: torch.fx.Node, node: Node) -> None:
        spatial = self._spatial_inputs(fx_node)
        if not self._is_map(node.shape):
            node.reason = "arithmetic on a tensor without the input's spatial axes"
            return
        d = self.d
        aligned = [s for s in spatial if self._is_map(_shape(s)) and _shape(s)[-d:] == node.shape[-d:]]
        node.flops = math.prod(node.shape[1:])
        node.operator = Operator.ARITHMETIC
        if len(spatial) == 1 and aligned:
            node.kind = NodeKind.POINTWISE
        elif len(aligned) == len(spatial):
            node.kind = NodeKind.MERGE
        else:
            # e.g. squeeze-and-excitation: a map times scales that depend on the whole map
            others = [s.name for s in spatial if s not in aligned]
            node.reason = f"combines the map with {', '.join(others)}, which depends on the whole input"

    def _set_cat(self, node: Node, dim: Any) -> None:
        if node.shape is not None and len(node.shape) == self.d + 2 and int(dim) in (1, -(self.d + 1)):
            node.kind, node.operator = NodeKind.MERGE, Operator.CAT
        else:
            node.reason = f"concatenation along dim {dim}"

    def _set_reshape(self, fx_node: torch.fx.Node, node: Node, name: str) -> None:
        in_shape, d = _shape(fx_node.args[0]), self.d
        if self._is_map(in_shape) and self._is_map(node.shape) and in_shape[-d:] == node.shape[-d:] \
                and in_shape[0] == node.shape[0]:
            self._set_pointwise(fx_node, node)  # channel regrouping keeps every position in place
            node.flops = 0
        else:
            node.reason = f"{name} moves spatial positions"

    def _set_permute(self, fx_node: torch.fx.Node, node: Node, name: str) -> None:
        ndim = len(node.shape or ())
        raw = fx_node.args[1:]
        if len(raw) == 1 and isinstance(raw[0], (tuple, list)):
            raw = tuple(raw[0])
        dims = [int(v) % ndim for v in raw] if ndim else []
        moved = dims if name == "transpose" else [i for i, v in enumerate(dims) if i != v]
        if self._is_map(node.shape) and moved and all(0 < v < ndim - self.d for v in moved):
            self._set_pointwise(fx_node, node)  # channel shuffle: the spatial axes stay last
            node.flops = 0
        else:
            node.reason = f"{name} moves spatial positions"

    def _set_split(self, fx_node: torch.fx.Node, node: Node, name: str) -> None:
        dim = int(_arg(fx_node.args, fx_node.kwargs, 2, "dim", 0))
        in_shape = _shape(fx_node.args[0])
        if in_shape and len(in_shape) == self.d + 2 and dim in (1, -(self.d + 1)):
            node.kind = NodeKind.POINTWISE
        else:
            node.reason = f"{name} along dim {dim}"

    def _set_getitem(self, fx_node: torch.fx.Node, node: Node) -> None:
        source, index = fx_node.args[0], fx_node.args[1]
        if isinstance(index, int) and _shape(source) is None:
            node.kind = NodeKind.POINTWISE  # picks one tensor out of a chunk/split tuple
        elif isinstance(index, tuple) and len(index) >= 2 and index[0] == slice(None) \
                and all(i == slice(None) for i in index[2:]) and isinstance(index[1], slice):
            node.kind = NodeKind.POINTWISE  # channel slice
        else:
            node.reason = "indexing that may move positions"


def _conv_flops(in_channels: int, groups: int, kernel: tuple[int, ...], out_shape: tuple[int, ...] | None) -> int:
    return (in_channels // groups) * math.prod(kernel) * math.prod(out_shape[1:]) if out_shape else 0


def _is_eval_stochastic_depth(fn: Any, args: tuple, kwargs: dict) -> bool:
    return getattr(fn, "__name__", "") == "stochastic_depth" and not bool(_arg(args, kwargs, 3, "training", True))
