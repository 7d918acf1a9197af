"""Hypothesis strategies, assertions and a fixture shared by the int8 depthwise kernel tests."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from hypothesis import strategies as st

from incrinf.kernels.depthwise_kernels import TILE
from incrinf.testing.depthwise_cases import ACTIVATIONS, SCALE_REGIMES, DepthwiseCase


@pytest.fixture
def one_numba_thread():
    """One numba thread per test process: CI runs two pytest-xdist workers on two cores, and oversubscribed
    parallel calls wait for a core. Tests that want more threads ask for them per call."""
    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(previous)


def assert_same(actual: np.ndarray, expected: np.ndarray, context) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape, context)
    mismatches = int((np.asarray(actual) != expected).sum())
    assert mismatches == 0, f"{mismatches} mismatches of {expected.size} for {context}"


@st.composite
def cases(draw, padding: str | None = None, max_size: int = 12) -> DepthwiseCase:
    """Kernels 1-7 (square or not), strides and dilations 1-3, multipliers 1-3, any channel count up to 3.5
    tiles, batch 1-3, zero points anywhere in int8 (the ends included), every scale regime."""
    padding = padding or draw(st.sampled_from(["same", "valid"]))
    kh = draw(st.integers(1, 7))
    kw = draw(st.one_of(st.just(kh), st.integers(1, 7)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    # VALID needs the (dilated) filter to fit: up to 19 pixels for 7 taps with dilation 3.
    min_h = (kh - 1) * dilation[0] + 1 if padding == "valid" else 1
    min_w = (kw - 1) * dilation[1] + 1 if padding == "valid" else 1
    zero_point = st.one_of(st.sampled_from([-128, 127]), st.integers(-128, 127))
    return DepthwiseCase(
        batch=draw(st.integers(1, 3)),
        height=draw(st.integers(min_h, max(min_h, max_size))),
        width=draw(st.integers(min_w, max(min_w, max_size))),
        channels=draw(st.one_of(st.integers(1, 8), st.integers(9, 2 * TILE + 1), st.integers(1, 3 * TILE + 17))),
        depth_multiplier=draw(st.integers(1, 3)),
        kernel=(kh, kw),
        stride=stride,
        dilation=dilation,
        padding=padding,
        activation=draw(st.sampled_from(ACTIVATIONS)),
        scale_regime=draw(st.sampled_from(["normal", "normal", *SCALE_REGIMES[1:]])),
        input_zero_point=draw(zero_point),
        output_zero_point=draw(zero_point),
        seed=draw(st.integers(0, 2**32 - 1)),
    )
