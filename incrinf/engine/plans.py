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

The order and cuts of the batches come from :mod:`~incrinf.engine.packing`, the bytes from
:mod:`~incrinf.engine.plan_bytes`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from incrinf.engine import packing
from incrinf.engine.boxes import step_box
from incrinf.engine.layout import (
    BoxIndex,
    Gather,
    Layout,
    Projection,
    aligned_index,
    part_overlay,
    projection_index,
    window_index,
)
from incrinf.engine.packing import candidate_orders, cheapest_order, order_queries, pack
from incrinf.engine.plan_bytes import ByteSizes, forward_peak_bytes, index_estimate, tail_group
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
        budget_bytes: memory the run may hold: naive re-inference's at this batch size, working memory of its
            operators on channels-first batches included (or the caller's budget),
            at least the batches' peak; freed memory the allocator keeps within it is not handed back.
        weight_bytes: bytes of weights the run reads: each batch reads the weights of every step it runs, each
            run of the tail the tail's (plain batched re-inference reads all of them once per batch).
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
    weight_bytes: int = 0

    @property
    def queries(self) -> int:
        return len(self.query_macs)

    @property
    def largest_batch(self) -> int:
        """Queries in its largest batch (more than :attr:`batch_size` where the bytes allow, see
        :func:`build_plan`)."""
        return max((b.n for b in self.batches), default=0)

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


def _assembles(program: Program, layout: Layout, step: Step) -> bool:
    """Whether a concatenation step can be written into a gather of its own base values."""
    head = step.head
    if step.window is not None or head.kind != NodeKind.MERGE or head.operator != Operator.CAT \
            or head.name not in layout.reads:
        return False
    parts = concat_parts(head)
    return parts is not None and len(set(parts)) == len(parts) and set(parts) <= set(step.inputs)


def _geometry(program: Program, layout: Layout, exact: Propagation | None, queries: np.ndarray, start: Boxes,
              tau: float, sizes: ByteSizes) -> tuple[list[StepPlan], list[Boxes | None], bool, float, int]:
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
            peak = max(peak, sum(live.values()) + read + copies * out_bytes
                       + step_working_bytes(program, step, n, out, sizes.element_size))
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
        # the tail reads the store's channels-last projections
        tail = forward_peak_bytes(program, n, sizes.element_size, {x.name for x in graph.nodes} - local,
                                  channels_last=True)
        peak = max(peak, sum(live.values()) + projected + tail)
    return steps, boundary, unchanged, macs, peak


def step_working_bytes(program: Program, step: Step, n: int, box: Boxes, element_size: int) -> int:
    """What a step's operator allocates and frees while it runs on ``n`` boxes ``box`` (channels-last region
    values; the executor's 3-D window convolutions always in oneDNN), see
    :meth:`~incrinf.engine.operators.Operators.working_bytes`."""
    if step.linear is not None:
        return 0  # a matrix product over rows
    read = step.window.read_size(box.size) if step.window is not None else box.size
    return program.ops.working_bytes(step.head, n, element_size, True, (tuple(read), tuple(box.size)),
                                     onednn=step.window is not None and program.graph.spatial_dims == 3)


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


class _Packed(NamedTuple):
    """One batch of a packing being weighed by :func:`build_plan`: its queries, geometry, multiply-adds, peak bytes
    and the estimated bytes of its index tensors."""

    queries: np.ndarray
    start: Boxes
    steps: list[StepPlan]
    boundary: list
    unchanged: bool
    macs: float
    peak: int
    index_bytes: int


def _keeps_index(made: list[_Packed], weights: int, store: int) -> bool:
    """Whether a plan of the batches ``made`` keeps their index tensors: all of them take at most
    :data:`INDEX_SHARE` of what the run holds anyway (the model's weights, the store, the largest batch)."""
    return sum(m.index_bytes for m in made) <= INDEX_SHARE * (weights + store + max(m.peak for m in made))


def _largest(made: list[_Packed]) -> int:
    """Queries in the largest of the batches ``made``."""
    return max(len(m.queries) for m in made)


def _cost(made: list[_Packed], weight_bytes: int) -> float:
    """What the batches ``made`` cost in multiply-adds: their own (tails included) plus the weights they read,
    weighed as :func:`~incrinf.engine.packing.run_cost` weighs them."""
    return sum(m.macs for m in made) + packing.MACS_PER_WEIGHT_BYTE * weight_bytes


def _holds(made: list[_Packed], weights: int, store: int) -> int:
    """The most bytes the batches ``made`` hold at once beyond the store: the largest batch's values and index
    tensors (all batches' index tensors when the plan keeps them)."""
    if _keeps_index(made, weights, store):
        return max(m.peak for m in made) + sum(m.index_bytes for m in made)
    return max(m.peak + m.index_bytes for m in made)


def build_plan(program: Program, layout: Layout, key: PlanKey, starts: np.ndarray, sizes: np.ndarray) -> Plan:
    """The :class:`Plan` for ``key``: ``starts`` and ``sizes`` (Q, d) are the queries' changed input boxes (inside
    the input) whose digest the key holds.

    The batch size is ``key.batch_size``, or (0) the most queries whose batch stays within ``key.memory`` bytes,
    measured on a batch of the queries with the largest boxes (at most :data:`CPU_BATCH_CAP`, or
    :data:`GPU_BATCH_CAP` on CUDA).

    Exact runs pack batches of half the batch size and more (:func:`~incrinf.engine.packing.pack`). Where the
    weight reads make larger batches cheaper, a batch may hold more than the batch size as long as what it
    holds fits the *allowance*: ``key.memory``, or what naive re-inference at the batch size holds beyond the
    model (its activations, :func:`~incrinf.engine.plan_bytes.forward_peak_bytes`) less what this run holds beyond
    it (the store's tables, the weights the executor made). The bytes per query come from a batch of the largest
    boxes; a packing whose batches then hold more than the allowance is replaced by one of at most the batch size.
    So a run's peak stays at naive re-inference's at the same batch size wherever the batch size alone kept it
    there. The run keeps freed memory within the *budget*: naive re-inference's real peak (its operators' working
    memory on plain channels-first batches included), or ``key.memory``.
    """
    graph = program.graph
    dims = tuple(graph.input_shape[2:])
    starts = np.asarray(starts, np.int64).reshape(-1, len(dims))
    sizes = np.asarray(sizes, np.int64).reshape(-1, len(dims))
    q = len(starts)
    device = torch.device(key.device)
    element_size = torch.empty((), dtype=getattr(torch, key.dtype.replace("torch.", ""))).element_size()
    byte_sizes = ByteSizes(program, element_size)
    exact = propagate(graph, Boxes(tuple(starts.T), tuple(sizes.T)), key.tau, uniform=False)
    query_macs = incremental_flops(graph, exact)
    order = order_queries(program, exact, sizes)
    per_axis = exact if key.tau >= 1.0 else None

    def geometry(queries: np.ndarray):
        extent = sizes[queries].max(axis=0)
        corner = np.minimum(starts[queries], np.asarray(dims) - extent)
        start = _freeze(Boxes(tuple(corner.T), tuple(int(e) for e in extent)))
        return start, _geometry(program, layout, per_axis, queries, start, key.tau, byte_sizes)

    cap = GPU_BATCH_CAP if device.type == "cuda" else CPU_BATCH_CAP
    per_query = 0.0
    if key.batch_size <= 0 or per_axis is not None:  # bytes per query, on a batch of the largest boxes
        trial = order[-min(cap, q):]
        _, (*_, trial_peak) = geometry(trial)
        per_query = max(trial_peak / len(trial), 1.0)
    batch_size = key.batch_size if key.batch_size > 0 else int(max(1, min(cap, key.memory // per_query)))
    batch_size = max(1, min(batch_size, q))
    store = sum(t.rows * byte_sizes.channels(t.source) * element_size for t in layout.tables.values())
    weights = sum(p.numel() * p.element_size() for p in graph.module.parameters())
    naive = forward_peak_bytes(program, batch_size, element_size)
    # what naive re-inference really peaks at: it runs the model on plain (channels-first) batches, whose operators'
    # working memory (oneDNN's blocked copies of maps and weights) comes on top of the activations (on a 3-D UNet
    # more than doubling them); the run keeps freed memory within it rather than fault it in again
    naive_peak = forward_peak_bytes(program, batch_size, element_size, channels_last=False)
    # what the batches may hold: the caller's budget, or what naive re-inference at this batch size holds beyond
    # the model less what this run holds beyond it (the store's tables, the weights the executor made)
    allowance = key.memory if key.batch_size <= 0 else naive - store - program.ops.made_bytes
    grow_to = int(min(cap, allowance // per_query)) if per_axis is not None and allowance > 0 else 0

    def batches(bounds: list[tuple[int, int]]) -> list[_Packed]:
        made = []
        for lo, hi in bounds:
            queries = order[lo:hi]
            start, (steps, boundary, unchanged, macs, peak) = geometry(queries)
            estimate = index_estimate(program, steps, len(queries), boundary, device)
            made.append(_Packed(queries, start, steps, boundary, unchanged, macs, peak, estimate))
        return made

    def totals(made: list[_Packed]) -> tuple[int, int, int, int]:
        """A packing's shared tail group, peak (the boundary tensors waiting for the shared tail included), budget
        and the bytes of weights it reads."""
        peak = max(m.peak for m in made)
        # naive re-inference's activations at this batch size (or the caller's budget) bound what batches and a
        # shared tail hold; its real peak, what freed memory the run keeps
        limit = max(key.memory if key.batch_size <= 0 else naive, peak)
        budget = max(key.memory if key.batch_size <= 0 else naive_peak, peak)
        largest = _largest(made)
        tail_queries = min(tail_group(program, largest, element_size, peak, limit), q) if q > largest else 0
        if tail_queries:
            peak += sum(byte_sizes.whole(name, 1) for name in program.boundary) * tail_queries
        changed = sum(len(m.queries) for m in made if not m.unchanged)
        tail_runs = -(-changed // tail_queries) if tail_queries else sum(not m.unchanged for m in made)
        weight_bytes = sum(program.steps[sp.index].weight_bytes for m in made for sp in m.steps) \
            + tail_runs * tail_weights
        return tail_queries, peak, budget, weight_bytes

    tail_weights = sum(p.numel() * p.element_size() for p in program.tail().parameters())
    if per_axis is None:
        made = batches([(lo, min(lo + batch_size, q)) for lo in range(0, q, batch_size)])
    else:
        # the order whose packing wastes the fewest multiply-adds and weight reads (the trial above keeps the
        # order by reach: its last queries have the largest boxes)
        order = cheapest_order(program, exact, candidate_orders(program, exact, sizes), batch_size, grow_to)
        made = batches(pack(program, exact, order, batch_size))
        if grow_to > _largest(made):
            grown = batches(pack(program, exact, order, batch_size, grow_to))
            while _largest(grown) > batch_size and (holds := _holds(grown, weights, store)) > allowance:
                # the estimate per query fell short (index tensors, boxes of mixed reach): shrink in proportion
                grow_to = min(grow_to - 1, int(grow_to * allowance / holds))
                grown = batches(pack(program, exact, order, batch_size, grow_to))
            # larger batches and a shared tail both save weight reads from the same memory: the packing whose
            # multiply-adds and weight reads cost less (packing's measure) wins
            if _cost(grown, totals(grown)[3]) < _cost(made, totals(made)[3]):
                made = grown
    keep = _keeps_index(made, weights, store)
    tail_queries, peak, budget, weight_bytes = totals(made)
    planned = []
    for queries, start, steps, boundary, unchanged, macs, batch_peak, estimate in made:
        frozen = np.array(queries)
        frozen.flags.writeable = False
        batch = BatchPlan(frozen, start, tuple(steps), tuple(boundary), unchanged, macs, batch_peak, estimate, None,
                          budget)
        if keep:
            index = batch_index(program, layout, batch, device)
            batch = BatchPlan(frozen, start, tuple(steps), tuple(boundary), unchanged, macs, batch_peak,
                              index.nbytes, index, budget)
        planned.append(batch)
    return Plan(key, tuple(planned), batch_size, float(program.full_flops), query_macs,
                float(sum(b.macs for b in planned)), peak, sum(b.index_bytes for b in planned), keep, tail_queries,
                budget, weight_bytes)
