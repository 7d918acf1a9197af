"""Noise-free comparison of the int8 depthwise kernels: instructions executed, counted by valgrind's callgrind.

Run: ``python benchmarks/depthwise_int8_instructions.py`` (several minutes; needs ``valgrind`` with its
headers and ``gcc``, e.g. Debian's ``valgrind`` package). Load on a shared machine changes wall times, not the
instructions a call executes, so this is the load-independent side of ``benchmarks/depthwise_int8.py``.

For every depthwise layer of MobileNetV2 and EfficientNet-Lite0 at 224x224 (random int8 data, as in the timing
benchmark) it counts the instructions of one call of ours (``depthwise_conv2d_int8_packed``, one thread) and of
LiteRT's XNNPACK kernels (``invoke``, one thread), Python call overhead included on both sides. Valgrind
emulates a CPU without AVX-512, so both sides run their AVX2 code here: numba compiles the kernel for
``haswell`` (cached beforehand, natively, so that valgrind does not run the compiler) and XNNPACK picks its AVX2
micro-kernels. A small C library made with gcc issues callgrind's client requests, so that only the timed
calls are counted.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The CPU valgrind shows a program (AVX2, no AVX-512), named so that numba's cache matches inside and outside.
HASWELL = dict(
    NUMBA_CPU_NAME="haswell",
    NUMBA_CPU_FEATURES="+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+cx8,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,"
    "+popcnt,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave",
    OMP_WAIT_POLICY="PASSIVE",
)
CONTROL_C = """
#include <valgrind/callgrind.h>
void incrinf_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void incrinf_stop(const char *label) { CALLGRIND_DUMP_STATS_AT(label); CALLGRIND_STOP_INSTRUMENTATION; }
"""


def _layers(model: str) -> list[dict]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from depthwise_int8 import depthwise_layers

    return [
        dict(name=lay.name, h=lay.height, w=lay.width, c=lay.channels, k=list(lay.kernel), s=list(lay.stride),
             m=lay.depth_multiplier)
        for lay in depthwise_layers(model)
    ]


def _prepare(spec: dict):
    """Packed layer, LiteRT XNNPACK runner and input for one layer spec (the timing benchmark's data)."""
    import numpy as np

    from incrinf.kernels import depthwise_int8 as dw
    from incrinf.kernels.quantize import per_channel_multipliers
    from incrinf.testing.tflite_oracle import TfliteRunner, build_depthwise_model

    rng = np.random.default_rng(0)
    c, oc = spec["c"], spec["c"] * spec["m"]
    x = rng.integers(-128, 128, (1, spec["h"], spec["w"], c), dtype=np.int8)
    w = rng.integers(-127, 128, (1, *spec["k"], oc), dtype=np.int8)
    bias = rng.integers(-5000, 5000, oc).astype(np.int32)
    w_scales = rng.uniform(1e-3, 1e-2, oc).astype(np.float32)
    mult, shift = per_channel_multipliers(0.02, w_scales, 0.05)
    packed = dw.pack_depthwise_int8(w, bias, input_offset=3, output_multiplier=mult, output_shift=shift)
    model = build_depthwise_model(
        w, bias, input_shape=x.shape, input_scale=0.02, input_zero_point=-3, weight_scales=w_scales,
        output_scale=0.05, output_zero_point=5, depth_multiplier=spec["m"], stride=tuple(spec["s"]), padding="same",
    )
    runner = TfliteRunner(model, reference=False, num_threads=1)
    runner.set_input(x)
    out = np.empty((1, -(-spec["h"] // spec["s"][0]), -(-spec["w"] // spec["s"][1]), oc), np.int8)

    def ours():
        dw.depthwise_conv2d_int8_packed(x, packed, stride=tuple(spec["s"]), padding="same", output_offset=5, out=out)

    return ours, runner.invoke


def _child(specs_path: str, control: str, passes: int) -> None:
    """Under callgrind: count ``passes`` calls per layer of ours, then of XNNPACK (one dump each)."""
    import numba

    numba.set_num_threads(1)
    lib = ctypes.CDLL(control)
    calls = [_prepare(spec) for spec in json.loads(Path(specs_path).read_text())]
    for index, label in enumerate(("ours", "xnnpack")):
        for pair in calls:
            pair[index]()  # warm up, uncounted
        lib.incrinf_start()
        for _ in range(passes):
            for pair in calls:
                pair[index]()
        lib.incrinf_stop(label.encode())


def _totals(directory: str) -> dict[str, int]:
    """``{label: instructions}`` from the callgrind dumps in ``directory``."""
    counts = {}
    for path in Path(directory).glob("callgrind.out.*"):
        text = path.read_text(errors="replace")
        trigger = re.search(r"^desc: Trigger: Client Request: (\S+)", text, re.MULTILINE)
        total = re.search(r"^(?:totals|summary): (\d+)", text, re.MULTILINE)
        if trigger and total:
            counts[trigger.group(1)] = int(total.group(1))
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mobilenet_v2,efficientnet_lite0")
    parser.add_argument("--passes", type=int, default=2, help="counted calls per layer and method")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child[0], args.child[1], args.passes)
        return
    for tool in ("valgrind", "gcc"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is needed (e.g. apt-get install valgrind gcc)")
    with tempfile.TemporaryDirectory() as work:
        control = os.path.join(work, "callgrind_control.so")
        source = os.path.join(work, "control.c")
        Path(source).write_text(CONTROL_C)
        subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", control, source], check=True)
        env = {**os.environ, **HASWELL, "NUMBA_CACHE_DIR": os.path.join(work, "numba"), "PYTHONPATH": str(ROOT)}
        for model in args.models.split(","):
            specs = os.path.join(work, f"{model}.json")
            Path(specs).write_text(json.dumps(_layers(model)))
            warm = [sys.executable, __file__, "--passes", "1", "--child", specs, control]
            subprocess.run(warm, env=env, check=True, capture_output=True)  # compile for haswell, natively
            dumps = os.path.join(work, model)
            os.makedirs(dumps)
            command = [
                "valgrind", "--tool=callgrind", "--instr-atstart=no", "--dump-instr=no",
                f"--callgrind-out-file={dumps}/callgrind.out.%p", sys.executable, __file__,
                "--passes", str(args.passes), "--child", specs, control,
            ]
            subprocess.run(command, env=env, check=True, capture_output=True)
            counts = _totals(dumps)
            n_layers = len(json.loads(Path(specs).read_text()))
            per_pass = {label: counts[label] / args.passes for label in ("ours", "xnnpack")}
            print(
                f"{model} ({n_layers} layers, one call each, 1 thread, AVX2 under valgrind): ours"
                f" {per_pass['ours'] / 1e6:.1f} M instructions, XNNPACK {per_pass['xnnpack'] / 1e6:.1f} M"
                f" (ours / XNNPACK {per_pass['ours'] / per_pass['xnnpack']:.2f}x)"
            )


if __name__ == "__main__":
    main()
