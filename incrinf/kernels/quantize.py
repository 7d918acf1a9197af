"""TFLite's int8 quantization arithmetic: multipliers, requantization, calibration.

Everything here mirrors TFLite's reference code (``QuantizeMultiplier``,
``MultiplyByQuantizedMultiplier`` with gemmlowp's double rounding,
``CalculateActivationRangeQuantized``, ``AffineQuantize``), so that kernels built on it are
bit-exact with the TFLite interpreter's ``BUILTIN_REF`` kernels.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from incrinf.extras import require

numba = require("numba", "int8", "the int8 kernels")
njit = numba.njit

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
INT8_MIN = -128
INT8_MAX = 127

__all__ = [
    "INT8_MAX",
    "INT8_MIN",
    "MinMaxObserver",
    "activation_range",
    "choose_qparams",
    "dequantize",
    "multiply_by_quantized_multiplier",
    "multiply_by_quantized_multiplier_np",
    "per_channel_multipliers",
    "quantize",
    "quantize_multiplier",
    "quantize_multipliers",
    "symmetric_weight_scales",
    "validate_multipliers",
]


def _round_half_away(value: float) -> float:
    """``std::round``: ties away from zero (Python's ``round`` ties to even)."""
    return math.copysign(math.floor(abs(value) + 0.5), value)


def quantize_multiplier(real: float) -> tuple[int, int]:
    """TFLite's ``QuantizeMultiplier``: ``real ~= multiplier * 2**(shift - 31)``.

    Args:
        real: the real multiplier (e.g. ``in_scale * w_scale / out_scale``), computed in float64.

    Returns:
        ``(multiplier, shift)`` with ``multiplier`` in ``[2**30, 2**31)`` (or ``(0, 0)`` for a
        multiplier of 0 or one so small that every result would round to 0, i.e. shift < -31).

    Raises:
        ValueError: ``real`` is negative, not finite, or so large that shift would exceed 30.
    """
    real = float(real)
    if not math.isfinite(real) or real < 0:
        raise ValueError(f"real multiplier must be finite and >= 0, got {real!r}")
    if real == 0.0:
        return 0, 0
    q, shift = math.frexp(real)  # real = q * 2**shift, q in [0.5, 1)
    q_fixed = int(_round_half_away(q * 2.0**31))
    if q_fixed == 2**31:  # q rounded up to 1.0: renormalize
        q_fixed //= 2
        shift += 1
    if shift < -31:  # every bit would be shifted out: TFLite flushes to zero
        return 0, 0
    if shift > 30:
        raise ValueError(f"real multiplier {real!r} is too large for int32 fixed point (shift {shift} > 30)")
    return q_fixed, shift


def quantize_multipliers(reals: Iterable[float] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized :func:`quantize_multiplier`.

    Args:
        reals: real multipliers, shape ``(C,)``.

    Returns:
        ``(multipliers, shifts)``, both int32 of shape ``(C,)``.
    """
    reals = np.asarray(reals, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(reals)) or np.any(reals < 0):
        raise ValueError("real multipliers must be finite and >= 0")
    q, shift = np.frexp(reals)
    q_fixed = np.floor(q * 2.0**31 + 0.5).astype(np.int64)  # q >= 0: floor(x + 0.5) is round-half-away
    shift = shift.astype(np.int64)
    renorm = q_fixed == 2**31
    q_fixed[renorm] //= 2
    shift[renorm] += 1
    tiny = (shift < -31) | (reals == 0.0)
    q_fixed[tiny] = 0
    shift[tiny] = 0
    if np.any(shift > 30):
        raise ValueError(f"real multiplier {reals[shift > 30][0]!r} is too large (shift > 30)")
    return q_fixed.astype(np.int32), shift.astype(np.int32)


def per_channel_multipliers(
    input_scale: float, weight_scales: np.ndarray, output_scale: float
) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel multipliers exactly as TFLite's ``PopulateConvolutionQuantizationParams``.

    Scales are stored as float32 in a model; TFLite widens them to double and computes
    ``input_scale * weight_scale / output_scale`` in that order.

    Args:
        input_scale: input tensor scale.
        weight_scales: per-output-channel filter scales, shape ``(C*M,)``.
        output_scale: output tensor scale.

    Returns:
        ``(multipliers, shifts)``, int32 of shape ``(C*M,)``.
    """
    in_s = float(np.float32(input_scale))
    out_s = float(np.float32(output_scale))
    w_s = np.asarray(weight_scales, dtype=np.float32).astype(np.float64).reshape(-1)
    return quantize_multipliers(in_s * w_s / out_s)


def validate_multipliers(multiplier: np.ndarray, shift: np.ndarray, channels: int) -> None:
    """Raise ``ValueError`` unless multipliers/shifts are valid TFLite fixed-point values.

    Args:
        multiplier: int32, shape ``(channels,)``, each in ``[2**30, 2**31)`` or 0.
        shift: int32, shape ``(channels,)``, each in ``[-31, 30]``.
        channels: expected number of output channels.
    """
    for name, arr in (("output_multiplier", multiplier), ("output_shift", shift)):
        if arr.shape != (channels,):
            raise ValueError(
                f"{name} must have shape ({channels},) (one per output channel), got {arr.shape}"
            )
    bad = (multiplier != 0) & ((multiplier < 2**30) | (multiplier > INT32_MAX))
    if np.any(bad):
        raise ValueError(
            f"output_multiplier must be 0 or in [2**30, 2**31), got {int(multiplier[bad][0])}"
            " (use quantize_multiplier to build it)"
        )
    if np.any((shift < -31) | (shift > 30)):
        raise ValueError(
            f"output_shift must be in [-31, 30], got {int(shift[(shift < -31) | (shift > 30)][0])}"
        )


@njit(cache=True, inline="always")
def multiply_by_quantized_multiplier(x: int, multiplier: int, shift: int) -> int:
    """TFLite's int32 ``MultiplyByQuantizedMultiplier`` (gemmlowp double rounding), numba scalar.

    ``x * 2**max(shift, 0)`` wraps in int32 (as the C++ does on every real target), then
    ``SaturatingRoundingDoublingHighMul`` with ``multiplier``, then ``RoundingDivideByPOT`` by
    ``max(-shift, 0)`` (ties away from zero). ``multiplier`` is never INT32_MIN, so the
    saturating case of the high-mul cannot occur.
    """
    left = shift if shift > 0 else 0
    right = -shift if shift < 0 else 0
    xs = np.int64(np.int32(np.int64(x) << left))  # int32 wrap, as in C++
    ab = xs * np.int64(multiplier)
    # Nudge then divide by 2**31, truncating toward zero like C++ integer division.
    v = ab + (np.int64(1 << 30) if ab >= 0 else np.int64(1 - (1 << 30)))
    high = (v >> 31) if v >= 0 else -((-v) >> 31)
    mask = np.int64((1 << right) - 1)
    remainder = high & mask
    threshold = (mask >> 1) + (1 if high < 0 else 0)
    return np.int32((high >> right) + (1 if remainder > threshold else 0))


def multiply_by_quantized_multiplier_np(
    x: np.ndarray, multiplier: np.ndarray, shift: np.ndarray
) -> np.ndarray:
    """Vectorized numpy :func:`multiply_by_quantized_multiplier` (broadcasting), returns int32."""
    x = np.asarray(x, dtype=np.int64)
    multiplier = np.asarray(multiplier, dtype=np.int64)
    shift = np.asarray(shift, dtype=np.int64)
    left = np.maximum(shift, 0)
    right = np.maximum(-shift, 0)
    xs = (x << left).astype(np.int32).astype(np.int64)  # int32 wrap
    ab = xs * multiplier
    v = ab + np.where(ab >= 0, 1 << 30, 1 - (1 << 30))
    high = np.where(v >= 0, v >> 31, -((-v) >> 31))
    mask = (np.int64(1) << right) - 1
    threshold = (mask >> 1) + (high < 0)
    return ((high >> right) + ((high & mask) > threshold)).astype(np.int32)


def activation_range(activation: str | None, output_scale: float, output_zero_point: int) -> tuple[int, int]:
    """TFLite's ``CalculateActivationRangeQuantized`` for int8 outputs.

    Args:
        activation: ``None``, ``"relu"`` or ``"relu6"``.
        output_scale: output scale (float32 arithmetic, as TFLite).
        output_zero_point: output zero point.

    Returns:
        ``(act_min, act_max)`` within ``[-128, 127]``.
    """
    zp = int(output_zero_point)
    if activation is None:
        return INT8_MIN, INT8_MAX
    if activation == "relu":
        return max(INT8_MIN, zp), INT8_MAX
    if activation == "relu6":
        six = float(np.float32(6.0) / np.float32(output_scale))  # float32 division, as TFLite
        return max(INT8_MIN, zp), min(INT8_MAX, zp + int(_round_half_away(six)))
    raise ValueError(f"activation must be None, 'relu' or 'relu6', got {activation!r}")


def choose_qparams(min_val: float, max_val: float) -> tuple[float, int]:
    """Asymmetric int8 ``(scale, zero_point)`` for a calibrated float range (TFLite style).

    The range is widened to contain 0 so that 0.0 (zero padding) is exactly representable.

    Returns:
        ``(scale, zero_point)`` with scale a float32-representable value and zero_point in
        ``[-128, 127]``.
    """
    lo, hi = min(float(min_val), 0.0), max(float(max_val), 0.0)
    if hi == lo:
        return 1.0, 0
    scale = float(np.float32((hi - lo) / (INT8_MAX - INT8_MIN)))
    zero_point = int(np.clip(_round_half_away(INT8_MIN - lo / scale), INT8_MIN, INT8_MAX))
    return scale, zero_point


def symmetric_weight_scales(weight: np.ndarray, axis: int) -> np.ndarray:
    """Per-channel symmetric int8 scales ``max|w| / 127`` along every axis but ``axis``.

    Args:
        weight: float weights of any shape.
        axis: the output-channel axis.

    Returns:
        float32 scales, shape ``(weight.shape[axis],)``; all-zero channels get scale 1.
    """
    w = np.moveaxis(np.asarray(weight, dtype=np.float32), axis, 0).reshape(weight.shape[axis], -1)
    max_abs = np.abs(w).max(axis=1) if w.shape[1] else np.zeros(w.shape[0], np.float32)
    return np.where(max_abs > 0, max_abs / np.float32(INT8_MAX), np.float32(1.0)).astype(np.float32)


def quantize(x: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    """TFLite's ``AffineQuantize``: ``clamp(round_half_away(x / scale) + zp, -128, 127)`` as int8.

    Division is float32 (as TFLite); the rounding is exact (no ``floor(v + 0.5)`` float error).

    Args:
        x: float tensor of any shape.
    """
    v = x.to(torch.float32) / torch.tensor(scale, dtype=torch.float32)
    whole = torch.trunc(v)
    frac = v - whole  # exact in float
    rounded = whole + torch.where(frac.abs() >= 0.5, torch.sign(v), torch.zeros_like(v))
    return (rounded + zero_point).clamp(INT8_MIN, INT8_MAX).to(torch.int8)


def dequantize(q: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    """``(q - zero_point) * scale`` in float32."""
    return (q.to(torch.int32) - zero_point).to(torch.float32) * torch.tensor(scale, dtype=torch.float32)


class MinMaxObserver:
    """Records the min/max of chosen modules' inputs and outputs with forward hooks.

    Example:
        >>> obs = MinMaxObserver({"dw": model.conv})  # doctest: +SKIP
        >>> with obs.observe():
        ...     model(images)
        >>> obs.input_range["dw"], obs.output_range["dw"]
    """

    def __init__(self, modules: dict[str, torch.nn.Module]) -> None:
        self.modules = modules
        self.input_range: dict[str, tuple[float, float]] = {}
        self.output_range: dict[str, tuple[float, float]] = {}

    @staticmethod
    def _update(ranges: dict[str, tuple[float, float]], name: str, t: torch.Tensor) -> None:
        lo, hi = float(t.min()), float(t.max())
        if name in ranges:
            lo, hi = min(lo, ranges[name][0]), max(hi, ranges[name][1])
        ranges[name] = (lo, hi)

    @contextmanager
    def observe(self) -> Iterator[MinMaxObserver]:
        """Attach the hooks for the duration of the ``with`` block."""

        def make_hook(name: str):
            def hook(_module, inputs, output):
                self._update(self.input_range, name, inputs[0].detach())
                self._update(self.output_range, name, output.detach())

            return hook

        handles = [m.register_forward_hook(make_hook(n)) for n, m in self.modules.items()]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
