"""Where the base values a batched run reads live, and the row indices that read them.

A :class:`~incrinf.engine.stores.BaseStore` keeps only the tensors some step reads outside its own region (the
program's cached tensors), each as a *row table* (one row per spatial position, channels as columns,
channels-last in memory):

- a window step reads its source through a *padded* table (the views' padding, then the operator's own), one per
  distinct padding of a source, which also serves the source's aligned reads;
- a tensor joined by a channel concatenation whose every part is kept anyway is a *column slice* of the
  concatenation's table (DenseNet's dense blocks: each layer's concatenation holds the previous one and the new
  features, so a block keeps one table instead of one per layer, as a plain forward pass frees them);
- any other kept tensor has a table of its own.

:func:`table_layout` decides this from the program's structure alone, so plans (built before any input is
seen) and stores agree on every row index. The index functions (:func:`window_index`, :func:`aligned_index`,
:func:`projection_index`) turn box geometry into the gathers the kernels run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from incrinf.engine.program import Program
from incrinf.engine.windows import WindowSpec
from incrinf.geometry import Boxes
from incrinf.graph import NodeKind, Operator
from incrinf.graph.execute import concat_parts
from incrinf.kernels import dispatch
from incrinf.kernels.gather import box_rows, box_rows_and_inside


@dataclass(frozen=True)
class Padding:
    """How a table is padded around its tensor (all zero: not padded).

    Attributes:
        view_before, view_after: (d,) padding views' extent (value ``view_value``).
        own_before, own_after: (d,) the operator's own padding outside the views (value ``pad_value``).
    """

    view_before: tuple[int, ...]
    view_after: tuple[int, ...]
    own_before: tuple[int, ...]
    own_after: tuple[int, ...]
    view_value: float = 0.0
    pad_value: float = 0.0

    @property
    def before(self) -> tuple[int, ...]:
        return tuple(v + o for v, o in zip(self.view_before, self.own_before))

    @property
    def after(self) -> tuple[int, ...]:
        return tuple(v + o for v, o in zip(self.view_after, self.own_after))

    @property
    def empty(self) -> bool:
        return not any(self.before) and not any(self.after)


def no_padding(d: int) -> Padding:
    zero = (0,) * d
    return Padding(zero, zero, zero, zero)


def window_padding(spec: WindowSpec) -> Padding:
    """The padding a window step's source table needs."""
    view_before, view_after, own_before, own_after = spec.pads
    if not any(view_before) and not any(view_after):
        return Padding(view_before, view_after, own_before, own_after, 0.0, spec.pad_value)
    return Padding(view_before, view_after, own_before, own_after, spec.view_value, spec.pad_value)


@dataclass(frozen=True)
class Table:
    """One row table of the store.

    Attributes:
        source: the tensor whose (padded) values fill it.
        padding: how it is padded.
        dims: (d,) its spatial extents (padding included).
    """

    source: str
    padding: Padding
    dims: tuple[int, ...]

    @property
    def rows(self) -> int:
        return math.prod(self.dims)


@dataclass(frozen=True)
class Place:
    """Where one tensor's base values are read: a table, the columns holding it, its origin in the table.

    Attributes:
        table: the table's key in :attr:`Layout.tables`.
        columns: ``(first, count)`` columns of the table holding the tensor (all of them for a table of its own).
        origin: (d,) table coordinates of the tensor's first element (the padding before it).
    """

    table: str
    columns: tuple[int, int]
    origin: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """Every table a store builds and where each read finds its values.

    Attributes:
        tables: key -> :class:`Table` (the key names the source and its padding).
        windows: window step's output name -> where its (padded) source is read.
        reads: tensor name -> where its values are read (aligned reads, full projections).
        kept: the tensors whose base values the store must be given (the roots of the tables).
    """

    tables: dict[str, Table]
    windows: dict[str, Place]
    reads: dict[str, Place]
    kept: frozenset[str]


def _channels(program: Program, name: str) -> int:
    shape = program.graph.by_name[name].shape
    return math.prod(shape[1:-program.graph.spatial_dims])


def _aliases(program: Program, mutated: set[str]) -> dict[str, tuple[str, int]]:
    """Kept tensors held as column slices of a concatenation: name -> (concatenation, first column)."""
    graph = program.graph
    kept = set(program.cached) | {graph.input.name}
    out: dict[str, tuple[str, int]] = {}
    for node in graph.nodes:
        if node.kind != NodeKind.MERGE or node.operator != Operator.CAT or node.name in mutated:
            continue
        parts = concat_parts(node)
        if parts is None or len(set(parts)) != len(parts) or not all(p in kept for p in parts):
            continue
        dims = program.dims(node.name)
        column = 0
        for part in parts:
            if part not in mutated and part != graph.input.name and program.dims(part) == dims \
                    and len(graph.by_name[part].shape) == len(graph.by_name[node.name].shape):
                out[part] = (node.name, column)
            column += _channels(program, part)
    return out


def table_layout(program: Program, mutated: set[str] = frozenset(), alias: bool = True) -> Layout:
    """The tables a store keeps for ``program`` and where every read finds its values.

    Args:
        program: the graph as steps.
        mutated: tensors a later in-place operation overwrites (never shared with a concatenation's table).
        alias: hold a concatenation's parts as column slices of its table (off: a table each; the Triton
            kernels read contiguous tables only).
    """
    graph = program.graph
    d = graph.spatial_dims
    links = _aliases(program, set(mutated)) if alias else {}
    padded: dict[str, set[str]] = {}  # tensors read through a padded table: never column slices
    for step in program.steps:
        if step.window is not None and not window_padding(step.window).empty:
            padded.setdefault(step.window.source, set()).add(step.out)
    links = {k: v for k, v in links.items() if k not in padded}

    def root(name: str) -> tuple[str, int]:
        column = 0
        while name in links:
            name, offset = links[name]
            column += offset
        return name, column

    tables: dict[str, Table] = {}
    windows: dict[str, Place] = {}
    reads: dict[str, Place] = {}
    kept: set[str] = set()
    first_padded: dict[str, str] = {}  # source -> its first padded table, which holds its values once

    def padded_key(source: str, pad: Padding) -> str:
        key = f"{source}/pad{pad.before}{pad.after}/{pad.view_value}/{pad.pad_value}"
        if key not in tables:
            dims = tuple(n + b + a for n, b, a in zip(program.dims(source), pad.before, pad.after))
            tables[key] = Table(source, pad, dims)
            kept.add(source)
            first_padded.setdefault(source, key)
        return key

    for step in program.steps:  # padded tables first: other reads of their sources (and parts) find them
        if step.window is not None and not window_padding(step.window).empty:
            padded_key(step.window.source, window_padding(step.window))

    def plain(name: str) -> Place:
        """Where ``name`` is read without padding: in a padded table of its root when there is one (a
        concatenation read by a padded window holds its parts' values once, in the columns of that table)."""
        base, column = root(name)
        key = first_padded.get(base)
        if key is not None:
            return Place(key, (column, _channels(program, name)), tables[key].padding.before)
        if base not in tables:
            tables[base] = Table(base, no_padding(d), program.dims(base))
            kept.add(base)
        return Place(base, (column, _channels(program, name)), (0,) * d)

    for step in program.steps:
        if step.window is None:
            continue
        source = step.window.source
        pad = window_padding(step.window)
        if pad.empty:
            windows[step.out] = plain(source)
            continue
        key = padded_key(source, pad)
        windows[step.out] = Place(key, (0, _channels(program, source)), pad.before)
        reads.setdefault(source, windows[step.out])
    for name in [graph.input.name, *program.cached, *sorted(kept)]:  # the roots are read too
        if name not in reads:
            reads[name] = plain(name)
    return Layout(tables, windows, reads, frozenset(kept))


# --- row indices --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BoxIndex:
    """A gather described by its boxes' corners instead of row indices: N boxes of extent ``size`` read from a
    table of extents ``dims``, each with its region (extent ``region``) overlaid at its offset inside the box.
    The kernels compute every row address from these few bytes on the device
    (:func:`incrinf.kernels.dispatch.gather_boxes`). Axes are padded to three (leading extents of 1).

    Attributes:
        geometry: (N, 6) int32 on the device: per box its first corner in the table, then its region's corner
            relative to the box.
        size: (3,) the boxes' extent.
        dims: (3,) the table's extents.
        region: (3,) the regions' extent (None: no overlay).
        batch_stride: table rows added per box (N stacked maps).
    """

    geometry: torch.Tensor
    size: tuple[int, int, int]
    dims: tuple[int, int, int]
    region: tuple[int, int, int] | None
    batch_stride: int = 0

    @property
    def nbytes(self) -> int:
        return self.geometry.numel() * self.geometry.element_size()


@dataclass(frozen=True)
class Gather:
    """The index tensors of one read: rows of a table, optionally overlaid with a region's values.

    Attributes:
        read: (R,) table row of every gathered row (None when ``box`` describes the read).
        dest: (K,) gathered rows receiving region values (None: no overlay).
        origin: (K,) region row of each ``dest`` (None: region rows 0..K-1 in order).
        combined: the fused index of the Triton kernels (None off CUDA).
        box: the read by its boxes' corners (on CUDA: no row indices at all).
        shifts: the overlay as runs ``(first, end, place)`` of consecutive boxes whose region starts at one place
            inside them (``dest`` and ``origin`` None: a strided copy of the region's values per run, clipped to
            the boxes, instead of a scatter of rows).
    """

    read: torch.Tensor | None
    dest: torch.Tensor | None = None
    origin: torch.Tensor | None = None
    combined: torch.Tensor | None = None
    box: BoxIndex | None = None
    shifts: tuple[tuple[int, int, tuple[int, ...]], ...] | None = None

    @property
    def overlays(self) -> bool:
        """Whether the read overlays a region's values."""
        return self.dest is not None or self.shifts is not None or \
            (self.box is not None and self.box.region is not None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.read, self.dest, self.origin, self.combined)
                   if t is not None) + (self.box.nbytes if self.box is not None else 0)


@dataclass(frozen=True)
class Projection:
    """The index tensors of a full projection: N copies of a map with each query's box written in.

    Attributes:
        dest: (K,) rows of the (N * positions) result receiving region values (None when ``box`` describes it).
        combined: the fused index of the Triton kernels (None off CUDA).
        box: the projection by the boxes' corners (on CUDA).
    """

    dest: torch.Tensor | None
    combined: torch.Tensor | None = None
    box: BoxIndex | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.dest, self.combined) if t is not None) \
            + (self.box.nbytes if self.box is not None else 0)


def _three(values, fill: int) -> tuple[int, ...]:
    return (fill,) * (3 - len(values)) + tuple(int(v) for v in values)


def compact(device: torch.device, d: int) -> bool:
    """Whether gathers on ``device`` of ``d``-dimensional maps are described by their boxes (:class:`BoxIndex`)."""
    return d <= 3 and dispatch.wants_box_index(device)


def describe_boxes(start: np.ndarray, size: tuple[int, ...], dims: tuple[int, ...], region: Boxes | None,
                   offset: np.ndarray | None, device: torch.device, batch_stride: int = 0) -> BoxIndex:
    """The :class:`BoxIndex` of N boxes at ``start`` (N, d) of extent ``size`` in a table of extents ``dims``,
    with ``region`` overlaid at ``offset`` (N, d) inside each box."""
    n, d = start.shape
    geometry = np.zeros((n, 6), np.int32)
    geometry[:, 3 - d:3] = start
    if region is not None:
        geometry[:, 6 - d:] = offset
    return BoxIndex(torch.from_numpy(geometry).to(device), _three(size, 1), _three(dims, 1),
                    None if region is None else _three(region.size, 1), batch_stride)


def _tensor(a: np.ndarray | None, device: torch.device) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)


def overlay_index(region: Boxes, offset: np.ndarray, window: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray | None]:
    """Rows of N stacked windows of extent ``window`` receiving the region's values (placed at ``offset`` (N, d)
    inside each window), and the region's source rows (None: all of them, in order); elements falling outside
    their window are dropped."""
    dest, inside = box_rows_and_inside(offset, region.size, window, batch_stride=math.prod(window))
    if inside.all():
        return dest, None
    return dest[inside], np.flatnonzero(inside)


def _runs(offset: np.ndarray) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    """Runs ``(first, end, place)`` of consecutive rows of ``offset`` (N, d) that are equal."""
    cuts = [0, *(np.flatnonzero((offset[1:] != offset[:-1]).any(axis=1)) + 1).tolist(), len(offset)]
    return tuple((a, b, tuple(int(o) for o in offset[a])) for a, b in zip(cuts[:-1], cuts[1:]))


def _read_boxes(table: Table, start: np.ndarray, size: tuple[int, ...], region: Boxes | None, origin: np.ndarray,
                device: torch.device) -> Gather:
    """N boxes of extent ``size`` at ``start`` (N, d) (table coordinates) read from ``table``, with ``region``'s
    changed boxes (map coordinates; ``origin``: where the map starts in the table) overlaid: a :class:`BoxIndex`
    where the device's kernels take one, else row indices."""
    offset = None if region is None else region.start() + origin - start
    if compact(device, len(size)):
        return Gather(None, box=describe_boxes(start, size, table.dims, region, offset, device))
    dest = origin_rows = None
    if region is not None and len(offset) and not dispatch.wants_fused_index(device):
        return Gather(_tensor(box_rows(start, size, table.dims), device), shifts=_runs(offset))
    if region is not None:
        dest, origin_rows = overlay_index(region, offset, size)
    read_t, dest_t, origin_t = (_tensor(a, device) for a in (box_rows(start, size, table.dims), dest, origin_rows))
    combined = dispatch.fuse_window_index(read_t, dest_t, origin_t, table.rows) \
        if dest_t is not None and dispatch.wants_fused_index(device) else None
    return Gather(read_t, dest_t, origin_t, combined)


def window_index(layout: Layout, spec: WindowSpec, place: Place, src: Boxes | None, out: Boxes,
                 device: torch.device) -> Gather:
    """The read-in windows of ``out`` (N boxes of a window step's output) in its source's padded table, with the
    source's changed boxes ``src`` overlaid."""
    origin = np.asarray(place.origin)
    # window start in table coordinates: out * stride - offset + origin; the table holds exactly the padding of
    # this window, so the origin equals the offset
    start = out.start() * np.asarray(spec.stride) + (origin - np.asarray(spec.offset))
    return _read_boxes(layout.tables[place.table], start, spec.read_size(out.size), src, origin, device)


def aligned_index(layout: Layout, place: Place, region: Boxes | None, out: Boxes, device: torch.device) -> Gather:
    """A tensor's base values in ``out`` (N boxes of one size), its changed boxes ``region`` overlaid."""
    origin = np.asarray(place.origin)
    return _read_boxes(layout.tables[place.table], out.start() + origin, out.size, region, origin, device)


def projection_index(dims: tuple[int, ...], region: Boxes, device: torch.device) -> Projection:
    """Rows of N stacked maps of extents ``dims`` that receive each query's box."""
    if compact(device, len(dims)):
        return Projection(None, box=describe_boxes(np.zeros((region.n, len(dims)), np.int64), dims, dims, region,
                                                   region.start(), device))
    positions = math.prod(dims)
    dest = _tensor(box_rows(region.start(), region.size, dims, batch_stride=positions), device)
    combined = dispatch.fuse_scatter_index(dest, None, region.n, positions) \
        if dispatch.wants_fused_index(device) else None
    return Projection(dest, combined)


def part_overlay(region: Boxes, out: Boxes, device: torch.device) -> Gather:
    """Where a concatenation part's changed boxes ``region`` land in the step's boxes ``out`` (an overlay without
    a read: ``dest``/``origin`` rows, or a :class:`BoxIndex` on CUDA)."""
    offset = region.start() - out.start()
    if compact(device, len(out.size)):
        return Gather(None, box=describe_boxes(np.zeros_like(offset), out.size, out.size, region, offset, device))
    dest, origin = overlay_index(region, offset, out.size)
    return Gather(None, _tensor(dest, device), _tensor(origin, device))
