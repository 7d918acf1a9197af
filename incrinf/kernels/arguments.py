"""Argument checks shared by the int8 kernels' wrappers: integers, tuples of integers, arrays of one dtype.

They run on every call (region calls of the incremental engine included), so plain ``int`` and ``tuple``
values take fast paths before the general checks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["as_array", "check_int", "int_tuple", "is_int", "per_channel"]


def is_int(value) -> bool:
    """Whether ``value`` is a Python or numpy integer (not a bool)."""
    if type(value) is int:
        return True
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def int_tuple(value, length: int) -> bool:
    """Whether ``value`` is a sequence of ``length`` integers."""
    if type(value) is tuple and len(value) == length:
        for v in value:
            if type(v) is not int and not is_int(v):
                return False
        return True
    return isinstance(value, Sequence) and len(value) == length and all(is_int(v) for v in value)


def check_int(value, name: str, lo: int, hi: int) -> int:
    """``value`` as an int, or ``TypeError`` (not an integer) / ``ValueError`` (outside ``[lo, hi]``)."""
    if type(value) is int and lo <= value <= hi:
        return value
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return int(value)


def as_array(value, name: str, dtype: type, dtype_name: str) -> np.ndarray:
    """A C-contiguous numpy array of exactly ``dtype`` from a numpy array or a (CPU or device) torch tensor."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if not isinstance(value, np.ndarray):
        raise TypeError(
            f"{name} must be a numpy array or torch tensor of {dtype_name}, got {type(value).__name__}"
        )
    if value.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype_name}, got {value.dtype}")
    return np.ascontiguousarray(value)


def per_channel(value, name: str, channels: int) -> np.ndarray:
    """An int32 ``(channels,)`` array from an integer array, tensor or scalar (broadcast); values must fit int32.

    The length is not checked here (the caller reports a wrong shape with its own context).
    """
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integer (int32), got dtype {arr.dtype}")
    if arr.ndim == 0:
        arr = np.full(channels, arr)
    if arr.dtype != np.int32:
        wide = arr.astype(np.int64)
        if np.any(wide != wide.astype(np.int32)):
            raise ValueError(f"{name} values must fit in int32")
        arr = wide.astype(np.int32)
    return np.ascontiguousarray(arr)
