"""Stream settings: one frozen, validated configuration for the session, the offloading session and the CLI,
and the keypoint matcher's settings (:class:`MatcherSettings`, the one place its defaults are written).

This module has no heavy imports: the CLI reads the defaults for its help text.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

MATCHERS = ("orb", "akaze", "sift")


@dataclass(frozen=True)
class MatcherSettings:
    """How the homography between consecutive frames is estimated (:class:`~incrinf.stream.matching.
    HomographyEstimator`; its defaults are these).

    Attributes:
        matcher: ``"orb"`` (fast), ``"akaze"`` (CacheInf's choice; needs an OpenCV build that has it) or
            ``"sift"`` keypoints.
        ratio: Lowe's ratio test: a match is kept when its distance is below this share of the second best.
        min_matches: fewer keypoints or ratio-test matches than this: no homography.
        ransac_threshold: RANSAC reprojection threshold in pixels.
        max_features: most keypoints ORB and SIFT keep per frame (AKAZE has no cap). 500 on a camera stream: the
            fit needs a few dozen inliers, and detection time grows with the count.
        min_inliers: fewer RANSAC inliers than this: no homography (a fit to noise).
        refine: polish the keypoint fit with ECC. Off by default: it costs about as much as the rest of a cached
            frame, and on a still camera the change mask absorbs the keypoint fit's noise.
    """

    matcher: str = "orb"
    ratio: float = 0.75
    min_matches: int = 20
    ransac_threshold: float = 5.0
    max_features: int = 500
    min_inliers: int = 12
    refine: bool = False

    def __post_init__(self) -> None:
        _check(self.matcher in MATCHERS, f"matcher must be one of {', '.join(MATCHERS)}", self.matcher)
        _check(0.0 < self.ratio <= 1.0, "ratio must be in (0, 1]", self.ratio)
        for name in ("min_matches", "max_features", "min_inliers"):
            _check(_is_int(getattr(self, name)) and getattr(self, name) >= 1, f"{name} must be a positive integer",
                   getattr(self, name))
        _check(self.ransac_threshold > 0, "ransac_threshold must be > 0 pixels", self.ransac_threshold)
        _check(isinstance(self.refine, bool), "refine must be True or False", self.refine)


@dataclass(frozen=True)
class StreamConfig:
    """How a stream session decides what to recompute.

    Settings that depend on each other adapt instead of raising: an ``audit_interval`` longer than
    ``keyframe_interval`` counts as ``keyframe_interval`` (:attr:`first_audit_interval`), and
    ``keyframe_interval=1`` (a full frame every frame) runs plain inference on every frame without audits.

    Attributes:
        pixel_threshold: change-mask threshold on the mean absolute difference per cell, in 0-255 pixel levels
            (0 marks every cell changed).
        cell: change-mask cell side in pixels (the seed's average-pooling size). 16 divides common input sizes
            and the strides of CNN stages up to 16, so a cell maps onto whole positions of those maps.
        max_ratio: above this changed fraction of the frame, full inference.
        matcher: ``"orb"``, ``"akaze"`` or ``"sift"`` keypoints for the homography.
        matcher_options: other :class:`MatcherSettings` fields (``max_features``, ``refine``, ...), replacing
            their defaults; :attr:`matcher_settings` has the result.
        keyframe_interval: full inference at least every this many frames (0: only on the other fallbacks). With
            the quality guard on, every keyframe is an audit: with sampled audits standing in for due ones, a full
            audit runs anyway every this many frames to start with, an interval that doubles (up to 4 times this)
            after each such audit that held with room to spare and halves after a miss.
        feature_threshold: recomputed positions whose features moved by at most this share of the tensor's mean
            magnitude stop spreading (value-based pruning); 0 propagates changes exactly. ``None``: 0.7 on
            still-camera frames and 0 under camera motion, where cached features are approximate already.
        min_motion: homographies that move no frame corner by this many pixels are treated as the identity
            (keypoint noise on a still camera would otherwise shift the whole cache).
        max_misalignment: cached features are read at the nearest position of their map; where that lands
            further than this (in positions of the map) from where the content moved, they are recomputed.
            Features are not shift-equivariant below their stride, so 0.5 (always reuse, as CacheInf) flips
            top-1 predictions on panning cameras; 0 reuses only whole-position shifts.
        still_fraction: when phase correlation finds a clear global shift below ``min_motion`` (a homography that
            moves no corner further would count as the identity) and the
            unmoved previous frame explains all but this fraction of the new one, the camera is taken as still
            and keypoint matching is skipped; 0 always estimates the homography. With 1 (the default) a clear
            sub-pixel shift alone decides: a keypoint fit on a still camera is noisier (its corners move by 1-7 px
            at 288x384 under a quarter pixel of jitter) than the phase correlation, and whatever the identity
            leaves unexplained is in the change mask anyway.
        still_response: the phase-correlation peak (1 for identical frames) from which a shift counts as clear; a
            weaker peak (a pan over repetitive texture, a zoom, a scene cut) is not taken as a still camera.
        backoff_after: frames in a row that tried the cache in vain before a back-off stretch starts. The default, 1,
            is the leave-one-out choice over the clip set (``benchmarks/stream.py --loo --candidates defaults,backoff
            after 1,backoff after 2``: chosen on the other clips for every held-out clip); with the speed guard a
            stretch starts only while the recent attempts' median saving is not positive, so a miss between
            attempts that pay does not start one.
        max_backoff: after ``backoff_after`` frames in a row that could not use the cache (or, with the speed
            guard, that tried it in vain while the recent attempts' median saving was not positive; without it,
            moved and saved little with it), run the next 2, 4, ... up to this many frames fully without matching
            (0: try every frame). With the speed guard the first stretch is already long enough for its attempt to
            cost at most 2% of its time.
        background_update: finish the frame's bookkeeping (the reference image) in a worker thread after
            returning the output; outputs are identical either way.
        speed_guard: choose cached or full inference per frame from the plan's predicted cost (the cost model,
            calibrated on the frames run); False: always try the cache.
        min_saving: when the plan of the smallest possible change saves less than this share of a full frame (a
            model where every change soon reaches the whole output: squeeze-excitation, a global branch early on;
            under value-based pruning the floor a change can be pruned down to, the model after its local part on
            whole maps), every frame runs plain inference, without matching, masks or a cache. The default is the
            leave-one-out choice over eleven (model, clip) cases (``benchmarks/stream.py --no-reuse --loo``): on
            every case whose smallest change saved under 25% (MobileNetV3 heads, squeeze-excitation) the cache
            lost to plain frames; of those above 80%, the losses came from per-frame fixed costs, not the floor.
        quality_guard: audit frames (run full inference as well, compare, keep the result as a keyframe) and adapt
            ``pixel_threshold``, the feature threshold and the audit interval to hold ``target_agreement``; False:
            fixed settings, a keyframe every ``keyframe_interval`` frames.
        target_agreement: agreement with full inference the quality guard holds: top-1 for classifier outputs
            ((1, classes)), per-position argmax for maps ((1, classes, H, W); the sign for one channel).
        target_error: optional bound on the relative error ``||cached - full|| / ||full||`` of an audited frame,
            held as well (None: agreement only).
        audit_interval: the shortest interval between audits (the first audit, and after a miss); the guard doubles
            it up to ``keyframe_interval`` while the target holds with room to spare.
        sampled_audits: between full audits, check a few tiles of a cached tensor recomputed exactly from the frame
            (:mod:`~incrinf.stream.audits`): at the guard's audit points (up to ``keyframe_interval``, where a full
            audit runs anyway) and every ``audit_interval`` frames; a full audit runs only when a sample says the
            cache has drifted. False: every audit is a full one.
        sample_budget: what one sampled audit may cost, as a share of a full frame (sets the probe's depth and the
            number of tiles).
        sample_tolerance: a sample flags when its error exceeds this many times the largest error seen at recent
            full audits that held the target.
        sample_seed: seed of the sampled audits' random tile draws (the first input shape's sampler; each further
            shape's the next integer): the same seed and frames give the same draws. Which tiles a sample draws
            decides which frames are checked in full, so a benchmark quotes several seeds, not one.
        near_tie: a cached classifier output is audited on the spot (every cached frame before the first audit)
            when its top-1 margin is within the largest lead change the recent audits measured (scaled to the
            frame's drift and sampled error: :meth:`~incrinf.stream.guards.QualityGuard.measured_loss`) or within
            this many times the lead it may have lost (:meth:`~incrinf.stream.guards.QualityGuard.lead_at_risk`:
            the quantile at ``target_agreement`` of an exponential fit to those changes); 0: no checks at all.
            Chosen with ``trust_after`` and the still-camera feature threshold by leave-one-out over the clip set
            (``benchmarks/stream.py --loo --candidates "defaults,still 0.7 trust after 2,still 0.7 near_tie 0.2,still
            0.7 near_tie 0.2 trust after 2" --frames 48 --rounds 1``, nine clips, load 0.4-0.9): every candidate kept
            100% top-1 on every clip, and the one with the fastest geometric mean chosen on all clips (and on the
            others for seven of nine held-out clips) is 0.7, 0.2 and 2. In a shorter run (24 frames, two passes)
            0.7 with ``near_tie`` 0.02 and one trusted audit flipped 2 of 48 frames of bikes@224 (near ties of full
            inference, 0.096 apart, after one audit had measured a small loss); with two audits, or 0.2, none.
        trust_after: label audits (a cached classifier frame compared with full inference) the quality guard
            records before it trusts a cached classifier output unchecked; until then every cached label output is
            checked in full (not charged to the cached path: these checks are the guard's measurements). One audit's
            lead loss is one draw of a heavy-tailed error and the guard's bound is the largest of the audits'
            losses: on bikes@224 one audit lost 0.083 of the lead and the three cached frames after it 0.30, 1.16
            and 1.07 (the third flipped). With the still-camera threshold at 0.35, 2 cost hall's multiply-add ratio
            3.9 -> 2.8 for one flip fewer on bikes@224 in 72 frames; at 0.7 a cached frame saves far more and its
            losses are larger, and the leave-one-out choice (see ``near_tie``) is 2.
        opencv_threads: worker threads OpenCV may use for the session's image work (the still-camera test,
            keypoint matching, warps, resizes), set with ``cv2.setNumThreads`` when the session is built; OpenCV's
            setting is process-wide, like ``torch.set_num_threads``. None leaves it as it is (OpenCV's default: one
            thread per core). Set it to torch's thread count when inference runs on fewer threads than cores on a
            shared machine: OpenCV's parallel loops then wait for a worker on a busy core (measured at load 4-5 on
            2 cores, torch at 1 thread, 24-frame clips in lockstep: the walkers clip's change mask took 1.05 ms
            median / 1.03 ms mean on one OpenCV thread against 1.14 / 1.72 on two, its matching 0.68 / 0.74 against
            0.71 / 1.01); ``benchmarks/stream.py`` sets OpenCV's threads to ``--threads``.
        keep_stats: per-frame records kept in :attr:`StreamSession.stats` (the newest; None: all). A stream never
            ends, and an unbounded log grows by a record per frame.
        oracle_sample: on this share of the frames that had a plan, run both the cached path and full inference,
            time both and return the one the speed guard chose (``FrameStats.oracle_cached`` and ``oracle_full``):
            a measurement of the guard's decisions (its regret), not a mode to run a camera in; the full run
            refills the cache, so such frames are keyframes.
    """

    pixel_threshold: float = 10.0
    cell: int = 16
    max_ratio: float = 0.6
    matcher: str = "orb"
    matcher_options: dict[str, Any] = field(default_factory=dict, compare=False)
    keyframe_interval: int = 30
    feature_threshold: float | None = None
    min_motion: float = 2.0
    max_misalignment: float = 0.25
    still_fraction: float = 1.0
    still_response: float = 0.5
    backoff_after: int = 1
    max_backoff: int = 64
    background_update: bool = False
    speed_guard: bool = True
    min_saving: float = 0.3
    quality_guard: bool = True
    target_agreement: float = 0.99
    target_error: float | None = None
    audit_interval: int = 4
    sampled_audits: bool = True
    sample_budget: float = 0.05
    sample_tolerance: float = 1.5
    sample_seed: int = 0
    near_tie: float = 0.2
    trust_after: int = 2
    keep_stats: int | None = 1000
    oracle_sample: float = 0.0
    opencv_threads: int | None = None

    #: feature threshold of still-camera frames when ``feature_threshold`` is None: the leave-one-out choice over
    #: the clip set with ``near_tie`` and ``trust_after`` (see ``near_tie``); candidates 0.35, 0.5, 0.7 and 1.0
    #: (``benchmarks/stream_ceiling.py`` has what each threshold saves and loses on the still-camera clips)
    STILL_FEATURE_THRESHOLD = 0.7

    def __post_init__(self) -> None:
        _check(self.pixel_threshold >= 0, "pixel_threshold must be >= 0 (0-255 pixel levels)", self.pixel_threshold)
        _check(_is_int(self.cell) and self.cell >= 1, "cell must be a positive integer", self.cell)
        _check(0.0 <= self.max_ratio <= 1.0, "max_ratio must be in [0, 1]", self.max_ratio)
        _check(self.matcher in MATCHERS, f"matcher must be one of {', '.join(MATCHERS)}", self.matcher)
        _check(isinstance(self.matcher_options, dict), "matcher_options must be a dict", self.matcher_options)
        self.matcher_settings  # noqa: B018 (validates the options now rather than on the first moving frame)
        if self.keyframe_interval is None:
            object.__setattr__(self, "keyframe_interval", 0)
        _check(_is_int(self.keyframe_interval) and self.keyframe_interval >= 0,
               "keyframe_interval must be a non-negative integer (0: none)", self.keyframe_interval)
        _check(self.feature_threshold is None or self.feature_threshold >= 0, "feature_threshold must be >= 0 or None",
               self.feature_threshold)
        _check(self.min_motion >= 0, "min_motion must be >= 0 pixels", self.min_motion)
        _check(0.0 <= self.max_misalignment <= 0.5, "max_misalignment must be in [0, 0.5] positions",
               self.max_misalignment)
        _check(0.0 <= self.still_fraction <= 1.0, "still_fraction must be in [0, 1]", self.still_fraction)
        _check(0.0 < self.still_response <= 1.0, "still_response must be in (0, 1]", self.still_response)
        _check(_is_int(self.backoff_after) and self.backoff_after >= 1, "backoff_after must be a positive integer",
               self.backoff_after)
        _check(_is_int(self.max_backoff) and self.max_backoff >= 0, "max_backoff must be a non-negative integer",
               self.max_backoff)
        for name in ("speed_guard", "quality_guard", "background_update"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be True or False", getattr(self, name))
        _check(0.0 < self.target_agreement <= 1.0, "target_agreement must be in (0, 1]", self.target_agreement)
        _check(self.target_error is None or self.target_error > 0, "target_error must be > 0 or None",
               self.target_error)
        _check(self.near_tie >= 0, "near_tie must be >= 0", self.near_tie)
        _check(_is_int(self.trust_after) and self.trust_after >= 1, "trust_after must be a positive integer",
               self.trust_after)
        _check(_is_int(self.audit_interval) and self.audit_interval >= 1, "audit_interval must be a positive integer",
               self.audit_interval)
        _check(0.0 <= self.min_saving < 1.0, "min_saving must be in [0, 1)", self.min_saving)
        _check(isinstance(self.sampled_audits, bool), "sampled_audits must be True or False", self.sampled_audits)
        _check(0.0 < self.sample_budget <= 1.0, "sample_budget must be in (0, 1]", self.sample_budget)
        _check(self.sample_tolerance >= 1.0, "sample_tolerance must be >= 1", self.sample_tolerance)
        _check(0.0 <= self.oracle_sample <= 1.0, "oracle_sample must be in [0, 1]", self.oracle_sample)
        _check(_is_int(self.sample_seed) and self.sample_seed >= 0, "sample_seed must be a non-negative integer",
               self.sample_seed)
        _check(self.keep_stats is None or (_is_int(self.keep_stats) and self.keep_stats >= 1),
               "keep_stats must be a positive integer or None", self.keep_stats)
        for name in ("pixel_threshold", "max_ratio", "min_motion", "max_misalignment", "still_fraction",
                     "still_response", "target_agreement", "near_tie", "min_saving", "oracle_sample",
                     "sample_budget", "sample_tolerance"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.target_error is not None:
            object.__setattr__(self, "target_error", float(self.target_error))
        for name in ("cell", "keyframe_interval", "backoff_after", "max_backoff", "audit_interval", "sample_seed",
                     "trust_after"):
            object.__setattr__(self, name, int(getattr(self, name)))
        if self.keep_stats is not None:
            object.__setattr__(self, "keep_stats", int(self.keep_stats))
        _check(self.opencv_threads is None or (_is_int(self.opencv_threads) and self.opencv_threads >= 1),
               "opencv_threads must be a positive integer or None", self.opencv_threads)
        if self.opencv_threads is not None:
            object.__setattr__(self, "opencv_threads", int(self.opencv_threads))

    @property
    def first_audit_interval(self) -> int:
        """``audit_interval``, shortened to ``keyframe_interval`` when that is shorter (audits are keyframes: none
        can be further apart than the keyframes themselves)."""
        if self.keyframe_interval:
            return min(self.audit_interval, self.keyframe_interval)
        return self.audit_interval
    @property
    def every_frame_full(self) -> bool:
        """A keyframe on every frame: the cache is never used (plain inference, no audits)."""
        return self.keyframe_interval == 1

    @property
    def still_feature_threshold(self) -> float:
        """The feature threshold of frames where the camera did not move."""
        return self.STILL_FEATURE_THRESHOLD if self.feature_threshold is None else float(self.feature_threshold)

    @property
    def moving_feature_threshold(self) -> float:
        """The feature threshold of frames where the camera moved."""
        return 0.0 if self.feature_threshold is None else float(self.feature_threshold)

    @property
    def matcher_settings(self) -> MatcherSettings:
        """The keypoint matcher's settings: :class:`MatcherSettings` with ``matcher`` and ``matcher_options``.

        Raises:
            TypeError: an option :class:`MatcherSettings` does not have.
        """
        names = {f.name for f in dataclasses.fields(MatcherSettings)} - {"matcher"}
        unknown = sorted(set(self.matcher_options) - names)
        if unknown:
            raise TypeError(f"unknown matcher option(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}")
        return MatcherSettings(matcher=self.matcher, **self.matcher_options)

    @classmethod
    def build(cls, config: StreamConfig | None = None, **settings: Any) -> StreamConfig:
        """``config`` (default: the defaults) with ``settings`` replaced.

        Raises:
            TypeError: a setting this class does not have (the message lists the valid ones).
            ValueError: a setting out of range.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise TypeError(f"unknown stream setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}")
        return dataclasses.replace(config or cls(), **settings)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) or (isinstance(value, float) and value.is_integer())


def _check(ok: bool, message: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{message}, got {value!r}")
