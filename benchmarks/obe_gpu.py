"""Exact occlusion explanations on a GPU: incrinf (Triton and plain-PyTorch window preparation) vs Captum.

Run: ``python benchmarks/obe_gpu.py`` on a machine with a CUDA GPU (a few minutes). For VGG16, ResNet18,
Inception3 and EfficientNet-Lite0 at patch 16, stride 4 (Krypton's setup, batch 128), side by side in one
process and with the same batch size:

- ``captum``: ``captum.attr.Occlusion`` (batched full re-inference of every occluded image);
- ``incr-torch``: incrinf's exact incremental engine with plain PyTorch index ops (``INCRINF_FORCE_TRITON=0``);
- ``incr-triton``: the same engine with the Triton window-preparation kernels (the default on CUDA).

Prints the median of ``--repeats`` warm runs (methods interleaved), speedups over Captum, the theoretical
(FLOP-ratio) speedup, peak GPU memory of each method above what was resident before it started (the largest of
every run's, the cold one's included), and the largest heat-map difference to Captum. The cold run of each
incrinf path is eager; from the first warm run on its planned batches run as recorded CUDA graphs
(``incrinf.engine.replays``; ``INCRINF_CUDA_GRAPHS=0`` in the environment measures the eager engine instead).
Exits with status 2 and a message when no CUDA GPU is present.
``--cpu-smoke`` runs the same code on the CPU with tiny inputs (for checking the script, not for timings).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Krypton's GPU exact speedups over naive batched re-inference (Titan X Pascal, ../shared/ANCHORS.md).
KRYPTON_GPU_EXACT = {"vgg16": 3.9, "resnet18": 1.6, "inception_v3": 0.7}
MODELS = ("vgg16", "resnet18", "inception_v3", "efficientnet_lite0")
METHODS = ("captum", "incr-torch", "incr-triton")


@dataclass
class Row:
    model: str
    size: int
    positions: int = 0
    theoretical: float = 0.0
    seconds: dict[str, list[float]] = field(default_factory=dict)
    cold: dict[str, float] = field(default_factory=dict)
    peak: dict[str, int | None] = field(default_factory=dict)
    max_diff: float = 0.0
    triton_launches: int = 0

    def median(self, method: str) -> float:
        return statistics.median(self.seconds[method])


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated zoo names")
    p.add_argument("--patch", type=int, default=16)
    p.add_argument("--stride", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=128, help="positions per batch (all methods)")
    p.add_argument("--repeats", type=int, default=3, help="warm runs per method (median reported)")
    p.add_argument("--size", type=int, default=None, help="override every model's input size")
    p.add_argument("--cudnn-benchmark", action="store_true", help="let cuDNN autotune (all methods)")
    p.add_argument("--cpu-smoke", action="store_true", help="run on the CPU with tiny inputs (no timings)")
    return p.parse_args(argv)


def _no_gpu_exit() -> None:
    print("obe_gpu: no CUDA GPU is available (torch.cuda.is_available() is False); this benchmark measures "
          "GPU execution and needs one. Nothing was run. (Use --cpu-smoke to check the script on a CPU.)",
          file=sys.stderr)
    raise SystemExit(2)


@contextmanager
def _force_triton(value: str):
    saved = os.environ.get("INCRINF_FORCE_TRITON")
    os.environ["INCRINF_FORCE_TRITON"] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("INCRINF_FORCE_TRITON", None)
        else:
            os.environ["INCRINF_FORCE_TRITON"] = saved


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, int | None, torch.Tensor]:
    """(seconds, peak bytes above what was resident before, result) of one call."""
    from incrinf.kernels.dispatch import peak_device_memory, reset_peak_device_memory

    _sync(device)
    resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    reset_peak_device_memory(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    seconds = time.perf_counter() - start
    peak = peak_device_memory(device)
    return seconds, None if peak is None else peak - resident, out


def _bench_model(name: str, args: argparse.Namespace, device: torch.device) -> Row:
    from captum.attr import Occlusion as CaptumOcclusion

    from incrinf import models
    from incrinf.explain.occlusion import occlusion
    from incrinf.kernels import triton_gather

    size = args.size or models.info(name).input_size
    model = models.load(name).to(device).eval()
    image = models.preprocess(models.sample_image(), name, size=size).unsqueeze(0).to(device)
    with torch.no_grad():
        target = int(model(image).argmax())
    patch, stride, bs = args.patch, args.stride, args.batch_size
    row = Row(name, size)

    def run_captum() -> torch.Tensor:
        with torch.no_grad():
            attr = CaptumOcclusion(model).attribute(image, (3, patch, patch), strides=(3, stride, stride),
                                                    baselines=0.0, target=target, perturbations_per_eval=bs)
        return attr[0, 0]

    def run_incr(force: str) -> Callable[[], torch.Tensor]:
        def go() -> torch.Tensor:
            with _force_triton(force):
                res = occlusion(model, image, target=target, patch=patch, stride=stride, batch_size=bs,
                                device=device, progress=False)
            row.positions = len(res.positions)
            row.theoretical = float(res.stats["theoretical_speedup"])
            return torch.from_numpy(res.pixel_map())
        return go

    launches = [0]
    real_gather, real_boxes = triton_gather.gather_rows, triton_gather.gather_boxes

    def counting(kernel: Callable) -> Callable:
        def launch(*a, **k):
            launches[0] += 1
            return kernel(*a, **k)
        return launch

    fns = {"captum": run_captum, "incr-torch": run_incr("0"), "incr-triton": run_incr("")}
    results: dict[str, torch.Tensor] = {}
    for method, fn in fns.items():  # cold: plan building, kernel compilation, cuDNN setup
        if method == "incr-triton":
            triton_gather.gather_rows, triton_gather.gather_boxes = counting(real_gather), counting(real_boxes)
        try:
            row.cold[method], cold_peak, results[method] = _measure(fn, device)
        finally:
            triton_gather.gather_rows, triton_gather.gather_boxes = real_gather, real_boxes
        # warm runs replay recorded CUDA graphs, whose working memory (the graphs' pool) was allocated while
        # recording: the peak is the largest of every run's, the eager cold run's included
        row.seconds[method], row.peak[method] = [], cold_peak
    row.triton_launches = launches[0]
    for _ in range(args.repeats):
        for method, fn in fns.items():  # interleaved, so drift hits every method alike
            seconds, peak, _ = _measure(fn, device)
            row.seconds[method].append(seconds)
            if peak is not None:
                row.peak[method] = max(row.peak[method] or 0, peak)
    reference = results["captum"].double().cpu()
    scale = float(reference.abs().max().clamp_min(1e-12))
    row.max_diff = max(float((results[m].double().cpu() - reference).abs().max()) / scale
                       for m in ("incr-torch", "incr-triton"))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _mib(b: int | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:.0f}"


def _print_machine(device: torch.device) -> None:
    import captum
    import triton

    print(f"python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"captum {captum.__version__}, CPU {platform.processor() or platform.machine()} x{os.cpu_count()}")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        print(f"GPU {props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}, "
              f"cuDNN {torch.backends.cudnn.version()}, TF32 conv={torch.backends.cudnn.allow_tf32} "
              f"matmul={torch.backends.cuda.matmul.allow_tf32}, cudnn.benchmark={torch.backends.cudnn.benchmark}")
    else:
        print("device: CPU (smoke run: timings are meaningless)")


def _print_table(rows: list[Row], args: argparse.Namespace) -> None:
    print(f"\nexact OBE, patch {args.patch}, stride {args.stride}, batch {args.batch_size}, "
          f"median of {args.repeats} warm runs (s); speedups over captum.attr.Occlusion")
    head = ("| model | size | positions | captum s | incr-torch s | incr-triton s | speedup torch | "
            "speedup triton | theoretical | triton/theory | Krypton GPU | peak MiB captum / torch / triton | "
            "mem cut triton | max rel diff |")
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    for r in rows:
        cap, tor, tri = (r.median(m) for m in METHODS)
        cut = "n/a"
        if r.peak["captum"] and r.peak["incr-triton"] is not None:
            cut = f"{100 * (1 - r.peak['incr-triton'] / r.peak['captum']):.0f}%"
        anchor = KRYPTON_GPU_EXACT.get(r.model)
        print(f"| {r.model} | {r.size} | {r.positions} | {cap:.3f} | {tor:.3f} | {tri:.3f} | {cap / tor:.2f}x | "
              f"{cap / tri:.2f}x | {r.theoretical:.2f}x | {cap / tri / r.theoretical:.2f} | "
              f"{'-' if anchor is None else f'{anchor}x'} | "
              f"{' / '.join(_mib(r.peak[m]) for m in METHODS)} | {cut} | {r.max_diff:.1e} |")
    print("\ncold first runs (plans, kernel compilation, cuDNN setup), s: " + "; ".join(
        f"{r.model} " + " / ".join(f"{r.cold[m]:.2f}" for m in METHODS) for r in rows))
    if any(r.triton_launches == 0 for r in rows):
        print("WARNING: the incr-triton runs launched no Triton kernel: the engine does not route window "
              "preparation through incrinf.kernels.dispatch yet, so incr-torch and incr-triton ran the same code.")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.cpu_smoke:
        device = torch.device("cpu")
        args.size = args.size or 48
        args.batch_size = min(args.batch_size, 16)
        args.repeats = min(args.repeats, 1)
    elif not torch.cuda.is_available():
        _no_gpu_exit()
    else:
        device = torch.device("cuda")
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    try:
        import incrinf  # noqa: F401
    except ImportError:  # run from a checkout without `pip install -e .`
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    _print_machine(device)
    rows = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        row = _bench_model(name, args, device)
        rows.append(row)
        print(f"{name}: captum {row.median('captum'):.3f}s, incr-torch {row.median('incr-torch'):.3f}s, "
              f"incr-triton {row.median('incr-triton'):.3f}s, theoretical {row.theoretical:.2f}x", flush=True)
    _print_table(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
