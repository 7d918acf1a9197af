"""Threads for the int8 depthwise kernel: a pool of spinning workers that take slices of a call's work units.

A depthwise layer takes 20-500 microseconds, so a second thread only helps if it starts within a few
microseconds. A numba ``prange`` call wakes its threads through the OpenMP runtime: with threads that sleep
between calls (``OMP_WAIT_POLICY=PASSIVE``, the only setting that behaves on a shared machine) the wake-up
takes as long as a small layer, and the call waits for it at its closing barrier even when the calling thread
has done all the work by then. With threads that spin for long (OpenMP's default) the wake-up is fast, but the
spinning costs whole milliseconds of CPU after every call and stalls a loaded machine.

This pool works the way XNNPACK's thread pool does, with one difference that matters on a busy machine:

- Workers spin for :data:`SPIN_SECONDS` after their last job (an atomic load and a ``pause`` per turn), so a
  layer that follows another is picked up at once; then they sleep on a futex (Linux) that a call finding them
  asleep wakes, or elsewhere nap in the C library's sleep function, 50 us at first and up to
  :data:`MAX_NAP_SECONDS`, looking for a job between naps. They never hold the GIL after they start (a worker
  woken from a Python event would take the GIL, and if the OS preempted it there, the caller would wait
  milliseconds to get the GIL back).
- A call publishes its job (the arrays' addresses and the slice count), then takes slices itself from the
  front while workers take them from the back, as XNNPACK's pool gives each thread a contiguous range: a
  thread computes neighbouring rows, and in repeated calls the same rows (their input and output stay in its
  core's caches). Slices are claimed one at a time with a compare-and-swap on one word that holds the job's
  generation and the first and last unclaimed slices, so a worker that looks late never claims a slice of a
  newer job.
- The calling thread waits only for slices that a worker has claimed, never for a worker to arrive: a worker
  that the OS has not scheduled yet simply finds no slice left. A call therefore never takes much longer than
  on one thread, however busy the machine is.

Each slice covers a range of the layer's work units (:func:`incrinf.kernels.depthwise_kernels.depthwise_units`),
which all cost the same multiply-adds, so slices of equal unit counts are equal work. Every unit is computed the
same way by whichever thread takes it: results do not depend on the thread count.

The control block is one int64 array, each field that several threads write on a cache line of its own.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

import numpy as np

from incrinf.extras import require
from incrinf.kernels.depthwise_kernels import SLICES_PER_THREAD, TILE, UNITS, depthwise_units
from incrinf.kernels.intrinsics import (
    FUTEX_SYSCALL,
    SLEEP_ADDRESS,
    SLEEP_DIVISOR,
    SYSCALL_ADDRESS,
    address_of,
    array_at,
    atomic_load,
    atomic_store,
    compare_exchange,
    fetch_add,
    nap,
    spin_pause,
    syscall6,
)

numba = require("numba", "int8", "the int8 kernels")
njit = numba.njit

__all__ = [
    "MAX_SLICES",
    "MAX_NAP_SECONDS",
    "MIN_SLICE_MACS",
    "SPIN_SECONDS",
    "SpinPool",
    "WAIT_SECONDS",
    "depthwise_call",
    "finish_call",
    "get_pool",
    "run_depthwise",
    "slice_count",
]

SPIN_SECONDS = 1e-3
"""How long an idle worker spins before it sleeps. Waking a sleeping thread costs tens of microseconds (more
on a virtual machine), as much as a small layer; a model's depthwise layers come well within a millisecond of
each other, and a millisecond of spinning after the last one is a small price (XNNPACK's pool spins too)."""

MAX_NAP_SECONDS = 1e-3
"""Longest nap of an idle worker: a call that comes while its workers nap runs alone until they look (at most
this long), and an idle worker wakes at most this often."""

WAIT_SECONDS = 2e-5
"""How long a call spins for a worker's last slice before it yields its core to the OS (and spins again)."""

MIN_SLICE_MACS = 32768
"""Fewest multiply-adds in a slice handed to the pool: about 3 microseconds of one core's work at the kernel's
measured rate (about 10 multiply-adds per nanosecond with AVX-512), against the about 0.3-1 microsecond it costs
to publish a job and move a slice's cache lines to another core. A layer with fewer than two such slices runs on
the calling thread alone."""

# Control block layout (int64 indexes); fields written by different threads sit 8 words (64 bytes) apart.
_CLAIM = 0  # (generation << 40) | (front << 20) | back: slices front..back-1 are unclaimed (none: no open job)
_DONE = 8  # slices finished in the current job
_JOB = 16  # n_slices, helpers, then (address, length) of xf, weights, params, zero_row, out, config
_N_SLICES, _HELPERS, _ARRAYS = _JOB, _JOB + 1, _JOB + 2
_STOP = 32
_WAKE = 33  # futex word (its low 32 bits): a call that finds a worker asleep adds 1 and wakes the workers
_FUTEX_WAIT, _FUTEX_WAKE = 128, 129  # FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE
_LONG_SLEEP_NS = 100_000_000  # with futexes an idle worker sleeps until a call wakes it (looking every 0.1 s)
_THREAD = 40  # per thread t (0: the calling thread), at _THREAD + 8*t: state, units computed, slices computed
_STATE, _UNITS_DONE, _SLICES_DONE = 0, 1, 2
_LINE = 8
_FIELD = np.int64(0xFFFFF)  # front and back are 20-bit fields
_FRONT = np.int64(1 << 20)
_GENERATIONS = np.int64(0x7FFFFF)  # 23 bits: the word stays positive
MAX_SLICES = (1 << 20) - 1
_AWAKE, _ASLEEP = 0, 1


def _control_size(max_threads: int) -> int:
    return _THREAD + _LINE * (max_threads + 1)


def slice_count(units: int, macs_per_unit: int, threads: int) -> int:
    """Slices of a call of ``units`` work units on ``threads`` threads: ``SLICES_PER_THREAD`` per thread, none
    smaller than :data:`MIN_SLICE_MACS` multiply-adds, at most one per unit; 1 means the calling thread alone."""
    if threads <= 1:
        return 1
    by_size = units * macs_per_unit // MIN_SLICE_MACS
    return max(1, min(SLICES_PER_THREAD * threads, units, by_size))


@njit(inline="always")
def _claim(control, generation, from_back):
    """Claim the first (or, ``from_back``, the last) unclaimed slice of job ``generation``; -1 when none is
    left or the job is over."""
    while True:
        word = atomic_load(control, _CLAIM)
        front = (word >> 20) & _FIELD
        back = word & _FIELD
        if (word >> 40) != generation or front >= back:
            return -1
        if from_back:
            if compare_exchange(control, _CLAIM, word, word - 1):
                return back - 1
        elif compare_exchange(control, _CLAIM, word, word + _FRONT):
            return front


@njit(inline="always")
def _work(xf, weights, params, zero_row, out, config, acc, ind, control, generation, n_slices, first, thread):
    """Compute slice ``first`` (already claimed) of the job, then claim and compute more until none is left."""
    units = config[UNITS]
    line = _THREAD + _LINE * thread
    s = first
    while s >= 0:
        u0 = s * units // n_slices
        u1 = (s + 1) * units // n_slices
        depthwise_units(xf, weights, params, zero_row, out, config, acc, ind, u0, u1)
        control[line + _UNITS_DONE] += u1 - u0  # statistics; only this thread writes its line
        control[line + _SLICES_DONE] += 1
        fetch_add(control, _DONE, 1)
        s = _claim(control, generation, thread > 0)


@njit(nogil=True, cache=True)
def depthwise_call(
    xf, weights, params, zero_row, out, config, control, helpers, n_slices, wait_turns, syscall, futex
):
    """Run the tiled kernel on the calling thread and, with ``helpers > 0`` and ``n_slices > 1``, the pool's
    first ``helpers`` workers (see the module docstring). Arrays as in ``depthwise_units``.

    ``syscall``, ``futex``: :data:`~incrinf.kernels.intrinsics.SYSCALL_ADDRESS` and ``FUTEX_SYSCALL`` (0: workers
    nap and are not woken). Returns 0 when the work is done, or the job's generation when workers still computed
    a slice after ``wait_turns`` turns of waiting: then :func:`finish_call` must return True before the arrays
    are used or freed and before the next call (:meth:`SpinPool.run` does both).
    """
    out_w = config[19]
    n_taps = config[5] * config[6]
    acc = np.empty(out_w * TILE, np.int32)
    ind = np.empty(out_w * n_taps, np.int64)
    if helpers <= 0 or n_slices <= 1:
        # config[20] is 0: a literal 0 would compile a second specialization of depthwise_units (u0 typed as
        # the literal), which measured 2.4x slower than the int64 one.
        depthwise_units(xf, weights, params, zero_row, out, config, acc, ind, config[20], config[UNITS])
        return 0
    generation = ((atomic_load(control, _CLAIM) >> 40) + 1) & _GENERATIONS
    control[_N_SLICES] = n_slices
    control[_HELPERS] = helpers
    control[_ARRAYS + 0] = address_of(xf)
    control[_ARRAYS + 1] = xf.size
    control[_ARRAYS + 2] = address_of(weights)
    control[_ARRAYS + 3] = weights.size
    control[_ARRAYS + 4] = address_of(params)
    control[_ARRAYS + 5] = params.size
    control[_ARRAYS + 6] = address_of(zero_row)
    control[_ARRAYS + 7] = zero_row.size
    control[_ARRAYS + 8] = address_of(out)
    control[_ARRAYS + 9] = out.size
    control[_ARRAYS + 10] = address_of(config)
    control[_ARRAYS + 11] = config.size
    atomic_store(control, _DONE, 0)
    atomic_store(control, _CLAIM, (generation << 40) | n_slices)  # open: the fields above are visible first
    if futex != 0:
        for t in range(1, helpers + 1):
            if atomic_load(control, _THREAD + _LINE * t + _STATE) == _ASLEEP:
                # It saw no job before it slept, or we would not see it asleep (both sides store, then load).
                fetch_add(control, _WAKE, 1)
                syscall6(syscall, futex, address_of(control) + 8 * _WAKE, _FUTEX_WAKE, helpers, 0, 0)
                break
    first = _claim(control, generation, False)
    _work(xf, weights, params, zero_row, out, config, acc, ind, control, generation, n_slices, first, 0)
    if _wait_for_workers(control, generation, n_slices, wait_turns):
        return 0
    return generation


@njit(inline="always")
def _wait_for_workers(control, generation, n_slices, wait_turns):
    for _ in range(wait_turns):
        if atomic_load(control, _DONE) >= n_slices:
            atomic_store(control, _CLAIM, generation << 40)  # closed: no slice left to claim
            return True
        spin_pause()
    return False


@njit(nogil=True, cache=True)
def finish_call(control, generation, n_slices, spin_turns):
    """Wait up to ``spin_turns`` turns for the slices that workers claimed in job ``generation``; when they are
    done, close the job (before the caller's arrays go away) and return True."""
    return _wait_for_workers(control, generation, n_slices, spin_turns)


@njit(nogil=True, cache=True)
def _worker_loop(
    control, thread, spin_turns, max_nap_us, sleep_address, sleep_divisor, syscall, futex, like_int8, like_int32,
    like_int64,
):
    """A worker's life: take slices of every job it sees; spin ``spin_turns`` idle turns, then nap (from 50 us
    up to ``max_nap_us``) between looks. Returns when the pool stops.

    ``sleep_address`` is an argument, not the module constant: a constant would be compiled into the cached
    machine code, and the C library sits at another address in every process."""
    acc = np.empty(0, np.int32)
    ind = np.empty(0, np.int64)
    timeout = np.empty(2, np.int64)  # struct timespec
    state = _THREAD + _LINE * thread + _STATE
    idle = 0
    nap_us = 50
    while True:
        if atomic_load(control, _STOP):
            return
        word = atomic_load(control, _CLAIM)
        back = word & _FIELD
        generation = word >> 40
        if ((word >> 20) & _FIELD) < back and thread <= atomic_load(control, _HELPERS):
            if compare_exchange(control, _CLAIM, word, word - 1):
                # Slice back-1 is ours: the job cannot finish before we report it, so its fields stay as they are.
                s = back - 1
                n_slices = control[_N_SLICES]
                xf = array_at(control[_ARRAYS + 0], control[_ARRAYS + 1], like_int8)
                weights = array_at(control[_ARRAYS + 2], control[_ARRAYS + 3], like_int32)
                params = array_at(control[_ARRAYS + 4], control[_ARRAYS + 5], like_int32)
                zero_row = array_at(control[_ARRAYS + 6], control[_ARRAYS + 7], like_int8)
                out = array_at(control[_ARRAYS + 8], control[_ARRAYS + 9], like_int8)
                config = array_at(control[_ARRAYS + 10], control[_ARRAYS + 11], like_int64)
                if acc.size < config[19] * TILE:
                    acc = np.empty(config[19] * TILE, np.int32)
                if ind.size < config[19] * config[5] * config[6]:
                    ind = np.empty(config[19] * config[5] * config[6], np.int64)
                _work(xf, weights, params, zero_row, out, config, acc, ind, control, generation, n_slices, s, thread)
                idle = 0
                nap_us = 50
                atomic_store(control, state, _AWAKE)
            continue
        idle += 1
        if idle < spin_turns:
            spin_pause()
            continue
        if futex == 0:
            atomic_store(control, state, _ASLEEP)
            nap(sleep_address, max(nap_us // sleep_divisor, 1))
            nap_us = min(2 * nap_us, max_nap_us)
            continue
        wake = atomic_load(control, _WAKE) & 0xFFFFFFFF
        atomic_store(control, state, _ASLEEP)
        word = atomic_load(control, _CLAIM)  # a job opened before the caller could see us asleep: take it
        if ((word >> 20) & _FIELD) >= (word & _FIELD) and atomic_load(control, _STOP) == 0:
            timeout[0] = 0
            timeout[1] = _LONG_SLEEP_NS
            syscall6(syscall, futex, address_of(control) + 8 * _WAKE, _FUTEX_WAIT, wake, address_of(timeout), 0)
        atomic_store(control, state, _AWAKE)
        idle = 0


@njit(nogil=True, cache=True)
def _spin_turns(control, turns):
    """``turns`` idle turns of :func:`_worker_loop` (atomic loads and a pause), to time them."""
    seen = 0
    for _ in range(turns):
        seen += atomic_load(control, _STOP) + atomic_load(control, _CLAIM) + atomic_load(control, _HELPERS)
        spin_pause()
    return seen


def _seconds_per_turn(control) -> float:
    """Seconds per idle turn of a worker, the least of a few timings (a preempted timing only comes out longer)."""
    probe = 20000
    _spin_turns(control, 10)  # compile
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        _spin_turns(control, probe)
        best = min(best, (time.perf_counter() - start) / probe)
    return max(best, 1e-10)


class SpinPool:
    """Worker threads for :func:`depthwise_call`, started on first use and kept for the process (they nap
    when idle).

    ``control`` is the block the calling thread and the workers share. Use :func:`get_pool`.
    """

    def __init__(self, max_threads: int, spin_seconds: float = SPIN_SECONDS):
        self.max_threads = max_threads
        self.control = np.zeros(_control_size(max_threads), np.int64)
        self.pid = os.getpid()
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()  # starting workers
        self._call_lock = threading.Lock()  # one call at a time uses the control block
        self._likes = (np.empty(0, np.int8), np.empty(0, np.int32), np.empty(0, np.int64))
        self.spin_turns = max(1, int(spin_seconds / _seconds_per_turn(self.control)))
        self.wait_turns = max(1, int(WAIT_SECONDS / _seconds_per_turn(self.control)))

    def run(self, xf, weights, params, zero_row, out, config, helpers: int, n_slices: int) -> None:
        """:func:`depthwise_call` with ``helpers`` workers, waiting for them to finish; the arrays as there.

        One call at a time uses the workers (the control block holds one job); a call made while another
        thread's call has them runs on its own thread.
        """
        n_slices = min(n_slices, MAX_SLICES)
        if helpers <= 0 or n_slices <= 1 or not self._call_lock.acquire(blocking=False):
            depthwise_call(xf, weights, params, zero_row, out, config, _NO_JOB, 0, 1, 0, 0, 0)
            return
        try:
            if len(self._workers) < helpers:
                self._start(helpers)
            control, wait = self.control, self.wait_turns
            generation = depthwise_call(
                xf, weights, params, zero_row, out, config, control, helpers, n_slices, wait, SYSCALL_ADDRESS,
                FUTEX_SYSCALL,
            )
            # A worker still computes a slice after WAIT_SECONDS: the OS has probably preempted it. Give up this
            # core for a moment rather than spin against it.
            while generation and not finish_call(control, generation, n_slices, wait):
                os.sched_yield()
        finally:
            self._call_lock.release()

    def _start(self, helpers: int) -> None:
        with self._lock:
            while len(self._workers) < helpers:
                thread = len(self._workers) + 1
                worker = threading.Thread(target=self._run, args=(thread,), name=f"incrinf-int8-{thread}", daemon=True)
                self._workers.append(worker)
                worker.start()

    def _run(self, thread: int) -> None:
        max_nap_us = int(MAX_NAP_SECONDS * 1e6)
        _worker_loop(
            self.control, thread, self.spin_turns, max_nap_us, SLEEP_ADDRESS, SLEEP_DIVISOR, SYSCALL_ADDRESS,
            FUTEX_SYSCALL, *self._likes,
        )

    def units_done(self) -> np.ndarray:
        """Work units computed so far by each thread (index 0: the calling threads), for balance statistics."""
        threads = len(self._workers) + 1
        return self.control[_THREAD + _UNITS_DONE : _THREAD + _LINE * threads : _LINE].copy()

    def slices_done(self) -> np.ndarray:
        """Slices computed so far by each thread (index 0: the calling threads)."""
        threads = len(self._workers) + 1
        return self.control[_THREAD + _SLICES_DONE : _THREAD + _LINE * threads : _LINE].copy()

    def stop(self) -> None:
        """Stop the workers (at exit), waking the sleeping ones."""
        self.control[_STOP] = 1
        if FUTEX_SYSCALL and self._workers:
            _wake_all(self.control)
        for worker in self._workers:
            worker.join(timeout=1.0)


@njit(cache=True)
def _futex_wake_all(control, syscall, futex):
    fetch_add(control, _WAKE, 1)
    syscall6(syscall, futex, address_of(control) + 8 * _WAKE, _FUTEX_WAKE, 1 << 30, 0, 0)


def _wake_all(control: np.ndarray) -> None:
    _futex_wake_all(control, SYSCALL_ADDRESS, FUTEX_SYSCALL)


_NO_JOB = np.zeros(_control_size(0), np.int64)  # the control block of calls that run alone (never written)

_POOL: SpinPool | None = None
_POOL_LOCK = threading.Lock()


def run_depthwise(xf, weights, params, zero_row, out, config, helpers: int, n_slices: int) -> None:
    """Run the tiled kernel with ``helpers`` workers of the process's pool (none: on the calling thread alone,
    without starting the pool); arrays as in :func:`depthwise_call`."""
    if helpers <= 0 or n_slices <= 1:
        depthwise_call(xf, weights, params, zero_row, out, config, _NO_JOB, 0, 1, 0, 0, 0)
    else:
        get_pool(numba.config.NUMBA_NUM_THREADS).run(xf, weights, params, zero_row, out, config, helpers, n_slices)


def get_pool(max_threads: int) -> SpinPool:
    """The process's pool (a new one after ``fork``: the parent's workers do not exist in the child)."""
    global _POOL
    pool = _POOL
    if pool is not None and pool.pid == os.getpid():
        return pool
    with _POOL_LOCK:
        if _POOL is None or _POOL.pid != os.getpid():
            _POOL = SpinPool(max_threads)
            atexit.register(_POOL.stop)
        return _POOL
