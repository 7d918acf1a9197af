"""Command-line pieces for approximate occlusion: ``incrinf tune`` and the approximation options of
``incrinf explain`` (``--tau``, ``--target-ssim``, ``--profile``, ``--drill-down``, ``--target-speedup``,
``--measure-quality``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    return value


def _taus(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 1,0.9,0.8, got {text!r}") from None


def add_explain_options(parser: argparse.ArgumentParser) -> None:
    """Add the approximation options to the ``explain`` parser (``--tau`` only if it is not there yet)."""
    group = parser.add_argument_group("approximation (faster, measured error)")
    if "--tau" not in parser._option_string_actions:
        group.add_argument("--tau", type=float, default=1.0, help="projective field threshold in (0, 1]; 1 = exact")
    group.add_argument("--target-ssim", type=_fraction,
                       help="wanted heat-map SSIM; tau comes from --profile (see `incrinf tune`)")
    group.add_argument("--profile", help="tuning profile JSON written by `incrinf tune`")
    group.add_argument("--drill-down", type=_fraction, metavar="FRACTION",
                       help="adaptive drill-down: recompute this fraction of the grid at --stride (e.g. 0.25)")
    group.add_argument("--target-speedup", type=_fraction,
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
    target_ssim = getattr(args, "target_ssim", None)
    profile = getattr(args, "profile", None)
    if target_ssim is not None and profile is None:
        raise ValueError("--target-ssim needs --profile (make one with `incrinf tune`)")
    if profile is not None:
        if kwargs["tau"] != 1.0:
            raise ValueError("give either --tau or --target-ssim/--profile, not both")
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
        return "exact heat map (tau = 1, no drill-down)"
    parts = [f"tau {stats['tau']:g}" + (f" (from the profile for SSIM {stats['target_ssim']:g})"
                                       if stats.get("tau_source") == "profile" else "")]
    if stats.get("stage_one_stride"):
        s1 = stats["stage_one_stride"]
        parts.append(f"drill-down: stage one stride {s1[0]}, {stats['stage_one_positions']} + "
                     f"{stats['stage_two_positions']} positions instead of {stats['fine_positions']} "
                     f"({stats['query_speedup']:.2f}x fewer queries)")
    if "ssim" in stats:
        parts.append(f"measured SSIM {stats['ssim']:.3f} vs the exact map (max |error| {stats['max_abs_error']:.3g})")
    elif "sampled_cells" in stats:
        parts.append(f"error on {stats['sampled_cells']} cells recomputed exactly: "
                     f"max {stats['sampled_max_abs_error']:.3g}, mean {stats['sampled_mean_abs_error']:.3g}")
    return "approximate: " + "; ".join(parts)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``incrinf tune``; returns its parser."""
    p = subparsers.add_parser("tune", help="tune tau for a target heat-map SSIM on sample images")
    p.add_argument("images", nargs="+", help="sample image files (the same domain as the images to explain)")
    p.add_argument("--model", default="efficientnet_lite0")
    p.add_argument("--weights", help="state-dict file for a torchvision architecture")
    p.add_argument("--size", type=int, help="image size (default: the model's input size)")
    p.add_argument("--patch", type=int, default=16)
    p.add_argument("--stride", type=int, default=4)
    p.add_argument("--target-ssim", type=_fraction, default=0.9)
    p.add_argument("--taus", type=_taus, default=None, help="comma-separated taus (default 1,0.9,...,0.4)")
    p.add_argument("--output", choices=["logit", "prob"], default="logit")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_tune)
    return p


def _read_rgb(path: str) -> np.ndarray:
    from incrinf.cli_args import read_rgb

    return read_rgb(path)


def cmd_tune(args: argparse.Namespace) -> int:
    """``incrinf tune``: tune tau on the given images and write the profile."""
    from incrinf import models
    from incrinf.explain.tuning import DEFAULT_TAUS, tune

    if args.model not in models.available():
        raise ValueError(f"unknown model {args.model!r}; try one of: {', '.join(models.ZOO)}")
    model = models.load(args.model, args.weights)
    size = args.size or models.info(args.model).input_size
    images = [models.preprocess(_read_rgb(path), args.model, size=size) for path in args.images]
    profile = tune(model, images, target_ssim=args.target_ssim, taus=args.taus or DEFAULT_TAUS, patch=args.patch,
                   stride=args.stride, output=args.output, progress=not args.quiet, name=args.model,
                   image_names=[Path(p).name for p in args.images])
    path = profile.save(args.out)
    print(profile.summary())
    print(f"tuned in {profile.seconds:.1f} s; profile written to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m incrinf.explain.cli_approx tune ...``) until ``incrinf`` wires it."""
    parser = argparse.ArgumentParser(prog="incrinf")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"incrinf {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
