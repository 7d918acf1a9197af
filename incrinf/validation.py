"""Shared validators: each raises ``ValueError``/``TypeError`` saying what is expected."""

from __future__ import annotations

import math
import re
from typing import Any

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


def check_image(image: Any) -> torch.Tensor:
    """An image tensor as ``(1, C, H, W)`` float, finite."""
    if not isinstance(image, torch.Tensor):
        raise TypeError(f"image must be a torch.Tensor of shape (3, H, W) or (1, 3, H, W), "
                        f"got {type(image).__name__}")
    if image.dim() == 3:
        image = image.unsqueeze(0)
    if image.dim() != 4 or image.shape[0] != 1:
        raise ValueError(f"image must have shape (C, H, W) or (1, C, H, W), got {tuple(image.shape)}")
    if not image.is_floating_point():
        raise TypeError(f"image must be a floating-point tensor, got {image.dtype}")
    if not torch.isfinite(image).all():
        raise ValueError("image contains NaN or infinite values")
    return image
