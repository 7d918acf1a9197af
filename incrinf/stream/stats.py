"""What a stream session did per frame (:class:`FrameStats`, its time split :class:`FrameTimes`), and the bounded
log that keeps the records (:class:`FrameLog`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, SupportsIndex

import numpy as np


class Cause(str, Enum):
    """Why a frame ran the way it did (:attr:`FrameStats.cause`)."""

    CACHED = "ok"
    FIRST_FRAME = "first frame"
    SIZE_CHANGED = "frame size changed"
    PREVIOUS_FAILED = "previous frame failed"
    NO_CACHE = "no cache kept"
    KEYFRAME = "keyframe"
    BACKING_OFF = "backing off"
    MATCH_FAILED = "match failed"
    CACHE_UNUSABLE = "cache unusable"
    CHANGED_FRACTION = "changed fraction"
    SLOWER = "cached slower"
    AUDIT = "audit"
    SUSPENDED = "quality guard"
    NO_REUSE = "no reuse"


@dataclass
class FrameTimes:
    """Where one frame's time went, in seconds (0 for a part the frame did not run).

    Attributes:
        prepare: validating, resizing and normalising the frame.
        match: the still-camera test and keypoint matching (the homography).
        mask: warping the reference and the change mask.
        plan: planning the cached frame's regions and predicting its cost.
        engine: the model (cached or full inference), a sampled audit's recomputation excluded.
        audit: checking the cached output: a sampled audit's recomputed tiles, or a full audit's full inference.
        commit: the frame's bookkeeping (reference image, back-off), unless it runs in the background.
        decide: the rest: the guards' decisions and statistics.
    """

    prepare: float = 0.0
    match: float = 0.0
    mask: float = 0.0
    plan: float = 0.0
    engine: float = 0.0
    audit: float = 0.0
    commit: float = 0.0
    decide: float = 0.0

    @property
    def overhead(self) -> float:
        """Everything but the model's own work (engine) and the audits."""
        return self.prepare + self.match + self.mask + self.plan + self.commit + self.decide

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class FrameStats:
    """What one frame did.

    Attributes:
        index: frame number in the session (0-based).
        mode: ``"full"`` or ``"cached"``.
        reason: why, in words: ``"ok"`` (cached), ``"first frame"``, ``"match failed: ..."``, ``"changed
            fraction 0.72 > max_ratio 0.6"``, ``"frame size changed"``, ``"keyframe"``, ``"previous frame
            failed"``, ``"backing off: ..."``, ``"cache unusable: ..."``, ``"cached slower: ..."`` (the plan's cost
            says full inference is faster), ``"audit: ..."`` (the quality guard compared the cached path with full
            inference and returned the latter), ``"quality guard: ..."`` (the cache is suspended after misses at
            the tightest settings), ``"no reuse: ..."`` (the plan shows the cache cannot pay on this model).
        homography_found: whether a usable homography previous -> current was found (or given).
        homography: that (3, 3) matrix in the model input's pixel coords (identity when the motion was below
            ``min_motion``), or None.
        recompute_fraction: share of the frame's pixels marked changed (1.0 for full inference).
        flops_ratio: full-inference multiply-adds / those computed for this frame (1.0 for full inference;
            ``inf`` when nothing was computed: no feature changed enough and the previous output was returned).
        seconds: wall time of the call, preprocessing and matching included.
        n_matches: keypoint matches that passed the ratio test (0 when matching did not run).
        cause: :attr:`reason` as a :class:`Cause`.
        audit: the frame was a full audit (:attr:`agreement` holds the cached path's agreement with full
            inference).
        agreement: a full audit's agreement (top-1: 1.0 or 0.0; a map: the share of agreeing positions), else None.
        predicted_full: the cost model's prediction of a full frame's engine time, seconds (NaN: unknown).
        predicted_cached: its prediction of this frame's cached engine time from the plan (NaN: not planned).
        guard_level: the quality guard's level (0: the configured thresholds; each level multiplies them by 0.6).
        regions: regions of the cached frame's input (boxes of the box walk; 0 for the block walk and full frames).
        sampled_error: a sampled audit's relative error on its recomputed tiles (NaN: none ran); when it flagged,
            the frame is also a full audit.
        oracle_cached: with ``oracle_sample``, the cached path's measured engine seconds on this frame (NaN: not
            measured).
        oracle_full: the same for full inference.
        times: where the time went (:class:`FrameTimes`).
    """

    index: int
    mode: str
    reason: str
    homography_found: bool
    homography: np.ndarray | None
    recompute_fraction: float
    flops_ratio: float
    seconds: float
    n_matches: int = 0
    cause: Cause = Cause.CACHED
    audit: bool = False
    agreement: float | None = None
    predicted_full: float = math.nan
    predicted_cached: float = math.nan
    guard_level: int = 0
    regions: int = 0
    sampled_error: float = math.nan
    oracle_cached: float = math.nan
    oracle_full: float = math.nan
    times: FrameTimes = field(default_factory=FrameTimes)

    @property
    def cache_ratio(self) -> float:
        """Share of the frame served from the cache."""
        return 1.0 - self.recompute_fraction


class FrameLog(list):
    """A list of per-frame records that keeps only the newest ``maxlen`` (None: all).

    A camera stream never ends: an unbounded log grows by a record per frame for as long as the process lives.
    Old records are dropped in chunks of a tenth of ``maxlen``, so appending stays O(1) amortised; between drops
    the log holds up to ``1.1 * maxlen`` records. Indexing and slicing work as on a list (index 0 is the oldest
    record kept); each record's own ``index`` field is its frame number.

    Args:
        maxlen: records kept, >= 1, or None.
        items: initial records.

    Attributes:
        dropped: records dropped so far (``dropped + len(log)`` frames were logged).
    """

    def __init__(self, maxlen: int | None = None, items: Iterable[Any] = ()) -> None:
        if maxlen is not None and maxlen < 1:
            raise ValueError(f"maxlen must be >= 1 or None, got {maxlen}")
        super().__init__(items)
        self.maxlen = maxlen
        self.dropped = 0
        self._trim()

    def append(self, item: Any) -> None:
        super().append(item)
        self._trim()

    def extend(self, items: Iterable[Any]) -> None:
        super().extend(items)
        self._trim()

    def insert(self, index: SupportsIndex, item: Any) -> None:
        super().insert(index, item)
        self._trim()

    def _trim(self) -> None:
        if self.maxlen is None or len(self) <= self.maxlen + self.maxlen // 10:
            return
        excess = len(self) - self.maxlen
        del self[:excess]
        self.dropped += excess
