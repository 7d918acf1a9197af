"""``incrinf.explain_dataset``: explain every image of a dataset, resumably, on one or many workers.

The driver (this module) discovers the inputs, skips the complete ones, streams the others' bytes to an
executor (in-process, local processes or Ray actors), writes each result as it arrives, and at the end derives
the results table, the dataset statistics and the gallery from the per-input records. Nothing is kept only in
memory: a run killed at any point leaves every finished input committed, and the next run redoes only the
rest.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch.nn as nn

from incrinf.explain.dataset.executors import Executor, InProcessExecutor, ProcessExecutor, RayExecutor
from incrinf.explain.dataset.inputs import KIND_VOLUMES, InputItem, Selection, discover_inputs, find_masks
from incrinf.explain.dataset.job import ExplainSpec, ModelSource, Preprocessing, Task
from incrinf.explain.dataset.mask_folders import MaskFolder, MaskMatch, read_feature_ids, read_mask, settings_with_mask
from incrinf.explain.dataset.report import DatasetReport
from incrinf.explain.dataset.stats import class_means, inside_share, load_mask
from incrinf.explain.dataset.store import (
    STATUS_ERROR,
    STATUS_OK,
    STATUS_PENDING,
    RunFolder,
    atomic_write_bytes,
    atomic_write_nifti,
    atomic_write_png,
    base_record,
    source_signature,
    table_row,
)
from incrinf.explain.dataset.volumes import VolumePreprocessing


class DatasetInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`explain_dataset`, after the table and gallery were brought up to date."""

    def __init__(self, report: DatasetReport) -> None:
        super().__init__("dataset run interrupted")
        self.report = report


def explain_dataset(
    model: nn.Module | str,
    inputs: str | os.PathLike | Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    weights: str | None = None,
    normalization: str | None = None,
    size: int | None = None,
    volume_index: int = 0,
    resize: tuple[int, int, int] | None = None,
    masks: str | os.PathLike | None = None,
    mask_threshold: float = 0.5,
    feature_mask: str | os.PathLike | None = None,
    workers: int = 1,
    ray: bool | str | None = None,
    cpus_per_worker: int = 1,
    overwrite: bool = False,
    labels: Sequence[str] | None = None,
    gallery: bool = True,
    progress: bool = True,
    callback: Callable[[dict[str, Any]], None] | None = None,
    **occlusion_options: Any,
) -> DatasetReport:
    """Occlusion heat maps for every image (or NIfTI volume) of a dataset, written to ``out`` with a table and a
    gallery.

    A run explains images or volumes (``.nii``, ``.nii.gz``), not both. A volume is read as ``incrinf explain
    VOLUME`` reads one (axes (x, y, z) -> (D, H, W), standardised), explained with ``spatial_dims=3``, and its
    outputs add the voxel heat map as NIfTI with the scan's affine; the gallery shows montages of slices.

    Re-running with the same arguments skips complete inputs (see :meth:`RunFolder.is_complete`) and redoes
    failed and partial ones; an unreadable input becomes an error row and the run goes on.

    Args:
        model: a zoo name (``"efficientnet_lite0"``, ``"resnet18"``, ...) or a module (pickled to workers).
        inputs: image or NIfTI files, directories (walked recursively) and glob patterns (``**`` recursive).
        out: the run's folder (created).
        weights: state-dict file for a zoo architecture.
        normalization: zoo name whose mean/std preprocess the images (default: ``model`` when it is a name,
            else ImageNet's).
        size: shorter side the images are resized to, then centre-cropped square (default: the model's).
        volume_index: volumes: which volume of a 4-D (x, y, z, t) file.
        resize: volumes: (D, H, W) every scan is resampled to (trilinear), e.g. to fit the model's downsampling.
        masks: images: a mask image for every input, or a folder of masks matched by relative path or stem; the
            share of positive heat inside each mask goes into the table.
        mask_threshold: inputs with more than this share of their positive heat outside their mask are listed.
        feature_mask: integer feature ids (anatomical labels, superpixels): one file applied to every input, or
            a folder of each input's own mask. A mask is a label volume (NIfTI or (D, H, W) ``.npy``) of its
            scan's shape before ``resize``, or a segment image (or (H, W) ``.npy``) of its image's size before
            resizing; each input's features are occluded instead of sliding windows, and an input of another
            shape is an error row (``error_kind`` "mask") with both shapes. In a folder, the mask of the input
            ``sub/scan01.nii.gz`` is ``sub/scan01`` or else ``scan01`` with a mask suffix (``.nii``, ``.nii.gz``,
            ``.npy``; images: an image suffix or ``.npy``); an input with none, or with two, is an error row
            "mask" saying so (see :mod:`incrinf.explain.dataset.mask_folders`). Read and validated as
            ``incrinf explain --feature-mask`` reads a mask; each input's mask content is part of its resume key.
        workers: local processes (1 = in-process); with ``ray``, the number of actors (default: one per
            ``cpus_per_worker`` CPUs of the cluster).
        ray: True or "local" starts Ray on this machine; an address ("auto", "HOST:PORT", "ray://HOST:PORT")
            connects to a cluster.
        cpus_per_worker: CPUs (and torch threads) per Ray actor.
        overwrite: recompute every input.
        labels: class names by index (default: ImageNet's for zoo image models, none otherwise).
        gallery: write ``index.html``.
        progress: progress bars (over inputs; in-process also per input).
        callback: called with each input's table row as soon as its outputs are written.
        **occlusion_options: passed to :func:`incrinf.occlusion` for every image (patch, stride, target,
            output, tau, drill_down, ...). ``target="all"`` keeps every class's map per input (``heatmap.npy``
            of shape (classes, ...)); the overlay, table row and statistics show the predicted class's.

    Returns:
        A :class:`DatasetReport` (its ``exit_code`` is what ``incrinf explain`` returns).

    Raises:
        FileNotFoundError / ValueError: missing inputs or masks, no inputs, images and volumes mixed, bad
            options (an image option for volumes or the reverse), a feature mask file missing, unreadable or not
            of integer ids, or a feature mask folder with no mask file at all.
        RuntimeError: the out folder is in use by another run, or workers cannot load the model.
        DatasetInterrupted: Ctrl-C; its ``report`` describes the folder as left (every finished input kept).
    """
    selection = discover_inputs([inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs))
    volumes = selection.kind == KIND_VOLUMES
    if volumes:
        if masks is not None:
            raise ValueError("masks= (the shortcut check) compares heat with image masks; a volume run has none "
                             "(give feature_mask= a label volume to score anatomical labels)")
        spec = _volume_spec(model, weights, normalization, size, volume_index, resize, occlusion_options)
    else:
        if volume_index != 0 or resize is not None:
            raise ValueError("volume_index= and resize= are for NIfTI volumes; these inputs are images (use size=)")
        spec = _spec(model, weights, normalization, size, occlusion_options)
    mask_folder = None
    if feature_mask is not None and Path(feature_mask).is_dir():
        mask_folder = MaskFolder(feature_mask, volumes)
    elif feature_mask is not None:
        spec = _with_feature_mask(spec, feature_mask)
    if not 0.0 <= mask_threshold <= 1.0:
        raise ValueError(f"mask_threshold must be in [0, 1], got {mask_threshold}")
    mask_check = _MaskCheck(find_masks(selection.items, masks), spec.preprocessing, mask_threshold)
    if labels is None and isinstance(model, str) and not volumes:
        labels = imagenet_labels()
    items = selection.items
    settings = _Settings(spec.settings_digest(), None if mask_folder is None else mask_folder.matches(items))
    with RunFolder(out) as folder:
        records: dict[str, dict[str, Any]] = {}
        todo = []
        for index, item in enumerate(items):
            record = folder.read_record(item.id)
            if not overwrite and folder.is_complete(record, settings.of(item), _signature(item)):
                records[item.id] = record
            else:
                todo.append(index)
        skipped = len(records)
        executor_info = {"executor": "in-process", "workers": 1}
        interrupted = False
        launch = start = time.perf_counter()
        try:
            executor = _executor(spec, workers, ray, cpus_per_worker, progress)
            with executor:
                executor_info["executor"], executor_info["workers"] = executor.name, executor.workers
                start = time.perf_counter()
                try:
                    _drive(executor, folder, items, todo, settings, spec, mask_check, labels, records, progress,
                           callback)
                finally:
                    executor_info.update(workers_lost=executor.workers_lost, retried=executor.retried)
        except KeyboardInterrupt:
            interrupted = True
        seconds = time.perf_counter() - start
        report = _finish(folder, selection, records, mask_check, labels, gallery,
                         DatasetReport(folder.root, [], len(records) - skipped, skipped, seconds,
                                       mask_threshold=mask_threshold, interrupted=interrupted,
                                       startup_seconds=start - launch, **executor_info))
    if interrupted:
        raise DatasetInterrupted(report)
    return report


def _spec(model: nn.Module | str, weights: str | None, normalization: str | None, size: int | None,
          options: dict[str, Any]) -> ExplainSpec:
    from incrinf import models

    source = _source(model, weights)
    if isinstance(model, str) and models.is_volume_model(model):
        raise ValueError(f"{model} explains 3-D volumes, and these inputs are images: give NIfTI files "
                         "(.nii, .nii.gz) or an image model")
    normalization = normalization or (model if isinstance(model, str) else "imagenet")
    size = size if size is not None else models.info(normalization).input_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    _check_options(options)
    return ExplainSpec(source, Preprocessing(normalization, size), dict(options))


def _volume_spec(model: nn.Module | str, weights: str | None, normalization: str | None, size: int | None,
                 volume_index: int, resize: tuple[int, int, int] | None, options: dict[str, Any]) -> ExplainSpec:
    from incrinf import models

    source = _source(model, weights)
    if isinstance(model, str) and not models.is_volume_model(model):
        raise ValueError(f"{model} explains RGB images, and these inputs are NIfTI volumes: give a 3-D model "
                         f"({', '.join(models.VOLUME_MODELS)}) or a module")
    if normalization is not None or size is not None:
        raise ValueError("normalization= and size= are for images; volumes are standardised per scan (use "
                         "resize=(D, H, W) to resample them)")
    if isinstance(volume_index, bool) or not isinstance(volume_index, int) or volume_index < 0:
        raise ValueError(f"volume_index must be an int >= 0, got {volume_index!r}")
    if resize is not None:
        if len(tuple(resize)) != 3 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in resize):
            raise ValueError(f"resize must be three positive ints (D, H, W), got {resize!r}")
        resize = tuple(resize)
    if options.get("spatial_dims", 3) != 3:
        raise ValueError(f"volumes have 3 spatial axes, got spatial_dims={options['spatial_dims']!r}")
    _check_options(options)
    return ExplainSpec(source, VolumePreprocessing(volume_index, resize), dict(options))


class _Settings:
    """Each input's resume key: the run's settings digest, joined with the content of the input's own feature
    mask when the run has a folder of them.

    Args:
        run: the run's :meth:`ExplainSpec.settings_digest`.
        masks: input id -> its :class:`MaskMatch` (a folder of feature masks), else None.
    """

    def __init__(self, run: str, masks: dict[str, MaskMatch] | None) -> None:
        self.run = run
        self.masks = masks
        self._keys: dict[str, str] = {}

    def of(self, item: InputItem) -> str:
        if self.masks is None:
            return self.run
        if item.id not in self._keys:  # read once per run: the key a record is written with is the one checked
            try:
                self._keys[item.id] = settings_with_mask(self.run, self.masks[item.id])
            except OSError as exc:  # the mask went away or is unreadable: the task reports it
                self._keys[item.id] = settings_with_mask(self.run, MaskMatch(error=str(exc)))
        return self._keys[item.id]

    def task(self, index: int, item: InputItem, data: bytes | None, read_error: str | None,
             spec: ExplainSpec) -> Task:
        """The task of one input, with its own feature mask read (or why it has none)."""
        if self.masks is None or data is None:
            return Task(index, item.id, item.rel, data, read_error)
        match = self.masks[item.id]
        volume_index = spec.preprocessing.volume_index if spec.volumes else 0
        try:
            labels = read_mask(match, spec.volumes, volume_index)
        except (OSError, ValueError) as exc:
            return Task(index, item.id, item.rel, data, mask_error=str(exc))
        return Task(index, item.id, item.rel, data, feature_mask=labels, feature_mask_name=str(match.path))


def _with_feature_mask(spec: ExplainSpec, path: str | os.PathLike) -> ExplainSpec:
    """``spec`` with the feature ids read from ``path`` once for the whole run (each worker fits them to its
    input's grid), by the readers ``incrinf explain --feature-mask`` uses."""
    from dataclasses import replace

    name = os.fspath(path)
    labels = read_feature_ids(name, spec.volumes, spec.preprocessing.volume_index if spec.volumes else 0)
    return replace(spec, feature_mask=labels, feature_mask_name=name)


def _source(model: nn.Module | str, weights: str | None) -> ModelSource:
    from incrinf import models

    if isinstance(model, str):
        if model not in models.available():
            raise ValueError(f"unknown model {model!r}; try one of: {', '.join((*models.ZOO, *models.VOLUME_MODELS))}")
        return ModelSource(name=model, weights=weights)
    if isinstance(model, nn.Module):
        if weights is not None:
            raise ValueError("weights= goes with a zoo model name; load them into the module yourself")
        return ModelSource(module=model)
    raise TypeError(f"model must be a zoo name or an nn.Module, got {type(model).__name__}")


def _check_options(options: dict[str, Any]) -> None:
    """Refuse, before any work, options a dataset run cannot honour per input."""
    if "progress" in options:
        raise TypeError("pass progress= to explain_dataset itself (it controls both progress bars)")
    _check_option_names(options)


def _check_option_names(options: dict[str, Any]) -> None:
    """Refuse a misspelt option now, rather than as the same error row for every input."""
    import inspect

    import incrinf

    try:
        inspect.signature(incrinf.occlusion).bind_partial(None, None, **options)
    except TypeError as exc:
        raise TypeError(f"not an option of incrinf.occlusion: {exc}") from None


def _executor(spec: ExplainSpec, workers: int | None, ray: bool | str | None, cpus_per_worker: int,
              progress: bool) -> Executor:
    if ray:
        address = None if ray is True else str(ray)
        return RayExecutor(spec, address, actors=workers if workers and workers > 1 else None,
                           cpus_per_actor=cpus_per_worker)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    if workers == 1:
        return InProcessExecutor(spec, progress=progress)
    return ProcessExecutor(spec, workers)


def _signature(item: InputItem) -> dict[str, int] | None:
    try:
        return source_signature(item.path)
    except OSError:
        return None


def _drive(executor: Executor, folder: RunFolder, items: Sequence[InputItem], todo: list[int], settings: _Settings,
           spec: ExplainSpec, mask_check: _MaskCheck, labels: Sequence[str] | None,
           records: dict[str, dict[str, Any]], progress: bool, callback: Callable | None) -> None:
    """Stream the inputs to do through ``executor``, writing each outcome as it arrives."""
    from incrinf.progress import progress_bar

    signatures: dict[int, dict[str, int] | None] = {}

    def tasks():
        for index in todo:
            item = items[index]
            signatures[index] = _signature(item)  # taken before reading: a file changed later is redone
            try:
                data, error = item.path.read_bytes(), None
            except OSError as exc:
                data, error = None, f"cannot read {item.path}: {exc.strerror or exc}"
            yield settings.task(index, item, data, error, spec)

    bar = progress_bar(total=len(items), initial=len(items) - len(todo), desc="inputs", unit="input", position=0,
                       disable=not progress, dynamic_ncols=True)
    done: set[int] = set()
    failed = 0
    name = spec.model.name or type(spec.model.module).__name__
    try:
        for outcome in executor.run(tasks()):
            if outcome.index in done:  # never written twice, whatever an executor does
                continue
            item = items[outcome.index]
            title = f"{name}: class {outcome.target}" + (f" ({labels[outcome.target]})" if labels and
                                                          outcome.target is not None else "")
            source = signatures.pop(outcome.index, None) or {}
            record = folder.write_outputs(item, outcome, settings.of(item), source, title, mask_check)
            done.add(outcome.index)
            records[item.id] = record
            failed += record["status"] == STATUS_ERROR
            bar.set_postfix(failed=failed, refresh=False)
            bar.update(1)
            if callback is not None:
                callback(table_row(record, labels))
    finally:
        bar.close()


class _MaskCheck:
    """The shortcut check: share of each input's positive heat inside its mask."""

    def __init__(self, files: dict[str, Path], preprocessing: Preprocessing, threshold: float) -> None:
        self.files = files
        self.preprocessing = preprocessing
        self.threshold = threshold
        self._masks: dict[Path, np.ndarray] = {}

    def key(self, item_id: str) -> dict[str, Any] | None:
        """What a record's mask entry must have been computed from to be current."""
        path = self.files.get(item_id)
        if path is None:
            return None
        return {"file": str(path), "source": source_signature(path), "threshold": self.threshold,
                "size": self.preprocessing.size}

    def __call__(self, item: InputItem, pixel: np.ndarray) -> dict[str, Any] | None:
        key = self.key(item.id)
        if key is None:
            return None
        path = self.files[item.id]
        if path not in self._masks:
            try:
                self._masks[path] = load_mask(path, self.preprocessing.normalization, self.preprocessing.size)
            except (OSError, ValueError) as exc:  # a bad mask spoils its row's check, not the run
                return dict(key, inside_share=None, outside=None, error=str(exc))
        mask = self._masks[path]
        if mask.shape != pixel.shape:
            return dict(key, inside_share=None, outside=None, error=f"mask {mask.shape} != image {pixel.shape}")
        share = inside_share(pixel, mask)
        return dict(key, inside_share=share, outside=None if share is None else (1.0 - share) > self.threshold)


def _finish(folder: RunFolder, selection: Selection, records: dict[str, dict[str, Any]], mask_check: _MaskCheck,
            labels: Sequence[str] | None, gallery: bool, report: DatasetReport) -> DatasetReport:
    """Bring masks up to date, derive the table, statistics, summary and gallery from the records."""

    def maps():
        """Each complete input's (target, pixel map, affine), one at a time (a run of large volumes does not fit in
        memory at once), bringing its mask entry up to date on the way."""
        for item in selection.items:
            record = records.get(item.id)
            if record is None or record["status"] != STATUS_OK:
                continue
            pixel = folder.load_pixel_map(record)
            affine = record.get("affine")
            yield record["target"], pixel, None if affine is None else np.asarray(affine)
            current = mask_check.key(item.id)
            entry = record.get("mask")
            stale = {k: v for k, v in (entry or {}).items() if k in ("file", "source", "threshold", "size")}
            if current != (stale or None):  # masks added, changed or dropped since the record was written
                record["mask"] = mask_check(item, pixel)
                folder.write_record(record)

    report.class_means = class_means(maps(), folder.root, atomic_write_png, atomic_write_nifti)
    report.rows = [table_row(records[item.id], labels) if item.id in records else
                   table_row(base_record(item, "", {}), labels) for item in selection.items]
    report.kind = selection.kind
    report.mask_outside = [row for row in report.rows if row.get("mask_outside")]
    report.skipped_non_images = [str(p) for p in selection.skipped_non_images]
    folder.write_table(report.rows)
    _write_summary(folder, report)
    if gallery:
        from incrinf.explain.dataset.gallery import write_gallery

        write_gallery(folder.root, report, labels)
    return report


def _write_summary(folder: RunFolder, report: DatasetReport) -> None:
    summary = {
        "inputs": len(report.rows), "kind": report.kind, "ok": report.count(STATUS_OK),
        "failed": report.count(STATUS_ERROR),
        "pending": report.count(STATUS_PENDING), "computed_this_run": report.computed,
        "skipped_complete": report.skipped, "seconds": report.seconds, "inputs_per_minute": report.inputs_per_minute,
        "startup_seconds": report.startup_seconds, "executor": report.executor, "workers": report.workers,
        "workers_lost": report.workers_lost, "retried": report.retried, "interrupted": report.interrupted,
        "class_means": [vars(m) for m in report.class_means],
        "mask_threshold": report.mask_threshold,
        "mask_outside": [{"path": r["path"], "inside_share": r["mask_inside_share"]} for r in report.mask_outside],
        "skipped_non_images": report.skipped_non_images,
    }
    atomic_write_bytes(folder.root / "summary.json", json.dumps(summary, indent=1).encode())


def imagenet_labels() -> list[str]:
    """The 1000 ImageNet class names in index order (from torchvision's metadata; nothing is downloaded)."""
    from torchvision.models import ResNet18_Weights

    return list(ResNet18_Weights.IMAGENET1K_V1.meta["categories"])
