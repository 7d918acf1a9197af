"""Running one frame the way the scheduler chose: locally (full or cached), offloaded (the whole frame or only
its changed pixels), or split between the two ends; and teaching the cost model what that took.

An :class:`~incrinf.offload.client.OffloadError` leaves :meth:`Dispatcher.run`; the session then completes the
frame locally (no frame is dropped or duplicated).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from incrinf.normalization import Normalization
from incrinf.offload import wire
from incrinf.offload.client import ReferenceMismatch, Reply, ServerUnavailable, SessionLost
from incrinf.offload.connection import ServerConnection
from incrinf.offload.local import SlowDevice
from incrinf.offload.policy import Option, Policy
from incrinf.offload.scheduler import CostModel
from incrinf.offload.timing import SplitRunner
from incrinf.offload.uplink import ChangedPixelsUplink, Update


@dataclass
class Outcome:
    """What running one frame gave.

    Attributes:
        output: the model's output for the frame, (1, ...) float32.
        recompute_fraction: changed share of the frame (1 for full work; None when unknown: a full upload).
        bytes_up: request bytes (0 for local frames).
        bytes_down: response bytes.
        server_seconds: the server's compute time.
        full_upload: an ``offload_changed_pixels`` frame that sent the whole frame.
        warm: the option's state now holds this frame.
        notes: what else happened, in words (appended to the frame's reason).
        flops_ratio: full FLOPs over computed FLOPs of the local cached engine (None otherwise).
    """

    output: torch.Tensor
    recompute_fraction: float | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    server_seconds: float = 0.0
    full_upload: bool = False
    warm: bool = False
    notes: list[str] = field(default_factory=list)
    flops_ratio: float | None = None


class Dispatcher:
    """Runs frames by option.

    Args:
        model: the local model.
        normalization: how uint8 frames become model inputs.
        runner: the model split in two halves at each split point (hybrid frames).
        local_cached: the local cached engine (a ``StreamSession``-like callable with ``reset``,
            ``last_recompute_fraction``, ``last_flops_ratio``).
        uplink: the client half of ``offload_changed_pixels``.
        device: the (emulated) local device every local computation runs under.
        cost: the cost model, taught by every frame.
        connection: the server, or None (local only).
    """

    def __init__(self, model: nn.Module, normalization: Normalization, runner: SplitRunner, local_cached: Any,
                 uplink: ChangedPixelsUplink, device: SlowDevice, cost: CostModel,
                 connection: ServerConnection | None) -> None:
        self.model, self.normalization, self.runner = model, normalization, runner
        self.local_cached, self.uplink, self.device = local_cached, uplink, device
        self.cost, self.connection = cost, connection

    def run(self, option: Option, frame: np.ndarray, index: int, timeout: float) -> Outcome:
        """Run ``frame`` (the stream's frame number ``index``) as ``option``; an offload gets ``timeout`` seconds
        in all.

        Raises:
            OffloadError: the offload failed (the caller computes the frame locally).
        """
        if not option.offloads:
            return self.local(option, frame)
        deadline = time.perf_counter() + timeout
        with self.connection.request(timeout):
            if option.policy is Policy.OFFLOAD_FULL:
                return self._offload_full(frame, deadline)
            if option.policy is Policy.OFFLOAD_CHANGED_PIXELS:
                return self._offload_changed_pixels(frame, index, deadline)
            return self._hybrid(option, frame, deadline)

    def local(self, option: Option, frame: np.ndarray) -> Outcome:
        """Run ``frame`` here: the local cached engine for ``local_cached``, else the whole model."""
        t0 = time.perf_counter()
        with self.device.compute(), torch.no_grad():
            if option.policy is Policy.LOCAL_CACHED:
                output = self.local_cached(frame)
            else:
                output = self.model(self.normalization.tensor(frame))
        seconds = time.perf_counter() - t0
        if option.policy is Policy.LOCAL_CACHED:
            x = self.local_cached.last_recompute_fraction
            self.cost.observe_local_cached(seconds, x)
            return Outcome(output, x, warm=True, flops_ratio=self.local_cached.last_flops_ratio)
        self.local_cached.reset()  # the local cache does not hold this frame
        self.cost.observe_local_full(seconds)
        return Outcome(output, 1.0)

    def _remaining(self, deadline: float) -> float:
        left = deadline - time.perf_counter()
        if left <= 0:
            raise ServerUnavailable("frame budget spent before the request")
        return left

    def _learn_remote(self, option: Option, reply: Reply, overhead: float) -> None:
        self.cost.observe_server(reply.server_seconds, option)
        self.cost.observe_overhead(option, overhead)

    def _remote(self, reply: Reply, **fields: Any) -> Outcome:
        return Outcome(torch.from_numpy(reply.output), bytes_up=reply.bytes_up, bytes_down=reply.bytes_down,
                       server_seconds=reply.server_seconds, **fields)

    def _offload_full(self, frame: np.ndarray, deadline: float) -> Outcome:
        reply = self.connection.client.infer_full(frame, timeout=self._remaining(deadline))
        self._learn_remote(Option(Policy.OFFLOAD_FULL), reply, 0.0)
        self.local_cached.reset()
        return self._remote(reply, recompute_fraction=1.0)

    def _offload_changed_pixels(self, frame: np.ndarray, index: int, deadline: float) -> Outcome:
        self.local_cached.reset()
        client, uplink, notes = self.connection.client, self.uplink, []
        t0 = time.perf_counter()
        with self.device.compute():
            update = uplink.prepare(frame, index)
        overhead = time.perf_counter() - t0
        for attempt in (0, 1):
            try:
                stream = self.connection.open_stream(self._remaining(deadline))
                if update.full:
                    reply = client.infer_full(frame, stream, index, timeout=self._remaining(deadline))
                else:
                    reply = client.infer_cached(stream, uplink.reference_id, index, update.matrix, update.boxes,
                                                update.tiles, timeout=self._remaining(deadline))
                break
            except (SessionLost, ReferenceMismatch) as exc:
                if attempt == 1:
                    raise
                notes.append(f"server cache lost ({exc.status}): resent the full frame")
                if isinstance(exc, SessionLost):
                    self.connection.stream_id = None
                update = Update(True, "server cache lost", frame.copy(), 1.0)
        if reply.digest is not None and reply.digest != wire.frame_digest(update.reference):
            notes.append("reference digests differ: next frame goes out full")
            uplink.reset()
        else:
            uplink.commit(update, index)
        if update.full:
            notes.append(f"full upload ({update.reason})")
        else:
            self._learn_remote(Option(Policy.OFFLOAD_CHANGED_PIXELS), reply, overhead)
        return self._remote(reply, recompute_fraction=None if update.full else update.recompute_fraction,
                            full_upload=update.full, warm=True, notes=notes)

    def _hybrid(self, option: Option, frame: np.ndarray, deadline: float) -> Outcome:
        self.local_cached.reset()
        with self.device.compute():
            tensor = self.runner.prefix(self.normalization.tensor(frame), option.split)
        reply = self.connection.client.infer_suffix(option.split, tensor.numpy(), timeout=self._remaining(deadline))
        self._learn_remote(option, reply, 0.0)
        return self._remote(reply, recompute_fraction=1.0)
