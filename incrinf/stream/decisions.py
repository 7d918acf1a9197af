"""Cached or full: the speed guard's decision from the plan's predicted cost, and whether the cache can pay on a
model at all.

Before a cached frame runs, its plan says what every step will compute; the engine's cost coefficients
(:class:`~incrinf.engine.costs.FrameCosts`: measured per step once, calibrated on the frames run) turn that into
seconds. The frame runs full only when that prediction says the cached frame would be slower than a full one (whose
time is the median of the latest full frames). What a cached frame spends outside its steps (copying the output,
the camera's index maps, the walk's bookkeeping) is the coefficients' own fixed cost per frame, calibrated from the
frames run (:meth:`~incrinf.engine.costs.FrameCosts.frame_seconds`): one calibration of one cost model, nothing
scaled on top. Under a feature threshold the plan discounts each step's boxes and positions by the shares pruning
left of the plan there lately; a frame that prunes less than that decides again at every cut point from its
regions as they are, and switches to the dense rest where that is cheaper.

A model in which every change reaches the whole output early (a squeeze-excitation block's global pooling, a
classifier without local layers worth caching) shows it in the plan of the smallest possible change: when even
that saves less than ``min_saving`` of a full frame, the session runs plain inference on every frame, without
matching, masks or a cache.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from incrinf.engine import FrameEngine
from incrinf.engine.blocks import BlockPlan
from incrinf.engine.costs import FrameCosts, RegionKind
from incrinf.engine.frame_regions import RegionPlan


@dataclass(frozen=True)
class Prediction:
    """A frame's predicted engine seconds, full and cached (NaN: unknown), and what the cached path is expected to
    spend on top in near-tie checks (a full run each, times the share of recent cached frames that needed one)."""

    full: float
    cached: float
    checks: float = 0.0

    @property
    def cached_total(self) -> float:
        """The cached path's expected seconds: the plan's, and the expected near-tie checks."""
        return self.cached + self.checks

    @property
    def cached_faster(self) -> bool:
        """Whether the cached path is predicted to be faster (True while either prediction is unknown)."""
        return math.isnan(self.full) or math.isnan(self.cached) or self.cached_total < self.full


# A frame the guard sends to full inference although its plan's predicted time is within this factor of a full
# frame's is, after PROBE_EVERY such frames, run cached anyway: the calibration ratios and the check rate learn only
# from frames that ran cached, and those samples may be stale (a load spike that has passed, new content, near ties
# that have resolved). The plan alone decides, without the expected checks: a check rate measured on a few frames
# would otherwise keep every later frame from running cached, and so from ever measuring it again. Each probe doubles
# the interval to the next (up to the longest back-off stretch): a probe that confirms the rejections costs a cached
# run (and its check) for nothing, so on a clip where the cache keeps losing probes grow rare; a frame that runs
# cached on its own merits starts the intervals anew.
PROBE_WITHIN = 1.5
PROBE_EVERY = 8
# Latest cached frames (after the quality guard's first audit) whose near-tie checks give the expected check rate.
CHECK_WINDOW = 8


class SpeedGuard:
    """Cached or full per frame: cached when the plan's prediction is faster, with a probe now and then when the
    two are close.

    A classifier's cached frame whose top-1 is a near tie is checked by full inference on the spot (see
    :meth:`~incrinf.stream.guards.QualityGuard.risky`): on a clip where that happens often, each cached frame costs
    its plan *and* a full frame. The guard charges the cached path the measured share of recent cached frames that
    needed a check (:meth:`record_check`; the frames before the first audit, all checked by rule, do not count)
    times a full frame.
    """

    def __init__(self, max_interval: int = 64) -> None:
        self._rejected = 0
        self._max_interval = max(max_interval, PROBE_EVERY)
        self.probe_every = PROBE_EVERY  # rejections before the next probe
        self._checks: deque[bool] = deque(maxlen=CHECK_WINDOW)

    def record_check(self, checked: bool) -> None:
        """A cached frame ran after the first audit; ``checked``: its near tie was checked by full inference."""
        self._checks.append(checked)

    @property
    def check_rate(self) -> float:
        """Share of the latest cached frames whose near tie was checked by full inference (0 before any)."""
        return sum(self._checks) / len(self._checks) if self._checks else 0.0

    def predict(self, costs: FrameCosts, plan: RegionPlan | BlockPlan, check_certain: bool = False) -> Prediction:
        """The full frame's and the planned cached frame's expected engine seconds (the plan's), the expected
        checks included (a full frame with ``check_certain``)."""
        full = costs.full_seconds
        return Prediction(full, plan.seconds, (1.0 if check_certain else self.check_rate) * full)

    @property
    def probe_due(self) -> bool:
        """Whether the next frame rejected by :meth:`hopeless` or :meth:`choose_cached` would be probed."""
        return self._rejected + 1 >= self.probe_every

    def reject(self) -> None:
        """A frame runs full without a plan because the cache it would have needed was not worth keeping (the last
        refill went unused): it counts towards the next probe as a rejection does."""
        self._rejected += 1

    def hopeless(self, engine: FrameEngine, pruning: bool, check_certain: bool = False) -> str:
        """Why no plan of the next frame can be faster than a full frame (``""``: one may be): the expected near-tie
        checks alone, on top of the cheapest plan there is (:func:`cheapest_seconds`), cost a full frame; with
        ``check_certain`` (the previous output was a near tie) the check is expected for sure. Known before the
        frame's stillness test, matching, mask and plan, which then need not run. Such a frame counts as a rejection
        towards the probe (:meth:`choose_cached`): the frame a probe is due on is planned."""
        costs = engine.costs
        if not costs.profiled or not (self._checks or check_certain) or self.probe_due:
            return ""
        full = costs.full_seconds
        checks = (1.0 if check_certain else self.check_rate) * full
        if not checks > 0:
            return ""
        cheapest = cheapest_seconds(engine, pruning)  # planned only when the checks leave it the question
        if not cheapest + checks >= full:
            return ""
        self._rejected += 1
        return (f"the cheapest plan ({cheapest * 1e3:.1f} ms) + {checks * 1e3:.1f} ms expected near-tie checks vs "
                f"{full * 1e3:.1f} ms full")

    def choose_cached(self, prediction: Prediction) -> bool:
        if prediction.cached_faster:
            self._rejected = 0
            self.probe_every = PROBE_EVERY
            return True
        if not prediction.cached < PROBE_WITHIN * prediction.full:
            return False
        self._rejected += 1
        if self._rejected >= self.probe_every:
            self._rejected = 0
            self.probe_every = min(2 * self.probe_every, self._max_interval)
            return True
        return False


def plan_kind(plan: RegionPlan | BlockPlan) -> RegionKind:
    return RegionKind.BOXES if isinstance(plan, RegionPlan) else RegionKind.BLOCKS


def cheapest_seconds(engine: FrameEngine, pruning: bool = False) -> float:
    """Predicted seconds of the cheapest cached frame there is: the smallest change's plan, or under value-based
    ``pruning`` the floor it can be pruned down to (:meth:`~incrinf.engine.FrameEngine.floor`)."""
    seconds = engine.best_case().seconds
    return min(seconds, engine.floor()[1]) if pruning else seconds


def best_saving(engine: FrameEngine, pruning: bool = False) -> float:
    """Share of a full frame the smallest possible change saves by the plan, in multiply-adds and, once the costs
    are profiled, in predicted seconds (the smaller of the two: the noise-free count and the measured time must
    both see the saving). With value-based ``pruning`` a change may die down to a position per step: the floor
    (:meth:`~incrinf.engine.FrameEngine.floor`, the tail on whole maps) bounds the saving instead of the exact
    plan."""
    plan = engine.best_case()
    flops, seconds = plan.flops, plan.seconds
    if pruning:
        floor_flops, floor_seconds = engine.floor()
        flops, seconds = min(flops, floor_flops), min(seconds, floor_seconds)
    saving = 1.0 - flops / engine.program.full_flops
    if not engine.costs.profiled:
        return saving
    return min(saving, 1.0 - seconds / engine.costs.dense_total)
