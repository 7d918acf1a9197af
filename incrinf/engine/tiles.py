"""Exact values of a few tiles of a cached tensor, recomputed from the frame through their receptive fields: what a
sampled audit compares the cache with.

A tile of a cached tensor (a few positions of one map) depends on a cone of the program: its read-in window in the
tensor before, that window's in the one before, ..., down to a box of the frame. Recomputing that cone from the
current frame gives the tile's exact value (what full inference would hold there) at the cone's cost, a fraction
of a full frame when the tensor is shallow enough. The *probe* is the deepest cached tensor whose cone of one
tile costs at most a budget (:func:`choose_probe`): the output itself for a model whose receptive field is small
against the frame (a face detector's score map), an intermediate map for one whose deep positions see the whole
frame (a classifier, a dilated segmenter) — there the sample compares the cache where it can afford to, and a
full audit compares the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from incrinf.engine.boxes import merge_values
from incrinf.engine.costs import FrameCosts, RegionKind
from incrinf.engine.frame_regions import area, bounding, run_box
from incrinf.engine.program import Program
from incrinf.engine.stores import take
from incrinf.geometry import Box, Boxes


@dataclass(frozen=True)
class Probe:
    """The cached tensor a sampled audit compares, and what one tile's cone costs.

    Attributes:
        name: the cached tensor.
        step: index of the step producing it.
        dims: its spatial extents.
        tile: tile side in positions.
        seconds: predicted seconds of one tile's cone (a tile at the map's centre).
        flops: multiply-adds of that cone.
    """

    name: str
    step: int
    dims: tuple[int, int]
    tile: int
    seconds: float
    flops: float


def cone(program: Program, step: int, tile: Box) -> dict[str, Box]:
    """The box of every tensor that the ``tile`` of step ``step``'s output depends on (the tile's receptive field
    through the program), the frame's included."""
    needed = {program.steps[step].out: tile}
    for index in range(step, -1, -1):
        s = program.steps[index]
        box = needed.get(s.out)
        if box is None:
            continue
        reads = [(s.window.source, _read_window(s, box, program.dims(s.window.source)))] if s.window is not None \
            else [(name, box) for name in s.inputs]
        for name, read in reads:
            needed[name] = bounding(needed[name], read) if name in needed else read
    return needed


def _read_window(step, box: Box, dims: tuple[int, ...]) -> Box:
    """The source box a window step reads for the output ``box`` (clipped to the source map)."""
    spec = step.window
    out = []
    for a in range(2):
        lo = box[2 * a] * spec.stride[a] - spec.offset[a]
        hi = (box[2 * a + 1] - 1) * spec.stride[a] - spec.offset[a] + spec.extent[a]
        out.extend((max(lo, 0), min(hi, dims[a])))
    return tuple(out)


def cone_cost(program: Program, costs: FrameCosts, step: int, tile: Box) -> tuple[float, float]:
    """``(seconds, multiply-adds)`` of recomputing ``tile`` of step ``step``'s output from the frame."""
    needed = cone(program, step, tile)
    seconds = flops = 0.0
    for index in range(step + 1):
        s = program.steps[index]
        box = needed.get(s.out)
        if box is not None:
            seconds += costs.box(index, area(box))
            flops += s.flops * area(box) / s.positions
    return seconds, flops


def choose_probe(program: Program, costs: FrameCosts, budget: float, tile: int = 4) -> Probe | None:
    """The deepest cached tensor (a map) whose cone of one ``tile`` x ``tile`` tile at its centre costs at most
    ``budget`` seconds; None when none does (pass the budget of one tile: a sample of several divides its own)."""
    best = None
    for index, step in enumerate(program.steps):
        if step.out not in program.cached_set or len(step.dims) != 2:
            continue
        h, w = step.dims
        t = min(tile, h, w)
        y, x = (h - t) // 2, (w - t) // 2
        seconds, flops = cone_cost(program, costs, index, (y, y + t, x, x + t))
        if seconds <= budget:
            best = Probe(step.out, index, (h, w), t, seconds, flops)
    return best


class _Scratch:
    """Full-size maps holding only the cone's boxes (read only there: the rest is never initialised)."""

    def __init__(self, program: Program, frame: torch.Tensor) -> None:
        self.program = program
        self.maps = {program.graph.input.name: frame}

    def map(self, name: str) -> torch.Tensor:
        return self.maps[name]


def exact_tiles(program: Program, frame: torch.Tensor, probe: Probe, tiles: list[Box],
                costs: FrameCosts | None = None) -> list[torch.Tensor]:
    """The exact values (1, C, th, tw) of the probe's ``tiles``, recomputed from ``frame`` (1, C, H, W) through
    their cones: one cone per tile, or (with ``costs``) one cone around all of them when that costs less (deep
    probes of a large receptive field: the tiles' cones overlap in most of the early maps). The tiles whose cones
    read no padding are translates of one another: they run as one batch through a single cone."""
    cones = [cone(program, probe.step, tile) for tile in tiles]
    # the tiles whose cones read no padding are translates of one another: one batch (a border tile's cone reads
    # padding and runs alone). Each cone is walked once; the batch's cones must then agree on their boxes' sizes
    # and on what each step reads relative to them
    own = [_translated_reads(program, probe, c) for c in cones] if len(cones) > 1 else []
    inside = [i for i, r in enumerate(own) if r is not None]
    reads = own[inside[0]] if len(inside) > 1 and _translates(cones, inside, own) else None
    batch = inside if reads is not None else []
    alone = [i for i in range(len(cones)) if i not in batch]
    if costs is not None and len(cones) > 1:
        union: dict[str, Box] = {}
        for needed in cones:
            for name, box in needed.items():
                union[name] = bounding(union[name], box) if name in union else box
        apart = _cones_seconds(program, costs, probe.step, [cones[i] for i in alone])
        if batch:
            apart += _batch_seconds(program, costs, probe.step, [cones[i] for i in batch])
        if _cones_seconds(program, costs, probe.step, [union]) <= apart:
            scratch = _run_cone(program, frame, probe, union)
            return [scratch.map(probe.name)[..., a:b, c:d].clone() for a, b, c, d in tiles]
    out: list[torch.Tensor | None] = [None] * len(tiles)
    if batch:
        for i, values in zip(batch, _run_batched(program, frame, probe, [cones[i] for i in batch], reads)):
            out[i] = values
    for i in alone:
        a, b, c, d = tiles[i]
        out[i] = _run_cone(program, frame, probe, cones[i]).map(probe.name)[..., a:b, c:d].clone()
    return out


def _cones_seconds(program: Program, costs: FrameCosts, step: int, cones: list[dict[str, Box]]) -> float:
    return sum(costs.box(index, area(needed[program.steps[index].out]))
               for needed in cones for index in range(step + 1) if program.steps[index].out in needed)


def _batch_seconds(program: Program, costs: FrameCosts, step: int, cones: list[dict[str, Box]]) -> float:
    """Translated cones run as one batch: each step's fixed cost once, its arithmetic per cone."""
    one = cones[0]
    call_ratio, compute_ratio = costs.call_ratio(RegionKind.BOXES), costs.compute_ratio(RegionKind.BOXES)
    seconds = 0.0
    for index in range(step + 1):
        name = program.steps[index].out
        if name in one:
            call, compute = costs.box_parts(index, area(one[name]))
            seconds += call_ratio * call + len(cones) * compute_ratio * compute
    return seconds


def _run_cone(program: Program, frame: torch.Tensor, probe: Probe, needed: dict[str, Box]) -> _Scratch:
    """Every step up to the probe's on its box of ``needed`` (the maps hold values only there)."""
    graph = program.graph
    scratch = _Scratch(program, frame)
    for index in range(probe.step + 1):
        step = program.steps[index]
        box = needed.get(step.out)
        if box is None:
            continue
        regions = {}
        if step.window is None and len(step.inputs) == 1:  # its input's values, in this box
            source = step.inputs[0]
            regions[source] = [Boxes((box[0], box[2]), (box[1] - box[0], box[3] - box[2]),
                                     take(scratch.map(source), _as_boxes(box)))]
        values = run_box(program, scratch, step, regions, box).values
        shape = graph.by_name[step.out].shape or values.shape
        # in the layout the values come in (channels-last, as the cache's): a copy across layouts, and every later
        # crop of a map in the other layout, would cost more than the cone's arithmetic
        layout = torch.channels_last if values.dim() == 4 and values.is_contiguous(
            memory_format=torch.channels_last) else torch.contiguous_format
        full = torch.empty((1, *values.shape[1:-2], *shape[-2:]), dtype=values.dtype, device=values.device,
                           memory_format=layout)
        full[..., box[0]:box[1], box[2]:box[3]] = values
        scratch.maps[step.out] = full
    return scratch


def _translated_reads(program: Program, probe: Probe, needed: dict[str, Box]
                      ) -> dict[str, tuple[tuple[str, tuple[int, int, int, int]], ...]] | None:
    """Per step of the cone ``needed``, what it reads: ``(tensor, rows and columns relative to that tensor's box)``,
    when it reads no padding; None otherwise (a tile near a border, average-pool border factors). Cones of boxes of
    the same sizes with the same relative reads are translates of one another (:func:`_translates`): a batch can run
    them as one."""
    reads = {}
    for index in range(probe.step + 1):
        step = program.steps[index]
        box = needed.get(step.out)
        if box is None:
            continue
        if step.factors is not None:
            return None
        if step.window is not None:
            spec, source = step.window, step.window.source
            dims = program.dims(source)
            window = []
            for a in range(2):
                lo = box[2 * a] * spec.stride[a] - spec.offset[a]
                hi = (box[2 * a + 1] - 1) * spec.stride[a] - spec.offset[a] + spec.extent[a]
                if lo < 0 or hi > dims[a]:
                    return None  # the window reads padding
                window.extend((lo, hi))
            own = ((source, tuple(window)),)
        else:
            own = tuple((name, box) for name in step.inputs)
        reads[step.out] = tuple((name, (w[0] - needed[name][0], w[1] - needed[name][0], w[2] - needed[name][2],
                                        w[3] - needed[name][2])) for name, w in own)
    return reads


def _translates(cones: list[dict[str, Box]], chosen: list[int], own: list[dict | None]) -> bool:
    """Whether the ``chosen`` cones have boxes of the same sizes for the same tensors and the same relative reads
    (``own``: :func:`_translated_reads` of each cone alone), i.e. whether they are translates of one another."""
    first = cones[chosen[0]]
    sizes = {name: (b[1] - b[0], b[3] - b[2]) for name, b in first.items()}
    for i in chosen[1:]:
        c = cones[i]
        if set(c) != set(first) or any((b[1] - b[0], b[3] - b[2]) != sizes[n] for n, b in c.items()):
            return False
        if own[i] != own[chosen[0]]:
            return False
    return True


def _run_batched(program: Program, frame: torch.Tensor, probe: Probe, cones: list[dict[str, Box]],
                 reads: dict[str, tuple[tuple[str, tuple[int, int, int, int]], ...]]) -> list[torch.Tensor]:
    """The probe's tiles of translated cones (``reads``: :func:`_translated_reads`) recomputed as one batch: each
    step runs once on the N cones' values (N, C, *box), not once per tile (a shallow probe's sample costs mostly
    per-call overhead)."""
    source = program.graph.input.name
    values = {source: torch.cat([frame[..., b[0]:b[1], b[2]:b[3]] for b in (c[source] for c in cones)])
              .contiguous(memory_format=torch.channels_last)}
    n = len(cones)
    for index in range(probe.step + 1):
        step = program.steps[index]
        if step.out not in reads:
            continue
        box = cones[0][step.out]
        crops = {name: values[name][..., r0:r1, c0:c1] for name, (r0, r1, c0, c1) in reads[step.out]}
        if step.window is not None:
            out = step.op(crops[step.window.source])
        else:
            out = merge_values(program, step, crops, Boxes((np.full(n, box[0]), np.full(n, box[2])),
                                                            (box[1] - box[0], box[3] - box[2])))
        for fn in step.functions:
            out = fn(out)
        values[step.out] = out
    probe_values = values[probe.name]
    return [probe_values[i:i + 1].clone() for i in range(n)]


def _as_boxes(box: Box) -> Boxes:
    return Boxes((box[0], box[2]), (box[1] - box[0], box[3] - box[2]))


def relative_error(cached: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    """``||cached - exact|| / ||exact||`` over all tiles (0 when both are zero)."""
    diff = math.sqrt(sum(float((a - b).float().pow(2).sum()) for a, b in zip(cached, exact)))
    norm = math.sqrt(sum(float(b.float().pow(2).sum()) for b in exact))
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)
