"""Exact occlusion-based explanation on the CPU: incrinf vs captum.attr.Occlusion, side by side.

Both run in this process on the same image, the same grid (patch 16, --stride) and the same batch size
(Captum's ``perturbations_per_eval``), plus plain batched re-inference in channels-last layout (what the layout
alone gains). Runs alternate (Captum, incrinf, Captum, ...) and medians are quoted,
since this machine is shared and noisy. Memory is the peak resident-set growth of one run in a forked
child (the same method for both).

Run: python benchmarks/obe_exact.py [--stride 16] [--batch 16] [--repeats 3] [--models vgg16 resnet18 ...]
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from _common import machine, median, mib, peak_rss_in_child, timed
from captum.attr import Occlusion as CaptumOcclusion

from incrinf import models
from incrinf.analysis import occlusion_grid
from incrinf.captum import Occlusion as IncrinfOcclusion

KRYPTON_CPU = {"vgg16": 5.4, "resnet18": 2.1, "inception_v3": 1.5}


_CACHE: dict = {}


def one_run(method: str, name: str, stride: int, batch: int, patch: int, warm: bool = False) -> None:
    """One attribution with ``method`` (for memory measurement in a child process)."""
    torch.set_grad_enabled(False)
    if name not in _CACHE:
        model = models.load(name)
        size = models.info(name).input_size
        _CACHE[name] = (model, models.preprocess(models.sample_image(), name, size)[None])
    model, image = _CACHE[name]
    cls = CaptumOcclusion if method == "captum" else IncrinfOcclusion
    if warm:  # only load the model and image
        return
    cls(model).attribute(image, (3, patch, patch), strides=(3, stride, stride), target=0,
                         perturbations_per_eval=batch)


def channels_last_full(model: torch.nn.Module, image: torch.Tensor, patch: int, stride: int, batch: int,
                       target: int) -> torch.Tensor:
    """Plain batched re-inference of every occluded copy, with the model in channels-last layout (incrinf's
    layout): separates what incremental inference gains from what the memory layout alone gains."""
    corners = occlusion_grid(tuple(image.shape[-2:]), (patch, patch), (stride, stride))  # Captum's grid
    out = []
    for lo in range(0, len(corners), batch):
        chunk = corners[lo:lo + batch]
        x = image.expand(len(chunk), -1, -1, -1).clone()
        for k, (y, xx) in enumerate(chunk):
            x[k, :, y:y + patch, xx:xx + patch] = 0.0  # windows past the edge are cropped, as in Captum
        out.append(model(x.contiguous(memory_format=torch.channels_last))[:, target])
    return torch.cat(out)


def run_model(name: str, stride: int, batch: int, repeats: int, patch: int) -> dict:
    model = models.load(name)
    size = models.info(name).input_size
    image = models.preprocess(models.sample_image(), name, size)[None]
    target = int(model(image).argmax()) if name == "efficientnet_lite0" else 0
    window = (3, patch, patch)
    strides = (3, stride, stride)
    captum = CaptumOcclusion(model)
    incr = IncrinfOcclusion(model)
    kwargs = dict(strides=strides, target=target, perturbations_per_eval=batch)
    incr.attribute(image, window, **kwargs)  # warm-up: capture, materialization code paths, plan cache
    cl_model = copy.deepcopy(model).to(memory_format=torch.channels_last)
    t_c, t_i, t_l = [], [], []
    err = 0.0
    for _ in range(repeats):
        s, _, want = timed(lambda: captum.attribute(image, window, **kwargs))
        t_c.append(s)
        s, _, got = timed(lambda: incr.attribute(image, window, **kwargs))
        t_i.append(s)
        s, _, _ = timed(lambda: channels_last_full(cl_model, image, patch, stride, batch, target))
        t_l.append(s)
        err = max(err, float((got - want).abs().max() / want.abs().max()))
    m_c = [peak_rss_in_child(one_run, "captum", name, stride, batch, patch)]
    m_i = [peak_rss_in_child(one_run, "incrinf", name, stride, batch, patch)]
    stats = incr.last_stats[0]
    speedup = median(t_c) / median(t_i)
    return dict(model=name, size=size, positions=stats["positions"], captum=median(t_c), incrinf=median(t_i),
                speedup=speedup, vs_cl=median(t_l) / median(t_i), theory=stats["theoretical_speedup"],
                plan=stats["realized_flop_ratio"],
                ratio=speedup / stats["theoretical_speedup"], mem_c=median(m_c), mem_i=median(m_i), err=err)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="*", default=["vgg16", "resnet18", "inception_v3", "efficientnet_lite0"])
    parser.add_argument("--patch", type=int, default=16)
    parser.add_argument("--stride", type=int, default=16, help="4 is Krypton's grid (slow for Captum on 2 cores)")
    parser.add_argument("--batch", type=int, default=16, help="perturbations_per_eval for both (Krypton CPU: 16)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    print(f"machine: {machine()}")
    print(f"exact OBE, patch {args.patch}, stride {args.stride}, batch {args.batch}, median of {args.repeats} "
          "alternating runs; image: skimage chelsea\n")
    header = (f"{'model':<19} {'pos':>5} {'captum s':>9} {'incrinf s':>9} {'speedup':>8} {'theory':>7} {'plan':>6} "
              f"{'sp/theory':>9} {'vs CL full':>10} {'Krypton':>8} {'captum mem':>11} {'incrinf mem':>11} "
              f"{'max rel err':>11}")
    print("theory: exact FLOP ratio averaged over the grid's positions; plan: FLOP ratio of the uniform packed\n"
          "batches actually run; sp/theory: measured speedup / theory; vs CL full: speedup over plain batched\n"
          "re-inference with the model in channels-last layout (incrinf's layout; Captum runs the model as given)\n")
    print(header)
    for name in args.models:
        r = run_model(name, args.stride, args.batch, args.repeats, args.patch)
        print(f"{r['model']:<19} {r['positions']:>5} {r['captum']:>9.2f} {r['incrinf']:>9.2f} {r['speedup']:>7.2f}x "
              f"{r['theory']:>6.2f}x {r['plan']:>5.2f}x {r['ratio']:>9.2f} {r['vs_cl']:>9.2f}x "
              f"{KRYPTON_CPU.get(name, ''):>8} "
              f"{mib(r['mem_c']):>11} {mib(r['mem_i']):>11} {r['err']:>11.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
