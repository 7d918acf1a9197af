"""The approximate-occlusion options shared by ``incrinf explain`` for images and volumes: adding them to a
parser, turning them into :func:`incrinf.occlusion` keyword arguments, and describing the approximation."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from incrinf.cli.common import number

if TYPE_CHECKING:
    from incrinf.explain.result import OcclusionStats


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
    """Keyword arguments for :func:`incrinf.occlusion` from the parsed options.

    Raises:
        ValueError: inconsistent options (the CLI prints it as an error).
    """
    from incrinf.explain.drilldown import DrillDown
    from incrinf.explain.tuning_profile import TuningProfile

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


def describe_approximation(stats: OcclusionStats) -> str:
    """One or two lines on what was approximated and the error measured (for ``incrinf explain``)."""
    setting, error, drill = stats.setting, stats.error, stats.drill_down
    if not stats.approximate:
        return "exact heat map (tau = 1, no pruning, no drill-down)"
    knobs = [f"tau {setting.tau:g}"] if setting.tau < 1 else []
    if setting.feature_threshold:
        knobs.append(f"feature threshold {setting.feature_threshold:g}")
    parts = [", ".join(knobs) or "drill-down"]
    if setting.source == "profile":
        parts[0] += (f" (from the profile for SSIM {setting.target_ssim:g}, which held "
                     f"{setting.predicted_ssim:.3f} when tuned)")
    if drill is not None:
        parts.append(f"drill-down: stage one stride {drill.stage_one_stride[0]}, {drill.stage_one_positions} + "
                     f"{drill.stage_two_positions} positions instead of {drill.fine_positions} "
                     f"({drill.query_speedup:.2f}x fewer queries)")
    if error.method == "measured":  # measure_quality; a grid too small for SSIM has only the errors
        ssim = f"measured SSIM {error.ssim:.3f} vs the exact map, " if error.ssim is not None else "vs the exact map: "
        parts.append(f"{ssim}max |error| {error.max_abs_error:.3g}")
    elif error.method == "sampled":
        estimate = f" (estimated SSIM {error.ssim:.3f})" if error.ssim is not None else ""
        parts.append(f"error on {error.cells} cells recomputed exactly: "
                     f"max {error.max_abs_error:.3g}, mean {error.mean_abs_error:.3g}{estimate}")
    return "approximate: " + "; ".join(parts)
