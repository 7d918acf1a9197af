"""What a frame's work costs on this machine: per-step coefficients measured once, scaled by ratios calibrated
online from the frames actually run.

A cached frame's work is known before it runs: the plan (:mod:`~incrinf.engine.frame_regions`,
:func:`~incrinf.engine.blocks.plan_blocks`) says which positions every step computes, in how many boxes or
blocks. Its time is predicted from that with three coefficients per step:

- ``dense``: the step over its whole map (what a full frame spends on it; the dense suffix after a switch);
- ``per_position``: ``dense`` over the map's positions (a region's arithmetic);
- ``box_call`` / ``block_call``: the fixed cost of running the step on one box (a crop, an operator call, a
  commit with its pruning test) or on a set of blocks (the masks, the index gather), whatever the region's size.

They are measured once, by a profile after the first full frame (the step ops on the whole map, scaled to the
generated full module's time; on one position; in the block walk on one cell; each repeated and the fastest taken,
so a load spike does not stick), and until then estimated from multiply-adds and bytes.

The frames run then calibrate them, with medians of ratios (a load spike on a shared machine moves no decision,
and no decision rests on a curve fitted to a few timings):

- every cached frame on the CPU times its steps; a step whose predicted time is mostly fixed cost is a sample of
  the *call* ratio (measured over predicted), one that is mostly arithmetic a sample of the *compute* ratio, per
  kind (boxes, blocks), summed over the frame's steps of each sort (a frame's time is set by its large steps, and
  a shared machine's descheduling taxes it as it taxes a full frame: :meth:`FrameCosts.record_steps`);
- full frames give the *dense* ratio (measured full frame over the profile's);
- a feature threshold prunes regions as a frame runs, which the plan's geometry cannot know: per step, the median
  share of the plan's positions and of its boxes that the latest frames actually computed there (ratios of the
  plan's own counts, no timing) discount that step's arithmetic and its fixed cost per box
  (:meth:`FrameCosts.survival`). The shares are taken against the plan at each step, not chained from one cached
  tensor to the next: a box pruned to a few positions grows back by its window's halo at the next step, so a
  product of per-tensor shares priced the deep steps at nothing (and per-box costs went with them). A plan's
  prediction takes each of the latest frames' shares at every step together (:meth:`FrameCosts.survival_profiles`,
  :func:`~incrinf.engine.frame_regions.plan_seconds`): a change dies at one step or carries on through all of them;
  the per-step medians steer the plan's own choices (merges, the switch) and the walk's switch decisions;
- what a cached frame spends outside its steps and its dense rest (copying the output, the walk's own bookkeeping,
  the camera's index maps) is measured per frame and its median is the frame's fixed cost
  (:meth:`FrameCosts.frame_seconds`): one calibration of the same model at the same depth as the steps, so no
  second scale on top of the plan's prediction is needed.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict, deque
from dataclasses import dataclass
from enum import Enum
from functools import partial

import numpy as np

from incrinf.engine.program import Program

# Latest frames whose ratios (or times, or shares) the calibration takes the median of.
SAMPLES = 9
# The profile's own word, as this many ratios of 1 beside the measured ones: a first cached frame that paid
# one-time costs (new kernel shapes) does not set the scale alone.
PRIOR_RATIOS = 2
# A step sample counts for the call ratio when its fixed cost is more than this share of its predicted time, else
# for the compute ratio.
DOMINANT = 0.5
# Before a profile (direct engine users; a stream profiles after its first full frame): a step over its map costs
# its multiply-adds plus the bytes it reads and writes at these rates, a box or a block step a fixed call on top
# (the orders of magnitude of one core of a server CPU, measured with 1 thread: 50-100 ps per multiply-add of a
# convolution, 20-60 us per call).
PRIOR_SECONDS_PER_FLOP = 5e-11
PRIOR_SECONDS_PER_BYTE = 2e-10
PRIOR_CALL = 20e-6
# A box plan's choices (merges, the switch to the dense rest) are reused while the calibration's ratios and the
# pruning's share stay within the same 1/PLAN_STEPS of an octave (about 19%): FrameCosts.plan_state.
PLAN_STEPS = 4
# A ratio's step in the plan key moves only once the ratio is this many steps from the step it is keyed at (more
# than the half step of rounding): a median near the boundary of two steps moves across it and back with the
# frames' noise, and each crossing rebuilt the plans of boxes that were planned a frame before. One step: the key
# lags a ratio by less than a step, the precision the steps already give.
PLAN_HYSTERESIS = 1.0


class RegionKind(str, Enum):
    """How a cached frame carries its change: boxes (the box walk) or blocks of positions (the block walk)."""

    BOXES = "boxes"
    BLOCKS = "blocks"


@dataclass
class StepCost:
    """One step's coefficients as measured (seconds).

    Attributes:
        dense: the step over its whole map.
        per_position: ``dense`` per output position.
        box_call: fixed cost of the step on one box.
        block_call: fixed cost of the step in the block walk.
    """

    dense: float
    per_position: float
    box_call: float
    block_call: float


def _median(samples: deque[float]) -> float:
    return statistics.median([1.0] * PRIOR_RATIOS + list(samples))


class FrameCosts:
    """Per-step coefficients of one program on this device, and their online calibration.

    Args:
        program: the graph as steps.

    Attributes:
        steps: a :class:`StepCost` per program step (as measured; the predictions apply the ratios).
        tail: seconds of the tail (the model after the local part) on full maps.
        move: seconds per byte of a cached tensor moved through a camera motion's index map.
        frame: fixed seconds of any cached frame as profiled (copying its output for the caller and the next frame);
            :meth:`frame_seconds` calibrates it with what cached frames measured outside their steps.
        profiled: whether the coefficients were measured (else estimated from multiply-adds).
    """

    def __init__(self, program: Program) -> None:
        self.program = program
        self.steps = []
        for step in program.steps:
            dense = step.flops * PRIOR_SECONDS_PER_FLOP + 8 * step.positions * math.prod(step.channels or (1,)) \
                * PRIOR_SECONDS_PER_BYTE  # read and written once, float32
            self.steps.append(StepCost(dense, dense / step.positions, PRIOR_CALL, PRIOR_CALL))
        self.tail = program.tail_flops * PRIOR_SECONDS_PER_FLOP
        self.move = PRIOR_SECONDS_PER_BYTE
        self.frame = 0.0
        self.profiled = False
        self._call = {k: deque(maxlen=SAMPLES) for k in RegionKind}
        self._compute = {k: deque(maxlen=SAMPLES) for k in RegionKind}
        # per step index: shares of the plan's positions and boxes that the latest frames computed (pruning)
        self._area_share: dict[int, deque[float]] = defaultdict(partial(deque, maxlen=SAMPLES))
        self._box_share: dict[int, deque[float]] = defaultdict(partial(deque, maxlen=SAMPLES))
        # per latest cached box frame, per step the plan's and the computed positions and boxes
        # (:meth:`survival_profiles`): the frame being walked, then the closed ones
        self._open: dict[int, tuple[int, int, int, int]] = {}
        self._profiles: deque[np.ndarray] = deque(maxlen=SAMPLES)
        self._profile_stack: np.ndarray | None = None
        self._profile_shares: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._outside = {k: deque(maxlen=SAMPLES) for k in RegionKind}
        self._ratios: dict[tuple[str, RegionKind], float] = {}
        self._full: deque[float] = deque(maxlen=SAMPLES)
        # medians kept until their next sample: plans ask for them at every step and box (a median per call cost
        # about 2 ms a frame at 144x176, a tenth of a full frame there)
        self._full_median: float | None = None
        self._share_median: dict[tuple[int, bool], float] = {}
        self._frame_median: dict[RegionKind, float] = {}
        self._suffix: dict[str, float] = {}
        self._plan_steps: tuple[int, ...] | None = None  # the ratios' steps of the latest plan key
        self._reindex()

    def _reindex(self) -> None:
        """Dense seconds of everything after each cut point (the suffix a switch runs), the tail included, and of
        the whole frame (plans ask for it at every box, through :attr:`dense_ratio`)."""
        after = self.tail
        self._suffix = {}
        for step, cost in zip(reversed(self.program.steps), reversed(self.steps)):
            if step.out in self.program.cuts:
                self._suffix[step.out] = after
            after += cost.dense
        self._dense_total = after

    def set_profile(self, dense: list[float], box_call: list[float], block_call: list[float], tail: float,
                    move: float, frame: float) -> None:
        """Take measured coefficients (seconds per step, in program order; ``move`` seconds per byte; ``frame``
        seconds per cached frame)."""
        self.steps = [StepCost(d, d / s.positions, max(b, 0.0), max(k, 0.0))
                      for d, b, k, s in zip(dense, box_call, block_call, self.program.steps)]
        self.tail = tail
        self.move = move
        self.frame = frame
        self.profiled = True
        self._reindex()

    # --- predictions (calibrated) ------------------------------------------------------------------------

    def box_parts(self, index: int, area: int) -> tuple[float, float]:
        """``(fixed, arithmetic)`` seconds of one box of ``area`` output positions of step ``index``, as measured."""
        cost = self.steps[index]
        return cost.box_call, cost.per_position * area

    def box(self, index: int, area: int) -> float:
        """One box of ``area`` output positions of step ``index``."""
        call, compute = self.box_parts(index, area)
        return self.call_ratio(RegionKind.BOXES) * call + self.compute_ratio(RegionKind.BOXES) * compute

    def blocks_parts(self, index: int, positions: int, dense: bool) -> tuple[float, float]:
        """``(fixed, arithmetic)`` seconds of step ``index`` of the block walk, as measured."""
        cost = self.steps[index]
        return cost.block_call, cost.dense if dense else cost.per_position * positions

    def blocks(self, index: int, positions: int, dense: bool) -> float:
        """Step ``index`` of the block walk on ``positions`` positions (``dense``: on the whole map)."""
        call, compute = self.blocks_parts(index, positions, dense)
        return self.call_ratio(RegionKind.BLOCKS) * call + self.compute_ratio(RegionKind.BLOCKS) * compute

    def suffix(self, cut: str) -> float:
        """Everything after the cut point ``cut`` run densely, the tail included."""
        return self._suffix[cut] * self.dense_ratio

    def suffix_parts(self, cut: str) -> float:
        """:meth:`suffix` as measured (before the dense ratio)."""
        return self._suffix[cut]

    def plan_state(self) -> tuple:
        """What a box plan's choices (merges, the switch to the dense rest) rest on, as a hashable key: the
        coefficients as measured, and the calibration's ratios and the pruning's mean shares over the steps, in
        steps of a quarter octave. Finer steps would miss on every frame (the medians move by their noise); a
        reused plan is priced with the exact calibration (:func:`~incrinf.engine.frame_regions.plan_seconds`), so
        only choices within a step of a tie can differ from a fresh plan's. A ratio keeps the step of the previous
        key until it is :data:`PLAN_HYSTERESIS` steps from it (the same boxes then find their plan while a median
        wavers about a step's boundary). The frame's fixed cost is left out: it is the same whatever the plan
        chooses."""
        n = len(self.steps)
        shares = [self.survival(i) for i in range(n)]
        area = sum(share[0] for share in shares) / max(n, 1)
        boxes = sum(share[1] for share in shares) / max(n, 1)
        ratios = (self.call_ratio(RegionKind.BOXES), self.compute_ratio(RegionKind.BOXES), self.dense_ratio, area,
                  boxes)
        scaled = [math.log2(max(r, 1e-9)) * PLAN_STEPS for r in ratios]
        last = self._plan_steps
        self._plan_steps = tuple(
            last[i] if last is not None and abs(value - last[i]) < PLAN_HYSTERESIS else round(value)
            for i, value in enumerate(scaled))
        return self._plan_steps, tuple((c.dense, c.box_call) for c in self.steps), self.tail

    def tail_seconds(self) -> float:
        return self.tail * self.dense_ratio

    def break_even(self, index: int) -> float:
        """Positions one more box costs at step ``index`` (its fixed cost over the cost of a position)."""
        call, compute = self.box_parts(index, 1)
        scaled = self.compute_ratio(RegionKind.BOXES) * compute
        return self.call_ratio(RegionKind.BOXES) * call / scaled if scaled > 0 else math.inf

    @property
    def dense_total(self) -> float:
        """A full frame from the coefficients as measured: every step dense, and the tail."""
        return self._dense_total

    @property
    def full_seconds(self) -> float:
        """A full frame's engine time: the median of the latest full frames, else the profile's."""
        return self._median_full() if self._full else self.dense_total

    def survival(self, index: int, since: int | None = None) -> tuple[float, float]:
        """``(positions, boxes)``: the shares of the plan's positions and boxes at step ``index`` that the latest
        frames computed there (value-based pruning; 1 without it, and before any frame); with ``since``, relative
        to the shares at that earlier step (for regions that are already the pruned ones there), at most 1. Ratios
        of the plan's own counts, no timing: no load spike can distort them, so the first frame's shares count
        alone (with the timing ratios' prior beside them, the second and third cached frames of a dilated
        segmenter were predicted at nearly a full frame, the pruning they would see unknown)."""
        area, boxes = self._share(index, True), self._share(index, False)
        if since is not None:
            base_area, base_boxes = self._share(since, True), self._share(since, False)
            area = min(area / base_area, 1.0) if base_area > 0 else 1.0
            boxes = min(boxes / base_boxes, 1.0) if base_boxes > 0 else 1.0
        return area, boxes

    def _share(self, index: int, area: bool) -> float:
        value = self._share_median.get((index, area))
        if value is None:
            samples = (self._area_share if area else self._box_share).get(index)
            value = self._share_median[(index, area)] = statistics.median(samples) if samples else 1.0
        return value

    def frame_seconds(self, kind: RegionKind) -> float:
        """A cached frame's fixed seconds outside its steps and its dense rest: the median of what the latest
        cached frames of this kind measured there, the profile's copy of the output standing in for
        ``PRIOR_RATIOS`` of them (one frame that paid one-time costs does not set it alone)."""
        value = self._frame_median.get(kind)
        if value is None:
            samples = self._outside[kind]
            value = statistics.median([self.frame] * PRIOR_RATIOS + list(samples)) if samples else self.frame
            self._frame_median[kind] = value
        return value

    # --- calibration -------------------------------------------------------------------------------------

    def call_ratio(self, kind: RegionKind) -> float:
        return self._ratio("call", kind)

    def compute_ratio(self, kind: RegionKind) -> float:
        return self._ratio("compute", kind)

    def _ratio(self, part: str, kind: RegionKind) -> float:
        """A calibration median, kept until the next samples (plans ask for it at every box)."""
        value = self._ratios.get((part, kind))
        if value is None:
            value = self._ratios[(part, kind)] = _median((self._call if part == "call" else self._compute)[kind])
        return value

    @property
    def dense_ratio(self) -> float:
        """Measured full frames over the profile's full frame (1 before any)."""
        if not self._full or not self.profiled:
            return 1.0
        return self._median_full() / max(self.dense_total, 1e-12)

    def _median_full(self) -> float:
        if self._full_median is None:
            self._full_median = statistics.median(self._full)
        return self._full_median

    def record_full(self, seconds: float) -> None:
        if math.isfinite(seconds):
            self._full.append(seconds)
            self._full_median = None

    def record_steps(self, kind: RegionKind, samples: list[tuple[float, float, float]]) -> None:
        """A cached frame's measured steps: ``(fixed, arithmetic, measured)`` seconds each (the first two as
        :meth:`box_parts` / :meth:`blocks_parts` give them). The steps mostly fixed cost give the frame's call
        ratio, the others its compute ratio: each the sum of their measured seconds over the sum of their
        predicted ones. Sums per frame, not a median over steps: a frame's time is its large steps' (an unweighted
        median of a few dozen steps is set by the many small ones), and on a shared machine a process is
        descheduled for milliseconds at a time, a tax that a full frame's measured time pays in proportion to its
        length; a median over steps would leave it out of the cached side only (on a still camera with three
        walkers at load 6-7: steps 2.2-3.6x their coefficients in sum, 1.2-1.6x by their median, and frames
        predicted at 40-54 ms ran 55-95 ms). The median over frames keeps one frame caught by a spike from moving
        anything."""
        sums = {"call": [0.0, 0.0], "compute": [0.0, 0.0]}
        for call, compute, measured in samples:
            total = call + compute
            if not total > 0 or not math.isfinite(measured):
                continue
            part = sums["call" if call > DOMINANT * total else "compute"]
            part[0], part[1] = part[0] + measured, part[1] + total
        for name, (measured, predicted) in sums.items():
            if predicted > 0:
                (self._call if name == "call" else self._compute)[kind].append(measured / predicted)
        self._ratios = {}

    def record_survival(self, index: int, planned: tuple[int, int], computed: tuple[int, int]) -> None:
        """A cached frame computed ``computed`` ``(positions, boxes)`` at step ``index`` where its plan's geometry
        (before pruning) had ``planned``."""
        if planned[0] > 0 and planned[1] > 0:
            area, boxes = computed[0] / planned[0], computed[1] / planned[1]
            self._area_share[index].append(area)  # a frame records every step: no new deque per call
            self._box_share[index].append(boxes)
            self._share_median.pop((index, True), None)
            self._share_median.pop((index, False), None)
            self._open[index] = (planned[0], computed[0], planned[1], computed[1])

    def open_survival(self) -> None:
        """A box walk starts: what :meth:`record_survival` gets next belongs to its frame's profile."""
        self._open = {}

    def close_survival(self, switched: bool) -> None:
        """The box walk that :meth:`open_survival` started ended; ``switched``: it ran the rest densely from a cut
        point. Its counts per step become one :meth:`survival_profiles` row: a step it did not record was computed
        nowhere (its change had died out) unless it switched (then what it would have computed is unknown, NaN)."""
        if not self._open:
            return
        row = np.full((4, len(self.steps)), np.nan)
        if not switched:
            row[1] = row[3] = 0.0
        for index, counts in self._open.items():
            row[:, index] = counts
        self._profiles.append(row)
        self._profile_stack = None
        self._open = {}

    def survival_profiles(self) -> np.ndarray | None:
        """(4, frames, steps): per latest cached box frame (at most ``SAMPLES``) and step, its plan's positions,
        the positions it computed, its plan's boxes and the boxes it computed (value-based pruning; NaN where
        unknown: the plan's own where the frame switched to the dense rest before; computed 0 after its change died
        out), or None before any. Counts of what ran, no timing. A frame's counts are kept together: a change
        dies at one step or carries on through all of them, so a plan priced with each frame's survival in turn
        sees the cost of the frames whose change died early and of those whose change carried on, where the
        per-step medians of :meth:`survival` mix steps of different frames."""
        if not self._profiles:
            return None
        if self._profile_stack is None:
            self._profile_stack = np.stack(list(self._profiles), axis=1)
            self._profile_shares = None
        return self._profile_stack

    def survival_shares(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """``(positions, boxes, first_pruned, alive)`` of :meth:`survival_profiles` (None before any): per frame
        and step the shares of its plan's positions and boxes it computed (frames, steps; 0 after its change died
        out, 1 where unknown, at most 1), per frame the first step where a share was below 1 (``steps`` if none)
        and whether its change reached the last step (or may have); kept until the next frame's profile (plans
        ask at every frame)."""
        profiles = self.survival_profiles()
        if profiles is None:
            return None
        if self._profile_shares is None:
            planned_area, computed_area, planned_boxes, computed_boxes = profiles
            with np.errstate(divide="ignore", invalid="ignore"):
                area = np.where(computed_area == 0, 0.0, computed_area / planned_area)
                boxes = np.where(computed_boxes == 0, 0.0, computed_boxes / planned_boxes)
            area = np.clip(np.nan_to_num(area, nan=1.0, posinf=1.0), 0.0, 1.0)
            boxes = np.clip(np.nan_to_num(boxes, nan=1.0, posinf=1.0), 0.0, 1.0)
            below = (area < 1) | (boxes < 1)
            first = np.where(below.any(axis=1), below.argmax(axis=1), below.shape[1])
            self._profile_shares = (area, boxes, first, ~(computed_area[:, -1] == 0))
        return self._profile_shares

    def record_frame(self, kind: RegionKind, outside: float) -> None:
        """A cached frame of ``kind`` spent ``outside`` seconds outside its timed steps and its dense rest."""
        if math.isfinite(outside):
            self._outside[kind].append(max(outside, 0.0))
            self._frame_median.pop(kind, None)
