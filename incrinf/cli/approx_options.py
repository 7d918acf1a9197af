"""The approximate-occlusion options shared by ``incrinf explain`` for images and volumes: adding them to a
parser, turning them into :func:`incrinf.occlusion` keyword arguments, and describing the approximation."""

from __future__ import annotations

import argparse
from typing import Any

from incrinf.cli.common import number


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
