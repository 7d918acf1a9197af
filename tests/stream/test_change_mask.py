"""Change masks over cells (incrinf.stream.change_mask)."""

import cv2
import numpy as np
import pytest
import skimage.data
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from incrinf.stream.change_mask import change_mask, merge_cell_boxes
from incrinf.stream.config import StreamConfig
from incrinf.stream.warp import warp_image, warp_valid_mask

SIDE = 96
CELL = 16  # 96 = 6 x 16: every cell is full
INSERT = (30, 50)


@pytest.fixture(scope="module")
def base() -> np.ndarray:
    return cv2.resize(skimage.data.astronaut(), (SIDE, SIDE), interpolation=cv2.INTER_AREA)


def _paste(base: np.ndarray, y0: int, x0: int, shape=INSERT) -> np.ndarray:
    """Copy of ``base`` with a block whose every channel differs by >= 128 from what it covers."""
    out = base.copy()
    h, w = shape
    block = out[y0 : y0 + h, x0 : x0 + w]
    out[y0 : y0 + h, x0 : x0 + w] = np.where(block < 128, 255, 0).astype(np.uint8)
    return out


def _cells_touching(y0, y1, x0, x1, cell=CELL, grid=(SIDE // CELL, SIDE // CELL)) -> np.ndarray:
    expected = np.zeros(grid, dtype=bool)
    expected[y0 // cell : -(-y1 // cell), x0 // cell : -(-x1 // cell)] = True
    return expected


def _cells_inside(y0, y1, x0, x1, cell=CELL, grid=(SIDE // CELL, SIDE // CELL)) -> np.ndarray:
    expected = np.zeros(grid, dtype=bool)
    expected[-(-y0 // cell) : y1 // cell, -(-x0 // cell) : x1 // cell] = True
    return expected


@settings(max_examples=30, deadline=None)
@given(row=st.integers(0, 6), col=st.integers(0, 4))
def test_grid_aligned_insert_marks_exactly_its_cells(base, row, col):
    # A 30x50 insert placed on a 10-px grid covers exactly 3x5 cells of side 10 (a 10x10 grid, last cells
    # 6 px) and differs by >= 128 everywhere, so it is detected exactly at the default threshold.
    y0, x0 = row * 10, col * 10
    mask = change_mask(_paste(base, y0, x0), base, cell=10)
    expected = np.zeros((10, 10), dtype=bool)
    expected[row : row + 3, col : col + 5] = True
    np.testing.assert_array_equal(mask.cells, expected)
    assert mask.boxes() == [(y0, y0 + 30, x0, x0 + 50)]
    assert mask.recompute_fraction == pytest.approx(30 * 50 / SIDE**2)


@settings(max_examples=30, deadline=None)
@given(y0=st.integers(0, SIDE - INSERT[0]), x0=st.integers(0, SIDE - INSERT[1]))
def test_any_insert_with_tiny_threshold_marks_exactly_the_cells_it_touches(base, y0, x0):
    mask = change_mask(_paste(base, y0, x0), base, cell=CELL, pixel_threshold=1e-9)
    np.testing.assert_array_equal(mask.cells, _cells_touching(y0, y0 + 30, x0, x0 + 50))


@settings(max_examples=30, deadline=None)
@given(y0=st.integers(0, SIDE - INSERT[0]), x0=st.integers(0, SIDE - INSERT[1]))
def test_any_insert_at_default_threshold_is_between_covered_and_touched_cells(base, y0, x0):
    mask = change_mask(_paste(base, y0, x0), base, cell=CELL)
    y1, x1 = y0 + 30, x0 + 50
    assert not (_cells_inside(y0, y1, x0, x1) & ~mask.cells).any()  # fully covered -> changed
    assert not (mask.cells & ~_cells_touching(y0, y1, x0, x1)).any()  # untouched -> unchanged


def test_zero_difference_changes_nothing(base):
    mask = change_mask(base, base.copy())
    assert mask.cells.shape == (6, 6) and not mask.cells.any()
    assert mask.recompute_fraction == 0.0 and mask.cache_ratio == 1.0 and mask.boxes() == []
    assert mask.pixel_mask.shape == (SIDE, SIDE)


def test_threshold_zero_marks_everything(base):
    # diff >= 0 holds for every cell, even identical ones.
    mask = change_mask(base, base, cell=CELL, pixel_threshold=0)
    assert mask.cells.all() and mask.cache_ratio == 0.0
    assert mask.boxes() == [(0, SIDE, 0, SIDE)]


def test_threshold_is_inclusive():
    curr = np.zeros((8, 8, 3), dtype=np.uint8)
    prev = curr.copy()
    prev[:4, :4] = 25  # the top-left 4x4 cell differs by exactly 25
    prev[4:, 4:] = 24
    mask = change_mask(curr, prev, cell=4, pixel_threshold=25)
    np.testing.assert_array_equal(mask.cells, [[True, False], [False, False]])
    np.testing.assert_allclose(mask.cell_diff, [[25, 0], [0, 24]])


def test_invalid_pixels_are_changed(base):
    valid = np.ones((SIDE, SIDE), dtype=bool)
    valid[50, 70] = False
    mask = change_mask(base, base, cell=CELL, valid=valid)
    expected = np.zeros((6, 6), dtype=bool)
    expected[50 // CELL, 70 // CELL] = True
    np.testing.assert_array_equal(mask.cells, expected)


def test_translation_marks_the_uncovered_border(base):
    shift = np.array([[1.0, 0, 5], [0, 1, 0], [0, 0, 1]])  # content moves 5 px right: column 0..4 is new
    moved = warp_image(base, shift)
    moved[:, :5] = base[:, :5]  # pretend the camera saw real content there
    valid = warp_valid_mask(shift, base.shape[:2])
    mask = change_mask(moved, warp_image(base, shift), cell=CELL, valid=valid)
    expected = np.zeros((6, 6), dtype=bool)
    expected[:, 0] = True
    np.testing.assert_array_equal(mask.cells, expected)
    assert mask.boxes() == [(0, SIDE, 0, CELL)]


def test_tensor_and_float_inputs_agree(base):
    curr = _paste(base, 20, 30)
    reference = change_mask(curr, base, cell=CELL)
    curr_t, base_t = (torch.from_numpy(x).permute(2, 0, 1) for x in (curr, base))
    as_chw = change_mask(curr_t, base_t, cell=CELL)
    as_batch = change_mask(
        curr_t[None].float() / 255, base_t[None].float() / 255, cell=CELL,
        pixel_threshold=StreamConfig.pixel_threshold / 255
    )
    for other in (as_chw, as_batch):
        np.testing.assert_array_equal(other.cells, reference.cells)
    # Grayscale (H, W) works too; the channel mean is taken before the difference there, so only check the
    # changed cells stay among those the insert touches.
    as_gray = change_mask(curr.mean(axis=2), base.mean(axis=2).astype(np.float32), cell=CELL)
    assert as_gray.cells.any() and not (as_gray.cells & ~_cells_touching(20, 50, 30, 80)).any()


def test_partial_edge_cells():
    curr = np.zeros((100, 70, 3), dtype=np.uint8)
    prev = curr.copy()
    prev[99, 69] = 255  # one pixel of the 4x6-px bottom-right cell
    mask = change_mask(curr, prev, cell=32, pixel_threshold=255 / 24)
    assert mask.cells.shape == (4, 3) and mask.cells.sum() == 1 and mask.cells[3, 2]
    assert mask.boxes() == [(96, 100, 64, 70)]
    assert mask.recompute_fraction == pytest.approx(4 * 6 / 7000)
    assert mask.changed_cell_fraction == pytest.approx(1 / 12)


def test_bad_inputs(base):
    with pytest.raises(ValueError, match="differ in shape"):
        change_mask(base, base[:50])
    with pytest.raises(ValueError, match="valid mask"):
        change_mask(base, base, valid=np.ones((5, 5), dtype=bool))
    with pytest.raises(ValueError, match="cell"):
        change_mask(base, base, cell=0)


def test_boxes_merge_blocks():
    cells = np.zeros((5, 6), dtype=bool)
    cells[1:4, 1:3] = True  # one block
    cells[0, 4:6] = True  # L shape: a row run ...
    cells[1:3, 5] = True  # ... and a column below part of it
    assert merge_cell_boxes(cells) == [(0, 1, 4, 6), (1, 4, 1, 3), (1, 3, 5, 6)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=7, max_size=7), min_size=1, max_size=6))
def test_boxes_tile_the_changed_cells_exactly(rows):
    cells = np.array(rows, dtype=bool)
    cover = np.zeros(cells.shape, dtype=int)
    for r0, r1, c0, c1 in merge_cell_boxes(cells):
        assert r0 < r1 and c0 < c1
        cover[r0:r1, c0:c1] += 1
    np.testing.assert_array_equal(cover, cells.astype(int))  # covers every changed cell once, nothing else
    assert len(merge_cell_boxes(cells)) <= int(cells.sum())


@settings(max_examples=40, deadline=None)
@given(h=st.integers(1, 70), w=st.integers(1, 70), cell=st.integers(1, 20), threshold=st.integers(0, 80),
       gray=st.booleans(), seed=st.integers(0, 2**16))
def test_uint8_fast_path_equals_float_path(h, w, cell, threshold, gray, seed):
    rng = np.random.default_rng(seed)
    shape = (h, w) if gray else (h, w, 3)
    curr = rng.integers(0, 256, shape, dtype=np.uint8)
    prev = np.where(rng.random(shape) < 0.7, curr, rng.integers(0, 256, shape, dtype=np.uint8)).astype(np.uint8)
    fast = change_mask(curr, prev, cell=cell, pixel_threshold=threshold)
    slow = change_mask(curr.astype(np.float64), prev.astype(np.float64), cell=cell, pixel_threshold=threshold)
    np.testing.assert_array_equal(fast.cells, slow.cells)
    np.testing.assert_allclose(fast.cell_diff, slow.cell_diff, rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(h=st.integers(1, 70), w=st.integers(1, 70), cell=st.integers(1, 20), channels=st.sampled_from([1, 3, 4]),
       threshold=st.floats(0, 255), seed=st.integers(0, 2**16))
def test_uint8_cell_sums_and_fraction_match_a_plain_count(h, w, cell, channels, threshold, seed):
    """The uint8 path (cells summed by cv2 in int32, the changed share counted per cell) gives the int64 sums and the
    pixel mask's mean exactly, edge cells and ties with the threshold included."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
    b = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
    if channels == 1 and seed % 2:
        a, b = a[..., 0], b[..., 0]
    mask = change_mask(a, b, cell, threshold)
    diff = np.abs(a.astype(np.int64) - b).reshape(h, w, -1)
    gh, gw = -(-h // cell), -(-w // cell)
    padded = np.zeros((gh * cell, gw * cell, diff.shape[2]), np.int64)
    padded[:h, :w] = diff
    sums = padded.reshape(gh, cell, gw, -1).sum(axis=(1, 3))
    counts = np.outer(np.minimum(cell, h - np.arange(gh) * cell), np.minimum(cell, w - np.arange(gw) * cell))
    np.testing.assert_array_equal(mask.cells, sums >= threshold * counts * diff.shape[2])
    np.testing.assert_array_equal(mask.cell_diff, (sums / (counts * diff.shape[2])).astype(np.float32))
    assert mask.recompute_fraction == float(mask.pixel_mask.mean())
