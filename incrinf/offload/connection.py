"""An offloading session's link to its server: the clients, the back-off after faults, the background worker that
checks the server's health and probes the link, and the server's cache of this stream.

Faults: a failed offload (refused, reset, timed out, a server error) puts the server in back-off (exponential,
capped); when the back-off expires a background worker re-checks ``/health`` (and that the model's weights still
match), and offloading resumes once it answers. A 429 (the credential's request rate or session cap) is handled
the same way, except that the back-off lasts at least the server's ``Retry-After`` and the server's cache is
kept. While frames run locally the same worker times small probe transfers, so the link estimate stays fresh
without delaying frames.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator

from incrinf.offload.client import Backoff, LinkEstimator, OffloadClient, OffloadError, RateLimited
from incrinf.offload.config import OffloadConfig


class _NetworkWorker:
    """Background thread for health checks during back-off and link probes while computing locally."""

    def __init__(self) -> None:
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


class ServerConnection:
    """The link to one offload server, for one session.

    Args:
        config: the session's settings (server URL and credentials, timeouts, back-off, probe interval).
        digest: :func:`~incrinf.offload.timing.model_digest` of the local model; a server running other weights
            is never used.

    Attributes:
        client: the client that carries frames (one request at a time, from the session's thread).
        link: bandwidth and round-trip time, measured from every transfer.
        backoff: the retry delay after faults.
        up: whether frames may be offloaded now (False while in back-off).
        stream_id: the server's cache of this stream (``POST /session``), or None before the first
            ``offload_changed_pixels`` frame.
        probes: link probes completed.
        adopt: called with the server's ``/profile`` answer the first time it answers after being unreachable
            at start-up; returns why that server cannot be used (None: it can).
        adopted: whether the server's answer has been adopted (at start-up or since).
    """

    def __init__(self, config: OffloadConfig, digest: str) -> None:
        self.config = config
        self.digest = digest
        self.link = LinkEstimator()
        self.backoff = Backoff(config.backoff_initial, config.backoff_cap)
        # Both clients raise on 429 at once: a rate-limited frame is computed locally instead of waiting.
        options = dict(timeout=config.max_timeout, link=self.link, ca_file=config.ca_file, verify=config.verify,
                       wait_rate_limited=False)
        self.client = OffloadClient(config.offload, config.token, **options)
        self._probe_client = OffloadClient(config.offload, config.token, **options)
        self.up = False
        self.stream_id: str | None = None
        self.probes = 0
        self.adopt: Callable[[dict], str | None] = lambda info: None
        self.adopted = False
        self.incompatible: str | None = None
        self.frame_bytes = 2048.0  # a full frame's request; the session sets it once the frame size is known
        self._last_network = -float("inf")
        self._health_pending = False
        self._worker: _NetworkWorker | None = None

    def connect(self) -> dict | None:
        """Health and identity check, then the server's description (``/profile``: model, input shape,
        normalisation, per-node times); None, and back-off, when the server cannot be used now."""
        try:
            health = self.client.health(timeout=min(1.0, self.config.max_timeout))
            if health.get("digest") != self.digest:
                raise ValueError("the offload server runs different weights (digest mismatch)")
            info = self.client.profile()
            self.backoff.success()
            self.up = self.adopted = True
            return info
        except OffloadError:
            self.backoff.failure()
            return None

    def start(self, probe_now: bool) -> None:
        """Start the background worker; ``probe_now``: time the link before the first frame (<= ~0.5 s), so the
        first decision has a measured link."""
        self._worker = _NetworkWorker()
        if probe_now and self.up:
            with contextlib.suppress(OffloadError):
                self._probe()

    def usable(self) -> bool:
        """Whether this frame may be offloaded; when a back-off has expired, a health check is queued."""
        if self.up:
            return True
        if self.backoff.due() and not self._health_pending and self._worker is not None:
            self._health_pending = self._worker.submit(self._health_check)
        return False

    def failed(self, exc: Exception) -> None:
        """An offload of this frame failed: back off (at least the server's ``Retry-After`` after a 429)."""
        self.up = False
        if isinstance(exc, RateLimited):  # the server is fine and keeps our cache: wait as long as it asks
            self.backoff.failure(at_least=exc.retry_after)
            return
        # The server's cache is kept even when the server is unreachable or slow: a server that restarted answers
        # 404 for it (SessionLost), and then a new one is opened. Forgetting it here would leave it open on the
        # server until it expires, and a few timeouts would fill the credential's session cap.
        self.client.close()
        self.backoff.failure()

    @contextlib.contextmanager
    def request(self, timeout: float) -> Iterator[None]:
        """Around one frame's offload: lets a probe in flight finish rather than share the link with it, but never
        waits long for it."""
        exclusive = self._worker.busy.acquire(timeout=min(0.05, timeout / 4)) if self._worker else False
        try:
            self._last_network = time.monotonic()
            yield
        finally:
            if exclusive:
                self._worker.busy.release()

    def open_stream(self, timeout: float) -> str:
        """The server's cache of this stream, opened on first use."""
        if self.stream_id is None:
            self.stream_id = self.client.open_session(timeout=timeout)
        return self.stream_id

    def maybe_probe(self) -> None:
        """After a local frame: refresh the link estimate in the background if it is getting old."""
        interval = self.config.probe_interval
        if not (self.up and interval > 0 and self._worker is not None):
            return
        now = time.monotonic()
        if now - self._last_network > interval and self.link.age() > interval:
            self._last_network = now
            self._worker.submit(self._probe)

    def _health_check(self) -> None:
        """Background: is the server back (and still the same model)?"""
        try:
            health = self._probe_client.health(timeout=min(0.5, self.config.max_timeout))
            ok = health.get("digest") == self.digest
            if ok and not self.adopted:  # first contact: adopt its description
                info = self._probe_client.profile(timeout=min(2.0, self.config.max_timeout))
                self.incompatible = self.adopt(info)
                self.adopted = ok = self.incompatible is None
        except OffloadError:
            ok = False
        if ok:
            self.backoff.success()
            self.up = True
        else:
            self.backoff.failure()
        self._health_pending = False

    def _probe(self) -> None:
        """Background: time a tiny transfer (round trip) and one as large as a full frame's request, so the
        estimate is measured where it is used; on a slow link the large one is cut to half the probe interval's
        worth of bytes, so probing never fills the link."""
        self._probe_client.health(timeout=0.5)
        nbytes = int(max(2048, min(self.frame_bytes, self.link.bandwidth * self.config.probe_interval / 2)))
        self._probe_client.probe(nbytes, timeout=min(self.config.max_timeout,
                                                     max(0.5, 4 * self.link.predict(nbytes))))
        self.probes += 1

    def close(self) -> None:
        """Stop the background worker, close the server's cache of this stream (best effort: otherwise it
        expires) and the connections."""
        if self._worker is not None:
            self._worker.close()
        if self.stream_id is not None and self.up:
            with contextlib.suppress(OffloadError):
                self.client.close_session(self.stream_id, timeout=min(0.5, self.config.max_timeout))
            self.stream_id = None
        self.client.close()
        self._probe_client.close()
