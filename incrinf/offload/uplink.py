"""Client half of ``offload_changed_pixels``: the server's reference frame mirrored on the client, the homography
to it, the change mask and the tiles of changed pixels that go up (see :mod:`incrinf.offload.wire`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from incrinf.offload import wire
from incrinf.stream.change_mask import change_mask
from incrinf.stream.config import StreamConfig
from incrinf.stream.matching import HomographyEstimator


@dataclass
class Update:
    """What the client sends for one offload_changed_pixels frame.

    Attributes:
        full: send the whole frame (first frame, failed matching, too much change, keyframe).
        reason: why a full frame, or ``"delta"``.
        matrix: (3, 3) homography reference -> frame (delta only).
        boxes: (n, 4) int32 changed tiles (delta only).
        tiles: flat uint8 pixels of the tiles (delta only).
        reference: the reference both ends hold after this frame.
        recompute_fraction: share of the frame's pixels sent (1 for full).
    """

    full: bool
    reason: str
    reference: np.ndarray
    recompute_fraction: float
    matrix: np.ndarray | None = None
    boxes: np.ndarray | None = None
    tiles: np.ndarray | None = None


class ChangedPixelsUplink:
    """Client half of ``offload_changed_pixels``: the server's reference frame mirrored, the homography
    estimator, the change mask and the tile packing (see :mod:`incrinf.offload.wire`).

    Args:
        config: the stream settings (change threshold and cell, ``max_ratio`` of changed cells at or above which
            a full frame is sent, matcher, keyframe interval).
    """

    def __init__(self, config: StreamConfig | None = None) -> None:
        self.config = config or StreamConfig()
        self.estimator = HomographyEstimator(self.config.matcher_settings)
        self.reference: np.ndarray | None = None
        self.reference_id: int | None = None
        self._last_seen: int | None = None
        self._since_full = 0

    def reset(self) -> None:
        """Forget the reference: the next frame goes out full."""
        self.reference = self.reference_id = self._last_seen = None
        self.estimator.reset()

    def prepare(self, frame: np.ndarray, frame_id: int) -> Update:
        """Build the update for ``frame``; the caller sends it and then calls :meth:`commit` or :meth:`reset`."""
        contiguous = self._last_seen is not None and frame_id == self._last_seen + 1
        self._last_seen = frame_id
        result = self.estimator.update(frame)
        if self.reference is None or not contiguous:
            return Update(True, "no reference", frame.copy(), 1.0)
        if not result.ok:
            return Update(True, f"matching failed: {result.reason}", frame.copy(), 1.0)
        config = self.config
        if config.keyframe_interval and self._since_full >= config.keyframe_interval:
            return Update(True, "keyframe", frame.copy(), 1.0)
        warped, valid = wire.warp_frame_nearest(self.reference, result.matrix)
        mask = change_mask(frame, warped, config.cell, config.pixel_threshold, valid)
        if mask.changed_cell_fraction > config.max_ratio:  # the session's rule (StreamConfig.max_ratio)
            return Update(True, f"changed cells {mask.changed_cell_fraction:.2f} > {config.max_ratio}", frame.copy(),
                          1.0)
        boxes = np.array(mask.boxes(), dtype=np.int32).reshape(-1, 4)
        tiles = wire.pack_tiles(frame, boxes)
        for y0, y1, x0, x1 in boxes.tolist():
            warped[y0:y1, x0:x1] = frame[y0:y1, x0:x1]
        return Update(False, "delta", warped, mask.recompute_fraction, result.matrix, boxes, tiles)

    def commit(self, update: Update, frame_id: int) -> None:
        self.reference, self.reference_id = update.reference, frame_id
        self._since_full = 0 if update.full else self._since_full + 1
