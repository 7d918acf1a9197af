"""Approximate occlusion vs ``captum.attr.Occlusion``, side by side in one process.

(a) EfficientNet-Lite0 with its real ImageNet weights: tau tuned for a target SSIM (0.9) on some scikit-image
    photos, then used on other photos: speedup over Captum and the measured SSIM against the exact map, per
    photo; then the same with drill-down (r = 0.25, target 3) added. Captum runs on the same grid; its pixel
    attributions are checked against incrinf's exact map.
(b) VGG16, ResNet18, Inception3 (torchvision architectures, random init: speed does not depend on weights)
    at Krypton's tuned tau (0.5, 0.7, 0.9) with adaptive drill-down r = 0.25, target 3, patch 16, stride 4:
    speedup over Captum. Captum and exact incremental inference are timed on a coarse grid whose windows
    are a subset of the fine grid's and extrapolated per forward (their cost is linear in positions); the
    approximate run covers the whole fine grid.

Run: ``python benchmarks/obe_approx.py`` (about 10 minutes on an idle 2-core machine). Shrink with ``--size``,
``--stride``, ``--images``, ``--size-b``, ``--models``; ``--skip-a`` / ``--skip-b`` run one half.
Krypton's CPU ImageNet figures (4-core i7, batch 16): VGG16 19.9x, ResNet18 8.5x, Inception3 4.7x
(best, OCT: 34.5x, 14.8x, 8.0x).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import skimage.data
import torch

try:
    import incrinf  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from captum.attr import Occlusion as CaptumOcclusion

from incrinf import models
from incrinf.analysis import occlusion_grid
from incrinf.explain.approx import occlusion
from incrinf.explain.drilldown import DrillDown
from incrinf.explain.occlusion import occlusion as exact_occlusion
from incrinf.explain.runner import OcclusionRunner, estimate_batch_size
from incrinf.explain.tuning import DEFAULT_TAUS, heatmap_ssim, tune
from incrinf.validation import parse_bytes

TUNE_PHOTOS = ("chelsea", "astronaut", "coffee", "camera")
EVAL_PHOTOS = ("rocket", "immunohistochemistry", "hubble_deep_field", "retina", "motorcycle", "coins", "clock",
               "moon", "brick", "gravel")
KRYPTON = {  # model: (tau, CPU ImageNet speedup, best CPU speedup)
    "vgg16": (0.5, 19.9, 34.5),
    "resnet18": (0.7, 8.5, 14.8),
    "inception_v3": (0.9, 4.7, 8.0),
}
CAPTUM_BATCH = 16  # Krypton's CPU batch size for the naive baseline


def photo(name: str) -> np.ndarray:
    """A scikit-image photo as HxWx3 uint8 (grey photos replicated)."""
    img = skimage.data.stereo_motorcycle()[0] if name == "motorcycle" else getattr(skimage.data, name)()
    return np.stack([img] * 3, axis=-1) if img.ndim == 2 else img[..., :3]


def machine() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return (f"{platform.platform()}; {platform.processor() or platform.machine()}; {os.cpu_count()} CPUs; "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average "
            f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


def captum_heat(model: torch.nn.Module, x: torch.Tensor, patch: int, stride: int, target: int) -> torch.Tensor:
    """Captum's attribution (3, H, W) on the grid of (patch, stride)."""
    return CaptumOcclusion(model).attribute(x[None], sliding_window_shapes=(3, patch, patch),
                                            strides=(3, stride, stride), target=target,
                                            perturbations_per_eval=CAPTUM_BATCH)[0]


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


# --- (a) ---------------------------------------------------------------------------------------------------


def part_a(args: argparse.Namespace) -> None:
    name = "efficientnet_lite0"
    model = models.load(name)
    size, stride, patch = args.size, args.stride, 16
    rows, cols = (-(-(size - patch) // stride) + 1,) * 2
    print(f"\n(a) EfficientNet-Lite0 (ImageNet weights), {size}x{size}, patch {patch}, stride {stride} "
          f"({rows}x{cols} = {rows * cols} positions), target SSIM {args.target_ssim}")
    tune_names = TUNE_PHOTOS[:args.tune_images]
    profile, seconds = timed(tune, model, [models.preprocess(photo(n), name, size=size) for n in tune_names],
                             target_ssim=args.target_ssim, taus=args.taus, patch=patch, stride=stride,
                             progress=False, name=name, image_names=tune_names)
    print(f"tuned on {', '.join(tune_names)} in {seconds:.1f} s:")
    print("  " + profile.summary().replace("\n", "\n  "))
    print(f"\n{'photo':<22} {'class':>5} {'tau':>5} {'captum s':>9} {'exact s':>8} {'approx s':>9} "
          f"{'exact x':>8} {'approx x':>9} {'SSIM':>6} {'+dd x':>7} {'+dd SSIM':>8} {'captum-exact':>12}")
    ratios, exact_ratios, ssims, dd_ratios, dd_ssims = [], [], [], [], []
    warm = models.preprocess(photo(tune_names[0]), name, size=size)  # first-call costs stay out of the table
    captum_heat(model, warm, patch, patch, 0)
    for pname in EVAL_PHOTOS[:args.images]:
        x = models.preprocess(photo(pname), name, size=size)
        approx, t_approx = timed(occlusion, model, x, patch=patch, stride=stride, target_ssim=args.target_ssim,
                                 profile=profile, progress=False)
        target = approx.target
        exact, t_exact = timed(exact_occlusion, model, x, patch=patch, stride=stride, target=target,
                               progress=False)
        drilled, t_drill = timed(occlusion, model, x, patch=patch, stride=stride, target=target,
                                 target_ssim=args.target_ssim, profile=profile, progress=False,
                                 drill_down=DrillDown(0.25, 3.0))
        attribution, t_captum = timed(captum_heat, model, x, patch, stride, target)
        agreement = float((attribution[0] - torch.from_numpy(exact.pixel_map()).float()).abs().max())
        ssim = heatmap_ssim(exact.heatmap, approx.heatmap)
        ratios.append(t_captum / t_approx)
        exact_ratios.append(t_captum / t_exact)
        ssims.append(ssim)
        dd_ratios.append(t_captum / t_drill)
        dd_ssims.append(heatmap_ssim(exact.heatmap, drilled.heatmap))
        print(f"{pname:<22} {target:>5} {approx.stats['tau']:>5.2f} {t_captum:>9.2f} {t_exact:>8.2f} "
              f"{t_approx:>9.2f} {t_captum / t_exact:>7.2f}x {t_captum / t_approx:>8.2f}x {ssim:>6.3f} "
              f"{dd_ratios[-1]:>6.2f}x {dd_ssims[-1]:>8.3f} {agreement:>12.1e}", flush=True)
    ssims_arr = np.array(ssims)
    print(f"median speedup over Captum: approx {statistics.median(ratios):.2f}x, exact "
          f"{statistics.median(exact_ratios):.2f}x; SSIM >= {args.target_ssim}: "
          f"{(ssims_arr >= args.target_ssim).sum()}/{len(ssims)}, lowest {ssims_arr.min():.3f} "
          f"(never below {args.target_ssim - 0.1:.2f}: {bool((ssims_arr >= args.target_ssim - 0.1).all())})")
    print(f"with drill-down (r=0.25, target 3) on top: median {statistics.median(dd_ratios):.2f}x, median SSIM "
          f"{statistics.median(dd_ssims):.3f}; captum-exact = max |Captum attribution - incrinf exact pixel map|")


# --- (b) ---------------------------------------------------------------------------------------------------


def coarse_stride(patch: int, stride: int) -> int:
    """The largest multiple of ``stride`` that Captum accepts (a stride may not exceed the window): Captum on
    that grid runs a subset of the fine grid's positions."""
    return max(stride, patch // stride * stride)


def part_b(args: argparse.Namespace) -> None:
    patch, stride = 16, args.stride_b
    print(f"\n(b) approximate (Krypton's tau + drill-down r=0.25, target 3) vs naive re-inference, patch {patch}, "
          f"stride {stride}, batch {CAPTUM_BATCH} for the naive baseline")
    print(f"{'model':<13} {'input':>7} {'tau':>4} {'S1':>3} {'positions':>14} {'naive s':>9} {'(spread)':>8} "
          f"{'exact s':>8} {'approx s':>9} {'exact x':>8} {'approx x':>9} {'theory x':>9} {'Krypton':>13}")
    for name in args.models:
        tau, krypton, best = KRYPTON[name]
        size = args.size_b or models.info(name).input_size
        model = models.load(name)
        x = models.preprocess(photo("chelsea"), name, size=size)
        hw = (size, size)
        n_fine = len(occlusion_grid(hw, (patch, patch), (stride, stride)))
        with torch.no_grad():
            target = int(model(x[None]).argmax())
        coarse = coarse_stride(patch, stride)
        subset = occlusion_grid(hw, (patch, patch), (coarse, coarse))
        runner = OcclusionRunner(model, x[None])
        batch = estimate_batch_size(runner.graph, (patch, patch), parse_bytes("2GiB"), 1.0)
        runner.run(subset[:2], (patch, patch), 0.0, batch_size=2)  # warm up capture and caches, untimed
        _, naive_first = timed(captum_heat, model, x, patch, coarse, target)
        _, t_exact_sub = timed(runner.run, subset, (patch, patch), 0.0, batch_size=batch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result, t_approx = timed(occlusion, model, x, patch=patch, stride=stride, tau=tau, target=target,
                                     drill_down=DrillDown(0.25, 3.0), progress=False)
        _, naive_second = timed(captum_heat, model, x, patch, coarse, target)  # before and after: load drifts
        # Captum runs one forward per position plus the initial one
        naive = statistics.mean([naive_first, naive_second]) * (n_fine + 1) / (len(subset) + 1)
        spread = abs(naive_first - naive_second) / statistics.mean([naive_first, naive_second])
        exact = t_exact_sub / len(subset) * n_fine
        s = result.stats
        run = f"{s['stage_one_positions']}+{s['stage_two_positions']}/{n_fine}"
        print(f"{name:<13} {size:>3}x{size:<3} {tau:>4.1f} {s['stage_one_stride'][0]:>3} {run:>14} {naive:>9.1f} "
              f"{spread:>7.0%} {exact:>8.1f} {t_approx:>9.1f} {naive / exact:>7.2f}x {naive / t_approx:>8.2f}x "
              f"{s['theoretical_speedup']:>8.2f}x {krypton:>5.1f}x/{best:>4.1f}x", flush=True)
    print(f"naive = captum.attr.Occlusion (batch {CAPTUM_BATCH}) and exact incremental: timed on a coarse grid "
          f"(stride {coarse_stride(patch, stride)}, the largest Captum accepts; a subset of the same grid) "
          "and extrapolated per forward; Captum timed before and after the approximate run (spread = their "
          "difference). approx: the whole grid end to end (sampled-error check included). theory x = FLOPs of "
          "naive / FLOPs planned. Krypton = CPU ImageNet / best")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=224, help="(a) image size")
    parser.add_argument("--stride", type=int, default=8, help="(a) occlusion stride")
    parser.add_argument("--images", type=int, default=8, help="(a) held-out photos (at most 10)")
    parser.add_argument("--tune-images", type=int, default=4, help="(a) tuning photos (at most 4)")
    parser.add_argument("--target-ssim", type=float, default=0.9)
    parser.add_argument("--taus", type=lambda t: tuple(float(v) for v in t.split(",")), default=DEFAULT_TAUS,
                        help="(a) taus measured when tuning, comma-separated")
    parser.add_argument("--size-b", type=int, default=0, help="(b) image size (default: 224, 299 for Inception3)")
    parser.add_argument("--stride-b", type=int, default=4, help="(b) occlusion stride")
    parser.add_argument("--models", type=lambda t: t.split(","), default=list(KRYPTON))
    parser.add_argument("--skip-a", action="store_true")
    parser.add_argument("--skip-b", action="store_true")
    args = parser.parse_args(argv)
    print(f"machine: {machine()}")
    start = time.perf_counter()
    if not args.skip_a:
        part_a(args)
    if not args.skip_b:
        part_b(args)
    print(f"\ntotal {time.perf_counter() - start:.0f} s; load average at the end "
          f"{os.getloadavg()[0]:.1f} (others' jobs make every time longer; ratios are taken side by side)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
