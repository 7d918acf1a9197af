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
