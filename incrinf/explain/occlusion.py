"""``incrinf.occlusion``: occlusion heat maps by batched incremental inference (Krypton, exact)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from incrinf.analysis import occlusion_grid
from incrinf.explain.runner import OcclusionRunner, RunStats, estimate_batch_size
from incrinf.graph import NodeKind
from incrinf.validation import check_feature_threshold, check_image, check_patch, check_stride, check_tau, parse_bytes


@dataclass
class OcclusionResult:
    """An occlusion heat map.

    Attributes:
        heatmap: (rows, cols) base output minus occluded output for ``target``, one value per position
            of the occlusion grid (a drop in the target score is positive).
        positions: (rows*cols, 2) top-left corners (y, x) of the windows, row-major.
        target: the explained class index.
        patch: (h, w) window size.
        stride: (sy, sx).
        image_shape: (H, W) of the explained image.
        stats: positions, batches, seconds, theoretical speedup and realized FLOP ratio, peak memory, tau.
        fine: (rows, cols) bool, which cells were computed at the requested stride (all, for exact runs).
    """

    heatmap: np.ndarray
    positions: np.ndarray
    target: int
    patch: tuple[int, int]
    stride: tuple[int, int]
    image_shape: tuple[int, int]
    stats: dict[str, Any] = field(default_factory=dict)
    fine: np.ndarray | None = None

    def pixel_map(self) -> np.ndarray:
        """(H, W) attribution per pixel: the mean heat of the windows covering it (Captum's averaging)."""
        h, w = self.image_shape
        total = np.zeros((h, w), np.float64)
        count = np.zeros((h, w), np.float64)
        for (y, x), value in zip(self.positions, self.heatmap.ravel()):
            total[y:y + self.patch[0], x:x + self.patch[1]] += value
            count[y:y + self.patch[0], x:x + self.patch[1]] += 1
        return np.divide(total, count, out=np.zeros_like(total), where=count > 0)

    def save(self, path: str | Path, image: np.ndarray | torch.Tensor | None = None, title: str | None = None
             ) -> Path:
        """Write a PNG of the heat map (over ``image`` when given) with a colour bar.

        Args:
            path: output file.
            image: HxWx3 array in [0, 1] or uint8, or a (3, H, W) tensor in [0, 1].
            title: optional figure title.

        Returns:
            The path written.
        """
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig, ax = plt.subplots(figsize=(6, 5))
        pixel = self.pixel_map()
        if image is not None:
            ax.imshow(_as_display(image))
            shown = ax.imshow(pixel, cmap="jet", alpha=0.5)
        else:
            shown = ax.imshow(pixel, cmap="jet")
        fig.colorbar(shown, ax=ax, label=f"drop in class {self.target} score")
        ax.set_axis_off()
        ax.set_title(title or f"occlusion {self.patch[0]}x{self.patch[1]}, stride {self.stride[0]}")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def _as_display(image: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().reshape(-1, *image.shape[-2:]).permute(1, 2, 0).numpy()
    image = np.asarray(image)
    if image.dtype == np.uint8:
        return image
    return np.clip(image, 0.0, 1.0)


def _score(out: torch.Tensor, output: str) -> torch.Tensor:
    out = out.reshape(out.shape[0], -1).float()
    return torch.softmax(out, dim=1) if output == "prob" else out


def occlusion(
    model: nn.Module,
    image: torch.Tensor,
    target: int | None = None,
    patch: int | tuple[int, int] = 16,
    stride: int | tuple[int, int] = 4,
    baseline: float | torch.Tensor = 0.0,
    batch_size: int | str = "auto",
    max_memory: str | int = "2GiB",
    output: str = "logit",
    device: str | torch.device | None = None,
    progress: bool = True,
    tau: float = 1.0,
    feature_threshold: float = 0.0,
) -> OcclusionResult:
    """Occlusion heat map of ``model`` on ``image`` by batched incremental inference.

    With ``tau=1`` the heat map equals naive re-inference of every occluded image (to float tolerance).

    Args:
        model: a ``torch.fx``-traceable classifier (eval mode is set).
        image: (3, H, W) or (1, 3, H, W) float tensor, already normalised for the model.
        target: class to explain (default: the predicted class).
        patch: occlusion window size, int or (h, w).
        stride: window stride, int or (sy, sx).
        baseline: occluding value: a scalar or a tensor broadcastable to the image.
        batch_size: positions per batch, or "auto" to stay under ``max_memory``.
        max_memory: working-memory budget for "auto", e.g. "2GiB".
        output: "logit" or "prob" (softmax probabilities).
        device: where to run (default: the image's device).
        progress: show a progress bar.
        tau: projective field threshold in (0, 1]; below 1 is approximate (faster).
        feature_threshold: value-based pruning: a recomputed position whose values moved by at most this share of
            its tensor's mean magnitude stops spreading its change; 0 (the default) is exact.

    Returns:
        An :class:`OcclusionResult`.

    Raises:
        TypeError / ValueError: bad image, patch, stride, target, batch size, output or memory budget.
        CaptureError: the model cannot be traced.
    """
    image = check_image(image)
    if device is not None:
        image = image.to(device)
        model = model.to(device)
    hw = (image.shape[-2], image.shape[-1])
    patch_hw = check_patch(patch, hw)
    stride_hw = check_stride(stride)
    tau = check_tau(tau)
    feature_threshold = check_feature_threshold(feature_threshold)
    if output not in ("logit", "prob"):
        raise ValueError(f"output must be 'logit' or 'prob', got {output!r}")
    budget = parse_bytes(max_memory)
    runner = OcclusionRunner(model, image, tau=tau, prune=feature_threshold)
    _warn_if_no_reuse(runner)
    base = _score(runner.base_output, output)[0]
    target = _check_target(target, base)
    bs = _batch_size(batch_size, runner, patch_hw, budget, tau)
    positions = occlusion_grid(hw, patch_hw, stride_hw)
    outputs, stats = runner.run(positions, patch_hw, baseline, batch_size=bs, progress=progress,
                                desc=f"occlusion {patch_hw[0]}x{patch_hw[1]}/{stride_hw[0]}")
    scores = _score(outputs, output)[:, target]
    rows = -(-(hw[0] - patch_hw[0]) // stride_hw[0]) + 1
    cols = len(positions) // rows
    heat = (base[target] - scores).cpu().numpy().reshape(rows, cols)
    return OcclusionResult(heat, positions, target, patch_hw, stride_hw, hw, _stats_dict(stats),
                           np.ones((rows, cols), bool))


def _check_target(target: int | None, base: torch.Tensor) -> int:
    if target is None:
        return int(base.argmax())
    if isinstance(target, bool) or not isinstance(target, (int, np.integer)):
        raise TypeError(f"target must be an int class index, got {type(target).__name__}")
    if not 0 <= int(target) < base.numel():
        raise ValueError(f"target {target} is out of range for a model with {base.numel()} outputs")
    return int(target)


def _batch_size(batch_size: int | str, runner: OcclusionRunner, patch: tuple[int, int], budget: int,
                tau: float) -> int:
    if batch_size == "auto":
        return estimate_batch_size(runner.graph, patch, budget, tau, device=runner.image.device)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int or 'auto', got {batch_size!r}")
    return batch_size


def _warn_if_no_reuse(runner: OcclusionRunner) -> None:
    graph = runner.graph
    if not any(n.kind == NodeKind.LOCAL for n in graph.nodes):
        warnings.warn("the model has no spatial (convolution or pooling) layers: incremental inference "
                      "cannot reuse anything, every position costs a full inference", stacklevel=3)


def _stats_dict(stats: RunStats) -> dict[str, Any]:
    out = stats.as_dict()
    out["seconds_per_position"] = stats.seconds / max(stats.positions, 1)
    return out


__all__ = ["OcclusionResult", "occlusion"]
