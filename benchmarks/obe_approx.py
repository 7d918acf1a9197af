"""Approximate occlusion vs exact incrinf and ``captum.attr.Occlusion``, side by side in one process.

(a) Real weights: EfficientNet-Lite0 and EfficientNet-Lite1 (ImageNet), patch 16, strides 8 and 4. For each
    model and stride, a profile is tuned for a target SSIM (0.9) with the default knobs (pruning thresholds,
    drill-downs) on four scikit-image photos, then used on at least eight other photos. Per photo: the setting
    used, wall-time speed over exact incrinf and over Captum, the multiply-add (FLOP) speed over exact, the true
    SSIM against the exact map (of the raw heat maps, incrinf's measure, and Krypton's: of the rendered
    overlays), the run's own estimate (sampled cells) and the profile's prediction. Summary:
    median and worst SSIM, median speeds, and whether the issue's goal (median SSIM >= 0.9, worst >= 0.8,
    >= 3x over exact) is met. When the tuner finds no setting that holds the target with a speedup, the profile
    is the exact path (the run says so) and the row is the exact run. Captum runs on the coarse grid of
    stride = patch (a subset of the fine grid) once per model and stride, and is extrapolated per forward
    (its cost is one forward per position, whatever the photo), at the first and the last photo (the faster of
    the two counts); its attributions are checked against incrinf's exact pixel map there.
(b) VGG16, ResNet18, Inception3 (torchvision architectures, random init: speed does not depend on weights)
    at Krypton's tuned tau (0.5, 0.7, 0.9) with adaptive drill-down r = 0.25, target 3, patch 16, stride 4:
    speedup over Captum. Captum and exact incremental inference are timed on a coarse grid whose windows
    are a subset of the fine grid's and extrapolated per forward (their cost is linear in positions); the
    approximate run covers the whole fine grid.

Run: ``python benchmarks/obe_approx.py`` (about 90 minutes on an idle 2-core machine, most of it stride 4).
Shrink with ``--real-models``, ``--strides``, ``--images``, ``--size``; (b) with ``--size-b``, ``--models``;
``--skip-a`` / ``--skip-b`` run one half. Tuning speeds are multiply-add ratios by default (``--tune-speed
wall`` for wall time; FLOPs are repeatable on a shared machine); the table reports both.
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
from incrinf.explain.dataset.stats import blend
from incrinf.explain.drilldown import DrillDown
from incrinf.explain.occlusion import occlusion
from incrinf.explain.quality import heatmap_ssim, overlay_ssim
from incrinf.explain.runner import OcclusionRunner
from incrinf.explain.tuning import tune
from incrinf.validation import parse_bytes

REAL_MODELS = ("efficientnet_lite0", "efficientnet_lite1")
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


def captum_seconds_per_forward(model: torch.nn.Module, x: torch.Tensor, patch: int, target: int,
                                warm_up: bool) -> tuple[float, torch.Tensor]:
    """Captum's seconds per forward on the grid of stride = patch, and its attribution (3, H, W) there."""
    if warm_up:  # first-call costs stay out of the figure
        captum_heat(model, x, patch, patch, target)
    attribution, seconds = timed(captum_heat, model, x, patch, patch, target)
    n = len(occlusion_grid(tuple(x.shape[-2:]), (patch, patch), (patch, patch)))
    return seconds / (n + 1), attribution


def approximate_run(model: torch.nn.Module, x: torch.Tensor, patch: int, stride: int, target: int,
                    profile) -> tuple[object, float, str] | None:
    """The run a user gets with the profile: (result, seconds, setting); None when the profile recorded that
    nothing faster holds its target (``occlusion`` refuses such a profile with a clear error; the user runs
    the exact path)."""
    try:
        result, seconds = timed(occlusion, model, x, patch=patch, stride=stride, target=target,
                                target_ssim=profile.target_ssim, profile=profile, progress=False)
        return result, seconds, result.stats.setting.description
    except ValueError as err:
        if "exact path" not in str(err):
            raise
        return None


def krypton_ssim(exact, approx, x: torch.Tensor, name: str) -> float:
    """Krypton's quality measure: SSIM of the rendered overlays (each heat map's pixel map in heat colours,
    blended over the photo as incrinf's overlay pictures draw it)."""
    photo_u8 = (models.unnormalize(x, name) * 255).round().astype(np.uint8)
    return overlay_ssim(blend(photo_u8, exact.pixel_map()), blend(photo_u8, approx.pixel_map()))


def part_a(args: argparse.Namespace) -> list[str]:
    patch, summaries = 16, []
    for name in args.real_models:
        model = models.load(name)
        size = args.size or models.info(name).input_size
        for stride in args.strides:
            n = len(occlusion_grid((size, size), (patch, patch), (stride, stride)))
            print(f"\n(a) {name} (ImageNet weights), {size}x{size}, patch {patch}, stride {stride} ({n} positions), "
                  f"target SSIM {args.target_ssim}", flush=True)
            tune_names = TUNE_PHOTOS[:args.tune_images]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                samples = [models.preprocess(photo(p), name, size=size) for p in tune_names]
                profile, seconds = timed(tune, model, samples,
                                         target_ssim=args.target_ssim, patch=patch, stride=stride, holdout=0.0,
                                         speed=args.tune_speed, progress=False, name=name, image_names=tune_names)
            print(f"tuned on {', '.join(tune_names)} in {seconds:.0f} s ({args.tune_speed} speeds):")
            print("  " + profile.summary().replace("\n", "\n  "))
            for w in caught:
                print(f"  tune warned: {w.message}")
            print(f"{'photo':<21} {'class':>5} {'setting':<30} {'exact s':>8} {'approx s':>8} {'vs exact':>8} "
                  f"{'FLOP x':>7} {'vs Captum':>9} {'SSIM':>6} {'overlay':>7} {'estim.':>6} {'pred.':>6}", flush=True)
            rows, captum_per_forward = [], None
            for pname in EVAL_PHOTOS[:args.images]:
                x = models.preprocess(photo(pname), name, size=size)
                with torch.no_grad():
                    target = int(model(x[None]).argmax())
                exact, t_exact = timed(occlusion, model, x, patch=patch, stride=stride, target=target,
                                       progress=False)
                if captum_per_forward is None:  # checked against incrinf's exact map on the same windows
                    coarse = occlusion(model, x, patch=patch, stride=patch, target=target, progress=False)
                    captum_per_forward, attribution = captum_seconds_per_forward(model, x, patch, target, True)
                    agreement = float((attribution[0] - torch.from_numpy(coarse.pixel_map()).float()).abs().max())
                run = approximate_run(model, x, patch, stride, target, profile)
                result, t_approx, setting = run if run is not None else (exact, t_exact, "exact (unreachable)")
                if pname == EVAL_PHOTOS[:args.images][-1]:  # again at the end: the faster of two, load drifts
                    captum_per_forward = min(captum_per_forward,
                                             captum_seconds_per_forward(model, x, patch, target, False)[0])
                t_captum = captum_per_forward * (n + 1)
                ssim = heatmap_ssim(exact.heatmap, result.heatmap)
                overlay = krypton_ssim(exact, result, x, name)
                flop = result.stats.realized_flop_ratio / exact.stats.realized_flop_ratio
                error, setting_used = result.stats.error, result.stats.setting
                est = error.ssim if error.method == "sampled" and error.ssim is not None else float("nan")
                pred = setting_used.predicted_ssim if setting_used.predicted_ssim is not None else float("nan")
                rows.append((t_exact / t_approx, flop, t_approx, ssim, est, overlay))
                print(f"{pname:<21} {target:>5} {setting[:30]:<30} {t_exact:>8.2f} {t_approx:>8.2f} "
                      f"{t_exact / t_approx:>7.2f}x {flop:>6.2f}x {t_captum / t_approx:>8.1f}x {ssim:>6.3f} "
                      f"{overlay:>7.3f} {est:>6.3f} {pred:>6.3f}", flush=True)
            arr = np.array(rows)
            med_ssim, worst = float(np.median(arr[:, 3])), float(arr[:, 3].min())
            med_speed = float(np.median(arr[:, 0]))
            met = med_ssim >= 0.9 and worst >= 0.8 and med_speed >= 3.0 and not profile.setting.exact
            over_captum = float(np.median(captum_per_forward * (n + 1) / arr[:, 2]))
            est_gap = np.nanmedian(np.abs(arr[:, 4] - arr[:, 3])) if np.isfinite(arr[:, 4]).any() else float("nan")
            line = (f"{name} stride {stride}: SSIM median {med_ssim:.3f}, worst {worst:.3f} (Krypton's overlay SSIM "
                    f"median {np.median(arr[:, 5]):.3f}, worst {arr[:, 5].min():.3f}); over exact "
                    f"{med_speed:.2f}x (FLOPs {np.median(arr[:, 1]):.2f}x); over Captum {over_captum:.1f}x "
                    f"(Captum {captum_per_forward * 1e3:.1f} ms/forward, max |Captum - exact| {agreement:.1e}); "
                    f"|estimated - true SSIM| median {est_gap:.3f}; goal (0.9/0.8/3x) {'met' if met else 'NOT met'}")
            print(line, flush=True)
            summaries.append(line)
    return summaries


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
        runner.run(subset[:2], (patch, patch), 0.0, batch_size=2)  # warm up capture and caches, untimed
        _, naive_first = timed(captum_heat, model, x, patch, coarse, target)
        _, t_exact_sub = timed(runner.run, subset, (patch, patch), 0.0, batch_size=None,
                                 memory=parse_bytes("2GiB"))
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
    parser.add_argument("--real-models", type=lambda t: t.split(","), default=list(REAL_MODELS),
                        help="(a) real-weights models, comma-separated")
    parser.add_argument("--size", type=int, default=0, help="(a) image size (default: the model's)")
    parser.add_argument("--strides", type=lambda t: [int(v) for v in t.split(",")], default=[8, 4],
                        help="(a) occlusion strides, comma-separated")
    parser.add_argument("--images", type=int, default=8, help="(a) held-out photos (at most 10)")
    parser.add_argument("--tune-images", type=int, default=4, help="(a) tuning photos (at most 4)")
    parser.add_argument("--tune-speed", choices=("flops", "wall"), default="flops")
    parser.add_argument("--target-ssim", type=float, default=0.9)
    parser.add_argument("--size-b", type=int, default=0, help="(b) image size (default: 224, 299 for Inception3)")
    parser.add_argument("--stride-b", type=int, default=4, help="(b) occlusion stride")
    parser.add_argument("--models", type=lambda t: t.split(","), default=list(KRYPTON))
    parser.add_argument("--skip-a", action="store_true")
    parser.add_argument("--skip-b", action="store_true")
    args = parser.parse_args(argv)
    print(f"machine: {machine()}")
    start = time.perf_counter()
    summaries = part_a(args) if not args.skip_a else []
    if not args.skip_b:
        part_b(args)
    if summaries:
        print("\nsummary (a):\n" + "\n".join(summaries))
    print(f"\ntotal {time.perf_counter() - start:.0f} s; load average at the end "
          f"{os.getloadavg()[0]:.1f} (others' jobs make every time longer; ratios are taken side by side)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
