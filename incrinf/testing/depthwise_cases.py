"""Random int8 depthwise configurations and their expected outputs, for the tests and the exactness sweep.

A :class:`DepthwiseCase` names one configuration (shapes, filter, stride, dilation, padding, fused activation,
quantization regime, zero points) and a seed for its arrays; :func:`make_problem` draws the arrays and
derives the multipliers from float32 scales as TFLite's ``Prepare`` does. The expected output comes from
LiteRT's ``BUILTIN_REF`` kernels (:meth:`DepthwiseProblem.tflite`, SAME/VALID padding) or from a plain numpy
int64 convolution (:func:`numpy_reference`, any explicit padding). :func:`random_case` draws cases with numpy
for the benchmark's sweep; the tests draw the same fields with hypothesis.

Scale regimes exercise every branch of TFLite's fixed-point arithmetic: ``normal``; ``round_up`` (the
multiplier rounds up to 2**31 and is renormalized); ``tiny`` (multipliers flushed to 0, or shift -31);
``big`` (real multipliers above 1: a left shift that can wrap int32); ``extreme`` (real multipliers just below
2**30 and just above 2**-31, the ends of the representable range).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from incrinf.kernels.quantize import (
    activation_range,
    multiply_by_quantized_multiplier_np,
    per_channel_multipliers,
)
from incrinf.testing.tflite_oracle import TfliteRunner, build_depthwise_model

__all__ = [
    "ACTIVATIONS",
    "SCALE_REGIMES",
    "DepthwiseCase",
    "DepthwiseProblem",
    "make_problem",
    "numpy_reference",
    "random_case",
]

SCALE_REGIMES = ("normal", "round_up", "tiny", "big", "extreme")
ACTIVATIONS = (None, "relu", "relu6")


@dataclass(frozen=True)
class DepthwiseCase:
    """One depthwise configuration; its arrays come from ``seed``. ``padding`` is "same" or "valid"."""

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


def _log_uniform(rng: np.random.Generator, lo: float, hi: float, size=None):
    return np.exp(rng.uniform(np.log(lo), np.log(hi), size))


def _scales(rng: np.random.Generator, regime: str, oc: int) -> tuple[float, np.ndarray, float]:
    """float32 ``(input_scale, weight_scales, output_scale)``; half the channels follow ``regime``."""
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
    elif regime == "extreme":
        # The largest valid shift (30) and the smallest kept one (-31), multipliers near both ends.
        high = 2.0 ** rng.uniform(29.0, 29.999, oc)
        low = 2.0 ** -rng.uniform(30.0, 31.0, oc)
        reals = np.where(rng.random(oc) < 0.5, high, low)
        w_s[pick] = reals[pick] * out_s / in_s
    elif regime != "normal":
        raise ValueError(f"unknown scale regime {regime!r}; choose from {SCALE_REGIMES}")
    return in_s, w_s.astype(np.float32), out_s


@dataclass
class DepthwiseProblem:
    """A case's arrays: int8 ``x`` (N, H, W, C), int8 ``w`` (1, KH, KW, C*M), int32 ``bias`` (C*M,), scales."""

    x: np.ndarray
    w: np.ndarray
    bias: np.ndarray
    input_scale: float
    weight_scales: np.ndarray
    output_scale: float
    case: DepthwiseCase

    def kernel_kwargs(self) -> dict:
        """Keyword arguments of :func:`incrinf.kernels.depthwise_conv2d_int8` for this problem."""
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
        """The output of LiteRT's reference kernels (``BUILTIN_REF``) on this problem."""
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


def make_problem(case: DepthwiseCase) -> DepthwiseProblem:
    """Draw a case's arrays: uniform int8 input and weights (-128 included), int32 bias, scales by regime.

    One case in ten gets a bias near the int32 limits, so that the accumulator wraps around.
    """
    rng = np.random.default_rng(case.seed)
    oc = case.channels * case.depth_multiplier
    x = rng.integers(-128, 128, (case.batch, case.height, case.width, case.channels), dtype=np.int8)
    w = rng.integers(-128, 128, (1, *case.kernel, oc), dtype=np.int8)
    bias_range = 2**31 if rng.random() < 0.1 else 2**16
    bias = rng.integers(-bias_range, bias_range, oc).astype(np.int32)
    in_s, w_s, out_s = _scales(rng, case.scale_regime, oc)
    return DepthwiseProblem(x, w, bias, in_s, w_s, out_s, case)


def random_case(rng: np.random.Generator, max_size: int = 12) -> DepthwiseCase:
    """A random configuration: kernels 1-7 (square or not), strides and dilations 1-3, multipliers 1-3,
    channel counts around and between the kernel's tile widths, batch 1-3, zero points at the int8 ends in
    one case in five. VALID cases are sized so that the dilated filter fits."""
    padding = "same" if rng.random() < 0.5 else "valid"
    kh = int(rng.integers(1, 8))
    kw = kh if rng.random() < 0.5 else int(rng.integers(1, 8))
    stride = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
    dilation = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
    min_h = (kh - 1) * dilation[0] + 1 if padding == "valid" else 1
    min_w = (kw - 1) * dilation[1] + 1 if padding == "valid" else 1
    band = rng.integers(0, 3)
    channels = int(rng.integers(1, 9) if band == 0 else rng.integers(9, 65) if band == 1 else rng.integers(65, 200))

    def zero_point() -> int:
        return int(rng.choice([-128, 127])) if rng.random() < 0.2 else int(rng.integers(-128, 128))

    return DepthwiseCase(
        batch=int(rng.integers(1, 4)),
        height=int(rng.integers(min_h, max(min_h, max_size) + 1)),
        width=int(rng.integers(min_w, max(min_w, max_size) + 1)),
        channels=channels,
        depth_multiplier=int(rng.integers(1, 4)),
        kernel=(kh, kw),
        stride=stride,
        dilation=dilation,
        padding=padding,
        activation=ACTIVATIONS[int(rng.integers(0, 3))],
        scale_regime=str(rng.choice(["normal", "normal", "normal", *SCALE_REGIMES[1:]])),
        input_zero_point=zero_point(),
        output_zero_point=zero_point(),
        seed=int(rng.integers(0, 2**32)),
    )


def numpy_reference(
    x: np.ndarray,
    w: np.ndarray,
    bias: np.ndarray,
    *,
    stride: tuple[int, int],
    pads: tuple[int, int, int, int],
    dilation: tuple[int, int],
    input_offset: int,
    output_offset: int,
    mult: np.ndarray,
    shift: np.ndarray,
    lo: int,
    hi: int,
) -> np.ndarray:
    """Plain numpy int64 depthwise conv with explicit ``(top, bottom, left, right)`` zero padding.

    Skipping out-of-image taps (TFLite) equals padding ``x + input_offset`` with zeros. Returns int8
    ``(N, OH, OW, C*M)``.
    """
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
    acc = (acc + bias).astype(np.int32)  # wraps like the reference's int32 accumulator
    out = multiply_by_quantized_multiplier_np(acc, mult, shift).astype(np.int64) + output_offset
    return np.clip(out, lo, hi).astype(np.int8)
