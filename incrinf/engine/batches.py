"""The engine for many changed copies of one input (occlusion queries): the input's tensors materialized once,
then batches of N update boxes carried through them (:func:`~incrinf.engine.boxes.walk` over a
:class:`~incrinf.engine.stores.BaseStore`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from incrinf.cache import runtime_cache
from incrinf.engine.boxes import WalkResult, walk
from incrinf.engine.program import Program
from incrinf.engine.stores import BaseStore
from incrinf.geometry import Boxes
from incrinf.graph import Graph
from incrinf.graph.execute import materialize


def positions_digest(positions: np.ndarray) -> str:
    """Hash of a positions array, so plan keys hold no arrays."""
    return hashlib.sha1(np.ascontiguousarray(positions, dtype=np.int64).tobytes()).hexdigest()


def batch_plan(graph: Graph, positions: np.ndarray, window: tuple[int, ...], tau: float,
               device: torch.device | str) -> dict:
    """The index tensors of one batch of queries, kept in the runtime cache under everything that determines
    them (graph signature, window, positions, tau, device; never tensor data): empty when new, filled by the
    first run and reused by every later run of the same batch (another image of the same size, another class).
    """
    key = ("plan", graph.signature, tuple(window), positions_digest(positions), len(positions), float(tau),
           str(device))
    plan, _ = runtime_cache().get_or_create(key, lambda _key: {})
    return plan


class BatchEngine:
    """One input's tensors, materialized once, and batched incremental runs of changed copies of it.

    Args:
        graph: captured graph.
        base_input: (1, C, *spatial) the unchanged input.
        fold_batch_norm: fold batch norms into the convolutions before them (a few ulps off the model's own
            arithmetic, a pass over every box saved).
    """

    def __init__(self, graph: Graph, base_input: torch.Tensor, fold_batch_norm: bool = True) -> None:
        self.graph = graph
        base, _ = materialize(graph, base_input)
        self.program = Program(graph, base, fold_batch_norm=fold_batch_norm)
        self.store = BaseStore(self.program, base)

    @property
    def base(self) -> dict[str, Any]:
        """Every node's value for the unchanged input."""
        return self.store.base

    @property
    def base_output(self) -> Any:
        """The model's output for the unchanged input."""
        return self.store.output

    @torch.no_grad()
    def run(self, start: Boxes, tau: float = 1.0, feature_threshold: float = 0.0, plan: dict | None = None
            ) -> WalkResult:
        """Outputs of N changed copies of the input.

        Args:
            start: the N changed boxes of the input (one size) and their new values (N, C, *size).
            tau: projective field threshold (1: exact).
            feature_threshold: value-based pruning at cached tensors (0: exact).
            plan: the batch's index tensors (:func:`batch_plan`), reused across runs of the same batch; ignored
                with pruning, whose boxes follow the data.

        Returns:
            The walk's result; its ``output`` has the batch axis N.
        """
        self.store.plan = plan if feature_threshold <= 0 else None
        try:
            return walk(self.program, self.store, start, tau=tau, feature_threshold=feature_threshold)
        finally:
            self.store.plan = None
