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
    return _pack(_StepCosts(program, exact, len(order)), order, batch_size, grow_to)[0]


def cheapest_order(program: Program, exact: Propagation, orders: list[np.ndarray], batch_size: int,
                   grow_to: int = 0) -> np.ndarray:
    """Of several orders of the same queries, the one whose packing (:func:`pack`) costs the least by
    :func:`run_cost` (ties: the first)."""
    costs = _StepCosts(program, exact, len(orders[0]))
    if len(orders) == 1 or not costs.extents:
        return orders[0]
    return min(orders, key=lambda order: _pack(costs, order, batch_size, grow_to)[1])


def _pack(costs: _StepCosts, order: np.ndarray, batch_size: int, grow_to: int) -> tuple[list[tuple[int, int]], float]:
    """:func:`pack`'s boundaries and what its batches cost by :func:`run_cost` (weights at their default price)."""
    q = len(order)
    if not costs.extents:
        return [(lo, min(lo + batch_size, q)) for lo in range(0, q, batch_size)], 0.0
    ordered = np.stack(costs.extents, axis=1)[order]  # (Q, steps, d)
    smallest = max(1, min(batch_size // 2, q))
    fewest_macs, _ = _cheapest(costs, ordered, smallest, batch_size, 0.0)
    largest = max(max(end - first for first, end in fewest_macs), min(grow_to, q))
    return _cheapest(costs, ordered, min(smallest, largest), largest, MACS_PER_WEIGHT_BYTE)


def _cheapest(costs: _StepCosts, ordered: np.ndarray, smallest: int, largest: int, per_byte: float
              ) -> tuple[list[tuple[int, int]], float]:
    """The cheapest cuts of the ordered queries' (Q, steps, d) extents into runs of ``smallest`` to ``largest``
    queries (shorter runs only first or last), weight bytes read costing ``per_byte`` multiply-adds each (dynamic
    programming; an exact batch computes each step on the per-axis largest of its queries' boxes, so queries of
    different reach waste work when packed together; ties go to fewer batches), and their cost.

    Every run ending at one query is weighed at once: the per-axis largest boxes of the runs ``first..end`` are a
    running maximum backwards from ``end``."""
    q = len(ordered)
    best = np.full(q + 1, np.inf)
    best[0] = 0.0
    cut = np.zeros(q + 1, np.int64)
    for end in range(1, q + 1):
        low = max(end - largest, 0)
        boxes = np.maximum.accumulate(ordered[low:end][::-1], axis=0)  # (runs, steps, d): first = end-1, end-2...
        n = np.arange(1, end - low + 1)
        first = end - n
        allowed = (n >= smallest) | (first == 0) | (end == q)
        cost = best[first] + costs.runs(n, boxes, per_byte) * (1 + 1e-9) + 1e-6
        cost[~allowed] = np.inf
        k = int(np.argmin(cost))  # the first of equal costs: the shortest run, as a walk from end-1 down keeps
        if cost[k] < best[end]:
            best[end], cut[end] = cost[k], first[k]
    bounds, end = [], q
    while end > 0:
        bounds.append((int(cut[end]), end))
        end = int(cut[end])
    return bounds[::-1], float(best[q])


def reach_classes(program: Program, exact: Propagation, q: int) -> np.ndarray:
    """(Q, d) per query (of ``q``) and axis, the rank of its extents along that axis over every step with a change (the
    query's *reach profile* there: queries of one class along every axis need boxes of one size at every step),
    classes ranked by their total extent, then by profile."""
    return _reach_classes(_StepCosts(program, exact, q))


def _reach_classes(costs: _StepCosts) -> np.ndarray:
    """:func:`reach_classes` from the queries' step extents (at least one step with a change)."""
    extents = np.stack(costs.extents, axis=1)  # (Q, steps, d)
    classes = np.zeros((extents.shape[0], extents.shape[2]), np.int64)
    for a in range(extents.shape[2]):
        profiles, inverse = np.unique(extents[:, :, a], axis=0, return_inverse=True)
        rank = np.lexsort([*profiles.T[::-1], profiles.sum(axis=1)])  # by total extent, then profile
        place = np.empty_like(rank)
        place[rank] = np.arange(len(rank))
        classes[:, a] = place[inverse.reshape(-1)]
    return classes


# Widths, in reach classes of the last axis, of the bands that banded orders cut the queries into.
BAND_WIDTHS = (1, 2, 3, 5)


def candidate_orders(program: Program, exact: Propagation, sizes: np.ndarray) -> list[np.ndarray]:
    """Orders worth packing the queries in (:func:`cheapest_order` picks one): :func:`order_queries`, and banded
    orders. A banded order cuts the queries into bands of :data:`BAND_WIDTHS` reach classes along the last axis
    (:func:`reach_classes`) and walks each band by its classes along the other axes (back and forth), so that a
    batch's queries differ little in reach along every axis, not only along the one it was sorted by last (on a
    2-D grid, sorting by rows packs whole rows: the per-axis largest box then spans every column's reach)."""
    orders = [order_queries(program, exact, sizes)]
    if sizes.shape[1] < 2:
        return orders
    costs = _StepCosts(program, exact, len(sizes))
    if not costs.extents:
        return orders
    classes = _reach_classes(costs)
    area = sizes.prod(axis=1)
    last, others = classes[:, -1], classes[:, :-1]
    seen = {orders[0].tobytes()}
    for width in BAND_WIDTHS:
        band = last // width
        walk = np.where(band % 2 == 0, others[:, 0], -others[:, 0])
        order = np.lexsort([last, *others[:, 1:].T[::-1], walk, band, area])
        if order.tobytes() not in seen:
            seen.add(order.tobytes())
            orders.append(order)
    return orders


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

    def runs(self, n: np.ndarray, boxes: np.ndarray, per_byte: float) -> np.ndarray:
        """:func:`run_cost` of R batches of ``n`` (R,) queries whose per-step boxes are ``boxes`` (R, steps, d)."""
        positions = boxes.prod(axis=2)  # (R, steps)
        macs = n[:, None] * positions * self.per_position
        reads = np.where(positions > 0, self.weight_bytes * per_byte, 0.0)
        return (macs + reads).sum(axis=1)


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
