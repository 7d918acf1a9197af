"""Heat-map pictures: a 1-D signal with its heat curve, a 2-D image with the heat map over it, and a montage of a
3-D volume's slices with the heat map over each.

An occlusion map is signed (a positive value: occluding there lowered the score; negative: it raised it), so the
default colour map is a diverging one whose neutral middle sits at zero with limits symmetric about it: equal
magnitudes of either sign get equally strong colours, and zero is white, never a colour of its own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# Slices a volume's montage shows (evenly spread along its first spatial axis).
MONTAGE_SLICES = 6
# Red where occluding lowered the score, blue where it raised it, white at zero (matplotlib's reversed RdBu).
DEFAULT_CMAP = "RdBu_r"


def map_title(patch: tuple[int, ...], stride: tuple[int, ...], features: bool) -> str:
    """The default title of a heat-map picture: what was occluded ("features", or the window and stride)."""
    if features:
        return "features"
    return f"occlusion {'x'.join(map(str, patch))}, stride {'x'.join(map(str, stride))}"


def save_heatmap(pixel: np.ndarray, path: str | Path, image: np.ndarray | torch.Tensor | None, title: str,
                 label: str, cmap: str = DEFAULT_CMAP, centre: float | None = 0.0) -> Path:
    """Write a PNG of an attribution map over its input (the figure of :func:`heatmap_figure`).

    Args:
        pixel: (*spatial) attribution per element (1-3 axes).
        path: output file.
        image: the input: for 2-D an HxWx3 array in [0, 1] or uint8, or a (C, H, W) tensor; for 1-D (C, L) or
            (L,); for 3-D (C, D, H, W) or (D, H, W) (channels are averaged for display).
        title: figure title.
        label: colour-bar label.
        cmap: a matplotlib colour map name (default: diverging red-white-blue).
        centre: the value at the colour map's middle, with limits symmetric about it; ``None``: the map spans
            the data's minimum to maximum (for a sequential map).

    Returns:
        The path written.
    """
    fig = heatmap_figure(pixel, image, title, label, cmap, centre)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def heatmap_figure(pixel: np.ndarray, image: np.ndarray | torch.Tensor | None, title: str, label: str,
                   cmap: str = DEFAULT_CMAP, centre: float | None = 0.0):
    """The ``matplotlib.figure.Figure`` :func:`save_heatmap` writes (arguments as there). A plain ``Figure``,
    not one of pyplot's: drawing neither switches the caller's backend nor keeps the figure alive."""
    from matplotlib.figure import Figure

    colours = colour_scale(pixel, cmap, centre)
    d = pixel.ndim
    if d == 1:
        fig = _signal(Figure(figsize=(8, 3.5)), pixel, image, label, colours)
    elif d == 2:
        fig = _image(Figure(figsize=(6, 5)), pixel, image, label, colours)
    elif d == 3:
        fig = _montage(pixel, image, label, colours)
    else:
        raise ValueError(f"cannot draw a heat map with {d} spatial axes")
    fig.suptitle(title)
    if d != 3:  # the montage lays itself out (constrained, with one colour bar for every slice)
        fig.tight_layout()
    return fig


def colour_scale(pixel: np.ndarray, cmap: str = DEFAULT_CMAP, centre: float | None = 0.0) -> dict:
    """``imshow`` keywords (``cmap``, ``vmin``, ``vmax``) for ``pixel``: limits symmetric about ``centre``, or the
    data's range when ``centre`` is None. Raises ValueError naming the valid choices for an unknown map."""
    from matplotlib import colormaps

    if cmap not in colormaps:
        raise ValueError(f"unknown colour map {cmap!r}; matplotlib's include {', '.join(_SUGGESTED)} "
                         f"(all: matplotlib.colormaps)")
    finite = pixel[np.isfinite(pixel)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)
    if centre is not None:
        reach = max(abs(high - centre), abs(low - centre)) or 1.0  # an all-centre map: any symmetric range
        low, high = centre - reach, centre + reach
    elif low == high:
        low, high = low - 0.5, high + 0.5
    return {"cmap": cmap, "vmin": low, "vmax": high}


# Named in the error for an unknown colour map: diverging maps first (for signed maps), then sequential ones.
_SUGGESTED = ("RdBu_r", "coolwarm", "bwr", "seismic", "PiYG", "viridis", "magma", "inferno", "jet")


def _signal(fig, pixel: np.ndarray, image, label: str, colours: dict):
    from matplotlib import colormaps
    from matplotlib.collections import LineCollection
    from matplotlib.colors import Normalize

    ax = fig.subplots()
    if image is not None:
        signal = _numpy(image)
        for row in signal.reshape(-1, signal.shape[-1]):
            ax.plot(row, color="0.6", linewidth=0.8)
        ax.set_ylabel("signal")
        ax = ax.twinx()
    # the curve in the colour map's colour for its value: positive and negative stretches read as in 2-D and 3-D
    scale = colormaps[colours["cmap"]]
    norm = Normalize(colours["vmin"], colours["vmax"])
    xs = np.arange(len(pixel))
    points = np.stack([xs, pixel], axis=1).reshape(-1, 1, 2)
    segments = np.concatenate([points[:-1], points[1:]], axis=1)
    curve = LineCollection(segments, cmap=scale, norm=norm, linewidth=1.6)
    curve.set_array((pixel[:-1] + pixel[1:]) / 2)
    ax.add_collection(curve)
    ax.bar(xs, pixel, width=1.0, color=scale(norm(pixel)), alpha=0.35)
    ax.set_xlim(-0.5, len(pixel) - 0.5)
    fig.colorbar(curve, ax=ax, label=label)
    ax.set_ylabel(label)
    ax.set_xlabel("position")
    return fig


def _image(fig, pixel: np.ndarray, image, label: str, colours: dict):
    ax = fig.subplots()
    if image is not None:
        display = as_display(image)
        ax.imshow(display, cmap="gray" if display.ndim == 2 else None)
        shown = ax.imshow(pixel, alpha=0.5, **colours)
    else:
        shown = ax.imshow(pixel, **colours)
    fig.colorbar(shown, ax=ax, label=label)
    ax.set_axis_off()
    return fig


def _montage(pixel: np.ndarray, image, label: str, colours: dict):
    from matplotlib.figure import Figure

    depth = pixel.shape[0]
    picks = np.unique(np.linspace(0, depth - 1, min(MONTAGE_SLICES, depth)).round().astype(int))
    volume = None
    if image is not None:
        volume = _numpy(image)
        volume = volume.reshape(-1, *volume.shape[-3:]).mean(axis=0)
    fig = Figure(figsize=(2.6 * len(picks) + 1.2, 3.2), layout="constrained")
    axes = fig.subplots(1, len(picks), squeeze=False)
    shown = None
    for ax, z in zip(axes[0], picks):
        # origin "lower": the file's second axis (y, anterior in RAS volumes) points up
        if volume is not None:
            ax.imshow(volume[z], cmap="gray", origin="lower")
            shown = ax.imshow(pixel[z], alpha=0.45, origin="lower", **colours)
        else:
            shown = ax.imshow(pixel[z], origin="lower", **colours)
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
