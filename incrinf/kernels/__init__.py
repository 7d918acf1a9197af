"""Kernels: region gathers and projections (PyTorch index operations; Triton on CUDA), and the int8 NHWC
depthwise convolution with its module wrapper.

The int8 names load on first use, so importing ``incrinf.kernels.gather`` does not pull in numba.
"""

from incrinf.lazy import lazy_exports

_EXPORTS = {
    "PackedDepthwiseInt8": ".depthwise_int8",
    "depthwise_conv2d_int8": ".depthwise_int8",
    "depthwise_conv2d_int8_packed": ".depthwise_int8",
    "depthwise_conv2d_int8_reference_order": ".depthwise_int8",
    "pack_depthwise_int8": ".depthwise_int8",
    "resolve_padding": ".depthwise_int8",
    "MinMaxObserver": ".quantize",
    "activation_range": ".quantize",
    "choose_qparams": ".quantize",
    "multiply_by_quantized_multiplier": ".quantize",
    "per_channel_multipliers": ".quantize",
    "quantize_multiplier": ".quantize",
    "quantize_multipliers": ".quantize",
    "QuantizedDepthwiseConv2d": ".quantized_module",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
