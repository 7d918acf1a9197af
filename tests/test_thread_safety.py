"""Many threads, one process: capture, stream sessions, occlusion and the runtime cache on shared models.

Every concurrent result is compared with the same work run serially in this process (same code, same inputs):
the computations are the same, so the results must be bit-identical.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import cv2
import numpy as np
import pytest
import skimage.data
import torch
import torch.nn as nn

import incrinf
from incrinf.graph import capture, captured_graph
from incrinf.stream import StreamSession

THREADS, ROUNDS = 8, 3
FRAME = 64


class _Block(nn.Module):
    """A residual block with batch norm and a depthwise convolution (EfficientNet's ingredients)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.depthwise = nn.Conv2d(channels, channels, 3, padding=1, groups=channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.depthwise(torch.relu(self.bn(self.conv(x)))))


def small_cnn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(), _Block(16), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU6(), _Block(32), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(32, 10),
    )
    for m in model.modules():  # non-trivial statistics, so that batch norm is not an identity
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 2.0)
    return model.eval()


@pytest.fixture(scope="module")
def photo() -> np.ndarray:
    return cv2.resize(skimage.data.chelsea(), (200, 150), interpolation=cv2.INTER_AREA)


def _work(model: nn.Module, index: int, photo: np.ndarray, start: threading.Barrier | None = None) -> dict:
    """What one camera thread does: build a session, run a few frames (first, unchanged, a local change, a
    known pan, a matched one), then an occlusion heat map of its own image."""
    if start is not None:
        start.wait()
    y, x = 10 + 3 * index, 20 + 5 * index
    base = np.ascontiguousarray(photo[y:y + FRAME, x:x + FRAME])
    changed = base.copy()
    changed[20:32, 24:36] = 255 - changed[20:32, 24:36]
    panned = np.ascontiguousarray(photo[y:y + FRAME, x + 4:x + 4 + FRAME])
    pan = np.array([[1.0, 0.0, -4.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    # unguarded: the speed guard's choice depends on timings, which threads sharing cores change
    session = StreamSession(model, pixel_threshold=5.0, speed_guard=False, quality_guard=False)
    outputs = [session(base), session(base, homography=np.eye(3)), session(changed, homography=np.eye(3)),
               session(panned, homography=pan), session(base)]
    image = torch.from_numpy(base[::2, ::2].astype(np.float32) / 127.5 - 1.0).permute(2, 0, 1).contiguous()
    heat = incrinf.occlusion(model, image, patch=8, stride=8, progress=False, batch_size=4)
    return {"outputs": outputs, "modes": [(s.mode, s.reason) for s in session.stats], "heatmap": heat.heatmap,
            "target": heat.target}


def _assert_same(concurrent: list[dict], serial: list[dict]) -> None:
    for i, (got, want) in enumerate(zip(concurrent, serial, strict=True)):
        assert got["modes"] == want["modes"], f"thread {i}"
        assert got["target"] == want["target"], f"thread {i}"
        for k, (a, b) in enumerate(zip(got["outputs"], want["outputs"], strict=True)):
            assert torch.equal(a, b), f"thread {i}, frame {k}: max diff {(a - b).abs().max().item():.3g}"
        assert np.array_equal(got["heatmap"], want["heatmap"]), f"thread {i}: heat map differs"


def _threads_of_a_fresh_thread() -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


@pytest.mark.parametrize("n_models", [1, 2], ids=["one shared model", "two models"])
def test_eight_threads_equal_a_serial_run(photo, n_models):
    models = [small_cnn(seed) for seed in range(n_models)]
    assignment = [models[i % n_models] for i in range(THREADS)]
    fresh_threads = _threads_of_a_fresh_thread()
    cache = incrinf.runtime_cache()
    cache.clear()
    # One job after another, on one worker thread like the concurrent jobs (the main thread would measure something
    # else: on it, the still-camera executor's per-operator torch.set_num_threads costs ~15x on a loaded machine).
    with ThreadPoolExecutor(1) as pool:
        serial = pool.submit(lambda: [_work(model, i, photo) for i, model in enumerate(assignment)]).result()
    built_serially = {kind: s["misses"] for kind, s in cache.stats().items()}
    assert all(len(r["modes"]) == 5 for r in serial)
    assert {mode for r in serial for mode, _ in r["modes"][1:4]} == {"cached"}  # the cached paths ran
    for _ in range(ROUNDS):
        cache.clear()  # so that the threads build the plans concurrently, not just read them
        start = threading.Barrier(THREADS)
        with ThreadPoolExecutor(THREADS) as pool:
            jobs = [pool.submit(_work, model, i, photo, start) for i, model in enumerate(assignment)]
            concurrent = [job.result() for job in jobs]
        _assert_same(concurrent, serial)
        # every plan key was built once, however many threads asked for it at the same time
        assert {kind: s["misses"] for kind, s in cache.stats().items()} == built_serially
    # one graph per (model, shape), shared by every thread
    for model in models:
        assert captured_graph(model, (3, FRAME // 2, FRAME // 2)) is captured_graph(model, (3, FRAME // 2, FRAME // 2))
    # no thread's temporary thread-count switch leaked into the process setting new threads start from
    assert _threads_of_a_fresh_thread() == fresh_threads


def test_models_run_while_other_threads_trace():
    """torch.fx patches ``nn.Module.__call__`` for every thread while it traces: a thread that only runs a
    model during someone else's capture must neither break that capture nor get proxies back."""
    traced, running = small_cnn(0), small_cnn(1)
    x = torch.randn(1, 3, FRAME, FRAME)
    with torch.no_grad():
        want_running, want_traced = running(x), traced(x)
    stop = threading.Event()
    errors: list[str] = []
    runs = [0]

    def run(model: nn.Module, want: torch.Tensor) -> None:
        try:
            while not stop.is_set():
                with torch.no_grad():
                    got = model(x)
                if not torch.equal(got, want):
                    errors.append("a forward pass changed its result during a capture")
                runs[0] += 1
        except Exception as exc:  # the failure this test is about
            errors.append(f"forward: {type(exc).__name__}: {exc}")

    def trace_many() -> None:
        try:
            for size in range(40, 72, 2):  # a new shape each time: no cached graph, a real trace
                capture(traced, (3, size, size))
        except Exception as exc:
            errors.append(f"capture: {type(exc).__name__}: {exc}")

    runners = [threading.Thread(target=run, args=(m, w)) for m, w in ((running, want_running),
                                                                      (traced, want_traced))]
    tracers = [threading.Thread(target=trace_many) for _ in range(2)]
    for t in runners + tracers:
        t.start()
    for t in tracers:
        t.join()
    stop.set()
    for t in runners:
        t.join()
    assert errors == []
    assert runs[0] > 0
