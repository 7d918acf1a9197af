"""The block walk: a moving camera's change as a set of positions per tensor, carried through a program's steps
(2-D inputs).

Cached tensors were moved through per-resolution index maps first (:meth:`FrameCache.move`); positions without
a usable source, or whose windows read padding where the previous frame had content, are recomputed too. Per
step:

- window steps grow the changed set by their kernel, cut the output grid into ``T x T`` blocks, gather every
  active block's read-in window with one index operation (tables built once per step; a Triton kernel on CUDA)
  and run with padding 0 on the batch of windows; when most blocks are active (40% of the map for depthwise
  convolutions and pools, which cost about one pass over their map, 75% for the others) they run on the whole
  merged map instead;
- merges and pointwise steps work on the union of their inputs' changed positions, reading the positions an
  input did not change from its merged map; 1x1 convolutions run as matrix products over those rows;
- a cached tensor's new values are committed (with value-based pruning), and at a cut point the rest of the
  model may run as one generated module.

:func:`plan_blocks` works out the same masks before anything runs (what each step will compute, densely or in
blocks, and at which cut point the dense rest is cheapest by the cost coefficients of
:class:`~incrinf.engine.costs.FrameCosts`); the walk then follows the plan's masks instead of growing them again,
until a commit prunes positions (a feature threshold), from which on it grows what is left.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from incrinf.engine.costs import FrameCosts, RegionKind
from incrinf.engine.program import Program, Step
from incrinf.engine.stores import FrameCache
from incrinf.engine.windows import WindowSpec, block_table, padded_map
from incrinf.kernels import dispatch
from incrinf.kernels.gather import from_rows, to_rows

# Above this share of a map's positions a window step runs densely on the whole map: block gathers stop paying
# for themselves, and later row steps skip their gathers too.
DENSE_RATIO = 0.75
# The same for depthwise convolutions and pools, whose compute per position is too small to pay for much
# gathering (measured on EfficientNet-Lite0 streams: blocks win below about 40% of the map).
CHEAP_DENSE_RATIO = 0.4


@dataclass
class Motion:
    """How the camera moved, per cached resolution (computed by the stream from the homography).

    Attributes:
        index: resolution -> (h*w,) source row of each position in the previous map (absent: read in place).
        invalid: resolution -> (h, w) bool, positions with no usable source (absent: all usable).
        new_padding: resolution -> sides ("top", "bottom", "left", "right") whose padding held image content in
            the previous frame: outputs whose windows read it there are stale.
    """

    index: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    invalid: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    new_padding: dict[tuple[int, int], tuple[str, ...]] = field(default_factory=dict)


@dataclass
class Positions:
    """Changed positions of one tensor in this frame and their new values.

    ``mask`` (h, w) bool and ``flat`` sorted flat positions; ``values`` is a (1, C, n, 1) row map, or the whole
    (1, C, h, w) map when ``dense``. ``n == 0``: nothing changed (values is None). ``whole``: the operator ran
    over the whole map (its cost), whichever positions changed. ``planned``: the positions are the plan's (no
    pruning changed them, nor any input's).
    """

    mask: np.ndarray
    flat: np.ndarray
    values: torch.Tensor | None
    dense: bool = False
    _index: torch.Tensor | None = None
    whole: bool = False
    planned: bool = True

    @property
    def n(self) -> int:
        return len(self.flat)

    def index(self, device: torch.device) -> torch.Tensor:
        if self._index is None:
            self._index = torch.from_numpy(self.flat).to(device)
        return self._index

    @staticmethod
    def of(mask: np.ndarray) -> Positions:
        return Positions(mask, np.flatnonzero(mask), None)


@dataclass
class BlockResult:
    """What a block walk computed (see :class:`~incrinf.engine.boxes.WalkResult`); ``seconds``: what the
    (calibrated) cost coefficients give for the work done; when timed, ``step_seconds`` the measured seconds per
    step (and the tail), ``step_positions`` the positions each step computed and ``step_samples`` the
    ``(fixed, arithmetic, measured)`` seconds of each step that computed anything."""

    output: Any
    flops: float
    positions: int
    dense_steps: int
    moved: int
    changed: dict[str, Positions]
    suffix: str | None = None
    seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)
    step_positions: list[int] = field(default_factory=list)
    step_samples: list[tuple[float, float, float]] = field(default_factory=list)


@dataclass
class BlockPlan:
    """What a moving camera's frame will compute, before it runs.

    Attributes:
        masks: per step, the output positions it recomputes (None: none).
        dense: per step, whether it runs on the whole map.
        switch: the cut point after which the rest runs densely, or None.
        flops: multiply-adds the frame computes (the dense rest and the tail included).
        seconds: predicted engine seconds from the coefficients (uncalibrated).
        positions: recomputed positions summed over the steps.
    """

    masks: list[np.ndarray | None]
    dense: list[bool]
    switch: str | None
    flops: float
    seconds: float
    positions: int


def block_size(h: int, w: int) -> tuple[int, int]:
    """Output block side: large blocks on large maps (few gathers), single positions on tiny ones."""
    side = min(h, w)
    t = 8 if side >= 32 else 4 if side >= 16 else 2 if side >= 8 else 1
    return t, t


def grow_mask(mask: np.ndarray, spec: WindowSpec, out_dims: tuple[int, int]) -> np.ndarray:
    """Output positions whose window reads any True position of the source ``mask`` (dilated kernels as dense:
    a superset, so recomputing stays exact): a max pool of the mask over the padded source."""
    (ho, wo), (kh, kw), (sy, sx), (oy, ox) = out_dims, spec.extent, spec.stride, spec.offset
    need_h, need_w = (ho - 1) * sy + kh, (wo - 1) * sx + kw
    padded = torch.zeros(need_h, need_w, dtype=torch.uint8)
    hs, ws = mask.shape
    y_lo, y_hi = max(0, -oy), min(hs, need_h - oy)  # source coord s sits at padded coord s + offset
    x_lo, x_hi = max(0, -ox), min(ws, need_w - ox)
    if y_hi > y_lo and x_hi > x_lo:
        padded[y_lo + oy:y_hi + oy, x_lo + ox:x_hi + ox] = torch.from_numpy(mask[y_lo:y_hi, x_lo:x_hi])
    grown = F.max_pool2d(padded[None].float(), (kh, kw), (sy, sx))[0]
    return grown.numpy() > 0


def padding_band(spec: WindowSpec, side: str, out_dims: tuple[int, int], source_dims: tuple[int, int]
                 ) -> np.ndarray | None:
    """(h, w) bool outputs whose windows read padding on ``side`` (None when none do)."""
    axis = 0 if side in ("top", "bottom") else 1
    first = np.arange(out_dims[axis]) * spec.stride[axis] - spec.offset[axis]
    reads = first < 0 if side in ("top", "left") else first + spec.extent[axis] - 1 >= source_dims[axis]
    if not reads.any():
        return None
    band = np.zeros(out_dims, bool)
    if axis == 0:
        band[reads, :] = True
    else:
        band[:, reads] = True
    return band


def plan_blocks(program: Program, costs: FrameCosts, changed: np.ndarray, motion: Motion,
                moved_bytes: float = 0.0) -> BlockPlan:
    """Plan a block walk: the positions each step recomputes (densely or in blocks) for the changed pixels and
    the motion, the cheapest cut point to switch to the dense rest, and the predicted seconds (``moved_bytes``:
    cached bytes the motion moves, priced by :attr:`FrameCosts.move`)."""
    dims = {n.name: tuple(n.shape[-2:]) for n in program.local if n.shape is not None}
    changed = np.asarray(changed, bool)
    masks: dict[str, np.ndarray] = {program.graph.input.name: changed}
    whole = {program.graph.input.name: bool(changed.all())}  # the walk holds these as dense maps
    plan = BlockPlan([], [], None, 0.0, costs.frame_seconds(RegionKind.BLOCKS) + costs.move * moved_bytes, 0)
    best = (math.inf, None, 0.0)
    for index, step in enumerate(program.steps):
        if step.window is not None:
            src = masks.get(step.window.source)
            mask = _window_mask(step, src, dims[step.window.source], motion)
            dense = mask is not None and mask.any() and _runs_dense(step, mask)
            n = 0 if mask is None else (step.positions if dense else _block_positions(step, mask))
            full = dense and mask.mean() > DENSE_RATIO
        else:
            present = [masks[name] for name in step.inputs if name in masks]
            mask = np.logical_or.reduce(present) if len(present) > 1 else (present[0] if present else None)
            full = mask is not None and (any(whole.get(name, False) for name in step.inputs)
                                         or (len(present) > 1 and mask.mean() > DENSE_RATIO))
            dense = full
            n = 0 if mask is None else (step.positions if dense else int(mask.sum()))
        if mask is not None and not mask.any():
            mask = None
        if full:
            mask = np.ones(step.dims, bool)
        plan.masks.append(mask)
        plan.dense.append(dense)
        if mask is None:
            continue
        masks[step.out] = mask
        whole[step.out] = full
        plan.seconds += costs.blocks(index, n, dense)
        plan.flops += step.flops * (1.0 if dense else n / step.positions)
        plan.positions += n
        if step.out in program.cuts:
            total = plan.seconds + costs.suffix(step.out)
            if total < best[0]:
                best = (total, step.out, plan.flops + program.suffix_flops(step.out) + program.tail_flops)
    plan.seconds += costs.tail_seconds()
    plan.flops += program.tail_flops
    if best[0] < plan.seconds:
        plan.seconds, plan.switch, plan.flops = best
    return plan


def _window_mask(step: Step, src: np.ndarray | None, source_dims: tuple[int, int], motion: Motion
                 ) -> np.ndarray | None:
    """A window step's output positions to recompute: what the changed source positions reach, plus the
    positions the motion left without a source and those whose windows read newly uncovered padding."""
    spec = step.window
    ho, wo = step.dims
    mask = grow_mask(src, spec, (ho, wo)) if src is not None and src.any() else None
    invalid = motion.invalid.get((ho, wo))
    if invalid is not None:
        mask = invalid.copy() if mask is None else mask | invalid
    # positions whose windows read padding where the previous frame still had content saw that content then:
    # their cached values are stale although no pixel of this frame changed
    for side in motion.new_padding.get(source_dims, ()):
        band = padding_band(spec, side, (ho, wo), source_dims)
        if band is not None:
            mask = band if mask is None else mask | band
    return mask


def _block_grid(step: Step) -> tuple[int, int, int, int]:
    """``(th, tw, gh, gw)``: a step's output block size and grid."""
    ho, wo = step.dims
    th, tw = block_size(ho, wo)
    th, tw = min(th, ho), min(tw, wo)
    return th, tw, -(-ho // th), -(-wo // tw)


def _active_blocks(step: Step, mask: np.ndarray) -> np.ndarray:
    """(gh, gw) bool, the output blocks holding a changed position."""
    th, tw, gh, gw = _block_grid(step)
    padded = np.zeros((gh * th, gw * tw), bool)
    padded[:mask.shape[0], :mask.shape[1]] = mask
    return padded.reshape(gh, th, gw, tw).any(axis=(1, 3))


def _block_positions(step: Step, mask: np.ndarray) -> int:
    """Positions a window step computes in blocks: its active blocks' outputs."""
    th, tw, _, _ = _block_grid(step)
    return int(_active_blocks(step, mask).sum()) * th * tw


def _runs_dense(step: Step, mask: np.ndarray) -> bool:
    """Whether a window step runs on the whole map: when its active blocks cover most of it."""
    th, tw, _, _ = _block_grid(step)
    active = int(_active_blocks(step, mask).sum())
    return active * th * tw >= (CHEAP_DENSE_RATIO if step.window.cheap else DENSE_RATIO) * step.positions


def walk_blocks(program: Program, cache: FrameCache, changed: np.ndarray, motion: Motion, feature_threshold: float,
                dense_cut: float, costs: FrameCosts | None = None, plan: BlockPlan | None = None,
                timed: bool = False) -> BlockResult:
    """Carry a moving camera's changed pixels through the program (the cache already moved by ``motion``).

    Args:
        program: the graph as steps.
        cache: the frame cache (``cache.frame`` is the new frame).
        changed: (H, W) bool, input pixels to recompute.
        motion: per-resolution invalid positions and newly uncovered padding.
        feature_threshold: value-based pruning at cached tensors (0: exact).
        dense_cut: without a plan (or once pruning left it), at a cut point with at least this share changed,
            finish with the generated suffix.
        costs: the cost coefficients (the result's ``seconds`` is 0 without them).
        plan: :func:`plan_blocks`'s plan for these arguments: its masks are used and it switches where planned.
        timed: measure each step's seconds.
    """
    walker = _BlockWalk(program, cache, motion, feature_threshold, costs, plan, timed)
    return walker.run(changed, dense_cut)


class _BlockWalk:
    def __init__(self, program: Program, cache: FrameCache, motion: Motion, feature_threshold: float,
                 costs: FrameCosts | None, plan: BlockPlan | None, timed: bool) -> None:
        self.program, self.cache, self.motion, self.feature_threshold = program, cache, motion, feature_threshold
        self.costs, self.plan, self.timed = costs, plan, timed
        self.device = cache.device
        self.dims = {n.name: tuple(n.shape[-2:]) for n in program.local if n.shape is not None}
        self.frame_rows = to_rows(cache.frame)
        self.dense_steps = 0
        self.moved = 0  # cached tensors moved through an index map
        self.moved_bytes = 0

    def run(self, changed: np.ndarray, dense_cut: float) -> BlockResult:
        program, cache, costs = self.program, self.cache, self.costs
        input_name = program.graph.input.name
        state = Positions.of(changed)
        state.dense = state.n == changed.size
        if state.dense:
            state.values = cache.frame
        elif state.n:
            state.values = from_rows(self.frame_rows.index_select(0, state.index(self.device)), 1, (state.n, 1))
        states = {input_name: state}
        result = BlockResult(None, program.tail_flops, 0, 0, 0, states)
        sync = self.timed and self.device.type == "cuda"
        for index, step in enumerate(program.steps):
            clock = time.perf_counter() if self.timed else 0.0
            if step.window is not None:
                state = self._window(index, step, states)
            else:
                state = self._rows(step, states)
            whole = state.dense or state.whole
            computed = step.positions if whole else state.n
            result.flops += step.flops * computed / step.positions
            result.positions += state.n
            if costs is not None and (state.n or whole):
                result.seconds += costs.blocks(index, computed, whole)
                parts = costs.blocks_parts(index, computed, whole)
            if step.out in program.cached_set:
                state = self._commit(step.out, state)
            states[step.out] = state
            if self.timed:
                if sync:
                    torch.cuda.synchronize(self.device)
                spent = time.perf_counter() - clock
                result.step_seconds.append(spent)
                result.step_positions.append(computed if (state.n or whole) else 0)
                if costs is not None and (state.n or whole):
                    result.step_samples.append((*parts, spent))
            if step.out in program.cuts and self._switch(step, state, dense_cut):
                output = cache.finish(step.out, None, 1)
                self.dense_steps += 1
                result.output, result.suffix = output, step.out
                result.flops += program.suffix_flops(step.out)
                if costs is not None:
                    result.seconds += costs.suffix(step.out) - costs.tail_seconds()  # the tail is counted below
                break
        else:
            clock = time.perf_counter() if self.timed else 0.0
            result.output = program.tail()(*[cache.map(name) for name in program.boundary])
            if self.timed:
                result.step_seconds.append(time.perf_counter() - clock)
        if costs is not None:
            result.seconds += (costs.frame_seconds(RegionKind.BLOCKS) + costs.tail_seconds()
                               + costs.move * self.moved_bytes)
        result.dense_steps, result.moved = self.dense_steps, self.moved
        return result

    def _switch(self, step: Step, state: Positions, dense_cut: float) -> bool:
        """Whether to finish with the dense rest at this cut point: where the plan says (while the walk follows
        it), else when most of the cut point changed."""
        if self.plan is not None and state.planned:
            return step.out == self.plan.switch
        if math.isinf(dense_cut):
            return False
        return state.dense or state.n >= dense_cut * step.positions

    def _window(self, index: int, step: Step, states: dict[str, Positions]) -> Positions:
        """A window step (and its chain) on blocks of its output around the changed positions."""
        spec = step.window
        src = states[spec.source]
        ho, wo = step.dims
        source_dims = self.dims[spec.source]
        if src.dense:
            mask = np.ones((ho, wo), bool)
        elif self.plan is not None and src.planned:
            mask = self.plan.masks[index]
            mask = np.zeros((ho, wo), bool) if mask is None else mask
        else:
            mask = _window_mask(step, src.mask if src.n else None, source_dims, self.motion)
            mask = np.zeros((ho, wo), bool) if mask is None else mask
        planned = src.planned
        if not mask.any():
            return Positions(mask, np.zeros(0, np.int64), None, planned=planned)
        source = self.frame_rows if spec.source == self.program.graph.input.name else self.cache.buffers[spec.source]
        th, tw, gh, gw = _block_grid(step)
        active = _active_blocks(step, mask)
        n_blocks = int(active.sum())
        dense = n_blocks * th * tw >= (CHEAP_DENSE_RATIO if spec.cheap else DENSE_RATIO) * ho * wo
        if dense:
            out = step.op(padded_map(spec, from_rows(source, 1, source_dims)))
            if step.factors is not None:
                out = out * step.factors
            self.dense_steps += 1
            if mask.mean() > DENSE_RATIO:
                return Positions(np.ones((ho, wo), bool), np.arange(ho * wo), self._chain(step, out), dense=True,
                                 planned=planned)
            state = Positions.of(mask)
            state.values = self._chain(step, from_rows(to_rows(out).index_select(0, state.index(self.device)), 1,
                                                       (state.n, 1)))
            state.whole = True
            state.planned = planned
            return state
        table = spec.tables.get((th, tw))
        if table is None:
            table = spec.tables[(th, tw)] = block_table(spec, (gh, gw), (th, tw), source_dims, self.device)
        ids = np.flatnonzero(active)
        index_rows = table.index.index_select(0, torch.from_numpy(ids).to(self.device)).view(-1)
        rows = dispatch.prepare_windows(source, index_rows, None, None)
        if table.border[ids].any():
            codes = table.codes[ids].reshape(-1)
            for code, value in ((1, spec.view_value), (2, spec.pad_value)):
                fill = np.flatnonzero(codes == code)
                if len(fill):
                    rows.index_fill_(0, torch.from_numpy(fill).to(self.device), value)
        out = step.op(from_rows(rows, n_blocks, spec.read_size((th, tw))))
        rank = np.full(gh * gw, -1, np.int64)
        rank[ids] = np.arange(n_blocks)
        state = Positions.of(mask)
        state.planned = planned
        y, x = np.divmod(state.flat, wo)
        select = rank[(y // th) * gw + x // tw] * (th * tw) + (y % th) * tw + (x % tw)
        values = to_rows(out).index_select(0, torch.from_numpy(select).to(self.device))
        if step.factors is not None:
            values = values * step.factors.reshape(-1, 1).index_select(0, state.index(self.device))
        state.values = self._chain(step, from_rows(values, 1, (state.n, 1)))
        return state

    def _rows(self, step: Step, states: dict[str, Positions]) -> Positions:
        """A pointwise step, 1x1 convolution or merge (and its chain) on the union of its inputs' changes."""
        ins = [states[name] for name in step.inputs]
        if len(ins) == 1:
            out = ins[0]
            if out.n == 0:
                return out
            values = {step.inputs[0]: out.values}
        else:
            if all(s.n == 0 for s in ins):
                return ins[0]
            mask = np.logical_or.reduce([s.mask for s in ins])
            dense = any(s.dense for s in ins) or mask.mean() > DENSE_RATIO
            out = Positions(np.ones_like(mask), np.arange(mask.size), None, dense=True) if dense else Positions.of(mask)
            out.planned = all(s.planned for s in ins)
            values = {}
            for name, s in zip(step.inputs, ins):
                if s.n == out.n:  # the same set (the union of nested sets is the larger one)
                    values[name] = s.values
                elif dense:
                    values[name] = self.cache.map(name)
                else:
                    values[name] = from_rows(self.cache.buffers[name].index_select(0, out.index(self.device)), 1,
                                             (out.n, 1))
        first = step.inputs[0]
        if step.inplace:  # the input may be a view of a cache or another step's values
            values[first] = values[first].clone()
        if step.linear is not None:
            rows = F.linear(to_rows(values[first]), *step.linear)
            result = from_rows(rows, 1, step.dims if out.dense else (out.n, 1))
        elif step.op is not None:
            result = step.op(values[first])
        else:
            result = self.program.ops.invoke(step.head, values, like=values[first])
        return Positions(out.mask, out.flat, self._chain(step, result), out.dense, out._index, planned=out.planned)

    def _chain(self, step: Step, values: torch.Tensor) -> torch.Tensor:
        for fn in step.functions:
            values = fn(values)
        return values

    def _commit(self, name: str, state: Positions) -> Positions:
        """Merge a cached tensor's new values into its (moved) cache, with value-based pruning."""
        cache = self.cache
        if state.dense:
            rows = to_rows(state.values)
            cache.buffers[name] = rows.clone() if name in self.program.mutated else rows
            return state
        moved = self.motion.index.get(self.dims[name])
        if moved is not None:  # the camera moved: the cached values move with the content
            buffer = cache.buffers[name]
            cache.buffers[name] = buffer.index_select(0, moved)
            self.moved += 1
            self.moved_bytes += buffer.numel() * buffer.element_size()
        if not state.n:
            return state
        rows = to_rows(state.values)
        index = state.index(self.device)
        eps = self.feature_threshold * cache.scale(name) if self.feature_threshold > 0 else 0.0
        if eps > 0:
            delta = (rows - cache.buffers[name].index_select(0, index)).abs().mean(dim=1)
            keep = (delta > eps).cpu().numpy()
            if not keep.all():
                kept = np.flatnonzero(keep)
                mask = np.zeros_like(state.mask)
                flat = state.flat[kept]
                mask.reshape(-1)[flat] = True
                rows = rows.index_select(0, torch.from_numpy(kept).to(self.device))
                state = Positions(mask, flat, from_rows(rows, 1, (len(flat), 1)) if len(flat) else None,
                                  planned=False)
                if not state.n:
                    return state
                index = state.index(self.device)
        cache.buffers[name].index_copy_(0, index, rows)
        return state

