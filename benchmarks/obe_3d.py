"""Occlusion sensitivity of 3-D networks on a real volume: MONAI's ``OcclusionSensitivity`` vs incrinf's drop-in,
side by side, over a whole volume and inside a bounding box (MONAI's ``b_box``).

The volume is the fMRI volume nibabel ships (``nibabel/tests/data/example4d.nii.gz``, MIT; its first time point,
128 x 96 x 24 voxels), read and standardised as ``incrinf explain`` reads volumes, then resampled (trilinear) to
``--size``. Networks are MONAI's, random init (speed and exactness do not depend on the weights): ResNet10,
DenseNet121, and a UNet segmenter (batch norm; MONAI's default instance norm normalises over the whole volume, so
no change stays local) explained through a region-of-interest reducer (class 1's logits summed over the central
eighth of the output, one score per volume; MONAI needs one score vector per example, so both methods get the UNet
wrapped in the reducer). Both methods get the same arguments (mask size, overlap, ``n_batch``, mode,
``b_box``) and the same torch threads.

Every run is one call in a fresh spawned process, which measures its time (incrinf: capture, executor, base and
plan included, and reported apart) and its peak resident-memory growth; the MONAI and incrinf runs of a network
alternate and repeat (``--repeats``), and the load average is printed with each. Next to the wall-time ratio the
table prints incrinf's plan: the theoretical FLOP ratio of the windows run (each window alone on its exact boxes),
the planned FLOP ratio (what its packed batches compute), and the ceiling of a whole call, which counts the base's
one full forward pass: ``windows * F / (F + windows * F / theory)``.

Whole volumes run at ``--whole-overlap 0.25`` (125 windows at 64^3) by default, so that MONAI's side takes a
minute rather than many; ``--monai-default`` runs them with MONAI's default occluder instead (mask 16, overlap
0.6: 729 windows at 64^3, several minutes of MONAI per network on one thread) and prints, per network, the
whole-volume speedup over MONAI at that occluder with its theory and ceiling.

Run: python benchmarks/obe_3d.py [--models resnet10 densenet121 unet] [--size 64x64x64] [--mask 16]
     [--overlap 0.6] [--whole-overlap 0.25] [--b-box 24 31 24 39 24 39] [--threads 1] [--repeats 1]
     python benchmarks/obe_3d.py --monai-default --models resnet10     # MONAI's default occluder, whole volume
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch
from _common import PeakRSS, load_average, machine, median, mib

from incrinf.testing.volumes import monai_network

MODELS = ("resnet10", "densenet121", "unet")
# MONAI's OcclusionSensitivity defaults (monai.visualize.OcclusionSensitivity: mask_size=16, overlap=0.6).
MONAI_MASK, MONAI_OVERLAP = 16, 0.6


def volume(size: tuple[int, int, int]) -> torch.Tensor:
    """(1, 1, *size) the nibabel fMRI volume, standardised and resampled."""
    import nibabel

    from incrinf.cli.volume import read_volume, resize

    path = os.path.join(os.path.dirname(nibabel.__file__), "tests", "data", "example4d.nii.gz")
    return resize(read_volume(path, 0), size)[None]


def one_run(method: str, name: str, size: tuple[int, int, int], options: dict, b_box: list[int] | None,
            threads: int) -> dict:
    """One occlusion-sensitivity call in this (fresh) process: seconds, peak RSS growth, the map, stats."""
    torch.set_grad_enabled(False)
    torch.set_num_threads(threads)
    warnings.simplefilter("ignore")
    model = monai_network(name, size)
    x = volume(size)
    if method == "monai":
        from monai.visualize import OcclusionSensitivity
    else:
        from incrinf.monai import OcclusionSensitivity
    occ = OcclusionSensitivity(model, verbose=False, **options)
    with PeakRSS() as mem:
        start, cpu = time.perf_counter(), time.thread_time()
        occ_map, _ = occ(x, b_box=b_box)
        seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
    return {"seconds": seconds, "cpu": cpu, "memory": mem.bytes, "file": mem.file_bytes,
            "map": occ_map.as_tensor().clone(), "stats": getattr(occ, "last_stats", {})}


def in_child(*args) -> dict:
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(one_run, args)


def size_arg(text: str) -> tuple[int, int, int]:
    size = tuple(int(v) for v in text.lower().split("x"))
    if len(size) != 3:
        raise argparse.ArgumentTypeError(f"expected DxHxW, got {text!r}")
    return size  # type: ignore[return-value]


def compare(name: str, case: str, size: tuple[int, int, int], options: dict, b_box: list[int] | None,
            threads: int, repeats: int) -> dict:
    runs: dict[str, list[dict]] = {"monai": [], "incrinf": []}
    loads = []
    for _ in range(repeats):
        for method in ("incrinf", "monai"):
            loads.append(load_average())
            runs[method].append(in_child(method, name, size, options, b_box, threads))
    ours, theirs = runs["incrinf"], runs["monai"]
    t_ours, t_theirs = median([r["seconds"] for r in ours]), median([r["seconds"] for r in theirs])
    s = ours[-1]["stats"]
    q, theory = s["positions"], s["theoretical_speedup"]
    ceiling = q / (1 + q / theory)
    err = max(float((o["map"] - t["map"]).abs().max() / t["map"].abs().max().clamp_min(1e-30))
              for o, t in zip(ours, theirs))
    speedup = t_theirs / t_ours
    fixed = (f"capture {s['capture_seconds']:.1f} + executor {s['executor_seconds']:.1f} + base "
             f"{s['base_seconds']:.1f} + plan {s['plan_seconds']:.2f} s")
    print(f"{name:<12} {case:<7} {q:>7} {t_theirs:>8.1f} {t_ours:>8.1f} {speedup:>7.2f}x {theory:>6.2f}x "
          f"{s['realized_flop_ratio']:>6.2f}x {ceiling:>7.2f}x {speedup / ceiling:>6.2f} "
          f"{mib(median([r['memory'] for r in theirs])):>9} {mib(median([r['memory'] for r in ours])):>9} "
          f"{err:>8.1e}", flush=True)
    c_ours, c_theirs = median([r["cpu"] for r in ours]), median([r["cpu"] for r in theirs])
    print(f"{'':<21}incrinf: {fixed}, batches {s['seconds']:.1f} s ({s['batches']} of {s['batch_size']}); "
          f"load {' | '.join(loads)}", flush=True)
    print(f"{'':<21}CPU seconds of the calling thread (all of a one-thread run's work; less swayed by other "
          f"jobs than wall time): MONAI {c_theirs:.1f}, incrinf {c_ours:.1f}: {c_theirs / c_ours:.2f}x, "
          f"{c_theirs / c_ours / ceiling:.2f} of the ceiling", flush=True)
    parts = ", ".join(f"{part} {mib(s[f'{part}_bytes'])}" for part in ("weights", "store", "base", "index", "batch",
                                                                       "budget"))
    measured = median([r["memory"] for r in ours])
    library = median([r["file"] for r in ours])
    work = measured - library
    print(f"{'':<21}memory: measured {mib(measured)} ({mib(library)} of it shared-library pages touched first), "
          f"the rest {mib(work)} against the byte model: predicted {mib(s['predicted_peak_bytes'])}, bound "
          f"{mib(s['bound_bytes'])} ({'within' if work <= s['bound_bytes'] else 'OVER'}); {parts}", flush=True)
    return {"windows": q, "speedup": speedup, "cpu_speedup": c_theirs / c_ours, "theory": theory,
            "plan": s["realized_flop_ratio"], "ceiling": ceiling,
            "monai_s": t_theirs, "ours_s": t_ours, "monai_mem": median([r["memory"] for r in theirs]),
            "ours_mem": measured}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    parser.add_argument("--size", type=size_arg, default=(64, 64, 64), help="DxHxW the volume is resampled to")
    parser.add_argument("--mask", type=int, default=16, help="mask_size (MONAI's default 16)")
    parser.add_argument("--overlap", type=float, default=0.6, help="overlap of the boxed runs (MONAI's default)")
    parser.add_argument("--whole-overlap", type=float, default=0.25,
                        help="overlap of the whole-volume runs (0.6 is MONAI's default: 729 windows at 64^3, minutes "
                             "per network for MONAI on 2 cores)")
    parser.add_argument("--n-batch", type=int, default=16, help="n_batch (MONAI's default 16)")
    parser.add_argument("--mode", default="gaussian", help="gaussian, mean_patch, mean_img or a number")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every run")
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs per method and case")
    parser.add_argument("--b-box", type=int, nargs="*", default=[24, 31, 24, 39, 24, 39],
                        help="bounding box of the boxed runs, [min, max] per axis, inclusive")
    parser.add_argument("--cases", nargs="*", default=["whole", "boxed"], choices=["whole", "boxed"])
    parser.add_argument("--monai-default", action="store_true",
                        help="whole volumes only, with MONAI's default occluder (mask 16, overlap 0.6: 729 windows "
                             "at 64^3), and a summary of each network's speedup over MONAI at it")
    args = parser.parse_args(argv)
    if args.monai_default:
        args.cases, args.mask, args.whole_overlap = ["whole"], MONAI_MASK, MONAI_OVERLAP
    mode = args.mode if args.mode in ("gaussian", "mean_patch", "mean_img") else float(args.mode)
    common = {"mask_size": args.mask, "n_batch": args.n_batch, "mode": mode}
    cases = {"whole": ({**common, "overlap": args.whole_overlap}, None),
             "boxed": ({**common, "overlap": args.overlap}, args.b_box)}
    print(f"machine: {machine()}; torch threads per run: {args.threads}; load average {load_average()}")
    shape = "x".join(map(str, args.size))
    print(f"volume: nibabel example4d.nii.gz (fMRI, 128x96x24, first volume) resampled to {shape}; mask {args.mask}, "
          f"n_batch {args.n_batch}, mode {mode}; whole: overlap {args.whole_overlap}; boxed: overlap "
          f"{args.overlap}, b_box {args.b_box}; MONAI networks, random init; {args.repeats} alternating run(s) per "
          "method in fresh processes (medians)\n")
    print("theory: FLOP ratio of the windows (each alone on its exact boxes); plan: FLOP ratio of incrinf's packed\n"
          "batches; ceiling: theory with the base's one full forward pass counted; vs ceil: speedup / ceiling;\n"
          "memory: peak resident growth of the call (the kernel's high-water mark, reset at the start, where Linux\n"
          "allows, else sampled every 5 ms; both methods the same way, each in a fresh process, the same n_batch,\n"
          "model and volume loaded before the measurement; incrinf's imports inside the call are counted);\n"
          "incrinf's predicted peak: its plan's byte model, max(weights it made + base (its forward pass keeping\n"
          "the store's values, then the tables made), weights + store + kept index + largest batch), every\n"
          "operator's working memory counted (reference convolutions' columns, oneDNN's reordered weights and\n"
          "blocked copies, max pools' indices); bound: max(that, budget) + 32 MiB freed between checks, the budget\n"
          "(naive re-inference's peak at n_batch, its operators' working memory on channels-first batches\n"
          "included) being what its allocator may keep; the bound covers the work's memory, not the\n"
          "shared-library pages the call touches first (printed apart)\n")
    print(f"{'model':<12} {'case':<7} {'windows':>7} {'MONAI s':>8} {'ours s':>8} {'speedup':>8} {'theory':>7} "
          f"{'plan':>7} {'ceiling':>8} {'vs ceil':>6} {'MONAI mem':>9} {'ours mem':>9} {'rel err':>8}")
    whole = {}
    for name in args.models:
        for case in args.cases:
            options, b_box = cases[case]
            row = compare(name, case, args.size, options, b_box, args.threads, args.repeats)
            if case == "whole":
                whole[name] = row
    if args.mask == MONAI_MASK and args.whole_overlap == MONAI_OVERLAP and whole:
        print(f"\nwhole volume at MONAI's default occluder (mask {MONAI_MASK}, overlap {MONAI_OVERLAP}), {shape}:")
        for name, r in whole.items():
            print(f"  {name}: {r['windows']} windows, {r['speedup']:.2f}x over MONAI ({r['monai_s']:.1f} s / "
                  f"{r['ours_s']:.1f} s; {r['cpu_speedup']:.2f}x in CPU seconds); theory {r['theory']:.2f}x, "
                  f"plan {r['plan']:.2f}x, ceiling "
                  f"{r['ceiling']:.2f}x ({r['speedup'] / r['ceiling']:.2f} of it); peak memory {mib(r['ours_mem'])} "
                  f"against MONAI's {mib(r['monai_mem'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
