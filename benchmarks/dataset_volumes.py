"""A folder of NIfTI scans end to end: ``incrinf.explain_dataset`` against MONAI's ``OcclusionSensitivity`` looped
over the same files, side by side in one process.

Writes a folder of scans made from the fMRI file nibabel ships (its two volumes and their left-right mirror
images: four real scans), resampled to ``--resize``, and explains every scan with the zoo's 3-D DenseNet121
(MONAI's, random init; ``--network resnet10``: MONAI's 3-D ResNet10) both ways: incrinf's dataset mode (reading
the files, explaining, writing the heat maps, NIfTI voxel maps, montages, table and gallery) and a loop that
reads each scan the same way and calls MONAI's ``OcclusionSensitivity`` with the same windows (``mask_size`` =
patch, ``overlap`` = 1 - stride / patch: MONAI's sliding window then puts its windows on the same stride grid; a
constant 0 occluder, softmax outputs). With stride = patch (no overlap, each voxel in one window) it checks that
both give the same drops (MONAI's occluded probability at each window against incrinf's heat map). It prints
scans per minute, the wall-time ratio and the multiply-add ratio (naive re-inference of every window against
what incrinf's plans ran), per round, with the load average. Rounds alternate which side runs first.

    python benchmarks/dataset_volumes.py                       # 4 scans at 32x64x64, patch 16, stride 8, 1 thread
    python benchmarks/dataset_volumes.py --stride 16           # no overlap: MONAI's map checked against incrinf's
    python benchmarks/dataset_volumes.py --network resnet10    # MONAI's 3-D ResNet10
    python benchmarks/dataset_volumes.py --rounds 3 --resize 48x64x64 --threads 2
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median  # noqa: E402

import incrinf  # noqa: E402
from incrinf import models  # noqa: E402
from incrinf.cli.volume import read_volume, resize, volume_size  # noqa: E402

MODEL = "monai_densenet121_3d"


def network(name: str) -> torch.nn.Module | str:
    """The model both sides explain: the zoo's DenseNet121 by name, or MONAI's ResNet10 (random init, seeded)."""
    if name == "densenet121":
        return MODEL
    from monai.networks.nets import resnet10

    torch.manual_seed(0)
    return resnet10(spatial_dims=3, n_input_channels=1, num_classes=2).eval()


def write_scans(folder: Path) -> list[Path]:
    """Four scans: the fMRI file's two volumes and their left-right mirror images."""
    import nibabel

    example = Path(nibabel.__file__).parent / "tests" / "data" / "example4d.nii.gz"
    fmri = nibabel.load(example)
    data = np.asarray(fmri.dataobj, np.float32)
    paths = []
    for t in range(data.shape[3]):
        for mirrored in (False, True):
            volume = data[::-1, :, :, t] if mirrored else data[..., t]
            path = folder / f"sub-{t + 1:02d}{'-mirrored' if mirrored else ''}.nii.gz"
            nibabel.save(nibabel.Nifti1Image(np.ascontiguousarray(volume), fmri.affine), path)
            paths.append(path)
    return paths


def run_incrinf(scans: Path, out: Path, args: argparse.Namespace) -> tuple[float, list[dict[str, str]]]:
    incrinf.runtime_cache().clear()  # cold, as a fresh `incrinf explain scans/ --out results/` starts
    start = time.perf_counter()
    report = incrinf.explain_dataset(args.model, scans, out, resize=args.resize, patch=args.patch, stride=args.stride,
                                     output="prob", progress=False)
    wall = time.perf_counter() - start
    if report.exit_code != 0:
        raise SystemExit(report.summary())
    with open(out / "results.csv", newline="") as fh:
        return wall, list(csv.DictReader(fh))


def run_monai(paths: list[Path], args: argparse.Namespace) -> tuple[float, list[tuple[torch.Tensor, torch.Tensor]]]:
    from monai.visualize import OcclusionSensitivity

    model = models.load(MODEL) if isinstance(args.model, str) else args.model
    start = time.perf_counter()
    maps = []
    for path in paths:
        x = resize(read_volume(str(path)), args.resize)[None]
        occ = OcclusionSensitivity(model, mask_size=args.patch, n_batch=args.n_batch, mode=0.0,
                                   overlap=1.0 - args.stride / args.patch,
                                   activate=lambda out: out.softmax(1), verbose=False)
        with torch.no_grad():
            occ_map, _ = occ(x)
            plain = model(x).softmax(1)[0]
        maps.append((occ_map[0], plain))
    return time.perf_counter() - start, maps


def check_same(rows: list[dict[str, str]], out: Path, maps: list[tuple[torch.Tensor, torch.Tensor]],
               patch: int) -> float:
    """Largest difference between incrinf's drops and MONAI's (unoccluded minus occluded probability)."""
    worst = 0.0
    for row, (occ_map, plain) in zip(rows, maps):
        heat = np.load(out / row["heatmap_file"])
        k = int(row["target"])
        corners = occ_map[k, ::patch, ::patch, ::patch]  # overlap 0: each window's value fills the window
        drops = (plain[k] - corners).numpy()
        worst = max(worst, float(np.abs(drops - heat).max()))
    return worst


def multiply_adds(rows: list[dict[str, str]], out: Path) -> tuple[float, float]:
    """(naive re-inference of every window, what incrinf ran), summed over the scans, from the runs' stats."""
    import json

    naive = ran = 0.0
    for row in rows:
        stats = json.loads((out / "items" / f"{row['id']}.json").read_text())["stats"]
        naive += stats["flops_full"] * stats["positions"]
        ran += stats["flops_full"] * stats["positions"] / stats["realized_flop_ratio"]
    return naive, ran


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resize", type=volume_size, default=(32, 64, 64), help="DxHxW every scan is resampled to")
    parser.add_argument("--patch", type=int, default=16, help="window (MONAI: mask_size)")
    parser.add_argument("--stride", type=int, default=8, help="window stride (MONAI: overlap 1 - stride / patch)")
    parser.add_argument("--n-batch", type=int, default=16, help="MONAI's windows per batch")
    parser.add_argument("--network", choices=["densenet121", "resnet10"], default="densenet121",
                        help="the zoo's 3-D DenseNet121, or MONAI's 3-D ResNet10 (both random init)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.model = network(args.network)
    print(machine())
    if not 0 < args.stride <= args.patch:
        raise SystemExit("--stride must be in 1..patch (MONAI's overlap is 1 - stride / patch)")
    grid = [-(-(n - args.patch) // args.stride) + 1 for n in args.resize]
    print(f"{args.network} (MONAI's, random init), 4 scans from nibabel's example4d.nii.gz resampled to "
          f"{'x'.join(map(str, args.resize))}, window {args.patch} at stride {args.stride} "
          f"({int(np.prod(grid))} windows per scan), exact, {args.threads} torch thread(s)")
    results = {"incrinf": [], "monai": []}
    with tempfile.TemporaryDirectory(prefix="incrinf-volumes-bench-") as tmp:
        scans = Path(tmp) / "scans"
        scans.mkdir()
        paths = sorted(write_scans(scans))
        for round_ in range(args.rounds):
            out = Path(tmp) / f"run{round_}"
            order = ("incrinf", "monai") if round_ % 2 == 0 else ("monai", "incrinf")
            for side in order:
                if side == "incrinf":
                    wall, rows = run_incrinf(scans, out, args)
                    results["incrinf"].append(wall)
                else:
                    wall, maps = run_monai(paths, args)
                    results["monai"].append(wall)
            same = "not checked (overlapping windows: MONAI blends them)"
            if args.stride == args.patch:
                same = f"{check_same(rows, out, maps, args.patch):.1g}"
            naive, ran = multiply_adds(rows, out)
            with open("/proc/loadavg") as fh:
                load = " ".join(fh.read().split()[:3])
            print(f"round {round_ + 1} ({' first, '.join(order)} second): incrinf {results['incrinf'][-1]:.1f} s, "
                  f"MONAI {results['monai'][-1]:.1f} s, {results['monai'][-1] / results['incrinf'][-1]:.2f}x; "
                  f"multiply-adds {naive / ran:.2f}x fewer; largest drop difference {same}; load {load}",
                  flush=True)
    n = len(paths)
    inc, mon = median(results["incrinf"]), median(results["monai"])
    print()
    print("| | scans | wall s (median) | scans/min | vs MONAI |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| MONAI `OcclusionSensitivity`, a loop over the files | {n} | {mon:.1f} | {60 * n / mon:.1f} | 1.00x |")
    print(f"| `incrinf.explain_dataset` (files, NIfTI maps, montages, gallery) | {n} | {inc:.1f} | "
          f"{60 * n / inc:.1f} | {mon / inc:.2f}x |")
    print(f"multiply-adds: naive re-inference of every window / what incrinf ran = {naive / ran:.2f}x "
          f"(the wall ratio's ceiling without fixed costs)")


if __name__ == "__main__":
    main()
