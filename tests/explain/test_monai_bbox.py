"""The MONAI drop-in's ``b_box`` restricts the work as MONAI's does: the same windows (the ones MONAI occludes for
the box, no more), multiply-adds for those windows only, and MONAI's map inside the box."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

monai_visualize = pytest.importorskip("monai.visualize")

from incrinf.explain.runner import OcclusionRunner  # noqa: E402
from incrinf.geometry import incremental_flops, input_boxes, propagate  # noqa: E402
from incrinf.graph import captured_graph  # noqa: E402
from incrinf.monai import OcclusionSensitivity  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FILL = 0.5  # a constant occluder: an occluded window is exactly the voxels that differ from the input


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool3d(2), nn.Conv3d(4, 6, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(6, 3)).eval()


class OccludedWindows(nn.Module):
    """Wraps the model MONAI calls and records the corner of each occluded copy it is given (the first voxel
    that differs from the input)."""

    def __init__(self, model: nn.Module, x: torch.Tensor) -> None:
        super().__init__()
        self.model, self.x, self.corners = model, x, []

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        for example in batch:
            changed = (example != self.x[0])[0].nonzero()
            self.corners.append(tuple(changed.min(0).values.tolist()))
        return self.model(batch)


@pytest.mark.parametrize("b_box", [None, [2, 9, -1, -1, 4, 11], [0, 5, 0, 5, 0, 5], [6, 13, 3, 8, -1, -1]])
def test_b_box_runs_exactly_the_boxes_windows_and_equals_monai(b_box, monkeypatch) -> None:
    model = small_net()
    x = torch.randn(1, 1, 14, 12, 16)
    options = dict(mask_size=4, n_batch=8, mode=FILL, overlap=0.5, verbose=False)
    monai_model = OccludedWindows(model, x)
    want_map, want_class = monai_visualize.OcclusionSensitivity(monai_model, **options)(x, b_box=b_box)

    ran = []  # the corners the drop-in hands to incremental inference
    original = OcclusionRunner.run  # whichever way the drop-in reaches it, every run goes through this class

    def recording_run(self, corners, *args, **kwargs):
        ran.append(np.asarray(corners))
        return original(self, corners, *args, **kwargs)

    monkeypatch.setattr(OcclusionRunner, "run", recording_run)
    ours = OcclusionSensitivity(model, **options)
    got_map, got_class = ours(x, b_box=b_box)

    # the same windows as MONAI, no more (MONAI occludes each window once)
    assert len(monai_model.corners) == len(set(monai_model.corners))
    (corners,) = ran
    assert sorted(map(tuple, corners.tolist())) == sorted(monai_model.corners)
    stats = ours.last_stats
    assert stats["positions"] == len(monai_model.corners)
    # multiply-adds for those windows only: what ran lies between the geometry's count for exactly these windows
    # (each window's own update regions) and re-running the model on each of them
    graph = captured_graph(model, tuple(x.shape[1:]))
    exact = incremental_flops(graph, propagate(graph, input_boxes(corners, (4, 4, 4), tuple(x.shape[2:])),
                                               uniform=False)).sum()
    ran_macs = stats["flops_full"] * stats["positions"] / stats["realized_flop_ratio"]
    assert exact <= ran_macs * (1 + 1e-9) and ran_macs <= stats["flops_full"] * stats["positions"]
    if b_box is None:
        assert stats["positions"] == 6 * 5 * 7  # windows of 4 at stride 2 over 14 x 12 x 16
    # MONAI's map inside the box
    assert got_map.shape == want_map.shape and torch.equal(got_class, want_class)
    assert ((got_map - want_map).abs().max() / want_map.abs().max()).item() < 1e-5


def test_a_smaller_box_runs_fewer_windows_and_multiply_adds() -> None:
    model = small_net()
    x = torch.randn(1, 1, 14, 12, 16)
    runs = {}
    for name, b_box in (("whole", None), ("box", [0, 5, 0, 5, 0, 5])):
        ours = OcclusionSensitivity(model, mask_size=4, n_batch=8, mode=FILL, overlap=0.5, verbose=False)
        ours(x, b_box=b_box)
        s = ours.last_stats
        runs[name] = (s["positions"], s["flops_full"] * s["positions"] / s["realized_flop_ratio"])
    assert runs["box"][0] < runs["whole"][0] / 10 and runs["box"][1] < runs["whole"][1] / 10
