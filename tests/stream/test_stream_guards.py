"""The session's online guards (incrinf.stream.guards): speed from measured costs, quality held by audits."""

import math

import cv2
import numpy as np
import pytest
import skimage.data
import torch
import torch.nn as nn
from stream_scenes import (
    H,
    W,
    frozen_costs,
    full_inference,
    small_classifier,
    still_camera,
    untimed_profile,
    wide_classifier,
)

from incrinf.graph import capture
from incrinf.stream.agreement import Comparison, OutputKind, compare
from incrinf.stream.config import StreamConfig
from incrinf.stream.guards import LEVELS, QualityGuard, Verdict
from incrinf.stream.session import StreamSession
from incrinf.stream.stats import Cause

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def frames() -> list[np.ndarray]:
    return still_camera(24)





# --- speed ------------------------------------------------------------------------------------------------------



def test_speed_guard_switches_to_full_inference_when_the_cached_path_is_slow(frames, monkeypatch):
    model = wide_classifier()
    session = StreamSession(model, quality_guard=False, max_backoff=0, feature_threshold=0.0, input_size=(H, W))
    costs = frozen_costs(session, monkeypatch)
    for frame in frames[:8]:
        session(frame)
    # a small change: its plan computes a few percent of the frame, so every frame with a plan runs cached
    early = session.stats[1:8]
    assert all(s.mode == "cached" for s in early), [s.reason for s in early]
    assert all(0 < s.predicted_cached < s.predicted_full for s in early if s.regions)
    for step in costs.steps:  # every box of the cached path now costs more than a full frame
        step.box_call = 2 * costs.full_seconds
    for frame in frames[8:20]:
        out = session(frame)
        if session.stats[-1].mode == "full":
            torch.testing.assert_close(out, full_inference(model, frame), rtol=1e-4, atol=1e-4)
    # every later frame with anything to compute runs full, as its plan's cost says (the predicted cached time is
    # far beyond 1.5x a full frame's, so the guard never probes the cached path)
    late = [s for s in session.stats[8:] if s.predicted_cached > 0]
    assert len(late) >= 8 and all(s.cause == Cause.SLOWER for s in late), [s.reason for s in late]
    for s in late:  # the decision and both estimates are in the stats
        assert s.predicted_cached > s.predicted_full > 0 and s.reason.startswith("cached slower: predicted")
    first = StreamSession(model, quality_guard=False)
    first(frames[0])
    assert math.isnan(first.stats[0].predicted_full)  # nothing measured before the first frame


def test_near_tie_checks_are_charged_to_the_cached_path(frames, monkeypatch):
    """A clip where every cached frame is a near tie pays a full frame on top of each cached one: the speed guard
    charges the cached path those checks, runs the frames full, and then plain frames that do not even try (back-off
    stretches, or frames the expected checks leave no plan that could pay) instead of auditing every frame."""
    model = wide_classifier()
    session = StreamSession(model, audit_interval=64, keyframe_interval=64, feature_threshold=0.0)
    session._quality.risky = lambda margin, *_: True  # every cached frame's top-1 is a near tie
    session(frames[0])  # profiles the engine
    frozen_costs(session, monkeypatch)  # from here on the plans alone decide (no wall clock)
    for frame in frames[1:16]:
        session(frame)
    causes = [s.cause for s in session.stats[1:]]
    untried = [s for s in session.stats[1:] if s.cause in (Cause.BACKING_OFF, Cause.SLOWER) and s.times.plan == 0]
    assert len(untried) >= 8, causes
    near_ties = [s for s in session.stats[1:] if s.audit]
    assert near_ties and all(s.reason.startswith("audit: near tie") for s in near_ties)
    from incrinf.stream.decisions import PROBE_EVERY

    # the checks by rule before the first audit and on the first frame after it, then a probe at most every
    # PROBE_EVERY frames
    assert len(near_ties) <= 2 + len(session.stats) // PROBE_EVERY, causes


def test_a_near_tie_checked_frame_counts_as_the_cached_frame_it_was(frames):
    """A near-tie check's full run is the quality guard's cost, charged to the cached path by the speed guard's
    expected checks: the back-off takes the checked frame by its cached part, so checks that come early (every cached
    frame is checked before the first audit) do not start a stretch of plain frames sized by a full frame each."""
    model = wide_classifier()
    session = StreamSession(model, audit_interval=64, keyframe_interval=64, feature_threshold=0.0)
    session._quality.risky = lambda margin, *_: True
    taken = []
    paid = session._backoff.paid

    def spy(cause, attempt, saving, predicted_full, seconds, overhead, missed_audit=False, warming=False):
        taken.append((cause, seconds))
        return paid(cause, attempt, saving, predicted_full, seconds, overhead, missed_audit, warming)

    session._backoff.paid = spy
    for frame in frames[:2]:
        session(frame)
    checked = session.stats[1]
    assert checked.audit and checked.reason.startswith("audit: near tie"), checked.reason
    cause, seconds = taken[1]
    assert cause is None  # a cached frame, not an audit (audits are no attempts)
    assert 0 < seconds and seconds + checked.times.audit <= checked.seconds  # its time without the check's full run


def test_the_speed_guard_charges_the_cached_path_its_expected_near_tie_checks(frames, monkeypatch):
    """A near-tie check runs full inference on top of the cached frame: once the recent cached frames all needed one,
    a plan that is cheaper than a full frame no longer makes the cached path cheaper, and the guard runs full."""
    from incrinf.stream.decisions import Prediction, SpeedGuard

    guard = SpeedGuard()
    assert guard.check_rate == 0.0
    for checked in (True, False, True, True):
        guard.record_check(checked)
    assert guard.check_rate == 0.75
    assert Prediction(1.0, 0.3, 0.75).cached_total == pytest.approx(1.05)
    assert Prediction(1.0, 0.3).cached_faster and not Prediction(1.0, 0.3, 0.75).cached_faster

    model = wide_classifier()
    session = StreamSession(model, max_backoff=0, feature_threshold=0.0, audit_interval=64, keyframe_interval=64,
                            sampled_audits=False, input_size=(H, W), trust_after=1)
    frozen_costs(session, monkeypatch)
    session._quality.risky = lambda margin, *_: True  # every cached frame's top-1 is a near tie
    session._check_certain = lambda: False  # the check rate alone (not the previous output's margin) decides here
    for frame in frames[:8]:
        torch.testing.assert_close(session(frame), full_inference(model, frame), rtol=1e-4, atol=1e-4)
    stats = session.stats
    # frame 1: checked by rule (no audit yet); frame 2: the first cached frame after an audit, checked as well; from
    # then on the plan (a few percent of a frame) plus a full check per frame costs more than a full frame
    assert [s.cause for s in stats[1:3]] == [Cause.AUDIT, Cause.AUDIT]
    assert all(s.reason.startswith("audit: near tie") for s in stats[1:3])
    later = stats[3:]
    assert all(s.cause == Cause.SLOWER and "expected near-tie checks" in s.reason for s in later), \
        [s.reason for s in later]
    # the plan alone would have run cached (frames not planned at all: even the cheapest plan there would have)
    from incrinf.stream.decisions import cheapest_seconds

    cheapest = cheapest_seconds(next(iter(session._engines.values())).engine)
    assert all((s.predicted_cached if s.times.plan > 0 else cheapest) < s.predicted_full for s in later)


def test_a_check_rate_that_rejects_every_frame_is_probed_again():
    """The check rate is measured on frames that ran cached: once it sends every frame to full inference it would
    never be measured again, so a plan within PROBE_WITHIN of a full frame runs cached every PROBE_EVERY rejections,
    whatever the expected checks add."""
    from incrinf.stream.decisions import PROBE_EVERY, PROBE_WITHIN, Prediction, SpeedGuard

    guard = SpeedGuard()
    for _ in range(8):
        guard.record_check(True)
    stuck = Prediction(1.0, 0.6, guard.check_rate * 1.0)  # the plan saves 40%, a check every frame costs a frame
    assert not stuck.cached_faster and stuck.cached_total > PROBE_WITHIN * stuck.full
    choices = [guard.choose_cached(stuck) for _ in range(3 * PROBE_EVERY)]
    # each probe that confirms the rejections doubles the interval to the next
    assert choices == [False] * (PROBE_EVERY - 1) + [True] + [False] * (2 * PROBE_EVERY - 1) + [True]
    hopeless = Prediction(1.0, PROBE_WITHIN * 1.01, 0.0)  # the plan alone is far slower: never probed
    assert not any(guard.choose_cached(hopeless) for _ in range(2 * PROBE_EVERY))


def test_cost_calibration_takes_medians_of_ratios_per_kind():
    from incrinf.engine import FrameEngine
    from incrinf.engine.costs import RegionKind

    costs = FrameEngine(capture(wide_classifier(), (3, H, W))).costs
    assert not costs.profiled and costs.full_seconds == pytest.approx(costs.dense_total)
    for seconds in (0.010, 0.011, 0.5, 0.009):  # one load spike
        costs.record_full(seconds)
    assert costs.full_seconds == pytest.approx(0.0105)
    boxes = RegionKind.BOXES
    assert costs.call_ratio(boxes) == costs.compute_ratio(boxes) == 1.0  # nothing measured: as profiled
    costs.record_steps(boxes, [(1e-5, 0.0, 1e-4)])
    assert costs.call_ratio(boxes) == 1.0  # one frame (it may have paid one-time costs) sets nothing alone
    # per frame, the steps mostly fixed cost give the call ratio and the steps mostly arithmetic the compute ratio,
    # each as the sum of what they measured over the sum of what they were predicted: the large steps weigh
    calls = [(1e-5, 1e-7, 2e-5 * 1.01), (1e-5, 0.0, 2e-5), (1e-5, 0.0, 2e-5), (1e-5, 0.0, 2.1e-5)]
    computes = [(1e-7, 1e-3, 1.5e-3 * 1.0001), (0.0, 1e-3, 1.5e-3), (0.0, 1e-3, 1.6e-3), (0.0, 1e-3, 1.5e-3)]
    for _ in range(4):
        costs.record_steps(boxes, calls + computes)
    costs.record_steps(boxes, [(c, a, 50 * m) for c, a, m in calls + computes])  # a frame caught by a load spike
    assert costs.call_ratio(boxes) == pytest.approx(2.0, rel=0.02)  # ... moves neither
    assert costs.compute_ratio(boxes) == pytest.approx(1.525, rel=0.01)
    assert costs.box(0, 10) == pytest.approx(costs.call_ratio(boxes) * costs.steps[0].box_call
                                             + costs.compute_ratio(boxes) * costs.steps[0].per_position * 10)
    weighted = FrameEngine(capture(wide_classifier(), (3, H, W))).costs
    for _ in range(3):  # one large step at 3x and ten small ones at 1x: the frame took about 2.8x its prediction
        weighted.record_steps(boxes, [(0.0, 1e-2, 3e-2)] + [(0.0, 1e-4, 1e-4)] * 10)
    assert weighted.compute_ratio(boxes) == pytest.approx(3.1e-2 / 1.1e-2)
    assert costs.call_ratio(RegionKind.BLOCKS) == 1.0  # kinds are kept apart
    # pruning: a step that computed a fifth of its plan's positions in half of its boxes discounts that step's
    # arithmetic and its per-box cost, and no other step's
    assert costs.survival(1) == (1.0, 1.0)
    costs.record_survival(1, (100, 4), (20, 2))  # counts from the plan, no timing: one frame says it
    assert costs.survival(1) == pytest.approx((0.2, 0.5))
    for _ in range(4):
        costs.record_survival(1, (100, 4), (30, 4))
    assert costs.survival(1) == pytest.approx((0.3, 1.0)) and costs.survival(2) == (1.0, 1.0)
    costs.record_survival(0, (100, 1), (0, 0))  # a step whose plan had nothing gives no sample
    costs.record_survival(2, (0, 0), (5, 1))
    assert costs.survival(2) == (1.0, 1.0)
    # relative to an earlier step (regions already pruned there): the share between the two, at most 1
    for _ in range(8):
        costs.record_survival(2, (100, 4), (15, 4))
    assert costs.survival(2, since=1) == pytest.approx((0.5, 1.0))
    assert costs.survival(1, since=2) == pytest.approx((1.0, 1.0))


# --- quality ----------------------------------------------------------------------------------------------------

def _label(agreement: float, risk: float = 0.0) -> Comparison:
    return Comparison(OutputKind.LABEL, agreement, 0.1, risk, 0.5)


def test_quality_guard_tightens_on_misses_and_relaxes_while_the_target_holds():
    guard = QualityGuard(StreamConfig(audit_interval=2, keyframe_interval=16))
    assert (guard.interval, guard.level, guard.pixel_threshold) == (2, 0, 10.0)
    verdicts = [guard.record(_label(1.0), guard.interval) for _ in range(4)]
    # holding with room to spare: audits get rarer, up to the keyframe interval
    assert verdicts == [Verdict.RELAX] * 3 + [Verdict.HOLD] and guard.interval == 16
    assert guard.record(_label(0.0, 1.5), guard.interval) == Verdict.MISS  # a top-1 flip
    assert (guard.interval, guard.level) == (2, 1)
    assert guard.pixel_threshold == pytest.approx(6.0)
    assert guard.still_feature_threshold == pytest.approx(0.6 * StreamConfig.STILL_FEATURE_THRESHOLD)
    assert guard.record(_label(1.0, 0.4), 2) == Verdict.HOLD  # 0.4 at 2 frames would be 0.8 at 4: no relaxing
    assert guard.interval == 2
    for _ in range(10):
        guard.record(_label(1.0), guard.interval)
    assert guard.level == 0 and guard.pixel_threshold == 10.0  # relaxed back once the misses stopped
    summary = guard.summary
    assert summary.audits == 16 and summary.misses == 1 and summary.agreement == pytest.approx(15 / 16)


def test_the_full_audit_interval_relaxes_while_samples_stand_in_and_tightens_after_a_miss():
    """Sampled audits stand in for due full audits; a full one runs anyway every ``long_interval`` frames. That
    interval starts at ``keyframe_interval``, doubles after each such full audit that held with room to spare (up
    to 4x) and halves after a miss, and a sampled hold stretches the due interval up to it (no sample on every
    frame between ``keyframe_interval`` and the long interval)."""
    guard = QualityGuard(StreamConfig(audit_interval=2, keyframe_interval=8))
    assert guard.long_interval == 8 and guard.long_due(8) and not guard.long_due(7)
    assert guard.record(_label(1.0), 8) == Verdict.RELAX  # a long audit that held
    assert guard.long_interval == 16 and not guard.long_due(8) and guard.long_due(16)
    for _ in range(4):
        guard.sampled_hold()
    assert guard.interval == 16 and not guard.due(15) and guard.due(16)
    for _ in range(3):
        guard.record(_label(1.0), guard.long_interval)
    assert guard.long_interval == 32  # at most four times keyframe_interval
    guard.record(_label(1.0, 0.9), 32)  # held without room to spare: no relaxing
    assert guard.long_interval == 32
    guard.record(_label(0.0, 1.5), 32)  # a miss
    assert guard.long_interval == 16 and guard.interval == 2
    guard.record(_label(1.0), 4)  # a short audit that held does not relax the long interval
    assert guard.long_interval == 16
    assert QualityGuard(StreamConfig(keyframe_interval=0)).long_interval == 1024


def test_quality_guard_suspends_the_cache_after_misses_at_the_tightest_level():
    guard = QualityGuard(StreamConfig())
    for _ in range(LEVELS):
        guard.record(_label(0.0, 2.0), guard.interval)
    assert guard.level == LEVELS and not guard.suspended
    guard.record(_label(0.0, 2.0), guard.interval)
    assert guard.suspended
    guard.tick()
    guard.tick()
    assert not guard.suspended


def test_maps_miss_below_the_pixel_target_and_near_ties_are_checked_on_the_spot():
    guard = QualityGuard(StreamConfig(target_agreement=0.99))
    assert guard.risky(0.3)  # before the first audit every classifier frame is checked
    assert guard.risky(float("nan"))  # and every map (nothing has measured the thresholds on the model yet)
    guard.record(Comparison(OutputKind.MAP, 0.995, 0.01, 0.5), 4)
    assert guard.level == 0 and guard.interval == 4  # held, but without room to double
    assert not guard.risky(float("nan"))  # a map's audit held: its target is held by the audits
    guard.record(Comparison(OutputKind.MAP, 0.98, 0.02, 2.0), 4)
    assert guard.level == 1
    assert guard.risky(float("nan"))  # after a miss every cached map frame is checked until an audit holds
    guard = QualityGuard(StreamConfig(near_tie=1.0, trust_after=1))
    guard.record(Comparison(OutputKind.LABEL, 1.0, 0.1, 0.2, 0.5), 4)
    # one audit's loss is no bound on the next frame's: a margin just above it is still checked, one far above not
    assert guard.risky(0.4) and guard.risky(0.6) and not guard.risky(10.0)
    assert not QualityGuard(StreamConfig(near_tie=0)).risky(0.0)


def test_the_near_tie_reference_grows_with_drift_sample_error_and_few_audits():
    """The lead a cached frame may have lost is scaled from the audits to the frame: more frames since the last full
    one, or a larger sampled error on the frame itself, widen it (never narrow it), and a few audits that lost
    little do not make a margin a few times their loss safe (single frames' losses are heavy-tailed)."""
    config = StreamConfig(target_agreement=0.99)
    guard = QualityGuard(config)
    guard.record(Comparison(OutputKind.LABEL, 1.0, 0.01, 0.1, 0.04), 1)
    guard.probe_error(0.05)
    base = guard.lead_at_risk(1)
    assert guard.lead_at_risk(4) == pytest.approx(4 * base)  # three more frames of drift than the audit had
    assert guard.lead_at_risk(1, sampled_error=0.2) == pytest.approx(4 * base)  # four times the audit's probe error
    assert guard.lead_at_risk(1, sampled_error=0.01) == pytest.approx(base)  # never narrower than the audit's own
    guard.record(Comparison(OutputKind.LABEL, 1.0, 0.01, 0.1, 0.037), 3)
    # the case of an animated clip: audits lost 0.04 and 0.037, then a frame with margin 0.11 lost 0.13 and flipped;
    # the reference (what near_tie scales) is above that loss, the largest audit's loss was not
    assert guard.lead_at_risk(1) > 0.13
    assert guard.risky(guard.config.near_tie * 0.13, 1) and not guard.risky(10.0, 1)
    assert QualityGuard(StreamConfig(target_agreement=1.0)).risky(1e6)  # before any audit: always
    exact = QualityGuard(StreamConfig(target_agreement=1.0))
    exact.record(Comparison(OutputKind.LABEL, 1.0, 0.01, 0.1, 0.04), 1)
    assert exact.risky(1e6)  # every flip counts: every cached label output is checked


def test_the_near_tie_reference_grows_with_the_drift_the_audits_measured():
    """The frames since the last full one widen the reference as much as the audits at different distances show
    the loss growing (a fit on log scales, raised by its standard error): linearly until three audits at two
    distances were measured, not at all when audits far from the last full frame lost no more than audits right
    after it (the change mask bounds a still camera's drift), like the square root when the loss grew like it, and
    a loose fit counts on its cautious side."""
    def guard_with(*audits: tuple[float, int]) -> QualityGuard:
        guard = QualityGuard(StreamConfig(target_agreement=0.99))
        for lost, frames in audits:
            guard.record(Comparison(OutputKind.LABEL, 1.0, 0.01, 0.1, lost), frames)
        return guard

    single = guard_with((0.1, 1))
    assert single.drift_growth() == 1.0 and single.lead_at_risk(8) == pytest.approx(8 * single.lead_at_risk(1))
    assert guard_with((0.1, 1), (0.1, 4)).drift_growth() == 1.0  # two audits: too few to trust a flat fit
    flat = guard_with((0.1, 1), (0.1, 4), (0.1, 8))
    assert flat.drift_growth() == pytest.approx(0.0)
    assert flat.lead_at_risk(8) == pytest.approx(flat.lead_at_risk(1))
    root = guard_with((0.1, 1), (0.2, 4), (0.1 * 8 ** 0.5, 8))
    assert root.drift_growth() == pytest.approx(0.5)
    linear = guard_with((0.1, 1), (0.4, 4), (0.8, 8))
    assert linear.drift_growth() == pytest.approx(1.0)
    assert flat.lead_at_risk(8) < root.lead_at_risk(8) < linear.lead_at_risk(8)
    loose = guard_with((0.1, 1), (0.05, 2), (0.2, 3), (0.1, 4))  # scattered: the fit's slope is uncertain
    assert loose.drift_growth() > 0.3
    shrinking = guard_with((0.4, 1), (0.2, 2), (0.1, 4))
    assert shrinking.drift_growth() == 0.0  # never scaled down: a later frame is at least as far off as the audits


def test_a_margin_below_a_lead_change_the_audits_measured_is_checked_whatever_near_tie_says():
    """The case of an animated clip's cached frame: audits had measured lead changes of 0.042, 0.067 and 0.139,
    the frame's margin was 0.127 (it lost 0.128 and flipped). Even a small ``near_tie`` (where the quantile times
    near_tie is below the margin) checks it: the cache has been seen to be off by more than that margin. A margin
    above every measured change and above near_tie times the quantile is not checked."""
    guard = QualityGuard(StreamConfig(near_tie=0.02))
    for lost, frames in ((0.042, 1), (0.0665, 3), (0.139, 4)):
        guard.record(Comparison(OutputKind.LABEL, 1.0, 0.01, 0.1, lost), frames)
    assert guard.config.near_tie * guard.lead_at_risk(1) < 0.127  # the quantile alone would let it through
    assert guard.measured_loss(1) == pytest.approx(0.139)
    assert guard.risky(0.127, 1) and not guard.risky(0.15, 1)
    assert guard.measured_loss(1, sampled_error=math.nan) <= guard.lead_at_risk(1)
    assert not QualityGuard(StreamConfig(near_tie=0)).risky(0.0)  # 0: no checks at all


def _tie_frames() -> list[np.ndarray]:
    """A still camera: a square of the photo brightening by 4 levels a frame (a slow change the change mask and the
    feature threshold let the cache lag behind)."""
    photo = cv2.resize(skimage.data.chelsea(), (W, H), interpolation=cv2.INTER_AREA).astype(np.float32)
    out = []
    for k in range(32):
        frame = photo.copy()
        frame[24:40, 30:46] = np.clip(frame[24:40, 30:46] + 4.0 * k, 0, 255)
        out.append(frame.astype(np.uint8))
    return out


def test_a_cached_output_near_a_tie_that_flips_is_caught():
    """A classifier whose two classes tie halfway through a clip: its cached outputs lag the slow change, and without
    near-tie checks several frames answer the old class. With checks at the reference itself (``near_tie=1``: the
    quantile at the target of the audits' measured lead changes) every frame agrees with full inference. (The
    default, 0.02, is the leave-one-out choice over the clip set, where losses are less extreme than here: the
    flipping frames lose ten times the largest lead change the audits saw, and at 0.02 they are not checked.)"""
    frames = _tie_frames()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, stride=2, padding=1),
                          nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(32, 2)).eval()
    first, last = full_inference(model, frames[0])[0], full_inference(model, frames[-1])[0]
    with torch.no_grad():  # the tie halfway between the first and the last frame
        model[-1].bias[0] -= float(first[0] - first[1] + last[0] - last[1]) / 2
    reference = [int(full_inference(model, f).argmax()) for f in frames]
    assert len(set(reference)) == 2  # the top-1 does change along the clip

    def top1(**settings) -> list[int]:
        session = StreamSession(model, speed_guard=False, **settings)
        return [int(session(f).argmax()) for f in frames]

    assert top1(near_tie=0) != reference  # unchecked, the cache answers the old class on some frames
    assert top1(near_tie=1.0) == reference  # checked: every frame agrees


def test_injected_disagreements_raise_the_audit_rate_and_tighten_then_relax(frames):
    model = small_classifier()
    # max_backoff=0: the quality guard's own schedule (missed audits would otherwise start back-off stretches)
    session = StreamSession(model, speed_guard=False, audit_interval=2, keyframe_interval=4, near_tie=0,
                            max_backoff=0)
    session(frames[0])
    executor = next(iter(session._engines.values()))
    honest = executor.cached
    injecting = [False]

    def cached(*args, **kwargs):
        out = honest(*args, **kwargs)
        if injecting[0]:
            out = out.clone()
            out[0, int(out.argmin())] = out.max() + 1.0  # another class on top
        return out

    executor.cached = cached
    sequence = [frames[k % 2] for k in range(1, 81)]  # the square flickers between two places: cheap frames
    for k, frame in enumerate(sequence):
        injecting[0] = 12 <= k < 20
        session(frame)
    stats = session.stats[1:]
    levels = [s.guard_level for s in stats]
    audits = [s.audit for s in stats]
    assert levels[11] == 0 and max(levels[12:20]) >= 2  # tightened while the answers were wrong
    assert sum(audits[13:20]) > sum(audits[4:11])  # audited more often after the misses
    assert levels[-1] == 0  # relaxed again once they stopped
    assert sum(audits[-8:]) < sum(audits[13:20])
    assert session.agreement.misses >= 2 and session.agreement.agreement < 1.0


def test_reported_agreement_equals_agreement_measured_against_full_inference(frames):
    model = small_classifier()
    session = StreamSession(model, speed_guard=False, audit_interval=2, keyframe_interval=4, pixel_threshold=30,
                            feature_threshold=0.5)
    session(frames[0])
    executor = next(iter(session._engines.values()))
    honest, seen = executor.cached, {}

    def cached(*args, **kwargs):
        out = honest(*args, **kwargs)
        seen[len(session.stats)] = out.clone()
        return out

    executor.cached = cached
    for frame in frames[1:16]:
        session(frame)
    audited = [s.index for s in session.stats if s.audit]
    assert len(audited) >= 3
    measured = [float(int(seen[i].argmax()) == int(full_inference(model, frames[i]).argmax())) for i in audited]
    report = session.agreement
    assert report.audits == len(audited) and report.kind == OutputKind.LABEL
    assert report.agreement == pytest.approx(sum(measured) / len(measured))
    assert [session.stats[i].agreement for i in audited] == measured


# --- dense outputs ----------------------------------------------------------------------------------------------

class _DilatedFCN(nn.Module):
    """A fully convolutional segmenter in torchvision's shape: dilated backbone, head, upsampling, dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                                  nn.Conv2d(32, 32, 3, padding=2, dilation=2), nn.ReLU())
        self.head = nn.Conv2d(32, 5, 1)

    def forward(self, x):
        size = x.shape[-2:]
        out = self.head(self.body(x))
        return {"out": nn.functional.interpolate(out, size=size, mode="bilinear", align_corners=False)}


def _dense_models() -> dict:
    import torchvision

    from incrinf.testing.pnet import PNet

    torch.manual_seed(0)
    return {
        "dilated_fcn": _DilatedFCN().eval(),
        "pnet": PNet().eval(),
        "lraspp_mobilenet_v3_large": torchvision.models.segmentation.lraspp_mobilenet_v3_large(
            weights=None, weights_backbone=None).eval(),
    }


@pytest.fixture(scope="module")
def dense_models() -> dict:
    return _dense_models()


@pytest.mark.parametrize("name", ["dilated_fcn", "pnet", "lraspp_mobilenet_v3_large"])
def test_dense_sessions_equal_full_inference_with_thresholds_at_zero(dense_models, frames, name):
    model = dense_models[name]
    session = StreamSession(model, pixel_threshold=0.0, feature_threshold=0.0, max_ratio=1.0, speed_guard=False,
                            quality_guard=False)
    local = StreamSession(model, pixel_threshold=0.01, feature_threshold=0.0, speed_guard=False, quality_guard=False)
    for frame in frames[:3]:
        for s in (session, local):
            out = s(frame, homography=np.eye(3))
            ref = full_inference(model, frame)
            out_t, ref_t = (o["out"] if isinstance(o, dict) else o for o in (out, ref))
            torch.testing.assert_close(out_t, ref_t, rtol=1e-4, atol=1e-4 * float(ref_t.abs().max()))
            assert compare(out, ref, 0.99).agreement == 1.0
    assert [s.mode for s in session.stats] == ["full", "cached", "cached"]
    assert local.stats[-1].mode == "cached" and local.stats[-1].recompute_fraction < 0.5


def test_dense_quality_guard_measures_pixel_agreement(dense_models, frames):
    model = dense_models["dilated_fcn"]
    session = StreamSession(model, speed_guard=False, audit_interval=2, keyframe_interval=4)
    for frame in frames[:10]:
        session(frame)
    report = session.agreement
    assert report.kind == OutputKind.MAP and report.audits >= 2
    assert 0.5 < report.worst <= report.agreement <= 1.0


# --- failures and settings --------------------------------------------------------------------------------------

def test_a_failed_frame_keeps_the_guards_state(frames, monkeypatch):
    model = small_classifier()
    untimed_profile(monkeypatch)  # a timed profile of this small model may say no reuse under load: no cached frames
    session = StreamSession(model, audit_interval=2, keyframe_interval=8)
    for frame in frames[:8]:
        session(frame)
    from incrinf.engine.costs import RegionKind

    quality, costs = session._quality, next(iter(session._engines.values())).costs

    def speed_state():
        return (costs.full_seconds, *[(costs.call_ratio(k), costs.compute_ratio(k)) for k in RegionKind])

    before = (quality.level, quality.interval, quality.summary, speed_state())
    with pytest.raises(TypeError, match="uint8"):
        session(frames[8].astype(np.float32))
    executor = next(iter(session._engines.values()))
    honest = executor.cached
    executor.cached = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("simulated failure"))
    executor_full, executor_plain = executor.full, executor.plain
    executor.full = executor.plain = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("simulated failure"))
    with pytest.raises(RuntimeError, match="simulated"):
        session(frames[8])
    executor.cached, executor.full, executor.plain = honest, executor_full, executor_plain
    after = (quality.level, quality.interval, quality.summary, speed_state())
    assert after == before
    out = session(frames[8])
    assert session.stats[-1].cause == Cause.PREVIOUS_FAILED
    torch.testing.assert_close(out, full_inference(model, frames[8]), rtol=1e-4, atol=1e-4)
    session(frames[9])
    assert session.stats[-1].cause != Cause.PREVIOUS_FAILED


@pytest.mark.parametrize("kwargs, match", [
    ({"target_agreement": 0}, "target_agreement"),
    ({"target_agreement": 1.5}, "target_agreement"),
    ({"target_error": -1}, "target_error"),
    ({"audit_interval": 0}, "audit_interval"),
    ({"keep_stats": 0}, "keep_stats"),
    ({"near_tie": -1}, "near_tie"),
    ({"speed_guard": "yes"}, "speed_guard"),
])
def test_bad_guard_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StreamConfig(**kwargs)


def test_stream_cli_reports_the_guards(tmp_path, capsys):
    import argparse
    import csv

    from incrinf.cli import stream as cli

    parser = argparse.ArgumentParser(prog="incrinf")
    cli.register(parser.add_subparsers(dest="command", required=True))
    out_csv = tmp_path / "stats.csv"
    args = parser.parse_args(["stream", "--model", "resnet18", "--max-frames", "6", "--size", "64x80", "--quiet",
                              "--target-agreement", "0.95", "--audit-interval", "2", "--csv", str(out_csv)])
    assert args.func(args) == 0
    summary = capsys.readouterr().out
    assert "audited" in summary and "measured by the session's audits" in summary
    with open(out_csv) as fh:
        rows = list(csv.DictReader(fh))
    assert {"audit", "agreement", "predicted_full", "predicted_cached", "guard_level"} <= set(rows[0])
    for bad in (["--target-agreement", "1.5"], ["--audit-interval", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["stream", *bad])


def test_dependent_settings_adapt_instead_of_raising():
    # audits are keyframes: an audit interval longer than the keyframe interval counts as the keyframe interval
    config = StreamConfig(audit_interval=40, keyframe_interval=30)
    assert (config.audit_interval, config.first_audit_interval) == (40, 30)
    assert QualityGuard(config).interval == 30
    assert StreamConfig(keyframe_interval=1).every_frame_full
    assert StreamConfig(keyframe_interval=0, audit_interval=40).first_audit_interval == 40


class _SqueezeExcite(nn.Module):
    """Squeeze-excitation (a global pool whose result scales every position), then a convolution."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.fc = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        x = x * torch.sigmoid(self.fc(x.mean(dim=(2, 3), keepdim=True)))
        return torch.relu(self.conv(x))


def test_a_model_where_every_change_reaches_the_whole_output_runs_plain_from_the_plan():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), _SqueezeExcite(16), _SqueezeExcite(16),
                          _SqueezeExcite(16), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).eval()
    session = StreamSession(model)
    session._change.estimator = None  # no keypoint matching may run
    for frame in still_camera(6):
        out = session(frame)
        torch.testing.assert_close(out, full_inference(model, frame), rtol=1e-4, atol=1e-4)
    # recognised before the first cached frame (the smallest change already computes nearly everything)
    assert all(s.cause == Cause.NO_REUSE and s.mode == "full" for s in session.stats)
    assert "multiply-adds" in session.stats[0].reason
    assert all(s.times.match == s.times.mask == s.times.plan == 0 for s in session.stats)
    assert not next(iter(session._engines.values())).has_cache  # nothing kept either



def _dense_convs() -> nn.Module:
    """A fully convolutional model with a (1, 4, H, W) score map, wide enough that a small change is clearly
    cheaper to recompute than a full frame."""
    torch.manual_seed(3)
    layers = []
    for c_in, c_out in ((3, 64), (64, 64), (64, 64), (64, 64)):
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers, nn.Conv2d(64, 4, 1)).eval()


def test_a_sampled_audit_detects_an_injected_drift(frames, monkeypatch):
    model = _dense_convs()
    # a small model at a small size: one tile's cone is a good part of a frame, so the budget is set higher
    session = StreamSession(model, audit_interval=2, keyframe_interval=64, feature_threshold=0.0, sample_budget=0.8,
                            max_backoff=0)
    session(frames[0])  # the first frame profiles the engine and picks the sampled audits' probe
    # the frames must run cached for samples to run: from here on the plan's multiply-adds and bytes alone decide,
    # whatever the machine's load (at this size a cached frame's Python overhead, which a calibration from
    # wall-clock times would add, is close to a full frame's time)
    frozen_costs(session, monkeypatch)
    for frame in frames[1:8]:
        session(frame)
    sampler = next(iter(session._samplers.values()))
    assert sampler.ready and sampler.probe is not None  # a full audit held: samples stand in for the next ones
    honest = [s for s in session.stats if not math.isnan(s.sampled_error)]
    assert honest and all(s.cause != Cause.AUDIT for s in honest)  # exact propagation: nothing drifts
    # drift: the cached probe tensor's values go stale everywhere (as if many frames of sub-threshold changes had
    # been reused), which no change mask reports
    # every cached tensor is made stale, not only the probe: the probe is picked by its cone's measured cost, and
    # when it is a tensor a dense tail recomputes whole each frame, drift injected there alone is overwritten
    engine = next(iter(session._engines.values())).engine
    noise = torch.Generator().manual_seed(0)
    for rows in engine.cache.buffers.values():
        rows.add_(torch.randn(rows.shape, generator=noise) * rows.abs().mean())
    start = len(session.stats)
    for frame in frames[8:14]:
        session(frame)
    checked = [s for s in session.stats[start:] if not math.isnan(s.sampled_error)]
    assert checked, "no sampled audit ran"
    first = checked[0]
    assert first.sampled_error > 10 * max(s.sampled_error for s in honest) and first.cause == Cause.AUDIT
    assert first.agreement is not None  # the flagged frame was audited in full (and returned full inference)
    torch.testing.assert_close(session(frames[14]), full_inference(model, frames[14]), rtol=1e-3, atol=1e-3)


def _dilated() -> nn.Module:
    """A dense model whose exact receptive field soon covers its whole (small, deep) map, with no tail after its
    local part: exactly propagated, the smallest change recomputes nearly everything; pruned, it may die down to a
    few positions."""
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(32, 96, 3, stride=2, padding=1),
              nn.ReLU()]
    for _ in range(9):  # wide enough that a step's fixed cost is small against its map's
        layers += [nn.Conv2d(96, 96, 3, padding=2, dilation=2), nn.ReLU()]
    return nn.Sequential(*layers, nn.Conv2d(96, 2, 1)).eval()


def _heavy_head() -> nn.Module:
    """A cheap local stem, then a global-pooling branch that scales every position of a heavy head: every change
    reaches the head, whatever pruning does before it."""
    torch.manual_seed(0)

    class HeavyHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
            self.fc = nn.Conv2d(8, 8, 1)
            self.head = nn.Sequential(nn.Conv2d(8, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                                      nn.ReLU(), nn.Conv2d(32, 2, 1))

        def forward(self, x):
            x = torch.relu(self.stem(x))
            return self.head(x * torch.sigmoid(self.fc(x.mean(dim=(2, 3), keepdim=True))))

    return HeavyHead().eval()


def test_the_no_reuse_decision_counts_the_floor_pruning_cannot_cut(frames):
    from incrinf.engine import FrameEngine
    from incrinf.stream.decisions import best_saving

    dilated = FrameEngine(capture(_dilated(), (3, H, W)))
    head = FrameEngine(capture(_heavy_head(), (3, H, W)))
    # exact: the smallest change already computes most of a frame on both; pruned, only the head's floor stays high
    assert best_saving(dilated) < 0.3 and best_saving(head) < 0.3
    assert best_saving(dilated, pruning=True) > 0.9
    assert best_saving(head, pruning=True) < 0.3
    floor_flops, _ = head.floor()
    assert floor_flops >= head.program.tail_flops > 0.7 * head.program.full_flops
    for model, pruned_reuse in ((_dilated(), True), (_heavy_head(), False)):
        for threshold, reuse in ((None, pruned_reuse), (0.0, False)):
            session = StreamSession(model, feature_threshold=threshold)
            for frame in frames[:5]:
                torch.testing.assert_close(session(frame), full_inference(model, frame), rtol=1e-4, atol=1e-4)
            no_reuse = [s.cause == Cause.NO_REUSE for s in session.stats[1:]]
            assert not any(no_reuse) if reuse else all(no_reuse), (type(model).__name__, threshold)


def test_the_cost_model_prices_a_cached_frame_with_what_frames_measured_outside_their_steps():
    """A plan whose steps predict 7 ms while cached frames like it measured 25 ms, 18 ms of it outside the steps
    (copies, index maps, bookkeeping), is predicted at 25 ms, and sent to full inference when that is slower: one
    calibration of the cost model, its fixed cost per frame, not a second scale on top of the plan."""
    from types import SimpleNamespace

    from incrinf.engine import FrameEngine
    from incrinf.engine.costs import SAMPLES, RegionKind
    from incrinf.engine.frame_regions import plan_seconds
    from incrinf.stream.decisions import SpeedGuard

    engine = FrameEngine(capture(wide_classifier(), (3, H, W)))
    costs, boxes = engine.costs, RegionKind.BOXES
    plan = engine.plan_boxes([(0, 8, 0, 8)])
    steps = plan.seconds - costs.frame_seconds(boxes)
    full = SimpleNamespace(full_seconds=steps + 0.013)
    guard = SpeedGuard()
    assert guard.predict(full, plan).cached_faster
    for outside in (0.018, 0.017, 0.019, 0.018, 0.5):  # one load spike (the profile stands in for two frames)
        costs.record_frame(boxes, outside)
    assert costs.frame_seconds(boxes) == pytest.approx(0.018) and costs.frame_seconds(RegionKind.BLOCKS) == 0.0
    plan = engine.plan_boxes([(0, 8, 0, 8)])  # a kept plan is priced with the current calibration
    assert plan.seconds == pytest.approx(steps + 0.018)
    assert plan_seconds(engine.program, costs, plan.parts) == pytest.approx(plan.seconds)
    assert not guard.predict(full, plan).cached_faster
    for _ in range(SAMPLES):  # the fixed cost got small again: the latest frames decide
        costs.record_frame(boxes, 0.001)
    assert engine.plan_boxes([(0, 8, 0, 8)]).seconds == pytest.approx(steps + 0.001)
    assert guard.predict(full, engine.plan_boxes([(0, 8, 0, 8)])).cached_faster


def test_a_plan_that_switches_but_whose_change_dies_is_predicted_cached_faster():
    """The speed guard's case that per-step shares got wrong, from the plan's counts alone (coefficients injected,
    no wall time): a change over the whole frame is planned to switch to the dense rest after its first
    convolution, so the plan priced step by step, with the median shares pruning left at each step, costs its
    first step *and* the dense rest: more than a full frame, and the frame ran full. But on a still camera whose
    changes die at the first commit (value-based pruning finds no feature that moved), a pruned walk decides again
    at the cut point and carries its nothing on: it computes the first step alone. Priced frame by frame, with
    the walk's own decision at the cut point, the prediction is what such frames computed, and the frame runs
    cached."""
    from incrinf.engine import FrameEngine
    from incrinf.engine.costs import RegionKind
    from incrinf.stream.decisions import SpeedGuard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(32, 32, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(32, 10)).eval()
    x0 = torch.randn(1, 3, H, W, generator=torch.Generator().manual_seed(2))
    engine = FrameEngine(capture(model, (3, H, W)))
    engine.full(x0)
    costs, steps = engine.costs, engine.program.steps
    n = len(steps)
    costs.set_profile([s.flops * 1e-10 for s in steps], [3e-5] * n, [3e-5] * n, 2e-4, costs.move, 1e-4)
    box, changed = (0, H, 0, W), np.ones((H, W), bool)
    guard = SpeedGuard()

    def old_rule(plan) -> float:
        """The plan priced step by step up to its switch with the per-step median shares, and its dense rest."""
        parts = plan.parts
        seconds = costs.frame_seconds(RegionKind.BOXES)
        for index, (fixed, arithmetic) in enumerate(parts.steps[:parts.switch + 1]):
            area_share, box_share = costs.survival(index)
            seconds += box_share * costs.call_ratio(RegionKind.BOXES) * fixed \
                + area_share * costs.compute_ratio(RegionKind.BOXES) * arithmetic
        return seconds + costs.dense_ratio * parts.dense

    computed = []
    for _ in range(3):  # faint changes: every one dies at the first commit
        engine.full(x0)
        plan = engine.plan_boxes([box])
        engine.cached(x0 + 1e-6, changed, feature_threshold=0.35, plan=plan)
        computed.append(engine.last.predicted)
    plan = engine.plan_boxes([box])
    assert plan.switch == steps[0].out  # the plan, on its unpruned geometry, switches after the first step
    full = costs.dense_total
    assert old_rule(plan) > full  # the old rule: "cached slower", the frame runs full
    assert max(computed) < 0.2 * full  # what those frames computed
    prediction = guard.predict(costs, plan)
    assert prediction.cached == pytest.approx(computed[-1]) and prediction.cached_faster
    assert guard.choose_cached(prediction)
