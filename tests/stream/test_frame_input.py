"""A camera frame as the model sees it (incrinf.stream.inputs.FrameInput): the table look-up of normalised bytes."""

import numpy as np
import pytest
import torch

from incrinf.normalization import Normalization
from incrinf.stream.inputs import FrameInput


def _frames(size: tuple[int, int], n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (*size, 3), dtype=np.uint8) for _ in range(n)]


@pytest.mark.parametrize("mean,std", [((0.5,) * 3, (0.5,) * 3), ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
def test_looked_up_inputs_equal_the_normalisation(mean, std):
    """Every frame's input is :meth:`Normalization.tensor`'s, bit for bit and channels-last, through a change of
    frame size; after a size's first frame the table does the work."""
    norm = Normalization(mean, std)
    inputs = FrameInput(norm)
    for frame in _frames((72, 96), 3) + _frames((65, 81), 2, seed=1):
        x, pixels, raw = inputs(frame)
        expected = norm.tensor(frame, channels_last=True)
        assert x.shape == expected.shape and x.dtype == torch.float32 and torch.equal(x, expected)
        assert x.is_contiguous(memory_format=torch.channels_last)
        assert np.array_equal(pixels, frame) and pixels is not frame and raw == frame.shape[:2]
    assert inputs._table_checked == {(72, 96): True, (65, 81): True}


def test_a_table_that_misses_a_value_is_not_used():
    """A size whose first frame the table does not reproduce is normalised directly from then on."""
    norm = Normalization((0.5,) * 3, (0.5,) * 3)
    inputs = FrameInput(norm)
    frame = _frames((64, 64), 1)[0]
    inputs(frame)  # builds the table and checks it on this size
    inputs._table_checked.clear()
    inputs._table = inputs._table.copy()
    inputs._table[int(frame[0, 0, 0]), 0, 0] += 1.0  # one value off: the check must see it
    for later in _frames((64, 64), 3, seed=2) + [frame]:
        assert torch.equal(inputs(later)[0], norm.tensor(later, channels_last=True))
    assert inputs._table_checked == {(64, 64): False}
