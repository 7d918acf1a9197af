"""Occlusion heat maps from the runner: the runner set up for one input and one target (:class:`TargetRunner`),
and the drops of windows and features.

Shared by the occlusion front end (:mod:`incrinf.explain.occlusion`) and the drill-down's two stages
(:mod:`incrinf.explain.approx`); it knows nothing of approximation settings or error estimates.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from incrinf.explain import targets
from incrinf.explain.runner import OcclusionRunner, RunStats
from incrinf.graph import NodeKind
from incrinf.validation import check_spatial_dims


def infer_spatial_dims(model: nn.Module, image: Any, spatial_dims: int | None = None) -> int:
    """The input's number of spatial axes: ``spatial_dims`` if given, else that of the model's first convolution
    module, else from the tensor's rank (2 axes: a signal (C, L); 3 or 4: an image; 5: a volume).

    Raises:
        ValueError: an unsupported number of spatial axes.
    """
    if spatial_dims is not None:
        return check_spatial_dims(spatial_dims)
    if isinstance(model, nn.Module):
        for module in model.modules():
            if isinstance(module, nn.modules.conv._ConvNd):
                return check_spatial_dims(len(module.kernel_size))
    rank = image.dim() if isinstance(image, torch.Tensor) else 3
    if rank not in (2, 3, 4, 5):
        raise ValueError(f"incrinf explains inputs with 1, 2 or 3 spatial axes: (C, L), (C, H, W) or (C, D, H, W), "
                         f"with an optional batch axis of 1; got a tensor of shape {tuple(image.shape)}")
    return {2: 1, 3: 2, 4: 2, 5: 3}[rank]


def check_batch_size(batch_size: Any) -> int | str:
    """A positive int or ``"auto"``."""
    if batch_size == "auto":
        return "auto"
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int or 'auto', got {batch_size!r}")
    return batch_size


def drops(base: torch.Tensor, scores: torch.Tensor) -> np.ndarray:
    """Unoccluded minus occluded scores: (N,) from a scalar base, (K, N) from a (K,) base and (N, K) scores."""
    drop = base - scores
    return (drop.transpose(0, 1) if drop.dim() == 2 else drop).cpu().numpy()


@dataclass
class TargetRunner:
    """The runner for one input, with the target's scores of the unoccluded input.

    Attributes:
        runner: the :class:`~incrinf.explain.runner.OcclusionRunner` (graph, engine, tau, feature threshold).
        target: the resolved :class:`~incrinf.explain.targets.Target`.
        base: the target's score of the unoccluded input: () or (K,) for ``"all"``.
        predicted: the output index with the largest unoccluded score (tensor outputs), else None.
    """

    runner: OcclusionRunner
    target: targets.Target
    base: torch.Tensor
    predicted: int | None

    @classmethod
    def build(cls, model: nn.Module, image: torch.Tensor, target: Any, output: str, tau: float = 1.0,
              feature_threshold: float = 0.0, warn: bool = True) -> TargetRunner:
        """Trace ``model`` on ``image`` (1, C, *spatial) and resolve ``target`` against its output.

        Args:
            warn: warn when the model has no spatial layers (nothing to reuse).
        """
        runner = OcclusionRunner(model, image, tau=tau, feature_threshold=feature_threshold)
        if warn and not any(n.kind == NodeKind.LOCAL for n in runner.graph.nodes):
            warnings.warn("the model has no spatial (convolution or pooling) layers: incremental inference "
                          "cannot reuse anything, every position costs a full inference", stacklevel=3)
        spec = targets.resolve(target, runner.base_output, output)
        out = runner.base_output
        predicted = int(out.reshape(out.shape[0], -1)[0].argmax()) if isinstance(out, torch.Tensor) and out.dim() \
            else None
        return cls(runner, spec, spec.scores(out)[0], predicted)

    def batch_size(self, batch_size: int | str) -> int | None:
        """Positions per batch: ``batch_size``, or None for ``"auto"`` (the plan sizes its batches to the memory
        budget given to :meth:`windows` / :meth:`features`)."""
        if check_batch_size(batch_size) == "auto":
            return None
        return int(batch_size)

    def window_scores(self, positions: np.ndarray, window: tuple[int, ...], baseline: Any, batch_size: int | None,
                      progress: bool = False, desc: str = "occlusion", memory: int | None = None, *,
                      channels: torch.Tensor | None = None) -> tuple[torch.Tensor, RunStats]:
        """The target's scores with each window occluded: (N,), or (N, K) for ``"all"``, and the run's counts.

        Args:
            positions: (N, d) window corners.
            window: (d,) window size.
            batch_size: positions per batch, or None to fill ``memory`` bytes of working memory.
            channels: optional (N, C) bool, the channels each window occludes (all when None).
        """
        return self.runner.run(positions, window, baseline, channels, batch_size=batch_size, progress=progress,
                               desc=desc, reduce=self.target.scores, memory=memory)

    def windows(self, positions: np.ndarray, window: tuple[int, ...], baseline: Any, batch_size: int | None,
                progress: bool = False, desc: str = "occlusion", memory: int | None = None, *,
                channels: torch.Tensor | None = None) -> tuple[np.ndarray, RunStats]:
        """Drops with each window occluded: (N,), or (K, N) for ``"all"``, and the run's counts (arguments as
        :meth:`window_scores`)."""
        scores, run = self.window_scores(positions, window, baseline, batch_size, progress, desc, memory,
                                         channels=channels)
        return drops(self.base, scores), run

    def features(self, mask: torch.Tensor, baseline: Any, batch_size: int | None, progress: bool = False,
                 desc: str = "features", memory: int | None = None) -> tuple[np.ndarray, np.ndarray, RunStats]:
        """Drops with each feature of ``mask`` occluded: the sorted feature ids (F,), the drops (F,) or (K, F),
        and the run's counts."""
        ids, scores, run = self.runner.run_features(mask, baseline, batch_size=batch_size, progress=progress,
                                                    desc=desc, reduce=self.target.scores, memory=memory)
        return ids, drops(self.base, scores), run


__all__ = ["TargetRunner", "check_batch_size", "drops", "infer_spatial_dims"]
