"""Which files a dataset run explains: files, directories (recursively) and glob patterns, each with a stable id.

An input's *relative name* is its path below the directory (or the glob's fixed prefix) it was found under, or
its bare file name when it was named directly; masks are matched by it. Its *id* names its outputs: the
relative name made filename-safe plus a short hash of the absolute path, so that two inputs with the same
relative name under different roots never share outputs and a re-run finds the same ids again.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from incrinf.explain.dataset.volumes import VOLUME_SUFFIXES, is_volume_name

# Suffixes a directory walk takes (case-insensitive). Files named directly or matched by a glob are taken
# whatever their suffix: the user asked for them, so one that is not an image becomes an error row.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp", ".gif", ".ppm", ".pgm")
# The formats decode_rgb reads (Pillow's common ones), named in its error for a file that is none of them.
READABLE = "PNG, JPEG, BMP, GIF, TIFF, WebP, PPM/PGM"
_GLOB_MAGIC = re.compile(r"[*?[]")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_ID_STEM_CHARS = 80  # keeps ids (and so file names) well under the usual 255-byte limit


@dataclass(frozen=True)
class InputItem:
    """One input file of a dataset run.

    Attributes:
        path: absolute path of the file.
        rel: relative name (posix separators) below the root it was found under.
        id: filename-safe, unique, stable name of its outputs.
    """

    path: Path
    rel: str
    id: str


# What a run's inputs are: every input of a run is of one kind (a model explains either RGB images or volumes).
KIND_IMAGES, KIND_VOLUMES = "images", "volumes"


@dataclass(frozen=True)
class Selection:
    """The inputs of a run, in a stable order, and what a directory walk passed over.

    Attributes:
        kind: :data:`KIND_VOLUMES` when the inputs are NIfTI files (``.nii``, ``.nii.gz``), else
            :data:`KIND_IMAGES`.
    """

    items: tuple[InputItem, ...]
    skipped_non_images: tuple[Path, ...]
    kind: str = KIND_IMAGES


def is_pattern(spec: str) -> bool:
    """Whether ``spec`` is a glob pattern (has ``*``, ``?`` or ``[``) rather than a path."""
    return bool(_GLOB_MAGIC.search(spec))


def discover_inputs(specs: Sequence[str | os.PathLike]) -> Selection:
    """Expand files, directories (recursively) and glob patterns into the inputs of a dataset run.

    Directories contribute the files with an image suffix (:data:`IMAGE_SUFFIXES`) or a NIfTI one (``.nii``,
    ``.nii.gz``), hidden files and folders excluded; the others are listed in ``skipped_non_images``. A run
    explains images or volumes, never both: a selection with both is a ``ValueError`` naming one of each.
    Patterns follow :func:`glob.glob` with ``recursive=True`` (``**`` crosses folders); a directory they match
    is walked. A file reached twice is explained once. Order: the order of ``specs``, sorted by relative name
    within each.

    Raises:
        FileNotFoundError: a path that does not exist, or a pattern that matches nothing.
        ValueError: no specs, no input file at all, or images and volumes mixed.
    """
    if isinstance(specs, (str, os.PathLike)):
        specs = [specs]
    if not specs:
        raise ValueError("no inputs given: name image files, directories or glob patterns")
    items: list[InputItem] = []
    skipped: list[Path] = []
    seen: set[Path] = set()
    for spec in specs:
        found, passed_over = _expand(os.fspath(spec))
        skipped.extend(passed_over)
        for path, rel in found:
            if path not in seen:
                seen.add(path)
                items.append(InputItem(path, rel, item_id(path, rel)))
    if not items:
        listed = ", ".join(os.fspath(s) for s in specs)
        raise ValueError(f"no image or volume files in {listed} (a directory contributes files ending in "
                         f"{', '.join(IMAGE_SUFFIXES + VOLUME_SUFFIXES)})")
    return Selection(tuple(items), tuple(skipped), _kind(items))


def _kind(items: Sequence[InputItem]) -> str:
    """The selection's kind; a ValueError when it mixes images and volumes (one model cannot explain both)."""
    volumes = [item for item in items if is_volume_name(item.path.name)]
    if not volumes:
        return KIND_IMAGES
    if len(volumes) < len(items):
        image = next(item for item in items if not is_volume_name(item.path.name))
        raise ValueError(f"the inputs mix {len(volumes)} NIfTI volume(s) (e.g. {volumes[0].rel}) with "
                         f"{len(items) - len(volumes)} other file(s) (e.g. {image.rel}): a dataset run explains "
                         "images or volumes with one model, so run each kind into its own --out folder")
    return KIND_VOLUMES


def _expand(spec: str) -> tuple[list[tuple[Path, str]], list[Path]]:
    if is_pattern(spec):
        matches = sorted(glob.glob(spec, recursive=True))
        if not matches:
            raise FileNotFoundError(f"no file matches the pattern {spec!r}")
        root = _fixed_prefix(spec)
        found: list[tuple[Path, str]] = []
        skipped: list[Path] = []
        for match in matches:
            path = Path(match)
            if path.is_dir():
                walked, passed_over = _walk(path)
                found.extend(walked)
                skipped.extend(passed_over)
            elif path.is_file():
                found.append((path.resolve(), _relative(path, root)))
        return found, skipped
    path = Path(spec)
    if path.is_dir():
        return _walk(path)
    if path.is_file():
        return [(path.resolve(), path.name)], []
    raise FileNotFoundError(f"input not found: {spec}")


def _walk(root: Path) -> tuple[list[tuple[Path, str]], list[Path]]:
    found: list[tuple[Path, str]] = []
    skipped: list[Path] = []
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith("."):
                continue
            path = Path(folder) / name
            if path.suffix.lower() in IMAGE_SUFFIXES or is_volume_name(name):
                found.append((path.resolve(), _relative(path, root)))
            else:
                skipped.append(path)
    found.sort(key=lambda pair: pair[1])
    return found, skipped


def _fixed_prefix(pattern: str) -> Path:
    """The folder part of a glob pattern before its first wildcard (``data/*/x*.png`` -> ``data``)."""
    parts = Path(pattern).parts
    fixed = []
    for part in parts[:-1]:
        if is_pattern(part):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path(".")


def _relative(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:  # a symlink leading out of the root
        return path.name


def item_id(path: Path, rel: str) -> str:
    """Stable output name of an input: its relative name made safe, plus 8 hex digits of its absolute path."""
    stem = _UNSAFE.sub("_", rel.replace("/", "--")).strip("._") or "input"
    digest = hashlib.sha1(os.fsencode(path)).hexdigest()[:8]
    return f"{stem[:_ID_STEM_CHARS]}-{digest}"


# --- masks for the shortcut check ---------------------------------------------------------------------------


def find_masks(items: Iterable[InputItem], masks: str | os.PathLike | None) -> dict[str, Path]:
    """The mask file of each input id: one file for all, or per input in a folder by relative name.

    In a folder, the mask of ``cats/a.jpg`` is the first of ``cats/a.<suffix>`` and ``a.<suffix>`` that exists
    (any image suffix, so JPEG photos can have PNG masks). Inputs without a mask are left out.

    Raises:
        FileNotFoundError: ``masks`` names nothing.
    """
    if masks is None:
        return {}
    root = Path(masks)
    if root.is_file():
        return {item.id: root.resolve() for item in items}
    if not root.is_dir():
        raise FileNotFoundError(f"masks not found: {root}")
    by_stem: dict[str, Path] = {}
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = Path(folder) / name
            if path.suffix.lower() in IMAGE_SUFFIXES:
                by_stem.setdefault(path.relative_to(root).with_suffix("").as_posix(), path.resolve())
    found = {}
    for item in items:
        rel_stem = Path(item.rel).with_suffix("").as_posix()
        mask = by_stem.get(rel_stem) or by_stem.get(Path(item.rel).stem)
        if mask is not None:
            found[item.id] = mask
    return found


def decode_rgb(data: bytes, name: str = "image") -> np.ndarray:
    """Decode image file bytes to HxWx3 uint8 RGB; ``incrinf explain`` reads its single image with it too.

    Grey is replicated, alpha dropped, palettes expanded, the first frame of an animated GIF or multi-page TIFF
    taken, and images of more than 8 bits scaled by their maximum to 0..255.

    Raises:
        ValueError: ``cannot read image <name>: <why>``: empty, not an image, damaged or cut short, a claimed size
            past Pillow's safety limit, or not a single 2-D picture.
    """
    import io

    from PIL import Image, UnidentifiedImageError

    def unreadable(why: str) -> ValueError:
        return ValueError(f"cannot read image {name}: {why}")

    if not data:
        raise unreadable("the file is empty")
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()  # decodes everything now: a truncated file fails here, not later
            if img.mode in ("P", "PA", "LA", "CMYK", "YCbCr", "LAB", "HSV", "1"):
                img = img.convert("RGBA" if "A" in img.mode or img.mode == "P" else "RGB")
            array = np.array(img)  # a writable copy (torch warns on read-only arrays)
    except UnidentifiedImageError:
        raise unreadable(f"its contents are not an image in a format incrinf reads ({READABLE}); the file "
                         f"starts with {data[:12]!r}") from None
    except Image.DecompressionBombError as exc:  # not an OSError: a header claiming billions of pixels
        raise unreadable(f"its claimed size exceeds the limit Pillow decodes safely, so it is damaged or "
                         f"hostile ({exc})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:  # PIL reports corrupt data in several ways
        raise unreadable(f"the file is damaged or cut short ({exc})") from None
    if array.ndim == 2:
        array = np.stack([array] * 3, axis=-1)
    if array.ndim != 3 or array.shape[2] not in (3, 4) or min(array.shape[:2]) < 1:
        raise unreadable(f"not a 2-D colour or grey picture (decoded shape {array.shape})")
    array = array[..., :3]
    if array.dtype != np.uint8:  # 16-bit or float: scaled by the maximum (NaN, infinities and negatives as 0)
        values = np.nan_to_num(array.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0).clip(min=0.0)
        array = (255 * (values / max(float(values.max()), 1e-12))).round().astype(np.uint8)
    return np.ascontiguousarray(array)
