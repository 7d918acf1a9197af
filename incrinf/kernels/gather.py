"""Tensors as rows: one row per spatial position, channels as columns.

Tensors of update regions are kept channels-last in memory: a map is a table of ``rows = positions`` by
``columns = channels``, so preparing N read-in windows is one ``index_select`` of whole rows and the result is
already the channels-last layout PyTorch's CPU convolutions prefer.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def to_rows(x: torch.Tensor, spatial_dims: int | None = None) -> torch.Tensor:
    """(N, C..., *spatial) -> (N * prod(spatial), prod(C...)) rows (a view when ``x`` is channels-last contiguous).

    Args:
        x: the tensor.
        spatial_dims: number of trailing spatial axes (default: all but the batch and one channel axis).
    """
    d = x.dim() - 2 if spatial_dims is None else spatial_dims
    c = x.dim() - d  # batch + channel axes
    n = x.shape[0]
    return x.permute(0, *range(c, x.dim()), *range(1, c)).reshape(n * math.prod(x.shape[c:]), -1)


def from_rows(rows: torch.Tensor, n: int, dims: tuple[int, ...], channels: tuple[int, ...] | None = None
              ) -> torch.Tensor:
    """(N * prod(dims), C) rows -> (N, C..., *dims) channels-last view (``channels`` splits C into several axes)."""
    channels = tuple(channels) if channels else (rows.shape[1],)
    d, k = len(dims), len(channels)
    return rows.view(n, *dims, *channels).permute(0, *range(d + 1, d + 1 + k), *range(1, d + 1))


def write_overlay(window_rows: torch.Tensor, dest: torch.Tensor, region_rows: torch.Tensor,
                  source: torch.Tensor | None = None) -> torch.Tensor:
    """Write region values into gathered windows, in place.

    Args:
        window_rows: (N*prod(window), C) gathered windows.
        dest: (K,) destination rows in ``window_rows``.
        region_rows: (M, C) incoming region values.
        source: (K,) which region rows to copy (all, in order, when ``None``).

    Returns:
        ``window_rows``.
    """
    values = region_rows if source is None else region_rows.index_select(0, source)
    return window_rows.index_copy_(0, dest, values)


def overlay_boxes(windows: torch.Tensor, region: torch.Tensor, runs) -> torch.Tensor:
    """Write N regions into N gathered boxes, in place: per run of consecutive boxes whose region starts at one
    place inside them, one strided copy (the part of a region outside its box is dropped).

    Args:
        windows: (N, *size, C) gathered boxes.
        region: (N, *region_size, C) incoming region values.
        runs: ``(first, end, place)``: boxes ``first:end`` receive their regions at ``place`` (may be negative).

    Returns:
        ``windows``.
    """
    for first, end, place in runs:
        into, take = [slice(first, end)], [slice(first, end)]
        for lo, extent, size in zip(place, region.shape[1:-1], windows.shape[1:-1]):
            a, b = max(lo, 0), min(lo + extent, size)
            if b <= a:
                break  # this run's regions miss their boxes
            into.append(slice(a, b))
            take.append(slice(a - lo, b - lo))
        else:
            windows[tuple(into)] = region[tuple(take)]
    return windows


def project_full(base_rows: torch.Tensor, n: int, dest: torch.Tensor, region_rows: torch.Tensor,
                 source: torch.Tensor | None = None) -> torch.Tensor:
    """Full projection: N copies of the base map with each position's region written in.

    Args:
        base_rows: (P, C) the unchanged map as rows.
        n: number of copies.
        dest: (K,) destination rows in the (N*P, C) result.
        region_rows: (M, C) region values.
        source: optional (K,) selection of region rows.

    Returns:
        (N*P, C) rows.
    """
    full = base_rows.repeat(n, 1)
    return write_overlay(full, dest, region_rows, source)


Index = np.ndarray | torch.Tensor


def _arange(like: Index, n: int) -> Index:
    """0..n-1 as int64, NumPy or on ``like``'s device."""
    return np.arange(n) if isinstance(like, np.ndarray) else torch.arange(n, device=like.device)


def _coordinates(start: Index, size: tuple[int, ...]) -> list[Index]:
    """Per axis ``a``, the coordinate of every element of N boxes at ``start`` (N, d) of extent ``size``, shaped
    (N, 1, ..., size[a], ..., 1) so that any expression over all axes broadcasts to (N, *size)."""
    start = start.astype(np.int64, copy=False) if isinstance(start, np.ndarray) else start.to(torch.int64)
    n, d = start.shape
    coords = []
    for a in range(d):
        c = start[:, a].reshape(-1, *([1] * d))
        if size[a] > 1:  # extent 1 adds nothing to the corner (the padded leading axes of the 3-D kernels)
            shape = [1] * (d + 1)
            shape[a + 1] = size[a]
            c = c + _arange(start, size[a]).reshape(shape)
        coords.append(c)
    return coords


def _rows(coords: list[Index], dims: tuple[int, ...], batch_stride: int) -> Index:
    """Row-major rows of the elements at ``coords`` (:func:`_coordinates`) in a map of extents ``dims``."""
    last = coords[-1]
    if batch_stride:  # added to the smallest term, so the (N, *size) array is written once
        last = last + _arange(last, last.shape[0]).reshape(-1, *([1] * (last.ndim - 1))) * batch_stride
    rows = coords[0] if len(coords) > 1 else last
    for a in range(1, len(coords)):
        rows = rows * dims[a] + (last if a == len(coords) - 1 else coords[a])
    return rows.reshape(-1)


def _inside(coords: list[Index], dims: tuple[int, ...]) -> Index:
    inside = None
    for c, dim in zip(coords, dims):
        ok = (c >= 0) & (c < dim)
        inside = ok if inside is None else inside & ok
    return inside.reshape(-1)


def box_rows(start: Index, size: tuple[int, ...], dims: tuple[int, ...], batch_stride: int = 0) -> Index:
    """Row index of every element of N boxes in a row-major map of extents ``dims``.

    The one implementation for both sides of the engine: NumPy corners give NumPy rows (plans and crops, built on
    the host, where NumPy's per-call overhead is lowest), tensors give tensors on their device (the box-addressed
    gathers, whose indices never touch the host). Horner's rule over per-axis coordinates writes the
    (N * prod(size),) result once (``benchmarks/box_rows.py`` times it).

    Args:
        start: (N, d) integer first corners (may lie outside the map: those rows then mean nothing, see
            :func:`box_rows_and_inside`).
        size: (d,) the boxes' uniform extent.
        dims: (d,) the map's extents.
        batch_stride: added per box (rows of one map, to index N stacked maps).

    Returns:
        (N * prod(size),) int64, boxes outermost, then the box's elements row-major.
    """
    return _rows(_coordinates(start, size), dims, batch_stride)


def box_rows_and_inside(start: Index, size: tuple[int, ...], dims: tuple[int, ...], batch_stride: int = 0
                        ) -> tuple[Index, Index]:
    """:func:`box_rows` and, in the same order, (N * prod(size),) bool: whether each element lies inside the map
    (the other rows then mean nothing)."""
    coords = _coordinates(start, size)
    return _rows(coords, dims, batch_stride), _inside(coords, dims)


def box_gather_rows(geometry: torch.Tensor, size: tuple[int, int, int], dims: tuple[int, int, int],
                    region_size: tuple[int, int, int] | None, batch_stride: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The row indices of :func:`incrinf.kernels.triton_gather.gather_boxes`, made on the geometry's device.

    Returns:
        ``(read, inside, region_row)``: (R,) table row of every gathered row; (R,) bool, whether it takes the
        region's value, and (R,) which region row (0 outside); the last two None without a region.
    """
    g = geometry.to(torch.int64)
    read = box_rows(g[:, :3], size, dims, batch_stride)
    if region_size is None:
        return read, None, None
    # element k of a box lies at k - offset in its region: the region's rows of boxes at -offset
    region_row, inside = box_rows_and_inside(-g[:, 3:], size, region_size, math.prod(region_size))
    return read, inside, torch.where(inside, region_row, 0)


def gather_boxes(base_rows: torch.Tensor | None, geometry: torch.Tensor, size: tuple[int, int, int],
                 dims: tuple[int, int, int], region_rows: torch.Tensor | None = None,
                 region_size: tuple[int, int, int] | None = None, batch_stride: int = 0,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`incrinf.kernels.triton_gather.gather_boxes` with PyTorch index ops (the indices made on the
    device, no host work)."""
    has_region = region_rows is not None and region_rows.shape[0] > 0
    read, inside, region_row = box_gather_rows(geometry, size, dims, region_size if has_region else None, batch_stride)
    if base_rows is None:
        if not has_region:
            return out
        values = torch.where(inside[:, None], region_rows.index_select(0, region_row), out)
        return out.copy_(values)
    rows = base_rows.index_select(0, read)
    if has_region:
        rows = torch.where(inside[:, None], region_rows.index_select(0, region_row), rows)
    return rows if out is None else out.copy_(rows)
