"""A program's steps bound once for the frame walk: the operator calls of one box with as little around them as the
results allow.

A cached camera frame runs every step of the local part on a few small boxes, so a step's fixed cost (the
operator calls and the Python around them) is what keeps a small change from paying. Per step, bound once per
program:

- a 1x1 convolution's matrix product takes its weight already transposed (``F.linear`` transposes it on every
  call: the same ``addmm`` on the same strides, one operator call less), and reads and writes a channels-last box
  as rows through one strided view each (:meth:`BoundStep.product`; a permute and a reshape each otherwise);
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
from dataclasses import dataclass
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
        merge: ``(first, second) -> head's values`` of a merge of two tensors whose call takes just them, in the
            order of the step's ``inputs`` (None otherwise: the head runs through the step's operators). Never
            for a step that overwrites an input (its inputs are views of the cache).
    """

    weight_t: torch.Tensor | None
    bias: torch.Tensor | None
    functions: list[Callable[[Any], Any]]
    in_place: int = 0
    merge: Callable[[Any, Any], Any] | None = None

    def product(self, values: torch.Tensor) -> torch.Tensor:
        """The 1x1 convolution (``weight_t`` set) on one box's values (1, C_in, *size) -> (1, C_out, *size)
        channels-last, before the chain. A box that is channels-last dense (a head's output, a whole box of
        one) is read as rows and the product written back as a map through one ``as_strided`` view each: the
        views :func:`~incrinf.kernels.gather.to_rows` and :func:`~incrinf.kernels.gather.from_rows` make, so
        the same ``addmm`` on the same strides. Any other (a pruned box's crop) goes through those."""
        shape = values.shape
        if len(shape) == 4 and shape[0] == 1 and values.is_contiguous(memory_format=torch.channels_last):
            _, c, h, w = shape
            rows = values.as_strided((h * w, c), (c, 1))
            product = torch.mm(rows, self.weight_t) if self.bias is None else \
                torch.addmm(self.bias, rows, self.weight_t)
            out = product.shape[1]
            return product.as_strided((1, out, h, w), (h * w * out, 1, w * out, out))
        rows = to_rows(values)
        product = torch.mm(rows, self.weight_t) if self.bias is None else torch.addmm(self.bias, rows, self.weight_t)
        return from_rows(product, shape[0], tuple(shape[2:]))


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
    return BoundStep(weight_t, bias, functions, in_place, merge)


def in_place_activation(node: Node, graph: Graph) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The in-place form of an activation node applied to its only tensor input, or None when it is not one of the
    common activations (or takes other arguments than those read here)."""
    fx_node = node.fx_node
    # a functional activation's ``inplace`` flag (traced as a keyword) changes nothing here
    if fx_node is None or set(fx_node.kwargs) - {"inplace"} or len(fx_node.args) != 1:
        return None
    if fx_node.op == "call_module":
        module = module_of(graph, node)
        if isinstance(module, nn.Hardtanh):  # ReLU6 too
            low, high = float(module.min_val), float(module.max_val)
            return lambda v: torch.clamp_(v, low, high)
        kinds = {nn.ReLU: torch.relu_, nn.Sigmoid: torch.sigmoid_,
                 nn.Hardswish: lambda v: F.hardswish(v, inplace=True), nn.SiLU: lambda v: F.silu(v, inplace=True)}
        return kinds.get(type(module))
    if fx_node.op == "call_function":
        target = fx_node.target
        if target in (torch.relu, F.relu):
            return torch.relu_
        if target is F.relu6:
            return lambda v: torch.clamp_(v, 0.0, 6.0)
        if target in (torch.sigmoid, F.sigmoid):
            return torch.sigmoid_
        return None
    if fx_node.op == "call_method" and fx_node.target in ("relu", "sigmoid"):
        method = f"{fx_node.target}_"
        return lambda v: getattr(v, method)()
    return None

