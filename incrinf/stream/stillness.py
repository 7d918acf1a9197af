"""The still-camera test: phase correlation with the previous frame, before any keypoint is detected.

Keypoint matching costs about half a small frame's inference; on a still camera it would only find the identity.
Phase correlation of the grey levels finds a global shift in about a millisecond: a clear peak at a shift below
half of ``min_motion`` says the camera did not move (a weak peak, from a pan over repetitive texture, a zoom or a
scene cut, is not taken as stillness: a low change fraction alone is not enough, since smooth regions hide real
motion).
"""

from __future__ import annotations

import math

import numpy as np

from incrinf.extras import require

cv2 = require("cv2", "stream", "camera streams")


class StillnessTest:
    """Whether consecutive frames come from a camera that did not move.

    Args:
        min_response: phase-correlation peak (1 for identical frames) from which a shift counts as clear.
        max_shift: largest global shift in pixels still taken as no motion.
    """

    def __init__(self, min_response: float, max_shift: float) -> None:
        self.min_response = min_response
        self.max_shift = max_shift
        self._prev: np.ndarray | None = None  # grey levels of the previous frame, when it was tested
        self._current: np.ndarray | None = None
        self._window: np.ndarray | None = None

    def reset(self) -> None:
        self._prev = self._current = None

    def __call__(self, pixels: np.ndarray, previous: np.ndarray) -> bool:
        """Whether ``pixels`` (H, W, 3) uint8 shows the scene of ``previous`` (the previous frame's pixels)
        unmoved. The grey levels are kept for the next frame's test (:meth:`advance`)."""
        gray = cv2.cvtColor(pixels, cv2.COLOR_RGB2GRAY).astype(np.float32)
        prev = self._prev
        if prev is None or prev.shape != gray.shape:
            prev = cv2.cvtColor(previous, cv2.COLOR_RGB2GRAY).astype(np.float32)
        if self._window is None or self._window.shape != gray.shape:
            self._window = cv2.createHanningWindow((gray.shape[1], gray.shape[0]), cv2.CV_32F)
        (dx, dy), response = cv2.phaseCorrelate(prev, gray, self._window)
        self._current = gray
        return response >= self.min_response and math.hypot(dx, dy) < self.max_shift

    def advance(self) -> None:
        """The frame tested last (if any) became the previous frame."""
        self._prev, self._current = self._current, None
