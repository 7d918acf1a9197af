"""Shared validators: each raises ``ValueError``/``TypeError`` saying what is expected."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import torch


def spatial(value: Any, d: int, name: str) -> tuple[int, ...]:
    """An int or ``d`` ints (one per spatial axis) as a ``d``-tuple."""
    axes = {1: "(l,)", 2: "(h, w)", 3: "(d, h, w)"}.get(d, f"{d} ints")
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int or {axes}, got {value!r}")
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return (int(value),) * d
    if isinstance(value, (tuple, list)) and len(value) == d and all(isinstance(v, int) and not isinstance(v, bool)
                                                                    for v in value):
        return tuple(int(v) for v in value)
    raise ValueError(f"{name} must be an int or {axes}, got {value!r}")


def _size(values: tuple[int, ...]) -> str:
    return "x".join(str(v) for v in values)


def check_patch(patch: Any, dims: tuple[int, ...]) -> tuple[int, ...]:
    """A patch size for an input of spatial extents ``dims``."""
    size = spatial(patch, len(dims), "patch")
    if min(size) < 1:
        raise ValueError(f"patch must be at least 1 along every axis, got {_size(size)}")
    if any(p > n for p, n in zip(size, dims)):
        raise ValueError(f"patch {_size(size)} is larger than the {_size(tuple(dims))} input")
    return size


def check_stride(stride: Any, d: int = 2) -> tuple[int, ...]:
    """A stride for ``d`` spatial axes."""
    size = spatial(stride, d, "stride")
    if min(size) < 1:
        raise ValueError(f"stride must be at least 1, got {stride!r}")
    return size


def check_tau(tau: Any) -> float:
    try:
        value = float(tau)
    except (TypeError, ValueError):
        raise ValueError(f"tau must be a number in (0, 1], got {tau!r}") from None
    if not (0.0 < value <= 1.0) or math.isnan(value):
        raise ValueError(f"tau must be in (0, 1], got {tau!r}")
    return value


def check_feature_threshold(value: Any) -> float:
    """A value-based pruning threshold: a number >= 0 (0 is exact)."""
    try:
        threshold = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"feature_threshold must be a number >= 0, got {value!r}") from None
    if not threshold >= 0 or math.isinf(threshold):
        raise ValueError(f"feature_threshold must be a finite number >= 0, got {value!r}")
    return threshold


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: Any, name: str = "max_memory") -> int:
    """``"2GiB"``, ``"512MB"`` or an int number of bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(f"{name} must be a positive number of bytes or a string like '2GiB', got {value!r}")


_AXES = {1: "(C, L)", 2: "(C, H, W)", 3: "(C, D, H, W)"}


def check_spatial_dims(value: Any) -> int:
    """A number of spatial axes: 1 (signals), 2 (images) or 3 (volumes)."""
    if isinstance(value, bool) or not isinstance(value, int) or value not in _AXES:
        raise ValueError(f"incrinf explains inputs with 1, 2 or 3 spatial axes (signals, images, volumes); "
                         f"got spatial_dims={value!r}")
    return value


def check_input(image: Any, spatial_dims: int) -> torch.Tensor:
    """An input tensor with ``spatial_dims`` spatial axes as ``(1, C, *spatial)`` float, finite.

    Accepts ``(C, *spatial)`` or ``(1, C, *spatial)``.
    """
    d = check_spatial_dims(spatial_dims)
    axes = _AXES[d]
    if not isinstance(image, torch.Tensor):
        raise TypeError(f"the input must be a torch.Tensor of shape {axes} or (1, {axes[1:]}, "
                        f"got {type(image).__name__}")
    if image.dim() == d + 1:
        image = image.unsqueeze(0)
    if image.dim() != d + 2 or image.shape[0] != 1:
        raise ValueError(f"the input must have shape {axes} or (1, {axes[1:]} for a model with {d} spatial "
                         f"ax{'is' if d == 1 else 'es'}, got shape {tuple(image.shape)}")
    if not image.is_floating_point():
        raise TypeError(f"the input must be a floating-point tensor, got {image.dtype}")
    if not torch.isfinite(image).all():
        raise ValueError("the input contains NaN or infinite values")
    return image


def check_image(image: Any) -> torch.Tensor:
    """An image tensor as ``(1, C, H, W)`` float, finite (:func:`check_input` with 2 spatial axes)."""
    return check_input(image, 2)


def check_feature_mask(mask: Any, image: torch.Tensor) -> torch.Tensor:
    """A feature mask for ``image`` (1, C, *spatial) as ``(C or 1, *spatial)`` int64 feature ids.

    Accepts integer tensors (or arrays) of shape ``spatial``, ``(C or 1, *spatial)`` or ``(1, C or 1, *spatial)``.
    """
    if not isinstance(mask, torch.Tensor):
        try:
            mask = torch.from_numpy(np.asarray(mask))
        except (TypeError, ValueError):
            raise TypeError(f"feature_mask must be an integer tensor, got {type(mask).__name__}") from None
    if mask.is_floating_point() or mask.is_complex():
        raise TypeError(f"feature_mask must hold integer feature ids, got dtype {mask.dtype}")
    c, dims = image.shape[1], tuple(image.shape[2:])
    d = len(dims)
    shape = tuple(mask.shape)
    if shape == dims:
        mask = mask.unsqueeze(0)
    elif len(shape) == d + 2 and shape[0] == 1:
        mask = mask[0]
    if tuple(mask.shape[1:]) != dims or mask.dim() != d + 1 or mask.shape[0] not in (1, c):
        want = "x".join(str(v) for v in dims)
        raise ValueError(f"feature_mask must have the input's spatial shape {want}, optionally behind a channel axis "
                         f"of 1 or {c} (and a batch axis of 1); got shape {shape}")
    return mask.to(device=image.device, dtype=torch.int64)


# --- camera frames --------------------------------------------------------------------------------------------

def check_frame_array(frame: Any) -> np.ndarray:
    """A camera frame as an (H, W, 3) uint8 RGB array (returned as is)."""
    if not isinstance(frame, np.ndarray):
        raise TypeError(f"frame must be an (H, W, 3) uint8 numpy array, got {type(frame).__name__}")
    if frame.dtype != np.uint8:
        raise TypeError(f"frame arrays must be uint8 RGB (H, W, 3), got dtype {frame.dtype}; pass floats as an "
                        "already normalised torch tensor")
    if frame.ndim != 3:
        raise ValueError(f"frame must have shape (H, W, 3), got {frame.ndim} dimensions {frame.shape}")
    if frame.shape[2] != 3:
        raise ValueError(f"frame must have 3 channels (RGB), got {frame.shape[2]} in shape {frame.shape}")
    if min(frame.shape[:2]) < 1:
        raise ValueError(f"frame is empty: shape {frame.shape}")
    return frame


def check_frame_tensor(x: Any, what: str = "frame", min_side: int = 8) -> torch.Tensor:
    """A preprocessed camera frame, (3, H, W) or (1, 3, H, W) float and finite, as (1, 3, H, W)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor (normalised), got {x.dtype}")
    if x.dim() == 3:
        x = x.unsqueeze(0)
    if x.dim() != 4 or x.shape[0] != 1:
        raise ValueError(f"{what} must have shape (3, H, W) or (1, 3, H, W), got {tuple(x.shape)}")
    if x.shape[1] != 3:
        raise ValueError(f"{what} must have 3 channels, got {x.shape[1]} in shape {tuple(x.shape)}")
    if min(x.shape[-2:]) < min_side:
        raise ValueError(f"{what} is too small: {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{what} contains NaN or infinite values")
    return x


def check_frame_size(size: Any, name: str = "input_size", min_side: int = 8) -> tuple[int, int] | None:
    """An (height, width) of at least ``min_side`` each, or None."""
    if size is None:
        return None
    try:
        h, w = (int(v) for v in size)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be (height, width), got {size!r}") from None
    if h < min_side or w < min_side:
        raise ValueError(f"{name} must be at least {min_side}x{min_side}, got {size!r}")
    return h, w


def check_homography(matrix: Any) -> np.ndarray | None:
    """A finite, invertible (3, 3) homography normalised to ``[2, 2] == 1`` (float64), or None."""
    if matrix is None:
        return None
    m = np.asarray(matrix, dtype=np.float64)
    if m.shape != (3, 3) or not np.all(np.isfinite(m)) or abs(m[2, 2]) < 1e-12:
        raise ValueError(f"homography must be a finite (3, 3) matrix with [2, 2] != 0, got shape {m.shape}")
    try:
        np.linalg.inv(m)
    except np.linalg.LinAlgError:
        raise ValueError("homography is singular") from None
    return m / m[2, 2]
