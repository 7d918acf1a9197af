"""Run many occluded copies of one input through the engine, in batches (shared by every OBE front end).

A query occludes either a window (a patch sliding over a grid, optionally only some channels) or one feature of a
mask (every element carrying that feature's id). Its update box is the window, or the bounding box of the
feature's elements; inside the box the occluder's values replace the occluded elements and the image keeps the
rest. Queries are packed into batches of one box size, ordered so that batch-mates need boxes of similar sizes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from incrinf.engine import BatchEngine, batch_plan
from incrinf.engine.windows import box_rows
from incrinf.explain.occluders import Occluder, make_occluder
from incrinf.geometry import Boxes, Propagation, RegionKind, full_flops, incremental_flops, input_boxes, propagate
from incrinf.graph import Graph, captured_graph
from incrinf.kernels.dispatch import free_device_memory, peak_device_memory, reset_peak_device_memory
from incrinf.kernels.gather import from_rows, to_rows
from incrinf.progress import progress_bar

# Packed batches beyond this many positions stop paying on a CPU and only cost memory.
CPU_BATCH_CAP = 64
# On a GPU larger packed batches keep paying (Krypton used 128); memory is the limit.
GPU_BATCH_CAP = 256
# Share of the free device memory a batch may use (cuDNN workspaces and the allocator need the rest).
GPU_MEMORY_SHARE = 0.5


@dataclass
class RunStats:
    """What a run did: positions, batches, time, FLOP ratios, working memory."""

    positions: int = 0
    batches: int = 0
    batch_size: int = 0
    seconds: float = 0.0
    flops_full: float = 0.0
    theoretical_speedup: float = 1.0
    realized_flop_ratio: float = 1.0
    peak_memory_bytes: int = 0
    tau: float = 1.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        out.update(self.extra)
        return out


def estimate_batch_size(graph: Graph, window: tuple[int, ...], max_memory: int, tau: float,
                        cap: int = CPU_BATCH_CAP, device: torch.device | str | None = None) -> int:
    """Positions per batch so that the working tensors stay under ``max_memory`` bytes (and, on a CUDA
    ``device``, under a share of its free memory, with the GPU cap)."""
    free = free_device_memory(device)
    if free is not None:
        max_memory = min(max_memory, int(GPU_MEMORY_SHARE * free))
        cap = GPU_BATCH_CAP
    dims = graph.input_shape[2:]
    centre = np.array([[(n - w) // 2 for n, w in zip(dims, window)]])
    prop = propagate(graph, input_boxes(centre, window, dims), tau=tau, uniform=True)
    largest = 0
    for node in graph.nodes:
        region = prop.regions[node.name]
        if node.shape is None or region.kind == RegionKind.NONE:
            continue
        step = prop.steps.get(node.name)
        if region.kind == RegionKind.FULL:
            elems = int(np.prod(node.shape[1:]))
        else:
            elems = int(np.prod(node.shape[1:-len(dims)])) * int(region.boxes.area) if graph.is_map(node.shape) else 0
        if step is not None:
            elems += graph.by_name[node.inputs[0]].shape[1] * int(np.prod(step.read_size))
        largest = max(largest, elems)
    per_position = 4 * 4 * max(largest, 1)  # float32; window, output, projection and slack
    return int(max(1, min(cap, max_memory // per_position)))


def batch_order(graph: Graph, exact: Propagation) -> np.ndarray:
    """Order in which to batch positions so that a batch's positions reach boxes of similar size.

    A packed batch computes every position on boxes of the batch's largest size; positions near the image
    edges reach fewer outputs, and they only keep that saving when their batch-mates are edge positions of
    the same orientation. Sorting by the exact reach (outermost axis first) at the deepest node that still
    has a box groups them (stable: ties keep the caller's order).

    Args:
        graph: captured graph.
        exact: per-position propagation (``propagate(..., uniform=False)``).

    Returns:
        (N,) permutation of the positions.
    """
    boxes = [n.name for n in graph.nodes if exact.regions[n.name].kind == RegionKind.BOX and graph.is_map(n.shape)]
    if not boxes:
        return np.arange(exact.n)
    deepest = exact.regions[boxes[-1]]
    return np.lexsort(deepest.boxes.sizes().T[::-1])


Reduce = Callable[[Any], torch.Tensor]


@dataclass
class _Batch:
    """One packed batch: which queries, their boxes (one size) and the occluded values inside them."""

    queries: np.ndarray  # (n,) indices into the caller's queries
    boxes: Boxes
    plan_key: tuple[np.ndarray, tuple[int, ...]]  # (corners, extent) that determine the batch's index plan


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
        self.graph = model if isinstance(model, Graph) else captured_graph(model, image.shape[1:])
        self.image = image
        self.dims = tuple(self.graph.input_shape[2:])
        self.tau = tau
        self.feature_threshold = feature_threshold
        self.engine = BatchEngine(self.graph, image)
        self.image_rows = to_rows(image).contiguous()

    @property
    def base_output(self) -> Any:
        """The model's output for the unoccluded input (batch axis 1)."""
        return self.engine.base_output

    def run(self, positions: np.ndarray, window: tuple[int, ...], baseline: Any = 0.0,
            channels: torch.Tensor | None = None, batch_size: int = 16, progress: bool = False,
            desc: str = "occlusion", reduce: Reduce | None = None) -> tuple[Any, RunStats]:
        """Model outputs with each window occluded.

        Args:
            positions: (N, d) first corners; windows reaching past the far edge are cropped.
            window: (d,) window size.
            baseline: what replaces the window: a scalar, a tensor broadcastable to the image, ``"mean_patch"``,
                ``"mean_img"``, ``"gaussian"``, a function of the window's values or an
                :class:`~incrinf.explain.occluders.Occluder`.
            channels: optional (N, C) bool mask of occluded channels per position (all when ``None``).
            batch_size: positions per packed batch.
            progress: show a progress bar.
            desc: progress bar label.
            reduce: applied to each batch's outputs as they come (e.g. the target's scores), so that large
                outputs (segmentation maps) are not kept for every position; must return a tensor with the
                batch axis first.

        Returns:
            ``(outputs, stats)``: outputs (reduced, if asked) with a leading dimension N, in the order of
            ``positions``.
        """
        dims = self.dims
        window = tuple(int(w) for w in window)
        positions = np.asarray(positions, dtype=np.int64).reshape(-1, len(dims))
        occluder = make_occluder(baseline, self.image, window)
        exact_prop = propagate(self.graph, input_boxes(positions, window, dims), self.tau, uniform=False)
        order = batch_order(self.graph, exact_prop)

        def batches() -> Iterator[_Batch]:
            for lo in range(0, len(positions), batch_size):
                queries = order[lo:lo + batch_size]
                chunk = positions[queries]
                boxes = input_boxes(chunk, window, dims)
                start = boxes.start()
                picked = None if channels is None else channels[torch.from_numpy(queries).to(channels.device)]
                mask = self._window_mask(chunk - start, window, boxes.size, picked)
                boxes.values = self._occlude(start, boxes.size, mask, occluder, chunk - start, window)
                yield _Batch(queries, boxes, (chunk, window))

        return self._run(batches(), len(positions), exact_prop, batch_size, progress, desc, reduce)

    def run_features(self, mask: torch.Tensor, baseline: Any = 0.0, batch_size: int = 16, progress: bool = False,
                     desc: str = "features", reduce: Reduce | None = None) -> tuple[np.ndarray, Any, RunStats]:
        """Model outputs with each feature of a mask occluded at once.

        A feature's update box is the bounding box of its elements; inside it the occluded values follow the
        mask (the baseline where the mask holds the feature, the image elsewhere).

        Args:
            mask: (C or 1, *spatial) integer feature ids (one per element; a channel axis of 1 applies to every
                channel).
            baseline: a scalar, a tensor broadcastable to the image, ``"mean_patch"`` (the mean over the feature's
                elements), ``"mean_img"`` or an :class:`~incrinf.explain.occluders.Occluder` that needs no window.
            batch_size: features per packed batch.
            progress: show a progress bar.
            desc: progress bar label.
            reduce: as for :meth:`run`.

        Returns:
            ``(features, outputs, stats)``: the sorted feature ids (F,), the outputs with a leading dimension F in
            that order, and the stats.
        """
        mask = mask.to(self.image.device)
        occluder = make_occluder(baseline, self.image, None)
        features, start, size = feature_boxes(mask)
        exact_prop = propagate(self.graph, Boxes(tuple(start.T), tuple(size.T)), self.tau, uniform=False)
        order = np.lexsort((*size.T[::-1], size.prod(axis=1)))  # similar boxes together: smallest first
        dims = np.asarray(self.dims)
        mask_rows = to_rows(mask[None]).contiguous()
        ids = torch.from_numpy(features).to(mask.device)

        def batches() -> Iterator[_Batch]:
            for lo in range(0, len(features), batch_size):
                queries = order[lo:lo + batch_size]
                extent = tuple(int(s) for s in size[queries].max(axis=0))
                corner = np.minimum(start[queries], dims - np.asarray(extent))
                index = torch.from_numpy(box_rows(corner, extent, self.dims)).to(mask.device)
                boxed = from_rows(mask_rows.index_select(0, index), len(queries), extent)
                occluded = boxed == ids[torch.from_numpy(queries).to(mask.device)].view(-1, *([1] * (boxed.dim() - 1)))
                values = self._occlude(corner, extent, occluded, occluder, None, None)
                yield _Batch(queries, Boxes(tuple(corner.T), extent, values), (corner, extent))

        outputs, stats = self._run(batches(), len(features), exact_prop, batch_size, progress, desc, reduce)
        return features, outputs, stats

    # --- the batch loop ----------------------------------------------------------------------------------

    def _run(self, batches: Iterator[_Batch], n: int, exact_prop: Propagation, batch_size: int, progress: bool,
             desc: str, reduce: Reduce | None) -> tuple[Any, RunStats]:
        stats = RunStats(positions=n, batch_size=batch_size, tau=self.tau)
        stats.flops_full = float(full_flops(self.graph))
        exact = incremental_flops(self.graph, exact_prop)
        stats.theoretical_speedup = stats.flops_full / max(float(exact.mean()), 1.0)
        outputs: list[Any] = []
        done: list[np.ndarray] = []
        realized = 0.0
        start = time.perf_counter()
        dev = self.image.device
        resident = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        reset_peak_device_memory(dev)
        bar = progress_bar(total=n, desc=desc, unit="pos", disable=not progress, leave=False)
        for batch in batches:
            corners, extent = batch.plan_key
            plan = batch_plan(self.graph, corners, extent, self.tau, dev)
            result = self.engine.run(batch.boxes, self.tau, self.feature_threshold, plan)
            outputs.append(result.output if reduce is None else _reduced(reduce, result.output, batch.boxes.n))
            done.append(batch.queries)
            realized += result.flops * batch.boxes.n
            stats.batches += 1
            stats.peak_memory_bytes = max(stats.peak_memory_bytes, result.peak_bytes)
            bar.update(batch.boxes.n)
        bar.close()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # kernels run asynchronously: time them, not their launches
        stats.seconds = time.perf_counter() - start
        peak = peak_device_memory(dev)
        if peak is not None:  # what the batches allocated on the device beyond the resident base tensors
            stats.peak_memory_bytes = peak - resident
            stats.extra["peak_device_memory_bytes"] = peak
        stats.realized_flop_ratio = stats.flops_full * n / max(realized, 1.0)
        inverse = torch.from_numpy(np.argsort(np.concatenate(done))).to(dev)
        return _concat(outputs, inverse), stats

    # --- occluded values -----------------------------------------------------------------------------------

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

    def _occlude(self, start: np.ndarray, size: tuple[int, ...], mask: torch.Tensor, occluder: Occluder,
                 offsets: np.ndarray | None, window: tuple[int, ...] | None) -> torch.Tensor:
        """(N, C, *size) values of each query's input box: the image with the masked elements occluded."""
        index = torch.from_numpy(box_rows(start, size, self.dims)).to(self.image.device)
        patch = from_rows(self.image_rows.index_select(0, index), len(start), size)
        return occluder.fill(patch, mask, start, offsets, window)


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
