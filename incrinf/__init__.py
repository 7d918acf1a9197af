"""incrinf: incremental CNN inference for occlusion explanations and camera streams.

Public API: :func:`analyze` (theoretical speedup), :func:`occlusion` (heat maps), ``incrinf.captum.Occlusion``
(Captum drop-in), :class:`RuntimeCache` / :func:`runtime_cache` (plan cache), ``incrinf.models`` (zoo).
"""

from incrinf.analysis import AnalysisReport, analyze
from incrinf.cache import LookupStatus, RuntimeCache, make_key, runtime_cache
from incrinf.errors import CaptureError
from incrinf.explain.approx import occlusion
from incrinf.explain.drilldown import DrillDown
from incrinf.explain.occlusion import OcclusionResult
from incrinf.explain.tuning import TuningProfile, tune
from incrinf.graph import Graph, NodeKind, capture

__all__ = [
    "AnalysisReport",
    "CaptureError",
    "DrillDown",
    "Graph",
    "LookupStatus",
    "NodeKind",
    "OcclusionResult",
    "RuntimeCache",
    "TuningProfile",
    "analyze",
    "capture",
    "make_key",
    "occlusion",
    "runtime_cache",
    "tune",
]
__version__ = "0.1.0"

# Imported on first use: they pull in numba / OpenCV, which plain OBE users do not need.
_LAZY = {
    "StreamSession": ("incrinf.stream.session", "StreamSession"),
    "QuantizedDepthwiseConv2d": ("incrinf.quantized", "QuantizedDepthwiseConv2d"),
    "depthwise_conv2d_int8": ("incrinf.kernels", "depthwise_conv2d_int8"),
    "explain_dataset": ("incrinf.explain.dataset", "explain_dataset"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'incrinf' has no attribute {name!r}")
