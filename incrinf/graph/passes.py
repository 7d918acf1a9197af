"""Graph passes (pure, no ``torch.fx``): liveness, input dependence, split points, the cache point."""

from __future__ import annotations

from dataclasses import dataclass

from incrinf.graph.nodes import Graph, NodeKind, Operator


@dataclass(frozen=True)
class SplitPoint:
    """A cut after node ``name`` (``index`` in the graph's topological order) where one tensor is live.

    Attributes:
        name: the node whose output crosses the cut.
        index: position of the node in ``Graph.nodes``.
        shape: shape of that tensor (batch 1).
        nbytes: its size in float32 bytes.
    """

    name: str
    index: int
    shape: tuple[int, ...]
    nbytes: int


def last_uses(graph: Graph) -> dict[int, list[str]]:
    """Node index -> names whose values are no longer needed after that node."""
    out: dict[int, list[str]] = {}
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    for node in graph.nodes:
        if node.users:
            out.setdefault(max(index[u] for u in node.users), []).append(node.name)
    return out


def input_dependent(graph: Graph) -> set[str]:
    """Names of the nodes whose value depends on the model input (the rest are constants)."""
    dependent = {graph.input.name}
    for node in graph.nodes[1:]:
        if node.kind != NodeKind.CONSTANT and any(i in dependent for i in node.inputs):
            dependent.add(node.name)
    return dependent


def single_live_points(graph: Graph, names: list[str], ignore: set[str] = frozenset()) -> list[str]:
    """Nodes of ``names`` (a topologically ordered subset) after which no other node of ``names`` made earlier is
    still read, besides those in ``ignore``: everything later flows through that one tensor."""
    index = {n: i for i, n in enumerate(names)}
    last = {n: max((index.get(u, len(names)) for u in graph.by_name[n].users), default=-1) for n in names}
    points, live = [], set()
    for i, name in enumerate(names):
        live = {m for m in live if last[m] > i}
        if not live:
            points.append(name)
        if name not in ignore:
            live.add(name)
    return points


def split_points(graph: Graph) -> list[SplitPoint]:
    """All cuts where exactly one input-dependent tensor is live, in graph order.

    The cut after the last computing node (whose tensor is the output) is not listed: it is plain local
    inference; neither is the input itself.
    """
    dependent = input_dependent(graph)
    names = [n.name for n in graph.nodes[:-1] if n.name in dependent]
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    output = len(graph.nodes) - 1
    out = []
    for name in single_live_points(graph, names):
        node = graph.by_name[name]
        if name == graph.input.name or node.shape is None or node.kind == NodeKind.META or not node.users \
                or max(index[u] for u in node.users) == output:
            continue
        out.append(SplitPoint(name, index[name], tuple(node.shape), graph.nbytes(name)))
    return out


def cache_point(graph: Graph) -> int:
    """Index of the last node before the first global one (CacheInf's cache point)."""
    for i, node in enumerate(graph.nodes):
        if node.kind == NodeKind.GLOBAL:
            return max(0, i - 1)
    return len(graph.nodes) - 1


# Operators known to return a new tensor (never a view of their input) unless they are in place.
_FRESH_OPERATORS = frozenset({Operator.CONV, Operator.MAX_POOL, Operator.AVG_POOL, Operator.ADAPTIVE_MAX_POOL,
                              Operator.ADAPTIVE_AVG_POOL, Operator.WINDOWED, Operator.PAD, Operator.BATCH_NORM,
                              Operator.ARITHMETIC, Operator.CAT})


def possibly_mutated(graph: Graph, names: set[str]) -> set[str]:
    """Those of ``names`` that an in-place operation may overwrite later: a node marked in place reads them, or a
    view of them (through operators that may return a view: reshapes, getitems, identities, in-place results)."""
    out = set()
    for name in names:
        seen, todo = {name}, [name]
        while todo:
            current = graph.by_name[todo.pop()]
            for user_name in current.users:
                user = graph.by_name[user_name]
                if user.inplace and user.inputs and user.inputs[0] in seen:
                    out.add(name)
                    break
                if user_name not in seen and (user.inplace or user.operator not in _FRESH_OPERATORS) \
                        and user.inputs and user.inputs[0] == current.name:
                    seen.add(user_name)
                    todo.append(user_name)
            if name in out:
                break
    return out
