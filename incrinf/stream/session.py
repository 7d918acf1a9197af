"""A camera stream session: full inference on the first frame, then reuse through the homography (CacheInf).

Per frame: the frame becomes the model's input (resized and normalised, or taken as is), the homography
previous -> current is estimated on the same pixels the model sees, the previous frame's *reference* (the
pixels the cache stands for) is warped into the current view, and the cells where it differs by at least
``threshold`` become the change mask. The engine (:class:`~incrinf.stream.executor.StreamExecutor` over
:class:`~incrinf.engine.FrameEngine`) then recomputes what the mask reaches and reads the rest from the
cache. A frame falls back to full inference (and refills the cache) on the first frame, a failed match, a frame
size change, too large a changed fraction and after a frame that raised.

Two guards (:mod:`incrinf.stream.guards`) keep the session's promise, the same answers sooner, on any clip: the
speed guard runs a frame fully when its measured costs say the cached path would not be faster, and the quality
guard audits frames against full inference (each audit is a keyframe) and adapts the thresholds and the audit
interval to hold ``target_agreement``. Without the quality guard a keyframe comes every ``keyframe_interval``
frames.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from incrinf.engine import CacheMemory
from incrinf.extras import require
from incrinf.graph import capture, has_windows
from incrinf.normalization import Normalization
from incrinf.stream.agreement import compare, top1_margin
from incrinf.stream.change_mask import ChangeMask, change_mask
from incrinf.stream.config import StreamConfig
from incrinf.stream.executor import StreamExecutor
from incrinf.stream.guards import Agreement, QualityGuard, SpeedEstimate, SpeedGuard, Walk
from incrinf.stream.matching import FrameFeatures, HomographyEstimator, corner_distance
from incrinf.stream.warp import warp_image, warp_valid_mask

cv2 = require("cv2", "stream", "camera streams")


class Cause(str, Enum):
    """Why a frame ran the way it did (:attr:`FrameStats.cause`)."""

    CACHED = "ok"
    FIRST_FRAME = "first frame"
    SIZE_CHANGED = "frame size changed"
    PREVIOUS_FAILED = "previous frame failed"
    KEYFRAME = "keyframe"
    BACKING_OFF = "backing off"
    MATCH_FAILED = "match failed"
    CACHE_UNUSABLE = "cache unusable"
    CHANGED_FRACTION = "changed fraction"
    SLOWER = "cached slower"
    AUDIT = "audit"
    SUSPENDED = "quality guard"


# Phase-correlation peak (1 for identical frames) below which a frame is not taken as a still camera.
_STILL_RESPONSE = 0.8
# Frames that tried the cache in vain; this many in a row start a back-off (see StreamConfig.max_backoff).
_MISSES = (Cause.MATCH_FAILED, Cause.CACHE_UNUSABLE, Cause.CHANGED_FRACTION)
_BACKOFF_AFTER = 3
# A cached frame of a moving camera that computed more than 1 / this of the full FLOPs counts as a miss too:
# under camera motion the change can reach nearly every position, and the bookkeeping then makes the frame
# slower than plain inference (measured: 1.7x slower on a panning 128 px synthetic camera).
_MIN_SAVING = 1.25
# Attempts whose net seconds saved decide whether misses start a back-off (with the speed guard).
_SAVINGS_WINDOW = 8
# Share of a back-off stretch's time that the attempt ending it may cost (with the speed guard).
_ATTEMPT_BUDGET = 0.02
_MIN_SIDE = 64  # frames smaller than this are upscaled: a CNN's deep maps would vanish


@dataclass(frozen=True)
class FrameStats:
    """What one frame did.

    Attributes:
        index: frame number in the session (0-based).
        mode: ``"full"`` or ``"cached"``.
        reason: why, in words: ``"ok"`` (cached), ``"first frame"``, ``"match failed: ..."``, ``"changed
            fraction 0.72 > max_ratio 0.6"``, ``"frame size changed"``, ``"keyframe"``, ``"previous frame
            failed"``, ``"backing off: ..."``, ``"cache unusable: ..."``, ``"cached slower: ..."`` (the speed
            guard), ``"audit: ..."`` (the quality guard compared the cached path with full inference and returned
            the latter), ``"quality guard: ..."`` (the cache is suspended after misses at the tightest settings).
        homography_found: whether a usable homography previous -> current was found (or given).
        homography: that (3, 3) matrix in the model input's pixel coords (identity when the motion was below
            ``min_motion``), or None.
        recompute_fraction: share of the frame's pixels marked changed (1.0 for full inference).
        flops_ratio: full-inference FLOPs / FLOPs computed for this frame (1.0 for full inference; ``inf`` when
            nothing was computed: no feature changed enough and the previous output was returned).
        seconds: wall time of the call, preprocessing and matching included.
        n_matches: keypoint matches that passed the ratio test (0 when matching did not run).
        cause: :attr:`reason` as a :class:`Cause`.
        audit: the frame was audited (:attr:`agreement` holds the cached path's agreement with full inference).
        agreement: this audit's agreement (top-1: 1.0 or 0.0; a map: the share of agreeing positions), else None.
        predicted_full: the speed guard's estimate of a full frame's engine time, seconds (NaN: unknown or off).
        predicted_cached: its estimate of this frame's cached engine time (NaN: not estimated).
        guard_level: the quality guard's level (0: the configured thresholds; each level multiplies them by 0.6).
    """

    index: int
    mode: str
    reason: str
    homography_found: bool
    homography: np.ndarray | None
    recompute_fraction: float
    flops_ratio: float
    seconds: float
    n_matches: int = 0
    cause: Cause = Cause.CACHED
    audit: bool = False
    agreement: float | None = None
    predicted_full: float = math.nan
    predicted_cached: float = math.nan
    guard_level: int = 0

    @property
    def cache_ratio(self) -> float:
        """Share of the frame served from the cache."""
        return 1.0 - self.recompute_fraction


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
        **settings: any :class:`~incrinf.stream.config.StreamConfig` field (``threshold=``,
            ``feature_threshold=``, ...), replacing the one in ``config``.

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
        self.normalization = Normalization(mean, std)
        if self.normalization.channels != 3:
            raise ValueError(f"mean and std need 3 values each (RGB frames); got {mean}, {std}")
        self.input_size = self._check_size(input_size)
        if preprocess is not None and not callable(preprocess):
            raise TypeError("preprocess must be callable: frame (H, W, 3) uint8 -> (3, H, W) tensor")
        if not has_windows(model):
            raise ValueError(f"{type(model).__name__} has no convolution or pooling layer: nothing to reuse "
                             "across frames (run the model directly)")
        self.model = model
        self.preprocess = preprocess
        param = next(iter(model.parameters()), None)
        self.device = torch.device(device) if device is not None else (
            param.device if param is not None else torch.device("cpu"))
        # ECC refinement costs about as much as the rest of a cached frame; keypoint noise on a still camera
        # is absorbed by min_motion instead
        options = {"refine": False, "max_features": 500, **self.config.matcher_options}
        self._estimator = HomographyEstimator(self.config.matcher, **options)
        self._executors: dict[tuple[int, ...], StreamExecutor] = {}
        self._speed_guards: dict[tuple[int, ...], SpeedGuard] = {}
        self._quality = QualityGuard(self.config) if self.config.quality_guard else None
        self.stats: list[FrameStats] = []
        self._index = 0
        self._worker: threading.Thread | None = None
        self._reset_stream()
        if self.input_size is not None:
            self._executor((1, 3, *self.input_size))

    # --- public ------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the stream (the next frame is a first frame); :attr:`stats` and the guards' measurements (of
        this model on this machine and camera) are kept."""
        self._join()
        self._reset_stream()
        for executor in self._executors.values():
            executor.reset()

    def cache_bytes(self) -> CacheMemory:
        """Cache memory kept for the current frame size versus caching every tensor before the cache point
        (zeros before the first frame when ``input_size`` was not given)."""
        executor = self._executors.get(self._shape) if self._shape else None
        if executor is None and self.input_size is not None:
            executor = self._executors.get((1, 3, *self.input_size))
        return executor.cache_memory() if executor is not None else CacheMemory(0, 0, 0, 0)

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
        x, pixels, raw_size = self._prepare(frame)
        matrix_given = self._check_homography(homography)
        self._join()
        executor = self._executor(tuple(x.shape))
        quality = self._quality
        if quality is not None:
            executor.feature_threshold = quality.still_feature_threshold
            executor.moving_feature_threshold = quality.moving_feature_threshold
        decided = time.perf_counter()
        reason, matrix, mask, warped, n_matches, features = self._decide(executor, x, pixels, raw_size,
                                                                         matrix_given)
        attempt = reason is None or reason.cause in _MISSES
        overhead = time.perf_counter() - decided
        walk = Walk.STILL if matrix is not None and np.array_equal(matrix, np.eye(3)) else Walk.MOVING
        work = _work(mask, walk) if reason is None else 1.0
        speed = self._speed_guards.setdefault(tuple(x.shape), SpeedGuard()) if self.config.speed_guard else None
        estimate = SpeedEstimate(math.nan, math.nan)
        if speed is not None:
            estimate = speed.estimate(walk, work) if reason is None else SpeedEstimate(speed.full_seconds, math.nan)
            if reason is None and not speed.choose_cached(estimate):
                reason = _Fallback(Cause.SLOWER, f"predicted {estimate.cached * 1e3:.1f} ms cached vs "
                                                 f"{estimate.full * 1e3:.1f} ms full")
        since_full = self._index - self._last_full
        audit = reason is None and quality is not None and quality.due(since_full)
        comparison = None
        verify = False
        engine = time.perf_counter()
        try:
            if reason is None:
                out = executor.cached(x, mask.pixel_mask, matrix)
                ran_full = bool(executor.full_reason)
                cached_seconds = time.perf_counter() - engine
                # a classifier's near tie is checked on the spot (see QualityGuard.risky)
                verify = not audit and not ran_full and quality is not None and quality.risky(top1_margin(out))
                if (audit or verify) and not ran_full:
                    cached_out, out = out, executor.full(x)
                    comparison = compare(cached_out, out, self.config.target_agreement, self.config.target_error)
            else:
                out = executor.full(x)
                ran_full = True
        except BaseException:
            self._failed = True  # the guards keep their state: the next frame runs full and carries on
            raise
        engine_seconds = time.perf_counter() - engine
        if reason is None and executor.full_reason:
            reason = _Fallback(Cause.CACHE_UNUSABLE, executor.full_reason)
        refreshed = executor.last.refreshed if reason is None and comparison is None else None
        # only a moving camera's low saving predicts the next frame's (a still camera's follows the scene)
        moving = matrix is not None and not np.array_equal(matrix, np.eye(3))
        saving = executor.last.flops_ratio if reason is None and moving else math.inf
        flops_ratio = executor.last.flops_ratio if reason is None and comparison is None else 1.0
        if speed is not None:
            if ran_full:
                speed.record_full(engine_seconds)
            else:
                # a check forced by the output is part of what the cached path costs; a scheduled audit's full run
                # is the keyframe the session needs anyway
                speed.record_cached(walk, work, engine_seconds if verify else cached_seconds)
                if comparison is not None:
                    speed.record_full(engine_seconds - cached_seconds)
        if comparison is not None:
            verdict = quality.record(comparison, since_full)
            why = "near tie, " if verify else ""
            reason = _Fallback(Cause.AUDIT, f"{why}{comparison.kind.value} agreement {comparison.agreement:.4g}, "
                                            f"{verdict.value}")
        if quality is not None:
            quality.tick()
        paid = self._paid(reason, attempt, saving, estimate, overhead + engine_seconds, overhead)
        commit = (reason, pixels, raw_size, tuple(x.shape), features, mask, warped, refreshed, paid)
        if self.config.background_update:
            self._worker = threading.Thread(target=self._commit, args=commit, daemon=True)
            self._worker.start()
        else:
            self._commit(*commit)
        seconds = time.perf_counter() - start
        cached = reason is None
        self.stats.append(FrameStats(
            index=self._index,
            mode="cached" if cached else "full",
            reason="ok" if cached else reason.text,
            homography_found=matrix is not None,
            homography=matrix,
            recompute_fraction=mask.recompute_fraction if cached else 1.0,
            flops_ratio=flops_ratio,
            seconds=seconds,
            n_matches=n_matches,
            cause=Cause.CACHED if cached else reason.cause,
            audit=comparison is not None,
            agreement=comparison.agreement if comparison is not None else None,
            predicted_full=estimate.full,
            predicted_cached=estimate.cached,
            guard_level=quality.level if quality is not None else 0,
        ))
        self._index += 1
        return out

    @property
    def agreement(self) -> Agreement:
        """Agreement with full inference measured on the quality guard's audits so far (no audits: 1.0)."""
        if self._quality is None:
            return Agreement(None, 0, 1.0, 1.0, 0.0, 0)
        return self._quality.summary

    @property
    def threshold(self) -> float:
        """The change threshold in use (the quality guard's current one)."""
        return self._quality.threshold if self._quality is not None else self.config.threshold

    # --- steps -------------------------------------------------------------------------------------------

    def _decide(self, executor: StreamExecutor, x: torch.Tensor, pixels: np.ndarray, raw_size: tuple[int, int],
                matrix_given: np.ndarray | None):
        """``(reason or None for cached, homography, change mask, warped reference, n_matches, keypoints of
        this frame or None)``; mutates nothing. Keypoints are detected only when a homography is estimated
        (the previous frame's lazily, when it had none)."""
        if self._prev_pixels is None:
            return _Fallback(Cause.FIRST_FRAME), None, None, None, 0, None
        if raw_size != self._raw_size or tuple(x.shape) != self._shape:
            return _Fallback(Cause.SIZE_CHANGED), None, None, None, 0, None
        if self._failed or not executor.has_cache:
            return _Fallback(Cause.PREVIOUS_FAILED), None, None, None, 0, None
        if self._quality is None and self.config.keyframe_interval \
                and self._index - self._last_full >= self.config.keyframe_interval:
            return _Fallback(Cause.KEYFRAME), None, None, None, 0, None  # with the quality guard: audits instead
        if self._quality is not None and self._quality.suspended:
            return (_Fallback(Cause.SUSPENDED, "the cached path missed the target at the tightest settings"), None,
                    None, None, 0, None)
        if self._skip > 0:
            return (_Fallback(Cause.BACKING_OFF, f"{self._misses} frames in a row could not use the cache or saved "
                                                 "little with it"), None, None, None, 0, None)
        n_matches = 0
        features = still = None
        if matrix_given is None and self.config.still_fraction > 0 and self._looks_still(pixels):
            # a still camera: keypoint matching (about half a small frame's inference) would find the identity
            still = change_mask(pixels, self._reference, self.config.cell, self.threshold, None)
            if still.recompute_fraction <= self.config.still_fraction:
                return None, np.eye(3), still, self._reference, 0, None
        if matrix_given is not None:
            matrix = matrix_given
        else:
            features = self._estimator.detect(pixels)
            prev = self._prev_features or self._estimator.detect(self._prev_pixels)
            result = self._estimator.match(prev, features)
            n_matches = result.n_matches
            if not result.ok:
                return _Fallback(Cause.MATCH_FAILED, result.reason), None, None, None, n_matches, features
            matrix = result.matrix
        size = pixels.shape[:2]
        if corner_distance(matrix, np.eye(3), size) < self.config.min_motion:
            matrix = np.eye(3)
        if np.array_equal(matrix, np.eye(3)):
            warped = self._reference  # a still camera: nothing to warp, nothing uncovered
            mask = still if still is not None else change_mask(pixels, warped, self.config.cell, self.threshold,
                                                                   None)
        else:
            unusable = executor.unusable_fraction(matrix)
            if unusable > executor.dense_cut:  # checked before the warp and mask it would make useless
                return (_Fallback(Cause.CACHE_UNUSABLE, f"{unusable:.0%} of the cache misaligned by the motion"),
                        matrix, None, None, n_matches, features)
            warped = warp_image(self._reference, matrix)
            mask = change_mask(pixels, warped, self.config.cell, self.threshold, warp_valid_mask(matrix, size))
        fraction = mask.recompute_fraction
        if fraction > self.config.max_ratio:
            return (_Fallback(Cause.CHANGED_FRACTION, f"{fraction:.2f} > max_ratio {self.config.max_ratio:g}"),
                    matrix, mask, None, n_matches, features)
        return None, matrix, mask, warped, n_matches, features

    def _looks_still(self, pixels: np.ndarray) -> bool:
        """Whether phase correlation with the previous frame finds a clear, sub-``min_motion`` global shift.

        A weak correlation peak (a panning camera over repetitive texture, a zoom, a scene cut) is not taken
        as stillness: a low change fraction alone is not enough, since smooth regions hide real motion."""
        gray = cv2.cvtColor(pixels, cv2.COLOR_RGB2GRAY).astype(np.float32)
        prev = self._prev_gray  # None when the previous frame skipped this test
        if prev is None:
            prev = cv2.cvtColor(self._prev_pixels, cv2.COLOR_RGB2GRAY).astype(np.float32)
        if self._window is None or self._window.shape != gray.shape:
            self._window = cv2.createHanningWindow((gray.shape[1], gray.shape[0]), cv2.CV_32F)
        (dx, dy), response = cv2.phaseCorrelate(prev, gray, self._window)
        self._gray = gray
        return response >= _STILL_RESPONSE and math.hypot(dx, dy) < max(self.config.min_motion / 2, 0.5)

    def _commit(self, reason: _Fallback | None, pixels: np.ndarray, raw_size: tuple[int, int], shape: tuple[int, ...],
                features: FrameFeatures | None, mask, warped: np.ndarray | None,
                refreshed: tuple[int, int, int, int] | None = None, paid: bool | None = None) -> None:
        """The frame succeeded: it becomes the previous frame."""
        if reason is None:
            # the reference is what the cache stands for: stale where the frame kept cached values
            if refreshed is None:
                self._reference = np.where(mask.pixel_mask[:, :, None], pixels, warped)
            else:
                y0, y1, x0, x1 = refreshed
                self._reference = warped.copy()
                self._reference[y0:y1, x0:x1] = pixels[y0:y1, x0:x1]
        else:
            self._reference = pixels
            self._last_full = self._index
            for other_shape, executor in self._executors.items():
                if other_shape != shape:
                    executor.reset()  # another frame size: free its cache
        self._count_attempt(reason, paid)
        self._prev_pixels = pixels
        self._prev_gray, self._gray = self._gray, None
        self._prev_features = features
        self._raw_size = raw_size
        self._shape = shape
        self._failed = False

    def _paid(self, reason: _Fallback | None, attempt: bool, saving: float, estimate: SpeedEstimate,
              seconds: float, overhead: float) -> bool | None:
        """Whether a frame that tried the cache paid for trying (None: it did not try). With the speed guard, a
        cached frame pays when its decision and engine time beat the full-frame estimate; a frame that ran full
        after trying (a failed match, the guard's choice) does not. Without it, a moving camera's cached frame
        pays when it saved FLOPs (a still camera's always: its next frame may be cheap again). With the speed
        guard the net seconds saved by the attempt are kept too (a miss costs its decision overhead)."""
        if not attempt or reason is not None and reason.cause == Cause.AUDIT:
            return None
        if self.config.speed_guard:
            net = -overhead if reason is not None else estimate.full - seconds
            self._savings.append(0.0 if math.isnan(net) else net)
        if reason is not None:
            return False
        if self.config.speed_guard:
            return not seconds >= estimate.full  # NaN (no estimate yet): paid
        return saving >= _MIN_SAVING

    def _count_attempt(self, reason: _Fallback | None, paid: bool | None) -> None:
        """Back-off bookkeeping: frames that tried the cache in vain start a full-only stretch. Without the speed
        guard stretches double up to ``max_backoff``; with it, a stretch starts only while the recent attempts
        saved nothing in total (misses that cost a few milliseconds of decision each are worth it while the hits
        between them save a good part of a frame), and lasts just long enough for its attempt to stay within 2%
        of the stretch's time."""
        if paid:
            self._misses = self._backoff = self._skip = 0
        elif reason is not None and reason.cause == Cause.BACKING_OFF:
            self._skip -= 1
        elif paid is not None:
            self._misses += 1
            if not self.config.max_backoff or self._misses < _BACKOFF_AFTER:
                return
            if not self.config.speed_guard:
                self._backoff = min(max(2 * self._backoff, 2), self.config.max_backoff)
            elif sum(self._savings) > 0:
                return  # the hits between the misses pay for them
            else:
                # measured: as long as keeps the attempt ending it within budget, no longer (doubling would only
                # delay noticing that the cache pays again)
                self._backoff = min(max(2, self._stretch()), self.config.max_backoff)
            self._skip = self._backoff

    def _stretch(self) -> int:
        """With the speed guard, the shortest back-off whose one attempt at its end costs at most 2% of the
        stretch's time: the misses' measured overhead over 2% of a full frame's time."""
        if not self.config.speed_guard or not self._savings:
            return 0
        misses = [-v for v in self._savings if v < 0]
        full = next(iter(self._speed_guards.values())).full_seconds if len(self._speed_guards) == 1 else math.nan
        if not misses or not full > 0:
            return 0
        return int(math.ceil(statistics.median(misses) / (_ATTEMPT_BUDGET * full)))

    def _reset_stream(self) -> None:
        self._prev_pixels: np.ndarray | None = None
        self._prev_features: FrameFeatures | None = None
        self._prev_gray: np.ndarray | None = None  # grey levels for the still-camera test
        self._gray: np.ndarray | None = None
        self._window: np.ndarray | None = None
        self._reference: np.ndarray | None = None
        self._raw_size: tuple[int, int] | None = None
        self._shape: tuple[int, ...] | None = None
        self._last_full = 0
        self._misses = self._backoff = self._skip = 0
        self._savings: deque[float] = deque(maxlen=_SAVINGS_WINDOW)
        self._failed = False

    def _join(self) -> None:
        if self._worker is not None:
            self._worker.join()
            self._worker = None

    def _executor(self, shape: tuple[int, ...]) -> StreamExecutor:
        executor = self._executors.get(shape)
        if executor is None:
            graph = capture(self.model, shape[1:])  # CaptureError when the model fails at this size
            executor = StreamExecutor(graph, self.device, max_misalignment=self.config.max_misalignment,
                                      feature_threshold=self.config.still_feature_threshold,
                                      moving_feature_threshold=self.config.moving_feature_threshold)
            self._executors[shape] = executor
        return executor

    # --- input handling ----------------------------------------------------------------------------------

    @staticmethod
    def _check_size(size: Any) -> tuple[int, int] | None:
        if size is None:
            return None
        try:
            h, w = (int(v) for v in size)
        except (TypeError, ValueError):
            raise ValueError(f"input_size must be (height, width), got {size!r}") from None
        if h < 8 or w < 8:
            raise ValueError(f"input_size must be at least 8x8, got {size!r}")
        return h, w

    @staticmethod
    def _check_homography(matrix: Any) -> np.ndarray | None:
        if matrix is None:
            return None
        m = np.asarray(matrix, dtype=np.float64)
        if m.shape != (3, 3) or not np.all(np.isfinite(m)) or abs(m[2, 2]) < 1e-12:
            raise ValueError(f"homography must be a finite (3, 3) matrix with [2, 2] != 0, got shape {m.shape}")
        try:
            np.linalg.inv(m)
        except np.linalg.LinAlgError:
            raise ValueError("homography is singular") from None
        return m / m[2, 2]

    def _target_size(self, h: int, w: int) -> tuple[int, int]:
        if self.input_size is not None:
            return self.input_size
        if min(h, w) >= _MIN_SIDE:
            return h, w
        scale = _MIN_SIDE / min(h, w)
        return max(_MIN_SIDE, round(h * scale)), max(_MIN_SIDE, round(w * scale))

    def _prepare(self, frame: Any) -> tuple[torch.Tensor, np.ndarray, tuple[int, int]]:
        """``(model input (1, 3, H, W), its pixels (H, W, 3) uint8, raw frame size)``; validates first."""
        if isinstance(frame, np.ndarray):
            if frame.dtype != np.uint8:
                raise TypeError(f"frame arrays must be uint8 RGB (H, W, 3), got dtype {frame.dtype}; pass "
                                "floats as an already normalised torch tensor")
            if frame.ndim != 3:
                raise ValueError(f"frame must have shape (H, W, 3), got {frame.ndim} dimensions {frame.shape}")
            if frame.shape[2] != 3:
                raise ValueError(f"frame must have 3 channels (RGB), got {frame.shape[2]} in shape {frame.shape}")
            if min(frame.shape[:2]) < 1:
                raise ValueError(f"frame is empty: shape {frame.shape}")
            raw_size = tuple(frame.shape[:2])
            if self.preprocess is not None:
                x = self._check_tensor(self.preprocess(frame), "preprocess output")
                return x, self.normalization.pixels(x), raw_size
            size = self._target_size(*raw_size)
            # the session keeps these pixels as its reference: never the caller's buffer, which a camera loop
            # may refill in place
            pixels = np.array(frame, order="C", copy=True)
            if size != raw_size:
                shrink = size[0] * size[1] < raw_size[0] * raw_size[1]
                pixels = cv2.resize(pixels, (size[1], size[0]),
                                    interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)
            return self.normalization.tensor(pixels, self.device, channels_last=True), pixels, raw_size
        if isinstance(frame, torch.Tensor):
            x = self._check_tensor(frame, "frame")
            raw_size = tuple(x.shape[-2:])
            if self.input_size is not None and raw_size != self.input_size:
                x = F.interpolate(x, size=self.input_size, mode="bilinear", align_corners=False, antialias=True)
            return x, self.normalization.pixels(x), raw_size
        raise TypeError(f"frame must be an (H, W, 3) uint8 numpy array or a float torch tensor, "
                        f"got {type(frame).__name__}")

    def _check_tensor(self, x: Any, what: str) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} must be a torch tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{what} must be a floating-point tensor (normalised), got {x.dtype}")
        if x.dim() == 3:
            x = x.unsqueeze(0)
        if x.dim() != 4 or x.shape[0] != 1:
            raise ValueError(f"{what} must have shape (3, H, W) or (1, 3, H, W), got {tuple(x.shape)}")
        if x.shape[1] != 3:
            raise ValueError(f"{what} must have 3 channels, got {x.shape[1]} in shape {tuple(x.shape)}")
        if min(x.shape[-2:]) < 8:
            raise ValueError(f"{what} is too small: {tuple(x.shape)}")
        if not torch.isfinite(x).all():
            raise ValueError(f"{what} contains NaN or infinite values")
        return x.to(self.device, torch.float32).contiguous(memory_format=torch.channels_last)


def _work(mask: ChangeMask, walk: Walk) -> float:
    """The share of the frame a cached frame starts from: the changed cells' bounding box for the box walk, the
    changed cells for the block walk."""
    if walk == Walk.MOVING:
        return mask.recompute_fraction
    cells = mask.cells
    rows, cols = np.flatnonzero(cells.any(axis=1)), np.flatnonzero(cells.any(axis=0))
    if not len(rows):
        return 0.0
    return (rows[-1] - rows[0] + 1) * (cols[-1] - cols[0] + 1) / cells.size


@dataclass(frozen=True)
class _Fallback:
    """Why a frame runs fully: a cause and its detail in words."""

    cause: Cause
    detail: str = ""

    @property
    def text(self) -> str:
        """The :attr:`FrameStats.reason` text, ``"cause: detail"``."""
        return f"{self.cause.value}: {self.detail}" if self.detail else self.cause.value
