"""Operator handling, once for every workload: invoking a node on region values, the window operator with
padding 0 (its windows arrive pre-padded), batch-norm folding, 1x1 convolutions as matrix products over rows,
and the average-pool border correction.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from incrinf.graph import Graph, Node, NodeKind, Operator
from incrinf.graph.execute import arguments, invoke, module_of, unary

if TYPE_CHECKING:
    from incrinf.engine.windows import WindowSpec

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}

WindowOp = Callable[[torch.Tensor], torch.Tensor]

# oneDNN computes convolutions on channel blocks of 16 (AVX-512; 8 on AVX2, 16 is the larger): a convolution called on
# maps in a plain channels-first layout reorders its output (and an input of at least a block of channels; smaller
# ones are read as they are) into blocked copies, channels padded up to a multiple of the block, and every
# convolution reorders its weights into a blocked copy on each call
_CHANNEL_BLOCK = 16
_TRANSPOSED = {F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d}
_CONVOLUTIONS = {*_CONV.values(), *_TRANSPOSED}
_INDEX_POOLS = {Operator.MAX_POOL, Operator.ADAPTIVE_MAX_POOL}


def _channels_last(weight: torch.Tensor) -> torch.Tensor:
    """A convolution weight in the layout of the region values (channels last): oneDNN then skips reordering
    it (measured on CPU: 3-D convolutions 1.2-2x faster with channels-last inputs and weights than contiguous; 2-D
    ones with 256-512 channels 1.5x)."""
    if weight.dim() == 4:
        return weight.contiguous(memory_format=torch.channels_last)
    if weight.dim() == 5:
        return weight.contiguous(memory_format=torch.channels_last_3d)
    return weight


def _blocked(channels: int) -> int:
    """``channels`` padded up to a multiple of oneDNN's channel block."""
    return -(-channels // _CHANNEL_BLOCK) * _CHANNEL_BLOCK


def _convolution_bytes(conv: tuple, n: int, source: tuple, shape: tuple, element_size: int,
                       channels_last: bool, onednn: bool = False) -> int:
    """Working bytes of one CPU float convolution call (see :meth:`Operators.working_bytes`): PyTorch's
    reference kernels (its ``use_mkldnn`` rule: a batch of one on a small map, a 1x1 convolution on one thread)
    unfold the input into columns (a transposed one folds columns of its output, one example at a time); oneDNN
    reorders the weights into channel blocks, and on channels-first maps the output and an input of at least a
    block of channels too."""
    weight, transposed, stride, dilation, groups = conv
    kernel = tuple(weight.shape[2:])
    d = len(kernel)
    strided = any(v != 1 for v in (stride if isinstance(stride, (tuple, list)) else (stride,) * d))
    dilated = any(v != 1 for v in (dilation if isinstance(dilation, (tuple, list)) else (dilation,) * d))
    wide = len(kernel) >= 2 and kernel[-1] > 3 and kernel[-2] > 3
    small = n * math.prod(source[1:4]) <= 20480 if len(source) >= 4 else True
    pointwise = len(kernel) >= 2 and kernel[-1] == 1 and kernel[-2] == 1
    onednn = onednn or (strided or dilated or n >= 16 or not pointwise or torch.get_num_threads() > 1) \
        and (groups > 1 or wide or n > 1 or not small)
    if not onednn:
        if transposed:
            return element_size * weight.shape[1] * groups * math.prod(kernel) * math.prod(source[2:])
        return element_size * n * source[1] // groups * math.prod(kernel) * math.prod(shape[2:])
    made = math.prod(_blocked(c) for c in weight.shape[:2]) * math.prod(kernel) * element_size
    if channels_last:
        return made
    if transposed:
        return made + element_size * n * (math.prod(source[1:]) + 2 * math.prod(shape[1:]))
    copies = element_size * n * _blocked(shape[1]) * math.prod(shape[2:])
    if source[1] >= _CHANNEL_BLOCK:
        copies += element_size * n * _blocked(source[1]) * math.prod(source[2:])
    return made + copies


def _triple(value: Any) -> list[int]:
    return [int(v) for v in value] if isinstance(value, (tuple, list)) else [int(value)] * 3


def _conv3d(weight: torch.Tensor, bias: torch.Tensor | None, stride: Any, dilation: Any, groups: int) -> WindowOp:
    """A 3-D convolution with padding 0 that runs through oneDNN for every float32 CPU batch: PyTorch sends a
    batch of one example on a small map to its reference kernel (im2col and a matrix product, measured 9x slower
    on a (1, 128, 10, 10, 10) window), and a plan's last batch or a boxed run may hold one query."""
    stride, dilation, padding = _triple(stride), _triple(dilation), [0, 0, 0]

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32:
            return torch.mkldnn_convolution(x, weight, bias, padding, stride, dilation, groups)
        return F.conv3d(x, weight, bias, stride, 0, dilation, groups)

    return run


def _same_layout(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y`` in ``x``'s channels-last layout: PyTorch's CPU 3-D average pooling returns a contiguous map for a
    channels-last one, and every later step would then copy its values to read them as rows (a copy of the pooled,
    smaller map instead)."""
    if x.dim() == 5 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last_3d) \
            and not y.is_contiguous(memory_format=torch.channels_last_3d):
        return y.contiguous(memory_format=torch.channels_last_3d)
    return y


def _arg(args: list, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


class _Lookup:
    """A node input's value by name for :meth:`Operators.invoke`: the region's values, else a constant, else a
    META node evaluated on them, else (a map only its size is read from) an empty meta tensor shaped like ``like``.

    An object rather than a closure: a closure calling itself (a META node's inputs are looked up with it) is a
    reference cycle, and the region values it holds (a concatenation's inputs, tens of MiB per batch) would then
    live until Python's cycle collector runs instead of being freed when the step is done.
    """

    def __init__(self, ops: Operators, values: dict[str, Any], like: torch.Tensor | None) -> None:
        self.ops = ops
        self.values = values
        self.like = like

    def __call__(self, name: str) -> Any:
        ops, values = self.ops, self.values
        if name in values:
            return values[name]
        if name in ops.constants:
            return ops.constants[name]
        node = ops.graph.by_name[name]
        if node.kind == NodeKind.META:
            values[name] = invoke(ops.graph, node, self)
            return values[name]
        if self.like is not None and ops.graph.is_map(node.shape):  # only its size is read (by a META node)
            shape = (self.like.shape[0], *node.shape[1:-ops.d], *self.like.shape[-ops.d:])
            return torch.empty(shape, dtype=self.like.dtype, device="meta")
        raise KeyError(f"no value for {name} (an input of a region step)")


class Operators:
    """Bound operators of one captured graph.

    Args:
        graph: the captured graph (its module runs the nodes; may be a private copy, see
            :func:`incrinf.graph.execute.copy_graph`).
        env: every node's value for one input (constants are taken from it; shapes are read from it).
    """

    def __init__(self, graph: Graph, env: dict[str, Any]) -> None:
        self.graph = graph
        self.d = graph.spatial_dims
        self.constants = {n.name: env[n.name] for n in graph.nodes if n.kind == NodeKind.CONSTANT}
        # bytes of the weights made here (folded batch norms, channels-last copies), which a run holds beyond the
        # model's own: part of a plan's predicted memory
        self.made_bytes = 0
        self._window_convs: dict[str, tuple] = {}

    def _made(self, tensor: torch.Tensor | None, *originals: torch.Tensor | None) -> torch.Tensor | None:
        """``tensor``, counted in :attr:`made_bytes` unless it shares memory with one of ``originals``."""
        if tensor is not None and not any(o is not None and o.untyped_storage().data_ptr()
                                          == tensor.untyped_storage().data_ptr() for o in originals):
            self.made_bytes += tensor.untyped_storage().nbytes()
        return tensor

    # --- any node ----------------------------------------------------------------------------------------

    def invoke(self, node: Node, values: dict[str, Any], like: torch.Tensor | None = None) -> Any:
        """Run ``node`` on ``values`` (its tensor inputs by name); constants are bound and sizes (META nodes, e.g.
        a channel shuffle's ``view``) evaluated for the region at hand: a tensor they read that ``values`` lacks
        stands in with its channels and the batch and spatial extents of ``like`` (the region's values)."""
        return invoke(self.graph, node, self._lookup(dict(values), like))

    def _lookup(self, values: dict[str, Any], like: torch.Tensor | None = None) -> Callable[[str], Any]:
        return _Lookup(self, values, like)

    def _parameters(self, node: Node) -> tuple[list, dict]:
        """A node's arguments with constants bound and tensor inputs as None (to read its settings)."""
        return arguments(node, lambda name: self.constants.get(name))

    def unary(self, node: Node, source: str) -> Callable[[Any], Any]:
        """``node`` as a function of its input ``source`` alone, the rest bound once (see
        :func:`incrinf.graph.execute.unary`)."""
        if any(self.graph.by_name[i].kind == NodeKind.META for i in node.inputs):
            return lambda v: self.invoke(node, {source: v}, like=v)  # sizes follow the values
        return unary(self.graph, node, source, self._lookup({}))

    def working_bytes(self, node: Node, n: int, element_size: int, channels_last: bool,
                      dims: tuple[tuple[int, ...], tuple[int, ...]] | None = None, onednn: bool = False) -> int:
        """Bytes a call of ``node`` on a batch of ``n`` allocates beyond its output and frees before it returns (its
        operator's scratch on CPU), from shapes alone; ``channels_last`` says the maps it reads are channels-last
        (the executor's region values and 4-D maps) rather than channels-first (a 3-D model's plain forward pass).
        ``dims``: the spatial extents ``(read, written)`` of a call on part of the maps (a step's windows and
        boxes; None: the whole maps); ``onednn``: the call goes to oneDNN whatever PyTorch's rule (the
        executor's 3-D window convolutions, :func:`_conv3d`).

        - a convolution: its weights reordered into channel blocks; on channels-first maps also its output in
          blocks of :data:`_CHANNEL_BLOCK` channels, and its input too when it has at least a block of channels
          (a transposed convolution instead copies its input and makes its output twice);
        - a max pool: the int64 indices of its maxima (PyTorch's CPU kernels always make them);
        - a 3-D average pool on channels-last maps: a channels-first copy of its input (PyTorch's CPU kernel);
        - anything else: nothing (elementwise operators, concatenations and resampling write their output only).
        """
        shape = node.shape
        if not shape or not isinstance(shape, tuple) or len(shape) < 3 or not node.inputs:
            return 0
        source = self.graph.by_name[node.inputs[0]].shape
        if not isinstance(source, tuple) or len(source) != len(shape):
            return 0
        if dims is not None:
            source = (*source[:len(source) - len(dims[0])], *dims[0])
            shape = (*shape[:len(shape) - len(dims[1])], *dims[1])
        out = element_size * n * math.prod(shape[1:])
        conv = self._convolution(node)
        if conv is not None:
            return _convolution_bytes(conv, n, source, shape, element_size, channels_last, onednn)
        if node.operator in _INDEX_POOLS:
            return out // element_size * 8
        if node.operator in (Operator.AVG_POOL, Operator.ADAPTIVE_AVG_POOL) and channels_last and len(shape) == 5:
            return element_size * n * math.prod(source[1:])
        return 0

    def _convolution(self, node: Node) -> tuple[torch.Tensor, bool, Any, Any, int] | None:
        """``(weight, transposed, stride, dilation, groups)`` of a convolution node (a module or a function,
        transposed or not), else None."""
        mod = module_of(self.graph, node)
        if isinstance(mod, nn.modules.conv._ConvNd):
            return mod.weight, bool(mod.transposed), mod.stride, mod.dilation, mod.groups
        target = node.fx_node.target
        if node.fx_node.op != "call_function" or target not in _CONVOLUTIONS:
            return None
        args, kwargs = self._parameters(node)
        weight = _arg(args, kwargs, 1, "weight")
        if not isinstance(weight, torch.Tensor):
            return None
        if target in _TRANSPOSED:
            return weight, True, _arg(args, kwargs, 3, "stride", 1), _arg(args, kwargs, 7, "dilation", 1), \
                int(_arg(args, kwargs, 6, "groups", 1))
        return weight, False, _arg(args, kwargs, 3, "stride", 1), _arg(args, kwargs, 5, "dilation", 1), \
            int(_arg(args, kwargs, 6, "groups", 1))

    # --- local nodes -------------------------------------------------------------------------------------

    def conv_params(self, node: Node) -> tuple[torch.Tensor, torch.Tensor | None, Any, Any, int] | None:
        """``(weight, bias, stride, dilation, groups)`` of a convolution node, else None."""
        if node.operator != Operator.CONV:
            return None
        mod = module_of(self.graph, node)
        if mod is not None:
            return mod.weight, mod.bias, mod.stride, mod.dilation, mod.groups
        args, kwargs = self._parameters(node)
        return (_arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias"), _arg(args, kwargs, 3, "stride", 1),
                _arg(args, kwargs, 5, "dilation", 1), int(_arg(args, kwargs, 6, "groups", 1)))

    def batch_norm(self, node: Node) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(scale, shift)`` of an eval-mode batch-norm module node (``y = x * scale + shift``), else None."""
        if node.operator != Operator.BATCH_NORM:
            return None
        mod = module_of(self.graph, node)
        scale = torch.rsqrt(mod.running_var + mod.eps)
        if mod.weight is not None:
            scale = scale * mod.weight
        shift = -mod.running_mean * scale
        if mod.bias is not None:
            shift = shift + mod.bias
        return scale.detach(), shift.detach()

    def fold(self, conv: Node, bn: Node) -> tuple[torch.Tensor, torch.Tensor, Any, Any, int]:
        """A convolution followed by a batch norm as one convolution's parameters."""
        weight, bias, stride, dilation, groups = self.conv_params(conv)
        scale, shift = self.batch_norm(bn)
        folded = self._made(_channels_last((weight * scale.view(-1, *([1] * (weight.dim() - 1)))).detach()))
        folded_bias = self._made((shift if bias is None else bias.detach() * scale + shift).contiguous())
        return folded, folded_bias, stride, dilation, groups

    def window(self, node: Node, folded: tuple | None = None) -> WindowOp:
        """The LOCAL node's operator with padding 0 (its input windows arrive padded), ``folded`` convolution
        parameters replacing its own."""
        d = self.d
        if node.operator == Operator.CONV:
            weight, bias, stride, dilation, groups = self._window_conv(node, folded)
            conv = _CONV[d]
            if d == 3 and torch.backends.mkldnn.is_available():
                return _conv3d(weight, bias, stride, dilation, groups)
            return lambda x: conv(x, weight, bias, stride, 0, dilation, groups)
        if node.operator == Operator.WINDOWED:
            return module_of(self.graph, node).without_padding()
        g = node.geometry
        kernel = tuple((e - 1) // dl + 1 for e, dl in zip(g.kernel, g.dilation))
        if node.operator in (Operator.MAX_POOL, Operator.ADAPTIVE_MAX_POOL):
            pool = _MAX_POOL[d]
            return lambda x: pool(x, kernel, g.stride, 0, g.dilation)
        if node.operator in (Operator.AVG_POOL, Operator.ADAPTIVE_AVG_POOL):
            pool = _AVG_POOL[d]
            if d == 3:
                return lambda x: _same_layout(x, pool(x, kernel, g.stride, 0))
            return lambda x: pool(x, kernel, g.stride, 0)
        raise AssertionError(f"no window operator for {node.name} ({node.op})")

    def whole_window(self, node: Node, spec: WindowSpec, dims: tuple[int, ...], folded: tuple | None = None
                     ) -> WindowOp | None:
        """The convolution ``node`` over its whole unpadded source map (N, C, *source dims), padding with zeros
        itself, so that it yields the step's ``dims`` outputs; None where it cannot (a pool, padding of another
        value, more padding after than before, a 3-D map: those run through :func:`_conv3d`)."""
        d = self.d
        if node.operator != Operator.CONV or d == 3:
            return None
        mod = module_of(self.graph, node)
        if mod is not None and getattr(mod, "padding_mode", "zeros") != "zeros":
            return None
        view_before, view_after, own_before, own_after = spec.pads
        if (any(view_before) or any(view_after)) and spec.view_value != 0.0:
            return None
        if (any(own_before) or any(own_after)) and spec.pad_value != 0.0:
            return None
        before = tuple(v + o for v, o in zip(view_before, own_before))
        after = tuple(v + o for v, o in zip(view_after, own_after))
        if any(a > b for a, b in zip(after, before)):
            return None
        in_dims = self.graph.by_name[spec.source].shape[-d:]
        out = tuple((n + 2 * b - e) // s + 1 for n, b, e, s in zip(in_dims, before, spec.extent, spec.stride))
        if out != tuple(dims):
            return None
        weight, bias, stride, dilation, groups = self._window_conv(node, folded)
        conv = _CONV[d]
        return lambda x: conv(x, weight, bias, stride, before, dilation, groups)

    def window_conv(self, node: Node, folded: tuple | None = None) -> tuple | None:
        """``(weight, bias, stride, dilation, groups)`` of a window convolution as its operator runs it (its weight
        channels-last, ``folded`` replacing its own parameters); None for any other node."""
        return self._window_conv(node, folded) if node.operator == Operator.CONV and node.is_window else None

    def _window_conv(self, node: Node, folded: tuple | None) -> tuple:
        """A window convolution's parameters with its weight channels-last (the windows arrive channels-last:
        oneDNN reorders other weights on every call), made once per node for all its operators."""
        if folded is not None:
            return folded
        if node.name not in self._window_convs:
            weight, *rest = self.conv_params(node)
            self._window_convs[node.name] = (self._made(_channels_last(weight.detach()), weight), *rest)
        return self._window_convs[node.name]

    def linear(self, node: Node, folded: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(weight (C_out, C_in), bias)`` of a 1x1, stride-1, unpadded, ungrouped convolution, to run as a
        matrix product over rows of positions; None for anything else."""
        if node.operator != Operator.CONV or node.is_window:
            return None
        weight, bias, _, _, groups = folded or self.conv_params(node)
        if groups != 1:
            return None
        return self._made(weight.reshape(weight.shape[0], -1).contiguous(), weight), bias

    def border_factors(self, node: Node, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """(1, 1, *out) factors turning a plain k-element average into the node's true average (which may
        divide by fewer elements at the border: ``count_include_pad=False``, ``ceil_mode`` overhang,
        ``divisor_override``); None when every output divides by the kernel size."""
        if node.operator != Operator.AVG_POOL:
            return None
        mod = module_of(self.graph, node)
        if mod is not None:
            kernel, stride, padding = mod.kernel_size, mod.stride or mod.kernel_size, mod.padding
            ceil_mode, include_pad = mod.ceil_mode, mod.count_include_pad
            override = getattr(mod, "divisor_override", None)
        else:
            args, kwargs = self._parameters(node)
            kernel = _arg(args, kwargs, 1, "kernel_size")
            stride = _arg(args, kwargs, 2, "stride", None) or kernel
            padding = _arg(args, kwargs, 3, "padding", 0)
            ceil_mode = _arg(args, kwargs, 4, "ceil_mode", False)
            include_pad = _arg(args, kwargs, 5, "count_include_pad", True)
            override = _arg(args, kwargs, 6, "divisor_override", None) if self.d > 1 else None
        d = self.d
        in_dims = self.graph.by_name[node.inputs[0]].shape[-d:]
        ones = torch.ones(1, 1, *in_dims, dtype=dtype, device=device)
        options = (kernel, stride, padding, ceil_mode, include_pad) + ((override,) if d > 1 else ())
        true = _AVG_POOL[d](ones, *options)
        g = node.geometry
        pads = []
        for before, after in zip(reversed(g.pad_before), reversed(g.pad_after)):
            pads.extend((before, after))
        plain = _AVG_POOL[d](F.pad(ones, pads), kernel, stride, 0)
        plain = plain[(..., *(slice(0, n) for n in true.shape[-d:]))]
        factors = true / plain.clamp_min(1e-12)
        return None if torch.allclose(factors, torch.ones_like(factors)) else factors

