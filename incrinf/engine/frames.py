"""The engine for a sequence of inputs that change locally (camera frames): full inference that fills a frame
cache, then incremental inference of the next inputs from it.

A frame's change arrives as a pixel mask (and, from a stream, the boxes of its clusters) plus, when the camera
moved, per-resolution index maps (:class:`~incrinf.engine.blocks.Motion`, computed by the stream from the
homography). Without motion the change is a few boxes per tensor (:mod:`~incrinf.engine.frame_regions`), every
step run densely on crops of its merged input, box sides rounded to multiples of 2 so oneDNN reuses its
per-shape kernels. With motion the change is a set of positions: the block walk
(:func:`~incrinf.engine.blocks.walk_blocks`). Either is planned before it runs (:meth:`FrameEngine.plan_boxes`,
:meth:`FrameEngine.plan_blocks`): the plan says what each step computes and, with the cost coefficients
(:class:`~incrinf.engine.costs.FrameCosts`, measured by :meth:`FrameEngine.profile`), what the frame will cost.
The engine knows nothing about cameras or homographies.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from incrinf.cache import LookupStatus, RuntimeCache
from incrinf.engine.blocks import BlockPlan, Motion, Positions, plan_blocks, walk_blocks
from incrinf.engine.costs import FrameCosts, RegionKind
from incrinf.engine.frame_regions import (
    Geometry,
    RegionPlan,
    cluster_boxes,
    plan_regions,
    plan_seconds,
    run_box,
    walk_regions,
)
from incrinf.engine.fusion import fuse_generated
from incrinf.engine.program import Program
from incrinf.engine.stores import FrameCache, clone_output, take
from incrinf.geometry import Box, Boxes
from incrinf.graph import Graph, NodeKind
from incrinf.graph.execute import copy_graph, extract, materialize

# Without a plan to follow (the block walk after pruning), when this share of a cut point's map changed, the rest
# of the local part would be recomputed nearly everywhere: run it as one generated module instead.
DENSE_CUT = 0.5
# Side in pixels of the grid on which a change mask's clusters are found when no boxes are given.
CLUSTER_GRID = 8
# Repetitions of the profile's measurements (the fastest counts: a load spike does not stick).
PROFILE_REPEATS = 2
# Box sides are rounded up to multiples of this many positions (chosen by leave-one-out over still-camera clips:
# benchmarks/stream_buckets.py; steps 1, 2 and 4 were within a few percent of each other, 8 and 16 slower).
BOX_QUANTUM = 2
# Box plans kept for reuse (a still camera's clusters recur while a subject stands or moves within its cells).
PLAN_CACHE = 128


class _PlanKey(NamedTuple):
    """What a box plan is made of: the input's boxes, the bucket step, the cost model's state
    (:meth:`~incrinf.engine.costs.FrameCosts.plan_state`)."""

    boxes: tuple[Box, ...]
    quantum: int
    costs: tuple


@dataclass(frozen=True)
class CacheMemory:
    """Bytes of cached tensors.

    Attributes:
        kept_bytes: what the engine keeps: tensors read outside their own step.
        naive_bytes: caching every tensor of the local part (what a cache per layer would hold).
        kept_tensors: number of cached tensors.
        naive_tensors: number of tensors in the local part.
    """

    kept_bytes: int
    naive_bytes: int
    kept_tensors: int
    naive_tensors: int


@dataclass
class ExecStats:
    """What one frame computed.

    Attributes:
        flops: multiply-accumulates actually computed.
        full_flops: multiply-accumulates of one full inference.
        positions: recomputed positions summed over the steps.
        dense_steps: steps that ran on the whole map (block walk), or a generated suffix (both walks).
        moved: cached tensors moved through an index map.
        refreshed: ``(y0, y1, x0, x1)`` boxes of input pixels whose current values the cache now stands for (box
            walk), else None (the changed pixels only).
        fresh: resolution -> (h, w) bool positions recomputed this frame (set when asked for).
        kind: how the change was carried (None: full inference).
        regions: the input's boxes (box walk; 0 otherwise).
        predicted: what the cost coefficients give for the work the frame did (seconds).
        step_samples: per step that computed anything, ``(fixed, arithmetic, measured)`` seconds, when timed (the
            calibration's samples: :meth:`~incrinf.engine.costs.FrameCosts.record_steps`).
        timed_seconds: when timed, the seconds of what the coefficients price (the steps and the dense rest; the
            block walk's dense suffix as predicted): a caller's measured frame time beyond it is the
            frame's fixed cost (:meth:`~incrinf.engine.costs.FrameCosts.record_frame`); NaN when not timed.
    """

    flops: float
    full_flops: float
    positions: int = 0
    dense_steps: int = 0
    moved: int = 0
    refreshed: list[Box] | None = None
    fresh: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    kind: RegionKind | None = None
    regions: int = 0
    predicted: float = 0.0
    step_samples: list[tuple[float, float, float]] = field(default_factory=list)
    timed_seconds: float = math.nan

    @property
    def flops_ratio(self) -> float:
        """Full FLOPs / computed FLOPs (``inf`` when the frame computed nothing: its output was reused)."""
        return self.full_flops / self.flops if self.flops >= 1.0 else math.inf


class FrameEngine:
    """Full inference that fills a frame cache, and incremental inference of the next frames.

    Works on a private copy of the model (weights channels-last, batch norms folded), so the caller's model is
    untouched.

    Args:
        graph: captured graph for the frame size.
        device: device of the model and the frames.

    Attributes:
        dense_cut: share of a cut point's map above which an unplanned block walk finishes with generated code.
        boxes: take the box walk when the camera did not move (False: the block walk always; for comparisons).
        box_quantum: box sides are rounded up to multiples of this (1: exact boxes).
        resolutions: the spatial extents of the input and of every cached tensor.
        cached_resolutions: those of the cached tensors (the frame itself is never moved).
        costs: the cost coefficients of this program on this device (measured by :meth:`profile`).
        last: :class:`ExecStats` of the latest frame.

    Raises:
        ValueError: the model has no sliding window before its first global operator (nothing to reuse).
    """

    def __init__(self, graph: Graph, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        graph = copy_graph(graph, self.device)
        example = torch.randn(graph.input_shape, device=self.device).contiguous(memory_format=torch.channels_last)
        env, mutated = materialize(graph, example, track_mutation=True)
        self.program = Program(graph, env, mutated)
        if not self.program.has_local_part:
            first = next((n for n in graph.nodes if n.kind == NodeKind.GLOBAL), None)
            why = f" (its first global operator, {first.name}: {first.reason})" if first else ""
            raise ValueError(f"the model has no spatial (local) layer before its first global operator{why}; "
                             "there is nothing to reuse across frames")
        self.graph = graph
        self.cache = FrameCache(self.program, self.device)
        fuse_generated(self.program)  # the generated modules without batch norms and pads of their own
        self.program.prepare(with_cached=True)  # generating a module costs about a frame's inference
        self.costs = FrameCosts(self.program)
        self.dense_cut = DENSE_CUT
        self.boxes = True
        self.box_quantum = BOX_QUANTUM
        self.geometry = Geometry(self.program, self.costs, self.box_quantum)
        self.cached_resolutions = {tuple(graph.by_name[m].shape[-2:]) for m in self.program.cached}
        self.resolutions = sorted(self.cached_resolutions | {tuple(graph.input_shape[-2:])})
        first = next((s for s in self.program.steps if s.window is not None), None)
        self.first_resolution = first.dims if first is not None else None
        self.last = ExecStats(0.0, self.program.full_flops)
        self.plans = RuntimeCache(PLAN_CACHE)
        self.last_plan_status: LookupStatus | None = None
        self._plain: torch.nn.Module | None = None

    @property
    def has_cache(self) -> bool:
        return bool(self.cache.buffers)

    @property
    def dims(self) -> tuple[int, int]:
        """The frame's (H, W)."""
        return tuple(self.graph.input_shape[-2:])

    def reset(self) -> None:
        """Drop the cache (the next frame must go through :meth:`full`)."""
        self.cache.buffers = {}

    def cache_memory(self) -> CacheMemory:
        """Bytes kept by the cache versus caching every tensor of the local part."""
        graph = self.graph
        tensors = [n.name for n in self.program.local
                   if n.kind not in (NodeKind.INPUT, NodeKind.PAD, NodeKind.META) and graph.is_map(n.shape)]
        kept = self.program.cached
        return CacheMemory(sum(graph.nbytes(m) for m in kept), sum(graph.nbytes(t) for t in tensors), len(kept),
                           len(tensors))

    @torch.no_grad()
    def full(self, x: torch.Tensor, scales: bool = True) -> Any:
        """Full inference of ``x`` (1, C, H, W) that also refills the cache (``scales`` is kept for callers: the
        cached tensors' mean magnitudes, the pruning threshold's unit, are now estimated on first use)."""
        self.reset()
        x = x.to(self.device).contiguous(memory_format=torch.channels_last)
        out, tensors = self.program.full(x)
        self.cache.frame = x
        self.cache.fill(dict(zip(self.program.cached, tensors)), scales)
        self.last = ExecStats(self.program.full_flops, self.program.full_flops,
                              dense_steps=sum(s.window is not None for s in self.program.steps))
        self.cache.last_output = clone_output(out)  # callers own what they get; a dead change returns a copy
        return out

    @torch.no_grad()
    def plain(self, x: torch.Tensor) -> Any:
        """Full inference of ``x`` without keeping anything: the cache is dropped (a frame whose successor will
        not use it need not fill it)."""
        self.reset()
        out = self.prepare_plain()(x.to(self.device).contiguous(memory_format=torch.channels_last))
        self.last = ExecStats(self.program.full_flops, self.program.full_flops)
        return out

    def prepare_plain(self) -> torch.nn.Module:
        """The generated module :meth:`plain` runs, generated now if it was not (that costs about a frame's
        inference: a caller that knows plain frames will come pays it up front, not on the first of them)."""
        if self._plain is None:
            self._plain = extract(self.graph, [self.graph.input.name], [self.graph.output.name])
        return self._plain

    # --- planning ----------------------------------------------------------------------------------------

    def plan_boxes(self, boxes: list[Box]) -> RegionPlan:
        """The plan of a frame whose input changed in ``boxes`` (``(y0, y1, x0, x1)`` pixel boxes, e.g. one per
        cluster of changed cells): boxes merged where that is cheaper, then carried through the steps.

        Plans are kept (an LRU of :data:`PLAN_CACHE`) per box set, bucket step and cost-model state, and a kept
        one is priced with the current calibration; ``last_plan_status`` says whether this one was reused."""
        if self.geometry.quantum != self.box_quantum:
            self.geometry = Geometry(self.program, self.costs, self.box_quantum)
        key = _PlanKey(tuple((int(b[0]), int(b[1]), int(b[2]), int(b[3])) for b in boxes), self.box_quantum,
                       self.costs.plan_state())
        plan, self.last_plan_status = self.plans.get_or_create(key, self._build_plan)
        if self.last_plan_status == LookupStatus.MISS:
            return plan
        return dataclasses.replace(plan, seconds=plan_seconds(self.program, self.costs, plan.parts))

    def _build_plan(self, key: _PlanKey) -> RegionPlan:
        return plan_regions(self.geometry, list(key.boxes))

    def plan_blocks(self, changed: np.ndarray, motion: Motion | None = None) -> BlockPlan:
        """The plan of a block walk for the changed pixels (H, W) and the motion."""
        motion = motion or Motion()
        moved = sum(self.graph.nbytes(name) for name in self.program.cached
                    if tuple(self.graph.by_name[name].shape[-2:]) in motion.index)
        return plan_blocks(self.program, self.costs, changed, motion, moved)

    def clusters(self, changed: np.ndarray, grid: int = CLUSTER_GRID) -> list[Box]:
        """Pixel boxes of the clusters of changed pixels (found on a grid of ``grid``-pixel cells), each the
        bounding box of its changed pixels."""
        h, w = changed.shape
        gh, gw = -(-h // grid), -(-w // grid)
        padded = np.zeros((gh * grid, gw * grid), bool)
        padded[:h, :w] = changed
        boxes = []
        for y0, y1, x0, x1 in cluster_boxes(padded.reshape(gh, grid, gw, grid).any(axis=(1, 3)), grid, (h, w)):
            rows = np.flatnonzero(changed[y0:y1, x0:x1].any(axis=1))
            cols = np.flatnonzero(changed[y0:y1, x0:x1].any(axis=0))
            boxes.append((y0 + int(rows[0]), y0 + int(rows[-1]) + 1, x0 + int(cols[0]), x0 + int(cols[-1]) + 1))
        return boxes

    def best_case(self) -> RegionPlan:
        """The plan of the smallest change there is (one quantum of pixels at the frame's centre): the most a
        cached frame can save (when even this costs about a full frame, the cache cannot pay on this model)."""
        h, w = self.dims
        q = self.box_quantum
        y, x = max(h // 2 - q // 2, 0), max(w // 2 - q // 2, 0)
        return self.plan_boxes([(y, min(y + q, h), x, min(x + q, w))])

    def floor(self) -> tuple[float, float]:
        """``(multiply-adds, predicted seconds)`` of the cheapest cached frame whose change still reaches the
        output: one position recomputed per step (what value-based pruning can cut a change down to, never below),
        and the tail (the model after the local part, a global-pooling head, a squeeze-excitation block's rest) on
        whole maps. A model whose tail is most of a frame cannot pay for a cache, however its changes are pruned."""
        steps = self.program.steps
        flops = self.program.tail_flops + sum(step.flops / step.positions for step in steps)
        costs = self.costs
        seconds = costs.frame_seconds(RegionKind.BOXES) + sum(costs.box(i, 1) for i in range(len(steps))) \
            + costs.tail_seconds()
        return flops, seconds

    # --- cached frames -----------------------------------------------------------------------------------

    @torch.no_grad()
    def cached(self, x: torch.Tensor, changed: np.ndarray, motion: Motion | None = None,
               feature_threshold: float = 0.0, fresh: bool = False, plan: RegionPlan | BlockPlan | None = None,
               timed: bool | None = None) -> Any:
        """Inference of a frame from the cache: recompute what the changed pixels (and the motion) reach.

        Args:
            x: (1, C, H, W) the frame as the model sees it.
            changed: (H, W) bool, pixels to recompute.
            motion: how the camera moved (None: it did not).
            feature_threshold: value-based pruning at cached tensors (0: exact propagation).
            fresh: record in ``last.fresh`` which positions of each resolution were recomputed.
            plan: the frame's plan (:meth:`plan_boxes` without motion, :meth:`plan_blocks`); default: planned
                here (the clusters of ``changed`` as boxes when the camera did not move).
            timed: time the steps (``last.step_samples``); None: on the CPU, where that costs nothing (no device
                synchronisation).

        Returns:
            The model's output for ``x``.

        Raises:
            RuntimeError: no cache (call :meth:`full` first).
            ValueError: a change mask of another size than the frame.
        """
        if not self.has_cache:
            raise RuntimeError("no cache: run full() on a frame first")
        x = x.to(self.device).contiguous(memory_format=torch.channels_last)
        changed = np.asarray(changed, dtype=bool)
        if changed.shape != tuple(x.shape[-2:]):
            raise ValueError(f"change mask has shape {changed.shape}, frame is {tuple(x.shape[-2:])}")
        self.cache.frame = x
        if timed is None:
            timed = self.device.type == "cpu"
        boxes = isinstance(plan, RegionPlan) or (plan is None and motion is None and self.boxes)
        try:
            if boxes:
                out, stats = self._boxes(x, changed, feature_threshold, fresh, plan, timed)
            else:
                out, stats = self._blocks(changed, motion or Motion(), feature_threshold, fresh, plan, timed)
        except BaseException:
            self.reset()  # caches may be half updated in place: the next frame must refill them
            raise
        self.last = stats
        self.cache.last_output = clone_output(out)
        return out

    def _boxes(self, x: torch.Tensor, changed: np.ndarray, feature_threshold: float, fresh: bool,
               plan: RegionPlan | None, timed: bool) -> tuple[Any, ExecStats]:
        if plan is None:
            plan = self.plan_boxes(self.clusters(changed))
        stats = ExecStats(0.0, self.program.full_flops, refreshed=list(plan.start), kind=RegionKind.BOXES,
                          regions=plan.regions)
        if not plan.start:
            return self.cache.unchanged(1), stats
        self.costs.open_survival()
        result = walk_regions(self.geometry, self.cache, x, plan, feature_threshold, timed)
        self.costs.close_survival(result.suffix is not None)  # what pruning left of this plan: one profile
        stats.flops, stats.positions, stats.predicted = result.flops, result.positions, result.seconds
        stats.dense_steps = int(result.suffix is not None)
        stats.step_samples = result.step_samples
        if timed:
            stats.timed_seconds = result.timed_seconds
        if fresh:
            self._mark_fresh(stats, result.committed, result.suffix)
        return result.output, stats

    def _blocks(self, changed: np.ndarray, motion: Motion, feature_threshold: float, fresh: bool,
                plan: BlockPlan | None, timed: bool) -> tuple[Any, ExecStats]:
        result = walk_blocks(self.program, self.cache, changed, motion, feature_threshold, self.dense_cut,
                             self.costs, plan, timed)
        stats = ExecStats(result.flops, self.program.full_flops, result.positions, result.dense_steps, result.moved,
                          kind=RegionKind.BLOCKS, predicted=result.seconds, step_samples=result.step_samples)
        if timed:  # the steps (their moves included) and the tail as timed; a dense suffix after a switch as predicted
            costs = self.costs
            suffix = costs.suffix(result.suffix) - costs.tail_seconds() if result.suffix is not None else 0.0
            stats.timed_seconds = sum(result.step_seconds) + suffix
        if fresh:
            self._mark_fresh(stats, result.changed, result.suffix)
        return result.output, stats

    def _mark_fresh(self, stats: ExecStats, changed: dict[str, list[Box] | Positions], suffix: str | None
                    ) -> None:
        """Per resolution, the positions that every cached tensor of it recomputed this frame (``changed``:
        boxes or positions per tensor; absent: none; after the ``suffix`` cut point: all)."""
        after = set(self.program.cached_after(suffix)) if suffix is not None else set()
        for name in self.program.cached:
            dims = tuple(self.graph.by_name[name].shape[-2:])
            where = changed.get(name)
            if name in after or (isinstance(where, Positions) and where.dense):
                done = np.ones(dims, bool)
            elif isinstance(where, Positions):
                done = where.mask
            else:
                done = np.zeros(dims, bool)
                for y0, y1, x0, x1 in where or ():
                    done[y0:y1, x0:x1] = True
            stats.fresh[dims] = done if dims not in stats.fresh else stats.fresh[dims] & done

    # --- the cost coefficients ---------------------------------------------------------------------------

    @torch.no_grad()
    def profile(self, repeats: int = PROFILE_REPEATS) -> None:
        """Measure the cost coefficients on the cached frame (call after :meth:`full`; costs about ``2 * repeats``
        full frames): every step on its whole map (their shares, scaled to the generated full module's time), on
        one position, and in the block walk on one cell; the fastest of ``repeats`` runs of each counts. The cache
        keeps the full frame's values (up to float rounding where the runs rewrote them)."""
        if not self.has_cache:
            raise RuntimeError("no cache: run full() on a frame first")
        program, cache, steps = self.program, self.cache, self.program.steps
        n = len(steps)
        saved = dict(cache.buffers)
        dense_runs = []
        for _ in range(repeats):
            result = walk_blocks(program, cache, np.ones(self.dims, bool), Motion(), 0.0, math.inf, self.costs,
                                 timed=True)
            dense_runs.append(result.step_seconds)
            cache.buffers = dict(saved)  # the dense runs replaced whole tensors: put the full frame's back
        dense = [min(run[i] for run in dense_runs) for i in range(n)]
        tail = min(run[n] if len(run) > n else 0.0 for run in dense_runs)
        # the step-by-step runs carry the walk's bookkeeping and whole-map padding copies that the generated full
        # module (and the dense suffix after a switch) does not: their shares count, and what the full module
        # spends besides the tail sets their scale. The tail is the same generated module in a cached frame as in
        # the walk, so its time stands as measured: scaling it with the steps would make a model whose tail is
        # most of a frame (a global-pooling head, squeeze-excitation early on) look as if caching the steps before
        # it could pay
        full = math.inf
        for _ in range(repeats):
            clock = time.perf_counter()
            program.full(cache.frame)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            full = min(full, time.perf_counter() - clock)
        tail = min(tail, full)
        scale = max(full - tail, 0.0) / max(sum(dense), 1e-12)
        dense = [d * scale for d in dense]
        box_call = [self._one_position(index, repeats + 1) for index in range(n)]
        h, w = self.dims
        one_cell = np.zeros(self.dims, bool)
        one_cell[h // 2:h // 2 + CLUSTER_GRID, w // 2:w // 2 + CLUSTER_GRID] = True
        block_runs = [walk_blocks(program, cache, one_cell, Motion(), 0.0, math.inf, self.costs, timed=True)
                      for _ in range(repeats)]
        block_call = []
        for i, step in enumerate(steps):
            spent = min(r.step_seconds[i] for r in block_runs)
            positions = block_runs[0].step_positions[i]
            block_call.append(spent - dense[i] * positions / step.positions)
        frame = math.inf
        for _ in range(repeats + 1):
            clock = time.perf_counter()
            clone_output(cache.last_output)
            frame = min(frame, time.perf_counter() - clock)
        self.costs.set_profile(dense, box_call, block_call, tail, self._move_seconds(repeats + 1), frame)
        cluster_boxes(np.ones((1, 1), bool), 1, (1, 1))  # its imports, now rather than in the first cached frame

    def _one_position(self, index: int, repeats: int) -> float:
        """Seconds of step ``index`` on a one-position box at the map's centre (its fixed cost per box), run as the
        walk runs it."""
        step = self.program.steps[index]
        h, w = step.dims
        bounds = (h // 2, h // 2 + 1, w // 2, w // 2 + 1)
        regions = {}
        if step.window is None and len(step.inputs) == 1:
            name = step.inputs[0]
            channels = tuple(self.graph.by_name[name].shape[1:-2])
            values = torch.zeros((1, *channels, 1, 1), device=self.device)
            regions[name] = [Boxes((bounds[0], bounds[2]), (1, 1), values)]
        cached = step.out in self.program.cached_set
        best = math.inf
        for _ in range(repeats):
            clock = time.perf_counter()
            box = run_box(self.program, self.cache, step, regions, bounds, self.geometry.bound[index])
            if cached:  # the commit with its pruning test (the values are the cache's own: nothing is written)
                box.values = take(self.cache.map(step.out), box).clone()
                self.cache.commit(step.out, box, 1e-6)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            best = min(best, time.perf_counter() - clock)
        return best

    def _move_seconds(self, repeats: int) -> float:
        """Seconds per byte of moving a cached tensor through an index map (measured on the largest one)."""
        name = max(self.program.cached, key=self.graph.nbytes)
        buffer = self.cache.buffers[name]
        index = torch.randperm(buffer.shape[0], device=self.device)
        best = math.inf
        for _ in range(repeats):
            clock = time.perf_counter()
            buffer.index_select(0, index)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            best = min(best, time.perf_counter() - clock)
        return best / max(buffer.numel() * buffer.element_size(), 1)
