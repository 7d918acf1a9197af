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

__all__ = ["gather_boxes", "gather_rows", "scatter_rows"]

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


def _gather_boxes_kernel(base_ptr, region_ptr, geometry_ptr, out_ptr, n_rows, n_cols, positions,
                         S1, S2, T1, T2, Z0, Z1, Z2, batch_stride, base_stride, region_stride, out_stride,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BASE: tl.constexpr,
                         HAS_REGION: tl.constexpr):
    """Row ``r`` of N stacked boxes of ``positions = S0*S1*S2`` elements: box ``n = r // positions``, element
    ``(k0, k1, k2)``; it reads the table row of ``starts[n] + k`` (tables of extents ``(*, T1, T2)``, plus
    ``n * batch_stride``), or region row ``n * Z + (k - offsets[n])`` where ``k - offsets[n]`` lies inside the
    region's extent ``(Z0, Z1, Z2)``. ``geometry`` holds (N, 6) int32: starts then offsets. Without a base, only
    the region's rows are written (an overlay in place)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    box = rows // positions
    local = rows - box * positions
    k2 = local % S2
    rest = local // S2
    k1 = rest % S1
    k0 = rest // S1
    geometry = geometry_ptr + box * 6
    # every address stays inside its source whether or not the row reads it (the region's coordinates are
    # clamped), so the masks alone select; no per-row select (Triton 3.6 miscompiles one next to 2-D masks)
    if HAS_REGION:
        j0 = k0 - tl.load(geometry + 3, mask=row_ok, other=0).to(tl.int64)
        j1 = k1 - tl.load(geometry + 4, mask=row_ok, other=0).to(tl.int64)
        j2 = k2 - tl.load(geometry + 5, mask=row_ok, other=0).to(tl.int64)
        inside = (j0 >= 0) & (j0 < Z0) & (j1 >= 0) & (j1 < Z1) & (j2 >= 0) & (j2 < Z2)
        j0 = tl.minimum(tl.maximum(j0, 0), Z0 - 1)
        j1 = tl.minimum(tl.maximum(j1, 0), Z1 - 1)
        j2 = tl.minimum(tl.maximum(j2, 0), Z2 - 1)
        region_row = box * (Z0 * Z1 * Z2) + (j0 * Z1 + j1) * Z2 + j2
        take = mask & inside[:, None]
        r = tl.load(region_ptr + region_row[:, None] * region_stride + cols[None, :], mask=take, other=0.0)
    if HAS_BASE:
        s0 = tl.load(geometry, mask=row_ok, other=0).to(tl.int64)
        s1 = tl.load(geometry + 1, mask=row_ok, other=0).to(tl.int64)
        s2 = tl.load(geometry + 2, mask=row_ok, other=0).to(tl.int64)
        base_row = ((s0 + k0) * T1 + s1 + k1) * T2 + s2 + k2 + box * batch_stride
        if HAS_REGION:
            b = tl.load(base_ptr + base_row[:, None] * base_stride + cols[None, :], mask=mask & ~take, other=0.0)
            values = tl.where(take, r, b)
        else:
            values = tl.load(base_ptr + base_row[:, None] * base_stride + cols[None, :], mask=mask, other=0.0)
        tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], values, mask=mask)
    else:
        tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], r, mask=take)


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


def gather_boxes(base_rows: torch.Tensor | None, geometry: torch.Tensor, size: tuple[int, int, int],
                 dims: tuple[int, int, int], region_rows: torch.Tensor | None = None,
                 region_size: tuple[int, int, int] | None = None, batch_stride: int = 0,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """N boxes of one extent gathered from a row table, a region overlaid, the row addresses computed in the
    kernel from the boxes' corners (no index tensor).

    Args:
        base_rows: (B, C) a row-major table of extents ``dims`` (None: only write the region's rows into
            ``out``, in place).
        geometry: (N, 6) int32 on the tables' device: per box its first corner in the table, then the region's
            corner relative to the box (both (d0, d1, d2)).
        size: the boxes' extent (three axes: lower-dimensional maps lead with extent 1).
        dims: the table's extents.
        region_rows: (N * prod(region_size), C) the regions' values (None: no overlay).
        region_size: the regions' extent; region elements outside their box are not read.
        batch_stride: table rows added per box (N stacked tables).
        out: optional (N * prod(size), C) destination with channel stride 1 (required without a base).

    Returns:
        (N * prod(size), C) rows (``out`` when given).
    """
    source = base_rows if base_rows is not None else region_rows
    if source is None or (base_rows is None and out is None):
        raise ValueError("gather_boxes needs a base table, or region rows and an out to write into")
    source = _rows_2d(source, "base_rows" if base_rows is not None else "region_rows")
    n_cols = source.shape[1]
    has_region = region_rows is not None and region_rows.shape[0] > 0
    if has_region:
        region_rows = _rows_2d(region_rows, "region_rows")
        if region_rows.dtype != source.dtype or region_rows.shape[1] != n_cols:
            raise ValueError("region_rows must match base_rows in dtype and channel count")
    n_rows = geometry.shape[0] * size[0] * size[1] * size[2]
    if out is None:
        out = torch.empty((n_rows, n_cols), dtype=source.dtype, device=source.device)
    elif out.dim() != 2 or (out.stride(1) != 1 and out.shape[1] != 1) or out.shape[0] != n_rows:
        raise ValueError(f"out must be ({n_rows}, C) with channel stride 1")
    if n_rows == 0 or n_cols == 0 or (base_rows is None and not has_region):
        return out
    region = region_rows if has_region else source  # a valid pointer the kernel never reads
    z = region_size if has_region else (1, 1, 1)
    block_r, block_c = _blocks(n_cols)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))
    _kernel(_gather_boxes_kernel, _interpret(source))[grid](
        source, region, geometry, out, n_rows, n_cols, size[0] * size[1] * size[2], size[1], size[2], dims[1],
        dims[2], z[0], z[1], z[2], batch_stride, source.stride(0), region.stride(0), out.stride(0),
        BLOCK_R=block_r, BLOCK_C=block_c, HAS_BASE=base_rows is not None, HAS_REGION=has_region)
    return out
