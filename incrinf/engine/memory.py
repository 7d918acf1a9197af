"""Memory for workloads: free device memory to size batches, the peak a run allocated (CUDA; None on CPU), and
handing freed host memory back to the operating system between batches."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from dataclasses import dataclass

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


# Freed bytes after which a batch checks whether to hand host memory back to the system (glibc's largest mmap
# threshold: blocks above it are unmapped when freed anyway).
TRIM_BYTES = 32 * 2**20

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_memory() -> int | None:
    """This process's resident set in bytes (Linux's ``/proc/self/statm``), None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def _status(field: str) -> int | None:
    """A field of Linux's ``/proc/self/status`` in bytes, None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return None


def reset_resident_peak() -> bool:
    """Reset the kernel's record of this process's peak resident set to its current size (Linux 4.0+:
    ``/proc/self/clear_refs``); whether it could. After it, :func:`resident_peak` is an exact peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def resident_peak() -> int | None:
    """This process's peak resident set in bytes since it started or :func:`reset_resident_peak` (``VmHWM``)."""
    return _status("VmHWM")


def file_resident() -> int | None:
    """This process's file-backed resident bytes (shared libraries' code and data among them: ``RssFile``)."""
    return _status("RssFile")


class HostMemory:
    """When to hand freed host memory back to the operating system: only when the process's resident growth since
    this object was made, plus what the work still to come may allocate, would pass a budget.

    Freed blocks the allocator keeps are what the next batch allocates again without faulting pages in; handing
    them back after every batch costs those faults (a third of a 2-D run's time on small networks). Within the
    budget (the plan's: what naive re-inference at the same batch size holds) they are kept.
    """

    def __init__(self) -> None:
        self.origin = resident_memory()
        self.releases = 0

    def growth(self) -> int | None:
        """Resident bytes gained since this object was made, None where they cannot be read."""
        now = resident_memory()
        return None if now is None or self.origin is None else now - self.origin

    def settle(self, budget: int, coming: int) -> bool:
        """Hand freed memory back when the resident growth plus ``coming`` bytes about to be allocated exceeds
        ``budget`` bytes (always where the growth cannot be read, or without a budget); returns whether it did."""
        growth = self.growth()
        if budget > 0 and growth is not None and growth + coming <= budget:
            return False
        release_free_memory()
        self.releases += 1
        return True


class FreedBytes:
    """Bytes of values freed since the resident memory was last checked: past :data:`TRIM_BYTES` it is, and freed
    memory is handed back to the system when the growth plus ``coming`` bytes would pass ``budget`` (0: always),
    so that the freed blocks the allocator keeps stay within :data:`TRIM_BYTES` of that budget."""

    def __init__(self, host: HostMemory, budget: int = 0, coming: int = 0) -> None:
        self.bytes = 0
        self.host = host
        self.budget = budget
        self.coming = coming

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` just freed."""
        self.bytes += nbytes
        if self.bytes >= TRIM_BYTES:
            self.host.settle(self.budget, self.coming)
            self.bytes = 0


@dataclass(frozen=True)
class RunBytes:
    """The host memory a planned run of many changed copies of one input holds, in bytes, from shapes and sizes
    alone: the byte model behind a plan's predicted peak (:meth:`~incrinf.engine.batches.BatchEngine.run_bytes`).

    Attributes:
        weights: weights the executor made beyond the model's own (folded batch norms, channels-last copies).
        store: the store's tables (the base values later steps read, padded as their windows read them).
        base: the base's peak: its forward pass (batch 1, the values the store needs kept), then the store's
            tables made one by one while those values are freed.
        index: the plan's kept index tensors (0 when each batch makes its own).
        batch: the largest batch's working memory (values live at once, the boundary tensors a shared tail run
            waits for, and its index tensors when the plan does not keep them).
        budget: what the run may hold before freed memory is handed back to the system (the plan's budget:
            naive re-inference's memory at the batch size, or the caller's).
        slack: freed bytes between two checks of the budget (:data:`TRIM_BYTES`).
    """

    weights: int
    store: int
    base: int
    index: int
    batch: int
    budget: int
    slack: int = TRIM_BYTES

    @property
    def held(self) -> int:
        """Bytes held from the base to the last batch: weights, store and kept index tensors."""
        return self.weights + self.store + self.index

    @property
    def peak(self) -> int:
        """Predicted peak resident growth of a run that builds its executor and base: the base forward pass and
        the store being made, or the largest batch on top of what is held, each operator's working memory
        counted (:meth:`~incrinf.engine.operators.Operators.working_bytes`). Not counted: the runtime libraries'
        own memory (oneDNN's primitives, Python objects; 10-30 MiB measured) and the freed blocks the allocator
        keeps (at most up to :attr:`bound`)."""
        return max(self.weights + self.base, self.held + self.batch)

    @property
    def bound(self) -> int:
        """What the run's resident growth stays under: the allocator keeps freed blocks only while the growth plus
        the next batch's peak is within the budget (and the base's forward pass none), checked every
        :attr:`slack` freed bytes (values and operators' working memory)."""
        return max(self.peak, self.budget) + self.slack
