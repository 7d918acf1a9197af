"""``incrinf explain --feature-mask FILE`` and ``--target all``: the option's types and the summary a feature or
every-class run prints. The masks are read and validated by :mod:`incrinf.explain.feature_masks` (shared with the
dataset mode); its readers are re-exported here."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from incrinf.explain.feature_masks import (
    fit_image_mask,
    read_image_mask,
    read_label_volume,
    read_volume_mask,
    resize_labels,
)

__all__ = ["fit_image_mask", "print_summary", "read_image_mask", "read_label_volume", "read_volume_mask",
           "resize_labels", "summary_line", "target_value"]


def target_value(text: str) -> int | str:
    """argparse type of ``--target``: a class index, or ``all`` (a map per class from one run)."""
    if text == "all":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a class index or 'all', got {text!r}") from None


def summary_line(result: Any, elapsed: float) -> str:
    """What a run explained, how fast, and its theoretical speedup."""
    s = result.stats
    what = f"{len(result.features)} features" if result.features is not None else f"{s.positions} positions"
    target = "every class" if result.every_class else f"class {result.target}"
    return (f"explained {target} with {what} in {elapsed:.1f} s ({s.batches} batches of {s.batch_size}); "
            f"theoretical speedup {s.theoretical_speedup:.2f}x, realized FLOP ratio {s.realized_flop_ratio:.2f}x")


def print_summary(result: Any, elapsed: float, out: Any, picture: str) -> int:
    """Print a feature-mask or every-class run's summary (the sliding-window one names its largest window)."""
    from incrinf.cli.approx_options import describe_approximation

    print(summary_line(result, elapsed))
    heat = np.asarray(result.heatmap)
    if result.features is not None and not result.every_class:
        print(f"largest drop {heat.max():.3f} at feature {result.features[int(np.argmax(heat))]}")
    print(describe_approximation(result.stats))
    print(f"{picture} written to {out}" + (" (the predicted class's map)" if result.every_class else ""))
    return 0
