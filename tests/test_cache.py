"""Tests for incrinf.cache, after OpenVINO's CPU runtime cache tests (LRU policy, builder counts, threads)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from incrinf.cache import (
    DEFAULT_CAPACITY,
    ENV_CAPACITY,
    LookupStatus,
    RuntimeCache,
    capacity_from_env,
    make_key,
    runtime_cache,
)

HIT, MISS = LookupStatus.HIT, LookupStatus.MISS


def k(i: int, kind: str = "plan") -> tuple[Any, ...]:
    return make_key(kind, shape=(1, 3, i, i), tau=0.5)


class CountingBuilder:
    """A builder that records how many times each key was built (thread-safe)."""

    def __init__(self, sleep_s: float = 0.0) -> None:
        self.calls: Counter[Any] = Counter()
        self.sleep_s = sleep_s
        self._lock = threading.Lock()

    def __call__(self, key: Any) -> str:
        with self._lock:
            self.calls[key] += 1
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return f"value-of-{key}"

    @property
    def total(self) -> int:
        return sum(self.calls.values())


# --- keys -----------------------------------------------------------------------------------------


def test_make_key_is_order_independent_and_flat() -> None:
    a = make_key("plan", shape=(1, 3, 8, 8), stride=2, device="cpu")
    b = make_key("plan", device="cpu", stride=2, shape=(1, 3, 8, 8))
    assert a == b and hash(a) == hash(b)
    assert a == ("plan", "device", "cpu", "shape", (1, 3, 8, 8), "stride", 2)
    assert make_key("plan", stride=2) != make_key("other", stride=2)
    assert make_key("plan", stride=2) != make_key("plan", stride=3)


@pytest.mark.parametrize(
    "fields",
    [{"x": [1, 2]}, {"x": {"a": 1}}, {"x": torch.zeros(2)}, {"x": (1, (torch.zeros(1),))}],
    ids=["list", "dict", "tensor", "nested-tensor"],
)
def test_make_key_rejects_unhashable_and_tensors(fields: dict[str, Any]) -> None:
    with pytest.raises(TypeError, match="'x'"):
        make_key("plan", **fields)


def test_make_key_rejects_non_string_kind() -> None:
    with pytest.raises(TypeError, match="kind"):
        make_key(3, x=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad", [("plan", [1]), [1, 2], (), ([1], 2)], ids=["list-field", "list", "empty-tuple", "list-kind"]
)
def test_unhashable_keys_are_a_clear_type_error(bad: Any) -> None:
    cache = RuntimeCache(4)
    with pytest.raises(TypeError, match="hashable"):
        cache.get_or_create(bad, lambda key: 1)
    with pytest.raises(TypeError, match="hashable"):
        cache.put(bad, 1)
    with pytest.raises(TypeError, match="hashable"):
        cache.get(bad)
    assert len(cache) == 0


# --- LRU policy -----------------------------------------------------------------------------------


def test_lru_eviction_order_is_exact() -> None:
    cache = RuntimeCache(3)
    for i in range(3):
        cache.put(k(i), i)
    assert cache.keys("plan") == [k(0), k(1), k(2)]
    assert cache.get(k(0)) == 0  # refresh: k(1) is now the least recently used
    assert cache.keys("plan") == [k(1), k(2), k(0)]
    cache.put(k(3), 3)
    assert cache.keys("plan") == [k(2), k(0), k(3)]
    value, status = cache.get_or_create(k(2), lambda key: pytest.fail("must hit"))
    assert (value, status) == (2, HIT)
    cache.put(k(4), 4)  # evicts k(0)
    cache.put(k(5), 5)  # evicts k(3)
    assert cache.keys("plan") == [k(2), k(4), k(5)]
    assert cache.stats()["plan"]["evictions"] == 3


def test_put_get_semantics() -> None:
    cache = RuntimeCache(2)
    assert cache.get(k(0)) is None  # a miss returns None
    cache.put(k(0), "a")
    cache.put(k(1), "b")
    assert cache.get(k(0)) == "a"  # refreshes k(0)
    cache.put(k(2), "c")  # full: evicts the LRU, k(1)
    assert cache.get(k(1)) is None
    assert cache.get(k(0)) == "a" and cache.get(k(2)) == "c"
    cache.put(k(0), "a2")  # overwrite refreshes and replaces, evicts nothing
    assert cache.keys("plan") == [k(2), k(0)]
    assert cache.get(k(0)) == "a2"
    cache.put(k(3), None)  # None means "no value": nothing stored
    assert k(3) not in cache and len(cache) == 2


def test_contains_and_keys_do_not_touch_recency_or_counters() -> None:
    cache = RuntimeCache(2)
    cache.put(k(0), 0)
    cache.put(k(1), 1)
    assert k(0) in cache and k(9) not in cache
    assert cache.keys("plan") == [k(0), k(1)]
    cache.put(k(2), 2)
    assert k(0) not in cache
    assert cache.stats()["plan"]["hits"] == cache.stats()["plan"]["misses"] == 0


def test_get_or_create_builds_exactly_three_times_capacity() -> None:
    capacity = 10
    cache = RuntimeCache(capacity)
    build = CountingBuilder()
    first, second = range(capacity), range(capacity, 2 * capacity)
    expected_status = [
        (first, MISS),  # 10 builds
        (first, HIT),  # all stored
        (second, MISS),  # 10 builds, evicting all of `first`
        (reversed(first), MISS),  # 10 builds: `first` was evicted
        (first, HIT),
    ]
    for keys, status in expected_status:
        for i in keys:
            value, got = cache.get_or_create(k(i), build)
            assert (value, got) == (f"value-of-{k(i)}", status)
    assert build.total == 3 * capacity
    assert cache.stats()["plan"] == {
        "hits": 2 * capacity,
        "misses": 3 * capacity,
        "evictions": 2 * capacity,
        "size": capacity,
        "waits": 0,
        "capacity": capacity,
    }


def test_cycling_more_keys_than_capacity_always_misses() -> None:
    # The LRU worst case: 3 passes over 3 x capacity keys in the same order never hit.
    cache = RuntimeCache(10)
    build = CountingBuilder()
    for _ in range(3):
        for i in range(30):
            assert cache.get_or_create(k(i), build)[1] is MISS
    assert build.total == 90 and set(build.calls.values()) == {3}


def test_capacity_zero_always_builds_and_stores_nothing() -> None:
    cache = RuntimeCache(0)
    build = CountingBuilder()
    for _ in range(3):
        assert cache.get_or_create(k(1), build) == (f"value-of-{k(1)}", MISS)
    cache.put(k(1), "x")
    assert build.total == 3 and len(cache) == 0 and cache.get(k(1)) is None
    assert cache.stats()["plan"]["misses"] == 4


def test_negative_capacity_argument_means_disabled() -> None:
    assert RuntimeCache(-5).capacity == 0


def test_non_int_capacity_argument_is_type_error() -> None:
    with pytest.raises(TypeError, match="capacity"):
        RuntimeCache(2.5)  # type: ignore[arg-type]


# --- environment ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"), [(None, DEFAULT_CAPACITY), ("", DEFAULT_CAPACITY), ("0", 0), ("-7", 0), (" 42 ", 42)]
)
def test_capacity_from_env(monkeypatch: pytest.MonkeyPatch, raw: str | None, expected: int) -> None:
    if raw is None:
        monkeypatch.delenv(ENV_CAPACITY, raising=False)
    else:
        monkeypatch.setenv(ENV_CAPACITY, raw)
    assert capacity_from_env() == expected
    assert RuntimeCache().capacity == expected
    assert DEFAULT_CAPACITY == 5000


@pytest.mark.parametrize("raw", ["abc", "1.5", "1e3", "10 items"])
def test_non_integer_env_capacity_is_value_error(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(ENV_CAPACITY, raw)
    with pytest.raises(ValueError, match=ENV_CAPACITY):
        RuntimeCache()


def test_process_wide_instance() -> None:
    cache = runtime_cache()
    assert cache is runtime_cache()
    key = make_key("test-process-wide", n=1)
    assert cache.get_or_create(key, lambda _: 1) == (1, MISS)
    assert cache.get_or_create(key, lambda _: 2) == (1, HIT)
    cache.clear()
    assert key not in cache and cache.stats() == {}


# --- builders -------------------------------------------------------------------------------------


def test_builder_error_propagates_and_stores_nothing() -> None:
    cache = RuntimeCache(4)

    def boom(key: Any) -> Any:
        raise ValueError("build failed")

    with pytest.raises(ValueError, match="build failed"):
        cache.get_or_create(k(1), boom)
    assert len(cache) == 0 and cache.get(k(1)) is None
    assert cache.get_or_create(k(1), lambda key: "ok") == ("ok", MISS)  # a later call builds again


def test_builder_returning_none_stores_nothing() -> None:
    cache = RuntimeCache(4)
    build = CountingBuilder()
    assert cache.get_or_create(k(1), lambda key: None) == (None, MISS)
    assert len(cache) == 0
    assert cache.get_or_create(k(1), build)[1] is MISS and build.total == 1


def test_builder_receives_the_key() -> None:
    cache = RuntimeCache(4)
    assert cache.get_or_create(k(7), lambda key: key)[0] == k(7)


def test_recursive_build_of_same_key_is_an_error_not_a_deadlock() -> None:
    cache = RuntimeCache(4)

    def again(key: Any) -> Any:
        return cache.get_or_create(key, again)

    with pytest.raises(RuntimeError, match="deadlock"):
        cache.get_or_create(k(1), again)
    assert len(cache) == 0
    stats = cache.stats()["plan"]
    assert (stats["misses"], stats["waits"], stats["hits"]) == (2, 1, 0)  # both calls counted


def test_clear_during_build_does_not_store_stale_value() -> None:
    cache = RuntimeCache(4)

    def build_then_clear(key: Any) -> str:
        cache.clear()
        return "stale"

    assert cache.get_or_create(k(1), build_then_clear) == ("stale", MISS)
    assert len(cache) == 0


# --- key types ------------------------------------------------------------------------------------


class ShapeKey(NamedTuple):
    shape: tuple[int, ...]


def test_capacity_is_per_key_type() -> None:
    cache = RuntimeCache(2)
    cache.put(k(0, "conv"), "conv0")
    cache.put(ShapeKey((1, 2)), "named")
    for i in range(5):  # filling "plan" evicts only "plan" entries
        cache.get_or_create(k(i), lambda key: "p")
    assert cache.get(k(0, "conv")) == "conv0"
    assert cache.get(ShapeKey((1, 2))) == "named"
    stats = cache.stats()
    assert stats["plan"]["size"] == 2 and stats["plan"]["evictions"] == 3
    assert stats["conv"]["evictions"] == 0 and stats[ShapeKey]["size"] == 1
    assert len(cache) == 4


def test_stats_counts() -> None:
    cache = RuntimeCache(1)
    cache.get_or_create(k(0), lambda key: 0)  # miss
    cache.get_or_create(k(0), lambda key: 0)  # hit
    cache.get(k(0))  # hit
    cache.get(k(1))  # miss
    cache.get_or_create(k(1), lambda key: 1)  # miss, evicts k(0)
    cache.get_or_create(k(2, "conv"), lambda key: 2)  # miss in another type
    assert cache.stats() == {
        "plan": {"hits": 2, "misses": 3, "evictions": 1, "size": 1, "waits": 0, "capacity": 1},
        "conv": {"hits": 0, "misses": 1, "evictions": 0, "size": 1, "waits": 0, "capacity": 1},
    }
    assert "plan=1" in repr(cache)
    cache.clear()
    assert cache.stats() == {} and len(cache) == 0


# --- threads --------------------------------------------------------------------------------------


def _run_threads(n: int, target: Any) -> list[BaseException]:
    errors: list[BaseException] = []

    def wrapped(i: int) -> None:
        try:
            target(i)
        except BaseException as err:  # collected, asserted by the test
            errors.append(err)

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "threads hung"
    return errors


def test_thirty_threads_build_each_key_once() -> None:
    n_threads, n_keys, per_thread = 30, 20, 10
    cache = RuntimeCache(100)
    build = CountingBuilder(sleep_s=0.002)
    barrier = threading.Barrier(n_threads)
    results: list[tuple[Any, Any, LookupStatus]] = []
    results_lock = threading.Lock()

    def worker(i: int) -> None:
        barrier.wait()
        for _ in range(2):
            for j in range(per_thread):
                key = k((i + j) % n_keys)  # overlapping windows of keys
                value, status = cache.get_or_create(key, build)
                with results_lock:
                    results.append((key, value, status))

    assert _run_threads(n_threads, worker) == []
    total_calls = n_threads * 2 * per_thread
    assert len(results) == total_calls
    assert all(value == f"value-of-{key}" for key, value, _ in results)
    assert len(build.calls) == n_keys and set(build.calls.values()) == {1}
    assert len(cache) == n_keys  # no lost entries
    stats = cache.stats()["plan"]
    assert stats["hits"] + stats["misses"] == total_calls
    assert stats["misses"] == n_keys == sum(status is MISS for *_, status in results)


def test_builders_of_different_keys_run_concurrently() -> None:
    # Each builder waits for the other to start: this deadlocks (times out) if the lock is held.
    cache = RuntimeCache(4)
    started = [threading.Event(), threading.Event()]

    def worker(i: int) -> None:
        def build(key: Any) -> int:
            started[i].set()
            assert started[1 - i].wait(timeout=5), "builders were serialised"
            return i

        assert cache.get_or_create(k(i), build) == (i, MISS)

    assert _run_threads(2, worker) == []
    assert len(cache) == 2


def _wait_for(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def test_waiters_get_the_builders_value_as_a_hit() -> None:
    cache = RuntimeCache(4)
    release = threading.Event()
    statuses: list[LookupStatus] = []

    def slow(key: Any) -> str:
        release.wait(timeout=5)
        return "v"

    def worker(i: int) -> None:
        statuses.append(cache.get_or_create(k(1), slow if i == 0 else lambda key: pytest.fail("rebuilt"))[1])

    owner = threading.Thread(target=worker, args=(0,))
    owner.start()
    _wait_for(lambda: cache.stats().get("plan", {}).get("misses") == 1)
    waiters = _start_waiters(3, worker)
    _wait_for(lambda: cache.stats()["plan"]["waits"] == 3)
    release.set()
    owner.join(timeout=5)
    for t in waiters:
        t.join(timeout=5)
    assert sorted(s.value for s in statuses) == ["hit", "hit", "hit", "miss"]
    assert cache.stats()["plan"] == {
        "hits": 3,
        "misses": 1,
        "evictions": 0,
        "size": 1,
        "waits": 3,
        "capacity": 4,
    }


def _start_waiters(n: int, worker: Any) -> list[threading.Thread]:
    threads = [threading.Thread(target=worker, args=(i + 1,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_waiters_get_the_builders_error() -> None:
    cache = RuntimeCache(4)
    release = threading.Event()
    errors: list[BaseException] = []

    def failing(key: Any) -> str:
        release.wait(timeout=5)
        raise ValueError("build failed")

    def worker(i: int) -> None:
        try:
            cache.get_or_create(k(1), failing)
        except ValueError as err:
            errors.append(err)

    owner = threading.Thread(target=worker, args=(0,))
    owner.start()
    _wait_for(lambda: cache.stats().get("plan", {}).get("misses") == 1)
    waiter = _start_waiters(1, worker)[0]
    _wait_for(lambda: cache.stats()["plan"]["waits"] == 1)
    release.set()
    owner.join(timeout=5)
    waiter.join(timeout=5)
    assert len(errors) == 2 and all("build failed" in str(e) for e in errors)
    assert len(cache) == 0 and cache.stats()["plan"]["misses"] == 2
    assert cache.get_or_create(k(1), lambda key: "ok") == ("ok", MISS)


# --- model-based check ----------------------------------------------------------------------------

_keys = st.builds(k, st.integers(0, 4), st.sampled_from(["a", "b"]))
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), _keys, st.integers(0, 9) | st.none()),
        st.tuples(st.just("get"), _keys, st.none()),
        st.tuples(st.just("get_or_create"), _keys, st.integers(0, 9) | st.none()),
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None)
@given(capacity=st.integers(0, 3), ops=_ops)
def test_matches_reference_lru(capacity: int, ops: list[tuple[str, Any, Any]]) -> None:
    cache = RuntimeCache(capacity)
    model: dict[str, list[tuple[Any, Any]]] = {"a": [], "b": []}  # per kind, least recently used first
    for op, key, value in ops:
        entries = model[key[0]]
        stored = next((v for mk, v in entries if mk == key), None)
        if stored is not None and not (op == "put" and value is None):  # put(key, None) is a no-op
            entries.remove((key, stored))
            entries.append((key, stored))
        if op == "get":
            assert cache.get(key) == stored
        elif op == "get_or_create":
            calls: list[Any] = []
            got = cache.get_or_create(key, lambda key_, v=value, c=calls: c.append(key_) or v)
            if stored is not None:
                assert got == (stored, HIT) and calls == []
            else:
                assert got == (value, MISS) and calls == [key]
                if value is not None and capacity > 0:
                    entries.append((key, value))
        else:
            cache.put(key, value)
        if op == "put" and value is not None and capacity > 0:
            if stored is not None:
                entries[-1] = (key, value)
            else:
                entries.append((key, value))
        del entries[: max(len(entries) - capacity, 0)]
        for kind, expected in model.items():
            assert cache.keys(kind) == [mk for mk, _ in expected]
            # Getting every entry oldest first checks the values and leaves the recency order as it was.
            assert [cache.get(mk) for mk, _ in expected] == [mv for _, mv in expected]
    assert len(cache) == sum(len(v) for v in model.values())
