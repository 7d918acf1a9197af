"""Shared benchmark helpers: machine description, medians, peak memory sampling."""

from __future__ import annotations

import copy
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.fx.experimental.optimization as fx_optimization

from incrinf.engine.memory import file_resident, reset_resident_peak, resident_memory, resident_peak


def machine() -> str:
    """One line describing this machine and software."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    return (f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), python {platform.python_version()}")


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as printed beside timings."""
    return " ".join(f"{v:.1f}" for v in os.getloadavg())


def plain_input(mean: Sequence[float], std: Sequence[float], channels_last: bool
                ) -> Callable[[np.ndarray], torch.Tensor]:
    """What a user of plain inference feeds the model for an (H, W, 3) uint8 frame: ``(x / 255 - mean) / std`` as
    (1, 3, H, W), channels-last in memory if asked."""
    m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)

    def normalise(frame: np.ndarray) -> torch.Tensor:
        x = (torch.from_numpy(frame).permute(2, 0, 1)[None].float().div_(255.0) - m) / s
        return x.contiguous(memory_format=torch.channels_last) if channels_last else x

    return normalise


def folded(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with its batch norms folded into the convolutions before them (what a user of plain
    inference would run, as incrinf folds them; the model as given where torch.fx cannot trace it)."""
    try:
        return fx_optimization.fuse(copy.deepcopy(model))
    except Exception as error:  # noqa: BLE001 - any tracing failure leaves the baseline unfolded
        print(f"  (batch norms not folded for the baseline: {type(error).__name__})")
        return copy.deepcopy(model)


def _rss() -> int:
    return resident_memory() or 0


class PeakRSS:
    """Peak resident memory above the level at entry: the kernel's high-water mark where it can be reset (exact),
    else sampled every few milliseconds. ``file_bytes`` is the growth of file-backed resident pages over the block
    (shared-library code and data touched for the first time: the runtime's, not the work's)."""

    def __enter__(self) -> PeakRSS:
        self.exact = reset_resident_peak()
        self.start, self.file_start = _rss(), file_resident() or 0
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss(), (resident_peak() or 0) if self.exact else 0)
        self.file_bytes = max((file_resident() or 0) - self.file_start, 0)

    @property
    def bytes(self) -> int:
        return max(self.peak - self.start, 0)


def timed(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    """(seconds, peak extra RSS bytes, result) of one call."""
    with PeakRSS() as mem:
        start = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - start
    return seconds, mem.bytes, out


def median(values: list[float]) -> float:
    return statistics.median(values)


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def peak_rss_in_child(fn: Callable[..., Any], *args: Any) -> int:
    """Peak resident-memory growth of ``fn(*args)`` run in a fresh spawned process (so this process's
    allocator caches do not hide it, and OpenMP is not forked); both methods of a comparison are measured the
    same way. ``fn`` must be a module-level function."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return int(pool.apply(_measure, (fn, *args)))


def _measure(fn: Callable[..., Any], *args: Any) -> int:
    fn(*args, warm=True)  # load the model and image outside the measured window
    with PeakRSS() as mem:
        fn(*args)
    return mem.bytes
