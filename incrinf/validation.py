"""Shared validators: each raises ``ValueError``/``TypeError`` saying what is expected."""

from __future__ import annotations

import math
import re
from typing import Any

import torch


def pair(value: Any, name: str) -> tuple[int, int]:
    """An int or a pair of ints as ``(h, w)``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int or (h, w), got {value!r}")
    if isinstance(value, (int,)) or (isinstance(value, float) and value.is_integer()):
        return int(value), int(value)
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return int(value[0]), int(value[1])
    raise ValueError(f"{name} must be an int or (h, w), got {value!r}")


def check_patch(patch: Any, image_hw: tuple[int, int]) -> tuple[int, int]:
    ph, pw = pair(patch, "patch")
    if ph < 1 or pw < 1:
        raise ValueError(f"patch must be at least 1x1, got {ph}x{pw}")
    if ph > image_hw[0] or pw > image_hw[1]:
        raise ValueError(f"patch {ph}x{pw} is larger than the {image_hw[0]}x{image_hw[1]} input")
    return ph, pw


def check_stride(stride: Any) -> tuple[int, int]:
    sh, sw = pair(stride, "stride")
    if sh < 1 or sw < 1:
        raise ValueError(f"stride must be at least 1, got {stride!r}")
    return sh, sw


def check_tau(tau: Any) -> float:
    try:
        value = float(tau)
    except (TypeError, ValueError):
        raise ValueError(f"tau must be a number in (0, 1], got {tau!r}") from None
    if not (0.0 < value <= 1.0) or math.isnan(value):
        raise ValueError(f"tau must be in (0, 1], got {tau!r}")
    return value


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
