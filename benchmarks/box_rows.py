"""Microbenchmark of :func:`incrinf.kernels.gather.box_rows`, the row indices of N boxes in a row-major table.

Plans (on the host) and the box-addressed PyTorch gather (on the device) both build these rows. This script times
the one implementation (Horner's rule over per-axis coordinates, extent-1 axes skipped) on NumPy corners and on CPU
tensors against the two forms it replaced (a NumPy per-axis accumulation over the whole (N, *size) array, and a
PyTorch broadcast over three padded axes), on box sizes of
occlusion plans (read-in windows of early and late layers, 2-D and 3-D), of a stream's blocks and of a few
tiny boxes. Every form is checked to give the same rows; rounds alternate the forms.

Run: ``python benchmarks/box_rows.py`` (about 10 s; one thread).
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

try:
    from incrinf.kernels.gather import box_rows
except ImportError:  # run from a checkout without `pip install -e .`: use the package next to this file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from incrinf.kernels.gather import box_rows

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine  # noqa: E402

# (what, N boxes, box extent, table extents)
CASES = [
    ("2-D occlusion, early layer read-in", 256, (17, 17), (114, 114)),
    ("2-D occlusion, late layer read-in", 256, (5, 5), (16, 16)),
    ("2-D occlusion, input-size patches", 64, (40, 40), (226, 226)),
    ("stream blocks", 32, (12, 12), (60, 80)),
    ("a few small boxes", 4, (8, 8), (28, 28)),
    ("3-D occlusion read-in", 32, (12, 12, 12), (64, 64, 64)),
    ("1-D signal windows", 512, (30,), (1000,)),
]


def accumulated(start: np.ndarray, size: tuple[int, ...], dims: tuple[int, ...]) -> np.ndarray:
    """The replaced NumPy form: every axis multiplies and adds over the whole (N, *size) array."""
    n, d = start.shape
    rows = np.zeros((n, *size), np.int64)
    for a in range(d):
        shape = [1] * (d + 1)
        shape[a + 1] = size[a]
        rows = rows * dims[a] + (start[:, a].reshape(-1, *([1] * d)) + np.arange(size[a]).reshape(shape))
    return rows.reshape(-1)


def broadcast3(start: torch.Tensor, size: tuple[int, ...], dims: tuple[int, ...]) -> torch.Tensor:
    """The replaced PyTorch form: corners and extents padded to three axes, one broadcast expression."""
    pad = 3 - start.shape[1]
    size, dims = (1,) * pad + tuple(size), (1,) * pad + tuple(dims)
    g = torch.nn.functional.pad(start.to(torch.int64), (pad, 0))
    k = [torch.arange(s).view(*([1] * (a + 1)), s, *([1] * (2 - a))) for a, s in enumerate(size)]
    corner = [g[:, a].view(-1, 1, 1, 1) for a in range(3)]
    return (((corner[0] + k[0]) * dims[1] + corner[1] + k[1]) * dims[2] + corner[2] + k[2]).reshape(-1)


def _numpy(form, start: np.ndarray, size: tuple[int, ...], dims: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(form(start, size, dims))  # plans hand their rows to torch as tensors


def main() -> None:
    torch.set_num_threads(1)
    print(machine())
    print(f"load average {os.getloadavg()}")
    rng = np.random.default_rng(0)
    print(f"{'case':38s} {'rows':>7s}  {'replaced NumPy':>14s} {'box_rows NumPy':>14s}  "
          f"{'replaced torch':>14s} {'box_rows torch':>14s}   (median us, NumPy corners -> tensor)")
    for what, n, size, dims in CASES:
        start = np.stack([rng.integers(0, x - s + 1, n) for x, s in zip(dims, size)], axis=1)
        start_t = torch.from_numpy(start)
        forms = [functools.partial(_numpy, accumulated, start, size, dims),
                 functools.partial(_numpy, box_rows, start, size, dims),
                 functools.partial(broadcast3, start_t, size, dims),
                 functools.partial(box_rows, start_t, size, dims)]
        first = forms[0]()
        assert all(torch.equal(first, f()) for f in forms[1:]), what
        times: list[list[float]] = [[] for _ in forms]
        for _ in range(40):  # alternate the forms so load drifts hit all alike
            for f, t in zip(forms, times):
                t0 = time.perf_counter()
                f()
                t.append(time.perf_counter() - t0)
        us = [statistics.median(t) * 1e6 for t in times]
        print(f"{what:38s} {math.prod(size) * n:7d}  {us[0]:14.1f} {us[1]:14.1f}  {us[2]:14.1f} {us[3]:14.1f}")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
