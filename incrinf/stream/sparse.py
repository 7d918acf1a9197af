"""Sparse local operators for camera streams: recompute what changed, read the rest from a warped cache.

CacheInf (seeds/000): every tensor before the model's first global operator (the *local part*) depends only
on a neighbourhood of the image. For a new frame, the previous frame's tensors are read through the
frame-to-frame homography (an index map per feature resolution, shared by every tensor of that resolution; one
``index_select`` per cached tensor) and only the positions that the changed pixels reach are recomputed:

- **row steps** (1x1 stride-1 convolutions with the batch norm after them folded in, pointwise ops) run on the
  packed rows of the changed positions only (``F.linear`` for the convolutions);
- **window steps** (k x k convolutions and pools, strided ops) grow the changed set by their kernel, cut the
  output grid into ``T x T`` blocks, gather every active block's read-in window with one ``index_select``
  (index tables built once per node) and run with padding 0 on the batch of windows; when most blocks are
  active (40% of the map for depthwise convolutions and pools, which cost about one pass over their map,
  75% for the others) they run on the whole merged map instead;
- **merges** (residual adds, concatenations) work on the union of their inputs' changed sets, reading the
  positions an input did not change from its merged map;
- once half of a *cut point* (a cached tensor through which everything later flows) has changed, the rest would
  be recomputed nearly everywhere: it runs as one compiled module and its tensors become the new caches;
- the rest of the model (global pooling, classifier) runs as usual on the merged maps at the *cache point*.

A still camera (every index map the identity, the common case on a robot that stops or a fixed camera) takes the
**box path** instead (:mod:`incrinf.stream.boxes`): the change is one rectangle per tensor, each operator runs
densely on a crop of its merged input (slicing is free, no index tables, no gathers) and writes back with one
slice copy, rectangles rounded up to multiples of 4 so oneDNN reuses its per-shape kernels; operators on small
crops run on one intra-op thread (a second one costs more than it saves there). The cache then stands for the
current frame over the whole input rectangle, and when the feature threshold stops the change before the cache
point the previous output is returned without running the classifier. On carphone (default thresholds) it takes
about 80% of the time of the position path with about half its output error, since the rectangle refreshes more of
the cache than the changed cells.

Only the tensors read outside their own changed set are cached (inputs of window operators, merge inputs and
the cache point): the row steps between two window operators are fused onto the first one's output and need
no cache of their own (the seed's halo fusion); :meth:`SparseExecutor.cache_memory` reports the saving. Caches
are updated in place while the frame runs, since later layers read the merged maps.

Approximations, all measured (``benchmarks/stream.py``): cached values are moved by nearest-neighbour index
maps, exact only for shifts that are whole positions at every resolution (a per-resolution *drift* field
keeps the rounding from accumulating over frames, and positions misplaced by more than ``max_misalignment``
are recomputed); pixels under the change threshold are reused stale; an optional ``feature_threshold`` drops
recomputed positions whose new values differ from the cache by less than that fraction of the tensor's mean
magnitude, so changes that fade out stop spreading (CBinfer-style; the box path cuts its rectangle to the
positions above it). With identity motion, every changed pixel marked and ``feature_threshold=0`` the output
equals full inference to float tolerance.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import cv2
import numpy as np
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from incrinf.engine import unpadded_operator
from incrinf.graph import Graph, Node, NodeKind
from incrinf.kernels.gather import from_rows, to_rows
from incrinf.stream.boxes import EMPTY, Bounds, Box, bounding_box, grow_bounds, padded_crop, round_up, union
from incrinf.stream.matching import scale_homography

_INPLACE_FUNCTIONS = {operator.iadd, operator.imul, operator.isub, operator.itruediv}
# Above this share of a map's positions a window node runs densely on the whole map: block gathers stop
# paying for themselves, and downstream row operators skip their gathers too.
_DENSE_RATIO = 0.75
# The same for depthwise convolutions and pools, whose compute per position is too small to pay for much
# gathering (measured on EfficientNet-Lite0 streams: blocks win below about 40% of the map).
_CHEAP_DENSE_RATIO = 0.4
# When this share of a cut point's map (a tensor through which everything later flows) changed, the rest of
# the local part would be recomputed nearly everywhere: run it as compiled code instead (see _run_suffix).
_DENSE_CUT = 0.5
# Box-path operators on fewer output elements than this run on one intra-op thread: below it a second thread
# costs more than it saves (depthwise 3x3 and 1x1 convolutions measured on 2 cores: break-even near 50-100k).
_PARALLEL_ELEMENTS = 65536
# Every this many positions of a cached tensor estimate its mean magnitude (the feature threshold's unit).
_SCALE_STRIDE = 7


@dataclass(frozen=True)
class CacheMemory:
    """Bytes of cached tensors.

    Attributes:
        kept_bytes: what the executor keeps: tensors read outside their changed set.
        naive_bytes: caching every tensor of the local part (what a cache per layer would hold).
        kept_tensors: number of cached tensors.
        naive_tensors: number of tensors in the local part.
    """

    kept_bytes: int
    naive_bytes: int
    kept_tensors: int
    naive_tensors: int

    @property
    def saved_fraction(self) -> float:
        """Share of the naive cache memory not kept."""
        return 1.0 - self.kept_bytes / self.naive_bytes if self.naive_bytes else 0.0


@dataclass
class ExecStats:
    """What one frame computed.

    Attributes:
        flops: multiply-accumulates actually computed.
        full_flops: multiply-accumulates of one full inference.
        positions: recomputed positions summed over the local part's tensors.
        dense_nodes: window nodes that ran densely on the whole map.
        warped: cached tensors moved through an index map (the others were read in place).
    """

    flops: float
    full_flops: float
    positions: int = 0
    dense_nodes: int = 0
    warped: int = 0
    full_reason: str = ""  # set when the frame ran as full inference instead (and why)
    # (y0, y1, x0, x1) input pixels whose current values the cache now stands for (None: the changed mask only)
    refreshed: tuple[int, int, int, int] | None = None

    @property
    def flops_ratio(self) -> float:
        """Full FLOPs / computed FLOPs (``inf`` when the frame computed nothing: its output was reused)."""
        return self.full_flops / self.flops if self.flops >= 1.0 else math.inf


@dataclass
class _Window:
    """Static description of a window operator, in coordinates of the tensor it reads (PAD views resolved)."""

    source: str
    offset: tuple[int, int]  # source coord = out * stride + tap - offset
    view: tuple[int, int, int, int]  # extent of PAD views around the source: top, bottom, left, right
    view_value: float  # value of the PAD views' border
    pad_value: float  # value of the node's own padding, beyond the views
    taps: tuple[np.ndarray, np.ndarray]  # tap offsets per axis (dilation applied)
    stride: tuple[int, int]
    extent: tuple[int, int]  # effective kernel extent
    block: tuple[int, int]
    op: Callable[[torch.Tensor], torch.Tensor]
    bands: dict[str, np.ndarray] = field(default_factory=dict)  # side -> outputs whose window reads padding there
    own_after: tuple[int, int] = (0, 0)  # the node's own padding after the views (bottom, right)
    cheap: bool = False  # depthwise conv or pool: run on the whole map rather than on gathered blocks
    table: _BlockTable | None = None  # read-in windows of all blocks, built lazily


@dataclass
class _State:
    """Changed positions of one tensor in this frame and their new values.

    ``mask`` (h, w) bool and ``flat`` sorted flat positions; ``values`` is a ``(1, C, n, 1)`` row map, or
    the full ``(1, C, h, w)`` map when ``dense``. ``n == 0``: nothing changed (values is None).
    """

    mask: np.ndarray
    flat: np.ndarray
    values: torch.Tensor | None
    dense: bool = False
    _index: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return len(self.flat)

    def index(self, device: torch.device) -> torch.Tensor:
        if self._index is None:
            self._index = torch.from_numpy(self.flat).to(device)
        return self._index


@dataclass
class _Warp:
    """Index map of one resolution for this frame."""

    index: torch.Tensor | None  # (h*w,) source row of each position; None = identity (read in place)
    invalid: np.ndarray | None  # (h, w) bool, positions with no source in the previous map
    drift: np.ndarray  # (2, h, w) offset of each position's content after the warp (see _warp_maps)
    new_padding: tuple[str, ...] = ()  # sides whose padding held image content in the previous frame


@dataclass
class _Step:
    """One unit of per-frame work: a node (the head) and the pointwise nodes fused after it.

    Chains stop at cached tensors and at nodes with several users, so only ``out``'s values are ever
    needed; a batch norm right after a convolution is folded into the convolution's weights.
    """

    head: Node
    out: str  # node whose state the step produces
    inputs: list[str]  # the head's inputs in the local part
    chain: list[tuple[Node, str]] = field(default_factory=list)  # (node, its input) applied after the head
    window: _Window | None = None
    linear: tuple[torch.Tensor, torch.Tensor | None] | None = None  # 1x1 convolution as F.linear on rows
    flops: float = 0.0
    hw: tuple[int, int] = (0, 0)


@dataclass
class _Plan:
    """Which nodes form the local part, which are cached, and the per-frame steps."""

    local: list[Node]
    materialized: list[str]
    boundary: list[str]
    steps: list[_Step] = field(default_factory=list)


def _is_window(node: Node) -> bool:
    g = node.geometry
    return node.kind == NodeKind.LOCAL and (
        g.kernel != (1, 1) or g.stride != (1, 1) or g.pad_before != (0, 0) or g.pad_after != (0, 0))


def _is_inplace(fx_node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    if fx_node.op == "call_function":
        return fx_node.target in _INPLACE_FUNCTIONS or bool(fx_node.kwargs.get("inplace", False))
    if fx_node.op == "call_method":
        return str(fx_node.target).endswith("_")
    if fx_node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(fx_node.target)), "inplace", False))
    return False


def _block_size(h: int, w: int) -> tuple[int, int]:
    """Output block side: large blocks on large maps (few gathers), single positions on tiny ones."""
    side = min(h, w)
    t = 8 if side >= 32 else 4 if side >= 16 else 2 if side >= 8 else 1
    return t, t


class SparseExecutor:
    """Full inference that fills the cache, and cached inference of the next frames (CacheInf).

    Works on a private copy of the model (channels-last weights), so the caller's model is untouched.

    Args:
        graph: captured graph for the frame size (``incrinf.graph.capture``).
        device: device of the model and the frames.
        feature_threshold: drop recomputed positions whose values changed by at most this fraction of the
            tensor's mean magnitude (0: keep every recomputed position; with exact inputs and identity motion
            the result then equals full inference).
        max_misalignment: recompute cached positions whose content the nearest-neighbour warp misplaces by more
            than this (in positions of their map).
        block: override the output block size of window operators (default: by map size).
        moving_feature_threshold: ``feature_threshold`` for frames the camera moved in (default: the same).

    Attributes:
        dense_cut: share of a cut point's map above which the rest of the model runs as compiled code.
        boxes: take the box path on still-camera frames (False: the position path always; for comparisons).
        box_quantum: box sides are rounded up to multiples of this (1: exact boxes).
        step_threads: intra-op threads of box-path operators on small crops (None: leave torch's setting).
            ``torch.set_num_threads`` is process-wide: other threads running torch at the same moment
            also get this many for the few microseconds of such an operator.
        last: :class:`ExecStats` of the latest frame.

    Raises:
        ValueError: the model has no local operator before its first global one (nothing to reuse).
    """

    def __init__(self, graph: Graph, device: torch.device | str = "cpu", feature_threshold: float = 0.0,
                 max_misalignment: float = 0.5, block: int | None = None,
                 moving_feature_threshold: float | None = None) -> None:
        if moving_feature_threshold is None:
            moving_feature_threshold = feature_threshold
        for name, value in (("feature_threshold", feature_threshold),
                            ("moving_feature_threshold", moving_feature_threshold)):
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if not 0.0 <= max_misalignment <= 0.5:
            raise ValueError(f"max_misalignment must be in [0, 0.5] positions, got {max_misalignment}")
        self.max_misalignment = float(max_misalignment)
        self.graph = graph
        self.device = torch.device(device)
        self.feature_threshold = float(feature_threshold)
        self.moving_feature_threshold = float(moving_feature_threshold)
        self._frame_threshold = self.feature_threshold  # the one the current frame uses
        self.gm = copy.deepcopy(graph.module).to(self.device).to(memory_format=torch.channels_last).eval()
        self._fx = {n.name: n for n in self.gm.graph.nodes}
        self._modules = dict(self.gm.named_modules())
        example = torch.randn(graph.input_shape, device=self.device).contiguous(memory_format=torch.channels_last)
        env, mutated = _probe(self.gm, example)
        self._constants = {n.name: env[n.name] for n in graph.nodes if n.kind == NodeKind.CONSTANT}
        self._plan = _plan(graph, self.gm, env, block)
        if not any(n.kind == NodeKind.LOCAL for n in self._plan.local):
            first = next((n for n in graph.nodes if n.kind == NodeKind.GLOBAL), None)
            why = f" (its first global operator, {first.name}: {first.reason})" if first else ""
            raise ValueError(f"the model has no spatial (local) layer before its first global operator{why}; "
                             "there is nothing to reuse across frames")
        self._inplace = {n.name for n in self._plan.local if _is_inplace(self._fx[n.name], self.gm)}
        self._materialized = set(self._plan.materialized)
        self._clone = {name for name in self._plan.materialized if name in mutated}
        self._full_gm = _full_module(self.gm, self._plan.materialized, self._clone)
        self._tail_gm = _tail_module(self.gm, graph, self._plan)
        self._cuts = _cut_points(graph, self._plan)
        # built now, not on first use: generating and compiling one costs about a frame's inference
        self._suffixes = {cut: _suffix_module(self.gm, graph, self._plan, cut, self._clone) for cut in self._cuts}
        self.dense_cut = _DENSE_CUT
        self.boxes = True
        self.box_quantum = 4
        self.step_threads: int | None = 1
        self._last_out: Any = None
        self._shapes = {n.name: n.shape for n in graph.nodes}
        self._resolutions = sorted({tuple(self._shapes[m][-2:]) for m in self._plan.materialized
                                    if m != graph.input.name} | {tuple(graph.input_shape[-2:])})
        self._input_hw = tuple(graph.input_shape[-2:])
        self._grids = {r: np.mgrid[0:r[0], 0:r[1]].astype(np.float64) for r in self._resolutions}
        self._arange = {r: np.arange(r[0] * r[1]) for r in self._resolutions}
        self._full_flops = float(sum(n.flops for n in graph.nodes))
        self._local_names = {n.name for n in self._plan.local}
        self._tail_flops = float(sum(n.flops for n in graph.nodes if n.name not in self._local_names))
        self._suffix_flops = {cut: float(sum(graph.by_name[n].flops for n in _suffix_nodes(graph, self._plan, cut)
                                             if n in self._local_names)) for cut in self._cuts}  # tail excluded
        self._live = _live_inputs(self._plan, graph.input.name)
        users = _users(graph)
        # boundary tensors whose values (not just sizes) the rest of the model reads
        self._read_boundary = [name for name in self._plan.boundary if any(
            u.name not in self._local_names and u.kind != NodeKind.META for u in users[name])]
        self._chains: dict[str, list[Callable[[torch.Tensor], Any]]] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._scales: dict[str, float] = {}
        self._drift: dict[tuple[int, int], np.ndarray] = {}
        self._first_hw = self._plan.steps[0].hw if self._plan.steps else None  # the first cached map's size
        self._warp_memo: tuple[tuple[bytes, tuple[int, int]], dict[tuple[int, int], _Warp]] | None = None
        self.last = ExecStats(0.0, self._full_flops)

    # --- introspection -----------------------------------------------------------------------------------

    @property
    def cache_point(self) -> list[str]:
        """Names of the local-part tensors the rest of the model reads (full merged maps each frame)."""
        return list(self._plan.boundary)

    @property
    def has_cache(self) -> bool:
        return bool(self._buffers)

    def cache_memory(self) -> CacheMemory:
        """Bytes kept by this executor's cache versus caching every tensor of the local part."""
        def nbytes(name: str) -> int:
            shape = self._shapes[name]
            return math.prod(shape) * 4 if shape else 0

        tensors = [n.name for n in self._plan.local
                   if n.kind not in (NodeKind.INPUT, NodeKind.PAD) and n.shape and len(n.shape) == 4]
        kept = [m for m in self._plan.materialized if m != self.graph.input.name]
        return CacheMemory(sum(nbytes(m) for m in kept), sum(nbytes(t) for t in tensors), len(kept), len(tensors))

    def reset(self) -> None:
        """Drop the cache (the next frame must go through :meth:`full`)."""
        self._buffers = {}
        self._drift = {}
        self._warp_memo = None

    # --- full inference ----------------------------------------------------------------------------------

    @torch.no_grad()
    def full(self, x: torch.Tensor) -> Any:
        """Full inference of ``x`` (1, C, H, W) that also refills the cache."""
        self.reset()
        x = x.to(self.device).contiguous(memory_format=torch.channels_last)
        out, tensors = self._full_gm(x)
        buffers = {}
        storages = set()
        for name, t in zip(self._plan.materialized, tensors):
            if name != self.graph.input.name:
                rows = to_rows(t)
                ptr = rows.untyped_storage().data_ptr()
                # caches are updated in place: two of them must not share memory
                buffers[name] = rows.clone() if ptr in storages else rows
                storages.add(ptr)
        if self.feature_threshold > 0 or self.moving_feature_threshold > 0:
            # a strided sample of positions estimates the mean magnitude well at a fraction of a full pass
            self._scales = {name: float(rows[::_SCALE_STRIDE].abs().mean()) for name, rows in buffers.items()}
        self._buffers = buffers
        self._drift = {r: np.zeros((2, *r)) for r in self._resolutions if r != self._input_hw}
        n_windows = sum(step.window is not None for step in self._plan.steps)
        self.last = ExecStats(self._full_flops, self._full_flops, dense_nodes=n_windows)
        self._last_out = _clone_output(out)  # callers own what they get; a dead change returns a copy of it
        return out

    # --- cached inference --------------------------------------------------------------------------------

    @torch.no_grad()
    def cached(self, x: torch.Tensor, changed: np.ndarray, matrix: np.ndarray) -> Any:
        """Inference of a frame from the cache: recompute the positions the changed pixels reach.

        Args:
            x: (1, C, H, W) the frame as the model sees it.
            changed: (H, W) bool, pixels to recompute (e.g. ``ChangeMask.pixel_mask``).
            matrix: (3, 3) homography previous -> current frame, in pixel coords of ``x``.

        Returns:
            The model's output for ``x``.

        Raises:
            RuntimeError: no cache (call :meth:`full` first).
        """
        if not self._buffers:
            raise RuntimeError("no cache: run full() on a frame first")
        try:
            return self._cached(x, changed, matrix)
        except BaseException:
            self.reset()  # caches may be half updated in place: the next frame must refill them
            raise

    def unusable_fraction(self, matrix: np.ndarray) -> float:
        """Share of the first cached map that the motion ``matrix`` (3, 3, previous -> current, input pixel
        coords) leaves without a usable source; above ``dense_cut`` :meth:`cached` runs full inference, so a
        caller can skip preparing the change mask."""
        return _unusable_fraction(self._frame_warps(matrix, self._input_hw), self._first_hw)

    def _frame_warps(self, matrix: np.ndarray, image_hw: tuple[int, int]) -> dict[tuple[int, int], _Warp]:
        """:meth:`_warp_maps` of this frame's motion, computed once when :meth:`unusable_fraction` asked first
        (the maps depend on the drift, which changes only when a frame ends: the memo is dropped then)."""
        matrix = np.asarray(matrix, dtype=np.float64)
        key = (matrix.tobytes(), image_hw)
        if self._warp_memo is None or self._warp_memo[0] != key:
            self._warp_memo = (key, self._warp_maps(matrix, image_hw, self._first_hw))
        return self._warp_memo[1]

    def _cached(self, x: torch.Tensor, changed: np.ndarray, matrix: np.ndarray) -> Any:
        x = x.to(self.device).contiguous(memory_format=torch.channels_last)
        image_hw = tuple(x.shape[-2:])
        changed = np.asarray(changed, dtype=bool)
        if changed.shape != image_hw:
            raise ValueError(f"change mask has shape {changed.shape}, frame is {image_hw}")
        warps = self._frame_warps(matrix, image_hw)
        self._warp_memo = None
        unusable = _unusable_fraction(warps, self._first_hw)
        if unusable > self.dense_cut:
            # the motion leaves most of the first cached map without a usable source: everything after it
            # would be recomputed, and full inference does that with less bookkeeping
            out = self.full(x)
            self.last.full_reason = f"{unusable:.0%} of the cache misaligned by the motion"
            return out
        buffers = dict(self._buffers)
        stats = ExecStats(self._tail_flops, self._full_flops)
        fresh: dict[tuple[int, int], np.ndarray] = {}
        still = all(w.index is None and w.invalid is None and not w.new_padding for w in warps.values())
        self._frame_threshold = self.feature_threshold if still else self.moving_feature_threshold
        if self.boxes and still:
            bounds = bounding_box(changed)
            out = self._propagate_box(x, bounds, buffers, fresh, stats)
            stats.refreshed = bounds
        else:
            out = self._propagate_positions(x, changed, warps, buffers, fresh, stats)
        if out is None:
            inputs = []
            for name in self._plan.boundary:
                if name == self.graph.input.name:
                    inputs.append(x)
                else:
                    shape = self._shapes[name]
                    inputs.append(from_rows(buffers[name], 1, shape[-2], shape[-1]))
            out = self._tail_gm(*inputs)
        self._buffers = buffers
        for res, warp in warps.items():
            if res == self._input_hw:
                continue
            drift = warp.drift
            if res in fresh:
                drift[:, fresh[res]] = 0.0
            self._drift[res] = drift
        self.last = stats
        self._last_out = _clone_output(out)  # callers own what they get; a dead change returns a copy of it
        return out

    def _propagate_positions(self, x: torch.Tensor, changed: np.ndarray, warps: dict[tuple[int, int], _Warp],
                             buffers: dict[str, torch.Tensor], fresh: dict[tuple[int, int], np.ndarray],
                             stats: ExecStats) -> Any:
        """Carry the changed positions through the local part, updating ``buffers`` in place; the output when
        a cut point ran the rest of the model, else None (the caller runs the tail)."""
        warped: set[str] = set()
        states: dict[str, _State] = {}
        frame_rows = to_rows(x)
        input_name = self.graph.input.name
        changed_flat = np.flatnonzero(changed)
        state = _State(changed, changed_flat, None, dense=len(changed_flat) == changed.size)
        if state.dense:
            state.values = x
        elif state.n:
            state.values = from_rows(frame_rows.index_select(0, state.index(self.device)), 1, state.n, 1)
        states[input_name] = state
        out = None
        for step in self._plan.steps:
            if step.window is not None:
                state = self._window(step, states, buffers, warps, frame_rows, input_name, stats)
            else:
                state = self._rows(step, states, buffers, stats)
            stats.positions += state.n
            if step.out in self._materialized:
                state = self._commit(step.out, state, buffers, warps, warped)
                done = np.ones(step.hw, bool) if state.dense else state.mask
                fresh[step.hw] = done if step.hw not in fresh else fresh[step.hw] & done
            states[step.out] = state
            if step.out in self._cuts and (state.dense or state.n >= self.dense_cut * step.hw[0] * step.hw[1]):
                out = self._run_suffix(step.out, x, buffers, fresh, stats)
                break
        stats.warped = len(warped)
        return out

    def _propagate_box(self, x: torch.Tensor, bounds: Bounds, buffers: dict[str, torch.Tensor],
                       fresh: dict[tuple[int, int], np.ndarray], stats: ExecStats) -> Any:
        """:meth:`_propagate_positions` for a still camera: one changed rectangle per tensor
        (:mod:`incrinf.stream.boxes`), every operator run densely on a crop of its merged input."""
        input_name = self.graph.input.name
        y0, y1, x0, x1 = bounds
        boxes = {input_name: Box(bounds, x[:, :, y0:y1, x0:x1])}
        drifting = any(d.any() for d in self._drift.values())
        for step, live in zip(self._plan.steps, self._live):
            if all(boxes[name].empty for name in live):
                break  # the change has died out (feature threshold): every later tensor keeps its cache
            hw = step.hw[0] * step.hw[1]
            box = self._box_window(step, boxes, buffers, x) if step.window is not None else \
                self._box_rows(step, boxes, buffers)
            stats.positions += box.area
            stats.flops += step.flops * box.area / hw
            if step.out in self._materialized:
                box = self._box_commit(step.out, box, buffers)
                if drifting:  # recomputed positions lose their drift (see _warp_maps)
                    done = box.mask(step.hw)
                    fresh[step.hw] = done if step.hw not in fresh else fresh[step.hw] & done
            boxes[step.out] = box
            if step.out in self._cuts and box.area >= self.dense_cut * hw:
                return self._run_suffix(step.out, x, buffers, fresh, stats)
        if self._last_out is not None and all(boxes.get(name, Box(EMPTY)).empty for name in self._read_boundary):
            stats.flops -= self._tail_flops  # nothing the classifier reads changed: neither does its output
            return _clone_output(self._last_out)
        return None

    def _box_window(self, step: _Step, boxes: dict[str, Box], buffers: dict[str, torch.Tensor],
                    x: torch.Tensor) -> Box:
        win = step.window
        src = boxes[win.source]
        if src.empty:
            return Box(EMPTY)
        bounds = round_up(grow_bounds(src.bounds, win, step.hw), step.hw, self.box_quantum)
        if bounds == EMPTY:
            return Box(EMPTY)
        if win.source == self.graph.input.name:
            source = x
        else:
            hs, ws = self._shapes[win.source][-2:]
            source = from_rows(buffers[win.source], 1, hs, ws)
        with self._threads_for(bounds, step.out):
            return Box(bounds, self._run_chain(step, win.op(padded_crop(source, bounds, win))))

    def _box_rows(self, step: _Step, boxes: dict[str, Box], buffers: dict[str, torch.Tensor]) -> Box:
        spatial = step.inputs
        ins = [boxes[s] for s in spatial]
        bounds = ins[0].bounds if len(ins) == 1 else union([b.bounds for b in ins])
        if bounds == EMPTY:
            return Box(EMPTY)
        y0, y1, x0, x1 = bounds
        values = {}
        for name, box in zip(spatial, ins):
            if box.bounds == bounds:
                values[name] = box.values
            else:  # merge inputs are cached: read the rest of the union from the merged map
                shape = self._shapes[name]
                values[name] = from_rows(buffers[name], 1, shape[-2], shape[-1])[:, :, y0:y1, x0:x1]
        with self._threads_for(bounds, step.out):
            if step.linear is not None:
                result = from_rows(F.linear(to_rows(values[spatial[0]]), *step.linear), 1, y1 - y0, x1 - x0)
            else:
                first = spatial[0]
                if step.head.name in self._inplace and first in buffers and \
                        values[first].untyped_storage().data_ptr() == buffers[first].untyped_storage().data_ptr():
                    values[first] = values[first].clone()
                result = self._invoke(step.head, values)
            return Box(bounds, self._run_chain(step, result))

    def _threads_for(self, bounds: Bounds, name: str) -> contextlib.AbstractContextManager:
        """One intra-op thread for an operator on a small box (sharing it costs more than it saves)."""
        y0, y1, x0, x1 = bounds
        small = (y1 - y0) * (x1 - x0) * self._shapes[name][1] < _PARALLEL_ELEMENTS
        return _threads(self.step_threads if small else None)

    def _box_commit(self, name: str, box: Box, buffers: dict[str, torch.Tensor]) -> Box:
        """Write a box's values into its cache (in place); with a feature threshold, first cut the box to the
        positions that moved by more than it."""
        if box.empty:
            return box
        h, w = self._shapes[name][-2:]
        y0, y1, x0, x1 = box.bounds
        target = from_rows(buffers[name], 1, h, w)[:, :, y0:y1, x0:x1]
        eps = self._frame_threshold * self._scales.get(name, 0.0)
        if eps > 0:
            a, b, c, d = bounding_box((torch.sub(box.values, target).abs_().mean(dim=1)[0] > eps).numpy())
            if a >= b:
                return Box(EMPTY)
            if (a, b, c, d) != (0, y1 - y0, 0, x1 - x0):
                box = Box((y0 + a, y0 + b, x0 + c, x0 + d), box.values[:, :, a:b, c:d])
                target = target[:, :, a:b, c:d]
        target.copy_(box.values)
        return box

    def _run_suffix(self, cut: str, x: torch.Tensor, buffers: dict[str, torch.Tensor],
                    fresh: dict[tuple[int, int], np.ndarray], stats: ExecStats) -> Any:
        """Most of ``cut`` changed, and so will everything after it: finish the frame with the compiled rest
        of the model (no per-step bookkeeping) and take its tensors as the new caches."""
        module, names = self._suffixes[cut]
        shape = self._shapes[cut]
        out, tensors = module(x, from_rows(buffers[cut], 1, shape[-2], shape[-1]))
        for name, t in zip(names, tensors):
            buffers[name] = to_rows(t)
            res = tuple(self._shapes[name][-2:])
            fresh[res] = np.ones(res, bool)
        stats.flops += self._suffix_flops[cut]
        stats.dense_nodes += 1
        return out

    def _rows(self, step: _Step, states: dict[str, _State], buffers: dict[str, torch.Tensor],
              stats: ExecStats) -> _State:
        """A pointwise op, 1x1 conv or merge (and its chain) on the union of its inputs' changed positions."""
        spatial = step.inputs
        ins = [states[s] for s in spatial]
        if len(ins) == 1:
            out = ins[0]
            if out.n == 0:
                return out
            values = {spatial[0]: out.values}
        else:
            if all(s.n == 0 for s in ins):
                return ins[0]
            mask = np.logical_or.reduce([s.mask for s in ins])
            dense = any(s.dense for s in ins) or mask.mean() > _DENSE_RATIO
            if dense:
                out = _State(np.ones_like(mask), np.arange(mask.size), None, dense=True)
            else:
                out = _State(mask, np.flatnonzero(mask), None)
            values = {}
            for name, s in zip(spatial, ins):
                if s.n == out.n:  # same set (the union of nested sets is the larger one)
                    values[name] = s.values
                elif dense:
                    shape = self._shapes[name]
                    values[name] = from_rows(buffers[name], 1, shape[-2], shape[-1])
                else:
                    values[name] = from_rows(buffers[name].index_select(0, out.index(self.device)), 1, out.n, 1)
        stats.flops += step.flops * (1.0 if out.dense else out.n / (step.hw[0] * step.hw[1]))
        if step.linear is not None:
            rows = F.linear(to_rows(values[spatial[0]]), *step.linear)
            result = from_rows(rows, 1, *(step.hw if out.dense else (out.n, 1)))
        else:
            if step.head.name in self._inplace:
                first = spatial[0]
                if first in buffers and values[first].untyped_storage().data_ptr() == \
                        buffers[first].untyped_storage().data_ptr():
                    values[first] = values[first].clone()
            result = self._invoke(step.head, values)
        return _State(out.mask, out.flat, self._run_chain(step, result), out.dense, out._index)

    def _run_chain(self, step: _Step, values: torch.Tensor) -> torch.Tensor:
        fns = self._chains.get(step.out)
        if fns is None:
            fns = self._chains[step.out] = [self._unary(node, source) for node, source in step.chain]
        for fn in fns:
            values = fn(values)
        return values

    def _unary(self, node: Node, source: str) -> Callable[[torch.Tensor], Any]:
        """``node`` as a function of its one local input, its other arguments bound once (a chain runs about a
        hundred small calls per frame: resolving arguments through ``torch.fx`` each time costs as much as
        the operators themselves)."""
        fx_node = self._fx[node.name]
        if fx_node.kwargs or not fx_node.args or any(isinstance(a, torch.fx.Node) for a in fx_node.args[1:]) \
                or not isinstance(fx_node.args[0], torch.fx.Node) or fx_node.args[0].name != source:
            return lambda v: self._invoke(node, {source: v})
        rest = tuple(fx_node.args[1:])
        if fx_node.op == "call_module":
            fn = self._modules[str(fx_node.target)]
        elif fx_node.op == "call_function":
            fn = fx_node.target
        else:
            method = str(fx_node.target)
            return lambda v: getattr(v, method)(*rest)
        return (lambda v: fn(v, *rest)) if rest else fn

    def _window(self, step: _Step, states: dict[str, _State], buffers: dict[str, torch.Tensor],
                warps: dict[tuple[int, int], _Warp], frame_rows: torch.Tensor, input_name: str,
                stats: ExecStats) -> _State:
        """A k x k / strided operator (and its chain) on blocks of its output around the changed positions."""
        win = step.window
        src = states[win.source]
        ho, wo = step.hw
        hs, ws = self._shapes[win.source][-2:]
        warp = warps.get((ho, wo))
        if src.dense:
            mask = np.ones((ho, wo), bool)
        else:
            mask = _grow(src.mask, win, (ho, wo)) if src.n else np.zeros((ho, wo), bool)
            if warp is not None and warp.invalid is not None:
                mask |= warp.invalid
            # positions whose windows read padding where the previous frame still had content saw that
            # content then: their cached values are stale although no pixel of this frame changed
            for side in warps[(hs, ws)].new_padding if (hs, ws) in warps else ():
                band = win.bands.get(side)
                if band is not None:
                    mask |= band
        if not mask.any():
            return _State(mask, np.zeros(0, np.int64), None)
        rows = frame_rows if win.source == input_name else buffers[win.source]
        th, tw = win.block
        gh, gw = -(-ho // th), -(-wo // tw)
        padded = np.zeros((gh * th, gw * tw), bool)
        padded[:ho, :wo] = mask
        active = padded.reshape(gh, th, gw, tw).any(axis=(1, 3))
        n_blocks = int(active.sum())
        # a depthwise conv or pool costs about one pass over its map: gathering blocks pays only when few are
        # active
        ratio = _CHEAP_DENSE_RATIO if win.cheap else _DENSE_RATIO
        dense = n_blocks * th * tw >= ratio * ho * wo
        if dense:
            out = win.op(_padded_map(win, rows, hs, ws))
            stats.flops += step.flops
            stats.dense_nodes += 1
            if mask.mean() > _DENSE_RATIO:
                return _State(np.ones((ho, wo), bool), np.arange(ho * wo), self._run_chain(step, out), dense=True)
            state = _State(mask, np.flatnonzero(mask), None)
            values = from_rows(to_rows(out).index_select(0, state.index(self.device)), 1, state.n, 1)
            state.values = self._run_chain(step, values)
            return state
        if win.table is None:
            win.table = _block_table(win, (gh, gw), (hs, ws), self.device)
        ids = np.flatnonzero(active)
        index = win.table.index.index_select(0, torch.from_numpy(ids).to(self.device)).view(-1)
        pad = None
        if win.table.border[ids].any():
            codes = win.table.codes[ids].reshape(-1)
            pad = [(torch.from_numpy(np.flatnonzero(codes == code)).to(self.device), value)
                   for code, value in ((1, win.view_value), (2, win.pad_value)) if (codes == code).any()]
        out = self._run_windows(win, rows, index, pad, n_blocks, (th, tw))
        stats.flops += step.flops * n_blocks * th * tw / (ho * wo)
        rank = np.full(gh * gw, -1, np.int64)
        rank[ids] = np.arange(n_blocks)
        flat = np.flatnonzero(mask)
        y, x = np.divmod(flat, wo)
        select = rank[(y // th) * gw + x // tw] * (th * tw) + (y % th) * tw + (x % tw)
        state = _State(mask, flat, None)
        values = from_rows(to_rows(out).index_select(0, torch.from_numpy(select).to(self.device)), 1, state.n, 1)
        state.values = self._run_chain(step, values)
        return state

    def _run_windows(self, win: _Window, rows: torch.Tensor, index: torch.Tensor, pad: tuple | None, n: int,
                     out_hw: tuple[int, int]) -> torch.Tensor:
        hr = (out_hw[0] - 1) * win.stride[0] + win.extent[0]
        wr = (out_hw[1] - 1) * win.stride[1] + win.extent[1]
        gathered = rows.index_select(0, index)
        if pad is not None:
            for rows_on_padding, value in pad:
                gathered.index_fill_(0, rows_on_padding, value)
        return win.op(from_rows(gathered, n, hr, wr))

    def _commit(self, name: str, state: _State, buffers: dict[str, torch.Tensor],
                warps: dict[tuple[int, int], _Warp], warped: set[str]) -> _State:
        """Merge a cached tensor's new values into its (warped) cache."""
        if state.dense:
            rows = to_rows(state.values)
            buffers[name] = rows.clone() if name in self._clone else rows
            return state
        shape = self._shapes[name]
        warp = warps.get(tuple(shape[-2:]))
        if warp is not None and warp.index is not None:
            buffers[name] = buffers[name].index_select(0, warp.index)
            warped.add(name)
        if not state.n:
            return state
        rows = to_rows(state.values)
        index = state.index(self.device)
        eps = self._frame_threshold * self._scales.get(name, 0.0)
        if eps > 0:
            delta = (rows - buffers[name].index_select(0, index)).abs().mean(dim=1)
            keep = (delta > eps).cpu().numpy()
            if not keep.all():
                kept = np.flatnonzero(keep)
                mask = np.zeros_like(state.mask)
                flat = state.flat[kept]
                mask.reshape(-1)[flat] = True
                rows = rows.index_select(0, torch.from_numpy(kept).to(self.device))
                state = _State(mask, flat, from_rows(rows, 1, len(flat), 1) if len(flat) else None)
                if not state.n:
                    return state
                index = state.index(self.device)
        buffers[name].index_copy_(0, index, rows)
        return state

    def _invoke(self, node: Node, values: dict[str, Any]) -> Any:
        fx_node = self._fx[node.name]

        def value(a: torch.fx.Node) -> Any:
            return values[a.name] if a.name in values else self._constants[a.name]

        args = torch.fx.node.map_arg(fx_node.args, value)
        kwargs = torch.fx.node.map_arg(fx_node.kwargs, value)
        if fx_node.op == "call_module":
            return self._modules[str(fx_node.target)](*args, **kwargs)
        if fx_node.op == "call_function":
            return fx_node.target(*args, **kwargs)
        return getattr(args[0], str(fx_node.target))(*args[1:], **kwargs)

    # --- warping -----------------------------------------------------------------------------------------

    def _warp_maps(self, matrix: np.ndarray, image_hw: tuple[int, int], first: tuple[int, int] | None = None
                   ) -> dict[tuple[int, int], _Warp]:
        """Per cached resolution, where each current position reads the previous map (``first`` first: when
        the motion leaves most of that map without a source, only it is returned, since the frame then runs
        as full inference).

        Nearest-neighbour reads round every frame; to keep that rounding from adding up over frames (a 3 px
        pan is 0.09 of a stride-32 position: rounded to 0 every frame, the deep cache would never move), each
        resolution keeps a *drift* field: the offset between where a position's cached content belongs and
        where it sits. The read position compensates for it and the field is updated with the new rounding
        error; recomputed positions have none.
        """
        still = np.allclose(matrix, np.eye(3), rtol=0.0, atol=1e-12)
        warps: dict[tuple[int, int], _Warp] = {}
        for res in sorted(self._resolutions, key=lambda r: r != first):
            if warps.get(first) is not None and warps[first].invalid is not None \
                    and warps[first].invalid.mean() > self.dense_cut:
                break
            h, w = res
            drift = self._drift.get(res)
            cached = res != self._input_hw
            if still and (not cached or drift is None or np.abs(drift).max() < 0.5):
                # a still camera: every map is read in place and keeps its drift
                warps[res] = _Warp(None, None, drift if drift is not None else np.zeros((2, h, w)))
                continue
            m = scale_homography(matrix, image_hw, res)
            inv = np.linalg.inv(m)
            sides = _new_padding(inv, h, w)
            if not cached:  # the frame itself is never cached: only its padding matters
                warps[res] = _Warp(None, None, np.zeros((2, h, w)), sides)
                continue
            ys, xs = self._grids[res]
            hw_ = inv[2, 0] * xs + inv[2, 1] * ys + inv[2, 2]
            with np.errstate(divide="ignore", invalid="ignore"):
                hw_ = np.where(hw_ > 0, hw_, np.nan)
                sx = (inv[0, 0] * xs + inv[0, 1] * ys + inv[0, 2]) / hw_
                sy = (inv[1, 0] * xs + inv[1, 1] * ys + inv[1, 2]) / hw_
                valid = (sx >= -0.5) & (sx < w - 0.5) & (sy >= -0.5) & (sy < h - 0.5)
            all_valid = bool(valid.all())
            if not all_valid:
                sx = np.where(valid, sx, np.clip(np.nan_to_num(sx), 0, w - 1))
                sy = np.where(valid, sy, np.clip(np.nan_to_num(sy), 0, h - 1))
            if drift is None:
                drift = np.zeros((2, h, w))
            qy0 = np.clip(np.floor(sy + 0.5), 0, h - 1).astype(np.int64)
            qx0 = np.clip(np.floor(sx + 0.5), 0, w - 1).astype(np.int64)
            qy = np.clip(np.floor(sy - drift[0][qy0, qx0] + 0.5), 0, h - 1).astype(np.int64)
            qx = np.clip(np.floor(sx - drift[1][qy0, qx0] + 0.5), 0, w - 1).astype(np.int64)
            index = (qy * w + qx).reshape(-1)
            identity = all_valid and bool((index == self._arange[res]).all())
            # where the content read from q belongs in the current frame, minus where it is put
            ly, lx = qy + drift[0][qy, qx], qx + drift[1][qy, qx]
            pw = m[2, 0] * lx + m[2, 1] * ly + m[2, 2]
            new_drift = np.stack([(m[1, 0] * lx + m[1, 1] * ly + m[1, 2]) / pw - ys,
                                  (m[0, 0] * lx + m[0, 1] * ly + m[0, 2]) / pw - xs])
            if self.max_misalignment < 0.5:
                # cached content further than this from where it belongs is recomputed, not reused
                off = (np.abs(new_drift) > self.max_misalignment).any(axis=0)
                if off.any():
                    valid = valid & ~off
                    all_valid = False
            if not all_valid:
                new_drift[:, ~valid] = 0.0
            warps[res] = _Warp(None if identity else torch.from_numpy(index).to(self.device),
                               None if all_valid else ~valid, new_drift, sides)
        return warps


def _new_padding(inv: np.ndarray, h: int, w: int) -> tuple[str, ...]:
    """Sides of an (h, w) map whose zero padding lies inside the previous map (``inv``: current -> previous
    coords): positions reading that padding saw image content in the previous frame."""
    def source(xs: np.ndarray, ys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        hw_ = inv[2, 0] * xs + inv[2, 1] * ys + inv[2, 2]
        with np.errstate(divide="ignore", invalid="ignore"):
            return ((inv[0, 0] * xs + inv[0, 1] * ys + inv[0, 2]) / hw_,
                    (inv[1, 0] * xs + inv[1, 1] * ys + inv[1, 2]) / hw_)

    cols, rows = np.arange(w, dtype=np.float64), np.arange(h, dtype=np.float64)
    sides = []
    with np.errstate(invalid="ignore"):
        if (source(cols, np.zeros(w))[1] >= 0.5).any():
            sides.append("top")
        if (source(cols, np.full(w, h - 1.0))[1] < h - 1.5).any():
            sides.append("bottom")
        if (source(np.zeros(h), rows)[0] >= 0.5).any():
            sides.append("left")
        if (source(np.full(h, w - 1.0), rows)[0] < w - 1.5).any():
            sides.append("right")
    return tuple(sides)


# --- window geometry -------------------------------------------------------------------------------------


def _grow(mask: np.ndarray, win: _Window, out_hw: tuple[int, int]) -> np.ndarray:
    """Output positions whose window reads any True position of the source ``mask``."""
    if len(win.taps[0]) == win.extent[0] and len(win.taps[1]) == win.extent[1]:
        return _grow_dense_taps(mask, win, out_hw)
    out = mask
    for axis in (0, 1):
        n_out = out_hw[axis]
        stride, taps, offset = win.stride[axis], win.taps[axis], win.offset[axis]
        size = out.shape[axis]
        need = (n_out - 1) * stride + int(taps[-1]) + 1
        padded_shape = list(out.shape)
        padded_shape[axis] = need
        padded = np.zeros(padded_shape, bool)
        # source coord s sits at padded coord s + offset
        lo, hi = max(0, -offset), min(size, need - offset)
        if hi > lo:
            dst = [slice(None), slice(None)]
            src = [slice(None), slice(None)]
            dst[axis] = slice(lo + offset, hi + offset)
            src[axis] = slice(lo, hi)
            padded[tuple(dst)] = out[tuple(src)]
        grown = np.zeros([n_out if a == axis else padded_shape[a] for a in (0, 1)], bool)
        for t in taps:
            sl = [slice(None), slice(None)]
            sl[axis] = slice(int(t), int(t) + (n_out - 1) * stride + 1, stride)
            grown |= padded[tuple(sl)]
        out = grown
    return out


def _padded_map(win: _Window, rows: torch.Tensor, hs: int, ws: int) -> torch.Tensor:
    """The source map (rows (hs*ws, C)) as (1, C, H, W) with the PAD views' and the node's own padding."""
    x = from_rows(rows, 1, hs, ws)
    top, bottom, left, right = win.view
    if top or bottom or left or right:
        x = F.pad(x, (left, right, top, bottom), value=win.view_value)
    # the node's own padding sits outside the views: offset = own + view before; after = what the windows need
    own_top, own_left = win.offset[0] - top, win.offset[1] - left
    own_bottom, own_right = win.own_after
    if own_top or own_left or own_bottom or own_right:
        x = F.pad(x, (own_left, own_right, own_top, own_bottom), value=win.pad_value)
    return x


def _grow_dense_taps(mask: np.ndarray, win: _Window, out_hw: tuple[int, int]) -> np.ndarray:
    """:func:`_grow` for undilated kernels: one forward-looking dilation (OpenCV), then the strided samples."""
    (ho, wo), (kh, kw), (sy, sx), (oy, ox) = out_hw, win.extent, win.stride, win.offset
    need_h, need_w = (ho - 1) * sy + kh, (wo - 1) * sx + kw
    padded = np.zeros((need_h, need_w), np.uint8)
    hs, ws = mask.shape
    # source coord s sits at padded coord s + offset
    y_lo, y_hi = max(0, -oy), min(hs, need_h - oy)
    x_lo, x_hi = max(0, -ox), min(ws, need_w - ox)
    if y_hi > y_lo and x_hi > x_lo:
        padded[y_lo + oy:y_hi + oy, x_lo + ox:x_hi + ox] = mask[y_lo:y_hi, x_lo:x_hi]
    grown = cv2.dilate(padded, np.ones((kh, kw), np.uint8), anchor=(0, 0), borderType=cv2.BORDER_CONSTANT,
                       borderValue=0)
    return grown[: (ho - 1) * sy + 1: sy, : (wo - 1) * sx + 1: sx].astype(bool)


@dataclass
class _BlockTable:
    """Read-in windows of every output block of a window node, built once: a frame only picks rows.

    Attributes:
        index: (blocks, hr*wr) source row of each window element (0 on padding).
        codes: (blocks, hr*wr) int8, 0 inside the source, 1 on a PAD view's border, 2 on the node's padding.
        border: (blocks,) bool, whether the block's window touches any padding.
    """

    index: torch.Tensor
    codes: np.ndarray
    border: np.ndarray


def _block_table(win: _Window, grid: tuple[int, int], source_hw: tuple[int, int],
                 device: torch.device) -> _BlockTable:
    gh, gw = grid
    by, bx = np.divmod(np.arange(gh * gw), gw)
    th, tw = win.block
    hs, ws = source_hw
    hr = (th - 1) * win.stride[0] + win.extent[0]
    wr = (tw - 1) * win.stride[1] + win.extent[1]
    sy = (by * th * win.stride[0] - win.offset[0])[:, None, None] + np.arange(hr)[None, :, None]
    sx = (bx * tw * win.stride[1] - win.offset[1])[:, None, None] + np.arange(wr)[None, None, :]
    sy, sx = np.broadcast_arrays(sy, sx)
    inside = (sy >= 0) & (sy < hs) & (sx >= 0) & (sx < ws)
    top, bottom, left, right = win.view
    in_view = (sy >= -top) & (sy < hs + bottom) & (sx >= -left) & (sx < ws + right)
    codes = np.where(inside, 0, np.where(in_view, 1, 2)).astype(np.int8).reshape(gh * gw, -1)
    index = np.where(inside, sy * ws + sx, 0).reshape(gh * gw, -1)
    return _BlockTable(torch.from_numpy(index).to(device), codes, (codes != 0).any(axis=1))


# --- planning --------------------------------------------------------------------------------------------


def _probe(gm: torch.fx.GraphModule, x: torch.Tensor) -> tuple[dict[str, Any], set[str]]:
    """Every node's value for ``x``, and the nodes whose tensor a later in-place op overwrites."""
    env: dict[str, Any] = {}
    snapshots: dict[str, torch.Tensor] = {}

    class _Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            env[n.name] = out
            if isinstance(out, torch.Tensor) and out.dim() == 4:
                snapshots[n.name] = out.clone()
            return out

    with torch.no_grad():
        _Recorder(gm).run(x)
    mutated = {name for name, snap in snapshots.items() if not torch.equal(env[name], snap)}
    return env, mutated


def _users(graph: Graph) -> dict[str, list[Node]]:
    users: dict[str, list[Node]] = {n.name: [] for n in graph.nodes}
    for n in graph.nodes:
        for name in n.inputs:
            users[name].append(n)
    return users


def _spatial_constants(node: Node, graph: Graph) -> bool:
    """Whether a constant input has a spatial extent (it would not broadcast over packed rows)."""
    for name in node.inputs:
        src = graph.by_name[name]
        if src.kind == NodeKind.CONSTANT and src.shape is not None and len(src.shape) >= 3 \
                and tuple(src.shape[-2:]) != (1, 1):
            return True
    return False


def _plan(graph: Graph, gm: torch.fx.GraphModule, env: dict[str, Any], block: int | None) -> _Plan:
    users = _users(graph)
    ops: dict[str, Callable] = {}
    candidate: set[str] = set()
    for node in graph.nodes:
        four_d = node.shape is not None and len(node.shape) == 4
        if node.kind == NodeKind.INPUT:
            candidate.add(node.name)
        elif node.kind == NodeKind.LOCAL and four_d:
            op = unpadded_operator(gm, node, env) if _is_window(node) else None
            if op is not None or not _is_window(node):
                candidate.add(node.name)
                if op is not None:
                    ops[node.name] = op
        elif node.kind in (NodeKind.POINTWISE, NodeKind.MERGE, NodeKind.PAD) and four_d \
                and not _spatial_constants(node, graph):
            candidate.add(node.name)
    local = set(candidate)
    changed = True
    while changed:  # drop nodes until every member's inputs are members and PAD views feed windows only
        changed = False
        for node in graph.nodes:
            if node.name not in local or node.kind == NodeKind.INPUT:
                continue
            ok = all(name in local or graph.by_name[name].kind == NodeKind.CONSTANT for name in node.inputs)
            if ok and node.kind == NodeKind.PAD:
                ok = all(u.name in local and u.kind == NodeKind.LOCAL and _is_window(u) for u in users[node.name])
            if not ok:
                local.discard(node.name)
                changed = True
    ordered = [n for n in graph.nodes if n.name in local]
    windows: dict[str, _Window] = {}
    materialized: list[str] = []

    def need(name: str) -> None:
        if name not in materialized:
            materialized.append(name)

    for node in ordered:
        if node.kind == NodeKind.LOCAL and _is_window(node):
            windows[node.name] = _describe_window(node, graph, ops[node.name], block)
            need(windows[node.name].source)
        elif node.kind == NodeKind.MERGE:
            for name in node.inputs:
                if name in local:
                    need(name)
    boundary = [n.name for n in ordered
                if any(u.name not in local for u in users[n.name]) and n.kind != NodeKind.PAD]
    for name in boundary:
        need(name)
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    materialized.sort(key=order.__getitem__)
    steps = _steps(graph, gm, env, ordered, set(materialized) | set(boundary), windows, users)
    return _Plan(ordered, materialized, boundary, steps)


def _steps(graph: Graph, gm: torch.fx.GraphModule, env: dict[str, Any], ordered: list[Node], keep: set[str],
           windows: dict[str, _Window], users: dict[str, list[Node]]) -> list[_Step]:
    """Group the local part into steps: each compute node plus the single-user pointwise chain after it."""
    local = {n.name for n in ordered}
    absorbed: set[str] = set()
    steps = []
    for node in ordered:
        if node.kind in (NodeKind.INPUT, NodeKind.PAD) or node.name in absorbed:
            continue
        conv = _conv_params(gm, node, env) if node.kind == NodeKind.LOCAL else None
        folded = None
        chain: list[tuple[Node, str]] = []
        flops = node.flops
        last = node
        while last.name not in keep and len(users[last.name]) == 1:
            user = users[last.name][0]
            if user.name not in local or user.kind != NodeKind.POINTWISE \
                    or [i for i in user.inputs if i in local] != [last.name]:
                break
            bn = _batch_norm(gm, user) if conv is not None and folded is None and not chain else None
            if bn is not None:
                folded = _fold(conv, bn)
            else:
                chain.append((user, last.name))
            absorbed.add(user.name)
            flops += user.flops
            last = user
        params = folded or conv
        step = _Step(node, last.name, [i for i in node.inputs if i in local], chain, flops=float(flops),
                     hw=tuple(node.shape[-2:]))
        if node.name in windows:
            window = windows[node.name]
            if folded is not None:
                weight, bias, stride, dilation, groups = folded
                window.op = functools.partial(_conv_unpadded, weight=weight, bias=bias, stride=stride,
                                              dilation=dilation, groups=groups)
            step.window = window
        elif params is not None and params[4] == 1 and params[0].shape[-2:] == (1, 1):
            weight, bias = params[0], params[1]
            step.linear = (weight.reshape(weight.shape[0], -1).contiguous(), bias)
        steps.append(step)
    return steps


def _unusable_fraction(warps: dict[tuple[int, int], _Warp], res: tuple[int, int] | None) -> float:
    invalid = warps[res].invalid if res in warps else None
    return float(invalid.mean()) if invalid is not None else 0.0


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """At most ``n`` intra-op threads inside the block (None: unchanged)."""
    before = torch.get_num_threads()
    if n is None or n >= before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _live_inputs(plan: _Plan, input_name: str) -> list[list[str]]:
    """Per step, the tensors made before it (the frame included) that it or a later step reads."""
    reads = [[step.window.source] if step.window is not None else list(step.inputs) for step in plan.steps]
    made = [input_name] + [step.out for step in plan.steps]
    live = []
    for i in range(len(plan.steps)):
        later = {name for r in reads[i:] for name in r}
        live.append([name for name in made[: i + 1] if name in later])
    return live


def _clone_output(out: Any) -> Any:
    """A copy of a model output (tensors cloned, containers rebuilt), so callers never share one."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (list, tuple)):
        return type(out)(_clone_output(o) for o in out)
    if isinstance(out, dict):
        return {k: _clone_output(v) for k, v in out.items()}
    return out


def _conv_unpadded(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Any, dilation: Any,
                   groups: int) -> torch.Tensor:
    return F.conv2d(x, weight, bias, stride, 0, dilation, groups)


def _conv_params(gm: torch.fx.GraphModule, node: Node, env: dict[str, Any]) -> tuple | None:
    """``(weight, bias, stride, dilation, groups)`` of a zero-padded 2-D convolution node, else None."""
    fx_node = node.fx_node
    if fx_node.op == "call_module":
        mod = gm.get_submodule(str(fx_node.target))
        if type(mod) is not nn.Conv2d or mod.padding_mode != "zeros":
            return None
        return mod.weight, mod.bias, mod.stride, mod.dilation, mod.groups
    if fx_node.op == "call_function" and fx_node.target in (F.conv2d, torch.conv2d):
        args, kwargs = fx_node.args, fx_node.kwargs

        def arg(i: int, name: str, default: Any = None) -> Any:
            value = args[i] if len(args) > i else kwargs.get(name, default)
            return env[value.name] if isinstance(value, torch.fx.Node) else value

        weight = arg(1, "weight")
        if not isinstance(weight, torch.Tensor) or isinstance(arg(4, "padding", 0), str):
            return None
        return weight, arg(2, "bias"), arg(3, "stride", 1), arg(5, "dilation", 1), int(arg(6, "groups", 1))
    return None


def _batch_norm(gm: torch.fx.GraphModule, node: Node) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(scale, shift)`` of an eval-mode BatchNorm2d module node (``y = x * scale + shift``), else None."""
    fx_node = node.fx_node
    if fx_node.op != "call_module":
        return None
    mod = gm.get_submodule(str(fx_node.target))
    if type(mod) is not nn.BatchNorm2d or mod.training or mod.running_mean is None:
        return None
    scale = torch.rsqrt(mod.running_var + mod.eps)
    if mod.weight is not None:
        scale = scale * mod.weight
    shift = -mod.running_mean * scale
    if mod.bias is not None:
        shift = shift + mod.bias
    return scale.detach(), shift.detach()


def _fold(conv: tuple, bn: tuple[torch.Tensor, torch.Tensor]) -> tuple:
    """A convolution followed by a batch norm as one convolution."""
    weight, bias, stride, dilation, groups = conv
    scale, shift = bn
    folded_weight = (weight * scale.view(-1, 1, 1, 1)).detach()
    if weight.dim() == 4:
        folded_weight = folded_weight.contiguous(memory_format=torch.channels_last)
    folded_bias = shift if bias is None else bias.detach() * scale + shift
    return folded_weight, folded_bias.contiguous(), stride, dilation, groups


def _describe_window(node: Node, graph: Graph, op: Callable, block: int | None) -> _Window:
    g = node.geometry
    source = node.inputs[0]
    view = [0, 0, 0, 0]  # top, bottom, left, right
    view_value = 0.0
    while graph.by_name[source].kind == NodeKind.PAD:
        pad = graph.by_name[source]
        in_shape = graph.by_name[pad.inputs[0]].shape
        top, left = pad.shift
        bottom = pad.shape[-2] - in_shape[-2] - top
        right = pad.shape[-1] - in_shape[-1] - left
        view = [view[0] + top, view[1] + bottom, view[2] + left, view[3] + right]
        view_value = _pad_value(pad)
        source = pad.inputs[0]
    ho, wo = node.shape[-2:]
    hs, ws = graph.by_name[source].shape[-2:]
    taps = tuple(np.arange(0, g.kernel[a], g.dilation[a]) for a in (0, 1))
    size = (block, block) if block else _block_size(ho, wo)
    size = (min(size[0], ho), min(size[1], wo))
    offset = (g.pad_before[0] + view[0], g.pad_before[1] + view[2])
    first_y = np.arange(ho) * g.stride[0] - offset[0]  # first source row each output reads
    first_x = np.arange(wo) * g.stride[1] - offset[1]
    last_y, last_x = first_y + g.kernel[0] - 1, first_x + g.kernel[1] - 1
    bands = {}
    for side, rows, cols in (("top", first_y < 0, None), ("bottom", last_y >= hs, None),
                             ("left", None, first_x < 0), ("right", None, last_x >= ws)):
        band = np.zeros((ho, wo), bool)
        if rows is not None:
            band[rows, :] = True
        else:
            band[:, cols] = True
        if band.any():
            bands[side] = band
    return _Window(
        source=source,
        offset=offset,
        view=(view[0], view[1], view[2], view[3]),
        view_value=view_value,
        pad_value=g.pad_value,
        taps=taps,
        stride=g.stride,
        extent=g.kernel,
        block=size,
        op=op,
        bands=bands,
        own_after=(g.pad_after[0], g.pad_after[1]),
        cheap=_is_cheap(node, graph),
    )


def _is_cheap(node: Node, graph: Graph) -> bool:
    """Pools and depthwise convolutions: about one multiply-add per input element and tap."""
    fx_node = node.fx_node
    if "pool" in node.op.lower():
        return True
    in_channels = graph.by_name[node.inputs[0]].shape[1]
    if fx_node.op == "call_module":
        groups = getattr(fx_node.graph.owning_module.get_submodule(str(fx_node.target)), "groups", 1)
    else:
        groups = fx_node.args[6] if len(fx_node.args) > 6 else fx_node.kwargs.get("groups", 1)
    return isinstance(groups, int) and groups == in_channels and groups > 1


def _pad_value(pad: Node) -> float:
    fx_node = pad.fx_node
    if fx_node.op == "call_module":
        mod = fx_node.graph.owning_module.get_submodule(str(fx_node.target))
        return float(getattr(mod, "value", 0.0))
    value = fx_node.kwargs.get("value", fx_node.args[3] if len(fx_node.args) > 3 else 0.0)
    return float(value or 0.0)


def _full_module(gm: torch.fx.GraphModule, materialized: list[str], clone: set[str]) -> torch.fx.GraphModule:
    """``gm`` returning ``(output, (materialized tensors...))``; tensors a later in-place op overwrites are
    cloned right after they are produced."""
    graph = torch.fx.Graph()
    val_map: dict[torch.fx.Node, torch.fx.Node] = {}
    out = graph.graph_copy(gm.graph, val_map)
    by_name = {n.name: n for n in gm.graph.nodes}
    extras = []
    for name in materialized:
        value = val_map[by_name[name]]
        if name in clone:
            with graph.inserting_after(value):
                value = graph.call_method("clone", (value,))
        extras.append(value)
    graph.output((out, tuple(extras)))
    return torch.fx.GraphModule(gm, graph)


def _cut_points(graph: Graph, plan: _Plan) -> set[str]:
    """Cached tensors of the local part through which all later computation flows (besides the frame)."""
    users = _users(graph)
    local = [n.name for n in plan.local]
    position = {name: i for i, name in enumerate(local)}
    last_use = {}
    for name in local:
        uses = [position.get(u.name, len(local)) for u in users[name]]
        last_use[name] = max(uses) if uses else -1
    cuts = set()
    materialized = set(plan.materialized)
    input_name = graph.input.name
    for i, name in enumerate(local):
        if name not in materialized or name == input_name:
            continue
        live = [n for n in local[:i] if last_use[n] > i and n != input_name]
        if not live:
            cuts.add(name)
    return cuts


def _suffix_nodes(graph: Graph, plan: _Plan, cut: str) -> list[str]:
    """Nodes computed after ``cut``: every node but the local part up to it (the frame is an input)."""
    local = [n.name for n in plan.local]
    done = set(local[: local.index(cut) + 1])
    return [n.name for n in graph.nodes if n.name not in done and n.kind != NodeKind.INPUT]


def _suffix_module(gm: torch.fx.GraphModule, graph: Graph, plan: _Plan, cut: str, clone: set[str]
                   ) -> tuple[torch.fx.GraphModule, list[str]]:
    """``(frame, cut tensor) -> (output, (cached tensors after the cut...))`` as one compiled module."""
    keep = set(_suffix_nodes(graph, plan, cut))
    later = [m for m in plan.materialized if m in keep]
    suffix = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for fx_node in gm.graph.nodes:
        if fx_node.op == "placeholder":
            env[fx_node.name] = suffix.placeholder(fx_node.name)
            env[cut] = suffix.placeholder(cut)
        elif fx_node.name in keep:
            if fx_node.op == "output":
                extras = []
                for name in later:
                    value = env[name]
                    if name in clone:
                        with suffix.inserting_after(value):
                            value = suffix.call_method("clone", (value,))
                    extras.append(value)
                suffix.output((torch.fx.node.map_arg(fx_node.args[0], lambda a: env[a.name]), tuple(extras)))
            else:
                env[fx_node.name] = suffix.node_copy(fx_node, lambda a: env[a.name])
    module = torch.fx.GraphModule(gm, suffix)
    module.graph.eliminate_dead_code()
    module.recompile()
    return module, later


def _tail_module(gm: torch.fx.GraphModule, graph: Graph, plan: _Plan) -> torch.fx.GraphModule:
    """The nodes after the cache point as a module taking the boundary tensors."""
    local = {n.name for n in plan.local}
    tail = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for name in plan.boundary:
        env[name] = tail.placeholder(name)
    for fx_node in gm.graph.nodes:
        if fx_node.name in local or fx_node.op == "placeholder":
            continue
        env[fx_node.name] = tail.node_copy(fx_node, lambda a: env[a.name])
    module = torch.fx.GraphModule(gm, tail)
    module.graph.eliminate_dead_code()
    module.recompile()
    return module

