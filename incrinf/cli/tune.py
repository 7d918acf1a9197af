"""``incrinf tune``: fit the approximation's knobs to a target heat-map SSIM on sample images."""

from __future__ import annotations

import argparse
from pathlib import Path

from incrinf.cli.common import number, read_rgb


def _taus(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 1,0.9,0.8, got {text!r}") from None


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``incrinf tune``; returns its parser."""
    p = subparsers.add_parser("tune", help="tune tau for a target heat-map SSIM on sample images")
    p.add_argument("images", nargs="+", help="sample image files (the same domain as the images to explain)")
    p.add_argument("--model", default="efficientnet_lite0")
    p.add_argument("--weights", help="state-dict file for a torchvision architecture")
    p.add_argument("--size", type=int, help="image size (default: the model's input size)")
    p.add_argument("--patch", type=int, default=16)
    p.add_argument("--stride", type=int, default=4)
    p.add_argument("--target-ssim", type=number, default=0.9)
    p.add_argument("--taus", type=_taus, default=None, help="comma-separated taus (default 1,0.9,...,0.4)")
    p.add_argument("--output", choices=["logit", "prob"], default="logit")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """``incrinf tune``: tune tau on the given images and write the profile."""
    from incrinf import models
    from incrinf.explain.tuning import DEFAULT_TAUS, tune

    if args.model not in models.available():
        raise ValueError(f"unknown model {args.model!r}; try one of: {', '.join(models.ZOO)}")
    model = models.load(args.model, args.weights)
    size = args.size or models.info(args.model).input_size
    images = [models.preprocess(read_rgb(path), args.model, size=size) for path in args.images]
    profile = tune(model, images, target_ssim=args.target_ssim, taus=args.taus or DEFAULT_TAUS, patch=args.patch,
                   stride=args.stride, output=args.output, progress=not args.quiet, name=args.model,
                   image_names=[Path(p).name for p in args.images])
    path = profile.save(args.out)
    print(profile.summary())
    print(f"tuned in {profile.seconds:.1f} s; profile written to {path}")
    return 0
