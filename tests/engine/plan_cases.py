"""Occlusion cases shared by the plan tests: naive inference of zeroed windows one copy at a time, and the same
windows through a planned run of a :class:`~incrinf.engine.BatchEngine`."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from incrinf.engine import BatchEngine
from incrinf.engine.memory import RunBytes
from incrinf.geometry import Boxes, input_boxes
from incrinf.graph import Graph


def naive_outputs(model: nn.Module, image: torch.Tensor, corners: np.ndarray, window: tuple[int, ...]) -> torch.Tensor:
    """(Q, ...) the model's outputs on copies of ``image`` (1, C, *dims) with each window at ``corners`` (Q, d)
    zeroed, one forward pass each."""
    outs = []
    for corner in corners:
        x = image.clone()
        x[(..., *(slice(int(c), int(c) + w) for c, w in zip(corner, window)))] = 0.0
        outs.append(model(x))
    return torch.cat(outs)


def planned_outputs(engine: BatchEngine, image: torch.Tensor, corners: np.ndarray, window: tuple[int, ...],
                    batch_size: int) -> tuple[torch.Tensor, object]:
    """The same outputs from ``engine``'s plan of those windows at ``batch_size`` (each batch run on the changed
    boxes it reads), and the plan."""
    dims = tuple(image.shape[2:])
    region = input_boxes(corners, window, dims)
    plan, _ = engine.plan(region.start(), region.sizes(), batch_size=batch_size)
    outputs = torch.zeros(len(corners), *engine.base_output.shape[1:])
    for batch in plan.batches:
        starts = batch.start.start()
        boxes = []
        for q, s in zip(batch.queries, starts):
            x = image.clone()
            x[(..., *(slice(int(c), int(c) + w) for c, w in zip(corners[q], window)))] = 0.0
            boxes.append(x[(0, slice(None), *(slice(int(a), int(a) + e) for a, e in zip(s, batch.start.size)))])
        result = engine.run_batch(batch, torch.stack(boxes))
        outputs[torch.tensor(batch.queries)] = result.output
    return outputs, plan


def run_zeroed_windows(graph: Graph, image: torch.Tensor, region: Boxes, batch_size: int) -> RunBytes:
    """A whole planned run, as a memory test measures it: an engine built on ``image`` (1, C, *dims), its plan of
    ``region``'s windows at ``batch_size`` and every batch run on zeroed boxes; the plan's byte model."""
    engine = BatchEngine(graph, image)
    plan, _ = engine.plan(region.start(), region.sizes(), batch_size=batch_size)
    for batch in plan.batches:
        engine.run_batch(batch, torch.zeros(batch.n, image.shape[1], *batch.start.size))
    return engine.run_bytes(plan)
