"""Benchmark of incrinf.cache.RuntimeCache: hit latency per key form, and build vs hit for a plan stand-in.

Run: ``python benchmarks/runtime_cache.py`` (about 15 s). Hit latency is the median over 7 rounds of
100k ``get_or_create`` calls on a stored key, looked up with an equal but distinct key object (as the
engine will build a fresh key per call, so the equality check really runs).
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

try:
    from incrinf.cache import RuntimeCache, key_kind, make_key
except ImportError:  # run from a checkout without `pip install -e .`: use the package next to this file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from incrinf.cache import RuntimeCache, key_kind, make_key

ROUNDS, CALLS = 7, 100_000
GRAPH = "3f9c2e1b7d04c55a8e6b1d2f0a9c7e43"  # a graph-signature hash, as the engine will keep it
POSITIONS = 0x5EED_1234_ABCD_0042  # a hash of the occlusion positions


class PlanKeyNT(NamedTuple):
    """Plan key as a NamedTuple: C-speed hash and equality; the cache buckets it by its class."""

    graph: str
    shape: tuple[int, ...]
    patch: tuple[int, int]
    stride: int
    tau: float
    positions: int
    device: str
    dtype: str


@dataclass(frozen=True, eq=False, slots=True)
class PlanKeyDC:
    """Plan key as a frozen dataclass with its hash computed once at construction."""

    graph: str
    shape: tuple[int, ...]
    patch: tuple[int, int]
    stride: int
    tau: float
    positions: int
    device: str
    dtype: str
    _hash: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash(self._fields()))

    def _fields(self) -> tuple[Any, ...]:
        return (
            self.graph,
            self.shape,
            self.patch,
            self.stride,
            self.tau,
            self.positions,
            self.device,
            self.dtype,
        )

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not PlanKeyDC:
            return NotImplemented
        return self._hash == other._hash and self._fields() == other._fields()


def _fields(size: int) -> dict[str, Any]:
    return {
        "graph": GRAPH,
        "shape": (1, 3, size, size),
        "patch": (16, 16),
        "stride": 4,
        "tau": 0.5,
        "positions": POSITIONS,
        "device": "cpu",
        "dtype": "float32",
    }


KEY_FORMS: dict[str, Callable[[int], Any]] = {
    "make_key tuple": lambda size: make_key("plan", **_fields(size)),
    "NamedTuple": lambda size: PlanKeyNT(**_fields(size)),
    "dataclass (cached hash)": lambda size: PlanKeyDC(**_fields(size)),
}


def median_ns(stmt: Callable[[], Any], number: int = CALLS, rounds: int = ROUNDS) -> float:
    """Median over rounds of the mean time per call, in nanoseconds."""
    times = timeit.Timer(stmt).repeat(repeat=rounds, number=number)
    return statistics.median(times) / number * 1e9


def print_machine() -> None:
    print("== machine")
    print(f"platform : {platform.platform()} ({platform.machine()})")
    print(f"cpus     : {os.cpu_count()} logical")
    print(f"python   : {sys.version.split()[0]} ({platform.python_implementation()})")
    print(f"torch    : {torch.__version__}, numpy {np.__version__}")


def bench_form(make: Callable[[int], Any]) -> tuple[float, float, float]:
    """Returns (build key, RuntimeCache hit, lru_cache hit) median ns per call for one key form."""
    stored, lookup = make(224), make(224)
    assert stored == lookup and stored is not lookup
    cache = RuntimeCache(5000)
    cache.put(stored, object())

    @functools.lru_cache(maxsize=5000)
    def cached_plan(key: Any) -> object:
        return object()

    cached_plan(stored)
    get_or_create, builder = cache.get_or_create, _never_called
    ours = median_ns(lambda: get_or_create(lookup, builder))
    theirs = median_ns(lambda: cached_plan(lookup))
    build_key = median_ns(lambda: make(224), number=CALLS // 5)
    assert cache.stats()[key_kind(stored)]["misses"] == 0
    return build_key, ours, theirs


def bench_hits() -> dict[str, float]:
    print(f"\n== get_or_create hit latency, realistic plan key (median of {ROUNDS} x {CALLS:,} calls)")
    print(f"{'key form':<26}{'build key':>11}{'RuntimeCache':>14}{'lru_cache':>11}{'ratio':>8}")
    hit_ns: dict[str, float] = {}
    for name, make in KEY_FORMS.items():
        build_key, ours, theirs = bench_form(make)
        hit_ns[name] = ours
        print(f"{name:<26}{build_key:>8.0f} ns{ours:>11.0f} ns{theirs:>8.0f} ns{ours / theirs:>7.2f}x")
    fastest = min(hit_ns, key=hit_ns.__getitem__)
    met = "met" if hit_ns[fastest] <= 2000 else "NOT met"
    print(f"fastest RuntimeCache hit: {fastest}; goal <= 2000 ns median: {met}")
    print("ratio = RuntimeCache / functools.lru_cache (lru_cache has no lock, per-type capacity or stats)")
    print("build key = constructing a fresh key from an 8-field kwargs dict (make_key also checks fields)")
    return hit_ns


def _never_called(key: Any) -> Any:
    raise AssertionError("the hit benchmark must not build")


def build_plan_standin(key: tuple[Any, ...]) -> dict[str, torch.Tensor]:
    """Stand-in for the real planner: index arrays of a 16x16 window at 32x32 = 1024 positions.

    For each window position it computes the flat indices of the window's pixels in the feature map,
    of its top-left corner, and the set of pixels any window covers, as torch tensors.
    """
    fields = dict(zip(key[1::2], key[2::2], strict=True))
    size, (ph, pw) = fields["shape"][-1], fields["patch"]
    tops = np.linspace(0, size - ph, 32).round().astype(np.int64)
    lefts = np.linspace(0, size - pw, 32).round().astype(np.int64)
    ys, xs = np.meshgrid(tops, lefts, indexing="ij")
    corner = (ys * size + xs).reshape(-1)  # (1024,)
    offsets = (np.arange(ph)[:, None] * size + np.arange(pw)[None, :]).reshape(-1)  # (256,)
    window = corner[:, None] + offsets[None, :]  # (1024, 256)
    return {
        "corner": torch.from_numpy(corner),
        "window": torch.from_numpy(window),
        "touched": torch.from_numpy(np.unique(window)),  # every map pixel some window covers
    }


def bench_end_to_end(calls: int = 2000) -> None:
    print("\n== end to end: plan build vs hit, shapes alternating 224,160,224,160,...")
    print("   (builder is a STAND-IN until the real planner exists: numpy index arrays for 1024 positions")
    print("    of a 16x16 window over the map, converted to torch tensors)")
    keys = {size: make_key("plan", **_fields(size)) for size in (224, 160)}
    build_ms = {
        size: median_ns(lambda k=key: build_plan_standin(k), number=5, rounds=ROUNDS) / 1e6
        for size, key in keys.items()
    }
    cache = RuntimeCache()
    sizes = [224 if i % 2 == 0 else 160 for i in range(calls)]
    fresh = [make_key("plan", **_fields(size)) for size in sizes]  # a fresh key per call, as the engine
    per_call: list[float] = []
    statuses: list[str] = []
    start = time.perf_counter()
    for key in fresh:
        t0 = time.perf_counter_ns()
        _, status = cache.get_or_create(key, build_plan_standin)
        per_call.append(time.perf_counter_ns() - t0)
        statuses.append(status.value)
    cached_s = time.perf_counter() - start
    uncached_s = sum(build_ms[size] for size in sizes) / 1e3
    hit_us = statistics.median(t for t, s in zip(per_call, statuses, strict=True) if s == "hit") / 1e3
    print(f"build (median of {ROUNDS} x 5): 224 -> {build_ms[224]:.2f} ms, 160 -> {build_ms[160]:.2f} ms")
    print(
        f"hit   (median over {statuses.count('hit')} hits): {hit_us:.2f} us "
        f"(single call timed with perf_counter_ns, so includes timer overhead)"
    )
    print(
        f"{calls} calls: {statuses.count('miss')} misses; with cache {cached_s * 1e3:.1f} ms, "
        f"building every call would take ~{uncached_s * 1e3:.0f} ms "
        f"({uncached_s / cached_s:.0f}x); build/hit = {build_ms[224] * 1e3 / hit_us:,.0f}x"
    )
    print(f"stats: {cache.stats()}")


def main() -> None:
    t0 = time.perf_counter()
    print_machine()
    bench_hits()
    bench_end_to_end()
    print(f"\n(total benchmark time {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
