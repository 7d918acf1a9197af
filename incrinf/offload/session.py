"""Offloading stream session: per frame, run locally, on the offload server, or split, with or without cache.

Per frame, :class:`OffloadingSession` (``OffloadingSession(model, offload=URL, policy=...)``) asks the
:class:`~incrinf.offload.scheduler.Scheduler` for an option (cost model over profiles, the link measured online,
the predicted change fraction, cache-rebuild costs, hysteresis), runs it, and records what was chosen, why, and
predicted vs actual time in :attr:`OffloadingSession.stats`.

Faults: an offload that fails (refused, reset, timed out, server error) is completed locally within the same
call: no frame is dropped or duplicated, outputs come back in order. The server is then in back-off
(exponential, capped); a background worker re-checks ``/health`` (and that the model's weights still match)
when the back-off expires, and offloading resumes once it answers. A 429 (the credential's request rate or
session cap on the server) is handled the same way, except that the back-off lasts at least the server's
``Retry-After`` and the server's cache is kept. While the client computes locally, the same worker times small
probe transfers so the link estimate stays fresh without delaying frames.

Credentials: ``token=`` (or ``$INCRINF_TOKEN``), and for ``https://`` servers ``ca_file=`` / ``verify=``, go to
every request, probes and health checks included.

Local cached inference is delegated to the incremental :class:`~incrinf.stream.session.StreamSession` (reset
whenever another option ran, so its next frame rebuilds the cache); for models it cannot cache,
:class:`FullInferenceStandIn` (full inference, reported as recompute fraction 1, so the scheduler predicts
it honestly as no faster than ``local_full``).

A slower robot CPU can be emulated with ``local_slowdown``: every local computation sleeps ``slowdown - 1``
times its measured duration (:class:`SlowDevice`), and the local profile is scaled by the same factor.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from incrinf.graph import cache_point, captured_graph, split_points
from incrinf.normalization import IMAGENET_MEAN, IMAGENET_STD, Normalization
from incrinf.offload import wire
from incrinf.offload.client import (
    Backoff,
    LinkEstimator,
    OffloadClient,
    OffloadError,
    RateLimited,
    ReferenceMismatch,
    ServerUnavailable,
    SessionLost,
)
from incrinf.offload.local import FullInferenceStandIn, SlowDevice, StreamSessionBackend, local_backend
from incrinf.offload.profile import NodeProfile, SplitRunner, model_digest, profile_graph
from incrinf.offload.scheduler import (
    HYBRID,
    LOCAL_CACHED,
    LOCAL_FULL,
    OFFLOAD_CACHED,
    OFFLOAD_FULL,
    CostModel,
    Decision,
    Payloads,
    Scheduler,
    is_offload,
    split_of,
)
from incrinf.offload.stats import FrameLog, OffloadFrameStats
from incrinf.offload.uplink import CachedUplink, Update
from incrinf.stream.config import StreamConfig

__all__ = ["CachedUplink", "FrameLog", "FullInferenceStandIn", "OffloadFrameStats", "OffloadingSession", "SlowDevice",
           "StreamSessionBackend", "Update"]


@dataclass
class _Outcome:
    output: torch.Tensor
    recompute_fraction: float | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    server_seconds: float = 0.0
    full_upload: bool = False
    warm: bool = False
    notes: list[str] = field(default_factory=list)
    flops_ratio: float | None = None


class _NetworkWorker:
    """Background thread for health checks during back-off and link probes while computing locally."""

    def __init__(self, session: OffloadingSession) -> None:
        self.session = session
        self.tasks: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=4)
        self.busy = threading.Lock()  # held by a probe; an offloading frame waits for it
        self.thread = threading.Thread(target=self._run, name="incrinf-offload-net", daemon=True)
        self.thread.start()

    def submit(self, task: Callable[[], None]) -> bool:
        try:
            self.tasks.put_nowait(task)
            return True
        except queue.Full:
            return False

    def _run(self) -> None:
        while True:
            task = self.tasks.get()
            if task is None:
                return
            with self.busy:
                try:
                    task()
                except Exception:  # a failed probe only means no sample
                    pass

    def close(self) -> None:
        with contextlib.suppress(queue.Full):
            self.tasks.put(None, timeout=1.0)
        self.thread.join(2.0)


class OffloadingSession:
    """A camera-stream session that schedules every frame among local, offloaded and hybrid execution.

    Example:
        >>> session = OffloadingSession(model, offload="http://127.0.0.1:8765", policy="auto")  # doctest: +SKIP
        >>> outputs = [session(frame) for frame in frames]  # frames: (H, W, 3) uint8
        >>> session.stats[-1].mode, session.stats[-1].reason

    Args:
        model: the model (eval mode), or a zoo name (``incrinf.models``).
        offload: server URL ``http://host:port`` or ``https://host:port``, or None for local only.
        policy: ``"auto"``, ``"local_full"``, ``"local_cached"``, ``"offload_full"``, ``"offload_cached"``,
            ``"hybrid"`` (best split) or ``"hybrid:<node>"``.
        input_size: (H, W) of the frames; default: from the server, or the model's zoo input size.
        mean: normalisation mean of uint8 frames (default: the zoo model's, else ImageNet).
        std: normalisation std.
        token: bearer token of the server; None reads ``$INCRINF_TOKEN`` (unset: no token); ``""`` sends none.
        ca_file: PEM file of the authority that signed the server's TLS certificate (``https://`` URLs; default:
            the system's trust store).
        verify: verify the server's TLS certificate and host name (keep True outside tests).
        config: stream settings of the cached options (:class:`~incrinf.stream.config.StreamConfig`): change
            threshold and cell, ``max_ratio`` of changed cells from which a cached option sends / computes the
            full frame, matcher, keyframe interval (a full frame, local or uploaded, every that many frames), and
            the local session's feature threshold and the rest.
        local_session: factory of the local cached engine (a ``StreamSession``-like callable); default: the
            incremental :class:`~incrinf.stream.session.StreamSession` with the settings above, or
            :class:`FullInferenceStandIn` for models it cannot cache.
        local_options: extra ``StreamSession`` arguments (``device``, ...).
        budget: seconds a frame may take; offload timeouts are chosen so a failed offload can still finish
            locally within it (None: ``max_timeout``).
        max_timeout: longest offload timeout in seconds.
        local_slowdown: emulate a local device this many times slower (see :class:`SlowDevice`).
        lookahead: frames a switch must pay off over (hysteresis).
        margin: relative saving required to switch.
        backoff_initial: first retry delay after a failure (seconds).
        backoff_cap: longest retry delay.
        probe_interval: seconds between link probes while not offloading (0 disables probes).
        max_splits: hybrid split points considered by ``auto`` (the smallest tensors).
        profile_repeats: timed passes of the local profile.
        keep_stats: per-frame records kept in :attr:`stats` (the newest; None: all). A stream never ends, and
            every record costs about 0.7 KB.
    """

    def __init__(self, model: nn.Module | str, offload: str | None = None, policy: str = "auto", *,
                 input_size: tuple[int, int] | None = None, mean: tuple[float, ...] | None = None,
                 std: tuple[float, ...] | None = None, token: str | None = None,
                 ca_file: str | os.PathLike | None = None, verify: bool = True,
                 config: StreamConfig | None = None, local_session: Callable[[], Any] | None = None,
                 local_options: dict[str, Any] | None = None,
                 budget: float | None = None,
                 max_timeout: float = 2.0, local_slowdown: float = 1.0, lookahead: int = 10,
                 margin: float = 0.1, backoff_initial: float = 0.25, backoff_cap: float = 8.0,
                 probe_interval: float = 0.25, max_splits: int = 3, profile_repeats: int = 5,
                 keep_stats: int | None = 1000,
                 **settings: Any) -> None:
        self.config = StreamConfig.build(config, **settings)
        self.model, self.model_name, mean, std = _resolve_model(model, mean, std)
        self.offload_url = offload
        self.budget, self.max_timeout = budget, max_timeout
        self.device = SlowDevice(local_slowdown)
        self.probe_interval = probe_interval
        self.link = LinkEstimator()
        self.backoff = Backoff(backoff_initial, backoff_cap)
        # Both clients raise on 429 at once: a rate-limited frame is computed locally instead of waiting.
        client = dict(timeout=max_timeout, link=self.link, ca_file=ca_file, verify=verify, wait_rate_limited=False)
        self.client = OffloadClient(offload, token, **client) if offload else None
        self._probe_client = OffloadClient(offload, token, **client) if offload else None
        self.digest = model_digest(self.model)
        server_info = self._connect() if self.client is not None else None
        if input_size is None:
            input_size = tuple(server_info["input_shape"][2:]) if server_info else _zoo_size(self.model_name)
        self.input_size = (int(input_size[0]), int(input_size[1]))
        self.normalization = Normalization(mean or (server_info or {}).get("mean") or IMAGENET_MEAN,
                                           std or (server_info or {}).get("std") or IMAGENET_STD)
        self.mean, self.std = self.normalization.mean, self.normalization.std
        channels = self.normalization.channels
        self.graph = captured_graph(self.model, (channels, *self.input_size))  # one per model, shared read-only
        if server_info is not None:
            problem = self._incompatibility(server_info)
            if problem:
                raise ValueError(problem)
        self.runner = SplitRunner(self.graph)
        with torch.no_grad():
            local_profile = profile_graph(self.graph, torch.zeros(self.graph.input_shape),
                                          repeats=profile_repeats).scaled(local_slowdown)
        server_profile = NodeProfile.from_json(server_info["profile"]) if server_info else None
        splits = sorted(split_points(self.graph), key=lambda s: (s.nbytes, -s.index))[:max_splits]
        pinned = split_of(policy)
        if pinned is not None:
            splits = [self.runner.split(pinned)] + [s for s in splits if s.name != pinned]
        frame_bytes = channels * self.input_size[0] * self.input_size[1]
        out_shape = self.graph.output.shape or self.graph.nodes[-2].shape or (1,)
        payloads = Payloads(frame_bytes, int(np.prod(out_shape)) * 4, splits={s.name: s.nbytes for s in splits})
        cost = CostModel(local_profile, server_profile, payloads, splits, cache_point(self.graph))
        self.scheduler = Scheduler(cost, policy, lookahead, margin)
        if policy != "auto" and is_offload(policy) and self.client is None:
            raise ValueError(f"policy {policy!r} needs an offload URL")
        self.local_cached = local_backend(local_session, self.model, self.input_size, self.normalization,
                                           self.config, local_options)
        self.uplink = CachedUplink(self.config)
        self._calibrate()
        self.session_id: str | None = None
        self.incompatible: str | None = None
        self.probes = 0
        self.stats: FrameLog = FrameLog(keep_stats)  # OffloadFrameStats, the newest keep_stats
        self._index = 0
        self._server_up = server_info is not None
        self._last_network = -float("inf")
        self._health_pending = False
        self._worker = _NetworkWorker(self) if self.client is not None else None
        if self._worker is not None and self._server_up and policy in ("auto", HYBRID):
            with contextlib.suppress(OffloadError):  # the first decision gets a measured link (<= ~0.5 s)
                self._probe()

    def _calibration_frames(self) -> list[np.ndarray]:
        """Three views of the sample photo, each shifted by a few pixels (a slowly panning camera)."""
        import cv2

        from incrinf import models

        h, w = self.input_size
        photo = cv2.resize(models.sample_image(), (w + 16, h + 16), interpolation=cv2.INTER_AREA)
        channels = len(self.mean)
        return [np.ascontiguousarray(np.resize(photo[2 * k:h + 2 * k, 3 * k:w + 3 * k], (h, w, channels)))
                for k in range(3)]

    def _calibrate(self) -> None:
        """Priors for the cached options, measured on this device before the first frame: the client
        overhead of offload_cached (matching + mask + packing) and the local cached engine's time relative
        to the cost model (its second cached frame, after one warm-up)."""
        cost = self.scheduler.cost
        frames = self._calibration_frames()
        self.uplink.commit(self.uplink.prepare(frames[0], 0), 0)
        t0 = time.perf_counter()
        with self.device.compute():
            self.uplink.prepare(frames[1], 1)
        cost.overhead[OFFLOAD_CACHED].value = time.perf_counter() - t0
        self.uplink.reset()
        if self.scheduler.policy not in ("auto", LOCAL_CACHED):
            return
        try:
            for frame in frames:  # full, cached (warm-up), cached (timed)
                t0 = time.perf_counter()
                with self.device.compute(), torch.no_grad():
                    self.local_cached(frame)
                seconds = time.perf_counter() - t0
            x = self.local_cached.last_recompute_fraction
            modelled = cost.local_cached_model(x) * cost.local_scale.value
            if modelled > 0:
                cost.cached_scale.value = min(cost.cached_scale.hi, max(cost.cached_scale.lo, seconds / modelled))
                self.scheduler.x[LOCAL_CACHED].value = x
        finally:
            self.local_cached.reset()

    # --- connection --------------------------------------------------------------------------------------

    def _connect(self) -> dict | None:
        """Health + identity check + profile; None (and back-off) if the server cannot be used now."""
        try:
            health = self.client.health(timeout=min(1.0, self.max_timeout))
            if health.get("digest") != self.digest:
                raise ValueError("the offload server runs different weights (digest mismatch)")
            info = self.client.profile()
            self.backoff.success()
            return info
        except OffloadError:
            self.backoff.failure()
            return None

    def _incompatibility(self, info: dict) -> str | None:
        """Why the server's model cannot stand in for ours, or None."""
        if info.get("digest") != self.digest:
            return "the offload server runs different weights (digest mismatch)"
        if info.get("signature") != self.graph.signature:
            return "the server's model graph differs from the local one (architecture or input size)"
        if tuple(info.get("mean", ())) != self.mean or tuple(info.get("std", ())) != self.std:
            return "the server normalises frames differently (mean/std): outputs would differ"
        return None

    def _health_check(self) -> None:
        """Background: is the server back (and still the same model)?"""
        try:
            health = self._probe_client.health(timeout=min(0.5, self.max_timeout))
            ok = health.get("digest") == self.digest
            if ok and self.scheduler.cost.server is None:  # first contact: adopt its profile
                info = self._probe_client.profile(timeout=min(2.0, self.max_timeout))
                problem = self._incompatibility(info)
                self.incompatible = problem
                if problem is None:
                    self.scheduler.cost.server = NodeProfile.from_json(info["profile"])
                ok = problem is None
        except OffloadError:
            ok = False
        if ok:
            self.backoff.success()
            self._server_up = True
        else:
            self.backoff.failure()
        self._health_pending = False

    def _probe(self) -> None:
        """Background: time a tiny transfer (round trip) and one as large as a full frame's request, so the
        estimate is measured where it is used; on a slow link the large one is cut to half the probe
        interval's worth of bytes, so probing never fills the link."""
        self._probe_client.health(timeout=0.5)
        frame_bytes = self.scheduler.cost.payloads.of(OFFLOAD_FULL, 1.0)
        nbytes = int(max(2048, min(frame_bytes, self.link.bandwidth * self.probe_interval / 2)))
        self._probe_client.probe(nbytes, timeout=min(self.max_timeout, max(0.5, 4 * self.link.predict(nbytes))))
        self.probes += 1

    def _server_usable(self) -> bool:
        if self.client is None:
            return False
        if self._server_up:
            return True
        if self.backoff.due() and not self._health_pending:
            self._health_pending = self._worker.submit(self._health_check)
        return False

    def _server_failed(self, exc: Exception) -> None:
        self._server_up = False
        if isinstance(exc, RateLimited):  # the server is fine and keeps our cache: wait as long as it asks
            self.backoff.failure(at_least=exc.retry_after)
            return
        # The server's cache is kept even when the server is unreachable or slow: a server that restarted answers
        # 404 for it (SessionLost), and then a new one is opened. Forgetting it here would leave it open on the
        # server until it expires, and a few timeouts would fill the credential's session cap.
        self.client.close()
        self.backoff.failure()

    # --- per frame ---------------------------------------------------------------------------------------

    def __call__(self, frame: np.ndarray) -> torch.Tensor:
        """Process the next frame.

        Args:
            frame: (H, W, C) uint8 camera frame of ``input_size``.

        Returns:
            The model output for the frame, (1, ...) float32.
        """
        frame = np.ascontiguousarray(frame)
        expected = (*self.input_size, len(self.mean))
        if frame.shape != expected or frame.dtype != np.uint8:
            raise ValueError(f"frame must be {expected} uint8, got {frame.shape} {frame.dtype}")
        t0 = time.perf_counter()
        index = self._index
        self._index += 1
        decision = self.scheduler.decide(self.link, self._server_usable(), self._offload_timeout(t0))
        error = None
        try:
            outcome = self._run(decision, frame, index, t0)
            mode = decision.option
        except OffloadError as exc:
            error = f"{type(exc).__name__}: {exc}"
            self._server_failed(exc)
            self.uplink.reset()
            outcome = self._local(LOCAL_FULL, frame)
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
        if not is_offload(mode):
            self._maybe_probe()
        return outcome.output

    def _maybe_probe(self) -> None:
        """After a local frame: refresh the link estimate in the background if it is getting old."""
        deciding = self.scheduler.policy in ("auto", HYBRID)  # a pinned policy has no use for probes
        if not (deciding and self._worker is not None and self._server_up and self.probe_interval > 0):
            return
        now = time.monotonic()
        if now - self._last_network > self.probe_interval and self.link.age() > self.probe_interval:
            self._last_network = now
            self._worker.submit(self._probe)

    def _run(self, decision: Decision, frame: np.ndarray, index: int, t0: float) -> _Outcome:
        option = decision.option
        if not is_offload(option):
            return self._local(option, frame)
        timeout = self._offload_timeout(t0)
        deadline = time.perf_counter() + timeout
        # Let a probe in flight finish rather than share the link with it, but never wait long for it.
        exclusive = self._worker.busy.acquire(timeout=min(0.05, timeout / 4))
        try:
            self._last_network = time.monotonic()
            if option == OFFLOAD_FULL:
                return self._offload_full(frame, deadline)
            if option == OFFLOAD_CACHED:
                return self._offload_cached(frame, index, deadline)
            return self._hybrid(split_of(option), frame, deadline)
        finally:
            if exclusive:
                self._worker.busy.release()

    def _offload_timeout(self, t0: float) -> float:
        """How long an offload request of this frame may take: ``max_timeout``, or with a budget what is left
        of it after keeping enough for a local fallback."""
        timeout = self.max_timeout
        if self.budget is not None:
            local_fallback = self.scheduler.cost.predict(LOCAL_FULL, 1.0, self.link).total
            timeout = max(0.01, min(timeout, self.budget - local_fallback - (time.perf_counter() - t0)))
        return timeout

    def _remaining(self, deadline: float) -> float:
        left = deadline - time.perf_counter()
        if left <= 0:
            raise ServerUnavailable("frame budget spent before the request")
        return left

    def _local(self, option: str, frame: np.ndarray) -> _Outcome:
        t0 = time.perf_counter()
        with self.device.compute(), torch.no_grad():
            if option == LOCAL_CACHED:
                output = self.local_cached(frame)
            else:
                output = self.model(self.normalization.tensor(frame))
        seconds = time.perf_counter() - t0
        cost = self.scheduler.cost
        if option == LOCAL_CACHED:
            x = self.local_cached.last_recompute_fraction
            cost.observe_local_cached(seconds, x)
            return _Outcome(output, x, warm=True, flops_ratio=self.local_cached.last_flops_ratio)
        self.local_cached.reset()  # the local cache does not hold this frame
        cost.observe_local_full(seconds)
        return _Outcome(output, 1.0)

    def _learn_remote(self, option: str, reply, overhead: float) -> None:
        cost = self.scheduler.cost
        cost.observe_server(reply.server_seconds, option)
        cost.observe_overhead(option, overhead)

    def _offload_full(self, frame: np.ndarray, deadline: float) -> _Outcome:
        reply = self.client.infer_full(frame, timeout=self._remaining(deadline))
        self._learn_remote(OFFLOAD_FULL, reply, 0.0)
        self.local_cached.reset()
        return _Outcome(torch.from_numpy(reply.output), 1.0, reply.bytes_up, reply.bytes_down, reply.server_seconds)

    def _offload_cached(self, frame: np.ndarray, index: int, deadline: float) -> _Outcome:
        self.local_cached.reset()
        notes: list[str] = []
        t0 = time.perf_counter()
        with self.device.compute():
            update = self.uplink.prepare(frame, index)
        overhead = time.perf_counter() - t0
        for attempt in (0, 1):
            try:
                if self.session_id is None:
                    self.session_id = self.client.open_session(timeout=self._remaining(deadline))
                if update.full:
                    reply = self.client.infer_full(frame, self.session_id, index, timeout=self._remaining(deadline))
                else:
                    reply = self.client.infer_cached(self.session_id, self.uplink.reference_id, index,
                                                     update.matrix, update.boxes, update.tiles,
                                                     timeout=self._remaining(deadline))
                break
            except (SessionLost, ReferenceMismatch) as exc:
                if attempt == 1:
                    raise
                notes.append(f"server cache lost ({exc.status}): resent the full frame")
                if isinstance(exc, SessionLost):
                    self.session_id = None
                update = Update(True, "server cache lost", frame.copy(), 1.0)
        if reply.digest is not None and reply.digest != wire.frame_digest(update.reference):
            notes.append("reference digests differ: next frame goes out full")
            self.uplink.reset()
        else:
            self.uplink.commit(update, index)
        if update.full:
            notes.append(f"full upload ({update.reason})")
        else:
            self._learn_remote(OFFLOAD_CACHED, reply, overhead)
        return _Outcome(torch.from_numpy(reply.output), update.recompute_fraction if not update.full else None,
                        reply.bytes_up, reply.bytes_down, reply.server_seconds, update.full, warm=True, notes=notes)

    def _hybrid(self, split: str, frame: np.ndarray, deadline: float) -> _Outcome:
        self.local_cached.reset()
        with self.device.compute():
            tensor = self.runner.prefix(self.normalization.tensor(frame), split)
        reply = self.client.infer_suffix(split, tensor.numpy(), timeout=self._remaining(deadline))
        self._learn_remote(f"{HYBRID}:{split}", reply, 0.0)
        return _Outcome(torch.from_numpy(reply.output), 1.0, reply.bytes_up, reply.bytes_down, reply.server_seconds)

    def close(self) -> None:
        """Stop the background worker, close the server's cache of this stream (best effort: otherwise it expires)
        and the connections."""
        if self._worker is not None:
            self._worker.close()
        if self.client is not None and self.session_id is not None and self._server_up:
            with contextlib.suppress(OffloadError):
                self.client.close_session(self.session_id, timeout=min(0.5, self.max_timeout))
            self.session_id = None
        for client in (self.client, self._probe_client):
            if client is not None:
                client.close()

    def __enter__(self) -> OffloadingSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _resolve_model(model: nn.Module | str, mean, std) -> tuple[nn.Module, str | None, Any, Any]:
    if isinstance(model, str):
        from incrinf import models

        meta = models.info(model)
        return models.load(model), model, mean or meta.mean, std or meta.std
    return model.eval(), None, mean, std


def _zoo_size(name: str | None) -> tuple[int, int]:
    if name is None:
        raise ValueError("input_size is required for a model that is not a zoo name (or give a server)")
    from incrinf import models

    size = models.info(name).input_size
    return (size, size)
