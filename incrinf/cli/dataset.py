"""Dataset mode of ``incrinf explain``: several files, directories or glob patterns, or ``--out DIR``.

``incrinf explain`` calls :func:`add_dataset_arguments` on its parser and, when :func:`is_dataset_run` says so,
hands the parsed arguments (and the occlusion keyword arguments it built from its own options) to
:func:`run_dataset`. With one image file and ``--out`` naming a file it keeps its single-image behaviour.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from incrinf.cli.common import positive_int, share

_DATASET_ONLY = ("workers", "ray", "masks", "overwrite", "size", "cpus_per_worker")
_PICTURE_SUFFIXES = (".png", ".jpg", ".jpeg", ".pdf", ".svg")


def _ray_address(text: str) -> str:
    """``--ray``'s optional value. It takes the next word, so an input path written after ``--ray`` would be
    read as an address: refuse anything that does not look like one."""
    if text in ("auto", "local") or ":" in text:
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a Ray address (auto, local, HOST:PORT or ray://HOST:PORT); "
                                     "write the inputs before --ray, or --ray=ADDRESS")


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the dataset options to the ``explain`` parser (its ``image`` positional takes several paths)."""
    group = parser.add_argument_group(
        "datasets (several inputs, a directory or a glob, or --out DIR)",
        "Writes DIR/results.csv, DIR/index.html (gallery), DIR/summary.json and per input DIR/items/<id>.* "
        "(heat map .npy, overlay, thumbnail, record). Re-running skips complete inputs.")
    group.add_argument("--workers", type=positive_int, default=None,
                       help="local worker processes (default 1: in this process); with --ray, the number of actors "
                            "(default: one per --cpus-per-worker CPUs of the cluster)")
    group.add_argument("--ray", nargs="?", const="local", type=_ray_address, metavar="ADDRESS",
                       help="run on Ray: no ADDRESS starts Ray on this machine; 'auto', HOST:PORT or ray://HOST:PORT "
                            "join a running cluster (needs pip install 'incrinf[ray]')")
    group.add_argument("--cpus-per-worker", type=positive_int, default=1,
                       help="CPUs Ray reserves per actor, and its torch threads (default 1)")
    group.add_argument("--overwrite", action="store_true", help="recompute inputs whose outputs are complete")
    group.add_argument("--size", type=positive_int,
                       help="resize the shorter side to SIZE and centre-crop (default: the model's input size)")
    group.add_argument("--masks", metavar="PATH",
                       help="shortcut check: one mask image for all inputs, or a folder of masks matched by relative "
                            "path or stem (non-black = where the evidence should be)")
    group.add_argument("--mask-threshold", type=share, default=0.5,
                       help="list inputs with more than this share of their positive heat outside the mask "
                            "(default 0.5)")


def is_dataset_run(args: argparse.Namespace) -> bool:
    """Whether ``incrinf explain`` should explain a dataset: several inputs, a directory or a glob pattern, an
    existing directory or a trailing slash as ``--out``, or any dataset-only option."""
    from incrinf.explain.dataset.inputs import is_pattern

    inputs = list(args.image or [])
    if len(inputs) > 1 or any(Path(p).is_dir() or is_pattern(p) for p in inputs):
        return True
    out = str(args.out)
    if Path(out).is_dir() or out.endswith(("/", os.sep)):
        return True
    return any(getattr(args, name, None) not in (None, False, 1) for name in _DATASET_ONLY)


def run_dataset(args: argparse.Namespace) -> int:
    """The body of ``incrinf explain`` in dataset mode; returns the exit status (0 all done, 1 some input
    failed or is not done, 130 interrupted).

    The inputs' kind picks the defaults: images get ``efficientnet_lite0``, a 16-pixel window and stride 4 and
    the image options; NIfTI volumes get ``monai_densenet121_3d``, a 16-voxel window and stride 16 and the volume
    options (``--volume-index``, ``--resize``). An option of the other kind is an error. ``--feature-mask FILE``
    applies one mask to every input of its shape (others are error rows), ``--feature-mask DIR`` each input's own
    mask matched by name (:mod:`incrinf.explain.dataset.mask_folders`; an input without one is an error row);
    ``--target all`` keeps every class's map per input.

    Args:
        args: the parsed ``explain`` arguments (``image`` a list, ``out`` the folder).
    """
    from incrinf.cli.approx_options import apply_explain_options
    from incrinf.cli.volume import DEFAULT_VOLUME_MODEL
    from incrinf.explain.dataset import DatasetInterrupted, explain_dataset
    from incrinf.explain.dataset.inputs import KIND_VOLUMES, discover_inputs

    if not args.image:
        raise ValueError("a dataset run needs inputs: image or NIfTI files, directories or glob patterns")
    if Path(args.out).suffix.lower() in _PICTURE_SUFFIXES and not Path(args.out).is_dir():
        raise ValueError(f"several inputs write a folder: give --out DIR (not the picture name {args.out!r})")
    volumes = discover_inputs(args.image).kind == KIND_VOLUMES
    options = apply_explain_options(args)  # the single-input options (tau, drill-down, ...) flow through here too
    if args.baseline != 0.0:
        options["baseline"] = args.baseline
    if volumes:
        for option in ("target_ssim", "profile", "drill_down", "target_speedup", "size", "masks"):
            if getattr(args, option, None) is not None:
                raise ValueError(f"--{option.replace('_', '-')} is for images; these inputs are NIfTI volumes")
        defaults = {"model": DEFAULT_VOLUME_MODEL, "patch": 16, "stride": 16}
        volume_options = {"volume_index": args.volume_index, "resize": args.resize}
    else:
        if args.volume_index != 0 or args.resize is not None:
            raise ValueError("--volume-index and --resize are for NIfTI volumes; these inputs are images "
                             "(use --size)")
        defaults = {"model": "efficientnet_lite0", "patch": 16, "stride": 4}
        volume_options = {}
    options.update(target=args.target, patch=args.patch or defaults["patch"],
                   stride=args.stride or defaults["stride"], output=args.output,
                   batch_size=args.batch_size if args.batch_size else "auto")
    try:
        report = explain_dataset(
            args.model or defaults["model"], args.image, args.out, weights=args.weights, size=args.size,
            masks=args.masks, mask_threshold=args.mask_threshold, feature_mask=args.feature_mask,
            workers=args.workers or 1,
            ray=(True if args.ray == "local" else args.ray) if args.ray else None,
            cpus_per_worker=args.cpus_per_worker, overwrite=args.overwrite, progress=not args.quiet,
            **volume_options, **options)
    except DatasetInterrupted as stop:
        print("\ninterrupted: every finished input is kept; run the same command again to do the rest",
              file=sys.stderr)
        print(stop.report.summary())
        return stop.report.exit_code
    print(report.summary())
    return report.exit_code
