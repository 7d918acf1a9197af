"""The byte model of a plan: what a program's tensors, a batch's index tensors, a plain forward pass and a shared
run of the model's tail hold, counted from shapes alone (no tensor is made)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from incrinf.engine.layout import compact
from incrinf.engine.program import Program
from incrinf.geometry import Boxes
from incrinf.graph import NodeKind


class ByteSizes:
    """Bytes of a program's tensors, whole or in boxes (the element counts a plan's bytes are made of)."""

    def __init__(self, program: Program, element_size: int) -> None:
        self.program = program
        self.element_size = element_size
        self.d = program.graph.spatial_dims

    def channels(self, name: str) -> int:
        """Elements per position of tensor ``name`` (its channels)."""
        shape = self.program.graph.by_name[name].shape
        return math.prod(shape[1:-self.d]) if shape else 0

    def of(self, name: str, box: Boxes) -> int:
        """Bytes of tensor ``name``'s values in ``box`` (every box of it)."""
        return self.element_size * self.channels(name) * box.area * box.n

    def whole(self, name: str, n: int) -> int:
        """Bytes of ``n`` whole copies of tensor ``name``."""
        return self.element_size * self.channels(name) * math.prod(self.program.dims(name)) * n


def forward_peak_bytes(program: Program, n: int, element_size: int, names: set[str] | None = None,
                       keep: frozenset[str] = frozenset(), channels_last: bool | None = None) -> int:
    """The most bytes of node outputs live at once in a plain forward pass of batch ``n`` over ``names`` (None:
    the whole graph; a tensor is freed after its last reader, except those in ``keep``), what naive
    re-inference holds (MONAI's and Captum's batches); outputs of nodes outside ``names`` are not counted.

    With ``channels_last`` set (the layout of the maps the pass reads), each node's operator also holds its
    working memory while it runs (:meth:`~incrinf.engine.operators.Operators.working_bytes`)."""
    graph = program.graph
    order = {node.name: i for i, node in enumerate(graph.nodes)}
    last = {node.name: max((order[u] for u in node.users), default=order[node.name]) for node in graph.nodes}
    live: dict[str, int] = {}
    peak = 0
    for i, node in enumerate(graph.nodes):
        if (names is None or node.name in names) and node.kind not in (NodeKind.CONSTANT, NodeKind.META) \
                and node.shape and not node.inplace:
            live[node.name] = element_size * n * math.prod(node.shape[1:])
            work = 0 if channels_last is None else program.ops.working_bytes(node, n, element_size, channels_last)
            peak = max(peak, sum(live.values()) + work)
        for name in [m for m in live if last[m] <= i and m not in keep]:
            del live[name]
    return peak


def index_estimate(program: Program, batch_steps: Sequence, n: int, boundary: list[Boxes | None],
                    device: torch.device) -> int:
    """Bytes of a batch's index tensors, without making them (int64 rows; the overlays at most as many again;
    gathers described by their boxes' corners: 24 bytes per box)."""
    if compact(device, program.graph.spatial_dims):
        gathers = sum(1 if program.steps[sp.index].window is not None else max(1, sum(not s for s in sp.same))
                      for sp in batch_steps) + sum(r is not None for r in boundary)
        return 24 * n * gathers
    rows = 0
    for sp in batch_steps:
        step = program.steps[sp.index]
        if step.window is not None:
            rows += 0 if sp.dense else 2 * n * math.prod(step.window.read_size(sp.box.size))
        else:
            rows += 2 * n * sp.box.area * max(1, sum(not s for s in sp.same))
    rows += sum(r.area * r.n for r in boundary if r is not None)
    return 8 * rows


def tail_group(program: Program, batch_size: int, element_size: int, peak: int, budget: int) -> int:
    """How many queries one run of the model's tail may take at once: the most whose boundary tensors, kept while
    the batches that make them run (at most ``peak`` bytes each), and the tail's own forward pass stay within
    ``budget`` bytes; 0 when that is no more than one batch, or when a run of the tail on one batch reads fewer
    bytes of weights than of boundary tensors (it is not bound by its weights: sharing would only hold memory).

    The tail runs on whole boundary tensors whatever the change, and reads all of its weights once per run: a
    classifier of large fully connected layers (VGG16's: 124 M multiply-adds and 0.5 GB of weights per run at
    batch 16) is bound by those reads, so fewer, larger runs cost less, as batched re-inference's do.
    """
    tail = {node.name for node in program.graph.nodes} - {node.name for node in program.local}
    boundary = sum(ByteSizes(program, element_size).whole(name, 1) for name in program.boundary)
    weights = sum(p.numel() * p.element_size() for p in program.tail().parameters())
    if weights <= boundary * batch_size:
        return 0
    per_query = boundary + forward_peak_bytes(program, 1, element_size, tail)
    queries = (budget - peak) // max(per_query, 1)
    return int(queries) if queries > batch_size else 0
