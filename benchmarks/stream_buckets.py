"""Still-camera frames: the box bucket step (``FrameEngine.box_quantum``) chosen by leave-one-out over clips.

Run: ``python benchmarks/stream_buckets.py [--clips hall,yard,walkers,carphone] [--frames 24] [--steps 1,2,4,8,16]``.

A box's sides are rounded up to multiples of the step, so crop shapes recur from frame to frame and the kernels
built for them (oneDNN builds one per new shape) are reused; a larger step computes more positions (exactly: the
output does not change). Per clip, a default :class:`~incrinf.stream.StreamSession` runs the clip once and its
still-camera frames are recorded (frame, change mask, the clusters' boxes, feature threshold); then one
:class:`~incrinf.engine.FrameEngine` per candidate step, each profiled after its full first frame, replays those
frames, the candidates in lockstep (frame by frame, the order rotated per frame, so a load change on the shared
machine falls on all alike), two passes. Printed per step: plan + cached engine time per frame (median, mean) and
the multiply-add ratio of the frames (full frame's over the cached frames' on average), the noise-free side.

Leave-one-out: for each clip, the step with the best geometric mean of (time / that clip's best time) on the
*other* clips, and how it does on the held-out clip; the default is the step chosen on all clips.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    from incrinf import models
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from incrinf import models
from incrinf.engine import FrameEngine
from incrinf.engine.frame_regions import RegionPlan
from incrinf.graph import capture
from incrinf.stream import camera
from incrinf.stream.session import StreamSession
from incrinf.testing.clips import load_clip

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine  # noqa: E402

PASSES = 2


def record(model: torch.nn.Module, clip, mean, std) -> tuple[torch.Tensor, list]:
    """A default session over the clip; its first model input and every box-walk frame's (input, mask, boxes,
    feature threshold)."""
    session = StreamSession(model, mean=mean, std=std)
    frames = []
    original = camera.CameraEngine.cached

    def cached(self, x, changed, matrix, plan=None):
        out = original(self, x, changed, matrix, plan)
        if isinstance(plan, RegionPlan):
            frames.append((x.clone(), changed.copy(), list(plan.start), self.feature_threshold))
        return out

    camera.CameraEngine.cached = cached
    try:
        for frame in clip.frames:
            session(frame)
    finally:
        camera.CameraEngine.cached = original
    return session.inputs(clip.frames[0])[0], frames


def replay(model: torch.nn.Module, x0: torch.Tensor, frames: list, steps: list[int]
           ) -> tuple[dict[int, list[float]], dict[int, list[float]], float]:
    """Per step: seconds (plan + cached engine) and computed / full multiply-adds of every replayed frame; and the
    seconds of one full frame."""
    graph = capture(model, tuple(x0.shape[1:]))
    engines = {}
    for q in steps:
        engine = FrameEngine(graph)
        engine.box_quantum = q
        engine.full(x0)
        engine.profile()
        engines[q] = engine
    seconds = {q: [] for q in steps}
    shares = {q: [] for q in steps}
    for _ in range(PASSES):
        for engine in engines.values():
            engine.full(x0)
        for i, (x, changed, boxes, threshold) in enumerate(frames):
            for q in steps[i % len(steps):] + steps[:i % len(steps)]:
                engine = engines[q]
                clock = time.perf_counter()
                engine.cached(x, changed, plan=engine.plan_boxes(boxes), feature_threshold=threshold)
                seconds[q].append(time.perf_counter() - clock)
                shares[q].append(engine.last.flops / engine.last.full_flops)
    clock = time.perf_counter()
    engines[steps[0]].full(x0)
    return seconds, shares, time.perf_counter() - clock


def choose(results: dict[str, dict[int, float]], clips: list[str], steps: list[int]) -> int:
    return min(steps, key=lambda q: sum(math.log(results[c][q] / min(results[c].values())) for c in clips))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", default="hall,yard,walkers,carphone", help="comma-separated clip names")
    parser.add_argument("--frames", type=int, default=24, help="frames per clip")
    parser.add_argument("--steps", default="1,2,4,8,16", help="candidate bucket steps")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps = [int(s) for s in args.steps.split(",")]
    model = models.load("efficientnet_lite0")
    meta = models.info("efficientnet_lite0")
    print(machine())
    print(f"EfficientNet-Lite0 (ImageNet weights), {args.frames} frames per clip, steps {steps}, {PASSES} passes; "
          f"load {os.getloadavg()[0]:.1f}")
    results: dict[str, dict[int, float]] = {}
    for name in args.clips.split(","):
        clip = load_clip(name, args.frames)
        x0, frames = record(model, clip, meta.mean, meta.std)
        if not frames:
            print(f"\n{name}: no still-camera frame ran cached (the bucket step does not apply)")
            continue
        seconds, shares, full = replay(model, x0, frames, steps)
        results[name] = {q: statistics.median(seconds[q]) for q in steps}
        print(f"\n{name}: {len(frames)} still-camera frames x {PASSES} passes; one full frame {full * 1e3:.1f} ms; "
              f"load {os.getloadavg()[0]:.1f}")
        print("| step | plan + engine ms (median / mean) | multiply-add ratio |")
        print("| --- | --- | --- |")
        for q in steps:
            print(f"| {q} | {statistics.median(seconds[q]) * 1e3:.1f} / {statistics.mean(seconds[q]) * 1e3:.1f} | "
                  f"{1 / statistics.mean(shares[q]):.1f} |")
    print("\n| held-out clip | step chosen on the others | its median ms there | best step there (median ms) |")
    print("| --- | --- | --- | --- |")
    for name in results:
        q = choose(results, [c for c in results if c != name], steps)
        best = min(results[name], key=results[name].get)
        print(f"| {name} | {q} | {results[name][q] * 1e3:.1f} | {best} ({results[name][best] * 1e3:.1f}) |")
    if results:
        print(f"\nchosen on all clips: {choose(results, list(results), steps)}; load at the end "
              f"{os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
