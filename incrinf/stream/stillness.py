"""The still-camera test: phase correlation with the previous frame, before any keypoint is detected.

Keypoint matching costs about half a small frame's inference; on a still camera it would only find the identity.
Phase correlation of the grey levels finds a global shift in about a millisecond: a clear peak at a shift below
``min_motion`` (a homography moving no corner further counts as the identity) says the camera did not move. A weak
peak, from a pan over repetitive texture, a zoom or a scene cut, is not taken as stillness: a low change fraction
alone is not enough, since smooth regions hide real motion.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from incrinf.extras import require

cv2 = require("cv2", "stream", "camera streams")


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

    def __call__(self, pixels: np.ndarray, reference: np.ndarray) -> Stillness:
        """The verdict on ``pixels`` (H, W, 3) uint8 against ``reference`` (the same size)."""
        gray, ref = _gray(pixels), _gray(reference)
        if self._window is None or self._window.shape != gray.shape:
            self._window = cv2.createHanningWindow((gray.shape[1], gray.shape[0]), cv2.CV_32F)
        (dx, dy), response = cv2.phaseCorrelate(ref, gray, self._window)
        scale = pixels.shape[1] / gray.shape[1]
        dx, dy = dx * scale, dy * scale
        still = response >= self.min_response and math.hypot(dx, dy) < self.max_shift
        return Stillness(bool(still), (float(dx), float(dy)), float(response))


# Frames are correlated at half size above this many pixels: the shift keeps a tenth of a pixel's precision, and
# the transform costs a quarter.
_HALVE_ABOVE = 160 * 160


def _gray(pixels: np.ndarray) -> np.ndarray:
    """Grey levels (float32) of an (H, W, 3) frame, at half size for a large one."""
    gray = cv2.cvtColor(pixels, cv2.COLOR_RGB2GRAY)
    if gray.shape[0] * gray.shape[1] > _HALVE_ABOVE:
        gray = cv2.resize(gray, (gray.shape[1] // 2, gray.shape[0] // 2), interpolation=cv2.INTER_AREA)
    return gray.astype(np.float32)


# Shifts below this (pixels) leave the reference as it is.
_SUBPIXEL = 0.05


def align(reference: np.ndarray, shift: tuple[float, float]) -> np.ndarray:
    """``reference`` (H, W, 3) moved by ``shift`` (dx, dy) pixels (bilinear; mirrored at the border), or itself
    when the shift is negligible."""
    dx, dy = shift
    if math.hypot(dx, dy) < _SUBPIXEL:
        return reference
    h, w = reference.shape[:2]
    return cv2.warpAffine(reference, np.float32([[1, 0, dx], [0, 1, dy]]), (w, h), flags=cv2.INTER_LINEAR,
                          borderMode=cv2.BORDER_REFLECT_101)
