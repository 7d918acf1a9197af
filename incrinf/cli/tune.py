"""``incrinf tune``: fit the approximation's knobs to a target heat-map SSIM on sample images."""

from __future__ import annotations

import argparse
from pathlib import Path

from incrinf.cli.common import model_name, number, positive_int, read_rgb


def _numbers(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 1,0.9,0.8, got {text!r}") from None


def _drills(text: str) -> tuple[tuple[int, float], ...]:
    try:
        pairs = [item.split("/") for item in text.split(",") if item.strip()]
        return tuple((int(f), float(r)) if int(f) > 1 else (1, 0.0) for f, r in pairs)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected factor/fraction pairs like 1/0,2/0.1, got {text!r}") from None


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``incrinf tune``; returns its parser."""
    from incrinf.explain.tuning import DEFAULT_FEATURE_THRESHOLDS, DEFAULT_TAUS

    p = subparsers.add_parser("tune", help="fit the approximation (tau, feature threshold, drill-down) to a target "
                                           "heat-map SSIM on sample images, checked on held-out ones",
                              description="Measure every setting of the approximation knobs on sample images, pick "
                                          "the fastest that holds --target-ssim, check it on held-out images and "
                                          "write a profile for 'incrinf explain --target-ssim S --profile FILE'.")
    p.add_argument("images", nargs="+", help="sample image files (the same domain as the images to explain)")
    p.add_argument("--model", type=model_name, default="efficientnet_lite0",
                   help="zoo model (default efficientnet_lite0; an unknown name lists them)")
    p.add_argument("--weights", help="state-dict file for a torchvision architecture")
    p.add_argument("--size", type=positive_int, help="image size (default: the model's input size)")
    p.add_argument("--patch", type=positive_int, default=16,
                   help="occlusion window, as you will explain with (default 16)")
    p.add_argument("--stride", type=positive_int, default=4, help="window stride, as you will explain with (default 4)")
    p.add_argument("--target-ssim", type=number, default=0.9,
                   help="heat-map SSIM against the exact map the choice must hold (default 0.9)")
    p.add_argument("--taus", type=_numbers, default=DEFAULT_TAUS,
                   help=f"taus to measure (default {','.join(map(str, DEFAULT_TAUS))})")
    p.add_argument("--feature-thresholds", type=_numbers, default=DEFAULT_FEATURE_THRESHOLDS,
                   help=f"pruning thresholds to measure (default {','.join(map(str, DEFAULT_FEATURE_THRESHOLDS))})")
    p.add_argument("--drill-downs", type=_drills, default=None,
                   help="drill-down settings factor/fraction (default 1/0,2/0.1,2/0.25; 1/0 = none)")
    p.add_argument("--holdout", type=number, default=1 / 3,
                   help="share of the images held out to check the choice (default 1/3)")
    p.add_argument("--output", choices=["logit", "prob"], default="logit",
                   help="score explained: logit or softmax probability (default logit)")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """``incrinf tune``: measure every setting on the images, choose, check, write the profile."""
    from incrinf import models
    from incrinf.explain.tuning import DEFAULT_DRILL_DOWNS, tune

    model = models.load(args.model, args.weights)
    size = args.size or models.info(args.model).input_size
    images = [models.preprocess(read_rgb(path), args.model, size=size) for path in args.images]
    profile = tune(model, images, target_ssim=args.target_ssim, patch=args.patch, stride=args.stride, taus=args.taus,
                   feature_thresholds=args.feature_thresholds, drill_downs=args.drill_downs or DEFAULT_DRILL_DOWNS,
                   holdout=args.holdout, output=args.output, progress=not args.quiet, name=args.model,
                   image_names=[Path(p).name for p in args.images])
    path = profile.save(args.out)
    print(profile.summary())
    print(f"tuned in {profile.seconds:.1f} s; profile written to {path}")
    return 0
