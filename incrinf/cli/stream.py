"""``incrinf stream VIDEO``: run a model on a video with :class:`StreamSession`, side by side with full inference."""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

from incrinf.cli.common import model_name, non_negative, non_negative_int, positive_int
from incrinf.stream.config import StreamConfig

_DEFAULTS = StreamConfig()

_CSV_FIELDS = ("index", "mode", "reason", "homography_found", "recompute_fraction", "flops_ratio", "seconds",
               "audit", "agreement", "predicted_full", "predicted_cached", "guard_level", "full_seconds", "top1",
               "full_top1", "relative_error")


def _size(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HxW, e.g. 144x176, got {text!r}") from None
    if h < 8 or w < 8:
        raise argparse.ArgumentTypeError(f"size must be at least 8x8, got {text!r}")
    return h, w


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``stream`` subcommand to an ``argparse`` subparsers object."""
    p = subparsers.add_parser("stream", help="run a CNN on a video, reusing computation across frames (CacheInf)",
                              description="Run a model on a video with StreamSession and, side by side, plain full "
                                          "inference; print the median speedup and the top-1 agreement.")
    p.add_argument("video", nargs="?", help="video file (default: the bundled carphone_pristine.mp4)")
    p.add_argument("--model", type=model_name, default="efficientnet_lite0",
                   help="zoo model (default: efficientnet_lite0; an unknown name lists the models)")
    p.add_argument("--weights", help="state-dict file for a torchvision architecture")
    p.add_argument("--pixel-threshold", type=non_negative, default=_DEFAULTS.pixel_threshold,
                   help="change-mask threshold: mean absolute difference per cell in 0-255 pixel levels (default "
                        f"{_DEFAULTS.pixel_threshold:g})")
    p.add_argument("--cell", type=positive_int, default=_DEFAULTS.cell,
                   help=f"change-mask cell side in pixels (default {_DEFAULTS.cell})")
    p.add_argument("--max-ratio", type=float, default=_DEFAULTS.max_ratio,
                   help=f"changed fraction above which a frame runs full (default {_DEFAULTS.max_ratio:g})")
    p.add_argument("--keyframe-interval", type=int, default=_DEFAULTS.keyframe_interval,
                   help=f"full inference every N frames (0: never; default {_DEFAULTS.keyframe_interval})")
    p.add_argument("--feature-threshold", type=non_negative, default=None,
                   help="drop recomputed positions whose features moved less than this share of the tensor's mean "
                        f"magnitude (default {_DEFAULTS.still_feature_threshold:g} on still-camera frames, 0 under "
                        "camera motion; 0: exact propagation)")
    p.add_argument("--target-agreement", type=_fraction, default=_DEFAULTS.target_agreement,
                   help="top-1 (classifier) or per-pixel (dense output) agreement with full inference that the quality "
                        f"guard holds (default {_DEFAULTS.target_agreement:g})")
    p.add_argument("--target-error", type=non_negative, default=None,
                   help="also hold the relative output error of audited frames below this (default: off)")
    p.add_argument("--audit-interval", type=positive_int, default=_DEFAULTS.audit_interval,
                   help=f"shortest interval between audit frames (default {_DEFAULTS.audit_interval}; the longest is "
                        "--keyframe-interval)")
    p.add_argument("--no-speed-guard", action="store_true",
                   help="always try the cache (no choice of cached or full from measured costs)")
    p.add_argument("--no-quality-guard", action="store_true",
                   help="fixed thresholds, a keyframe every --keyframe-interval frames, no audits")
    p.add_argument("--sample-seed", type=non_negative_int, default=_DEFAULTS.sample_seed,
                   help="seed of the sampled audits' tile draws: the same seed and video give the same run (default "
                        f"{_DEFAULTS.sample_seed})")
    p.add_argument("--opencv-threads", type=positive_int, default=_DEFAULTS.opencv_threads,
                   help="threads OpenCV may use for matching, masks and warps (process-wide; default: OpenCV's own, "
                        "one per core; on a shared machine, as many as torch uses)")
    p.add_argument("--size", type=_size, help="resize frames to HxW (default: the video's size)")
    p.add_argument("--max-frames", type=positive_int, help="stop after this many frames")
    p.add_argument("--csv", help="write per-frame statistics to this CSV file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def stream_config(args: argparse.Namespace) -> StreamConfig:
    """The session's settings from the parsed ``stream`` options.

    Raises:
        ValueError: settings out of range (the option types check each one; the config checks them together).
    """
    return StreamConfig(pixel_threshold=args.pixel_threshold, cell=args.cell, max_ratio=args.max_ratio,
                        keyframe_interval=args.keyframe_interval, feature_threshold=args.feature_threshold,
                        target_agreement=args.target_agreement, target_error=args.target_error or None,
                        audit_interval=args.audit_interval, speed_guard=not args.no_speed_guard,
                        quality_guard=not args.no_quality_guard, sample_seed=args.sample_seed,
                        opencv_threads=args.opencv_threads)


def run(args: argparse.Namespace) -> int:
    import torch

    from incrinf import models
    from incrinf.progress import progress_bar
    from incrinf.stream.session import StreamSession
    from incrinf.stream.video import bundled_video_path, read_frames

    path = Path(args.video) if args.video else bundled_video_path("carphone_pristine")
    frames = read_frames(path, max_frames=args.max_frames, size=args.size)  # fails here on a bad file
    model = models.load(args.model, args.weights)
    meta = models.info(args.model)
    session = StreamSession(model, stream_config(args), mean=meta.mean, std=meta.std)
    rows, outputs = [], []
    # the session and the reference run in separate passes over the clip, as each would run on its own (run
    # frame by frame in turn they evict each other's caches, which slows the session by about a third)
    bar = progress_bar(frames, total=args.max_frames, unit="frame", disable=args.quiet, desc=f"{path.name} (session)")
    with torch.no_grad():
        for frame in bar:
            outputs.append(session(frame))
            stats = session.stats[-1]
            rows.append({
                "index": stats.index, "mode": stats.mode, "reason": stats.reason,
                "homography_found": stats.homography_found, "recompute_fraction": round(stats.recompute_fraction, 4),
                "flops_ratio": round(stats.flops_ratio, 3), "seconds": round(stats.seconds, 5),
                "audit": stats.audit, "agreement": stats.agreement, "predicted_full": round(stats.predicted_full, 5),
                "predicted_cached": round(stats.predicted_cached, 5), "guard_level": stats.guard_level,
                "top1": int(outputs[-1].argmax()),
            })
            bar.set_postfix(mode=stats.mode, changed=f"{stats.recompute_fraction:.0%}")
        reference = read_frames(path, max_frames=args.max_frames, size=args.size)
        for row, out, frame in zip(rows, outputs, progress_bar(reference, total=len(rows), unit="frame",
                                                               disable=args.quiet,
                                                               desc=f"{path.name} (full inference)")):
            start = time.perf_counter()
            ref = model(meta.normalization.tensor(frame))
            row["full_seconds"] = round(time.perf_counter() - start, 5)
            row["full_top1"] = int(ref.argmax())
            row["relative_error"] = round(float((out - ref).norm() / ref.norm().clamp_min(1e-12)), 5)
    if not rows:
        raise ValueError(f"{path} has no frames")
    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=_CSV_FIELDS)
            writer.writeheader()
            writer.writerows(rows)
    timed = rows[1:] or rows  # the first frame also captures the model
    session_ms = statistics.median(r["seconds"] for r in timed) * 1e3
    full_ms = statistics.median(r["full_seconds"] for r in timed) * 1e3
    agree = statistics.mean(r["top1"] == r["full_top1"] for r in rows)
    cached = sum(r["mode"] == "cached" for r in rows)
    audits = sum(r["audit"] for r in rows)
    measured = session.agreement
    print(f"{len(rows)} frames of {path.name} ({cached} cached, {audits} audited: {audits / len(rows):.0%}): median "
          f"{session_ms:.1f} ms/frame vs {full_ms:.1f} ms full inference, speedup {full_ms / session_ms:.2f}x; top-1 "
          f"agreement with full inference {agree:.1%} (measured by the session's audits: {measured.agreement:.1%} "
          f"over {measured.audits}); mean relative output error "
          f"{statistics.mean(r['relative_error'] for r in rows):.3f}; median FLOPs ratio "
          f"{statistics.median(r['flops_ratio'] for r in rows):.2f}")
    if args.csv:
        print(f"per-frame statistics written to {args.csv}")
    return 0
