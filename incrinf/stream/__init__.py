"""Camera streams: reuse the previous frame's computation through the frame-to-frame homography (CacheInf).

:class:`StreamSession` is the entry point, configured by a :class:`StreamConfig`; :func:`read_frames` and
:func:`bundled_video_path` read videos. Offloading to a server is :class:`incrinf.offload.OffloadingSession`.
Names are imported on first use, so ``import incrinf.stream.config`` (say) stays light.
"""

from incrinf.lazy import lazy_exports

_EXPORTS = {
    "Cause": ".stats",
    "FrameStats": ".stats",
    "FrameTimes": ".stats",
    "StreamSession": ".session",
    "StreamConfig": ".config",
    "ChangeMask": ".change_mask",
    "change_mask": ".change_mask",
    "HomographyEstimator": ".matching",
    "estimate_homography": ".matching",
    "BUNDLED_VIDEOS": ".video",
    "bundled_video_path": ".video",
    "read_frames": ".video",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
