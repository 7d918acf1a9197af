"""Int8 depthwise convolution, NHWC, bit-exact with TFLite's reference kernel: the public entry points.

Three ways to call it, all with the same results:

- :func:`depthwise_conv2d_int8`: everything per call (the weights are checked and packed on every call);
- :func:`pack_depthwise_int8` once per layer, then :func:`depthwise_conv2d_int8_packed` per input (what an
  interpreter does; :class:`~incrinf.kernels.quantized_module.QuantizedDepthwiseConv2d` does it for you);
- :func:`depthwise_conv2d_int8_reference_order`: TFLite's reference loop order, compiled with numba (the
  baseline the fast kernel is measured against).

The fast kernel (:mod:`incrinf.kernels.depthwise_kernels`) is numba code that LLVM vectorizes: channel tiles of
int32 accumulators, weights packed per tile, unipass 3x3 and 5x5 filters, padding read from a zero row through
an indirection buffer, and TFLite's double-rounding requantization vectorized per tile.

Threads: ``threads=`` threads per call (default ``numba.get_num_threads()``); results are identical for every
thread count. The tiled kernel runs on the calling thread helped by a pool of spinning workers
(:mod:`incrinf.kernels.depthwise_pool`), which start within a microsecond and never make the caller wait for a
worker the OS has not scheduled. The reference-order kernel is a numba ``prange`` loop; on an oversubscribed
machine GNU OpenMP's spin-waiting can stall it for a scheduler slice (set ``OMP_WAIT_POLICY=PASSIVE``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from incrinf.extras import require
from incrinf.geometry import Box
from incrinf.kernels.arguments import as_array, check_int
from incrinf.kernels.depthwise_geometry import (
    Padding,
    Pair,
    conv_geometry,
    depthwise_output_size,
    resolve_padding,
)
from incrinf.kernels.depthwise_kernels import CONFIG_SIZE, TILE, depthwise_reference_order
from incrinf.kernels.depthwise_packing import PackedDepthwiseInt8, pack_depthwise_int8
from incrinf.kernels.depthwise_pool import SOLO, make_job, pool_threads, run_job, smallest_claim
from incrinf.kernels.quantize import INT8_MAX, INT8_MIN

numba = require("numba", "int8", "the int8 kernels")
_MAX_THREADS = numba.config.NUMBA_NUM_THREADS
_MAX_CALL_PLANS = 256
_INT8 = np.dtype(np.int8)

__all__ = [
    "CallPlan",
    "PackedDepthwiseInt8",
    "call_plan",
    "depthwise_conv2d_int8",
    "depthwise_conv2d_int8_packed",
    "depthwise_conv2d_int8_reference_order",
    "depthwise_output_size",
    "pack_depthwise_int8",
    "resolve_padding",
]


def _check_x(x, in_channels: int | None = None) -> np.ndarray:
    x = as_array(x, "x", np.int8, "int8")
    if x.ndim != 4:
        raise ValueError(f"x must be 4-D NHWC (N, H, W, C), got shape {x.shape}")
    if in_channels is not None and x.shape[3] != in_channels:
        raise ValueError(
            f"x has {x.shape[3]} channels (last axis, NHWC) but the filter expects {in_channels}; is x NCHW?"
        )
    return x


def _check_output_quant(output_offset, act_min, act_max) -> tuple[int, int, int]:
    out_off = check_int(output_offset, "output_offset", INT8_MIN, INT8_MAX)
    lo = check_int(act_min, "act_min", INT8_MIN, INT8_MAX)
    hi = check_int(act_max, "act_max", INT8_MIN, INT8_MAX)
    if lo > hi:
        raise ValueError(f"act_min ({lo}) must be <= act_max ({hi})")
    return out_off, lo, hi


def _run_with_threads(threads: int | None, kernel, *args) -> None:
    """``kernel(*args)`` with ``threads`` numba threads (``None``: the current setting)."""
    if threads is None:
        kernel(*args)
        return
    threads = check_int(threads, "threads", 1, _MAX_THREADS)
    previous = numba.get_num_threads()
    if previous == threads:
        kernel(*args)
        return
    numba.set_num_threads(threads)
    try:
        kernel(*args)
    finally:
        numba.set_num_threads(previous)


def _wrap_like(result: np.ndarray, like) -> np.ndarray | torch.Tensor:
    if isinstance(like, torch.Tensor):
        return torch.from_numpy(result).to(like.device)
    return result


def _prepare(x, packed: PackedDepthwiseInt8, stride, padding, dilation, region, output_offset, act_min, act_max):
    """Checked input, geometry, output quantization and the empty output of a call."""
    xa = _check_x(x, packed.in_channels)
    geo = conv_geometry(xa.shape[1:3], packed.kernel_size, stride, padding, dilation, region)
    quant = _check_output_quant(output_offset, act_min, act_max)
    y0, y1, x0, x1 = geo.region
    out = np.empty((xa.shape[0], y1 - y0, x1 - x0, packed.in_channels * packed.depth_multiplier), np.int8)
    return xa, geo, quant, out


class CallPlan(NamedTuple):
    """What a call of the tiled kernel needs besides its input and output, for one input shape and set of
    arguments: checked once, then reused by every call with the same ones."""

    config: np.ndarray  # int64 (CONFIG_SIZE,): the kernel's scalars (a view of the job's first entries)
    out_shape: tuple[int, int, int, int]
    size: int  # outputs (0: nothing to compute)
    units: int  # work units: output rows x depth-multiplier planes x channel tiles
    macs_per_unit: int  # multiply-adds of a unit (a full tile's; every tap counted)
    job: np.ndarray  # int64: config, the packed arrays' addresses, the smallest claim (depthwise_pool.make_job)
    arrays: tuple[np.ndarray, ...]  # the packed arrays the job points at, kept alive with it


def _build_plan(x_shape, packed: PackedDepthwiseInt8, stride, padding, dilation, region, quant_args) -> CallPlan:
    """Check the call's arguments (raising on bad ones) and lay out the kernel's scalars and job.

    Whether threads share the layer and their smallest claim come from the plan's work (units and multiply-adds
    per unit, see :func:`~incrinf.kernels.depthwise_pool.smallest_claim`), with the pool's settings at the time
    of planning."""
    n, in_h, in_w, in_c = x_shape
    if in_c != packed.in_channels:
        raise ValueError(
            f"x has {in_c} channels (last axis, NHWC) but the filter expects {packed.in_channels}; is x NCHW?"
        )
    geo = conv_geometry((in_h, in_w), packed.kernel_size, stride, padding, dilation, region)
    out_off, lo, hi = _check_output_quant(*quant_args)
    (sh, sw), (dh, dw), pads, (y0, y1, x0, x1) = geo
    kh, kw = packed.kernel_size
    dm = packed.depth_multiplier
    units = n * (y1 - y0) * dm * -(-in_c // TILE)
    config = np.array(
        [n, in_h, in_w, in_c, dm, kh, kw, sh, sw, dh, dw, pads[0], pads[2], out_off, lo, hi]
        + [y0, x0, y1 - y0, x1 - x0, 0, units],
        np.int64,
    )
    assert config.size == CONFIG_SIZE
    out_shape = (n, y1 - y0, x1 - x0, in_c * dm)
    size = n * (y1 - y0) * (x1 - x0) * in_c * dm
    macs_per_unit = (x1 - x0) * TILE * kh * kw
    arrays = (packed.tile_weights, packed.tile_params, packed.zero_row)
    job = make_job(config, *arrays, smallest_claim(units, macs_per_unit))
    return CallPlan(job[:CONFIG_SIZE], out_shape, size, units, macs_per_unit, job, arrays)


_PLAIN_TYPES = (int, str, type(None))


def _plain_arguments(args: tuple) -> bool:
    """Whether every argument is an int, str, None or tuple of ints, by exact type.

    Only plain arguments are cached: ``True``, ``1.0`` and ``np.int64(1)`` hash and compare like ``1``, so a
    plan made for ``1`` would otherwise serve them, and a bool or float must still raise.
    """
    for arg in args:
        kind = type(arg)
        if kind is tuple:
            for item in arg:
                if type(item) is not int:
                    return False
        elif kind not in _PLAIN_TYPES:
            return False
    return True


def call_plan(x_shape, packed: PackedDepthwiseInt8, stride, padding, dilation, region, quant_args) -> CallPlan:
    """:func:`_build_plan`, kept in the packed layer's ``call_plans`` when the arguments are plain values.

    Checking and laying out the arguments costs more than the convolution of a small layer (tens of
    microseconds when the caches are cold), so a layer remembers the plans of its last
    :data:`_MAX_CALL_PLANS` input shapes and argument sets.
    """
    args = (stride, padding, dilation, region, *quant_args)
    if not _plain_arguments(args):
        return _build_plan(x_shape, packed, stride, padding, dilation, region, quant_args)
    key = (x_shape, *args)
    plans = packed.call_plans
    plan = plans.get(key)
    if plan is None:
        plan = _build_plan(x_shape, packed, stride, padding, dilation, region, quant_args)
        if len(plans) >= _MAX_CALL_PLANS:  # e.g. the engine's many regions: start over rather than grow
            plans.clear()
        plans[key] = plan
    return plan


def _check_out(out, shape: tuple[int, int, int, int], x: np.ndarray) -> np.ndarray:
    """``out`` as a writable C-contiguous int8 numpy array of ``shape`` that does not overlap ``x``."""
    if isinstance(out, torch.Tensor):
        if out.device.type != "cpu":
            raise ValueError(f"out must be a CPU tensor, got one on {out.device}")
        out = out.detach().numpy()
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy array or CPU torch tensor of int8, got {type(out).__name__}")
    if out.dtype != np.int8 or out.shape != shape:
        raise ValueError(f"out must be int8 of shape {shape}, got {out.dtype} {out.shape}")
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("out must be C-contiguous and writable")
    if np.may_share_memory(out, x):
        raise ValueError("out must not overlap the input x")
    return out


def _run_plan(xa: np.ndarray, plan: CallPlan, threads, out: np.ndarray) -> None:
    """Run the tiled kernel for ``plan`` into ``out`` (checked but for overlap) on ``threads`` threads.

    The calling thread computes and the pool's workers help (:mod:`incrinf.kernels.depthwise_pool`); a layer
    too small to pay for a second thread (by its plan's multiply-adds) runs alone. One compiled call does it
    all; with ``threads=None`` it reads numba's thread count itself.
    """
    if threads is not None and (type(threads) is not int or not 1 <= threads <= _MAX_THREADS):
        threads = check_int(threads, "threads", 1, _MAX_THREADS)
    if not plan.size:
        return
    if threads == 1 or _MAX_THREADS == 1:
        status = run_job(xa, out, plan.job, SOLO, 1)
    else:
        status = run_job(xa, out, plan.job, *pool_threads(threads))
    if status:
        raise ValueError("out must not overlap the input x")


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
    threads: int | None = None,
    out: np.ndarray | torch.Tensor | None = None,
) -> np.ndarray | torch.Tensor:
    """:func:`depthwise_conv2d_int8` with weights prepared by :func:`pack_depthwise_int8`.

    ``out``: an int8 C-contiguous array (or CPU tensor) of the result's shape to write into and return, as an
    interpreter writes into its output tensor; a new array on every call costs page faults on large layers.

    A layer keeps the checked plan of each input shape and argument set it was called with, so a repeated call
    costs a dictionary look-up and one compiled call (a few microseconds; see ``benchmarks/depthwise_int8.py``).
    """
    if not isinstance(packed, PackedDepthwiseInt8):
        raise TypeError(f"packed must come from pack_depthwise_int8, got {type(packed).__name__}")
    numpy_x = type(x) is np.ndarray
    if numpy_x and x.dtype is _INT8 and x.ndim == 4 and x.flags.c_contiguous:
        xa = x  # the common case, checked without the general path's conversions (channels: by the plan)
    else:
        xa = _check_x(x, packed.in_channels)
    try:
        plan = packed.call_plans.get((xa.shape, stride, padding, dilation, region, output_offset, act_min, act_max))
    except TypeError:  # an unhashable argument (a list): call_plan checks it
        plan = None
    # A cached plan serves the common argument types at once; values equal to a cached key's but of another
    # type (True or 1.0 for 1) go through call_plan, which raises on the wrong ones. (A pair equal to a cached
    # key's has its two items, so its first and last are all there is to check.)
    if plan is None or not (
        (type(stride) is int or type(stride) is tuple and type(stride[0]) is int and type(stride[-1]) is int)
        and (
            type(dilation) is int
            or type(dilation) is tuple and type(dilation[0]) is int and type(dilation[-1]) is int
        )
        and type(padding) is str and region is None
        and type(output_offset) is int and type(act_min) is int and type(act_max) is int
    ):
        plan = call_plan(xa.shape, packed, stride, padding, dilation, region, (output_offset, act_min, act_max))
    if out is None:
        result = np.empty(plan.out_shape, np.int8)
        _run_plan(xa, plan, threads, result)
        return result if numpy_x else _wrap_like(result, x)
    if type(out) is np.ndarray and out.dtype is _INT8 and out.shape == plan.out_shape and out.flags.c_contiguous:
        _run_plan(xa, plan, threads, out if out.flags.writeable else _check_out(out, plan.out_shape, xa))
    else:
        _run_plan(xa, plan, threads, _check_out(out, plan.out_shape, xa))  # raises, or a tensor's array
    return out


def _pack_for(x, w, bias, input_offset, output_multiplier, output_shift, depth_multiplier) -> PackedDepthwiseInt8:
    """A raw filter packed for the channels of ``x`` (the unpacked entry points pack on every call)."""
    return pack_depthwise_int8(w, bias, input_offset=input_offset, output_multiplier=output_multiplier,
                               output_shift=output_shift, depth_multiplier=depth_multiplier,
                               in_channels=_check_x(x).shape[3])


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
    threads: int | None = None,
) -> np.ndarray | torch.Tensor:
    """Int8 depthwise convolution, bit-exact with TFLite's reference ``DepthwiseConvPerChannel``.

    Args:
        x: int8 input, NHWC ``(N, H, W, C)``, numpy or torch (the result has the same type).
        w: int8 filter ``(1, KH, KW, C*M)`` (TFLite layout; output channel ``oc = ic*M + m``).
        bias: int32 ``(C*M,)``, or ``None`` for zeros.
        stride: int or ``(h, w)``.
        padding: ``"same"`` / ``"valid"`` (TFLite semantics) or explicit ``(top, bottom, left, right)``.
            Padding is zero padding: out-of-image taps contribute nothing, as in TFLite.
        dilation: int or ``(h, w)``.
        depth_multiplier: ``M``; inferred from the shapes when ``None`` (checked when given).
        input_offset: ``-input_zero_point``, in ``[-127, 128]``.
        output_offset: ``output_zero_point``, in ``[-128, 127]``.
        output_multiplier: int32 ``(C*M,)`` (or a scalar for per-tensor), each 0 or in ``[2**30, 2**31)``.
        output_shift: int32 ``(C*M,)`` (or a scalar), each in ``[-31, 30]``.
        act_min, act_max: output clamp (the fused activation), within ``[-128, 127]``.
        region: half-open output box ``(y0, y1, x0, x1)``; only that box is computed and returned.
        threads: numba threads for this call; default ``numba.get_num_threads()``.

    Returns:
        int8 ``(N, OH, OW, C*M)``, or ``(N, y1 - y0, x1 - x0, C*M)`` with ``region``.

    Raises:
        TypeError: wrong dtypes or argument types.
        ValueError: wrong shapes or layouts, channel mismatch, out-of-range multipliers, shifts,
            offsets or clamp, or a region outside the output.
    """
    packed = _pack_for(x, w, bias, input_offset, output_multiplier, output_shift, depth_multiplier)
    return depthwise_conv2d_int8_packed(
        x,
        packed,
        stride=stride,
        padding=padding,
        dilation=dilation,
        output_offset=output_offset,
        act_min=act_min,
        act_max=act_max,
        region=region,
        threads=threads,
    )


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
    tap, parallel over output rows: the baseline the tiled kernel is measured against. ``w`` may also
    be a :class:`PackedDepthwiseInt8` (then ``bias``, ``input_offset`` and the multipliers come from it).
    """
    if isinstance(w, PackedDepthwiseInt8):
        packed = w
    else:
        if input_offset is None or output_multiplier is None or output_shift is None:
            raise TypeError("input_offset, output_multiplier and output_shift are required with a raw filter")
        packed = _pack_for(x, w, bias, input_offset, output_multiplier, output_shift, depth_multiplier)
    xa, geo, quant, out = _prepare(x, packed, stride, padding, dilation, region, output_offset, act_min, act_max)
    if out.size:
        (sh, sw), (dh, dw), pads, (y0, _, x0, _) = geo
        _run_with_threads(
            threads,
            depthwise_reference_order,
            xa,
            packed.weight,
            packed.bias,
            packed.multiplier,
            np.maximum(packed.shift, 0),
            np.maximum(-packed.shift, 0),
            packed.depth_multiplier,
            (sh, sw, dh, dw, pads[0], pads[2]),
            (packed.input_offset, *quant),
            (y0, x0),
            out,
        )
    return _wrap_like(out, x)
