"""Threads for the int8 depthwise kernel: a pool of spinning workers that claim ranges of a call's work units.

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
- A call publishes its job, then claims units itself from the front while workers claim them from the back,
  as XNNPACK's pool gives each thread a contiguous range: a thread computes neighbouring rows, and in repeated
  calls about the same rows (their input and output stay in its core's caches). A claim takes a fraction of
  what is left (half a thread's share of it, so less and less, down to :data:`MIN_CLAIM_MACS` worth:
  guided self-scheduling), so a call makes few claims and its threads finish within one small claim of each
  other. Claims are compare-and-swaps on one word that holds the job's generation and the first and last
  unclaimed units, so a worker that looks late never claims units of a newer job.
- The calling thread waits only for units that a worker has claimed, never for a worker to arrive: a worker
  that the OS has not scheduled yet simply finds nothing left. A call therefore never takes much longer than
  on one thread, however busy the machine is.

The work units (:func:`incrinf.kernels.depthwise_kernels.depthwise_units`: one output row of one channel tile)
all cost the same multiply-adds, so equal unit counts are equal work, and what a claim or a layer costs comes
from the plan, not from timings. Every unit is computed the same way by whichever thread takes it: results do
not depend on the thread count.

A call is one compiled function (:func:`run_job`): the layer's call plan keeps a *job array* with everything
but the input and output (the kernel's scalars, the packed arrays' addresses, the smallest claim, planned from
the layer's work), and the call takes the pool with a compare-and-swap on a busy word
(another thread's call running meanwhile computes alone), reads numba's thread count, publishes the job, works,
waits and releases the pool without going back to Python in between.

The control block is one int64 array, each field that several threads write on a cache line of its own.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

import numpy as np

from incrinf.extras import require
from incrinf.kernels.depthwise_kernels import CONFIG_SIZE, TILE, UNITS, depthwise_units
from incrinf.kernels.intrinsics import (
    FUTEX_SYSCALL,
    SLEEP_ADDRESS,
    SLEEP_DIVISOR,
    SYSCALL_ADDRESS,
    YIELD_SYSCALL,
    address_of,
    array_at,
    atomic_load,
    atomic_store,
    call_int,
    compare_exchange,
    fetch_add,
    nap,
    spin_pause,
    syscall6,
)

numba = require("numba", "int8", "the int8 kernels")
njit = numba.njit

__all__ = [
    "MAX_NAP_SECONDS",
    "MAX_PIECES",
    "MIN_CLAIM_MACS",
    "MIN_SPLIT_MACS",
    "OVERLAP",
    "SOLO",
    "SPIN_SECONDS",
    "SpinPool",
    "WAIT_SECONDS",
    "get_pool",
    "claim_size",
    "make_job",
    "planned_claims",
    "planned_units",
    "pool_control",
    "pool_threads",
    "run_job",
    "smallest_claim",
]

SPIN_SECONDS = 1e-3
"""How long an idle worker spins before it sleeps. Waking a sleeping thread costs tens of microseconds (more
on a virtual machine), as much as a small layer; a model's depthwise layers come well within a millisecond of
each other, and a millisecond of spinning after the last one is a small price (XNNPACK's pool spins too)."""

MAX_NAP_SECONDS = 1e-3
"""Longest nap of an idle worker: a call that comes while its workers nap runs alone until they look (at most
this long), and an idle worker wakes at most this often."""

WAIT_SECONDS = 2e-5
"""How long a call spins for a worker's last claim before it yields its core to the OS (and spins again)."""

MIN_SPLIT_MACS = 65536
"""Fewest multiply-adds of a layer that threads share: about 6 microseconds of one core's work at the kernel's
measured rate (about 10 multiply-adds per nanosecond with AVX-512), against the about 1-2 microseconds it costs to
publish a job, claim work and move cache lines to another core. Smaller layers run on the calling thread alone."""

MIN_CLAIM_MACS = 8192
"""Fewest multiply-adds a thread claims at a time (about 0.8 microseconds of work, against about 0.2 for a
claim's compare-and-swap and counter on shared cache lines). Claims start at a fraction of what is left and
shrink towards this size (see :func:`claim_size`), so a call makes few claims and its threads finish within
about one smallest claim of each other."""

# Control block layout (int64 indexes); fields written by different threads sit 8 words (64 bytes) apart.
_CLAIM = 0  # (generation << 40) | (front << 20) | back: pieces front..back-1 are unclaimed (none: no open job)
_DONE = 8  # pieces finished in the current job
_JOB = 16  # pieces, helpers, (address, length) of the flat input, output and job array, claim divisor, smallest
_PIECES, _HELPERS, _ARRAYS, _DIVISOR, _MIN_CLAIM = _JOB, _JOB + 1, _JOB + 2, _JOB + 8, _JOB + 9  # claim, grain
_GRAIN, _UNITS = _JOB + 10, _JOB + 11  # (units per piece) and units
_STOP = 32
_WAKE = 33  # futex word (its low 32 bits): a call that finds a worker asleep adds 1 and wakes the workers
_BUSY = 40  # 1 while a call uses the workers (one call at a time: the block holds one job)
_SETTINGS = 48  # written by the pool: workers started, wait turns, syscall address, futex and yield numbers,
_WORKERS, _WAIT_TURNS, _SYSCALL, _FUTEX, _YIELD, _THREADS_FN = range(_SETTINGS, _SETTINGS + 6)  # numba's threads
_FUTEX_WAIT, _FUTEX_WAKE = 128, 129  # FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE
_LONG_SLEEP_NS = 100_000_000  # with futexes an idle worker sleeps until a call wakes it (looking every 0.1 s)
_THREAD = 56  # per thread t (0: the calling thread), at _THREAD + 8*t: state, units computed, claims made
_STATE, _UNITS_DONE, _CLAIMS_DONE = 0, 1, 2
_LINE = 8
_FIELD = np.int64(0xFFFFF)  # front and back are 20-bit fields
_FRONT = np.int64(1 << 20)
_GENERATIONS = np.int64(0x7FFFFF)  # 23 bits: the word stays positive
MAX_PIECES = (1 << 20) - 1
OVERLAP = 1
"""What :func:`run_job` returns when its output overlaps its input."""
_AWAKE, _ASLEEP = 0, 1

# A job array (int64, one per call plan: see make_job) holds what a call needs besides its input and output.
JOB_WEIGHTS = CONFIG_SIZE  # after depthwise_units's config: (address, length) of the packed weights,
JOB_PARAMS = JOB_WEIGHTS + 2  # of the packed parameters
JOB_ZERO_ROW = JOB_WEIGHTS + 4  # and of the zero row
JOB_GRAIN = JOB_WEIGHTS + 6  # units per piece (pieces are what the claim word counts: 1 unit unless too many)
JOB_PIECES = JOB_WEIGHTS + 7  # pieces
JOB_MIN_CLAIM = JOB_WEIGHTS + 8  # smallest claim, in pieces; 0: the layer runs on the calling thread alone
JOB_SIZE = JOB_WEIGHTS + 9


def _control_size(max_threads: int) -> int:
    return _THREAD + _LINE * (max_threads + 1)


def smallest_claim(units: int, macs_per_unit: int) -> int:
    """The smallest claim, in work units, when threads share a layer of ``units`` units of ``macs_per_unit``
    multiply-adds: :data:`MIN_CLAIM_MACS` worth; 0 when the layer is too small to share (fewer than
    :data:`MIN_SPLIT_MACS` multiply-adds, or one unit): then the calling thread computes it alone."""
    if units < 2 or units * macs_per_unit < MIN_SPLIT_MACS:
        return 0
    return max(1, -(-MIN_CLAIM_MACS // max(macs_per_unit, 1)))


def make_job(config, weights, params, zero_row, min_claim: int) -> np.ndarray:
    """The job array of a call plan: ``config`` (:func:`depthwise_units`'s), the packed arrays' addresses and
    how threads claim its units (``min_claim`` units at least; 0: the calling thread alone).

    The arrays must outlive the job array (a call plan keeps both)."""
    job = np.zeros(JOB_SIZE, np.int64)
    job[:CONFIG_SIZE] = config
    for at, array in ((JOB_WEIGHTS, weights), (JOB_PARAMS, params), (JOB_ZERO_ROW, zero_row)):
        job[at], job[at + 1] = array.ctypes.data, array.size
    units = int(config[UNITS])
    grain = max(1, -(-units // MAX_PIECES))
    job[JOB_GRAIN] = grain
    job[JOB_PIECES] = -(-units // grain)
    job[JOB_MIN_CLAIM] = -(-min_claim // grain) if min_claim > 0 else 0
    return job


def claim_size(left: int, divisor: int, min_claim: int) -> int:
    """How many of the ``left`` unclaimed pieces a claim takes: ``left / divisor`` (``divisor`` is twice the
    thread count: half a thread's share of what is left, so the claims shrink as the work runs out), at least
    ``min_claim``, at most ``left``. Guided self-scheduling: few claims, and a short wait at the end."""
    return min(max(min_claim, left // divisor), left)


def planned_claims(units: int, macs_per_unit: int, threads: int) -> list[tuple[int, int]]:
    """``(thread, units)`` of each claim of a call, in order, when every thread runs at the same speed
    (noise-free, from the plan alone): the calling thread (0) claims first, then each thread claims again as
    soon as it has finished its last claim. One claim of everything when the layer runs alone."""
    min_claim = smallest_claim(units, macs_per_unit)
    if threads <= 1 or not min_claim:
        return [(0, units)]
    claims = []
    clock = [0] * threads
    left = units
    while left:
        t = clock.index(min(clock))
        size = claim_size(left, 2 * threads, min_claim)
        claims.append((t, size))
        clock[t] += size
        left -= size
    return claims


def planned_units(units: int, macs_per_unit: int, threads: int) -> list[int]:
    """Units each thread computes in :func:`planned_claims`."""
    done = [0] * max(threads, 1)
    for t, size in planned_claims(units, macs_per_unit, threads):
        done[t] += size
    return done


@njit(inline="always")
def _claim(control, generation, from_back, divisor, min_claim):
    """Claim the first (or, ``from_back``, the last) :func:`claim_size` unclaimed pieces of job
    ``generation``: ``(first, end)``, or ``(-1, -1)`` when none is left or the job is over."""
    while True:
        word = atomic_load(control, _CLAIM)
        front = (word >> 20) & _FIELD
        back = word & _FIELD
        if (word >> 40) != generation or front >= back:
            return -1, -1
        size = min(max(min_claim, (back - front) // divisor), back - front)
        if from_back:
            if compare_exchange(control, _CLAIM, word, word - size):
                return back - size, back
        elif compare_exchange(control, _CLAIM, word, word + size * _FRONT):
            return front, front + size


@njit(inline="always")
def _job_arrays(job):
    """The packed weights, parameters and zero row that a job array points at."""
    weights = array_at(job[JOB_WEIGHTS], job[JOB_WEIGHTS + 1], np.int32)
    params = array_at(job[JOB_PARAMS], job[JOB_PARAMS + 1], np.int32)
    zero_row = array_at(job[JOB_ZERO_ROW], job[JOB_ZERO_ROW + 1], np.int8)
    return weights, params, zero_row


@njit(inline="always")
def _work(xf, out, job, acc, ind, control, generation, first, end, thread):
    """Compute pieces ``first`` to ``end`` (already claimed) of the job, then claim and compute more until none
    is left."""
    weights, params, zero_row = _job_arrays(job)
    grain = control[_GRAIN]
    units = control[_UNITS]
    divisor = control[_DIVISOR]
    min_claim = control[_MIN_CLAIM]
    line = _THREAD + _LINE * thread
    a, b = first, end
    while a >= 0:
        u0 = a * grain
        u1 = min(b * grain, units)
        depthwise_units(xf, weights, params, zero_row, out, job, acc, ind, u0, u1)
        control[line + _UNITS_DONE] += u1 - u0  # statistics; only this thread writes its line
        control[line + _CLAIMS_DONE] += 1
        fetch_add(control, _DONE, b - a)
        a, b = _claim(control, generation, thread > 0, divisor, min_claim)


@njit(nogil=True, cache=True)
def run_job(x, out, job, control, threads):
    """Run a call plan's job (see :func:`make_job`) on the calling thread, helped by the pool's workers.

    Args:
        x: int8 C-contiguous NHWC input; out: int8 C-contiguous output (the plan's shape).
        job: the plan's job array; control: the pool's control block (:attr:`SpinPool.control`), or one
            with no workers (:data:`SOLO`): then the calling thread computes everything.
        threads: threads for this call; 0: numba's current setting (``numba.get_num_threads()``; only with a
            control block that knows where that function is, see :func:`pool_threads`).

    The layer runs on the calling thread alone when one thread is asked for, when its plan says it is too
    small to share, or when another call is using the workers; otherwise the call publishes its job, wakes
    sleeping workers, claims units from the front while workers claim them from the back, and returns once
    every unit is done (spinning for a worker's last claim, then yielding its core now and then).

    Returns 0, or :data:`OVERLAP` (having computed nothing) when ``out`` overlaps ``x``.
    """
    xf = x.reshape(x.size)
    of = out.reshape(out.size)
    if address_of(xf) < address_of(of) + of.size and address_of(of) < address_of(xf) + xf.size:
        return OVERLAP
    if threads > 0:
        n_threads = threads
    else:  # numba's get_num_threads(), through its C function (a Python object would stop the caching)
        n_threads = call_int(control[_THREADS_FN]) if control[_THREADS_FN] != 0 else 1
    min_claim = job[JOB_MIN_CLAIM]
    helpers = min(n_threads - 1, control[_WORKERS])
    out_w = job[19]
    acc = np.empty(out_w * TILE, np.int32)
    ind = np.empty(out_w * job[5] * job[6], np.int64)
    if helpers <= 0 or min_claim <= 0 or not compare_exchange(control, _BUSY, 0, 1):
        weights, params, zero_row = _job_arrays(job)
        # job[20] is 0: a literal 0 would compile a second specialization of depthwise_units (u0 typed as
        # the literal), which measured 2.4x slower than the int64 one.
        depthwise_units(xf, weights, params, zero_row, of, job, acc, ind, job[20], job[UNITS])
        return 0
    generation = ((atomic_load(control, _CLAIM) >> 40) + 1) & _GENERATIONS
    pieces = job[JOB_PIECES]
    control[_PIECES] = pieces
    control[_HELPERS] = helpers
    control[_DIVISOR] = 2 * (helpers + 1)
    control[_MIN_CLAIM] = min_claim
    control[_GRAIN] = job[JOB_GRAIN]
    control[_UNITS] = job[UNITS]
    control[_ARRAYS + 0] = address_of(xf)
    control[_ARRAYS + 1] = xf.size
    control[_ARRAYS + 2] = address_of(of)
    control[_ARRAYS + 3] = of.size
    control[_ARRAYS + 4] = address_of(job)
    control[_ARRAYS + 5] = job.size
    atomic_store(control, _DONE, 0)
    atomic_store(control, _CLAIM, (generation << 40) | pieces)  # open: the fields above are visible first
    syscall = control[_SYSCALL]
    futex = control[_FUTEX]
    if futex != 0:
        for t in range(1, helpers + 1):
            if atomic_load(control, _THREAD + _LINE * t + _STATE) == _ASLEEP:
                # It saw no job before it slept, or we would not see it asleep (both sides store, then load).
                fetch_add(control, _WAKE, 1)
                syscall6(syscall, futex, address_of(control) + 8 * _WAKE, _FUTEX_WAKE, helpers, 0, 0)
                break
    first, end = _claim(control, generation, False, 2 * (helpers + 1), min_claim)
    _work(xf, of, job, acc, ind, control, generation, first, end, 0)
    # A worker still computes a claim after WAIT_SECONDS: the OS has probably preempted it. Give up this core
    # for a moment (where sched_yield is known) rather than spin against it.
    while not _wait_for_workers(control, generation, pieces, control[_WAIT_TURNS]):
        if control[_YIELD] != 0:
            syscall6(syscall, control[_YIELD], 0, 0, 0, 0, 0)
    atomic_store(control, _BUSY, 0)
    return 0


@njit(inline="always")
def _wait_for_workers(control, generation, pieces, wait_turns):
    for _ in range(wait_turns):
        if atomic_load(control, _DONE) >= pieces:
            atomic_store(control, _CLAIM, generation << 40)  # closed: nothing left to claim
            return True
        spin_pause()
    return False


@njit(nogil=True, cache=True)
def _worker_loop(control, thread, spin_turns, max_nap_us, sleep_address, sleep_divisor, syscall, futex):
    """A worker's life: claim units of every job it sees; spin ``spin_turns`` idle turns, then sleep on the
    futex (or nap, from 50 us up to ``max_nap_us``, between looks). Returns when the pool stops.

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
            first, end = _claim(control, generation, True, control[_DIVISOR], control[_MIN_CLAIM])
            if first >= 0:
                # Pieces first..end-1 are ours: the job cannot finish before we report them, so its fields stay.
                xf = array_at(control[_ARRAYS + 0], control[_ARRAYS + 1], np.int8)
                out = array_at(control[_ARRAYS + 2], control[_ARRAYS + 3], np.int8)
                job = array_at(control[_ARRAYS + 4], control[_ARRAYS + 5], np.int64)
                out_w = job[19]
                if acc.size < out_w * TILE:
                    acc = np.empty(out_w * TILE, np.int32)
                if ind.size < out_w * job[5] * job[6]:
                    ind = np.empty(out_w * job[5] * job[6], np.int64)
                _work(xf, out, job, acc, ind, control, generation, first, end, thread)
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
    """Worker threads for :func:`run_job`, started on first use and kept for the process (they sleep when
    idle).

    ``control`` is the block the calling thread and the workers share. Use :func:`get_pool`.
    """

    def __init__(self, max_threads: int, spin_seconds: float = SPIN_SECONDS):
        self.max_threads = max_threads
        self.control = np.zeros(_control_size(max_threads), np.int64)
        self.pid = os.getpid()
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()  # starting workers
        seconds_per_turn = _seconds_per_turn(self.control)
        self.spin_turns = max(1, int(spin_seconds / seconds_per_turn))
        self.control[_WAIT_TURNS] = max(1, int(WAIT_SECONDS / seconds_per_turn))
        self.control[_SYSCALL], self.control[_FUTEX] = SYSCALL_ADDRESS, FUTEX_SYSCALL
        self.control[_YIELD] = YIELD_SYSCALL
        self.control[_THREADS_FN] = _num_threads_function()
        self.threads_known = bool(self.control[_THREADS_FN])

    def start(self, workers: int) -> None:
        """Start workers until ``workers`` (at most ``max_threads - 1``) run."""
        workers = min(workers, self.max_threads - 1)
        if len(self._workers) >= workers:
            return
        with self._lock:
            while len(self._workers) < workers:
                thread = len(self._workers) + 1
                worker = threading.Thread(target=self._run, args=(thread,), name=f"incrinf-int8-{thread}", daemon=True)
                self._workers.append(worker)
                worker.start()
                self.control[_WORKERS] = thread  # a call may hand it work now (it takes them once it runs)

    def run(self, xf, weights, params, zero_row, out, config, helpers: int, min_claim: int) -> None:
        """The tiled kernel (arrays as in :func:`depthwise_units`) with at most ``helpers`` workers claiming at
        least ``min_claim`` units at a time, whatever the layer's size (for tests and measurements; calls go
        through :func:`run_job`)."""
        self.start(helpers)
        job = make_job(config, weights, params, zero_row, max(min_claim, 1))
        run_job(xf, out, job, self.control, helpers + 1)

    def _run(self, thread: int) -> None:
        max_nap_us = int(MAX_NAP_SECONDS * 1e6)
        _worker_loop(
            self.control, thread, self.spin_turns, max_nap_us, SLEEP_ADDRESS, SLEEP_DIVISOR, SYSCALL_ADDRESS,
            FUTEX_SYSCALL,
        )

    def units_done(self) -> np.ndarray:
        """Work units computed so far by each thread (index 0: the calling threads), for balance statistics."""
        threads = len(self._workers) + 1
        return self.control[_THREAD + _UNITS_DONE : _THREAD + _LINE * threads : _LINE].copy()

    def claims_done(self) -> np.ndarray:
        """Claims computed so far by each thread (index 0: the calling threads)."""
        threads = len(self._workers) + 1
        return self.control[_THREAD + _CLAIMS_DONE : _THREAD + _LINE * threads : _LINE].copy()

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


SOLO = np.zeros(_control_size(0), np.int64)
"""The control block of calls that run on the calling thread alone (no workers; never written)."""

_POOL: SpinPool | None = None
_POOL_LOCK = threading.Lock()


def pool_control() -> np.ndarray:
    """The control block of the process's pool, its workers started (what a multi-threaded call passes to
    :func:`run_job`)."""
    pool = _POOL
    if pool is None:
        pool = get_pool(numba.config.NUMBA_NUM_THREADS)
    return pool.control


def pool_threads(threads: int | None) -> tuple[np.ndarray, int]:
    """``(control block, threads argument)`` for :func:`run_job`: the pool's block, and 0 for numba's current
    thread count where the compiled call can read it (otherwise read here), for ``threads=None``."""
    pool = _POOL
    if pool is None:
        pool = get_pool(numba.config.NUMBA_NUM_THREADS)
    if threads is not None:
        return pool.control, threads
    return pool.control, 0 if pool.threads_known else numba.get_num_threads()


def get_pool(max_threads: int) -> SpinPool:
    """The process's pool with ``max_threads - 1`` workers started (a new one after ``fork``: the parent's
    workers do not exist in the child)."""
    global _POOL
    pool = _POOL
    if pool is None or pool.pid != os.getpid():
        with _POOL_LOCK:
            if _POOL is None or _POOL.pid != os.getpid():
                _POOL = SpinPool(max_threads)
                atexit.register(_POOL.stop)
            pool = _POOL
    pool.start(pool.max_threads - 1)
    return pool


def _num_threads_function() -> int:
    """The address of numba's C function behind ``numba.get_num_threads()`` (per thread: what
    ``numba.set_num_threads`` set on it), or 0 where numba's internals no longer expose it."""
    import ctypes

    numba.get_num_threads()  # starts numba's threading layer, which loads the function
    function = getattr(numba.np.ufunc.parallel, "_get_num_threads", None)
    try:
        address = ctypes.cast(function, ctypes.c_void_p).value or 0
    except (ctypes.ArgumentError, TypeError):
        return 0
    return address if numba.get_num_threads() == _check_num_threads(address) else 0


@njit(cache=True)
def _check_num_threads(address):
    return call_int(address)


def _forget_pool() -> None:
    global _POOL
    _POOL = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)
