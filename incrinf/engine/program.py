"""A captured graph grouped into steps: the unit of incremental work shared by every region representation.

CacheInf (seed 000): every tensor before the model's first global operator (the *local part*) depends only on
a neighbourhood of the input. The local part is cut into *steps*: a compute node (a sliding window, a 1x1
convolution, a merge, a pointwise node) plus the single-user pointwise nodes after it (a batch norm right after
a convolution is folded into it). Only the tensors read outside their own step's region are *cached*
(window sources, merge inputs, the tensors the rest of the model reads): the halo fusion of the seed. The rest
of the model (global pooling, classifier) is the *tail*, one generated module run on the full cached tensors;
a *cut point* is a cached tensor through which everything later flows, from which a generated *suffix* module
can finish a run whose change has reached most of the map.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from incrinf.engine.operators import Operators, WindowOp
from incrinf.engine.windows import WindowSpec, window_spec
from incrinf.graph import Graph, Node, NodeKind, single_live_points
from incrinf.graph.execute import extract


@dataclass
class Step:
    """One unit of per-region work.

    Attributes:
        head: the compute node.
        out: the node whose value the step produces (the head or the last node of its chain).
        inputs: the head's tensor inputs in the local part.
        chain: ``(node, its input)`` pointwise nodes applied after the head.
        window: the head's window geometry (sliding windows only).
        op: the head's window operator with padding 0 (sliding windows only).
        factors: (1, 1, *out) average-pool border factors, or None.
        linear: ``(weight, bias)`` when the head is a 1x1 convolution run as a matrix product over rows.
        inplace: some node of the step overwrites its input (its inputs must not be views of a cache).
        flops: multiply-accumulates of the whole step over the whole map.
        dims: the output's spatial extents.
        channels: the output's channel axes (more than one after a channel shuffle's view).
        weight_bytes: bytes of the head's weights (a convolution's), which every batch that runs the step reads.
        conv: ``(weight, bias, stride, dilation, groups)`` of a convolution head that ``op`` runs (None otherwise).
        whole_op: for a window step whose padding is all zeros, its operator over the whole unpadded source map
            with the padding done by the operator itself (None otherwise): oneDNN runs a 3x3 convolution on a 7x7
            map with padding 1 about 15% faster than on the 9x9 map padded beforehand (14x14: 6-12%).
    """

    head: Node
    out: str
    inputs: list[str]
    chain: list[tuple[Node, str]] = field(default_factory=list)
    window: WindowSpec | None = None
    op: WindowOp | None = None
    factors: torch.Tensor | None = None
    linear: tuple[torch.Tensor, torch.Tensor | None] | None = None
    inplace: bool = False
    flops: float = 0.0
    dims: tuple[int, ...] = ()
    channels: tuple[int, ...] = ()
    weight_bytes: int = 0
    whole_op: WindowOp | None = None
    conv: tuple | None = None
    functions: list = field(default_factory=list, repr=False)  # the chain, bound once

    @property
    def positions(self) -> int:
        return math.prod(self.dims)


class Program:
    """The local part of a graph as steps, its cached tensors, cut points, tail and suffix modules.

    Args:
        graph: the captured graph (its module runs the steps).
        env: node values: the constants at least (:func:`incrinf.graph.execute.constant_values`), or every
            node's value for one input (:func:`incrinf.graph.execute.materialize`).
        mutated: tensors a later in-place operation overwrites (cached copies of them must be clones).
        fold_batch_norm: fold batch norms into the convolutions before them.

    Attributes:
        local: the local part's nodes in order (the input first).
        cached: names of the cached tensors, in graph order (the input excluded).
        boundary: local tensors the rest of the model reads.
        read_boundary: the boundary tensors whose values (not only sizes) the rest of the model reads.
        cuts: cached tensors through which all later computation flows (the input aside, which later nodes may
            read only for its size).
        steps: the steps in order.
        live: per step, the tensors made before it (the input included) that it or a later step reads.
        release: per step, the tensors no later step and not the tail reads (a walk may drop their regions).
    """

    def __init__(self, graph: Graph, env: dict[str, Any], mutated: set[str] = frozenset(),
                 fold_batch_norm: bool = True) -> None:
        self.graph = graph
        self.ops = Operators(graph, env)
        self.mutated = set(mutated)
        self.local = _local_part(graph)
        local = {n.name for n in self.local}
        self.is_local = local.__contains__
        windows = {n.name: window_spec(graph, n) for n in self.local if n.is_window}
        cached: list[str] = []
        for node in self.local:
            if node.name in windows:
                cached.append(windows[node.name].source)
            elif node.kind == NodeKind.MERGE:
                cached.extend(name for name in node.inputs if name in local)
        self.boundary = [n.name for n in self.local if n.kind not in (NodeKind.PAD, NodeKind.META)
                         and any(u not in local for u in n.users)]
        # boundary tensors whose values, not only their sizes, the rest of the model reads
        self.read_boundary = [name for name in self.boundary if any(
            u not in local and graph.by_name[u].kind != NodeKind.META for u in graph.by_name[name].users)]
        order = {n.name: i for i, n in enumerate(graph.nodes)}
        self.cached = sorted(set(cached + self.boundary) - {graph.input.name}, key=order.__getitem__)
        self.cached_set = frozenset(self.cached)
        self.steps = self._steps(windows, set(self.cached) | set(self.boundary), fold_batch_norm, env)
        # the input is often read later for its size alone (a flatten to its batch size): a cut may ignore it, but
        # not come before a node that reads its values
        name_of_input = graph.input.name
        value_readers = [u for u in graph.input.users if graph.by_name[u].kind != NodeKind.META]
        order_of = {n.name: i for i, n in enumerate(graph.nodes)}
        after = max((order_of[u] for u in value_readers), default=0)
        self.cuts = {c for c in single_live_points(graph, [n.name for n in self.local], ignore={name_of_input})
                     if c in self.cached_set and order_of[c] >= after}
        self.live = self._live()
        self.release = self._release()
        self.full_flops = float(graph.full_flops())
        self.tail_flops = float(sum(n.flops for n in graph.nodes if n.name not in local))
        self._modules: dict[tuple, torch.nn.Module] = {}

    def dims(self, name: str) -> tuple[int, ...]:
        """A tensor's spatial extents."""
        return tuple(self.graph.by_name[name].shape[-self.graph.spatial_dims:])

    @property
    def has_local_part(self) -> bool:
        """Whether any sliding window precedes the first global operator (else nothing can be reused)."""
        return any(step.window is not None for step in self.steps)

    # --- generated modules -------------------------------------------------------------------------------

    def prepare(self, with_cached: bool) -> None:
        """Generate the tail, the suffixes (and with ``with_cached`` the full module) now rather than on first use
        (generating one costs about an inference)."""
        self.tail()
        for cut in self.cuts:
            self._suffix_module(cut, with_cached)
        if with_cached:
            self._full_module()

    def tail(self) -> torch.nn.Module:
        """``(boundary tensors...) -> output``: the model after the local part."""
        return self._module(("tail",), lambda: extract(self.graph, self.boundary, [self.graph.output.name]))

    def full(self, x: torch.Tensor) -> tuple[Any, list[torch.Tensor]]:
        """Full inference of ``x`` that also yields every cached tensor: ``(output, [cached tensors...])``."""
        out, *tensors = self._full_module()(x)
        return out, tensors

    def suffix(self, cut: str, tensor: torch.Tensor, like_input: torch.Tensor, with_cached: bool
               ) -> tuple[Any, list[torch.Tensor]]:
        """The rest of the model from the cut point's tensor: ``(output, [cached tensors after the cut...])``
        (the list is empty without ``with_cached``). ``like_input`` has the input's shape (batch included): the
        rest of the model may read it for its size, never its values."""
        out, *tensors = self._suffix_module(cut, with_cached)(like_input, tensor)
        return out, tensors

    def _full_module(self) -> torch.nn.Module:
        return self._module(("full",), lambda: extract(self.graph, [self.graph.input.name],
                                                       [self.graph.output.name, *self.cached], self.mutated, True))

    def _suffix_module(self, cut: str, with_cached: bool) -> torch.nn.Module:
        later = self.cached_after(cut) if with_cached else []
        return self._module(("suffix", cut, with_cached), lambda: extract(
            self.graph, [self.graph.input.name, cut], [self.graph.output.name, *later], self.mutated, True))

    def cached_after(self, cut: str) -> list[str]:
        """The cached tensors computed after ``cut``."""
        return self.cached[self.cached.index(cut) + 1:]

    def suffix_flops(self, cut: str) -> float:
        """FLOPs of the local part after ``cut`` (the tail excluded)."""
        after = False
        total = 0.0
        for node in self.local:
            if after:
                total += node.flops
            after = after or node.name == cut
        return total

    def _module(self, key: tuple, build) -> torch.nn.Module:
        module = self._modules.get(key)
        if module is None:
            module = self._modules[key] = build()
        return module

    # --- construction ------------------------------------------------------------------------------------

    def _steps(self, windows: dict[str, WindowSpec], keep: set[str], fold: bool, env: dict[str, Any]) -> list[Step]:
        graph, ops = self.graph, self.ops
        local = {n.name for n in self.local}
        d = graph.spatial_dims
        absorbed: set[str] = set()
        steps = []
        for node in self.local:
            if node.kind in (NodeKind.INPUT, NodeKind.PAD, NodeKind.META) or node.name in absorbed:
                continue
            chain: list[tuple[Node, str]] = []
            folded = None
            flops = node.flops
            last = node
            while last.name not in keep and len(last.users) == 1:
                user = graph.by_name[last.users[0]]
                if user.name not in local or user.kind != NodeKind.POINTWISE \
                        or [i for i in user.inputs if i in local and graph.by_name[i].kind != NodeKind.META] \
                        != [last.name]:
                    break
                if fold and folded is None and not chain and ops.conv_params(node) is not None \
                        and ops.batch_norm(user) is not None:
                    folded = ops.fold(node, user)
                else:
                    chain.append((user, last.name))
                absorbed.add(user.name)
                flops += user.flops
                last = user
            inputs = [i for i in node.inputs if i in local and graph.by_name[i].kind != NodeKind.META]
            # a split's tuple has no shape: its maps keep their input's positions
            out_shape = graph.by_name[last.name].shape or graph.by_name[inputs[0]].shape
            step = Step(node, last.name, inputs, chain, flops=float(flops), dims=tuple(out_shape[-d:]),
                        channels=tuple(out_shape[1:-d]), inplace=node.inplace or any(n.inplace for n, _ in chain))
            params = folded or ops.conv_params(node)
            if params is not None and isinstance(params[0], torch.Tensor):
                step.weight_bytes = params[0].numel() * params[0].element_size()
            if node.name in windows:
                step.window = windows[node.name]
                step.op = ops.window(node, folded)
                step.conv = ops.window_conv(node, folded)
                step.whole_op = ops.whole_window(node, step.window, step.dims, folded)
                value = env.get(node.name)
                dtype, device = _reference(graph, value if value is not None else env.get(graph.input.name))
                step.factors = ops.border_factors(node, dtype, device)
            else:
                step.linear = ops.linear(node, folded) if node.kind == NodeKind.LOCAL else None
                if node.kind == NodeKind.LOCAL and step.linear is None:
                    step.op = ops.window(node, folded)  # a 1x1 grouped convolution: no window, no padding
            step.functions = [ops.unary(n, src) for n, src in chain]
            steps.append(step)
        return steps

    def _release(self) -> list[list[str]]:
        last: dict[str, int] = {}
        for i, names in enumerate(self.live):
            for name in names:
                last[name] = i  # the last step that reads it
        for i, step in enumerate(self.steps):
            last.setdefault(step.out, i)  # read by no later step
        out: list[list[str]] = [[] for _ in self.steps]
        for name, i in last.items():
            if name not in self.boundary:
                out[i].append(name)
        return out

    def _live(self) -> list[list[str]]:
        reads = [[s.window.source] if s.window is not None else list(s.inputs) for s in self.steps]
        made = [self.graph.input.name] + [s.out for s in self.steps]
        live = []
        for i in range(len(self.steps)):
            later = {name for r in reads[i:] for name in r}
            live.append([name for name in made[: i + 1] if name in later])
        return live


def _reference(graph: Graph, value: Any) -> tuple[torch.dtype, torch.device]:
    """dtype and device of a node's value, or (a program built from constants alone) of the model's weights."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.device
    weight = next(iter(graph.module.parameters()), None)
    return (weight.dtype, weight.device) if weight is not None else (torch.float32, torch.device("cpu"))


def _spatial_constants(graph: Graph, node: Node) -> bool:
    """Whether a constant input has a spatial extent (it would not broadcast over a region's values)."""
    d = graph.spatial_dims
    for name in node.inputs:
        src = graph.by_name[name]
        if src.kind == NodeKind.CONSTANT and src.shape is not None and len(src.shape) >= d + 1 \
                and any(s != 1 for s in src.shape[-d:]):
            return True
    return False


def _local_part(graph: Graph) -> list[Node]:
    """Nodes before the first global operator that carry regions (plus the sizes they read)."""
    d = graph.spatial_dims
    candidate: set[str] = set()
    for node in graph.nodes:
        is_map = graph.is_map(node.shape)
        if node.kind == NodeKind.INPUT:
            candidate.add(node.name)
        elif node.kind == NodeKind.LOCAL and is_map and len(node.shape) == d + 2:
            candidate.add(node.name)
        elif node.kind in (NodeKind.POINTWISE, NodeKind.MERGE, NodeKind.PAD) and is_map \
                and not _spatial_constants(graph, node):
            candidate.add(node.name)
        elif node.kind == NodeKind.POINTWISE and node.shape is None:
            candidate.add(node.name)  # a channel split's tuple of maps (its getitems pick them)
        elif node.kind == NodeKind.META:
            candidate.add(node.name)
    local = set(candidate)
    changed = True
    while changed:  # until every member's inputs are members (or constants) and padding feeds windows only
        changed = False
        for node in graph.nodes:
            if node.name not in local or node.kind == NodeKind.INPUT:
                continue
            ok = all(name in local or graph.by_name[name].kind == NodeKind.CONSTANT for name in node.inputs)
            if ok and node.kind == NodeKind.PAD:
                ok = all(u in local and graph.by_name[u].is_window for u in node.users)
            if not ok:
                local.discard(node.name)
                changed = True
    # sizes only matter for the steps that read them: drop the others
    needed = {i for n in graph.nodes if n.name in local and n.kind != NodeKind.META for i in n.inputs}
    changed = True
    while changed:
        changed = False
        for node in graph.nodes:
            if node.name in local and node.kind == NodeKind.META and node.name not in needed:
                local.discard(node.name)
                changed = True
        needed |= {i for n in graph.nodes if n.name in local and n.kind == NodeKind.META for i in n.inputs}
    return [n for n in graph.nodes if n.name in local]
