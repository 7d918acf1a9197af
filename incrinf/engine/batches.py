"""The engine for many changed copies of one input (occlusion queries): the input's kept tensors materialized once,
then batches of N update boxes carried through them.

Three costs, each paid once where it can be:

- the *executor* (:class:`~incrinf.engine.program.Program`: steps, folded batch norms, generated modules, the
  store's table layout) once per captured graph, device and dtype, shared by every input and thread (rebuilt
  when the model's weights change in place);
- the *plan* (:mod:`~incrinf.engine.plans`) once per key, kept in the :class:`~incrinf.cache.RuntimeCache` and
  shared by every input of that shape and every model of that architecture;
- the *base* (one forward pass of the unchanged input, keeping only the tensors some step reads) once per input.

:meth:`BatchEngine.run_batch` runs one planned batch; :meth:`BatchEngine.run` walks boxes without a plan (value-
based pruning, whose boxes follow the data).
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from incrinf.cache import LookupStatus, runtime_cache
from incrinf.engine.boxes import WalkResult, chain, compute, shares_memory, walk
from incrinf.engine.layout import Layout, compact, table_layout
from incrinf.engine.memory import FreedBytes, HostMemory, RunBytes, release_free_memory
from incrinf.engine.plan_bytes import ByteSizes, forward_peak_bytes
from incrinf.engine.plans import (
    BatchIndex,
    BatchPlan,
    Plan,
    PlanKey,
    StepIndex,
    StepPlan,
    batch_index,
    boxes_digest,
    build_plan,
    projections,
    step_indices,
    step_working_bytes,
)
from incrinf.engine.program import Program, Step
from incrinf.engine.replays import Replays, graphs_enabled
from incrinf.engine.stores import BaseStore
from incrinf.geometry import Boxes
from incrinf.graph import Graph, NodeKind, Operator, possibly_mutated
from incrinf.graph.execute import concat_parts, constant_values, materialize, run_releasing
from incrinf.kernels import dispatch


def positions_digest(positions: np.ndarray) -> str:
    """Hash of a positions array, so plan keys hold no arrays."""
    return hashlib.sha1(np.ascontiguousarray(positions, dtype=np.int64).tobytes()).hexdigest()


@dataclass(frozen=True)
class Executor:
    """What one captured graph needs to run batches on a device, built once and shared.

    Attributes:
        program: the graph as steps (weights bound, batch norms folded).
        layout: the store's tables.
        mutated: tensors a later in-place operation overwrites (recorded as copies).
        fingerprint: the weights it was built from (data pointers and version counters).
        seconds: how long building it took.
        replays: its planned batches recorded as CUDA graphs (:mod:`~incrinf.engine.replays`).
    """

    program: Program
    layout: Layout
    mutated: frozenset[str]
    fingerprint: tuple
    seconds: float
    replays: Replays = field(default_factory=Replays, repr=False, compare=False)

    @property
    def layout_digest(self) -> str:
        """Hash of the layout (every table and place), for plan keys."""
        text = repr(sorted(self.layout.tables.items())) + repr(sorted(self.layout.windows.items())) \
            + repr(sorted(self.layout.reads.items()))
        return hashlib.sha1(text.encode()).hexdigest()[:16]


_EXECUTORS_LOCK = threading.Lock()


def _fingerprint(module: torch.nn.Module) -> tuple:
    tensors = [*module.parameters(), *module.buffers()]
    return tuple((t.data_ptr(), t._version) for t in tensors)


def _candidates(program: Program) -> set[str]:
    """Tensors a store may keep (every cached tensor and concatenations whose parts are all cached): those whose
    in-place overwrites matter."""
    graph = program.graph
    kept = set(program.cached) | {graph.input.name, graph.output.name}
    for node in graph.nodes:
        if node.kind == NodeKind.MERGE and node.operator == Operator.CAT:
            parts = concat_parts(node)
            if parts is not None and set(parts) <= kept:
                kept.add(node.name)
    return kept


def executor_for(graph: Graph, x: torch.Tensor, fold_batch_norm: bool = True) -> tuple[Executor, dict[str, Any]]:
    """The graph's shared executor for ``x``'s device and dtype (built on first use), and the base values of ``x``
    that its store keeps.

    Tensors an in-place operation may overwrite later (:func:`incrinf.graph.possibly_mutated`) are recorded as
    copies made when they are made, and never share a concatenation's table.
    """
    key = ("executor", str(x.device), str(x.dtype), bool(fold_batch_norm))
    fingerprint = _fingerprint(graph.module)
    with _EXECUTORS_LOCK:
        found = graph.attachments.get(key)
        if found is None or found.fingerprint != fingerprint:
            start = time.perf_counter()
            program = Program(graph, {**constant_values(graph), graph.input.name: x}, fold_batch_norm=fold_batch_norm)
            mutated = possibly_mutated(graph, _candidates(program))
            program.mutated = set(mutated)
            alias = not dispatch.wants_fused_index(x.device)  # the Triton kernels read contiguous tables
            found = Executor(program, table_layout(program, mutated, alias), frozenset(mutated), fingerprint,
                             time.perf_counter() - start)
            graph.attachments[key] = found
    return found, _base(found, x)


def _base(executor: Executor, x: torch.Tensor) -> dict[str, Any]:
    graph = executor.program.graph
    # freed memory handed back every TRIM_BYTES freed: the pass frees every value the store does not keep
    env, _ = materialize(graph, x, keep=executor.layout.kept | {graph.input.name, graph.output.name},
                         clone=executor.mutated, released=FreedBytes(HostMemory()).add,
                         scratch=lambda name: executor.program.ops.working_bytes(
                             graph.by_name[name], x.shape[0], x.element_size(), _channels_last(x))
                         if name in graph.by_name else 0)
    return env


class BatchEngine:
    """One input's kept tensors, materialized once, and batched incremental runs of changed copies of it.

    Args:
        graph: captured graph.
        base_input: (1, C, *spatial) the unchanged input.
        fold_batch_norm: fold batch norms into the convolutions before them (a few ulps off the model's own
            arithmetic, a pass over every box saved).

    Attributes:
        seconds: time spent building the executor (0 when it was shared) and materializing the base.
        host: when batches hand freed host memory back to the system (within a plan's budget they keep it).
    """

    def __init__(self, graph: Graph, base_input: torch.Tensor, fold_batch_norm: bool = True) -> None:
        self.graph = graph
        self.host = HostMemory()  # the resident growth a plan's budget bounds counts from here
        self._work: dict[tuple, int] = {}
        start = time.perf_counter()
        self.executor, base = executor_for(graph, base_input, fold_batch_norm)
        self.program = self.executor.program
        self.store = BaseStore(self.program, self.executor.layout, base)
        del base
        release_free_memory()  # once: the base's forward pass freed every tensor the store does not keep
        took = time.perf_counter() - start
        built = self.executor.seconds if took >= self.executor.seconds else 0.0
        self.seconds = {"executor": built, "base": took - built}
        self._base_input = base_input

    @property
    def base(self) -> dict[str, Any]:
        """Every node's value for the unchanged input (a forward pass on demand: the store keeps only what the
        steps read)."""
        env, _ = materialize(self.graph, self._base_input)
        return env

    @property
    def base_output(self) -> Any:
        """The model's output for the unchanged input."""
        return self.store.output

    def plan(self, starts: np.ndarray, sizes: np.ndarray, tau: float = 1.0, batch_size: int | None = None,
             memory: int | None = None) -> tuple[Plan, LookupStatus]:
        """The plan of a run over queries whose changed input boxes are ``starts`` / ``sizes`` ((Q, d), inside the
        input), from the runtime cache (built on a miss).

        Args:
            starts, sizes: the queries' changed input boxes.
            tau: projective field threshold (1: exact).
            batch_size: queries per batch; None: as many as ``memory`` bytes allow.
            memory: bytes a batch may use (with ``batch_size`` None).

        Returns:
            ``(plan, hit or miss)``.
        """
        if batch_size is None and memory is None:
            raise ValueError("give a batch size or a memory budget")
        x = self.store.input
        starts = np.asarray(starts, np.int64)
        sizes = np.asarray(sizes, np.int64)
        key = PlanKey(self.graph.signature, tuple(self.graph.input_shape), self.executor.layout_digest,
                      boxes_digest(starts, sizes), len(starts), float(tau), int(batch_size or 0),
                      0 if batch_size else int(memory or 0),  # a given batch size leaves the budget unread
                      str(x.device), str(x.dtype), compact(x.device, self.graph.spatial_dims))
        return runtime_cache().get_or_create(
            key, lambda k: build_plan(self.program, self.executor.layout, k, starts, sizes))

    def run_bytes(self, plan: Plan) -> RunBytes:
        """The host memory a run of ``plan`` holds (its byte model: weights made, base forward and store, index
        tensors, batches, budget); its ``peak`` predicts the resident growth of a run that builds this engine."""
        program, layout = self.program, self.executor.layout
        graph = program.graph
        element_size = self.store.input.element_size()
        sizes = ByteSizes(program, element_size)
        kept = layout.kept | {graph.input.name, graph.output.name}
        # the base forward pass keeps what the store needs; the store then makes its tables one by one, each kept
        # tensor freed after its last table (as BaseStore does)
        base = forward_peak_bytes(program, 1, element_size, keep=kept, channels_last=_channels_last(self.store.input))
        values = {name: sizes.whole(name, 1) for name in kept if graph.by_name[name].shape}
        remaining: dict[str, int] = {}
        for table in layout.tables.values():
            remaining[table.source] = remaining.get(table.source, 0) + 1
        made = 0
        for table in layout.tables.values():
            made += table.rows * sizes.channels(table.source) * element_size
            base = max(base, sum(values.values()) + made)
            remaining[table.source] -= 1
            if not remaining[table.source] and table.source not in (graph.input.name, graph.output.name):
                values.pop(table.source, None)
        batch = max(plan.peak_bytes, max((b.peak_bytes + (0 if plan.keeps_index else b.index_bytes)
                                          for b in plan.batches), default=0))
        return RunBytes(program.ops.made_bytes, self.store.nbytes, base, plan.index_bytes if plan.keeps_index else 0,
                        batch, plan.budget_bytes)

    def index(self, batch: BatchPlan) -> BatchIndex:
        """A planned batch's index tensors: the plan's, or made now from its geometry (not kept)."""
        return batch.index or batch_index(self.program, self.executor.layout, batch, self.store.device)

    @torch.no_grad()
    def run_batch(self, batch: BatchPlan, values: torch.Tensor) -> WalkResult:
        """The outputs of one planned batch (on CUDA, replayed from a recorded graph where one is kept:
        :mod:`~incrinf.engine.replays`).

        Args:
            batch: a batch of a plan of this engine's graph.
            values: (n, C, *batch.start.size) the changed input boxes' new values.

        Returns:
            The walk's result (output with the batch axis n; flops per query; ``peak_bytes`` from the plan).
        """
        if batch.index is not None and not batch.unchanged and graphs_enabled(self.store.device):
            return self.executor.replays.run(batch, values, self.store, self._run_batch)
        return self._run_batch(batch, values)

    def _run_batch(self, batch: BatchPlan, values: torch.Tensor) -> WalkResult:
        result = self.run_to_tail(batch, values)
        if not result.unchanged:
            result.output = self.tail(result.output, batch.budget_bytes, batch.peak_bytes)
        return result

    @torch.no_grad()
    def tail(self, boundary: list[torch.Tensor], budget: int = 0, coming: int = 0) -> Any:
        """The model's output from the boundary tensors of one or more batches (joined along the batch axis, in
        the program's boundary order): one run of the rest of the model.

        Freed host memory is handed back to the system afterwards when the run's resident growth plus ``coming``
        bytes (the next batch's) would pass ``budget`` (0: always), see :class:`~incrinf.engine.memory.HostMemory`.
        """
        # node by node, freed values counted: a tail at full resolution (a 3-D decoder) frees far more than the
        # allocator may keep between two checks
        graph, like = self.program.graph, boundary[0] if boundary else self.store.input
        output = run_releasing(self.program.tail(), boundary, FreedBytes(self.host, budget, coming).add,
                               lambda name: self.program.ops.working_bytes(graph.by_name[name], like.shape[0],
                                                                           like.element_size(), True)
                               if name in graph.by_name else 0)
        del boundary
        self.host.settle(budget, coming)
        return output

    @torch.no_grad()
    def run_to_tail(self, batch: BatchPlan, values: torch.Tensor) -> WalkResult:
        """One planned batch up to the model's tail: its ``output`` is the list of boundary tensors (n, ...) the
        tail reads (:meth:`tail` finishes them, alone or joined with other batches'), or the unchanged output
        when ``unchanged``.

        Args:
            batch: a batch of a plan of this engine's graph.
            values: (n, C, *batch.start.size) the changed input boxes' new values.
        """
        program, store = self.program, self.store
        device = store.device
        indices = batch.index.steps if batch.index is not None else \
            step_indices(program, self.executor.layout, batch, device)
        regions: dict[str, Boxes] = {self.graph.input.name: Boxes(batch.start.lo, batch.start.size, values)}
        freed = _Freed(self.host, batch)
        positions = 0
        done = 0
        for sp, si in zip(batch.steps, indices):
            for skipped in range(done, sp.index):  # steps without a change still end their inputs' lives
                freed.drop(regions, program.release[skipped])
            out = Boxes(sp.box.lo, sp.box.size)
            out.values = self._step(program.steps[sp.index], sp, si, out, regions, freed)
            # its operator's working memory was freed too (a 3-D convolution's reordered weights: tens of MiB)
            freed.add(self._working_bytes(sp, batch.n, values.element_size()))
            positions += out.area
            regions[program.steps[sp.index].out] = out
            freed.drop(regions, program.release[sp.index])
            done = sp.index + 1
        flops = batch.macs / batch.n
        if batch.unchanged:
            return WalkResult(store.unchanged(batch.n), flops, positions, unchanged=True, peak_bytes=batch.peak_bytes)
        projected = batch.index.projections if batch.index is not None else projections(program, batch, device)
        tensors = [store.full(name, None, batch.n) if region is None else
                   store.project(name, regions[name], batch.n, projection)
                   for name, region, projection in zip(program.boundary, batch.boundary, projected)]
        regions.clear()
        return WalkResult(tensors, flops, positions, peak_bytes=batch.peak_bytes)

    def _working_bytes(self, sp: StepPlan, n: int, element_size: int) -> int:
        """A planned step's operator's working memory (:func:`~incrinf.engine.plans.step_working_bytes`), kept per
        step, batch size and box extent (every batch of a plan asks again)."""
        key = (sp.index, n, tuple(sp.box.size), element_size)
        found = self._work.get(key)
        if found is None:
            found = self._work[key] = step_working_bytes(self.program, self.program.steps[sp.index], n, sp.box,
                                                         element_size)
        return found

    def _step(self, step: Step, sp: StepPlan, si: StepIndex, out: Boxes, regions: dict[str, Boxes],
              freed: _Freed) -> torch.Tensor:
        """One planned step's values: windows gathered (or the source padded, for a whole map), a concatenation
        assembled in its own base values, or inputs gathered where their boxes are not the step's."""
        program, store, layout = self.program, self.store, self.executor.layout
        n = out.n
        if step.window is not None:
            source = regions.get(step.window.source)
            if sp.dense and step.whole_op is not None:  # the operator pads the whole map itself
                return chain(step, step.whole_op(source.values))
            windows = store.padded(step.window, source.values) if sp.dense else store.gather(
                layout.windows[step.out], si.window, source, n, step.window.read_size(out.size),
                _channels(program, step.window.source))
            values = compute(program, step, out, windows=windows)
            nbytes = _nbytes(windows)
            del windows
            freed.add(nbytes)
            return values
        if sp.assemble:
            head = step.head.name
            gathered = store.gather(layout.reads[head], si.inputs[0], None, n, out.size, _channels(program, head))
            columns = _columns(program, step)
            parts = [(regions.get(name), columns[name], overlay)
                     for name, overlay in zip(concat_parts(step.head), si.parts)]
            return chain(step, store.assemble(gathered, parts))
        inputs = {}
        for name, same, gather in zip(step.inputs, sp.same, si.inputs):
            region = regions.get(name)
            inputs[name] = region.values if same else store.gather(
                layout.reads[name], gather, region, n, out.size, _channels(program, name))
        values = compute(program, step, out, inputs=inputs, fresh=self._fresh(step, sp, regions))
        nbytes = sum(_nbytes(inputs[name]) for name, same in zip(step.inputs, sp.same) if not same)
        del inputs
        freed.add(nbytes)
        return values

    def _fresh(self, step, sp, regions: dict[str, Boxes]) -> bool:
        """Whether a step may overwrite its first input's values: gathered for it, or an input's values whose last
        reader it is, sharing memory with no other live values (and not the caller's input boxes)."""
        first = step.inputs[0]
        if not sp.same[0]:
            return True
        if first == self.graph.input.name or first not in self.program.release[sp.index] \
                or step.inputs.count(first) != 1:
            return False
        values = regions[first].values
        return not any(shares_memory(r.values, values) for name, r in regions.items() if name != first)

    @torch.no_grad()
    def run(self, start: Boxes, tau: float = 1.0, feature_threshold: float = 0.0) -> WalkResult:
        """Outputs of N changed copies of the input, walking boxes without a plan (the boxes of value-based pruning
        follow the data).

        Args:
            start: the N changed boxes of the input (one size) and their new values (N, C, *size).
            tau: projective field threshold (1: exact).
            feature_threshold: value-based pruning at cached tensors (0: exact).

        Returns:
            The walk's result; its ``output`` has the batch axis N.
        """
        return walk(self.program, self.store, start, tau=tau, feature_threshold=feature_threshold)


class _Freed(FreedBytes):
    """Bytes of region values and gathers freed since the resident memory was last checked (see
    :class:`~incrinf.engine.memory.FreedBytes`; glibc keeps freed blocks below its mmap threshold, 32 MiB at most,
    resident)."""

    def __init__(self, host: HostMemory, batch: BatchPlan) -> None:
        super().__init__(host, batch.budget_bytes, batch.peak_bytes)

    def drop(self, regions: dict[str, Boxes], names: list[str]) -> None:
        """Remove the regions of ``names`` (their last reader ran), counting their values."""
        for name in names:
            region = regions.pop(name, None)
            if region is not None:
                nbytes = _nbytes(region.values)
                del region
                self.add(nbytes)


def _channels_last(x: torch.Tensor) -> bool:
    """Whether a map is laid out channels-last (its operators' working memory depends on it)."""
    return x.dim() > 3 and not x.is_contiguous() and x.is_contiguous(
        memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


def _nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _channels(program: Program, name: str) -> tuple[int, ...]:
    return tuple(program.graph.by_name[name].shape[1:-program.graph.spatial_dims])


def _columns(program: Program, step) -> dict[str, tuple[int, int]]:
    """Columns of each part of a concatenation step's output."""
    out, first = {}, 0
    for name in concat_parts(step.head):
        count = int(np.prod(_channels(program, name)))
        out[name] = (first, count)
        first += count
    return out
