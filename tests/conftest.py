"""Shared test helpers: every RNG seeded, small zoo models cached per session."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


_MODELS: dict[str, torch.nn.Module] = {}


def zoo_model(name: str) -> torch.nn.Module:
    """A zoo model, built once per test process, with batch-norm statistics calibrated on random inputs so
    that random-init activations neither vanish nor explode (the exactness checks need outputs that move)."""
    from incrinf import models

    if name not in _MODELS:
        model = models.load(name)
        if name != "efficientnet_lite0":
            calibrate_batchnorm(model, 96 if name == "inception_v3" else 64)
        _MODELS[name] = model
    return _MODELS[name]


def calibrate_batchnorm(model: torch.nn.Module, size: int) -> None:
    """Set batch-norm running statistics from a few random images; leaves the model in eval mode."""
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative average
    model.train()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model(torch.randn(8, 3, size, size, generator=g))
    model.eval()


def naive_occlusion(model: torch.nn.Module, image: torch.Tensor, positions: np.ndarray, window: tuple[int, int],
                    baseline: float = 0.0) -> torch.Tensor:
    """Reference: re-run the model on every occluded copy (what Captum does)."""
    outs = []
    for lo in range(0, len(positions), 32):
        chunk = positions[lo:lo + 32]
        batch = image.repeat(len(chunk), 1, 1, 1)
        for i, (y, x) in enumerate(chunk):
            batch[i, :, y:y + window[0], x:x + window[1]] = baseline
        with torch.no_grad():
            outs.append(model(batch))
    return torch.cat(outs)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module: tiny maps and latency decisions need steady compute times (two
    OpenMP threads on two busy cores stall for tens of milliseconds per op, and CI runs two workers)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_classifier() -> torch.nn.Module:
    """A two-convolution classifier with fixed weights (seed 0): cheap enough for servers and sessions in tests."""
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    ).eval()


def assert_planned_batches(runner, positions: np.ndarray, window: tuple[int, ...], batch_size: int, stats) -> None:
    """A run's batches are its plan's, exactly: the plan (from the runtime cache, a hit) packs every position once,
    in batches of at most ``batch_size``, and the run ran that many."""
    from incrinf.geometry import input_boxes

    boxes = input_boxes(np.asarray(positions), tuple(window), runner.dims)
    plan, hit, _ = runner.plan(boxes.start(), boxes.sizes(), batch_size, None)
    assert hit  # the run's own plan, not a new one
    assert stats.batches == len(plan.batches) and stats.batch_size == plan.batch_size
    assert all(1 <= b.n <= batch_size for b in plan.batches)
    assert np.array_equal(np.sort(np.concatenate([b.queries for b in plan.batches])), np.arange(len(positions)))
