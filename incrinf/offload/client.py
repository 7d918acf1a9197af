"""HTTP client of the offload server, online link estimation, and retry back-off.

- :class:`OffloadClient`: one persistent HTTP/1.1 or HTTPS connection (stdlib ``http.client``, TCP_NODELAY),
  a timeout per request taken from the frame's budget, one transparent reconnect when a kept-alive connection
  turns out to be stale, the bearer token (argument or ``$INCRINF_TOKEN``), TLS verification on by default,
  and ``Retry-After`` honoured when the server limits the request rate (429). Every transfer is timed and fed
  to a :class:`LinkEstimator`.
- :class:`LinkEstimator`: round-trip time and bandwidth from real transfers. Each request gives one sample
  ``(bytes moved, seconds on the wire)`` (the server's compute time, reported in ``X-Server-Seconds``, is
  subtracted); a weighted least-squares fit of ``seconds = rtt + bytes / bandwidth`` over recent samples,
  with exponential forgetting, predicts the time of any payload.
- :class:`Backoff`: exponential, capped delays between retries of a server that failed.

Payloads are :mod:`incrinf.offload.wire` messages; the server's endpoints are listed in
:mod:`incrinf.offload.server`.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import ssl
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from incrinf.offload import wire
from incrinf.offload.credentials import client_ssl_context, client_token, server_address

SESSION_HEADER = "X-Incrinf-Session"
# Request line, headers and their response counterparts: counted as bytes on the wire.
HTTP_OVERHEAD_BYTES = 400
# Bandwidth estimates are capped here (bytes/s, 10 Gbit/s): transfers too short to time say only "fast".
MAX_BANDWIDTH = 1.25e9


class OffloadError(Exception):
    """Offloading this frame failed; the caller computes it locally."""


class ServerUnavailable(OffloadError):
    """Connection refused, reset or timed out: the server is down, unreachable or too slow."""


class RemoteError(OffloadError):
    """The server answered with an error status.

    Attributes:
        status: HTTP status.
        message: the server's explanation.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class RateLimited(RemoteError):
    """429: this credential's request rate or open-session cap is exceeded.

    Attributes:
        retry_after: seconds the server asks us to wait before the next request.
    """

    def __init__(self, status: int, message: str, retry_after: float) -> None:
        super().__init__(status, message)
        self.retry_after = retry_after


class SessionLost(RemoteError):
    """404: the server does not know our session (restart, expiry): open a new one and send a full frame."""


class ReferenceMismatch(RemoteError):
    """409: the server's reference frame is not ours: send a full frame."""


@dataclass
class Reply:
    """One completed request.

    Attributes:
        output: the decoded ``output`` tensor, or None for non-tensor replies.
        json: the decoded JSON body for JSON replies.
        seconds: wall time of the request (send, server, receive).
        server_seconds: the server's compute time (0 if not reported).
        bytes_up: request bytes including an HTTP overhead estimate.
        bytes_down: response bytes including an HTTP overhead estimate.
        digest: ``X-Frame-Digest`` (cached streams) or None.
    """

    output: np.ndarray | None
    json: dict | None
    seconds: float
    server_seconds: float
    bytes_up: int
    bytes_down: int
    digest: str | None = None


class LinkEstimator:
    """Online estimate of the link's round-trip time and bandwidth from timed transfers.

    Fits ``seconds = rtt + bytes / bandwidth`` by least squares over the last ``window`` samples, sample
    ``i`` (0 = newest) weighted ``forget ** i``. When recent samples all have about the same size the slope
    is not identifiable; then the previous RTT is kept and the bandwidth comes from the newest samples.
    Thread-safe (the session's background prober feeds it too).

    Args:
        window: samples kept.
        forget: weight decay per older sample, in (0, 1].
        rtt: prior round-trip time in seconds.
        bandwidth: prior bandwidth in bytes per second.
    """

    def __init__(self, window: int = 12, forget: float = 0.75, rtt: float = 0.005,
                 bandwidth: float = 1.25e6) -> None:
        self.window = window
        self.forget = forget
        self.rtt = rtt
        self.bandwidth = bandwidth
        self.samples: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.updated_at = -math.inf

    def add(self, nbytes: float, seconds: float) -> None:
        """Record one transfer of ``nbytes`` (up + down) that spent ``seconds`` on the network."""
        if not (nbytes > 0 and seconds > 0 and math.isfinite(seconds)):
            return
        with self._lock:
            self.samples.appendleft((float(nbytes), float(seconds), time.monotonic()))
            self.updated_at = time.monotonic()
            self._fit()

    def _fit(self) -> None:
        b = np.array([s[0] for s in self.samples])
        t = np.array([s[1] for s in self.samples])
        w = self.forget ** np.arange(len(b))
        spread = b.max() / max(b.min(), 1.0)
        if len(b) >= 3 and spread >= 1.5:
            wb, wt = np.average(b, weights=w), np.average(t, weights=w)
            var = np.average((b - wb) ** 2, weights=w)
            # A slope at or below zero (timing noise on a fast link) means "faster than we can tell".
            slope = max(np.average((b - wb) * (t - wt), weights=w) / var, 1.0 / MAX_BANDWIDTH)
            rtt = wt - slope * wb
            if rtt >= 0:
                self.rtt, self.bandwidth = float(rtt), float(1.0 / slope)
            else:  # the line crosses below zero: no measurable fixed cost, all time is transfer time
                self.rtt = 0.0
                self.bandwidth = float(min(MAX_BANDWIDTH, np.sum(w * b) / np.sum(w * t)))
            return
        # Not identifiable: keep rtt, take bandwidth from the newest samples' excess over it (a ratio of
        # weighted sums, so one slow transfer weighs as much as the time it took).
        head = min(len(b), 3)
        excess = np.maximum(t[:head] - self.rtt, 1e-5)
        if b[:head].mean() > 2000:
            self.bandwidth = float(min(MAX_BANDWIDTH, np.sum(w[:head] * b[:head]) / np.sum(w[:head] * excess)))
        elif t[0] < self.rtt:  # a small, fast transfer: the rtt is at most this
            self.rtt = float(t[0])

    def predict(self, nbytes: float) -> float:
        """Seconds on the network for a request moving ``nbytes`` in total."""
        with self._lock:
            return self.rtt + nbytes / self.bandwidth

    def age(self) -> float:
        """Seconds since the last sample."""
        return time.monotonic() - self.updated_at


class Backoff:
    """Exponential, capped retry delays: ``initial, initial*factor, ...`` up to ``cap``.

    Args:
        initial: first delay in seconds.
        cap: largest delay.
        factor: growth per consecutive failure.
    """

    def __init__(self, initial: float = 0.25, cap: float = 8.0, factor: float = 2.0) -> None:
        self.initial, self.cap, self.factor = initial, cap, factor
        self.failures = 0
        self.retry_at = -math.inf
        self._lock = threading.Lock()

    def failure(self, now: float | None = None, at_least: float = 0.0) -> float:
        """Record a failure; returns the delay before the next attempt (``at_least`` when the server asked for
        that long, e.g. in ``Retry-After``, even beyond ``cap``)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            delay = max(at_least, min(self.cap, self.initial * self.factor ** self.failures))
            self.failures += 1
            self.retry_at = now + delay
            return delay

    def success(self) -> None:
        with self._lock:
            self.failures = 0
            self.retry_at = -math.inf

    @property
    def healthy(self) -> bool:
        return self.failures == 0

    def due(self, now: float | None = None) -> bool:
        """Whether the next attempt may go out now."""
        return (time.monotonic() if now is None else now) >= self.retry_at


class _Connection(http.client.HTTPConnection):
    def connect(self) -> None:
        super().connect()
        # Small request/response exchanges must not wait for Nagle + delayed ACK.
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _TLSConnection(http.client.HTTPSConnection):
    def connect(self) -> None:
        super().connect()  # TCP, then the TLS handshake (certificate and host name checked by the context)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class OffloadClient:
    """Synchronous client of one offload server over a persistent connection. Not thread-safe: give each
    thread its own client (they may share a :class:`LinkEstimator`).

    Args:
        url: ``http://host:port`` or ``https://host:port``.
        token: bearer token; None reads ``$INCRINF_TOKEN`` (unset: none); ``""`` sends none.
        timeout: default per-request timeout in seconds.
        link: estimator fed with every transfer (a new one if None).
        ca_file: PEM file of the certificate authority (or the self-signed certificate) that signed the
            server's certificate; default: the system's trust store. HTTPS only.
        verify: check the server's certificate and host name (HTTPS). False encrypts without knowing who
            answers: anyone on the path can impersonate the server and read the token. Testing only.
        wait_rate_limited: on 429, sleep for ``Retry-After`` and retry when that fits in the request's timeout
            (False: raise :class:`RateLimited` at once, for callers with a fallback of their own).

    Raises:
        ValueError: a malformed URL, token or CA file.
    """

    def __init__(self, url: str, token: str | None = None, timeout: float = 2.0,
                 link: LinkEstimator | None = None, *, ca_file: str | os.PathLike | None = None, verify: bool = True,
                 wait_rate_limited: bool = True) -> None:
        self.url = url
        self.tls, self.host, self.port = server_address(url)
        self.token = client_token(token)
        self.timeout = timeout
        self.link = link if link is not None else LinkEstimator()
        self.wait_rate_limited = wait_rate_limited
        self._ssl: ssl.SSLContext | None = client_ssl_context(ca_file, verify) if self.tls else None
        self._conn: http.client.HTTPConnection | None = None

    def __repr__(self) -> str:  # never the token
        return f"OffloadClient({self.url!r}, token={'***' if self.token else None})"

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        if self._ssl is not None:
            return _TLSConnection(self.host, self.port, timeout=timeout, context=self._ssl)
        return _Connection(self.host, self.port, timeout=timeout)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _headers(self, session: str | None, has_body: bool) -> dict[str, str]:
        headers = {"Connection": "keep-alive"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if session:
            headers[SESSION_HEADER] = session
        if has_body:
            headers["Content-Type"] = wire.CONTENT_TYPE
        return headers

    def request(self, method: str, path: str, body: bytes | None = None, session: str | None = None,
                timeout: float | None = None, measure: bool = True) -> Reply:
        """Send one request and decode the reply.

        Raises:
            ServerUnavailable: network failure, TLS failure or timeout. SessionLost: 404. ReferenceMismatch: 409.
            RateLimited: 429 (after waiting once for ``Retry-After`` when allowed and it fits in ``timeout``).
            RemoteError: any other error status.
        """
        timeout = self.timeout if timeout is None else timeout
        deadline = time.perf_counter() + timeout
        headers = self._headers(session, body is not None)
        waited = False
        while True:
            response, data, seconds = self._exchange(method, path, body, headers, timeout, measure)
            if response.status != 429:
                break
            retry_after = _retry_after(response, data)
            left = deadline - time.perf_counter()
            if waited or not self.wait_rate_limited or retry_after >= left:
                raise RateLimited(429, _error_message(data), retry_after)
            time.sleep(retry_after)  # the server asked for it and the request's time allows it
            waited, timeout = True, deadline - time.perf_counter()
        server_seconds = float(response.getheader("X-Server-Seconds", "0") or 0)
        up = len(body or b"") + HTTP_OVERHEAD_BYTES // 2
        down = len(data) + HTTP_OVERHEAD_BYTES // 2
        if measure:
            self.link.add(up + down, max(seconds - server_seconds, 1e-6))
        if response.status >= 400:
            message = _error_message(data)
            cls = {404: SessionLost, 409: ReferenceMismatch}.get(response.status, RemoteError)
            raise cls(response.status, message)
        content_type = response.getheader("Content-Type", "")
        output = js = None
        if content_type.startswith(wire.CONTENT_TYPE):
            try:
                output = wire.decode(data).tensor("output")
            except wire.PayloadError as exc:
                raise RemoteError(response.status, f"undecodable reply: {exc}") from None
        elif content_type.startswith("application/json"):
            try:
                js = json.loads(data)
            except ValueError:
                raise RemoteError(response.status, "undecodable JSON reply") from None
        return Reply(output, js, seconds, server_seconds, up, down, response.getheader("X-Frame-Digest"))

    def _exchange(self, method: str, path: str, body: bytes | None, headers: dict[str, str], timeout: float,
                  measure: bool) -> tuple[http.client.HTTPResponse, bytes, float]:
        """One request/response on the kept-alive connection, reopened once if it turns out stale."""
        for attempt in (0, 1):
            reused = self._conn is not None
            t0 = time.perf_counter()
            try:
                if self._conn is None:
                    self._conn = self._connect(timeout)
                    self._conn.connect()
                else:
                    self._conn.sock.settimeout(timeout)
                self._conn.request(method, path, body=body, headers=headers)
                response = self._conn.getresponse()
                data = response.read()
            except ssl.SSLCertVerificationError as exc:  # not a flaky link: retrying cannot help
                self.close()
                raise ServerUnavailable(f"{method} {path}: TLS certificate not trusted: {exc.verify_message}") from exc
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if measure and isinstance(exc, TimeoutError):  # censored sample: the link is at least this slow
                    self.link.add(len(body or b"") + HTTP_OVERHEAD_BYTES, time.perf_counter() - t0)
                # A kept-alive connection the server has closed fails at once: retry once on a fresh one.
                stale = reused and not isinstance(exc, TimeoutError)
                if attempt == 0 and stale and time.perf_counter() - t0 < timeout / 2:
                    continue
                raise ServerUnavailable(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
            seconds = time.perf_counter() - t0
            if response.getheader("Connection", "").lower() == "close":
                self.close()
            return response, data, seconds
        raise AssertionError("unreachable")

    # --- endpoints -------------------------------------------------------------------------------------

    def health(self, timeout: float | None = None) -> dict:
        return self.request("GET", "/health", timeout=timeout).json or {}

    def profile(self, timeout: float | None = None) -> dict:
        return self.request("GET", "/profile", timeout=timeout, measure=False).json or {}

    def open_session(self, timeout: float | None = None) -> str:
        reply = self.request("POST", "/session", body=b"", timeout=timeout)
        return str((reply.json or {})["session"])

    def close_session(self, session: str, timeout: float | None = None) -> None:
        self.request("DELETE", "/session", session=session, timeout=timeout)

    def infer_full(self, frame: np.ndarray, session: str | None = None, frame_id: int | None = None,
                   timeout: float | None = None) -> Reply:
        """Full inference of a (H, W, C) uint8 frame (or a (1, C, H, W) float32 ``input``); with a session
        the frame becomes the server's reference ``frame_id``."""
        name = "frame" if frame.dtype == np.uint8 else "input"
        meta = {"frame_id": int(frame_id)} if session is not None and frame_id is not None else {}
        return self.request("POST", "/infer/full", wire.encode({name: frame}, meta), session, timeout)

    def infer_cached(self, session: str, base_id: int, frame_id: int, matrix: np.ndarray | None,
                     boxes: np.ndarray, tiles: np.ndarray, timeout: float | None = None) -> Reply:
        """Cached inference: reference ``base_id`` warped by ``matrix`` plus ``tiles`` in ``boxes``."""
        tensors = {"boxes": boxes.astype(np.int32), "tiles": tiles}
        if matrix is not None:
            tensors["matrix"] = np.asarray(matrix, dtype=np.float64)
        body = wire.encode(tensors, {"base_id": int(base_id), "frame_id": int(frame_id)})
        return self.request("POST", "/infer/cached", body, session, timeout)

    def infer_suffix(self, split: str, tensor: np.ndarray, timeout: float | None = None) -> Reply:
        """Hybrid split: the server runs the graph after node ``split`` from ``tensor``."""
        body = wire.encode({"tensor": np.asarray(tensor, dtype=np.float32)})
        return self.request("POST", f"/infer/suffix?k={split}", body, None, timeout)

    def probe(self, nbytes: int, timeout: float | None = None) -> Reply:
        """Send ``nbytes`` of filler to measure the uplink (the server discards them)."""
        return self.request("POST", "/probe", bytes(nbytes), None, timeout)


def _retry_after(response: http.client.HTTPResponse, data: bytes) -> float:
    """Seconds to wait from a 429: the JSON ``retry_after`` (sub-second), else ``Retry-After``, else 1."""
    try:
        value = float(json.loads(data)["retry_after"])
        if math.isfinite(value) and value >= 0:
            return value
    except (ValueError, KeyError, TypeError):
        pass
    try:
        return max(0.0, float(response.getheader("Retry-After", "1")))
    except ValueError:  # an HTTP date: not something this server sends
        return 1.0


def _error_message(data: bytes) -> str:
    try:
        return str(json.loads(data).get("error", data[:200]))
    except (ValueError, AttributeError):
        return data[:200].decode("utf-8", "replace")
