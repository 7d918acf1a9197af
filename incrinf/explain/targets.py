"""What an occlusion explains: one output index, every output index at once, or any scalar a function computes
from the model's output (a segmentation model's class score inside a region of interest).

A :class:`Target` turns a batch of model outputs (any structure, batch axis first) into scores: (N,) for one
index or a reducer, (N, K) for ``"all"``. The heat map is the unoccluded score minus the occluded one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

Reducer = Callable[[Any], torch.Tensor]
# What a class score is: the model's raw outputs, or softmax probabilities over each example's outputs.
OUTPUTS = ("logit", "prob")


def check_output(output: Any) -> str:
    """``"logit"`` or ``"prob"`` (:data:`OUTPUTS`), else a ValueError."""
    if output not in OUTPUTS:
        raise ValueError(f"output must be 'logit' or 'prob', got {output!r}")
    return output


@dataclass(frozen=True)
class Target:
    """A resolved target.

    Attributes:
        index: the explained output index (flattened per example), or None.
        every: a score per output index (``"all"``).
        reducer: a function of the model's output returning one value per example, or None.
        prob: scores are softmax probabilities over the flattened outputs rather than raw values.
        label: how to name it (``3``, ``"all"``, the reducer's name).
    """

    index: int | None = None
    every: bool = False
    reducer: Reducer | None = None
    prob: bool = False
    label: int | str = 0

    def scores(self, output: Any) -> torch.Tensor:
        """(N,) scores, or (N, K) for ``"all"``, of a batch of model outputs."""
        if self.reducer is not None:
            return reduced(self.reducer, output)
        flat = _flat(output)
        if self.prob:
            flat = torch.softmax(flat, dim=1)
        return flat if self.every else flat[:, self.index]


def resolve(target: Any, base_output: Any, output: str = "logit") -> Target:
    """The :class:`Target` that ``target`` names, checked against the model's output for the unoccluded input.

    Args:
        target: None (the predicted class), an int output index, ``"all"`` (a map per output index) or a callable
            ``f(output) -> (N,)`` reducing a batch of outputs to one value per example.
        base_output: the model's output for the unoccluded input (batch axis 1).
        output: ``"logit"`` (raw outputs) or ``"prob"`` (softmax over each example's outputs).

    Raises:
        TypeError / ValueError: naming what is wrong (an index out of range, a structured output without a
            reducer, a reducer that does not return one value per example).
    """
    prob = check_output(output) == "prob"
    if callable(target) and not isinstance(target, (str, int)):
        if prob:
            raise ValueError("output='prob' applies to class scores; with a reducer target, apply any activation "
                             "inside the reducer")
        reduced(target, base_output)  # fails early, with the reducer's own shape in the message
        return Target(reducer=target, label=getattr(target, "__name__", type(target).__name__))
    if not isinstance(base_output, torch.Tensor):
        raise TypeError(f"the model returns a {type(base_output).__name__}, not a tensor of scores: pass a callable "
                        "target reducing it to one value per example, e.g. "
                        "target=lambda out: out['out'][:, k].mean((1, 2))")
    n_outputs = base_output[0].numel()
    if isinstance(target, str):
        if target != "all":
            raise ValueError(f"target must be an int, 'all', a callable or None, got {target!r}")
        return Target(every=True, prob=prob, label="all")
    if target is None:
        flat = _flat(base_output)
        return Target(index=int(flat[0].argmax()), prob=prob, label=int(flat[0].argmax()))
    if isinstance(target, bool) or not isinstance(target, (int, np.integer)):
        raise TypeError(f"target must be an int class index, 'all', a callable or None, got {type(target).__name__}")
    if not 0 <= int(target) < n_outputs:
        raise ValueError(f"target {target} is out of range for a model with {n_outputs} outputs")
    return Target(index=int(target), prob=prob, label=int(target))


def reduced(reducer: Reducer, output: Any) -> torch.Tensor:
    """(N,) float scores from a reducer, checked: one value per example of the batch."""
    n = batch_size(output)
    scores = reducer(output)
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"the target reducer must return a tensor with one value per example, got "
                        f"{type(scores).__name__}")
    if scores.dim() == 0 or scores.shape[0] != n or scores[0].numel() != 1:
        raise ValueError(f"the target reducer must return one value per example, shape ({n},), for a batch of {n}; "
                         f"got shape {tuple(scores.shape)}")
    return _as_scores(scores.reshape(n))


def batch_size(output: Any) -> int:
    """The batch size of a model output (the first tensor's first axis)."""
    if isinstance(output, torch.Tensor):
        if output.dim() == 0:
            raise ValueError("the model returns a scalar for the whole batch, not one output per example")
        return int(output.shape[0])
    values = output.values() if isinstance(output, dict) else output
    if isinstance(values, (list, tuple)) or isinstance(output, dict):
        for v in values:
            try:
                return batch_size(v)
            except TypeError:
                continue
    raise TypeError(f"cannot find the batch axis of a model output of type {type(output).__name__}")


def _flat(output: torch.Tensor) -> torch.Tensor:
    return _as_scores(output.reshape(output.shape[0], -1))


def _as_scores(values: torch.Tensor) -> torch.Tensor:
    """Scores in float32, or float64 for a model computing in float64 (its differences keep their precision, as
    with the plain libraries the drop-ins stand in for)."""
    return values if values.dtype == torch.float64 else values.float()


__all__ = ["OUTPUTS", "Reducer", "Target", "batch_size", "check_output", "reduced", "resolve"]
