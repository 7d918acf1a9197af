"""The session's quality guard: it measures itself while it runs instead of trusting defaults fitted to one clip.

(The speed guard, cached or full from the plan's predicted cost, is :mod:`incrinf.stream.decisions`.)

- :class:`QualityGuard`: on audit frames the session runs the cached path and full inference, keeps the full
  result (a keyframe: an audit is never wasted) and reports the comparison here
  (:class:`~incrinf.stream.agreement.Comparison`). A miss tightens the knobs one level (change threshold and
  feature threshold times 0.6) and audits again after ``audit_interval`` frames; an audit that holds with room to
  spare (its risk, extrapolated to the next interval, at most 1/2) doubles the interval up to the keyframe
  interval, then loosens one level. A level that missed needs twice as many holds as before to be loosened again.
  A miss at the tightest level suspends the cache for 2, 4, ... frames (full inference only). A map's audit that
  held without room (more than half the budget of disagreeing positions used) tightens one level too: its agreement
  varies from frame to frame, so the frames between audits straddle the target; the first cached frame is audited
  whatever the output (nothing has measured the configured thresholds on the model yet). For classifiers a
  cached frame is also checked on its own: when its top-1 margin is within the lead the cached path may have lost
  on this frame (every frame before the first audit), it is audited on the spot, so a near tie is never answered
  from the cache unverified. Two bounds say what it may have lost: the largest lead change the recent audits
  measured (a margin below what the cache has been seen to be off by is never trusted), and ``near_tie`` times
  the quantile at the target of an exponential fit to those changes (single frames' changes are heavy-tailed).
  Both are taken per class pair: the lead of a cached frame's top class over each of its closest rivals is held
  against what that pair lost at the audits once :data:`PAIR_AUDITS` of them measured it, else against the pooled
  changes (per audit the largest over the top class's five closest rivals); a rival several logits behind may move
  a lot without mattering.
  Each audit's change is scaled to the frame by what differs between them (:meth:`QualityGuard.lead_at_risk`):
  when the frame had a sampled audit, its own measured error against the one the audit's sample saw, else the
  frames since the last full one (raised to the growth the audits at different distances show, on its cautious
  side). A near tie is first checked that way, by a sample of the frame (a fraction of a frame), and audited in
  full only when the sampled drift leaves its margin at risk. A frame is not trusted on the linear guess from the
  audits' distances alone: when its margin would be at risk had the drift grown quadratically
  (:meth:`QualityGuard.needs_sample`), a sample measures its drift first; once the recent samples say how far
  off the cache is, a frame without its own is taken to be as far off as the largest of them
  (:meth:`QualityGuard.expected_drift`). The interval of full
  audits that run whatever sampled audits say starts at ``keyframe_interval`` and adapts
  (:meth:`QualityGuard.long_due`).
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from incrinf.stream.agreement import Comparison, Leads, OutputKind
from incrinf.stream.config import StreamConfig

# --- quality ----------------------------------------------------------------------------------------------------

TIGHTEN = 0.6  # a miss multiplies the change and feature thresholds by this
LEVELS = 4  # tightest level: thresholds at 0.6^4 = 13% of the configured ones
_HEADROOM = 0.5  # relax only when the risk extrapolated to the next interval stays under this
_MAX_INTERVAL = 1024  # when keyframe_interval is 0 (no upper bound)
_LONG_SPAN = 4  # the full-audit interval relaxes up to this many times keyframe_interval
_MAX_SUSPEND = 64
_LEAD_SAMPLES = 8  # audits whose lost lead a label output's margin is checked against (pooled and per class pair)
# Audits of a class pair (a top-1 class and one of its five closest rivals) before its own losses bound a cached
# output's lead over that rival instead of the pooled ones (the largest change over every rival). Chosen by a
# leave-one-out over four still clips (hall, walkers, carphone, bigbuckbunny@224; EfficientNet-Lite0, feature
# thresholds 0.35 and 0.7, every other cached frame an audit): the smallest count at which the other clips let no
# flip through unchecked and the pairs' bounds missed their next loss no more often than the pooled bound missed
# the next pooled loss. Holding out hall, walkers or carphone chose 4; holding out bigbuckbunny, the only clip with
# flips, chose 1 from clips without any and let a flip through on it, so the count is the folds' 4.
PAIR_AUDITS = 4
_PAIRS_KEPT = 256  # class pairs whose losses are kept (the least recently measured go first): a long stream's
# scenes bring new top classes, and a pair not measured for that long says little of the cache now
# Probe errors below this are float rounding: no ratio to a frame's sampled error is taken from them.
_PROBE_FLOOR = 1e-4
# Lead losses below this are float rounding: no growth exponent is taken from them.
_LOSS_FLOOR = 1e-6
# How fast the lead a cached frame loses is assumed to grow beyond the distance from a full frame at which an audit
# measured it, until the audits' fit says: loss ~ frames ** 2. On a moving camera warping resamples the cached
# features every frame and the error compounds with the misalignment it leaves (a street clip lost 0.12, 0.42 and
# 0.21 of the lead 1, 2 and 3 frames after an audit); on a still one the cells that changed by less than the
# threshold go stale together (an animated clip lost 0.04 one frame and 0.136 three frames after a full one). The
# power comes from that error model (the lowest integer power above the linear fit), not from a leave-one-out over
# the clips: it only decides when a frame's own sample is taken (a twentieth of a frame), and the sample then
# measures the drift (see QualityGuard.needs_sample).
CAUTIOUS_GROWTH = 2.0
# Recent sampled audits whose errors stand in for a cached frame's own sample (QualityGuard.expected_drift): a sample of
# four tiles varies by a factor of 2-3 from draw to draw, and the largest of eight is above about 9 draws in 10.
_DRIFT_SAMPLES = 8


def _is_map(margin: float | Leads) -> bool:
    """Whether a margin stands for a map's output (NaN: no top-1 lead)."""
    return not isinstance(margin, Leads) and math.isnan(margin)


def _cautious_slope(points: list[tuple[int, float]]) -> float | None:
    """The exponent ``g`` of ``value ~ frames ** g`` fitted to ``(frames, value)`` points on log scales (least
    squares), raised by its standard error (the cautious side of a loose fit), not capped; None until three points
    above :data:`_LOSS_FLOOR` at two or more distances."""
    points = [(math.log(max(d, 1)), math.log(v)) for d, v in points if v > _LOSS_FLOOR]
    xs = [x for x, _ in points]
    if len(points) < 3 or len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in points) / (len(points) - 2)
    return slope + math.sqrt(residual / sxx)


@dataclass(frozen=True)
class LeadLoss:
    """What one label audit measured: the top-1 lead the cached path lost (output units), the frames since the last
    full one at the audit, and the sampled error between the cached and the full probe on that frame (NaN: none)."""

    lost: float
    frames: int
    probe_error: float = math.nan


class Verdict(str, Enum):
    """What an audit concluded."""

    MISS = "miss"
    HOLD = "hold"
    RELAX = "relax"
    TIGHTEN = "tighten"  # a map's audit held without room: the frames between audits may not


@dataclass(frozen=True)
class Agreement:
    """Agreement with full inference measured on the audit frames so far.

    Attributes:
        kind: what agreement means (top-1 or pixels); None before the first audit.
        audits: audited frames.
        agreement: mean over the audits (1.0 before any): the share of audits with the same top-1, or the mean
            share of agreeing positions.
        worst: the lowest single audit's agreement.
        relative_error: mean relative error over the audits.
        misses: audits that missed the target.
    """

    kind: OutputKind | None
    audits: int
    agreement: float
    worst: float
    relative_error: float
    misses: int


class QualityGuard:
    """Audit schedule and knobs held to a target (see the module docstring).

    Args:
        config: the session's settings (targets, thresholds, audit interval bounds).
    """

    def __init__(self, config: StreamConfig) -> None:
        self.config = config
        self.min_interval = config.first_audit_interval
        self.max_interval = config.keyframe_interval or _MAX_INTERVAL
        self.interval = self.min_interval
        # full audits whatever sampled audits say: every keyframe_interval frames to start with, then adapting
        self.long_interval = self.max_interval
        self._long_cap = _LONG_SPAN * config.keyframe_interval if config.keyframe_interval else _MAX_INTERVAL
        self.level = 0
        self._holds = 0
        self._holds_needed = [1] * (LEVELS + 1)  # per level: holds before loosening to it from the level below
        self._suspend = 0
        self._suspended = 0
        self._comparisons: list[Comparison] = []
        self._misses = 0
        self._recent: deque[float] = deque(maxlen=self._window())
        self._lead_lost: deque[LeadLoss] = deque(maxlen=_LEAD_SAMPLES)
        # per (top class, rival): the lead changes the audits measured on that pair
        self._pair_lost: OrderedDict[tuple[int, int], deque[LeadLoss]] = OrderedDict()
        self._last_pairs: tuple[tuple[int, int], ...] = ()  # the pairs the latest label audit measured
        self._label_audits = 0
        self._drift: deque[tuple[int, float]] = deque(maxlen=_DRIFT_SAMPLES)  # (frames since full, sampled error)
        self._unsettled = True  # a map whose latest audit missed or held without room: its frames are checked

    # --- knobs -------------------------------------------------------------------------------------------------

    @property
    def scale(self) -> float:
        """Factor on the configured thresholds at the current level."""
        return TIGHTEN ** self.level

    @property
    def pixel_threshold(self) -> float:
        return self.config.pixel_threshold * self.scale

    @property
    def still_feature_threshold(self) -> float:
        return self.config.still_feature_threshold * self.scale

    @property
    def moving_feature_threshold(self) -> float:
        return self.config.moving_feature_threshold * self.scale

    @property
    def audited(self) -> bool:
        """Whether any audit has been recorded (before the first, every cached label output is checked)."""
        return bool(self._comparisons)

    @property
    def trusting(self) -> bool:
        """Whether cached outputs may be trusted unchecked: an audit has been recorded and, for a label output,
        ``trust_after`` of them (until then every cached label output is checked by rule; such checks say nothing
        of how often near ties come)."""
        if not self._comparisons:
            return False
        return self._comparisons[-1].kind == OutputKind.MAP or self._label_audits >= self.config.trust_after

    def due(self, frames_since_full: int) -> bool:
        """Whether a frame this many frames after the last full one is audited."""
        return frames_since_full >= self.interval

    @property
    def suspended(self) -> bool:
        """The cache is suspended (full inference only) for this frame; call :meth:`tick` once per frame."""
        return self._suspended > 0

    @property
    def suspended_for(self) -> int:
        """Frames of the suspension left, this one included."""
        return self._suspended

    def tick(self) -> None:
        """One frame passed (counts down a suspension)."""
        self._suspended = max(self._suspended - 1, 0)

    def risky(self, margin: float | Leads, frames_since_full: int = 1, sampled_error: float = math.nan) -> bool:
        """Whether a cached label output whose top-1 leads by ``margin`` may have flipped: always before the first
        audit (a map's output too: nothing says yet how far the configured thresholds leave it from full
        inference); after it, when the margin is within a lead change the audits actually measured (the largest,
        scaled to this frame: :meth:`measured_loss`), whatever ``near_tie`` says, or within ``near_tie`` times
        :meth:`lead_at_risk`. A map (NaN margin) is checked while its latest audit missed or held without room
        (each check tightens the thresholds until one holds), else its target, a share of positions, is held by
        the audits. ``near_tie=0`` turns the checks off.

        ``margin`` as :class:`~incrinf.stream.agreement.Leads` (the output's top class and its leads over its
        closest rivals): each lead is held against what its own class pair lost at the audits once
        :data:`PAIR_AUDITS` of them measured it, else against the pooled losses (the largest change over any
        rival: a new top class or a rival never measured is checked as cautiously as a bare margin); risky when
        any rival's lead is within its bound (:meth:`_pairs_within`). A bare float margin (the lead over the
        runner-up) is held against the pooled losses."""
        if self.config.near_tie == 0:
            return False
        if not self._comparisons:
            return True  # nothing measured yet: a map's first cached frame is checked too
        if _is_map(margin):
            return self._unsettled
        if not self._lead_lost or self._label_audits < self.config.trust_after:
            return True  # too few audits measured what the cache loses (see trusting)
        if math.isnan(sampled_error):
            sampled_error = self.expected_drift(frames_since_full)
        return self._pairs_within(margin, lambda audits: self._scaled_losses(frames_since_full, sampled_error,
                                                                             audits))

    def _within(self, margin: float, losses: list[float]) -> bool:
        """Whether ``margin`` is within the lead these audit ``losses`` put at risk (:meth:`_bound`)."""
        return margin <= self._bound(losses)

    def _bound(self, losses: list[float]) -> float:
        """The lead these audit ``losses`` put at risk: their largest (a change the cache was measured to make), or
        ``near_tie`` times their reference (:meth:`_reference`)."""
        return max(max(losses), self.config.near_tie * self._reference(losses))

    def _pairs_within(self, margin: float | Leads, scaled: Callable[[Sequence[LeadLoss]], list[float]]) -> bool:
        """Whether a label output's lead is within what the audits measured, their losses ``scaled`` to the frame
        (a list of audits to their losses): a bare margin against the pooled losses; each of a
        :class:`~incrinf.stream.agreement.Leads`' leads against its pair's own losses where :data:`PAIR_AUDITS`
        audits measured that pair, else against the pooled ones. The pooled losses take, per audit, the largest
        change over five rivals: a class several logits behind moves a lot without mattering, and held against the
        lead over the runner-up that change sent nearly every cached frame of a still clip to a check at feature
        thresholds above the default."""
        if not isinstance(margin, Leads):
            return self._within(margin, scaled(self._lead_lost))
        pooled = math.nan  # computed once, when a lead needs it
        for rival, lead in zip(margin.rivals, margin.leads):
            pair = self._pair_lost.get((margin.top, rival))
            if pair is not None and len(pair) >= PAIR_AUDITS:
                bound = self._bound(scaled(pair))
            else:
                if math.isnan(pooled):
                    pooled = self._bound(scaled(self._lead_lost))
                bound = pooled
            if lead <= bound:
                return True
        return False

    def measured_loss(self, frames_since_full: int = 1, sampled_error: float = math.nan) -> float:
        """The largest top-1 lead change the recent audits measured, scaled to a frame as in :meth:`lead_at_risk`
        (0 before any): the cache has been seen to be off by this much, so a margin below it is never trusted."""
        return max(self._scaled_losses(frames_since_full, sampled_error), default=0.0)

    def lead_at_risk(self, frames_since_full: int = 1, sampled_error: float = math.nan) -> float:
        """The top-1 lead a cached frame ``frames_since_full`` frames after the last full one may have lost.

        Each recent audit's measured loss is first scaled up (never down) to this frame: when this frame had a
        sampled audit (``sampled_error``) and the audit's own sample measured the error between the cached and the
        full probe, by the frame's error against the mean of those the audits' samples measured (the frame's own
        measurement of how far its cache is off, which grows with its drift); else by the frames since the full
        frame against the audit's, raised to the growth exponent the audits themselves show (:meth:`drift_growth`:
        the change mask recomputes every cell that moved by the threshold, so the cache's drift need not accumulate
        frame by frame). The losses of single frames are
        heavy-tailed (a frame may lose three times the lead of the audits around it), so the largest of a few audits
        is no bound: the losses are taken as exponentially distributed, their mean raised by its standard error
        (``1 / sqrt(n)`` of it for ``n`` audits), and the reference is the quantile that only
        ``1 - target_agreement`` of the frames exceed (``mean * ln(1 / (1 - target))``), never below the largest
        scaled loss itself."""
        return self._reference(self._scaled_losses(frames_since_full, sampled_error))

    def _scaled_losses(self, frames_since_full: int, sampled_error: float,
                       audits: Sequence[LeadLoss] | None = None) -> list[float]:
        """The recent audits' lead losses (pooled, or those of ``audits``: one class pair's), each scaled up to a
        frame (see :meth:`lead_at_risk`); the growth and the audits' mean sampled error are the pooled audits'
        whichever losses are scaled."""
        growth = self.drift_growth()
        # what the audits' own samples measured, pooled: one sample of a few tiles varies by a factor of 2-3 from
        # draw to draw, and the audit whose sample happened to draw low would otherwise set every frame's scale
        probes = [a.probe_error for a in self._lead_lost if a.probe_error > _PROBE_FLOOR]
        probe = statistics.fmean(probes) if probes else math.nan
        losses = []
        for audit in self._lead_lost if audits is None else audits:
            if sampled_error > 0 and audit.probe_error > _PROBE_FLOOR:
                # the frame's own measurement of its drift stands in for the extrapolation by frames (a guess at how
                # drift grows); never below the audit's own loss (pruning after the probe, which the sample cannot
                # see, is bounded by the feature threshold at every commit: it does not grow with the frames)
                scale = max(1.0, sampled_error / probe)
            else:
                scale = max(1.0, frames_since_full / max(audit.frames, 1)) ** growth
            losses.append(audit.lost * scale)
        return losses

    def _reference(self, losses: list[float]) -> float:
        """The quantile at the target of an exponential fit to ``losses`` (see :meth:`lead_at_risk`)."""
        if not losses:
            return 0.0
        budget = 1.0 - self.config.target_agreement
        if budget <= 0:
            return math.inf  # every flip counts: every cached label output is checked
        mean = sum(losses) / len(losses) * (1.0 + 1.0 / math.sqrt(len(losses)))
        return max(max(losses), mean * math.log(1.0 / budget))

    def surely_risky(self, margin: float | Leads) -> bool:
        """Whether a label output's margin is at risk however little drift the frame shows: within the largest lead
        change an audit measured or ``near_tie`` times their reference, each audit's loss unscaled (the frames since
        the full one and a frame's own sample only ever scale it up: :meth:`lead_at_risk`); per class pair as in
        :meth:`risky`. A near tie lasts over frames, so a frame after such an output will most likely be checked in
        full whatever its sample says."""
        if self.config.near_tie == 0 or _is_map(margin) or not self._lead_lost:
            return False
        return self._pairs_within(margin, lambda audits: [a.lost for a in audits])

    def needs_sample(self, margin: float | Leads, frames_since_full: int) -> bool:
        """Whether a cached label output that :meth:`risky` let through is trusted only on the audits' fit of how
        the drift grows: with each audit's loss extrapolated from its own distance at :data:`CAUTIOUS_GROWTH`, the
        margin would be within the lead at risk (at an audit's own distance the two bounds agree). A fit to a few
        heavy-tailed losses says little: three audits that lost 0.04, 0.057 and 0.067 one, two and three frames
        after a full one fitted a growth like the square root, and the next frames lost 0.01, 0.069 and 0.136. The
        session then measures the frame's drift with a sample (a fraction of a frame) before trusting it (a check
        in full when no sample can). Once the recent samples measured the drift (:meth:`expected_drift`), the
        margin is checked against the losses scaled by it instead. Per class pair as in :meth:`risky`."""
        if self.config.near_tie == 0 or _is_map(margin) or not self._lead_lost:
            return False
        expected = self.expected_drift(frames_since_full)
        if not math.isnan(expected):
            # the recent samples measured the drift at these distances (extrapolated cautiously beyond them)
            return self._pairs_within(margin, lambda audits: self._scaled_losses(frames_since_full, expected, audits))
        return self._pairs_within(margin, lambda audits: [
            a.lost * max(1.0, frames_since_full / a.frames) ** CAUTIOUS_GROWTH for a in audits])

    def drift_sampled(self, frames_since_full: int, error: float) -> None:
        """A sampled audit measured the cache's ``error`` on a cached frame ``frames_since_full`` frames after the
        last full one (see :meth:`expected_drift`)."""
        if math.isfinite(error):
            self._drift.append((max(frames_since_full, 1), error))

    def expected_drift(self, frames_since_full: int) -> float:
        """The sampled error a cached frame without a sample of its own is taken to have: the largest of the last
        :data:`_DRIFT_SAMPLES` samples (NaN until that many were taken at the current level); when this frame is
        farther from the last full one than any of them, extrapolated from the farthest at the growth they show
        (their errors against their distances on log scales, raised by its standard error, within [0,
        :data:`CAUTIOUS_GROWTH`]; :data:`CAUTIOUS_GROWTH` while they do not span two distances).

        On a still camera the change mask recomputes every cell that moved by the threshold, so the drift is bounded
        by the thresholds rather than growing with the frames since the full one: a garage clip's samples 2 to 22
        frames after a full frame measured 0.08-0.21 with no trend, while its one audit's loss, scaled linearly by
        the frames, asked for a sample on nearly every frame. The samples that keep coming (every
        ``audit_interval`` frames, at due audits, on the frames still found at risk) keep the window fresh; a level
        change empties it (other thresholds, other drift)."""
        if len(self._drift) < _DRIFT_SAMPLES:
            return math.nan
        reach = max(d for d, _ in self._drift)
        largest = max(e for _, e in self._drift)
        slope = _cautious_slope(list(self._drift))
        growth = CAUTIOUS_GROWTH if slope is None else min(max(slope, 0.0), CAUTIOUS_GROWTH)
        return largest * max(1.0, frames_since_full / reach) ** growth

    def _fitted_slope(self) -> float | None:
        """The growth exponent fitted to the recent audits (see :meth:`drift_growth`), raised by its standard error
        and not capped; None until three audits at two or more distances measured a loss."""
        return _cautious_slope([(a.frames, a.lost) for a in self._lead_lost])

    def drift_growth(self) -> float:
        """How the lead a cached frame loses grows with the frames since the last full one: the exponent ``g`` of
        ``loss ~ frames ** g`` fitted to the recent audits on log scales (least squares), raised by its standard
        error (a few heavy-tailed losses give a loose fit: the cautious side of it), within [0, 1]; 1 (linear
        growth, the cautious guess) until three audits at two or more distances have measured a loss."""
        slope = self._fitted_slope()
        return 1.0 if slope is None else min(max(slope, 0.0), 1.0)

    # --- audits ------------------------------------------------------------------------------------------------

    def record(self, comparison: Comparison, frames_since_full: int) -> Verdict:
        """Take an audit's result (made ``frames_since_full`` frames after the previous full frame) and adapt."""
        self._comparisons.append(comparison)
        self._recent.append(comparison.agreement)
        if not math.isnan(comparison.lead_lost):
            self._label_audits += 1
            self._lead_lost.append(LeadLoss(comparison.lead_lost, max(frames_since_full, 1)))
            # either way, as the pooled loss: the sign of one frame's error says little of the next frame's
            for pair, lost in comparison.pair_lost:
                self._pair_lost.setdefault(pair, deque(maxlen=_LEAD_SAMPLES)).append(
                    LeadLoss(abs(lost), max(frames_since_full, 1)))
                self._pair_lost.move_to_end(pair)
            while len(self._pair_lost) > _PAIRS_KEPT:
                self._pair_lost.popitem(last=False)
            self._last_pairs = tuple(pair for pair, _ in comparison.pair_lost)
        long_audit = frames_since_full >= self.long_interval
        self._unsettled = comparison.kind == OutputKind.MAP and (
            self._missed(comparison) or comparison.risk > _HEADROOM)
        if self._missed(comparison):
            self._misses += 1
            self._holds = 0
            self.interval = self.min_interval
            self.long_interval = max(self.long_interval // 2, self.min_interval)
            if self.level < LEVELS:
                self.level += 1
                self._drift.clear()  # other thresholds, other drift
                self._holds_needed[self.level - 1] = min(self._holds_needed[self.level - 1] * 2, 8)
            else:
                self._suspend = min(max(2 * self._suspend, 2), _MAX_SUSPEND)
                self._suspended = self._suspend
            return Verdict.MISS
        self._suspend = 0
        if comparison.kind == OutputKind.MAP and comparison.risk > _HEADROOM and self.level < LEVELS:
            # a map's agreement varies from frame to frame around what the audits see: one that used more than the
            # headroom of the budget leaves the frames between audits on both sides of the target
            self.level += 1
            self._drift.clear()  # other thresholds, other drift
            self._holds = 0
            self.interval = self.min_interval
            return Verdict.TIGHTEN
        if long_audit and comparison.risk <= _HEADROOM:
            # the samples in between stood in for every due audit and the cache still held with room to spare
            self.long_interval = min(2 * self.long_interval, self._long_cap)
        if self.interval < self.max_interval:
            # the error grows with the frames since the last full one: extrapolate to twice the interval
            if comparison.risk * 2 * self.interval / max(frames_since_full, 1) > _HEADROOM:
                return Verdict.HOLD
            self.interval = min(2 * self.interval, self.max_interval)
            return Verdict.RELAX
        if self.level == 0 or comparison.risk / TIGHTEN > _HEADROOM:
            self._holds = 0
            return Verdict.HOLD
        self._holds += 1
        if self._holds < self._holds_needed[self.level - 1]:
            return Verdict.HOLD
        self.level -= 1
        self._drift.clear()  # other thresholds, other drift
        self._holds = 0
        self.interval = max(self.max_interval // 2, self.min_interval)  # the looser level proves itself anew
        return Verdict.RELAX

    def probe_error(self, error: float) -> None:
        """The sampled error between the cached and the full probe on the audit just recorded (a label audit's
        loss is then also compared with the samples of later frames)."""
        if self._lead_lost and math.isfinite(error):
            for audits in (self._lead_lost, *(self._pair_lost[pair] for pair in self._last_pairs)):
                last = audits[-1]
                audits[-1] = LeadLoss(last.lost, last.frames, error)

    def sampled_hold(self) -> None:
        """A sampled audit stood in for a due full audit and held: the interval grows as after a full audit that
        held with room to spare (up to the full-audit interval), the level stays (only full audits loosen the
        thresholds)."""
        self.interval = min(2 * self.interval, max(self.long_interval, self.max_interval))

    def long_due(self, frames_since_full: int) -> bool:
        """Whether a full audit is due whatever samples say: ``long_interval`` frames since the last full one. That
        interval starts at ``keyframe_interval``, doubles (up to 4 times it) after each such full audit that held
        with room to spare (the samples in between stood in well) and halves after a miss (down to the shortest
        audit interval)."""
        return frames_since_full >= self.long_interval

    def _missed(self, comparison: Comparison) -> bool:
        target_error = self.config.target_error
        if target_error is not None and comparison.relative_error >= target_error:
            return True
        if comparison.kind == OutputKind.MAP:
            return comparison.agreement < self.config.target_agreement
        # a classifier's flip is a miss when it takes the recent audits' agreement below the target (with target
        # 0.99: any flip among the latest 100 audits)
        return comparison.agreement < 1.0 and sum(self._recent) / len(self._recent) < self.config.target_agreement

    def _window(self) -> int:
        budget = 1.0 - self.config.target_agreement
        return min(int(math.ceil(1.0 / budget)), 100) if budget > 0 else 1

    @property
    def summary(self) -> Agreement:
        """The agreement measured so far."""
        done = self._comparisons
        if not done:
            return Agreement(None, 0, 1.0, 1.0, 0.0, 0)
        return Agreement(done[-1].kind, len(done), sum(c.agreement for c in done) / len(done),
                         min(c.agreement for c in done), sum(c.relative_error for c in done) / len(done),
                         self._misses)
