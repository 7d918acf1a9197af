"""Wire format shared by the offload server and client: a binary tensor codec and the cached-frame protocol.

**Tensor messages** (``application/x-incrinf-tensors``): a small self-describing header and raw
little-endian bytes, never JSON lists of floats::

    b"INCT" | u32 meta_len | meta (UTF-8 JSON object of small scalars) | u16 n_tensors |
    n x ( u8 name_len | name | u8 dtype | u8 ndim | ndim x u32 dim | u64 nbytes | raw bytes )

Every length is checked against the bytes actually present before anything is allocated, so a truncated or
lying payload raises :class:`PayloadError` (the server answers 400), never a crash or a huge allocation.

**Cached frames** (CacheInf's "send only what changed"): both ends hold the same *reference frame*, the last
frame the server reconstructed. The client sends the homography reference -> current frame and the pixels of
the changed cells; both ends warp the reference by the homography with a nearest-neighbour gather (exact
copies, deterministic: the two ends agree bit for bit) and paste the tiles (:func:`apply_update`). Only the
changed pixels cross the uplink, which is the scarce resource when offloading; the server then runs the model
on the reconstructed frame. :func:`frame_digest` lets the client check that both copies still agree.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from incrinf.stream.warp import nearest_source_index

CONTENT_TYPE = "application/x-incrinf-tensors"
MAGIC = b"INCT"
MAX_TENSORS = 64
MAX_NDIM = 8
MAX_META_BYTES = 65536
MAX_ELEMENTS = 1 << 34  # per tensor, counting zero-sized dims as 1 (numpy refuses larger shapes even if empty)

_DTYPES: dict[int, np.dtype] = {
    1: np.dtype("u1"), 2: np.dtype("i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"), 5: np.dtype("<i8"),
    6: np.dtype("<f2"), 7: np.dtype("<f4"), 8: np.dtype("<f8"), 9: np.dtype("?"),
}
_CODES = {dt: code for code, dt in _DTYPES.items()}


class PayloadError(ValueError):
    """A message that does not decode, or whose content does not fit the request (HTTP 400)."""


@dataclass
class Message:
    """A decoded tensor message.

    Attributes:
        tensors: name -> numpy array (owned copies, writable).
        meta: small JSON metadata (frame ids, split names, ...).
    """

    tensors: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)

    def tensor(self, name: str, dtype: np.dtype | None = None, ndim: int | None = None) -> np.ndarray:
        """The tensor ``name``, checked for presence, dtype and rank (raises :class:`PayloadError`)."""
        if name not in self.tensors:
            raise PayloadError(f"missing tensor {name!r} (got {sorted(self.tensors)})")
        arr = self.tensors[name]
        if dtype is not None and arr.dtype != np.dtype(dtype):
            raise PayloadError(f"tensor {name!r} must be {np.dtype(dtype)}, got {arr.dtype}")
        if ndim is not None and arr.ndim != ndim:
            raise PayloadError(f"tensor {name!r} must have {ndim} dims, got shape {arr.shape}")
        return arr


def _as_numpy(value: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    little = arr.dtype.newbyteorder("<")
    if little not in _CODES:
        raise TypeError(f"unsupported dtype {arr.dtype}")
    return np.asarray(arr.astype(little, copy=False), order="C")  # not ascontiguousarray: it makes 0-d arrays 1-d


def encode(tensors: Mapping[str, np.ndarray | torch.Tensor], meta: Mapping[str, Any] | None = None) -> bytes:
    """Serialise named tensors and small metadata into one message.

    Args:
        tensors: name (ASCII, <= 255 bytes) -> array or tensor of a supported dtype, any shape up to 8 dims.
        meta: JSON-serialisable metadata (keep it small: ids, names, numbers).

    Returns:
        The message bytes.
    """
    meta_bytes = json.dumps(dict(meta or {}), separators=(",", ":")).encode()
    if len(meta_bytes) > MAX_META_BYTES:
        raise ValueError(f"metadata too large ({len(meta_bytes)} bytes)")
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"too many tensors ({len(tensors)} > {MAX_TENSORS})")
    parts = [MAGIC, struct.pack("<I", len(meta_bytes)), meta_bytes, struct.pack("<H", len(tensors))]
    for name, value in tensors.items():
        arr = _as_numpy(value)
        name_bytes = name.encode("ascii")
        if not 0 < len(name_bytes) < 256 or arr.ndim > MAX_NDIM:
            raise ValueError(f"bad tensor name or rank: {name!r}, shape {arr.shape}")
        code = _CODES[arr.dtype]
        parts += [
            struct.pack("<B", len(name_bytes)), name_bytes, struct.pack("<BB", code, arr.ndim),
            struct.pack(f"<{arr.ndim}I", *arr.shape), struct.pack("<Q", arr.nbytes), arr.tobytes(),
        ]
    return b"".join(parts)


class _Reader:
    """Bounds-checked cursor over a byte buffer."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.view = memoryview(data)
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.view):
            raise PayloadError(f"truncated payload: {what} needs {n} bytes at offset {self.pos}, "
                               f"only {len(self.view) - self.pos} left")
        out = self.view[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Parse a message made by :func:`encode`.

    Raises:
        PayloadError: bad magic, truncated data, unknown dtype, sizes that disagree, trailing bytes.
    """
    reader = _Reader(data)
    if bytes(reader.take(4, "magic")) != MAGIC:
        raise PayloadError("not an incrinf tensor message (bad magic; expected b'INCT')")
    (meta_len,) = reader.unpack("<I", "metadata length")
    if meta_len > MAX_META_BYTES:
        raise PayloadError(f"metadata too large ({meta_len} > {MAX_META_BYTES} bytes)")
    raw_meta = bytes(reader.take(meta_len, "metadata"))
    try:
        meta = json.loads(raw_meta or b"{}")
    # ValueError also covers integers too long to convert; RecursionError, nesting too deep to parse
    except (ValueError, RecursionError) as exc:
        raise PayloadError(f"metadata is not valid JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(meta, dict):
        raise PayloadError("metadata must be a JSON object")
    (count,) = reader.unpack("<H", "tensor count")
    if count > MAX_TENSORS:
        raise PayloadError(f"too many tensors ({count} > {MAX_TENSORS})")
    tensors: dict[str, np.ndarray] = {}
    for i in range(count):
        (name_len,) = reader.unpack("<B", f"tensor {i} name length")
        try:
            name = bytes(reader.take(name_len, f"tensor {i} name")).decode("ascii")
        except UnicodeDecodeError:
            raise PayloadError(f"tensor {i} name is not ASCII") from None
        code, ndim = reader.unpack("<BB", f"tensor {name!r} dtype and rank")
        if code not in _DTYPES:
            raise PayloadError(f"tensor {name!r}: unknown dtype code {code}")
        if ndim > MAX_NDIM:
            raise PayloadError(f"tensor {name!r}: {ndim} dims > {MAX_NDIM}")
        shape = reader.unpack(f"<{ndim}I", f"tensor {name!r} shape")
        (nbytes,) = reader.unpack("<Q", f"tensor {name!r} size")
        dtype = _DTYPES[code]
        if int(np.prod([max(d, 1) for d in shape], dtype=object)) > MAX_ELEMENTS:  # also when a dim is 0
            raise PayloadError(f"tensor {name!r}: shape {shape} is too large")
        if int(np.prod(shape, dtype=object)) * dtype.itemsize != nbytes:
            raise PayloadError(f"tensor {name!r}: shape {shape} x {dtype} does not match {nbytes} bytes")
        raw = reader.take(nbytes, f"tensor {name!r} data")
        if name in tensors:
            raise PayloadError(f"duplicate tensor name {name!r}")
        tensors[name] = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    if reader.pos != len(reader.view):
        raise PayloadError(f"{len(reader.view) - reader.pos} trailing bytes after the last tensor")
    return Message(tensors, meta)


# --- frames ---------------------------------------------------------------------------------------------


def frame_digest(frame: np.ndarray) -> str:
    """Short content hash of a frame (both ends compare it to detect a diverged reference)."""
    return hashlib.blake2b(np.ascontiguousarray(frame).tobytes(), digest_size=8).hexdigest()


def warp_frame_nearest(frame: np.ndarray, matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Warp a frame by a homography with one nearest-neighbour gather (exact copies of source pixels).

    Args:
        frame: (H, W, C) reference frame, any dtype.
        matrix: (3, 3) homography reference -> current, pixel coords.

    Returns:
        ``(warped (H, W, C), valid (H, W) bool)``; pixels whose source lies outside the frame are 0 and
        invalid.
    """
    h, w, c = frame.shape
    idx, valid = nearest_source_index(np.asarray(matrix, dtype=np.float64), h, w, (h, w))
    idx_np, valid_np = idx.numpy(), valid.numpy()
    warped = frame.reshape(h * w, c)[idx_np]
    warped[~valid_np] = 0
    return warped.reshape(h, w, c), valid_np.reshape(h, w)


def check_boxes(boxes: np.ndarray, size: tuple[int, int]) -> None:
    """Raise :class:`PayloadError` unless ``boxes`` is (n, 4) ``(y0, y1, x0, x1)`` inside a frame of ``size``."""
    if boxes.ndim != 2 or boxes.shape[1] != 4:
        raise PayloadError(f"boxes must be (n, 4), got {boxes.shape}")
    h, w = size
    y0, y1, x0, x1 = (boxes[:, i].astype(np.int64) for i in range(4))
    if np.any((y0 < 0) | (y1 > h) | (y0 >= y1) | (x0 < 0) | (x1 > w) | (x0 >= x1)):
        raise PayloadError(f"boxes must satisfy 0 <= y0 < y1 <= {h} and 0 <= x0 < x1 <= {w}")


def pack_tiles(frame: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """The pixels of ``frame`` inside ``boxes``, flattened box after box (row-major, channels last).

    Args:
        frame: (H, W, C).
        boxes: (n, 4) int ``(y0, y1, x0, x1)``.

    Returns:
        (sum of box areas * C,) array of ``frame``'s dtype.
    """
    parts = [frame[y0:y1, x0:x1].reshape(-1) for y0, y1, x0, x1 in boxes.tolist()]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=frame.dtype)


def apply_update(reference: np.ndarray, matrix: np.ndarray | None, boxes: np.ndarray,
                 tiles: np.ndarray) -> np.ndarray:
    """Rebuild the current frame from the reference, the homography and the changed tiles.

    Args:
        reference: (H, W, C) reference frame (the previous reconstruction).
        matrix: (3, 3) homography reference -> current, or None for a static camera (no warp).
        boxes: (n, 4) int ``(y0, y1, x0, x1)`` of the pasted tiles.
        tiles: flat pixels from :func:`pack_tiles`, same dtype as ``reference``.

    Returns:
        (H, W, C) new frame (a new array; ``reference`` is not modified).

    Raises:
        PayloadError: boxes outside the frame, a tile size that does not add up, a bad matrix.
    """
    h, w, c = reference.shape
    check_boxes(boxes, (h, w))
    if tiles.dtype != reference.dtype or tiles.ndim != 1:
        raise PayloadError(f"tiles must be a flat {reference.dtype} array, got {tiles.dtype} {tiles.shape}")
    areas = (boxes[:, 1] - boxes[:, 0]).astype(np.int64) * (boxes[:, 3] - boxes[:, 2]) * c
    if int(areas.sum()) != tiles.size:
        raise PayloadError(f"tiles hold {tiles.size} values, boxes need {int(areas.sum())}")
    if matrix is None:
        frame = reference.copy()
    else:
        matrix = np.asarray(matrix, dtype=np.float64)
        if matrix.shape != (3, 3) or not np.all(np.isfinite(matrix)) or abs(np.linalg.det(matrix)) < 1e-12:
            raise PayloadError("homography must be a finite, invertible 3x3 matrix")
        frame, _ = warp_frame_nearest(reference, matrix)
    offset = 0
    for (y0, y1, x0, x1), n in zip(boxes.tolist(), areas.tolist()):
        frame[y0:y1, x0:x1] = tiles[offset:offset + n].reshape(y1 - y0, x1 - x0, c)
        offset += n
    return frame
