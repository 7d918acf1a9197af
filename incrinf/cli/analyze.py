"""``incrinf analyze``: the theoretical speedup of incremental inference, per layer."""

from __future__ import annotations

import argparse

from incrinf.cli.common import input_shape, model_name, positive_int


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``analyze`` subcommand."""
    p = subparsers.add_parser(
        "analyze", help="theoretical speedup of incremental inference, per layer",
        description="Print, per layer, the region an occluding patch changes and the multiply-adds incremental "
                    "inference saves (Krypton's equations), without running the model on data.")
    p.add_argument("--model", type=model_name, default="resnet18",
                   help="zoo model (default resnet18; an unknown name lists them)")
    p.add_argument("--weights", help="state-dict file for a torchvision architecture")
    p.add_argument("--patch", type=positive_int, default=16, help="occlusion window side (default 16)")
    p.add_argument("--stride", type=positive_int, default=4, help="window stride, used with --position all (default 4)")
    p.add_argument("--tau", type=float, default=1.0, help="projective field threshold in (0, 1]; 1 = exact (default)")
    p.add_argument("--input", type=input_shape,
                   help="input shape, e.g. 3x224x224 (default: the model's; required for a volume model, "
                        "e.g. 1x64x96x128)")
    p.add_argument("--position", default="center", choices=["center", "all"],
                   help="center: one patch in the middle (default); all: the mean over the occlusion grid")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from incrinf import models
    from incrinf.analysis import analyze

    if models.is_volume_model(args.model) and args.input is None:
        raise ValueError(f"{args.model} takes volumes: give their shape, e.g. --input 1x64x96x128")
    size = models.info(args.model).input_size
    model = models.load(args.model, args.weights)
    report = analyze(model, args.input or (3, size, size), args.patch, stride=args.stride, tau=args.tau,
                     position=args.position)
    print(report.table())
    return 0
