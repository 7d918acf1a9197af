"""What an offloading session measures before its first frame: the model's per-node times on this machine, the
cost model built from them and the server's, and priors for the options that keep state.

The cost model (:class:`~incrinf.offload.scheduler.CostModel`) rests on measured times only: the local graph is
timed node by node here (times an emulated slowdown), the server's times come from its ``/profile``; the
hybrid split points considered are the ``max_splits`` with the smallest tensors (plus a pinned one). Then
:func:`calibrate` runs a few frames of a slowly panning view of the sample photo to measure the client's
overhead of ``offload_changed_pixels`` (matching, change mask, packing) and how the local cached engine's time
relates to the cost model's prediction.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from incrinf.graph import Graph, cache_point, split_points
from incrinf.offload.config import OffloadConfig
from incrinf.offload.local import SlowDevice
from incrinf.offload.policy import LOCAL_CACHED, Policy
from incrinf.offload.scheduler import CostModel, Payloads, Scheduler
from incrinf.offload.timing import NodeTimes, SplitRunner, time_nodes
from incrinf.offload.uplink import ChangedPixelsUplink


def cost_model(graph: Graph, runner: SplitRunner, config: OffloadConfig, server_info: dict | None) -> CostModel:
    """The cost model of ``graph``: its per-node times measured here, the server's (None without a server), the
    payload of every option and the split points considered.

    Raises:
        ValueError: ``config.split`` is not a split point of the graph.
    """
    with torch.no_grad():
        local = time_nodes(graph, torch.zeros(graph.input_shape), repeats=config.timing_repeats)
    server = NodeTimes.from_json(server_info["profile"]) if server_info else None
    splits = sorted(split_points(graph), key=lambda s: (s.nbytes, -s.index))[:config.max_splits]
    if config.split is not None:
        if config.split not in runner.splits:
            raise ValueError(f"split {config.split!r} is not a split point of the model; choose one of "
                             f"{', '.join(runner.splits)}")
        splits = [runner.split(config.split)] + [s for s in splits if s.name != config.split]
    _, channels, height, width = graph.input_shape
    out_shape = graph.output.shape or graph.nodes[-2].shape or (1,)
    payloads = Payloads(channels * height * width, int(np.prod(out_shape)) * 4,
                        splits={s.name: s.nbytes for s in splits})
    return CostModel(local.scaled(config.local_slowdown), server, payloads, splits, cache_point(graph))


def calibration_frames(input_size: tuple[int, int], channels: int) -> list[np.ndarray]:
    """Three views of the sample photo, each shifted by a few pixels (a slowly panning camera): (H, W, C) uint8."""
    import cv2

    from incrinf import models

    h, w = input_size
    photo = cv2.resize(models.sample_image(), (w + 16, h + 16), interpolation=cv2.INTER_AREA)
    return [np.ascontiguousarray(np.resize(photo[2 * k:h + 2 * k, 3 * k:w + 3 * k], (h, w, channels)))
            for k in range(3)]


def calibrate(scheduler: Scheduler, uplink: ChangedPixelsUplink, local_cached: Any, device: SlowDevice,
              frames: list[np.ndarray]) -> None:
    """Priors for the options that keep state, measured on this device: the client overhead of
    ``offload_changed_pixels`` (matching + mask + packing of the second frame) and, when the policy may run it,
    the local cached engine's time over the cost model's (its second cached frame, after one warm-up).

    Args:
        scheduler: its cost model's priors are set.
        uplink: the client half of ``offload_changed_pixels`` (left reset).
        local_cached: the local cached engine (a ``StreamSession``-like callable; left reset).
        device: the (emulated) local device.
        frames: :func:`calibration_frames`.
    """
    cost = scheduler.cost
    uplink.commit(uplink.prepare(frames[0], 0), 0)
    t0 = time.perf_counter()
    with device.compute():
        uplink.prepare(frames[1], 1)
    cost.overhead[Policy.OFFLOAD_CHANGED_PIXELS].value = time.perf_counter() - t0
    uplink.reset()
    if scheduler.policy not in (Policy.AUTO, Policy.LOCAL_CACHED):
        return
    try:
        for frame in frames:  # full, cached (warm-up), cached (timed)
            t0 = time.perf_counter()
            with device.compute(), torch.no_grad():
                local_cached(frame)
            seconds = time.perf_counter() - t0
        x = local_cached.last_recompute_fraction
        modelled = cost.local_cached_model(x) * cost.local_scale.value
        if modelled > 0:
            cost.cached_scale.value = min(cost.cached_scale.hi, max(cost.cached_scale.lo, seconds / modelled))
            scheduler.x[LOCAL_CACHED.policy].value = x
    finally:
        local_cached.reset()
