"""CUDA graphs of planned batches: a batch's kernels recorded once and replayed with one launch.

A planned batch (:class:`~incrinf.engine.plans.BatchPlan` with its index tensors) has static shapes, and the
engine's per-step work on the host (Python, one cuDNN call and one Triton launch per step, about 0.2 ms a step)
costs more than the GPU's work on small boxes: ResNet18's 2809 occlusions at batch 128 run 957 steps, 46 ms of GPU
time behind 0.2 s of host time. Recorded as a CUDA graph, a batch is one replay.

A graph reads the addresses it was recorded with: the executor's weights, the plan's index tensors, the store's
tables, the static copy of the batch's input values. It is therefore kept per executor (weights changed in place
make a new executor) and keyed by the batch and the addresses of the store's tables, so it serves every input of
that shape whose store lands at those addresses (PyTorch's caching allocator gives a store the blocks of the
previous one of the same sizes), and never reads a freed or foreign table. Every graph of one executor shares one
memory pool and replays are serialized by a lock, so the pool holds one batch's working memory, kept between
runs (what a plain run allocates and frees each time). A batch is recorded the second time it runs with the same
key (the first run, eager, compiles the kernels and sets cuDNN up); a model whose steps cannot be recorded (a host
copy inside a step) runs eagerly from then on.

``INCRINF_CUDA_GRAPHS=0`` turns graphs off (every batch runs eagerly).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

GRAPHS_ENV = "INCRINF_CUDA_GRAPHS"
# Graphs kept per executor, the oldest dropped first (each holds its static input and output; the working memory
# is the shared pool's).
MAX_GRAPHS = 1024


def graphs_enabled(device: torch.device) -> bool:
    """Whether planned batches on ``device`` are recorded as CUDA graphs."""
    return device.type == "cuda" and os.environ.get(GRAPHS_ENV, "1").strip() != "0"


@dataclass
class _Recorded:
    batch: Any  # the planned batch (held, so that its id is not reused while the graph lives)
    graph: torch.cuda.CUDAGraph
    values: torch.Tensor  # the static input the graph reads
    result: Any  # the eager run's result whose output tensors the graph writes


def _clone(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (list, tuple)):
        return type(out)(_clone(o) for o in out)
    if isinstance(out, dict):
        return type(out)((k, _clone(v)) for k, v in out.items())
    return out


class Replays:
    """The recorded batches of one executor (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.recorded: dict[tuple, _Recorded] = {}
        self.seen: set[tuple] = set()
        self.pool = None
        self.broken = False  # a step could not be recorded: run eagerly

    def run(self, batch: Any, values: torch.Tensor, addresses: tuple, eager: Callable[[Any, torch.Tensor], Any]
            ) -> Any:
        """``eager(batch, values)``'s result, replayed from a graph when one is recorded for this key.

        Args:
            batch: a planned batch with its index tensors.
            values: its input boxes' new values.
            addresses: the data pointers of every store tensor the batch may read.
            eager: runs the batch step by step (and is what gets recorded).
        """
        key = (id(batch), addresses, tuple(values.shape), values.dtype, values.device)
        with self.lock:
            found = self.recorded.get(key)
            if found is None:
                if self.broken or key not in self.seen:
                    self.seen.add(key)
                    return eager(batch, values)
                while len(self.recorded) >= MAX_GRAPHS:
                    self.recorded.pop(next(iter(self.recorded)))
                found = self._record(key, batch, values, eager)
                if found is None:
                    return eager(batch, values)
            found.values.copy_(values)
            found.graph.replay()
            return dataclasses.replace(found.result, output=_clone(found.result.output))

    def _record(self, key: tuple, batch: Any, values: torch.Tensor, eager: Callable[[Any, torch.Tensor], Any]
                ) -> _Recorded | None:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        static = values.clone()
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize(values.device)
            with torch.cuda.graph(graph, pool=self.pool):
                result = eager(batch, static)
        except Exception:  # a step that cannot be recorded (a host copy, a synchronization): eager from now on
            self.broken = True
            torch.cuda.synchronize(values.device)
            return None
        found = _Recorded(batch, graph, static, result)
        self.recorded[key] = found
        return found
