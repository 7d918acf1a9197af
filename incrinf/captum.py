"""A drop-in for ``captum.attr.Occlusion`` computed by incremental inference.

Swap ``from captum.attr import Occlusion`` for ``from incrinf.captum import Occlusion``: same constructor,
same ``attribute`` signature and semantics (window counts ``ceil((dim - window) / stride) + 1``, windows
cropped at the far edge, attribution = mean over the windows covering an element of
``initial output - occluded output`` for ``target``). Whatever cannot be captured (a plain function, several
input tensors, extra forward arguments, an untraceable model) is computed by Captum itself, with a warning.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from incrinf.errors import CaptureError
from incrinf.explain.runner import OcclusionRunner
from incrinf.graph import captured_graph


class Occlusion:
    """Occlusion attribution (Captum's API) by batched incremental inference.

    Args:
        forward_func: the model (an ``nn.Module`` that ``torch.fx`` can trace) or any callable (then Captum
            computes the result).
    """

    def __init__(self, forward_func: Callable[..., torch.Tensor]) -> None:
        self.forward_func = forward_func
        self.last_stats: list[dict] = []

    def attribute(
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
            inputs: (N, C, H, W) batch of examples.
            sliding_window_shapes: window shape including the channel dimension, e.g. ``(3, 16, 16)``.
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
        reason = self._why_plain(inputs, sliding_window_shapes, additional_forward_args)
        if reason is None:
            try:
                captured_graph(self.forward_func, inputs.shape[1:])
            except CaptureError as exc:
                reason = str(exc)
        if reason is not None:
            warnings.warn(f"incrinf cannot capture this forward function ({reason}); computing the same "
                          "result with captum.attr.Occlusion, without incremental inference", stacklevel=2)
            from captum.attr import Occlusion as CaptumOcclusion

            return CaptumOcclusion(self.forward_func).attribute(
                inputs, sliding_window_shapes, strides=strides, baselines=baselines, target=target,
                additional_forward_args=additional_forward_args, perturbations_per_eval=perturbations_per_eval,
                show_progress=show_progress)
        window, stride = _window_and_stride(inputs, sliding_window_shapes, strides)
        if isinstance(perturbations_per_eval, bool) or not isinstance(perturbations_per_eval, int) \
                or perturbations_per_eval < 1:
            raise ValueError(f"perturbations_per_eval must be a positive int, got {perturbations_per_eval!r}")
        self.last_stats = []
        attributions = torch.zeros_like(inputs)
        for i in range(inputs.shape[0]):
            attributions[i] = self._one(inputs[i:i + 1], window, stride, _baseline_for(baselines, inputs, i),
                                        _target_for(target, i, inputs.shape[0]), perturbations_per_eval,
                                        show_progress)
        return attributions

    def _why_plain(self, inputs: Any, window: Any, extra: Any) -> str | None:
        if not isinstance(self.forward_func, nn.Module):
            return "it is not an nn.Module"
        if not isinstance(inputs, torch.Tensor):
            return "several input tensors"
        if inputs.dim() != 4:
            return f"inputs of rank {inputs.dim()} (expected N x C x H x W)"
        if extra is not None:
            return "additional_forward_args"
        if not inputs.is_floating_point():
            return f"inputs of dtype {inputs.dtype}"
        return None

    def _one(self, image: torch.Tensor, window: tuple[int, int, int], stride: tuple[int, int, int],
             baseline: torch.Tensor | float, target: Any, batch: int, progress: bool) -> torch.Tensor:
        c, h, w = image.shape[1:]
        counts = [math.ceil((dim - win) / st) + 1 for dim, win, st in zip((c, h, w), window, stride)]
        starts = [np.arange(n) * st for n, st in zip(counts, stride)]
        cy, yy, xx = np.meshgrid(*starts, indexing="ij")
        cy, yy, xx = cy.ravel(), yy.ravel(), xx.ravel()
        channels = None
        if window[0] < c:
            ch = torch.arange(c).view(1, c)
            c0 = torch.from_numpy(cy).view(-1, 1)
            channels = (ch >= c0) & (ch < c0 + window[0])
        runner = OcclusionRunner(self.forward_func, image.detach())
        base = _select(runner.base_output, target)
        outputs, stats = runner.run(np.stack([yy, xx], 1), window[1:], baseline, channels, batch, progress,
                                    desc="incrinf occlusion")
        self.last_stats.append(stats.as_dict())
        diffs = (base - _select(outputs, target)).to(image.dtype)
        total = torch.zeros(c, h, w, dtype=image.dtype, device=image.device)
        weight = torch.zeros(c, h, w, dtype=image.dtype, device=image.device)
        for k, d in enumerate(diffs.tolist()):
            sl = (slice(cy[k], cy[k] + window[0]), slice(yy[k], yy[k] + window[1]), slice(xx[k], xx[k] + window[2]))
            total[sl] += d
            weight[sl] += 1
        return total / weight


def _window_and_stride(inputs: torch.Tensor, window: Any, strides: Any
                       ) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    if isinstance(window, Sequence) and len(window) == 1 and isinstance(window[0], Sequence):
        window = window[0]
    if not isinstance(window, Sequence) or len(window) != 3 or not all(isinstance(v, int) for v in window):
        raise ValueError(f"sliding_window_shapes must be (C, H, W) for N x C x H x W inputs, got {window!r}")
    if strides is None:
        strides = 1
    if isinstance(strides, Sequence) and len(strides) == 1 and isinstance(strides[0], (Sequence, int)):
        strides = strides[0]
    stride = (strides,) * 3 if isinstance(strides, int) else tuple(strides)
    if len(stride) != 3 or not all(isinstance(v, int) and v >= 1 for v in stride):
        raise ValueError(f"strides must be a positive int or (C, H, W), got {strides!r}")
    dims = inputs.shape[1:]
    for dim, win, st in zip(dims, window, stride):
        if not 1 <= win <= dim:
            raise ValueError(f"sliding window {tuple(window)} does not fit inputs of shape {tuple(dims)}")
        if win < dim and st > win:
            raise ValueError(f"stride {st} cannot be larger than the sliding window dimension {win}")
    return tuple(window), stride  # type: ignore[return-value]


def _baseline_for(baselines: Any, inputs: torch.Tensor, i: int) -> torch.Tensor | float:
    if baselines is None:
        return 0.0
    if isinstance(baselines, (int, float)):
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


def _select(out: torch.Tensor, target: Any) -> torch.Tensor:
    """(N,) the target entry of each output row."""
    if target is None:
        if out[0].numel() != 1:
            raise ValueError("target is required for a model with more than one output per example")
        return out.reshape(out.shape[0])
    index = (target,) if isinstance(target, (int, np.integer)) else tuple(target)
    return out[(slice(None), *index)]
