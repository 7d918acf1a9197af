"""A depthwise layer's int8 weights and per-channel constants, checked and laid out once per layer.

:func:`pack_depthwise_int8` is what an interpreter does at ``allocate_tensors``: it validates the filter, bias
and multipliers, and packs them per channel tile for :func:`incrinf.kernels.depthwise_kernels.depthwise_tiles`
the way XNNPACK packs its depthwise weights (bias in front of each tile's weights): per depth-multiplier plane
``m`` and tile of :data:`~incrinf.kernels.depthwise_kernels.TILE` input channels,

- ``tile_weights``: the ``KH*KW`` taps' weights of the tile's channels, widened to int32 (so the kernel's
  multiply needs no widening of its own), zero past the last channel;
- ``tile_params``: int32 rows BASE (``bias + input_offset * sum of the channel's filter``: every tap is read,
  padding from a zero row, so this term is the same for every pixel), MULT, LEFT, RIGHT, ROUND_MASK and
  ROUND_THRESHOLD of TFLite's requantization.

Packing costs about as much as a small layer's convolution; callers that run a layer more than once
(:class:`~incrinf.kernels.quantized_module.QuantizedDepthwiseConv2d`, the benchmark) keep the packed layer.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from incrinf.kernels.arguments import as_array, check_int, per_channel
from incrinf.kernels.depthwise_kernels import (
    BASE,
    LEFT,
    MULT,
    PARAM_ROWS,
    RIGHT,
    ROUND_MASK,
    ROUND_THRESHOLD,
    TILE,
)
from incrinf.kernels.quantize import INT8_MAX, INT8_MIN, validate_multipliers

__all__ = ["PackedDepthwiseInt8", "pack_depthwise_int8"]


class PackedDepthwiseInt8(NamedTuple):
    """A depthwise layer packed by :func:`pack_depthwise_int8`.

    ``M`` is the depth multiplier, ``C`` the input channels, ``T = KH * KW`` the taps,
    ``n_tiles = ceil(C / TILE)``.
    """

    weight: np.ndarray  # int8 (KH, KW, C*M): TFLite layout (the reference-order kernel reads it)
    bias: np.ndarray  # int32 (C*M,)
    multiplier: np.ndarray  # int32 (C*M,)
    shift: np.ndarray  # int32 (C*M,)
    tile_weights: np.ndarray  # int32 (M * n_tiles * T * TILE,)
    tile_params: np.ndarray  # int32 (M * n_tiles * PARAM_ROWS * TILE,)
    zero_row: np.ndarray  # int8 (n_tiles * TILE,): the input zero point, read by taps in the padding
    kernel_size: tuple[int, int]
    in_channels: int
    depth_multiplier: int
    input_offset: int
    call_plans: dict  # the wrappers' checked per-call plans, keyed by input shape and arguments (bounded)


def _channel_counts(oc: int, depth_multiplier, in_channels) -> tuple[int, int]:
    """``(C, M)`` from the filter's ``C*M`` output channels and whichever of ``M``/``C`` the caller gave."""
    if in_channels is None:
        dm = 1 if depth_multiplier is None else check_int(depth_multiplier, "depth_multiplier", 1, oc)
        if oc % dm:
            raise ValueError(f"w has {oc} output channels, not a multiple of depth_multiplier={dm}")
        return oc // dm, dm
    in_channels = check_int(in_channels, "in_channels", 1, oc)
    if oc % in_channels:
        raise ValueError(f"w has {oc} output channels, not a multiple of the input's {in_channels} channels")
    dm = oc // in_channels
    if depth_multiplier is not None and check_int(depth_multiplier, "depth_multiplier", 1, oc) != dm:
        raise ValueError(f"depth_multiplier={depth_multiplier} but w has {oc} = {in_channels} x {dm} channels")
    return in_channels, dm


def _tiles(rows: np.ndarray, in_channels: int, dm: int) -> np.ndarray:
    """``(R, C*M)`` per-output-channel rows -> flat ``(M, n_tiles, R, TILE)``, zero-padded past channel C."""
    n_rows = rows.shape[0]
    n_tiles = -(-in_channels // TILE)
    planes = rows.reshape(n_rows, in_channels, dm).transpose(2, 0, 1)  # (M, R, C): oc = ic*M + m
    padded = np.zeros((dm, n_rows, n_tiles * TILE), rows.dtype)
    padded[:, :, :in_channels] = planes
    return np.ascontiguousarray(padded.reshape(dm, n_rows, n_tiles, TILE).transpose(0, 2, 1, 3)).reshape(-1)


def pack_depthwise_int8(
    w: np.ndarray | torch.Tensor,
    bias: np.ndarray | torch.Tensor | None,
    *,
    input_offset: int,
    output_multiplier: np.ndarray | int,
    output_shift: np.ndarray | int,
    depth_multiplier: int | None = None,
    in_channels: int | None = None,
) -> PackedDepthwiseInt8:
    """Validate and lay out a layer's weights once (see :func:`depthwise_conv2d_int8` for the args).

    Args:
        w: int8 filter ``(1, KH, KW, C*M)``.
        bias: int32 ``(C*M,)`` or ``None``.
        input_offset: ``-input_zero_point``, in ``[-127, 128]``.
        output_multiplier, output_shift: int32 ``(C*M,)`` or scalars.
        depth_multiplier: ``M``; with ``in_channels`` unknown, defaults to 1.
        in_channels: ``C``; defaults to ``C*M // depth_multiplier``.

    Returns:
        A :class:`PackedDepthwiseInt8` for :func:`depthwise_conv2d_int8_packed`.
    """
    w = as_array(w, "w", np.int8, "int8")
    if w.ndim != 4 or w.shape[0] != 1:
        raise ValueError(f"w must have shape (1, KH, KW, C*M) (TFLite depthwise layout), got {w.shape}")
    _, kh, kw, oc = w.shape
    if kh == 0 or kw == 0 or oc == 0:
        raise ValueError(f"w must have a non-empty kernel and channels, got shape {w.shape}")
    in_channels, dm = _channel_counts(oc, depth_multiplier, in_channels)
    bias = np.zeros(oc, np.int32) if bias is None else as_array(bias, "bias", np.int32, "int32")
    if bias.shape != (oc,):
        raise ValueError(f"bias must have shape ({oc},) (one per output channel), got {bias.shape}")
    mult = per_channel(output_multiplier, "output_multiplier", oc)
    shift = per_channel(output_shift, "output_shift", oc)
    validate_multipliers(mult, shift, oc)
    in_off = check_int(input_offset, "input_offset", -INT8_MAX, -INT8_MIN)  # = -input_zero_point

    w3 = w[0]
    # int32 wraps, in the reference as here: the folded sum may wrap and still give the same results.
    base = (bias.astype(np.int64) + in_off * w3.sum(axis=(0, 1), dtype=np.int64)).astype(np.int32)
    left = np.maximum(shift, 0)
    right = np.maximum(-shift, 0)
    round_mask = (np.left_shift(1, right.astype(np.int64)) - 1).astype(np.int32)
    params = np.empty((PARAM_ROWS, oc), np.int32)
    params[BASE], params[MULT], params[LEFT], params[RIGHT] = base, mult, left, right
    params[ROUND_MASK], params[ROUND_THRESHOLD] = round_mask, round_mask >> 1
    n_tiles = -(-in_channels // TILE)
    return PackedDepthwiseInt8(
        weight=w3,
        bias=bias,
        multiplier=mult,
        shift=shift,
        tile_weights=_tiles(w3.reshape(kh * kw, oc).astype(np.int32), in_channels, dm),
        tile_params=_tiles(params, in_channels, dm),
        zero_row=np.full(n_tiles * TILE, -in_off, np.int8),
        kernel_size=(kh, kw),
        in_channels=in_channels,
        depth_multiplier=dm,
        input_offset=in_off,
        call_plans={},
    )
