"""A camera frame as the model sees it: validated, resized and normalised, with the pixels that matching and the
change mask work on (the same pixels the model sees)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from incrinf.extras import require
from incrinf.normalization import Normalization
from incrinf.validation import check_frame_array, check_frame_size, check_frame_tensor

cv2 = require("cv2", "stream", "camera streams")

MIN_SIDE = 64  # frames smaller than this are upscaled: a CNN's deep maps would vanish


class FrameInput:
    """Turns frames into ``(model input (1, 3, H, W), its pixels (H, W, 3) uint8, the raw frame's size)``.

    Args:
        normalization: per-channel mean and std of the default preprocessing (and of tensor frames, to turn them
            back into pixels).
        input_size: (H, W) the model sees; default: the frame's size, scaled up if a side is below 64.
        preprocess: ``frame (H, W, 3) uint8 -> (3, H', W') float tensor``; default: resize to ``input_size`` and
            normalise.
        device: where the model input goes.

    Raises:
        ValueError / TypeError: a bad ``input_size`` or a ``preprocess`` that is not callable.
    """

    def __init__(self, normalization: Normalization, input_size: Any = None,
                 preprocess: Callable[[np.ndarray], torch.Tensor] | None = None,
                 device: torch.device | str = "cpu") -> None:
        if normalization.channels != 3:
            raise ValueError(f"mean and std need 3 values each (RGB frames); got {normalization.mean}, "
                             f"{normalization.std}")
        if preprocess is not None and not callable(preprocess):
            raise TypeError("preprocess must be callable: frame (H, W, 3) uint8 -> (3, H, W) tensor")
        self.normalization = normalization
        self.input_size = check_frame_size(input_size)
        self.preprocess = preprocess
        self.device = torch.device(device)
        self._table: np.ndarray | None = None  # per uint8 value, its normalised value per channel (CPU frames)
        self._table_checked: dict[tuple[int, int], bool] = {}  # per frame size: does the table give the values?

    def __call__(self, frame: Any) -> tuple[torch.Tensor, np.ndarray, tuple[int, int]]:
        """``(model input (1, 3, H, W) channels-last, its pixels (H, W, 3) uint8, raw frame size)``; validates
        first (TypeError / ValueError for a bad frame)."""
        if isinstance(frame, np.ndarray):
            check_frame_array(frame)
            raw_size = tuple(frame.shape[:2])
            if self.preprocess is not None:
                x = self._to_device(check_frame_tensor(self.preprocess(frame), "preprocess output"))
                return x, self.normalization.pixels(x), raw_size
            size = self._target_size(*raw_size)
            # the session keeps these pixels as its reference: never the caller's buffer, which a camera loop may
            # refill in place
            pixels = np.array(frame, order="C", copy=True)
            if size != raw_size:
                shrink = size[0] * size[1] < raw_size[0] * raw_size[1]
                pixels = cv2.resize(pixels, (size[1], size[0]),
                                    interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)
            return self._normalised(pixels), pixels, raw_size
        if isinstance(frame, torch.Tensor):
            x = self._to_device(check_frame_tensor(frame))
            raw_size = tuple(x.shape[-2:])
            if self.input_size is not None and raw_size != self.input_size:
                x = F.interpolate(x, size=self.input_size, mode="bilinear", align_corners=False, antialias=True)
            return x, self.normalization.pixels(x), raw_size
        raise TypeError(f"frame must be an (H, W, 3) uint8 numpy array or a float torch tensor, "
                        f"got {type(frame).__name__}")

    def _normalised(self, pixels: np.ndarray) -> torch.Tensor:
        """(1, 3, H, W) channels-last model input of ``pixels`` (H, W, 3) uint8: on the CPU one table look-up per
        byte (a uint8 has 256 values: each one's normalised value is computed once, by
        :meth:`~incrinf.normalization.Normalization.tensor` itself), about half the time of converting and scaling
        every byte; the first frame of a size checks that the table gives its values bit for bit (else that size
        is normalised as before)."""
        if self.device.type != "cpu":  # the bytes travel, and the device converts them
            return self.normalization.tensor(pixels, self.device, channels_last=True)
        if self._table is None:
            ramp = np.repeat(np.arange(256, dtype=np.uint8)[:, None, None], 3, axis=2)  # (256, 1, 3)
            self._table = self.normalization.tensor(ramp)[0].permute(1, 2, 0).contiguous().numpy()
        size = pixels.shape[:2]
        checked = self._table_checked.get(size)
        if checked is None:
            direct = self.normalization.tensor(pixels, self.device, channels_last=True)
            checked = self._table_checked[size] = torch.equal(self._looked_up(pixels), direct)
            return direct
        if not checked:
            return self.normalization.tensor(pixels, self.device, channels_last=True)
        return self._looked_up(pixels)

    def _looked_up(self, pixels: np.ndarray) -> torch.Tensor:
        """``pixels`` (H, W, 3) uint8 through the table: (1, 3, H, W) float32, channels-last."""
        return torch.from_numpy(cv2.LUT(pixels, self._table))[None].permute(0, 3, 1, 2)

    def _target_size(self, h: int, w: int) -> tuple[int, int]:
        if self.input_size is not None:
            return self.input_size
        if min(h, w) >= MIN_SIDE:
            return h, w
        scale = MIN_SIDE / min(h, w)
        return max(MIN_SIDE, round(h * scale)), max(MIN_SIDE, round(w * scale))

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device, torch.float32).contiguous(memory_format=torch.channels_last)
