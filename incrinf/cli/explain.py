"""``incrinf explain``: an occlusion heat map of one image, exact or approximate (``--tau``, ``--target-ssim``,
``--profile``, ``--drill-down``, ``--target-speedup``, ``--measure-quality``), or of a NIfTI volume
(:mod:`incrinf.cli.volume`)."""

from __future__ import annotations

import argparse
import time

import numpy as np

from incrinf.cli.approx_options import add_explain_options, apply_explain_options, describe_approximation
from incrinf.cli.common import model_name, non_negative_int, positive_int
from incrinf.cli.feature_mask import print_summary, target_value
from incrinf.cli.volume import is_volume_path, run_volume, volume_size


def baseline_value(text: str) -> float | str:
    """argparse type: a number or an occluder mode (``mean_patch``, ``mean_img``, ``gaussian``)."""
    from incrinf.explain.occluders import MODES

    if text in MODES:
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or one of {', '.join(MODES)}, got {text!r}") from None


def colour_map(text: str) -> str:
    """argparse type: a matplotlib colour map name."""
    import difflib

    from matplotlib import colormaps

    if text not in colormaps:
        close = difflib.get_close_matches(text, list(colormaps), n=5, cutoff=0.5)
        raise argparse.ArgumentTypeError(f"unknown colour map {text!r}" + (f"; did you mean {', '.join(close)}?"
                                                                            if close else ""))
    return text


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``explain`` subcommand."""
    p = subparsers.add_parser(
        "explain", help="occlusion heat map by incremental inference",
        description="Occlusion heat map of an image, a NIfTI volume, or a dataset (several files, folders or "
                    "globs with --out DIR), by exact incremental inference unless an approximation is asked for. "
                    "With no arguments: a shipped photo of a cat with the shipped EfficientNet-Lite0. Guides: "
                    "docs/occlusion.md (images), docs/volumes.md (volumes, feature masks), docs/datasets.md.")
    p.add_argument("image", nargs="*", help="image file (default: a shipped photo of a cat), or a NIfTI volume "
                   "(.nii, .nii.gz; needs the [nifti] extra); several files, directories or glob patterns explain "
                   "a dataset of images or of volumes (see --out DIR)")
    p.add_argument("--model", type=model_name,
                   help="zoo model (default: efficientnet_lite0 for images, monai_densenet121_3d for volumes)")
    p.add_argument("--weights", help="state-dict file for a zoo architecture")
    p.add_argument("--patch", type=positive_int, help="occlusion window (default 16)")
    p.add_argument("--stride", type=positive_int, help="window stride (default 4 for images, 16 for volumes)")
    p.add_argument("--baseline", type=baseline_value, default=0.0,
                   help="occluding value: a number, mean_patch, mean_img or gaussian (default 0)")
    p.add_argument("--target", type=target_value,
                   help="class to explain (default: predicted), or 'all' for a map per class from one run")
    p.add_argument("--feature-mask", metavar="FILE|DIR",
                   help="occlude features instead of sliding windows: a segment image or .npy of ids (images, the "
                        "image's size) or a label volume (NIfTI or .npy, the volume's shape); one value per "
                        "feature. A dataset run takes one FILE for every input, or a DIR of each input's own mask, "
                        "matched by name: the input sub/scan01.nii.gz takes DIR/sub/scan01.EXT, else "
                        "DIR/scan01.EXT (EXT .nii, .nii.gz or .npy; for images an image suffix or .npy); an input "
                        "with no mask or two is an error row")
    p.add_argument("--output", choices=["logit", "prob"], default="logit",
                   help="score whose drop the map shows: the model's logit or its softmax probability "
                        "(default logit)")
    p.add_argument("--batch-size", type=positive_int,
                   help="windows per batch (default: as many as the working-memory budget holds)")
    p.add_argument("--out", default="heatmap.png", help="picture to write, or the folder of a dataset run")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--cmap", type=colour_map, default="RdBu_r",
                   help="matplotlib colour map of the picture (default RdBu_r: red where occluding lowered the "
                        "score, blue where it raised it, white at zero)")
    p.add_argument("--no-centre", action="store_true",
                   help="colour limits from the map's minimum to maximum, not symmetric about zero (for a "
                        "sequential colour map such as viridis)")
    volumes = p.add_argument_group("volumes (NIfTI)")
    volumes.add_argument("--volume-index", type=non_negative_int, default=0,
                         help="which volume of a 4-D (x, y, z, t) file")
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
    from incrinf.explain.occlusion import occlusion

    if is_dataset_run(args):
        return run_dataset(args)
    volumes = [path for path in args.image or [] if is_volume_path(path)]
    if volumes:
        return run_volume(args, volumes[0], args.baseline)
    name = args.model or "efficientnet_lite0"
    if models.is_volume_model(name):
        raise ValueError(f"{name} explains 3-D volumes: give a NIfTI file (.nii, .nii.gz)")
    options = apply_explain_options(args)
    image = _read_image(args.image[0] if args.image else None)
    model = models.load(name, args.weights)
    x = models.preprocess(image, name)
    if args.feature_mask:
        from incrinf.cli.feature_mask import fit_image_mask, read_image_mask

        try:
            labels = read_image_mask(args.feature_mask)
        except (FileNotFoundError, ValueError) as exc:
            raise SystemExit(f"incrinf explain: {exc}") from None
        options["feature_mask"] = fit_image_mask(labels, image.shape[:2], x.shape[-1])
    start = time.perf_counter()
    result = occlusion(model, x, target=args.target, patch=args.patch or 16, stride=args.stride or 4,
                       baseline=args.baseline, batch_size=args.batch_size if args.batch_size else "auto",
                       output=args.output, progress=not args.quiet, **options)
    elapsed = time.perf_counter() - start
    out = result.save(args.out, image=models.unnormalize(x, name), title=f"{name}: class {result.target}",
                      cmap=args.cmap, centre=None if args.no_centre else 0.0)
    s = result.stats
    if result.features is not None or result.every_class:
        return print_summary(result, elapsed, out, "heat map")
    print(f"explained class {result.target} with {s.positions} positions in {elapsed:.1f} s "
          f"({s.batches} batches of {s.batch_size}); theoretical speedup {s.theoretical_speedup:.2f}x, "
          f"realized FLOP ratio {s.realized_flop_ratio:.2f}x")
    y, x_ = np.unravel_index(np.argmax(result.heatmap), result.heatmap.shape)
    py, px = result.positions[y * result.heatmap.shape[1] + x_]
    print(f"largest drop {result.heatmap.max():.3f} at window y={py}..{py + result.patch[0]}, "
          f"x={px}..{px + result.patch[1]}")
    print(describe_approximation(s))
    print(f"heat map written to {out}")
    return 0

