"""Int8 depthwise convolution: incrinf's channel-innermost kernel vs the reference loop order and LiteRT.

Run: ``python benchmarks/depthwise_int8.py`` (about a minute). For every depthwise layer of MobileNetV2
(torchvision, random weights) and EfficientNet-Lite0 at a 224x224 input, batch 1, with random int8
data and per-channel quantization, it times (median of ``--repeats`` warm calls, methods taking
turns call by call so that load changes hit them alike, at 1 and 2 threads):

- ``ours``: :func:`incrinf.kernels.depthwise_conv2d_int8_packed` (weights packed once per layer, as
  LiteRT does in ``allocate_tensors``; the functional API's extra per-call cost is printed first);
- ``ref-order``: the same arithmetic in TFLite's reference loop order (channel outer), numba;
- ``REF``: LiteRT ``BUILTIN_REF`` (TFLite's reference kernels; single-threaded whatever num_threads);
- ``opt``: LiteRT optimized builtin kernels without delegates (``BUILTIN_WITHOUT_DEFAULT_DELEGATES``);
- ``xnnpack``: LiteRT's default (``AUTO``: the XNNPACK delegate).

Numba's OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE`` unless set): on a shared machine
the default spin-then-sleep barrier makes a 2-thread call wait for a scheduler slice (~10 ms).
Every layer uses TFLite SAME padding (MobileNetV2's symmetric stride-2 padding differs by one pixel;
the shapes and work are the same), and ``ours`` is checked bit-exact against ``REF`` on each layer.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before numba/torch start OpenMP (see above)
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numba
import numpy as np
import torch

try:
    from incrinf.kernels import depthwise_int8 as dw
except ImportError:  # run from a checkout without `pip install -e .`: use the package next to this file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from incrinf.kernels import depthwise_int8 as dw
from incrinf.kernels.quantize import per_channel_multipliers
from incrinf.testing.tflite_oracle import TfliteRunner, build_depthwise_model

MODELS = ("mobilenet_v2", "efficientnet_lite0")
METHODS = ("ours", "ref-order", "REF", "opt", "xnnpack")


@dataclass(frozen=True)
class Layer:
    """A depthwise layer's shape: NHWC input ``(1, H, W, C)``, kernel, stride, depth multiplier."""

    name: str
    height: int
    width: int
    channels: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    depth_multiplier: int


@dataclass
class Timing:
    layer: Layer
    seconds: dict[tuple[str, int], float] = field(default_factory=dict)  # (method, threads) -> median


def depthwise_layers(model_name: str, size: int = 224) -> list[Layer]:
    """The depthwise convs (groups == in_channels) of a model, with their input sizes."""
    if model_name == "mobilenet_v2":
        import torchvision

        model = torchvision.models.mobilenet_v2(weights=None)
    elif model_name == "efficientnet_lite0":
        from efficientnet_lite_pytorch import EfficientNet

        model = EfficientNet.from_name("efficientnet-lite0")
    else:
        raise ValueError(f"unknown model {model_name!r}; choose from {MODELS}")
    layers: list[Layer] = []

    def hook(name):
        def record(module, inputs, _output):
            _, c, h, w = inputs[0].shape  # EfficientNet's static ZeroPad2d runs inside forward: unpadded
            layers.append(
                Layer(
                    name, h, w, c, tuple(module.kernel_size), tuple(module.stride), module.out_channels // c
                )
            )

        return record

    handles = [
        m.register_forward_hook(hook(n))
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Conv2d) and m.groups == m.in_channels and m.groups > 1
    ]
    with torch.no_grad():
        model.eval()(torch.zeros(1, 3, size, size))
    for h in handles:
        h.remove()
    return layers


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up (and compile)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds per function, timing them in turn each round so load changes hit all alike."""
    for fn in fns.values():
        fn()  # warm up (and compile)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def time_layer(layer: Layer, repeats: int, threads: tuple[int, ...], seed: int = 0) -> Timing:
    rng = np.random.default_rng(seed)
    c, oc = layer.channels, layer.channels * layer.depth_multiplier
    x = rng.integers(-128, 128, (1, layer.height, layer.width, c), dtype=np.int8)
    w = rng.integers(-127, 128, (1, *layer.kernel, oc), dtype=np.int8)
    bias = rng.integers(-5000, 5000, oc).astype(np.int32)
    in_s, in_zp, out_s, out_zp = 0.02, -3, 0.05, 5
    w_scales = rng.uniform(1e-3, 1e-2, oc).astype(np.float32)
    mult, shift = per_channel_multipliers(in_s, w_scales, out_s)
    geometry = dict(stride=layer.stride, padding="same")
    packed = dw.pack_depthwise_int8(w, bias, input_offset=-in_zp, output_multiplier=mult, output_shift=shift)
    model = build_depthwise_model(
        w,
        bias,
        input_shape=x.shape,
        input_scale=in_s,
        input_zero_point=in_zp,
        weight_scales=w_scales,
        output_scale=out_s,
        output_zero_point=out_zp,
        depth_multiplier=layer.depth_multiplier,
        **geometry,
    )

    def ours():
        return dw.depthwise_conv2d_int8_packed(x, packed, output_offset=out_zp, **geometry)

    def ref_order():
        return dw.depthwise_conv2d_int8_reference_order(x, packed, output_offset=out_zp, **geometry)

    timing = Timing(layer)
    for t in threads:
        numba.set_num_threads(t)
        runners = {
            method: TfliteRunner(model, reference=resolver, num_threads=t)
            for method, resolver in (("REF", True), ("opt", "builtin"), ("xnnpack", False))
        }
        for runner in runners.values():
            runner.set_input(x)
        fns = {"ours": ours, "ref-order": ref_order, **{m: r.invoke for m, r in runners.items()}}
        for method, seconds in _interleaved_medians(fns, repeats).items():
            timing.seconds[method, t] = seconds
        mismatches = int((runners["REF"].output() != ours()).sum())
        if mismatches:
            raise AssertionError(f"{layer.name}: {mismatches} mismatches against BUILTIN_REF")
    return timing


def call_overheads_us(repeats: int) -> tuple[float, float]:
    """Microseconds per call on a tiny layer (1x4x4x32, 3x3): packed call, and functional minus packed."""
    x = np.zeros((1, 4, 4, 32), np.int8)
    w = np.zeros((1, 3, 3, 32), np.int8)
    args = dict(output_multiplier=2**30, output_shift=0)
    packed = dw.pack_depthwise_int8(w, None, input_offset=0, **args)
    medians = _interleaved_medians(
        {
            "functional": lambda: dw.depthwise_conv2d_int8(
                x, w, None, input_offset=0, output_offset=0, **args
            ),
            "packed": lambda: dw.depthwise_conv2d_int8_packed(x, packed, output_offset=0),
        },
        repeats * 20,
    )
    return medians["packed"] * 1e6, (medians["functional"] - medians["packed"]) * 1e6


def print_machine() -> None:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from importlib.metadata import version

    print(f"platform : {platform.platform()} ({platform.machine()})")
    print(f"cpu      : {cpu}, {os.cpu_count()} logical cpus, load average {os.getloadavg()[0]:.2f}")
    print(f"threads  : OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    print(
        f"python   : {sys.version.split()[0]}, numpy {np.__version__}, numba {numba.__version__}"
        f" (threading layer {numba.threading_layer()}), ai-edge-litert {version('ai-edge-litert')}"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f}"


def print_table(model: str, timings: list[Timing], threads: int) -> None:
    print(f"\n### {model}, {threads} thread{'s' if threads > 1 else ''} (median ms; ratios = other / ours)")
    header = (
        "| layer | HxWxC k s | ours | ref-order | REF | opt | xnnpack |"
        " ref-order/ours | REF/ours | opt/ours | xnnpack/ours |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    totals = dict.fromkeys(METHODS, 0.0)

    def row(name: str, shape: str, sec: dict[str, float]) -> str:
        ours = sec["ours"]
        cells = [_ms(sec[m]) for m in METHODS]
        ratios = [f"{sec[m] / ours:6.2f}x" for m in METHODS[1:]]
        return f"| {name} | {shape} | " + " | ".join(cells + ratios) + " |"

    for t in timings:
        sec = {m: t.seconds[m, threads] for m in METHODS}
        for m in METHODS:
            totals[m] += sec[m]
        lay = t.layer
        shape = f"{lay.height}x{lay.width}x{lay.channels} {lay.kernel[0]}x{lay.kernel[1]} s{lay.stride[0]}"
        print(row(lay.name, shape, sec))
    print(row("**total**", f"{len(timings)} layers", totals))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per measurement (median)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {MODELS}")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    args = parser.parse_args(argv)
    threads = tuple(int(t) for t in args.threads.split(","))
    packed_us, extra_us = call_overheads_us(args.repeats)  # also starts numba's threading layer
    print_machine()
    print(
        f"per-call cost on a tiny layer: packed {packed_us:.1f} us; the functional API adds {extra_us:.1f} us"
        " (validation + packing)"
    )
    for model in args.models.split(","):
        timings = [time_layer(layer, args.repeats, threads) for layer in depthwise_layers(model)]
        for t in threads:
            print_table(model, timings, t)


if __name__ == "__main__":
    main()
