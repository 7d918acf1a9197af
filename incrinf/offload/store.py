"""The offload server's per-client stream caches: reference frames keyed by (credential, session id), bounded in
number overall and per credential, expiring when idle."""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


class SessionNotFound(LookupError):
    """The session id is unknown to this server (expired, evicted, another client's, or a restart)."""


class TooManySessions(RuntimeError):
    """The credential holds its maximum of open caches (HTTP 429).

    Attributes:
        retry_after: seconds until its least recently used cache expires.
    """

    def __init__(self, limit: int, retry_after: float) -> None:
        super().__init__(f"this credential already holds {limit} open sessions (the limit): close one "
                         f"(DELETE /session) or retry after {retry_after:.0f} s, when the oldest idle one expires")
        self.retry_after = retry_after


@dataclass
class StreamCache:
    """One client stream's reference frame (the frame both ends hold) and its id."""

    frame: np.ndarray | None = None
    frame_id: int | None = None
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)


class SessionStore:
    """Per-client reference frames, LRU-bounded and expiring (thread-safe).

    Args:
        max_sessions: most caches kept over all credentials; the least recently used is dropped beyond it.
        ttl: seconds after which an unused cache is dropped.
    """

    def __init__(self, max_sessions: int = 256, ttl: float = 600.0) -> None:
        if max_sessions < 1 or not ttl > 0:
            raise ValueError(f"need max_sessions >= 1 and ttl > 0, got {max_sessions}, {ttl}")
        self.max_sessions = max_sessions
        self.ttl = ttl
        self._caches: OrderedDict[tuple[str, str], StreamCache] = OrderedDict()
        self._lock = threading.Lock()

    def _expire(self, now: float) -> None:
        while self._caches:
            key, cache = next(iter(self._caches.items()))
            if now - cache.last_used <= self.ttl and len(self._caches) <= self.max_sessions:
                break
            del self._caches[key]

    def create(self, owner: str, per_owner: int = 0) -> str:
        """Open a cache for ``owner``; returns its id (a 128-bit random capability).

        Args:
            owner: the credential (caches of different owners never meet).
            per_owner: most open caches ``owner`` may hold (0: no limit but ``max_sessions``).

        Raises:
            TooManySessions: ``owner`` holds ``per_owner`` caches already.
        """
        session = secrets.token_urlsafe(16)
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            if per_owner:
                held = [cache.last_used for (who, _), cache in self._caches.items() if who == owner]
                if len(held) >= per_owner:
                    raise TooManySessions(per_owner, max(0.0, min(held) + self.ttl - now))
            self._caches[(owner, session)] = StreamCache(last_used=now)
            self._expire(now)
        return session

    def get(self, owner: str, session: str) -> StreamCache:
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            cache = self._caches.get((owner, session))
            if cache is None:
                raise SessionNotFound("unknown session (expired, evicted or never opened here): open a new one")
            cache.last_used = now
            self._caches.move_to_end((owner, session))
            return cache

    def delete(self, owner: str, session: str) -> bool:
        with self._lock:
            return self._caches.pop((owner, session), None) is not None

    def count(self, owner: str | None = None) -> int:
        """Open caches, of ``owner`` or of everyone."""
        with self._lock:
            self._expire(time.monotonic())
            return len(self._caches) if owner is None else sum(who == owner for who, _ in self._caches)

    def __len__(self) -> int:
        return len(self._caches)
