"""What bounds exact occlusion's speedup over channels-last re-inference as a share of the theoretical ratio.

``obe_exact.py``'s ``CL/theory`` divides the measured speedup by the theoretical multiply-add ratio. That ratio counts
every convolution's multiply-adds by its formula (output positions x kernel taps x channels), but neither side
runs exactly that:

- plain re-inference runs each convolution on whole maps with its padding, and oneDNN skips the kernel taps
  that fall on the padding (on a 14x14 map a 3x3 convolution computes 0.907 of its formula's multiply-adds, on
  7x7 0.819);
- incrinf runs the plan's batches (every position of a batch on the batch's largest boxes: the plan's
  multiply-adds), on read-in windows whose padding is real zeros it multiplies (only steps whose box covers the
  whole map run with the operator's own padding and skip those taps), plus one forward pass of the unchanged
  input (the base) that the theoretical ratio leaves out.

So at the same speed per multiply-add actually executed, with no other cost (gathers, Python), the speedup over
re-inference is at most ``ceiling`` x the theoretical ratio. This script prints those counts (no timing: the
counts are exact) and, with ``--layers``, the speed of each convolution in the calling thread's CPU seconds (one
thread; incrinf's box convolutions against the same layer's whole-map convolution in channels-last re-inference
with folded batch norms, per multiply-add executed), with the thread-CPU shares of gathers and of the base.

Run: python benchmarks/obe_ceiling.py [--models resnet18 vgg16 ...] [--patch 16] [--stride 16] [--batch 16]
     [--layers] [--repeats 2]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import defaultdict

import numpy as np
import torch
from _common import folded, machine, median
from obe_exact import channels_last_full

from incrinf import models
from incrinf.analysis import occlusion_grid
from incrinf.engine.plans import Plan
from incrinf.engine.program import Program
from incrinf.engine.stores import BaseStore
from incrinf.explain.runner import OcclusionRunner
from incrinf.geometry import input_boxes
from incrinf.graph import Graph, Operator


def executed_share(graph: Graph, name: str) -> float:
    """The share of a convolution node's formula multiply-adds that run on its whole map with its own padding:
    the kernel taps inside the input (oneDNN skips the rest), 1 for other nodes."""
    node = graph.by_name[name]
    g = node.geometry
    if node.operator != Operator.CONV or g is None:
        return 1.0
    inside = formula = 1
    for n_in, n_out, kernel, stride, before, dilation in zip(graph.by_name[node.inputs[0]].shape[2:],
                                                             node.shape[2:], g.kernel, g.stride, g.pad_before,
                                                             g.dilation):
        taps = (kernel - 1) // dilation + 1
        inside *= sum(0 <= o * stride - before + t * dilation < n_in for o in range(n_out) for t in range(taps))
        formula *= n_out * taps
    return inside / formula


def counts(graph: Graph, program: Program, plan: Plan) -> dict:
    """Multiply-adds by formula and executed, for re-inference of every position and for incrinf's plan."""
    share = {node.name: executed_share(graph, node.name) for node in graph.nodes}
    full = float(sum(node.flops for node in graph.nodes))
    full_run = float(sum(node.flops * share[node.name] for node in graph.nodes))
    positions = plan.queries
    ours = plan.macs
    for batch in plan.batches:
        for sp in batch.steps:
            step = program.steps[sp.index]
            if sp.dense and step.whole_op is not None:  # the operator pads the whole map itself
                ours -= sp.macs * (1.0 - share[step.head.name])
    theory = plan.theoretical_speedup
    return dict(positions=positions, theory=theory, plan=positions * full / plan.macs / theory,
                reinf_share=full_run / full, ours_share=ours / plan.macs,
                ceiling=positions * full_run / ours / theory,
                with_base=positions * full_run / (ours + full_run) / theory)


class LayerClock:
    """Thread-CPU seconds and executed multiply-adds of each window step of a program (its operator wrapped while
    the clock is on), and of the store's gathers."""

    def __init__(self, graph: Graph, program: Program) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.macs: dict[str, float] = defaultdict(float)
        self.shape: dict[str, tuple] = {}
        self._graph, self._program = graph, program
        self._saved: list = []

    def _wrap(self, step, fn, dense: bool):
        name, share = step.head.name, executed_share(self._graph, step.head.name) if dense else 1.0

        def timed(x: torch.Tensor) -> torch.Tensor:
            start = time.thread_time()
            out = fn(x)
            self.seconds[name] += time.thread_time() - start
            self.macs[name] += step.flops * math.prod(out.shape[2:]) / step.positions * out.shape[0] * share
            self.shape[name] = tuple(x.shape)
            return out
        return timed

    def __enter__(self) -> LayerClock:
        for step in self._program.steps:
            if step.window is not None:
                self._saved.append((step, step.op, step.whole_op))
                step.op = self._wrap(step, step.op, False)
                if step.whole_op is not None:
                    step.whole_op = self._wrap(step, step.whole_op, True)
        gather = BaseStore.gather

        def timed_gather(*args, **kwargs):
            start = time.thread_time()
            out = gather(*args, **kwargs)
            self.seconds["(gathers)"] += time.thread_time() - start
            return out
        self._saved.append((BaseStore, "gather", gather))
        BaseStore.gather = timed_gather
        return self

    def __exit__(self, *exc) -> None:
        for owner, first, second in self._saved:
            if owner is BaseStore:
                BaseStore.gather = second
            else:
                owner.op, owner.whole_op = first, second


def whole_map_clock(model: torch.nn.Module, graph: Graph) -> tuple[dict, dict]:
    """Forward hooks on ``model``'s convolutions: thread-CPU seconds and executed multiply-adds by graph node name
    (torch.fx names a module ``a.b`` node ``a_b``)."""
    seconds: dict[str, float] = defaultdict(float)
    macs: dict[str, float] = defaultdict(float)
    for qualified, module in model.named_modules():
        name = qualified.replace(".", "_")
        if not isinstance(module, torch.nn.modules.conv._ConvNd) or name not in graph.by_name:
            continue
        share = executed_share(graph, name)

        def pre(mod, inputs, name=name):
            seconds[name] -= time.thread_time()

        def post(mod, inputs, out, name=name, share=share):
            seconds[name] += time.thread_time()
            macs[name] += out.numel() * mod.weight[0].numel() * share
        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
    return seconds, macs


def layers(name: str, runner: OcclusionRunner, positions: np.ndarray, patch: int, stride: int, batch: int,
           repeats: int) -> None:
    """Per-layer thread-CPU table: incrinf's box convolutions against re-inference's whole maps."""
    image = runner.image
    base = folded(models.load(name)).to(memory_format=torch.channels_last)
    channels_last_full(base, image, patch, stride, batch, 0)  # warm-up
    clock = LayerClock(runner.graph, runner.engine.program)
    b_seconds, b_macs = whole_map_clock(base, runner.graph)
    ours, theirs, build = [], [], []
    window = (patch,) * (image.dim() - 2)
    for _ in range(repeats):  # alternating
        start = time.thread_time()
        channels_last_full(base, image, patch, stride, batch, 0)
        theirs.append(time.thread_time() - start)
        with clock:
            start = time.thread_time()
            fresh = OcclusionRunner(runner.graph, image)  # the base is materialized once per input
            build.append(time.thread_time() - start)
            fresh.run(positions, window, batch_size=batch)
            ours.append(time.thread_time() - start)
    k = repeats
    conv = sum(v for n, v in clock.seconds.items() if n in b_seconds) / k
    print(f"  thread CPU per run (median of {repeats}): re-inference {median(theirs):.3f} s, "
          f"incrinf {median(ours):.3f} s"
          f" (convolutions {conv:.3f} s, gathers {clock.seconds['(gathers)'] / k:.3f} s, base and store "
          f"{median(build):.3f} s); load {os.getloadavg()[0]:.1f}")
    print(f"  {'layer':<24} {'last box read (N, C, *read)':<28} {'G MAC':>7} {'s':>7} {'GMAC/s':>7} "
          f"{'whole-map GMAC/s':>16} {'ratio':>6} {'lost s':>7}")
    for node in runner.graph.nodes:
        n = node.name
        if n not in b_seconds or n not in clock.seconds:
            continue
        mine = clock.macs[n] / clock.seconds[n]
        whole = b_macs[n] / b_seconds[n]
        print(f"  {n:<24} {str(clock.shape[n]):<28} {clock.macs[n] / k / 1e9:>7.2f} {clock.seconds[n] / k:>7.3f} "
              f"{mine / 1e9:>7.1f} {whole / 1e9:>16.1f} {mine / whole:>6.2f} "
              f"{(clock.seconds[n] - clock.macs[n] / whole) / k:>+7.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["resnet18", "vgg16", "efficientnet_lite0", "mobilenet_v2"])
    parser.add_argument("--patch", type=int, default=16)
    parser.add_argument("--stride", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--layers", action="store_true", help="also time each convolution (one thread)")
    parser.add_argument("--repeats", type=int, default=2, help="alternating timed runs with --layers")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    print(f"machine: {machine()}")
    print(f"exact OBE, patch {args.patch}, stride {args.stride}, batch {args.batch}\n")
    print("plan: the theory's multiply-adds over the plan's; reinf / ours: multiply-adds executed over the formula's\n"
          "(re-inference on whole maps / incrinf's batches); ceiling: speedup over re-inference at equal speed per\n"
          "executed multiply-add and no other cost, over the theoretical ratio; +base: with the base's forward pass\n")
    print(f"{'model':<20} {'pos':>5} {'theory':>7} {'plan':>6} {'reinf':>6} {'ours':>6} {'ceiling':>8} {'+base':>6}")
    for name in args.models:
        model = models.load(name)
        size = models.info(name).input_size
        image = models.preprocess(models.sample_image(), name, size)[None]
        runner = OcclusionRunner(model, image)
        dims = tuple(image.shape[2:])
        window = (args.patch,) * len(dims)
        positions = occlusion_grid(dims, window, (args.stride,) * len(dims))
        boxes = input_boxes(positions, window, dims)
        plan, _, _ = runner.plan(boxes.start(), boxes.sizes(), args.batch, None)
        c = counts(runner.graph, runner.engine.program, plan)
        print(f"{name:<20} {c['positions']:>5} {c['theory']:>6.2f}x {c['plan']:>6.3f} {c['reinf_share']:>6.3f} "
              f"{c['ours_share']:>6.3f} {c['ceiling']:>8.3f} {c['with_base']:>6.3f}", flush=True)
        if args.layers:
            runner.run(positions, window, batch_size=args.batch)  # warm-up
            layers(name, runner, positions, args.patch, args.stride, args.batch, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
