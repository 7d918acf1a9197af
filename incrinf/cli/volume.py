"""``incrinf explain VOLUME.nii.gz``: an occlusion heat map of a 3-D volume (a NIfTI file, read with nibabel),
written as a montage of slices with the heat map over them."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from incrinf.errors import CaptureError
from incrinf.extras import require

NIFTI_SUFFIXES = (".nii", ".nii.gz")
DEFAULT_VOLUME_MODEL = "monai_densenet121_3d"


def is_volume_path(path: str | None) -> bool:
    """Whether ``path`` names a NIfTI volume (by its suffix)."""
    return path is not None and str(path).lower().endswith(NIFTI_SUFFIXES)


def read_volume(path: str, index: int = 0) -> torch.Tensor:
    """A NIfTI volume as a (1, D, H, W) float32 tensor, standardised (zero mean, unit variance).

    The file's axes (x, y, z) become (D, H, W) = (z, y, x), so the montage shows axial slices; a 4-D file
    (x, y, z, t) gives its volume ``index``.

    Reads the file's bytes with :func:`incrinf.explain.dataset.volumes.decode_volume`, as a dataset run of volumes
    does, so both explain the same tensor.

    Raises:
        FileNotFoundError: no such file. ValueError: unreadable, not 3-D or 4-D, ``index`` out of range, or not
            finite. MissingExtraError: nibabel is not installed.
    """
    from incrinf.explain.dataset.volumes import decode_volume

    require("nibabel", "nifti", "NIfTI volumes")
    if not Path(path).is_file():
        raise FileNotFoundError(f"volume not found: {path}")
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read volume {path}: {exc.strerror or exc}") from None
    return torch.from_numpy(decode_volume(data, path, index).voxels)[None]


def resize(volume: torch.Tensor, size: tuple[int, int, int]) -> torch.Tensor:
    """(C, D, H, W) volume resampled (trilinear) to (C, *size)."""
    return F.interpolate(volume[None], size=size, mode="trilinear", align_corners=False)[0]


def volume_size(text: str) -> tuple[int, int, int]:
    """argparse type: ``DxHxW``."""
    try:
        size = tuple(int(p) for p in text.lower().split("x"))
    except ValueError:
        size = ()
    if len(size) != 3 or min(size) < 1:
        raise argparse.ArgumentTypeError(f"expected DxHxW with three positive integers, got {text!r}")
    return size  # type: ignore[return-value]


def resize_hint(model: torch.nn.Module, shape: tuple[int, int, int]) -> str:
    """What to tell a user whose volume of (D, H, W) ``shape`` the model cannot run on (an axis too short for
    its downsampling): a ``--resize`` that raises every axis to the smallest power of two the model runs on,
    found by running it on meta tensors (shapes only, no arithmetic)."""
    import itertools

    from torch.func import functional_call

    grid = "x".join(map(str, shape))
    meta = {key: torch.empty_like(value, device="meta")
            for key, value in itertools.chain(model.named_parameters(), model.named_buffers())}
    for side in (8, 16, 32, 64, 128, 256):
        size = tuple(max(axis, side) for axis in shape)
        try:
            with torch.no_grad():
                functional_call(model, meta, (torch.empty(1, 1, *size, device="meta"),))
        except Exception:  # any failure on this grid: try a larger one
            continue
        return (f"the volume is {grid} (D x H x W) and the network's downsampling needs more voxels along some axis: "
                f"resample it with --resize, e.g. --resize {'x'.join(map(str, size))}")
    return f"the volume is {grid} (D x H x W): resample it with --resize DxHxW to a grid the network runs on"


def run_volume(args: argparse.Namespace, path: str, baseline: object) -> int:
    """The ``explain`` subcommand for the volume file ``path``."""
    from incrinf import models
    from incrinf.cli.approx_options import describe_approximation
    from incrinf.explain.occlusion import occlusion

    for option in ("target_ssim", "profile", "drill_down", "target_speedup"):
        if getattr(args, option, None) is not None:
            raise ValueError(f"--{option.replace('_', '-')} is for images; volumes run exact (or with --tau, "
                             "--feature-threshold)")
    name = args.model or DEFAULT_VOLUME_MODEL
    if not models.is_volume_model(name):
        raise ValueError(f"{name} explains RGB images; a volume needs a 3-D model: "
                         f"{', '.join(models.VOLUME_MODELS)}")
    try:
        volume = read_volume(path, args.volume_index)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"incrinf explain: {exc}") from None
    labels = None
    if getattr(args, "feature_mask", None):
        from incrinf.cli.feature_mask import read_volume_mask

        try:
            labels = read_volume_mask(args.feature_mask, tuple(volume.shape[1:]), args.volume_index)
        except (FileNotFoundError, ValueError) as exc:
            raise SystemExit(f"incrinf explain: {exc}") from None
    if args.resize:
        volume = resize(volume, args.resize)
        if labels is not None:
            from incrinf.cli.feature_mask import resize_labels

            labels = resize_labels(labels, args.resize)
    model = models.load(name, args.weights)
    start = time.perf_counter()
    try:
        result = occlusion(model, volume, target=args.target, patch=args.patch or 16, stride=args.stride or 16,
                           baseline=baseline, batch_size=args.batch_size or "auto", output=args.output,
                           progress=not args.quiet, tau=args.tau, feature_threshold=args.feature_threshold,
                           measure_quality=args.measure_quality, spatial_dims=3, feature_mask=labels)
    except CaptureError as exc:  # a zoo model traces, so it failed on this grid: say how to resample
        raise CaptureError(f"{exc}\n{resize_hint(model, tuple(volume.shape[1:]))}") from None
    elapsed = time.perf_counter() - start
    out = result.save(args.out, image=volume, title=f"{name} on {Path(path).name}: class {result.target}",
                      cmap=args.cmap, centre=None if args.no_centre else 0.0)
    s = result.stats
    if result.features is not None or result.every_class:
        from incrinf.cli.feature_mask import print_summary

        return print_summary(result, elapsed, out, "montage")
    shape = "x".join(map(str, volume.shape[1:]))
    print(f"explained class {result.target} of a {shape} volume with {s.positions} positions in {elapsed:.1f} s "
          f"({s.batches} batches of {s.batch_size}); theoretical speedup {s.theoretical_speedup:.2f}x, "
          f"realized FLOP ratio {s.realized_flop_ratio:.2f}x")
    cell = np.unravel_index(np.argmax(result.heatmap), result.heatmap.shape)
    corner = result.positions[np.ravel_multi_index(cell, result.heatmap.shape)]
    window = ", ".join(f"{axis}={c}..{c + p}" for axis, c, p in zip("zyx", corner, result.patch))
    print(f"largest drop {result.heatmap.max():.3f} at window {window}")
    print(describe_approximation(s))
    print(f"montage written to {out}")
    return 0
