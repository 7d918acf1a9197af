"""Int8 depthwise convolution, NHWC, channels innermost, bit-exact with TFLite's reference kernel.

TFLite's reference kernel (``reference_integer_ops::DepthwiseConvPerChannel``) walks
``batch, out_y, out_x, in_channel, m, filter_y, filter_x``: consecutive reads are ``C`` bytes
apart in NHWC. Following the TFLM design (seed 003) this kernel walks, at each output pixel,
the filter taps and then a chunk of ``chunk`` output channels with int32 accumulators, so reads
of both input and filter are contiguous and the inner loop vectorizes. The integer arithmetic
is the reference's, so results are identical:

    acc = bias[oc] + sum over in-image taps of filter[fy, fx, oc] * (input[iy, ix, ic] + input_offset)
    out = clamp(MultiplyByQuantizedMultiplier(acc, mult[oc], shift[oc]) + output_offset, act_min, act_max)

with ``oc = ic * depth_multiplier + m``. For pixels whose taps are all inside the image the
``input_offset`` term is the same for every pixel, so it is folded into the bias once
(``bias + input_offset * sum(filter)``); int32 addition wraps, so the reordering cannot change a
result. Border pixels skip out-of-image taps exactly like the reference (zero padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from typing import NamedTuple

import numba
import numpy as np
import torch
from numba import njit, prange

from incrinf.kernels.quantize import (
    INT8_MAX,
    INT8_MIN,
    multiply_by_quantized_multiplier,
    validate_multipliers,
)

__all__ = [
    "depthwise_conv2d_int8",
    "depthwise_conv2d_int8_reference_order",
    "depthwise_output_size",
    "resolve_padding",
]

Pair = int | tuple[int, int]
Padding = str | tuple[int, int, int, int]


# ----------------------------------------------------------------------------------------------
# Geometry
# ----------------------------------------------------------------------------------------------


def _pair(value: Pair, name: str) -> tuple[int, int]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        pair = (int(value), int(value))
    elif isinstance(value, Sequence) and len(value) == 2 and all(isinstance(v, (int, np.integer)) for v in value):
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
    ``max((out - 1) * stride + eff_k - in, 0)``, top/left get ``total // 2``, bottom/right the rest.
    """
    if isinstance(padding, str):
        mode = padding.lower()
        if mode == "valid":
            return (0, 0, 0, 0)
        if mode != "same":
            raise ValueError(f"padding must be 'same', 'valid' or (top, bottom, left, right), got {padding!r}")
        pads = []
        for size, k, s, d in zip(in_hw, kernel, stride, dilation, strict=True):
            out = (size + s - 1) // s
            total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
            pads += [total // 2, total - total // 2]
        return (pads[0], pads[1], pads[2], pads[3])
    if (
        isinstance(padding, Sequence)
        and len(padding) == 4
        and all(isinstance(p, (int, np.integer)) and not isinstance(p, bool) for p in padding)
    ):
        if min(padding) < 0:
            raise ValueError(f"padding must be non-negative, got {padding!r}")
        return tuple(int(p) for p in padding)  # type: ignore[return-value]
    raise TypeError(f"padding must be 'same', 'valid' or (top, bottom, left, right) ints, got {padding!r}")


def depthwise_output_size(
    in_size: int, kernel: int, stride: int, dilation: int, pad_before: int, pad_after: int
) -> int:
    """Output length along one axis for explicit padding (``floor`` division, as PyTorch/TFLite)."""
    eff_k = (kernel - 1) * dilation + 1
    return max((in_size + pad_before + pad_after - eff_k) // stride + 1, 0)


# ----------------------------------------------------------------------------------------------
# Numba kernels
# ----------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _requantize(acc, mult, left, right, out_off, act_min, act_max):
    """Branch-free ``MultiplyByQuantizedMultiplier`` + offset + clamp, so chunk loops vectorize.

    Same integer results as :func:`incrinf.kernels.quantize.multiply_by_quantized_multiplier`:
    ``left``/``right`` are ``max(shift, 0)``/``max(-shift, 0)``.
    """
    xs = np.int64(np.int32(np.int64(acc) << left))  # int32 wrap, as in C++
    ab = xs * mult
    v = ab + ((1 << 30) - ((ab >> 63) & 0x7FFFFFFF))  # nudge: 2**30, or 1 - 2**30 if ab < 0
    high = (v + ((v >> 63) & 0x7FFFFFFF)) >> 31  # divide by 2**31 truncating toward zero
    mask = (np.int64(1) << right) - 1
    threshold = (mask >> 1) + ((high >> 63) & 1)
    q = (high >> right) + np.int64((high & mask) > threshold) + out_off
    return np.int8(min(max(q, act_min), act_max))


@njit(parallel=True, cache=True)
def _dw_channels_inner(
    xf, n_batch, in_h, in_w, in_c, wp, kh, kw, bias, base, mult, left, right,
    sh, sw, dh, dw, pad_t, pad_l, in_off, out_off, act_min, act_max,
    y0, x0, out_h, out_w, chunk, out,
):  # fmt: skip
    """Channel-innermost kernel on flat arrays.

    Shapes: ``xf`` int8 ``(N*H*W*C,)`` (NHWC); ``wp`` int8 ``(M, KH*KW, C)``: filter planes, one
    per depth-multiplier index, so the channel loop reads the filter contiguously; ``bias``,
    ``base``, ``mult``, ``left``, ``right``: ``(M, C)``; ``out`` int8 ``(N*OHr*OWr*C*M,)``.
    Offsets are unsigned so numba emits no negative-index wraparound and the loops vectorize.
    """
    dm = wp.shape[0]
    oc = in_c * dm
    n_taps = kh * kw
    tap_off = np.empty(n_taps, np.int64)  # input offset of each tap relative to the window origin
    for ky in range(kh):
        for kx in range(kw):
            tap_off[ky * kw + kx] = (ky * dh * in_w + kx * dw) * in_c
    for row in prange(n_batch * out_h):
        n = row // out_h
        r = row % out_h
        iy0 = (y0 + r) * sh - pad_t
        y_inside = iy0 >= 0 and iy0 + (kh - 1) * dh < in_h
        acc = np.empty(chunk, np.int32)
        for col in range(out_w):
            ix0 = (x0 + col) * sw - pad_l
            inside = y_inside and ix0 >= 0 and ix0 + (kw - 1) * dw < in_w
            out_base = ((n * out_h + r) * out_w + col) * oc
            for m in range(dm):
                for c0 in range(0, in_c, chunk):
                    cn = np.uint64(min(chunk, in_c - c0))
                    pc = np.uint64(c0)
                    if inside:
                        # Every tap is in the image: input_offset * sum(filter) is folded into base.
                        # Taps go three at a time: fewer accumulator load/store round trips.
                        origin = ((n * in_h + iy0) * in_w + ix0) * in_c + c0
                        for j in range(cn):
                            acc[j] = base[m, pc + j]
                        t = 0
                        while t + 3 <= n_taps:
                            xa = np.uint64(origin + tap_off[t])
                            xb = np.uint64(origin + tap_off[t + 1])
                            xc = np.uint64(origin + tap_off[t + 2])
                            wa, wb, wc = wp[m, t], wp[m, t + 1], wp[m, t + 2]
                            for j in range(cn):
                                acc[j] += (
                                    np.int32(wa[pc + j]) * np.int32(xf[xa + j])
                                    + np.int32(wb[pc + j]) * np.int32(xf[xb + j])
                                    + np.int32(wc[pc + j]) * np.int32(xf[xc + j])
                                )
                            t += 3
                        while t < n_taps:
                            xo = np.uint64(origin + tap_off[t])
                            wrow = wp[m, t]
                            for j in range(cn):
                                acc[j] += np.int32(wrow[pc + j]) * np.int32(xf[xo + j])
                            t += 1
                    else:
                        # Border: skip out-of-image taps exactly like the reference (zero padding).
                        for j in range(cn):
                            acc[j] = bias[m, pc + j]
                        for ky in range(kh):
                            iy = iy0 + ky * dh
                            if iy < 0 or iy >= in_h:
                                continue
                            for kx in range(kw):
                                ix = ix0 + kx * dw
                                if ix < 0 or ix >= in_w:
                                    continue
                                xo = np.uint64(((n * in_h + iy) * in_w + ix) * in_c + c0)
                                wrow = wp[m, ky * kw + kx]
                                for j in range(cn):
                                    acc[j] += np.int32(wrow[pc + j]) * (np.int32(xf[xo + j]) + in_off)
                    mrow = mult[m]
                    lrow = left[m]
                    rrow = right[m]
                    if dm == 1:
                        ob = np.uint64(out_base + c0)
                        for j in range(cn):
                            out[ob + j] = _requantize(
                                acc[j], mrow[pc + j], lrow[pc + j], rrow[pc + j], out_off, act_min, act_max
                            )
                    else:
                        ob = np.uint64(out_base + c0 * dm + m)
                        step = np.uint64(dm)
                        for j in range(cn):
                            out[ob + j * step] = _requantize(
                                acc[j], mrow[pc + j], lrow[pc + j], rrow[pc + j], out_off, act_min, act_max
                            )


@njit(parallel=True, cache=True)
def _dw_reference_order(
    x, w, bias, mult, left, right, sh, sw, dh, dw, pad_t, pad_l, dm,
    in_off, out_off, act_min, act_max, y0, x0, out,
):  # fmt: skip
    """TFLite's reference loop order (channel outer, taps inner), parallel over output rows.

    ``x`` (N,H,W,C), ``w`` (KH,KW,C*M), ``out`` (N,OHr,OWr,C*M); per-channel params ``(C*M,)``.
    """
    n_batch, in_h, in_w, in_c = x.shape
    kh, kw, oc = w.shape
    _, out_h, out_w, _ = out.shape
    for row in prange(n_batch * out_h):
        n = row // out_h
        r = row % out_h
        iy0 = (y0 + r) * sh - pad_t
        for col in range(out_w):
            ix0 = (x0 + col) * sw - pad_l
            for ic in range(in_c):
                for m in range(dm):
                    c = ic * dm + m
                    acc = np.int32(0)
                    for ky in range(kh):
                        iy = iy0 + ky * dh
                        for kx in range(kw):
                            ix = ix0 + kx * dw
                            if iy >= 0 and iy < in_h and ix >= 0 and ix < in_w:
                                acc += np.int32(w[ky, kx, c]) * (np.int32(x[n, iy, ix, ic]) + in_off)
                    acc += bias[c]
                    out[n, r, col, c] = _requantize(acc, mult[c], left[c], right[c], out_off, act_min, act_max)


# ----------------------------------------------------------------------------------------------
# Validation and the public entry points
# ----------------------------------------------------------------------------------------------


class _Problem(NamedTuple):
    x: np.ndarray  # (N, H, W, C) int8
    w: np.ndarray  # (KH, KW, OC) int8
    bias: np.ndarray  # (OC,) int32
    mult: np.ndarray  # (OC,) int32
    shift: np.ndarray  # (OC,) int32
    stride: tuple[int, int]
    dilation: tuple[int, int]
    pads: tuple[int, int, int, int]
    dm: int
    box: tuple[int, int, int, int]  # output box (y0, y1, x0, x1)


def _as_numpy(value, name: str, dtype: np.dtype, dtype_name: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name} must be a numpy array or torch tensor of {dtype_name}, got {type(value).__name__}")
    if value.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype_name}, got {value.dtype}")
    return np.ascontiguousarray(value)


def _per_channel(value, name: str, channels: int) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integer (int32), got dtype {arr.dtype}")
    if arr.ndim == 0:
        arr = np.full(channels, arr)
    arr64 = arr.astype(np.int64)
    if np.any(arr64 != arr64.astype(np.int32)):
        raise ValueError(f"{name} values must fit in int32")
    return np.ascontiguousarray(arr64.astype(np.int32))


def _check_int(value, name: str, lo: int, hi: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return int(value)


def _prepare(x, w, bias, stride, padding, dilation, depth_multiplier, mult, shift, region) -> _Problem:
    x = _as_numpy(x, "x", np.dtype(np.int8), "int8")
    w = _as_numpy(w, "w", np.dtype(np.int8), "int8")
    if x.ndim != 4:
        raise ValueError(f"x must be 4-D NHWC (N, H, W, C), got shape {x.shape}")
    if w.ndim != 4 or w.shape[0] != 1:
        raise ValueError(f"w must have shape (1, KH, KW, C*M) (TFLite depthwise layout), got {w.shape}")
    channels, oc = x.shape[3], w.shape[3]
    if channels == 0 or oc % channels != 0:
        raise ValueError(f"w has {oc} output channels, not a multiple of x's {channels} channels (NHWC)")
    dm = oc // channels
    if depth_multiplier is not None and _check_int(depth_multiplier, "depth_multiplier", 1, 2**31) != dm:
        raise ValueError(f"depth_multiplier={depth_multiplier} but w has {oc} = {channels} x {dm} channels")
    if bias is None:
        bias = np.zeros(oc, np.int32)
    bias = _as_numpy(bias, "bias", np.dtype(np.int32), "int32")
    if bias.shape != (oc,):
        raise ValueError(f"bias must have shape ({oc},) (one per output channel), got {bias.shape}")
    mult = _per_channel(mult, "output_multiplier", oc)
    shift = _per_channel(shift, "output_shift", oc)
    validate_multipliers(mult, shift, oc)

    stride_hw = _pair(stride, "stride")
    dilation_hw = _pair(dilation, "dilation")
    kernel = (w.shape[1], w.shape[2])
    pads = resolve_padding(padding, (x.shape[1], x.shape[2]), kernel, stride_hw, dilation_hw)
    out_h = depthwise_output_size(x.shape[1], kernel[0], stride_hw[0], dilation_hw[0], pads[0], pads[1])
    out_w = depthwise_output_size(x.shape[2], kernel[1], stride_hw[1], dilation_hw[1], pads[2], pads[3])
    box = _check_region(region, out_h, out_w)
    return _Problem(x, w[0], bias, mult, shift, stride_hw, dilation_hw, pads, dm, box)


def _check_region(region, out_h: int, out_w: int) -> tuple[int, int, int, int]:
    if region is None:
        return (0, out_h, 0, out_w)
    if not (
        isinstance(region, Sequence)
        and len(region) == 4
        and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in region)
    ):
        raise TypeError(f"region must be (y0, y1, x0, x1) ints (half-open output box), got {region!r}")
    y0, y1, x0, x1 = (int(v) for v in region)
    if not (0 <= y0 <= y1 <= out_h and 0 <= x0 <= x1 <= out_w):
        raise ValueError(
            f"region {region!r} must satisfy 0 <= y0 <= y1 <= {out_h} and 0 <= x0 <= x1 <= {out_w}"
            f" (half-open box inside the {out_h}x{out_w} output)"
        )
    return (y0, y1, x0, x1)


def _check_quant(input_offset, output_offset, act_min, act_max) -> tuple[int, int, int, int]:
    in_off = _check_int(input_offset, "input_offset", -INT8_MAX, -INT8_MIN)  # = -input_zero_point
    out_off = _check_int(output_offset, "output_offset", INT8_MIN, INT8_MAX)
    lo = _check_int(act_min, "act_min", INT8_MIN, INT8_MAX)
    hi = _check_int(act_max, "act_max", INT8_MIN, INT8_MAX)
    if lo > hi:
        raise ValueError(f"act_min ({lo}) must be <= act_max ({hi})")
    return in_off, out_off, lo, hi


@contextmanager
def _num_threads(threads: int | None):
    if threads is None:
        yield
        return
    threads = _check_int(threads, "threads", 1, numba.config.NUMBA_NUM_THREADS)
    previous = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        yield
    finally:
        numba.set_num_threads(previous)


def _wrap_like(result: np.ndarray, like) -> np.ndarray | torch.Tensor:
    if isinstance(like, torch.Tensor):
        return torch.from_numpy(result).to(like.device)
    return result


def depthwise_conv2d_int8(
    x: np.ndarray | torch.Tensor,
    w: np.ndarray | torch.Tensor,
    bias: np.ndarray | torch.Tensor | None,
    *,
    stride: Pair = 1,
    padding: Padding = "valid",
    dilation: Pair = 1,
    depth_multiplier: int | None = None,
    input_offset: int,
    output_offset: int,
    output_multiplier: np.ndarray | int,
    output_shift: np.ndarray | int,
    act_min: int = INT8_MIN,
    act_max: int = INT8_MAX,
    region: tuple[int, int, int, int] | None = None,
    chunk: int = 64,
    threads: int | None = None,
) -> np.ndarray | torch.Tensor:
    """Int8 depthwise convolution, bit-exact with TFLite's reference ``DepthwiseConvPerChannel``.

    Args:
        x: int8 input, NHWC ``(N, H, W, C)``, numpy or torch (the result has the same type).
        w: int8 filter, ``(1, KH, KW, C*M)`` (TFLite layout; output channel ``oc = ic*M + m``).
        bias: int32 bias ``(C*M,)`` or ``None`` for zeros.
        stride: int or ``(h, w)``.
        padding: ``"same"`` / ``"valid"`` (TFLite semantics) or explicit ``(top, bottom, left, right)``.
            Padding is zero padding: out-of-image taps are skipped.
        dilation: int or ``(h, w)``.
        depth_multiplier: ``M``; inferred from the shapes when ``None`` (checked when given).
        input_offset: ``-input_zero_point``.
        output_offset: ``output_zero_point``.
        output_multiplier: int32 ``(C*M,)`` (or a scalar for per-tensor), each 0 or in ``[2**30, 2**31)``.
        output_shift: int32 ``(C*M,)`` (or a scalar), each in ``[-31, 30]``.
        act_min, act_max: output clamp (the fused activation), within ``[-128, 127]``.
        region: half-open output box ``(y0, y1, x0, x1)``; only that box is computed and returned.
        chunk: int32 accumulators per channel chunk (rounded down to a multiple of ``M``).
        threads: numba threads for this call (default: ``numba.get_num_threads()``, which
            ``numba.set_num_threads`` controls).

    Returns:
        int8 ``(N, OH, OW, C*M)``, or ``(N, y1 - y0, x1 - x0, C*M)`` with ``region``.

    Raises:
        TypeError: wrong dtypes / argument types.
        ValueError: wrong shapes, channel mismatch, invalid multipliers, offsets, clamp or region.
    """
    p = _prepare(x, w, bias, stride, padding, dilation, depth_multiplier, output_multiplier, output_shift, region)
    in_off, out_off, lo, hi = _check_quant(input_offset, output_offset, act_min, act_max)
    chunk = _check_int(chunk, "chunk", 1, 1 << 16)
    n, in_h, in_w, in_c = p.x.shape
    kh, kw, oc = p.w.shape
    y0, y1, x0, x1 = p.box
    out = np.empty((n, y1 - y0, x1 - x0, oc), np.int8)
    if out.size:
        left, right = np.maximum(p.shift, 0), np.maximum(-p.shift, 0)
        # Interior pixels see every tap: fold input_offset * sum(filter) into the bias (int32 wraps).
        wsum = p.w.astype(np.int64).sum(axis=(0, 1))
        base = (p.bias.astype(np.int64) + in_off * wsum).astype(np.int32)

        def planes(a: np.ndarray) -> np.ndarray:  # (..., C*M) -> (M, ..., C): oc = ic*M + m
            a = a.reshape(*a.shape[:-1], in_c, p.dm)
            return np.ascontiguousarray(np.moveaxis(a, -1, 0))

        with _num_threads(threads):
            _dw_channels_inner(
                p.x.reshape(-1), n, in_h, in_w, in_c, planes(p.w.reshape(kh * kw, oc)), kh, kw,
                planes(p.bias), planes(base), planes(p.mult.astype(np.int64)),
                planes(left.astype(np.int64)), planes(right.astype(np.int64)),
                *p.stride, *p.dilation, p.pads[0], p.pads[2], in_off, out_off, lo, hi,
                y0, x0, y1 - y0, x1 - x0, chunk, out.reshape(-1),
            )  # fmt: skip
    return _wrap_like(out, x)


def depthwise_conv2d_int8_reference_order(
    x: np.ndarray | torch.Tensor,
    w: np.ndarray | torch.Tensor,
    bias: np.ndarray | torch.Tensor | None,
    *,
    stride: Pair = 1,
    padding: Padding = "valid",
    dilation: Pair = 1,
    depth_multiplier: int | None = None,
    input_offset: int,
    output_offset: int,
    output_multiplier: np.ndarray | int,
    output_shift: np.ndarray | int,
    act_min: int = INT8_MIN,
    act_max: int = INT8_MAX,
    region: tuple[int, int, int, int] | None = None,
    threads: int | None = None,
) -> np.ndarray | torch.Tensor:
    """Same as :func:`depthwise_conv2d_int8` with TFLite's reference loop order (channel outer).

    ``out_y, out_x, in_channel, m, filter_y, filter_x`` with a bounds check per tap: the
    baseline the channel-innermost kernel is benchmarked against. Same arguments and results.
    """
    p = _prepare(x, w, bias, stride, padding, dilation, depth_multiplier, output_multiplier, output_shift, region)
    in_off, out_off, lo, hi = _check_quant(input_offset, output_offset, act_min, act_max)
    y0, y1, x0, x1 = p.box
    out = np.empty((p.x.shape[0], y1 - y0, x1 - x0, p.w.shape[2]), np.int8)
    if out.size:
        left, right = np.maximum(p.shift, 0).astype(np.int64), np.maximum(-p.shift, 0).astype(np.int64)
        with _num_threads(threads):
            _dw_reference_order(
                p.x, p.w, p.bias, p.mult.astype(np.int64), left, right, *p.stride, *p.dilation, p.pads[0], p.pads[2],
                p.dm, in_off, out_off, lo, hi, y0, x0, out,
            )  # fmt: skip
    return _wrap_like(out, x)
