"""The exact occlusion front end: heat maps by batched incremental inference (Krypton) for 1-D signals, 2-D images
and 3-D volumes; sliding windows or the features of a mask; one output index, every index, or a reducer of the
model's output (dense models); any occluder (:mod:`incrinf.explain.occluders`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from incrinf.analysis import grid_shape, occlusion_grid
from incrinf.explain import targets
from incrinf.explain.pictures import DEFAULT_CMAP, save_heatmap
from incrinf.explain.runner import OcclusionRunner, RunStats, estimate_batch_size, feature_boxes
from incrinf.graph import NodeKind
from incrinf.validation import (
    check_feature_mask,
    check_feature_threshold,
    check_input,
    check_patch,
    check_spatial_dims,
    check_stride,
    check_tau,
    parse_bytes,
)


@dataclass
class OcclusionResult:
    """An occlusion heat map.

    Attributes:
        heatmap: score of the unoccluded input minus the occluded one (a drop is positive), one value per position
            of the occlusion grid, shape ``grid`` (e.g. (rows, cols); (depth, rows, cols) for volumes); for
            ``target="all"`` one map per output index, ``(K, *grid)``. Feature-mask runs: one value per feature, (F,)
            (or (K, F)), in the order of :attr:`features`.
        positions: (N, d) first corners of the windows, row-major (feature runs: each feature's bounding-box
            corner).
        target: the explained output index, ``"all"``, or the reducer's name.
        patch: (d,) window size (feature runs: ``()``).
        stride: (d,) window stride (feature runs: ``()``).
        image_shape: (d,) spatial extents of the explained input.
        stats: positions, batches, seconds, theoretical speedup and realized FLOP ratio, peak memory, tau.
        fine: ``(*grid)`` bool, which cells were computed at the requested stride (all, for exact runs).
        features: (F,) the mask's feature ids (feature runs only).
        feature_mask: ``(C or 1, *spatial)`` the feature mask (feature runs only).
        predicted: the output index with the largest unoccluded score (tensor outputs), else None.
    """

    heatmap: np.ndarray
    positions: np.ndarray
    target: int | str
    patch: tuple[int, ...]
    stride: tuple[int, ...]
    image_shape: tuple[int, ...]
    stats: dict[str, Any] = field(default_factory=dict)
    fine: np.ndarray | None = None
    features: np.ndarray | None = None
    feature_mask: np.ndarray | None = None
    predicted: int | None = None

    @property
    def every_class(self) -> bool:
        """Whether the heat map has a map per output index (``target="all"``)."""
        return self.target == "all"

    def pixel_map(self) -> np.ndarray:
        """Attribution per input element, shape ``image_shape`` (``(K, *image_shape)`` for ``"all"``).

        Windows: the mean heat of the windows covering an element (Captum's averaging). Features: the heat of
        the element's feature (channel-wise masks give ``(C, *image_shape)``).
        """
        heat = self.heatmap if self.every_class else self.heatmap[None]
        heat = heat.reshape(heat.shape[0], -1)
        if self.features is not None:
            index = np.searchsorted(self.features, self.feature_mask)
            out = heat[:, index]  # (K, C or 1, *spatial)
            out = out[:, 0] if self.feature_mask.shape[0] == 1 else out
        else:
            total = np.zeros((heat.shape[0], *self.image_shape), np.float64)
            count = np.zeros(self.image_shape, np.float64)
            for k, corner in enumerate(self.positions):
                window = tuple(slice(int(c), int(c) + p) for c, p in zip(corner, self.patch))
                total[(slice(None), *window)] += heat[:, k].reshape(-1, *([1] * len(window)))
                count[window] += 1
            out = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
        return out if self.every_class else out[0]

    def save(self, path: str | Path, image: np.ndarray | torch.Tensor | None = None, title: str | None = None,
             class_index: int | None = None, cmap: str = DEFAULT_CMAP, centre: float | None = 0.0) -> Path:
        """Write a PNG of the heat map with a colour bar: over the image (2-D), as a curve under the signal
        (1-D), or over a montage of slices (3-D).

        Args:
            path: output file.
            image: the input for display: 2-D an HxWx3 array in [0, 1] or uint8, or a (C, H, W) tensor in [0, 1];
                1-D (C, L); 3-D (C, D, H, W) or (D, H, W).
            title: optional figure title.
            class_index: with ``target="all"``, the class whose map to draw (default: the predicted class).
            cmap: a matplotlib colour map (default: diverging, red where occluding lowered the score, blue where
                it raised it, white at zero).
            centre: the value at the colour map's middle, limits symmetric about it; ``None``: the map spans the
                heat map's minimum to maximum (for a sequential map such as ``"viridis"``).

        Returns:
            The path written.
        """
        pixel = self.pixel_map()
        label = f"drop in {self.target}" if isinstance(self.target, str) else f"drop in class {self.target} score"
        if self.every_class:
            k = self.predicted if class_index is None else int(class_index)
            pixel, label = pixel[k or 0], f"drop in class {k or 0} score"
        if pixel.ndim == len(self.image_shape) + 1:  # a channel-wise feature mask: average the channels
            pixel = pixel.mean(axis=0)
        what = "features" if self.features is not None else \
            f"occlusion {'x'.join(map(str, self.patch))}, stride {'x'.join(map(str, self.stride))}"
        return save_heatmap(pixel, path, image, title or what, label, cmap=cmap, centre=centre)


def occlusion(
    model: nn.Module,
    image: torch.Tensor,
    target: Any = None,
    patch: int | tuple[int, ...] = 16,
    stride: int | tuple[int, ...] = 4,
    baseline: Any = 0.0,
    batch_size: int | str = "auto",
    max_memory: str | int = "2GiB",
    output: str = "logit",
    device: str | torch.device | None = None,
    progress: bool = True,
    tau: float = 1.0,
    feature_threshold: float = 0.0,
    *,
    feature_mask: Any = None,
    spatial_dims: int | None = None,
) -> OcclusionResult:
    """Occlusion heat map of ``model`` on ``image`` by batched incremental inference.

    With ``tau=1`` the heat map equals naive re-inference of every occluded input (to float tolerance), for every
    target, occluder and feature mask.

    Args:
        model: a ``torch.fx``-traceable model (eval mode is set): a classifier, or any model with a reducer target.
        image: the input without or with a batch axis of 1: (C, L) signals, (C, H, W) images, (C, D, H, W)
            volumes; float, already normalised for the model.
        target: what to explain: None (the predicted class), an int output index, ``"all"`` (a heat map per
            output index from one run), or a callable ``f(output) -> (N,)`` reducing a batch of the model's
            outputs to one value per example (e.g. a segmentation model's class-k logits summed over a region of
            interest: ``lambda out: (out["out"][:, k] * roi).sum((1, 2))``).
        patch: occlusion window size, an int or one per spatial axis.
        stride: window stride, an int or one per spatial axis.
        baseline: what replaces an occluded element: a number, a tensor broadcastable to the input,
            ``"mean_patch"`` (the mean of the occluded elements), ``"mean_img"`` (the input's mean), ``"gaussian"``
            (MONAI's Gaussian blend: multiplied by one minus a Gaussian centred on the window), or a function
            ``f(image, window_values) -> window_values``.
        batch_size: positions per batch, or "auto" to stay under ``max_memory``.
        max_memory: working-memory budget for "auto", e.g. "2GiB".
        output: "logit" or "prob" (softmax over each example's outputs; not with a reducer target).
        device: where to run (default: the input's device).
        progress: show a progress bar.
        tau: projective field threshold in (0, 1]; below 1 is approximate (faster).
        feature_threshold: value-based pruning: a recomputed position whose values moved by at most this share of
            its tensor's mean magnitude stops spreading its change; 0 (the default) is exact.
        feature_mask: occlude the features of this integer mask instead of sliding windows (Captum's
            ``FeatureAblation``): shape ``spatial``, or ``(C or 1, *spatial)``; every element with one id is
            occluded at once; ``patch`` and ``stride`` are then ignored.
        spatial_dims: the input's number of spatial axes (1, 2 or 3); default: that of the model's first
            convolution, else 2 for 3- and 4-axis tensors, 1 for 2-axis and 3 for 5-axis ones.

    Returns:
        An :class:`OcclusionResult`.

    Raises:
        TypeError / ValueError: bad input, patch, stride, target, reducer output, feature mask, baseline, batch
            size, output or memory budget, or an unsupported number of spatial axes.
        CaptureError: the model cannot be traced.
    """
    d = infer_spatial_dims(model, image, spatial_dims)
    image = check_input(image, d)
    if device is not None:
        image = image.to(device)
        model = model.to(device)
    dims = tuple(image.shape[2:])
    tau = check_tau(tau)
    feature_threshold = check_feature_threshold(feature_threshold)
    if output not in ("logit", "prob"):
        raise ValueError(f"output must be 'logit' or 'prob', got {output!r}")
    budget = parse_bytes(max_memory)
    mask = None if feature_mask is None else check_feature_mask(feature_mask, image)
    if mask is None:
        patch_size = check_patch(patch, dims)
        stride_size = check_stride(stride, d)
    runner = OcclusionRunner(model, image, tau=tau, feature_threshold=feature_threshold)
    _warn_if_no_reuse(runner)
    spec = targets.resolve(target, runner.base_output, output)
    base = spec.scores(runner.base_output)[0]
    predicted = _predicted(runner.base_output)
    if mask is not None:
        ids, corners, sizes = feature_boxes(mask)
        bs = _batch_size(batch_size, runner, tuple(int(s) for s in sizes.max(axis=0)), budget, tau)
        features, scores, stats = runner.run_features(mask, baseline, batch_size=bs, progress=progress,
                                                      desc=f"occlusion of {len(ids)} features", reduce=spec.scores)
        heat = _drops(base, scores)  # (F,) or (K, F)
        return OcclusionResult(heat, corners, spec.label, (), (), dims, _stats_dict(stats), None, features,
                               mask.cpu().numpy(), predicted)
    bs = _batch_size(batch_size, runner, patch_size, budget, tau)
    positions = occlusion_grid(dims, patch_size, stride_size)
    scores, stats = runner.run(positions, patch_size, baseline, batch_size=bs, progress=progress,
                               desc=f"occlusion {'x'.join(map(str, patch_size))}/{'x'.join(map(str, stride_size))}",
                               reduce=spec.scores)
    grid = grid_shape(dims, patch_size, stride_size)
    heat = _drops(base, scores)
    heat = heat.reshape(-1, *grid) if spec.every else heat.reshape(grid)
    return OcclusionResult(heat, positions, spec.label, patch_size, stride_size, dims, _stats_dict(stats),
                           np.ones(grid, bool), predicted=predicted)


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


def _drops(base: torch.Tensor, scores: torch.Tensor) -> np.ndarray:
    """Unoccluded minus occluded scores: (N,) from a scalar base, (K, N) from a (K,) base and (N, K) scores."""
    drop = base - scores
    return (drop.transpose(0, 1) if drop.dim() == 2 else drop).cpu().numpy()


def _predicted(base_output: Any) -> int | None:
    if isinstance(base_output, torch.Tensor) and base_output.dim() >= 1:
        return int(base_output.reshape(base_output.shape[0], -1)[0].argmax())
    return None


def _score(out: torch.Tensor, output: str) -> torch.Tensor:
    """(N, K) scores of a classifier's outputs: logits, or softmax probabilities with ``output="prob"``."""
    out = out.reshape(out.shape[0], -1).float()
    return torch.softmax(out, dim=1) if output == "prob" else out


def _check_target(target: int | None, base: torch.Tensor) -> int:
    """An int class index (the predicted class for None), checked against the (K,) base scores."""
    if target is None:
        return int(base.argmax())
    if isinstance(target, bool) or not isinstance(target, (int, np.integer)):
        raise TypeError(f"target must be an int class index, got {type(target).__name__}")
    if not 0 <= int(target) < base.numel():
        raise ValueError(f"target {target} is out of range for a model with {base.numel()} outputs")
    return int(target)


def _batch_size(batch_size: int | str, runner: OcclusionRunner, patch: tuple[int, ...], budget: int,
                tau: float) -> int:
    if batch_size == "auto":
        return estimate_batch_size(runner.graph, patch, budget, tau, device=runner.image.device)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int or 'auto', got {batch_size!r}")
    return batch_size


def _warn_if_no_reuse(runner: OcclusionRunner) -> None:
    graph = runner.graph
    if not any(n.kind == NodeKind.LOCAL for n in graph.nodes):
        warnings.warn("the model has no spatial (convolution or pooling) layers: incremental inference "
                      "cannot reuse anything, every position costs a full inference", stacklevel=3)


def _stats_dict(stats: RunStats) -> dict[str, Any]:
    out = stats.as_dict()
    out["seconds_per_position"] = stats.seconds / max(stats.positions, 1)
    return out


__all__ = ["OcclusionResult", "infer_spatial_dims", "occlusion"]
