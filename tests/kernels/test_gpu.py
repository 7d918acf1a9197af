"""GPU path: Triton kernels on CUDA tensors, occlusion on CUDA against the CPU path, Captum drop-in on CUDA.

Every test but the last needs a CUDA device and skips cleanly without one; the last checks that the GPU
benchmark refuses to run (with a clear message) where there is none.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from incrinf.kernels import dispatch

HAS_CUDA = torch.cuda.is_available()
needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
ROOT = Path(__file__).resolve().parents[2]


def _gpu(fn):
    for mark in needs_cuda:
        fn = mark(fn)
    return fn


@pytest.fixture
def exact_cuda():
    """No TF32 in convolutions or matmuls while comparing GPU and CPU results."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


class _Net(nn.Module):
    """Padded and strided convs, a pool, a residual add, avg pooling and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 16, 3, padding=1)
        self.b = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.c = nn.Conv2d(32, 32, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.avg = nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        y = torch.relu(self.b(torch.relu(self.a(x))))
        y = self.avg(self.pool(y + self.c(y)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


def _net_and_image(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return _Net().eval(), torch.randn(1, 3, 64, 64)


@_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels", [1, 3, 17, 64, 130])
def test_triton_kernels_on_cuda_match_torch(monkeypatch, dtype, channels):
    from incrinf.kernels import triton_gather as tg

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the compiled kernels, not the interpreter
    assert not tg._interpret(torch.zeros(1, device="cuda"))

    gen = torch.Generator().manual_seed(channels)
    base = torch.randn(5000, channels, generator=gen).to(dtype).cuda()
    region = torch.randn(700, channels, generator=gen).to(dtype).cuda()
    read = torch.randint(0, 5000, (90_000,), generator=gen).cuda()
    dest = torch.randperm(90_000, generator=gen)[:700].cuda()
    expected = base.index_select(0, read).index_copy_(0, dest, region)
    fused = tg.gather_rows(base, dispatch.fuse_window_index(read, dest, None, 5000), region)
    assert fused.is_cuda and torch.equal(fused, expected)
    rows = tg.gather_rows(base, read)
    assert torch.equal(tg.scatter_rows(rows, dest, region), expected)
    proj_dest = torch.randperm(3 * 5000, generator=gen)[:700].cuda()
    proj = tg.gather_rows(base, dispatch.fuse_scatter_index(proj_dest, None, 3, 5000), region)
    assert torch.equal(proj, base.repeat(3, 1).index_copy_(0, proj_dest, region))


@_gpu
def test_dispatch_uses_triton_for_cuda_tensors(monkeypatch):
    monkeypatch.delenv(dispatch.FORCE_ENV, raising=False)
    assert dispatch.use_triton(torch.zeros(1, device="cuda"))
    assert not dispatch.use_triton(torch.zeros(1))
    monkeypatch.setenv(dispatch.FORCE_ENV, "0")
    assert not dispatch.use_triton(torch.zeros(1, device="cuda"))


@_gpu
def test_device_memory_helpers_on_cuda():
    dispatch.reset_peak_device_memory("cuda")
    free = dispatch.free_device_memory("cuda")
    assert free is not None and free > 0
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    peak = dispatch.peak_device_memory("cuda")
    assert peak is not None and peak >= x.numel()
    del x


@_gpu
def test_occlusion_on_cuda_equals_cpu(exact_cuda):
    from incrinf.explain.occlusion import occlusion

    model, image = _net_and_image()
    cpu = occlusion(model, image, patch=12, stride=6, batch_size=16, progress=False)
    gpu = occlusion(model, image, patch=12, stride=6, batch_size=16, progress=False, device="cuda")
    assert gpu.target == cpu.target
    scale = max(float(np.abs(cpu.heatmap).max()), 1e-6)
    np.testing.assert_allclose(gpu.heatmap, cpu.heatmap, atol=1e-4 * scale + 1e-5, rtol=1e-4)
    assert gpu.stats["peak_memory_bytes"] > 0


@_gpu
def test_occlusion_on_cuda_torch_and_triton_paths_agree(monkeypatch, exact_cuda):
    from incrinf.explain.occlusion import occlusion

    model, image = _net_and_image(1)
    heat = {}
    for force in ("0", "1"):
        monkeypatch.setenv(dispatch.FORCE_ENV, force)
        heat[force] = occlusion(model, image, patch=16, stride=8, batch_size=32, progress=False,
                                device="cuda").heatmap
    np.testing.assert_allclose(heat["1"], heat["0"], atol=1e-5, rtol=1e-5)


@_gpu
def test_recorded_batches_replay_exactly(monkeypatch, exact_cuda):
    """Planned batches recorded as CUDA graphs (from the second run of a plan on) give the eager run's heat maps,
    for the image they were recorded with and for other images of the same shape (their tables copied into the
    graphs' static ones); a model with a step that cannot be recorded (the border factors of an average pool
    without its padding, made on the host) falls back to eager runs with the same results."""
    import torchvision

    from incrinf.engine import replays
    from incrinf.explain.occlusion import occlusion

    recorded = []
    real_record = replays.Replays._record

    def record(self, *args):
        found = real_record(self, *args)
        recorded.append(found is not None)
        return found

    monkeypatch.setattr(replays.Replays, "_record", record)
    torch.manual_seed(3)
    nets = [(torchvision.models.resnet18(num_classes=7).eval(), True), (_net_and_image(3)[0], False)]
    for model, recordable in nets:
        images = [torch.randn(1, 3, 64, 64) for _ in range(3)]
        kwargs = dict(patch=12, stride=6, batch_size=16, progress=False, device="cuda")
        monkeypatch.setenv(replays.GRAPHS_ENV, "0")
        eager = [occlusion(model, x, target=1, **kwargs).heatmap for x in images]
        assert not recorded
        monkeypatch.setenv(replays.GRAPHS_ENV, "1")
        kept = []  # results alive: later stores land elsewhere and are copied in
        for x, want in [*zip(images, eager), *zip(images, eager), (images[0], eager[0])]:
            got = occlusion(model, x, target=1, **kwargs)
            scale = float(np.abs(want).max())
            np.testing.assert_allclose(got.heatmap, want, rtol=1e-5, atol=1e-6 * scale)
            kept.append(got)
        assert recorded and all(recorded) == recordable and (recordable or len(recorded) == 1)
        recorded.clear()


@_gpu
def test_captum_drop_in_on_cuda_inputs(exact_cuda):
    captum_attr = pytest.importorskip("captum.attr")
    from incrinf.captum import Occlusion

    model, image = _net_and_image(2)
    model = model.cuda()
    x = image.repeat(2, 1, 1, 1).cuda()
    x[1] = x[1].flip(-1)
    kwargs = dict(sliding_window_shapes=(3, 16, 16), strides=(3, 8, 8), baselines=0.0, target=[1, 4],
                  perturbations_per_eval=16)
    ours = Occlusion(model).attribute(x, **kwargs)
    reference = captum_attr.Occlusion(model).attribute(x, **kwargs)
    assert ours.is_cuda and ours.shape == x.shape
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU message")
def test_gpu_benchmark_exits_cleanly_without_gpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "obe_gpu.py")], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "no CUDA GPU" in done.stderr
    assert "Traceback" not in done.stderr


def test_gpu_benchmark_cpu_smoke(capsys, monkeypatch):
    """The benchmark's code path (Captum, both incremental paths, the table) on the CPU with a tiny input."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("obe_gpu", ROOT / "benchmarks" / "obe_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "obe_gpu", bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    assert bench.main(["--cpu-smoke", "--models", "resnet18", "--size", "32", "--stride", "16"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| resnet18 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "4"  # positions: (32 - 16) / 16 + 1 = 2 per axis
    assert float(cells[-1]) < 1e-4  # incremental heat maps equal Captum's
