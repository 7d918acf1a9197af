"""TFLite quantization arithmetic: multipliers, requantization, rounding, calibration helpers."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from incrinf.kernels.quantize import (
    MinMaxObserver,
    activation_range,
    choose_qparams,
    dequantize,
    multiply_by_quantized_multiplier,
    multiply_by_quantized_multiplier_np,
    per_channel_multipliers,
    quantize,
    quantize_multiplier,
    quantize_multipliers,
    symmetric_weight_scales,
    validate_multipliers,
)

INT32 = st.integers(-(2**31), 2**31 - 1)


# --- a deliberately plain big-int transcription of gemmlowp / TFLite, the test's own reference ---


def _wrap32(v: int) -> int:
    return (v + 2**31) % 2**32 - 2**31


def _srdhm(a: int, b: int) -> int:
    if a == b == -(2**31):
        return 2**31 - 1
    ab = a * b
    v = ab + (2**30 if ab >= 0 else 1 - 2**30)
    q = abs(v) // 2**31  # C++ division truncates toward zero
    return q if v >= 0 else -q


def _rounding_divide_by_pot(x: int, exponent: int) -> int:
    mask = (1 << exponent) - 1
    threshold = (mask >> 1) + (1 if x < 0 else 0)
    return (x >> exponent) + (1 if (x & mask) > threshold else 0)


def _mbqm(x: int, multiplier: int, shift: int) -> int:
    return _rounding_divide_by_pot(_srdhm(_wrap32(x * (1 << max(shift, 0))), multiplier), max(-shift, 0))


# --- quantize_multiplier ---


@pytest.mark.parametrize(
    "real, expected",
    [
        (0.0, (0, 0)),
        (0.5, (2**30, 0)),
        (1.0, (2**30, 1)),
        (0.75, (3 * 2**29, 0)),
        (2.0**-31, (2**30, -30)),
        (2.0**-32, (2**30, -31)),  # the smallest shift kept
        (2.0**-33, (0, 0)),  # shift -32: flushed to zero
        (1e-12, (0, 0)),
        ((1 - 2.0**-40) * 0.25, (2**30, -1)),  # q_fixed rounds to 2**31: halve, shift + 1
        ((1 - 2.0**-40), (2**30, 1)),
    ],
)
def test_quantize_multiplier_known_values(real, expected):
    assert quantize_multiplier(real) == expected


def test_quantize_multiplier_rejects_bad_values():
    with pytest.raises(ValueError, match="real multiplier"):
        quantize_multiplier(-0.5)
    with pytest.raises(ValueError, match="real multiplier"):
        quantize_multiplier(float("nan"))
    with pytest.raises(ValueError, match="too large"):
        quantize_multiplier(2.0**31)


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=2.0**-31.5, max_value=2.0**29, allow_subnormal=False))
def test_quantize_multiplier_represents_the_real_value(real):
    mult, shift = quantize_multiplier(real)
    assert 2**30 <= mult < 2**31 and -31 <= shift <= 30
    # real = mult * 2**(shift - 31) up to the rounding of a 31-bit mantissa.
    assert abs(mult * 2.0 ** (shift - 31) - real) <= real * 2.0**-31


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=2.0**20, allow_subnormal=True), min_size=1, max_size=20))
def test_vectorized_matches_scalar(reals):
    mult, shift = quantize_multipliers(reals)
    assert mult.dtype == np.int32 and shift.dtype == np.int32
    assert [quantize_multiplier(r) for r in reals] == list(zip(mult.tolist(), shift.tolist(), strict=True))


def test_vectorized_corner_cases():
    reals = [0.0, 1e-12, 2.0**-32, (1 - 2.0**-40) * 0.25, 0.5]
    mult, shift = quantize_multipliers(reals)
    assert mult.tolist() == [0, 0, 2**30, 2**30, 2**30]
    assert shift.tolist() == [0, 0, -31, -1, 0]
    with pytest.raises(ValueError):
        quantize_multipliers([2.0**40])


def test_per_channel_multipliers_use_float32_scales_in_double():
    in_s, out_s = 0.1, 0.3  # not float32-exact: they must be rounded to float32 first
    w_s = np.array([0.01, 0.02], np.float32)
    mult, shift = per_channel_multipliers(in_s, w_s, out_s)
    reals = float(np.float32(in_s)) * w_s.astype(np.float64) / float(np.float32(out_s))
    expected = [quantize_multiplier(r) for r in reals]
    assert list(zip(mult.tolist(), shift.tolist(), strict=True)) == expected


def test_validate_multipliers():
    validate_multipliers(np.array([0, 2**30, 2**31 - 1], np.int32), np.array([0, -31, 30], np.int32), 3)
    with pytest.raises(ValueError, match=r"output_multiplier must be 0 or in \[2\*\*30"):
        validate_multipliers(np.array([5], np.int32), np.array([0], np.int32), 1)
    with pytest.raises(ValueError, match=r"output_shift must be in \[-31, 30\]"):
        validate_multipliers(np.array([2**30], np.int32), np.array([31], np.int32), 1)
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        validate_multipliers(np.array([2**30], np.int32), np.array([0], np.int32), 2)


# --- MultiplyByQuantizedMultiplier ---


@settings(max_examples=1000, deadline=None)
@given(
    x=st.one_of(INT32, st.integers(-100_000, 100_000), st.sampled_from([-(2**31), 2**31 - 1, 0, -1, 1])),
    multiplier=st.one_of(st.integers(2**30, 2**31 - 1), st.just(0), st.sampled_from([2**30, 2**31 - 1])),
    shift=st.integers(-31, 30),
)
def test_multiply_by_quantized_multiplier_matches_big_int_reference(x, multiplier, shift):
    expected = _mbqm(x, multiplier, shift)
    assert multiply_by_quantized_multiplier(x, multiplier, shift) == expected
    vec = multiply_by_quantized_multiplier_np(np.array([x]), np.array([multiplier]), np.array([shift]))
    assert vec.dtype == np.int32 and int(vec[0]) == expected


@settings(max_examples=300, deadline=None)
@given(x=st.integers(-(2**20), 2**20), multiplier=st.integers(2**30, 2**31 - 1), shift=st.integers(-31, 0))
def test_multiply_by_quantized_multiplier_is_close_to_exact(x, multiplier, shift):
    # No overflow here: the double rounding stays within one unit of the exact product.
    exact = Fraction(x * multiplier, 2 ** (31 - shift))
    assert abs(multiply_by_quantized_multiplier(x, multiplier, shift) - exact) <= 1


def test_rounding_matches_gemmlowp():
    # SaturatingRoundingDoublingHighMul rounds ties up (x * 0.5 for x = -1 gives 0) ...
    assert [int(multiply_by_quantized_multiplier(v, 2**30, 0)) for v in (1, -1, 3, -3)] == [1, 0, 2, -1]
    # ... then RoundingDivideByPOT rounds ties away from zero (x * 0.5 exact, then / 2).
    assert [int(multiply_by_quantized_multiplier(v, 2**30, -1)) for v in (2, -2, 6, -6)] == [1, -1, 2, -2]


# --- activations, rounding, calibration ---


def test_activation_range():
    assert activation_range(None, 0.1, 5) == (-128, 127)
    assert activation_range("relu", 0.1, 5) == (5, 127)
    assert activation_range("relu", 0.1, -200) == (-128, 127)
    assert activation_range("relu6", 0.1, -128) == (-128, -68)
    assert activation_range("relu6", 0.05, -128) == (-128, -8)
    assert activation_range("relu6", 12.0, 0) == (0, 1)  # 6 / 12 = 0.5 rounds away from zero
    assert activation_range("relu6", 0.01, 0) == (0, 127)
    with pytest.raises(ValueError, match="activation"):
        activation_range("gelu", 0.1, 0)


def test_quantize_rounds_half_away_from_zero_and_clamps():
    x = torch.tensor([0.5, -0.5, 1.5, -1.5, 2.5, 0.49999997, 1000.0, -1000.0])
    assert quantize(x, 1.0, 0).tolist() == [1, -1, 2, -2, 3, 0, 127, -128]
    assert quantize(torch.zeros(3), 0.37, -17).tolist() == [-17, -17, -17]
    q = torch.arange(-128, 128, dtype=torch.int8)
    assert torch.equal(quantize(dequantize(q, 0.05, 3), 0.05, 3), q)


@pytest.mark.parametrize("lo, hi", [(-1.0, 3.0), (0.0, 6.0), (-2.5, -0.5), (0.1, 0.2), (-5.0, 5.0)])
def test_choose_qparams_represents_zero_exactly(lo, hi):
    scale, zp = choose_qparams(lo, hi)
    assert -128 <= zp <= 127 and scale > 0
    assert float(dequantize(quantize(torch.zeros(1), scale, zp), scale, zp)) == 0.0
    # The range is covered to within one step.
    assert (zp - -128) * scale >= -min(lo, 0.0) - scale and (127 - zp) * scale >= max(hi, 0.0) - scale


def test_symmetric_weight_scales():
    w = np.zeros((3, 1, 2, 2), np.float32)
    w[0, 0, 0, 0] = -2.54
    w[1, 0, 1, 1] = 1.27
    scales = symmetric_weight_scales(w, axis=0)
    np.testing.assert_allclose(scales, [0.02, 0.01, 1.0], rtol=1e-6)
    assert scales.dtype == np.float32


def test_min_max_observer_records_inputs_and_outputs():
    model = torch.nn.Sequential(torch.nn.Identity(), torch.nn.ReLU())
    obs = MinMaxObserver({"relu": model[1]})
    with obs.observe():
        model(torch.tensor([-2.0, 3.0]))
        model(torch.tensor([-1.0, 5.0]))
    model(torch.tensor([100.0]))  # hooks are gone after the block
    assert obs.input_range["relu"] == (-2.0, 5.0)
    assert obs.output_range["relu"] == (0.0, 5.0)
    assert math.isclose(choose_qparams(*obs.output_range["relu"])[0], 5.0 / 255, rel_tol=1e-6)
