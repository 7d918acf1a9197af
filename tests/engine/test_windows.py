"""Window geometry: growth, padded crops and block tables agree with the whole padded map (incrinf.engine)."""

import numpy as np
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from incrinf.engine.blocks import grow_mask
from incrinf.engine.regions import grow, union
from incrinf.engine.windows import WindowSpec, block_table, padded_crop, padded_map
from incrinf.geometry import Boxes
from incrinf.kernels.gather import to_rows


def _spec(kernel, stride, dilation, pad_before, view, view_value=0.0, pad_value=0.0, own_after=(0, 0)):
    extent = tuple(d * (k - 1) + 1 for k, d in zip(kernel, dilation))
    return WindowSpec(source="x", offset=(pad_before[0] + view[0], pad_before[1] + view[2]),
                      view_before=(view[0], view[2]), view_after=(view[1], view[3]), view_value=view_value,
                      pad_value=pad_value, own_after=own_after, extent=extent, stride=stride, dilation=dilation,
                      cheap=False)


@st.composite
def _geometry(draw):
    kernel = (draw(st.integers(1, 5)), draw(st.integers(1, 5)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    pad = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    view = tuple(draw(st.integers(0, 2)) for _ in range(4))
    hs, ws = draw(st.integers(6, 20)), draw(st.integers(6, 20))
    spec = _spec(kernel, stride, dilation, pad, view, draw(st.sampled_from([0.0, 1.5])),
                 draw(st.sampled_from([0.0, -2.0])), own_after=pad)
    # the map the operator reads: source + views + own padding on both sides
    ho = (hs + view[0] + view[1] + 2 * pad[0] - spec.extent[0]) // stride[0] + 1
    wo = (ws + view[2] + view[3] + 2 * pad[1] - spec.extent[1]) // stride[1] + 1
    assume(ho >= 1 and wo >= 1)
    y0, x0 = draw(st.integers(0, hs - 1)), draw(st.integers(0, ws - 1))
    box = Boxes((y0, x0), (draw(st.integers(1, hs - y0)), draw(st.integers(1, ws - x0))))
    return spec, (hs, ws), (ho, wo), box


def _mask(box: Boxes, dims) -> np.ndarray:
    out = np.zeros(dims, bool)
    y0, y1, x0, x1 = box.bounds
    out[y0:y1, x0:x1] = True
    return out


@settings(max_examples=150, deadline=None)
@given(_geometry(), st.sampled_from([1, 4]))
def test_box_growth_holds_every_output_the_change_reaches(geometry, quantum):
    spec, (hs, ws), (ho, wo), box = geometry
    grown = grow_mask(_mask(box, (hs, ws)), spec, (ho, wo))
    out = grow(box, spec, (ho, wo), quantum=quantum)
    assert not (grown & ~_mask(out, (ho, wo))).any()  # every output the change reaches is in the box
    y0, y1, x0, x1 = out.bounds
    assert 0 <= y0 < y1 <= ho and 0 <= x0 < x1 <= wo
    for size, side in ((ho, y1 - y0), (wo, x1 - x0)):
        assert side % quantum == 0 or side == size
    rows, cols = np.flatnonzero(grown.any(axis=1)), np.flatnonzero(grown.any(axis=0))
    if quantum == 1 and spec.dilation == (1, 1) and len(rows):  # undilated: the box is tight
        assert out.bounds == (rows[0], rows[-1] + 1, cols[0], cols[-1] + 1)


@settings(max_examples=150, deadline=None)
@given(_geometry())
# a 1x1 window of stride 3 behind two columns of view padding: the first output reads only padding (the crop's
# end was negative and wrapped around to the map's far side)
@example((_spec((1, 1), (1, 3), (1, 1), (0, 0), (0, 0, 2, 0)), (6, 6), (6, 3), Boxes((0, 0), (1, 1))))
def test_padded_crop_equals_the_slice_of_the_padded_map(geometry):
    spec, (hs, ws), (ho, wo), box = geometry
    out = grow(box, spec, (ho, wo))
    source = torch.randn(1, 3, hs, ws)
    full = padded_map(spec, source)
    y0, y1, x0, x1 = out.bounds
    (sy, sx), (ky, kx) = spec.stride, spec.extent
    expected = full[:, :, y0 * sy:(y1 - 1) * sy + ky, x0 * sx:(x1 - 1) * sx + kx]  # padded-map coordinates
    crop = padded_crop(spec, source, out.bounds)
    assert crop.shape == expected.shape
    torch.testing.assert_close(crop, expected, rtol=0, atol=0)


@settings(max_examples=60, deadline=None)
@given(_geometry(), st.integers(1, 4))
def test_block_tables_gather_the_padded_map(geometry, side):
    spec, (hs, ws), (ho, wo), _ = geometry
    block = (min(side, ho), min(side, wo))
    grid = (-(-ho // block[0]), -(-wo // block[1]))
    table = block_table(spec, grid, block, (hs, ws), torch.device("cpu"))
    source = torch.randn(1, 3, hs, ws)
    rows = to_rows(source).index_select(0, table.index.view(-1)).view(*table.codes.shape, 3)
    values = torch.tensor([0.0, spec.view_value, spec.pad_value])[torch.from_numpy(table.codes.astype(np.int64))]
    rows = torch.where(torch.from_numpy(table.codes != 0)[..., None], values[..., None], rows)
    full = padded_map(spec, source)
    read = spec.read_size(block)
    for b in range(grid[0] * grid[1]):
        by, bx = divmod(b, grid[1])
        r0, c0 = by * block[0] * spec.stride[0], bx * block[1] * spec.stride[1]
        expected = full[0, :, r0:r0 + read[0], c0:c0 + read[1]]
        got = rows[b].view(*read, 3).permute(2, 0, 1)[:, :expected.shape[1], :expected.shape[2]]
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_union_of_boxes_single_and_batched():
    a, b = Boxes((1, 2), (2, 2)), Boxes((2, 0), (4, 3))
    assert union([a, b], (10, 8)).bounds == (1, 6, 0, 4)
    batch = union([Boxes((np.array([0, 5]), np.array([1, 1])), (2, 2)),
                   Boxes((np.array([1, 8]), np.array([0, 6])), (2, 2))], (10, 8))
    # per query the bounding boxes are 3x3 at (0, 0) and 5x7 at (5, 1): one size for the batch, the larger,
    # and a box that would leave the map is shifted inwards (none needs it here)
    assert batch.size == (5, 7)
    assert batch.lo[0].tolist() == [0, 5] and batch.lo[1].tolist() == [0, 1]
    edge = union([Boxes((np.array([0, 8]),), (2,)), Boxes((np.array([1, 6]),), (3,))], (10,))
    assert edge.size == (4,) and edge.lo[0].tolist() == [0, 6]  # 8..10 and 6..9 -> 6..10


@given(seed=st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_box_rows_agree_on_numpy_and_torch(seed):
    """The one box-row implementation gives, for NumPy corners and for tensors alike, each element's row-major
    row in the map (plus the batch stride) and whether it lies inside the map, element by element."""
    from incrinf.kernels.gather import box_rows, box_rows_and_inside

    rng = np.random.default_rng(seed)
    d = int(rng.integers(1, 4))
    dims = tuple(int(x) for x in rng.integers(1, 7, size=d))
    size = tuple(int(x) for x in rng.integers(1, 5, size=d))
    n = int(rng.integers(1, 4))
    stride = int(rng.integers(0, 50))
    start = np.stack([rng.integers(-3, x + 1, size=n) for x in dims], axis=1).astype(np.int32)
    want_rows, want_inside = [], []
    for i in range(n):
        for k in np.ndindex(*size):
            c = [int(start[i, a]) + k[a] for a in range(d)]
            row = 0
            for a in range(d):
                row = row * dims[a] + c[a]
            want_rows.append(row + i * stride)
            want_inside.append(all(0 <= c[a] < dims[a] for a in range(d)))
    rows, inside = box_rows_and_inside(start, size, dims, stride)
    assert rows.dtype == np.int64 and rows.tolist() == want_rows and inside.tolist() == want_inside
    assert box_rows(start, size, dims, stride).tolist() == want_rows
    t = torch.from_numpy(start)
    rows, inside = box_rows_and_inside(t, size, dims, stride)
    assert rows.dtype == torch.int64 and rows.tolist() == want_rows and inside.tolist() == want_inside
    assert box_rows(t, size, dims, stride).tolist() == want_rows
