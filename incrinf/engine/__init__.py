"""The one region engine: update regions flowing through a captured graph, for every workload.

A :class:`~incrinf.engine.program.Program` groups the graph into steps (operator handling lives in
:mod:`~incrinf.engine.operators`, once). Two small parts differ between workloads:

- where unchanged values come from: an immutable :class:`~incrinf.engine.stores.BaseStore` (N virtual copies of
  one input: occlusion) or a :class:`~incrinf.engine.stores.FrameCache` (a camera's merged tensors, committed as
  a frame runs);
- how a region is represented: N boxes of one size (:mod:`~incrinf.engine.boxes`: occlusion queries, a still
  camera's change with N = 1) or a set of positions in blocks (:mod:`~incrinf.engine.blocks`: a moving camera).

:class:`BatchEngine` serves occlusion, :class:`FrameEngine` serves streams. The engine knows nothing about
occlusion or cameras.
"""

from incrinf.engine.batches import BatchEngine, batch_plan, positions_digest
from incrinf.engine.blocks import Motion
from incrinf.engine.boxes import WalkResult, walk
from incrinf.engine.frames import CacheMemory, ExecStats, FrameEngine
from incrinf.engine.program import Program, Step
from incrinf.geometry import Boxes

__all__ = [
    "BatchEngine",
    "Boxes",
    "CacheMemory",
    "ExecStats",
    "FrameEngine",
    "Motion",
    "Program",
    "Step",
    "WalkResult",
    "batch_plan",
    "positions_digest",
    "walk",
]
