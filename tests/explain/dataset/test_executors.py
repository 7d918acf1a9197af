"""Dataset runs on local worker processes and on a real local Ray cluster: the same table and arrays as
in-process, and every input done exactly once when a worker is killed mid-run."""

from __future__ import annotations

import csv
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from dataset_fixtures import BAD, GOOD, MODEL, OPTIONS, SIZE, photos_fixture  # noqa: F401 (the photos fixture)

from incrinf.explain.dataset import explain_dataset
from incrinf.explain.dataset.executors import threads_per_worker

# Columns that describe how a run went rather than what it computed.
RUN_COLUMNS = ("seconds", "worker")


def read_table(out: Path) -> list[dict[str, str]]:
    with open(out / "results.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def computed_columns(out: Path) -> list[dict[str, str]]:
    return [{k: v for k, v in row.items() if k not in RUN_COLUMNS} for row in read_table(out)]


def inputs(photos: Path) -> list[str]:
    return [str(photos / "data"), str(photos / "extra" / "*.png")]


@pytest.fixture
def local_ray():
    """A real Ray instance on this machine (2 CPUs, loopback). Function-scoped and used by one test, so that
    pytest-xdist never runs two Ray instances at once on the two cores."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'incrinf[ray]')")
    # niceness 0 as incrinf's own local Ray (Ray's default 15 starves the actors next to another xdist worker)
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False,
             _system_config={"worker_niceness": 0})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def in_process_run(photos, tmp_path_factory) -> Path:
    """The reference: an in-process run with as many torch threads as each worker below gets. (Float sums
    depend on the thread count: 1 vs 2 threads differ by ~2e-5 on these logits.)"""
    out = tmp_path_factory.mktemp("reference")
    threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_worker(2))
    try:
        report = explain_dataset(MODEL, inputs(photos), out, size=SIZE, progress=False, **OPTIONS)
    finally:
        torch.set_num_threads(threads)
    assert report.count("ok") == GOOD and report.count("error") == BAD
    return out


def assert_same_run(out: Path, reference: Path) -> None:
    assert computed_columns(out) == computed_columns(reference)  # every value, to the last digit
    for row in read_table(reference):
        if row["status"] == "ok":
            np.testing.assert_array_equal(np.load(out / row["heatmap_file"]), np.load(reference / row["heatmap_file"]))


def killer(kind: str) -> tuple[list, list, callable]:
    """A callback that records every input written and SIGKILLs the worker of the first result (it still holds
    a queued input, and maybe a running one)."""
    killed: list[int] = []
    written: list[str] = []

    def callback(row: dict) -> None:
        written.append(row["id"])
        if not killed and row["worker"]:
            pid = int(row["worker"].split("@")[0])
            assert pid != os.getpid(), f"{kind} work ran in the driver"
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    return killed, written, callback


def assert_every_input_once(out: Path, report, written: list[str], reference: Path) -> None:
    rows = read_table(out)
    assert sorted(written) == sorted(r["id"] for r in rows)  # each input written exactly once
    assert len(set(written)) == GOOD + BAD
    assert report.workers_lost == 1 and report.retried >= 1 and report.computed == GOOD + BAD
    records = sorted(p.name for p in (out / "items").glob("*.json"))
    assert records == sorted(f"{r['id']}.json" for r in rows)
    assert_same_run(out, reference)


def test_killed_local_worker_loses_nothing(photos, tmp_path, in_process_run) -> None:
    """``--workers 2`` gives the in-process table and arrays, also with a worker SIGKILLed mid-run."""
    killed, written, callback = killer("process")
    report = explain_dataset(MODEL, inputs(photos), tmp_path, size=SIZE, progress=False, workers=2,
                             callback=callback, **OPTIONS)
    assert report.executor == "processes" and report.workers == 2 and report.exit_code == 1  # the 2 bad inputs
    assert len(killed) == 1
    assert len({r["worker"] for r in read_table(tmp_path) if r["status"] == "ok"}) >= 2  # the work was shared
    assert_every_input_once(tmp_path, report, written, in_process_run)


def test_ray_matches_in_process_and_survives_a_killed_actor(local_ray, photos, tmp_path, in_process_run) -> None:
    report = explain_dataset(MODEL, inputs(photos), tmp_path / "plain", size=SIZE, progress=False, ray=True,
                             cpus_per_worker=threads_per_worker(2), **OPTIONS)
    assert report.executor == "ray" and report.workers == 2 and report.workers_lost == 0
    workers = {r["worker"] for r in read_table(tmp_path / "plain") if r["status"] == "ok"}
    assert len(workers) == 2 and str(os.getpid()) not in {w.split("@")[0] for w in workers}  # both actors worked
    assert_same_run(tmp_path / "plain", in_process_run)
    assert local_ray.is_initialized()  # a cluster the run did not start is left running

    killed, written, callback = killer("Ray")
    report = explain_dataset(MODEL, inputs(photos), tmp_path / "killed", size=SIZE, progress=False, ray=True,
                             cpus_per_worker=threads_per_worker(2), callback=callback, **OPTIONS)
    assert len(killed) == 1
    assert_every_input_once(tmp_path / "killed", report, written, in_process_run)


def test_an_input_that_keeps_killing_workers_becomes_an_error_row() -> None:
    from incrinf.explain.dataset.executors import MAX_LOSSES, _Queue
    from incrinf.explain.dataset.job import ERROR_WORKER_LOST, Task

    tasks = [Task(i, f"id{i}", f"in{i}.png", b"") for i in range(3)]
    queue = _Queue(iter(tasks))
    first = queue.next()
    for _ in range(MAX_LOSSES - 1):
        assert queue.lost(first) is None  # queued again, ahead of the inputs not yet taken
        assert queue.next() is first
    failed = queue.lost(first)
    assert failed.error_kind == ERROR_WORKER_LOST and failed.index == 0 and queue.retried == MAX_LOSSES - 1
    assert [queue.next().index, queue.next().index, queue.next()] == [1, 2, None]
