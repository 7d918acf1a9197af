"""Memory for workloads: free device memory to size batches, the peak a run allocated (CUDA; None on CPU), and
handing freed host memory back to the operating system between batches."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

from incrinf.kernels import dispatch


def free_device_memory(device: torch.device | str | None) -> int | None:
    """Free bytes on a CUDA device (what PyTorch's allocator holds unused included), None elsewhere."""
    return dispatch.free_device_memory(device)


def reset_peak_memory(device: torch.device | str | None) -> int:
    """Start a peak-memory measurement on a CUDA device; returns the bytes allocated now (0 elsewhere)."""
    dispatch.reset_peak_device_memory(device)
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.memory_allocated(device))
    return 0


def peak_memory(device: torch.device | str | None) -> int | None:
    """Peak bytes allocated on a CUDA device since the last reset, None elsewhere."""
    return dispatch.peak_device_memory(device)


@functools.lru_cache(maxsize=1)
def _trim():
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_memory() -> None:
    """Return the host memory freed since the last call to the operating system (glibc keeps freed blocks below
    its mmap threshold, 32 MiB at most, in its heaps: a batch's maps would otherwise stay resident after their
    last use); nothing happens without glibc."""
    trim = _trim()
    if trim is not None:
        trim(0)
