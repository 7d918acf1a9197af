"""Plans: what a batched incremental run of many changed copies of one input does, decided before it runs.

For one key (the captured graph's signature, the input's shape, every query's changed box, the projective-field
threshold, the batch size or memory budget, device and dtype) :func:`build_plan` makes a :class:`Plan`: the order
and size of the batches and, per batch and step, the boxes it recomputes, the row indices of its gathers, its
multiply-adds and its bytes. A plan reads no tensor value and no weight, so the
:class:`~incrinf.cache.RuntimeCache` keeps it and every image or volume of that shape (and every model of that
architecture) reuses it. Runtime decisions rest on what the plan says the work costs: the batch size (bytes),
keeping the index tensors (bytes), running the rest of a model as one module once a change covers a cut point.

Geometry. Exact runs (tau = 1) give each step of a batch the per-axis largest of its queries' *exact* boxes,
shifted inwards at the far edge: a query's extra elements are unchanged values, recomputed exactly, and they do
not grow further (growing the batch's box instead compounds the waste layer after layer). Truncated runs
(tau < 1) grow the batch's boxes step by step, as the seed defines the truncation on them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from incrinf.engine.boxes import step_box
from incrinf.engine.layout import (
    BoxIndex,
    Gather,
    Layout,
    Projection,
    aligned_index,
    compact,
    part_overlay,
    projection_index,
    window_index,
)
from incrinf.engine.program import Program, Step
from incrinf.geometry import Boxes, Propagation, Region, RegionKind, incremental_flops, propagate
from incrinf.graph import NodeKind, Operator
from incrinf.graph.execute import concat_parts

# Packed batches beyond this many queries stop paying on a CPU and only cost memory.
CPU_BATCH_CAP = 64
# On a GPU larger packed batches keep paying (Krypton used 128); memory is the limit.
GPU_BATCH_CAP = 256
# A plan keeps its index tensors when all of them take at most this share of what a run holds anyway (the model's
# weights, the store's tables, the largest batch's working memory); otherwise each batch makes its own, step by
# step, as it runs.
INDEX_SHARE = 0.25


class PlanKey(NamedTuple):
    """Everything that determines a plan (never tensor data).

    Attributes:
        signature: the captured graph's structure-and-shape hash.
        input_shape: (1, C, *spatial).
        layout: hash of the store's table layout (which tables, where each tensor lives in them).
        boxes: hash of the queries' changed input boxes (corners and extents).
        queries: number of queries.
        tau: projective field threshold (1: exact).
        batch_size: queries per batch (0: as many as ``memory`` allows).
        memory: bytes one batch may use (with ``batch_size`` 0).
        device: where the index tensors live.
        dtype: the values' dtype (bytes per element).
        boxed: whether its gathers are described by their boxes' corners (:func:`~incrinf.engine.layout.compact`)
            rather than row indices.
    """

    signature: str
    input_shape: tuple[int, ...]
    layout: str
    boxes: str
    queries: int
    tau: float
    batch_size: int
    memory: int
    device: str
    dtype: str
    boxed: bool = False


def boxes_digest(starts: np.ndarray, sizes: np.ndarray) -> str:
    """Hash of the queries' boxes ((Q, d) corners and extents), so plan keys hold no arrays."""
    h = hashlib.sha1(np.ascontiguousarray(starts, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(sizes, dtype=np.int64).tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class StepPlan:
    """One step of one batch.

    Attributes:
        index: the step's position in ``Program.steps``.
        box: the N boxes it recomputes (no values).
        same: per input of a merge or pointwise step, whether that input's boxes are the step's (its values are
            read as they are, no gather).
        assemble: a channel concatenation written into a gather of its own base values (each changed part
            overlaid into its columns) instead of gathering every part and joining them.
        dense: a window step whose source changed everywhere: its windows are the source's new values padded
            (no gather).
        macs: multiply-adds over the batch.
        out_bytes: bytes of the values it produces.
        read_bytes: bytes of what it gathers (read-in windows, inputs' values), freed when it is done.
    """

    index: int
    box: Boxes
    same: tuple[bool, ...]
    assemble: bool
    dense: bool
    macs: float
    out_bytes: int
    read_bytes: int


@dataclass(frozen=True)
class Overlay:
    """Rows of a gathered box receiving a region's values (``dest`` and ``box`` None: every row, in order;
    ``box``: the region's place by its boxes' corners, on CUDA)."""

    dest: torch.Tensor | None
    origin: torch.Tensor | None
    box: BoxIndex | None = None


@dataclass(frozen=True)
class StepIndex:
    """The index tensors of one planned step.

    Attributes:
        window: the read-in windows (window steps).
        inputs: per input, its gather (None: read as it is).
        parts: per part of an assembled concatenation, the overlay of its change (None: unchanged part).
    """

    window: Gather | None
    inputs: tuple[Gather | None, ...]
    parts: tuple[Overlay | None, ...] = ()

    @property
    def nbytes(self) -> int:
        total = self.window.nbytes if self.window is not None else 0
        total += sum(g.nbytes for g in self.inputs if g is not None)
        for part in self.parts:
            if part is not None:
                total += sum(t.numel() * t.element_size() for t in (part.dest, part.origin) if t is not None)
                total += part.box.nbytes if part.box is not None else 0
        return total


@dataclass(frozen=True)
class BatchIndex:
    """Every index tensor of one batch: per planned step, and per full projection of a boundary tensor."""

    steps: tuple[StepIndex, ...]
    projections: tuple[Projection | None, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.steps) + sum(p.nbytes for p in self.projections if p is not None)


@dataclass(frozen=True)
class BatchPlan:
    """One packed batch.

    Attributes:
        queries: (n,) the caller's query indices, in batch order.
        start: the n changed boxes of the input (one extent; no values).
        steps: the steps that run, in order.
        boundary: the tail's inputs' boxes, each None when unchanged.
        unchanged: no change reaches the model's output (the unchanged output is every query's).
        macs: multiply-adds of the batch.
        peak_bytes: the most bytes of values live at once while it runs (index tensors excluded).
        index_bytes: bytes of its index tensors.
        index: its index tensors, or None when the plan does not keep them (made as the batch runs).
        budget_bytes: host memory the run may hold (its plan's :attr:`Plan.budget_bytes`; 0: none, freed memory
            is handed back to the system as it is freed).
    """

    queries: np.ndarray
    start: Boxes
    steps: tuple[StepPlan, ...]
    boundary: tuple[Boxes | None, ...]
    unchanged: bool
    macs: float
    peak_bytes: int
    index_bytes: int
    index: BatchIndex | None
    budget_bytes: int = 0

    @property
    def n(self) -> int:
        return len(self.queries)


@dataclass(frozen=True)
class Plan:
    """A batched run of many changed copies of one input, decided before it runs.

    Attributes:
        key: what it was built for.
        batches: the batches in run order.
        batch_size: queries per batch (the last may hold fewer).
        full_macs: multiply-adds of one full inference.
        query_macs: (Q,) multiply-adds of each query alone on its exact boxes (the theoretical cost).
        macs: multiply-adds the batches compute, in total.
        peak_bytes: the largest batch's working memory (values; index tensors excluded).
        index_bytes: bytes of the index tensors of every batch (kept or not).
        keeps_index: whether the batches carry their index tensors.
        tail_queries: how many queries of consecutive batches may share one run of the model's tail (their boundary
            tensors kept until then; 0: each batch runs its own), see :func:`tail_group`.
        budget_bytes: memory the run may hold: naive re-inference's at this batch size (or the caller's budget),
            at least the batches' peak; freed memory the allocator keeps within it is not handed back.
    """

    key: PlanKey
    batches: tuple[BatchPlan, ...]
    batch_size: int
    full_macs: float
    query_macs: np.ndarray
    macs: float
    peak_bytes: int
    index_bytes: int
    keeps_index: bool
    tail_queries: int = 0
    budget_bytes: int = 0

    @property
    def queries(self) -> int:
        return len(self.query_macs)

    @property
    def theoretical_speedup(self) -> float:
        """Full inference of every query over each query alone on its exact boxes (FLOP ratio)."""
        return self.full_macs * self.queries / max(float(self.query_macs.sum()), 1.0)

    @property
    def planned_speedup(self) -> float:
        """Full inference of every query over what the packed batches compute (FLOP ratio)."""
        return self.full_macs * self.queries / max(self.macs, 1.0)


def _freeze(boxes: Boxes) -> Boxes:
    lo = []
    for a in boxes.lo:
        a = np.array(a, dtype=np.int64)
        a.flags.writeable = False
        lo.append(a)
    return Boxes(tuple(lo), tuple(int(s) for s in boxes.size))


def _exact_box(region: Region, queries: np.ndarray, dims: tuple[int, ...]) -> Boxes | None:
    """The batch's boxes at a tensor: per axis the largest of its queries' exact boxes, shifted inwards at the far
    edge so that each holds its query's own."""
    if region.kind == RegionKind.NONE:
        return None
    n = len(queries)
    if region.kind == RegionKind.FULL:
        return Boxes(tuple(np.zeros(n, np.int64) for _ in dims), tuple(dims))
    size = region.boxes.sizes()[queries].max(axis=0)
    size = np.minimum(size, np.asarray(dims))
    lo = np.minimum(region.boxes.start()[queries], np.asarray(dims) - size)
    return Boxes(tuple(lo.T), tuple(int(s) for s in size))


def _covers(box: Boxes, dims: tuple[int, ...]) -> bool:
    return tuple(box.size) == tuple(dims)


class _Sizes:
    """Element counts the plan's bytes are made of."""

    def __init__(self, program: Program, element_size: int) -> None:
        self.program = program
        self.element_size = element_size
        self.d = program.graph.spatial_dims

    def channels(self, name: str) -> int:
        shape = self.program.graph.by_name[name].shape
        return math.prod(shape[1:-self.d]) if shape else 0

    def of(self, name: str, box: Boxes) -> int:
        return self.element_size * self.channels(name) * box.area * box.n

    def whole(self, name: str, n: int) -> int:
        return self.element_size * self.channels(name) * math.prod(self.program.dims(name)) * n


def _assembles(program: Program, layout: Layout, step: Step) -> bool:
    """Whether a concatenation step can be written into a gather of its own base values."""
    head = step.head
    if step.window is not None or head.kind != NodeKind.MERGE or head.operator != Operator.CAT \
            or head.name not in layout.reads:
        return False
    parts = concat_parts(head)
    return parts is not None and len(set(parts)) == len(parts) and set(parts) <= set(step.inputs)


def _geometry(program: Program, layout: Layout, exact: Propagation | None, queries: np.ndarray, start: Boxes,
              tau: float, sizes: _Sizes) -> tuple[list[StepPlan], list[Boxes | None], bool, float, int]:
    """One batch's steps (boxes, reads, multiply-adds, bytes), the tail's inputs' boxes, whether its change dies
    out before the output, its multiply-adds and its peak working bytes."""
    graph = program.graph
    n = len(queries)
    regions: dict[str, Boxes | None] = {graph.input.name: start}
    live = {graph.input.name: sizes.of(graph.input.name, start)}
    peak = sum(live.values())
    steps: list[StepPlan] = []
    macs = 0.0
    for i, step in enumerate(program.steps):
        if exact is not None:
            ins = [step.window.source] if step.window is not None else step.inputs
            out = _exact_box(exact.regions[step.out], queries, step.dims) \
                if any(regions.get(name) is not None for name in ins) else None
        else:
            out = step_box(program, step, regions, tau)
        if out is not None:
            out = _freeze(out)
            same: tuple[bool, ...] = ()
            assemble = dense = False
            if step.window is not None:
                source = step.window.source
                dense = _covers(regions[source], program.dims(source)) and _covers(out, step.dims)
                read = sizes.element_size * sizes.channels(source) * math.prod(step.window.read_size(out.size)) * n
            else:
                same = tuple(regions.get(name) is not None and regions[name].same_place(out) for name in step.inputs)
                assemble = not all(same) and _assembles(program, layout, step)  # all in place: a plain join
                read = 0 if assemble else sum(sizes.of(name, out) for name, s in zip(step.inputs, same) if not s)
            out_bytes = sizes.of(step.out, out)
            step_macs = step.flops * out.area / step.positions * n
            macs += step_macs
            steps.append(StepPlan(i, out, same, assemble, dense, step_macs, out_bytes, read))
            # a function of the chain that is not in place (or the border factors) holds its input and output
            copies = 2 if step.factors is not None or any(not node.inplace for node, _ in step.chain) else 1
            peak = max(peak, sum(live.values()) + read + copies * out_bytes)
            regions[step.out] = out
            live[step.out] = out_bytes
        for name in program.release[i]:
            regions.pop(name, None)
            live.pop(name, None)
    boundary = [regions.get(name) for name in program.boundary]
    unchanged = all(regions.get(name) is None for name in program.read_boundary)
    if not unchanged:
        macs += program.tail_flops * n
        projected = sum(sizes.whole(name, n) for name in program.boundary)
        local = {node.name for node in program.local}
        tail = forward_peak_bytes(program, n, sizes.element_size, {x.name for x in graph.nodes} - local)
        peak = max(peak, sum(live.values()) + projected + tail)
    return steps, boundary, unchanged, macs, peak


def step_indices(program: Program, layout: Layout, batch: BatchPlan, device: torch.device
                 ) -> Iterator[StepIndex]:
    """The index tensors of a planned batch's steps, one step at a time (made from its geometry alone)."""
    regions: dict[str, Boxes | None] = {program.graph.input.name: batch.start}
    for sp in batch.steps:
        step = program.steps[sp.index]
        out = sp.box
        if step.window is not None:
            window = None if sp.dense else window_index(layout, step.window, layout.windows[step.out],
                                                        regions.get(step.window.source), out, device)
            yield StepIndex(window, ())
        elif sp.assemble:
            base = aligned_index(layout, layout.reads[step.head.name], None, out, device)
            parts = []
            for name in concat_parts(step.head):
                region = regions.get(name)
                if region is None:
                    parts.append(None)
                elif region.same_place(out):
                    parts.append(Overlay(None, None))
                else:
                    overlay = part_overlay(region, out, device)
                    parts.append(Overlay(overlay.dest, overlay.origin, overlay.box))
            yield StepIndex(None, (base,), tuple(parts))
        else:
            yield StepIndex(None, tuple(
                None if same else aligned_index(layout, layout.reads[name], regions.get(name), out, device)
                for name, same in zip(step.inputs, sp.same)))
        regions[step.out] = out


def projections(program: Program, batch: BatchPlan, device: torch.device) -> tuple[Projection | None, ...]:
    """The index tensors of a planned batch's full projections of the boundary tensors."""
    return tuple(None if region is None else projection_index(program.dims(name), region, device)
                 for name, region in zip(program.boundary, batch.boundary))


def batch_index(program: Program, layout: Layout, batch: BatchPlan, device: torch.device) -> BatchIndex:
    """Every index tensor of a planned batch."""
    return BatchIndex(tuple(step_indices(program, layout, batch, device)), projections(program, batch, device))


def forward_peak_bytes(program: Program, n: int, element_size: int, names: set[str] | None = None) -> int:
    """The most bytes of node outputs live at once in a plain forward pass of batch ``n`` over ``names`` (None:
    the whole graph; a tensor is freed after its last reader), what naive re-inference holds (MONAI's and
    Captum's batches); outputs of nodes outside ``names`` are not counted."""
    graph = program.graph
    order = {node.name: i for i, node in enumerate(graph.nodes)}
    last = {node.name: max((order[u] for u in node.users), default=order[node.name]) for node in graph.nodes}
    live: dict[str, int] = {}
    peak = 0
    for i, node in enumerate(graph.nodes):
        if (names is None or node.name in names) and node.kind not in (NodeKind.CONSTANT, NodeKind.META) \
                and node.shape and not node.inplace:
            live[node.name] = element_size * n * math.prod(node.shape[1:])
            peak = max(peak, sum(live.values()))
        for name in [m for m in live if last[m] <= i]:
            del live[name]
    return peak


def _index_estimate(program: Program, batch_steps: list[StepPlan], n: int, boundary: list[Boxes | None],
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


def order_queries(program: Program, exact: Propagation, sizes: np.ndarray) -> np.ndarray:
    """Order in which to pack queries so that batch-mates need boxes of similar sizes: by the area of the changed
    input box, then by the exact reach (outermost axis first) at the deepest tensor that still has boxes (stable:
    ties keep the caller's order). A packed batch computes every query on its largest boxes; edge positions reach
    fewer outputs and keep that saving only among edge positions of the same orientation."""
    graph = program.graph
    keys = [sizes.prod(axis=1)]
    boxed = [n.name for n in graph.nodes if exact.regions[n.name].kind == RegionKind.BOX and graph.is_map(n.shape)]
    if boxed:
        deepest = exact.regions[boxed[-1]].boxes.sizes()
        keys = [*deepest.T[::-1], *keys]
    return np.lexsort(keys)


def _step_extents(program: Program, exact: Propagation, q: int) -> tuple[list[float], list[np.ndarray]]:
    """Per step with a change and multiply-adds: its multiply-adds per output position, and the (Q, d) extents of
    every query's exact box there."""
    per_position, extents = [], []
    for step in program.steps:
        region = exact.regions[step.out]
        if region.kind == RegionKind.NONE or step.flops == 0:
            continue
        dims = np.asarray(step.dims)
        per_position.append(step.flops / step.positions)
        extents.append(np.broadcast_to(dims, (q, len(dims))) if region.kind == RegionKind.FULL
                       else np.minimum(region.boxes.sizes(), dims))
    return per_position, extents


def pack(program: Program, exact: Propagation, order: np.ndarray, batch_size: int) -> list[tuple[int, int]]:
    """Batch boundaries over the ordered queries: the fewest batches (:func:`_fewest_runs`, as many as plain batched
    re-inference runs) unless they would be larger than those of the cheapest packing (:func:`_cheapest_runs`,
    the fewest multiply-adds with runs of half to the full batch size), whose largest batch bounds the working
    memory: every batch pays the same walk, weight reads and tail whatever its size, so fewer batches run faster
    (ResNet18, 196 queries at batch 16: 13 batches instead of 23, 8% faster on one thread) where they hold no
    more memory.

    Returns:
        ``(first, end)`` positions in ``order`` of each batch, in order.
    """
    cheapest = _cheapest_runs(program, exact, order, batch_size)
    fewest = _fewest_runs(program, exact, order, batch_size)
    largest = max(end - first for first, end in cheapest)
    return fewest if max(end - first for first, end in fewest) <= largest else cheapest


def _fewest_runs(program: Program, exact: Propagation, order: np.ndarray, batch_size: int) -> list[tuple[int, int]]:
    """Batch boundaries over the ordered queries: as many batches as plain batched re-inference runs
    (``ceil(Q / batch_size)``, each of at most ``batch_size`` queries), cut where the packed boxes cost the fewest
    multiply-adds (dynamic programming; an exact batch computes each step on the per-axis largest of its queries'
    boxes, so queries of different reach waste work when packed together). More, smaller batches would save a few
    multiply-adds but pay what every batch pays whatever its size (a walk over every step, the weights read once
    per convolution, the tail) on fewer queries, and small batches run the convolutions less efficiently.

    Returns:
        ``(first, end)`` positions in ``order`` of each batch, in order.
    """
    q = len(order)
    count = -(-q // batch_size)
    per_position, extents = _step_extents(program, exact, q)
    if not extents or count == 1:
        return [(lo, min(lo + batch_size, q)) for lo in range(0, q, batch_size)]
    weight = np.asarray(per_position)
    ordered = np.stack(extents, axis=1)[order].astype(np.float64)  # (Q, steps, d)
    # run[n - 1, first]: multiply-adds of the run of n queries starting at ``first`` (inf past the end)
    run = np.full((batch_size, q), np.inf)
    largest = ordered.copy()
    for n in range(1, batch_size + 1):
        if n > 1:
            largest = np.maximum(largest[:-1], ordered[n - 1:])
        run[n - 1, :q - n + 1] = n * (largest.prod(axis=2) @ weight)
    # best[k, end]: the cheapest k batches over the first ``end`` queries; ties go to earlier cuts (stable)
    best = np.full((count + 1, q + 1), np.inf)
    best[0, 0] = 0.0
    cut = np.zeros((count + 1, q + 1), np.int64)
    ends = np.arange(q + 1)
    for k in range(1, count + 1):
        for n in range(1, batch_size + 1):
            firsts = ends[n:] - n
            cost = best[k - 1, firsts] + run[n - 1, firsts]
            better = cost < best[k, n:]
            best[k, n:] = np.where(better, cost, best[k, n:])
            cut[k, n:] = np.where(better, firsts, cut[k, n:])
    bounds, end = [], q
    for k in range(count, 0, -1):
        bounds.append((int(cut[k, end]), end))
        end = int(cut[k, end])
    return bounds[::-1]


def _cheapest_runs(program: Program, exact: Propagation, order: np.ndarray, batch_size: int) -> list[tuple[int, int]]:
    """Batch boundaries over the ordered queries: consecutive runs of ``batch_size // 2`` (at least 1) to
    ``batch_size`` queries whose packed boxes cost the fewest multiply-adds (dynamic programming; an exact batch
    computes each step on the per-axis largest of its queries' boxes, so queries of different reach waste work
    when packed together). Runs never shrink below half the batch size, so per-batch costs at most double.

    Returns:
        ``(first, end)`` positions in ``order`` of each batch, in order.
    """
    q = len(order)
    smallest = max(1, min(batch_size // 2, q))
    per_position, extents = _step_extents(program, exact, q)
    if not extents:
        return [(lo, min(lo + batch_size, q)) for lo in range(0, q, batch_size)]
    weight = np.asarray(per_position)
    ordered = np.stack(extents, axis=1)[order]  # (Q, steps, d)
    best = np.full(q + 1, np.inf)
    best[0] = 0.0
    cut = np.zeros(q + 1, np.int64)
    for end in range(1, q + 1):
        largest = None
        for first in range(end - 1, max(end - batch_size, 0) - 1, -1):
            largest = ordered[first] if largest is None else np.maximum(largest, ordered[first])
            n = end - first
            if n < smallest and first > 0 and end < q:
                continue
            # a batch costs its multiply-adds; ties go to fewer batches
            cost = best[first] + n * float(weight @ largest.prod(axis=1)) * (1 + 1e-9) + 1e-6
            if cost < best[end]:
                best[end], cut[end] = cost, first
    bounds, end = [], q
    while end > 0:
        bounds.append((int(cut[end]), end))
        end = int(cut[end])
    return bounds[::-1]


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
    boundary = sum(_Sizes(program, element_size).whole(name, 1) for name in program.boundary)
    weights = sum(p.numel() * p.element_size() for p in program.tail().parameters())
    if weights <= boundary * batch_size:
        return 0
    per_query = boundary + forward_peak_bytes(program, 1, element_size, tail)
    queries = (budget - peak) // max(per_query, 1)
    return int(queries) if queries > batch_size else 0


def build_plan(program: Program, layout: Layout, key: PlanKey, starts: np.ndarray, sizes: np.ndarray) -> Plan:
    """The :class:`Plan` for ``key``: ``starts`` and ``sizes`` (Q, d) are the queries' changed input boxes (inside
    the input) whose digest the key holds.

    The batch size is ``key.batch_size``, or (0) the most queries whose batch stays within ``key.memory`` bytes,
    measured on a batch of the queries with the largest boxes (at most :data:`CPU_BATCH_CAP`, or
    :data:`GPU_BATCH_CAP` on CUDA).
    """
    graph = program.graph
    dims = tuple(graph.input_shape[2:])
    starts = np.asarray(starts, np.int64).reshape(-1, len(dims))
    sizes = np.asarray(sizes, np.int64).reshape(-1, len(dims))
    q = len(starts)
    device = torch.device(key.device)
    element_size = torch.empty((), dtype=getattr(torch, key.dtype.replace("torch.", ""))).element_size()
    byte_sizes = _Sizes(program, element_size)
    exact = propagate(graph, Boxes(tuple(starts.T), tuple(sizes.T)), key.tau, uniform=False)
    query_macs = incremental_flops(graph, exact)
    order = order_queries(program, exact, sizes)
    per_axis = exact if key.tau >= 1.0 else None

    def geometry(queries: np.ndarray):
        extent = sizes[queries].max(axis=0)
        corner = np.minimum(starts[queries], np.asarray(dims) - extent)
        start = _freeze(Boxes(tuple(corner.T), tuple(int(e) for e in extent)))
        return start, _geometry(program, layout, per_axis, queries, start, key.tau, byte_sizes)

    batch_size = key.batch_size
    if batch_size <= 0:
        cap = GPU_BATCH_CAP if device.type == "cuda" else CPU_BATCH_CAP
        trial = order[-min(cap, q):]
        _, (*_, peak) = geometry(trial)
        per_query = max(peak / len(trial), 1.0)
        batch_size = int(max(1, min(cap, key.memory // per_query)))
    batch_size = max(1, min(batch_size, q))
    store = sum(t.rows * byte_sizes.channels(t.source) * element_size for t in layout.tables.values())
    bounds = pack(program, exact, order, batch_size) if per_axis is not None else \
        [(lo, min(lo + batch_size, q)) for lo in range(0, q, batch_size)]
    made = []
    for lo, hi in bounds:
        queries = order[lo:hi]
        start, (steps, boundary, unchanged, macs, peak) = geometry(queries)
        estimate = _index_estimate(program, steps, len(queries), boundary, device)
        made.append((queries, start, steps, boundary, unchanged, macs, peak, estimate))
    peak = max(m[6] for m in made)
    index_bytes = sum(m[7] for m in made)
    weights = sum(p.numel() * p.element_size() for p in graph.module.parameters())
    keep = index_bytes <= INDEX_SHARE * (weights + store + peak)
    # naive re-inference at this batch size (or the caller's budget) bounds what batches and a shared tail hold
    budget = max(key.memory if key.batch_size <= 0 else forward_peak_bytes(program, batch_size, element_size), peak)
    tail_queries = min(tail_group(program, batch_size, element_size, peak, budget), q) if q > batch_size else 0
    if tail_queries:
        per_query = sum(byte_sizes.whole(name, 1) for name in program.boundary)
        peak += per_query * tail_queries  # the boundary tensors waiting for the shared tail run
    batches = []
    for queries, start, steps, boundary, unchanged, macs, batch_peak, estimate in made:
        frozen = np.array(queries)
        frozen.flags.writeable = False
        batch = BatchPlan(frozen, start, tuple(steps), tuple(boundary), unchanged, macs, batch_peak, estimate, None,
                          budget)
        if keep:
            index = batch_index(program, layout, batch, device)
            batch = BatchPlan(frozen, start, tuple(steps), tuple(boundary), unchanged, macs, batch_peak,
                              index.nbytes, index, budget)
        batches.append(batch)
    return Plan(key, tuple(batches), batch_size, float(program.full_flops), query_macs,
                float(sum(b.macs for b in batches)), peak, sum(b.index_bytes for b in batches), keep, tail_queries,
                budget)
