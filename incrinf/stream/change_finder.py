"""What changed since the cached frame: the camera's motion and the change mask, against the pixels the cache
stands for.

The session keeps a *reference* (the pixels its cache stands for: the last full frame's, then the warped reference
with each cached frame's recomputed cells taken from that frame) and the previous frame's pixels and keypoints. For
a frame that may use the cache, :meth:`ChangeFinder.find` sets its homography (the still-camera test first, keypoint
matching only when the camera moved), its warped reference and its change mask, or a fallback when the motion leaves
the cache unusable or too much changed. :meth:`ChangeFinder.commit` then makes the frame the previous one.
"""

from __future__ import annotations

import math
import time

import cv2
import numpy as np

from incrinf.geometry import Box
from incrinf.stream.camera import CameraEngine
from incrinf.stream.change_mask import change_mask
from incrinf.stream.config import StreamConfig
from incrinf.stream.frame_state import Fallback, FrameState
from incrinf.stream.matching import FrameFeatures, HomographyEstimator, corner_distance
from incrinf.stream.stats import Cause
from incrinf.stream.stillness import Stillness, StillnessTest, align
from incrinf.stream.warp import warp_image, warp_valid_mask


class ChangeFinder:
    """The reference the cache stands for, and per frame the camera's motion and the cells that changed.

    Args:
        config: the session's settings (matcher, ``still_fraction``, ``still_response``, ``min_motion``, ``cell``,
            ``max_ratio``, ``opencv_threads``: set here, for the whole process).

    Attributes:
        estimator: the keypoint homography estimator.
        stillness: the still-camera test.
        reference: (H, W, 3) uint8 pixels the cache stands for (None: no frame yet).
        prev_pixels: (H, W, 3) uint8 pixels of the previous frame (None: no frame yet).
        prev_features: the previous frame's keypoints, when it had them detected.
    """

    def __init__(self, config: StreamConfig) -> None:
        self.config = config
        if config.opencv_threads is not None:
            cv2.setNumThreads(config.opencv_threads)  # process-wide, as torch.set_num_threads
        self.estimator = HomographyEstimator(config.matcher_settings)
        self.stillness = StillnessTest(config.still_response, max(config.min_motion, 0.5))
        self.reset()

    def reset(self) -> None:
        """Forget the stream: the next frame has no previous one."""
        self.reference: np.ndarray | None = None
        self.prev_pixels: np.ndarray | None = None
        self.prev_features: FrameFeatures | None = None

    def find(self, f: FrameState, engine: CameraEngine, matrix_given: np.ndarray | None,
             pixel_threshold: float) -> None:
        """Set the frame's homography, warped reference, change mask and keypoints, or its fallback (the motion
        leaves the cache unusable, matching failed, too much changed); times the matching and the mask. Keypoints
        are detected only when a homography is estimated (the previous frame's lazily, when it had none)."""
        config, times = self.config, f.times
        stillness = self.rule_out(f, engine) if matrix_given is None else None  # timed into times.match
        if f.fallback is not None:
            return
        clock = time.perf_counter()
        if stillness is not None and stillness.still:
            # a still camera: keypoint matching (about half a small frame's inference) would find the identity. The
            # mask is taken against the reference moved by the camera's sub-pixel jitter; the reference itself keeps
            # the alignment of the features the cache holds (moving it would let a slow pan drift away unseen)
            aligned = align(self.reference, stillness.shift)
            f.mask = change_mask(f.pixels, aligned, config.cell, pixel_threshold, None)
            clock, times.mask = time.perf_counter(), time.perf_counter() - clock
            if f.mask.recompute_fraction <= config.still_fraction:
                f.matrix, f.warped = np.eye(3), self.reference
                return
        if matrix_given is not None:
            f.matrix = matrix_given
        else:
            f.features = self.estimator.detect(f.pixels)
            prev = self.prev_features or self.estimator.detect(self.prev_pixels)
            result = self.estimator.match(prev, f.features)
            f.n_matches = result.n_matches
            if not result.ok:
                times.match += time.perf_counter() - clock
                f.fallback = Fallback(Cause.MATCH_FAILED, result.reason)
                return
            f.matrix = result.matrix
        size = f.pixels.shape[:2]
        if corner_distance(f.matrix, np.eye(3), size) < config.min_motion:
            f.matrix = np.eye(3)
        mask_start = time.perf_counter()
        times.match += mask_start - clock
        if f.still:
            f.warped = self.reference  # a still camera: nothing to warp, nothing uncovered
            if f.mask is None:
                f.mask = change_mask(f.pixels, f.warped, config.cell, pixel_threshold, None)
        else:
            unusable = engine.unusable_fraction(f.matrix)
            if unusable > engine.dense_cut:  # checked before the warp and mask it would make useless
                f.mask = None
                f.fallback = Fallback(Cause.CACHE_UNUSABLE, f"{unusable:.0%} of the cache misaligned by the motion")
                times.mask += time.perf_counter() - mask_start
                return
            f.warped = warp_image(self.reference, f.matrix)
            f.mask = change_mask(f.pixels, f.warped, config.cell, pixel_threshold, warp_valid_mask(f.matrix, size))
        times.mask += time.perf_counter() - mask_start
        fraction = f.mask.recompute_fraction
        if fraction > config.max_ratio:
            f.fallback = Fallback(Cause.CHANGED_FRACTION, f"{fraction:.2f} > max_ratio {config.max_ratio:g}")
            f.warped = None

    def rule_out(self, f: FrameState, engine: CameraEngine) -> Stillness | None:
        """The still-camera test of the frame against the reference, and for a frame that moved by a clear shift,
        whether that motion leaves the cache misaligned (then ``f.fallback`` is ``CACHE_UNUSABLE``): from the pixels
        alone, before any keypoint is detected, so a probe can ask before the cache is filled. Times itself into
        ``f.times.match``; returns the test's verdict (None: the test is off, ``still_fraction`` 0)."""
        config, clock = self.config, time.perf_counter()
        if config.still_fraction <= 0:
            return None
        stillness = self.stillness(f.pixels, self.reference)
        if not stillness.still and stillness.response >= self.stillness.min_response:
            f.fallback = self._misaligned(f, engine, stillness)
            f.told_by_pixels = f.fallback is not None
        f.times.match += time.perf_counter() - clock
        return stillness

    def _misaligned(self, f: FrameState, engine: CameraEngine, stillness: Stillness) -> Fallback | None:
        """Why a frame whose clear shift ``stillness`` measured leaves the cache unusable, or None: that translation
        alone misaligns it (a keypoint fit would refine the motion, rarely into one the cache can use), or the
        quarters' shifts, when they are clear and one affine motion explains each within the misalignment the cache
        tolerates, show a zoom or rotation that misaligns it whatever the exact translation."""
        dx, dy = stillness.shift
        unusable = engine.estimate_unusable(np.array([[1.0, 0.0, dx], [0.0, 1.0, dy], [0.0, 0.0, 1.0]]))
        if unusable > engine.dense_cut:
            return Fallback(Cause.CACHE_UNUSABLE, f"{unusable:.0%} of the cache misaligned by a clear "
                                                  f"{math.hypot(dx, dy):.1f} px shift")
        local = self.stillness.local_motion(f.pixels, self.reference)
        if local.response >= self.stillness.min_response and \
                local.residual <= self.config.max_misalignment * engine.position_pixels:
            unusable = engine.unusable_at_any_shift(local.matrix)
            if unusable > engine.dense_cut:
                return Fallback(Cause.CACHE_UNUSABLE, f"{unusable:.0%} of the cache misaligned by the zoom or rotation "
                                                      "of the frame quarters' shifts")
        return None

    def commit(self, f: FrameState, kept_cache: bool, refreshed: list[Box] | None) -> None:
        """The frame succeeded: it becomes the previous frame. ``kept_cache``: it ran cached (the reference then
        keeps the warped pixels where the frame kept cached values; ``refreshed``: the boxes the engine recomputed,
        None: the change mask's cells); else the frame's pixels become the reference."""
        if kept_cache:
            # the reference is what the cache stands for: stale where the frame kept cached values
            if refreshed is None:
                self.reference = np.where(f.mask.pixel_mask[:, :, None], f.pixels, f.warped)
            else:
                self.reference = f.warped.copy()
                for y0, y1, x0, x1 in refreshed:
                    self.reference[y0:y1, x0:x1] = f.pixels[y0:y1, x0:x1]
                self.stillness.derive(self.reference, f.pixels, f.warped, refreshed)
        else:
            self.reference = f.pixels
        self.prev_pixels = f.pixels
        self.prev_features = f.features
