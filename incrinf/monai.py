"""A drop-in for MONAI's ``OcclusionSensitivity`` computed by incremental inference, for 2-D images and 3-D volumes.

Swap ``from monai.visualize import OcclusionSensitivity`` for ``from incrinf.monai import OcclusionSensitivity``:
a subclass of MONAI's class with its constructor (``mask_size``, ``n_batch``, ``verbose``, ``mode``, ``overlap``,
``activate``) and call (``x``, ``b_box``), returning MONAI's outputs: the occlusion map ``(1, num_classes, *spatial)``
(each voxel: the activated outputs with the windows covering it occluded, blended as MONAI's sliding-window
inference blends them) and the most probable class ``(1, 1, *spatial)``. MONAI's own sliding-window inference places
the windows and blends the results; only the model's outputs for the occluded copies come from incremental
inference. Calls incrinf cannot capture (a model that torch.fx cannot trace, extra forward arguments, outputs
that are not one score vector per example) are computed by MONAI itself, with a warning.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from incrinf.errors import CaptureError
from incrinf.explain.heatmaps import TargetRunner
from incrinf.explain.occluders import Constant, Gaussian, Occluder, PatchFunction
from incrinf.extras import require
from incrinf.graph import captured_graph

_visualize = require("monai.visualize", "monai", "the MONAI drop-in")


class OcclusionSensitivity(_visualize.OcclusionSensitivity):
    """MONAI's occlusion sensitivity by batched incremental inference (same arguments, same outputs).

    Args:
        nn_module: classification model (an ``nn.Module`` that ``torch.fx`` can trace for incremental inference).
        mask_size: size of the occluded box, an int or one per spatial axis.
        n_batch: windows per batch.
        verbose: show MONAI's progress bar.
        mode: what replaces the occluded box: a float, ``"gaussian"``, ``"mean_patch"``, ``"mean_img"`` (MONAI's
            definitions, as its code computes them: ``"mean_patch"`` multiplies the box by its mean), or a callable
            ``f(image, box_values) -> box_values`` (which MONAI 1.6 accepts but then fails on; here it is applied).
        overlap: overlap between windows, in [0, 1).
        activate: ``True``: softmax over the outputs (sigmoid when the input has one channel, as MONAI decides);
            ``False``: none; a callable: applied to the outputs.

    Attributes:
        last_stats: the last incremental call's statistics (positions, batches, seconds, theoretical and planned
            FLOP ratios, planned peak bytes, the fixed costs: capture, executor, base, plan), empty after a call
            MONAI computed.
    """

    def __init__(self, nn_module: nn.Module, mask_size: int | Sequence = 16, n_batch: int = 16, verbose: bool = True,
                 mode: Any = "gaussian", overlap: float = 0.6, activate: Any = True) -> None:
        super().__init__(nn_module, mask_size=mask_size, n_batch=n_batch, verbose=verbose, mode=mode,
                         overlap=overlap, activate=activate)
        self.last_stats: dict[str, Any] = {}

    def __call__(self, x: torch.Tensor, b_box: Sequence | None = None, **kwargs: Any
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The occlusion map and the most probable class (see MONAI's ``OcclusionSensitivity.__call__``).

        Args:
            x: (1, C, H, W) or (1, C, D, H, W) image.
            b_box: ``[min1, max1, min2, max2, ...]`` inclusive bounds to analyse (-1: the whole axis).
            kwargs: extra arguments for the model (computed by MONAI).

        Returns:
            ``(occ_map, most_probable_class)``: (1, num_classes, *spatial) and (1, 1, *spatial), cropped to
            ``b_box`` when given.
        """
        self.last_stats = {}
        start = time.perf_counter()
        reason = _why_plain(self.nn_module, x, kwargs)
        capture_seconds = time.perf_counter() - start
        if reason is not None:
            warnings.warn(f"incrinf cannot capture this call ({reason}); computing the same result with "
                          "monai.visualize.OcclusionSensitivity, without incremental inference", stacklevel=2)
            return super().__call__(x, b_box, **kwargs)
        from monai.data.meta_tensor import MetaTensor
        from monai.inferers import sliding_window_inference
        from monai.networks.utils import eval_mode
        from monai.transforms import SpatialCrop
        from monai.utils import ensure_tuple_rep

        image = x.as_tensor() if isinstance(x, MetaTensor) else x
        sd = image.ndim - 2
        mask_size: Sequence = ensure_tuple_rep(self.mask_size, sd)
        # the same grid of voxel coordinates MONAI slides its windows over, cropped to the bounding box
        grid = MetaTensor(np.stack(np.meshgrid(*[np.arange(0, i) for i in image.shape[2:]], indexing="ij"))[None],
                          device=image.device, dtype=image.dtype)
        if b_box is not None:
            grid, cropper, mask_size = self.crop_meshgrid(grid, b_box, mask_size)
        if any(m > g for g, m in zip(grid.shape[2:], mask_size)):
            raise ValueError(f"Image (spatial shape) {grid.shape[2:]} should be bigger than mask {mask_size}.")
        window = tuple(int(m) for m in mask_size)

        def slide(predictor: Any, progress: bool) -> torch.Tensor:
            return sliding_window_inference(grid, roi_size=window, sw_batch_size=self.n_batch, predictor=predictor,
                                            overlap=self.overlap, progress=progress,
                                            mode="gaussian" if self.mode == "gaussian" else "constant")

        with eval_mode(self.nn_module):
            # every output of the model, as the explain front end scores them (target "all")
            scoring = TargetRunner.build(self.nn_module, image.detach(), "all", "logit", warn=False)
            # MONAI's windows first (its own sliding window, answered with zeros), then every window from one plan
            # (batches of windows of similar reach, n_batch at a time), then MONAI's blend of the outputs
            windows = _Windows(window, scoring.base.numel())
            slide(windows, False)
            corners = windows.corners()
            out, stats = scoring.window_scores(corners, window, self._occluder(image, window), self.n_batch,
                                               self.verbose, "incrinf occlusion")
            sensitivity_im = slide(_Predictor(corners, self._activated(out, image.shape[1]), window), False)
        stats.capture_seconds = capture_seconds
        self.last_stats = stats.as_dict()
        if b_box is not None:  # as MONAI: undo the grid's crop, then crop to the bounding box itself
            sensitivity_im = cropper.inverse(sensitivity_im[0])[None]
            bbox_min = [max(b, 0) for b in b_box[::2]]
            bbox_max = [b if b > 0 else s for b, s in zip(b_box[1::2], image.shape[2:])]
            sensitivity_im = SpatialCrop(roi_start=bbox_min, roi_end=bbox_max)(sensitivity_im[0])[None]
        return sensitivity_im, sensitivity_im.argmax(dim=1, keepdim=True)

    def _activated(self, out: torch.Tensor, in_channels: int) -> torch.Tensor:
        """MONAI's activation of the outputs: a callable, or (True) sigmoid for one input channel, else softmax."""
        if callable(self.activate):
            return self.activate(out)
        if self.activate:
            return out.sigmoid() if in_channels == 1 else out.softmax(1)
        return out

    def _occluder(self, image: torch.Tensor, window: tuple[int, ...]) -> Occluder:
        """MONAI's ``mode`` as an occluder."""
        if callable(self.mode):
            return PatchFunction(self.mode, image)
        if self.mode == "mean_img":
            return Constant(image.mean().item())
        if self.mode == "mean_patch":
            return _ScaledByMean()
        if self.mode == "gaussian":
            return Gaussian(window)
        return Constant(float(self.mode))


class _ScaledByMean(Occluder):
    """MONAI 1.6's ``mean_patch`` as its code computes it: its predictor unpacks ``constant_occlusion``'s
    ``(multiplier, addend)`` as ``(addend, multiplier)``, so the window is *multiplied* by its mean (its docstring
    says "replaced with"); the drop-in reproduces the library's output. :class:`incrinf.explain.occluders.MeanPatch`
    (``baseline="mean_patch"`` elsewhere in incrinf) replaces the window with its mean, as documented."""

    def fill(self, patch, mask, start, offsets, window):
        n = patch.shape[0]
        full = mask.expand_as(patch)
        total = torch.where(full, patch, torch.zeros((), dtype=patch.dtype, device=patch.device))
        mean = total.reshape(n, -1).sum(1) / full.reshape(n, -1).sum(1).clamp_min(1)
        return torch.where(mask, patch * mean.view(n, *([1] * (patch.dim() - 1))), patch)


class _Windows:
    """A stand-in predictor for MONAI's sliding window that records the windows' corners (the first voxel of each
    grid crop) and answers zeros."""

    def __init__(self, window: tuple[int, ...], classes: int) -> None:
        self.window = window
        self.classes = classes
        self.seen: list[np.ndarray] = []

    def __call__(self, cropped_grid: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.seen.append(_corners(cropped_grid))
        return torch.zeros(cropped_grid.shape[0], self.classes, *self.window, dtype=cropped_grid.dtype,
                           device=cropped_grid.device)

    def corners(self) -> np.ndarray:
        """(N, d) the distinct corners, in MONAI's order."""
        every = np.concatenate(self.seen)
        _, first = np.unique(every, axis=0, return_index=True)
        return every[np.sort(first)]


class _Predictor:
    """MONAI's window predictor, answered from outputs computed beforehand: the model's (activated) outputs for a
    window occluded, repeated over the window."""

    def __init__(self, corners: np.ndarray, outputs: torch.Tensor, window: tuple[int, ...]) -> None:
        self.rows = {tuple(c): i for i, c in enumerate(corners.tolist())}
        self.outputs = outputs
        self.window = window

    def __call__(self, cropped_grid: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows = [self.rows[tuple(c)] for c in _corners(cropped_grid).tolist()]
        out = self.outputs[torch.tensor(rows, device=self.outputs.device)]
        for m in self.window:
            out = torch.repeat_interleave(out.unsqueeze(-1), m, dim=-1)
        return out


def _corners(cropped_grid: torch.Tensor) -> np.ndarray:
    sd = cropped_grid.ndim - 2
    return cropped_grid[(slice(None), slice(None), *([0] * sd))].round().long().cpu().numpy()


def _why_plain(model: Any, x: Any, kwargs: dict) -> str | None:
    """Why MONAI must compute this call itself, or None when incrinf can."""
    if kwargs:
        return f"extra forward arguments {sorted(kwargs)}"
    if not isinstance(model, nn.Module):
        return "the model is not an nn.Module"
    if not isinstance(x, torch.Tensor) or x.ndim not in (3, 4, 5) or x.shape[0] != 1:
        return "an input that is not one (1, C, *spatial) tensor"
    if not x.is_floating_point():
        return f"an input of dtype {x.dtype}"
    try:
        graph = captured_graph(model, tuple(x.shape[1:]))
    except CaptureError as exc:
        return str(exc)
    shape = graph.output.shape
    if shape is None or len(shape) != 2:
        return "the model's output is not one score vector per example"
    return None


__all__ = ["OcclusionSensitivity"]
