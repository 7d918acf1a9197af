"""Occlusion sensitivity of a 3-D network on a real volume: MONAI's ``OcclusionSensitivity`` vs incrinf's drop-in,
side by side.

The volume is the fMRI volume nibabel ships (``nibabel/tests/data/example4d.nii.gz``, MIT; its first time point,
128 x 96 x 24 voxels), read and standardised as ``incrinf explain`` reads volumes, then resampled (trilinear) to
``--size``: MONAI's DenseNet121 halves the volume five times, and the file's 24 slices are too few. Networks are
MONAI's, random init (speed and exactness do not depend on the weights). Both methods get the same arguments
(mask size, overlap, ``n_batch``, mode, ``b_box``); each runs once in a fresh spawned process, which measures its
time (capture and materialization included for incrinf) and its peak resident-memory growth. A full volume has
thousands of windows (hours for MONAI on 2 cores), so ``--b-box`` restricts both to a region, as MONAI's docs advise
for large images: the per-window costs, hence the speedup, are those of the whole volume.

Run: python benchmarks/obe_3d.py [--models densenet121 resnet10] [--size 48x96x128] [--mask 16] [--overlap 0.6]
     [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch
from _common import PeakRSS, machine, mib

# Networks from monai.networks.nets, one input channel, two classes.
MODELS = {
    "densenet121": lambda nets: nets.DenseNet121(spatial_dims=3, in_channels=1, out_channels=2),
    "resnet10": lambda nets: nets.resnet10(spatial_dims=3, n_input_channels=1, num_classes=2),
    "resnet18": lambda nets: nets.resnet18(spatial_dims=3, n_input_channels=1, num_classes=2),
}


def volume(size: tuple[int, int, int]) -> torch.Tensor:
    """(1, 1, *size) the nibabel fMRI volume, standardised and resampled."""
    import nibabel

    from incrinf.cli.volume import read_volume, resize

    path = os.path.join(os.path.dirname(nibabel.__file__), "tests", "data", "example4d.nii.gz")
    return resize(read_volume(path, 0), size)[None]


def one_run(method: str, name: str, size: tuple[int, int, int], options: dict, b_box: list[int] | None,
            threads: int = 0) -> dict:
    """One occlusion-sensitivity call in this (fresh) process: seconds, peak RSS growth, the map, stats."""
    torch.set_grad_enabled(False)
    if threads:
        torch.set_num_threads(threads)
    warnings.simplefilter("ignore")
    from monai.networks import nets

    torch.manual_seed(0)
    model = MODELS[name](nets).eval()
    x = volume(size)
    if method == "monai":
        from monai.visualize import OcclusionSensitivity
    else:
        from incrinf.monai import OcclusionSensitivity
    occ = OcclusionSensitivity(model, verbose=False, **options)
    with PeakRSS() as mem:
        start = time.perf_counter()
        occ_map, _ = occ(x, b_box=b_box)
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "memory": mem.bytes, "map": occ_map.as_tensor().clone(),
            "stats": getattr(occ, "last_stats", {})}


def in_child(*args) -> dict:
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(one_run, args)


def theory(name: str, size: tuple[int, int, int], mask: int) -> float:
    """Exact FLOP ratio for a centred mask (the analysis, before anything runs)."""
    from monai.networks import nets

    from incrinf.analysis import analyze

    torch.manual_seed(0)
    return analyze(MODELS[name](nets).eval(), (1, *size), mask).theoretical_speedup


def size_arg(text: str) -> tuple[int, int, int]:
    size = tuple(int(v) for v in text.lower().split("x"))
    if len(size) != 3:
        raise argparse.ArgumentTypeError(f"expected DxHxW, got {text!r}")
    return size  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["densenet121", "resnet10"], choices=sorted(MODELS))
    parser.add_argument("--size", type=size_arg, default=(48, 96, 128), help="DxHxW the volume is resampled to")
    parser.add_argument("--mask", type=int, default=16, help="mask_size (MONAI's default 16)")
    parser.add_argument("--overlap", type=float, default=0.6, help="overlap (MONAI's default 0.6)")
    parser.add_argument("--n-batch", type=int, default=16, help="n_batch (MONAI's default 16)")
    parser.add_argument("--mode", default="gaussian", help="gaussian, mean_patch, mean_img or a number")
    parser.add_argument("--threads", type=int, default=0, help="torch threads in each run (0: leave as is)")
    parser.add_argument("--b-box", type=int, nargs="*", default=[20, 27, 40, 55, 56, 71],
                        help="bounding box [min, max] per axis, inclusive (-1 -1: whole axis); none: whole volume")
    args = parser.parse_args(argv)
    mode = args.mode if args.mode in ("gaussian", "mean_patch", "mean_img") else float(args.mode)
    options = {"mask_size": args.mask, "overlap": args.overlap, "n_batch": args.n_batch, "mode": mode}
    b_box = args.b_box or None
    print(f"machine: {machine()}; torch threads: {args.threads or torch.get_num_threads()}; "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    shape = "x".join(map(str, args.size))
    print(f"volume: nibabel example4d.nii.gz (fMRI, 128x96x24, first volume) resampled to {shape}; "
          f"mask {args.mask}, overlap {args.overlap}, n_batch {args.n_batch}, mode {mode}, b_box {b_box}; "
          "MONAI networks, random init; one run each in a fresh process\n")
    print(f"{'model':<12} {'windows':>7} {'MONAI s':>9} {'incrinf s':>9} {'speedup':>8} {'theory':>7} "
          f"{'MONAI mem':>10} {'incrinf mem':>11} {'max rel err':>11}")
    for name in args.models:
        ours = in_child("incrinf", name, args.size, options, b_box, args.threads)
        theirs = in_child("monai", name, args.size, options, b_box, args.threads)
        err = float((ours["map"] - theirs["map"]).abs().max() / theirs["map"].abs().max())
        stats = ours["stats"]
        print(f"{name:<12} {stats['positions']:>7} {theirs['seconds']:>9.1f} {ours['seconds']:>9.1f} "
              f"{theirs['seconds'] / ours['seconds']:>7.2f}x {stats['theoretical_speedup']:>6.2f}x "
              f"{mib(theirs['memory']):>10} {mib(ours['memory']):>11} {err:>11.1e}", flush=True)
    print("\ntheory: FLOP ratio of the windows run (incrinf's own count); centred mask over the whole volume: " +
          ", ".join(f"{n} {theory(n, args.size, args.mask):.2f}x" for n in args.models))
    return 0


if __name__ == "__main__":
    sys.exit(main())
