"""MTCNN's proposal network (PNet): a small, fully convolutional face detector with real weights.

The architecture is Zhang et al.'s (MTCNN, 2016) as facenet-pytorch ships it: three 3x3 convolutions with PReLU
and one 2x2 max pool (ceil mode), then a 1x1 convolution to face / no-face scores. Every output position scores
a 12x12 window of the input at stride 2, so the output is a map: a dense model whose change stays local. The box
regression head is left out (streams compare the face-probability map).

The weights come from the ``facenet-pytorch`` wheel (``facenet_pytorch/data/pnet.pt``), which pins an old torch:
take the file with ``pip download --no-deps facenet-pytorch==2.6.0`` (``benchmarks/stream.py`` does, once, into a
cache folder) and pass the wheel or the extracted file to :func:`load_pnet`. Nothing is downloaded at run time.
MTCNN feeds it RGB scaled as ``(x - 127.5) / 128``: in a stream session, ``mean=(0.5,) * 3`` and ``std=(128 /
255,) * 3``.
"""

from __future__ import annotations

import io
import os
import zipfile

import torch
import torch.nn as nn

MEAN = (0.5, 0.5, 0.5)
STD = (128 / 255, 128 / 255, 128 / 255)
_MEMBER = "facenet_pytorch/data/pnet.pt"


class PNet(nn.Module):
    """MTCNN's PNet: (1, 3, H, W) -> (1, 2, (H - 2) // 2 - 4, ...) face / no-face probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 10, kernel_size=3)
        self.prelu1 = nn.PReLU(10)
        self.pool1 = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.conv2 = nn.Conv2d(10, 16, kernel_size=3)
        self.prelu2 = nn.PReLU(16)
        self.conv3 = nn.Conv2d(16, 32, kernel_size=3)
        self.prelu3 = nn.PReLU(32)
        self.conv4_1 = nn.Conv2d(32, 2, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(self.prelu1(self.conv1(x)))
        x = self.prelu3(self.conv3(self.prelu2(self.conv2(x))))
        return torch.softmax(self.conv4_1(x), dim=1)


def load_pnet(path: str | os.PathLike) -> PNet:
    """PNet with MTCNN's weights, from the facenet-pytorch wheel (a zip) or its extracted ``pnet.pt``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file holds no PNet weights.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no PNet weights at {path}")
    data: str | io.BytesIO = path
    if zipfile.is_zipfile(path):  # a wheel, or a state dict (torch saves zips too)
        with zipfile.ZipFile(path) as archive:
            if _MEMBER in archive.namelist():
                data = io.BytesIO(archive.read(_MEMBER))
    try:
        state = torch.load(data, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for files that are not its own
        raise ValueError(f"{path} is neither a facenet-pytorch wheel nor a PNet state dict ({error})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} is not a PNet state dict")
    model = PNet()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or [k for k in unexpected if not k.startswith("conv4_2")]:
        raise ValueError(f"{path} is not a PNet state dict (missing {missing}, unexpected {unexpected})")
    return model.eval()
