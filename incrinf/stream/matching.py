"""Frame-to-frame homography estimation from keypoint matches (CacheInf, "identifying reusable results").

Coordinate convention used throughout ``incrinf.stream``: a point is ``(x, y)`` with ``x`` the column and
``y`` the row, in pixels, pixel centres at integers (OpenCV's convention). A homography ``H`` (3x3 float64)
maps a point of the *previous* frame to the *current* frame: ``(x', y', w') = H @ (x, y, 1)``, then
``(x'/w', y'/w')``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from incrinf.extras import require
from incrinf.stream.config import MatcherSettings
from incrinf.stream.warp import scale_homography

cv2 = require("cv2", "stream", "camera streams")

Matcher = Literal["orb", "akaze", "sift"]
_DEFAULTS = MatcherSettings()  # the one place the matcher's defaults are written

# Bounds of the determinant of H's 2x2 part: zooming more than 2x per axis between consecutive frames is
# not camera motion a cache can exploit, it is a bad fit.
_MIN_DET = 0.25
_MAX_DET = 4.0
# Largest change of the homogeneous scale w' across the frame; more is "strong perspective".
_MAX_PERSPECTIVE = 0.5
# ECC ignores pixels whose blurred residual under the keypoint fit exceeds this (0-255 gray levels).
_ECC_OUTLIER_LEVEL = 40.0
# ... unless that leaves less than this fraction of the frame, when the keypoint fit is too rough to judge.
_ECC_MIN_MASK_FRACTION = 0.25


@dataclass(frozen=True)
class HomographyResult:
    """Outcome of one homography estimate.

    Attributes:
        matrix: (3, 3) float64 mapping previous-frame pixel coords ``(x, y, 1)`` to current-frame coords,
            normalised so ``matrix[2, 2] == 1``; ``None`` when ``ok`` is False.
        ok: whether ``matrix`` is usable for reuse.
        reason: ``"ok"`` or why not (``"too few keypoints (n < 20)"``, ``"too few matches (n < 20)"``,
            ``"too few inliers (n < 12)"``, ``"degenerate homography: ..."``, ``"no previous frame"``).
        n_matches: matches that passed the ratio test.
        n_inliers: RANSAC inliers (0 when RANSAC did not run).
        refined: whether ECC refinement was applied and accepted.
    """

    matrix: np.ndarray | None
    ok: bool
    reason: str
    n_matches: int = 0
    n_inliers: int = 0
    refined: bool = False


@dataclass(frozen=True)
class FrameFeatures:
    """Keypoints of one frame.

    Attributes:
        points: (K, 2) float32 keypoint coords (x, y).
        descriptors: (K, D) uint8 (ORB, AKAZE) or float32 (SIFT), or None when K == 0.
        gray: (H, W) uint8 frame, kept for ECC refinement.
    """

    points: np.ndarray
    descriptors: np.ndarray | None
    gray: np.ndarray

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) of the frame."""
        return self.gray.shape[:2]


def to_gray(frame: np.ndarray) -> np.ndarray:
    """Convert a frame to single-channel uint8.

    Args:
        frame: (H, W, 3) RGB or (H, W) grayscale, uint8 or float in [0, 255].

    Returns:
        (H, W) uint8.
    """
    frame = np.asarray(frame)
    if frame.ndim == 3 and frame.shape[2] == 1:
        frame = frame[:, :, 0]
    if frame.dtype != np.uint8:
        frame = np.clip(np.rint(frame), 0, 255).astype(np.uint8)
    if frame.ndim == 2:
        return np.ascontiguousarray(frame)
    if frame.ndim == 3 and frame.shape[2] == 3:
        return cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_RGB2GRAY)
    raise ValueError(f"expected an (H, W, 3) RGB or (H, W) grayscale frame, got shape {frame.shape}")


def _make_detector(matcher: Matcher, max_features: int) -> cv2.Feature2D:
    if matcher == "orb":
        # Small patches (default 31) keep keypoints near the borders of small frames; 3 pyramid levels suffice
        # for frame-to-frame motion and give finer keypoint positions than 8.
        return cv2.ORB_create(
            nfeatures=max_features, nlevels=3, edgeThreshold=15, patchSize=15, fastThreshold=10
        )
    if matcher == "akaze":
        if not hasattr(cv2, "AKAZE_create"):
            # OpenCV 5 moved AKAZE out of the main modules into opencv-contrib.
            raise RuntimeError(
                f"AKAZE is not available in this OpenCV build ({cv2.__version__}); install OpenCV 4.x or "
                "opencv-contrib, or use matcher='orb' or 'sift'"
            )
        # Response threshold below the default 1e-3 so small, low-contrast frames still give enough points.
        return cv2.AKAZE_create(threshold=1e-4)
    if matcher == "sift":
        return cv2.SIFT_create(nfeatures=max_features)
    raise ValueError(f"unknown matcher {matcher!r}; expected 'orb', 'akaze' or 'sift'")


def ratio_matches(desc_prev: np.ndarray, desc_curr: np.ndarray, ratio: float) -> np.ndarray:
    """Brute-force kNN (k=2) matching with Lowe's ratio test.

    Args:
        desc_prev: (K1, D) descriptors of the previous frame: uint8 binary (ORB, AKAZE; Hamming distance)
            or float32 (SIFT; L2 distance).
        desc_curr: (K2, D) descriptors of the current frame, same kind.
        ratio: keep a match when its distance < ratio x the second-best distance.

    Returns:
        (M, 2) int64 pairs ``(index in prev, index in curr)``.
    """
    if len(desc_prev) < 2 or len(desc_curr) < 2:
        return np.zeros((0, 2), dtype=np.int64)
    binary = desc_prev.dtype == np.uint8
    # Brute force is exact and deterministic (FLANN would be approximate for no gain at these sizes). batchDistance is
    # what BFMatcher.knnMatch runs, returned as arrays instead of a DMatch object per neighbour (a fifth of the call
    # for 500 x 500 ORB descriptors).
    distances, nearest = cv2.batchDistance(desc_prev, desc_curr, cv2.CV_32S if binary else cv2.CV_32F,
                                           normType=cv2.NORM_HAMMING if binary else cv2.NORM_L2, K=2)
    # float32 like a DMatch's distance, compared in double precision like the Python test on DMatch objects was
    distances = distances.astype(np.float32).astype(np.float64)
    kept = np.flatnonzero(distances[:, 0] < ratio * distances[:, 1])
    return np.stack([kept, nearest[kept, 0]], axis=1).astype(np.int64).reshape(-1, 2)


def refine_ecc(
    prev_gray: np.ndarray,
    curr_gray: np.ndarray,
    matrix: np.ndarray,
    iterations: int = 30,
    max_side: int = 320,
) -> np.ndarray | None:
    """Refine a homography by direct photometric alignment (``cv2.findTransformECC``).

    Keypoint fits extrapolate poorly to the frame's corners (errors of 1-2 px at 160 px frames); ECC
    aligns all pixels and typically brings them to ~0.1 px, for a few ms per 224 px frame. Larger frames
    are aligned at a reduced size (longest side ``max_side``) to bound the cost.

    Args:
        prev_gray: (H, W) uint8 previous frame.
        curr_gray: (H, W) uint8 current frame.
        matrix: (3, 3) initial homography prev -> curr.
        iterations: most ECC iterations.
        max_side: longest side ECC works at.

    Returns:
        (3, 3) refined homography prev -> curr, or None when ECC did not converge.
    """
    size = prev_gray.shape[:2]
    factor = min(1.0, max_side / max(size))
    work_size = (max(1, round(size[0] * factor)), max(1, round(size[1] * factor)))
    if work_size != size:
        prev_gray = cv2.resize(prev_gray, work_size[::-1], interpolation=cv2.INTER_AREA)
        curr_gray = cv2.resize(curr_gray, work_size[::-1], interpolation=cv2.INTER_AREA)
        matrix = scale_homography(matrix, size, work_size)
    # ECC's warp maps template (curr) coords to input (prev) coords, i.e. the inverse of ours.
    warp = np.linalg.inv(matrix).astype(np.float32)
    # Moving objects pull a plain ECC fit off the background: ignore pixels the keypoint fit leaves far off.
    h, w = work_size
    aligned = cv2.warpPerspective(prev_gray, matrix, (w, h))
    inside = cv2.warpPerspective(np.ones_like(prev_gray), matrix, (w, h), flags=cv2.INTER_NEAREST)
    residual = cv2.blur(cv2.absdiff(curr_gray, aligned).astype(np.float32), (5, 5))
    mask = ((residual < _ECC_OUTLIER_LEVEL) & (inside > 0)).astype(np.uint8)
    if mask.mean() < _ECC_MIN_MASK_FRACTION:
        mask = None
    criteria = (cv2.TERM_CRITERIA_EPS | cv2.TERM_CRITERIA_COUNT, iterations, 1e-5)
    try:
        _, warp = cv2.findTransformECC(
            curr_gray.astype(np.float32),
            prev_gray.astype(np.float32),
            warp,
            cv2.MOTION_HOMOGRAPHY,
            criteria,
            mask,
            1,
        )
    except cv2.error:
        return None
    refined = np.linalg.inv(warp.astype(np.float64))
    if not np.all(np.isfinite(refined)) or abs(refined[2, 2]) < 1e-12:
        return None
    return scale_homography(refined, work_size, size)


def degeneracy_reason(matrix: np.ndarray | None, size: tuple[int, int]) -> str | None:
    """Say why a homography is unusable for a frame of ``size``, or None when it is plausible camera motion.

    Checks: present and finite; ``|det|`` of the 2x2 part in [0.25, 4]; the homogeneous scale varies by
    less than 50% over the frame (no strong perspective) and stays positive; the frame's corners map to a
    convex quad of the same orientation (no fold or self-intersection).

    Args:
        matrix: (3, 3) homography or None.
        size: (height, width) of the previous frame.
    """
    if matrix is None:
        return "degenerate homography: no solution"
    if not np.all(np.isfinite(matrix)) or abs(matrix[2, 2]) < 1e-12:
        return "degenerate homography: not finite"
    m = matrix / matrix[2, 2]
    det = float(np.linalg.det(m[:2, :2]))
    if not _MIN_DET <= det <= _MAX_DET:
        return f"degenerate homography: det {det:.3g} outside [{_MIN_DET}, {_MAX_DET}]"
    h, w = size
    corners = np.array([[0, 0, 1], [w - 1, 0, 1], [w - 1, h - 1, 1], [0, h - 1, 1]], dtype=np.float64)
    mapped = corners @ m.T
    scale = mapped[:, 2]
    if np.any(scale <= 0) or np.max(np.abs(scale - 1.0)) > _MAX_PERSPECTIVE:
        return "degenerate homography: strong perspective"
    quad = mapped[:, :2] / scale[:, None]
    edges = np.roll(quad, -1, axis=0) - quad
    cross = edges[:, 0] * np.roll(edges, -1, axis=0)[:, 1] - edges[:, 1] * np.roll(edges, -1, axis=0)[:, 0]
    # The source corners go clockwise in image coords (y down), i.e. every cross product is positive.
    if np.any(cross <= 0):
        return "degenerate homography: corners map to a non-convex quad"
    return None


class HomographyEstimator:
    """Estimates the homography between consecutive frames, detecting each frame's keypoints once.

    Pipeline (CacheInf): keypoints + binary descriptors on the grayscale frame, brute-force kNN (k=2) with
    Lowe's ratio test, ``cv2.findHomography(RANSAC)``, plausibility checks (:func:`degeneracy_reason`),
    optionally ECC refinement (:func:`refine_ecc`).

    Example:
        >>> est = HomographyEstimator()
        >>> for frame in frames:  # doctest: +SKIP
        ...     result = est.update(frame)  # previous -> this frame; ok=False on the first frame

    Args:
        settings: the matcher's settings (default: :class:`~incrinf.stream.config.MatcherSettings`' defaults,
            which say why they are what they are: keypoint kind, ratio test, RANSAC threshold, inlier floor,
            ECC refinement).
        **overrides: :class:`~incrinf.stream.config.MatcherSettings` fields replacing those of ``settings``
            (``matcher="sift"``, ``refine=True``, ...), validated as the settings are.
    """

    def __init__(self, settings: MatcherSettings | None = None, **overrides: Any) -> None:
        self.settings = dataclasses.replace(settings or _DEFAULTS, **overrides)
        self._detector = _make_detector(self.settings.matcher, self.settings.max_features)
        self._prev: FrameFeatures | None = None

    def reset(self) -> None:
        """Forget the previous frame (e.g. after a scene cut)."""
        self._prev = None

    def detect(self, frame: np.ndarray) -> FrameFeatures:
        """Detect keypoints and descriptors of one (H, W, 3) RGB or (H, W) frame."""
        gray = to_gray(frame)
        keypoints, descriptors = self._detector.detectAndCompute(gray, None)
        points = np.asarray(cv2.KeyPoint_convert(keypoints), dtype=np.float32).reshape(-1, 2)
        return FrameFeatures(points=points, descriptors=descriptors, gray=gray)

    def update(self, frame: np.ndarray) -> HomographyResult:
        """Feed the next frame; return the homography previous frame -> ``frame``.

        Args:
            frame: (H, W, 3) uint8 RGB or (H, W) grayscale; every frame must have the same size.

        Returns:
            The estimate; ``ok=False`` with reason ``"no previous frame"`` on the first call.
        """
        curr = self.detect(frame)
        prev, self._prev = self._prev, curr
        if prev is None:
            return HomographyResult(None, False, "no previous frame")
        if prev.size != curr.size:
            raise ValueError(f"frame size changed from {prev.size} to {curr.size}; call reset() first")
        return self.match(prev, curr)

    def match(self, prev: FrameFeatures, curr: FrameFeatures) -> HomographyResult:
        """Estimate the homography prev -> curr between two already-detected frames."""
        cfg = self.settings
        n_kp = min(len(prev.points), len(curr.points))
        if n_kp < cfg.min_matches or prev.descriptors is None or curr.descriptors is None:
            return HomographyResult(None, False, f"too few keypoints ({n_kp} < {cfg.min_matches})")
        pairs = ratio_matches(prev.descriptors, curr.descriptors, cfg.ratio)
        n_matches = len(pairs)
        if n_matches < cfg.min_matches:
            return HomographyResult(
                None, False, f"too few matches ({n_matches} < {cfg.min_matches})", n_matches
            )
        src = prev.points[pairs[:, 0]].reshape(-1, 1, 2)
        dst = curr.points[pairs[:, 1]].reshape(-1, 1, 2)
        matrix, inlier_mask = cv2.findHomography(src, dst, cv2.RANSAC, cfg.ransac_threshold)
        n_inliers = 0 if inlier_mask is None else int(inlier_mask.sum())
        reason = degeneracy_reason(matrix, prev.size)
        if reason is not None:
            return HomographyResult(None, False, reason, n_matches, n_inliers)
        if n_inliers < cfg.min_inliers:
            return HomographyResult(
                None, False, f"too few inliers ({n_inliers} < {cfg.min_inliers})", n_matches, n_inliers
            )
        matrix = matrix / matrix[2, 2]
        if cfg.refine:
            refined = refine_ecc(prev.gray, curr.gray, matrix)
            if refined is not None and degeneracy_reason(refined, prev.size) is None:
                if corner_distance(refined, matrix, prev.size) <= cfg.ransac_threshold:
                    return HomographyResult(refined, True, "ok", n_matches, n_inliers, refined=True)
        return HomographyResult(matrix, True, "ok", n_matches, n_inliers)


def corner_distance(a: np.ndarray, b: np.ndarray, size: tuple[int, int]) -> float:
    """Largest distance in pixels between where two homographies send the corners of a frame of ``size``.

    Args:
        a: (3, 3) homography.
        b: (3, 3) homography.
        size: (height, width) of the frame whose corners (pixel centres) are mapped.
    """
    h, w = size
    corners = np.array([[0, 0, 1], [w - 1, 0, 1], [w - 1, h - 1, 1], [0, h - 1, 1]], dtype=np.float64)
    pa, pb = corners @ np.asarray(a, np.float64).T, corners @ np.asarray(b, np.float64).T
    diff = pa[:, :2] / pa[:, 2:] - pb[:, :2] / pb[:, 2:]
    return float(np.max(np.hypot(diff[:, 0], diff[:, 1])))


def estimate_homography(prev: np.ndarray, curr: np.ndarray, settings: MatcherSettings | None = None,
                        **overrides: Any) -> HomographyResult:
    """Estimate the homography mapping ``prev`` pixel coords to ``curr`` pixel coords.

    One-shot form of :class:`HomographyEstimator`; use the class for streams so each frame is detected once.

    Args:
        prev: (H, W, 3) uint8 RGB or (H, W) grayscale previous frame.
        curr: current frame, same size as ``prev``.
        settings: the matcher's settings (default: :class:`~incrinf.stream.config.MatcherSettings`' defaults).
        **overrides: :class:`~incrinf.stream.config.MatcherSettings` fields replacing those of ``settings``
            (``refine=True``, ``max_features=1000``, ...), validated as the settings are.

    Returns:
        A :class:`HomographyResult`.
    """
    est = HomographyEstimator(settings, **overrides)
    prev_features, curr_features = est.detect(prev), est.detect(curr)
    if prev_features.size != curr_features.size:
        raise ValueError(f"frames differ in size: {prev_features.size} vs {curr_features.size}")
    return est.match(prev_features, curr_features)
