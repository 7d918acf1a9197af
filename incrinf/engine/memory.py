"""Device memory for workloads: free memory to size batches, and the peak a run allocated (CUDA; None on CPU)."""

from __future__ import annotations

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
