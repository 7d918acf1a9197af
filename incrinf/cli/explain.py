"""``incrinf explain``: an occlusion heat map of one image, exact or approximate (``--tau``, ``--target-ssim``,
``--profile``, ``--drill-down``, ``--target-speedup``, ``--measure-quality``), or of a NIfTI volume
(:mod:`incrinf.cli.volume`)."""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from incrinf.cli.common import model_name, number, positive_int
from incrinf.cli.volume import is_volume_path, run_volume, volume_size


def add_explain_options(parser: argparse.ArgumentParser) -> None:
    """Add the approximation options to the ``explain`` parser."""
    group = parser.add_argument_group("approximation (faster, measured error)")
    group.add_argument("--tau", type=float, default=1.0, help="projective field threshold in (0, 1]; 1 = exact")
    group.add_argument("--feature-threshold", type=number, default=0.0,
                       help="value-based pruning: changes under this share of a layer's mean magnitude stop "
                            "spreading; 0 = exact")
    group.add_argument("--target-ssim", type=number,
                       help="wanted heat-map SSIM; tau comes from --profile (see `incrinf tune`)")
    group.add_argument("--profile", help="tuning profile JSON written by `incrinf tune`")
    group.add_argument("--drill-down", type=number, metavar="FRACTION",
                       help="adaptive drill-down: recompute this fraction of the grid at --stride (e.g. 0.25)")
    group.add_argument("--target-speedup", type=number,
                       help="drill-down target speedup in queries (default 3; implies --drill-down 0.25)")
    group.add_argument("--measure-quality", action="store_true",
                       help="also compute the exact heat map and print the measured SSIM")


def apply_explain_options(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for :func:`incrinf.explain.approx.occlusion` from the parsed options.

    Raises:
        ValueError: inconsistent options (the CLI prints it as an error).
    """
    from incrinf.explain.drilldown import DrillDown
    from incrinf.explain.tuning import TuningProfile

    kwargs: dict[str, Any] = {"tau": getattr(args, "tau", 1.0)}
    if getattr(args, "feature_threshold", 0.0):
        kwargs["feature_threshold"] = args.feature_threshold
    target_ssim = getattr(args, "target_ssim", None)
    profile = getattr(args, "profile", None)
    if target_ssim is not None and profile is None:
        raise ValueError("--target-ssim needs --profile (make one with `incrinf tune`)")
    if profile is not None:
        if kwargs["tau"] != 1.0 or kwargs.get("feature_threshold"):
            raise ValueError("give either --tau/--feature-threshold or --target-ssim/--profile, not both")
        kwargs["profile"] = TuningProfile.load(profile)
        kwargs["target_ssim"] = target_ssim
    fraction = getattr(args, "drill_down", None)
    speedup = getattr(args, "target_speedup", None)
    if fraction is not None or speedup is not None:
        kwargs["drill_down"] = DrillDown(0.25 if fraction is None else fraction, 3.0 if speedup is None else speedup)
    kwargs["measure_quality"] = bool(getattr(args, "measure_quality", False))
    return kwargs


def describe_approximation(stats: dict[str, Any]) -> str:
    """One or two lines on what was approximated and the error measured (for ``incrinf explain``)."""
    if not stats.get("approximate"):
        return "exact heat map (tau = 1, no pruning, no drill-down)"
    knobs = [f"tau {stats['tau']:g}"] if stats["tau"] < 1 else []
    if stats.get("feature_threshold"):
        knobs.append(f"feature threshold {stats['feature_threshold']:g}")
    parts = [", ".join(knobs) or "drill-down"]
    if stats.get("setting_source") == "profile":
        parts[0] += (f" (from the profile for SSIM {stats['target_ssim']:g}, which held "
                     f"{stats['predicted_ssim']:.3f} when tuned)")
    if stats.get("stage_one_stride"):
        s1 = stats["stage_one_stride"]
        parts.append(f"drill-down: stage one stride {s1[0]}, {stats['stage_one_positions']} + "
                     f"{stats['stage_two_positions']} positions instead of {stats['fine_positions']} "
                     f"({stats['query_speedup']:.2f}x fewer queries)")
    if "max_abs_error" in stats:  # measure_quality; a grid too small for SSIM has only the errors
        ssim = f"measured SSIM {stats['ssim']:.3f} vs the exact map, " if "ssim" in stats else "vs the exact map: "
        parts.append(f"{ssim}max |error| {stats['max_abs_error']:.3g}")
    elif "sampled_cells" in stats:
        estimate = f" (estimated SSIM {stats['estimated_ssim']:.3f})" if "estimated_ssim" in stats else ""
        parts.append(f"error on {stats['sampled_cells']} cells recomputed exactly: "
                     f"max {stats['sampled_max_abs_error']:.3g}, mean {stats['sampled_mean_abs_error']:.3g}{estimate}")
    return "approximate: " + "; ".join(parts)


def baseline_value(text: str) -> float | str:
    """argparse type: a number or an occluder mode (``mean_patch``, ``mean_img``, ``gaussian``)."""
    from incrinf.explain.occluders import MODES

    if text in MODES:
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or one of {', '.join(MODES)}, got {text!r}") from None


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``explain`` subcommand."""
    p = subparsers.add_parser("explain", help="occlusion heat map by incremental inference")
    p.add_argument("image", nargs="*", help="image file (default: a shipped photo of a cat), or a NIfTI volume "
                   "(.nii, .nii.gz; needs the [nifti] extra); several image files, directories or glob patterns "
                   "explain a dataset (see --out DIR)")
    p.add_argument("--model", type=model_name,
                   help="zoo model (default: efficientnet_lite0 for images, monai_densenet121_3d for volumes)")
    p.add_argument("--weights", help="state-dict file for a zoo architecture")
    p.add_argument("--patch", type=positive_int, help="occlusion window (default 16)")
    p.add_argument("--stride", type=positive_int, help="window stride (default 4 for images, 16 for volumes)")
    p.add_argument("--baseline", type=baseline_value, default=0.0,
                   help="occluding value: a number, mean_patch, mean_img or gaussian (default 0)")
    p.add_argument("--target", type=int, help="class to explain (default: predicted)")
    p.add_argument("--output", choices=["logit", "prob"], default="prob")
    p.add_argument("--batch-size", type=positive_int)
    p.add_argument("--out", default="heatmap.png", help="picture to write, or the folder of a dataset run")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    volumes = p.add_argument_group("volumes (NIfTI)")
    volumes.add_argument("--volume-index", type=int, default=0, help="which volume of a 4-D (x, y, z, t) file")
    volumes.add_argument("--resize", type=volume_size, metavar="DxHxW",
                         help="resample the volume (trilinear), e.g. to fit the model's downsampling")
    add_explain_options(p)
    from incrinf.cli.dataset import add_dataset_arguments

    add_dataset_arguments(p)
    p.set_defaults(func=run)
    return p


def _read_image(path: str | None) -> np.ndarray:
    from incrinf import models
    from incrinf.cli.common import read_rgb

    if path is None:
        return models.sample_image()
    try:
        return read_rgb(path)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"incrinf explain: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from incrinf import models
    from incrinf.cli.dataset import is_dataset_run, run_dataset
    from incrinf.explain import approx

    volumes = [path for path in args.image or [] if is_volume_path(path)]
    if volumes:
        if len(args.image) > 1:
            raise ValueError("NIfTI volumes are explained one at a time: give a single .nii/.nii.gz file")
        return run_volume(args, volumes[0], args.baseline)
    name = args.model or "efficientnet_lite0"
    if models.is_volume_model(name):
        raise ValueError(f"{name} explains 3-D volumes: give a NIfTI file (.nii, .nii.gz)")
    options = apply_explain_options(args)
    if is_dataset_run(args):
        # the dataset path reads the same options as one image: fill in the image defaults it would not know
        args.model, args.patch, args.stride = name, args.patch or 16, args.stride or 4
        if args.baseline != 0.0:
            options["baseline"] = args.baseline
        return run_dataset(args, options)
    image = _read_image(args.image[0] if args.image else None)
    model = models.load(name, args.weights)
    x = models.preprocess(image, name)
    start = time.perf_counter()
    result = approx.occlusion(model, x, target=args.target, patch=args.patch or 16, stride=args.stride or 4,
                              baseline=args.baseline, batch_size=args.batch_size if args.batch_size else "auto",
                              output=args.output, progress=not args.quiet, **options)
    elapsed = time.perf_counter() - start
    out = result.save(args.out, image=models.unnormalize(x, name), title=f"{name}: class {result.target}")
    s = result.stats
    print(f"explained class {result.target} with {s['positions']} positions in {elapsed:.1f} s "
          f"({s['batches']} batches of {s['batch_size']}); theoretical speedup {s['theoretical_speedup']:.2f}x, "
          f"realized FLOP ratio {s['realized_flop_ratio']:.2f}x")
    y, x_ = np.unravel_index(np.argmax(result.heatmap), result.heatmap.shape)
    py, px = result.positions[y * result.heatmap.shape[1] + x_]
    print(f"largest drop {result.heatmap.max():.3f} at window y={py}..{py + result.patch[0]}, "
          f"x={px}..{px + result.patch[1]}")
    print(describe_approximation(s))
    print(f"heat map written to {out}")
    return 0
