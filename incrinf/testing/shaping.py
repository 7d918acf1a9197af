"""A bandwidth- and latency-shaping TCP proxy on loopback that replays a link trace (tests, benchmarks).

``client -> ShapingProxy(listen_port) -> 127.0.0.1:target_port``. Each direction is one emulated link
shared by all connections: a chunk read at time ``t`` starts transmitting when the link is free, takes
``len * 8 / rate`` seconds (a token bucket without burst), and is delivered ``latency`` later. Reading and
writing are separate threads with a bounded queue between them, so latency pipelines like on a real link
and memory stays bounded (the reader blocks when the queue is full: TCP back-pressure does the rest).

The link follows a trace of ``(duration_seconds, mbit_per_s, latency_ms)`` segments played from
:meth:`ShapingProxy.start` (the last segment holds, or the trace loops), or is set by hand with
:meth:`ShapingProxy.set_link` (benchmarks that step the link per frame). ``latency_ms`` is added one way,
in each direction: the round trip grows by twice that.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

CHUNK_BYTES = 16384


@dataclass(frozen=True)
class Link:
    """Link state: rate in Mbit/s and one-way added latency in milliseconds."""

    mbit_per_s: float
    latency_ms: float

    def __post_init__(self) -> None:
        if not self.mbit_per_s > 0 or self.latency_ms < 0:
            raise ValueError(f"need mbit_per_s > 0 and latency_ms >= 0, got {self}")


class _Direction:
    """One direction of the emulated link: when the next byte may start transmitting."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.lock = threading.Lock()

    def schedule(self, nbytes: int, link: Link, now: float) -> float:
        """Delivery time of a chunk of ``nbytes`` handed to the link at ``now``."""
        with self.lock:
            start = max(now, self.free_at)
            self.free_at = start + nbytes * 8 / (link.mbit_per_s * 1e6)
            return self.free_at + link.latency_ms / 1000


class ShapingProxy:
    """Threaded TCP proxy on 127.0.0.1 that shapes bandwidth and latency per a trace.

    Args:
        target_port: port of the real server on ``target_host``.
        listen_port: port to listen on (0 = any free one; see :attr:`port`).
        trace: ``[(duration_s, mbit_per_s, latency_ms), ...]``; default: 1000 Mbit/s, 0 ms.
        loop: replay the trace forever instead of holding its last segment.
        target_host: host of the real server (keep it on loopback).
        max_connections: connections beyond this are refused (closed at once).
        queue_chunks: chunks buffered per direction per connection.
    """

    def __init__(self, target_port: int, listen_port: int = 0,
                 trace: Sequence[tuple[float, float, float]] | None = None, loop: bool = False,
                 target_host: str = "127.0.0.1", max_connections: int = 64, queue_chunks: int = 64) -> None:
        self.target = (target_host, target_port)
        self._listen_port = listen_port
        self.trace = [(float(d), Link(float(r), float(lat))) for d, r, lat in (trace or [(1.0, 1000.0, 0.0)])]
        if any(d <= 0 for d, _ in self.trace):
            raise ValueError("trace segment durations must be > 0")
        self.loop = loop
        self.max_connections = max_connections
        self.queue_chunks = queue_chunks
        self._manual: Link | None = None
        self._t0 = time.monotonic()
        self._up, self._down = _Direction(), _Direction()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self.port: int | None = None
        self.connections = 0

    # --- link ------------------------------------------------------------------------------------------

    def link(self, now: float | None = None) -> Link:
        """The link state in force at ``now`` (monotonic seconds)."""
        if self._manual is not None:
            return self._manual
        elapsed = (time.monotonic() if now is None else now) - self._t0
        total = sum(d for d, _ in self.trace)
        if self.loop:
            elapsed %= total
        for duration, link in self.trace:
            if elapsed < duration:
                return link
            elapsed -= duration
        return self.trace[-1][1]

    def set_link(self, mbit_per_s: float, latency_ms: float) -> None:
        """Override the trace with a fixed link from now on."""
        self._manual = Link(mbit_per_s, latency_ms)

    def replay(self) -> None:
        """Drop any manual link and restart the trace from its beginning."""
        self._manual = None
        self._t0 = time.monotonic()

    # --- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> ShapingProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self._listen_port))
        listener.listen(32)
        listener.settimeout(0.1)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._t0 = time.monotonic()
        self._spawn(self._accept_loop, "netem-accept")
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop accepting, close every connection, join the threads."""
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()
        self.close_connections()
        deadline = time.monotonic() + timeout
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))

    def close_connections(self) -> None:
        """Cut every open connection (the listener stays up): a network outage for open connections."""
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        for sock in sockets:
            _close(sock)

    def __enter__(self) -> ShapingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, target, name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                full = len(self._sockets) >= 2 * self.max_connections
            if full:
                _close(client)
                continue
            try:
                server = socket.create_connection(self.target, timeout=2.0)
            except OSError:
                _close(client)  # the server is down: the client sees the connection close
                continue
            for sock in (client, server):
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets.update((client, server))
                self.connections += 1
            self._pipe(client, server, self._up, "up")
            self._pipe(server, client, self._down, "down")

    def _pipe(self, src: socket.socket, dst: socket.socket, direction: _Direction, name: str) -> None:
        chunks: queue.Queue[tuple[float, bytes]] = queue.Queue(self.queue_chunks)
        self._spawn(self._reader, f"netem-{name}-read", src, dst, direction, chunks)
        self._spawn(self._writer, f"netem-{name}-write", src, dst, chunks)

    def _reader(self, src: socket.socket, dst: socket.socket, direction: _Direction,
                chunks: queue.Queue) -> None:
        while True:
            try:
                data = src.recv(CHUNK_BYTES)
            except OSError:
                data = b""
            if not data:
                _put(chunks, (0.0, b""), self._stopping)
                return
            now = time.monotonic()
            if not _put(chunks, (direction.schedule(len(data), self.link(now), now), data), self._stopping):
                return

    def _writer(self, src: socket.socket, dst: socket.socket, chunks: queue.Queue) -> None:
        while not self._stopping.is_set():
            try:
                deliver_at, data = chunks.get(timeout=0.1)
            except queue.Empty:
                continue
            if not data:  # end of stream: pass the half-close on, then let both ends go
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                self._forget(src, dst)
                return
            delay = deliver_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                dst.sendall(data)
            except OSError:
                self._forget(src, dst)
                return

    def _forget(self, *socks: socket.socket) -> None:
        with self._lock:
            for sock in socks:
                self._sockets.discard(sock)
        for sock in socks:
            _close(sock)


def _put(chunks: queue.Queue, item: tuple[float, bytes], stopping: threading.Event) -> bool:
    while not stopping.is_set():
        try:
            chunks.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
