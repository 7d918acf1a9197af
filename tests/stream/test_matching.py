"""Homography estimation (incrinf.stream.matching) on synthetic camera motion with known homographies."""

import cv2
import numpy as np
import pytest
import skimage.data

from incrinf.stream.matching import (
    HomographyEstimator,
    corner_distance,
    degeneracy_reason,
    estimate_homography,
    ratio_matches,
)
from incrinf.stream.warp import scale_homography, warp_image, warp_valid_mask
from incrinf.testing.clips import load_clip
from incrinf.testing.synthetic import synthetic_camera, synthetic_scene

SIZE = (160, 160)
HAS_AKAZE = hasattr(cv2, "AKAZE_create")


@pytest.fixture(scope="module")
def photo() -> np.ndarray:
    return skimage.data.astronaut()


def _pairs(photo, motion, seed=0, n_frames=3):
    frames = synthetic_camera(photo, n_frames, size=SIZE, motion=motion, seed=seed)
    return [(prev[0], curr[0], curr[1]) for prev, curr in zip(frames, frames[1:], strict=False)]


@pytest.mark.parametrize("motion", ["pan", "zoom", "pan_zoom"])
def test_recovers_known_homography(photo, motion):
    for prev, curr, h_true in _pairs(photo, motion):
        result = estimate_homography(prev, curr, refine=True, max_features=1000)
        assert result.ok, result.reason
        assert result.reason == "ok" and result.refined
        assert result.n_inliers >= 12 and result.n_matches >= result.n_inliers
        assert corner_distance(result.matrix, h_true, SIZE) < 1.5


@pytest.mark.parametrize("motion", ["pan", "zoom"])
def test_keypoint_only_fit_is_close(photo, motion):
    # Without ECC the corners are extrapolated from keypoints: ~0.5 px typical, a few px at worst.
    for prev, curr, h_true in _pairs(photo, motion, seed=1):
        result = estimate_homography(prev, curr, refine=False)
        assert result.ok and not result.refined
        assert corner_distance(result.matrix, h_true, SIZE) < 3.0


def test_estimator_reuses_previous_frame(photo):
    frames = synthetic_camera(photo, 4, size=SIZE, motion="pan_zoom", seed=2)
    estimator = HomographyEstimator(refine=True, max_features=1000)
    first = estimator.update(frames[0][0])
    assert not first.ok and first.reason == "no previous frame" and first.matrix is None
    for (prev, _), (curr, h_true) in zip(frames, frames[1:], strict=False):
        streamed = estimator.update(curr)
        assert streamed.ok
        alone = estimate_homography(prev, curr, refine=True, max_features=1000)
        np.testing.assert_allclose(streamed.matrix, alone.matrix, atol=1e-9)
        assert corner_distance(streamed.matrix, h_true, SIZE) < 1.5
    estimator.reset()
    assert estimator.update(frames[0][0]).reason == "no previous frame"
    with pytest.raises(ValueError, match="frame size changed"):
        estimator.update(frames[0][0][:100])


def test_grayscale_frames(photo):
    prev, curr, h_true = _pairs(photo, "pan")[0]
    gray_prev, gray_curr = (cv2.cvtColor(f, cv2.COLOR_RGB2GRAY) for f in (prev, curr))
    result = estimate_homography(gray_prev, gray_curr)
    assert result.ok and corner_distance(result.matrix, h_true, SIZE) < 1.5


def test_unrelated_images_are_rejected(photo):
    noise = np.random.default_rng(0).integers(0, 256, size=SIZE + (3,), dtype=np.uint8)
    frame = _pairs(photo, "pan")[0][0]
    result = estimate_homography(noise, frame)
    assert not result.ok and result.matrix is None
    assert result.reason.startswith(("too few matches", "too few inliers", "degenerate homography"))


def test_flat_frame_has_no_keypoints(photo):
    grey = np.full(SIZE + (3,), 128, dtype=np.uint8)
    result = estimate_homography(grey, _pairs(photo, "pan")[0][0])
    assert not result.ok and result.reason == f"too few keypoints (0 < {20})"


@pytest.mark.skipif(not HAS_AKAZE, reason="this OpenCV build has no AKAZE (OpenCV 5 moved it to contrib)")
def test_akaze_matcher(photo):
    for prev, curr, h_true in _pairs(photo, "pan_zoom"):
        result = estimate_homography(prev, curr, matcher="akaze")
        assert result.ok and corner_distance(result.matrix, h_true, SIZE) < 1.5


@pytest.mark.skipif(HAS_AKAZE, reason="AKAZE is available")
def test_akaze_missing_is_a_clear_error():
    with pytest.raises(RuntimeError, match="AKAZE is not available"):
        HomographyEstimator(matcher="akaze")


def test_sift_matcher(photo):
    for prev, curr, h_true in _pairs(photo, "zoom"):
        result = estimate_homography(prev, curr, matcher="sift")
        assert result.ok and corner_distance(result.matrix, h_true, SIZE) < 1.5


def test_unknown_matcher():
    with pytest.raises(ValueError, match="matcher must be one of"):
        HomographyEstimator(matcher="surf")


@pytest.mark.parametrize(
    ("matrix", "reason"),
    [
        (None, "no solution"),
        (np.full((3, 3), np.nan), "not finite"),
        (np.diag([0.3, 0.3, 1.0]), "det"),
        (np.array([[-1.0, 0, 159], [0, 1, 0], [0, 0, 1]]), "det"),  # mirror
        (np.array([[1.0, 0, 0], [0, 1, 0], [0.01, 0, 1]]), "perspective"),
    ],
)
def test_degenerate_homographies(matrix, reason):
    assert reason in degeneracy_reason(matrix, SIZE)


def test_plausible_homography_passes():
    assert degeneracy_reason(np.array([[1.02, 0.01, 3], [-0.01, 1.02, -2], [1e-5, 0, 1]]), SIZE) is None


def test_scale_homography_pixel_centres():
    shift = np.array([[1.0, 0, 4], [0, 1, -2], [0, 0, 1]])
    # A 4 px shift on a 64 px image is a 2 px shift on a 32 px map, whatever the centre convention.
    expected = [[1, 0, 2], [0, 1, -1], [0, 0, 1]]
    np.testing.assert_allclose(scale_homography(shift, (64, 64), (32, 32)), expected)
    np.testing.assert_allclose(scale_homography(np.eye(3), (224, 224), (7, 7)), np.eye(3), atol=1e-12)
    zoom = np.array([[1.1, 0.02, 3], [-0.01, 0.95, 1], [1e-4, 2e-4, 1]])
    there = scale_homography(zoom, (96, 128), (24, 40))
    np.testing.assert_allclose(scale_homography(there, (24, 40), (96, 128)), zoom, atol=1e-12)
    # x' = (x + 0.5) * s - 0.5: the image point mapped by H, then converted, equals conversion then H'.
    point = np.array([10.0, 20.0, 1.0])
    to_map = np.array([[40 / 128, 0, 0.5 * 40 / 128 - 0.5], [0, 24 / 96, 0.5 * 24 / 96 - 0.5], [0, 0, 1]])
    a, b = to_map @ (zoom @ point), there @ (to_map @ point)
    np.testing.assert_allclose(a[:2] / a[2], b[:2] / b[2], atol=1e-9)


def test_synthetic_homography_explains_the_frames(photo):
    frames = synthetic_camera(photo, 4, size=SIZE, motion="pan_zoom", seed=3)
    np.testing.assert_array_equal(frames[0][1], np.eye(3))
    for (prev, _), (curr, h_true) in zip(frames, frames[1:], strict=False):
        valid = warp_valid_mask(h_true, SIZE)
        residual = np.abs(warp_image(prev, h_true).astype(float) - curr)[valid]
        assert residual.mean() < 8  # resampling twice, nothing else
    again = synthetic_camera(photo, 4, size=SIZE, motion="pan_zoom", seed=3)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(frames, again, strict=True))


def test_synthetic_object_moves_independently(photo):
    scene = synthetic_scene(photo, 3, size=SIZE, motion="pan", seed=0, insert_object=True)
    background = synthetic_scene(photo, 3, size=SIZE, motion="pan", seed=0)
    assert scene[1].object_box != scene[0].object_box
    for with_object, without in zip(scene, background, strict=True):
        np.testing.assert_array_equal(with_object.homography, without.homography)
        y0, y1, x0, x1 = with_object.object_box
        changed = np.any(with_object.frame != without.frame, axis=2)
        assert not changed[:y0].any() and not changed[y1:].any()
        assert not changed[:, :x0].any() and not changed[:, x1:].any()
        assert changed[y0:y1, x0:x1].mean() > 0.9
    with pytest.raises(ValueError, match="unknown motion"):
        synthetic_scene(photo, 2, motion="roll")


def test_settings_object_and_keyword_overrides_agree(photo):
    """estimate_homography takes the matcher's settings as one MatcherSettings; keywords override its fields
    (validated like the settings), so the two spellings give the same fit."""
    from incrinf.stream.config import MatcherSettings

    prev, curr, _ = _pairs(photo, "pan", seed=3)[0]
    by_keywords = estimate_homography(prev, curr, refine=True, max_features=1000)
    by_settings = estimate_homography(prev, curr, MatcherSettings(refine=True, max_features=1000))
    mixed = estimate_homography(prev, curr, MatcherSettings(max_features=1000), refine=True)
    assert by_keywords.ok and by_settings.ok and mixed.ok
    np.testing.assert_array_equal(by_keywords.matrix, by_settings.matrix)
    np.testing.assert_array_equal(by_keywords.matrix, mixed.matrix)
    with pytest.raises(ValueError, match="ratio must be in"):
        estimate_homography(prev, curr, ratio=1.5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'threshold'"):
        estimate_homography(prev, curr, threshold=3.0)


def _knn_ratio_reference(desc_prev: np.ndarray, desc_curr: np.ndarray, ratio: float) -> np.ndarray:
    """Lowe's ratio test on BFMatcher.knnMatch's DMatch objects (what ratio_matches computes from arrays)."""
    norm = cv2.NORM_HAMMING if desc_prev.dtype == np.uint8 else cv2.NORM_L2
    knn = cv2.BFMatcher(norm).knnMatch(desc_prev, desc_curr, k=2)
    pairs = [(m[0].queryIdx, m[0].trainIdx) for m in knn if len(m) == 2 and m[0].distance < ratio * m[1].distance]
    return np.asarray(pairs, dtype=np.int64).reshape(-1, 2)


@pytest.mark.parametrize("matcher", ["orb", "sift"])
@pytest.mark.parametrize("ratio", [0.75, 0.8, 1.0])
def test_ratio_matches_equal_brute_force_knn_matching(matcher, ratio):
    """The array form of the ratio test keeps exactly the pairs that BFMatcher's kNN matches keep, on real frames
    (ties in distance included: ORB's Hamming distances are integers)."""
    frames = load_clip("bikes@224", 3).frames
    estimator = HomographyEstimator(matcher=matcher)
    prev, curr = estimator.detect(frames[0]), estimator.detect(frames[2])
    np.testing.assert_array_equal(ratio_matches(prev.descriptors, curr.descriptors, ratio),
                                  _knn_ratio_reference(prev.descriptors, curr.descriptors, ratio))
    assert len(ratio_matches(prev.descriptors, curr.descriptors, ratio)) >= 20
