"""Vectorised window gathers and region scatters (one index operation each, no loop over positions).

Tensors of update regions are kept channels-last in memory: a map is a table of ``rows = positions`` by
``columns = channels``, so preparing N read-in windows is one ``index_select`` of whole rows and the result is
already the channels-last layout PyTorch's CPU convolutions prefer.
"""

from __future__ import annotations

import torch


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """(N, C..., H, W) -> (N*H*W, prod(C...)) rows (a view when ``x`` is channels-last contiguous)."""
    d = x.dim()
    n, h, w = x.shape[0], x.shape[-2], x.shape[-1]
    return x.permute(0, d - 2, d - 1, *range(1, d - 2)).reshape(n * h * w, -1)


def from_rows(rows: torch.Tensor, n: int, h: int, w: int, channels: tuple[int, ...] | None = None
              ) -> torch.Tensor:
    """(N*H*W, C) rows -> (N, C..., H, W) channels-last view (``channels`` splits C for >4-D maps)."""
    channels = channels or (rows.shape[1],)
    k = len(channels)
    return rows.view(n, h, w, *channels).permute(0, *range(3, 3 + k), 1, 2)


def gather_windows(base_rows: torch.Tensor, index: torch.Tensor, n: int, h: int, w: int) -> torch.Tensor:
    """Gather N windows from one map.

    Args:
        base_rows: (Hp*Wp, C) the (padded) map as rows.
        index: (N*h*w,) row of each window element, positions outermost.
        n, h, w: number and size of the windows.

    Returns:
        (N*h*w, C) rows, a fresh tensor the caller may overwrite.
    """
    return base_rows.index_select(0, index)


def overlay_rows(window_rows: torch.Tensor, dest: torch.Tensor, region_rows: torch.Tensor,
                 source: torch.Tensor | None = None) -> torch.Tensor:
    """Write region values into gathered windows, in place.

    Args:
        window_rows: (N*hr*wr, C) gathered windows.
        dest: (K,) destination rows in ``window_rows``.
        region_rows: (N*h*w, C) incoming region values.
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
        base_rows: (H*W, C) the unchanged map as rows.
        n: number of positions.
        dest: (K,) destination rows in the (N*H*W, C) result.
        region_rows: (N*h*w, C) region values.
        source: optional (K,) selection of region rows.

    Returns:
        (N*H*W, C) rows.
    """
    full = base_rows.repeat(n, 1)
    return overlay_rows(full, dest, region_rows, source)
