"""Drop-ins for ``captum.attr.Occlusion`` and ``captum.attr.FeatureAblation`` computed by incremental inference.

Swap ``from captum.attr import Occlusion, FeatureAblation`` for ``from incrinf.captum import Occlusion,
FeatureAblation``. Both are subclasses of Captum's classes (``isinstance(..., captum.attr.Attribution)`` holds and
every other method is Captum's own), with the same ``attribute`` signature and semantics: window counts
``ceil((dim - window) / stride) + 1`` with windows cropped at the far edge, occlusion attribution = the mean over
the windows covering an element of ``initial output - occluded output`` for ``target``; feature ablation gives
every element its feature's output difference. Inputs of 1, 2 or 3 spatial axes ((N, C, L), (N, C, H, W),
(N, C, D, H, W)) run incrementally; whatever cannot (a plain function, several input tensors, extra forward
arguments, an untraceable model, a model that aggregates the batch) is computed by Captum itself, with a warning.

``attribute`` carries Captum's usage-logging decorator, so Captum's wrappers work around the drop-ins as around
Captum's own classes (``NoiseTunnel`` calls ``attribute.__wrapped__``); the attributions are plain tensors of the
inputs' shape, which ``captum.attr.visualization.visualize_image_attr`` draws after a move of the channel axis.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from incrinf.errors import CaptureError
from incrinf.explain.heatmaps import TargetRunner
from incrinf.extras import require
from incrinf.graph import captured_graph

_attr = require("captum.attr", "captum", "the Captum drop-ins")
# Captum decorates every ``attribute`` with ``log_usage`` (a functools.wraps wrapper); its wrappers rely on that:
# ``NoiseTunnel`` calls ``attribution_method.attribute.__wrapped__`` to skip the inner logging
_log_usage = require("captum.log", "captum", "the Captum drop-ins").log_usage


class Occlusion(_attr.Occlusion):
    """Occlusion attribution (Captum's API) by batched incremental inference.

    Args:
        forward_func: the model (an ``nn.Module`` that ``torch.fx`` can trace) or any callable (then Captum
            computes the result).

    Attributes:
        last_stats: per example of the last incremental ``attribute`` call, the run's statistics (positions,
            seconds, theoretical speedup, ...).
    """

    def __init__(self, forward_func: Any) -> None:
        super().__init__(forward_func)
        self.last_stats: list[dict] = []

    @_log_usage()
    def attribute(  # type: ignore[override]
        self,
        inputs: torch.Tensor | tuple[torch.Tensor, ...],
        sliding_window_shapes: tuple[int, ...] | tuple[tuple[int, ...], ...],
        strides: int | tuple[int, ...] | None = None,
        baselines: float | int | torch.Tensor | None = None,
        target: Any = None,
        additional_forward_args: Any = None,
        perturbations_per_eval: int = 1,
        show_progress: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Attributions with the shape of ``inputs`` (see ``captum.attr.Occlusion.attribute``).

        Args:
            inputs: ``(N, C, *spatial)`` batch of examples, 1-3 spatial axes (or a tuple holding one such tensor).
            sliding_window_shapes: window shape including the channel axis, e.g. ``(3, 16, 16)``.
            strides: int or a tuple like the window shape (default 1).
            baselines: occluding values: scalar or a tensor broadcastable to ``inputs`` (default 0).
            target: output index per example: int, tuple, list or tensor (one per example), or ``None``
                for models with one output per example.
            additional_forward_args: extra forward arguments (computed by Captum).
            perturbations_per_eval: windows per packed batch.
            show_progress: show a progress bar.

        Returns:
            Attributions, same shape and dtype as ``inputs``.
        """
        tensor, as_tuple = _single(inputs)
        reason = _why_plain(self.forward_func, tensor, additional_forward_args)
        if reason is not None:
            _warn_plain(reason, "Occlusion")
            return super().attribute(inputs, sliding_window_shapes, strides=strides, baselines=baselines,
                                     target=target, additional_forward_args=additional_forward_args,
                                     perturbations_per_eval=perturbations_per_eval, show_progress=show_progress)
        window, stride = _window_and_stride(tensor, sliding_window_shapes, strides)
        batch = _per_eval(perturbations_per_eval)
        self.last_stats = []
        attributions = torch.zeros_like(tensor)
        for i in range(tensor.shape[0]):
            attributions[i] = self._one(tensor[i:i + 1], window, stride, _baseline_for(baselines, tensor, i),
                                        _target_for(target, i, tensor.shape[0]), batch, show_progress)
        return (attributions,) if as_tuple else attributions

    def _one(self, image: torch.Tensor, window: tuple[int, ...], stride: tuple[int, ...],
             baseline: torch.Tensor | float, target: Any, batch: int, progress: bool) -> torch.Tensor:
        shape = tuple(image.shape[1:])  # (C, *spatial)
        counts = [math.ceil((dim - win) / st) + 1 for dim, win, st in zip(shape, window, stride)]
        corners = np.stack([c.ravel() for c in np.meshgrid(*[np.arange(n) * st for n, st in zip(counts, stride)],
                                                           indexing="ij")], axis=1)
        channels = None
        if window[0] < shape[0]:
            ch = torch.arange(shape[0]).view(1, -1)
            c0 = torch.from_numpy(corners[:, 0]).view(-1, 1)
            channels = (ch >= c0) & (ch < c0 + window[0])
        scoring = _scoring(self.forward_func, image, target)
        diffs, stats = scoring.windows(corners[:, 1:], window[1:], baseline, batch, progress, "incrinf occlusion",
                                       channels=channels)
        self.last_stats.append(stats.as_dict())
        diffs = torch.from_numpy(diffs).to(image.dtype)
        total = torch.zeros(shape, dtype=image.dtype, device=image.device)
        weight = torch.zeros(shape, dtype=image.dtype, device=image.device)
        for corner, d in zip(corners, diffs.tolist()):
            sl = tuple(slice(int(c), int(c) + w) for c, w in zip(corner, window))
            total[sl] += d
            weight[sl] += 1
        return total / weight


class FeatureAblation(_attr.FeatureAblation):
    """Feature ablation (Captum's API) by batched incremental inference: each feature of the mask is occluded at
    once, its update region the bounding box of its elements.

    Args:
        forward_func: the model (an ``nn.Module`` that ``torch.fx`` can trace) or any callable (then Captum
            computes the result).

    Attributes:
        last_stats: per example of the last incremental ``attribute`` call, the run's statistics.
    """

    def __init__(self, forward_func: Any) -> None:
        super().__init__(forward_func)
        self.last_stats: list[dict] = []

    @_log_usage()
    def attribute(  # type: ignore[override]
        self,
        inputs: torch.Tensor | tuple[torch.Tensor, ...],
        baselines: float | int | torch.Tensor | None = None,
        target: Any = None,
        additional_forward_args: Any = None,
        feature_mask: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        perturbations_per_eval: int = 1,
        show_progress: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Attributions with the shape of ``inputs`` (see ``captum.attr.FeatureAblation.attribute``).

        Args:
            inputs: ``(N, C, *spatial)`` batch of examples, 1-3 spatial axes (or a tuple holding one such tensor).
            baselines: ablating values: scalar or a tensor broadcastable to ``inputs`` (default 0).
            target: output index per example: int, tuple, list or tensor, or ``None`` for one output per example.
            additional_forward_args: extra forward arguments (computed by Captum).
            feature_mask: integer feature ids broadcastable to ``inputs`` (one mask for all examples, or one per
                example along the first axis); ``None``: every element is its own feature.
            perturbations_per_eval: features per packed batch.
            show_progress: show a progress bar.
            **kwargs: passed to Captum (which then computes the result).

        Returns:
            Attributions, the shape of ``inputs``, the dtype of the model's output.
        """
        tensor, as_tuple = _single(inputs)
        masks, _ = _single(feature_mask) if feature_mask is not None else (None, False)
        reason = _why_plain(self.forward_func, tensor, additional_forward_args)
        if reason is None and kwargs:
            reason = f"extra arguments {sorted(kwargs)}"
        if reason is None and feature_mask is not None and not isinstance(masks, torch.Tensor):
            reason = "a feature mask for several input tensors"
        if reason is None:
            masks, reason = _masks(masks, tensor)
        if reason is not None:
            _warn_plain(reason, "FeatureAblation")
            return super().attribute(inputs, baselines=baselines, target=target,
                                     additional_forward_args=additional_forward_args, feature_mask=feature_mask,
                                     perturbations_per_eval=perturbations_per_eval, show_progress=show_progress,
                                     **kwargs)
        batch = _per_eval(perturbations_per_eval)
        self.last_stats = []
        parts = []
        for i in range(tensor.shape[0]):
            parts.append(self._one(tensor[i:i + 1], masks[i if masks.shape[0] > 1 else 0],
                                   _baseline_for(baselines, tensor, i), _target_for(target, i, tensor.shape[0]),
                                   batch, show_progress))
        attributions = torch.cat(parts)
        return (attributions,) if as_tuple else attributions

    def _one(self, image: torch.Tensor, mask: torch.Tensor, baseline: torch.Tensor | float, target: Any, batch: int,
             progress: bool) -> torch.Tensor:
        scoring = _scoring(self.forward_func, image, target)
        features, diffs, stats = scoring.features(mask, baseline, batch, progress, "incrinf ablation")
        self.last_stats.append(stats.as_dict())
        diffs = torch.from_numpy(diffs).to(image.device)  # (F,)
        index = torch.from_numpy(np.searchsorted(features, mask.cpu().numpy())).to(diffs.device)
        per_element = diffs[index]  # (C or 1, *spatial)
        return per_element.expand(image.shape[1:]).unsqueeze(0).clone()


def _single(inputs: Any) -> tuple[Any, bool]:
    """The one tensor of ``inputs`` (a tensor or a one-tuple) and whether it came in a tuple."""
    if isinstance(inputs, tuple) and len(inputs) == 1:
        return inputs[0], True
    return inputs, False


def _why_plain(forward_func: Any, inputs: Any, extra: Any) -> str | None:
    """Why Captum must compute this call itself, or None when incrinf can."""
    if not isinstance(forward_func, nn.Module):
        return "it is not an nn.Module"
    if not isinstance(inputs, torch.Tensor):
        return "several input tensors"
    if not 3 <= inputs.dim() <= 5:
        return f"inputs of rank {inputs.dim()} (expected N x C x L, N x C x H x W or N x C x D x H x W)"
    if extra is not None:
        return "additional_forward_args"
    if not inputs.is_floating_point():
        return f"inputs of dtype {inputs.dtype}"
    try:
        graph = captured_graph(forward_func, inputs.shape[1:])
    except CaptureError as exc:
        return str(exc)
    shape = graph.output.shape
    if shape is None or len(shape) == 0 or shape[0] != 1:
        return "the model does not return one output per example (it aggregates the batch)"
    return None


def _warn_plain(reason: str, name: str) -> None:
    warnings.warn(f"incrinf cannot capture this forward function ({reason}); computing the same result with "
                  f"captum.attr.{name}, without incremental inference", stacklevel=3)


def _per_eval(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"perturbations_per_eval must be a positive int, got {value!r}")
    return value


def _masks(mask: torch.Tensor | None, inputs: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
    """Feature masks as (N or 1, C or 1, *spatial) int64, or a reason to let Captum handle them."""
    n, shape = inputs.shape[0], tuple(inputs.shape[1:])
    if mask is None:  # every element its own feature
        return torch.arange(math.prod(shape), device=inputs.device).view(1, *shape), None
    if mask.is_floating_point() or mask.is_complex():
        return None, f"a feature mask of dtype {mask.dtype}"
    mask = mask.view(*([1] * (inputs.dim() - mask.dim())), *mask.shape) if mask.dim() < inputs.dim() else mask
    if mask.dim() != inputs.dim() or mask.shape[0] not in (1, n) or mask.shape[1] not in (1, shape[0]) \
            or any(m not in (1, s) for m, s in zip(mask.shape[2:], shape[1:])):
        return None, f"a feature mask of shape {tuple(mask.shape)} for inputs of shape {tuple(inputs.shape)}"
    full = mask.expand(mask.shape[0], mask.shape[1], *shape[1:])
    return full.to(device=inputs.device, dtype=torch.int64), None


def _window_and_stride(inputs: torch.Tensor, window: Any, strides: Any
                       ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    rank = inputs.dim() - 1
    axes = {2: "(C, L)", 3: "(C, H, W)", 4: "(C, D, H, W)"}[rank]
    if isinstance(window, Sequence) and len(window) == 1 and isinstance(window[0], Sequence):
        window = window[0]
    if not isinstance(window, Sequence) or len(window) != rank or not all(isinstance(v, int) for v in window):
        raise ValueError(f"sliding_window_shapes must be {axes} for inputs of shape {tuple(inputs.shape)}, "
                         f"got {window!r}")
    if strides is None:
        strides = 1
    if isinstance(strides, Sequence) and len(strides) == 1 and isinstance(strides[0], (Sequence, int)):
        strides = strides[0]
    stride = (strides,) * rank if isinstance(strides, int) else tuple(strides)
    if len(stride) != rank or not all(isinstance(v, int) and v >= 1 for v in stride):
        raise ValueError(f"strides must be a positive int or {axes}, got {strides!r}")
    dims = inputs.shape[1:]
    for dim, win, st in zip(dims, window, stride):
        if not 1 <= win <= dim:
            raise ValueError(f"sliding window {tuple(window)} does not fit inputs of shape {tuple(dims)}")
        if win < dim and st > win:
            raise ValueError(f"stride {st} cannot be larger than the sliding window dimension {win}")
    return tuple(window), stride


def _baseline_for(baselines: Any, inputs: torch.Tensor, i: int) -> torch.Tensor | float:
    if baselines is None:
        return 0.0
    if isinstance(baselines, (int, float)) and not isinstance(baselines, bool):
        return float(baselines)
    if isinstance(baselines, torch.Tensor):
        if baselines.numel() == 1:
            return float(baselines)
        full = torch.broadcast_to(baselines, inputs.shape) if baselines.dim() == inputs.dim() \
            else torch.broadcast_to(baselines, inputs.shape[1:]).unsqueeze(0).expand_as(inputs)
        return full[i:i + 1]
    raise TypeError(f"baselines must be a number or a tensor, got {type(baselines).__name__}")


def _target_for(target: Any, i: int, n: int) -> Any:
    if target is None or isinstance(target, (int, np.integer)) or (
            isinstance(target, tuple) and all(isinstance(t, int) for t in target)):
        return target
    if isinstance(target, torch.Tensor):
        if target.numel() == 1:
            return int(target)
        return int(target[i])
    if isinstance(target, list):
        if len(target) != n:
            raise ValueError(f"target list has {len(target)} entries for {n} examples")
        return target[i]
    raise TypeError(f"unsupported target {target!r}")


def _scoring(model: nn.Module, image: torch.Tensor, target: Any) -> TargetRunner:
    """The explain front end's runner for one example, scoring Captum's ``target`` (an index into each output
    row, or None for one output per example)."""
    return TargetRunner.build(model, image.detach(), lambda out: _select(out, target), "logit", warn=False)


def _select(out: torch.Tensor, target: Any) -> torch.Tensor:
    """(N,) the target entry of each output row."""
    if target is None:
        if out[0].numel() != 1:
            raise ValueError("target is required for a model with more than one output per example")
        return out.reshape(out.shape[0])
    index = (target,) if isinstance(target, (int, np.integer)) else tuple(target)
    return out[(slice(None), *index)]


__all__ = ["FeatureAblation", "Occlusion"]
