"""Run many occluded copies of one input through the engine, in batches (shared by every OBE front end).

A query occludes either a window (a patch sliding over a grid, optionally only some channels) or one feature of a
mask (every element carrying that feature's id). Its update box is the window, or the bounding box of the
feature's elements; inside the box the occluder's values replace the occluded elements and the image keeps the
rest. Queries are packed into batches of one box size, ordered so that batch-mates need boxes of similar sizes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from incrinf.engine import BatchEngine, Boxes, Plan, crop_boxes, free_device_memory, peak_memory, reset_peak_memory
from incrinf.explain.occluders import Occluder, make_occluder
from incrinf.geometry import input_boxes
from incrinf.graph import Graph, captured_graph
from incrinf.progress import progress_bar

# Share of the free device memory a batch may use (cuDNN workspaces and the allocator need the rest).
GPU_MEMORY_SHARE = 0.5


@dataclass
class RunStats:
    """What a run did: positions, batches, time, FLOP ratios, working memory, and its fixed costs.

    ``peak_memory_bytes`` is the largest batch's planned working memory (on CUDA: what the batches allocated);
    ``predicted_peak_bytes`` the byte model's peak resident growth of the whole call (executor, base, store and
    batches: :class:`~incrinf.engine.RunBytes`), its parts in ``extra``. ``seconds`` is the batches' time;
    ``capture_seconds``, ``executor_seconds``, ``base_seconds`` and
    ``plan_seconds`` are the fixed costs of the run's capture (0 when shared), executor build (0 when shared),
    base materialization and plan (0 on a cache hit), each measured separately.
    """

    positions: int = 0
    batches: int = 0
    batch_size: int = 0
    seconds: float = 0.0
    flops_full: float = 0.0
    theoretical_speedup: float = 1.0
    realized_flop_ratio: float = 1.0
    peak_memory_bytes: int = 0
    predicted_peak_bytes: int = 0
    tau: float = 1.0
    capture_seconds: float = 0.0
    executor_seconds: float = 0.0
    base_seconds: float = 0.0
    plan_seconds: float = 0.0
    plan_hit: bool = False
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        out.update(self.extra)
        return out


Reduce = Callable[[Any], torch.Tensor]


class OcclusionRunner:
    """Outputs of a model for many occlusions of one input, by batched incremental inference.

    Args:
        model: a ``torch.fx``-traceable model (eval mode is set), or its captured graph.
        image: (1, C, *spatial) float tensor, 1-3 spatial axes.
        tau: projective field threshold (1 = exact).
        feature_threshold: value-based pruning (0 = exact): a recomputed position whose values moved by at most
            this share of the tensor's mean magnitude stops spreading.
    """

    def __init__(self, model: nn.Module | Graph, image: torch.Tensor, tau: float = 1.0,
                 feature_threshold: float = 0.0) -> None:
        start = time.perf_counter()
        self.graph = model if isinstance(model, Graph) else captured_graph(model, image.shape[1:])
        self.capture_seconds = time.perf_counter() - start
        self.image = image
        self.dims = tuple(self.graph.input_shape[2:])
        self.tau = tau
        self.feature_threshold = feature_threshold
        self.engine = BatchEngine(self.graph, image)

    @property
    def base_output(self) -> Any:
        """The model's output for the unoccluded input (batch axis 1)."""
        return self.engine.base_output

    def plan(self, starts: np.ndarray, sizes: np.ndarray, batch_size: int | None, memory: int | None
             ) -> tuple[Plan, bool, float]:
        """The engine's plan for queries with these changed boxes: ``(plan, hit, seconds)``. Without a batch size,
        batches fill ``memory`` bytes (on CUDA, at most a share of the free device memory)."""
        if batch_size is None:
            free = free_device_memory(self.image.device)
            memory = memory if free is None else min(memory, int(GPU_MEMORY_SHARE * free))
        start = time.perf_counter()
        plan, status = self.engine.plan(starts, sizes, self.tau, batch_size, memory)
        return plan, status.value == "hit", time.perf_counter() - start

    def run(self, positions: np.ndarray, window: tuple[int, ...], baseline: Any = 0.0,
            channels: torch.Tensor | None = None, batch_size: int | None = 16, progress: bool = False,
            desc: str = "occlusion", reduce: Reduce | None = None, memory: int | None = None
            ) -> tuple[Any, RunStats]:
        """Model outputs with each window occluded.

        Args:
            positions: (N, d) first corners; windows reaching past the far edge are cropped.
            window: (d,) window size.
            baseline: what replaces the window: a scalar, a tensor broadcastable to the image, ``"mean_patch"``,
                ``"mean_img"``, ``"gaussian"``, a function of the window's values or an
                :class:`~incrinf.explain.occluders.Occluder`.
            channels: optional (N, C) bool mask of occluded channels per position (all when ``None``).
            batch_size: positions per packed batch (None: as many as ``memory`` bytes allow).
            progress: show a progress bar.
            desc: progress bar label.
            reduce: applied to each batch's outputs as they come (e.g. the target's scores), so that large
                outputs (segmentation maps) are not kept for every position; must return a tensor with the
                batch axis first.
            memory: bytes a batch may use, with ``batch_size`` None.

        Returns:
            ``(outputs, stats)``: outputs (reduced, if asked) with a leading dimension N, in the order of
            ``positions``.
        """
        dims = self.dims
        window = tuple(int(w) for w in window)
        positions = np.asarray(positions, dtype=np.int64).reshape(-1, len(dims))
        occluder = make_occluder(baseline, self.image, window)
        boxes = input_boxes(positions, window, dims)
        plan, hit, planning = self.plan(boxes.start(), boxes.sizes(), batch_size, memory)

        def values(batch) -> torch.Tensor:
            chunk = positions[batch.queries]
            corner, size = batch.start.start(), batch.start.size
            picked = None if channels is None else channels[torch.tensor(batch.queries, device=channels.device)]
            mask = self._window_mask(chunk - corner, window, size, picked)
            return self._occlude(corner, size, mask, occluder, chunk - corner, window)

        return self._run(plan, values, progress, desc, reduce, hit, planning)

    def run_features(self, mask: torch.Tensor, baseline: Any = 0.0, batch_size: int | None = 16,
                     progress: bool = False, desc: str = "features", reduce: Reduce | None = None,
                     memory: int | None = None) -> tuple[np.ndarray, Any, RunStats]:
        """Model outputs with each feature of a mask occluded at once.

        A feature's update box is the bounding box of its elements; inside it the occluded values follow the
        mask (the baseline where the mask holds the feature, the image elsewhere).

        Args:
            mask: (C or 1, *spatial) integer feature ids (one per element; a channel axis of 1 applies to every
                channel).
            baseline: a scalar, a tensor broadcastable to the image, ``"mean_patch"`` (the mean over the feature's
                elements), ``"mean_img"`` or an :class:`~incrinf.explain.occluders.Occluder` that needs no window.
            batch_size: features per packed batch (None: as many as ``memory`` bytes allow).
            progress: show a progress bar.
            desc: progress bar label.
            reduce: as for :meth:`run`.
            memory: bytes a batch may use, with ``batch_size`` None.

        Returns:
            ``(features, outputs, stats)``: the sorted feature ids (F,), the outputs with a leading dimension F in
            that order, and the stats.
        """
        mask = mask.to(self.image.device)
        occluder = make_occluder(baseline, self.image, None)
        features, start, size = feature_boxes(mask)
        plan, hit, planning = self.plan(start, size, batch_size, memory)
        ids = torch.from_numpy(features).to(mask.device)

        def values(batch) -> torch.Tensor:
            corner, extent = batch.start.start(), batch.start.size
            boxed = crop_boxes(mask[None], corner, extent)
            wanted = ids[torch.tensor(batch.queries, device=mask.device)].view(-1, *([1] * (boxed.dim() - 1)))
            return self._occlude(corner, extent, boxed == wanted, occluder, None, None)

        outputs, stats = self._run(plan, values, progress, desc, reduce, hit, planning)
        return features, outputs, stats

    # --- the batch loop ----------------------------------------------------------------------------------

    def _run(self, plan: Plan, values: Callable[[Any], torch.Tensor], progress: bool, desc: str,
             reduce: Reduce | None, hit: bool, planning: float) -> tuple[Any, RunStats]:
        n = plan.queries
        stats = RunStats(positions=n, batch_size=plan.batch_size, tau=self.tau, flops_full=plan.full_macs,
                         theoretical_speedup=plan.theoretical_speedup, capture_seconds=self.capture_seconds,
                         executor_seconds=self.engine.seconds["executor"], base_seconds=self.engine.seconds["base"],
                         plan_seconds=planning, plan_hit=hit)
        predicted = self.engine.run_bytes(plan)
        stats.predicted_peak_bytes = predicted.peak
        stats.extra.update({f"{part}_bytes": getattr(predicted, part)
                            for part in ("weights", "store", "base", "index", "batch", "budget", "bound")})
        outputs: list[Any] = []
        done: list[np.ndarray] = []
        realized = 0.0
        start = time.perf_counter()
        dev = self.image.device
        resident = reset_peak_memory(dev)
        bar = progress_bar(total=n, desc=desc, unit="pos", disable=not progress, leave=False)
        # consecutive batches' boundary tensors wait for one shared run of the model's tail (the plan sizes the
        # group within the memory of naive re-inference at its batch size)
        waiting: list[tuple[np.ndarray, list[torch.Tensor]]] = []

        def finish_tail() -> None:
            if not waiting:
                return
            count = sum(len(queries) for queries, _ in waiting)
            joined = [torch.cat(parts) for parts in zip(*(tensors for _, tensors in waiting))] \
                if len(waiting) > 1 else waiting[0][1]
            done.extend(queries for queries, _ in waiting)
            waiting.clear()
            output = self.engine.tail(joined, plan.budget_bytes, plan.peak_bytes)
            del joined
            outputs.append(output if reduce is None else _reduced(reduce, output, count))
            bar.update(count)

        for batch in plan.batches:
            boxes_values = values(batch)
            if self.feature_threshold > 0:  # pruned boxes follow the data: walked without the plan's boxes
                result = self.engine.run(Boxes(batch.start.lo, batch.start.size, boxes_values), self.tau,
                                         self.feature_threshold)
            elif plan.tail_queries:
                result = self.engine.run_to_tail(batch, boxes_values)
            else:  # a whole batch at once (on CUDA, a recorded graph replayed where one is kept)
                result = self.engine.run_batch(batch, boxes_values)
            del boxes_values
            if self.feature_threshold > 0 or result.unchanged or not plan.tail_queries:
                outputs.append(result.output if reduce is None else _reduced(reduce, result.output, batch.n))
                done.append(batch.queries)
                bar.update(batch.n)
            else:
                waiting.append((batch.queries, result.output))
                if sum(len(q) for q, _ in waiting) + plan.largest_batch > plan.tail_queries:
                    finish_tail()  # the next batch would not fit in the group
            result.output = None
            realized += result.flops * batch.n
            stats.batches += 1
            stats.peak_memory_bytes = max(stats.peak_memory_bytes, result.peak_bytes)
        finish_tail()
        stats.peak_memory_bytes = max(stats.peak_memory_bytes, plan.peak_bytes if self.feature_threshold <= 0 else 0)
        bar.close()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # kernels run asynchronously: time them, not their launches
        stats.seconds = time.perf_counter() - start
        peak = peak_memory(dev)
        if peak is not None:  # what the batches allocated on the device beyond the resident base tensors
            stats.peak_memory_bytes = peak - resident
            stats.extra["peak_device_memory_bytes"] = peak
        stats.realized_flop_ratio = stats.flops_full * n / max(realized, 1.0)
        inverse = torch.from_numpy(np.argsort(np.concatenate(done))).to(dev)
        return _concat(outputs, inverse), stats

    def _window_mask(self, offsets: np.ndarray, window: tuple[int, ...], size: tuple[int, ...],
                     channels: torch.Tensor | None) -> torch.Tensor:
        """(N, C or 1, *size) bool: the elements of each box that its window (and channel selection) covers."""
        n, d = offsets.shape
        dev = self.image.device
        mask = torch.ones(n, 1, *size, dtype=torch.bool, device=dev)
        for a in range(d):
            offset = torch.from_numpy(offsets[:, a]).to(dev).view(n, *([1] * (d + 1)))
            shape = [1] * (d + 2)
            shape[2 + a] = size[a]
            k = torch.arange(size[a], device=dev).view(shape)
            mask = mask & (k >= offset) & (k < offset + window[a])
        if channels is not None:
            mask = mask & channels.to(dev).view(n, -1, *([1] * d))
        return mask

    # --- occluded values -----------------------------------------------------------------------------------

    def _occlude(self, start: np.ndarray, size: tuple[int, ...], mask: torch.Tensor, occluder: Occluder,
                 offsets: np.ndarray | None, window: tuple[int, ...] | None) -> torch.Tensor:
        """(N, C, *size) values of each query's input box: the image with the masked elements occluded."""
        return occluder.fill(crop_boxes(self.image, start, size), mask, start, offsets, window)


def feature_boxes(mask: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each feature's bounding box over the spatial axes.

    Args:
        mask: (C or 1, *spatial) integer feature ids.

    Returns:
        ``(features, start, size)``: the sorted ids (F,), and (F, d) first corners and extents.
    """
    d = mask.dim() - 1
    ids, inverse = torch.unique(mask.reshape(-1), sorted=True, return_inverse=True)
    coords = torch.meshgrid(*[torch.arange(n, device=mask.device) for n in mask.shape], indexing="ij")
    f = len(ids)
    start, stop = [], []
    for a in range(d):
        c = coords[a + 1].reshape(-1)
        start.append(torch.full((f,), mask.shape[a + 1], device=mask.device).scatter_reduce(0, inverse, c, "amin"))
        stop.append(torch.zeros(f, dtype=torch.long, device=mask.device).scatter_reduce(0, inverse, c, "amax"))
    lo = torch.stack(start, 1).cpu().numpy().astype(np.int64)
    hi = torch.stack(stop, 1).cpu().numpy().astype(np.int64)
    return ids.cpu().numpy(), lo, hi - lo + 1


def _reduced(reduce: Reduce, output: Any, n: int) -> torch.Tensor:
    scores = reduce(output)
    if not isinstance(scores, torch.Tensor) or scores.dim() == 0 or scores.shape[0] != n:
        raise ValueError(f"the target reducer must return a tensor with one row per example ({n} here), got "
                         f"{tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__}")
    return scores


def _concat(outputs: list[Any], inverse: torch.Tensor) -> Any:
    """Batches of outputs (tensors, or dicts / tuples of them) as one, rows put back in the queries' order."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs, 0).index_select(0, inverse.to(first.device))
    if isinstance(first, dict):
        return type(first)((k, _concat([o[k] for o in outputs], inverse)) for k in first)
    if isinstance(first, (list, tuple)):
        return type(first)(_concat([o[i] for o in outputs], inverse) for i in range(len(first)))
    raise TypeError(f"cannot batch model outputs of type {type(first).__name__}; pass a reducer target")
