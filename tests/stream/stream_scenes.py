"""Scenes, models and frozen cost coefficients shared by the stream session tests.

Imported by the test modules of this folder (pytest puts the folder on the path); nothing here is a test.
"""

import cv2
import numpy as np
import pytest
import skimage.data
import torch
import torch.nn as nn

from incrinf.engine.costs import PRIOR_CALL, FrameCosts
from incrinf.engine.frames import FrameEngine
from incrinf.stream.session import StreamSession

H, W = 64, 80


def still_camera(n: int) -> list[np.ndarray]:
    """``n`` frames ``(H, W, 3)`` uint8 of a still camera: a photo with a small bright square moving 2 px a frame."""
    photo = cv2.resize(skimage.data.chelsea(), (W, H), interpolation=cv2.INTER_AREA)
    out = []
    for k in range(n):
        frame = photo.copy()
        frame[20:30, 4 + 2 * k:14 + 2 * k] = 250
        out.append(frame)
    return out


def small_classifier() -> nn.Module:
    """Three strided convolutions, global pooling and a linear head: 10 logits."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, stride=2, padding=1),
                         nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(32, 10)).eval()


def wide_classifier() -> nn.Module:
    """Enough work per frame that recomputing a small change is clearly cheaper than a full frame: 10 logits."""
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 48, 3, padding=1), nn.ReLU()]
    for _ in range(4):
        layers += [nn.Conv2d(48, 48, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(48, 10)).eval()


def full_inference(model: nn.Module, frame: np.ndarray) -> torch.Tensor:
    """Plain inference on one ``(H, W, 3)`` uint8 frame, normalised as the session does (mean 0.5, std 0.5)."""
    x = torch.from_numpy(frame).permute(2, 0, 1)[None].float() / 255.0
    with torch.no_grad():
        return model((x - 0.5) / 0.5)


def untimed_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines profiled from their plans' multiply-adds and bytes (the priors a new engine's costs start from)
    instead of timed runs: the first full frame's profile, and the no-reuse decision made on it (a small model's
    measured saving falls under ``min_saving`` when the machine's load inflates its fixed costs), are then the same
    whatever the load. Later frames still calibrate the costs from what they measure."""

    def profile(self: FrameEngine, *args, **kwargs) -> None:
        priors = FrameCosts(self.program)
        calls = [PRIOR_CALL] * len(priors.steps)
        self.costs.set_profile([s.dense for s in priors.steps], calls, calls, priors.tail, priors.move, 0.0)

    monkeypatch.setattr(FrameEngine, "profile", profile)


def frozen_costs(session: StreamSession, monkeypatch: pytest.MonkeyPatch) -> FrameCosts:
    """The session's cost coefficients set from the plan's multiply-adds and bytes (the engine's priors) and kept
    there: no profile, no calibration from wall-clock timings, so the speed guard's decisions are a function of the
    plans alone, whatever the machine's load (the priors of a new cost model of the same program: the first frame's
    timed profile, when one ran, is replaced)."""
    engine = next(iter(session._engines.values())).engine
    costs, priors = engine.costs, FrameCosts(engine.program)
    calls = [PRIOR_CALL] * len(priors.steps)
    costs.set_profile([s.dense for s in priors.steps], calls, calls, priors.tail, priors.move, 0.0)
    for name in ("record_full", "record_steps", "record_survival", "record_frame"):
        monkeypatch.setattr(costs, name, lambda *args: None)
    return costs
