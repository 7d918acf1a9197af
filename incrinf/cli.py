"""Command line: ``incrinf analyze | explain | ...``."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from incrinf.cli_args import input_shape as _input_shape
from incrinf.cli_args import positive_int as _positive_int


def _model_name(text: str) -> str:
    from incrinf import models

    if text not in models.available():
        raise argparse.ArgumentTypeError(f"unknown model {text!r}; try one of: {', '.join(models.ZOO)}")
    return text


def cmd_analyze(args: argparse.Namespace) -> int:
    from incrinf import models
    from incrinf.analysis import analyze

    shape = args.input or (3, models.info(args.model).input_size, models.info(args.model).input_size)
    model = models.load(args.model, args.weights)
    report = analyze(model, shape, args.patch, stride=args.stride, tau=args.tau, position=args.position)
    print(report.table())
    return 0


def _read_image(path: str | None) -> np.ndarray:
    from incrinf import models
    from incrinf.cli_args import read_rgb

    if path is None:
        return models.sample_image()
    try:
        return read_rgb(path)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"incrinf explain: {exc}") from None


def cmd_explain(args: argparse.Namespace) -> int:
    from incrinf import models
    from incrinf.explain import approx
    from incrinf.explain.cli_approx import apply_explain_options, describe_approximation
    from incrinf.explain.dataset_cli import is_dataset_run, run_dataset

    options = apply_explain_options(args)
    if is_dataset_run(args):
        return run_dataset(args, options)
    image = _read_image(args.image[0] if args.image else None)
    model = models.load(args.model, args.weights)
    x = models.preprocess(image, args.model)
    start = time.perf_counter()
    result = approx.occlusion(model, x, target=args.target, patch=args.patch, stride=args.stride,
                              batch_size=args.batch_size if args.batch_size else "auto",
                              output=args.output, progress=not args.quiet, **options)
    elapsed = time.perf_counter() - start
    out = result.save(args.out, image=models.unnormalize(x, args.model),
                      title=f"{args.model}: class {result.target}")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="incrinf", description="Incremental CNN inference.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("analyze", help="theoretical speedup of incremental inference, per layer")
    p.add_argument("--model", type=_model_name, default="resnet18")
    p.add_argument("--weights", help="state-dict file for a torchvision architecture")
    p.add_argument("--patch", type=_positive_int, default=16)
    p.add_argument("--stride", type=_positive_int, default=4, help="used with --position all")
    p.add_argument("--tau", type=float, default=1.0, help="projective field threshold in (0, 1]")
    p.add_argument("--input", type=_input_shape, help="input shape, e.g. 3x224x224")
    p.add_argument("--position", default="center", choices=["center", "all"])
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("explain", help="occlusion heat map by incremental inference")
    p.add_argument("image", nargs="*", help="image file (default: a shipped photo of a cat); several files, "
                   "directories or glob patterns explain a dataset (see --out DIR)")
    p.add_argument("--model", type=_model_name, default="efficientnet_lite0")
    p.add_argument("--weights", help="state-dict file for a torchvision architecture")
    p.add_argument("--patch", type=_positive_int, default=16)
    p.add_argument("--stride", type=_positive_int, default=4)
    p.add_argument("--target", type=int, help="class to explain (default: predicted)")
    p.add_argument("--output", choices=["logit", "prob"], default="prob")
    p.add_argument("--batch-size", type=_positive_int)
    p.add_argument("--out", default="heatmap.png", help="picture to write, or the folder of a dataset run")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_explain)
    from incrinf.explain import cli_approx

    cli_approx.add_explain_options(p)
    from incrinf.explain.dataset_cli import add_dataset_arguments

    add_dataset_arguments(p)
    cli_approx.register(sub)

    from incrinf.stream import cli as stream_cli
    from incrinf.stream import serve_cli

    stream_cli.register(sub)
    serve_cli.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``incrinf`` command."""
    from incrinf.errors import CaptureError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, CaptureError, FileNotFoundError, RuntimeError) as exc:
        print(f"incrinf {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
