"""Int8 depthwise convolution: incrinf's tiled kernel vs LiteRT (reference, optimized, XNNPACK), and exactness.

Run: ``python benchmarks/depthwise_int8.py`` (a few minutes; ``--sweep 0`` skips the random sweep).

Speed: for every depthwise layer of MobileNetV2 (torchvision, random weights) and EfficientNet-Lite0 at a
224x224 input, batch 1, with random int8 data and per-channel quantization, it times at 1 and 2 threads
(median of ``--repeats`` calls; methods timed together take turns call by call, so load changes hit them
alike). ``ours`` and ``xnnpack`` are timed warm (with one thread they alternate, each with its data in cache, as
a layer's input is right after the layer before it wrote it; with more threads each runs alone, since both keep
pool threads spinning after a call) and, with one thread, cold (an 8 MB array is read before
every call, which evicts the data and the code path from the core's caches). ``REF`` and ``opt`` take turns in a pass of
their own with a fifth of the calls: they are slow anchors, and their 10-100x longer calls would evict the
others' caches. The methods:

- ``ours``: :func:`incrinf.kernels.depthwise_conv2d_int8_packed` (weights packed once per layer, as LiteRT
  does in ``allocate_tensors``; the per-call cost on a tiny layer is printed first);
- ``REF``: LiteRT ``BUILTIN_REF`` (TFLite's reference kernels, the bit-exact oracle; one thread whatever
  num_threads says);
- ``opt``: LiteRT's optimized builtin kernels without delegates (``BUILTIN_WITHOUT_DEFAULT_DELEGATES``);
- ``xnnpack``: LiteRT's default (``AUTO``: the XNNPACK delegate; float32 requantization, not bit-exact);
- ``ref-order`` (with ``--ref-order``): the same arithmetic as ours in TFLite's loop order, numba.

Next to the times it prints each layer's multiply-adds (noise-free work) and ours' time per output; with one
thread, also the median CPU time of the calling thread (``time.thread_time``), which leaves out the time the
OS gives to other processes on a shared machine. Per model, the speed-up of 2 threads over 1 comes from passes
where each method runs alone (both keep pool threads spinning after a call, and on two cores one's spinning
thread takes the core the other's worker needs): in wall time, and from noise-free counts (the calling thread's
CPU time and the share of the work units each of ours' threads computed; see :func:`print_thread_scaling`).
Before the tables it prints the pool's cost on a tiny layer (1 vs 2 threads). Every timed layer's output is
checked against ``REF`` at every thread count.

Exactness: all 16 EfficientNet-Lite0 depthwise layers with their real weights (BatchNorm folded, calibrated on
three photos) and ``--sweep`` random configurations (kernels 1-7, strides and dilations 1-3, depth
multipliers 1-3, SAME/VALID, fused activations, every multiplier regime, batch 1-3), each at every thread
count, against ``BUILTIN_REF``: the number of mismatching outputs is printed (it must be 0).

Ours runs its threads in its own pool (:mod:`incrinf.kernels.depthwise_pool`); the reference-order kernel is
a numba OpenMP loop whose threads wait passively (``OMP_WAIT_POLICY=PASSIVE`` unless set): on a shared machine
the default spin-then-sleep barrier makes a 2-thread call wait for a scheduler slice (~10 ms). Every layer uses
TFLite SAME padding (MobileNetV2's symmetric stride-2 padding differs by one pixel; the shapes and work are
the same).
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
from incrinf.kernels import depthwise_pool
from incrinf.kernels.depthwise_kernels import TILE
from incrinf.kernels.quantize import per_channel_multipliers
from incrinf.testing.depthwise_cases import make_problem, random_case
from incrinf.testing.quantized_layers import efficientnet_lite0_depthwise_layers, tflite_reference_output
from incrinf.testing.tflite_oracle import TfliteRunner, build_depthwise_model

MODELS = ("mobilenet_v2", "efficientnet_lite0")
LITERT = (("REF", True), ("opt", "builtin"), ("xnnpack", False))


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

    def out_hw(self) -> tuple[int, int]:
        """TFLite SAME output size."""
        return (-(-self.height // self.stride[0]), -(-self.width // self.stride[1]))

    def outputs(self) -> int:
        oh, ow = self.out_hw()
        return oh * ow * self.channels * self.depth_multiplier

    def macs(self) -> int:
        """Multiply-adds, every tap counted (the padding's taps included, as the kernels compute them)."""
        return self.outputs() * self.kernel[0] * self.kernel[1]


@dataclass
class Timing:
    layer: Layer
    # (method, threads) -> median seconds; methods "ours", "xnnpack", "ours cold", "xnnpack cold", "ours alone",
    # "REF", "opt"
    seconds: dict[tuple[str, int], float] = field(default_factory=dict)
    cpu: dict[tuple[str, int], float] = field(default_factory=dict)  # the same, CPU time of the calling thread
    # threads -> work units each thread of ours computed in the "ours alone" pass (index 0: the calling thread)
    units: dict[int, np.ndarray] = field(default_factory=dict)


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
                Layer(name, h, w, c, tuple(module.kernel_size), tuple(module.stride), module.out_channels // c)
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


def interleaved_medians(
    fns: dict[str, Callable[[], object]], repeats: int, before: Callable[[], object] | None = None
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Median wall seconds, CPU seconds of the calling thread and CPU seconds of the process per function,
    timing the functions in turn each round so load changes hit all alike; ``before`` (untimed) runs before
    every timed call.

    The calling thread's CPU time (``time.thread_time``) leaves out the time the OS gives to other processes,
    which on a shared machine is most of the noise; with one thread every method here computes in the calling
    thread, so it is their whole cost. The process's CPU time (``time.process_time``) adds the other threads':
    with several threads it is the work a call spreads over them.
    """
    for fn in fns.values():
        fn()  # warm up (and compile)
    samples: dict[str, tuple[list[float], list[float], list[float]]] = {name: ([], [], []) for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if before is not None:
                before()
            start, start_cpu, start_work = time.perf_counter(), time.thread_time(), time.process_time()
            fn()
            wall, cpu, work = samples[name]
            work.append(time.process_time() - start_work)
            cpu.append(time.thread_time() - start_cpu)
            wall.append(time.perf_counter() - start)
    return tuple(  # type: ignore[return-value]
        {name: statistics.median(s[i]) for name, s in samples.items()} for i in range(3)
    )


_EVICTION_BUFFER = np.ones(8 << 20, np.int8)  # larger than a core's L2 (2 MiB on recent Xeons)


def evict_caches() -> None:
    """Read 8 MiB, pushing the last call's data and code path out of the core's caches."""
    _EVICTION_BUFFER.sum()


def time_layer(layer: Layer, repeats: int, threads: tuple[int, ...], ref_order: bool, seed: int = 0) -> Timing:
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

    def reference_order():
        return dw.depthwise_conv2d_int8_reference_order(x, packed, output_offset=out_zp, **geometry)

    timing = Timing(layer)
    for t in threads:
        numba.set_num_threads(t)
        runners = {method: TfliteRunner(model, reference=kind, num_threads=t) for method, kind in LITERT}
        for runner in runners.values():
            runner.set_input(x)
        versus = {"ours": ours, "xnnpack": runners["xnnpack"].invoke}
        passes = [
            # Turn by turn with one thread. With more, each runs alone: both keep their worker threads spinning
            # for a while after a call, and on two cores one's spinning worker takes the core the other's needs.
            *([(versus, repeats, None, "")] if t == 1 else []),
            ({"ours": ours}, repeats, None, " alone"),
            ({"xnnpack": runners["xnnpack"].invoke}, repeats, None, " alone"),
            # Cold, one thread only: a second thread sleeping while the eviction runs would be timed waking up.
            *([(versus, repeats, evict_caches, " cold")] if t == 1 else []),
            (
                {"REF": runners["REF"].invoke, "opt": runners["opt"].invoke}
                | ({"ref-order": reference_order} if ref_order else {}),
                max(3, repeats // 5),
                None,
                "",
            ),
        ]
        pool = depthwise_pool.get_pool(numba.config.NUMBA_NUM_THREADS)
        for fns, n, before, suffix in passes:
            units_before = pool.units_done()
            wall, cpu, _work = interleaved_medians(fns, n, before)
            if suffix == " alone" and "ours" in fns:
                after = pool.units_done()
                timing.units[t] = after - np.pad(units_before, (0, after.size - units_before.size))
            for method in fns:
                timing.seconds[method + suffix, t] = wall[method]
                timing.cpu[method + suffix, t] = cpu[method]
        mismatches = int((runners["REF"].output() != ours()).sum())
        if mismatches:
            raise AssertionError(f"{layer.name}, {t} threads: {mismatches} mismatches against BUILTIN_REF")
    return timing


def call_overhead_us(repeats: int) -> tuple[float, float]:
    """Microseconds per call on a tiny layer (1x4x4x32, 3x3): packed call, and functional minus packed."""
    x = np.zeros((1, 4, 4, 32), np.int8)
    w = np.zeros((1, 3, 3, 32), np.int8)
    args = dict(output_multiplier=2**30, output_shift=0)
    packed = dw.pack_depthwise_int8(w, None, input_offset=0, **args)
    medians, _, _ = interleaved_medians(
        {
            "functional": lambda: dw.depthwise_conv2d_int8(x, w, None, input_offset=0, output_offset=0, **args),
            "packed": lambda: dw.depthwise_conv2d_int8_packed(x, packed, output_offset=0),
        },
        repeats * 20,
    )
    return medians["packed"] * 1e6, (medians["functional"] - medians["packed"]) * 1e6


def load() -> str:
    return "load average " + " / ".join(f"{v:.2f}" for v in os.getloadavg()) + " (1 / 5 / 15 min)"


def print_machine() -> None:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from importlib.metadata import version

    import llvmlite.binding as llvm

    flags = [f for f in ("avx2", "avx512f", "avx512bw", "avx512vnni") if llvm.get_host_cpu_features().get(f)]
    print(f"platform : {platform.platform()} ({platform.machine()})")
    print(f"cpu      : {cpu} ({llvm.get_host_cpu_name()}: {', '.join(flags)}), {os.cpu_count()} logical cpus")
    print(f"load     : {load()}")
    print(f"threads  : OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, numba max {numba.config.NUMBA_NUM_THREADS}")
    print(
        f"python   : {sys.version.split()[0]}, numpy {np.__version__}, numba {numba.__version__}"
        f" (threading layer {numba.threading_layer()}), ai-edge-litert {version('ai-edge-litert')}"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def print_table(model: str, timings: list[Timing], threads: int, anchors: list[str]) -> None:
    """One row per layer and a total: warm and cold times of ours and XNNPACK, the anchors, and ratios."""
    cpu = threads == 1  # with one thread, the calling thread's CPU time is each method's whole cost
    alone = ", ours and xnnpack each timed alone" if threads > 1 else ""
    print(f"\n### {model}, {threads} thread{'s' if threads > 1 else ''} (median ms{alone})")
    header = (
        "| layer | HxWxC k s | MMAC | ours | xnnpack | ours/xnnpack | "
        + ("ours cold | xnnpack cold | ours/xnnpack cold | " if cpu else "")
        + " | ".join(anchors)
        + " | "
        + " | ".join(f"{m}/ours" for m in anchors)
        + " | ours ns/output |"
        + (" CPU ours | CPU xnnpack | CPU ours/xnnpack |" if cpu else " ours: units by other threads |")
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    columns = ["ours", "xnnpack", *(["ours cold", "xnnpack cold"] if cpu else []), *anchors]
    totals = dict.fromkeys(columns, 0.0)
    cpu_totals = {"ours": 0.0, "xnnpack": 0.0}
    macs = outputs = 0
    unit_totals = np.zeros(threads)

    def row(
        name: str, shape: str, mmac: float, sec: dict[str, float], n_out: int, cpu_sec: dict[str, float],
        units: np.ndarray,
    ) -> str:
        cells = [_ms(sec["ours"]), _ms(sec["xnnpack"]), f"{sec['ours'] / sec['xnnpack']:.2f}x"]
        if cpu:
            cells += [_ms(sec["ours cold"]), _ms(sec["xnnpack cold"]), f"{sec['ours cold'] / sec['xnnpack cold']:.2f}x"]
        cells += [
            *(_ms(sec[m]) for m in anchors),
            *(f"{sec[m] / sec['ours']:.1f}x" for m in anchors),
            f"{sec['ours'] / n_out * 1e9:.2f}",
        ]
        if cpu:
            cells += [_ms(cpu_sec["ours"]), _ms(cpu_sec["xnnpack"]), f"{cpu_sec['ours'] / cpu_sec['xnnpack']:.2f}x"]
        else:  # the share of the work units that the pool's workers computed in the "ours alone" pass
            cells.append(f"{units[1:].sum() / max(units.sum(), 1):.0%}")
        return f"| {name} | {shape} | {mmac:.2f} | " + " | ".join(cells) + " |"

    for t in timings:
        # several threads: ours and XNNPACK from the passes where each ran alone (see time_layer)
        sec = {m: t.seconds[m + (" alone" if threads > 1 and m in ("ours", "xnnpack") else ""), threads]
               for m in columns}
        cpu_sec = {m: t.cpu[m + ("" if cpu else " alone"), threads] for m in cpu_totals}
        for m in columns:
            totals[m] += sec[m]
        for m in cpu_totals:
            cpu_totals[m] += cpu_sec[m]
        lay = t.layer
        macs += lay.macs()
        outputs += lay.outputs()
        shape = f"{lay.height}x{lay.width}x{lay.channels} {lay.kernel[0]}x{lay.kernel[1]} s{lay.stride[0]}"
        units = t.units.get(threads, np.zeros(1, np.int64))[:threads].astype(float)
        unit_totals[: units.size] += units
        print(row(lay.name, shape, lay.macs() / 1e6, sec, lay.outputs(), cpu_sec, units))
    print(row("**total**", f"{len(timings)} layers", macs / 1e6, totals, outputs, cpu_totals, unit_totals))


def planned_share(layer: Layer, threads: int) -> float:
    """The busiest thread's share of a layer's work units when every thread computes at the same speed.

    From the plan alone (noise-free): the layer's units (output rows x channel tiles, equal multiply-adds) and
    the pool's claims (:func:`incrinf.kernels.depthwise_pool.planned_units`: each thread claims again as soon as
    its last claim is done).
    """
    if threads == 1:
        return 1.0
    units, macs_per_unit = layer_units(layer)
    return max(depthwise_pool.planned_units(units, macs_per_unit, threads)) / units


def layer_units(layer: Layer) -> tuple[int, int]:
    """The layer's work units (output rows x channel tiles) and multiply-adds per unit, as the kernel plans them."""
    oh, ow = layer.out_hw()
    return oh * layer.depth_multiplier * -(-layer.channels // TILE), ow * TILE * layer.kernel[0] * layer.kernel[1]


def print_plan(model: str, timings: list[Timing], threads: tuple[int, ...]) -> None:
    """Noise-free: how the pool plans each layer's work at every thread count above one (unit sizes, layers
    shared, claims per call and their sizes, units per thread), from the plan's counts alone."""
    for t in threads:
        if t < 2:
            continue
        per_unit, claims, smallest, shared = [], [], [], 0
        done = np.zeros(t)
        for x in timings:
            units, macs_per_unit = layer_units(x.layer)
            plan = depthwise_pool.planned_claims(units, macs_per_unit, t)
            per_unit.append(macs_per_unit)
            shared += len(plan) > 1
            claims.append(len(plan))
            smallest.append(min(size for _, size in plan) * macs_per_unit)
            for thread, size in plan:
                done[thread] += size * macs_per_unit
        print(
            f"{model} plan at {t} threads: work units of {min(per_unit):,}-{max(per_unit):,} multiply-adds;"
            f" {shared}/{len(timings)} layers shared; {min(claims)}-{max(claims)} claims per call, the smallest"
            f" {min(smallest):,}-{max(smallest):,} multiply-adds; multiply-adds per thread "
            + " / ".join(f"{share:.1%}" for share in done / done.sum())
        )


def print_thread_scaling(model: str, timings: list[Timing], threads: tuple[int, ...]) -> None:
    """Speed-up of more threads over the first thread count, in wall time and from noise-free counts.

    Wall: the sums of the "alone" medians (each method timed without the other's spinning pool threads). On a
    shared machine with more runnable threads than cores a call's second thread waits for a core and the wall
    time says little, so for ours next to it:

    - the speed-up the slicing allows on idle cores: one thread's CPU time (``time.thread_time``, which leaves
      out the time the OS gives to other processes) over the same times the busiest thread's planned share of
      the units (:func:`planned_share`);
    - the share of the units each thread computed in this run (the pool's counters): how often the worker got a
      core while a call ran;
    - the calling thread's CPU time at ``t`` threads over one thread's CPU time times the calling thread's
      measured share: what starting the job, claiming units and waiting for the workers' last claims cost it
      (1.00x: nothing).
    """
    if len(threads) < 2:
        return
    base = threads[0]
    for method in ("ours", "xnnpack"):
        key = method + " alone"
        total = {t: sum(x.seconds[key, t] for x in timings) for t in threads}
        caller = {t: sum(x.cpu[key, t] for x in timings) for t in threads}
        parts = [f"{t} threads {total[base] / total[t]:.2f}x wall (alone: {_ms(total[base])} -> {_ms(total[t])} ms)"
                 for t in threads[1:]]
        if method == "ours":
            for t in threads[1:]:
                bound = sum(x.cpu[key, base] * planned_share(x.layer, t) for x in timings)
                units = np.zeros(t)
                own_work = 0.0
                for x in timings:
                    done = x.units.get(t, np.zeros(1, np.int64))[:t].astype(float)
                    units[: done.size] += done
                    own_work += x.cpu[key, base] * (done[0] / done.sum() if done.sum() else 1.0)
                shares = units / max(units.sum(), 1)
                parts.append(
                    f"{caller[base] / bound:.2f}x on idle cores (planned split); work units per thread in this run "
                    + " / ".join(f"{share:.0%}" for share in shares)
                    + f"; calling thread's CPU {_ms(caller[base])} -> {_ms(caller[t])} ms,"
                    f" {caller[t] / own_work:.2f}x one thread's CPU time for its share of the units"
                )
        print(f"{model}: {method} speed-up over {base} thread: " + "; ".join(parts))


def pool_overhead_us(repeats: int) -> tuple[float, float, float]:
    """Microseconds per call of a 1x8x8x64 3x3 layer (16 work units, about 2 us of work) at 1 thread, at 2
    threads through the pool (every layer to the pool for this measurement), and the calling thread's CPU
    time at 2 threads: the pool's start and synchronization cost when a worker is spinning."""
    rng = np.random.default_rng(0)
    x = rng.integers(-128, 128, (1, 8, 8, 64), dtype=np.int8)
    w = rng.integers(-127, 128, (1, 3, 3, 64), dtype=np.int8)
    packed = dw.pack_depthwise_int8(w, None, input_offset=0, output_multiplier=2**30, output_shift=-8)
    previous = depthwise_pool.MIN_SPLIT_MACS, depthwise_pool.MIN_CLAIM_MACS
    depthwise_pool.MIN_SPLIT_MACS = depthwise_pool.MIN_CLAIM_MACS = 1  # before the first call: plans keep them
    try:
        out = dw.depthwise_conv2d_int8_packed(x, packed, padding="same", output_offset=0)
        wall, cpu, _ = interleaved_medians(
            {
                t: (lambda t=t: dw.depthwise_conv2d_int8_packed(x, packed, padding="same", output_offset=0,
                                                                 threads=t, out=out))
                for t in (1, 2)
            },
            repeats * 20,
        )
    finally:
        depthwise_pool.MIN_SPLIT_MACS, depthwise_pool.MIN_CLAIM_MACS = previous
    return wall[1] * 1e6, wall[2] * 1e6, cpu[2] * 1e6


def check_real_weights(threads: tuple[int, ...]) -> None:
    """EfficientNet-Lite0's 16 depthwise layers, real weights and activations, at every thread count."""
    total = mismatches = 0
    for layer in efficientnet_lite0_depthwise_layers():
        q = layer.module
        x_q = q.quantize_input(layer.x).numpy()
        expected = tflite_reference_output(q, x_q)
        for t in threads:
            mismatches += int((q.forward_int8(x_q, threads=t) != expected).sum())
            total += expected.size
    print(
        f"real weights: EfficientNet-Lite0's 16 depthwise layers, 3 photos, threads {threads}:"
        f" {mismatches} mismatches of {total:,} outputs against BUILTIN_REF"
    )


def sweep(n_cases: int, threads: tuple[int, ...], seed: int = 1) -> None:
    """``n_cases`` random configurations against BUILTIN_REF, each at every thread count."""
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    total = mismatches = failed = 0
    for _ in range(n_cases):
        problem = make_problem(random_case(rng))
        expected = problem.tflite()
        kwargs = problem.kernel_kwargs()
        case_bad = 0
        for t in threads:
            got = dw.depthwise_conv2d_int8(problem.x, problem.w, problem.bias, threads=t, **kwargs)
            case_bad += int((got != expected).sum())
            total += expected.size
        mismatches += case_bad
        if case_bad:
            failed += 1
            print(f"  MISMATCH: {problem.case}")
    print(
        f"random sweep: {n_cases:,} configurations (seed {seed}), threads {threads}: {mismatches} mismatches"
        f" of {total:,} outputs ({failed} configurations with any), {time.perf_counter() - start:.0f} s"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50, help="timed calls per measurement (median)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {MODELS}")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--sweep", type=int, default=5000, help="random configurations checked against REF")
    parser.add_argument("--ref-order", action="store_true", help="also time TFLite's loop order (numba)")
    args = parser.parse_args(argv)
    threads = tuple(int(t) for t in args.threads.split(","))
    packed_us, extra_us = call_overhead_us(args.repeats)  # also compiles and starts numba's threading layer
    print_machine()
    print(f"per-call cost on a tiny layer: packed {packed_us:.1f} us; the functional API adds {extra_us:.1f} us")
    if numba.config.NUMBA_NUM_THREADS >= 2:
        one_us, two_us, two_cpu_us = pool_overhead_us(args.repeats)
        print(
            f"thread pool on a 1x8x8x64 3x3 layer: 1 thread {one_us:.1f} us, 2 threads {two_us:.1f} us wall"
            f" ({two_cpu_us:.1f} us CPU of the calling thread); the pool shares only layers of at least"
            f" {depthwise_pool.MIN_SPLIT_MACS:,} multiply-adds, in claims of at least {depthwise_pool.MIN_CLAIM_MACS:,}"
        )
    anchors = ["REF", "opt", *(["ref-order"] if args.ref_order else [])]
    for model in args.models.split(","):
        timings = [time_layer(layer, args.repeats, threads, args.ref_order) for layer in depthwise_layers(model)]
        for t in threads:
            print_table(model, timings, t, anchors)
        print_thread_scaling(model, timings, threads)
        print_plan(model, timings, threads)
        print(f"({load()}; every output equal to BUILTIN_REF's at every thread count)")
    all_threads = tuple(range(1, numba.config.NUMBA_NUM_THREADS + 1))
    print()
    check_real_weights(all_threads)
    if args.sweep:
        sweep(args.sweep, all_threads)
    print(load())


if __name__ == "__main__":
    main()
