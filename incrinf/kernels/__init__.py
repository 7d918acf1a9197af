"""Kernels: region gather/scatter and the int8 NHWC depthwise convolution.

The int8 names below load lazily (PEP 562), so importing ``incrinf.kernels.gather`` does not pull
in numba or LiteRT.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "PackedDepthwiseInt8": "depthwise_int8",
    "depthwise_conv2d_int8": "depthwise_int8",
    "depthwise_conv2d_int8_packed": "depthwise_int8",
    "depthwise_conv2d_int8_reference_order": "depthwise_int8",
    "pack_depthwise_int8": "depthwise_int8",
    "resolve_padding": "depthwise_int8",
    "MinMaxObserver": "quantize",
    "activation_range": "quantize",
    "choose_qparams": "quantize",
    "multiply_by_quantized_multiplier": "quantize",
    "per_channel_multipliers": "quantize",
    "quantize_multiplier": "quantize",
    "quantize_multipliers": "quantize",
    "TfliteRunner": "tflite_oracle",
    "build_depthwise_model": "tflite_oracle",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
