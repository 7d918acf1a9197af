"""One stream frame's state while the session runs it (:class:`FrameState`), and why a frame runs fully
(:class:`Fallback`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from incrinf.engine.blocks import BlockPlan
from incrinf.engine.frame_regions import RegionPlan
from incrinf.stream.change_mask import ChangeMask
from incrinf.stream.matching import FrameFeatures
from incrinf.stream.stats import Cause, FrameTimes


@dataclass(frozen=True)
class Fallback:
    """Why a frame runs fully: a cause and its detail in words."""

    cause: Cause
    detail: str = ""

    @property
    def text(self) -> str:
        """The :attr:`FrameStats.reason` text, ``"cause: detail"``."""
        return f"{self.cause.value}: {self.detail}" if self.detail else self.cause.value


@dataclass
class FrameState:
    """One frame's state while it runs."""

    x: torch.Tensor
    pixels: np.ndarray
    raw_size: tuple[int, int]
    times: FrameTimes
    fallback: Fallback | None = None
    matrix: np.ndarray | None = None
    mask: ChangeMask | None = None
    warped: np.ndarray | None = None
    n_matches: int = 0
    features: FrameFeatures | None = None
    plan: RegionPlan | BlockPlan | None = None
    oracle: tuple[float, float] = (math.nan, math.nan)  # measured cached and full engine seconds
    sampled: float = math.nan  # a sampled audit's error
    checked: float = 0.0  # seconds of a near-tie check's or audit's full run on top of the cached frame
    overhead: float = 0.0  # seconds of the decision (stillness test, matching, mask, plan) before the engine ran
    probes: tuple[torch.Tensor, torch.Tensor] | None = None  # the probe, cached and full, at a full audit
    near_tie: bool = False  # the previous output was a near tie: a cached frame now would be checked
    homography_given: bool = False  # the caller gave the frame's homography (no keypoint matching)
    told_by_pixels: bool = False  # the still-camera test or the quarters' shifts ruled the cache out, no keypoints

    @property
    def still(self) -> bool:
        return self.matrix is not None and np.array_equal(self.matrix, np.eye(3))
