"""Where a run's unchanged values come from.

- :class:`BaseStore`: one input's materialized tensors, immutable, standing for N virtual copies (occlusion:
  N occluded copies of one image). Windows are gathered from the base and the incoming boxes overlaid, one
  index operation each (a Triton kernel on CUDA); plans of index tensors are kept per batch.
- :class:`FrameCache`: a camera's cached tensors (one frame), updated in place as a frame runs: a window reads a
  crop of its merged source (a view), a cached tensor's new values are committed into it, and cached tensors
  can be moved through per-resolution index maps (the stream computes them from the homography).

Both offer value-based pruning at commit: positions whose new values differ from the old by at most
``feature_threshold`` times the tensor's mean magnitude stop spreading (the stream's feature threshold, DeltaCNN's
delta threshold); feature_threshold 0 keeps every recomputed position and is exact.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from incrinf.engine.program import Program, Step
from incrinf.engine.regions import cut
from incrinf.engine.windows import box_rows, padded_crop, padded_rows
from incrinf.geometry import Boxes
from incrinf.kernels import dispatch
from incrinf.kernels.gather import from_rows, to_rows

# Every this many positions of a tensor estimate its mean magnitude (the pruning threshold's unit).
_SCALE_STRIDE = 7
# Pruned boxes of a batch are rounded up to even sides: their sizes follow the data, and each new shape costs
# oneDNN a kernel build.
PRUNED_QUANTUM = 2


def _index(a: np.ndarray | None, device: torch.device) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)


def _overlay(region: Boxes, offset: np.ndarray, window: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray | None]:
    """Rows of N stacked windows of extent ``window`` receiving the region's values (placed at ``offset`` (N, d)
    inside each window), and the region's source rows (None: all of them, in order); elements falling outside
    their window are dropped."""
    n, d = offset.shape
    dest = np.zeros((n, *region.size), np.int64)
    source = np.zeros_like(dest)
    valid = np.ones(dest.shape, bool)
    for a in range(d):
        shape = [1] * (d + 1)
        shape[a + 1] = region.size[a]
        k = np.arange(region.size[a]).reshape(shape)
        w = offset[:, a].reshape(-1, *([1] * d)) + k
        valid &= (w >= 0) & (w < window[a])
        dest = dest * window[a] + w
        source = source * region.size[a] + k
    dest = dest + (np.arange(n) * math.prod(window)).reshape(-1, *([1] * d))
    source = source + (np.arange(n) * region.area).reshape(-1, *([1] * d))
    if valid.all():
        return dest.reshape(-1), None
    return dest[valid], source[valid]


def take(tensor: torch.Tensor, boxes: Boxes) -> torch.Tensor:
    """The values of a (1, C..., *dims) tensor inside ``boxes``: (N, C..., *size) (a view for one box)."""
    d = len(boxes.size)
    if boxes.single:
        return tensor[(..., *(slice(int(lo), int(lo) + s) for lo, s in zip(boxes.lo, boxes.size)))]
    dims = tuple(tensor.shape[-d:])
    index = torch.from_numpy(box_rows(boxes.start(), boxes.size, dims)).to(tensor.device)
    return from_rows(to_rows(tensor).index_select(0, index), boxes.n, boxes.size, tuple(tensor.shape[1:-d]))


class BaseStore:
    """One input's materialized tensors standing for N virtual copies.

    Args:
        program: the graph as steps.
        base: every node's value for the unchanged input (:func:`incrinf.graph.execute.materialize`).

    Attributes:
        plan: index tensors of the current batch by key, reused whenever the same batch runs again (set by the
            caller from :func:`incrinf.engine.plan.batch_plan`; None: build them every time).
    """

    def __init__(self, program: Program, base: dict[str, Any]) -> None:
        self.program = program
        self.base = base
        self.d = program.graph.spatial_dims
        self.device = base[program.graph.input.name].device
        self.plan: dict | None = None
        self._rows: dict[str, torch.Tensor] = {}
        self._scales: dict[str, float] = {}

    @property
    def output(self) -> Any:
        """The model's output for the unchanged input."""
        return self.base[self.program.graph.output.name]

    def rows(self, key: str, make: Any = None) -> torch.Tensor:
        """Row table of a base tensor (or of ``make()``), kept."""
        rows = self._rows.get(key)
        if rows is None:
            rows = self._rows[key] = (make() if make is not None else to_rows(self.base[key])).contiguous()
        return rows

    def _indices(self, key: tuple | None, build) -> tuple:
        if self.plan is None or key is None:
            return build()
        found = self.plan.get(key)
        if found is None:
            found = self.plan[key] = build()
        return found

    def windows(self, step: Step, src: Boxes, out: Boxes) -> torch.Tensor:
        """(N, C, *read) the read-in windows of ``out``: the padded base source with ``src`` overlaid."""
        spec = step.window
        source = self.base[spec.source]
        table = self.rows(f"{step.out}/padded", lambda: padded_rows(spec, source))
        dims = source.shape[-self.d:]
        padded = tuple(n + o + a for n, o, a in zip(dims, spec.offset, (v + w for v, w in
                                                                          zip(spec.view_after, spec.own_after))))
        read = spec.read_size(out.size)

        def build() -> tuple:
            start = out.start() * np.asarray(spec.stride)
            dest, origin = _overlay(src, src.start() + np.asarray(spec.offset) - start, read)
            return self._windowing(box_rows(start, read, padded), dest, origin, table.shape[0])

        return self._gather(table, self._indices(("window", step.out), build), src, out.n, read)

    def aligned(self, name: str, region: Boxes | None, out: Boxes, key: str | None = None) -> torch.Tensor:
        """(N, C..., *out.size): ``name``'s base values in ``out`` with ``region`` (its change) overlaid (``key``:
        the reading step, under which the plan keeps the indices)."""
        if region is not None and region.same_place(out):
            return region.values
        base = self.base[name]
        table = self.rows(name)
        dims = tuple(base.shape[-self.d:])

        def build() -> tuple:
            start = out.start()
            dest = origin = None
            if region is not None:
                dest, origin = _overlay(region, region.start() - start, out.size)
            return self._windowing(box_rows(start, out.size, dims), dest, origin, table.shape[0])

        index = self._indices(None if key is None else ("aligned", name, key), build)
        return self._gather(table, index, region, out.n, out.size, tuple(base.shape[1:-self.d]))

    def full(self, name: str, region: Boxes | None, n: int) -> torch.Tensor:
        """(N, C..., *dims): N copies of ``name``'s base tensor with each query's box written in."""
        base = self.base[name]
        if region is None:
            return base.expand(n, *base.shape[1:]) if isinstance(base, torch.Tensor) and base.dim() else base
        d = self.d
        dims = tuple(base.shape[-d:])
        table = self.rows(name)
        positions = math.prod(dims)

        def build() -> tuple:
            dest = _index(box_rows(region.start(), region.size, dims, batch_stride=positions), table.device)
            combined = dispatch.fuse_scatter_index(dest, None, n, positions) \
                if dispatch.wants_fused_index(table.device) else None
            return dest, combined

        dest, combined = self._indices(("full", name), build)
        rows = dispatch.project(table, n, dest, to_rows(region.values), None, combined)
        return from_rows(rows, n, dims, tuple(base.shape[1:-d]))

    def unchanged(self, n: int) -> Any:
        """The output when no change reaches the rest of the model: the base output for every query (each tensor
        of a structured output, e.g. a segmentation model's dict, expanded along its batch axis)."""
        return expand_output(self.output, n)

    def finish(self, cut_point: str, region: Boxes, n: int) -> Any:
        """Run the rest of the model from the cut point's full tensors (its change reached most of it)."""
        like_input = self.full(self.program.graph.input.name, None, n)  # read for its size at most
        return self.program.suffix(cut_point, self.full(cut_point, region, n), like_input, False)[0]

    def commit(self, name: str, region: Boxes, feature_threshold: float) -> Boxes | None:
        """``region`` cut to the positions whose values moved by more than ``feature_threshold`` times the tensor's
        mean magnitude (unchanged with feature_threshold 0); None when no query keeps any."""
        if feature_threshold <= 0:
            return region
        scale = self._scales.get(name)
        if scale is None:
            scale = self._scales[name] = float(to_rows(self.base[name])[::_SCALE_STRIDE].abs().mean())
        old = self.aligned(name, None, region)  # no key: pruned boxes follow the data, no plan holds them
        delta = (region.values - old).abs_()
        keep = delta.mean(dim=tuple(range(1, delta.dim() - self.d))) > feature_threshold * scale
        return cut(region, keep.cpu().numpy(), PRUNED_QUANTUM)

    def _windowing(self, read: np.ndarray, dest: np.ndarray | None, origin: np.ndarray | None, n_rows: int) -> tuple:
        device = self.device
        read_t, dest_t, origin_t = _index(read, device), _index(dest, device), _index(origin, device)
        combined = dispatch.fuse_window_index(read_t, dest_t, origin_t, n_rows) \
            if dest_t is not None and dispatch.wants_fused_index(device) else None
        return read_t, dest_t, origin_t, combined

    def _gather(self, table: torch.Tensor, index: tuple, region: Boxes | None, n: int, size: tuple[int, ...],
                channels: tuple[int, ...] | None = None) -> torch.Tensor:
        read, dest, origin, combined = index
        values = to_rows(region.values) if region is not None and dest is not None else None
        rows = dispatch.prepare_windows(table, read, dest, values, origin, combined)
        return from_rows(rows, n, size, channels)


class FrameCache:
    """A camera's cached tensors, one frame, merged in place as frames run.

    Args:
        program: the graph as steps.
        device: where the tensors live.

    Attributes:
        buffers: cached tensor name -> (positions, C) rows.
        frame: the current frame (1, C, *dims), the source of windows reading the input.
        last_output: a copy of the latest output (returned again when a change dies out before the tail).
    """

    def __init__(self, program: Program, device: torch.device) -> None:
        self.program = program
        self.device = device
        self.d = program.graph.spatial_dims
        self.shapes = {n.name: n.shape for n in program.graph.nodes}
        self.buffers: dict[str, torch.Tensor] = {}
        self.scales: dict[str, float] = {}
        self.frame: torch.Tensor | None = None
        self.last_output: Any = None

    def map(self, name: str) -> torch.Tensor:
        """(1, C..., *dims) view of a cached tensor (the frame for the input)."""
        if name == self.program.graph.input.name:
            return self.frame
        shape = self.shapes[name]
        return from_rows(self.buffers[name], 1, shape[-self.d:], shape[1:-self.d])

    def fill(self, tensors: dict[str, torch.Tensor], scales: bool = True) -> None:
        """Take a full run's tensors as the cache. Their mean magnitudes (the pruning threshold's unit) are
        estimated on first use (:meth:`scale`), so full frames that are never reused do not pay for them
        (``scales`` is kept for callers; it no longer changes anything)."""
        storages = set()
        self.scales = {}
        for name, t in tensors.items():
            rows = to_rows(t)
            ptr = rows.untyped_storage().data_ptr()
            # cached tensors are updated in place: two of them must not share memory
            self.buffers[name] = rows.clone() if ptr in storages else rows
            storages.add(ptr)

    def scale(self, name: str) -> float:
        """Mean magnitude of a cached tensor, estimated from every few positions on first use after a fill."""
        value = self.scales.get(name)
        if value is None:
            value = self.scales[name] = float(self.buffers[name][::_SCALE_STRIDE].abs().mean())
        return value

    def windows(self, step: Step, src: Boxes, out: Boxes) -> torch.Tensor:
        """(1, C, *read) the read-in window of ``out``: a padded crop of the merged source."""
        return padded_crop(step.window, self.map(step.window.source), out.bounds)

    def aligned(self, name: str, region: Boxes | None, out: Boxes, key: str | None = None) -> torch.Tensor:
        """``name``'s merged values in ``out`` (a view)."""
        if region is not None and region.same_place(out):
            return region.values
        return take(self.map(name), out)

    def full(self, name: str, region: Boxes | None, n: int) -> torch.Tensor:
        return self.map(name)

    def unchanged(self, n: int) -> Any:
        """The output when no change reaches the rest of the model: the previous frame's (a copy)."""
        return clone_output(self.last_output)

    def finish(self, cut_point: str, region: Boxes, n: int) -> Any:
        """Most of the cut point changed, and so will everything after it: run the rest of the model as one
        generated module (no per-step bookkeeping) and take its tensors as the new caches."""
        out, tensors = self.program.suffix(cut_point, self.map(cut_point), self.frame, True)
        for name, t in zip(self.program.cached_after(cut_point), tensors):
            self.buffers[name] = to_rows(t)
        return out

    def commit(self, name: str, region: Boxes, feature_threshold: float) -> Boxes | None:
        """Write ``region`` into its cache, first cut to the positions that moved by more than
        ``feature_threshold`` times the tensor's mean magnitude; None when none did."""
        target = take(self.map(name), region)
        eps = feature_threshold * self.scale(name) if feature_threshold > 0 else 0.0
        if eps > 0:
            delta = torch.sub(region.values, target).abs_()
            kept = cut(region, (delta.mean(dim=tuple(range(1, delta.dim() - self.d))) > eps).numpy())
            if kept is None:
                return None
            if kept is not region:
                region, target = kept, take(self.map(name), kept)
        target.copy_(region.values)
        return region


def expand_output(out: Any, n: int) -> Any:
    """A batch-1 model output as N copies (tensors expanded along their batch axis, containers rebuilt)."""
    if isinstance(out, torch.Tensor):
        return out.expand(n, *out.shape[1:]) if out.dim() else out
    if isinstance(out, (list, tuple)):
        return type(out)(expand_output(o, n) for o in out)
    if isinstance(out, dict):
        return type(out)((k, expand_output(v, n)) for k, v in out.items())
    return out


def clone_output(out: Any) -> Any:
    """A copy of a model output (tensors cloned, containers rebuilt), so callers never share one."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (list, tuple)):
        return type(out)(clone_output(o) for o in out)
    if isinstance(out, dict):
        return {k: clone_output(v) for k, v in out.items()}
    return out
