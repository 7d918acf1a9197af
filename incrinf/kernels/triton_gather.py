"""Triton kernels that prepare every read-in window of a batch in one parallel pass.

Krypton found that preparing windows with one small copy per position throttles a GPU; a kernel that copies
all windows in parallel fixes it. Maps are tables of ``rows = positions`` by ``columns = channels``
(channels-last), so a window batch is a pure row gather. The overlay of the incoming region is fused into the
same pass: the plan builds, once, a *combined* index into the virtual concatenation ``[base rows; region
rows]``; the kernel reads each destination row from the base map or from the region and writes it once. Full
projection (N copies of a base map with each position's region written in) is the same gather with another
combined index.

Kernels are plain Python functions wrapped lazily: compiled with :func:`triton.jit` for CUDA tensors, run by
Triton's interpreter for CPU tensors (or when ``TRITON_INTERPRET=1``), so tests can check them without a GPU
regardless of when ``triton`` was first imported.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

__all__ = ["gather_rows", "scatter_rows"]

# Elements per program: large enough to amortize the per-row index load, small enough for registers.
_BLOCK_ELEMS = 4096
_MAX_BLOCK_C = 128


# --- kernels ----------------------------------------------------------------------------------------------


def _gather_rows_kernel(base_ptr, region_ptr, index_ptr, out_ptr, n_rows, n_cols, n_base,
                        base_stride, region_stride, out_stride,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HAS_REGION: tl.constexpr):
    """out[r, :] = base[index[r], :] if index[r] < n_base else region[index[r] - n_base, :]."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    src = tl.load(index_ptr + rows, mask=row_ok, other=0)
    if HAS_REGION:
        from_region = src >= n_base
        # each source is read only where it is selected, so neither load goes out of bounds
        base_row = tl.where(from_region, 0, src)
        region_row = tl.where(from_region, src - n_base, 0)
        b = tl.load(base_ptr + base_row[:, None] * base_stride + cols[None, :],
                    mask=mask & (~from_region)[:, None], other=0.0)
        r = tl.load(region_ptr + region_row[:, None] * region_stride + cols[None, :],
                    mask=mask & from_region[:, None], other=0.0)
        values = tl.where(from_region[:, None], r, b)
    else:
        values = tl.load(base_ptr + src[:, None] * base_stride + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], values, mask=mask)


def _scatter_rows_kernel(out_ptr, region_ptr, dest_ptr, source_ptr, n_rows, n_cols, out_stride, region_stride,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HAS_SOURCE: tl.constexpr):
    """out[dest[k], :] = region[source[k], :] (source[k] = k when absent), in place."""
    k = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    k_ok = k < n_rows
    mask = k_ok[:, None] & (cols < n_cols)[None, :]
    dst = tl.load(dest_ptr + k, mask=k_ok, other=0)
    if HAS_SOURCE:
        src = tl.load(source_ptr + k, mask=k_ok, other=0)
    else:
        src = k
    values = tl.load(region_ptr + src[:, None] * region_stride + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + dst[:, None] * out_stride + cols[None, :], values, mask=mask)


_WRAPPED: dict[tuple[str, bool], Callable] = {}


def _kernel(fn: Callable, interpret: bool):
    """``fn`` compiled (GPU) or interpreted (CPU), built once per flavour."""
    key = (fn.__name__, interpret)
    wrapped = _WRAPPED.get(key)
    if wrapped is None:
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            wrapped = InterpretedFunction(fn)
        else:
            wrapped = triton.jit(fn)
        _WRAPPED[key] = wrapped
    return wrapped


def _interpret(t: torch.Tensor) -> bool:
    return t.device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _blocks(n_cols: int) -> tuple[int, int]:
    block_c = min(triton.next_power_of_2(max(n_cols, 1)), _MAX_BLOCK_C)
    return max(_BLOCK_ELEMS // block_c, 1), block_c


def _rows_2d(t: torch.Tensor, name: str) -> torch.Tensor:
    """A (rows, C) table whose channel stride is 1 (row stride may be anything)."""
    if t.dim() != 2:
        raise ValueError(f"{name} must be (rows, C), got shape {tuple(t.shape)}")
    return t if t.stride(1) == 1 or t.shape[1] == 1 else t.contiguous()


# --- launchers --------------------------------------------------------------------------------------------


def gather_rows(base_rows: torch.Tensor, index: torch.Tensor, region_rows: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather rows from a base map, or from ``[base rows; region rows]`` with a combined index, in one pass.

    Args:
        base_rows: (B, C) the (padded) base map as rows.
        index: (R,) int64 row of every output row; with ``region_rows``, values ``>= B`` read region row
            ``index - B`` (see :func:`incrinf.kernels.dispatch.fuse_window_index`).
        region_rows: optional (M, C) incoming region values, same dtype and device as ``base_rows``.
        out: optional (R, C) destination with channel stride 1.

    Returns:
        (R, C) rows (``out`` when given).
    """
    base_rows = _rows_2d(base_rows, "base_rows")
    n_rows, n_cols = index.numel(), base_rows.shape[1]
    if region_rows is not None:
        region_rows = _rows_2d(region_rows, "region_rows")
        if region_rows.dtype != base_rows.dtype or region_rows.shape[1] != n_cols:
            raise ValueError("region_rows must match base_rows in dtype and channel count")
    if out is None:
        out = torch.empty((n_rows, n_cols), dtype=base_rows.dtype, device=base_rows.device)
    if n_rows == 0 or n_cols == 0:
        return out
    index = index.to(device=base_rows.device, dtype=torch.int64).contiguous()
    has_region = region_rows is not None and region_rows.shape[0] > 0
    region = region_rows if has_region else base_rows  # a valid pointer the kernel never reads
    block_r, block_c = _blocks(n_cols)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))
    _kernel(_gather_rows_kernel, _interpret(base_rows))[grid](
        base_rows, region, index, out, n_rows, n_cols, base_rows.shape[0],
        base_rows.stride(0), region.stride(0), out.stride(0),
        BLOCK_R=block_r, BLOCK_C=block_c, HAS_REGION=has_region)
    return out


def scatter_rows(out: torch.Tensor, dest: torch.Tensor, region_rows: torch.Tensor,
                 source: torch.Tensor | None = None) -> torch.Tensor:
    """Write region rows into ``out`` in place: ``out[dest[k]] = region_rows[source[k]]``.

    Args:
        out: (R, C) rows with channel stride 1 (e.g. gathered windows).
        dest: (K,) unique destination rows.
        region_rows: (M, C) region values.
        source: (K,) region rows to copy (``None``: rows 0..K-1 in order).

    Returns:
        ``out``.
    """
    if out.dim() != 2 or (out.stride(1) != 1 and out.shape[1] != 1):
        raise ValueError("out must be (rows, C) with channel stride 1")
    region_rows = _rows_2d(region_rows, "region_rows").to(out.dtype)
    n_rows, n_cols = dest.numel(), out.shape[1]
    if n_rows == 0 or n_cols == 0:
        return out
    dest = dest.to(device=out.device, dtype=torch.int64).contiguous()
    has_source = source is not None
    src = source.to(device=out.device, dtype=torch.int64).contiguous() if has_source else dest
    block_r, block_c = _blocks(n_cols)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))
    _kernel(_scatter_rows_kernel, _interpret(out))[grid](
        out, region_rows, dest, src, n_rows, n_cols, out.stride(0), region_rows.stride(0),
        BLOCK_R=block_r, BLOCK_C=block_c, HAS_SOURCE=has_source)
    return out
