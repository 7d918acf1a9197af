"""A camera stream session: full inference on the first frame, then reuse through the homography (CacheInf).

Per frame: the frame becomes the model's input (:mod:`~incrinf.stream.inputs`); :mod:`~incrinf.stream.change_finder`
finds what changed: the homography previous ->
current is estimated on the same pixels the model sees (skipped on a still camera:
:mod:`~incrinf.stream.stillness`), the previous frame's *reference* (the pixels the cache stands for) is warped
into the current view, and the cells where it differs by at least ``pixel_threshold`` become the change mask. The
engine (:class:`~incrinf.stream.camera.CameraEngine` over :class:`~incrinf.engine.FrameEngine`) then recomputes
what the mask reaches and reads the rest from the cache. A frame falls back to full inference (and refills the
cache) on the first frame, a failed match, a frame size change, too large a changed fraction and after a frame
that raised; frames that tried the cache in vain start a back-off (:mod:`~incrinf.stream.backoff`).

Two guards (:mod:`incrinf.stream.guards`) keep the session's promise, the same answers sooner, on any clip: the
speed guard runs a frame fully when the cached path would not be faster, and the quality guard audits frames
against full inference (each audit is a keyframe) and adapts the thresholds and the audit interval to hold
``target_agreement``. Without the quality guard a keyframe comes every ``keyframe_interval`` frames. This module
only orchestrates; what a frame did is a :class:`~incrinf.stream.stats.FrameStats`.
"""

from __future__ import annotations

import gc
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from incrinf.engine import CacheMemory
from incrinf.graph import capture, has_windows
from incrinf.normalization import Normalization
from incrinf.stream.agreement import Comparison, Leads, OutputKind, compare, top_leads
from incrinf.stream.audits import SampledAudit
from incrinf.stream.backoff import BackOff
from incrinf.stream.camera import CameraEngine
from incrinf.stream.change_finder import ChangeFinder
from incrinf.stream.config import StreamConfig
from incrinf.stream.decisions import Prediction, SpeedGuard, best_saving, plan_kind
from incrinf.stream.frame_state import Fallback, FrameState
from incrinf.stream.guards import Agreement, QualityGuard, Verdict
from incrinf.stream.inputs import FrameInput
from incrinf.stream.stats import Cause, FrameLog, FrameStats, FrameTimes
from incrinf.validation import check_homography

# Frames that tried the cache in vain; they count towards a back-off.
_MISSES = (Cause.MATCH_FAILED, Cause.CACHE_UNUSABLE, Cause.CHANGED_FRACTION)


class StreamSession:
    """Run a CNN on a camera stream, recomputing per frame only what the camera's motion does not explain.

    Example:
        >>> session = StreamSession(incrinf.models.load("efficientnet_lite0"))  # doctest: +SKIP
        >>> for frame in read_frames(bundled_video_path("carphone_pristine")):  # doctest: +SKIP
        ...     logits = session(frame)
        >>> session.stats[-1]  # doctest: +SKIP
        FrameStats(index=..., mode='cached', reason='ok', ...)

    Args:
        model: any ``torch.fx``-traceable CNN; the session works on a private copy of it.
        config: the stream settings (:class:`~incrinf.stream.config.StreamConfig`; default: its defaults).
        input_size: (H, W) the model sees; default: the frame's size, scaled up if a side is below 64.
        preprocess: ``frame (H, W, 3) uint8 -> (3, H', W') float tensor``; default: resize to ``input_size``
            and normalise with ``mean``/``std``.
        device: where the model runs (default: where its parameters are).
        mean, std: per-channel normalisation of the default preprocessing; also used to turn tensor frames
            back into pixels for matching (defaults: EfficientNet-Lite's 0.5, 0.5).
        **settings: any :class:`~incrinf.stream.config.StreamConfig` field (``pixel_threshold=``,
            ``feature_threshold=``, ...), replacing the one in ``config``.

    Attributes:
        stats: a :class:`~incrinf.stream.stats.FrameStats` per frame, the newest ``keep_stats``.

    Raises:
        CaptureError: the model cannot be traced.
        TypeError: an unknown setting.
        ValueError: bad settings, or a model with no convolution or pooling layer (nothing a cache could
            reuse: there is no always-full mode, run the model directly instead).
    """

    def __init__(
        self,
        model: nn.Module,
        config: StreamConfig | None = None,
        *,
        input_size: tuple[int, int] | None = None,
        preprocess: Callable[[np.ndarray], torch.Tensor] | None = None,
        device: torch.device | str | None = None,
        mean: tuple[float, float, float] = (0.5, 0.5, 0.5),
        std: tuple[float, float, float] = (0.5, 0.5, 0.5),
        **settings: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.config = StreamConfig.build(config, **settings)
        if not has_windows(model):
            raise ValueError(f"{type(model).__name__} has no convolution or pooling layer: nothing to reuse "
                             "across frames (run the model directly)")
        self.model = model
        param = next(iter(model.parameters()), None)
        self.device = torch.device(device) if device is not None else (
            param.device if param is not None else torch.device("cpu"))
        self.inputs = FrameInput(Normalization(mean, std), input_size, preprocess, self.device)
        self._change = ChangeFinder(self.config)
        self._engines: dict[tuple[int, ...], CameraEngine] = {}
        self._no_reuse: dict[tuple[int, ...], str] = {}  # frame shapes on which the cache cannot pay, and why
        self._warm: set[tuple[int, ...]] = set()  # frame shapes that ran the cached path (one-time costs paid)
        self._samplers: dict[tuple[int, ...], SampledAudit] = {}
        self._collected: set[tuple[int, ...]] = set()  # frame shapes whose first full frame collected garbage
        self._speed = SpeedGuard(self.config.max_backoff)
        self._quality = QualityGuard(self.config) if self.config.quality_guard else None
        self._backoff = BackOff(self.config)
        self.stats: FrameLog = FrameLog(self.config.keep_stats)
        self._index = 0
        self._worker: threading.Thread | None = None
        self._reset_stream()
        if self.input_size is not None:
            self._engine((1, 3, *self.input_size))

    # --- public ------------------------------------------------------------------------------------------

    @property
    def input_size(self) -> tuple[int, int] | None:
        """(H, W) the model sees, or None: the frame's own size."""
        return self.inputs.input_size

    @property
    def normalization(self) -> Normalization:
        return self.inputs.normalization

    @property
    def agreement(self) -> Agreement:
        """Agreement with full inference measured on the quality guard's audits so far (no audits: 1.0)."""
        if self._quality is None:
            return Agreement(None, 0, 1.0, 1.0, 0.0, 0)
        return self._quality.summary

    @property
    def pixel_threshold(self) -> float:
        """The change-mask threshold in use (the quality guard's current one)."""
        return self._quality.pixel_threshold if self._quality is not None else self.config.pixel_threshold

    def reset(self) -> None:
        """Forget the stream (the next frame is a first frame); :attr:`stats` and the guards' measurements (of
        this model on this machine and camera) are kept."""
        self._join()
        self._reset_stream()
        for engine in self._engines.values():
            engine.reset()

    def cache_bytes(self) -> CacheMemory:
        """Cache memory kept for the current frame size versus caching every tensor before the cache point
        (zeros before the first frame when ``input_size`` was not given)."""
        engine = self._engines.get(self._shape) if self._shape else None
        if engine is None and self.input_size is not None:
            engine = self._engines.get((1, 3, *self.input_size))
        return engine.cache_memory() if engine is not None else CacheMemory(0, 0, 0, 0)

    @torch.no_grad()
    def __call__(self, frame: np.ndarray | torch.Tensor, homography: np.ndarray | None = None) -> Any:
        """Run the model on the next frame.

        Args:
            frame: (H, W, 3) uint8 RGB array, or a float tensor (3, H, W) / (1, 3, H, W) already preprocessed
                (normalised with ``mean``/``std``).
            homography: optional known (3, 3) homography previous -> this frame in the model input's pixel
                coords (skips keypoint matching; e.g. a synthetic camera's ground truth).

        Returns:
            The model's output for the frame, batch dimension 1.

        Raises:
            TypeError / ValueError: a frame of the wrong type, dtype, rank or channel count, or a bad
                homography; the session's state is untouched and the next frame is handled normally.
        """
        start = time.perf_counter()
        x, pixels, raw_size = self.inputs(frame)
        matrix_given = check_homography(homography)
        self._join()
        f = FrameState(x, pixels, raw_size, FrameTimes(), homography_given=matrix_given is not None)
        f.times.prepare = time.perf_counter() - start
        engine = self._engine(tuple(x.shape))
        quality = self._quality
        if quality is not None:
            engine.feature_threshold = quality.still_feature_threshold
            engine.moving_feature_threshold = quality.moving_feature_threshold
        decided = time.perf_counter()
        self._decide(f, engine, matrix_given)
        attempt = f.fallback is None or f.fallback.cause in _MISSES
        prediction = self._plan(f, engine)
        overhead = f.overhead = time.perf_counter() - decided
        since_full = self._index - self._last_full
        audit = f.fallback is None and quality is not None and quality.due(since_full)
        oracle = f.plan is not None and self._oracle_due()
        audited = quality is not None and quality.trusting  # before this frame: checks no longer the rule
        # the first frame of a size to run the cached path pays one-time costs: no miss for the back-off (BackOff.paid)
        warming = f.fallback is None and tuple(x.shape) not in self._warm
        try:
            out, comparison, verify, engine_seconds = self._run(f, engine, audit, oracle)
        except BaseException:
            self._failed = True  # the guards keep their state: the next frame runs full and carries on
            raise
        bookkeeping = time.perf_counter()
        if warming:
            self._warm.add(tuple(x.shape))
        if f.fallback is None and engine.full_reason:
            f.fallback = Fallback(Cause.CACHE_UNUSABLE, engine.full_reason)
        if self._refilled_at == self._index - 1:  # the previous frame refilled a dropped cache: did this one use it?
            self._refill_wasted = not (f.plan is not None and f.fallback is None)
        ran_cached = f.fallback is None and not oracle
        cached = f.fallback is None and comparison is None and not oracle
        refreshed = engine.last.refreshed if cached else None
        # only a moving camera's low saving predicts the next frame's (a still camera's follows the scene)
        saving = engine.last.flops_ratio if f.fallback is None and not f.still else math.inf
        flops_ratio = engine.last.flops_ratio if cached or (oracle and f.fallback is None) else 1.0
        regions = engine.last.regions if f.fallback is None else 0
        if comparison is not None:
            # a flip that lost no more of the lead than the cache had been seen to lose: the margin was small, the
            # drift ordinary (its sample is no reference of a drift that misses)
            ordinary = comparison.kind == OutputKind.LABEL and \
                comparison.lead_lost <= quality.measured_loss(since_full, f.sampled)
            verdict = quality.record(comparison, since_full)
            if f.probes is not None:
                missed = None if verdict == Verdict.MISS and ordinary else verdict == Verdict.MISS
                quality.probe_error(self._samplers[tuple(x.shape)].record(*f.probes, f.mask, missed, f.sampled))
            # a map's check on the spot (its first cached frame, or after an audit that left no room) is no near tie
            why = ("near tie, " if comparison.kind == OutputKind.LABEL else "check, ") if verify else ""
            f.fallback = Fallback(Cause.AUDIT, f"{why}{comparison.kind.value} agreement {comparison.agreement:.4g}, "
                                               f"{verdict.value}")
        if quality is not None:
            quality.tick()
            if audited and ran_cached and (comparison is None or verify):
                self._speed.record_check(verify)
        cause = f.fallback.cause if f.fallback is not None else None
        # a near-tie checked frame counts as the cached frame it was, without the check's full run: the speed guard
        # charges the cached path its expected checks (a full frame times the check rate) and sends frames to full
        # inference once they make it slower; counted here too, a clip whose checks come often early (every cached
        # frame is checked before the first audit) would back off for a stretch sized by a full frame per check
        missed = comparison is not None and verdict == Verdict.MISS  # the cached run was in vain: a miss
        # a cached run is judged by what it computed, priced by the calibrated cost model (counts: boxes, positions,
        # the dense rest it switched to; ratios and fixed cost as medians over frames), not by its wall time: one
        # frame caught by a load spike or by new box shapes' one-time costs started a stretch of tens of plain
        # frames on the still clips (its miss the only sample of the savings' median), while a cache that is
        # really slower raises the calibration's ratios and shows in the price as in the guard's predictions
        ran = engine.last.predicted if f.plan is not None and not oracle and engine.last.predicted > 0 \
            else engine_seconds - f.checked
        paid = self._backoff.paid(None if verify and not missed else cause, attempt, saving, prediction.full,
                                  overhead + ran, overhead, missed, warming)
        f.times.decide = time.perf_counter() - bookkeeping
        commit_start = time.perf_counter()
        commit = (f, tuple(x.shape), refreshed, paid, engine.costs.full_seconds, oracle)
        if self.config.background_update:
            self._worker = threading.Thread(target=self._commit, args=commit, daemon=True)
            self._worker.start()
        else:
            self._commit(*commit)
        f.times.commit = time.perf_counter() - commit_start
        seconds = time.perf_counter() - start
        f.times.decide += max(seconds - sum(f.times.as_dict().values()), 0.0)
        reported_cached = f.fallback is None
        self.stats.append(FrameStats(
            index=self._index,
            mode="cached" if reported_cached else "full",
            reason="ok" if reported_cached else f.fallback.text,
            homography_found=f.matrix is not None,
            homography=f.matrix,
            recompute_fraction=f.mask.recompute_fraction if reported_cached else 1.0,
            flops_ratio=flops_ratio,
            seconds=seconds,
            n_matches=f.n_matches,
            cause=Cause.CACHED if reported_cached else f.fallback.cause,
            audit=comparison is not None,
            agreement=comparison.agreement if comparison is not None else None,
            predicted_full=prediction.full,
            predicted_cached=prediction.cached,
            guard_level=quality.level if quality is not None else 0,
            regions=regions,
            sampled_error=f.sampled,
            oracle_cached=f.oracle[0],
            oracle_full=f.oracle[1],
            times=f.times,
        ))
        self._index += 1
        self._margin = _leads(out) if self._quality is not None else math.nan
        return out

    # --- steps -------------------------------------------------------------------------------------------

    def _plan(self, f: FrameState, engine: CameraEngine) -> Prediction:
        """Plan a frame that may run cached and predict its cost; with the speed guard, send it to full
        inference when the plan says the cached path would be slower."""
        costs = engine.costs
        if f.fallback is not None:
            return Prediction(costs.full_seconds if costs.profiled else math.nan, math.nan)
        clock = time.perf_counter()
        f.plan = engine.plan(f.mask.pixel_mask, f.matrix, f.mask.clusters() if f.still else None)
        prediction = self._speed.predict(costs, f.plan, f.near_tie) if costs.profiled \
            else Prediction(math.nan, math.nan)
        f.times.plan = time.perf_counter() - clock
        if self.config.speed_guard and not self._speed.choose_cached(prediction):
            checks = f" + {prediction.checks * 1e3:.1f} ms expected near-tie checks" if prediction.checks else ""
            f.fallback = Fallback(Cause.SLOWER, f"predicted {prediction.cached * 1e3:.1f} ms cached{checks} vs "
                                                f"{prediction.full * 1e3:.1f} ms full")
        return prediction

    def _run(self, f: FrameState, engine: CameraEngine, audit: bool, oracle: bool
             ) -> tuple[Any, Comparison | None, bool, float]:
        """Run the frame: ``(output, the audit's comparison or None, whether the audit was a near-tie check, engine
        seconds)``; times the engine and the audit, and calibrates the cost model."""
        quality, costs = self._quality, engine.costs
        comparison, verify = None, False
        clock = time.perf_counter()
        if oracle:  # both paths, timed: the cached one first (it needs the previous frame's cache)
            cached_out = engine.cached(f.x, f.mask.pixel_mask, f.matrix, f.plan)
            cached_seconds = time.perf_counter() - clock
            if not engine.full_reason:
                self._calibrate(f, engine, cached_seconds)
            middle = time.perf_counter()
            full_out = engine.full(f.x)
            f.oracle = (cached_seconds, time.perf_counter() - middle)
            out = cached_out if f.fallback is None else full_out
            f.times.engine = f.oracle[0] if f.fallback is None else f.oracle[1]
            costs.record_full(f.oracle[1])
            return out, None, False, f.times.engine
        if f.fallback is not None:
            out = self._full_frame(f, engine)
            seconds = time.perf_counter() - clock
            f.times.engine = seconds
            if f.fallback.cause != Cause.FIRST_FRAME:  # the first pays one-time costs (and the profile)
                costs.record_full(seconds)
            self._collect_once(tuple(f.x.shape))
            return out, None, False, seconds
        out = engine.cached(f.x, f.mask.pixel_mask, f.matrix, f.plan)
        cached_seconds = time.perf_counter() - clock
        f.times.engine = cached_seconds
        if engine.full_reason:
            costs.record_full(cached_seconds)
            return out, None, False, cached_seconds
        self._calibrate(f, engine, cached_seconds)
        audit = self._sample(f, engine, audit)
        # a classifier's near tie is checked on the spot (see QualityGuard.risky): by a sample of the frame first (a
        # fraction of a frame: its measured drift replaces the guess from the frames since the last full one), in
        # full when the margin is still at risk or the sample flags
        margin, since_full = _leads(out), self._index - self._last_full
        verify = not audit and quality is not None and quality.risky(margin, since_full, f.sampled)
        # a frame whose margin is safe only if the drift grows linearly from the audits' distances: its own sample
        # measures the drift (a full check when no sample can)
        cautious = not audit and not verify and quality is not None and math.isnan(f.sampled) \
            and quality.needs_sample(margin, since_full)
        if (verify or cautious) and math.isnan(f.sampled) and isinstance(margin, Leads):
            audit = self._sample(f, engine, False, near_tie=True)
            verify = not audit and (quality.risky(margin, since_full, f.sampled) if not math.isnan(f.sampled)
                                    else verify or cautious)
        if audit or verify:
            sampler = self._samplers.get(tuple(f.x.shape))
            probe = sampler.probe if sampler is not None else None
            cached_probe = engine.engine.cache.map(probe.name).clone() if probe is not None else None
            audit_start = time.perf_counter()
            cached_out, out = out, engine.full(f.x)
            spent = time.perf_counter() - audit_start
            f.times.audit += spent
            f.checked = spent
            costs.record_full(spent)
            comparison = compare(cached_out, out, self.config.target_agreement, self.config.target_error)
            if cached_probe is not None:
                f.probes = (cached_probe, engine.engine.cache.map(probe.name))
        return out, comparison, verify, time.perf_counter() - clock

    def _sample(self, f: FrameState, engine: CameraEngine, due: bool, near_tie: bool = False) -> bool:
        """A sampled audit where one is due (in place of a due full audit, or every ``audit_interval`` frames since
        the last check, or on a near tie); returns whether a full audit runs on this frame (a due one the sample
        cannot stand in for, or one the sample flagged)."""
        quality, sampler = self._quality, self._samplers.get(tuple(f.x.shape))
        if quality is None or sampler is None or not sampler.ready:
            return due
        since_full = self._index - self._last_full
        if due and quality.long_due(since_full):
            return True  # the long interval: a full audit whatever a sample would say
        if not due and not near_tie and self._index - self._last_check < self.config.first_audit_interval:
            return False
        clock = time.perf_counter()
        result = sampler.check(engine.engine, f.x, f.mask)
        f.times.audit += time.perf_counter() - clock
        f.sampled = result.error
        quality.drift_sampled(since_full, result.error)
        self._last_check = self._index
        if result.flagged:
            return True
        if due:
            quality.sampled_hold()
        return False

    def _calibrate(self, f: FrameState, engine: CameraEngine, seconds: float) -> None:
        """Feed the cost model what the cached frame's steps measured (the pruning was recorded as it ran) and
        what the frame's measured ``seconds`` spent beyond them (its fixed cost); without the speed guard the
        coefficients stay as they are, so runs are reproducible."""
        if self.config.speed_guard:
            kind = plan_kind(f.plan)
            engine.costs.record_steps(kind, engine.last.step_samples)
            engine.costs.record_frame(kind, seconds - engine.last.timed_seconds)

    def _full_frame(self, f: FrameState, engine: CameraEngine) -> Any:
        """Full inference of a frame that falls back: plain (nothing kept) when the next frame cannot use the
        cache either, else refilling it (the first frame also profiles the engine's costs)."""
        if not self._next_may_use_cache(f):
            return engine.plain(f.x)
        out = engine.full(f.x)
        if f.fallback.cause == Cause.NO_CACHE:
            self._refilled_at = self._index
        if self.config.speed_guard and not engine.costs.profiled:
            engine.profile()
            if best_saving(engine.engine, self._pruning) < self.config.min_saving:
                self._no_reuse[tuple(f.x.shape)] = "the plan of the smallest change saves less than " \
                                                   f"{self.config.min_saving:.0%} of a full frame"
            elif self.config.quality_guard and self.config.sampled_audits:
                sampler = SampledAudit(self.config, seed=self.config.sample_seed + len(self._samplers))
                sampler.choose(engine.engine)
                self._samplers[tuple(f.x.shape)] = sampler
        return out

    def _collect_once(self, shape: tuple[int, ...]) -> None:
        """After the first full frame of a frame size, one full garbage collection (after the frame's engine time is
        taken: no full-frame sample of the cost model holds it). Tracing the model and profiling its engine leave
        the interpreter's collector a full collection due, which with torch loaded takes 0.2-0.4 s; left alone it
        lands in one of the next frames, and in a cached frame's decision it reads as a miss that starts a back-off
        stretch of up to ``max_backoff`` plain frames. A frame that traced a model costs seconds anyway: this runs
        the collection the interpreter would run, sooner, and changes none of its settings."""
        if shape not in self._collected:
            self._collected.add(shape)
            gc.collect()

    def _next_may_use_cache(self, f: FrameState) -> bool:
        """Whether the frame after this full one may use the cache (else this one need not fill it)."""
        cause = f.fallback.cause
        if cause in (Cause.NO_REUSE, Cause.KEYFRAME) and (cause == Cause.NO_REUSE or self.config.every_frame_full):
            return False
        if cause == Cause.BACKING_OFF and self._backoff.keeps_plain(pixels_first=not f.homography_given):
            return False  # this frame's stretch goes on, or its probe asks the pixels first
        if cause == Cause.SLOWER and f.plan is None:
            return self._speed.probe_due  # no plan can pay: only a probe's frame uses the cache
        if cause == Cause.NO_CACHE and self._refill_wasted and self.config.speed_guard:
            # the last refill of a dropped cache went unused (the frame after it was a near tie, a miss or planned
            # slower): a refill costs more than a plain frame (the maps are written), so only a probe's refills
            self._speed.reject()
            return self._speed.probe_due
        if cause in (*_MISSES, Cause.SLOWER) and self._backoff.starts_with_miss(f.overhead):
            return False  # this miss starts a stretch
        quality = self._quality
        return not (cause == Cause.SUSPENDED and quality is not None and quality.suspended_for > 1)

    def _check_certain(self) -> bool:
        """Whether a cached frame now would be checked by full inference: the previous output's top-1 lead is within
        what a cached frame may lose (a near tie lasts over frames). Where a sampled audit could check the frame for
        a fraction of a frame first, only a lead within what the audits measured unscaled counts (no sample can
        clear it: :meth:`~incrinf.stream.guards.QualityGuard.surely_risky`); such a frame would otherwise pay its
        cached run, its sample and a full frame. Until the guard trusts cached outputs
        (:attr:`~incrinf.stream.guards.QualityGuard.trusting`) every cached label output is checked by rule, and
        those checks are the guard's measurements: not counted."""
        quality, sampler = self._quality, self._samplers.get(self._shape)
        if quality is None or not quality.trusting:
            return False
        if sampler is not None and sampler.ready:
            return quality.surely_risky(self._margin)
        return quality.risky(self._margin, self._index - self._last_full)

    @property
    def _pruning(self) -> bool:
        """Whether cached frames prune by value (a change may then die down to the engine's floor)."""
        return self.config.still_feature_threshold > 0 or self.config.moving_feature_threshold > 0

    def _oracle_due(self) -> bool:
        share = self.config.oracle_sample
        if share <= 0:
            return False
        self._planned += 1
        return self._planned % max(int(round(1.0 / share)), 1) == 0

    # --- steps -------------------------------------------------------------------------------------------

    def _decide(self, f: FrameState, engine: CameraEngine, matrix_given: np.ndarray | None) -> None:
        """Set the frame's fallback (None: cached), and for a frame that may use the cache its homography, change
        mask, warped reference and keypoints (:meth:`~incrinf.stream.change_finder.ChangeFinder.find`); mutates
        nothing else."""
        no_reuse = self._no_reuse.get(tuple(f.x.shape))
        if no_reuse is not None:
            f.fallback = Fallback(Cause.NO_REUSE, no_reuse)
            return
        if self._change.prev_pixels is None:
            f.fallback = Fallback(Cause.FIRST_FRAME)
            return
        if f.raw_size != self._raw_size or tuple(f.x.shape) != self._shape:
            f.fallback = Fallback(Cause.SIZE_CHANGED)
            return
        if self._failed:
            f.fallback = Fallback(Cause.PREVIOUS_FAILED)
            return
        if self.config.every_frame_full or (self._quality is None and self.config.keyframe_interval
                                            and self._index - self._last_full >= self.config.keyframe_interval):
            f.fallback = Fallback(Cause.KEYFRAME)  # with the quality guard: audits instead
            return
        if self._quality is not None and self._quality.suspended:
            f.fallback = Fallback(Cause.SUSPENDED, "the cached path missed the target at the tightest settings")
            return
        if self._backoff.active:
            f.fallback = Fallback(Cause.BACKING_OFF, f"{self._backoff.misses} frames in a row could not use the "
                                                     "cache or saved little with it")
            return
        f.near_tie = self._check_certain()
        hopeless = self._speed.hopeless(engine.engine, self._pruning, f.near_tie) \
            if self.config.speed_guard else ""
        if hopeless:  # known before the stillness test, matching, mask and plan: none of them runs
            f.fallback = Fallback(Cause.SLOWER, hopeless)
            return
        if not engine.has_cache:  # the last full frame ran plain: it was not expected to be followed by a cached one
            if self._backoff.pixel_probe and matrix_given is None:  # a motion's stretch ended: do the pixels tell?
                self._change.rule_out(f, engine)
                if f.fallback is not None:
                    return
            f.fallback = Fallback(Cause.NO_CACHE, "the last full frame kept no maps")
            return
        self._change.find(f, engine, matrix_given, self.pixel_threshold)

    def _commit(self, f: FrameState, shape: tuple[int, ...], refreshed: list[tuple[int, int, int, int]] | None,
                paid: bool | None, full_seconds: float, oracle: bool) -> None:
        """The frame succeeded: it becomes the previous frame."""
        kept_cache = f.fallback is None and not oracle
        self._change.commit(f, kept_cache, refreshed)
        if not kept_cache:
            self._last_full = self._last_check = self._index
            for other_shape, engine in self._engines.items():
                if other_shape != shape:
                    engine.reset()  # another frame size: free its cache
        self._backoff.count(f.fallback.cause if f.fallback is not None else None, paid, full_seconds, f.told_by_pixels)
        self._raw_size = f.raw_size
        self._shape = shape
        self._failed = False

    def _reset_stream(self) -> None:
        self._change.reset()
        self._raw_size: tuple[int, int] | None = None
        self._shape: tuple[int, ...] | None = None
        self._last_full = 0
        self._last_check = 0
        self._planned = 0
        self._refilled_at = -2  # the latest frame that refilled a dropped cache (Cause.NO_CACHE)
        self._refill_wasted = False  # the frame after it did not run cached
        self._backoff.reset()
        self._failed = False
        # the latest output's top-1 class and leads over its closest rivals (NaN: none, or a map)
        self._margin: Leads | float = math.nan

    def _join(self) -> None:
        if self._worker is not None:
            self._worker.join()
            self._worker = None

    def _engine(self, shape: tuple[int, ...]) -> CameraEngine:
        engine = self._engines.get(shape)
        if engine is None:
            graph = capture(self.model, shape[1:])  # CaptureError when the model fails at this size
            engine = CameraEngine(graph, self.device, max_misalignment=self.config.max_misalignment,
                                  feature_threshold=self.config.still_feature_threshold,
                                  moving_feature_threshold=self.config.moving_feature_threshold)
            self._engines[shape] = engine
            if self.config.speed_guard and best_saving(engine.engine, self._pruning) < self.config.min_saving:
                # the plan's multiply-adds say it before anything runs: no change could pay for the bookkeeping
                self._no_reuse[shape] = (f"the smallest change computes over {1 - self.config.min_saving:.0%} of a "
                                         "full frame's multiply-adds")
        return engine


def _leads(out: Any) -> Leads | float:
    """A label output's top class and its leads over its closest rivals, what the quality guard checks; NaN for a
    map (no top-1 lead)."""
    leads = top_leads(out)
    return math.nan if leads is None else leads
