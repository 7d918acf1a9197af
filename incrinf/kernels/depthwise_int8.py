"""Int8 depthwise convolution, NHWC, channels innermost, bit-exact with TFLite's reference kernel.

TFLite's reference kernel (``reference_integer_ops::DepthwiseConvPerChannel``) walks
``batch, out_y, out_x, in_channel, m, filter_y, filter_x``: consecutive reads are ``C`` bytes
apart in NHWC. Following the TFLM design (seed 003) this kernel walks, at each output pixel,
the filter taps and, innermost, a chunk of ``chunk`` channels with int32 accumulators, so reads of
input and filter are contiguous and the channel loop vectorizes. The integer arithmetic is the
reference's, so results are identical:

    acc = bias[oc] + sum over in-image taps of filter[fy, fx, oc] * (input[iy, ix, ic] + input_offset)
    out = clamp(MultiplyByQuantizedMultiplier(acc, mult[oc], shift[oc]) + output_offset, act_min, act_max)

with ``oc = ic * depth_multiplier + m``. For pixels whose taps are all inside the image the
``input_offset`` term is the same for every pixel, so it is folded into the bias once
(``bias + input_offset * sum(filter)``, the "filter sum trick"); int32 addition wraps, so the
regrouping cannot change a result. Border pixels skip out-of-image taps exactly like the
reference (zero padding).

Two entry points: :func:`depthwise_conv2d_int8` (everything per call) and
:func:`pack_depthwise_int8` + :func:`depthwise_conv2d_int8_packed` (weights and per-channel
constants prepared once per layer, as an interpreter does at ``allocate_tensors``).

Threads: the kernels are numba ``prange`` loops over output rows; they use
``numba.get_num_threads()`` threads (set with ``numba.set_num_threads``) or ``threads=`` per call.
On an oversubscribed machine (more busy threads than cores) GNU OpenMP's spin-waiting can stall a
multi-threaded call for a whole scheduler slice; use one thread there, or ``OMP_WAIT_POLICY=PASSIVE``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from incrinf.extras import require
from incrinf.kernels.quantize import INT8_MAX, INT8_MIN, validate_multipliers

numba = require("numba", "int8", "the int8 kernels")
njit, prange = numba.njit, numba.prange

__all__ = [
    "PackedDepthwiseInt8",
    "depthwise_conv2d_int8",
    "depthwise_conv2d_int8_packed",
    "depthwise_conv2d_int8_reference_order",
    "depthwise_output_size",
    "pack_depthwise_int8",
    "resolve_padding",
]

Pair = int | tuple[int, int]
Padding = str | tuple[int, int, int, int]
Box = tuple[int, int, int, int]


# ----------------------------------------------------------------------------------------------
# Geometry
# ----------------------------------------------------------------------------------------------


# Validation runs on every call, region calls included: plain ints and tuples take fast paths.


def _is_int(value) -> bool:
    if type(value) is int:
        return True
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _int_tuple(value, length: int) -> bool:
    if type(value) is tuple and len(value) == length:
        for v in value:
            if type(v) is not int and not _is_int(v):
                return False
        return True
    return isinstance(value, Sequence) and len(value) == length and all(_is_int(v) for v in value)


def _pair(value: Pair, name: str) -> tuple[int, int]:
    if _is_int(value):
        pair = (int(value), int(value))
    elif _int_tuple(value, 2):
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
    if _int_tuple(padding, 4):
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


# ----------------------------------------------------------------------------------------------
# Numba kernels
# ----------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _requantize(acc, mult, left, right, out_off, act_min, act_max):
    """Branch-free ``MultiplyByQuantizedMultiplier`` + offset + clamp, so chunk loops vectorize.

    Same integer results as :func:`incrinf.kernels.quantize.multiply_by_quantized_multiplier`
    (``left``/``right`` are ``max(shift, 0)``/``max(-shift, 0)``), in fewer operations:

    - ``SaturatingRoundingDoublingHighMul(a, b)`` adds a nudge of ``2**30`` (``1 - 2**30`` when
      ``a*b < 0``) and divides by ``2**31`` truncating toward zero. For ``a*b < 0`` truncation is
      ``floor((v + 2**31 - 1) / 2**31)``, and the two corrections cancel: both signs reduce to
      ``(a*b + 2**30) >> 31`` (round half up). ``b`` is never INT32_MIN, so it never saturates.
    - ``RoundingDivideByPOT(h, e)`` rounds half away from zero: ``(h + 2**(e-1) - (h < 0)) >> e``
      for ``e > 0``, and ``h`` for ``e == 0``.
    """
    xs = np.int64(np.int32(np.int64(acc) << left))  # int32 wrap, as in C++
    high = (xs * mult + (1 << 30)) >> 31
    half = (np.int64(1) << right) >> 1
    q = ((high + half - ((high >> 63) & np.int64(right > 0))) >> right) + out_off
    return np.int8(min(max(q, act_min), act_max))


@njit(cache=True, inline="always")
def _accumulate(acc, init, xf, wf, tap_x, tap_w, n_valid, x_base, w_base, p_base, cn, off):
    """``acc[j] = init[p_base + j] + sum_t wf[w_base + tap_w[t] + j] * (xf[x_base + tap_x[t] + j] + off)``.

    Channels ``j < cn`` innermost (contiguous in NHWC and in the filter planes); taps go three at
    a time, which cuts the accumulator load/store round trips by three.
    """
    for j in range(cn):
        acc[j] = init[p_base + j]
    t = 0
    while t + 3 <= n_valid:
        xa = np.uint64(x_base + tap_x[t])
        xb = np.uint64(x_base + tap_x[t + 1])
        xc = np.uint64(x_base + tap_x[t + 2])
        wa = np.uint64(w_base + tap_w[t])
        wb = np.uint64(w_base + tap_w[t + 1])
        wc = np.uint64(w_base + tap_w[t + 2])
        for j in range(cn):
            acc[j] += (
                np.int32(wf[wa + j]) * (np.int32(xf[xa + j]) + off)
                + np.int32(wf[wb + j]) * (np.int32(xf[xb + j]) + off)
                + np.int32(wf[wc + j]) * (np.int32(xf[xc + j]) + off)
            )
        t += 3
    while t < n_valid:
        xa = np.uint64(x_base + tap_x[t])
        wa = np.uint64(w_base + tap_w[t])
        for j in range(cn):
            acc[j] += np.int32(wf[wa + j]) * (np.int32(xf[xa + j]) + off)
        t += 1


@njit(parallel=True, cache=True)
def _dw_channels_inner(
    xf, x_shape, wf, kernel, bias, base, mult, left, right, geometry, quant, box, chunk, out
):
    """Channel-innermost kernel on flat arrays, parallel over output rows.

    Arrays: ``xf`` int8 ``(N*H*W*C,)`` (NHWC); ``wf`` int8 ``(M*KH*KW*C,)``: filter planes
    ``(M, KH*KW, C)``, one per depth-multiplier index, so the channel loop reads the filter
    contiguously; ``bias``, ``base``, ``mult``, ``left``, ``right``: ``(M*C,)`` planes; ``out``
    int8 ``(N*OHr*OWr*C*M,)``. Offsets are unsigned: numba then emits no negative-index
    wraparound and the channel loops vectorize. Scalars come in tuples: ``x_shape``
    ``(N, H, W, C)``, ``kernel`` ``(M, KH, KW)``, ``geometry`` ``(sh, sw, dh, dw, pad_top,
    pad_left)``, ``quant`` ``(input_offset, output_offset, act_min, act_max)``, ``box``
    ``(y0, x0, OHr, OWr)``. (Arrays stay separate arguments: numba's alias analysis would count
    arrays unpacked from a tuple as aliases and drop the noalias flag.)
    """
    n_batch, in_h, in_w, in_c = x_shape
    dm, kh, kw = kernel
    sh, sw, dh, dw, pad_t, pad_l = geometry
    in_off, out_off, act_min, act_max = quant
    y0, x0, out_h, out_w = box
    oc = in_c * dm
    n_taps = kh * kw
    # Interior windows: every tap, offsets relative to the window origin.
    all_x = np.empty(n_taps, np.int64)
    all_w = np.empty(n_taps, np.int64)
    for ky in range(kh):
        for kx in range(kw):
            all_x[ky * kw + kx] = (ky * dh * in_w + kx * dw) * in_c
            all_w[ky * kw + kx] = (ky * kw + kx) * in_c
    # A window origin (iy0, ix0) is interior iff 0 <= iy0 < y_lim and 0 <= ix0 < x_lim; tested with
    # one unsigned compare. (No `and` on bools: numba's alias analysis treats bool copies as
    # possible array aliases and would drop the noalias flag that lets the loops vectorize.)
    y_lim = np.uint64(max(in_h - (kh - 1) * dh, 0))
    x_lim = np.uint64(max(in_w - (kw - 1) * dw, 0))
    for row in prange(n_batch * out_h):
        n = row // out_h
        r = row % out_h
        iy0 = (y0 + r) * sh - pad_t
        y_inside = np.uint64(iy0) < y_lim
        acc = np.empty(chunk, np.int32)
        border_x = np.empty(n_taps, np.int64)
        border_w = np.empty(n_taps, np.int64)
        for col in range(out_w):
            ix0 = (x0 + col) * sw - pad_l
            inside = y_inside & (np.uint64(ix0) < x_lim)
            origin = ((n * in_h + iy0) * in_w + ix0) * in_c
            n_valid = 0
            if not inside:
                # Border: list the in-image taps only, exactly the reference's zero padding.
                for ky in range(kh):
                    iy = iy0 + ky * dh
                    if np.uint64(iy) < np.uint64(in_h):  # also rejects iy < 0
                        for kx in range(kw):
                            ix = ix0 + kx * dw
                            if np.uint64(ix) < np.uint64(in_w):
                                border_x[n_valid] = (ky * dh * in_w + kx * dw) * in_c
                                border_w[n_valid] = (ky * kw + kx) * in_c
                                n_valid += 1
            out_base = ((n * out_h + r) * out_w + col) * oc
            for m in range(dm):
                for c0 in range(0, in_c, chunk):
                    cn = np.uint64(min(chunk, in_c - c0))
                    p_base = np.uint64(m * in_c + c0)  # index into the (M, C) parameter planes
                    w_base = m * n_taps * in_c + c0  # filter plane m, channel c0
                    if inside:
                        # input_offset * sum(filter) is already in `base`: add the raw input.
                        _accumulate(
                            acc, base, xf, wf, all_x, all_w, n_taps, origin + c0, w_base, p_base, cn, 0
                        )
                    else:
                        _accumulate(
                            acc,
                            bias,
                            xf,
                            wf,
                            border_x,
                            border_w,
                            n_valid,
                            origin + c0,
                            w_base,
                            p_base,
                            cn,
                            in_off,
                        )
                    if dm == 1:
                        ob = np.uint64(out_base + c0)
                        for j in range(cn):
                            out[ob + j] = _requantize(
                                acc[j],
                                mult[p_base + j],
                                left[p_base + j],
                                right[p_base + j],
                                out_off,
                                act_min,
                                act_max,
                            )
                    else:  # output channel ic*M + m: stride M
                        ob = np.uint64(out_base + c0 * dm + m)
                        step = np.uint64(dm)
                        for j in range(cn):
                            out[ob + j * step] = _requantize(
                                acc[j],
                                mult[p_base + j],
                                left[p_base + j],
                                right[p_base + j],
                                out_off,
                                act_min,
                                act_max,
                            )


@njit(parallel=True, cache=True)
def _dw_reference_order(x, w, bias, mult, left, right, dm, geometry, quant, origin, out):
    """TFLite's reference loop order (channel outer, taps inner), parallel over output rows.

    ``x`` (N,H,W,C), ``w`` (KH,KW,C*M), ``out`` (N,OHr,OWr,C*M); per-channel params ``(C*M,)``;
    scalar tuples as in :func:`_dw_channels_inner`, ``origin`` = ``(y0, x0)``.
    """
    sh, sw, dh, dw, pad_t, pad_l = geometry
    in_off, out_off, act_min, act_max = quant
    y0, x0 = origin
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
                    out[n, r, col, c] = _requantize(
                        acc, mult[c], left[c], right[c], out_off, act_min, act_max
                    )


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _as_numpy(value, name: str, dtype: type, dtype_name: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if not isinstance(value, np.ndarray):
        raise TypeError(
            f"{name} must be a numpy array or torch tensor of {dtype_name}, got {type(value).__name__}"
        )
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
    if arr.dtype != np.int32:
        wide = arr.astype(np.int64)
        if np.any(wide != wide.astype(np.int32)):
            raise ValueError(f"{name} values must fit in int32")
        arr = wide.astype(np.int32)
    return np.ascontiguousarray(arr)


def _check_int(value, name: str, lo: int, hi: int) -> int:
    if type(value) is int and lo <= value <= hi:
        return value
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return int(value)


def _check_region(region, out_h: int, out_w: int) -> Box:
    if region is None:
        return (0, out_h, 0, out_w)
    if not _int_tuple(region, 4):
        raise TypeError(f"region must be (y0, y1, x0, x1) ints (a half-open output box), got {region!r}")
    y0, y1, x0, x1 = int(region[0]), int(region[1]), int(region[2]), int(region[3])
    if not (0 <= y0 <= y1 <= out_h and 0 <= x0 <= x1 <= out_w):
        raise ValueError(
            f"region {tuple(region)!r} must satisfy 0 <= y0 <= y1 <= {out_h} and 0 <= x0 <= x1 <= {out_w}"
            f" (a half-open box inside the {out_h}x{out_w} output)"
        )
    return (y0, y1, x0, x1)


def _check_x(x, in_channels: int | None = None) -> np.ndarray:
    x = _as_numpy(x, "x", np.int8, "int8")
    if x.ndim != 4:
        raise ValueError(f"x must be 4-D NHWC (N, H, W, C), got shape {x.shape}")
    if in_channels is not None and x.shape[3] != in_channels:
        raise ValueError(
            f"x has {x.shape[3]} channels (last axis, NHWC) but the filter expects {in_channels}; is x NCHW?"
        )
    return x


def _check_output_quant(output_offset, act_min, act_max) -> tuple[int, int, int]:
    out_off = _check_int(output_offset, "output_offset", INT8_MIN, INT8_MAX)
    lo = _check_int(act_min, "act_min", INT8_MIN, INT8_MAX)
    hi = _check_int(act_max, "act_max", INT8_MIN, INT8_MAX)
    if lo > hi:
        raise ValueError(f"act_min ({lo}) must be <= act_max ({hi})")
    return out_off, lo, hi


def _run_with_threads(threads: int | None, kernel, *args) -> None:
    """``kernel(*args)`` with ``threads`` numba threads (``None``: the current setting)."""
    if threads is None:
        kernel(*args)
        return
    threads = _check_int(threads, "threads", 1, numba.config.NUMBA_NUM_THREADS)
    previous = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        kernel(*args)
    finally:
        numba.set_num_threads(previous)


def _wrap_like(result: np.ndarray, like) -> np.ndarray | torch.Tensor:
    if isinstance(like, torch.Tensor):
        return torch.from_numpy(result).to(like.device)
    return result


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


class PackedDepthwiseInt8(NamedTuple):
    """A depthwise layer's int8 weights and per-channel constants, laid out for the kernel.

    ``M`` is the depth multiplier, ``C`` the input channels, ``T = KH * KW``. Per-channel arrays
    are split into ``M`` planes of ``C`` (``oc = ic*M + m``) so the channel loop is contiguous.
    """

    weight: np.ndarray  # int8 (KH, KW, C*M): TFLite layout (reference-order kernel)
    bias: np.ndarray  # int32 (C*M,)
    multiplier: np.ndarray  # int32 (C*M,)
    shift: np.ndarray  # int32 (C*M,)
    weight_planes: np.ndarray  # int8 (M*T*C,): planes (M, T, C)
    bias_planes: np.ndarray  # int32 (M*C,)
    base_planes: np.ndarray  # int32 (M*C,): bias + input_offset * sum over taps of the filter
    mult_planes: np.ndarray  # int32 (M*C,)
    left_planes: np.ndarray  # int32 (M*C,): max(shift, 0)
    right_planes: np.ndarray  # int32 (M*C,): max(-shift, 0)
    kernel_size: tuple[int, int]
    in_channels: int
    depth_multiplier: int
    input_offset: int


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
    w = _as_numpy(w, "w", np.int8, "int8")
    if w.ndim != 4 or w.shape[0] != 1:
        raise ValueError(f"w must have shape (1, KH, KW, C*M) (TFLite depthwise layout), got {w.shape}")
    _, kh, kw, oc = w.shape
    if kh == 0 or kw == 0 or oc == 0:
        raise ValueError(f"w must have a non-empty kernel and channels, got shape {w.shape}")
    if in_channels is None:
        dm = 1 if depth_multiplier is None else _check_int(depth_multiplier, "depth_multiplier", 1, oc)
        if oc % dm:
            raise ValueError(f"w has {oc} output channels, not a multiple of depth_multiplier={dm}")
        in_channels = oc // dm
    else:
        in_channels = _check_int(in_channels, "in_channels", 1, oc)
        if oc % in_channels:
            raise ValueError(
                f"w has {oc} output channels, not a multiple of the input's {in_channels} channels"
            )
        dm = oc // in_channels
        if depth_multiplier is not None and _check_int(depth_multiplier, "depth_multiplier", 1, oc) != dm:
            raise ValueError(
                f"depth_multiplier={depth_multiplier} but w has {oc} = {in_channels} x {dm} channels"
            )
    bias = np.zeros(oc, np.int32) if bias is None else _as_numpy(bias, "bias", np.int32, "int32")
    if bias.shape != (oc,):
        raise ValueError(f"bias must have shape ({oc},) (one per output channel), got {bias.shape}")
    mult = _per_channel(output_multiplier, "output_multiplier", oc)
    shift = _per_channel(output_shift, "output_shift", oc)
    validate_multipliers(mult, shift, oc)
    in_off = _check_int(input_offset, "input_offset", -INT8_MAX, -INT8_MIN)  # = -input_zero_point

    w3 = w[0]
    # Interior pixels see every tap: fold input_offset * sum(filter) into the bias (int32 wraps).
    base = (bias.astype(np.int64) + in_off * w3.sum(axis=(0, 1), dtype=np.int64)).astype(np.int32)

    def planes(a: np.ndarray) -> np.ndarray:  # (..., C*M) -> flat (M, ..., C)
        if dm == 1:
            return a.reshape(-1)
        lead = a.shape[:-1]
        a = a.reshape(-1, in_channels, dm).transpose(2, 0, 1)
        return np.ascontiguousarray(a).reshape(dm * int(np.prod(lead, dtype=np.int64)) * in_channels)

    return PackedDepthwiseInt8(
        weight=w3,
        bias=bias,
        multiplier=mult,
        shift=shift,
        weight_planes=planes(w3.reshape(kh * kw, oc)),
        bias_planes=planes(bias),
        base_planes=planes(base),
        mult_planes=planes(mult),
        left_planes=planes(np.maximum(shift, 0)),
        right_planes=planes(np.maximum(-shift, 0)),
        kernel_size=(kh, kw),
        in_channels=in_channels,
        depth_multiplier=dm,
        input_offset=in_off,
    )


def _geometry(x: np.ndarray, packed: PackedDepthwiseInt8, stride, padding, dilation, region):
    stride_hw = _pair(stride, "stride")
    dilation_hw = _pair(dilation, "dilation")
    kh, kw = packed.kernel_size
    pads = resolve_padding(padding, (x.shape[1], x.shape[2]), packed.kernel_size, stride_hw, dilation_hw)
    out_h = depthwise_output_size(x.shape[1], kh, stride_hw[0], dilation_hw[0], pads[0], pads[1])
    out_w = depthwise_output_size(x.shape[2], kw, stride_hw[1], dilation_hw[1], pads[2], pads[3])
    return stride_hw, dilation_hw, pads, _check_region(region, out_h, out_w)


def depthwise_conv2d_int8_packed(
    x: np.ndarray | torch.Tensor,
    packed: PackedDepthwiseInt8,
    *,
    stride: Pair = 1,
    padding: Padding = "valid",
    dilation: Pair = 1,
    output_offset: int,
    act_min: int = INT8_MIN,
    act_max: int = INT8_MAX,
    region: Box | None = None,
    chunk: int = 64,
    threads: int | None = None,
) -> np.ndarray | torch.Tensor:
    """:func:`depthwise_conv2d_int8` with weights prepared by :func:`pack_depthwise_int8`."""
    if not isinstance(packed, PackedDepthwiseInt8):
        raise TypeError(f"packed must come from pack_depthwise_int8, got {type(packed).__name__}")
    return _wrap_like(
        _run_packed(
            _check_x(x, packed.in_channels),
            packed,
            stride,
            padding,
            dilation,
            output_offset,
            act_min,
            act_max,
            region,
            chunk,
            threads,
        ),
        x,
    )


def _run_packed(
    xa: np.ndarray,
    packed: PackedDepthwiseInt8,
    stride,
    padding,
    dilation,
    output_offset,
    act_min,
    act_max,
    region,
    chunk,
    threads,
) -> np.ndarray:
    (sh, sw), (dh, dw), pads, (y0, y1, x0, x1) = _geometry(xa, packed, stride, padding, dilation, region)
    out_off, lo, hi = _check_output_quant(output_offset, act_min, act_max)
    chunk = _check_int(chunk, "chunk", 1, 1 << 16)
    n, in_h, in_w, in_c = xa.shape
    kh, kw = packed.kernel_size
    out = np.empty((n, y1 - y0, x1 - x0, in_c * packed.depth_multiplier), np.int8)
    if out.size:
        _run_with_threads(
            threads,
            _dw_channels_inner,
            xa.reshape(-1),
            (n, in_h, in_w, in_c),
            packed.weight_planes,
            (packed.depth_multiplier, kh, kw),
            packed.bias_planes,
            packed.base_planes,
            packed.mult_planes,
            packed.left_planes,
            packed.right_planes,
            (sh, sw, dh, dw, pads[0], pads[2]),
            (packed.input_offset, out_off, lo, hi),
            (y0, x0, y1 - y0, x1 - x0),
            chunk,
            out.reshape(-1),
        )
    return out


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
    region: Box | None = None,
    chunk: int = 64,
    threads: int | None = None,
) -> np.ndarray | torch.Tensor:
    """Int8 depthwise convolution, bit-exact with TFLite's reference ``DepthwiseConvPerChannel``.

    Args:
        x: int8 input, NHWC ``(N, H, W, C)``, numpy or torch (the result has the same type).
        w: int8 filter ``(1, KH, KW, C*M)`` (TFLite layout; output channel ``oc = ic*M + m``).
        bias: int32 ``(C*M,)``, or ``None`` for zeros.
        stride: int or ``(h, w)``.
        padding: ``"same"`` / ``"valid"`` (TFLite semantics) or explicit ``(top, bottom, left, right)``.
            Padding is zero padding: out-of-image taps are skipped, as in TFLite.
        dilation: int or ``(h, w)``.
        depth_multiplier: ``M``; inferred from the shapes when ``None`` (checked when given).
        input_offset: ``-input_zero_point``, in ``[-127, 128]``.
        output_offset: ``output_zero_point``, in ``[-128, 127]``.
        output_multiplier: int32 ``(C*M,)`` (or a scalar for per-tensor), each 0 or in ``[2**30, 2**31)``.
        output_shift: int32 ``(C*M,)`` (or a scalar), each in ``[-31, 30]``.
        act_min, act_max: output clamp (the fused activation), within ``[-128, 127]``.
        region: half-open output box ``(y0, y1, x0, x1)``; only that box is computed and returned.
        chunk: int32 accumulators per channel chunk (seed 003 uses 32; 64 is a little faster here).
        threads: numba threads for this call; default ``numba.get_num_threads()``.

    Returns:
        int8 ``(N, OH, OW, C*M)``, or ``(N, y1 - y0, x1 - x0, C*M)`` with ``region``.

    Raises:
        TypeError: wrong dtypes or argument types.
        ValueError: wrong shapes or layouts, channel mismatch, out-of-range multipliers, shifts,
            offsets or clamp, or a region outside the output.
    """
    xa = _check_x(x)
    packed = pack_depthwise_int8(
        w,
        bias,
        input_offset=input_offset,
        output_multiplier=output_multiplier,
        output_shift=output_shift,
        depth_multiplier=depth_multiplier,
        in_channels=xa.shape[3],
    )
    out = _run_packed(
        xa, packed, stride, padding, dilation, output_offset, act_min, act_max, region, chunk, threads
    )
    return _wrap_like(out, x)


def depthwise_conv2d_int8_reference_order(
    x: np.ndarray | torch.Tensor,
    w: np.ndarray | torch.Tensor | PackedDepthwiseInt8,
    bias: np.ndarray | torch.Tensor | None = None,
    *,
    stride: Pair = 1,
    padding: Padding = "valid",
    dilation: Pair = 1,
    depth_multiplier: int | None = None,
    input_offset: int | None = None,
    output_offset: int,
    output_multiplier: np.ndarray | int | None = None,
    output_shift: np.ndarray | int | None = None,
    act_min: int = INT8_MIN,
    act_max: int = INT8_MAX,
    region: Box | None = None,
    threads: int | None = None,
) -> np.ndarray | torch.Tensor:
    """Same results as :func:`depthwise_conv2d_int8`, in TFLite's reference loop order.

    ``out_y, out_x, in_channel, m, filter_y, filter_x`` (channel outer) with a bounds check per
    tap, parallel over output rows: the baseline the channel-innermost kernel is measured
    against. ``w`` may also be a :class:`PackedDepthwiseInt8` (then ``bias``, ``input_offset``
    and the multipliers come from it).
    """
    if isinstance(w, PackedDepthwiseInt8):
        packed = w
    else:
        if input_offset is None or output_multiplier is None or output_shift is None:
            raise TypeError("input_offset, output_multiplier and output_shift are required with a raw filter")
        x_channels = _check_x(x).shape[3]
        packed = pack_depthwise_int8(
            w,
            bias,
            input_offset=input_offset,
            output_multiplier=output_multiplier,
            output_shift=output_shift,
            depth_multiplier=depth_multiplier,
            in_channels=x_channels,
        )
    xa = _check_x(x, packed.in_channels)
    (sh, sw), (dh, dw), pads, (y0, y1, x0, x1) = _geometry(xa, packed, stride, padding, dilation, region)
    out_off, lo, hi = _check_output_quant(output_offset, act_min, act_max)
    out = np.empty((xa.shape[0], y1 - y0, x1 - x0, packed.weight.shape[2]), np.int8)
    if out.size:
        _run_with_threads(
            threads,
            _dw_reference_order,
            xa,
            packed.weight,
            packed.bias,
            packed.multiplier,
            np.maximum(packed.shift, 0),
            np.maximum(-packed.shift, 0),
            packed.depth_multiplier,
            (sh, sw, dh, dw, pads[0], pads[2]),
            (packed.input_offset, out_off, lo, hi),
            (y0, x0),
            out,
        )
    return _wrap_like(out, x)
