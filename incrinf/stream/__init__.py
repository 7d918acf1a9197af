"""Camera streams: reuse the previous frame's computation through the frame-to-frame homography (CacheInf).

:class:`StreamSession` is the entry point, configured by a :class:`StreamConfig`; :func:`read_frames` and
:func:`bundled_video_path` read videos. Offloading to a server is :class:`incrinf.offload.OffloadingSession`.
Names are imported on first use, so ``import incrinf.stream.config`` (say) stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Cause": "session",
    "FrameStats": "session",
    "StreamSession": "session",
    "StreamConfig": "config",
    "ChangeMask": "change_mask",
    "change_mask": "change_mask",
    "HomographyEstimator": "matching",
    "estimate_homography": "matching",
    "BUNDLED_VIDEOS": "video",
    "bundled_video_path": "video",
    "read_frames": "video",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'incrinf.stream' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"incrinf.stream.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
