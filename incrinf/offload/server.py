"""The offload server: full, cached and split (suffix) inference over HTTP(S), with per-client stream caches.

Stack: ``aiohttp`` (asyncio HTTP/1.1 with keep-alive, request-size limits and a mature parser); the model
runs in a small thread pool so a slow inference never blocks the event loop, and one client's bad request
never stops the others.

Endpoints (binary bodies are :mod:`incrinf.offload.wire` tensor messages):

=========================  ===================================================================================
``GET /health``            liveness, model identity (name, graph signature, weight digest), whether a token and
                           TLS are required, and the limits; no token needed, no secret in it
``GET /profile``           per-node times of the server's model (measured once at start-up) and split points
``POST /session``          open a stream cache; answers ``{"session": id}`` (a 128-bit random capability)
``DELETE /session``        drop the cache named by the ``X-Incrinf-Session`` header
``POST /infer/full``       tensor ``frame`` (H, W, C) uint8 or ``input`` (1, C, H, W) float32 -> ``output``;
                           with ``X-Incrinf-Session`` and meta ``frame_id`` the frame becomes that cache's
                           reference
``POST /infer/cached``     meta ``base_id``, ``frame_id``; tensors ``boxes`` (n, 4) int32, ``tiles`` uint8
                           and optionally ``matrix`` (3, 3) float64: the server warps its reference by the
                           homography, pastes the tiles (:func:`~incrinf.offload.wire.apply_update`), runs
                           the model on that frame and keeps it as the new reference. Only changed pixels
                           cross the uplink.
``POST /infer/suffix?k=N`` tensor ``tensor`` = the value live after split node ``N`` -> ``output``
``POST /probe``            body discarded: the client times it to measure the link
=========================  ===================================================================================

Responses carry ``X-Server-Seconds`` (compute time, so the client can separate network from compute) and,
for cached streams, ``X-Frame-Digest`` of the reference frame. Errors are JSON ``{"error": ...}`` with 400
(malformed payload), 401 (missing or wrong bearer token), 404 (unknown session or route), 409 (the client's
reference frame is not the server's: send a full frame), 413 (request too large), 429 (the credential's request
rate or open-session cap is exceeded: ``Retry-After`` says when to come back, JSON ``retry_after`` more
precisely).

Security (:class:`~incrinf.offload.config.ServerConfig`): loopback by default, and a public interface only with
tokens (or an explicit ``insecure``); any number of tokens, each its own credential; TLS when a certificate and
key are given; per-credential request rate (token bucket) and open-session cap; refused requests are
rate-limited per peer address. Isolation: caches are keyed by (credential, session id); session ids are
server-issued random capabilities, so a client can neither read (run the model on) nor overwrite another
client's reference frame.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import threading
import time
import warnings
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from incrinf.extras import require
from incrinf.graph import captured_graph, split_points
from incrinf.normalization import FRAME_MEAN, FRAME_STD, Normalization
from incrinf.offload import wire
from incrinf.offload.config import DEFAULT_MAX_REQUEST_BYTES, ServerConfig
from incrinf.offload.credentials import server_ssl_context
from incrinf.offload.limits import RateLimiter, retry_after_header
from incrinf.offload.store import SessionNotFound, SessionStore, TooManySessions
from incrinf.offload.timing import NodeTimes, SplitRunner, model_digest, time_nodes

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "CacheConflict", "ModelService", "OffloadServer", "SessionNotFound",
           "SessionStore", "TooManySessions"]

web = require("aiohttp.web", "serve", "the offload server")
HttpProcessingError = require("aiohttp.http_exceptions", "serve", "the offload server").HttpProcessingError

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Incrinf-Session"
# The request's credential, set by the guard (typed keys from aiohttp 3.14; a plain string before).
_OWNER: Any = web.RequestKey("owner", str) if hasattr(web, "RequestKey") else "incrinf.owner"


class _ClientFaultFilter(logging.Filter):
    """aiohttp logs every request it cannot parse at ERROR, with a traceback: the client's fault, not the server's,
    and a client sending many would flood the log. They become one short INFO line each."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError) and (error.code or 400) < 500:
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = "malformed request answered %s: %s", (error.code, str(error.message)[:120])
            record.exc_info = record.exc_text = None
        return True


_CLIENT_FAULTS = _ClientFaultFilter()


class CacheConflict(RuntimeError):
    """The client's reference frame id is not the server's: the client must send a full frame."""


class ModelService:
    """The model side of the server, free of HTTP: full, cached and suffix inference plus the profile.

    Args:
        model: the model (put in eval mode).
        input_shape: ``(C, H, W)``: the one input shape this server accepts.
        name: model name reported to clients.
        mean: per-channel normalisation mean applied to uint8 frames
            (:class:`~incrinf.normalization.Normalization`); default: the camera-stream sessions'
            (:data:`~incrinf.normalization.FRAME_MEAN`).
        std: per-channel normalisation std.
        timing_repeats: timed passes when measuring the per-node times at start-up.
        max_sessions: most per-client caches kept.
        session_ttl: seconds before an unused cache is dropped.
    """

    def __init__(self, model: nn.Module, input_shape: tuple[int, ...], *, name: str = "model",
                 mean: tuple[float, ...] = FRAME_MEAN, std: tuple[float, ...] = FRAME_STD,
                 timing_repeats: int = 5, max_sessions: int = 256, session_ttl: float = 600.0,
                 profile_repeats: int | None = None) -> None:
        if profile_repeats is not None:
            warnings.warn("profile_repeats is now called timing_repeats", DeprecationWarning, stacklevel=2)
            timing_repeats = profile_repeats
        self.model = model.eval()
        self.name = name
        self.graph = captured_graph(model, input_shape)  # shared with every other user of this model
        self.input_shape = tuple(self.graph.input_shape)
        self.normalization = Normalization(mean, std)
        self.mean, self.std = self.normalization.mean, self.normalization.std
        if self.normalization.channels != self.input_shape[1]:
            raise ValueError("mean and std need one value per input channel")
        self.runner = SplitRunner(self.graph)
        self.digest = model_digest(model)
        param = next(iter(model.parameters()), None)
        self.dtype = param.dtype if param is not None else torch.float32
        with torch.no_grad():
            self.times: NodeTimes = time_nodes(self.graph, torch.zeros(self.input_shape, dtype=self.dtype),
                                               repeats=timing_repeats)
        self.sessions = SessionStore(max_sessions, session_ttl)

    @property
    def frame_shape(self) -> tuple[int, int, int]:
        _, c, h, w = self.input_shape
        return (h, w, c)

    def identity(self) -> dict:
        return {"model": self.name, "signature": self.graph.signature, "digest": self.digest,
                "input_shape": list(self.input_shape)}

    def profile_json(self) -> dict:
        return {
            **self.identity(), "mean": list(self.mean), "std": list(self.std),
            "threads": torch.get_num_threads(), "profile": self.times.to_json(),
            "splits": [{"name": s.name, "index": s.index, "shape": list(s.shape), "nbytes": s.nbytes}
                       for s in split_points(self.graph)],
        }

    def _run(self, x: torch.Tensor) -> tuple[np.ndarray, float]:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model(x.to(self.dtype))
        return out.float().numpy(), time.perf_counter() - t0

    def _frame_input(self, frame: np.ndarray) -> torch.Tensor:
        if frame.shape != self.frame_shape:
            raise wire.PayloadError(f"frame must be {self.frame_shape} uint8, got {frame.shape}")
        return self.normalization.tensor(frame)

    def infer_full(self, msg: wire.Message, owner: str, session: str | None) -> tuple[np.ndarray, float, str | None]:
        """Full inference on a frame or a model input; with a session the frame becomes its reference.

        Returns:
            ``(output, compute seconds, reference digest or None)``.
        """
        if "frame" in msg.tensors:
            frame = msg.tensor("frame", np.uint8, 3)
            x = self._frame_input(frame)
        elif "input" in msg.tensors:
            x = torch.from_numpy(msg.tensor("input", np.float32))
            if tuple(x.shape) != self.input_shape:
                raise wire.PayloadError(f"input must be {self.input_shape} float32, got {tuple(x.shape)}")
            frame = None
        else:
            raise wire.PayloadError("send a tensor named 'frame' (H, W, C) uint8 or 'input' (1, C, H, W) float32")
        if session is None:
            out, seconds = self._run(x)
            return out, seconds, None
        if frame is None:
            raise wire.PayloadError("a session reference must be a uint8 'frame'")
        frame_id = _int_meta(msg, "frame_id")
        cache = self.sessions.get(owner, session)
        with cache.lock:
            out, seconds = self._run(x)
            cache.frame, cache.frame_id = frame, frame_id
            return out, seconds, wire.frame_digest(frame)

    def infer_cached(self, msg: wire.Message, owner: str, session: str) -> tuple[np.ndarray, float, str]:
        """Rebuild the session's next frame from its reference + homography + tiles and run the model.

        Raises:
            SessionNotFound: unknown session. CacheConflict: ``base_id`` is not the reference's id.
            wire.PayloadError: malformed update.
        """
        base_id, frame_id = _int_meta(msg, "base_id"), _int_meta(msg, "frame_id")
        boxes = msg.tensor("boxes", np.int32, 2)
        tiles = msg.tensor("tiles", np.uint8, 1)
        matrix = msg.tensor("matrix", np.float64) if "matrix" in msg.tensors else None
        if matrix is not None and matrix.shape != (3, 3):
            raise wire.PayloadError(f"matrix must be (3, 3), got {matrix.shape}")
        cache = self.sessions.get(owner, session)
        with cache.lock:
            if cache.frame is None or cache.frame_id != base_id:
                raise CacheConflict(f"reference is frame {cache.frame_id}, request builds on {base_id}: "
                                    "send a full frame")
            frame = wire.apply_update(cache.frame, matrix, boxes, tiles)
            out, seconds = self._run(self._frame_input(frame))
            cache.frame, cache.frame_id = frame, frame_id
            return out, seconds, wire.frame_digest(frame)

    def infer_suffix(self, msg: wire.Message, split: str) -> tuple[np.ndarray, float]:
        """Run the graph after split node ``split`` from the tensor live there."""
        if split not in self.runner.splits:
            raise wire.PayloadError(f"unknown split point {split!r}; GET /profile lists them")
        tensor = torch.from_numpy(msg.tensor("tensor", np.float32))
        t0 = time.perf_counter()
        try:
            out = self.runner.suffix(tensor.to(self.dtype), split)
        except ValueError as exc:
            raise wire.PayloadError(str(exc)) from None
        return out.float().numpy(), time.perf_counter() - t0


def _int_meta(msg: wire.Message, key: str) -> int:
    value = msg.meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise wire.PayloadError(f"metadata {key!r} must be an integer, got {value!r}")
    return value


def _error(status: int, message: str, headers: dict[str, str] | None = None, **fields: Any) -> web.Response:
    return web.json_response({"error": message, "status": status, **fields}, status=status, headers=headers)


def _too_many(message: str, retry_after: float) -> web.Response:
    return _error(429, message, {"Retry-After": retry_after_header(retry_after)}, retry_after=round(retry_after, 3))


def _owner_of(token: bytes) -> str:
    # Caches and limits are namespaced by credential; a hash, so the key never holds the secret itself.
    return "token:" + hashlib.sha256(token).hexdigest()[:16]


class OffloadServer:
    """HTTP(S) front of a :class:`ModelService`.

    Use :meth:`start` / :meth:`stop` (background thread, for tests, benchmarks and embedding) or
    :meth:`serve_forever` (the ``incrinf serve`` command).

    Args:
        service: the model service.
        config: the server settings (:class:`~incrinf.offload.config.ServerConfig`: interface, tokens, TLS,
            limits); default: its defaults (loopback, no token).
        token: one accepted bearer token (added to ``config.tokens``); every endpoint but ``/health`` then needs
            ``Authorization: Bearer <token>``.
        **settings: any :class:`~incrinf.offload.config.ServerConfig` field (``host=``, ``port=``,
            ``tls_cert=``, ``requests_per_second=``, ...), replacing the one in ``config``.

    Raises:
        ValueError: a public interface without a token (unless ``insecure``), bad limits, an unusable
            certificate. TypeError: an unknown setting.
    """

    def __init__(self, service: ModelService, config: ServerConfig | None = None, *, token: str | None = None,
                 **settings: Any) -> None:
        self.service = service
        self.config = ServerConfig.build(config, token=token, **settings)
        self.host, self._requested_port = self.config.host, self.config.port
        self._tokens = [(t.encode(), _owner_of(t.encode())) for t in self.config.tokens]
        self.max_request_bytes = self.config.max_request_bytes
        self._ssl = server_ssl_context(self.config.tls_cert, self.config.tls_key) if self.config.tls else None
        self._rate = RateLimiter(self.config.requests_per_second, self.config.burst)
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop_requested = threading.Event()
        self._startup_error: BaseException | None = None
        self.port: int | None = None
        self.started_at = time.monotonic()

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self._ssl else 'http'}://{host}:{self.port}"

    # --- app ---------------------------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_request_bytes, middlewares=[self._guard])
        app.router.add_get("/health", self._health)
        app.router.add_get("/profile", self._profile)
        app.router.add_post("/session", self._open_session)
        app.router.add_delete("/session", self._close_session)
        app.router.add_post("/infer/full", self._full)
        app.router.add_post("/infer/cached", self._cached)
        app.router.add_post("/infer/suffix", self._suffix)
        app.router.add_post("/probe", self._probe)
        return app

    def _credential(self, request: web.Request) -> str | None:
        """The owner key of the request's credential, ``"anon"`` on a server without tokens, None if refused."""
        if not self._tokens:
            return "anon"
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        presented = given.strip().encode("utf-8", "surrogateescape")
        owner = None
        for token, key in self._tokens:  # compare with every token: the time taken says nothing about which
            if hmac.compare_digest(presented, token) and scheme.lower() == "bearer":
                owner = key
        return owner

    @web.middleware
    async def _guard(self, request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.path != "/health":
            owner = self._credential(request)
            # Refused requests are limited per peer address too, so guessing tokens is as slow as the rate.
            wait = self._rate.acquire(owner or f"peer:{request.remote}")
            if wait > 0:
                return _too_many(f"request rate above {self.config.requests_per_second:g}/s for this credential",
                                 wait)
            if owner is None:
                return _error(401, "missing or wrong bearer token", {"WWW-Authenticate": 'Bearer realm="incrinf"'})
            request[_OWNER] = owner
        length = request.content_length
        if length is not None and length > self.max_request_bytes:
            return _error(413, f"request body of {length} bytes exceeds the limit of {self.max_request_bytes}")
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body exceeds the limit of {self.max_request_bytes} bytes")
        except web.HTTPException as exc:
            return _error(exc.status, exc.reason)
        except wire.PayloadError as exc:
            return _error(400, f"malformed payload: {exc}")
        except SessionNotFound as exc:
            return _error(404, str(exc))
        except CacheConflict as exc:
            return _error(409, str(exc))
        except TooManySessions as exc:
            return _too_many(str(exc), exc.retry_after)
        except (ConnectionResetError, HttpProcessingError) as exc:  # the body broke off: the client's fault
            log.debug("request %s %s: incomplete body: %s", request.method, request.path, exc)
            return _error(400, f"incomplete request body: {type(exc).__name__}")
        except Exception:  # a bug must not take the server down; the client sees a 500
            log.exception("request %s %s failed", request.method, request.path)
            return _error(500, "internal error")

    async def _body(self, request: web.Request) -> wire.Message:
        return wire.decode(await request.read())

    def _session(self, request: web.Request, required: bool) -> str | None:
        session = request.headers.get(SESSION_HEADER)
        if required and not session:
            raise wire.PayloadError(f"the {SESSION_HEADER} header is required (POST /session opens one)")
        return session or None

    async def _compute(self, fn: Callable, *args: object) -> object:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _tensor_response(self, out: np.ndarray, seconds: float, digest: str | None = None) -> web.Response:
        headers = {"X-Server-Seconds": f"{seconds:.6f}"}
        if digest is not None:
            headers["X-Frame-Digest"] = digest
        return web.Response(body=wire.encode({"output": out}), content_type=wire.CONTENT_TYPE, headers=headers)

    async def _health(self, request: web.Request) -> web.Response:
        sessions = self.service.sessions
        limits = {**self.config.limits_json(), "max_sessions": sessions.max_sessions, "session_ttl": sessions.ttl}
        return web.json_response({"status": "ok", **self.service.identity(),
                                  "uptime": time.monotonic() - self.started_at, "auth": "token" if self._tokens else
                                  "none", "tls": self._ssl is not None, "limits": limits,
                                  "open_sessions": sessions.count()})

    async def _profile(self, request: web.Request) -> web.Response:
        return web.json_response(self.service.profile_json())

    async def _open_session(self, request: web.Request) -> web.Response:
        session = self.service.sessions.create(request[_OWNER], self.config.sessions_per_token)
        return web.json_response({"session": session})

    async def _close_session(self, request: web.Request) -> web.Response:
        session = self._session(request, required=True)
        if not self.service.sessions.delete(request[_OWNER], session):
            raise SessionNotFound("unknown session")
        return web.json_response({"deleted": session})

    async def _full(self, request: web.Request) -> web.Response:
        msg = await self._body(request)
        out, seconds, digest = await self._compute(self.service.infer_full, msg, request[_OWNER],
                                                   self._session(request, required=False))
        return self._tensor_response(out, seconds, digest)

    async def _cached(self, request: web.Request) -> web.Response:
        msg = await self._body(request)
        out, seconds, digest = await self._compute(self.service.infer_cached, msg, request[_OWNER],
                                                   self._session(request, required=True))
        return self._tensor_response(out, seconds, digest)

    async def _suffix(self, request: web.Request) -> web.Response:
        split = request.query.get("k")
        if not split:
            raise wire.PayloadError("query parameter k (the split node) is required")
        msg = await self._body(request)
        out, seconds = await self._compute(self.service.infer_suffix, msg, split)
        return self._tensor_response(out, seconds)

    async def _probe(self, request: web.Request) -> web.Response:
        n = len(await request.read())
        return web.json_response({"bytes": n})

    # --- lifecycle ---------------------------------------------------------------------------------------

    async def _start_async(self) -> None:
        self._runner = web.AppRunner(self.make_app(), access_log=None, shutdown_timeout=0.25)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self._requested_port, reuse_address=True,
                           ssl_context=self._ssl)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the real port when 0 was asked for

    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._start_async())
        except BaseException as exc:  # e.g. port in use: report to start()
            self._startup_error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

    def start(self, timeout: float = 30.0) -> OffloadServer:
        """Serve in a background thread; returns once the port is bound."""
        if self._thread is not None:
            raise RuntimeError("server already started")
        parse_log = logging.getLogger("aiohttp.server")
        if _CLIENT_FAULTS not in parse_log.filters:
            parse_log.addFilter(_CLIENT_FAULTS)
        self.started_at = time.monotonic()
        self._executor = ThreadPoolExecutor(max_workers=self.config.workers, thread_name_prefix="incrinf-infer")
        self._thread = threading.Thread(target=self._thread_main, name="incrinf-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("server did not start")
        if self._startup_error is not None:
            self._thread = None
            self._ready.clear()
            self._executor.shutdown(wait=False)
            error, self._startup_error = self._startup_error, None
            raise OSError(f"cannot serve on {self.host}:{self._requested_port}: {error}")
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Close the listening socket and every open connection (in-flight requests are cut)."""
        if self._thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._thread = None
        self._ready.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def request_stop(self) -> None:
        """Ask :meth:`serve_forever` to stop and return. Safe in a signal handler and at any time, before
        :meth:`serve_forever` is entered too (it only sets an event)."""
        self._stop_requested.set()

    def serve_forever(self) -> None:
        """Serve until :meth:`request_stop` (the CLI's SIGTERM handler) or Ctrl-C; starts the server unless
        :meth:`start` already did."""
        if self._thread is None:
            self.start()
        try:
            while self._thread is not None and self._thread.is_alive() and not self._stop_requested.is_set():
                self._stop_requested.wait(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    def __enter__(self) -> OffloadServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
