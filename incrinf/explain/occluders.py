"""What replaces an occluded region: a constant, a tensor, the patch's mean, the image's mean, a Gaussian-weighted
blend (MONAI's ``OcclusionSensitivity`` modes), or any function of the patch.

An occluder gets each query's box of the input (the image's values there) and a mask of the elements it occludes,
and returns the box's new values; elements outside the mask keep the image's values. The engine then runs on the
boxes whatever they hold, so every mode is exact in the same way.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from incrinf.engine import crop_boxes

MODES = ("mean_patch", "mean_img", "gaussian")


class Occluder(ABC):
    """Turns the image's values in N boxes into their occluded values."""

    #: whether the occluder is defined by a window's position (Gaussian, a patch function), so feature masks
    #: cannot use it
    needs_window: bool = False

    @abstractmethod
    def fill(self, patch: torch.Tensor, mask: torch.Tensor, start: np.ndarray, offsets: np.ndarray | None,
             window: tuple[int, ...] | None) -> torch.Tensor:
        """The occluded values of N boxes.

        Args:
            patch: (N, C, *size) the image's values in the boxes.
            mask: (N, C or 1, *size) bool, the occluded elements.
            start: (N, d) the boxes' first corners in the image.
            offsets: (N, d) each window's first corner inside its box (None for feature masks).
            window: (d,) the window's size (None for feature masks).

        Returns:
            (N, C, *size) the boxes' new values.
        """


class Constant(Occluder):
    """Every occluded element becomes ``value``."""

    def __init__(self, value: float) -> None:
        self.value = float(value)

    def fill(self, patch, mask, start, offsets, window):
        return torch.where(mask, torch.tensor(self.value, dtype=patch.dtype, device=patch.device), patch)


class Baseline(Occluder):
    """Occluded elements take a baseline tensor's values at the same place (Captum's tensor baselines).

    Args:
        baseline: a tensor broadcastable to the image's shape (1, C, *dims).
        image: (1, C, *dims) the image.
    """

    def __init__(self, baseline: torch.Tensor, image: torch.Tensor) -> None:
        try:
            full = torch.broadcast_to(baseline.to(image), image.shape)
        except RuntimeError:
            raise ValueError(f"baseline of shape {tuple(baseline.shape)} does not broadcast to the input's shape "
                             f"{tuple(image.shape)}") from None
        self.full = full.contiguous()

    def fill(self, patch, mask, start, offsets, window):
        return torch.where(mask, crop_boxes(self.full, start, tuple(patch.shape[2:])), patch)


class MeanPatch(Occluder):
    """Occluded elements become the mean of the image over the occluded elements (MONAI's ``mean_patch``: the
    mean over the window's elements of every channel)."""

    def fill(self, patch, mask, start, offsets, window):
        n, c = patch.shape[:2]
        full = mask.expand_as(patch)
        total = torch.where(full, patch, torch.zeros((), dtype=patch.dtype, device=patch.device))
        mean = total.reshape(n, -1).sum(1) / full.reshape(n, -1).sum(1).clamp_min(1)
        return torch.where(mask, mean.view(n, *([1] * (patch.dim() - 1))), patch)


class Gaussian(Occluder):
    """Occluded elements are multiplied by one minus a Gaussian centred on the window (MONAI's ``gaussian``): 0 at
    the window's centre, 1 at its edges.

    Args:
        window: (d,) the window's size.
        sigma: the Gaussian's standard deviation as a share of the window's size per axis (MONAI: 0.25).
    """

    needs_window = True

    def __init__(self, window: Sequence[int], sigma: float = 0.25) -> None:
        self.window = tuple(int(w) for w in window)
        self.kernel = gaussian_multiplier(self.window, sigma)

    def fill(self, patch, mask, start, offsets, window):
        if window is None or tuple(window) != self.window:
            raise ValueError(f"the gaussian occluder was made for windows of {self.window}, not {window}")
        n, size = patch.shape[0], tuple(patch.shape[2:])
        kernel = self.kernel.to(patch)
        flat = torch.zeros((n, *size), dtype=torch.long, device=patch.device)
        for a, (extent, w) in enumerate(zip(size, self.window)):
            shape = [1] * (len(size) + 1)
            shape[a + 1] = extent
            # the kernel's index along this axis (clamped: elements outside the window are not occluded)
            rel = torch.arange(extent, device=patch.device).view(shape) \
                - torch.from_numpy(offsets[:, a]).to(patch.device).view(-1, *([1] * len(size)))
            flat = flat * w + rel.clamp(0, w - 1)
        weights = kernel.reshape(-1)[flat].unsqueeze(1)
        return torch.where(mask, patch * weights, patch)


class PatchFunction(Occluder):
    """Occluded windows become ``function(image, window_values)`` (MONAI's callable ``mode``): the function gets
    the image (1, C, *dims) and one window's values (1, C, *window) and returns the window's new values."""

    needs_window = True

    def __init__(self, function: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], image: torch.Tensor) -> None:
        self.function = function
        self.image = image

    def fill(self, patch, mask, start, offsets, window):
        if offsets is None or window is None:
            raise ValueError("a patch function occludes windows, not the features of a mask")
        out = patch.clone()
        for i in range(patch.shape[0]):
            inside = tuple(slice(int(o), int(o) + w) for o, w in zip(offsets[i], window))
            values = out[(slice(i, i + 1), slice(None), *inside)]
            new = self.function(self.image, values.clone())
            if not isinstance(new, torch.Tensor) or new.shape != values.shape:
                raise ValueError(f"the occlusion function must return a tensor of the window's shape "
                                 f"{tuple(values.shape)}, got {getattr(new, 'shape', type(new).__name__)}")
            values.copy_(new)
        return out


def gaussian_multiplier(window: Sequence[int], sigma: float = 0.25) -> torch.Tensor:
    """MONAI's Gaussian occlusion multiplier: a unit impulse at the window's centre smoothed by a Gaussian of
    ``sigma * window`` per axis (the ``erf`` discretization, truncated at 4 sigma), negated and rescaled to [0, 1].

    Returns:
        (*window) float32, 0 at the centre and 1 at the farthest elements.
    """
    grid = torch.ones(())
    for w in window:
        s = torch.as_tensor(sigma * w, dtype=torch.float)
        tail = int(max(float(s) * 4.0, 0.5) + 0.5)
        x = torch.arange(-tail, tail + 1, dtype=torch.float)
        t = 0.70710678 / torch.abs(s)
        kernel = (0.5 * ((t * (x + 0.5)).erf() - (t * (x - 0.5)).erf())).clamp(min=0)
        offset = torch.arange(w) - w // 2  # distance from the impulse
        inside = offset.abs() <= tail
        axis = torch.where(inside, kernel[(offset + tail).clamp(0, 2 * tail)], torch.zeros(()))
        grid = grid.unsqueeze(-1) * axis
    smoothed = -grid
    low, high = smoothed.min(), smoothed.max()
    if low == high:
        return torch.zeros(tuple(window))
    return (smoothed - low) / (high - low)


def make_occluder(baseline: Any, image: torch.Tensor, window: Sequence[int] | None = None) -> Occluder:
    """The occluder that ``baseline`` names.

    Args:
        baseline: a number, a tensor broadcastable to the image, ``"mean_patch"``, ``"mean_img"``, ``"gaussian"``,
            a function ``f(image, window_values) -> window_values``, or an :class:`Occluder`.
        image: (1, C, *dims) the image.
        window: (d,) the occlusion window (None for feature masks).

    Raises:
        ValueError / TypeError: an unknown mode, or one that needs a window given none.
    """
    if isinstance(baseline, Occluder):
        occluder = baseline
    elif isinstance(baseline, str):
        if baseline not in MODES:
            raise ValueError(f"baseline must be a number, a tensor or one of {', '.join(MODES)}; got {baseline!r}")
        if baseline == "mean_img":
            occluder = Constant(float(image.mean()))
        elif baseline == "mean_patch":
            occluder = MeanPatch()
        else:
            if window is None:
                raise ValueError("the gaussian occluder is defined on a window: it cannot occlude mask features")
            occluder = Gaussian(window)
    elif isinstance(baseline, torch.Tensor):
        occluder = Constant(float(baseline)) if baseline.numel() == 1 else Baseline(baseline, image)
    elif isinstance(baseline, (int, float, np.integer, np.floating)) and not isinstance(baseline, bool):
        if not math.isfinite(float(baseline)):
            raise ValueError(f"baseline must be finite, got {baseline!r}")
        occluder = Constant(float(baseline))
    elif callable(baseline):
        occluder = PatchFunction(baseline, image)
    else:
        raise TypeError(f"baseline must be a number, a tensor, one of {', '.join(MODES)} or a function, "
                        f"got {type(baseline).__name__}")
    if occluder.needs_window and window is None:
        raise ValueError(f"{type(occluder).__name__} occludes windows: it cannot occlude the features of a mask")
    return occluder


__all__ = ["MODES", "Baseline", "Constant", "Gaussian", "MeanPatch", "Occluder", "PatchFunction",
           "gaussian_multiplier", "make_occluder"]
