"""Running a captured graph's nodes without exposing ``torch.fx``: invoking one node, recording every node's
value, timing node by node, and cutting the graph into modules (a prefix, a suffix, the part after a set of
tensors).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx
import torch.nn as nn

from incrinf.graph.nodes import Graph, Node, NodeKind

Value = Callable[[str], Any]


def module_of(graph: Graph, node: Node) -> nn.Module | None:
    """The module a node calls (``None`` for functions and methods)."""
    fx_node = node.fx_node
    return graph.module.get_submodule(str(fx_node.target)) if fx_node.op == "call_module" else None


def arguments(node: Node, value: Value) -> tuple[list, dict]:
    """A node's positional and keyword arguments, every node reference replaced by ``value(name)``."""
    fx_node = node.fx_node
    args = list(torch.fx.node.map_arg(fx_node.args, lambda a: value(a.name)))
    kwargs = dict(torch.fx.node.map_arg(fx_node.kwargs, lambda a: value(a.name)))
    return args, kwargs


def invoke(graph: Graph, node: Node, value: Value) -> Any:
    """Run one node on the values ``value(name)`` gives for its inputs."""
    fx_node = node.fx_node
    args, kwargs = arguments(node, value)
    if fx_node.op == "call_module":
        return graph.module.get_submodule(str(fx_node.target))(*args, **kwargs)
    if fx_node.op == "call_function":
        return fx_node.target(*args, **kwargs)
    if fx_node.op == "call_method":
        return getattr(args[0], str(fx_node.target))(*args[1:], **kwargs)
    if fx_node.op == "output":
        return args[0]
    raise AssertionError(f"cannot invoke {fx_node.op} node {node.name}")


def unary(graph: Graph, node: Node, source: str, value: Value) -> Callable[[Any], Any]:
    """``node`` as a function of its input ``source``, every other argument bound once from ``value``.

    A stream frame runs about a hundred small operator calls: resolving their arguments per call costs about
    as much as the operators themselves.
    """
    fx_node = node.fx_node
    first = fx_node.args[0] if fx_node.args else None
    if fx_node.kwargs or not isinstance(first, torch.fx.Node) or first.name != source \
            or any(isinstance(a, torch.fx.Node) for a in fx_node.args[1:]):
        return lambda v: invoke(graph, node, lambda name: v if name == source else value(name))
    rest = tuple(fx_node.args[1:])
    if fx_node.op == "call_method":
        method = str(fx_node.target)
        return lambda v: getattr(v, method)(*rest)
    fn = graph.module.get_submodule(str(fx_node.target)) if fx_node.op == "call_module" else fx_node.target
    return (lambda v: fn(v, *rest)) if rest else fn


def binary(graph: Graph, node: Node, first: str, second: str) -> Callable[[Any, Any], Any] | None:
    """``node`` as a function of its two tensor inputs ``first`` and ``second`` when they are its only arguments,
    in that order (an elementwise add or multiply of two maps); None for any other form (constants, keywords,
    a list of tensors). Like :func:`unary`, it spares a merge of a few small boxes the per-call argument
    resolution of :func:`invoke`."""
    fx_node = node.fx_node
    args = fx_node.args
    if fx_node.kwargs or len(args) != 2 or not all(isinstance(a, torch.fx.Node) for a in args) \
            or (args[0].name, args[1].name) != (first, second):
        return None
    if fx_node.op == "call_method":
        method = str(fx_node.target)
        return lambda a, b: getattr(a, method)(b)
    if fx_node.op == "call_module":
        return graph.module.get_submodule(str(fx_node.target))
    return fx_node.target if fx_node.op == "call_function" else None


class _Releasing(torch.fx.Interpreter):
    """A module run node by node that reports the bytes of the values it drops after their last reader (to
    ``released``, before the next node runs), except those of nodes ``held`` names (recorded elsewhere).

    Freed blocks below glibc's mmap threshold stay resident until handed back: a caller that hands them back
    every few tens of MiB bounds what a long pass (a 3-D decoder at full resolution) holds beyond its live
    values, which a compiled module run in one call cannot. ``scratch(name)``, where given, is what a node's
    operator allocated and freed while it ran (its working memory), reported with the node's dropped values."""

    def __init__(self, module: nn.Module, released: Callable[[int], None] | None,
                 held: Callable[[str], bool] = lambda name: False,
                 scratch: Callable[[str], int] | None = None) -> None:
        super().__init__(module)
        self.released = released
        self.held = held
        self.scratch = scratch
        self.pending = 0

    def run_node(self, n: torch.fx.Node) -> Any:
        if self.pending and self.released is not None:
            self.released(self.pending)
        self.pending = 0
        out = super().run_node(n)
        if self.released is not None:
            self.pending = sum(_nbytes(self.env.get(dead)) for dead in self.user_to_last_uses.get(n, ())
                               if not self.held(dead.name)) + (self.scratch(n.name) if self.scratch else 0)
        return out


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


def run_releasing(module: nn.Module, args: Iterable[Any], released: Callable[[int], None],
                  scratch: Callable[[str], int] | None = None) -> Any:
    """``module(*args)`` for a graph module (:func:`extract`'s), run node by node, each value dropped after its
    last reader and its bytes reported to ``released`` (see :class:`_Releasing`)."""
    with torch.no_grad():
        return _Releasing(module, released, scratch=scratch).run(*args)


def materialize(graph: Graph, x: torch.Tensor, track_mutation: bool = False, keep: Iterable[str] | None = None,
                clone: Iterable[str] = (), watch: Iterable[str] | None = None,
                released: Callable[[int], None] | None = None, scratch: Callable[[str], int] | None = None
                ) -> tuple[dict[str, Any], set[str]]:
    """Node values for input ``x``, and (with ``track_mutation``) the names of the recorded tensors a later
    in-place operation overwrote (their recorded values are then copies taken when they were made).

    Args:
        graph: the captured graph.
        x: the input.
        track_mutation: compare every recorded tensor with a snapshot taken when it was made.
        keep: record only these nodes' tensors (every non-tensor value and every constant is recorded too), so
            that the rest are freed after their last use as in a plain forward pass; None: every node.
        clone: record copies of these nodes' tensors, made when they are made (a later in-place operation
            overwrites the originals).
        watch: with ``track_mutation``, snapshot only these recorded tensors (None: every recorded one).
        released: told the bytes of the values the pass drops after their last reader (those it does not
            record) and, with ``scratch``, what each node's operator allocated and freed while it ran
            (``scratch(name)`` bytes), e.g. to hand freed host memory back to the system.
    """
    env: dict[str, Any] = {}
    snapshots: dict[str, torch.Tensor] = {}
    wanted = None if keep is None else set(keep) | {n.name for n in graph.nodes if n.kind == NodeKind.CONSTANT}
    copies = set(clone)
    watched = None if watch is None else set(watch)

    class _Recorder(_Releasing):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            is_tensor = isinstance(out, torch.Tensor)
            if wanted is None or n.name in wanted or not (is_tensor or _holds_tensors(out)):
                env[n.name] = out.clone() if is_tensor and n.name in copies else out
                if track_mutation and is_tensor and out.dim() >= 3 and n.name not in copies \
                        and (watched is None or n.name in watched):
                    snapshots[n.name] = out.clone()
            return out

    with torch.no_grad():
        _Recorder(graph.module, released, lambda name: name in env, scratch).run(x)
    mutated = {name for name, snap in snapshots.items() if not torch.equal(env[name], snap)}
    for name in mutated:
        env[name] = snapshots[name]  # the value when it was made, which is what the node stands for
    return env, mutated


def constant_values(graph: Graph) -> dict[str, Any]:
    """The values of the nodes that do not depend on the input (parameters, buffers and what is computed from
    them alone), without running the model."""
    env: dict[str, Any] = {}
    with torch.no_grad():
        for node in graph.nodes:
            if node.kind != NodeKind.CONSTANT:
                continue
            fx_node = node.fx_node
            if fx_node.op == "get_attr":
                value: Any = graph.module
                for part in str(fx_node.target).split("."):
                    value = getattr(value, part)
                env[node.name] = value
            else:
                env[node.name] = invoke(graph, node, env.__getitem__)
    return env


def _holds_tensors(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value)


def run_nodes(graph: Graph, x: torch.Tensor, around: Callable[[Node, Callable[[], Any]], Any]) -> Any:
    """Run the graph node by node, each through ``around(node, run)`` (which must call ``run()`` and return its
    value), e.g. to time every node. Returns the output."""
    interp = torch.fx.Interpreter(graph.module)
    fx_nodes = list(graph.module.graph.nodes)
    interp.env = {fx_nodes[0]: x}
    out = None
    for fx_node in fx_nodes[1:]:
        node = graph.by_name[fx_node.name]
        out = interp.env[fx_node] = around(node, lambda n=fx_node: interp.run_node(n))
    return out


def extract(graph: Graph, inputs: Iterable[str], outputs: Iterable[str], clone: Iterable[str] = (),
            as_tuple: bool = False) -> nn.Module:
    """A module computing ``outputs`` from the tensors ``inputs`` (placeholders, in that order).

    Nodes that the outputs do not need are dropped; constants (parameters) are re-created from the graph's
    module; a value needed but neither an input nor computable from them is an error. Outputs listed in
    ``clone`` are copied right after they are made (a later in-place operation would overwrite them).

    Returns:
        The module; it returns a tuple of the outputs (one value when one output is asked for, unless
        ``as_tuple``).
    """
    inputs, outputs, clone = list(inputs), list(outputs), set(clone)
    new = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {name: new.placeholder(name) for name in inputs}
    fx_nodes = {n.name: n for n in graph.module.graph.nodes}
    # the nodes the outputs need: a walk back from them that stops at the inputs (a loop, not a function calling
    # itself: a closure referring to itself is a reference cycle, freed only by Python's cycle collector)
    roots: list[torch.fx.Node] = []
    for name in outputs:
        fx_node = fx_nodes[name]
        if fx_node.op == "output":  # the output node stands for the model's output (any structure of tensors)
            torch.fx.node.map_arg(fx_node.args[0], roots.append)
        else:
            roots.append(fx_node)
    needed: set[str] = set()
    while roots:
        fx_node = roots.pop()
        if fx_node.name in env or fx_node.name in needed:
            continue
        if fx_node.op == "placeholder":
            raise ValueError(f"{fx_node.name} is needed but is not among the inputs {inputs}")
        needed.add(fx_node.name)
        roots.extend(fx_node.all_input_nodes)
    for fx_node in graph.module.graph.nodes:  # in graph order: every input copied before its readers
        if fx_node.name in needed:
            env[fx_node.name] = new.node_copy(fx_node, lambda a: env[a.name])
    results = []
    for name in outputs:
        fx_node = fx_nodes[name]
        value = torch.fx.node.map_arg(fx_node.args[0], lambda a: env[a.name]) if fx_node.op == "output" \
            else env[fx_node.name]
        if name in clone:
            value = new.call_method("clone", (value,))
        results.append(value)
    new.output(results[0] if len(results) == 1 and not as_tuple else tuple(results))
    module = torch.fx.GraphModule(graph.module, new)
    module.graph.eliminate_dead_code()
    module.recompile()
    return module


def copy_graph(graph: Graph, device: torch.device | str, channels_last: bool = True) -> Graph:
    """The same graph over a private copy of its module (moved to ``device``, weights channels-last), so an
    executor may lay out and fold weights without touching the caller's model."""
    module = copy.deepcopy(graph.module).to(device)
    if channels_last:  # applies to 4-D weights only
        module = module.to(memory_format=torch.channels_last)
    module.eval()
    fx_nodes = {n.name: n for n in module.graph.nodes}
    nodes = [copy.copy(n) for n in graph.nodes]
    for node in nodes:
        node.fx_node = fx_nodes[node.name]
    return Graph(module, nodes, graph.input_shape, graph.signature)


def concat_parts(node: Node) -> list[str] | None:
    """The tensors a concatenation node joins, in order (repeats kept), or None when its first argument is not a
    plain list of nodes."""
    parts = node.fx_node.args[0] if node.fx_node.args else node.fx_node.kwargs.get("tensors")
    if not isinstance(parts, (list, tuple)) or not all(isinstance(p, torch.fx.Node) for p in parts):
        return None
    return [p.name for p in parts]
