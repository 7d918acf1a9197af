"""Feature masks read from files: integer features (superpixels, anatomical labels) as a segment image, a label
volume or a ``.npy`` array, validated and brought onto the model's input grid by the same resampling as the input,
with nearest-neighbour labels (ids are never blended).

Images take a segment image (a greyscale or palette PNG/TIFF of ids; an RGB image's distinct colours become ids)
or a ``.npy`` array of the image's height and width; volumes take a label volume (NIfTI, or ``.npy`` in (D, H, W)
order) of the volume's shape, with its axes read as the volume's are. ``incrinf explain --feature-mask`` and the
dataset mode both read masks here, so a mask is refused for the same reasons either way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from incrinf.extras import require


def _labels(array: np.ndarray, path: str, colours: bool = True) -> np.ndarray:
    """Integer ids of a label array; with ``colours`` (segment images), an RGB(A) array's distinct colours
    numbered in order (a label volume's last axis of 3 or 4 slices is not colour)."""
    if colours and array.ndim == 3 and array.shape[2] in (3, 4):
        colours = array[..., :3].reshape(-1, 3)
        _, ids = np.unique(colours, axis=0, return_inverse=True)
        return ids.reshape(array.shape[:2]).astype(np.int64)
    if not (np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.bool_)):
        rounded = np.rint(array)
        if not np.isfinite(array).all() or not np.array_equal(rounded, array):
            raise ValueError(f"feature mask {path} must hold integer ids (found non-integer values)")
        array = rounded
    return array.astype(np.int64)


def _read_array(path: str, read_file: Callable[[str], np.ndarray]) -> np.ndarray:
    """The array a mask file holds: ``.npy`` by NumPy, anything else by ``read_file``; any failure to read is a
    ValueError naming the file.

    Raises:
        FileNotFoundError: no such file. ValueError: unreadable, or a folder.
    """
    if Path(path).is_dir():
        raise ValueError(f"feature mask {path} is a folder: a folder of each input's own mask is for dataset runs "
                         "(several inputs, or --out DIR); one input takes one mask file")
    if not Path(path).is_file():
        raise FileNotFoundError(f"feature mask not found: {path}")
    try:
        return np.load(path, allow_pickle=False) if path.lower().endswith(".npy") else read_file(path)
    except Exception as exc:  # numpy, skimage and nibabel raise many types for a bad file: all mean "cannot read"
        raise ValueError(f"cannot read feature mask {path}: {type(exc).__name__}: {exc}") from None


def _segment_image(path: str) -> np.ndarray:
    import skimage.io

    return np.asarray(skimage.io.imread(path))


def read_image_mask(path: str) -> np.ndarray:
    """(H, W) int64 feature ids from a segment image or a ``.npy`` array.

    Raises:
        FileNotFoundError: no such file. ValueError: unreadable, or not a 2-D map of integer ids.
    """
    array = _read_array(path, _segment_image)
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (3, 4)):
        raise ValueError(f"feature mask {path} must be an (H, W) map of ids, got shape {array.shape}")
    return _labels(array, path)


def fit_image_mask(mask: np.ndarray, image_shape: tuple[int, int], size: int, crop: bool = True) -> torch.Tensor:
    """The mask on the grid :func:`incrinf.models.preprocess` makes of the image: shorter side to ``size`` and a
    centre crop, labels taken from the nearest pixel.

    Args:
        mask: (H, W) ids of the original image.
        image_shape: the original image's (H, W), which the mask must have.
        size: the model's input size.
    """
    if tuple(mask.shape) != tuple(image_shape):
        raise ValueError(f"the feature mask is {mask.shape[0]}x{mask.shape[1]} but the image is "
                         f"{image_shape[0]}x{image_shape[1]}: give a mask of the image's size")
    h, w = mask.shape
    scale = size / min(h, w)
    nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
    out = F.interpolate(torch.from_numpy(mask)[None, None].double(), size=(nh, nw), mode="nearest")[0, 0].long()
    if crop:
        top, left = (nh - size) // 2, (nw - size) // 2
        out = out[top:top + size, left:left + size]
    return out.contiguous()


def read_label_volume(path: str, index: int = 0) -> torch.Tensor:
    """(D, H, W) int64 labels from a NIfTI label volume (axes (x, y, z) -> (z, y, x), as volumes are read; a 4-D
    file gives its volume ``index``) or a ``.npy`` array in (D, H, W) order, of any shape (see
    :func:`check_volume_mask` for the shape a volume needs).

    Raises:
        FileNotFoundError: no such file. ValueError: unreadable, not 3-D, or not integer ids.
    """
    data = _read_array(path, lambda nifti: _label_volume(nifti, index))
    if data.ndim != 3:
        raise ValueError(f"feature mask {path} must be a 3-D label volume, got shape {data.shape}")
    return torch.from_numpy(_labels(np.ascontiguousarray(data), path, colours=False))


def check_volume_mask(labels: torch.Tensor, shape: tuple[int, ...], path: str) -> None:
    """Refuse a label volume whose (D, H, W) is not the volume's ``shape`` (before any ``--resize``).

    Raises:
        ValueError: naming both shapes.
    """
    if tuple(labels.shape) != tuple(shape):
        raise ValueError(f"feature mask {path} has shape {'x'.join(map(str, labels.shape))} but the volume is "
                         f"{'x'.join(map(str, shape))} (D x H x W)")


def read_volume_mask(path: str, shape: tuple[int, int, int], index: int = 0) -> torch.Tensor:
    """(D, H, W) int64 labels of :func:`read_label_volume`, which must have the volume's ``shape`` before any
    ``--resize``.

    Raises:
        FileNotFoundError: no such file. ValueError: unreadable, not integer ids, or of another shape.
    """
    labels = read_label_volume(path, index)
    check_volume_mask(labels, shape, path)
    return labels


def _label_volume(path: str, index: int) -> np.ndarray:
    """A NIfTI label volume in (D, H, W) order (its volume ``index`` of a 4-D file)."""
    nibabel = require("nibabel", "nifti", "NIfTI volumes")
    data = np.asarray(nibabel.load(path).dataobj)
    if data.ndim == 4:
        if not 0 <= index < data.shape[3]:
            raise ValueError(f"it holds {data.shape[3]} volumes; index {index} is out of range")
        data = data[..., index]
    return data.transpose(2, 1, 0) if data.ndim == 3 else data


def resize_labels(mask: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
    """Labels resampled to ``size`` (nearest neighbour: ids are never blended)."""
    if tuple(mask.shape) == tuple(size):
        return mask
    return F.interpolate(mask[None, None].double(), size=size, mode="nearest")[0, 0].long()
