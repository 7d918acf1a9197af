"""What a dataset run did: the report :func:`incrinf.explain.dataset.explain_dataset` returns and the gallery
reads (its own module so that the gallery needs nothing else of the dataset run)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from incrinf.explain.dataset.stats import ClassMean
from incrinf.explain.dataset.store import STATUS_ERROR, STATUS_OK, STATUS_PENDING

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130


@dataclass
class DatasetReport:
    """What a dataset run did.

    Attributes:
        out: the run's folder. rows: one results-table row per input, in input order.
        computed: inputs explained (or failed) by this run. skipped: inputs already complete.
        seconds: wall time of the explaining phase (without the final table and gallery).
        startup_seconds: time to start the workers and load their models (Ray: also to start Ray).
        executor: "in-process", "processes" or "ray"; workers, workers_lost and retried describe it.
        class_means: mean heat map per class. mask_outside: rows whose positive heat falls mostly outside
            their mask. mask_threshold: the outside share above which a row is listed.
        skipped_non_images: files a directory walk passed over (no image or NIfTI suffix).
        interrupted: the run was stopped (Ctrl-C) before every input was done.
        kind: ``"images"`` or ``"volumes"`` (NIfTI scans).
    """

    out: Path
    rows: list[dict[str, Any]]
    computed: int
    skipped: int
    seconds: float
    executor: str
    workers: int
    workers_lost: int = 0
    retried: int = 0
    class_means: list[ClassMean] = field(default_factory=list)
    mask_outside: list[dict[str, Any]] = field(default_factory=list)
    mask_threshold: float = 0.5
    skipped_non_images: list[str] = field(default_factory=list)
    interrupted: bool = False
    startup_seconds: float = 0.0
    kind: str = "images"

    def count(self, status: str) -> int:
        return sum(row["status"] == status for row in self.rows)

    @property
    def exit_code(self) -> int:
        """0 when every input is done, 1 when any failed or is still pending, 130 after an interruption."""
        if self.interrupted:
            return EXIT_INTERRUPTED
        return EXIT_OK if self.count(STATUS_OK) == len(self.rows) else EXIT_FAILED

    def where(self) -> str:
        if self.executor == "in-process":
            return "in this process"
        return f"on {self.workers} " + ("local processes" if self.executor == "processes" else "Ray actors")

    @property
    def inputs_per_minute(self) -> float:
        return 60.0 * self.computed / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        """The end-of-run summary printed by ``incrinf explain``."""
        ok, failed, pending = self.count(STATUS_OK), self.count(STATUS_ERROR), self.count(STATUS_PENDING)
        lines = [f"{len(self.rows)} inputs: {ok} explained, {failed} failed, {pending} not done"
                 + (" (interrupted)" if self.interrupted else ""),
                 f"this run: {self.computed} computed in {self.seconds:.1f} s "
                 f"({self.inputs_per_minute:.1f} inputs/min) {self.where()} after {self.startup_seconds:.1f} s of "
                 f"start-up; {self.skipped} already complete"]
        if self.workers_lost:
            lines.append(f"{self.workers_lost} worker(s) lost; {self.retried} input(s) retried on other workers")
        if self.skipped_non_images:
            lines.append(f"passed over {len(self.skipped_non_images)} file(s) without an image or NIfTI suffix, e.g. "
                         f"{self.skipped_non_images[0]}")
        for row in [r for r in self.rows if r["status"] == STATUS_ERROR][:10]:
            lines.append(f"  failed: {row['path']}: {row['error']}")
        if self.class_means:
            top = sorted(self.class_means, key=lambda m: -m.count)[:5]
            lines.append("mean heat maps for " + ", ".join(f"class {m.target} ({m.count})" for m in top)
                         + (" ..." if len(self.class_means) > 5 else ""))
        if self.mask_outside:
            lines.append(f"{len(self.mask_outside)} input(s) with over {self.mask_threshold:.0%} of their heat outside "
                         "the mask: " + ", ".join(Path(r["path"]).name for r in self.mask_outside[:5]))
        lines.append(f"table {self.out / 'results.csv'}, gallery {self.out / 'index.html'}")
        return "\n".join(lines)
