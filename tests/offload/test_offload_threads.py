"""Several cameras in one process: one thread and one offloading session each, on one shared model instance,
against one server with a token (the setting in which sessions used to die while being constructed)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn as nn

from incrinf.models import sample_image
from incrinf.normalization import Normalization
from incrinf.offload.server import ModelService, OffloadServer
from incrinf.offload.session import OffloadingSession, StreamSessionBackend
from incrinf.offload.stats import FrameLog
from incrinf.testing.synthetic import synthetic_camera

TOKEN = "shared-gpu-server"
SIZE = 64
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
# exact options only: each output must equal full inference (the cached ones send every changed pixel)
POLICIES = ["offload_full", "offload_changed_pixels", "hybrid", "local_full", "offload_full", "offload_changed_pixels"]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.head = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.stem(x)))
        x = torch.relu(self.head(x + self.dw(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_cameras_in_threads_share_one_model_and_server():
    torch.manual_seed(0)
    model = _Net().eval()
    service = ModelService(model, (3, SIZE, SIZE), mean=MEAN, std=STD, timing_repeats=1)
    cameras = [[f for f, _ in synthetic_camera(sample_image(), 10, size=(SIZE, SIZE), motion="pan", seed=i)]
               for i in range(len(POLICIES))]
    with torch.no_grad():
        references = [[model(Normalization(MEAN, STD).tensor(f)) for f in frames] for frames in cameras]
    start = threading.Barrier(len(POLICIES))

    def camera(index: int, url: str) -> tuple[list[torch.Tensor], list[str]]:
        start.wait()  # every session is constructed (traced, profiled, calibrated) at the same moment
        session = OffloadingSession(model, offload=url, policy=POLICIES[index], token=TOKEN, mean=MEAN, std=STD,
                                    timing_repeats=1, pixel_threshold=0.0, max_ratio=1.0)
        with session:
            outputs = [session(frame) for frame in cameras[index]]
        return outputs, [s.mode.policy for s in session.stats]

    with OffloadServer(service, token=TOKEN) as server, ThreadPoolExecutor(len(POLICIES)) as pool:
        jobs = [pool.submit(camera, i, server.url) for i in range(len(POLICIES))]
        results = [job.result() for job in jobs]
    for index, (outputs, modes) in enumerate(results):
        policy = POLICIES[index]
        assert all(mode.startswith(policy) for mode in modes), (policy, modes)
        assert len(outputs) == len(cameras[index])
        for k, (out, ref) in enumerate(zip(outputs, references[index])):
            torch.testing.assert_close(out.float(), ref, rtol=1e-4, atol=1e-5, msg=f"{policy}, frame {k}")


def test_frame_log_keeps_the_newest_records():
    log = FrameLog(10)
    for i in range(100):
        log.append(i)
        assert len(log) <= 11
    assert log[-1] == 99 and log.dropped + len(log) == 100 and list(log) == list(range(100 - len(log), 100))
    assert log[-3:] == [97, 98, 99]
    unbounded = FrameLog(None, range(5000))
    assert len(unbounded) == 5000 and unbounded.dropped == 0
    with pytest.raises(ValueError):
        FrameLog(0)


def test_sessions_keep_their_stats_bounded():
    torch.manual_seed(0)
    model = _Net().eval()
    frames = [f for f, _ in synthetic_camera(sample_image(), 30, size=(SIZE, SIZE), motion="pan")]
    session = OffloadingSession(model, policy="local_cached", input_size=(SIZE, SIZE), mean=MEAN, std=STD,
                                timing_repeats=1, keep_stats=8)
    backend = session.local_cached
    assert isinstance(backend, StreamSessionBackend)
    backend._KEEP_STATS = 4  # the adapter trims the inner StreamSession's records too
    for i in range(len(frames) * 5):
        session(frames[i % len(frames)])
    assert len(session.stats) <= 9 and session.stats[-1].index == len(frames) * 5 - 1
    assert len(backend.session.stats) <= 8
    np.testing.assert_array_equal([s.index for s in session.stats], np.arange(len(frames) * 5 - len(session.stats),
                                                                               len(frames) * 5))
