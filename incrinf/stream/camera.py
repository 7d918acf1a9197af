"""The engine's frame cache driven by camera motion: homographies become per-resolution index maps.

A frame's homography (previous -> current, input pixel coordinates) is scaled to every cached resolution and
turned into a nearest-neighbour index map (:class:`~incrinf.engine.blocks.Motion`). Nearest-neighbour reads round
every frame; to keep that rounding from adding up over frames (a 3 px pan is 0.09 of a stride-32 position:
rounded to 0 every frame, the deep cache would never move), each resolution keeps a *drift* field: the offset
between where a position's cached content belongs and where it sits. Reads compensate for it, the field takes
the new rounding error, and recomputed positions have none. Positions the motion misplaces by more than
``max_misalignment`` are recomputed instead of reused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from incrinf.engine import CacheMemory, ExecStats, FrameEngine, Motion
from incrinf.engine.blocks import BlockPlan
from incrinf.engine.costs import FrameCosts
from incrinf.engine.frame_regions import RegionPlan
from incrinf.geometry import Box
from incrinf.graph import Graph
from incrinf.stream.warp import scale_homography

# Positions of the first cached map on which a motion's unusable share is estimated before the full index maps.
ESTIMATE_POSITIONS = 2048
# Offsets (in positions of the first cached map, per axis) added to a motion's translation by
# :meth:`CameraEngine.unusable_at_any_shift` (steps of a quarter position: any translation lies within an eighth of
# one), and the positions it samples per offset (25 offsets x 256 positions: under a millisecond).
_SHIFT_OFFSETS = np.arange(-2, 3) / 4.0
ANY_SHIFT_POSITIONS = 256


@dataclass
class _Warp:
    """One resolution's map for a frame: source rows (None: identity), positions without a usable source (None:
    none), the drift after the move, and the sides whose padding held content in the previous frame."""

    index: torch.Tensor | None
    invalid: np.ndarray | None
    drift: np.ndarray
    new_padding: tuple[str, ...] = ()


class CameraEngine:
    """Full and cached inference of camera frames (a :class:`~incrinf.engine.FrameEngine` plus motion).

    Args:
        graph: captured graph for the frame size.
        device: device of the model and the frames.
        feature_threshold: value-based pruning of frames where the camera did not move (0: exact).
        moving_feature_threshold: the same for frames where it moved.
        max_misalignment: recompute cached positions whose content the nearest-neighbour warp misplaces by more
            than this (in positions of their map).

    Attributes:
        engine: the frame engine.
        last: :class:`~incrinf.engine.ExecStats` of the latest frame; ``full_reason`` is set when a cached frame
            ran as full inference instead (and why).
    """

    def __init__(self, graph: Graph, device: torch.device | str = "cpu", feature_threshold: float = 0.0,
                 moving_feature_threshold: float | None = None, max_misalignment: float = 0.5) -> None:
        if moving_feature_threshold is None:
            moving_feature_threshold = feature_threshold
        for name, value in (("feature_threshold", feature_threshold),
                            ("moving_feature_threshold", moving_feature_threshold)):
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if not 0.0 <= max_misalignment <= 0.5:
            raise ValueError(f"max_misalignment must be in [0, 0.5] positions, got {max_misalignment}")
        self.engine = FrameEngine(graph, device)
        self.feature_threshold = float(feature_threshold)
        self.moving_feature_threshold = float(moving_feature_threshold)
        self.max_misalignment = float(max_misalignment)
        self.input_dims = tuple(graph.input_shape[-2:])
        self._grids = {r: np.mgrid[0:r[0], 0:r[1]].astype(np.float64) for r in self.engine.resolutions}
        self._arange = {r: np.arange(r[0] * r[1]) for r in self.engine.resolutions}
        self._drift: dict[tuple[int, int], np.ndarray] = {}
        # what the drift fields hold, kept as they are set (a still camera's frame would otherwise scan every field
        # twice to find them unchanged): the resolutions with a drift of half a position or more (their maps move
        # even when the camera did not), and whether any drift is nonzero (recomputed positions must be reported)
        self._moving_drift: set[tuple[int, int]] = set()
        self._drifting = False
        self._memo: tuple[bytes, dict[tuple[int, int], _Warp]] | None = None
        self._zero_drift: dict[tuple[int, int], np.ndarray] = {}
        self.full_reason = ""

    # --- the engine's surface ----------------------------------------------------------------------------

    @property
    def last(self) -> ExecStats:
        return self.engine.last

    @property
    def has_cache(self) -> bool:
        return self.engine.has_cache

    @property
    def dense_cut(self) -> float:
        return self.engine.dense_cut

    def cache_memory(self) -> CacheMemory:
        return self.engine.cache_memory()

    def reset(self) -> None:
        """Drop the cache (the next frame must go through :meth:`full`)."""
        self.engine.reset()
        self._set_drift({}, zero=True)
        self._memo = None

    # --- frames ------------------------------------------------------------------------------------------

    def full(self, x: torch.Tensor) -> Any:
        """Full inference of ``x`` (1, C, H, W) that also refills the cache."""
        self._set_drift({r: np.zeros((2, *r)) for r in self.engine.cached_resolutions}, zero=True)
        self._memo = None
        self.full_reason = ""
        thresholds = self.feature_threshold > 0 or self.moving_feature_threshold > 0
        return self.engine.full(x, scales=thresholds)

    def plain(self, x: torch.Tensor) -> Any:
        """Full inference of ``x`` that keeps nothing (the cache is dropped)."""
        self._set_drift({}, zero=True)
        self._memo = None
        self.full_reason = ""
        return self.engine.plain(x)

    def profile(self) -> None:
        """Measure the engine's cost coefficients on the cached frame (after :meth:`full`), and generate the module
        of plain frames (back-off stretches, no-reuse frames): the first of them would otherwise pay for it."""
        self.engine.profile()
        self.engine.prepare_plain()

    @property
    def costs(self) -> FrameCosts:
        return self.engine.costs

    def unusable_fraction(self, matrix: np.ndarray) -> float:
        """Share of the first cached map that the motion ``matrix`` (3, 3, previous -> current, input pixel
        coords) leaves without a usable source; above ``dense_cut`` :meth:`cached` runs full inference, so a
        caller can skip preparing the change mask. Estimated first on a subgrid of the map: an estimate above
        ``dense_cut`` is returned as it is (the frame runs full, the index maps are never built); else the exact
        share from the maps the cached frame reads anyway."""
        matrix = np.asarray(matrix, dtype=np.float64)  # converted once here: the helpers below take it as it is
        if self._memo is None or self._memo[0] != matrix.tobytes():
            estimate = self._estimate(matrix)
            if estimate > self.dense_cut:
                return estimate
        warps = self._warps(matrix)
        invalid = warps[self.engine.first_resolution].invalid if self.engine.first_resolution in warps else None
        return float(invalid.mean()) if invalid is not None else 0.0

    def plan(self, changed: np.ndarray, matrix: np.ndarray, boxes: list[Box] | None = None
             ) -> RegionPlan | BlockPlan:
        """The plan of a cached frame: for a still camera the box walk's (over ``boxes``, the clusters of changed
        pixels; default: found on ``changed``), else the block walk's for the motion ``matrix``."""
        motion = self._motion(matrix)
        if motion is None and self.engine.boxes:
            return self.engine.plan_boxes(self.engine.clusters(changed) if boxes is None else boxes)
        return self.engine.plan_blocks(changed, motion)

    def cached(self, x: torch.Tensor, changed: np.ndarray, matrix: np.ndarray,
               plan: RegionPlan | BlockPlan | None = None) -> Any:
        """Inference of a frame from the cache.

        Args:
            x: (1, C, H, W) the frame as the model sees it.
            changed: (H, W) bool, pixels to recompute.
            matrix: (3, 3) homography previous -> current frame, in pixel coords of ``x``.
            plan: the frame's :meth:`plan` (default: planned here).

        Returns:
            The model's output for ``x``.
        """
        self.full_reason = ""
        unusable = self.unusable_fraction(matrix)
        if unusable > self.dense_cut:
            # the motion leaves most of the first cached map without a usable source: everything after it would
            # be recomputed, and full inference does that with less bookkeeping
            self._memo = None
            out = self.full(x)
            self.full_reason = f"{unusable:.0%} of the cache misaligned by the motion"
            return out
        motion = self._motion(matrix)
        warps, self._memo = self._warps(matrix), None
        drifting = self._drifting
        still = motion is None
        threshold = self.feature_threshold if still else self.moving_feature_threshold
        out = self.engine.cached(x, changed, motion, threshold, fresh=drifting or not still, plan=plan)
        if drifting or not still:  # else every drift is zero and stays so
            drifts = dict(self._drift)
            for res, warp in warps.items():
                if res not in self.engine.cached_resolutions:
                    continue
                drift = warp.drift
                fresh = self.engine.last.fresh.get(res)
                if fresh is not None:
                    drift[:, fresh] = 0.0
                drifts[res] = drift
            self._set_drift(drifts)
        return out

    def _set_drift(self, drifts: dict[tuple[int, int], np.ndarray], zero: bool = False) -> None:
        """Take ``drifts`` (resolution -> (2, h, w)) as the drift fields, noting which are nonzero or large (``zero``:
        the caller knows them all zero, e.g. after a full frame, and nothing is scanned)."""
        self._drift = drifts
        largest = {} if zero else {res: float(np.abs(d).max()) if d.size else 0.0 for res, d in drifts.items()}
        self._moving_drift = {res for res, value in largest.items() if value >= 0.5}
        self._drifting = any(value > 0 for value in largest.values())

    def _motion(self, matrix: np.ndarray) -> Motion | None:
        """The engine's view of the motion (None: every map is read in place)."""
        warps = self._warps(matrix)
        if all(w.index is None and w.invalid is None and not w.new_padding for w in warps.values()):
            return None
        return Motion({r: w.index for r, w in warps.items() if w.index is not None},
                      {r: w.invalid for r, w in warps.items() if w.invalid is not None},
                      {r: w.new_padding for r, w in warps.items() if w.new_padding})

    # --- warping -----------------------------------------------------------------------------------------

    def _warps(self, matrix: np.ndarray) -> dict[tuple[int, int], _Warp]:
        """:meth:`_warp_maps` of this frame's motion, computed once when :meth:`unusable_fraction` asked first
        (the maps depend on the drift, which changes only when a frame ends: the memo is dropped then)."""
        matrix = np.asarray(matrix, dtype=np.float64)
        key = matrix.tobytes()
        if self._memo is None or self._memo[0] != key:
            self._memo = (key, self._warp_maps(matrix))
        return self._memo[1]

    def _warp_maps(self, matrix: np.ndarray) -> dict[tuple[int, int], _Warp]:
        """Per cached resolution, where each current position reads the previous map (the first cached map
        first: when the motion leaves most of it without a source, only it is returned, since the frame then
        runs as full inference)."""
        first = self.engine.first_resolution
        still = _is_identity(matrix)
        warps: dict[tuple[int, int], _Warp] = {}
        for res in sorted(self.engine.resolutions, key=lambda r: r != first):
            if warps.get(first) is not None and warps[first].invalid is not None \
                    and warps[first].invalid.mean() > self.dense_cut:
                break
            h, w = res
            drift = self._drift.get(res)
            # a cached tensor of the frame's size (a stride-1 stem) moves; the frame itself never does
            cached = res in self.engine.cached_resolutions
            if still and (not cached or res not in self._moving_drift):
                # a still camera: every map is read in place and keeps its drift (a map that is not cached has none)
                warps[res] = _Warp(None, None, drift if drift is not None and cached else
                                   np.zeros((2, h, w)) if cached else self._no_drift(res))
                continue
            m = scale_homography(matrix, self.input_dims, res)
            inv = np.linalg.inv(m)
            sides = _new_padding(inv, h, w)
            if not cached:  # the frame itself is never cached: only its padding matters
                warps[res] = _Warp(None, None, self._no_drift(res), sides)
                continue
            ys, xs = self._grids[res]
            if drift is None:
                drift = np.zeros((2, h, w))
            index, inside, valid, new_drift = self._read(m, inv, ys, xs, drift)
            identity = inside and bool((index == self._arange[res]).all())
            all_valid = bool(valid.all())
            if not all_valid:
                new_drift[:, ~valid] = 0.0
            warps[res] = _Warp(None if identity else torch.from_numpy(index).to(self.engine.device),
                               None if all_valid else ~valid, new_drift, sides)
        return warps

    def _no_drift(self, res: tuple[int, int]) -> np.ndarray:
        """(2, h, w) zeros, read-only: the drift of a map that is not cached (the frame's own resolution), made once
        per resolution rather than per frame (the frame's is its largest field)."""
        zeros = self._zero_drift.get(res)
        if zeros is None:
            zeros = self._zero_drift[res] = np.zeros((2, *res))
            zeros.flags.writeable = False
        return zeros

    def estimate_unusable(self, matrix: np.ndarray) -> float:
        """:meth:`unusable_fraction` estimated on every k-th row and column of the first cached map (about
        ``ESTIMATE_POSITIONS`` positions): a moving camera's attempt that the motion makes unusable is told so
        without the full map's index arithmetic (3-5 ms on a 272 x 640 frame's stride-2 map)."""
        return self._estimate(np.asarray(matrix, dtype=np.float64))

    @property
    def position_pixels(self) -> float:
        """Input pixels per position of the first cached map (its stride; 1 without a cached map)."""
        res = self.engine.first_resolution
        if res is None:
            return 1.0
        return max(self.input_dims[0] / res[0], self.input_dims[1] / res[1])

    def unusable_at_any_shift(self, matrix: np.ndarray) -> float:
        """The smallest :meth:`estimate_unusable` of the motion ``matrix`` (3, 3, previous -> current, input pixel
        coords) over translations within half a position of its own (quarter-position steps, on a coarser subgrid):
        what its zoom, rotation or shear alone leave misaligned, whatever the translation. A motion estimated only
        roughly (its translation a fraction of a position off, which alone decides whether a pure shift keeps the
        cache aligned) says the cache is unusable when this is above ``dense_cut``."""
        valid = self._subgrid_valid(np.asarray(matrix, dtype=np.float64), ANY_SHIFT_POSITIONS, _SHIFT_OFFSETS)
        return 1.0 - float(valid.mean(axis=1).max()) if valid is not None else 0.0

    def _estimate(self, matrix: np.ndarray) -> float:
        """:meth:`estimate_unusable` of a float64 ``matrix``."""
        if self.engine.first_resolution not in self._moving_drift and _is_identity(matrix):
            return 0.0
        valid = self._subgrid_valid(matrix, ESTIMATE_POSITIONS)
        return 1.0 - float(valid.mean()) if valid is not None else 0.0

    def _subgrid_valid(self, matrix: np.ndarray, positions: int, offsets: np.ndarray | None = None
                       ) -> np.ndarray | None:
        """Which positions of a subgrid of about ``positions`` positions of the first cached map the float64 motion
        ``matrix`` leaves a usable source (:meth:`_read`): (1, P) bool, or with ``offsets`` (k,) a row per
        translation ``matrix`` moved by (dx, dy) in their k x k grid, in positions; None without a cached first
        map."""
        res = self.engine.first_resolution
        if res is None or res not in self.engine.cached_resolutions:
            return None
        h, w = res
        drift = self._drift.get(res)
        if drift is None:
            drift = np.zeros((2, h, w))
        step = max(int(math.sqrt(h * w / positions)), 1)
        ys, xs = (np.ascontiguousarray(g[::step, ::step]).reshape(1, -1) for g in self._grids[res])
        if offsets is not None:
            # moving the current positions by -offset is reading the motion moved by +offset (offsets x positions)
            dy, dx = (d.reshape(-1, 1) for d in np.meshgrid(offsets, offsets, indexing="ij"))
            ys, xs = ys - dy, xs - dx
        m = scale_homography(matrix, self.input_dims, res)
        return self._read(m, np.linalg.inv(m), ys, xs, drift)[2]

    def _read(self, m: np.ndarray, inv: np.ndarray, ys: np.ndarray, xs: np.ndarray, drift: np.ndarray
              ) -> tuple[np.ndarray, bool, np.ndarray, np.ndarray]:
        """Where positions ``(ys, xs)`` (float arrays of one shape ``S``) of a map read its previous content under
        the motion ``m`` (``inv``: its inverse) and that map's ``drift`` (2, h, w): ``(index (prod(S),) flat source
        rows, whether every source lies inside the map, valid S bool: a source exists and lies within
        ``max_misalignment`` of where the content belongs, new drift (2, *S))``."""
        h, w = drift.shape[1:]
        hw_ = inv[2, 0] * xs + inv[2, 1] * ys + inv[2, 2]
        with np.errstate(divide="ignore", invalid="ignore"):
            hw_ = np.where(hw_ > 0, hw_, np.nan)
            sx = (inv[0, 0] * xs + inv[0, 1] * ys + inv[0, 2]) / hw_
            sy = (inv[1, 0] * xs + inv[1, 1] * ys + inv[1, 2]) / hw_
            valid = (sx >= -0.5) & (sx < w - 0.5) & (sy >= -0.5) & (sy < h - 0.5)
        inside = bool(valid.all())
        if not inside:
            sx = np.where(valid, sx, np.clip(np.nan_to_num(sx), 0, w - 1))
            sy = np.where(valid, sy, np.clip(np.nan_to_num(sy), 0, h - 1))
        qy0 = np.clip(np.floor(sy + 0.5), 0, h - 1).astype(np.int64)
        qx0 = np.clip(np.floor(sx + 0.5), 0, w - 1).astype(np.int64)
        qy = np.clip(np.floor(sy - drift[0][qy0, qx0] + 0.5), 0, h - 1).astype(np.int64)
        qx = np.clip(np.floor(sx - drift[1][qy0, qx0] + 0.5), 0, w - 1).astype(np.int64)
        # where the content read from q belongs in the current frame, minus where it is put
        ly, lx = qy + drift[0][qy, qx], qx + drift[1][qy, qx]
        pw = m[2, 0] * lx + m[2, 1] * ly + m[2, 2]
        new_drift = np.stack([(m[1, 0] * lx + m[1, 1] * ly + m[1, 2]) / pw - ys,
                              (m[0, 0] * lx + m[0, 1] * ly + m[0, 2]) / pw - xs])
        if self.max_misalignment < 0.5:
            # cached content further than this from where it belongs is recomputed, not reused
            valid = valid & ~(np.abs(new_drift) > self.max_misalignment).any(axis=0)
        return (qy * w + qx).reshape(-1), inside, valid, new_drift


_EYE = np.eye(3)


def _is_identity(matrix: np.ndarray) -> bool:
    """Whether a (3, 3) float64 homography is the identity within 1e-12 per entry (``np.allclose`` with ``rtol=0``
    for finite matrices, NaN never close; without its broadcasting, a tenth of a millisecond per frame)."""
    return bool(np.abs(matrix - _EYE).max() <= 1e-12)


def _new_padding(inv: np.ndarray, h: int, w: int) -> tuple[str, ...]:
    """Sides of an (h, w) map whose zero padding lies inside the previous map (``inv``: current -> previous
    coords): positions reading that padding saw image content in the previous frame."""
    def source(xs: np.ndarray, ys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        hw_ = inv[2, 0] * xs + inv[2, 1] * ys + inv[2, 2]
        with np.errstate(divide="ignore", invalid="ignore"):
            return ((inv[0, 0] * xs + inv[0, 1] * ys + inv[0, 2]) / hw_,
                    (inv[1, 0] * xs + inv[1, 1] * ys + inv[1, 2]) / hw_)

    cols, rows = np.arange(w, dtype=np.float64), np.arange(h, dtype=np.float64)
    sides = []
    with np.errstate(invalid="ignore"):
        if (source(cols, np.zeros(w))[1] >= 0.5).any():
            sides.append("top")
        if (source(cols, np.full(w, h - 1.0))[1] < h - 1.5).any():
            sides.append("bottom")
        if (source(np.zeros(h), rows)[0] >= 0.5).any():
            sides.append("left")
        if (source(np.full(h, w - 1.0), rows)[0] < w - 1.5).any():
            sides.append("right")
    return tuple(sides)
