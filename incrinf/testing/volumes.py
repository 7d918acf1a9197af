"""MONAI's 3-D networks as the volume benchmarks and memory tests run them: random init (seeded), one input channel,
two classes, segmenters reduced to one score per volume (:class:`RoiSegmenter`). MONAI is imported on use."""

from __future__ import annotations

import torch
import torch.nn as nn


class RoiSegmenter(nn.Module):
    """A segmentation network reduced to one score per volume: class ``k``'s logits summed over a region of
    interest of its output map, the central half of each axis (the reducer Captum's and MONAI's users wrap dense
    models in)."""

    def __init__(self, net: nn.Module, size: tuple[int, int, int], k: int = 1) -> None:
        super().__init__()
        self.net = net
        self.k = k
        roi = torch.zeros(1, *size)
        roi[(slice(None), *(slice(n // 4, n - n // 4) for n in size))] = 1.0
        self.register_buffer("roi", roi)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, 1) scores of volumes ``x`` (N, 1, *size)."""
        return (self.net(x)[:, self.k] * self.roi).sum((1, 2, 3)).unsqueeze(1)


def monai_network(name: str, size: tuple[int, int, int]) -> nn.Module:
    """MONAI's ``resnet10``, ``densenet121``, ``unet`` or ``segresnet`` (3-D, one input channel, two classes,
    seeded random init, eval mode) for volumes of ``size``; the segmenters wrapped in a :class:`RoiSegmenter`."""
    from monai.networks import nets

    torch.manual_seed(0)
    if name == "resnet10":
        return nets.resnet10(spatial_dims=3, n_input_channels=1, num_classes=2).eval()
    if name == "densenet121":
        return nets.DenseNet121(spatial_dims=3, in_channels=1, out_channels=2).eval()
    if name == "unet":
        unet = nets.UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(16, 32, 64, 128),
                         strides=(2, 2, 2), num_res_units=2, norm="batch")
        return RoiSegmenter(unet, size).eval()
    if name == "segresnet":
        return RoiSegmenter(nets.SegResNet(spatial_dims=3, in_channels=1, out_channels=2, init_filters=8,
                                           norm="batch"), size).eval()
    raise ValueError(f"unknown network {name!r}: one of resnet10, densenet121, unet, segresnet")
