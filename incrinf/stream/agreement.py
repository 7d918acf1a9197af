"""How close a cached frame's output is to full inference: what the quality guard measures on audit frames.

A model's output is compared through its *primary tensor* (the tensor itself; ``out["out"]`` or the first tensor
of a dict, as torchvision's segmentation models return; the first tensor of a tuple or list). Its shape says what
agreement means:

- (1, classes): a classifier; the frames agree when their top-1 classes do;
- (1, classes, *positions): a dense map (segmentation, a detector's score map); the share of positions whose argmax
  over the classes agrees (for one channel, the sign: a logit or a centred score).

Besides agreement, every comparison has the relative error ``||cached - full|| / ||full||`` and a *risk*: how
close the cached output came to missing the target, 1 at the target (a classifier's top-1 flip; a map's agreement
at ``target_agreement``), 0 for an exact match. The guard relaxes only when the risk extrapolated to a longer
audit interval stays well under 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

_RIVALS = 6  # the top-1 class and the five classes that compete with it


class OutputKind(str, Enum):
    """What agreement means for a model's output."""

    LABEL = "top-1"
    MAP = "pixels"


@dataclass(frozen=True)
class Comparison:
    """One audited frame: the cached path's output against full inference.

    Attributes:
        kind: label (classifier) or map (dense output).
        agreement: 1.0 or 0.0 for a label (same top-1), the share of agreeing positions for a map.
        relative_error: ``||cached - full|| / ||full||`` of the primary tensors.
        risk: 1 at the target, 0 for an exact match; a label's is the share of the full output's top-1 margin
            (to the class that came closest) the cached output used up, >= 1 exactly when the top-1 flipped.
        lead_lost: a label's largest change, either way, of the top-1 class's lead over one of its five closest
            rivals, in output units (a cached output whose own top-1 margin is below it may have flipped); NaN for
            a map. Either way: an audit where the cache happened to err in the top class's favour measures how far
            the cache is off as well as one where it erred against it.
        pair_lost: a label's signed change of the full output's top-1 class's lead over each of its five closest
            rivals, ``((top, rival), full lead - cached lead)`` (positive: the cached output's lead was smaller),
            closest rival first; empty for a map. A class several logits behind may move a lot without mattering:
            a cached output's lead over each of its rivals is held against what that pair lost
            (:meth:`~incrinf.stream.guards.QualityGuard.risky`).
    """

    kind: OutputKind
    agreement: float
    relative_error: float
    risk: float
    lead_lost: float = math.nan
    pair_lost: tuple[tuple[tuple[int, int], float], ...] = ()


@dataclass(frozen=True)
class Leads:
    """A label output's top-1 class and its lead over each of its closest rivals (output units, closest first):
    what the quality guard holds against the lead each class pair was measured to lose."""

    top: int
    rivals: tuple[int, ...]
    leads: tuple[float, ...]

    @property
    def margin(self) -> float:
        """The lead over the runner-up (``inf`` without rivals)."""
        return self.leads[0] if self.leads else math.inf


def primary_tensor(out: Any) -> torch.Tensor:
    """The tensor of a model output that agreement is measured on.

    Raises:
        TypeError: the output holds no tensor.
    """
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        if isinstance(out.get("out"), torch.Tensor):
            return out["out"]
        values = list(out.values())
    elif isinstance(out, (list, tuple)):
        values = list(out)
    else:
        values = []
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"cannot compare model outputs of type {type(out).__name__}: no tensor in it (the quality "
                    "guard needs a tensor, a dict with 'out' or a tuple of tensors; set quality_guard=False)")


def output_kind(tensor: torch.Tensor) -> OutputKind:
    """Label for (1, classes) or (1, classes) plus size-one axes, map when positions follow the classes."""
    if tensor.dim() >= 3 and any(s > 1 for s in tensor.shape[2:]):
        return OutputKind.MAP
    return OutputKind.LABEL


def compare(cached: Any, full: Any, target_agreement: float, target_error: float | None = None) -> Comparison:
    """Compare the cached path's output for a frame with full inference's.

    Args:
        cached, full: the two outputs (any structure :func:`primary_tensor` reads), batch size 1.
        target_agreement: the guard's target (for a map, the agreement at which ``risk`` is 1).
        target_error: optional relative-error bound (``risk`` is at least ``relative_error / target_error``).

    Raises:
        ValueError: outputs of different shapes.
    """
    a, b = primary_tensor(cached).detach().float(), primary_tensor(full).detach().float()
    if a.shape != b.shape:
        raise ValueError(f"outputs differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    kind = output_kind(b)
    norm = float(b.norm())
    relative = float((a - b).norm()) / norm if norm > 0 else float(a.norm() > 0) * math.inf
    lead_lost, pair_lost = math.nan, ()
    if kind == OutputKind.LABEL:
        a, b = a.reshape(-1), b.reshape(-1)
        agreement = float(int(a.argmax()) == int(b.argmax()))
        risk, lead_lost, pair_lost = _margin_used(a, b)
    else:
        agreement = float(_labels(a).eq(_labels(b)).float().mean())
        budget = 1.0 - target_agreement
        risk = (1.0 - agreement) / budget if budget > 0 else (math.inf if agreement < 1.0 else 0.0)
    if target_error is not None:
        risk = max(risk, relative / target_error)
    return Comparison(kind, agreement, relative, risk, lead_lost, pair_lost)


def top1_margin(out: Any) -> float:
    """A label output's lead of its top-1 class over the second (``inf`` for one class; NaN for a map)."""
    x = primary_tensor(out).detach()
    if output_kind(x) == OutputKind.MAP:
        return math.nan
    x = x.reshape(-1)
    if x.numel() < 2:
        return math.inf
    top = x.float().topk(2).values
    return float(top[0] - top[1])


def top_leads(out: Any) -> Leads | None:
    """A label output's top-1 class and its leads over its five closest rivals (None for a map)."""
    x = primary_tensor(out).detach()
    if output_kind(x) == OutputKind.MAP:
        return None
    x = x.reshape(-1).float()
    values, indices = x.topk(min(_RIVALS, x.numel()))
    return Leads(int(indices[0]), tuple(int(i) for i in indices[1:]), tuple(float(values[0] - v) for v in values[1:]))


def _labels(x: torch.Tensor) -> torch.Tensor:
    """Per-position labels of a (1, classes, *positions) map."""
    return x[:, 0] > 0 if x.shape[1] == 1 else x.argmax(dim=1)


def _margin_used(cached: torch.Tensor, full: torch.Tensor) \
        -> tuple[float, float, tuple[tuple[tuple[int, int], float], ...]]:
    """``(share, amount, pairs)``: how much of the full output's lead of its top-1 class over every other class the
    cached output lost, as a share of that lead (max over the classes: >= 1 exactly when another class caught up),
    and the largest change of that lead either way, in output units, over the classes that compete for the top (the
    full output's top five: a class far behind may move a lot without mattering), and that change, signed, per
    pair of the top class and one of those rivals (:attr:`Comparison.pair_lost`)."""
    top = int(full.argmax())
    lead = full[top] - full  # >= 0
    lost = lead - (cached[top] - cached)
    lead[top] = math.inf
    used = (lost / lead.clamp_min(1e-12)).max()
    rivals = full.topk(min(_RIVALS, full.numel())).indices
    pairs = tuple(((top, int(j)), float(lost[j])) for j in rivals[1:])
    return max(float(used), 0.0), float(lost[rivals].abs().max()), pairs
