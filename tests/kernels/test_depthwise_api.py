"""Int8 depthwise kernel API: explicit padding, regions, torch tensors, the packed entry point, errors.

Explicit padding is checked against a plain numpy int64 convolution (TFLite has only SAME and VALID); the
other tests check the API's contracts. Bit-exactness against TFLite is in ``test_depthwise_int8.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from depthwise_strategies import assert_same, cases, one_numba_thread  # noqa: F401 (fixture)
from hypothesis import given, settings
from hypothesis import strategies as st

from incrinf.kernels.depthwise_int8 import (
    depthwise_conv2d_int8,
    depthwise_conv2d_int8_packed,
    depthwise_conv2d_int8_reference_order,
    pack_depthwise_int8,
    resolve_padding,
)
from incrinf.testing.depthwise_cases import DepthwiseCase, make_problem, numpy_reference

pytestmark = pytest.mark.usefixtures("one_numba_thread")


# ------------------------------------------------------------------------------------------------
# Explicit padding and regions
# ------------------------------------------------------------------------------------------------


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
    assert_same(depthwise_conv2d_int8(p.x, p.w, p.bias, **kwargs), expected, (case, pads))
    assert_same(depthwise_conv2d_int8_reference_order(p.x, p.w, p.bias, **kwargs), expected, (case, pads))


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
        assert_same(part, full[:, y0:y1, x0:x1], (p.case, (y0, y1, x0, x1)))



def test_threads_and_torch_tensors():
    p = make_problem(DepthwiseCase(2, 12, 12, 33, 1, (3, 3), (1, 1), (1, 1), "same", "relu6", "normal", 3, -7, seed=3))
    kwargs = p.kernel_kwargs()
    one = depthwise_conv2d_int8(p.x, p.w, p.bias, threads=1, **kwargs)
    two = depthwise_conv2d_int8(p.x, p.w, p.bias, threads=2, **kwargs)
    assert_same(two, one, "threads")
    out = depthwise_conv2d_int8(
        torch.from_numpy(p.x), torch.from_numpy(p.w), torch.from_numpy(p.bias), **kwargs
    )
    assert isinstance(out, torch.Tensor) and out.dtype == torch.int8
    assert_same(out.numpy(), one, "torch")
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
    assert_same(again, one, "packed")


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
    ("threads 0", _kw(threads=0), ValueError, "threads must be in"),
    ("threads float", _kw(threads=1.0), TypeError, "threads must be an int"),
]


BAD_CASES = [
    pytest.param(fn, *case, id=f"{fn.__name__}-{case[0]}")
    for fn in (depthwise_conv2d_int8, depthwise_conv2d_int8_reference_order)
    for case in BAD_INPUTS
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



@pytest.mark.parametrize("name, change, error", [
    ("stride bool", dict(stride=True), TypeError),
    ("stride float", dict(stride=1.0), TypeError),
    ("stride numpy", dict(stride=np.int64(1)), None),
    ("padding list", dict(padding=[1, 1, 1, 1]), None),
    ("dilation pair float", dict(dilation=(1, 1.0)), TypeError),
    ("output_offset float", dict(output_offset=-2.0), TypeError),
    ("act_max bool", dict(act_max=True), TypeError),
    ("stride pair bool", dict(stride=(1, True)), TypeError),
    ("stride pair float", dict(stride=(1.0, 1)), TypeError),
    ("dilation pair bool", dict(dilation=(True, 1)), TypeError),
    ("stride pair numpy", dict(stride=(np.int64(1), 1)), None),
])
@pytest.mark.parametrize("pairs", [False, True], ids=["int args", "pair args"])
def test_cached_call_plans_do_not_hide_bad_arguments(name, change, error, pairs):
    """A call with plain arguments caches its checked plan; values equal to those (``True == 1 == 1.0``) but
    of the wrong type must still raise, and valid non-plain ones (numpy ints, lists) must still work, whether
    the cached call gave stride and dilation as ints or as pairs."""
    x, w, bias, kwargs = _good_args()
    packed = pack_depthwise_int8(
        w,
        bias,
        input_offset=3,
        output_multiplier=kwargs["output_multiplier"],
        output_shift=kwargs["output_shift"],
        in_channels=x.shape[3],
    )
    call = dict(stride=1, padding=(1, 1, 1, 1), dilation=1, output_offset=-2, act_min=-128, act_max=1)
    if pairs:
        call.update(stride=(1, 1), padding="same", dilation=(1, 1))
    expected = depthwise_conv2d_int8_packed(x, packed, **call)  # caches the plan of the plain arguments
    assert_same(depthwise_conv2d_int8_packed(x, packed, **call), expected, "cached")
    if error is None:
        assert_same(depthwise_conv2d_int8_packed(x, packed, **{**call, **change}), expected, name)
    else:
        with pytest.raises(error):
            depthwise_conv2d_int8_packed(x, packed, **{**call, **change})


def test_packed_rejects_other_objects_and_channel_mismatch():
    x, w, bias, kwargs = _good_args()
    with pytest.raises(TypeError, match="pack_depthwise_int8"):
        depthwise_conv2d_int8_packed(x, (w, bias), output_offset=0)
    packed = pack_depthwise_int8(w, bias, input_offset=0, output_multiplier=2**30, output_shift=0, in_channels=4)
    with pytest.raises(ValueError, match="expects 4"):
        depthwise_conv2d_int8_packed(np.zeros((1, 6, 6, 8), np.int8), packed, output_offset=0)


def test_out_buffer_is_written_and_checked():
    x, w, bias, kwargs = _good_args()
    x = np.random.default_rng(1).integers(-128, 128, x.shape, dtype=np.int8)
    packed = pack_depthwise_int8(w, bias, input_offset=3, output_multiplier=2**30, output_shift=-1, in_channels=4)
    expected = depthwise_conv2d_int8_packed(x, packed, padding="same", output_offset=-2)
    buffer = np.full(expected.shape, 99, np.int8)
    assert depthwise_conv2d_int8_packed(x, packed, padding="same", output_offset=-2, out=buffer) is buffer
    assert_same(buffer, expected, "out")
    tensor = torch.zeros(expected.shape, dtype=torch.int8)
    depthwise_conv2d_int8_packed(x, packed, padding="same", output_offset=-2, out=tensor)
    assert_same(tensor.numpy(), expected, "torch out")
    bad = [
        (np.empty((1, 6, 6, 7), np.int8), ValueError, "shape"),
        (np.empty(expected.shape, np.int16), ValueError, "int8"),
        (np.empty((1, 6, 6, 16), np.int8)[..., ::2], ValueError, "C-contiguous"),
        ([0] * 8, TypeError, "numpy array"),
    ]
    for out, error, pattern in bad:
        with pytest.raises(error, match=pattern):
            depthwise_conv2d_int8_packed(x, packed, padding="same", output_offset=-2, out=out)
    memory = np.zeros(288, np.int8)  # x and out both contiguous, sharing their first 144 bytes
    with pytest.raises(ValueError, match="overlap"):
        depthwise_conv2d_int8_packed(
            memory[:144].reshape(1, 6, 6, 4), packed, padding="same", output_offset=-2, out=memory.reshape(1, 6, 6, 8)
        )


def test_non_contiguous_and_transposed_inputs_equal_their_contiguous_copies():
    p = make_problem(DepthwiseCase(2, 14, 12, 40, 1, (3, 3), (2, 1), (1, 1), "same", None, "normal", 4, -4, seed=11))
    kwargs = p.kernel_kwargs()
    strided = np.repeat(p.x, 2, axis=2)[:, :, ::2]  # a view with a gap between pixels
    assert not strided.flags.c_contiguous and np.array_equal(strided, p.x)
    nchw = torch.from_numpy(np.ascontiguousarray(p.x.transpose(0, 3, 1, 2))).permute(0, 2, 3, 1)  # NHWC view
    expected = depthwise_conv2d_int8(p.x, p.w, p.bias, **kwargs)
    assert_same(depthwise_conv2d_int8(strided, p.w, p.bias, **kwargs), expected, "strided")
    assert_same(depthwise_conv2d_int8(nchw, p.w, p.bias, **kwargs).numpy(), expected, "permuted tensor")


def test_valid_padding_with_a_filter_larger_than_the_input_gives_an_empty_output():
    x = np.ones((2, 3, 9, 5), np.int8)
    w = np.ones((1, 5, 3, 5), np.int8)
    args = dict(padding="valid", input_offset=0, output_offset=0, output_multiplier=2**30, output_shift=0)
    for fn in (depthwise_conv2d_int8, depthwise_conv2d_int8_reference_order):
        assert fn(x, w, None, **args).shape == (2, 0, 7, 5)
