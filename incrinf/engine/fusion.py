"""The frame engine's generated modules (the full frame, the dense suffixes, the tail, plain frames) with the work
that inference does not need taken out of its private copy of the model:

- a batch norm right after a convolution is folded into the convolution's weights and bias (the steps of a
  cached frame fold it the same way: :meth:`~incrinf.engine.operators.Operators.fold`), and the batch-norm module
  becomes an identity;
- a zero padding the same on both sides of each axis, read only by a convolution, is done by the convolution
  itself (a ``static same`` padding module copies and fills the whole map before every convolution: in
  EfficientNet-Lite0 at 288x384 the pads and batch norms took about a third of a full frame's time).

Node names stay (the cached tensors are named by them, and the steps were built before): a folded batch norm or
a padding done by its convolution is an identity module under its own name. Run after the
:class:`~incrinf.engine.program.Program` is built, before it generates its modules.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from incrinf.engine.program import Program
from incrinf.graph import Graph, Node, Operator

_CONV_FUNCTIONS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_ZERO_PADS = (nn.ZeroPad1d, nn.ZeroPad2d, nn.ZeroPad3d, nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d)


def fuse_generated(program: Program) -> int:
    """Fold batch norms and symmetric zero paddings into the convolutions of ``program``'s graph module (the
    engine's private copy), in place; returns how many batch norms and paddings the convolutions took over."""
    graph = program.graph
    fx_graph = graph.module.graph
    kept = set(program.cached) | set(program.boundary)
    targets = [n.target for n in fx_graph.nodes if n.op == "call_module"]
    fused = 0
    for node in graph.nodes:
        if node.operator != Operator.CONV or node.name in kept:
            continue
        conv = _conv_arguments(graph, node)
        if conv is None:
            continue
        fx_node = node.fx_node
        source, weight, bias, stride, padding, dilation, groups = conv
        identities: list[torch.fx.Node] = []  # modules whose work the convolution takes over
        taken = 0
        users = list(fx_node.users)
        bn = graph.by_name.get(users[0].name) if len(users) == 1 else None
        if bn is not None and targets.count(bn.fx_node.target) == 1 and program.ops.batch_norm(bn) is not None:
            weight, bias, *_ = program.ops.fold(node, bn)
            identities.append(bn.fx_node)
            taken += 1
        pad = _symmetric_zero_pad(graph, source, kept, targets)
        if pad is not None and all(p == 0 for p in padding):
            padding = pad
            if source.op == "call_module":
                identities.append(source)
            source = source.args[0]  # a function's padding is read by no one now: the generated modules drop it
            taken += 1
        if not taken:
            continue
        with fx_graph.inserting_before(fx_node):
            attrs = []
            for part, value in (("weight", weight), ("bias", bias)):
                if value is None:
                    attrs.append(None)
                    continue
                name = f"_fused_{fx_node.name}_{part}"
                graph.module.register_buffer(name, value.detach())
                attrs.append(fx_graph.get_attr(name))
        d = len(stride)
        fx_node.op, fx_node.target = "call_function", _CONV_FUNCTIONS[d]
        fx_node.args, fx_node.kwargs = (source, *attrs, tuple(stride), tuple(padding), tuple(dilation), groups), {}
        for done in identities:  # an identity under its own name: the tensor it stood for is now the convolution's
            parent, _, attr = str(done.target).rpartition(".")
            setattr(graph.module.get_submodule(parent) if parent else graph.module, attr, nn.Identity())
        fused += taken
    fx_graph.lint()
    graph.module.recompile()
    return fused


def _conv_arguments(graph: Graph, node: Node) -> tuple | None:
    """``(input node, weight, bias, stride, padding, dilation, groups)`` of a plain zero-padded convolution
    (a module or a function whose weight is a constant), with every setting as a tuple per axis; else None."""
    fx_node = node.fx_node
    d = graph.spatial_dims
    if fx_node.op == "call_module":
        module = graph.module.get_submodule(str(fx_node.target))
        if type(module) not in _CONV_MODULES or module.padding_mode != "zeros" or isinstance(module.padding, str) \
                or len(fx_node.args) != 1 or fx_node.kwargs:
            return None
        return (fx_node.args[0], module.weight, module.bias, tuple(module.stride), tuple(module.padding),
                tuple(module.dilation), module.groups)
    if fx_node.op != "call_function" or fx_node.target not in (_CONV_FUNCTIONS[d], getattr(torch, f"conv{d}d")):
        return None
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    values = dict(zip(names, fx_node.args))
    values.update(fx_node.kwargs)
    weight, bias = values.get("weight"), values.get("bias")
    if not isinstance(values.get("input"), torch.fx.Node) or not isinstance(weight, torch.fx.Node) \
            or weight.op != "get_attr" or (bias is not None and (not isinstance(bias, torch.fx.Node)
                                                                  or bias.op != "get_attr")):
        return None
    padding = values.get("padding", 0)
    if isinstance(padding, str):
        return None

    def per_axis(value):
        return tuple(value) if isinstance(value, (tuple, list)) else (value,) * d

    fetch = _attribute(graph.module)
    return (values["input"], fetch(weight.target), None if bias is None else fetch(bias.target),
            per_axis(values.get("stride", 1)), per_axis(padding), per_axis(values.get("dilation", 1)),
            int(values.get("groups", 1)))


def _attribute(module: nn.Module) -> Callable[[str], torch.Tensor]:
    """A function reading a ``get_attr`` target (a dotted path) of ``module``."""

    def fetch(target: str) -> torch.Tensor:
        value = module
        for part in target.split("."):
            value = getattr(value, part)
        return value
    return fetch


def _symmetric_zero_pad(graph: Graph, source: object, kept: set[str], targets: list
                        ) -> tuple[int, ...] | None:
    """The per-axis padding of ``source`` when it is a zero padding (a padding module, or ``F.pad`` with constant
    zeros) read only by the convolution, the same on both sides of every axis, and not a kept tensor; else None."""
    if not isinstance(source, torch.fx.Node) or len(source.users) != 1 or source.name in kept:
        return None
    if source.op == "call_module":
        if targets.count(source.target) != 1:
            return None
        module = graph.module.get_submodule(str(source.target))
        if not isinstance(module, _ZERO_PADS) or getattr(module, "value", 0.0) != 0.0:
            return None
        pads = tuple(module.padding)  # (last before, last after, previous before, previous after, ...)
    elif source.op == "call_function" and source.target is F.pad:
        values = dict(zip(("input", "pad", "mode", "value"), source.args))
        values.update(source.kwargs)
        pads = values.get("pad")
        if values.get("mode", "constant") != "constant" or values.get("value") not in (None, 0, 0.0) \
                or not isinstance(pads, (tuple, list)) or not all(isinstance(p, int) for p in pads):
            return None
    else:
        return None
    if len(pads) != 2 * graph.spatial_dims or any(pads[2 * i] != pads[2 * i + 1] for i in range(len(pads) // 2)):
        return None
    return tuple(reversed(pads[0::2]))
