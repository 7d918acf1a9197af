"""``QuantizedDepthwiseConv2d``: a float-in/float-out module running the int8 NHWC depthwise kernel.

It quantizes like a TFLite int8 model (per-tensor asymmetric activations, per-channel
symmetric weights, int32 bias) and computes with :func:`incrinf.kernels.depthwise_conv2d_int8`,
so its integer outputs are bit-exact with TFLite's reference kernel. It exposes the geometry of
a local node (``kernel_size``, ``stride``, ``dilation``, explicit ``padding`` and
:meth:`~QuantizedDepthwiseConv2d.without_padding`) so the incremental engine can run it on
pre-padded region batches.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from incrinf.kernels.depthwise_int8 import depthwise_conv2d_int8_packed, pack_depthwise_int8, resolve_padding
from incrinf.kernels.quantize import (
    activation_range,
    dequantize,
    per_channel_multipliers,
    quantize,
    symmetric_weight_scales,
)

__all__ = ["QuantizedDepthwiseConv2d"]


def _round_half_away(x: np.ndarray) -> np.ndarray:
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _conv_padding(conv: nn.Conv2d) -> tuple[int, int, int, int]:
    """``(top, bottom, left, right)`` of a conv, including a ``static_padding`` ZeroPad2d.

    EfficientNet-style "static same" convs pad with an ``nn.ZeroPad2d`` attribute before a conv
    with ``padding=0``; both are zero padding, so they simply add up.
    """
    if conv.padding_mode != "zeros":
        raise ValueError(f"only zero padding is supported, got padding_mode={conv.padding_mode!r}")
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            top = bottom = left = right = 0
        else:  # PyTorch 'same' (stride 1): total d*(k-1), the extra pixel after
            (top, bottom), (left, right) = (
                (d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2)
                for k, d in zip(conv.kernel_size, conv.dilation, strict=True)
            )
    else:
        top = bottom = int(conv.padding[0])
        left = right = int(conv.padding[1])
    static = getattr(conv, "static_padding", None)
    if isinstance(static, nn.ZeroPad2d):
        s_left, s_right, s_top, s_bottom = static.padding
        top, bottom, left, right = top + s_top, bottom + s_bottom, left + s_left, right + s_right
    return (top, bottom, left, right)


class QuantizedDepthwiseConv2d(nn.Module):
    """Int8 depthwise convolution (TFLite arithmetic) with float NCHW input and output.

    ``forward`` quantizes the input with TFLite's ``AffineQuantize`` rounding (float32
    ``x / scale``, ties away from zero, clamp to int8), runs the NHWC int8 kernel and dequantizes
    ``(q - zero_point) * scale``.

    Args:
        weight: int8 filter ``(1, KH, KW, C*M)`` (TFLite layout).
        bias: int32 bias ``(C*M,)``.
        weight_scales: float32 per-output-channel filter scales ``(C*M,)``.
        input_scale, input_zero_point: input quantization.
        output_scale, output_zero_point: output quantization.
        stride, dilation: ``(h, w)``.
        padding: explicit zero padding ``(top, bottom, left, right)``.
        activation: ``None``, ``"relu"`` or ``"relu6"`` (fused as TFLite's activation clamp).

    Attributes:
        kernel_size, stride, dilation: ``(h, w)`` pairs.
        padding: ``(top, bottom, left, right)``.
        in_channels, out_channels, groups, depth_multiplier: channel geometry.
    """

    def __init__(
        self,
        weight: np.ndarray,
        bias: np.ndarray,
        weight_scales: np.ndarray,
        input_scale: float,
        input_zero_point: int,
        output_scale: float,
        output_zero_point: int,
        stride: tuple[int, int] = (1, 1),
        padding: tuple[int, int, int, int] = (0, 0, 0, 0),
        dilation: tuple[int, int] = (1, 1),
        activation: str | None = None,
        in_channels: int | None = None,
    ) -> None:
        super().__init__()
        weight = np.ascontiguousarray(weight, dtype=np.int8)
        if weight.ndim != 4 or weight.shape[0] != 1:
            raise ValueError(f"weight must be int8 (1, KH, KW, C*M), got shape {weight.shape}")
        out_channels = weight.shape[3]
        self.in_channels = out_channels if in_channels is None else int(in_channels)
        if out_channels % self.in_channels:
            raise ValueError(
                f"{out_channels} output channels is not a multiple of in_channels={self.in_channels}"
            )
        self.out_channels = out_channels
        self.groups = self.in_channels
        self.depth_multiplier = out_channels // self.in_channels
        self.kernel_size = (weight.shape[1], weight.shape[2])
        self.stride = tuple(int(s) for s in stride)
        self.dilation = tuple(int(d) for d in dilation)
        if len(self.stride) != 2 or len(self.dilation) != 2:
            raise ValueError("stride and dilation must be (h, w) pairs")
        if isinstance(padding, str):
            raise TypeError(
                "padding must be explicit (top, bottom, left, right): 'same' depends on the input size"
            )
        self.padding = resolve_padding(tuple(padding), (0, 0), self.kernel_size, self.stride, self.dilation)
        self.activation = activation
        self.input_scale = float(np.float32(input_scale))
        self.input_zero_point = int(input_zero_point)
        self.output_scale = float(np.float32(output_scale))
        self.output_zero_point = int(output_zero_point)
        self.act_min, self.act_max = activation_range(activation, self.output_scale, self.output_zero_point)
        w_scales = np.asarray(weight_scales, dtype=np.float32).reshape(-1)
        mult, shift = per_channel_multipliers(self.input_scale, w_scales, self.output_scale)
        self.register_buffer("weight", torch.from_numpy(weight))
        self.register_buffer("bias", torch.from_numpy(np.ascontiguousarray(bias, dtype=np.int32)))
        self.register_buffer("weight_scales", torch.from_numpy(w_scales.copy()))
        self.register_buffer("output_multiplier", torch.from_numpy(mult))
        self.register_buffer("output_shift", torch.from_numpy(shift))
        self._repack()
        # The kernel reads packed copies of the buffers: refresh them when a state_dict is loaded.
        self.register_load_state_dict_post_hook(lambda module, _keys: module._repack())

    def get_extra_state(self) -> dict:
        """Activation quantization travels with the state_dict (the integer tensors are buffers)."""
        return {
            "input": (self.input_scale, self.input_zero_point),
            "output": (self.output_scale, self.output_zero_point),
            "activation": self.activation,
        }

    def set_extra_state(self, state: dict) -> None:
        self.input_scale, self.input_zero_point = state["input"]
        self.output_scale, self.output_zero_point = state["output"]
        self.activation = state["activation"]
        self.act_min, self.act_max = activation_range(
            self.activation, self.output_scale, self.output_zero_point
        )

    def _repack(self) -> None:
        self._packed = pack_depthwise_int8(
            self.weight.numpy(),
            self.bias.numpy(),
            input_offset=-self.input_zero_point,
            output_multiplier=self.output_multiplier.numpy(),
            output_shift=self.output_shift.numpy(),
            in_channels=self.in_channels,
        )
        self._unpadded: QuantizedDepthwiseConv2d | None = None

    @classmethod
    def from_float(
        cls,
        conv: nn.Conv2d,
        input_scale: float,
        input_zero_point: int,
        output_scale: float,
        output_zero_point: int,
        activation: str | None = None,
        padding: tuple[int, int, int, int] | None = None,
    ) -> QuantizedDepthwiseConv2d:
        """Quantize a float depthwise ``nn.Conv2d`` (``groups == in_channels``).

        Weights get per-channel symmetric scales ``max|w| / 127`` (values rounded half away from
        zero, clamped to [-127, 127]); the bias becomes int32 ``round(b / (input_scale * w_scale))``.

        Args:
            conv: the float conv; an ``nn.ZeroPad2d`` attribute ``static_padding`` (EfficientNet's
                static-same convs) is folded into the padding.
            input_scale, input_zero_point: input activation quantization (e.g. from
                :func:`incrinf.kernels.quantize.choose_qparams`).
            output_scale, output_zero_point: output activation quantization.
            activation: activation fused after the conv: ``None``, ``"relu"`` or ``"relu6"``.
            padding: explicit ``(top, bottom, left, right)`` overriding the conv's own.
        """
        if not isinstance(conv, nn.Conv2d):
            raise TypeError(f"conv must be an nn.Conv2d, got {type(conv).__name__}")
        if conv.groups != conv.in_channels or conv.out_channels % conv.in_channels:
            raise ValueError(
                f"conv must be depthwise (groups == in_channels), got groups={conv.groups},"
                f" in_channels={conv.in_channels}, out_channels={conv.out_channels}"
            )
        w = conv.weight.detach().cpu().to(torch.float32).numpy()  # (C*M, 1, KH, KW)
        scales = symmetric_weight_scales(w, axis=0)
        w_q = np.clip(_round_half_away(w / scales[:, None, None, None]), -127, 127).astype(np.int8)
        w_q = np.ascontiguousarray(w_q.transpose(1, 2, 3, 0))  # -> (1, KH, KW, C*M); oc = ic*M + m
        if conv.bias is not None:
            b = conv.bias.detach().cpu().to(torch.float64).numpy()
            b_scale = np.float32(input_scale) * scales.astype(np.float32)
            b_q = np.clip(_round_half_away(b / b_scale.astype(np.float64)), -(2**31), 2**31 - 1).astype(
                np.int32
            )
        else:
            b_q = np.zeros(conv.out_channels, np.int32)
        return cls(
            w_q,
            b_q,
            scales,
            input_scale,
            input_zero_point,
            output_scale,
            output_zero_point,
            stride=tuple(conv.stride),
            padding=_conv_padding(conv) if padding is None else padding,
            dilation=tuple(conv.dilation),
            activation=activation,
            in_channels=conv.in_channels,
        )

    def without_padding(self) -> QuantizedDepthwiseConv2d:
        """The same layer with zero padding removed (for inputs that are already padded).

        Padding a float input with 0.0 quantizes to the zero point, whose contribution
        ``w * (zero_point + input_offset)`` is 0: identical to the kernel skipping those taps.
        The clone is built once and cached.
        """
        if self.padding == (0, 0, 0, 0):
            return self
        if self._unpadded is None:
            self._unpadded = self._clone_unpadded()
        return self._unpadded

    def _clone_unpadded(self) -> QuantizedDepthwiseConv2d:
        return type(self)(
            self.weight.numpy(),
            self.bias.numpy(),
            self.weight_scales.numpy(),
            self.input_scale,
            self.input_zero_point,
            self.output_scale,
            self.output_zero_point,
            stride=self.stride,
            padding=(0, 0, 0, 0),
            dilation=self.dilation,
            activation=self.activation,
            in_channels=self.in_channels,
        )

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """Float NCHW -> int8 NHWC (contiguous), TFLite rounding."""
        return (
            quantize(x.detach().cpu(), self.input_scale, self.input_zero_point)
            .permute(0, 2, 3, 1)
            .contiguous()
        )

    def forward_int8(
        self,
        x_q: torch.Tensor | np.ndarray,
        region: tuple[int, int, int, int] | None = None,
        threads: int | None = None,
    ) -> torch.Tensor | np.ndarray:
        """Integer path: int8 NHWC ``(N, H, W, C)`` in, int8 NHWC ``(N, OH, OW, C*M)`` out (same type).

        ``region`` is a half-open output box ``(y0, y1, x0, x1)``; ``threads`` the kernel's numba threads
        (default ``numba.get_num_threads()``; every count gives the same result).
        """
        return depthwise_conv2d_int8_packed(
            x_q,
            self._packed,
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            output_offset=self.output_zero_point,
            act_min=self.act_min,
            act_max=self.act_max,
            region=region,
            threads=threads,
        )

    def forward(self, x: torch.Tensor, region: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        """Quantize, convolve in int8, dequantize.

        Args:
            x: float ``(N, C, H, W)``.
            region: optional half-open output box ``(y0, y1, x0, x1)``; only that box is computed.

        Returns:
            float32 ``(N, C*M, OH, OW)`` (or the box's size), on ``x``'s device.
        """
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"x must be (N, {self.in_channels}, H, W), got shape {tuple(x.shape)}")
        y_q = self.forward_int8(self.quantize_input(x), region)
        y = dequantize(y_q, self.output_scale, self.output_zero_point)
        return y.permute(0, 3, 1, 2).contiguous().to(x.device)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride},"
            f" padding={self.padding}, dilation={self.dilation}, activation={self.activation},"
            f" input=({self.input_scale:.4g}, {self.input_zero_point}),"
            f" output=({self.output_scale:.4g}, {self.output_zero_point})"
        )
