"""The box walk: N update boxes of one size carried through a program's steps (occlusion queries; a still
camera's change with N = 1).

Per step: a window grows its source's boxes by Krypton's equations, reads the windows from the store (the
incoming boxes overlaid on unchanged values) and runs its operator with padding 0; a merge or pointwise step
takes the bounding box of its inputs and reads what they did not change from the store; the step's pointwise
chain follows. A cached tensor's boxes are committed to the store, which may cut them to the positions that
moved enough (value-based pruning). At a cut point whose box covers most of the map, the rest of the model runs
as one generated module; otherwise the tail runs on the full boundary tensors. When every change has died out
before the tail, the unchanged output is returned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from incrinf.engine.program import Program, Step
from incrinf.engine.regions import grow, union
from incrinf.engine.stores import take
from incrinf.geometry import Boxes
from incrinf.kernels.gather import from_rows, to_rows


class Store(Protocol):
    """Where a walk's unchanged values come from (:class:`~incrinf.engine.stores.BaseStore` or
    :class:`~incrinf.engine.stores.FrameCache`)."""

    def windows(self, step: Step, src: Boxes, out: Boxes) -> torch.Tensor: ...

    def aligned(self, name: str, region: Boxes | None, out: Boxes, key: str | None = None) -> torch.Tensor: ...

    def full(self, name: str, region: Boxes | None, n: int) -> torch.Tensor: ...

    def commit(self, name: str, region: Boxes, feature_threshold: float) -> Boxes | None: ...

    def finish(self, cut_point: str, region: Boxes, n: int) -> Any: ...

    def unchanged(self, n: int) -> Any: ...


@dataclass
class WalkResult:
    """What a walk computed.

    Attributes:
        output: the model's output for every query (batch axis N).
        flops: multiply-accumulates computed per query.
        positions: recomputed positions per query, summed over the steps.
        committed: the boxes committed to each cached tensor (after pruning).
        suffix: the cut point from which the rest ran as one module, if any.
        unchanged: no change reached the rest of the model (the unchanged output was returned).
        peak_bytes: the largest sum of live region values during the walk.
    """

    output: Any
    flops: float
    positions: int
    committed: dict[str, Boxes] = field(default_factory=dict)
    suffix: str | None = None
    unchanged: bool = False
    peak_bytes: int = 0


def walk(program: Program, store: Store, start: Boxes, tau: float = 1.0, feature_threshold: float = 0.0,
         quantum: int = 1, dense_cut: float = math.inf) -> WalkResult:
    """Carry ``start`` (the input's boxes with their new values) through the program.

    Args:
        program: the graph as steps.
        store: where unchanged values come from.
        start: the changed boxes of the input and their values.
        tau: projective field threshold (1: exact).
        feature_threshold: value-based pruning at cached tensors (0: exact).
        quantum: round box sides up to multiples of this (a camera's varying boxes reuse oneDNN's kernels).
        dense_cut: at a cut point whose box covers at least this share of the map, finish with the generated
            suffix module (``math.inf``: never).

    Returns:
        The :class:`WalkResult`.
    """
    regions: dict[str, Boxes] = {program.graph.input.name: start}
    cached = program.cached_set
    n = start.n
    flops, positions, live_bytes, peak = 0.0, 0, 0, 0
    committed: dict[str, Boxes] = {}
    for step, live, release in zip(program.steps, program.live, program.release):
        if all(regions.get(name) is None for name in live):
            break  # every change has died out (pruning): later tensors keep their unchanged values
        region = _run_step(program, store, step, regions, tau, quantum)
        if region is not None:
            flops += step.flops * region.area / step.positions
            positions += region.area
            if step.out in cached:
                region = store.commit(step.out, region, feature_threshold)
                if region is not None:
                    committed[step.out] = region
        if region is not None:
            regions[step.out] = region
            live_bytes += _nbytes(region)
            peak = max(peak, live_bytes)
            if step.out in program.cuts and region.covers(step.dims, dense_cut):
                output = store.finish(step.out, region, n)
                flops += program.suffix_flops(step.out) + program.tail_flops
                return WalkResult(output, flops, positions, committed, suffix=step.out, peak_bytes=peak)
        for name in release:
            live_bytes -= _nbytes(regions.pop(name, None))
    if all(regions.get(name) is None for name in program.read_boundary):
        return WalkResult(store.unchanged(n), flops, positions, committed, unchanged=True, peak_bytes=peak)
    tensors = [store.full(name, regions.get(name), n) for name in program.boundary]
    return WalkResult(program.tail()(*tensors), flops + program.tail_flops, positions, committed, peak_bytes=peak)


def _nbytes(region: Boxes | None) -> int:
    values = None if region is None else region.values
    return values.numel() * values.element_size() if isinstance(values, torch.Tensor) else 0


def step_box(program: Program, step: Step, regions: dict[str, Boxes | None], tau: float = 1.0,
             quantum: int = 1) -> Boxes | None:
    """The boxes a step recomputes (without values): a window grows its source's boxes, a merge or pointwise step
    takes the bounding box of its inputs' boxes; None when none of its inputs changed."""
    if step.window is not None:
        src = regions.get(step.window.source)
        if src is None:
            return None
        if tau < 1.0 and src.covers(program.dims(step.window.source)):
            tau = 1.0  # a change covering the whole map is computed whole (the seed truncates boxes only)
        return grow(src, step.window, step.dims, tau, quantum)
    present = [r for r in (regions.get(name) for name in step.inputs) if r is not None]
    return union(present, step.dims) if present else None


def compute(program: Program, step: Step, out: Boxes, windows: torch.Tensor | None = None,
            inputs: dict[str, Any] | None = None, fresh: bool = False) -> torch.Tensor:
    """A step's values in ``out`` from its read-in windows (window steps) or its inputs' values in ``out``.

    Args:
        program: the graph as steps.
        step: the step.
        out: its output boxes.
        windows: (N, C, *read) the read-in windows (window steps).
        inputs: the inputs' values in ``out`` by name (other steps).
        fresh: the first input is a tensor no one else reads (an in-place head may overwrite it; otherwise it
            is copied first, as it may be a view of a store or another step's values).

    Returns:
        (N, C..., *out.size) the step's values.
    """
    if step.window is not None:
        values = step.op(windows)
        if step.factors is not None:
            values = values * take(step.factors, out)
    else:
        values = merge_values(program, step, inputs, out, fresh)
    return chain(step, values)


def merge_values(program: Program, step: Step, inputs: dict[str, Any], out: Boxes, fresh: bool = False) -> Any:
    """A step without a window over the boxes ``out``, from its inputs' values there ((N, C, *size) each, by
    input name), before its pointwise chain. The first input may be a view of a cache or of another step's values:
    an in-place head gets a copy, unless ``fresh`` says no one else reads it."""
    first = step.inputs[0]
    if step.head.inplace and not fresh:
        inputs[first] = inputs[first].clone()
    if step.linear is not None:
        values = from_rows(F.linear(to_rows(inputs[first]), *step.linear), out.n, out.size)
    elif step.op is not None:
        values = step.op(inputs[first])
    else:
        values = program.ops.invoke(step.head, inputs, like=inputs[first])
    if step.inplace and not step.head.inplace and not fresh and shares_memory(values, inputs[first]):
        values = values.clone()  # an in-place chain after a head that returned a view of its input
    return values


def chain(step: Step, values: Any) -> Any:
    """The step's pointwise chain applied to its head's values."""
    for fn in step.functions:
        values = fn(values)
    return values


def shares_memory(value: Any, tensor: Any) -> bool:
    """Whether ``value`` (a tensor or a tuple of them, e.g. a split's) is or holds a view of ``tensor``."""
    if isinstance(value, (tuple, list)):
        return any(shares_memory(v, tensor) for v in value)
    return isinstance(value, torch.Tensor) and isinstance(tensor, torch.Tensor) \
        and value.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()


def _run_step(program: Program, store: Store, step: Step, regions: dict[str, Boxes], tau: float,
              quantum: int) -> Boxes | None:
    out = step_box(program, step, regions, tau, quantum)
    if out is None:
        return None
    if step.window is not None:
        out.values = compute(program, step, out, windows=store.windows(step, regions[step.window.source], out))
    else:
        inputs = {name: store.aligned(name, regions.get(name), out, step.out) for name in step.inputs}
        out.values = compute(program, step, out, inputs=inputs)
    return out
