"""Per-channel input normalisation, one definition for every part of incrinf (zoo, streams, offload server).

A camera frame or photo (H, W, C) uint8 becomes the model input ``(pixels / 255 - mean) / std``, computed as one
multiply-add; :meth:`Normalization.pixels` goes back (matching and change masks work on pixels).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# EfficientNet-Lite's normalisation (the zoo's pretrained models): the default of the camera-frame sessions,
# StreamSession and OffloadingSession, and of the offload server's ModelService, so that they agree.
FRAME_MEAN = (0.5, 0.5, 0.5)
FRAME_STD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class Normalization:
    """``(x - mean) / std`` per channel, for inputs in [0, 1] (uint8 pixels are divided by 255 first).

    Attributes:
        mean: per-channel mean.
        std: per-channel standard deviation (positive).
    """

    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD

    def __post_init__(self) -> None:
        mean, std = tuple(float(v) for v in self.mean), tuple(float(v) for v in self.std)
        if not mean or len(mean) != len(std) or min(std) <= 0:
            raise ValueError(f"mean and std need one value per channel, std positive; got {self.mean}, {self.std}")
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)

    @property
    def channels(self) -> int:
        return len(self.mean)

    def _scale_shift(self, device: torch.device | str | None, uint8: bool) -> tuple[torch.Tensor, torch.Tensor]:
        std = torch.tensor(self.std, dtype=torch.float32, device=device).view(-1, 1, 1)
        mean = torch.tensor(self.mean, dtype=torch.float32, device=device).view(-1, 1, 1)
        scale = 1.0 / ((255.0 if uint8 else 1.0) * std)
        return scale, -mean / std

    def tensor(self, pixels: np.ndarray, device: torch.device | str | None = None, channels_last: bool = False
               ) -> torch.Tensor:
        """(H, W, C) uint8 pixels (or floats in [0, 1]) -> (1, C, H, W) float32 model input (contiguous, or
        channels-last in memory)."""
        array = np.ascontiguousarray(pixels)
        if array.ndim != 3 or array.shape[2] != self.channels:
            raise ValueError(f"pixels must be (H, W, {self.channels}), got shape {array.shape}")
        x = torch.from_numpy(array).to(device).permute(2, 0, 1)[None].float()  # channels-last already
        scale, shift = self._scale_shift(device, array.dtype == np.uint8)
        x = torch.addcmul(shift, x, scale)
        return x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)

    def normalize(self, image: torch.Tensor) -> torch.Tensor:
        """(..., C, H, W) float image in [0, 1] -> normalised, same shape."""
        scale, shift = self._scale_shift(image.device, False)
        return torch.addcmul(shift, image, scale)

    def image(self, x: torch.Tensor) -> np.ndarray:
        """A normalised (C, H, W) or (1, C, H, W) input back to an (H, W, C) float image in [0, 1]."""
        std = torch.tensor(self.std).view(-1, 1, 1)
        mean = torch.tensor(self.mean).view(-1, 1, 1)
        img = (x.detach().float().cpu().reshape(self.channels, *x.shape[-2:]) * std + mean).clamp(0, 1)
        return img.permute(1, 2, 0).numpy()

    def pixels(self, x: torch.Tensor) -> np.ndarray:
        """A normalised (1, C, H, W) input back to (H, W, C) uint8 pixels (rounded)."""
        return np.ascontiguousarray((self.image(x) * 255.0).round().astype(np.uint8))
