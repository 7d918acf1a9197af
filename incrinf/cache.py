"""A thread-safe LRU cache for runtime artefacts (plans, index tensors) keyed by what determines them.

Modelled on OpenVINO's CPU runtime parameters cache: a key holds every field that determines the
cached value (graph signature, shapes, attributes), never tensor data or pointers; a builder makes the
value from the key on a miss; ``get_or_create`` returns the value and whether it was a hit or a miss.
As in OpenVINO's ``MultiCache`` there is one LRU per key type, each with the same capacity.

Key type rule: a plain ``tuple`` key's type is its first element (its *kind*, which ``make_key`` puts
there); any other key's type is ``type(key)``. So filling the ``"plan"`` kind never evicts entries of
another kind. For keys built on every call, a ``typing.NamedTuple`` subclass (one per key kind) is the
fastest form: C-speed construction, hashing and equality (see benchmarks/runtime_cache.py);
``make_key`` is the convenient form, and checks that no field is a tensor or unhashable.

Capacity: ``RuntimeCache(capacity=None)`` reads ``INCRINF_RUNTIME_CACHE_CAPACITY`` (default 5000).
0 disables the cache: every call builds and nothing is stored; a negative value means 0.

Concurrency: one lock guards the LRUs and is never held while a builder runs, so builders of different
keys run concurrently. A key being built is built once: other threads asking for it meanwhile wait for
that build and get its value (a ``HIT``). If the build raises, the waiters get the same exception
object re-raised (they do not retry) and nothing is stored; a later call builds again.
"""

from __future__ import annotations

import enum
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Final

ENV_CAPACITY: Final = "INCRINF_RUNTIME_CACHE_CAPACITY"
DEFAULT_CAPACITY: Final = 5000

# Field types that are hashable by value and cannot hide a tensor: make_key skips checking them.
_PLAIN_TYPES: Final = frozenset({str, int, float, bool, bytes, type(None)})
_MISSING: Final = object()


class LookupStatus(enum.Enum):
    """Whether a lookup found a stored (or concurrently built) value or had to build it."""

    HIT = "hit"
    MISS = "miss"


# Module-level aliases: the hit path returns them without an attribute lookup on the enum class.
_HIT: Final = LookupStatus.HIT
_MISS: Final = LookupStatus.MISS


def _check_field(name: str, value: Any) -> None:
    """Rejects a key field that is unhashable or holds a tensor (hashed by identity, not by content)."""
    if isinstance(value, tuple | frozenset):
        for item in value:
            if type(item) not in _PLAIN_TYPES:
                _check_field(name, item)
        return
    if hasattr(type(value), "data_ptr"):
        raise TypeError(
            f"cache key field {name!r} is a {type(value).__name__}: keys must hold what determines the "
            "value (shapes, attributes, hashes), never tensors, which hash by identity"
        )
    try:
        hash(value)
    except TypeError as err:
        raise TypeError(
            f"cache key field {name!r} of type {type(value).__name__} is unhashable; use a tuple or a hash"
        ) from err


def make_key(kind: str, **fields: Any) -> tuple[Any, ...]:
    """Builds a hashable cache key ``(kind, name1, value1, name2, value2, ...)``, names sorted.

    The tuple is flat (no nested name/value pairs) so hashing and comparing it stays fast.

    Args:
        kind: The key type; the cache keeps one LRU, with its own capacity, per kind.
        **fields: Every value that determines the cached value: hashable scalars, strings, tuples
            (e.g. shapes), hashes of larger data. Never tensors or arrays.

    Returns:
        A tuple whose first element is ``kind``; equal fields give equal keys whatever their order.

    Raises:
        TypeError: If ``kind`` is not a string, or a field is unhashable or a tensor.
    """
    if type(kind) is not str:
        raise TypeError(f"cache key kind must be a str, got {type(kind).__name__}")
    parts: list[Any] = [kind]
    for name in sorted(fields):
        value = fields[name]
        if type(value) not in _PLAIN_TYPES:  # plain scalars need no check (the common case, kept fast)
            _check_field(name, value)
        parts += (name, value)
    return tuple(parts)


def key_kind(key: Hashable) -> Hashable:
    """Returns the key type used to pick the LRU: ``key[0]`` for a plain tuple, else ``type(key)``."""
    if type(key) is tuple:
        if not key:
            raise TypeError("an empty tuple is not a cache key: tuple keys start with their kind")
        return key[0]
    return type(key)


def _kind_label(kind: Hashable) -> str:
    return kind.__qualname__ if isinstance(kind, type) else str(kind)


def _bad_key(key: Any, err: BaseException) -> TypeError:
    return TypeError(
        f"cache key {key!r:.200} is not usable: keys must be hashable values (e.g. from make_key); {err}"
    )


def _checked_kind(key: Hashable) -> Hashable:
    """Returns the key's type after checking that the key and its kind hash, with a clear TypeError."""
    try:
        kind = key_kind(key)
        hash(kind)
        hash(key)
    except TypeError as err:
        raise _bad_key(key, err) from err
    return kind


class _Bucket:
    """One LRU (oldest first) and its counters, for one key type."""

    __slots__ = ("lru", "inflight", "hits", "misses", "evictions", "waits")

    def __init__(self) -> None:
        self.lru: OrderedDict[Hashable, Any] = OrderedDict()
        self.inflight: dict[Hashable, _InFlight] = {}
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.waits = 0


class _InFlight:
    """A build in progress: waiters block on ``done`` and then read ``value`` or ``error``."""

    __slots__ = ("done", "value", "error", "owner")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.owner = threading.get_ident()


def capacity_from_env() -> int:
    """Reads ``INCRINF_RUNTIME_CACHE_CAPACITY``: unset or blank gives 5000, a negative value gives 0.

    Raises:
        ValueError: If the variable is set to something that is not an integer.
    """
    raw = os.environ.get(ENV_CAPACITY, "").strip()
    if not raw:
        return DEFAULT_CAPACITY
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_CAPACITY} must be an integer (0 disables the cache), got {raw!r}") from None
    return max(value, 0)


class RuntimeCache:
    """A thread-safe LRU cache with one LRU per key type and build-once semantics per key.

    Args:
        capacity: Entries kept per key type; ``None`` reads ``INCRINF_RUNTIME_CACHE_CAPACITY``
            (default 5000). 0 disables the cache (always build, never store); negative means 0.

    Raises:
        ValueError: If ``capacity`` is None and the environment variable is not an integer.
        TypeError: If ``capacity`` is neither None nor an int.
    """

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is None:
            capacity = capacity_from_env()
        elif type(capacity) is not int:
            raise TypeError(f"capacity must be an int or None, got {type(capacity).__name__}")
        self.capacity: Final[int] = max(capacity, 0)
        self._lock = threading.Lock()
        self._buckets: dict[Hashable, _Bucket] = {}
        # Bumped by clear(): a build that started before a clear() does not store its result after it.
        self._generation = 0

    def get_or_create(self, key: Hashable, builder: Callable[[Any], Any]) -> tuple[Any, LookupStatus]:
        """Returns the value for ``key``, calling ``builder(key)`` to make it on a miss.

        While one thread builds a key, other threads asking for it wait and get that value as a
        ``HIT``; if the build raises they get the same exception. A value of ``None`` is never stored.

        Args:
            key: A hashable key holding every field that determines the value (see ``make_key``).
            builder: Makes the value from the key; called without the cache lock held.

        Returns:
            ``(value, LookupStatus.HIT)`` if stored or built by another thread, else
            ``(value, LookupStatus.MISS)`` (value may be None, which is then not stored).

        Raises:
            TypeError: If the key is unhashable or an empty tuple.
            RuntimeError: If the builder asks for the key it is building (recursion would deadlock).
            Exception: Whatever the builder raised.
        """
        # Hit path: one lock, two dict lookups and a move_to_end; subscripting beats .get() here.
        try:
            with self._lock:
                bucket = self._buckets[key[0] if type(key) is tuple else type(key)]
                value = bucket.lru[key]  # a KeyError (unknown type or key) is the miss
                bucket.lru.move_to_end(key)
                bucket.hits += 1
                return value, _HIT
        except KeyError:
            pass
        except (TypeError, IndexError) as err:
            raise _bad_key(key, err) from err
        return self._miss(key, builder)

    def _miss(self, key: Hashable, builder: Callable[[Any], Any]) -> tuple[Any, LookupStatus]:
        kind = _checked_kind(key)
        with self._lock:
            bucket = self._bucket(kind)
            # Re-check: another thread may have stored the key since the hit path released the lock.
            value = bucket.lru.get(key, _MISSING)
            if value is not _MISSING:
                bucket.lru.move_to_end(key)
                bucket.hits += 1
                return value, _HIT
            if self.capacity == 0:
                bucket.misses += 1
                flight = None
            else:
                flight = bucket.inflight.get(key)
                if flight is None:
                    bucket.misses += 1
                    flight = bucket.inflight[key] = _InFlight()
                    generation = self._generation
                    owner = True
                else:
                    bucket.waits += 1
                    owner = False
        if flight is None:  # disabled cache: build, store nothing
            return builder(key), _MISS
        if not owner:
            return self._wait(bucket, flight)
        return self._build(bucket, key, builder, flight, generation)

    def _build(
        self,
        bucket: _Bucket,
        key: Hashable,
        builder: Callable[[Any], Any],
        flight: _InFlight,
        generation: int,
    ) -> tuple[Any, LookupStatus]:
        """Runs the builder as the key's owner, stores the value and wakes the waiters."""
        try:
            value = builder(key)
        except BaseException as err:
            with self._lock:
                bucket.inflight.pop(key, None)
            flight.error = err
            flight.done.set()
            raise
        evicted: list[Any] = []
        with self._lock:
            bucket.inflight.pop(key, None)
            if value is not None and generation == self._generation:
                evicted = self._store(bucket, key, value)
        flight.value = value
        flight.done.set()
        # Evicted values are released here, outside the lock: their destructors may be slow or re-enter.
        del evicted
        return value, _MISS

    def _wait(self, bucket: _Bucket, flight: _InFlight) -> tuple[Any, LookupStatus]:
        if flight.owner == threading.get_ident():
            with self._lock:
                bucket.misses += 1
            raise RuntimeError("a cache builder asked for the key it is building; this would deadlock")
        flight.done.wait()
        if flight.error is not None:
            with self._lock:
                bucket.misses += 1
            raise flight.error
        status = _MISS if flight.value is None else _HIT
        with self._lock:
            if status is _HIT:
                bucket.hits += 1
            else:
                bucket.misses += 1
        return flight.value, status

    def get(self, key: Hashable) -> Any | None:
        """Returns the stored value for ``key`` (and marks it most recently used), or None on a miss.

        Does not wait for a build of ``key`` in progress in another thread.
        """
        kind = _checked_kind(key)
        with self._lock:
            bucket = self._bucket(kind)
            value = bucket.lru.get(key, _MISSING)
            if value is _MISSING:
                bucket.misses += 1
                return None
            bucket.lru.move_to_end(key)
            bucket.hits += 1
            return value

    def put(self, key: Hashable, value: Any) -> None:
        """Stores ``value`` as the most recently used entry of its key type, evicting the LRU if full.

        Storing None does nothing (None means "no value", as for a builder), nor does a disabled cache.
        """
        kind = _checked_kind(key)
        if value is None:
            return
        with self._lock:
            evicted = self._store(self._bucket(kind), key, value)
        del evicted  # released outside the lock

    def _bucket(self, kind: Hashable) -> _Bucket:
        bucket = self._buckets.get(kind)
        if bucket is None:
            bucket = self._buckets[kind] = _Bucket()
        return bucket

    def _store(self, bucket: _Bucket, key: Hashable, value: Any) -> list[Any]:
        """Inserts under the lock; returns what it displaced so the caller drops it after unlocking."""
        if self.capacity == 0:
            return []
        lru = bucket.lru
        displaced = [lru.get(key)]
        lru[key] = value
        lru.move_to_end(key)
        while len(lru) > self.capacity:
            displaced.append(lru.popitem(last=False))
            bucket.evictions += 1
        return displaced

    def keys(self, kind: Hashable) -> list[Hashable]:
        """Returns the keys stored for one key type, least recently used first (recency untouched)."""
        with self._lock:
            bucket = self._buckets.get(kind)
            return [] if bucket is None else list(bucket.lru)

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` is stored; does not count as a lookup nor change recency."""
        kind = _checked_kind(key)
        with self._lock:
            bucket = self._buckets.get(kind)
            return bucket is not None and key in bucket.lru

    def __len__(self) -> int:
        with self._lock:
            return sum(len(bucket.lru) for bucket in self._buckets.values())

    def clear(self) -> None:
        """Drops every entry and resets the counters; builds in progress will not store their result."""
        with self._lock:
            old = self._buckets
            self._buckets = {}
            self._generation += 1
        del old  # released outside the lock

    def stats(self) -> dict[Hashable, dict[str, int]]:
        """Returns counters per key type (a kind string, or a class for non-tuple keys).

        Each value has ``hits``, ``misses`` (calls that built, or found nothing), ``evictions``,
        ``size`` (entries stored), ``waits`` (calls that waited for another thread's build; also
        counted as hits, or as misses if that build failed) and ``capacity``.
        """
        with self._lock:
            return {
                kind: {
                    "hits": b.hits,
                    "misses": b.misses,
                    "evictions": b.evictions,
                    "size": len(b.lru),
                    "waits": b.waits,
                    "capacity": self.capacity,
                }
                for kind, b in self._buckets.items()
            }

    def __repr__(self) -> str:
        kinds = ", ".join(f"{_kind_label(k)}={len(b.lru)}" for k, b in self._buckets.items())
        return f"RuntimeCache(capacity={self.capacity}, sizes: {kinds or 'empty'})"


_global_cache: RuntimeCache | None = None
_global_lock = threading.Lock()


def runtime_cache() -> RuntimeCache:
    """Returns the process-wide cache, created on first use with the capacity from the environment.

    Raises:
        ValueError: On first use, if ``INCRINF_RUNTIME_CACHE_CAPACITY`` is not an integer.
    """
    global _global_cache
    cache = _global_cache
    if cache is None:
        with _global_lock:
            if _global_cache is None:
                _global_cache = RuntimeCache()
            cache = _global_cache
    return cache
