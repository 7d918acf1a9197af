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
    a multi-page TIFF taken; more than 8 bits are scaled to 0-255 by the image's maximum).

    Raises:
        FileNotFoundError: no such file. ValueError: ``cannot read image <path>: <why>`` (a folder, no
            permission, empty, not an image, damaged or cut short).
    """
    from incrinf.explain.dataset.inputs import decode_rgb

    file = Path(path)
    if not file.exists():
        raise FileNotFoundError(f"image not found: {path}")
    if file.is_dir():
        raise ValueError(f"cannot read image {path}: it is a folder")
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read image {path}: {exc.strerror or exc}") from None
    return decode_rgb(data, path)
