"""NIfTI volumes in a dataset run: decoding a scan from its bytes, its preprocessing, and what the run writes for it
(the voxel heat map as NIfTI with the scan's affine, montages of slices for the gallery).

A scan's file axes (x, y, z) become the model's (D, H, W) = (z, y, x), as ``incrinf explain VOLUME`` reads one
(:func:`incrinf.cli.volume.read_volume` calls :func:`decode_volume` too), so a dataset run's heat maps equal the
single-volume command's. Pictures are uint8 RGB arrays: a montage puts evenly spread axial slices side by side,
each drawn with the file's second axis pointing up, as the single-volume montage draws them.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from incrinf.extras import require

# Suffixes of the NIfTI files a directory walk takes (case-insensitive).
VOLUME_SUFFIXES = (".nii", ".nii.gz")
# Axial slices in a gallery montage (evenly spread along D).
MONTAGE_SLICES = 6
# Height (pixels) below which a montage's slices are enlarged by a whole factor.
_MIN_TILE = 96
_GZIP_MAGIC = b"\x1f\x8b"


def is_volume_name(name: str | Path) -> bool:
    """Whether a file name ends in a NIfTI suffix (``.nii`` or ``.nii.gz``, any case)."""
    return str(name).lower().endswith(VOLUME_SUFFIXES)


@dataclass(frozen=True)
class Scan:
    """A decoded NIfTI volume on the model's grid.

    Attributes:
        voxels: (D, H, W) float32, standardised (zero mean, unit variance), axes (z, y, x) of the file.
        affine: (4, 4) voxel (x, y, z) -> world (scanner mm) of ``voxels``' grid (after any resampling).
    """

    voxels: np.ndarray
    affine: np.ndarray


def decode_volume(data: bytes, name: str = "volume", index: int = 0) -> Scan:
    """A NIfTI-1/2 file's bytes (``.nii``, or gzipped ``.nii.gz``) as a standardised (D, H, W) scan.

    A 4-D file (x, y, z, t) gives its volume ``index``.

    Raises:
        ValueError: ``cannot read volume <name>: <why>``: empty, not NIfTI, damaged or cut short, not 3-D or 4-D,
            ``index`` out of range, or not finite. MissingExtraError: nibabel is not installed.
    """
    nibabel = require("nibabel", "nifti", "NIfTI volumes")

    def unreadable(why: str) -> ValueError:
        return ValueError(f"cannot read volume {name}: {why}")

    if not data:
        raise unreadable("the file is empty")
    try:
        raw = gzip.decompress(data) if data[:2] == _GZIP_MAGIC else data
        image = _nifti_from_bytes(nibabel, raw)
        array = np.asarray(image.dataobj, dtype=np.float32)
        affine = np.asarray(image.affine, dtype=np.float64)
    except Exception as exc:  # gzip, nibabel and numpy raise many types for a bad file: all mean "cannot read"
        raise unreadable(f"the file is damaged, cut short or not NIfTI ({type(exc).__name__}: {exc})") from None
    if array.ndim == 4:
        if not 0 <= index < array.shape[3]:
            raise unreadable(f"it holds {array.shape[3]} volumes; volume index {index} is out of range")
        array = array[..., index]
    elif array.ndim != 3:
        raise unreadable(f"not a 3-D volume (shape {array.shape})")
    if min(array.shape) < 1:
        raise unreadable(f"the volume is empty (shape {array.shape})")
    if not np.isfinite(array).all():
        raise unreadable("it contains NaN or infinite values")
    voxels = np.ascontiguousarray(array.transpose(2, 1, 0))
    spread = float(voxels.std())
    voxels = (voxels - float(voxels.mean())) / (spread if spread > 0 else 1.0)
    return Scan(voxels.astype(np.float32), affine)


def _nifti_from_bytes(nibabel, raw: bytes):
    """A NIfTI-1 or NIfTI-2 image from uncompressed bytes, told apart by the header's first field (its size: 348
    or 540 bytes, in either byte order); anything else is refused before nibabel logs its repair attempts."""
    import struct

    if len(raw) < 4:
        raise ValueError(f"only {len(raw)} bytes")
    sizes = {struct.unpack("<i", raw[:4])[0], struct.unpack(">i", raw[:4])[0]}
    if 348 in sizes:
        return nibabel.Nifti1Image.from_bytes(raw)
    if 540 in sizes:
        return nibabel.Nifti2Image.from_bytes(raw)
    raise ValueError(f"no NIfTI-1 or NIfTI-2 header (the file starts with {raw[:12]!r})")


def resampled(scan: Scan, size: tuple[int, int, int] | None) -> Scan:
    """``scan`` resampled (trilinear, as ``--resize`` does) to (D, H, W) ``size``, with the affine of the new grid.

    With ``align_corners=False`` a new voxel i covers old coordinate ``(i + 0.5) * s - 0.5`` (``s`` = old / new
    extent), so the new grid's affine is the old one composed with that scaling and shift, axis by axis.
    """
    import torch.nn.functional as F

    if size is None or tuple(size) == scan.voxels.shape:
        return scan
    x = torch.from_numpy(scan.voxels)[None, None]
    voxels = F.interpolate(x, size=tuple(size), mode="trilinear", align_corners=False)[0, 0].numpy()
    scale = np.array([old / new for old, new in zip(scan.voxels.shape, size)])[::-1]  # (z, y, x) -> (x, y, z)
    step = np.eye(4)
    step[:3, :3] = np.diag(scale)
    step[:3, 3] = (scale - 1.0) / 2.0
    return Scan(np.ascontiguousarray(voxels, dtype=np.float32), scan.affine @ step)


@dataclass(frozen=True)
class VolumePreprocessing:
    """How a scan's bytes become the model's (1, D, H, W) input.

    Attributes:
        volume_index: which volume of a 4-D (x, y, z, t) file.
        resize: (D, H, W) to resample to (trilinear), or None for the scan's own grid.
    """

    volume_index: int = 0
    resize: tuple[int, int, int] | None = None

    def key(self) -> list:
        """What the settings digest records of it."""
        return ["volume", self.volume_index, list(self.resize) if self.resize else None]

    def decode(self, data: bytes, name: str) -> Scan:
        """The scan on its own grid (what a feature mask's shape is checked against)."""
        return decode_volume(data, name, self.volume_index)

    def resample(self, scan: Scan) -> Scan:
        """``scan`` on the model's grid (``resize``, if any)."""
        return resampled(scan, self.resize)

    def apply(self, data: bytes, name: str) -> Scan:
        return self.resample(self.decode(data, name))


# --- outputs ----------------------------------------------------------------------------------------------------


def write_nifti(path: Path, values: np.ndarray, affine: np.ndarray) -> None:
    """Write (D, H, W) ``values`` as a float32 NIfTI file in the scan's (x, y, z) order with ``affine`` (the
    suffix, ``.nii`` or ``.nii.gz``, chooses compression)."""
    nibabel = require("nibabel", "nifti", "NIfTI volumes")
    image = nibabel.Nifti1Image(np.ascontiguousarray(np.asarray(values, np.float32).transpose(2, 1, 0)), affine)
    image.header.set_xyzt_units("mm")
    data = image.to_bytes()  # bytes, not nibabel.save: that picks the format from the suffix, a temp name has none
    Path(path).write_bytes(gzip.compress(data, compresslevel=6) if str(path).endswith(".gz") else data)


def read_nifti(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(D, H, W) values and the affine of a file :func:`write_nifti` wrote."""
    nibabel = require("nibabel", "nifti", "NIfTI volumes")
    image = nibabel.load(str(path))
    return np.asarray(image.dataobj, np.float32).transpose(2, 1, 0), np.asarray(image.affine)


def slice_picks(depth: int, slices: int = MONTAGE_SLICES) -> np.ndarray:
    """Indices of the montage's slices: ``slices`` evenly spread over ``depth`` (fewer when the volume is thin)."""
    return np.unique(np.linspace(0, depth - 1, min(slices, depth)).round().astype(int))


def grey(voxels: np.ndarray) -> np.ndarray:
    """(D, H, W) uint8 of a scan for display: its 1st to 99th percentile stretched to black..white (a few bright
    voxels do not darken the rest)."""
    low, high = np.percentile(voxels, [1.0, 99.0])
    scaled = (voxels - low) / (high - low) if high > low else np.zeros_like(voxels)
    return (np.clip(scaled, 0.0, 1.0) * 255).round().astype(np.uint8)


def montage(pictures: np.ndarray, picks: np.ndarray, gap: int = 2) -> np.ndarray:
    """(H', n*W' + gaps, 3) uint8: the slices ``picks`` of (D, H, W, 3) ``pictures`` side by side, each flipped so
    that the file's second axis points up (as :func:`incrinf.explain.pictures.save_heatmap` draws volumes), and
    enlarged by a whole factor when H is under 96 pixels."""
    tiles = [pictures[z, ::-1] for z in picks]
    zoom = -(-_MIN_TILE // tiles[0].shape[0])  # small scans are enlarged (whole voxels) so the gallery shows them
    if zoom > 1:
        tiles = [tile.repeat(zoom, axis=0).repeat(zoom, axis=1) for tile in tiles]
    h, w = tiles[0].shape[:2]
    out = np.full((h, len(tiles) * (w + gap) - gap, 3), 255, np.uint8)
    for i, tile in enumerate(tiles):
        out[:, i * (w + gap):i * (w + gap) + w] = tile
    return out


def scan_montage(voxels: np.ndarray) -> np.ndarray:
    """Montage of a scan's slices in grey (the gallery's "model input")."""
    return montage(np.repeat(grey(voxels)[..., None], 3, axis=3), slice_picks(voxels.shape[0]))


def heat_montage(colours: np.ndarray, voxels: np.ndarray | None = None, alpha: float = 0.5) -> np.ndarray:
    """Montage of a heat map's (D, H, W, 3) uint8 ``colours`` (e.g. :func:`~.stats.heat_colours` of the voxel
    map) over the scan's slices, or alone without ``voxels``."""
    mixed = colours.astype(np.float32)
    if voxels is not None:
        mixed = (1 - alpha) * np.repeat(grey(voxels)[..., None], 3, axis=3) + alpha * mixed
    return montage(mixed.round().astype(np.uint8), slice_picks(colours.shape[0]))
