"""Offloading stream session: per frame, run locally, on the offload server, or split, with or without cache.

Per frame, :class:`OffloadingSession` asks the :class:`~incrinf.offload.scheduler.Scheduler` for an option (cost
model over per-node times, the link measured online, the predicted change fraction, rebuild costs, hysteresis),
runs it (:class:`~incrinf.offload.dispatch.Dispatcher`), and records what was chosen, why, and predicted vs
actual time in :attr:`OffloadingSession.stats`. Its parts: the settings (one frozen, validated
:class:`~incrinf.offload.config.OffloadConfig`), the link to the server (:mod:`incrinf.offload.connection`:
clients, back-off, the background worker, probes), what is measured before the first frame
(:mod:`incrinf.offload.calibration`) and the per-frame dispatch (:mod:`incrinf.offload.dispatch`).

Faults: an offload that fails (refused, reset, timed out, server error, 429) is completed locally within the same
call: no frame is dropped or duplicated, outputs come back in order; the connection then backs off.

Local cached inference is delegated to the incremental :class:`~incrinf.stream.session.StreamSession` (reset
whenever another option ran, so its next frame rebuilds the cache); for models it cannot cache,
:class:`~incrinf.offload.local.FullInferenceStandIn` (full inference, reported as recompute fraction 1, so the
scheduler predicts it honestly as no faster than ``local_full``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from incrinf.graph import captured_graph
from incrinf.normalization import FRAME_MEAN, FRAME_STD, Normalization
from incrinf.offload.calibration import calibrate, calibration_frames, cost_model
from incrinf.offload.client import LinkEstimator, OffloadError
from incrinf.offload.config import OffloadConfig
from incrinf.offload.connection import ServerConnection
from incrinf.offload.dispatch import Dispatcher
from incrinf.offload.local import FullInferenceStandIn, SlowDevice, StreamSessionBackend, local_backend
from incrinf.offload.policy import LOCAL_FULL, OFFLOAD_FULL, Policy
from incrinf.offload.scheduler import Scheduler
from incrinf.offload.stats import FrameLog, OffloadFrameStats
from incrinf.offload.timing import NodeTimes, SplitRunner, model_digest
from incrinf.offload.uplink import ChangedPixelsUplink, Update
from incrinf.stream.config import StreamConfig

__all__ = ["ChangedPixelsUplink", "FrameLog", "FullInferenceStandIn", "OffloadFrameStats", "OffloadingSession",
           "SlowDevice", "StreamSessionBackend", "Update"]


class OffloadingSession:
    """A camera-stream session that schedules every frame among local, offloaded and hybrid execution.

    Example:
        >>> config = OffloadConfig(offload="http://127.0.0.1:8765", policy="auto", budget=0.25)  # doctest: +SKIP
        >>> session = OffloadingSession(model, config=config)  # doctest: +SKIP
        >>> outputs = [session(frame) for frame in frames]  # frames: (H, W, 3) uint8  # doctest: +SKIP
        >>> session.stats[-1].mode, session.stats[-1].reason  # doctest: +SKIP

    Args:
        model: the model (eval mode), or a zoo name (``incrinf.models``).
        offload: the server's URL (:attr:`OffloadConfig.offload`), replacing the one in ``config``.
        policy: a :class:`~incrinf.offload.policy.Policy` or its name (:attr:`OffloadConfig.policy`), replacing the
            one in ``config``.
        config: the settings (:class:`~incrinf.offload.config.OffloadConfig`; default: its defaults). A
            :class:`~incrinf.stream.config.StreamConfig` is taken as the stream settings of the cached options.
        local_session: factory of the local cached engine (a ``StreamSession``-like callable); default: the
            incremental :class:`~incrinf.stream.session.StreamSession` with the stream settings, or
            :class:`~incrinf.offload.local.FullInferenceStandIn` for models it cannot cache.
        local_options: extra ``StreamSession`` arguments (``device``, ...).
        **settings: any :class:`~incrinf.offload.config.OffloadConfig` field (``budget=``, ``token=``,
            ``input_size=``, ...) or :class:`~incrinf.stream.config.StreamConfig` field (``pixel_threshold=``, ...),
            replacing the one in ``config``.

    Raises:
        TypeError: an unknown setting (the message lists the valid ones).
        ValueError: a bad setting (a policy that offloads without a server, a split node the model does not have,
            ...), or a server whose model, weights, input size or normalisation differ from the local ones.
        CaptureError: the model cannot be traced.

    Attributes:
        config: the settings.
        stats: one :class:`~incrinf.offload.stats.OffloadFrameStats` per frame, the newest ``config.keep_stats``.
        connection: the link to the server (:class:`~incrinf.offload.connection.ServerConnection`), or None.
        scheduler: chooses each frame's option.
        input_size: (H, W) of the frames.
        normalization: how uint8 frames become model inputs.
    """

    def __init__(self, model: nn.Module | str, offload: str | None = None, policy: Policy | str | None = None, *,
                 config: OffloadConfig | StreamConfig | None = None, local_session: Callable[[], Any] | None = None,
                 local_options: dict[str, Any] | None = None, **settings: Any) -> None:
        if offload is not None:
            settings["offload"] = offload
        if policy is not None:
            settings["policy"] = policy
        self.config = config = OffloadConfig.build(config, **settings)
        self.model, self.model_name, zoo_mean, zoo_std = _resolve_model(model)
        self.device = SlowDevice(config.local_slowdown)
        self.digest = model_digest(self.model)
        self.connection = ServerConnection(config, self.digest) if config.offload else None
        server_info = self.connection.connect() if self.connection is not None else None
        self.link = self.connection.link if self.connection is not None else LinkEstimator()
        input_size = config.input_size or (tuple(server_info["input_shape"][2:]) if server_info
                                           else _zoo_size(self.model_name))
        self.input_size = (int(input_size[0]), int(input_size[1]))
        server = server_info or {}
        self.normalization = Normalization(config.mean or zoo_mean or server.get("mean") or FRAME_MEAN,
                                           config.std or zoo_std or server.get("std") or FRAME_STD)
        self.mean, self.std = self.normalization.mean, self.normalization.std
        channels = self.normalization.channels
        self.graph = captured_graph(self.model, (channels, *self.input_size))  # one per model, shared read-only
        if server_info is not None:
            problem = self._incompatibility(server_info)
            if problem:
                raise ValueError(problem)
        self.runner = SplitRunner(self.graph)
        self.scheduler = Scheduler(cost_model(self.graph, self.runner, config, server_info), config.policy,
                                   config.lookahead, config.margin, split=config.split)
        self.local_cached = local_backend(local_session, self.model, self.input_size, self.normalization,
                                          config.stream, local_options)
        self.uplink = ChangedPixelsUplink(config.stream)
        calibrate(self.scheduler, self.uplink, self.local_cached, self.device,
                  calibration_frames(self.input_size, channels))
        self.dispatcher = Dispatcher(self.model, self.normalization, self.runner, self.local_cached, self.uplink,
                                     self.device, self.scheduler.cost, self.connection)
        self.stats: FrameLog = FrameLog(config.keep_stats)  # OffloadFrameStats, the newest keep_stats
        self._index = 0
        if self.connection is not None:
            self.connection.frame_bytes = self.scheduler.cost.payloads.of(OFFLOAD_FULL, 1.0)
            self.connection.adopt = self._adopt
            self.connection.start(probe_now=self.scheduler.deciding)

    def _incompatibility(self, info: dict) -> str | None:
        """Why the server's model cannot stand in for ours, or None."""
        if info.get("digest") != self.digest:
            return "the offload server runs different weights (digest mismatch)"
        if info.get("signature") != self.graph.signature:
            return "the server's model graph differs from the local one (architecture or input size)"
        if tuple(info.get("mean", ())) != self.mean or tuple(info.get("std", ())) != self.std:
            return "the server normalises frames differently (mean/std): outputs would differ"
        return None

    def _adopt(self, info: dict) -> str | None:
        """A server that was unreachable at start-up answered: use its per-node times, if it can stand in."""
        problem = self._incompatibility(info)
        if problem is None:
            self.scheduler.cost.server = NodeTimes.from_json(info["profile"])
        return problem

    def __call__(self, frame: np.ndarray) -> torch.Tensor:
        """Process the next frame.

        Args:
            frame: (H, W, C) uint8 camera frame of ``input_size``.

        Returns:
            The model output for the frame, (1, ...) float32.
        """
        frame = np.ascontiguousarray(frame)
        expected = (*self.input_size, self.normalization.channels)
        if frame.shape != expected or frame.dtype != np.uint8:
            raise ValueError(f"frame must be {expected} uint8, got {frame.shape} {frame.dtype}")
        t0 = time.perf_counter()
        index = self._index
        self._index += 1
        server_up = self.connection is not None and self.connection.usable()
        decision = self.scheduler.decide(self.link, server_up, self._offload_timeout(t0))
        error = None
        try:
            outcome = self.dispatcher.run(decision.option, frame, index, self._offload_timeout(t0))
            mode = decision.option
        except OffloadError as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.connection.failed(exc)
            self.uplink.reset()
            outcome = self.dispatcher.local(LOCAL_FULL, frame)
            mode = LOCAL_FULL
        seconds = time.perf_counter() - t0
        self.scheduler.committed(mode, outcome.warm)
        if outcome.recompute_fraction is not None:
            self.scheduler.observe_x(mode, outcome.recompute_fraction)
        reason = decision.reason + ("".join(f"; {n}" for n in outcome.notes))
        if error:
            reason += f"; offload failed, computed locally ({error})"
        self.stats.append(OffloadFrameStats(
            index, mode, decision.option, reason, decision.predictions, decision.predicted, seconds,
            fallback=error is not None, error=error, recompute_fraction=outcome.recompute_fraction,
            flops_ratio=outcome.flops_ratio, bytes_up=outcome.bytes_up, bytes_down=outcome.bytes_down,
            server_seconds=outcome.server_seconds, full_upload=outcome.full_upload))
        if not mode.offloads and self.connection is not None and self.scheduler.deciding:
            self.connection.maybe_probe()  # a pinned policy has no use for probes
        return outcome.output

    def _offload_timeout(self, t0: float) -> float:
        """How long an offload request of this frame may take: ``max_timeout``, or with a budget what is left
        of it after keeping enough for a local fallback."""
        timeout = self.config.max_timeout
        if self.config.budget is not None:
            local_fallback = self.scheduler.cost.predict(LOCAL_FULL, 1.0, self.link).total
            timeout = max(0.01, min(timeout, self.config.budget - local_fallback - (time.perf_counter() - t0)))
        return timeout

    def close(self) -> None:
        """Stop the background worker, close the server's cache of this stream (best effort: otherwise it expires)
        and the connections."""
        if self.connection is not None:
            self.connection.close()

    def __enter__(self) -> OffloadingSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _resolve_model(model: nn.Module | str) -> tuple[nn.Module, str | None, tuple | None, tuple | None]:
    """The module, its zoo name (None for a module) and the zoo entry's normalisation (None, None for a module)."""
    if isinstance(model, str):
        from incrinf import models

        meta = models.info(model)
        return models.load(model), model, meta.mean, meta.std
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or a zoo name, got {type(model).__name__}")
    return model.eval(), None, None, None


def _zoo_size(name: str | None) -> tuple[int, int]:
    if name is None:
        raise ValueError("input_size is required for a model that is not a zoo name (or give a server)")
    from incrinf import models

    size = models.info(name).input_size
    return (size, size)
