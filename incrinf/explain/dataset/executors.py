"""Where a dataset run's jobs execute: in-process, local worker processes, or Ray actors.

Every executor turns a lazy stream of :class:`~incrinf.explain.dataset.job.Task` into a stream of
:class:`~incrinf.explain.dataset.job.Outcome` in completion order, with a bounded number of tasks in flight per
worker (so neither the inputs' bytes nor the results pile up in memory). Workers hold one model each and return
results; the driver writes every file. A worker that dies (killed, out of memory, a lost Ray node) loses only
the tasks it held: they go back to the queue, to the other workers and to a replacement. A task that was in
flight on :data:`MAX_LOSSES` dead workers becomes an error outcome instead of being retried for ever.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import signal
from collections.abc import Iterator
from typing import Any

from incrinf.explain.dataset.job import (
    ERROR_EXPLAIN,
    ERROR_WORKER_LOST,
    Explainer,
    ExplainSpec,
    ModelSource,
    Outcome,
    Task,
)

MAX_LOSSES = 3  # worker deaths one task may witness before it counts as the cause
IN_FLIGHT_PER_WORKER = 2  # one running, one queued: a worker never waits for the driver between inputs


def available_cores() -> int:
    """Cores this process may run on (the affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_worker(workers: int) -> int:
    """Torch threads for each of ``workers`` local processes: the cores shared out, at least one, so that N
    workers do not run N x cores OpenMP threads on the same cores."""
    return max(1, available_cores() // max(1, workers))


class _Queue:
    """Tasks still to run: retries first (they were taken earlier), then the lazy input stream."""

    def __init__(self, tasks: Iterator[Task]) -> None:
        self._tasks = tasks
        self._retry: collections.deque[Task] = collections.deque()
        self._losses: collections.Counter[int] = collections.Counter()
        self.retried = 0

    def next(self) -> Task | None:
        if self._retry:
            return self._retry.popleft()
        return next(self._tasks, None)

    def lost(self, task: Task) -> Outcome | None:
        """A worker died holding ``task``: queue it again, or give its error outcome after MAX_LOSSES."""
        self._losses[task.index] += 1
        if self._losses[task.index] >= MAX_LOSSES:
            return Outcome(task.index, task.id, ERROR_WORKER_LOST,
                           f"the worker died {MAX_LOSSES} times while explaining this input")
        self._retry.append(task)
        self.retried += 1
        return None


class Executor:
    """Base: ``run(tasks)`` yields outcomes as they complete; ``close()`` releases the workers.

    Attributes:
        name: how the summary names it. workers: number of workers. workers_lost: workers that died.
        retried: tasks queued again after their worker died.
    """

    name = "executor"

    def __init__(self) -> None:
        self.workers = 1
        self.workers_lost = 0
        self.retried = 0

    def run(self, tasks: Iterator[Task]) -> Iterator[Outcome]:
        raise NotImplementedError

    def close(self, abort: bool = False) -> None:
        """Stop the workers (idempotent); ``abort`` kills them without waiting for the tasks they hold."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(abort=exc_type is not None)


class InProcessExecutor(Executor):
    """Runs every task in this process, one at a time, with the per-input progress bar."""

    name = "in-process"

    def __init__(self, spec: ExplainSpec, progress: bool = True) -> None:
        super().__init__()
        self._explainer = Explainer(spec, progress=progress)

    def run(self, tasks: Iterator[Task]) -> Iterator[Outcome]:
        for task in tasks:
            yield self._explainer(task)


# --- local worker processes -----------------------------------------------------------------------------------


def _process_main(spec: ExplainSpec, threads: int, tasks: mp.Queue, results: mp.connection.Connection) -> None:
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle: it stops us
    torch.set_num_threads(threads)
    try:
        explainer = Explainer(spec)
    except Exception as exc:
        results.send(("init-error", f"{type(exc).__name__}: {exc}"))
        return
    results.send(("ready", os.getpid()))
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # the driver was killed: do not linger as an orphan
                return
            continue
        if task is None:
            return
        try:
            results.send(("outcome", explainer(task)))
        except (BrokenPipeError, EOFError):  # the driver is gone
            return


class _LocalWorker:
    def __init__(self, ctx: Any, spec: ExplainSpec, threads: int) -> None:
        # a queue per worker (its feeder thread keeps put() from blocking on a busy worker) and a pipe per
        # worker back (a worker killed mid-send corrupts only its own pipe, not a shared queue)
        self.tasks = ctx.Queue()
        self.conn, child_conn = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_process_main, args=(spec, threads, self.tasks, child_conn), daemon=True)
        self.process.start()
        child_conn.close()
        self.in_flight: dict[int, Task] = {}

    def stop(self, wait: float = 5.0) -> None:
        if self.process.is_alive() and wait > 0:
            try:
                self.tasks.put(None)
            except (OSError, ValueError):
                pass
            self.process.join(wait)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.tasks.cancel_join_thread()  # never block exit on tasks a dead worker will not read
        self.tasks.close()
        self.conn.close()


class ProcessExecutor(Executor):
    """``workers`` spawned processes, each with its own model and ``threads_per_worker(workers)`` torch threads.

    Processes are spawned, not forked: a fork of a process whose OpenMP pool is running can deadlock.
    """

    name = "processes"

    def __init__(self, spec: ExplainSpec, workers: int) -> None:
        super().__init__()
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers = workers
        self._spec = spec
        self._ctx = mp.get_context("spawn")
        self._threads = threads_per_worker(workers)
        self._pool: list[_LocalWorker] = [self._start() for _ in range(workers)]
        try:
            for worker in self._pool:
                self._await_ready(worker)
        except BaseException:
            self.close(abort=True)
            raise

    def _start(self) -> _LocalWorker:
        return _LocalWorker(self._ctx, self._spec, self._threads)

    @staticmethod
    def _await_ready(worker: _LocalWorker) -> None:
        """Wait until ``worker`` has loaded its model, so a model that cannot load fails the run at once and
        the run's clock starts with every worker ready."""
        mp.connection.wait([worker.conn, worker.process.sentinel])
        try:
            kind, payload = worker.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"a worker process died while loading the model (exit code "
                               f"{worker.process.exitcode})") from None
        if kind == "init-error":
            raise RuntimeError(f"a worker process could not load the model: {payload}")

    def run(self, tasks: Iterator[Task]) -> Iterator[Outcome]:
        pending = _Queue(tasks)
        exhausted = False
        deaths_without_progress = 0
        try:
            while True:
                for worker in self._pool:
                    while not exhausted and len(worker.in_flight) < IN_FLIGHT_PER_WORKER:
                        task = pending.next()
                        if task is None:
                            exhausted = True
                            break
                        worker.in_flight[task.index] = task
                        worker.tasks.put(task)
                if not any(w.in_flight for w in self._pool):
                    return
                waitables = [w.conn for w in self._pool] + [w.process.sentinel for w in self._pool]
                ready = set(mp.connection.wait(waitables))
                for worker in list(self._pool):
                    for outcome in self._drain(worker):
                        deaths_without_progress = 0
                        yield outcome
                    if worker.process.sentinel in ready and not worker.process.is_alive():
                        deaths_without_progress += 1
                        if deaths_without_progress > 2 * self.workers + 2:
                            raise RuntimeError("local workers keep dying before finishing any input")
                        yield from self._replace(worker, pending)
                        exhausted = False  # retried tasks are back in the queue
                self.retried = pending.retried
        finally:
            self.retried = pending.retried

    def _drain(self, worker: _LocalWorker) -> Iterator[Outcome]:
        """Outcomes already sent by ``worker`` (also after it died: they are complete)."""
        while True:
            try:
                if not worker.conn.poll():
                    return
                kind, payload = worker.conn.recv()
            except (EOFError, OSError):
                return
            if kind == "init-error":
                raise RuntimeError(f"a worker process could not load the model: {payload}")
            if kind == "ready":  # a replacement worker has loaded its model
                continue
            worker.in_flight.pop(payload.index, None)
            yield payload

    def _replace(self, worker: _LocalWorker, pending: _Queue) -> Iterator[Outcome]:
        self.workers_lost += 1
        for task in worker.in_flight.values():
            failed = pending.lost(task)
            if failed is not None:
                yield failed
        worker.in_flight.clear()
        worker.stop(wait=0)
        self._pool[self._pool.index(worker)] = self._start()

    def close(self, abort: bool = False) -> None:
        for worker in self._pool:
            worker.stop(wait=0 if abort else 5.0)
        self._pool = []


# --- Ray ----------------------------------------------------------------------------------------------------


class _RayWorker:
    """The actor: one model, loaded in the constructor; torch threads = the CPUs Ray gave it."""

    def __init__(self, spec: ExplainSpec, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self._explainer = Explainer(spec)

    def explain(self, task: Task) -> Outcome:
        return self._explainer(task)

    def pid(self) -> int:
        return os.getpid()


class RayExecutor(Executor):
    """One actor per ``cpus_per_actor`` CPUs of a Ray cluster (or ``actors`` of them).

    Args:
        spec: what each actor loads and runs.
        address: None or "local" starts a Ray instance on this machine (stopped on close); anything else
            ("auto", "HOST:PORT", "ray://HOST:10001") connects to a running cluster.
        actors: number of actors (default: the cluster's CPUs // cpus_per_actor).
        cpus_per_actor: CPUs Ray reserves for each actor, and its torch threads.
    """

    name = "ray"

    def __init__(self, spec: ExplainSpec, address: str | None = None, actors: int | None = None,
                 cpus_per_actor: int = 1) -> None:
        super().__init__()
        try:
            import ray
        except ImportError:
            raise RuntimeError("Ray is not installed: pip install 'incrinf[ray]'") from None
        if cpus_per_actor < 1:
            raise ValueError(f"cpus_per_actor must be at least 1, got {cpus_per_actor}")
        self._ray = ray
        self._owns_ray = False
        if not ray.is_initialized():
            if address in (None, "local"):
                # Ray runs workers at niceness 15 by default; here the actors are the work, and at 15 they would
                # yield every core to any other process (local worker processes run at 0)
                ray.init(num_cpus=available_cores(), include_dashboard=False, logging_level=logging.WARNING,
                         configure_logging=False, _system_config={"worker_niceness": 0})
                self._owns_ray = True
            else:
                try:
                    ray.init(address=address, logging_level=logging.WARNING, configure_logging=False)
                except ConnectionError as exc:
                    raise RuntimeError(f"cannot reach a Ray cluster at {address}: {exc}") from None
        if spec.model.weights is not None:  # a weights file may exist on this machine only: ship the model
            spec = dataclasses.replace(spec, model=ModelSource(module=spec.model.load()))
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.workers = actors or max(1, cpus // cpus_per_actor)
        self._cpus = cpus_per_actor
        # max_restarts=0: a dead actor stays dead and this class retries its tasks on a fresh one, so every
        # retry is visible here (and counted) rather than hidden inside Ray
        self._actor_class = ray.remote(num_cpus=cpus_per_actor, max_restarts=0, max_task_retries=0)(_RayWorker)
        self._spec_ref = ray.put(spec)  # a module is pickled once, not once per actor
        self._actors = [self._start() for _ in range(self.workers)]
        try:
            self.actor_pids()  # every actor has loaded its model (or the error surfaces now)
        except Exception as exc:
            self.close(abort=True)
            raise RuntimeError(f"a Ray actor could not load the model: {exc}") from None

    def _start(self) -> Any:
        return self._actor_class.remote(self._spec_ref, self._cpus)

    def actor_pids(self) -> list[int]:
        return self._ray.get([actor.pid.remote() for actor in self._actors])

    def run(self, tasks: Iterator[Task]) -> Iterator[Outcome]:
        ray = self._ray
        from ray.exceptions import RayActorError, RayTaskError

        pending = _Queue(tasks)
        refs: dict[Any, tuple[Any, Task]] = {}  # object ref -> (actor, task)
        load = collections.Counter()  # actor -> tasks in flight
        exhausted = False
        deaths_without_progress = 0
        try:
            while True:
                for actor in self._actors:
                    while not exhausted and load[actor] < IN_FLIGHT_PER_WORKER:
                        task = pending.next()
                        if task is None:
                            exhausted = True
                            break
                        refs[actor.explain.remote(task)] = (actor, task)
                        load[actor] += 1
                if not refs:
                    return
                ready, _ = ray.wait(list(refs), num_returns=1)
                for ref in ready:
                    if ref not in refs:  # dropped with its dead actor
                        continue
                    actor, task = refs.pop(ref)
                    load[actor] -= 1
                    try:
                        outcome = ray.get(ref)
                    except RayActorError:
                        deaths_without_progress += 1
                        if deaths_without_progress > 2 * self.workers + 2:
                            raise RuntimeError("Ray actors keep dying before finishing any input "
                                               "(can they load the model?)") from None
                        yield from self._replace(actor, task, refs, load, pending)
                        exhausted = False
                        continue
                    except RayTaskError as exc:  # the job itself catches model errors; this is anything else
                        outcome = Outcome(task.index, task.id, ERROR_EXPLAIN, f"Ray task failed: {exc}")
                    deaths_without_progress = 0
                    yield outcome
                self.retried = pending.retried
        finally:
            self.retried = pending.retried

    def _replace(self, actor: Any, first: Task, refs: dict[Any, tuple[Any, Task]], load: collections.Counter,
                 pending: _Queue) -> Iterator[Outcome]:
        """``actor`` died: its other tasks fail too; queue them all again and start a replacement."""
        self.workers_lost += 1
        lost = [first] + [task for ref, (owner, task) in list(refs.items()) if owner is actor]
        for ref in [ref for ref, (owner, _) in refs.items() if owner is actor]:
            del refs[ref]
        del load[actor]
        for task in sorted(lost, key=lambda t: t.index):
            failed = pending.lost(task)
            if failed is not None:
                yield failed
        try:
            self._ray.kill(actor, no_restart=True)
        except Exception:  # already gone; nothing to release
            pass
        self._actors[self._actors.index(actor)] = self._start()

    def close(self, abort: bool = False) -> None:
        for actor in self._actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self._actors = []
        if self._owns_ray:
            self._ray.shutdown()
            self._owns_ray = False
