"""The still-camera test's reused grey levels (incrinf.stream.stillness)."""

import numpy as np
import pytest

from incrinf.stream.stillness import StillnessTest, _gray
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
