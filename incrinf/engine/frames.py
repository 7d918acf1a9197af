"""The engine for a sequence of inputs that change locally (camera frames): full inference that fills a frame
cache, then incremental inference of the next inputs from it.

A frame's change arrives as a pixel mask plus, when the camera moved, per-resolution index maps
(:class:`~incrinf.engine.blocks.Motion`, computed by the stream from the homography). Without motion the change
is one box: the box walk with N = 1 (:func:`~incrinf.engine.boxes.walk`), every step run densely on a crop of
its merged input, box sides rounded to multiples of 4 so oneDNN reuses its per-shape kernels. With motion the
change is a set of positions: the block walk (:func:`~incrinf.engine.blocks.walk_blocks`). The engine knows
nothing about cameras or homographies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from incrinf.engine.blocks import Motion, Positions, walk_blocks
from incrinf.engine.boxes import walk
from incrinf.engine.program import Program
from incrinf.engine.stores import FrameCache, clone_output
from incrinf.geometry import Boxes
from incrinf.graph import Graph, NodeKind
from incrinf.graph.execute import copy_graph, materialize

# When this share of a cut point's map changed, the rest of the local part would be recomputed nearly everywhere:
# run it as one generated module instead.
DENSE_CUT = 0.5


@dataclass(frozen=True)
class CacheMemory:
    """Bytes of cached tensors.

    Attributes:
        kept_bytes: what the engine keeps: tensors read outside their own step.
        naive_bytes: caching every tensor of the local part (what a cache per layer would hold).
        kept_tensors: number of cached tensors.
        naive_tensors: number of tensors in the local part.
    """

    kept_bytes: int
    naive_bytes: int
    kept_tensors: int
    naive_tensors: int


@dataclass
class ExecStats:
    """What one frame computed.

    Attributes:
        flops: multiply-accumulates actually computed.
        full_flops: multiply-accumulates of one full inference.
        positions: recomputed positions summed over the steps.
        dense_steps: steps that ran on the whole map (block walk), or a generated suffix (both walks).
        moved: cached tensors moved through an index map.
        refreshed: (y0, y1, x0, x1) input pixels whose current values the cache now stands for (box walk), else
            None (the changed pixels only).
        fresh: resolution -> (h, w) bool positions recomputed this frame (set when asked for).
    """

    flops: float
    full_flops: float
    positions: int = 0
    dense_steps: int = 0
    moved: int = 0
    refreshed: tuple[int, ...] | None = None
    fresh: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)

    @property
    def flops_ratio(self) -> float:
        """Full FLOPs / computed FLOPs (``inf`` when the frame computed nothing: its output was reused)."""
        return self.full_flops / self.flops if self.flops >= 1.0 else math.inf


class FrameEngine:
    """Full inference that fills a frame cache, and incremental inference of the next frames.

    Works on a private copy of the model (weights channels-last, batch norms folded), so the caller's model is
    untouched.

    Args:
        graph: captured graph for the frame size.
        device: device of the model and the frames.

    Attributes:
        dense_cut: share of a cut point's map above which the rest of the model runs as generated code.
        boxes: take the box walk when the camera did not move (False: the block walk always; for comparisons).
        box_quantum: box sides are rounded up to multiples of this (1: exact boxes).
        resolutions: the spatial extents of the input and of every cached tensor.
        cached_resolutions: those of the cached tensors (the frame itself is never moved).
        last: :class:`ExecStats` of the latest frame.

    Raises:
        ValueError: the model has no sliding window before its first global operator (nothing to reuse).
    """

    def __init__(self, graph: Graph, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        graph = copy_graph(graph, self.device)
        example = torch.randn(graph.input_shape, device=self.device).contiguous(memory_format=torch.channels_last)
        env, mutated = materialize(graph, example, track_mutation=True)
        self.program = Program(graph, env, mutated)
        if not self.program.has_local_part:
            first = next((n for n in graph.nodes if n.kind == NodeKind.GLOBAL), None)
            why = f" (its first global operator, {first.name}: {first.reason})" if first else ""
            raise ValueError(f"the model has no spatial (local) layer before its first global operator{why}; "
                             "there is nothing to reuse across frames")
        self.graph = graph
        self.cache = FrameCache(self.program, self.device)
        self.program.prepare(with_cached=True)  # generating a module costs about a frame's inference
        self.dense_cut = DENSE_CUT
        self.boxes = True
        self.box_quantum = 4
        self.cached_resolutions = {tuple(graph.by_name[m].shape[-2:]) for m in self.program.cached}
        self.resolutions = sorted(self.cached_resolutions | {tuple(graph.input_shape[-2:])})
        first = next((s for s in self.program.steps if s.window is not None), None)
        self.first_resolution = first.dims if first is not None else None
        self.last = ExecStats(0.0, self.program.full_flops)

    @property
    def has_cache(self) -> bool:
        return bool(self.cache.buffers)

    def reset(self) -> None:
        """Drop the cache (the next frame must go through :meth:`full`)."""
        self.cache.buffers = {}

    def cache_memory(self) -> CacheMemory:
        """Bytes kept by the cache versus caching every tensor of the local part."""
        graph = self.graph
        tensors = [n.name for n in self.program.local
                   if n.kind not in (NodeKind.INPUT, NodeKind.PAD, NodeKind.META) and graph.is_map(n.shape)]
        kept = self.program.cached
        return CacheMemory(sum(graph.nbytes(m) for m in kept), sum(graph.nbytes(t) for t in tensors), len(kept),
                           len(tensors))

    @torch.no_grad()
    def full(self, x: torch.Tensor, scales: bool = True) -> Any:
        """Full inference of ``x`` (1, C, H, W) that also refills the cache (``scales`` is kept for callers: the
        cached tensors' mean magnitudes, the pruning threshold's unit, are now estimated on first use)."""
        self.reset()
        x = x.to(self.device).contiguous(memory_format=torch.channels_last)
        out, tensors = self.program.full(x)
        self.cache.frame = x
        self.cache.fill(dict(zip(self.program.cached, tensors)), scales)
        self.last = ExecStats(self.program.full_flops, self.program.full_flops,
                              dense_steps=sum(s.window is not None for s in self.program.steps))
        self.cache.last_output = clone_output(out)  # callers own what they get; a dead change returns a copy
        return out

    @torch.no_grad()
    def cached(self, x: torch.Tensor, changed: np.ndarray, motion: Motion | None = None, feature_threshold: float = 0.0,
               fresh: bool = False) -> Any:
        """Inference of a frame from the cache: recompute what the changed pixels (and the motion) reach.

        Args:
            x: (1, C, H, W) the frame as the model sees it.
            changed: (H, W) bool, pixels to recompute.
            motion: how the camera moved (None: it did not).
            feature_threshold: value-based pruning at cached tensors (0: exact propagation).
            fresh: record in ``last.fresh`` which positions of each resolution were recomputed.

        Returns:
            The model's output for ``x``.

        Raises:
            RuntimeError: no cache (call :meth:`full` first).
            ValueError: a change mask of another size than the frame.
        """
        if not self.has_cache:
            raise RuntimeError("no cache: run full() on a frame first")
        x = x.to(self.device).contiguous(memory_format=torch.channels_last)
        changed = np.asarray(changed, dtype=bool)
        if changed.shape != tuple(x.shape[-2:]):
            raise ValueError(f"change mask has shape {changed.shape}, frame is {tuple(x.shape[-2:])}")
        self.cache.frame = x
        try:
            if motion is None and self.boxes:
                out, stats = self._boxes(x, changed, feature_threshold, fresh)
            else:
                out, stats = self._blocks(changed, motion or Motion(), feature_threshold, fresh)
        except BaseException:
            self.reset()  # caches may be half updated in place: the next frame must refill them
            raise
        self.last = stats
        self.cache.last_output = clone_output(out)
        return out

    def _boxes(self, x: torch.Tensor, changed: np.ndarray, feature_threshold: float, fresh: bool
               ) -> tuple[Any, ExecStats]:
        bounds = _bounding_box(changed)
        stats = ExecStats(0.0, self.program.full_flops, refreshed=bounds or None)
        if not bounds:
            return self.cache.unchanged(1), stats
        y0, y1, x0, x1 = bounds
        start = Boxes((y0, x0), (y1 - y0, x1 - x0), x[:, :, y0:y1, x0:x1])
        result = walk(self.program, self.cache, start, feature_threshold=feature_threshold, quantum=self.box_quantum,
                      dense_cut=self.dense_cut)
        stats.flops, stats.positions = result.flops, result.positions
        stats.dense_steps = int(result.suffix is not None)
        if fresh:
            regions = {name: region.bounds for name, region in result.committed.items()}
            self._mark_fresh(stats, regions, result.suffix)
        return result.output, stats

    def _blocks(self, changed: np.ndarray, motion: Motion, feature_threshold: float, fresh: bool
                ) -> tuple[Any, ExecStats]:
        result = walk_blocks(self.program, self.cache, changed, motion, feature_threshold, self.dense_cut)
        stats = ExecStats(result.flops, self.program.full_flops, result.positions, result.dense_steps, result.moved)
        if fresh:
            self._mark_fresh(stats, result.changed, result.suffix)
        return result.output, stats

    def _mark_fresh(self, stats: ExecStats, changed: dict[str, tuple[int, ...] | Positions], suffix: str | None
                    ) -> None:
        """Per resolution, the positions that every cached tensor of it recomputed this frame (``changed``:
        bounds or positions per tensor; absent: none; after the ``suffix`` cut point: all)."""
        after = set(self.program.cached_after(suffix)) if suffix is not None else set()
        for name in self.program.cached:
            dims = tuple(self.graph.by_name[name].shape[-2:])
            where = changed.get(name)
            if name in after or (isinstance(where, Positions) and where.dense):
                done = np.ones(dims, bool)
            elif isinstance(where, Positions):
                done = where.mask
            else:
                done = np.zeros(dims, bool)
                if where:
                    done[where[0]:where[1], where[2]:where[3]] = True
            stats.fresh[dims] = done if dims not in stats.fresh else stats.fresh[dims] & done


def _bounding_box(mask: np.ndarray) -> tuple[int, ...]:
    """``(y0, y1, x0, x1)`` of the True entries of an (h, w) mask (empty when there are none)."""
    rows = np.flatnonzero(mask.any(axis=1))
    if not len(rows):
        return ()
    cols = np.flatnonzero(mask.any(axis=0))
    return int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
