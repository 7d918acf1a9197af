"""Packing: the order in which a plan's queries join batches and where its batches are cut, so that batch-mates
need boxes of similar sizes and the packed batches compute few multiply-adds beyond each query's own."""

from __future__ import annotations

import numpy as np

from incrinf.engine.program import Program
from incrinf.geometry import Propagation, RegionKind

# The multiply-adds a core completes in the time it streams one byte from memory (its machine balance): 2-3 GHz
# AVX2/AVX-512 cores complete 16-64 single-precision multiply-adds per cycle, 30-150 G a second, against 5-15 GB/s
# of memory bandwidth per core; a GPU's fp32 rate over its memory bandwidth is of the same order. A step that reads
# more weight bytes than this many multiply-adds per byte is bound by reading its weights.
MACS_PER_WEIGHT_BYTE = 16.0


def order_queries(program: Program, exact: Propagation, sizes: np.ndarray) -> np.ndarray:
    """Order in which to pack queries so that batch-mates need boxes of similar sizes: by the area of the changed
    input box, then by the exact reach (outermost axis first) at the deepest tensor that still has boxes (stable:
    ties keep the caller's order). A packed batch computes every query on its largest boxes; edge positions reach
    fewer outputs and keep that saving only among edge positions of the same orientation."""
    graph = program.graph
    keys = [sizes.prod(axis=1)]
    boxed = [n.name for n in graph.nodes if exact.regions[n.name].kind == RegionKind.BOX and graph.is_map(n.shape)]
    if boxed:
        deepest = exact.regions[boxed[-1]].boxes.sizes()
        keys = [*deepest.T[::-1], *keys]
    return np.lexsort(keys)


def pack(program: Program, exact: Propagation, order: np.ndarray, batch_size: int, grow_to: int = 0
         ) -> list[tuple[int, int]]:
    """Batch boundaries over the ordered queries: consecutive runs of ``batch_size // 2`` (at least 1) to at most
    the larger of ``grow_to`` and the largest run of the packing that costs the fewest multiply-adds, that cost the
    least by :func:`run_cost`, multiply-adds and weight reads together. The caller sets ``grow_to`` from bytes (the
    most queries whose batch stays within its memory allowance); without it weighing the weight reads only merges
    batches, it never makes a batch hold more. Runs never shrink below half the batch size, so what every batch
    pays whatever its size (the walk over its steps, the tail) at most doubles.

    Returns:
        ``(first, end)`` positions in ``order`` of each batch, in order.
    """
    q = len(order)
    costs = _StepCosts(program, exact, q)
    if not costs.extents:
        return [(lo, min(lo + batch_size, q)) for lo in range(0, q, batch_size)]
    ordered = np.stack(costs.extents, axis=1)[order]  # (Q, steps, d)
    smallest = max(1, min(batch_size // 2, q))
    fewest_macs = _cheapest(costs, ordered, smallest, batch_size, 0.0)
    largest = max(max(end - first for first, end in fewest_macs), min(grow_to, q))
    return _cheapest(costs, ordered, min(smallest, largest), largest, MACS_PER_WEIGHT_BYTE)


def _cheapest(costs: _StepCosts, ordered: np.ndarray, smallest: int, largest: int, per_byte: float
              ) -> list[tuple[int, int]]:
    """The cheapest cuts of the ordered queries' (Q, steps, d) extents into runs of ``smallest`` to ``largest``
    queries (shorter runs only first or last), weight bytes read costing ``per_byte`` multiply-adds each (dynamic
    programming; an exact batch computes each step on the per-axis largest of its queries' boxes, so queries of
    different reach waste work when packed together; ties go to fewer batches)."""
    q = len(ordered)
    best = np.full(q + 1, np.inf)
    best[0] = 0.0
    cut = np.zeros(q + 1, np.int64)
    for end in range(1, q + 1):
        boxes = None
        for first in range(end - 1, max(end - largest, 0) - 1, -1):
            boxes = ordered[first] if boxes is None else np.maximum(boxes, ordered[first])
            n = end - first
            if n < smallest and first > 0 and end < q:
                continue
            cost = best[first] + costs.run(n, boxes, per_byte) * (1 + 1e-9) + 1e-6
            if cost < best[end]:
                best[end], cut[end] = cost, first
    bounds, end = [], q
    while end > 0:
        bounds.append((int(cut[end]), end))
        end = int(cut[end])
    return bounds[::-1]


class _StepCosts:
    """Per step with a change and multiply-adds: its multiply-adds per output position, the bytes of its weights,
    and the (Q, d) extents of every query's exact box there."""

    def __init__(self, program: Program, exact: Propagation, q: int) -> None:
        per_position, weight_bytes, self.extents = [], [], []
        for step in program.steps:
            region = exact.regions[step.out]
            if region.kind == RegionKind.NONE or step.flops == 0:
                continue
            dims = np.asarray(step.dims)
            per_position.append(step.flops / step.positions)
            weight_bytes.append(step.weight_bytes)
            self.extents.append(np.broadcast_to(dims, (q, len(dims))) if region.kind == RegionKind.FULL
                                else np.minimum(region.boxes.sizes(), dims))
        self.per_position = np.asarray(per_position, np.float64)
        self.weight_bytes = np.asarray(weight_bytes, np.float64)

    def run(self, n: int, boxes: np.ndarray, per_byte: float) -> float:
        """:func:`run_cost` of a batch of ``n`` queries whose per-step boxes are ``boxes`` (steps, d)."""
        return run_cost(n, boxes.prod(axis=1), self.per_position, self.weight_bytes, per_byte)


def run_cost(n: int, positions: np.ndarray, per_position: np.ndarray, weight_bytes: np.ndarray,
             per_byte: float = MACS_PER_WEIGHT_BYTE) -> float:
    """What one packed batch costs, in multiply-adds: per step that computes anything, its multiply-adds (``n``
    queries on ``positions`` output positions each, ``per_position`` multiply-adds apiece) plus the multiply-adds
    the machine completes in the time it reads the step's weights (``weight_bytes`` times ``per_byte``, by default
    :data:`MACS_PER_WEIGHT_BYTE`), which every batch that runs the step reads again. Where boxes are large the
    multiply-adds dominate and batches are cut to waste few; where the step's output is a few positions per query
    (the last stages of a classifier, edge windows), the weights dominate and fewer, larger batches cost less."""
    macs = n * positions * per_position
    reads = np.where(positions > 0, weight_bytes * per_byte, 0.0)
    return float((macs + reads).sum())
