"""Where a run's unchanged values come from.

- :class:`BaseStore`: one input's kept tensors, immutable, standing for N virtual copies (occlusion: N occluded
  copies of one image), as the row tables :mod:`~incrinf.engine.layout` lays out. Windows are gathered from the
  tables and the incoming boxes overlaid, one index operation each (a Triton kernel on CUDA), with the index
  tensors of a plan (:mod:`~incrinf.engine.plans`) or made on the spot (unplanned runs).
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

from incrinf.engine.layout import Gather, Layout, Place, Projection, aligned_index, projection_index, window_index
from incrinf.engine.program import Program, Step
from incrinf.engine.regions import cut
from incrinf.engine.windows import WindowSpec, crop_view, pad_map, padded_crop
from incrinf.geometry import Boxes
from incrinf.kernels import dispatch
from incrinf.kernels.gather import box_rows, from_rows, overlay_boxes, to_rows

# Every this many positions of a tensor estimate its mean magnitude (the pruning threshold's unit).
_SCALE_STRIDE = 7
# Pruned boxes of a batch are rounded up to even sides: their sizes follow the data, and each new shape costs
# oneDNN a kernel build.
PRUNED_QUANTUM = 2


def take(tensor: torch.Tensor, boxes: Boxes) -> torch.Tensor:
    """The values of a (1, C..., *dims) tensor inside ``boxes``: (N, C..., *size) (a view for one box)."""
    d = len(boxes.size)
    if boxes.single:
        if d == 2:  # a camera frame's box, once per commit and merge input: one view, no generator
            (y, x), (h, w) = boxes.lo, boxes.size
            return crop_view(tensor, y, x, h, w)
        return tensor[(..., *(slice(int(lo), int(lo) + s) for lo, s in zip(boxes.lo, boxes.size)))]
    dims = tuple(tensor.shape[-d:])
    index = torch.from_numpy(box_rows(boxes.start(), boxes.size, dims)).to(tensor.device)
    return from_rows(to_rows(tensor).index_select(0, index), boxes.n, boxes.size, tuple(tensor.shape[1:-d]))


def crop_boxes(tensor: torch.Tensor, corners: np.ndarray, extent: tuple[int, ...]) -> torch.Tensor:
    """(N, C..., *extent): the values of a (1, C..., *dims) tensor in N boxes of one extent at ``corners`` (N, d)."""
    corners = np.asarray(corners, np.int64)
    return take(tensor, Boxes(tuple(corners.T), tuple(int(e) for e in extent)))


class BaseStore:
    """One input's kept tensors standing for N virtual copies, as row tables (:mod:`~incrinf.engine.layout`).

    Args:
        program: the graph as steps.
        layout: which tables to keep and where each tensor lives in them.
        base: the unchanged input's values of at least ``layout.kept``, the input and the output; each kept
            tensor is removed from it once its tables are made, so that it is freed then.

    Attributes:
        tables: table key -> (rows, columns) channels-last rows.
        output: the model's output for the unchanged input.
    """

    def __init__(self, program: Program, layout: Layout, base: dict[str, Any]) -> None:
        self.program = program
        self.layout = layout
        graph = program.graph
        self.d = graph.spatial_dims
        self.input = base[graph.input.name]
        self.device = self.input.device
        self.output = base[graph.output.name]
        self.tables: dict[str, torch.Tensor] = {}
        remaining = {}
        for table in layout.tables.values():
            remaining[table.source] = remaining.get(table.source, 0) + 1
        for key, table in layout.tables.items():
            p = table.padding
            value = base[table.source]
            remaining[table.source] -= 1
            if not remaining[table.source] and table.source not in (graph.input.name, graph.output.name):
                del base[table.source]  # its last table: let it go as soon as the table is made
            if not p.empty:
                value = pad_map(value, p.view_before, p.view_after, p.view_value, p.own_before, p.own_after,
                                p.pad_value)
            self.tables[key] = to_rows(value).contiguous()
            del value
        self._scales: dict[str, float] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of the tables."""
        return sum(t.numel() * t.element_size() for t in self.tables.values())

    def table(self, place: Place) -> torch.Tensor:
        """The rows of one tensor's place (a column slice of a shared table: a view)."""
        rows = self.tables[place.table]
        first, count = place.columns
        return rows if first == 0 and count == rows.shape[1] else rows[:, first:first + count]

    def _channels(self, name: str) -> tuple[int, ...]:
        return tuple(self.program.graph.by_name[name].shape[1:-self.d])

    def gather(self, place: Place, index: Gather, region: Boxes | None, n: int, size: tuple[int, ...],
               channels: tuple[int, ...]) -> torch.Tensor:
        """(N, C..., *size) rows of a place gathered by ``index``, with ``region``'s values overlaid."""
        values = to_rows(region.values, self.d) if region is not None and index.overlays else None
        if index.box is not None:
            b = index.box
            rows = dispatch.gather_boxes(self.table(place), b.geometry, b.size, b.dims, values, b.region,
                                         b.batch_stride)
            return from_rows(rows, n, size, channels)
        if index.shifts is not None:
            rows = dispatch.prepare_windows(self.table(place), index.read, None, None)
            overlay_boxes(rows.view(n, *size, -1), values.reshape(n, *region.size, -1), index.shifts)
            return from_rows(rows, n, size, channels)
        rows = dispatch.prepare_windows(self.table(place), index.read, index.dest, values, index.origin,
                                        index.combined)
        return from_rows(rows, n, size, channels)

    def plain(self, name: str) -> torch.Tensor:
        """(1, C..., *dims) ``name``'s base values (a view of its table: the padding cut off, its columns)."""
        place = self.layout.reads[name]
        table = self.layout.tables[place.table]
        rows = self.table(place)
        grid = rows.view(*table.dims, rows.shape[1]) if rows.is_contiguous() else \
            rows.as_strided((*table.dims, rows.shape[1]), (*_row_strides(table.dims, rows.stride(0)), 1))
        dims = self.program.dims(name)
        inside = grid[tuple(slice(o, o + n) for o, n in zip(place.origin, dims))]
        return inside.permute(self.d, *range(self.d)).reshape(*self._channels(name), *dims)[None]

    def padded(self, spec: WindowSpec, values: torch.Tensor) -> torch.Tensor:
        """The read-in windows of a window over its whole map: the source's whole new values (N, C, *dims)
        padded as the window reads them."""
        view_before, view_after, own_before, own_after = spec.pads
        return pad_map(values, view_before, view_after, spec.view_value, own_before, own_after, spec.pad_value)

    def project(self, name: str, region: Boxes, n: int, index: Projection) -> torch.Tensor:
        """(N, C..., *dims): N copies of ``name``'s base tensor with each query's box written in."""
        base_rows = to_rows(self.plain(name), self.d).contiguous()
        if index.box is not None:
            b = index.box
            rows = dispatch.gather_boxes(base_rows, b.geometry, b.size, b.dims, to_rows(region.values, self.d),
                                         b.region, b.batch_stride)
            return from_rows(rows, n, self.program.dims(name), self._channels(name))
        rows = dispatch.project(base_rows, n, index.dest, to_rows(region.values, self.d), None, index.combined)
        return from_rows(rows, n, self.program.dims(name), self._channels(name))

    def assemble(self, values: torch.Tensor, parts: list[tuple[Boxes | None, tuple[int, int], Any]]
                 ) -> torch.Tensor:
        """Write the changed parts of a concatenation into ``values`` (N, C, *size), its gathered base values:
        ``parts`` holds each part's region, columns and overlay (None: unchanged; an overlay without rows: the
        region is the whole box)."""
        rows = to_rows(values, self.d)
        for region, (first, count), overlay in parts:
            if region is None:
                continue
            target = rows[:, first:first + count]
            incoming = to_rows(region.values, self.d)
            if overlay.box is not None:
                b = overlay.box
                dispatch.gather_boxes(None, b.geometry, b.size, b.dims, incoming, b.region, out=target)
            elif overlay.dest is None:
                target.copy_(incoming)
            else:
                source = incoming if overlay.origin is None else incoming.index_select(0, overlay.origin)
                target.index_copy_(0, overlay.dest, source)
        return values

    # --- the walk's store protocol (unplanned runs: value-based pruning, tests) ---------------------------

    def windows(self, step: Step, src: Boxes, out: Boxes) -> torch.Tensor:
        """(N, C, *read) the read-in windows of ``out``: the padded base source with ``src`` overlaid."""
        place = self.layout.windows[step.out]
        index = window_index(self.layout, step.window, place, src, out, self.device)
        return self.gather(place, index, src, out.n, step.window.read_size(out.size),
                           self._channels(step.window.source))

    def aligned(self, name: str, region: Boxes | None, out: Boxes, key: str | None = None) -> torch.Tensor:
        """(N, C..., *out.size): ``name``'s base values in ``out`` with ``region`` (its change) overlaid."""
        if region is not None and region.same_place(out):
            return region.values
        place = self.layout.reads[name]
        index = aligned_index(self.layout, place, region, out, self.device)
        return self.gather(place, index, region, out.n, out.size, self._channels(name))

    def full(self, name: str, region: Boxes | None, n: int) -> Any:
        """(N, C..., *dims): N copies of ``name``'s base tensor with each query's box written in."""
        if region is None:
            base = self.input if name == self.program.graph.input.name else self.plain(name)
            return base.expand(n, *base.shape[1:])
        index = projection_index(self.program.dims(name), region, self.device)
        return self.project(name, region, n, index)

    def unchanged(self, n: int) -> Any:
        """The output when no change reaches the rest of the model: the base output for every query (each tensor
        of a structured output, e.g. a segmentation model's dict, expanded along its batch axis)."""
        return expand_output(self.output, n)

    def finish(self, cut_point: str, region: Boxes, n: int) -> Any:
        """Run the rest of the model from the cut point's full tensors (its change reached most of it)."""
        like_input = self.input.expand(n, *self.input.shape[1:])  # read for its size at most
        return self.program.suffix(cut_point, self.full(cut_point, region, n), like_input, False)[0]

    def commit(self, name: str, region: Boxes, feature_threshold: float) -> Boxes | None:
        """``region`` cut to the positions whose values moved by more than ``feature_threshold`` times the tensor's
        mean magnitude (unchanged with feature_threshold 0); None when no query keeps any."""
        if feature_threshold <= 0:
            return region
        scale = self._scales.get(name)
        if scale is None:
            whole = Boxes(tuple(np.zeros(1, np.int64) for _ in range(self.d)), self.program.dims(name))
            rows = to_rows(self.aligned(name, None, whole), self.d)
            scale = self._scales[name] = float(rows[::_SCALE_STRIDE].abs().mean())
        old = self.aligned(name, None, region)
        delta = (region.values - old).abs_()
        keep = delta.mean(dim=tuple(range(1, delta.dim() - self.d))) > feature_threshold * scale
        return cut(region, keep.cpu().numpy(), PRUNED_QUANTUM)


def _row_strides(dims: tuple[int, ...], row: int) -> list[int]:
    """Element strides of a row table's spatial axes (row-major positions, ``row`` elements per position)."""
    strides, step = [], row
    for n in reversed(dims):
        strides.append(step)
        step *= n
    return strides[::-1]


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
        # name -> (buffer, its map view): a frame asks for each map several times per step, and making the view
        # costs as much as a small box's arithmetic; a buffer replaced (a fill, a dense suffix) makes a new view
        self._views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self.scales: dict[str, float] = {}
        self.frame: torch.Tensor | None = None
        self.last_output: Any = None
        self._input_name = program.graph.input.name
        # per cached tensor, its channel axes and channel count (float32) for the commits' pruning test
        self._channels: dict[str, tuple[tuple[int, ...], np.float32]] = {}

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """Cached tensor name -> its values as rows (positions by channels)."""
        return self._buffers

    @buffers.setter
    def buffers(self, value: dict[str, torch.Tensor]) -> None:
        self._buffers = value
        self._views = {}  # views of dropped buffers would keep their memory

    def map(self, name: str) -> torch.Tensor:
        """(1, C..., *dims) view of a cached tensor (the frame for the input)."""
        if name == self._input_name:
            return self.frame
        buffer = self.buffers[name]
        memo = self._views.get(name)
        if memo is not None and memo[0] is buffer:
            return memo[1]
        shape = self.shapes[name]
        view = from_rows(buffer, 1, shape[-self.d:], shape[1:-self.d])
        self._views[name] = (buffer, view)
        return view

    def fill(self, tensors: dict[str, torch.Tensor], scales: bool = True) -> None:
        """Take a full run's tensors as the cache. Their mean magnitudes (the pruning threshold's unit) are
        estimated on first use (:meth:`scale`), so full frames that are never reused do not pay for them
        (``scales`` is kept for callers; it no longer changes anything)."""
        storages = set()
        self.scales = {}
        self._views = {}
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
            channels, count = self._channels.get(name) or self._channel_axes(name, delta)
            # torch's CPU mean is this sum divided by the channel count: the division and the comparison against
            # eps, both in float32 as torch's would be, are done in numpy (two operator calls less per commit,
            # the scalar division's tensor included, and a frame commits every cached tensor's boxes)
            sums = delta.sum(dim=channels)
            if sums.requires_grad:
                sums = sums.detach()
            moved = sums.numpy() / count > np.float32(eps)
            kept = _cut_one(region, moved[0]) if region.single and self.d == 2 else cut(region, moved)
            if kept is None:
                return None
            if kept is not region:
                region, target = kept, take(self.map(name), kept)
        target.copy_(region.values)
        return region

    def _channel_axes(self, name: str, values: torch.Tensor) -> tuple[tuple[int, ...], np.float32]:
        """The channel axes of a tensor's values (1, C..., *dims) and their element count, kept per tensor."""
        axes = tuple(range(1, values.dim() - self.d))
        entry = self._channels[name] = axes, np.float32(math.prod(values.shape[1:values.dim() - self.d]))
        return entry


def _cut_one(region: Boxes, moved: np.ndarray) -> Boxes | None:
    """:func:`~incrinf.engine.regions.cut` of one 2-D box by its (h, w) ``moved`` positions, with a few numpy
    calls on the two projections (the general cut's per-axis batch arithmetic costs a camera frame about as much
    as its convolutions): the box itself when moved positions touch all four sides, None when none moved."""
    rows, cols = moved.any(axis=1), moved.any(axis=0)
    if rows[0] and rows[-1] and cols[0] and cols[-1]:
        return region
    ys = rows.nonzero()[0]
    if not len(ys):
        return None
    xs = cols.nonzero()[0]
    y0, y1, x0, x1 = int(ys[0]), int(ys[-1]) + 1, int(xs[0]), int(xs[-1]) + 1
    return Boxes((int(region.lo[0]) + y0, int(region.lo[1]) + x0), (y1 - y0, x1 - x0),
                 crop_view(region.values, y0, x0, y1 - y0, x1 - x0))


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
