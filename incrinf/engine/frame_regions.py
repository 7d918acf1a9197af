"""A still camera's change as several boxes per tensor, planned from their cost and carried through the steps.

Changes in several places of a frame (two people walking on either side of a street) are *one* image's change:
one box around them would cost the street between them. Here every tensor's change is a list of boxes, one per
cluster of changed pixels to start with (:func:`cluster_boxes`), and the plan (:func:`plan_regions`) carries them
through the program's steps:

- a window step grows each box by Krypton's equations (box sides rounded up to multiples of ``quantum`` so oneDNN
  reuses its per-shape kernels) and reads every box's window from the step's *merged* source: every box of the
  source step was committed before this step runs, so each box sees the others' new values where their extents
  overlap (the changes belong to one image);
- a merge step (an add, a concatenation) covers the union of its inputs' boxes and reads all of its inputs from
  their merged caches;
- a pointwise step or 1x1 convolution keeps its input's boxes and their values;
- at window and merge steps, boxes are merged where one box over both costs less than the two
  (:class:`~incrinf.engine.costs.FrameCosts`: a box's fixed cost against the positions the merged box adds), so
  overlapping or nearby boxes become one and distant ones stay apart;
- at a cut point the rest of the model may run densely (the generated suffix): it does at the first cut point
  where the regional steps up to the next cut point would cost at least the same steps run densely
  (:meth:`Geometry.switches`; dense is for good, so this is the cheapest choice for the regions as they stand).

The walk (:func:`walk_regions`) follows the plan. Value-based pruning at commits cuts each box to the positions
whose features moved; once a commit pruned, later boxes are grown from what is left, and every cut point from the
plan's switch on decides again from the regions as they are (a change that dies out is carried on, though the
plan, which cannot know that, would have switched); before it, the smaller regions keep the plan's choice.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from incrinf.engine.boxes import merge_values
from incrinf.engine.costs import FrameCosts, RegionKind
from incrinf.engine.frame_steps import BoundStep, bind_steps
from incrinf.engine.program import Program, Step
from incrinf.engine.stores import FrameCache, take
from incrinf.engine.windows import WindowSpec, crop_view, padded_crop
from incrinf.geometry import Box, Boxes

_EIGHT_NEIGHBOURS = np.ones((3, 3), bool)
# Up to this many boxes, merge_by_cost tries every pair in Python (cheaper than setting up arrays; same result).
_FEW_BOXES = 8


@dataclass(frozen=True)
class PlanParts:
    """What a box plan's predicted seconds are made of, as the coefficients measured them (before the calibration's
    ratios and pruning shares): :func:`plan_seconds` prices them with the current calibration, so a plan kept for
    reuse is priced as of the frame that reuses it.

    Attributes:
        steps: per program step the plan reaches, ``(fixed, arithmetic)`` seconds of its boxes, the steps after
            its switch included (a pruned walk may carry its change on past the switch).
        switch: the step index of the plan's switch to the dense rest, or None.
        dense: the dense rest's seconds (the suffix after the switch, the tail included; without a switch the
            tail; 0 when no change reaches the output).
        tail: the tail's seconds (what a walk that carries its change to the end runs after the steps).
        cuts: ``(step index, suffix seconds)`` of every cut point at or after the switch: where a pruned walk
            decides again whether to run the rest densely.
    """

    steps: tuple[tuple[float, float], ...] = ()
    switch: int | None = None
    dense: float = 0.0
    tail: float = 0.0
    cuts: tuple[tuple[int, float], ...] = ()


@dataclass
class RegionPlan:
    """What a still-camera frame will compute, before it runs.

    Attributes:
        start: the input's boxes ``(y0, y1, x0, x1)`` (after merging by cost).
        steps: per program step, the output boxes (as planned, before any pruning; empty: unchanged).
        switch: the cut point after which the rest runs densely, or None.
        flops: multiply-adds the frame computes (the dense rest and the tail included).
        seconds: predicted engine seconds from the coefficients (calibrated; under pruning, from what the latest
            frames' pruning left: :func:`plan_seconds`).
        gathered_bytes: bytes of the windows and aligned reads gathered by the regional steps.
        unchanged: no change reaches the output (the previous output is returned).
        parts: what ``seconds`` is made of (:class:`PlanParts`).
    """

    start: list[Box]
    steps: list[list[Box]]
    switch: str | None
    flops: float
    seconds: float
    gathered_bytes: int
    unchanged: bool = False
    parts: PlanParts = field(default_factory=PlanParts)
    _counts: list[tuple[int, int]] | None = field(default=None, repr=False, compare=False)

    @property
    def regions(self) -> int:
        return len(self.start)

    @property
    def counts(self) -> list[tuple[int, int]]:
        """Per step, ``(positions, boxes)`` of its planned boxes (counted once: a plan is reused by many frames,
        and the walk compares every step's work with them)."""
        if self._counts is None:
            self._counts = [(sum(area(b) for b in boxes), len(boxes)) for boxes in self.steps]
        return self._counts


@dataclass
class RegionResult:
    """What a walk computed.

    Attributes:
        output: the model's output.
        flops: multiply-adds computed.
        positions: recomputed positions summed over the steps.
        committed: per cached tensor, the boxes committed to it (after pruning).
        suffix: the cut point from which the rest ran densely, if any.
        seconds: what the (calibrated) coefficients give for the work done.
        step_samples: per step run regionally, ``(fixed, arithmetic, measured)`` seconds (when timed): the
            coefficients' parts as measured by the profile, and the step's measured time.
        timed_seconds: measured seconds of the steps and the dense rest (the suffix after a switch, or the tail)
            when timed: what the coefficients price, so the frame's time beyond it is its fixed cost.
    """

    output: Any
    flops: float
    positions: int
    committed: dict[str, list[Box]] = field(default_factory=dict)
    suffix: str | None = None
    seconds: float = 0.0
    step_samples: list[tuple[float, float, float]] = field(default_factory=list)
    timed_seconds: float = 0.0


def cluster_boxes(cells: np.ndarray, cell: int, size: tuple[int, int]) -> list[Box]:
    """Pixel boxes of the 8-connected clusters of True cells of a ``(gh, gw)`` grid of ``cell``-pixel cells,
    clipped to a frame of ``size``; ordered by their first row."""
    cells = np.asarray(cells, bool)
    if not cells.any():
        return []
    from scipy import ndimage  # a dependency of scikit-image; imported on first use (FrameEngine.profile does)

    labels, _ = ndimage.label(cells, structure=_EIGHT_NEIGHBOURS)
    h, w = size
    boxes = [(rows.start * cell, min(rows.stop * cell, h), cols.start * cell, min(cols.stop * cell, w))
             for rows, cols in ndimage.find_objects(labels)]
    return sorted(boxes)


def bounding(a: Box, b: Box) -> Box:
    return min(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), max(a[3], b[3])


def area(b: Box) -> int:
    return (b[1] - b[0]) * (b[3] - b[2])


def merge_by_cost(boxes: list[Box], break_even: float) -> list[Box]:
    """Merge boxes while one box over a pair costs less than the pair: while the merged box adds at most
    ``break_even`` positions (a box's fixed cost over the cost of a position) to the two. Greedy: the pair that
    saves most first (the first such pair in list order on a tie), the merged box last in the list."""
    boxes = list(dict.fromkeys(boxes))  # the same box twice is computed once
    if len(boxes) > _FEW_BOXES:
        return _merge_many(boxes, break_even)
    while len(boxes) > 1:
        best, pair = -math.inf, None
        for i in range(len(boxes)):
            for j in range(i + 1, len(boxes)):
                gain = break_even + area(boxes[i]) + area(boxes[j]) - area(bounding(boxes[i], boxes[j]))
                if gain >= 0 and gain > best:
                    best, pair = gain, (i, j)
        if pair is None:
            break
        i, j = pair
        merged = bounding(boxes[i], boxes[j])
        boxes = [b for k, b in enumerate(boxes) if k not in pair] + [merged]
    return boxes


def _merge_many(boxes: list[Box], break_even: float) -> list[Box]:
    """:func:`merge_by_cost` of many boxes with the pairs' gains as one array, updated per merge (the pairwise loop
    recomputes every pair per merge: a frame of a high-resolution clip with 40 clusters spent 0.2 s planning).
    The same arithmetic in the same order and the same tie-break (the first pair in row-major order), so the same
    boxes."""
    corners = np.array(boxes, np.int64).reshape(len(boxes), 4)
    areas = (corners[:, 1] - corners[:, 0]) * (corners[:, 3] - corners[:, 2])
    lo = np.minimum(corners[:, None, 0::2], corners[None, :, 0::2])
    hi = np.maximum(corners[:, None, 1::2], corners[None, :, 1::2])
    gains = (break_even + areas[:, None] + areas[None, :] - (hi - lo).prod(axis=-1)).astype(np.float64)
    gains[np.tril_indices(len(boxes))] = -math.inf  # pairs (i, j) with i < j only
    gains[gains < 0] = -math.inf
    while len(boxes) > 1:
        flat = int(np.argmax(gains))
        i, j = divmod(flat, len(boxes))
        if gains[i, j] == -math.inf:
            break
        merged = bounding(boxes[i], boxes[j])
        keep = [k for k in range(len(boxes)) if k not in (i, j)]
        boxes = [boxes[k] for k in keep] + [merged]
        corners = np.concatenate([corners[keep], np.array([merged], np.int64)])
        areas = np.concatenate([areas[keep], [area(merged)]])
        # the kept pairs' gains stand; the merged box (last) pairs with every kept box before it
        lo = np.minimum(corners[:-1, 0::2], corners[-1, 0::2])
        hi = np.maximum(corners[:-1, 1::2], corners[-1, 1::2])
        column = (break_even + areas[:-1] + areas[-1] - (hi - lo).prod(axis=-1)).astype(np.float64)
        column[column < 0] = -math.inf
        n = len(boxes)
        grown = np.full((n, n), -math.inf)
        grown[:n - 1, :n - 1] = gains[np.ix_(keep, keep)]
        grown[:n - 1, n - 1] = column
        gains = grown
    return boxes


def grow_box(box: Box, spec: WindowSpec, dims: tuple[int, ...], quantum: int) -> Box:
    """The outputs of a window whose windows read ``box`` of its source (Krypton's equations, as
    :func:`~incrinf.engine.regions.grow` for one box), sides rounded up to multiples of ``quantum``."""
    out = []
    for a in range(2):
        lo, hi, n = box[2 * a], box[2 * a + 1], dims[a]
        first = -((spec.extent[a] - 1 - lo - spec.offset[a]) // spec.stride[a])
        last = (hi - 1 + spec.offset[a]) // spec.stride[a] + 1
        end = min(last, n)
        start = min(max(first, 0), end - 1)
        size = max(end - start, 1)
        if quantum > 1:
            size = min(n, -(-size // quantum) * quantum)
        start = min(start, n - size)
        out.extend((start, start + size))
    return tuple(out)


def _read_bytes(program: Program, step: Step) -> int:
    """Bytes a step reads per position of what it reads (float32)."""
    names = [step.window.source] if step.window is not None else step.inputs
    shapes = [program.graph.by_name[name].shape for name in names]
    return sum(4 * math.prod(shape[1:-2]) for shape in shapes if shape is not None)


def _clip(box: Box, dims: tuple[int, ...]) -> Box:
    return max(box[0], 0), min(box[1], dims[0]), max(box[2], 0), min(box[3], dims[1])


class Geometry:
    """A program's box geometry: per step, the output boxes of the input boxes (shared by the plan and the walk;
    built once per program: it reads every step's shapes)."""

    def __init__(self, program: Program, costs: FrameCosts, quantum: int) -> None:
        self.program, self.costs, self.quantum = program, costs, quantum
        self.read_bytes = [_read_bytes(program, step) for step in program.steps]
        cuts = self.cut_steps = program_cut_steps(program)
        self.next_cut = {c: n for c, n in zip(cuts, cuts[1:] + [None])}  # cut step -> the next one (None: none)
        self.step_of = {step.out: index for index, step in enumerate(program.steps)}
        # steps without a window that read one tensor: their boxes are their input's, box by box
        self.pointwise = [step.window is None and len(step.inputs) == 1 for step in program.steps]
        self.bound = bind_steps(program)

    def switches(self, cut: int, step_seconds: list[float]) -> bool:
        """Whether to run the rest densely from the cut point step ``cut``: when the regional steps up to the next
        cut point (``step_seconds``: their predicted seconds, indexed by step) cost at least those steps run
        densely. Dense is for good (nothing returns to regions), so while a segment is cheaper in regions, going
        on is never worse: the rule is optimal for the regions as they stand."""
        program, costs = self.program, self.costs
        nxt = self.next_cut[cut]
        end = len(program.steps) if nxt is None else nxt + 1
        regional = sum(step_seconds[cut + 1:end])
        if nxt is None:
            return regional + costs.tail_seconds() >= costs.suffix(program.steps[cut].out)
        ratio = costs.dense_ratio  # FrameCosts.suffix of both cut points, the ratio read once
        return regional >= costs.suffix_parts(program.steps[cut].out) * ratio \
            - costs.suffix_parts(program.steps[nxt].out) * ratio

    def segment(self, cut: int, regions: dict[str, list[Box]]) -> list[float]:
        """Predicted seconds per step (indexed by step) of the regional steps after the cut point step ``cut`` up to
        the next cut point, from the tensors' current ``regions`` (already the pruned ones at the cut point: each step
        is discounted by the pruning the latest frames saw there relative to the cut point,
        :meth:`~incrinf.engine.costs.FrameCosts.survival`)."""
        program = self.program
        regions = dict(regions)
        nxt = self.next_cut[cut]
        seconds = [0.0] * len(program.steps)
        for index in range(cut + 1, len(program.steps) if nxt is None else nxt + 1):
            step = program.steps[index]
            boxes = self.out_boxes(index, step, regions)
            if boxes:
                regions[step.out] = boxes
                seconds[index] = self.priced(index, boxes, cut)
        return seconds

    def priced(self, index: int, boxes: list[Box], since: int | None = None) -> float:
        """Predicted seconds of step ``index`` on ``boxes`` as planned (:meth:`price` of their :meth:`parts`)."""
        return self.price(index, self.parts(index, boxes), since)

    def parts(self, index: int, boxes: list[Box]) -> tuple[float, float]:
        """``(fixed, arithmetic)`` seconds of step ``index`` on ``boxes`` as profiled: each box's call and
        arithmetic, summed, before the calibration and pruning."""
        return self.area_parts(index, [area(b) for b in boxes])

    def area_parts(self, index: int, areas: list[int]) -> tuple[float, float]:
        """:meth:`parts` of boxes of ``areas`` positions each."""
        costs = self.costs
        fixed = arithmetic = 0.0
        for positions in areas:
            call, compute = costs.box_parts(index, positions)
            fixed, arithmetic = fixed + call, arithmetic + compute
        return fixed, arithmetic

    def price(self, index: int, parts: tuple[float, float], since: int | None = None,
              ratios: tuple[float, float] | None = None) -> float:
        """Predicted seconds of step ``index`` from its :meth:`parts`: calibrated (``ratios``: the calibration's
        call and compute ratios when the caller read them already) and discounted by the shares of boxes and
        positions that pruning left of the plan there lately (relative to step ``since`` when the boxes are
        already the pruned ones there)."""
        costs = self.costs
        area_share, box_share = costs.survival(index, since)
        call_ratio, compute_ratio = ratios or (costs.call_ratio(RegionKind.BOXES),
                                               costs.compute_ratio(RegionKind.BOXES))
        fixed, arithmetic = parts
        return box_share * call_ratio * fixed + area_share * compute_ratio * arithmetic

    def break_even(self, index: int) -> float:
        return self.costs.break_even(index)

    def out_boxes(self, index: int, step: Step, regions: dict[str, list[Box]]) -> list[Box]:
        if step.window is not None:
            src = regions.get(step.window.source)
            if not src:
                return []
            grown = [grow_box(b, step.window, step.dims, self.quantum) for b in src]
            # one box has nothing to merge with: its break-even (the calibration's ratios) need not be read
            return grown if len(grown) == 1 else merge_by_cost(grown, self.break_even(index))
        present = [b for name in step.inputs for b in regions.get(name, ())]
        if not present:
            return []
        if len(step.inputs) == 1:
            return list(present)  # values flow box by box: the input may not be cached
        clipped = list(dict.fromkeys(_clip(b, step.dims) for b in present))
        return clipped if len(clipped) == 1 else merge_by_cost(clipped, self.break_even(index))


def plan_regions(geometry: Geometry, start: list[Box]) -> RegionPlan:
    """Plan a frame whose input changed in ``start`` boxes: the boxes per step, the cut point to switch to the
    dense rest (:meth:`Geometry.switches`), its multiply-adds, bytes and predicted seconds."""
    program, costs = geometry.program, geometry.costs
    start = merge_by_cost([_clip(b, program.dims(program.graph.input.name)) for b in start],
                          geometry.break_even(0)) if start else []
    regions = {program.graph.input.name: start}
    steps: list[list[Box]] = []
    step_seconds: list[float] = []
    # per step, (fixed, arithmetic) seconds of its boxes as profiled: priced with the calibration, read once, and
    # kept as the plan's parts
    step_parts: list[tuple[float, float]] = []
    ratios = costs.call_ratio(RegionKind.BOXES), costs.compute_ratio(RegionKind.BOXES)
    died = False
    for index, (step, live) in enumerate(zip(program.steps, program.live)):
        if not any(regions.get(name) for name in live):
            died = True
            break
        boxes = geometry.out_boxes(index, step, regions)
        steps.append(boxes)
        parts = geometry.parts(index, boxes)
        step_parts.append(parts)
        step_seconds.append(geometry.price(index, parts, ratios=ratios))
        if boxes:
            regions[step.out] = boxes
    steps.extend([] for _ in range(len(program.steps) - len(steps)))
    unchanged = died or not any(regions.get(name) for name in program.read_boundary)
    switch = None
    for index in geometry.cut_steps:
        if index < len(step_seconds) and steps[index] and geometry.switches(index, step_seconds):
            switch = index
            break
    last = len(step_seconds) if switch is None else switch + 1
    dense = 0.0
    flops, gathered = 0.0, 0
    for index in range(last):
        step = program.steps[index]
        for b in steps[index]:
            flops += step.flops * area(b) / step.positions
            gathered += _gathered(geometry, index, step, b)
    if switch is not None:
        cut = program.steps[switch].out
        dense = costs.suffix_parts(cut)
        flops += program.suffix_flops(cut) + program.tail_flops
    elif not unchanged:
        dense = costs.tail
        flops += program.tail_flops
    cuts = () if switch is None else tuple(
        (index, costs.suffix_parts(program.steps[index].out)) for index in geometry.cut_steps
        if switch <= index < len(step_parts))
    parts = PlanParts(tuple(step_parts), switch, dense, costs.tail, cuts)
    # counted now, on the plan the cache keeps: the copies that price its reuses share the counts
    counts = [(sum(area(b) for b in boxes), len(boxes)) for boxes in steps]
    return RegionPlan(start, steps, None if switch is None else program.steps[switch].out, flops,
                      plan_seconds(program, costs, parts), gathered, unchanged and switch is None, parts, counts)


def plan_seconds(program: Program, costs: FrameCosts, parts: PlanParts) -> float:
    """A box plan's predicted seconds from its :attr:`RegionPlan.parts`, with the current calibration: the
    frame's fixed cost, the box ratios, the dense ratio and, under value-based pruning, what the latest cached
    frames' pruning left (:meth:`~incrinf.engine.costs.FrameCosts.survival_profiles`): the plan is walked once
    with each frame's shares of boxes and positions per step, and the median of those walks' seconds is the
    prediction (before any frame: the plan's whole geometry, and its switch).

    Frame by frame, not step by step: a still camera's change either dies out within a few steps (pruning finds
    that nothing moved; the frame costs a few boxes) or carries on, and per-step medians mix steps of different
    frames. The median over frames, not the mean: the frames are the recent scene's, and one frame whose change
    carried on through a plan's whole geometry (or one whose change died at once) does not move the
    prediction. And with each frame's walk as :func:`walk_regions` goes: a walk that pruned decides again at
    every cut point from the plan's switch on, so a frame whose change died is not charged the plan's dense rest
    (the plan, priced on its unpruned geometry, switched; the walk carries the few surviving boxes on), and one
    whose change carried on pays it from the cut point where its regions grew costlier than the dense rest: a
    cached attempt's downside is bounded by the switch it can still make."""
    seconds = costs.frame_seconds(RegionKind.BOXES)
    if not parts.steps:
        return seconds + costs.dense_ratio * parts.dense
    call_ratio, compute_ratio = costs.call_ratio(RegionKind.BOXES), costs.compute_ratio(RegionKind.BOXES)
    fixed, arithmetic = (np.array(column) for column in zip(*parts.steps))
    n = len(parts.steps)
    shares = costs.survival_shares()
    if shares is None:  # no box frame ran yet: the per-step shares (1 before any), the plan's switch as planned
        steps = np.array([costs.survival(index) for index in range(n)])
        priced = steps[:, 1] * call_ratio * fixed + steps[:, 0] * compute_ratio * arithmetic
        return seconds + float(_walk_seconds(priced[None], parts, costs.dense_ratio, np.zeros(1, bool),
                                             np.ones(1, bool))[0])
    area_share, box_share, first_pruned, alive = shares
    # (frames, steps): each frame's shares on this plan's steps
    priced = box_share[:, :n] * (call_ratio * fixed) + area_share[:, :n] * (compute_ratio * arithmetic)
    # the walk decides again at cut points once a commit pruned: a commit at the switch shows in the step after
    pruned = first_pruned < (n if parts.switch is None else parts.switch + 2)
    return seconds + float(np.median(_walk_seconds(priced, parts, costs.dense_ratio, pruned, alive)))


def _walk_seconds(priced: np.ndarray, parts: PlanParts, dense_ratio: float, pruned: np.ndarray, alive: np.ndarray
                  ) -> np.ndarray:
    """Per walk, its seconds from its steps' calibrated ``priced`` seconds (frames, steps), as
    :func:`walk_regions` goes: a walk that did not prune by the plan's switch (``pruned``, per frame) switches
    there; one that did decides at every cut point from the switch on, and switches at the first where its next
    segment of regions costs at least that segment run densely. Without a switch, every step, and the tail when
    the change reached the end (``alive``, per frame)."""
    done = np.concatenate([np.zeros((len(priced), 1)), np.cumsum(priced, axis=1)], axis=1)  # steps before each
    tail = np.where(alive, dense_ratio * parts.tail, 0.0)
    if parts.switch is None:
        return done[:, -1] + np.where(alive, dense_ratio * parts.dense, 0.0)
    index, suffix = (np.array(column) for column in zip(*parts.cuts))  # the cut points from the switch on
    # per walk and cut point: the next segment of regions (to the next cut point, or to the end and the tail)
    # against the same segment run densely
    ends = np.append(index[1:] + 1, done.shape[1] - 1)
    regional = done[:, ends] - done[:, index + 1]
    regional[:, -1] += tail
    switching = regional >= dense_ratio * (suffix - np.append(suffix[1:], 0.0))
    switching[:, 0] |= ~pruned
    first = switching.argmax(axis=1)
    rows = np.arange(len(priced))
    return np.where(switching.any(axis=1), done[rows, index[first] + 1] + dense_ratio * suffix[first],
                    done[:, -1] + tail)


def program_cut_steps(program: Program) -> list[int]:
    """Indices of the steps that produce a cut point, in order."""
    return [i for i, s in enumerate(program.steps) if s.out in program.cuts]


def _gathered(geometry: Geometry, index: int, step: Step, box: Box) -> int:
    """Bytes a step reads for one output box (a window's read-in window, or the box of each input)."""
    h, w = box[1] - box[0], box[3] - box[2]
    if step.window is not None:
        h, w = step.window.read_size((h, w))
    return h * w * geometry.read_bytes[index]


def walk_regions(geometry: Geometry, cache: FrameCache, x: torch.Tensor, plan: RegionPlan,
                 feature_threshold: float = 0.0, timed: bool = False) -> RegionResult:
    """Run a :class:`RegionPlan` on the frame ``x`` (1, C, H, W) over the frame cache (updated in place)."""
    program, costs = geometry.program, geometry.costs
    input_name = program.graph.input.name
    regions: dict[str, list[Boxes]] = {input_name: [
        Boxes((b[0], b[2]), (b[1] - b[0], b[3] - b[2]), crop_view(x, b[0], b[2], b[1] - b[0], b[3] - b[2]))
        for b in plan.start]}
    result = RegionResult(None, 0.0, 0, seconds=costs.frame_seconds(RegionKind.BOXES))
    pruned = False
    switch_index = geometry.step_of[plan.switch] if plan.switch is not None else len(program.steps)
    sync = x.device.type == "cuda" and timed
    # the calibration does not change while a frame runs: its ratios are read once
    call_ratio, compute_ratio = costs.call_ratio(RegionKind.BOXES), costs.compute_ratio(RegionKind.BOXES)
    cached_set, planned, counts, bound = program.cached_set, plan.steps, plan.counts, geometry.bound
    planned_parts = plan.parts.steps
    for index, (step, live) in enumerate(zip(program.steps, program.live)):
        if not any(map(regions.get, live)):
            # every change has died out (pruning): later tensors keep their cached values, and the plan's boxes
            # up to its switch were computed nowhere
            for rest in range(index, min(switch_index + 1, len(planned))):
                _record_share(costs, rest, counts[rest], (0, 0))
            break
        clock = time.perf_counter() if timed else 0.0
        if geometry.pointwise[index]:  # the input's boxes, each with its own values
            out = [run_pointwise(program, step, source, bound[index]) for source in regions.get(step.inputs[0], ())]
        else:
            if pruned:
                reads = [step.window.source] if step.window is not None else step.inputs
                bounds = geometry.out_boxes(index, step, {k: [v.bounds for v in regions.get(k, ())] for k in reads})
            else:
                bounds = planned[index]
            out = [run_box(program, cache, step, regions, b, bound[index]) for b in bounds]
        if pruned or index >= len(planned_parts):
            areas = [box.area for box in out]
            call, compute = geometry.area_parts(index, areas)
            positions = sum(areas)
            if index < len(planned):
                _record_share(costs, index, counts[index], (positions, len(out)))
        else:  # the plan's boxes as planned: its counts and parts stand
            (call, compute), (positions, _) = planned_parts[index], counts[index]
            _record_share(costs, index, counts[index], counts[index])
        result.seconds += call_ratio * call + compute_ratio * compute
        result.flops += step.flops * positions / step.positions
        result.positions += positions
        if out and step.out in cached_set:
            kept = []
            for box in out:
                committed = cache.commit(step.out, box, feature_threshold)
                if committed is not box:
                    pruned = True
                if committed is not None:
                    kept.append(committed)
            out = kept
            result.committed[step.out] = [b.bounds for b in out]
        regions[step.out] = out
        for name in program.release[index]:
            regions.pop(name, None)
        if timed:
            if sync:
                torch.cuda.synchronize(x.device)
            spent = time.perf_counter() - clock
            result.timed_seconds += spent
            if out:
                result.step_samples.append((call, compute, spent))
        if step.out in program.cuts and out:
            if pruned and index >= switch_index:  # the regions are no longer the plan's: decide from what is left
                live = {k: [v.bounds for v in r] for k, r in regions.items()}
                switching = geometry.switches(index, geometry.segment(index, live))
            else:
                # before the plan's switch, the plan's regions were cheaper than the dense rest, and pruning only
                # shrinks regions (each box to the bounding box of what moved): going on stays the cheaper way
                switching = step.out == plan.switch
            if switching:
                clock = time.perf_counter() if timed else 0.0
                result.output = cache.finish(step.out, None, 1)
                if timed:
                    if sync:
                        torch.cuda.synchronize(x.device)
                    result.timed_seconds += time.perf_counter() - clock
                result.suffix = step.out
                result.seconds += costs.suffix(step.out)
                result.flops += program.suffix_flops(step.out) + program.tail_flops
                return result
    if not any(regions.get(name) for name in program.read_boundary):
        result.output = cache.unchanged(1)
        return result
    clock = time.perf_counter() if timed else 0.0
    result.output = program.tail()(*[cache.map(name) for name in program.boundary])
    if timed:
        if sync:
            torch.cuda.synchronize(x.device)
        result.timed_seconds += time.perf_counter() - clock
    result.seconds += costs.tail_seconds()
    result.flops += program.tail_flops
    return result


def _record_share(costs: FrameCosts, index: int, planned: tuple[int, int], computed: tuple[int, int]) -> None:
    """What a step computed against what its plan had (``(positions, boxes)`` each): the pruning's share there."""
    if planned[1]:
        costs.record_survival(index, planned, computed)


def run_pointwise(program: Program, step: Step, source: Boxes, bound: BoundStep | None = None) -> Boxes:
    """A step without a window that reads one tensor, on one box of it (``source``, with its values); ``bound``:
    the step's calls bound for the walk (:mod:`~incrinf.engine.frame_steps`)."""
    out = Boxes(source.lo, source.size)
    if bound is not None and bound.weight_t is not None:  # a 1x1 convolution: one matrix product over rows
        values = bound.product(source.values)
    else:
        values = merge_values(program, step, {step.inputs[0]: source.values}, out)
    for fn in step.functions if bound is None else bound.functions:
        values = fn(values)
    out.values = values
    return out


def run_box(program: Program, cache: FrameCache, step: Step, regions: dict[str, list[Boxes]], bounds: Box,
            bound: BoundStep | None = None) -> Boxes:
    """One output box of a step, with its values; ``bound``: the step's calls bound for the walk
    (:mod:`~incrinf.engine.frame_steps`)."""
    out = Boxes((bounds[0], bounds[2]), (bounds[1] - bounds[0], bounds[3] - bounds[2]))
    if step.window is not None:
        crop = padded_crop(step.window, cache.map(step.window.source), bounds)
        if bound is not None and bound.window is not None:  # the head and its leading clamp in one call
            values = bound.window(crop)
            for fn in bound.after_window:
                values = fn(values)
            out.values = values
            return out
        values = step.op(crop)
        if step.factors is not None:
            values = values * take(step.factors, out)
    elif len(step.inputs) == 1:
        source = next(b for b in regions[step.inputs[0]] if b.bounds == bounds)
        if bound is not None and bound.weight_t is not None:
            return run_pointwise(program, step, source, bound)
        values = merge_values(program, step, {step.inputs[0]: source.values}, out)
    elif bound is not None and bound.merge is not None:  # a merge of two cached and committed tensors
        first, second = step.inputs
        values = bound.merge(take(cache.map(first), out), take(cache.map(second), out))
    else:  # a merge: every input is cached and committed
        values = merge_values(program, step, {name: take(cache.map(name), out) for name in step.inputs}, out)
    for fn in step.functions if bound is None else bound.functions:
        values = fn(values)
    out.values = values
    return out
