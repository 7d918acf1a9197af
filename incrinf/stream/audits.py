"""Sampled audits: a few tiles of a cached tensor recomputed exactly from the frame and compared with the cache, at a
fraction of a full frame's cost; a full audit only when the sample says the cache has drifted.

The quality guard's full audit compares the output with full inference, but costs a full frame. In between, a
sampled audit recomputes a few randomly chosen tiles of the *probe* (:func:`~incrinf.engine.tiles.choose_probe`:
the deepest cached tensor whose tile cone costs at most ``sample_budget`` of a full frame) through their receptive
fields and measures the cache's relative error there. Tiles are drawn where drift can live: cells weighted by how
far the frame is from the pixels the cache stands for (capped at the change threshold, so cells recomputed this
frame do not crowd out the stale ones), plus a uniform share.

What the sample's error means is learned from the full audits: each one also measures the same kind of sample
between the cached tensor and full inference's. A sample flags (and a full audit runs on that frame) when its
error is above ``sample_tolerance`` times the largest error seen at recent full audits that held the target, or at
least the smallest error seen at one that missed. Before the first full audit held, there is nothing to compare
with, and every audit is a full one.

Where this cannot see: for a classifier the output is one vector that depends on the whole frame, and for a
dilated segmenter every deep position does: a tile of the output would cost nearly a full frame. There the probe
is an earlier map, and the sample sees drift that arises before it (stale cells under the change threshold,
pruning up to that depth), not pruning after it; the full audits on the long interval (from ``keyframe_interval``,
adapting: :meth:`~incrinf.stream.guards.QualityGuard.long_due`) still compare the output itself.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from incrinf.engine import FrameEngine
from incrinf.engine.tiles import Probe, choose_probe, exact_tiles, relative_error
from incrinf.geometry import Box
from incrinf.stream.change_mask import ChangeMask
from incrinf.stream.config import StreamConfig

# Share of the tile draws that ignore the weights (drift where the frame looks the same to the change mask).
_UNIFORM = 0.25
# Tiles per sample: one tile's error varies too much from draw to draw to compare with a reference.
TILES = 4
_REFERENCES = 8  # recent full audits whose errors a sample is compared with
# Relative errors below this are float rounding and never flag.
_FLOOR = 1e-4


def _choice_cdf(weights: np.ndarray) -> np.ndarray:
    """The cumulative distribution ``Generator.choice(n, p=weights)`` draws from (``weights`` (n,) float64, summing
    to 1): an index is ``cdf.searchsorted(generator.random(), side="right")``, the same draw from the same state."""
    cdf = weights.cumsum()
    cdf /= cdf[-1]
    return cdf


@dataclass(frozen=True)
class SampleResult:
    """One sampled audit: the cache's relative error on the tiles and whether it flagged a full audit."""

    error: float
    flagged: bool
    tiles: int


class SampledAudit:
    """Tiles, errors and the flag rule of sampled audits for one frame size (see the module docstring).

    Args:
        config: the session's settings (``sample_budget``, ``sample_tolerance``, ``pixel_threshold``).
        seed: of the tile draws.
    """

    def __init__(self, config: StreamConfig, seed: int = 0) -> None:
        self.config = config
        self.rng = np.random.default_rng(seed)
        self.probe: Probe | None = None
        self.n_tiles = 0
        self._held: deque[float] = deque(maxlen=_REFERENCES)
        self._missed: deque[float] = deque(maxlen=_REFERENCES)

    def choose(self, engine: FrameEngine) -> None:
        """Pick the probe: the deepest cached tensor whose ``TILES`` tile cones fit the budget (from the engine's
        plan costs, after its profile)."""
        costs = engine.costs
        self.probe = choose_probe(engine.program, costs, self.config.sample_budget * costs.full_seconds / TILES)
        self.n_tiles = TILES if self.probe is not None else 0

    @property
    def ready(self) -> bool:
        """Whether a sample can stand in for a full audit (a probe, and a full audit that held to compare with)."""
        return self.probe is not None and bool(self._held)

    def tiles(self, mask: ChangeMask | None, frame_size: tuple[int, int]) -> list[Box]:
        """Tiles of the probe, drawn by the weights of the module docstring."""
        probe = self.probe
        ph, pw = probe.dims
        t = probe.tile
        h, w = frame_size
        cdf = None
        if mask is not None:
            diff = np.minimum(mask.cell_diff.astype(np.float64), max(self.config.pixel_threshold, 1e-6))
            if diff.sum() > 0:
                cdf = _choice_cdf(diff.reshape(-1) / diff.sum())
        out = []
        for _ in range(self.n_tiles):
            if cdf is not None and self.rng.random() >= _UNIFORM:
                # Generator.choice(len(weights), p=weights), its distribution built once for the frame's tiles
                cell = int(cdf.searchsorted(self.rng.random(), side="right"))
                gy, gx = divmod(cell, mask.cells.shape[1])
                cy = (gy + self.rng.random()) * mask.cell * ph / h
                cx = (gx + self.rng.random()) * mask.cell * pw / w
            else:
                cy, cx = self.rng.random() * ph, self.rng.random() * pw
            y = int(min(max(round(cy - t / 2), 0), ph - t))
            x = int(min(max(round(cx - t / 2), 0), pw - t))
            out.append((y, y + t, x, x + t))
        return out

    def check(self, engine: FrameEngine, x: torch.Tensor, mask: ChangeMask | None) -> SampleResult:
        """Compare the cache (after this frame's cached run) with the probe's tiles recomputed from ``x``."""
        tiles = self.tiles(mask, tuple(x.shape[-2:]))
        exact = exact_tiles(engine.program, x, self.probe, tiles, engine.costs)
        cached = engine.cache.map(self.probe.name)
        error = relative_error([cached[..., a:b, c:d] for a, b, c, d in tiles], exact)
        return SampleResult(error, self.flags(error), len(tiles))

    def flags(self, error: float) -> bool:
        if not error > _FLOOR:
            return False
        if self._missed and error >= min(self._missed):
            return True
        return error > self.config.sample_tolerance * max(self._held, default=0.0)

    def record(self, cached_probe: torch.Tensor, full_probe: torch.Tensor, mask: ChangeMask | None,
               missed: bool | None, flagged: float = math.nan) -> float:
        """A full audit: the sampled error between the cached tensor and full inference's, kept as a reference;
        ``flagged``: the error of this frame's sample that called the audit. When the audit held, that error was a
        false alarm: the output met the target with the cache that far off, so it is a held reference too (the
        drift a still camera's cache accumulates between keyframes grows its sample error steadily, and without
        this every sample past the first reference's age would call a full frame). ``missed=None``: a miss that
        says nothing of the drift (a classifier's near tie that flipped losing no more of its lead than audits had
        seen the cache lose): no reference is kept, else every later sample at that ordinary drift would call a
        full audit, a cascade of full frames after one near tie."""
        tiles = self.tiles(mask, self._frame_size(mask, full_probe))
        error = relative_error([cached_probe[..., a:b, c:d] for a, b, c, d in tiles],
                               [full_probe[..., a:b, c:d] for a, b, c, d in tiles])
        if missed is None:
            return error
        if math.isfinite(error):
            (self._missed if missed else self._held).append(error)
        if not missed and math.isfinite(flagged):
            self._held.append(flagged)
        return error

    def _frame_size(self, mask: ChangeMask | None, probe: torch.Tensor) -> tuple[int, int]:
        return mask.image_size if mask is not None else tuple(probe.shape[-2:])
