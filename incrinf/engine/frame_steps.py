"""A program's steps bound once for the frame walk: the operator calls of one box with as little around them as the
results allow.

A cached camera frame runs every step of the local part on a few small boxes, so a step's fixed cost (the
operator calls and the Python around them) is what keeps a small change from paying. Per step, bound once per
program:

- a 1x1 convolution's matrix product takes its weight already transposed (``F.linear`` transposes it on every
  call: the same ``addmm`` on the same strides, one operator call less), and reads and writes a channels-last box
  as rows through one strided view each (:meth:`BoundStep.product`; a permute and a reshape each otherwise);
- a grouped 2-D convolution (a depthwise one) runs through oneDNN's fused-convolution operator with its weight
  reordered once into oneDNN's own layout, and a leading ReLU or ReLU6 of its chain as the operator's clamp
  (:func:`prepacked_window`): PyTorch runs such a convolution through the same oneDNN kernel but reorders the
  weight on every call and dispatches through three more layers, about a fifth of a small box's call; the clamp
  is exact, so the values are the captured step's bit for bit;
- a merge of two maps by a plain call (an add of a residual) is that call with the two boxes as its arguments
  (:func:`~incrinf.graph.execute.binary`), without resolving its arguments per call;
- a step whose head makes a new tensor (a convolution, a pool, a 1x1 convolution) runs the leading activations of
  its chain in place on it: no one else reads the head's output, and the in-place kernels are the same arithmetic
  without an allocation. A ReLU6 (any ``Hardtanh``) runs as ``clamp_``, which is what ``hardtanh_`` calls (through
  ``hardtanh``'s out variant): the same kernel, one operator call instead of three. A chain node not recognised
  here, and everything after it, runs as captured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from incrinf.engine.program import Program, Step
from incrinf.graph import Graph, Node, Operator
from incrinf.graph.execute import binary, module_of
from incrinf.kernels.gather import from_rows, to_rows

# Heads whose output is a tensor no one else holds (the window operators run with padding 0 on a crop, the 1x1
# convolutions as a matrix product): their chains may start in place.
_FRESH_HEADS = frozenset({Operator.CONV, Operator.MAX_POOL, Operator.AVG_POOL, Operator.ADAPTIVE_MAX_POOL,
                          Operator.ADAPTIVE_AVG_POOL})


@dataclass
class BoundStep:
    """One step's calls for the frame walk.

    Attributes:
        weight_t: (C_in, C_out) a 1x1 convolution's weight, transposed once (None: not a 1x1 convolution run
            as a matrix product).
        bias: (C_out,) its bias, or None.
        functions: the step's pointwise chain, its leading activations in place where the head's output is new.
        in_place: how many of ``functions`` run in place.
        window: ``read-in window (1, C, *read) -> values`` of a window step's head and its first ``fused`` chain
            functions in one call (None: the step's own operator, then ``functions``).
        fused: how many of the chain's functions ``window`` applies (it is followed by ``functions[fused:]``,
            kept as ``after_window``).
        merge: ``(first, second) -> head's values`` of a merge of two tensors whose call takes just them, in the
            order of the step's ``inputs`` (None otherwise: the head runs through the step's operators). Never
            for a step that overwrites an input (its inputs are views of the cache).
    """

    weight_t: torch.Tensor | None
    bias: torch.Tensor | None
    functions: list[Callable[[Any], Any]]
    in_place: int = 0
    merge: Callable[[Any, Any], Any] | None = None
    window: Callable[[torch.Tensor], torch.Tensor] | None = None
    fused: int = 0
    after_window: list[Callable[[Any], Any]] = field(default_factory=list)

    def product(self, values: torch.Tensor) -> torch.Tensor:
        """The 1x1 convolution (``weight_t`` set) on one box's values (1, C_in, *size) -> (1, C_out, *size)
        channels-last, before the chain. A box that is channels-last dense (a head's output, a whole box of
        one) is read as rows and the product written back as a map through one ``as_strided`` view each: the
        views :func:`~incrinf.kernels.gather.to_rows` and :func:`~incrinf.kernels.gather.from_rows` make, so
        the same ``addmm`` on the same strides. Any other (a pruned box's crop) goes through those."""
        shape = values.shape
        dense = len(shape) == 4 and shape[0] == 1 and values.is_contiguous(memory_format=torch.channels_last)
        rows = values.as_strided((shape[2] * shape[3], shape[1]), (shape[1], 1)) if dense else to_rows(values)
        product = torch.mm(rows, self.weight_t) if self.bias is None else torch.addmm(self.bias, rows, self.weight_t)
        if not dense:
            return from_rows(product, shape[0], tuple(shape[2:]))
        h, w, out = shape[2], shape[3], product.shape[1]
        return product.as_strided((1, out, h, w), (h * w * out, 1, w * out, out))


def bind_steps(program: Program) -> list[BoundStep]:
    """A :class:`BoundStep` per program step."""
    return [bind_step(step, program.graph) for step in program.steps]


def bind_step(step: Step, graph: Graph) -> BoundStep:
    """``step``'s calls bound for the walk (``graph``: the captured graph its nodes belong to)."""
    weight_t = bias = None
    if step.linear is not None:
        weight, bias = step.linear
        weight_t = weight.t()
    functions = list(step.functions)
    in_place = 0
    if step.head.operator in _FRESH_HEADS and (step.window is not None or step.linear is not None):
        for node, _ in step.chain:
            fn = in_place_activation(node, graph)
            if fn is None:
                break
            functions[in_place] = fn
            in_place += 1
    merge = None
    if step.window is None and step.linear is None and step.op is None and len(step.inputs) == 2 \
            and not step.inplace:
        merge = binary(graph, step.head, *step.inputs)
    bound = BoundStep(weight_t, bias, functions, in_place, merge)
    if step.window is not None and step.conv is not None and step.factors is None:
        clamp = clamp_bounds(step.chain[0][0], graph) if step.chain else None
        source_shape = graph.by_name[step.window.source].shape
        bound.window = prepacked_window(step.conv, source_shape, clamp)
        bound.fused = int(bound.window is not None and clamp is not None)
        bound.after_window = functions[bound.fused:]
    return bound


def _pointwise_convolution() -> Callable[..., torch.Tensor] | None:
    """oneDNN's fused-convolution operator, where this build of PyTorch has it."""
    try:
        return torch.ops.mkldnn._convolution_pointwise.default
    except (AttributeError, RuntimeError):
        return None


def prepacked_window(conv: tuple, source_shape: tuple[int, ...], clamp: tuple[float, float | None] | None
                     ) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A window convolution ``conv`` (``(weight, bias, stride, dilation, groups)``, padding 0) with its weight
    reordered once, followed by ``clamp`` (``(low, high)``; ``high`` None: a ReLU) in the same call; None where
    PyTorch would not run it through oneDNN (then it would not be the same arithmetic): anything but a float32
    CPU 2-D convolution with groups and a kernel larger than one position (PyTorch sends an ungrouped one on a
    small window, and a 1x1 one on one thread, to its own kernels), a build without oneDNN's operator, or a clamp
    other than a ReLU's or a ``Hardtanh``'s.

    Returns:
        ``window (1, C_in, *read) -> (1, C_out, *out)`` channels-last, or None.
    """
    weight, bias, stride, dilation, groups = conv
    run = _pointwise_convolution()
    if run is None or not isinstance(weight, torch.Tensor) or weight.dim() != 4 or groups <= 1 \
            or tuple(weight.shape[-2:]) == (1, 1) or weight.device.type != "cpu" or weight.dtype != torch.float32 \
            or not (torch.backends.mkldnn.is_available() and torch._C._get_mkldnn_enabled()):
        return None
    if clamp is None:
        attr, scalars = "none", []
    elif clamp[1] is None:
        if clamp[0] != 0.0:
            return None
        attr, scalars = "relu", []
    else:
        attr, scalars = "hardtanh", [clamp[0], clamp[1]]
    stride, dilation = _pair(stride), _pair(dilation)
    bias = None if bias is None else bias.detach()
    # a map's shape only guides oneDNN's choice of the weight's layout (any window then runs with it); one that
    # the kernel fits in, as every window does
    extent = [dl * (k - 1) + 1 for dl, k in zip(dilation, weight.shape[-2:])]
    hint = [1, weight.shape[1] * groups, *(max(n, e) for n, e in zip(source_shape[-2:], extent))]
    try:
        packed = torch.ops.mkldnn._reorder_convolution_weight(weight.detach(), [0, 0], stride, dilation, groups,
                                                               hint)
    except RuntimeError:  # a form this oneDNN does not take: the captured operator it is
        return None
    return lambda x: run(x, packed, bias, [0, 0], stride, dilation, groups, attr, scalars, "")


def _pair(value: Any) -> list[int]:
    return [int(v) for v in value] if isinstance(value, (tuple, list)) else [int(value)] * 2


def _one_input(node: Node) -> Any:
    """The fx node of ``node`` when it is applied to its one tensor argument alone (a functional activation's
    ``inplace`` flag, traced as a keyword, changes nothing here), else None."""
    fx_node = node.fx_node
    if fx_node is None or set(fx_node.kwargs) - {"inplace"} or len(fx_node.args) != 1:
        return None
    return fx_node


def clamp_bounds(node: Node, graph: Graph) -> tuple[float, float | None] | None:
    """``(low, high)`` of an activation node that clamps its only tensor input: ``(0, None)`` for a ReLU, the
    bounds of a ReLU6 or another ``Hardtanh``; None for anything else."""
    fx_node = _one_input(node)
    if fx_node is None:
        return None
    if fx_node.op == "call_module":
        module = module_of(graph, node)
        if isinstance(module, nn.Hardtanh):  # ReLU6 too
            return float(module.min_val), float(module.max_val)
        return (0.0, None) if type(module) is nn.ReLU else None
    if fx_node.op == "call_function":
        if fx_node.target in (torch.relu, F.relu):
            return 0.0, None
        return (0.0, 6.0) if fx_node.target is F.relu6 else None
    if fx_node.op == "call_method" and fx_node.target == "relu":
        return 0.0, None
    return None


def in_place_activation(node: Node, graph: Graph) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The in-place form of an activation node applied to its only tensor input, or None when it is not one of the
    common activations (or takes other arguments than those read here). A clamp (:func:`clamp_bounds`: a ReLU, a
    ReLU6 or another ``Hardtanh``) runs as ``relu_`` or ``clamp_``."""
    clamp = clamp_bounds(node, graph)
    if clamp is not None:
        low, high = clamp
        return torch.relu_ if high is None else (lambda v: torch.clamp_(v, low, high))
    fx_node = _one_input(node)
    if fx_node is None:
        return None
    if fx_node.op == "call_module":
        kinds = {nn.Sigmoid: torch.sigmoid_, nn.Hardswish: lambda v: F.hardswish(v, inplace=True),
                 nn.SiLU: lambda v: F.silu(v, inplace=True)}
        return kinds.get(type(module_of(graph, node)))
    if fx_node.op == "call_function":
        return torch.sigmoid_ if fx_node.target in (torch.sigmoid, F.sigmoid) else None
    if fx_node.op == "call_method" and fx_node.target == "sigmoid":
        return torch.sigmoid_
    return None
