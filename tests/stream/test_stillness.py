"""The still-camera test's reused grey levels (incrinf.stream.stillness)."""

import cv2
import numpy as np
import pytest
import skimage.data

from incrinf.stream.stillness import StillnessTest, _gray, align
from incrinf.testing.clips import load_clip


@pytest.fixture(scope="module")
def frames() -> list[np.ndarray]:
    return load_clip("hall", 4).frames  # 288 x 384: correlated at half size


def test_verdicts_with_reused_grey_levels_equal_a_fresh_test(frames):
    """A test that keeps its grey levels between frames (phaseCorrelate writes into its inputs) gives the verdict of a
    test that sees the pair for the first time."""
    kept = StillnessTest(0.9, 0.5)
    for prev, frame in zip(frames, frames[1:], strict=False):
        assert kept(frame, prev) == StillnessTest(0.9, 0.5)(frame, prev)
        assert np.array_equal(kept.gray(prev), _gray(prev)) and np.array_equal(kept.gray(frame), _gray(frame))


@pytest.mark.parametrize("boxes", [[(0, 64, 32, 96), (128, 288, 0, 384)], [(16, 48, 16, 48)], [],
                                   [(3, 40, 8, 100)], [(0, 288, 0, 383)]])
def test_derived_reference_grey_levels_equal_fresh_ones(frames, boxes):
    """A reference pasted from a frame's boxes over the previous reference gets the grey levels computed from scratch:
    pasted from both when every box edge is even, recomputed otherwise (odd edges straddle the halved frame's 2 x 2
    blocks)."""
    test = StillnessTest(0.9, 0.5)
    base, frame = frames[0], frames[2]
    test(frame, base)
    reference = base.copy()
    for y0, y1, x0, x1 in boxes:
        reference[y0:y1, x0:x1] = frame[y0:y1, x0:x1]
    test.derive(reference, frame, base, boxes)
    np.testing.assert_array_equal(test.gray(reference), _gray(reference))
    assert test(frames[3], reference) == StillnessTest(0.9, 0.5)(frames[3], reference)


def _zoomed(photo: np.ndarray, zoom: float, shift: tuple[float, float], size: tuple[int, int]) -> np.ndarray:
    """The middle ``size`` crop of ``photo`` zoomed by ``zoom`` about its centre, then moved by ``shift`` (dx, dy)."""
    h, w = photo.shape[:2]
    cx, cy = (w - 1) / 2, (h - 1) / 2
    matrix = np.float32([[zoom, 0, cx - zoom * cx + shift[0]], [0, zoom, cy - zoom * cy + shift[1]]])
    moved = cv2.warpAffine(photo, matrix, (w, h), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT_101)
    y0, x0 = (h - size[0]) // 2, (w - size[1]) // 2
    return np.ascontiguousarray(moved[y0:y0 + size[0], x0:x0 + size[1]])


@pytest.mark.parametrize(("zoom", "shift"), [(1.0, (2.0, 0.0)), (1.01, (3.0, -1.0)), (0.99, (0.0, 2.5)),
                                             (1.02, (0.0, 0.0))])
def test_the_quarters_shifts_give_the_zoom_and_the_shift(zoom, shift):
    """The four quarters' phase correlations measure a zoom about the frame's middle and a shift: the fitted affine's
    scale within 0.6% (a quarter's peak is a few tenths of a pixel off under a zoom; a keypoint fit's scale is about as
    far off) and its translation at the middle within 0.3 px, every quarter's shift explained."""
    photo = skimage.data.chelsea()
    size = (224, 224)
    before, after = _zoomed(photo, 1.0, (0.0, 0.0), size), _zoomed(photo, zoom, shift, size)
    test = StillnessTest(0.5, 2.0)
    test(after, before)
    motion = test.local_motion(after, before)
    assert motion.response > 0.5 and motion.residual < 0.3
    np.testing.assert_allclose(np.diag(motion.matrix)[:2], [zoom, zoom], atol=0.006)
    middle = motion.matrix @ np.array([(size[1] - 1) / 2, (size[0] - 1) / 2, 1.0])
    np.testing.assert_allclose(middle[:2] - [(size[1] - 1) / 2, (size[0] - 1) / 2], shift, atol=0.3)


@pytest.mark.parametrize("shift", [(0.3, 0.2), (-0.45, 0.07), (0.06, -0.49), (0.5, 0.5)])
def test_aligned_reference_equals_opencvs_three_channel_warp(frames, shift):
    """The sub-pixel alignment warps four channels (OpenCV's vectorised path) and drops the fourth: the same pixels as
    warping the three (mirrored border included), on a clip frame and on noise of odd sizes."""
    noise = np.random.default_rng(0).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    for image in (frames[0], noise):
        h, w = image.shape[:2]
        three = cv2.warpAffine(image, np.float32([[1, 0, shift[0]], [0, 1, shift[1]]]), (w, h),
                               flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT_101)
        moved = align(image, shift)
        assert moved.shape == image.shape and moved.dtype == np.uint8
        assert np.array_equal(moved, three)
        assert not np.array_equal(moved, image)  # the shift did move the pixels
    assert align(frames[0], (0.01, 0.02)) is frames[0]  # a negligible shift leaves the reference itself
