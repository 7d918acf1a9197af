"""The still-camera test: phase correlation with the previous frame, before any keypoint is detected.

Keypoint matching costs about half a small frame's inference; on a still camera it would only find the identity.
Phase correlation of the grey levels finds a global shift in about a millisecond: a clear peak at a shift below
``min_motion`` (a homography moving no corner further counts as the identity) says the camera did not move. A weak
peak, from a pan over repetitive texture, a zoom or a scene cut, is not taken as stillness: a low change fraction
alone is not enough, since smooth regions hide real motion.

A zoom or a rotation gives a clear peak too (the shift of the frame's middle) but no global shift explains it:
:meth:`StillnessTest.local_motion` correlates the four quarters of the frame separately and fits the affine motion
their shifts imply, which tells a probe that the cache is misaligned before any keypoint is detected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from incrinf.extras import require
from incrinf.geometry import Box

cv2 = require("cv2", "stream", "camera streams")


@dataclass(frozen=True)
class LocalMotion:
    """The affine motion implied by the shifts of a frame's four quarters (:meth:`StillnessTest.local_motion`).

    Attributes:
        matrix: (3, 3) affine homography reference -> frame, input pixel coords (least squares over the quarters).
        residual: largest distance in pixels (per axis) between a quarter's shift and the fit's shift at its centre.
        response: the weakest quarter's phase-correlation peak.
    """

    matrix: np.ndarray
    residual: float
    response: float


@dataclass(frozen=True)
class Stillness:
    """The test's verdict: ``still``, and the global shift ``(dx, dy)`` in pixels that maps the reference onto the
    frame (phase correlation's peak, ``response`` 1 for identical images)."""

    still: bool
    shift: tuple[float, float]
    response: float


class StillnessTest:
    """Whether a frame shows the reference (the pixels the cache stands for) from a camera that did not move.

    The test correlates the frame with the reference itself rather than with the previous frame: a camera on a
    pole jitters by a fraction of a pixel around one place, and what matters is how far the frame sits from what
    the cache holds. A still frame's change mask is then taken against the reference moved by that sub-pixel shift
    (:func:`align`), so the jitter at every edge of the scene is not mistaken for change; the cached features are
    reused unmoved, as a homography below ``min_motion`` would be.

    Args:
        min_response: phase-correlation peak (1 for identical images) from which a shift counts as clear.
        max_shift: largest global shift in pixels still taken as no motion.
    """

    def __init__(self, min_response: float, max_shift: float) -> None:
        self.min_response = min_response
        self.max_shift = max_shift
        self._window: np.ndarray | None = None
        self._quarter_window: np.ndarray | None = None
        # (image, its grey levels) of the latest frame tested and of the latest reference whose grey levels are
        # known: a session's next reference is one of its frames, or a frame's refreshed boxes pasted over the last
        # reference (:meth:`derive`), so its grey levels need not be computed again
        self._frame: tuple[np.ndarray, np.ndarray] | None = None
        self._reference: tuple[np.ndarray, np.ndarray] | None = None

    def __call__(self, pixels: np.ndarray, reference: np.ndarray) -> Stillness:
        """The verdict on ``pixels`` (H, W, 3) uint8 against ``reference`` (the same size)."""
        gray, ref = _gray(pixels), self.gray(reference)
        self._frame = (pixels, gray)
        if self._window is None or self._window.shape != gray.shape:
            self._window = cv2.createHanningWindow((gray.shape[1], gray.shape[0]), cv2.CV_32F)
        # copies: phaseCorrelate writes into its inputs, and the grey levels are kept for the next frame
        (dx, dy), response = cv2.phaseCorrelate(ref.copy(), gray.copy(), self._window)
        scale = pixels.shape[1] / gray.shape[1]
        dx, dy = dx * scale, dy * scale
        still = response >= self.min_response and math.hypot(dx, dy) < self.max_shift
        return Stillness(bool(still), (float(dx), float(dy)), float(response))

    def local_motion(self, pixels: np.ndarray, reference: np.ndarray) -> LocalMotion:
        """The affine motion ``reference`` -> ``pixels`` (both (H, W, 3) uint8) that the shifts of their four
        quarters imply (each quarter correlated alone, on the grey levels the test already has); four shifts give
        eight equations for the affine's six unknowns, the residual says whether one motion explains them."""
        gray, ref = self.gray(pixels), self.gray(reference)
        h, w = gray.shape[0] // 2, gray.shape[1] // 2
        if self._quarter_window is None or self._quarter_window.shape != (h, w):
            self._quarter_window = cv2.createHanningWindow((w, h), cv2.CV_32F)
        scale = pixels.shape[1] / gray.shape[1]
        centres, shifts, responses = [], [], []
        for y0 in (0, h):
            for x0 in (0, w):
                # copies: phaseCorrelate writes into its inputs
                (dx, dy), response = cv2.phaseCorrelate(ref[y0:y0 + h, x0:x0 + w].copy(),
                                                        gray[y0:y0 + h, x0:x0 + w].copy(), self._quarter_window)
                centres.append(((x0 + (w - 1) / 2) * scale, (y0 + (h - 1) / 2) * scale, 1.0))
                shifts.append((dx * scale, dy * scale))
                responses.append(response)
        points, moves = np.array(centres), np.array(shifts)
        fit = np.linalg.lstsq(points, moves, rcond=None)[0]  # (3, 2): displacement = (x, y, 1) @ fit
        matrix = np.eye(3)
        matrix[:2] += fit.T
        return LocalMotion(matrix, float(np.abs(points @ fit - moves).max()), float(min(responses)))

    def gray(self, image: np.ndarray) -> np.ndarray:
        """The test's grey levels of ``image`` (H, W, 3) uint8 (float32, at half size above ``_HALVE_ABOVE``
        pixels): those already known when ``image`` is the latest frame tested or reference derived (the same
        object, which the session never changes in place), else computed."""
        for known in (self._reference, self._frame):
            if known is not None and known[0] is image:
                return known[1]
        gray = _gray(image)
        self._reference = (image, gray)
        return gray

    def derive(self, reference: np.ndarray, pixels: np.ndarray, base: np.ndarray, boxes: list[Box]) -> None:
        """Note the grey levels of ``reference`` = ``base`` with the pixel ``boxes`` ``(y0, y1, x0, x1)`` (end
        exclusive) taken from ``pixels``, when those of both are known (``pixels`` the latest frame tested,
        ``base`` the latest reference): pasted from theirs. Exact when every grey pixel comes from one side (a
        halved frame's 2 x 2 blocks straddle no box edge when the edges and the sides are even); otherwise
        nothing is noted and the next test computes them."""
        if self._frame is None or self._frame[0] is not pixels or self._reference is None \
                or self._reference[0] is not base:
            return
        h, w = reference.shape[:2]
        factor = 1 if _grey_size(h, w) == (h, w) else 2
        if h % factor or w % factor or any(v % factor for box in boxes for v in box):
            return
        gray, frame_gray = self._reference[1].copy(), self._frame[1]
        for y0, y1, x0, x1 in boxes:
            y0, y1, x0, x1 = y0 // factor, y1 // factor, x0 // factor, x1 // factor
            gray[y0:y1, x0:x1] = frame_gray[y0:y1, x0:x1]
        self._reference = (reference, gray)


# Frames are correlated at half size above this many pixels: the shift keeps a tenth of a pixel's precision, and
# the transform costs a quarter.
_HALVE_ABOVE = 160 * 160


def _gray(pixels: np.ndarray) -> np.ndarray:
    """Grey levels (float32) of an (H, W, 3) frame, at half size for a large one."""
    gray = cv2.cvtColor(pixels, cv2.COLOR_RGB2GRAY)
    size = _grey_size(*gray.shape)
    if size != gray.shape:
        gray = cv2.resize(gray, (size[1], size[0]), interpolation=cv2.INTER_AREA)
    return gray.astype(np.float32)


def _grey_size(h: int, w: int) -> tuple[int, int]:
    """(rows, columns) of the grey levels of an (h, w) frame."""
    return (h // 2, w // 2) if h * w > _HALVE_ABOVE else (h, w)


# Shifts below this (pixels) leave the reference as it is.
_SUBPIXEL = 0.05


def align(reference: np.ndarray, shift: tuple[float, float]) -> np.ndarray:
    """``reference`` (H, W, 3) moved by ``shift`` (dx, dy) pixels (bilinear; mirrored at the border), or itself
    when the shift is negligible."""
    dx, dy = shift
    if math.hypot(dx, dy) < _SUBPIXEL:
        return reference
    h, w = reference.shape[:2]
    matrix = np.float32([[1, 0, dx], [0, 1, dy]])
    if reference.ndim == 3 and reference.shape[2] == 3 and reference.dtype == np.uint8:
        # OpenCV's vectorised bilinear warp takes four channels: the same fixed-point arithmetic per channel (the
        # same values), in less than half the time of three even with the conversions
        four = cv2.warpAffine(cv2.cvtColor(reference, cv2.COLOR_RGB2RGBA), matrix, (w, h), flags=cv2.INTER_LINEAR,
                              borderMode=cv2.BORDER_REFLECT_101)
        return cv2.cvtColor(four, cv2.COLOR_RGBA2RGB)
    return cv2.warpAffine(reference, matrix, (w, h), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT_101)
