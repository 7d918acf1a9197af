"""Numba kernels of the int8 depthwise convolution: the tiled channel-innermost kernel and TFLite's loop order.

Both compute TFLite's reference arithmetic (``reference_integer_ops::DepthwiseConvPerChannel``)::

    acc = bias[oc] + sum over in-image taps of filter[fy, fx, oc] * (input[iy, ix, ic] + input_offset)
    out = clamp(MultiplyByQuantizedMultiplier(acc, mult[oc], shift[oc]) + output_offset, act_min, act_max)

with ``oc = ic * M + m`` (``M`` the depth multiplier), so their results are identical bit for bit.

:func:`depthwise_units` follows the TFLM design (NHWC, channels innermost, int32 accumulators in chunks) laid
out the way XNNPACK's micro-kernels are (see :mod:`incrinf.kernels.depthwise_packing` for the packed weights):

- The work is cut into units (one output row of one channel tile; see :func:`depthwise_units`) that threads take
  in claims of unit ranges (:mod:`incrinf.kernels.depthwise_pool`). For each
  row the kernel first builds the row's *indirection buffer*: for every output pixel and tap, the address of the
  input pixel the tap reads, or of a *zero row* when the tap falls outside the image. The zero row holds the input
  zero point, whose contribution ``filter * (zero_point + input_offset)`` is 0, so padding costs no bounds test; and
  since every tap is then read, ``input_offset * sum(filter)`` is the same for every pixel and is folded into the
  packed bias ("base").
- Channels go in tiles of :data:`TILE` (a compile-time constant, so the channel loop of a tile has a fixed trip
  count that LLVM unrolls into 512-bit vectors). For each tile, the row's pixels accumulate
  ``base + sum_t weight[t] * x[tap t]`` in int32 lanes: the tap loop has a constant trip count for 3x3 and 5x5
  filters (9 and 25 taps: "unipass", the accumulator stays in registers) and runs in groups of
  :data:`TAP_GROUP` taps otherwise. Weights are packed as int32, so each tap is one sign-extending load of
  input bytes, one ``vpmulld`` and one ``vpaddd`` per 16 channels.
- The row's accumulators for the tile are then requantized with TFLite's double rounding
  (``SaturatingRoundingDoublingHighMul``, then ``RoundingDivideByPOT``), vectorized in two passes over the
  tile: a 64-bit pass that multiplies channel pairs (even lanes and odd lanes, the two ``vpmuldq`` an
  SSE/AVX gemmlowp implementation uses) and an int32 pass for the rounding shift, offset and clamp.

int32 additions wrap, as the reference's do on every real target, so regrouping the sum (base first, taps in
any order) cannot change a result. Indices are unsigned in the hot loops: numba then emits no negative-index
wraparound and the loops vectorize.
"""

from __future__ import annotations

import numpy as np

from incrinf.extras import require
from incrinf.kernels.intrinsics import (
    address_of,
    load_int8,
    load_pair,
    prefer_wide_vectors,
    store_pair,
    store_scratch,
)

numba = require("numba", "int8", "the int8 kernels")
njit, prange = numba.njit, numba.prange

__all__ = [
    "CONFIG_SIZE",
    "PARAM_ROWS",
    "TAP_GROUP",
    "TILE",
    "UNIPASS_TAPS",
    "UNITS",
    "depthwise_reference_order",
    "depthwise_units",
    "requantize_block",
]

TILE = 32
"""Channels per tile: 2 AVX-512 vectors of int32 accumulators (4 with AVX2)."""

TAP_GROUP = 4
"""Taps accumulated per pass over a tile's accumulators when the filter has no unipass kernel."""


UNIPASS_TAPS = (9, 25)
"""Tap counts (3x3, 5x5) whose kernels sum every tap in one pass, the accumulator held in registers."""

# Rows of the packed per-tile int32 parameters (see depthwise_packing.PackedDepthwiseInt8.tile_params).
BASE, MULT, LEFT, RIGHT, ROUND_MASK, ROUND_THRESHOLD = range(6)
PARAM_ROWS = 6

CONFIG_SIZE = 22
"""Length of :func:`depthwise_units`'s ``config`` (entry 20 is 0: see :func:`_high_mul`'s ``s32``)."""

UNITS = 21
"""Index in ``config`` of the layer's work units (output rows x depth-multiplier planes x channel tiles)."""

_HALF = TILE // 2
_LOW_WORDS = np.int64(0xFFFFFFFF)


def _unipass(n_taps: int):
    """The kernel summing ``n_taps`` taps (a compile-time constant) into one tile's accumulators of one pixel."""

    @njit(inline="always")
    def accumulate(acc, acc_base, ind, ind_base, tap_stride, c0, weights, w_base, params, p_base, width):
        for j in range(width):
            ju = np.uint64(j)
            s = np.int32(params[p_base + np.uint64(BASE * TILE) + ju])
            for t in range(n_taps):
                tap = np.uint64(t)
                s = np.int32(
                    s
                    + np.int32(weights[w_base + tap * np.uint64(TILE) + ju])
                    * np.int32(load_int8(ind[ind_base + tap * tap_stride] + c0, j))
                )
            store_scratch(acc, acc_base + ju, np.int32(s << (params[p_base + np.uint64(LEFT * TILE) + ju] & 31)))

    return accumulate


_accumulate_9 = _unipass(9)
_accumulate_25 = _unipass(25)


@njit(inline="always")
def _accumulate_groups(
    acc, acc_base, ind, ind_base, tap_stride, c0, weights, w_base, params, p_base, width, n_taps
):
    """Multipass form for any tap count: groups of :data:`TAP_GROUP` taps, then the remaining taps one by one."""
    for j in range(width):
        ju = np.uint64(j)
        store_scratch(acc, acc_base + ju, params[p_base + np.uint64(BASE * TILE) + ju])
    t0 = 0
    while t0 + TAP_GROUP <= n_taps:
        for j in range(width):
            ju = np.uint64(j)
            s = acc[acc_base + ju]
            for g in range(TAP_GROUP):
                tap = np.uint64(t0 + g)
                s = np.int32(
                    s
                    + np.int32(weights[w_base + tap * np.uint64(TILE) + ju])
                    * np.int32(load_int8(ind[ind_base + tap * tap_stride] + c0, j))
                )
            store_scratch(acc, acc_base + ju, s)
        t0 += TAP_GROUP
    while t0 < n_taps:
        tap = np.uint64(t0)
        address = ind[ind_base + tap * tap_stride] + c0
        for j in range(width):
            ju = np.uint64(j)
            product = np.int32(weights[w_base + tap * np.uint64(TILE) + ju]) * np.int32(load_int8(address, j))
            store_scratch(acc, acc_base + ju, np.int32(acc[acc_base + ju] + product))
        t0 += 1
    for j in range(width):
        ju = np.uint64(j)
        shifted = np.int32(acc[acc_base + ju] << (params[p_base + np.uint64(LEFT * TILE) + ju] & 31))
        store_scratch(acc, acc_base + ju, shifted)


@njit(inline="always")
def _high_mul(acc, acc_base, n_pixels, params, p_base, s32):
    """``SaturatingRoundingDoublingHighMul(acc, mult)`` in place, two channels per int64 lane.

    ``(a * b + 2**30) >> 31`` is TFLite's nudge-and-truncate for both signs (for ``a*b < 0`` truncation toward
    zero is ``floor((v + 2**31 - 1) / 2**31)``, and the corrections cancel); ``b`` is never INT32_MIN, so it
    never saturates. The even channel of a pair sits in the low 32 bits, the odd one in the high 32 bits, so
    each half is one 32x32->64 multiply (``vpmuldq``). ``s32`` is 32, passed at run time: a literal 32 lets
    LLVM fold the odd lane's shifts into its multiply and pick the slower 64-bit ``vpmullq``. (The kernel adds
    a config entry that is always 0 to a literal 32.)
    """
    m_base = (p_base + np.uint64(MULT * TILE)) >> np.uint64(1)
    for px in range(n_pixels):
        a_base = (acc_base + np.uint64(px) * np.uint64(TILE)) >> np.uint64(1)
        for k in range(_HALF):
            ku = np.uint64(k)
            a = load_pair(acc, a_base + ku)
            m = load_pair(params, m_base + ku)
            even = ((a << 32) >> 32) * ((m << 32) >> 32)
            odd = (a >> 32) * (m >> 32)
            high = (((even + (1 << 30)) >> 31) & _LOW_WORDS) | (((odd + (1 << 30)) >> 31) << s32)
            store_pair(acc, a_base + ku, high)


@njit(inline="always")
def _round_store(
    acc, acc_base, n_pixels, params, p_base, width, out, out_base, pixel_stride, dm, m, out_off, act_min, act_max
):
    """``RoundingDivideByPOT`` (ties away from zero) + output offset + clamp, stored as int8.

    ``(h >> e) + ((h & mask) > threshold + (h < 0))`` with ``mask = 2**e - 1``, ``threshold = mask >> 1``
    (gemmlowp's form: no addition that could overflow int32).
    """
    r_base = p_base + np.uint64(RIGHT * TILE)
    mask_base = p_base + np.uint64(ROUND_MASK * TILE)
    thr_base = p_base + np.uint64(ROUND_THRESHOLD * TILE)
    step = np.uint64(dm)
    for px in range(n_pixels):
        a_base = acc_base + np.uint64(px) * np.uint64(TILE)
        o_base = out_base + np.uint64(px) * pixel_stride + np.uint64(m)
        for j in range(width):
            ju = np.uint64(j)
            h = acc[a_base + ju]
            above = np.int32(np.int32(h & params[mask_base + ju]) > np.int32(params[thr_base + ju] - (h >> 31)))
            q = np.int32(np.int32(h >> (params[r_base + ju] & 31)) + above + out_off)
            out[o_base + ju * step] = np.int8(min(max(q, act_min), act_max))


@njit(nogil=True, cache=True, _nrt=False)
def depthwise_units(xf, weights, params, zero_row, out, config, acc, ind, u0, u1):
    """The tiled kernel on flat arrays, for work units ``u0 <= u < u1`` (see the module docstring).

    A work unit is one output row of one channel tile of one depth-multiplier plane: unit ``u`` is row
    ``u // (M * n_tiles)`` (rows of all batch images in turn) and tile ``u % (M * n_tiles)``; every unit of a
    layer costs the same multiply-adds (but the last, narrower tile of a plane). The threads of a call
    (:mod:`incrinf.kernels.depthwise_pool`) take ranges of units; every unit is computed the same way whichever
    thread takes it, so results do not depend on the number of threads.

    Args:
        xf: int8 ``(N*H*W*C,)``, the NHWC input.
        weights: int32 ``(M * n_tiles * T * TILE,)``: per plane ``m`` and channel tile, the ``T = KH*KW`` taps'
            weights of the tile's channels (zero past the last channel).
        params: int32 ``(M * n_tiles * PARAM_ROWS * TILE,)``: per tile, the rows BASE (bias + input_offset *
            sum of the filter), MULT, LEFT (max(shift, 0)), RIGHT (max(-shift, 0)), ROUND_MASK (2**RIGHT - 1)
            and ROUND_THRESHOLD (ROUND_MASK >> 1).
        zero_row: int8 ``(>= n_tiles * TILE,)`` filled with the input zero point.
        out: int8 ``(N*OHr*OWr*C*M,)``, NHWC: output rows ``y0:y0+OHr`` and columns ``x0:x0+OWr``.
        config: int64 ``(CONFIG_SIZE,)``: N, H, W, C, M, KH, KW, stride (h, w), dilation (h, w), padding (top,
            left), output_offset, act_min, act_max, y0, x0, OHr, OWr, 0, units (one array rather than tuples:
            numba types an array argument faster than tuples, which matters on small layers).
        acc: int32 scratch ``(>= OWr * TILE,)``: one row's accumulators of one tile.
        ind: int64 scratch ``(>= OWr * T,)``: one row's indirection buffer.

    The function is compiled with every array argument ``noalias`` (:func:`_assume_no_alias`): LLVM then knows
    that the accumulators never overwrite the indirection buffer or the weights, hoists the tap addresses out of
    the channel loop and vectorizes it. The caller guarantees it (``out`` never overlaps the input; the scratch
    is the calling thread's own). It allocates nothing and is compiled without numba's reference counting, which
    would otherwise count the arrays in and out of every inlined helper (two calls per pixel and tile).
    """
    prefer_wide_vectors()
    in_h, in_w, in_c = config[1], config[2], config[3]
    dm, kh, kw = config[4], config[5], config[6]
    sh, sw, dh, dw, pad_t, pad_l = config[7], config[8], config[9], config[10], config[11], config[12]
    out_off, act_min, act_max = np.int32(config[13]), np.int32(config[14]), np.int32(config[15])
    y0, x0, out_h, out_w = config[16], config[17], config[18], config[19]
    s32 = np.int64(32) + config[20]
    n_taps = kh * kw
    n_tiles = (in_c + TILE - 1) // TILE
    planes = dm * n_tiles
    pixel_stride = np.uint64(in_c * dm)
    ow = np.uint64(out_w)
    x_address = address_of(xf)
    zero_address = address_of(zero_row)
    acc0 = np.uint64(0)
    ind0 = np.uint64(0)
    if u1 <= u0:
        return
    for row in range(u0 // planes, (u1 - 1) // planes + 1):
        n = row // out_h
        r = row % out_h
        iy0 = (y0 + r) * sh - pad_t
        # Indirection buffer, tap-major (ind[t*OWr + col]): the address of every tap's input pixel, or of the
        # zero row. (Bounds as unsigned compares joined with `&`: branch-free, and a bool copied by `and` or
        # `x if c else y` would count as an array alias for numba.)
        for ky in range(kh):
            iy = iy0 + ky * dh
            row_address = x_address + (n * in_h + iy) * in_w * in_c
            for kx in range(kw):
                slots = ind0 + np.uint64((ky * kw + kx) * out_w)
                for col in range(out_w):
                    ix = (x0 + col) * sw - pad_l + kx * dw
                    if (np.uint64(iy) < np.uint64(in_h)) & (np.uint64(ix) < np.uint64(in_w)):
                        ind[slots + np.uint64(col)] = row_address + ix * in_c
                    else:
                        ind[slots + np.uint64(col)] = zero_address
        out_row = np.uint64(row * out_w) * pixel_stride
        for plane in range(max(u0 - row * planes, 0), min(u1 - row * planes, planes)):
            m = plane // n_tiles
            k = plane % n_tiles
            c0 = k * TILE
            width = min(TILE, in_c - c0)
            tile = np.uint64(plane)
            w_base = tile * np.uint64(n_taps * TILE)
            p_base = tile * np.uint64(PARAM_ROWS * TILE)
            for col in range(out_w):
                a_base = acc0 + np.uint64(col * TILE)
                i_base = ind0 + np.uint64(col)
                if width == TILE and n_taps == 9:
                    _accumulate_9(acc, a_base, ind, i_base, ow, c0, weights, w_base, params, p_base, TILE)
                elif width == TILE and n_taps == 25:
                    _accumulate_25(acc, a_base, ind, i_base, ow, c0, weights, w_base, params, p_base, TILE)
                elif width == TILE:
                    _accumulate_groups(
                        acc, a_base, ind, i_base, ow, c0, weights, w_base, params, p_base, TILE, n_taps
                    )
                else:
                    _accumulate_groups(
                        acc, a_base, ind, i_base, ow, c0, weights, w_base, params, p_base, width, n_taps
                    )
            _high_mul(acc, acc0, out_w, params, p_base, s32)
            out_base = out_row + np.uint64(c0 * dm)
            if width == TILE:
                _round_store(
                    acc, acc0, out_w, params, p_base, TILE, out, out_base, pixel_stride, dm, m,
                    out_off, act_min, act_max,
                )
            else:
                _round_store(
                    acc, acc0, out_w, params, p_base, width, out, out_base, pixel_stride, dm, m,
                    out_off, act_min, act_max,
                )


def _assume_no_alias(dispatcher) -> None:
    """Compile ``dispatcher`` with its array arguments marked ``noalias``, as numba marks a parallel loop's.

    numba has no public option for it; its compiler asks the dispatcher to customize the compile flags, and
    this sets the ``noalias`` flag there. If numba's internals change, the kernel compiles without it: slower
    (about 6x: the channel loops stop vectorizing), never different.
    """
    compiler = getattr(dispatcher, "_compiler", None)
    customize = getattr(compiler, "_customize_flags", None)
    if customize is None:
        return

    def with_noalias(flags):
        flags = customize(flags)
        flags.noalias = True
        return flags

    compiler._customize_flags = with_noalias


_assume_no_alias(depthwise_units)


@njit(cache=True)
def requantize_block(acc, params, p_base, out, out_off, act_min, act_max, s32):
    """The tiled kernel's requantization on its own: ``acc`` holds ``P`` pixels' accumulators of one tile.

    Args:
        acc: int32 ``(P * TILE,)`` accumulators (after the left shift), pixel-major; overwritten.
        params: packed per-tile parameters (``PackedDepthwiseInt8.tile_params``); the tile starts at ``p_base``.
        out: int8 ``(P * TILE,)`` results.
        out_off, act_min, act_max: output offset and clamp; ``s32``: 32.
    """
    n_pixels = acc.size // TILE
    base = np.uint64(p_base)
    _high_mul(acc, np.uint64(0), n_pixels, params, base, np.int64(s32))
    _round_store(
        acc, np.uint64(0), n_pixels, params, base, TILE, out, np.uint64(0), np.uint64(TILE), 1, 0,
        np.int32(out_off), np.int32(act_min), np.int32(act_max),
    )


@njit(inline="always")
def _requantize_scalar(acc, mult, left, right, out_off, act_min, act_max):
    """One output of TFLite's requantization (the scalar form of :func:`_high_mul` + :func:`_round_store`)."""
    xs = np.int64(np.int32(np.int64(acc) << left))  # int32 wrap, as in C++
    high = (xs * mult + (1 << 30)) >> 31
    half = (np.int64(1) << right) >> 1
    q = ((high + half - ((high >> 63) & np.int64(right > 0))) >> right) + out_off
    return np.int8(min(max(q, act_min), act_max))


@njit(parallel=True, cache=True)
def depthwise_reference_order(x, w, bias, mult, left, right, dm, geometry, quant, origin, out):
    """TFLite's reference loop order (channel outer, taps inner, a bounds test per tap), parallel over rows.

    The baseline the tiled kernel is measured against. ``x`` (N,H,W,C), ``w`` (KH,KW,C*M), ``out``
    (N,OHr,OWr,C*M); per-channel ``(C*M,)`` ``bias``, ``mult``, ``left`` = max(shift, 0), ``right`` =
    max(-shift, 0); ``geometry`` as in :func:`depthwise_units`, ``quant`` = ``(input_offset, output_offset,
    act_min, act_max)``, ``origin`` = ``(y0, x0)``.
    """
    sh, sw, dh, dw, pad_t, pad_l = geometry
    in_off, out_off, act_min, act_max = quant
    y0, x0 = origin
    n_batch, in_h, in_w, in_c = x.shape
    kh, kw, _ = w.shape
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
                    out[n, r, col, c] = _requantize_scalar(
                        acc, mult[c], left[c], right[c], out_off, act_min, act_max
                    )
