"""Per-credential request-rate limits of the offload server: token buckets keyed by credential (or by peer
address for requests that present none that the server accepts).

A bucket holds up to ``burst`` requests and refills at ``rate`` per second; a request that finds it empty is
refused with the time until the next request would be admitted (the server answers 429 with
``Retry-After``). Buckets of idle keys are dropped once they would be full again, and at most ``max_keys``
are kept, so a flood of addresses cannot grow the server's memory.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict


class RateLimiter:
    """Token buckets per key (thread-safe).

    Args:
        rate: requests per second each key may sustain; 0 disables the limit.
        burst: requests a key may send at once after being idle (the bucket's size), >= 1.
        max_keys: most buckets kept; the least recently used is dropped beyond it.
    """

    def __init__(self, rate: float, burst: int, max_keys: int = 4096) -> None:
        if not rate >= 0 or not math.isfinite(rate):
            raise ValueError(f"rate must be a finite number >= 0 requests per second, got {rate}")
        if burst < 1:
            raise ValueError(f"burst must be >= 1 request, got {burst}")
        self.rate, self.burst, self.max_keys = float(rate), int(burst), int(max_keys)
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at time)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def acquire(self, key: str, now: float | None = None) -> float:
        """Take one request from ``key``'s bucket.

        Returns:
            0.0 if the request may go ahead, else the seconds until one would be admitted.
        """
        if not self.enabled:
            return 0.0
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens, at = self._buckets.pop(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - at) * self.rate)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                wait = 0.0
            else:
                self._buckets[key] = (tokens, now)
                wait = (1.0 - tokens) / self.rate
            self._drop_idle(now)
            return wait

    def _drop_idle(self, now: float) -> None:
        refill = self.burst / self.rate  # after this long idle a bucket is full: the same as no bucket
        while self._buckets:
            key, (_, at) = next(iter(self._buckets.items()))
            if now - at < refill and len(self._buckets) <= self.max_keys:
                break
            del self._buckets[key]

    def __len__(self) -> int:
        return len(self._buckets)


def retry_after_header(seconds: float) -> str:
    """``Retry-After`` is whole seconds (RFC 9110): round up, at least 1."""
    return str(max(1, math.ceil(seconds)))
