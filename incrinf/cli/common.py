"""Argument types and input readers shared by every ``incrinf`` subcommand."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def _checked(text: str, parse: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Any:
    """``parse(text)`` when ``ok`` holds for it; else the argparse error saying what was ``expected``."""
    try:
        value = parse(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _checked(text, int, lambda v: v >= 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _checked(text, int, lambda v: v >= 0, "an integer >= 0")


def share(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    return _checked(text, float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")


def number(text: str) -> float:
    """argparse type: any real number."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def non_negative(text: str) -> float:
    """argparse type: a number >= 0."""
    return _checked(text, float, lambda v: v >= 0, "a number >= 0")


def model_name(text: str) -> str:
    """argparse type: a zoo model name (:mod:`incrinf.models`)."""
    from incrinf import models

    if text not in models.available():
        names = ", ".join((*models.ZOO, *models.VOLUME_MODELS))
        raise argparse.ArgumentTypeError(f"unknown model {text!r}; try one of: {names}")
    return text


def input_shape(text: str) -> tuple[int, ...]:
    """argparse type: ``CxHxW`` (``CxL``, ``CxDxHxW``) as ``(C, *spatial)``."""
    from incrinf.graph import parse_input_shape

    try:
        return parse_input_shape(text)[1:]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def read_rgb(path: str) -> np.ndarray:
    """An image file as HxWx3 uint8 RGB (grey is replicated, alpha dropped, the first frame of an animated GIF or
    a multi-page TIFF taken; other dtypes are scaled to 0-255 by the image's maximum).

    Raises:
        FileNotFoundError: no such file. ValueError: unreadable or not an image (the message names the file).
    """
    import skimage.io

    if not Path(path).is_file():
        raise FileNotFoundError(f"image not found: {path}")
    try:
        image = np.asarray(skimage.io.imread(path))
    except Exception as exc:
        raise ValueError(f"cannot read image {path}: {exc}") from None
    if image.ndim == 4 and image.shape[0] >= 1 and image.shape[3] in (1, 2, 3, 4):
        image = image[0]  # frames first (GIF, multi-page TIFF)
    if image.ndim == 3 and image.shape[2] in (1, 2):
        image = image[..., 0]  # grey, or grey + alpha
    if image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)
    if image.ndim != 3 or image.shape[2] not in (3, 4) or min(image.shape[:2]) < 1 or image.dtype.kind not in "biuf":
        raise ValueError(f"{path} is not an RGB image (shape {image.shape}, dtype {image.dtype})")
    image = image[..., :3]
    if image.dtype != np.uint8:
        values = np.nan_to_num(image.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0).clip(min=0.0)
        image = (255 * (values / max(float(values.max()), 1e-12))).round().astype(np.uint8)
    return np.ascontiguousarray(image)
