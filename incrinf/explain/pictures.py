"""Heat-map pictures: a 1-D signal with its heat curve, a 2-D image with the heat map over it, and a montage of a
3-D volume's slices with the heat map over each."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# Slices a volume's montage shows (evenly spread along its first spatial axis).
MONTAGE_SLICES = 6


def save_heatmap(pixel: np.ndarray, path: str | Path, image: np.ndarray | torch.Tensor | None, title: str,
                 label: str) -> Path:
    """Write a PNG of an attribution map over its input.

    Args:
        pixel: (*spatial) attribution per element (1-3 axes).
        path: output file.
        image: the input: for 2-D an HxWx3 array in [0, 1] or uint8, or a (C, H, W) tensor; for 1-D (C, L) or
            (L,); for 3-D (C, D, H, W) or (D, H, W) (channels are averaged for display).
        title: figure title.
        label: colour-bar label.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    d = pixel.ndim
    if d == 1:
        fig = _signal(plt, pixel, image, label)
    elif d == 2:
        fig = _image(plt, pixel, image, label)
    elif d == 3:
        fig = _montage(plt, pixel, image, label)
    else:
        raise ValueError(f"cannot draw a heat map with {d} spatial axes")
    fig.suptitle(title)
    if d != 3:  # the montage lays itself out (constrained, with one colour bar for every slice)
        fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _signal(plt, pixel: np.ndarray, image, label: str):
    fig, ax = plt.subplots(figsize=(8, 3.5))
    if image is not None:
        signal = _numpy(image)
        for row in signal.reshape(-1, signal.shape[-1]):
            ax.plot(row, color="0.6", linewidth=0.8)
        ax.set_ylabel("signal")
        ax = ax.twinx()
    ax.plot(pixel, color="tab:red")
    ax.fill_between(np.arange(len(pixel)), pixel, color="tab:red", alpha=0.2)
    ax.set_ylabel(label)
    ax.set_xlabel("position")
    return fig


def _image(plt, pixel: np.ndarray, image, label: str):
    fig, ax = plt.subplots(figsize=(6, 5))
    if image is not None:
        display = as_display(image)
        ax.imshow(display, cmap="gray" if display.ndim == 2 else None)
        shown = ax.imshow(pixel, cmap="jet", alpha=0.5)
    else:
        shown = ax.imshow(pixel, cmap="jet")
    fig.colorbar(shown, ax=ax, label=label)
    ax.set_axis_off()
    return fig


def _montage(plt, pixel: np.ndarray, image, label: str):
    depth = pixel.shape[0]
    picks = np.unique(np.linspace(0, depth - 1, min(MONTAGE_SLICES, depth)).round().astype(int))
    volume = None
    if image is not None:
        volume = _numpy(image)
        volume = volume.reshape(-1, *volume.shape[-3:]).mean(axis=0)
    low, high = float(pixel.min()), float(pixel.max())
    fig, axes = plt.subplots(1, len(picks), figsize=(2.6 * len(picks) + 1.2, 3.2), squeeze=False,
                             layout="constrained")
    shown = None
    for ax, z in zip(axes[0], picks):
        # origin "lower": the file's second axis (y, anterior in RAS volumes) points up
        if volume is not None:
            ax.imshow(volume[z], cmap="gray", origin="lower")
            shown = ax.imshow(pixel[z], cmap="jet", alpha=0.45, vmin=low, vmax=high, origin="lower")
        else:
            shown = ax.imshow(pixel[z], cmap="jet", vmin=low, vmax=high, origin="lower")
        ax.set_title(f"slice {z}")
        ax.set_axis_off()
    fig.colorbar(shown, ax=axes[0].tolist(), label=label, shrink=0.8)
    return fig


def _numpy(image: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(image, torch.Tensor):
        image = image.detach().float().cpu().numpy()
    return np.asarray(image, dtype=np.float64)


def as_display(image: np.ndarray | torch.Tensor) -> np.ndarray:
    """A 2-D image as HxWx3 (or HxW grey) for ``imshow``: tensors (C, H, W) in [0, 1], arrays HxWx3."""
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().reshape(-1, *image.shape[-2:])
        image = image[0] if image.shape[0] != 3 else image.permute(1, 2, 0)
        image = image.numpy()
    image = np.asarray(image)
    if image.dtype == np.uint8:
        return image
    return np.clip(image, 0.0, 1.0)
