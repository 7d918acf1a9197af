"""CUDA graphs of planned batches: a batch's kernels recorded once and replayed with one launch.

A planned batch (:class:`~incrinf.engine.plans.BatchPlan` with its index tensors) has static shapes, and the
engine's per-step work on the host (Python, one cuDNN call and one Triton launch per step, about 0.2 ms a step)
costs more than the GPU's work on small boxes: ResNet18's 2809 occlusions at batch 128 run 957 steps, 46 ms of GPU
time behind 0.2 s of host time. Recorded as a CUDA graph, a batch is one replay.

A graph reads the addresses it was recorded with: the executor's weights, the plan's index tensors, and static
copies of the store's tables and input, which a run copies its own store into before its first replay (one
device copy of the base tables per input; a run for another input of that shape reuses every graph). Graphs are
kept per executor (weights changed in place make a new executor), keyed by the batch. Every graph of one
executor shares one memory pool, and replays are serialized by a lock, so the pool holds one batch's working
memory, kept between runs (what a plain run allocates and frees each time). A batch is recorded the second time
it runs (the first run, eager, compiles the kernels and sets cuDNN up); a model whose steps cannot be recorded (a
host copy inside a step) runs eagerly from then on.

``INCRINF_CUDA_GRAPHS=0`` turns graphs off (every batch runs eagerly).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from incrinf.engine.stores import clone_output
from incrinf.kernels import dispatch

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


class Replays:
    """The recorded batches of one executor (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.recorded: dict[tuple, _Recorded] = {}
        self.seen: set[tuple] = set()
        self.pool = None
        self.broken = False  # a step could not be recorded: run eagerly
        self.tables: dict[str, torch.Tensor] = {}  # static copies of the bound store's tables
        self.input: torch.Tensor | None = None
        self.owner: Callable[[], Any] | None = None  # weak reference to the store copied in

    def run(self, batch: Any, values: torch.Tensor, store: Any, eager: Callable[[Any, torch.Tensor], Any]) -> Any:
        """``eager(batch, values)``'s result, replayed from a graph when one is recorded for this batch.

        Args:
            batch: a planned batch with its index tensors.
            values: its input boxes' new values.
            store: the :class:`~incrinf.engine.stores.BaseStore` the batch reads (its ``tables`` and ``input``).
            eager: runs the batch step by step on ``store`` (and is what gets recorded).
        """
        # the gathers' path is part of what gets recorded (INCRINF_FORCE_TRITON may change between runs)
        key = (id(batch), tuple(values.shape), values.dtype, values.device, dispatch.use_triton(values))
        with self.lock:
            found = self.recorded.get(key)
            if found is None:
                if self.broken or key not in self.seen:
                    self.seen.add(key)
                    return eager(batch, values)
                while len(self.recorded) >= MAX_GRAPHS:
                    self.recorded.pop(next(iter(self.recorded)))
                self._bind(store)
                found = self._record(key, batch, values, store, eager)
                if found is None:
                    return eager(batch, values)
            self._bind(store)
            found.values.copy_(values)
            found.graph.replay()
            return dataclasses.replace(found.result, output=clone_output(found.result.output))

    def _bind(self, store: Any) -> None:
        """Copy ``store``'s tables and input into the static tensors the graphs read (unless they hold them)."""
        if self.owner is not None and self.owner() is store:
            return
        shapes = {k: (t.shape, t.dtype) for k, t in store.tables.items()}
        if {k: (t.shape, t.dtype) for k, t in self.tables.items()} != shapes or self.input is None \
                or self.input.shape != store.input.shape:
            self.recorded.clear()  # another layout: the graphs read tensors that no longer fit
            self.tables = {k: torch.empty_like(t) for k, t in store.tables.items()}
            self.input = torch.empty_like(store.input)
        for k, t in store.tables.items():
            self.tables[k].copy_(t)
        self.input.copy_(store.input)
        self.owner = weakref.ref(store)

    def _record(self, key: tuple, batch: Any, values: torch.Tensor, store: Any,
                eager: Callable[[Any, torch.Tensor], Any]) -> _Recorded | None:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        static = values.clone()
        graph = torch.cuda.CUDAGraph()
        tables, image = store.tables, store.input
        store.tables, store.input = self.tables, self.input  # the graph reads the static copies
        try:
            torch.cuda.synchronize(values.device)
            with torch.cuda.graph(graph, pool=self.pool):
                result = eager(batch, static)
        except Exception:  # a step that cannot be recorded (a host copy, a synchronization): eager from now on
            self.broken = True
            torch.cuda.synchronize(values.device)
            return None
        finally:
            store.tables, store.input = tables, image
        found = _Recorded(batch, graph, static, result)
        self.recorded[key] = found
        return found
