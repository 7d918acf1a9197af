"""QuantizedDepthwiseConv2d: geometry, quantization, float error, real EfficientNet-Lite0 layers bit-exact with
TFLite, and the module as a local node of the engine (incremental occlusion equals re-inference)."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import naive_occlusion
from depthwise_strategies import one_numba_thread  # noqa: F401 (fixture)

from incrinf import NodeKind, capture
from incrinf.explain.runner import OcclusionRunner
from incrinf.kernels.quantize import choose_qparams
from incrinf.kernels.quantized_module import QuantizedDepthwiseConv2d
from incrinf.testing.quantized_layers import efficientnet_lite0_depthwise_layers, tflite_reference_output

pytestmark = pytest.mark.usefixtures("one_numba_thread")


def _model() -> nn.Module:
    dw = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8)
    q = QuantizedDepthwiseConv2d.from_float(dw, 0.05, 3, 0.04, -2, activation="relu6")
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), q, nn.Conv2d(8, 4, 1), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten()).eval()


def test_quantized_depthwise_is_a_local_node_and_incremental_is_exact() -> None:
    model = _model()
    graph = capture(model, (3, 32, 32))
    node = next(n for n in graph.nodes if "Quantized" in n.op)
    assert node.kind == NodeKind.LOCAL and node.geometry.stride == (2, 2)
    image = torch.randn(1, 3, 32, 32)
    positions = np.array([[0, 0], [10, 13], [26, 26], [5, 20]])
    got, _ = OcclusionRunner(model, image).run(positions, (6, 6), batch_size=3)
    want = naive_occlusion(model, image, positions, (6, 6))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (want - want[:1]).abs().max() > 0


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
# EfficientNet-Lite0: every depthwise layer, real weights, calibrated on real photos
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def efficientnet_layers():
    """Per depthwise layer: (name, quantized module, float folded conv, real float input batch)."""
    return efficientnet_lite0_depthwise_layers()


def test_efficientnet_lite0_depthwise_layers_bit_exact(efficientnet_layers):
    """All 16 depthwise layers at their full 224x224-input sizes, batch of 3 real photos, every thread count."""
    assert len(efficientnet_layers) == 16
    for name, q, _, x in efficientnet_layers:
        x_q = q.quantize_input(x).numpy()
        # EfficientNet's static "same" ZeroPad2d is TFLite's SAME for these sizes (checked in there).
        expected = tflite_reference_output(q, x_q)
        for threads in range(1, numba.config.NUMBA_NUM_THREADS + 1):
            got = q.forward_int8(x_q, threads=threads)
            mismatches = int((got != expected).sum())
            assert got.shape == expected.shape and mismatches == 0, (name, threads, mismatches)


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
