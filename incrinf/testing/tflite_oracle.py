"""One-op int8 DEPTHWISE_CONV_2D TFLite models, built in memory and run with LiteRT.

The LiteRT interpreter with ``OpResolverType.BUILTIN_REF`` runs TFLite's reference kernels,
the bit-exactness oracle for :func:`incrinf.kernels.depthwise_conv2d_int8`. Models are written
with the flatbuffers schema module that ``ai_edge_litert`` ships, so no TensorFlow is needed.

Example:
    >>> model = build_depthwise_model(w_q, b_q, input_shape=(1, 8, 8, 4), input_scale=0.02,
    ...     input_zero_point=3, weight_scales=w_s, output_scale=0.05, output_zero_point=-2)  # doctest: +SKIP
    >>> y = TfliteRunner(model)(x_q)  # doctest: +SKIP
"""

from __future__ import annotations

import numpy as np

from incrinf.extras import require

flatbuffers = require("flatbuffers", "int8", "the TFLite oracle")
schema = require("ai_edge_litert.schema_py_generated", "int8", "the TFLite oracle")
_interpreter = require("ai_edge_litert.interpreter", "int8", "the TFLite oracle")
Interpreter, OpResolverType = _interpreter.Interpreter, _interpreter.OpResolverType

__all__ = ["TfliteRunner", "build_depthwise_model", "tflite_output_size"]

_ACTIVATIONS = {
    None: schema.ActivationFunctionType.NONE,
    "relu": schema.ActivationFunctionType.RELU,
    "relu6": schema.ActivationFunctionType.RELU6,
}
_PADDINGS = {"same": schema.Padding.SAME, "valid": schema.Padding.VALID}


def tflite_output_size(in_size: int, kernel: int, stride: int, dilation: int, padding: str) -> int:
    """TFLite's ``ComputeOutSize`` for SAME / VALID padding."""
    eff_k = (kernel - 1) * dilation + 1
    if padding == "same":
        return (in_size + stride - 1) // stride
    if padding == "valid":
        return (in_size - eff_k + stride) // stride
    raise ValueError(f"padding must be 'same' or 'valid', got {padding!r}")


def _pair(v: int | tuple[int, int]) -> tuple[int, int]:
    return (int(v), int(v)) if np.isscalar(v) else (int(v[0]), int(v[1]))


def _tensor(
    shape, tensor_type: int, buffer: int, name: str, scale, zero_point, dim: int = 0
) -> schema.TensorT:
    quant = schema.QuantizationParametersT()
    quant.scale = np.asarray(scale, dtype=np.float32).reshape(-1)
    quant.zeroPoint = np.asarray(zero_point, dtype=np.int64).reshape(-1)
    quant.quantizedDimension = dim
    t = schema.TensorT()
    t.shape = np.asarray(shape, dtype=np.int32)
    t.type = tensor_type
    t.buffer = buffer
    t.name = name
    t.quantization = quant
    return t


def build_depthwise_model(
    weight: np.ndarray,
    bias: np.ndarray,
    *,
    input_shape: tuple[int, int, int, int],
    input_scale: float,
    input_zero_point: int,
    weight_scales: np.ndarray,
    output_scale: float,
    output_zero_point: int,
    stride: int | tuple[int, int] = 1,
    dilation: int | tuple[int, int] = 1,
    padding: str = "same",
    depth_multiplier: int = 1,
    activation: str | None = None,
) -> bytes:
    """Serialize a one-op int8 DEPTHWISE_CONV_2D model (per-channel filter quantization).

    Args:
        weight: int8 filter, shape ``(1, KH, KW, C*M)``.
        bias: int32 bias, shape ``(C*M,)``; its scales are ``input_scale * weight_scales``.
        input_shape: ``(N, H, W, C)`` of the int8 input.
        input_scale, input_zero_point: per-tensor input quantization.
        weight_scales: float32 per-output-channel filter scales, shape ``(C*M,)`` (zero points 0).
        output_scale, output_zero_point: per-tensor output quantization.
        stride, dilation: ints or ``(h, w)`` pairs.
        padding: ``"same"`` or ``"valid"``.
        depth_multiplier: output channels per input channel.
        activation: fused activation, ``None``, ``"relu"`` or ``"relu6"``.

    Returns:
        The ``.tflite`` flatbuffer bytes.
    """
    weight = np.ascontiguousarray(weight, dtype=np.int8)
    bias = np.ascontiguousarray(bias, dtype=np.int32)
    n, h, w, _ = (int(s) for s in input_shape)
    _, kh, kw, oc = weight.shape
    sh, sw = _pair(stride)
    dh, dw = _pair(dilation)
    out_shape = (
        n,
        tflite_output_size(h, kh, sh, dh, padding),
        tflite_output_size(w, kw, sw, dw, padding),
        oc,
    )
    w_scales = np.asarray(weight_scales, dtype=np.float32).reshape(-1)
    bias_scales = np.float32(input_scale) * w_scales  # float32 product, as a converter stores it
    tensors = [
        _tensor(input_shape, schema.TensorType.INT8, 0, "input", [input_scale], [input_zero_point]),
        _tensor(weight.shape, schema.TensorType.INT8, 1, "filter", w_scales, np.zeros(oc), dim=3),
        _tensor((oc,), schema.TensorType.INT32, 2, "bias", bias_scales, np.zeros(oc)),
        _tensor(out_shape, schema.TensorType.INT8, 0, "output", [output_scale], [output_zero_point]),
    ]
    options = schema.DepthwiseConv2DOptionsT()
    options.padding = _PADDINGS[padding]
    options.strideH, options.strideW = sh, sw
    options.dilationHFactor, options.dilationWFactor = dh, dw
    options.depthMultiplier = depth_multiplier
    options.fusedActivationFunction = _ACTIVATIONS[activation]

    op = schema.OperatorT()
    op.opcodeIndex = 0
    op.inputs = np.array([0, 1, 2], dtype=np.int32)
    op.outputs = np.array([3], dtype=np.int32)
    op.builtinOptionsType = schema.BuiltinOptions.DepthwiseConv2DOptions
    op.builtinOptions = options

    subgraph = schema.SubGraphT()
    subgraph.tensors = tensors
    subgraph.inputs = np.array([0], dtype=np.int32)
    subgraph.outputs = np.array([3], dtype=np.int32)
    subgraph.operators = [op]

    code = schema.OperatorCodeT()
    code.deprecatedBuiltinCode = code.builtinCode = schema.BuiltinOperator.DEPTHWISE_CONV_2D
    code.version = 3  # int8 per-channel

    buffers = [schema.BufferT(), schema.BufferT(), schema.BufferT()]  # buffer 0: the empty sentinel
    buffers[1].data = weight.reshape(-1).view(np.uint8)
    buffers[2].data = bias.reshape(-1).view(np.uint8)

    model = schema.ModelT()
    model.version = 3
    model.operatorCodes = [code]
    model.subgraphs = [subgraph]
    model.buffers = buffers
    builder = flatbuffers.Builder(1024 + weight.nbytes + bias.nbytes)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


class TfliteRunner:
    """A LiteRT interpreter around one single-input, single-output model.

    Args:
        model: ``.tflite`` bytes.
        reference: ``True`` for TFLite's reference kernels (``BUILTIN_REF``, the exactness
            oracle); ``False`` for the default optimized kernels (``AUTO``: XNNPACK where it
            applies); ``"builtin"`` for optimized builtin kernels without default delegates.
        num_threads: interpreter threads.
    """

    def __init__(self, model: bytes, reference: bool | str = True, num_threads: int = 1) -> None:
        if reference is True:
            resolver = OpResolverType.BUILTIN_REF
        elif reference == "builtin":
            resolver = OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
        else:
            resolver = OpResolverType.AUTO
        self._model = model  # the interpreter reads the buffer in place: keep it alive
        self.interpreter = Interpreter(
            model_content=model, num_threads=num_threads, experimental_op_resolver_type=resolver
        )
        self.interpreter.allocate_tensors()
        self._in = self.interpreter.get_input_details()[0]["index"]
        self._out = self.interpreter.get_output_details()[0]["index"]

    def set_input(self, x: np.ndarray) -> None:
        """Copy ``x`` (int8 NHWC) into the input tensor."""
        self.interpreter.set_tensor(self._in, np.ascontiguousarray(x))

    def invoke(self) -> None:
        """Run the model on the current input."""
        self.interpreter.invoke()

    def output(self) -> np.ndarray:
        """A copy of the output tensor (int8 NHWC)."""
        return self.interpreter.get_tensor(self._out)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Run on ``x`` (int8 ``(N, H, W, C)``), return the int8 output ``(N, OH, OW, C*M)``."""
        self.set_input(x)
        self.invoke()
        return self.output()
