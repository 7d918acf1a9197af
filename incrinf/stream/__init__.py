"""Camera streams: reuse the previous frame's computation through the frame-to-frame homography (CacheInf).

:class:`StreamSession` is the entry point; the other names are its parts (keypoint matching, warping, the change
mask, the sparse executor) plus video input and a synthetic camera with known motion. Names are imported on
first use, so ``import incrinf.offload.wire`` (say) does not pull in the model-side modules.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ChangeMask": "change_mask",
    "change_mask": "change_mask",
    "merge_cell_boxes": "change_mask",
    "DEFAULT_CELL": "defaults",
    "DEFAULT_THRESHOLD": "defaults",
    "DEFAULT_FEATURE_THRESHOLD": "defaults",
    "HomographyEstimator": "matching",
    "HomographyResult": "matching",
    "corner_distance": "matching",
    "estimate_homography": "matching",
    "scale_homography": "matching",
    "FrameStats": "session",
    "StreamSession": "session",
    "CacheMemory": "sparse",
    "ExecStats": "sparse",
    "SparseExecutor": "sparse",
    "SyntheticFrame": "synthetic",
    "synthetic_camera": "synthetic",
    "synthetic_scene": "synthetic",
    "BUNDLED_VIDEOS": "video",
    "bundled_video_path": "video",
    "read_frames": "video",
    "nearest_source_index": "warp",
    "warp_feature_map": "warp",
    "warp_feature_map_bilinear": "warp",
    "warp_image": "warp",
    "warp_valid_mask": "warp",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'incrinf.stream' has no attribute {name!r}")
    return getattr(importlib.import_module(f"incrinf.stream.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
