"""Tensors as rows: one row per spatial position, channels as columns.

Tensors of update regions are kept channels-last in memory: a map is a table of ``rows = positions`` by
``columns = channels``, so preparing N read-in windows is one ``index_select`` of whole rows and the result is
already the channels-last layout PyTorch's CPU convolutions prefer.
"""

from __future__ import annotations

import math

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


def overlay_rows(window_rows: torch.Tensor, dest: torch.Tensor, region_rows: torch.Tensor,
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
    return overlay_rows(full, dest, region_rows, source)


def box_index(geometry: torch.Tensor, size: tuple[int, int, int], dims: tuple[int, int, int],
              region_size: tuple[int, int, int] | None, batch_stride: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The row indices of :func:`incrinf.kernels.triton_gather.gather_boxes`, made on the geometry's device.

    Returns:
        ``(read, inside, region_row)``: (R,) table row of every gathered row; (R,) bool, whether it takes the
        region's value, and (R,) which region row (0 outside); the last two None without a region.
    """
    n = geometry.shape[0]
    device = geometry.device
    g = geometry.to(torch.int64)
    k = [torch.arange(s, device=device).view(*([1] * (a + 1)), s, *([1] * (2 - a))) for a, s in enumerate(size)]
    corner = [g[:, a].view(-1, 1, 1, 1) for a in range(3)]
    read = ((corner[0] + k[0]) * dims[1] + corner[1] + k[1]) * dims[2] + corner[2] + k[2]
    read = (read + (torch.arange(n, device=device) * batch_stride).view(-1, 1, 1, 1)).reshape(-1)
    if region_size is None:
        return read, None, None
    j = [k[a] - g[:, 3 + a].view(-1, 1, 1, 1) for a in range(3)]
    inside = (j[0] >= 0) & (j[0] < region_size[0]) & (j[1] >= 0) & (j[1] < region_size[1]) & (j[2] >= 0) \
        & (j[2] < region_size[2])
    region_row = (j[0] * region_size[1] + j[1]) * region_size[2] + j[2] \
        + (torch.arange(n, device=device) * math.prod(region_size)).view(-1, 1, 1, 1)
    return read, inside.reshape(-1), torch.where(inside, region_row, 0).reshape(-1)


def gather_boxes(base_rows: torch.Tensor | None, geometry: torch.Tensor, size: tuple[int, int, int],
                 dims: tuple[int, int, int], region_rows: torch.Tensor | None = None,
                 region_size: tuple[int, int, int] | None = None, batch_stride: int = 0,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`incrinf.kernels.triton_gather.gather_boxes` with PyTorch index ops (the indices made on the
    device, no host work)."""
    has_region = region_rows is not None and region_rows.shape[0] > 0
    read, inside, region_row = box_index(geometry, size, dims, region_size if has_region else None, batch_stride)
    if base_rows is None:
        if not has_region:
            return out
        values = torch.where(inside[:, None], region_rows.index_select(0, region_row), out)
        return out.copy_(values)
    rows = base_rows.index_select(0, read)
    if has_region:
        rows = torch.where(inside[:, None], region_rows.index_select(0, region_row), rows)
    return rows if out is None else out.copy_(rows)
