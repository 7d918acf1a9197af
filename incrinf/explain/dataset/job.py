"""The per-input job of a dataset run, as a worker runs it: decode, preprocess, explain, summarise.

Everything here is picklable and free of file-system writes, so the same job runs in-process, in a local
worker process or in a Ray actor on another machine: the driver reads each input's bytes and sends them (the
workers need no shared storage) and writes every output itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from incrinf.explain.dataset.volumes import VolumePreprocessing

# How a task failed; the driver branches on these, never on messages.
ERROR_READ = "read"  # the driver could not read the file
ERROR_DECODE = "decode"  # not an image, corrupt or truncated
ERROR_EXPLAIN = "explain"  # the model or the occlusion options rejected it
ERROR_MASK = "mask"  # the feature mask does not fit this input (another shape), or it has none: skipped, not guessed
ERROR_WORKER_LOST = "worker-lost"  # the worker died while it held the input, too many times

# Options that change how fast a heat map is computed but not what it is: left out of the settings digest, so
# a re-run with another batch size still counts earlier outputs as complete.
_HOW_NOT_WHAT = ("progress", "batch_size", "max_memory", "device")


@dataclass(frozen=True)
class ModelSource:
    """How a worker gets its model: a zoo name (with an optional weights file) or a picklable module.

    Attributes:
        name: zoo name for :func:`incrinf.models.load`, or None with ``module``.
        weights: optional state-dict file for a zoo architecture.
        module: the model itself (pickled to each worker).
    """

    name: str | None = None
    weights: str | None = None
    module: nn.Module | None = None

    def load(self) -> nn.Module:
        if self.module is not None:
            return self.module.eval()
        from incrinf import models

        return models.load(self.name, self.weights)

    def digest(self) -> str:
        """Identity of the model for resume: architecture and weights, not object identity."""
        h = hashlib.sha256()
        if self.module is not None:
            h.update(type(self.module).__qualname__.encode())
            for key, tensor in self.module.state_dict().items():
                h.update(key.encode())
                h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        else:
            h.update(str(self.name).encode())
            if self.weights is not None:
                h.update(Path(self.weights).read_bytes())
        return h.hexdigest()[:16]


@dataclass(frozen=True)
class Preprocessing:
    """How a decoded image becomes the model's input (:func:`incrinf.models.preprocess`).

    Attributes:
        normalization: zoo name whose mean and std to use (any torchvision name means ImageNet's).
        size: shorter side after resizing; the centre crop is ``size`` x ``size``.
    """

    normalization: str
    size: int

    def key(self) -> list:
        """What the settings digest records of it."""
        return [self.normalization, self.size]

    def apply(self, rgb: np.ndarray) -> torch.Tensor:
        from incrinf import models

        return models.preprocess(rgb, self.normalization, size=self.size)

    def display(self, x: torch.Tensor) -> np.ndarray:
        """(size, size, 3) uint8 picture of the model's input: what the heat map is aligned with."""
        from incrinf import models

        return np.round(models.unnormalize(x, self.normalization) * 255).astype(np.uint8)


@dataclass(frozen=True)
class ExplainSpec:
    """Everything a worker needs besides the inputs: the model, preprocessing and occlusion options.

    Attributes:
        feature_mask: the run's feature ids on an input's own grid ((H, W) of an image before resizing and
            cropping, (D, H, W) of a volume before ``resize``), fitted to each input in its worker; None slides
            windows. ``feature_mask_name``: its file, for messages.
    """

    model: ModelSource
    preprocessing: Preprocessing | VolumePreprocessing
    options: dict[str, Any] = field(default_factory=dict)
    feature_mask: np.ndarray | None = None
    feature_mask_name: str = ""

    @property
    def volumes(self) -> bool:
        """Whether the inputs are NIfTI volumes (else RGB images)."""
        return isinstance(self.preprocessing, VolumePreprocessing)

    def settings_digest(self) -> str:
        """Digest of what determines the outputs (model, preprocessing, occlusion options); see
        ``_HOW_NOT_WHAT`` for the options left out."""
        options = {k: _canonical(v) for k, v in sorted(self.options.items()) if k not in _HOW_NOT_WHAT}
        if self.feature_mask is not None:  # its content, not its file name: an edited mask is another result
            options["feature_mask"] = _canonical(self.feature_mask)
        text = json.dumps({"model": self.model.digest(), "pre": self.preprocessing.key(), "options": options},
                          sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _canonical(value: Any) -> Any:
    """A JSON-able stand-in for an option value that is equal exactly when the values are."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return ["array", list(value.shape), str(value.dtype), hashlib.sha256(value.tobytes()).hexdigest()]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return repr(value)


@dataclass(frozen=True)
class Task:
    """One input sent to a worker.

    Attributes:
        index: position in the run's selection.
        id: the input's output id.
        name: the input's relative name (for messages).
        data: the file's bytes, or None when the driver could not read it.
        read_error: why ``data`` is None.
        feature_mask: runs with a folder of feature masks: this input's own ids on its own grid ((H, W) or
            (D, H, W)), read by the driver; ``feature_mask_name`` its file. ``mask_error``: why it has none (no
            file matched, two did, or it is unreadable); the input is then an error row of kind "mask".
    """

    index: int
    id: str
    name: str
    data: bytes | None
    read_error: str | None = None
    feature_mask: np.ndarray | None = None
    feature_mask_name: str = ""
    mask_error: str | None = None


@dataclass
class Outcome:
    """What a worker returns for one task.

    Attributes:
        index, id: the task's.
        error_kind: None on success, else one of the ``ERROR_*`` constants; ``error`` is its message.
        heatmap: (rows, cols) float32 drops, ``positions`` (rows*cols, 2) window corners, ``fine`` (rows, cols)
            bool, ``target``, ``patch``, ``stride``, ``image_shape`` and ``stats`` as in
            :class:`incrinf.OcclusionResult`.
        score: the model's ``output`` ("logit" or "prob") for ``target`` on the unoccluded input;
            ``probability`` its softmax probability; ``predicted`` the top-1 class.
        display: (H, W, 3) uint8 picture of the model's input (the crop the heat map is aligned with); for a
            volume the (D, H, W) float32 standardised scan the model saw.
        affine: volumes only: (4, 4) voxel -> world affine of ``display``'s grid (the scan's, resampled).
        features: feature-mask runs: (F,) the mask's feature ids, in ``heatmap``'s order (``heatmap`` is (F,) or,
            with ``target="all"``, (K, F)).
        pixel: feature-mask and every-class runs: (*image_shape) attribution per element of ``target``'s map (the
            map the single-input command draws); None for a plain grid, whose pixel map follows from the heat map.
        seconds: wall time of the job in the worker. ``worker``: ``pid@host``.
    """

    index: int
    id: str
    error_kind: str | None = None
    error: str | None = None
    heatmap: np.ndarray | None = None
    positions: np.ndarray | None = None
    fine: np.ndarray | None = None
    target: int | None = None
    patch: tuple[int, int] | None = None
    stride: tuple[int, int] | None = None
    image_shape: tuple[int, int] | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    score: float | None = None
    probability: float | None = None
    predicted: int | None = None
    display: np.ndarray | None = None
    affine: np.ndarray | None = None
    features: np.ndarray | None = None
    pixel: np.ndarray | None = None
    seconds: float = 0.0
    worker: str = ""


def worker_name() -> str:
    return f"{os.getpid()}@{socket.gethostname()}"


class Explainer:
    """Runs tasks with one loaded model: built once per worker (in-process, process or Ray actor)."""

    def __init__(self, spec: ExplainSpec, progress: bool = False) -> None:
        self.spec = spec
        self.model = spec.model.load()
        self.progress = progress

    def __call__(self, task: Task) -> Outcome:
        start = time.perf_counter()
        outcome = self._run(task)
        outcome.seconds = time.perf_counter() - start
        outcome.worker = worker_name()
        return outcome

    def _run(self, task: Task) -> Outcome:
        from incrinf.explain.dataset.inputs import decode_rgb

        if task.data is None:
            return Outcome(task.index, task.id, ERROR_READ, task.read_error)
        preprocessing = self.spec.preprocessing
        labels, mask_name = self.spec.feature_mask, self.spec.feature_mask_name
        if task.feature_mask is not None:  # the input's own mask (a folder of masks)
            labels, mask_name = task.feature_mask, task.feature_mask_name
        mask = None
        try:
            if isinstance(preprocessing, VolumePreprocessing):
                scan = preprocessing.decode(task.data, task.name)
                shape = scan.voxels.shape
                scan = preprocessing.resample(scan)
                x, display, affine = torch.from_numpy(scan.voxels)[None], scan.voxels, scan.affine
            else:
                rgb = decode_rgb(task.data, task.name)
                shape = rgb.shape[:2]
                x = preprocessing.apply(rgb)
                display, affine = preprocessing.display(x), None
        except ValueError as exc:
            return Outcome(task.index, task.id, ERROR_DECODE, str(exc))
        if task.mask_error is not None:  # after decoding: a corrupt input says so, whether or not it has a mask
            return Outcome(task.index, task.id, ERROR_MASK, task.mask_error)
        if labels is not None:
            try:
                mask = _fit_mask(labels, shape, tuple(x.shape[1:]), mask_name)
            except ValueError as exc:  # another shape than the mask's: skipped with why, never resampled blindly
                return Outcome(task.index, task.id, ERROR_MASK, str(exc))
        try:
            return self._explain(task, x, display, affine, mask)
        except Exception as exc:  # one bad input must not end the run: its error goes in the table
            where = traceback.extract_tb(exc.__traceback__)[-1]
            return Outcome(task.index, task.id, ERROR_EXPLAIN,
                           f"{type(exc).__name__}: {exc} ({Path(where.filename).name}:{where.lineno})")

    def _explain(self, task: Task, x: torch.Tensor, display: np.ndarray, affine: np.ndarray | None,
                 mask: torch.Tensor | None = None) -> Outcome:
        """Explain the model's input ``x`` ((C, H, W) image or (1, D, H, W) volume), by sliding windows or, with
        ``mask`` ((H, W) or (D, H, W) ids on ``x``'s grid), by occluding its features."""
        import incrinf  # the public entry point, looked up per call so options that land later flow through

        options = dict(self.spec.options)
        options.setdefault("progress", self.progress)
        if self.spec.volumes:
            options.setdefault("spatial_dims", 3)
        if mask is not None:
            options["feature_mask"] = mask
        result = incrinf.occlusion(self.model, x, **options)
        with torch.no_grad():
            logits = self.model(x[None].to(options.get("device") or x.device)).reshape(1, -1).float().cpu()
        probs = torch.softmax(logits, dim=1)[0]
        output = options.get("output", "logit")
        # an every-class run is summarised (score, overlay, table) by the predicted class's map, as the
        # single-input command draws it; its heat map keeps every class's
        target = int(probs.argmax()) if result.every_class else int(result.target)
        score = probs[target] if output == "prob" else logits[0, target]
        plain = result.features is None and not result.every_class
        pixel = None if plain else np.asarray(result.pixel_map(), np.float32)
        if pixel is not None and result.every_class:
            pixel = pixel[target]
        return Outcome(
            task.index, task.id, heatmap=np.asarray(result.heatmap, np.float32),
            positions=np.asarray(result.positions, np.int64),
            fine=None if result.fine is None else np.asarray(result.fine, bool), target=target,
            patch=tuple(int(v) for v in result.patch), stride=tuple(int(v) for v in result.stride),
            image_shape=tuple(int(v) for v in result.image_shape), stats=_plain(result.stats.as_dict()),
            score=float(score), probability=float(probs[target]), predicted=int(probs.argmax()),
            display=display, affine=affine,
            features=None if result.features is None else np.asarray(result.features, np.int64), pixel=pixel)


def _fit_mask(labels: np.ndarray, shape: tuple[int, ...], model_shape: tuple[int, ...], name: str) -> torch.Tensor:
    """The run's feature ids on one input's model grid, resampled as the input was (nearest labels).

    Args:
        labels: (H, W) or (D, H, W) ids on an input's own grid.
        shape: this input's own (H, W) or (D, H, W). model_shape: the model's input grid ``x.shape[1:]``.
        name: the mask's file, for messages.

    Raises:
        ValueError: ``labels`` is not of this input's shape (the same messages as ``incrinf explain``'s).
    """
    from incrinf.explain.feature_masks import check_volume_mask, fit_image_mask, resize_labels

    tensor = torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64))
    if labels.ndim == 3:
        check_volume_mask(tensor, shape, name)
        return resize_labels(tensor, model_shape)
    try:
        return fit_image_mask(labels, shape, model_shape[-1])
    except ValueError as exc:
        raise ValueError(f"feature mask {name}: {exc}") from None


def _plain(stats: dict[str, Any]) -> dict[str, Any]:
    """Stats as JSON-able plain values (tuples to lists, numpy scalars to Python)."""
    out = {}
    for key, value in stats.items():
        if isinstance(value, np.generic):
            value = value.item()
        elif isinstance(value, tuple):
            value = [v.item() if isinstance(v, np.generic) else v for v in value]
        out[key] = value
    return out
