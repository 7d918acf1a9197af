"""A folder of feature masks for a dataset run: each input's own mask (an anatomical segmentation per scan,
superpixels per photo), found by name, read by the driver and sent with the input to its worker.

Matching: the mask of an input whose relative name is ``sub/scan01.nii.gz`` is the file in the mask folder with
the stem ``sub/scan01`` (the input's relative path without its suffix; ``.nii.gz`` counts as one suffix) and any
mask suffix: ``.nii``, ``.nii.gz`` or ``.npy`` for volumes, an image suffix or ``.npy`` for images; when there is
none, the file with the bare stem at the mask folder's top (``masks/scan01.npy``).
An input with no such file, or with two (``scan01.nii.gz`` and ``scan01.npy``), is an error row saying so;
nothing is guessed. Each input's resume key includes its mask file's content, so an edited mask is explained
again and an unchanged one is not.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from incrinf.explain.dataset.inputs import IMAGE_SUFFIXES, InputItem
from incrinf.explain.dataset.volumes import VOLUME_SUFFIXES

# Suffixes a mask file may have, by the kind of the run's inputs (case-insensitive).
VOLUME_MASK_SUFFIXES = (*VOLUME_SUFFIXES, ".npy")
IMAGE_MASK_SUFFIXES = (*IMAGE_SUFFIXES, ".npy")


def _split(name: str, suffixes: tuple[str, ...]) -> tuple[str, str] | None:
    """(stem, suffix) of a posix relative name whose suffix is one of ``suffixes`` (the longest that fits, so
    ``a.nii.gz`` is ``a`` + ``.nii.gz``), else None."""
    lower = name.lower()
    for suffix in sorted(suffixes, key=len, reverse=True):
        if lower.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)], suffix
    return None


def input_stem(rel: str) -> str:
    """An input's relative name without its suffix (``sub/scan01.nii.gz`` -> ``sub/scan01``)."""
    split = _split(rel, VOLUME_SUFFIXES)
    return split[0] if split else Path(rel).with_suffix("").as_posix()


@dataclass(frozen=True)
class MaskMatch:
    """One input's mask in the folder: ``path`` when exactly one file matches, else ``error`` says why not."""

    path: Path | None = None
    error: str | None = None

    def digest(self) -> str:
        """Identity of the mask's content (its file's bytes), or of the reason there is none, for resume keys."""
        if self.path is None:
            return f"none: {self.error}"
        return hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]


class MaskFolder:
    """The feature masks of a folder, matched to a run's inputs by name (see the module's docstring).

    Args:
        root: the mask folder.
        volumes: whether the run's inputs are volumes (which mask suffixes count).

    Raises:
        FileNotFoundError: ``root`` is not a folder. ValueError: it holds no mask file at all (a wrong folder,
            rather than inputs that each lack a mask).
    """

    def __init__(self, root: str | os.PathLike, volumes: bool) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"feature mask folder not found: {self.root}")
        self.suffixes = VOLUME_MASK_SUFFIXES if volumes else IMAGE_MASK_SUFFIXES
        self._by_stem: dict[str, list[Path]] = {}
        for folder, dirs, files in os.walk(self.root, followlinks=True):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                path = Path(folder) / name
                split = None if name.startswith(".") else _split(path.relative_to(self.root).as_posix(),
                                                                  self.suffixes)
                if split is not None:
                    self._by_stem.setdefault(split[0], []).append(path.resolve())
        if not self._by_stem:
            raise ValueError(f"feature mask folder {self.root} holds no mask file (names ending in "
                             f"{', '.join(self.suffixes)})")

    def match(self, item: InputItem) -> MaskMatch:
        """The mask of one input: by its relative stem, else by its bare stem at the folder's top."""
        stem = input_stem(item.rel)
        for key in dict.fromkeys((stem, Path(stem).name)):
            found = self._by_stem.get(key)
            if found and len(found) > 1:
                names = " and ".join(str(p.relative_to(self.root.resolve())) for p in found)
                return MaskMatch(error=f"two feature masks match {item.rel} in {self.root}: {names}; keep one")
            if found:
                return MaskMatch(found[0])
        wanted = " or ".join(dict.fromkeys((stem, Path(stem).name)))
        return MaskMatch(error=f"no feature mask for {item.rel} in {self.root} (looked for {wanted} with a suffix "
                               f"of {', '.join(self.suffixes)})")

    def matches(self, items: Iterable[InputItem]) -> dict[str, MaskMatch]:
        """Each input id's :class:`MaskMatch`."""
        return {item.id: self.match(item) for item in items}


def settings_with_mask(settings: str, match: MaskMatch) -> str:
    """An input's resume key: the run's settings digest joined with its own mask's content."""
    return hashlib.sha256(f"{settings}|feature-mask:{match.digest()}".encode()).hexdigest()[:16]


def read_feature_ids(path: str | os.PathLike, volumes: bool, volume_index: int = 0) -> np.ndarray:
    """The feature ids of a mask file on its input's own grid ((D, H, W) for volumes, (H, W) for images), read as
    ``incrinf explain --feature-mask`` reads one.

    Raises:
        FileNotFoundError: no such file. ValueError: unreadable, not integer ids, or not an (H, W) map / 3-D
            volume.
    """
    from incrinf.explain.feature_masks import read_image_mask, read_label_volume

    name = os.fspath(path)
    return read_label_volume(name, volume_index).numpy() if volumes else read_image_mask(name)


def read_mask(match: MaskMatch, volumes: bool, volume_index: int = 0) -> np.ndarray:
    """The ids of a matched mask (:func:`read_feature_ids`), in the smallest of int32 / int64 that holds them
    (they travel to workers with every input).

    Raises:
        FileNotFoundError: no mask matched (``match.error``) or the file is gone. ValueError: unreadable, not
            integer ids, or not an (H, W) map / 3-D volume.
    """
    if match.path is None:
        raise FileNotFoundError(match.error)
    labels = read_feature_ids(match.path, volumes, volume_index)
    small = np.iinfo(np.int32)
    if labels.size and small.min <= labels.min() and labels.max() <= small.max:
        labels = labels.astype(np.int32)
    return labels
