"""incrinf: incremental CNN inference for occlusion explanations and camera streams."""

from incrinf.errors import CaptureError

__all__ = ["CaptureError"]
__version__ = "0.1.0"
