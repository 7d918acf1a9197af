"""Exact occlusion-based explanation on the CPU: incrinf vs captum.attr.Occlusion, side by side.

Both run in this process on the same image, the same grid (patch 16, --stride) and the same batch size
(Captum's ``perturbations_per_eval``), plus plain batched re-inference in channels-last layout (what the layout
alone gains), once as given and once with every batch norm folded into the convolution before it
(``torch.fx.experimental.optimization.fuse``, as incrinf folds them): ratios are quoted against the faster of the
two. Segmentation rows (``--segmentation``, a torchvision segmentation network, random init) explain a
region of interest: class 1's logits summed over the output map's central quarter, given to incrinf as a reducer
target and to Captum as the model wrapped in that reducer (what Captum's users are told to do; the table's
"vs CL full" column is empty for them). Runs alternate
(Captum, incrinf, Captum, ...) and medians are quoted, since this machine is shared and noisy. Memory is the peak
resident-set growth of one run in a spawned child (the same method for both).

Run: python benchmarks/obe_exact.py [--stride 16] [--batch 16] [--repeats 3] [--models vgg16 resnet18 ...]
     [--segmentation lraspp_mobilenet_v3_large ...]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torchvision
from _common import folded, machine, median, mib, peak_rss_in_child, timed
from captum.attr import Occlusion as CaptumOcclusion

from incrinf import models
from incrinf.analysis import occlusion_grid
from incrinf.cache import runtime_cache
from incrinf.captum import Occlusion as IncrinfOcclusion
from incrinf.engine.plans import PlanKey
from incrinf.explain.occlusion import occlusion as incrinf_occlusion

KRYPTON_CPU = {"vgg16": 5.4, "resnet18": 2.1, "inception_v3": 1.5}


_CACHE: dict = {}


def cpu_timed(fn) -> tuple[float, float, object]:
    """(wall seconds, this thread's CPU seconds, result) of one call: with one torch thread every operator runs on
    the calling thread, so its CPU time is the work's whatever else the machine runs (the wall time is not)."""
    cpu = time.thread_time()
    seconds, _, out = timed(fn)
    return seconds, time.thread_time() - cpu, out


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


# the operators that run a convolution's arithmetic (oneDNN's, its weight reorder inside, and PyTorch's own)
_CONVOLUTION_OPS = ("aten::mkldnn_convolution", "mkldnn::_convolution_pointwise", "aten::_slow_conv2d_forward",
                    "aten::thnn_conv2d", "aten::_nnpack_spatial_convolution")


def convolution_profile(fn) -> tuple[dict, float]:
    """Where one call of ``fn`` spends its convolution time: ``({weight shape: (multiply-adds, seconds)}, seconds
    of the whole call)``, the multiply-adds from the profiler's shape formulas (noise-free), the seconds its self
    time of the operators doing the arithmetic (profiling slows the many small operators more than the
    convolutions: the share outside them is an upper bound)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        start = time.perf_counter()
        fn()
        whole = time.perf_counter() - start
    layers: dict[tuple, list[float]] = {}
    for event in prof.key_averages(group_by_input_shape=True):
        if len(event.input_shapes) < 2 or len(event.input_shapes[1]) < 3:
            continue
        layer = layers.setdefault(tuple(event.input_shapes[1]), [0.0, 0.0])
        if event.key == "aten::conv2d":
            layer[0] += event.flops / 2
        elif event.key in _CONVOLUTION_OPS:
            layer[1] += event.self_cpu_time_total / 1e6
    return {k: (macs, seconds) for k, (macs, seconds) in layers.items() if seconds > 0}, whole


def convolution_speed(ours: dict, baseline: dict) -> float:
    """How fast ``ours``'s convolutions run against ``baseline``'s, layer by layer (both
    :func:`convolution_profile`'s): the seconds the baseline's convolutions would take for our multiply-adds at
    their own speed per weight shape, over the seconds ours took (below 1: our boxes run slower than its whole
    maps; shapes the baseline never runs are left out)."""
    would = took = 0.0
    for shape, (macs, seconds) in ours.items():
        if shape in baseline and baseline[shape][0] > 0 and macs > 0:
            would += macs * baseline[shape][1] / baseline[shape][0]
            took += seconds
    return would / took if took else float("nan")


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
    cl_folded = folded(model).to(memory_format=torch.channels_last)
    channels_last_full(cl_folded, image, patch, stride, batch, target)  # warm-up
    t_c, t_i, t_l, t_f = [], [], [], []
    c_i, c_l, c_f = [], [], []  # the same runs' CPU seconds
    err = 0.0
    for _ in range(repeats):
        s, _, want = timed(lambda: captum.attribute(image, window, **kwargs))
        t_c.append(s)
        s, c, got = cpu_timed(lambda: incr.attribute(image, window, **kwargs))
        t_i.append(s)
        c_i.append(c)
        s, c, _ = cpu_timed(lambda: channels_last_full(cl_model, image, patch, stride, batch, target))
        t_l.append(s)
        c_l.append(c)
        s, c, _ = cpu_timed(lambda: channels_last_full(cl_folded, image, patch, stride, batch, target))
        t_f.append(s)
        c_f.append(c)
        err = max(err, float((got - want).abs().max() / want.abs().max()))
    # where incrinf's time goes: the share in convolutions and their speed against the baseline's, layer by layer
    # (one profiled run each)
    conv_i, whole_i = convolution_profile(lambda: incr.attribute(image, window, **kwargs))
    conv_f, _ = convolution_profile(lambda: channels_last_full(cl_folded, image, patch, stride, batch, target))
    m_c = [peak_rss_in_child(one_run, "captum", name, stride, batch, patch)]
    m_i = [peak_rss_in_child(one_run, "incrinf", name, stride, batch, patch)]
    stats = incr.last_stats[0]
    speedup = median(t_c) / median(t_i)
    return dict(model=name, size=size, positions=stats["positions"], captum=median(t_c), incrinf=median(t_i),
                speedup=speedup, vs_cl=median(t_l) / median(t_i), vs_folded=median(t_f) / median(t_i),
                cpu=min(median(c_l), median(c_f)) / median(c_i) if torch.get_num_threads() == 1 else float("nan"),
                theory=stats["theoretical_speedup"],
                plan=stats["realized_flop_ratio"],
                ratio=speedup / stats["theoretical_speedup"], mem_c=median(m_c), mem_i=median(m_i), err=err,
                conv_share=sum(v[1] for v in conv_i.values()) / whole_i, conv_speed=convolution_speed(conv_i, conv_f),
                **weight_traffic(model, stats["positions"], batch), load=os.getloadavg()[0])


def _last_plan():
    """The plan of the last incrinf run (None before any)."""
    keys = runtime_cache().keys(PlanKey)
    return runtime_cache().get(keys[-1]) if keys else None


def weight_traffic(model: torch.nn.Module, positions: int, batch: int) -> dict:
    """Bytes of weights read: by the last plan run (each batch the weights of the steps it runs, each tail run
    the tail's) and by plain batched re-inference (every weight once per batch)."""
    plan = _last_plan()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(w_i=plan.weight_bytes if plan is not None else float("nan"), w_l=-(-positions // batch) * weights,
                batches=len(plan.batches) if plan is not None else 0)


ROI_CLASS = 1


def segmentation_case(name: str) -> tuple[torch.nn.Module, torch.Tensor, object]:
    """A torchvision segmentation network (random init), the preprocessed photo, and the ROI reducer."""
    import warnings

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(torchvision.models.segmentation, name)(weights=None, weights_backbone=None).eval()
    image = models.preprocess(models.sample_image(), "resnet18", 224)[None]
    roi = torch.zeros(224, 224)
    roi[56:168, 56:168] = 1.0

    def roi_logits(out: dict) -> torch.Tensor:
        return (out["out"][:, ROI_CLASS] * roi).sum((1, 2))

    return model, image, roi_logits


def one_segmentation_run(method: str, name: str, stride: int, batch: int, patch: int, warm: bool = False) -> None:
    """One ROI attribution with ``method`` (for memory measurement in a child process)."""
    torch.set_grad_enabled(False)
    if name not in _CACHE:
        _CACHE[name] = segmentation_case(name)
    model, image, roi = _CACHE[name]
    if warm:
        return
    if method == "captum":
        CaptumOcclusion(lambda t: roi(model(t))).attribute(image, (3, patch, patch), strides=(3, stride, stride),
                                                           perturbations_per_eval=batch)
    else:
        incrinf_occlusion(model, image, target=roi, patch=patch, stride=stride, batch_size=batch, progress=False)


def run_segmentation(name: str, stride: int, batch: int, repeats: int, patch: int) -> dict:
    model, image, roi = segmentation_case(name)
    captum = CaptumOcclusion(lambda t: roi(model(t)))

    def ours():
        return incrinf_occlusion(model, image, target=roi, patch=patch, stride=stride, batch_size=batch,
                                 progress=False)

    ours()  # warm-up: capture, materialization code paths, plan cache
    t_c, t_i = [], []
    err = 0.0
    for _ in range(repeats):
        s, _, want = timed(lambda: captum.attribute(image, (3, patch, patch), strides=(3, stride, stride),
                                                    perturbations_per_eval=batch))
        t_c.append(s)
        s, _, got = timed(ours)
        t_i.append(s)
        err = max(err, float(abs(got.pixel_map() - want[0, 0].numpy()).max() / want.abs().max()))
    m_c = peak_rss_in_child(one_segmentation_run, "captum", name, stride, batch, patch)
    m_i = peak_rss_in_child(one_segmentation_run, "incrinf", name, stride, batch, patch)
    stats = got.stats
    speedup = median(t_c) / median(t_i)
    return dict(model=f"{name.split('_')[0]} (ROI)", size=224, positions=stats["positions"], captum=median(t_c),
                incrinf=median(t_i), speedup=speedup, vs_cl=float("nan"), vs_folded=float("nan"),
                theory=stats["theoretical_speedup"],
                plan=stats["realized_flop_ratio"], ratio=speedup / stats["theoretical_speedup"], mem_c=m_c,
                mem_i=m_i, err=err, w_i=float("nan"), w_l=float("nan"), batches=0, cpu=float("nan"),
                conv_share=float("nan"), conv_speed=float("nan"),
                load=os.getloadavg()[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="*", default=["vgg16", "resnet18", "inception_v3", "efficientnet_lite0"])
    parser.add_argument("--segmentation", nargs="*", default=["lraspp_mobilenet_v3_large"],
                        help="torchvision segmentation networks explained for a region of interest (none: skip)")
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
              f"{'sp/theory':>9} {'vs CL full':>10} {'vs CL fold':>10} {'CL/theory':>9} {'CPU/theory':>10} "
              f"{'Krypton':>8} "
              f"{'captum mem':>11} {'incrinf mem':>11} {'max rel err':>11} {'batches':>7} {'W GB':>6} {'CL W GB':>7} "
              f"{'conv %':>6} {'conv speed':>10} {'load':>5}")
    print("theory: exact FLOP ratio averaged over the grid's positions; plan: FLOP ratio of the uniform packed\n"
          "batches actually run; sp/theory: measured speedup / theory; vs CL full: speedup over plain batched\n"
          "re-inference with the model in channels-last layout (incrinf's layout; Captum runs the model as given);\n"
          "vs CL fold: the same with batch norms folded into the convolutions (as incrinf folds them);\n"
          "CL/theory: speedup over the faster of the two / theory; CPU/theory: the same in CPU seconds of the\n"
          "calling thread (with --threads 1, where it is the work's however loaded the machine; '-' otherwise);\n"
          "W GB: weights read by incrinf's plan (each batch\n"
          "the weights of the steps it runs, each tail run the tail's), CL W GB: by plain batched re-inference\n"
          "(all, once per batch); conv %: share of incrinf's run inside convolutions (one profiled run);\n"
          "conv speed: the CL fold baseline's convolution seconds for incrinf's multiply-adds, layer by layer at\n"
          "the baseline's own speed, over incrinf's convolution seconds (below 1: boxes run slower than maps);\n"
          "load: 1-minute load average after the row's runs\n")
    print(header)
    runs = [(run_model, name) for name in args.models] + [(run_segmentation, name) for name in args.segmentation]
    for run, name in runs:
        r = run(name, args.stride, args.batch, args.repeats, args.patch)
        measured = r["vs_cl"] == r["vs_cl"]  # NaN: not measured
        slower = min(r["vs_cl"], r["vs_folded"])  # incrinf's speedup over the faster baseline
        vs_cl = f"{r['vs_cl']:>9.2f}x {r['vs_folded']:>9.2f}x {slower / r['theory']:>9.2f}" if measured \
            else f"{'-':>10} {'-':>10} {'-':>9}"
        vs_cl += f" {r['cpu'] / r['theory']:>10.2f}" if r["cpu"] == r["cpu"] else f" {'-':>10}"
        print(f"{r['model']:<19} {r['positions']:>5} {r['captum']:>9.2f} {r['incrinf']:>9.2f} {r['speedup']:>7.2f}x "
              f"{r['theory']:>6.2f}x {r['plan']:>5.2f}x {r['ratio']:>9.2f} {vs_cl} "
              f"{KRYPTON_CPU.get(name, ''):>8} "
              f"{mib(r['mem_c']):>11} {mib(r['mem_i']):>11} {r['err']:>11.1e} {r['batches']:>7} "
              f"{r['w_i'] / 1e9:>6.2f} {r['w_l'] / 1e9:>7.2f} {100 * r['conv_share']:>5.0f}% "
              f"{r['conv_speed']:>10.2f} {r['load']:>5.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
