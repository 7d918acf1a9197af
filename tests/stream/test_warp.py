"""Warping images and cached maps through homographies (incrinf.stream.warp)."""

import cv2
import numpy as np
import pytest
import skimage.data
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from incrinf.stream.warp import nearest_source_index, source_coords, warp_image, warp_valid_mask


def _translation(dx: float, dy: float) -> np.ndarray:
    return np.array([[1.0, 0, dx], [0, 1, dy], [0, 0, 1]])


def _shifted(prev: torch.Tensor, dx: int, dy: int, fill: float) -> torch.Tensor:
    """Reference: out[..., y, x] = prev[..., y - dy, x - dx] by slicing, ``fill`` where that is outside."""
    h, w = prev.shape[-2:]
    out = torch.full_like(prev, fill)
    out[..., max(dy, 0) : h + min(dy, 0), max(dx, 0) : w + min(dx, 0)] = prev[
        ..., max(-dy, 0) : h - max(dy, 0), max(-dx, 0) : w - max(dx, 0)
    ]
    return out


def _gather(prev: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """A whole map read through an index map: ``out[..., p] = prev[..., idx[p]]``, ``fill`` where invalid."""
    out = prev.flatten(-2).index_select(-1, idx)
    out.masked_fill_(~valid, fill)
    return out.view(prev.shape)


@pytest.fixture(scope="module")
def image() -> np.ndarray:
    return cv2.resize(skimage.data.astronaut(), (80, 64), interpolation=cv2.INTER_AREA)


def test_identity_index_map():
    idx, valid = nearest_source_index(np.eye(3), 5, 7, (40, 56))
    assert idx.dtype == torch.int64 and valid.dtype == torch.bool
    torch.testing.assert_close(idx, torch.arange(35))
    assert bool(valid.all())
    prev = torch.randn(2, 3, 5, 7)
    torch.testing.assert_close(_gather(prev, idx, valid), prev)


def test_source_coords_inverse_mapping():
    src_y, src_x = source_coords(_translation(2.5, -1.0), 3, 4)
    np.testing.assert_allclose(src_x, np.arange(4)[None, :].repeat(3, 0) - 2.5)
    np.testing.assert_allclose(src_y, np.arange(3)[:, None].repeat(4, 1) + 1.0)


@settings(max_examples=40, deadline=None)
@given(dx=st.integers(-6, 6), dy=st.integers(-6, 6), fill=st.sampled_from([0.0, -1.0]))
def test_integer_translation_shifts_exactly(dx, dy, fill):
    prev = torch.arange(2 * 3 * 8 * 9, dtype=torch.float32).view(2, 3, 8, 9)
    idx, valid = nearest_source_index(_translation(dx, dy), 8, 9, (8, 9))
    out = _gather(prev, idx, valid, fill=fill)
    torch.testing.assert_close(out, _shifted(prev, dx, dy, fill))
    expected_valid = _shifted(torch.ones(8, 9), dx, dy, 0.0).bool()
    torch.testing.assert_close(valid.view(8, 9), expected_valid)


def test_translation_is_rescaled_to_the_feature_grid():
    # 8 px on a 64 x 96 image is 2 positions on a stride-4 map of 16 x 24.
    prev = torch.randn(1, 4, 16, 24)
    idx, valid = nearest_source_index(_translation(8, -4), 16, 24, (64, 96))
    torch.testing.assert_close(_gather(prev, idx, valid), _shifted(prev, 2, -1, 0.0))


def test_integer_dtypes_and_leading_dims():
    prev = torch.randint(-128, 127, (3, 6, 6), dtype=torch.int8)
    idx, valid = nearest_source_index(_translation(1, 2), 6, 6, (6, 6))
    torch.testing.assert_close(_gather(prev, idx, valid, fill=0), _shifted(prev, 1, 2, 0))


@pytest.mark.parametrize("interpolation", ["bilinear", "nearest"])
@pytest.mark.parametrize(("dx", "dy"), [(5, 3), (-7, 2), (0, -4)])
def test_image_translation_matches_numpy_slicing(image, interpolation, dx, dy):
    out = warp_image(image, _translation(dx, dy), interpolation=interpolation)
    expected = _shifted(torch.from_numpy(image).permute(2, 0, 1), dx, dy, 0).permute(1, 2, 0).numpy()
    np.testing.assert_array_equal(out, expected)
    valid = warp_valid_mask(_translation(dx, dy), image.shape[:2], interpolation=interpolation)
    np.testing.assert_array_equal(valid, _shifted(torch.ones(image.shape[:2]), dx, dy, 0).bool().numpy())
    # And back: the round trip restores every pixel that stayed in view.
    back = warp_image(out, _translation(-dx, -dy), interpolation=interpolation)
    kept = warp_image(valid.astype(np.uint8), _translation(-dx, -dy), interpolation="nearest").astype(bool)
    np.testing.assert_array_equal(back[kept], image[kept])


def test_warp_image_grayscale_and_out_size(image):
    gray = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
    out = warp_image(gray, _translation(2, 1), out_size=(50, 70), fill=255)
    assert out.shape == (50, 70)
    np.testing.assert_array_equal(out[1:, 2:], gray[:49, :68])
    assert (out[0] == 255).all()
