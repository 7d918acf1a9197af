"""A dataset run's folder: atomic writes, per-input records, what counts as complete, the results table.

Layout of ``DIR``::

    results.csv            one row per input of the run (derived from the records: never the only copy)
    summary.json           counts, dataset statistics, run info
    index.html             the gallery
    items/<id>.heatmap.npy (rows, cols) float32 heat map; (depth, rows, cols) for a volume; with --target all one
                           map per class, (classes, ...); with --feature-mask one value per feature, (F,) or
                           (classes, F), in the order of items/<id>.features.npy (the mask's ids)
    items/<id>.pixel.npy   feature-mask and every-class runs: the drawn map per pixel or voxel (the predicted
                           class's for --target all), which the overlay, NIfTI map and statistics use
    items/<id>.heatmap.nii.gz  volumes: the voxel heat map (mean of the windows covering each voxel) as NIfTI, on
                           the scan's grid (resampled with --resize) with the scan's affine
    items/<id>.overlay.png heat map over the input with a colour bar (OcclusionResult.save; a montage of slices
                           for a volume)
    items/<id>.image.png   the model's input crop (a volume: a montage of its slices)
    items/<id>.thumb.png   small overlay for the gallery (a volume: a montage of slices)
    items/<id>.json        the input's record, written last: its presence commits the files above
    stats/class-<k>.png    mean heat map of class k (volumes: a montage, and stats/class-<k>.nii.gz per voxel)

Every file is written to a temporary name in its folder and renamed over the final name, so a crash leaves
either the old file or the new one, never half of one.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from incrinf.explain.dataset.inputs import InputItem
from incrinf.explain.dataset.job import Outcome

RECORD_FORMAT = 1
STATUS_OK, STATUS_ERROR, STATUS_PENDING = "ok", "error", "pending"
OUTPUT_FILES = ("heatmap", "overlay", "image", "thumb")
VOLUME_OUTPUT_FILES = (*OUTPUT_FILES, "voxels")
_SUFFIX = {"heatmap": ".heatmap.npy", "overlay": ".overlay.png", "image": ".image.png", "thumb": ".thumb.png",
           "positions": ".positions.npy", "voxels": ".heatmap.nii.gz", "pixel": ".pixel.npy",
           "features": ".features.npy"}
KIND_IMAGE, KIND_VOLUME = "image", "volume"  # a record's "kind"

# The results table, in column order.
COLUMNS = (
    "path", "id", "status", "target", "class_name", "score", "probability", "predicted", "largest_drop", "drop_z",
    "drop_y", "drop_x", "patch", "stride", "features", "every_class", "positions", "batches", "seconds",
    "theoretical_speedup", "realized_flop_ratio", "approximate", "error_estimate", "error_estimate_kind",
    "mask_inside_share", "mask_outside", "heatmap_file", "overlay_file", "voxels_file", "worker", "error_kind", "error",
)


def atomic_write(path: Path, write: Callable[[Path], Any]) -> int:
    """Write ``path`` through a temporary file in the same folder, flushed to disk, then renamed over it.

    Args:
        path: the final file.
        write: ``write(tmp_path)`` creates the temporary file (it keeps ``path``'s suffix, for writers that
            choose the format from it).

    Returns:
        The size of the file written, in bytes.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def atomic_write_bytes(path: Path, data: bytes) -> int:
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_png(path: Path, rgb: np.ndarray) -> int:
    from PIL import Image

    return atomic_write(path, lambda tmp: Image.fromarray(rgb).save(tmp, format="PNG"))


def atomic_write_nifti(path: Path, values: np.ndarray, affine: np.ndarray) -> int:
    """Write (D, H, W) ``values`` as NIfTI with ``affine`` (see :func:`~.volumes.write_nifti`), atomically."""
    from incrinf.explain.dataset.volumes import write_nifti

    return atomic_write(path, lambda tmp: write_nifti(tmp, values, affine))


def source_signature(path: Path) -> dict[str, int]:
    """Size and modification time of an input file: a changed file is explained again."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


class RunFolder:
    """The output folder of a dataset run; holds an exclusive lock while open (one writer at a time)."""

    def __init__(self, out: str | os.PathLike) -> None:
        self.root = Path(out)
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"--out must be a directory for a dataset run, and {self.root} is a file")
        self.items = self.root / "items"
        self.items.mkdir(parents=True, exist_ok=True)
        self._lock = None

    def __enter__(self) -> RunFolder:
        import fcntl

        self._lock = open(self.root / ".lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise RuntimeError(f"another incrinf run is writing to {self.root}") from None
        for stale in self.root.rglob(".*.tmp*"):  # left by a run that was killed mid-write; we hold the lock
            stale.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def path(self, item_id: str, kind: str) -> Path:
        return self.items / f"{item_id}{_SUFFIX[kind]}"

    def record_path(self, item_id: str) -> Path:
        return self.items / f"{item_id}.json"

    def read_record(self, item_id: str) -> dict[str, Any] | None:
        """The input's record, or None when there is none or it is unreadable."""
        try:
            record = json.loads(self.record_path(item_id).read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def is_complete(self, record: dict[str, Any] | None, settings: str, source: dict[str, int]) -> bool:
        """Whether an input needs no work: its record says ok, was made with these settings from this very
        file (size and mtime), and every file it lists is present with the size it had when written."""
        if not record or record.get("format") != RECORD_FORMAT or record.get("status") != STATUS_OK:
            return False
        if record.get("settings") != settings or record.get("source") != source:
            return False
        files = record.get("files") or {}
        required = VOLUME_OUTPUT_FILES if record.get("kind") == KIND_VOLUME else OUTPUT_FILES
        if any(kind not in files for kind in required):
            return False
        for entry in files.values():
            path = self.items / entry["name"]
            if not path.is_file() or path.stat().st_size != entry["bytes"]:
                return False
        return True

    def write_record(self, record: dict[str, Any]) -> None:
        atomic_write_bytes(self.record_path(record["id"]), json.dumps(record, indent=1).encode())

    def write_outputs(self, item: InputItem, outcome: Outcome, settings: str, source: dict[str, int],
                      overlay_title: str, check_mask: Callable[[InputItem, np.ndarray], dict | None] | None = None
                      ) -> dict[str, Any]:
        """Write an input's files, then its record (the commit point); returns the record.

        Args:
            item, outcome: the input and what its worker returned.
            settings: the run's settings digest. source: the input file's :func:`source_signature`.
            overlay_title: title of the overlay picture.
            check_mask: ``check_mask(item, pixel_map)`` gives the record's ``mask`` entry (or None).
        """
        record = base_record(item, settings, source)
        record.update(seconds=outcome.seconds, worker=outcome.worker)
        if outcome.error_kind is not None:
            record.update(status=STATUS_ERROR, error_kind=outcome.error_kind, error=outcome.error)
            self.write_record(record)
            return record
        from incrinf.explain.dataset.stats import blend, grid_positions, heat_colours, pixel_map, thumbnail
        from incrinf.explain.pictures import map_title, save_heatmap
        from incrinf.explain.result import OcclusionResult

        heat = outcome.heatmap
        files: dict[str, dict[str, Any]] = {}

        def put(kind: str, write: Callable[[Path], Any]) -> None:
            path = self.path(item.id, kind)
            files[kind] = {"name": path.name, "bytes": atomic_write(path, write)}

        put("heatmap", lambda tmp: np.save(tmp, heat))
        if outcome.pixel is not None:  # features or every class: the heat map is not one grid of windows
            pixel = outcome.pixel
            put("pixel", lambda tmp: np.save(tmp, pixel))
            if outcome.features is not None:
                put("features", lambda tmp: np.save(tmp, outcome.features))
            what = map_title(outcome.patch, outcome.stride, outcome.features is not None)
            put("overlay", lambda tmp: save_heatmap(pixel, tmp, outcome.display, overlay_title or what,
                                                    f"drop in class {outcome.target} score"))
        else:
            regular = np.array_equal(outcome.positions, grid_positions(heat.shape, outcome.stride))
            if not regular:  # kept only when the heat map is not a plain grid, which later statistics assume
                put("positions", lambda tmp: np.save(tmp, outcome.positions))
            result = OcclusionResult(heat, outcome.positions, outcome.target, outcome.patch, outcome.stride,
                                     outcome.image_shape, fine=outcome.fine)
            put("overlay", lambda tmp: result.save(tmp, image=outcome.display, title=overlay_title))
            pixel = pixel_map(heat, outcome.positions, outcome.patch, outcome.image_shape)
        volume = outcome.affine is not None
        if volume:
            from incrinf.explain.dataset.volumes import heat_montage, scan_montage, write_nifti

            put("voxels", lambda tmp: write_nifti(tmp, pixel, outcome.affine))
            put("image", lambda tmp: _save_png(tmp, scan_montage(outcome.display)))
            put("thumb", lambda tmp: _save_png(tmp, thumbnail(heat_montage(heat_colours(pixel), outcome.display), 320)))
        else:
            put("image", lambda tmp: _save_png(tmp, outcome.display))
            put("thumb", lambda tmp: _save_png(tmp, thumbnail(blend(outcome.display, pixel))))
        if outcome.pixel is None:
            flat = int(np.argmax(heat))
            largest, corner = float(heat.reshape(-1)[flat]), [int(v) for v in outcome.positions[flat]]
        else:  # the drawn map's largest drop, at its first element (a feature's or a window's)
            cell = np.unravel_index(int(np.argmax(pixel)), pixel.shape)
            largest, corner = float(pixel[cell]), [int(v) for v in cell]
        record.update(
            status=STATUS_OK, kind=KIND_VOLUME if volume else KIND_IMAGE, target=outcome.target,
            score=outcome.score, probability=outcome.probability, predicted=outcome.predicted,
            largest_drop=largest, drop_z=corner[0] if volume else None, drop_y=corner[-2],
            drop_x=corner[-1], patch=list(outcome.patch), stride=list(outcome.stride),
            features=None if outcome.features is None else len(outcome.features),
            every_class=heat.ndim > (1 if outcome.features is not None else len(outcome.image_shape)),
            image_shape=list(outcome.image_shape), grid=list(heat.shape), stats=outcome.stats, files=files,
            affine=outcome.affine.tolist() if volume else None,
            mask=check_mask(item, pixel) if check_mask is not None else None)
        self.write_record(record)
        return record

    def load_pixel_map(self, record: dict[str, Any]) -> np.ndarray:
        """(H, W) pixel map ((D, H, W) voxel map of a volume) of a complete input, from its heat map file."""
        from incrinf.explain.dataset.stats import grid_positions, pixel_map

        if "pixel" in record["files"]:  # features or every class: stored as drawn
            return np.load(self.items / record["files"]["pixel"]["name"])
        heat = np.load(self.items / record["files"]["heatmap"]["name"])
        if "positions" in record["files"]:
            positions = np.load(self.items / record["files"]["positions"]["name"])
        else:
            positions = grid_positions(heat.shape, tuple(record["stride"]))
        return pixel_map(heat, positions, tuple(record["patch"]), tuple(record["image_shape"]))

    def write_table(self, rows: Sequence[dict[str, Any]]) -> Path:
        """``results.csv``: the rows in :data:`COLUMNS` order (missing values empty)."""
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(row.get(k)) for k in COLUMNS})
        path = self.root / "results.csv"
        atomic_write_bytes(path, text.getvalue().encode())
        return path


def _save_png(path: Path, rgb: np.ndarray) -> None:
    from PIL import Image

    Image.fromarray(rgb).save(path, format="PNG")


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)  # round-trips exactly
    if isinstance(value, (list, tuple)):
        return "x".join(str(v) for v in value)
    return value


def base_record(item: InputItem, settings: str, source: dict[str, int]) -> dict[str, Any]:
    return {"format": RECORD_FORMAT, "id": item.id, "path": str(item.path), "rel": item.rel, "settings": settings,
            "source": source, "status": STATUS_PENDING}


def table_row(record: dict[str, Any], labels: Sequence[str] | None = None) -> dict[str, Any]:
    """One row of the results table from an input's record."""
    row = {k: record.get(k) for k in ("path", "id", "status", "target", "score", "probability", "predicted",
                                      "largest_drop", "drop_z", "drop_y", "drop_x", "patch", "stride", "features",
                                      "every_class", "seconds",
                                      "worker", "error_kind", "error")}
    stats = record.get("stats") or {}
    row.update(positions=stats.get("positions"), batches=stats.get("batches"),
               theoretical_speedup=stats.get("theoretical_speedup"),
               realized_flop_ratio=stats.get("realized_flop_ratio"), approximate=stats.get("approximate"))
    if "max_abs_error" in stats:
        row.update(error_estimate=stats["max_abs_error"], error_estimate_kind="measured max |error|")
    elif "sampled_max_abs_error" in stats:
        row.update(error_estimate=stats["sampled_max_abs_error"],
                   error_estimate_kind=f"max |error| on {stats.get('sampled_cells')} sampled cells")
    target = record.get("target")
    if labels is not None and target is not None and 0 <= target < len(labels):
        row["class_name"] = labels[target]
    mask = record.get("mask") or {}
    row.update(mask_inside_share=mask.get("inside_share"), mask_outside=mask.get("outside"))
    files = record.get("files") or {}
    for kind in ("heatmap", "overlay", "voxels"):
        if kind in files:
            row[f"{kind}_file"] = f"items/{files[kind]['name']}"
    return row
