"""Geometry of a depthwise convolution: stride/dilation pairs, TFLite SAME/VALID padding, output size, regions."""

from __future__ import annotations

from typing import NamedTuple

from incrinf.geometry import Box
from incrinf.kernels.arguments import int_tuple, is_int

__all__ = [
    "ConvGeometry",
    "Pair",
    "Padding",
    "conv_geometry",
    "depthwise_output_size",
    "resolve_padding",
]

Pair = int | tuple[int, int]
Padding = str | tuple[int, int, int, int]


class ConvGeometry(NamedTuple):
    """Validated geometry of one call: ``(h, w)`` pairs, explicit padding and the output box to compute."""

    stride: tuple[int, int]
    dilation: tuple[int, int]
    padding: tuple[int, int, int, int]  # (top, bottom, left, right)
    region: Box  # half-open (y0, y1, x0, x1) inside the full output


def _pair(value: Pair, name: str) -> tuple[int, int]:
    if is_int(value):
        pair = (int(value), int(value))
    elif int_tuple(value, 2):
        pair = (int(value[0]), int(value[1]))
    else:
        raise TypeError(f"{name} must be an int or an (h, w) pair of ints, got {value!r}")
    if min(pair) < 1:
        raise ValueError(f"{name} must be >= 1, got {value!r}")
    return pair


def resolve_padding(
    padding: Padding,
    in_hw: tuple[int, int],
    kernel: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
) -> tuple[int, int, int, int]:
    """Explicit ``(top, bottom, left, right)`` padding from ``"same"``, ``"valid"`` or a 4-tuple.

    SAME follows TFLite: ``out = ceil(in / stride)``, total pad
    ``max((out - 1) * stride + eff_k - in, 0)`` with ``eff_k = (k - 1) * dilation + 1``; top/left
    get ``total // 2``, bottom/right the rest.
    """
    if isinstance(padding, str):
        mode = padding.lower()
        if mode == "valid":
            return (0, 0, 0, 0)
        if mode != "same":
            raise ValueError(
                f"padding must be 'same', 'valid' or (top, bottom, left, right), got {padding!r}"
            )
        pads = []
        for size, k, s, d in zip(in_hw, kernel, stride, dilation, strict=True):
            out = (size + s - 1) // s
            total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
            pads += [total // 2, total - total // 2]
        return (pads[0], pads[1], pads[2], pads[3])
    if int_tuple(padding, 4):
        if min(padding) < 0:
            raise ValueError(f"padding must be non-negative, got {padding!r}")
        return (int(padding[0]), int(padding[1]), int(padding[2]), int(padding[3]))
    raise TypeError(f"padding must be 'same', 'valid' or (top, bottom, left, right) ints, got {padding!r}")


def depthwise_output_size(
    in_size: int, kernel: int, stride: int, dilation: int, pad_before: int, pad_after: int
) -> int:
    """Output length along one axis for explicit padding (floor division, as PyTorch/TFLite)."""
    eff_k = (kernel - 1) * dilation + 1
    return max((in_size + pad_before + pad_after - eff_k) // stride + 1, 0)


def _check_region(region, out_h: int, out_w: int) -> Box:
    if region is None:
        return (0, out_h, 0, out_w)
    if not int_tuple(region, 4):
        raise TypeError(f"region must be (y0, y1, x0, x1) ints (a half-open output box), got {region!r}")
    y0, y1, x0, x1 = int(region[0]), int(region[1]), int(region[2]), int(region[3])
    if not (0 <= y0 <= y1 <= out_h and 0 <= x0 <= x1 <= out_w):
        raise ValueError(
            f"region {tuple(region)!r} must satisfy 0 <= y0 <= y1 <= {out_h} and 0 <= x0 <= x1 <= {out_w}"
            f" (a half-open box inside the {out_h}x{out_w} output)"
        )
    return (y0, y1, x0, x1)


def conv_geometry(
    in_hw: tuple[int, int],
    kernel: tuple[int, int],
    stride: Pair,
    padding: Padding,
    dilation: Pair,
    region: Box | None,
) -> ConvGeometry:
    """Check a call's geometry arguments and resolve padding and the output box.

    Args:
        in_hw: input ``(H, W)``.
        kernel: ``(KH, KW)``.
        stride, dilation: ints or ``(h, w)`` pairs, each >= 1.
        padding: ``"same"``, ``"valid"`` or explicit ``(top, bottom, left, right)``.
        region: half-open output box ``(y0, y1, x0, x1)``, or ``None`` for the whole output.
    """
    stride_hw = _pair(stride, "stride")
    dilation_hw = _pair(dilation, "dilation")
    pads = resolve_padding(padding, in_hw, kernel, stride_hw, dilation_hw)
    out_h = depthwise_output_size(in_hw[0], kernel[0], stride_hw[0], dilation_hw[0], pads[0], pads[1])
    out_w = depthwise_output_size(in_hw[1], kernel[1], stride_hw[1], dilation_hw[1], pads[2], pads[3])
    return ConvGeometry(stride_hw, dilation_hw, pads, _check_region(region, out_h, out_w))
