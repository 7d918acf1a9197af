"""The one region engine: update regions flowing through a captured graph, for every workload.

A :class:`~incrinf.engine.program.Program` groups the graph into steps (operator handling lives in
:mod:`~incrinf.engine.operators`, once). Two small parts differ between workloads:

- where unchanged values come from: an immutable :class:`~incrinf.engine.stores.BaseStore` (N virtual copies of
  one input: occlusion) or a :class:`~incrinf.engine.stores.FrameCache` (a camera's merged tensors, committed as
  a frame runs);
- how a region is represented: N boxes of one size (:mod:`~incrinf.engine.boxes`: occlusion queries, a still
  camera's change with N = 1) or a set of positions in blocks (:mod:`~incrinf.engine.blocks`: a moving camera).

:class:`BatchEngine` serves occlusion: it asks for a typed :class:`Plan` (:mod:`~incrinf.engine.plans`: batch
order and sizes, per step the boxes, index tensors, multiply-adds and bytes), built once per key by the runtime
cache, and runs its batches. :class:`FrameEngine` serves streams. The engine knows nothing about occlusion or
cameras.
"""

from incrinf.engine.batches import BatchEngine, Executor, executor_for, positions_digest
from incrinf.engine.blocks import Motion
from incrinf.engine.boxes import WalkResult, walk
from incrinf.engine.frames import CacheMemory, ExecStats, FrameEngine
from incrinf.engine.memory import RunBytes, free_device_memory, peak_memory, reset_peak_memory
from incrinf.engine.plans import BatchPlan, Plan, PlanKey, StepPlan
from incrinf.engine.program import Program, Step
from incrinf.engine.stores import crop_boxes
from incrinf.geometry import Boxes

__all__ = [
    "BatchEngine",
    "BatchPlan",
    "Boxes",
    "CacheMemory",
    "ExecStats",
    "Executor",
    "FrameEngine",
    "Motion",
    "Plan",
    "PlanKey",
    "Program",
    "RunBytes",
    "Step",
    "StepPlan",
    "WalkResult",
    "crop_boxes",
    "executor_for",
    "free_device_memory",
    "peak_memory",
    "positions_digest",
    "reset_peak_memory",
    "walk",
]
