"""Run many occluded copies of one image through the engine, in batches (shared by every OBE front end)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
from tqdm.auto import tqdm

from incrinf.engine import BatchEngine, Boxes, batch_plan
from incrinf.engine.windows import box_rows
from incrinf.geometry import Propagation, Region, RegionKind, full_flops, incremental_flops, input_region, propagate
from incrinf.graph import Graph, captured_graph
from incrinf.kernels.dispatch import free_device_memory, peak_device_memory, reset_peak_device_memory
from incrinf.kernels.gather import from_rows, to_rows

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


def estimate_batch_size(graph: Graph, window: tuple[int, int], max_memory: int, tau: float,
                        cap: int = CPU_BATCH_CAP, device: torch.device | str | None = None) -> int:
    """Positions per batch so that the working tensors stay under ``max_memory`` bytes (and, on a CUDA
    ``device``, under a share of its free memory, with the GPU cap)."""
    free = free_device_memory(device)
    if free is not None:
        max_memory = min(max_memory, int(GPU_MEMORY_SHARE * free))
        cap = GPU_BATCH_CAP
    dims = graph.input_shape[2:]
    centre = np.array([[(n - w) // 2 for n, w in zip(dims, window)]])
    prop = propagate(graph, input_region(centre, window, dims), tau=tau, uniform=True)
    largest = 0
    for node in graph.nodes:
        region = prop.regions[node.name]
        if node.shape is None or region.kind == RegionKind.NONE:
            continue
        step = prop.steps.get(node.name)
        if region.kind == RegionKind.FULL:
            elems = int(np.prod(node.shape[1:]))
        else:
            elems = int(np.prod(node.shape[1:-len(dims)])) * int(region.area()[0]) if graph.is_map(node.shape) else 0
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
    return np.lexsort(deepest.size.T[::-1])


class OcclusionRunner:
    """Outputs of a model for many occlusions of one image, by batched incremental inference.

    Args:
        model: a ``torch.fx``-traceable model (eval mode is set).
        image: (1, C, *spatial) float tensor.
        tau: projective field threshold (1 = exact).
        prune: value-based pruning threshold (0 = exact): a recomputed position whose values moved by at most
            this share of the tensor's mean magnitude stops spreading.
    """

    def __init__(self, model: nn.Module | Graph, image: torch.Tensor, tau: float = 1.0, prune: float = 0.0) -> None:
        self.graph = model if isinstance(model, Graph) else captured_graph(model, image.shape[1:])
        self.image = image
        self.tau = tau
        self.prune = prune
        self.engine = BatchEngine(self.graph, image)
        self.image_rows = to_rows(image).contiguous()

    @property
    def base_output(self) -> torch.Tensor:
        return self.engine.base_output

    def run(self, positions: np.ndarray, window: tuple[int, int], baseline: torch.Tensor | float = 0.0,
            channels: torch.Tensor | None = None, batch_size: int = 16, progress: bool = False,
            desc: str = "occlusion") -> tuple[torch.Tensor, RunStats]:
        """Model outputs with each window replaced by the baseline.

        Args:
            positions: (N, d) first corners; windows reaching past the far edge are cropped.
            window: (d,) window size.
            baseline: scalar or a tensor broadcastable to the image: the occluding values.
            channels: optional (N, C) bool mask of occluded channels per position (all when ``None``).
            batch_size: positions per packed batch.
            progress: show a progress bar.
            desc: progress bar label.

        Returns:
            ``(outputs, stats)``: outputs with a leading dimension N.
        """
        dims = self.graph.input_shape[2:]
        positions = np.asarray(positions, dtype=np.int64).reshape(-1, len(dims))
        n = len(positions)
        stats = RunStats(positions=n, batch_size=batch_size, tau=self.tau)
        stats.flops_full = float(full_flops(self.graph))
        exact_prop = propagate(self.graph, input_region(positions, window, dims), self.tau, uniform=False)
        exact = incremental_flops(self.graph, exact_prop)
        stats.theoretical_speedup = stats.flops_full / max(float(exact.mean()), 1.0)
        order = batch_order(self.graph, exact_prop)
        positions = positions[order]
        if channels is not None:
            channels = channels[torch.from_numpy(order).to(channels.device)]
        baseline_rows = self._baseline_rows(baseline)
        outputs: list[torch.Tensor] = []
        realized = 0.0
        start = time.perf_counter()
        dev = self.image.device
        resident = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        reset_peak_device_memory(dev)
        bar = tqdm(total=n, desc=desc, unit="pos", disable=not progress, leave=False)
        for lo in range(0, n, batch_size):
            chunk = positions[lo:lo + batch_size]
            region = input_region(chunk, window, dims)
            values = self._occluded_region(chunk, window, region, baseline_rows,
                                           None if channels is None else channels[lo:lo + batch_size])
            boxes = Boxes(tuple(region.start.T), tuple(int(s) for s in region.size[0]), values)
            plan = batch_plan(self.graph, chunk, window, self.tau, dev)
            result = self.engine.run(boxes, self.tau, self.prune, plan)
            outputs.append(result.output)
            realized += result.flops * len(chunk)
            stats.batches += 1
            stats.peak_memory_bytes = max(stats.peak_memory_bytes, result.peak_bytes)
            bar.update(len(chunk))
        bar.close()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # kernels run asynchronously: time them, not their launches
        stats.seconds = time.perf_counter() - start
        peak = peak_device_memory(dev)
        if peak is not None:  # what the batches allocated on the device beyond the resident base tensors
            stats.peak_memory_bytes = peak - resident
            stats.extra["peak_device_memory_bytes"] = peak
        stats.realized_flop_ratio = stats.flops_full * n / max(realized, 1.0)
        inverse = torch.from_numpy(np.argsort(order)).to(dev)
        return torch.cat(outputs, 0).index_select(0, inverse), stats

    def _baseline_rows(self, baseline: torch.Tensor | float) -> torch.Tensor | float:
        if isinstance(baseline, torch.Tensor) and baseline.numel() > 1:
            full = torch.broadcast_to(baseline.to(self.image), self.image.shape)
            return to_rows(full).contiguous()
        return float(baseline)

    def _occluded_region(self, chunk: np.ndarray, window: tuple[int, ...], region: Region, baseline_rows,
                         channels: torch.Tensor | None) -> torch.Tensor:
        """(N, C, *size) values of each position's input box: the image with its window occluded."""
        n, d = chunk.shape
        size = tuple(int(s) for s in region.size[0])
        dims = self.graph.input_shape[2:]
        dev = self.image.device
        index = torch.from_numpy(box_rows(region.start, size, dims)).to(dev)
        patch = from_rows(self.image_rows.index_select(0, index), n, size)
        if isinstance(baseline_rows, torch.Tensor):
            fill = from_rows(baseline_rows.index_select(0, index), n, size)
        else:
            fill = torch.full_like(patch, baseline_rows)
        mask = torch.ones(n, 1, *size, dtype=torch.bool, device=dev)
        for a in range(d):
            offset = torch.from_numpy(chunk[:, a] - region.start[:, a]).to(dev).view(n, *([1] * (d + 1)))
            shape = [1] * (d + 2)
            shape[2 + a] = size[a]
            k = torch.arange(size[a], device=dev).view(shape)
            mask = mask & (k >= offset) & (k < offset + window[a])
        if channels is not None:
            mask = mask & channels.to(dev).view(n, -1, *([1] * d))
        return torch.where(mask, fill, patch)
