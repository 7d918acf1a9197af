"""Explaining a dataset: inputs per minute in-process, on 2 local worker processes and on 2 Ray actors.

Writes a folder of scikit-image photos and explains it with the real EfficientNet-Lite0 four ways (in-process
with 1 torch thread and with all, 2 local processes, 2 Ray actors); prints inputs per minute (explaining phase,
start-up apart) and the scaling efficiency: the speedup over the 1-thread run divided by the cores used. Every
configuration starts from an empty output folder; the runs must agree (same classes, heat maps equal to float
tolerance: the thread count changes float sums).

    python benchmarks/dataset.py                      # 12 photos, patch 16, stride 8 (729 positions each)
    python benchmarks/dataset.py --images 16 --stride 16 --keep /tmp/gallery-run
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
from _common import machine  # noqa: E402

import incrinf  # noqa: E402
from incrinf.explain.executors import available_cores  # noqa: E402

# RGB or grey photos shipped inside the scikit-image wheel (nothing is downloaded).
PHOTOS = ("chelsea", "astronaut", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina",
          "coins", "camera", "moon", "page", "text", "brick", "grass", "gravel", "colorwheel", "logo", "clock")


def write_photos(folder: Path, count: int) -> list[str]:
    import skimage.data
    from PIL import Image

    names = []
    for name in PHOTOS:
        if len(names) == count:
            break
        try:
            image = getattr(skimage.data, name)()
        except Exception:  # not in this scikit-image version, or it would need a download
            continue
        if image.ndim == 2:
            image = np.stack([image] * 3, axis=-1)
        if image.dtype != np.uint8:
            image = (255 * (image / max(float(image.max()), 1e-12))).astype(np.uint8)
        Image.fromarray(np.ascontiguousarray(image[..., :3])).save(folder / f"{name}.png")
        names.append(name)
    if len(names) < count:
        raise SystemExit(f"only {len(names)} sample photos available; use --images {len(names)}")
    return names


def run(label: str, photos: Path, out: Path, args: argparse.Namespace, cores: int, **how) -> dict:
    start = time.perf_counter()
    report = incrinf.explain_dataset("efficientnet_lite0", photos, out, size=args.size, patch=args.patch,
                                     stride=args.stride, output="prob", progress=False, **how)
    wall = time.perf_counter() - start
    if report.exit_code != 0:
        raise SystemExit(f"{label}: {report.summary()}")
    print(f"  {label}: {report.computed} inputs in {report.seconds:.1f} s after {report.startup_seconds:.1f} s "
          f"start-up (wall {wall:.1f} s)", flush=True)
    return {"label": label, "rate": report.inputs_per_minute, "seconds": report.seconds,
            "startup": report.startup_seconds, "cores": cores, "out": out}


def table(out: Path) -> list[dict[str, str]]:
    with open(out / "results.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def check_agree(reference: Path, other: Path) -> float:
    """Largest heat-map difference between two runs; the explained classes must be the same."""
    worst = 0.0
    for a, b in zip(table(reference), table(other)):
        assert a["path"] == b["path"] and a["target"] == b["target"], (a["path"], b["path"])
        diff = np.abs(np.load(reference / a["heatmap_file"]) - np.load(other / b["heatmap_file"])).max()
        worst = max(worst, float(diff))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=12)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--patch", type=int, default=16)
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray configuration")
    parser.add_argument("--keep", help="copy the in-process run's folder (table, gallery) here")
    args = parser.parse_args()

    print(machine())
    positions = (-(-(args.size - args.patch) // args.stride) + 1) ** 2
    print(f"EfficientNet-Lite0 (real weights), {args.images} scikit-image photos at {args.size} px, patch "
          f"{args.patch}, stride {args.stride} ({positions} positions each), exact")
    with tempfile.TemporaryDirectory(prefix="incrinf-dataset-bench-") as tmp:
        photos = Path(tmp) / "photos"
        photos.mkdir()
        write_photos(photos, args.images)
        cores = available_cores()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        results = [run("in-process, 1 torch thread", photos, Path(tmp) / "one-thread", args, cores=1)]
        torch.set_num_threads(threads)
        results.append(run(f"in-process, {threads} torch threads (the default)", photos, Path(tmp) / "one", args,
                           cores=threads))
        per_worker = max(1, cores // 2)
        results.append(run(f"2 local processes x {per_worker} thread(s)", photos, Path(tmp) / "two", args,
                           cores=2 * per_worker, workers=2))
        if not args.no_ray:
            try:
                import ray  # noqa: F401
            except ImportError:
                print("  Ray is not installed: pip install 'incrinf[ray]' (skipped)")
            else:
                results.append(run(f"Ray, 2 actors x {per_worker} CPU(s), local cluster", photos, Path(tmp) / "ray",
                                   args, cores=2 * per_worker, ray=True, workers=2, cpus_per_worker=per_worker))
        diffs = [check_agree(results[0]["out"], r["out"]) for r in results[1:]]
        base = results[0]["rate"]
        print()
        print("| configuration | cores used | inputs/min | speedup | scaling efficiency | start-up s |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in results:
            speedup = r["rate"] / base
            print(f"| {r['label']} | {r['cores']} | {r['rate']:.1f} | {speedup:.2f}x | {speedup / r['cores']:.0%} | "
                  f"{r['startup']:.1f} |")
        print("\nspeedup and scaling efficiency (speedup / cores used) are over the 1-thread in-process run")
        print(f"\nlargest heat-map difference from the in-process run: {max(diffs, default=0.0):.2g} "
              "(thread counts change float sums)")
        if args.keep:
            import shutil

            shutil.copytree(results[0]["out"], args.keep, dirs_exist_ok=True)
            print(f"in-process run's folder copied to {args.keep}")


if __name__ == "__main__":
    main()
