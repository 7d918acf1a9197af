"""Pixels to a model input (incrinf.normalization.Normalization.tensor)."""

import numpy as np
import pytest
import torch

from incrinf.normalization import Normalization


@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_tensor_equals_the_channel_first_normalisation(channels_last, dtype):
    """Normalised in the pixels' own layout: the values of ``(x / 255 - mean) / std`` as one multiply-add per element on
    the channel-first tensor, bit for bit, in the memory layout asked for."""
    norm = Normalization((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    pixels = np.random.default_rng(0).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    if dtype == np.float32:
        pixels = pixels.astype(np.float32) / 255.0
    scale, shift = norm._scale_shift(None, dtype == np.uint8)
    expected = torch.addcmul(shift, torch.from_numpy(pixels).permute(2, 0, 1)[None].float(), scale)
    x = norm.tensor(pixels, channels_last=channels_last)
    assert x.shape == (1, 3, 37, 53) and x.dtype == torch.float32
    assert torch.equal(x, expected)
    assert x.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    back = norm.pixels(x) if dtype == np.uint8 else None
    assert back is None or np.array_equal(back, pixels)
