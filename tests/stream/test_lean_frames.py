"""The lean frame: work the decision does not need is skipped (incrinf.stream.session, decisions, backoff, camera).

Decisions here rest on injected costs and outcomes, never on wall-clock timings: the speed guard's coefficients are
frozen at the plan's priors, near ties and flipped outputs are injected.
"""

import math

import cv2
import numpy as np
import pytest
import skimage.data
import torch
from stream_scenes import H, W, frozen_costs, full_inference, still_camera, wide_classifier

from incrinf import models
from incrinf.stream.backoff import BackOff
from incrinf.stream.camera import CameraEngine
from incrinf.stream.config import StreamConfig
from incrinf.stream.decisions import PROBE_EVERY, cheapest_seconds
from incrinf.stream.session import StreamSession
from incrinf.stream.stats import Cause

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def frames() -> list[np.ndarray]:
    return still_camera(24)






def test_no_frame_is_planned_while_a_near_tie_check_is_certain(frames, monkeypatch):
    """After the first audit, a cached frame whose previous output was a near tie would be checked by full inference
    (a near tie lasts over frames): the cheapest plan there is plus that check costs a full frame, and the session
    knows it before the frame's stillness test, matching, mask and plan, runs it plain without them, and plans (and
    probes) a frame only now and then, at intervals that double while the probes confirm it (8, then 16 frames)."""
    model = wide_classifier()
    # backoff_after=64: no back-off stretch (whether a checked frame paid is measured in wall time)
    session = StreamSession(model, feature_threshold=0.0, audit_interval=64, keyframe_interval=64,
                            sampled_audits=False, input_size=(H, W), backoff_after=64, trust_after=1)
    costs = frozen_costs(session, monkeypatch)
    session._quality.risky = lambda margin, *_: True  # every output's top-1 is a near tie
    n = 2 + 3 * PROBE_EVERY + 2
    engine = next(iter(session._engines.values())).engine
    kept = []
    for k in range(n):
        frame = frames[k % len(frames)]
        torch.testing.assert_close(session(frame), full_inference(model, frame), rtol=1e-4, atol=1e-4)
        kept.append(engine.has_cache)
    assert cheapest_seconds(engine) < costs.full_seconds  # the plan alone would pay
    stats = session.stats[1:]
    assert stats[0].cause == Cause.AUDIT  # checked by rule: the guard's first measurement
    planned = [s for s in stats[1:] if s.times.plan > 0]
    skipped = [s for s in stats[1:] if s.times.plan == 0]
    assert all(s.cause == Cause.SLOWER and "expected near-tie checks" in s.reason for s in skipped)
    assert all(s.times.match == s.times.mask == 0 and math.isnan(s.predicted_cached) for s in skipped)
    # the probes run cached (and are checked: audits), 8 and then 16 frames apart
    assert [s.index for s in planned] == [1 + PROBE_EVERY, 1 + 3 * PROBE_EVERY], [s.reason for s in stats]
    assert all(s.cause == Cause.AUDIT for s in planned)
    # a skipped frame runs plain (keeps no cache) unless the next frame is a probe's
    assert all(kept[s.index] == (s.index + 1 in {p.index for p in planned}) for s in skipped)


def test_probes_grow_rare_while_they_confirm_and_start_anew_after_a_frame_that_pays():
    from incrinf.stream.decisions import Prediction, SpeedGuard

    guard = SpeedGuard(max_interval=4 * PROBE_EVERY)
    stuck = Prediction(1.0, 0.6, 1.0)  # the plan saves 40%, a certain check costs a frame
    probes = [i for i in range(1, 8 * PROBE_EVERY) if guard.choose_cached(stuck)]
    gaps = [b - a for a, b in zip([0, *probes], probes)]
    assert gaps == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY]  # doubling up to the longest stretch
    assert guard.choose_cached(Prediction(1.0, 0.3))  # a frame that pays on its own
    assert [guard.choose_cached(stuck) for _ in range(PROBE_EVERY)] == [False] * (PROBE_EVERY - 1) + [True]


def test_a_missed_audit_is_a_miss_that_costs_its_cached_run():
    """An audit whose cached output missed the target was an attempt in vain: a miss whose cost is the decision and
    the cached run (what it spent on top of the full frame); an audit that held is no attempt."""
    full = 0.036
    backoff = BackOff(StreamConfig(backoff_after=3, max_backoff=64))
    assert backoff.paid(Cause.AUDIT, True, math.inf, full, 0.020, 0.003) is None
    for _ in range(3):
        paid = backoff.paid(Cause.AUDIT, True, math.inf, full, 0.020, 0.003, missed_audit=True)
        assert paid is False
        backoff.count(Cause.AUDIT, paid, full)
    assert list(backoff._savings) == [-0.020] * 3
    # a stretch sized by what the misses cost: its one attempt at the end costs at most 2% of it
    assert backoff.active and backoff.stretch == math.ceil(0.020 / (0.02 * full))


def test_a_near_tie_check_that_missed_counts_as_a_miss(frames):
    model = wide_classifier()
    session = StreamSession(model, audit_interval=64, keyframe_interval=64, feature_threshold=0.0)
    session._quality.risky = lambda margin, *_: True
    session(frames[0])
    session._warm.add(next(iter(session._engines)))  # past the first cached frame (one-time costs: no attempt)
    executor = next(iter(session._engines.values()))
    honest = executor.cached

    def flipped(*args, **kwargs):  # the cached output answers another class
        out = honest(*args, **kwargs).clone()
        out[0, int(out.argmin())] = out.max() + 1.0
        return out

    executor.cached = flipped
    taken = []
    paid = session._backoff.paid

    def spy(*args):
        taken.append(args)
        return paid(*args)

    session._backoff.paid = spy
    session(frames[1])
    checked = session.stats[1]
    assert checked.audit and "miss" in checked.reason, checked.reason
    cause, attempt, _, _, seconds, overhead, missed, _ = taken[0]
    assert cause == Cause.AUDIT and attempt and missed
    assert overhead < seconds and seconds + checked.times.audit <= checked.seconds  # the cached run, not the check
    assert session._backoff.misses == 1


def test_an_unusable_motion_is_told_without_building_the_index_maps(monkeypatch):
    """A sub-stride pan leaves most of the first cached map misaligned: that share is estimated on a subgrid of the
    map, and the full index maps (the costly part) are built only for a motion the frame can use."""
    model = models.load("mobilenet_v2")
    photo = cv2.resize(skimage.data.chelsea(), (320, 240), interpolation=cv2.INTER_AREA)
    session = StreamSession(model, speed_guard=False, quality_guard=False, still_fraction=0)
    session(np.ascontiguousarray(photo[40:120, 60:156]))
    engine = next(iter(session._engines.values()))
    calls = []
    original = CameraEngine._warp_maps
    monkeypatch.setattr(CameraEngine, "_warp_maps", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    for shift in (3.0, 5.0, 1.3):
        pan = np.array([[1.0, 0, -shift], [0, 1, 0], [0, 0, 1]])
        estimate = engine.unusable_fraction(pan)
        assert estimate > engine.dense_cut and calls == []
        exact = original(engine, pan)[engine.engine.first_resolution].invalid.mean()
        assert abs(estimate - exact) < 0.05
    usable = np.array([[1.0, 0, -32.0], [0, 1, 0], [0, 0, 1]])  # a whole-position pan: reads its sources exactly
    assert engine.unusable_fraction(usable) <= engine.dense_cut and calls == [1]


def test_a_clear_shift_that_misaligns_the_cache_skips_the_keypoint_fit(monkeypatch):
    """A camera that moved by a clear 3 px (1.5 positions of the first, stride-2, map): the still-camera test's phase
    correlation measures the shift, its translation alone leaves the cache misaligned, and the frame runs full without
    detecting a keypoint; a sub-pixel jitter is still taken as a still camera."""
    model = models.load("mobilenet_v2")
    photo = cv2.resize(skimage.data.chelsea(), (320, 240), interpolation=cv2.INTER_AREA)
    session = StreamSession(model, speed_guard=False, quality_guard=False, max_backoff=0)
    detections = []
    detect = session._change.estimator.detect
    monkeypatch.setattr(session._change.estimator, "detect", lambda frame: detections.append(1) or detect(frame))
    session(np.ascontiguousarray(photo[40:120, 60:156]))
    moved = np.ascontiguousarray(photo[40:120, 63:159])
    torch.testing.assert_close(session(moved), full_inference(model, moved), rtol=1e-4, atol=1e-4)
    stats = session.stats[-1]
    assert stats.cause == Cause.CACHE_UNUSABLE and "clear 3.0 px shift" in stats.reason, stats.reason
    assert detections == [] and stats.times.mask == 0
    session(moved)  # the same view again: still
    assert session.stats[-1].cause == Cause.CACHED


def test_one_miss_starts_a_stretch_by_default_unless_the_attempts_around_it_saved():
    """The default back-off (``backoff_after=1``, the leave-one-out choice): a miss starts a stretch of plain frames
    while the recent attempts saved nothing, not while hits around it saved."""
    full = 0.036
    first = BackOff(StreamConfig())
    paid = first.paid(Cause.CACHE_UNUSABLE, True, math.inf, full, 0.004, 0.004)
    first.count(Cause.CACHE_UNUSABLE, paid, full)
    assert first.active and first.stretch == math.ceil(0.004 / (0.02 * full))
    saving = BackOff(StreamConfig())
    for cause, seconds in [(None, 0.015), (None, 0.015), (Cause.CACHE_UNUSABLE, 0.004)]:
        saving.count(cause, saving.paid(cause, True, math.inf, full, seconds, 0.004), full)
    assert saving.misses == 1 and not saving.active


def test_a_dropped_cache_is_refilled_only_for_a_probe_after_a_refill_went_unused(frames, monkeypatch):
    """A frame whose cache was dropped (the frame before ran plain) refills it by a full run, which writes every map:
    while the latest such refill went unused (the frame after it was a near tie that no plan can pay for), the next
    ones run plain and count towards the speed guard's probe, and the frame before the probe refills."""
    model = wide_classifier()
    session = StreamSession(model, feature_threshold=0.0, audit_interval=64, keyframe_interval=64,
                            sampled_audits=False, input_size=(H, W), backoff_after=64, trust_after=1)
    frozen_costs(session, monkeypatch)
    engine = next(iter(session._engines.values())).engine
    # after the first frames, every other output is a near tie whose check no cached frame can pay for
    monkeypatch.setattr(session, "_check_certain", lambda: session._index >= 2 and session._index % 2 == 0)
    kept = []
    for k in range(2 + 2 * PROBE_EVERY):
        frame = frames[k % len(frames)]
        torch.testing.assert_close(session(frame), full_inference(model, frame), rtol=1e-4, atol=1e-4)
        kept.append(engine.has_cache)
    stats = session.stats
    refills = [s.index for s in stats if s.cause == Cause.NO_CACHE and kept[s.index]]
    plain = [s.index for s in stats if s.cause == Cause.NO_CACHE and not kept[s.index]]
    planned = [s.index for s in stats[2:] if s.times.plan > 0]
    assert refills and plain, [(s.cause, kept[s.index]) for s in stats]
    first = refills[0]
    assert stats[first + 1].cause == Cause.SLOWER and stats[first + 1].times.plan == 0  # the refill went unused
    # after a refill that went unused, a dropped cache is refilled only right before a probe (a planned frame); after
    # one that was used, as before
    for before, after in zip(refills, refills[1:]):
        assert before + 1 in planned or after + 1 in planned, (refills, planned)
        assert all(before + 1 not in planned for i in plain if before < i < after), (refills, plain, planned)
    assert all(i > first for i in plain) and len(plain) >= 2, (refills, plain, planned)


def _zoomed_view(photo: np.ndarray, zoom: float, shift: float) -> np.ndarray:
    """A 112 x 112 view of the middle of ``photo`` zoomed by ``zoom`` about it and moved ``shift`` px to the right."""
    h, w = photo.shape[:2]
    cx, cy = (w - 1) / 2, (h - 1) / 2
    matrix = np.float32([[zoom, 0, cx - zoom * cx + shift], [0, zoom, cy - zoom * cy]])
    moved = cv2.warpAffine(photo, matrix, (w, h), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT_101)
    return np.ascontiguousarray(moved[cy.__floor__() - 56:cy.__floor__() + 56, cx.__floor__() - 56:cx.__floor__() + 56])


def test_a_zoom_that_misaligns_the_cache_at_any_shift_is_told_by_the_quarters(monkeypatch):
    """A camera that zooms by 2% while it pans 4 px (two positions of the first, stride-2, map: the translation
    alone keeps the cache aligned): the quarters' shifts show the zoom, which leaves the cache misaligned whatever
    the exact translation, and the frame runs full without detecting a keypoint. The pan alone is matched and
    cached."""
    model = models.load("mobilenet_v2")
    photo = cv2.resize(skimage.data.chelsea(), (320, 240), interpolation=cv2.INTER_AREA)
    session = StreamSession(model, speed_guard=False, quality_guard=False, max_backoff=0)
    engine_shape = (1, 3, 112, 112)
    detections = []
    detect = session._change.estimator.detect
    monkeypatch.setattr(session._change.estimator, "detect", lambda frame: detections.append(1) or detect(frame))
    first = _zoomed_view(photo, 1.0, 0.0)
    session(first)
    zoomed = _zoomed_view(photo, 1.02, 4.0)
    torch.testing.assert_close(session(zoomed), full_inference(model, zoomed), rtol=1e-4, atol=1e-4)
    stats = session.stats[-1]
    assert stats.cause == Cause.CACHE_UNUSABLE and "zoom or rotation" in stats.reason, stats.reason
    assert detections == [] and stats.times.mask == 0
    engine = session._engines[engine_shape]
    for dx in (0.0, 0.7, 1.3, 2.5):  # a pure pan: only the uncovered border is lost at the best nearby translation
        pan = np.array([[1.0, 0, dx], [0, 1, 0], [0, 0, 1]])
        assert engine.unusable_at_any_shift(pan) < 0.1
    assert engine.estimate_unusable(np.array([[1.0, 0, 1.3], [0, 1, 0], [0, 0, 1]])) > engine.dense_cut  # that one
    session(first)
    panned = _zoomed_view(photo, 1.0, 4.0)
    session(panned)
    assert session.stats[-1].cause == Cause.CACHED and detections, session.stats[-1].reason


def test_a_probe_after_a_zoom_asks_the_pixels_before_the_cache_is_filled(monkeypatch):
    """A camera that keeps zooming: every probe after a back-off stretch is ruled out by the pixels (the quarters'
    shifts), so the stretch's last frame runs plain instead of filling the cache for it; after the first frame no
    frame writes the cache, and every output is full inference's."""
    model = models.load("mobilenet_v2")
    photo = cv2.resize(skimage.data.chelsea(), (320, 240), interpolation=cv2.INTER_AREA)
    frames = [_zoomed_view(photo, 1.02 ** k, 4.0 * k) for k in range(16)]
    # stretches of 2, then 4 frames (without the speed guard they double; not sized by timings)
    session = StreamSession(model, quality_guard=False, speed_guard=False, max_backoff=4)
    filled = []
    full = CameraEngine.full
    monkeypatch.setattr(CameraEngine, "full", lambda self, x: filled.append(1) or full(self, x))
    for frame in frames:
        torch.testing.assert_close(session(frame), full_inference(model, frame), rtol=1e-4, atol=1e-4)
    causes = [s.cause for s in session.stats]
    probes = [s for s in session.stats[1:] if s.cause == Cause.CACHE_UNUSABLE]
    assert Cause.BACKING_OFF in causes and len(probes) >= 3, causes
    # told by the pixels: a translation that alone misaligns the cache, or the quarters' zoom
    assert all("zoom or rotation" in s.reason or "clear" in s.reason for s in probes), [s.reason for s in probes]
    assert len(filled) == 1, causes  # the first frame's


def test_the_first_cached_frame_is_no_attempt_for_the_back_off(frames):
    """The first frame of a size to run the cached path pays one-time costs (its box shapes' kernels, the maps'
    first touches): however slow it ran it is no miss for the back-off (it counts if it paid); the next cached
    frame is judged like any."""
    session = StreamSession(wide_classifier(), audit_interval=64, keyframe_interval=64, trust_after=1)
    taken = {}
    paid = session._backoff.paid

    def spy(*args):
        taken[session._index] = (args[-1], paid(*args))  # (warming, what the back-off took)
        return taken[session._index][1]

    session._backoff.paid = spy
    for frame in frames[:12]:
        session(frame)
    ran_cached = [s.index for s in session.stats  # cached, or checked after its cached run
                  if s.cause in (Cause.CACHED, Cause.AUDIT) and not math.isnan(s.predicted_cached)]
    assert len(ran_cached) >= 2, [s.reason for s in session.stats]
    first, second = taken[ran_cached[0]], taken[ran_cached[1]]
    assert first[0] and first[1] is not False  # a hit or nothing, never a miss
    assert not second[0] and second[1] is not None  # judged like any cached frame


def test_the_back_off_judges_a_cached_run_by_the_price_of_what_it_computed(frames):
    """A cached frame caught by a load spike (here: 0.3 s of sleep inside its engine call) is judged by the back-off
    at the cost model's price of what it computed (its boxes, positions and dense rest, calibrated), not at its wall
    time: one such frame no longer starts a stretch of plain frames sized by the spike."""
    import time

    session = StreamSession(wide_classifier(), audit_interval=64, keyframe_interval=64, trust_after=1)
    taken = {}
    paid = session._backoff.paid

    def spy(*args):
        taken[session._index] = args
        return paid(*args)

    session._backoff.paid = spy
    session(frames[0])
    executor = next(iter(session._engines.values()))
    honest = executor.cached

    def spiked(*args, **kwargs):
        time.sleep(0.3)
        return honest(*args, **kwargs)

    executor.cached = spiked
    for frame in frames[1:6]:
        session(frame)
    ran = [s for s in session.stats if s.cause == Cause.CACHED]
    assert ran, [s.reason for s in session.stats]
    for s in ran:
        cause, _, _, _, seconds, overhead, *_ = taken[s.index]
        assert s.times.engine >= 0.3 and seconds < 0.3  # the spike is in the wall time, not in the judged time
        assert seconds >= overhead
