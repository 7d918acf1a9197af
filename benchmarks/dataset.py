"""Explaining a dataset: inputs per minute in-process, on 2 local worker processes and on 2 Ray actors.

Writes a folder of scikit-image photos and explains it with the real EfficientNet-Lite0 four ways (in-process
with 1 torch thread and with all, 2 local processes, 2 Ray actors); prints inputs per minute (explaining phase,
start-up apart) and the scaling efficiency: the speedup over the 1-thread run divided by the cores used. Every
configuration starts from an empty output folder; the runs must agree (same classes, heat maps equal to float
tolerance: the thread count changes float sums).

    python benchmarks/dataset.py                      # 12 photos, patch 16, stride 8 (729 positions each)
    python benchmarks/dataset.py --images 6 --rounds 3   # alternating rounds, median rates (a shared machine)
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
from _common import machine, median  # noqa: E402

import incrinf  # noqa: E402
from incrinf.explain.dataset.executors import available_cores  # noqa: E402

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
    incrinf.runtime_cache().clear()  # every run starts cold, like a fresh `incrinf explain` (workers always do)
    start = time.perf_counter()
    report = incrinf.explain_dataset("efficientnet_lite0", photos, out, size=args.size, patch=args.patch,
                                     stride=args.stride, output="prob", progress=False, **how)
    wall = time.perf_counter() - start
    if report.exit_code != 0 or report.computed != args.images:
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
    parser.add_argument("--rounds", type=int, default=1, help="rounds of all configurations (median rates)")
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
        per_worker = max(1, cores // 2)
        configs = [
            ("in-process, 1 torch thread", 1, {"threads": 1}),
            (f"in-process, {threads} torch threads (the default)", threads, {"threads": threads}),
            (f"2 local processes x {per_worker} thread(s)", 2 * per_worker, {"workers": 2}),
        ]
        if not args.no_ray:
            try:
                import ray  # noqa: F401
            except ImportError:
                print("  Ray is not installed: pip install 'incrinf[ray]' (skipped)")
            else:
                configs.append((f"Ray, 2 actors x {per_worker} CPU(s), local cluster", 2 * per_worker,
                                {"ray": True, "workers": 2, "cpus_per_worker": per_worker}))
        # every round runs every configuration, in an order rotated by one per round, so that a change in the
        # machine's load falls on all of them
        runs: dict[str, list[dict]] = {label: [] for label, _, _ in configs}
        for round_ in range(args.rounds):
            for shift in range(len(configs)):
                which = (round_ + shift) % len(configs)
                label, used, how = configs[which]
                how = dict(how)
                torch.set_num_threads(how.pop("threads", threads))
                out = Path(tmp) / f"round{round_}-config{which}"  # a fresh folder: nothing to skip
                runs[label].append(run(label, photos, out, args, cores=used, **how))
                torch.set_num_threads(threads)
        reference = runs[configs[0][0]][0]["out"]
        diffs = [check_agree(reference, r["out"]) for rs in runs.values() for r in rs]
        rates = {label: median([r["rate"] for r in runs[label]]) for label in runs}
        base = rates[configs[0][0]]
        print()
        print("| configuration | cores used | inputs/min | speedup | scaling efficiency | start-up s |")
        print("| --- | --- | --- | --- | --- | --- |")
        for label, used, _ in configs:
            speedup = rates[label] / base
            startup = median([r["startup"] for r in runs[label]])
            print(f"| {label} | {used} | {rates[label]:.1f} | {speedup:.2f}x | {speedup / used:.0%} | {startup:.1f} |")
        print(f"\nmedian of {args.rounds} round(s); speedup and scaling efficiency (speedup / cores used) are over "
              "the 1-thread in-process run")
        print(f"largest heat-map difference between runs: {max(diffs, default=0.0):.2g} "
              "(thread counts change float sums)")
        with open("/proc/loadavg") as fh:
            print(f"load average at the end: {' '.join(fh.read().split()[:3])}")
        if args.keep:
            import shutil

            shutil.copytree(reference, args.keep, dirs_exist_ok=True)
            print(f"in-process run's folder copied to {args.keep}")


if __name__ == "__main__":
    main()
