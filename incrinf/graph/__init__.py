"""The captured graph: the only part of incrinf that reads ``torch.fx``.

:func:`capture` traces a model and types every node (:class:`NodeKind`, :class:`Operator`, window geometry,
groups, padding values, in-place flags, users); :func:`captured_graph` keeps one graph per model and input shape;
:mod:`~incrinf.graph.passes` holds the graph passes and :mod:`~incrinf.graph.execute` runs nodes and cuts the
graph into modules, so nothing downstream needs ``torch.fx``.
"""

from incrinf.graph.capture import capture, captured_graph, forget_graphs, has_windows, parse_input_shape, trace
from incrinf.graph.nodes import Graph, LocalGeometry, Node, NodeKind, Operator
from incrinf.graph.passes import (
    SplitPoint,
    cache_point,
    input_dependent,
    last_uses,
    possibly_mutated,
    single_live_points,
    split_points,
)

__all__ = [
    "Graph",
    "LocalGeometry",
    "Node",
    "NodeKind",
    "Operator",
    "SplitPoint",
    "cache_point",
    "capture",
    "captured_graph",
    "forget_graphs",
    "has_windows",
    "input_dependent",
    "last_uses",
    "parse_input_shape",
    "possibly_mutated",
    "single_live_points",
    "split_points",
    "trace",
]
