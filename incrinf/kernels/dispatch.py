"""Pick the window-preparation kernels for a device: Triton on CUDA, plain PyTorch index ops elsewhere.

``INCRINF_FORCE_TRITON=1`` takes the Triton path for every tensor (CPU tensors then run in Triton's
interpreter, which is how CI checks the kernels); ``INCRINF_FORCE_TRITON=0`` takes the PyTorch path even on
CUDA (the baseline the GPU benchmark compares against). Unset: Triton exactly when the tensors are on CUDA
and Triton imports.

Plans precompute, per windowing and per full projection, a *combined* index over the virtual concatenation
``[base rows; region rows]`` (:func:`fuse_window_index`, :func:`fuse_scatter_index`; pure torch, importable
without Triton), so the GPU kernel is one pure row gather from two sources. :func:`prepare_windows` and
:func:`project` are the entry points the engine calls (for occlusion batches and for a moving camera's blocks).
:func:`free_device_memory` and :func:`peak_device_memory` size batches and report memory on CUDA (``None`` on
CPU).
"""

from __future__ import annotations

import functools
import os

import torch

from incrinf.kernels import gather as _torch_path

FORCE_ENV = "INCRINF_FORCE_TRITON"


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether Triton imports (it ships with CUDA builds of torch on Linux)."""
    try:
        import triton  # noqa: F401
    except Exception:  # an absent or broken install both mean "use PyTorch"
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Whether tensors like ``t`` go through the Triton kernels (see the module docstring)."""
    force = os.environ.get(FORCE_ENV, "").strip()
    if force == "0":
        return False
    if force:
        if not triton_available():
            raise RuntimeError(f"{FORCE_ENV}={force} but triton cannot be imported")
        return True
    return t.device.type == "cuda" and triton_available()


def wants_fused_index(device: torch.device | str) -> bool:
    """Whether plans for ``device`` should carry combined indexes (:func:`fuse_window_index`): on CUDA with
    Triton, or when Triton is forced. Independent of ``INCRINF_FORCE_TRITON=0``, so a plan cached while the
    PyTorch path was forced still serves the Triton path without rebuilding its index per batch."""
    if os.environ.get(FORCE_ENV, "").strip() not in ("", "0"):
        return True
    return torch.device(device).type == "cuda" and triton_available()


def wants_box_index(device: torch.device | str) -> bool:
    """Whether plans for ``device`` describe their gathers by the boxes' corners (:func:`gather_boxes`: a few
    bytes per box, the row addresses computed on the device) instead of row index tensors made on the host: on
    CUDA (either path), or when Triton is forced."""
    if os.environ.get(FORCE_ENV, "").strip() not in ("", "0"):
        return True
    return torch.device(device).type == "cuda"


def _triton():
    from incrinf.kernels import triton_gather

    return triton_gather


# --- combined indexes (host side, once per plan; pure torch) ---------------------------------------------


def fuse_window_index(read_index: torch.Tensor, dest: torch.Tensor | None, source: torch.Tensor | None,
                      n_base_rows: int) -> torch.Tensor:
    """Combine a window gather and its region overlay into one index over ``[base rows; region rows]``.

    Args:
        read_index: (R,) base-map row of every window row (R = N*hr*wr).
        dest: (K,) window rows that receive region values, unique (``None``: no overlay).
        source: (K,) region row copied to each ``dest`` (``None``: region rows 0..K-1 in order).
        n_base_rows: rows of the base map; region row ``j`` becomes ``n_base_rows + j``.

    Returns:
        (R,) int64: values ``< n_base_rows`` read the base map, the others read region row
        ``value - n_base_rows``.
    """
    combined = read_index.to(torch.int64).clone()
    if dest is None or dest.numel() == 0:
        return combined
    if source is None:
        source = torch.arange(dest.numel(), device=combined.device)
    combined[dest.to(combined.device)] = source.to(combined.device, torch.int64) + n_base_rows
    return combined


def fuse_scatter_index(dest: torch.Tensor, source: torch.Tensor | None, n: int, n_base_rows: int
                       ) -> torch.Tensor:
    """Combined index of a full projection: N copies of the base map with region rows written in.

    Args:
        dest: (K,) rows of the (N*H*W, C) projection that receive region values, unique.
        source: (K,) region row of each ``dest`` (``None``: 0..K-1 in order).
        n: number of copies (positions).
        n_base_rows: H*W, rows of the base map.

    Returns:
        (N*H*W,) int64 index over ``[base rows; region rows]``.
    """
    device = dest.device
    tiled = torch.arange(n_base_rows, device=device, dtype=torch.int64).repeat(n)
    return fuse_window_index(tiled, dest, source, n_base_rows)


# --- fused entry points -------------------------------------------------------------------------------------


def prepare_windows(base_rows: torch.Tensor, read_index: torch.Tensor, dest: torch.Tensor | None,
                    region_rows: torch.Tensor | None, source: torch.Tensor | None = None,
                    combined: torch.Tensor | None = None) -> torch.Tensor:
    """All read-in windows of a batch with the incoming regions overlaid.

    Args:
        base_rows: (B, C) the (padded) base map as rows.
        read_index: (R,) base row of every window row.
        dest: (K,) window rows receiving region values (``None``: no overlay).
        region_rows: (M, C) incoming region values (``None``: no overlay).
        source: (K,) region row of each ``dest`` (``None``: 0..K-1 in order).
        combined: optional precomputed ``fuse_window_index(read_index, dest, source, B)``.

    Returns:
        (R, C) rows, a fresh tensor.
    """
    overlay = dest is not None and region_rows is not None
    if use_triton(base_rows):
        tg = _triton()
        if not overlay:
            return tg.gather_rows(base_rows, read_index)
        if combined is None:
            combined = fuse_window_index(read_index, dest, source, base_rows.shape[0])
        return tg.gather_rows(base_rows, combined, region_rows)
    rows = base_rows.index_select(0, read_index)
    if overlay:
        _torch_path.write_overlay(rows, dest, region_rows, source)
    return rows


def project(base_rows: torch.Tensor, n: int, dest: torch.Tensor, region_rows: torch.Tensor,
            source: torch.Tensor | None = None, combined: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`project_full` with an optional precomputed ``fuse_scatter_index(dest, source, n, B)``."""
    if use_triton(base_rows):
        tg = _triton()
        if combined is None:
            combined = fuse_scatter_index(dest, source, n, base_rows.shape[0])
        return tg.gather_rows(base_rows, combined, region_rows)
    return _torch_path.project_full(base_rows, n, dest, region_rows, source)


def gather_boxes(base_rows: torch.Tensor | None, geometry: torch.Tensor, size: tuple[int, int, int],
                 dims: tuple[int, int, int], region_rows: torch.Tensor | None = None,
                 region_size: tuple[int, int, int] | None = None, batch_stride: int = 0,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """N boxes of one extent gathered from a row table with a region overlaid, addressed by the boxes' corners
    (see :func:`incrinf.kernels.triton_gather.gather_boxes` for the arguments): one Triton kernel, or PyTorch
    index ops whose indices are made on the device."""
    like = base_rows if base_rows is not None else region_rows
    if like is not None and use_triton(like):
        return _triton().gather_boxes(base_rows, geometry, size, dims, region_rows, region_size, batch_stride, out)
    return _torch_path.gather_boxes(base_rows, geometry, size, dims, region_rows, region_size, batch_stride, out)


# --- device memory -----------------------------------------------------------------------------------------


def _cuda(device: torch.device | str | None) -> torch.device | None:
    if device is None:
        return None
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return device


def free_device_memory(device: torch.device | str | None) -> int | None:
    """Free bytes on a CUDA device (plus what PyTorch's caching allocator holds but does not use), or
    ``None`` for CPU devices."""
    dev = _cuda(device)
    if dev is None:
        return None
    free, _total = torch.cuda.mem_get_info(dev)
    cached_unused = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    return int(free + max(cached_unused, 0))


def reset_peak_device_memory(device: torch.device | str | None) -> None:
    """Start a new peak-memory measurement on a CUDA device (no-op elsewhere)."""
    dev = _cuda(device)
    if dev is not None:
        torch.cuda.reset_peak_memory_stats(dev)


def peak_device_memory(device: torch.device | str | None) -> int | None:
    """Peak bytes allocated by tensors on a CUDA device since the last reset, or ``None`` for CPU."""
    dev = _cuda(device)
    if dev is None:
        return None
    return int(torch.cuda.max_memory_allocated(dev))
