"""incrinf: incremental CNN inference for occlusion explanations and camera streams.

Entry points: :func:`analyze` (theoretical speedup), :func:`occlusion` (heat maps) and :func:`tune`,
``incrinf.captum`` and ``incrinf.monai`` (Captum and MONAI drop-ins), :class:`StreamSession` (camera streams)
with :class:`StreamConfig`, :class:`OffloadingSession` (streams with an offload server) with
:class:`OffloadConfig`, :func:`runtime_cache` (plan cache), :func:`capture` (the typed graph), and the
submodules ``incrinf.models`` (zoo) and ``incrinf.kernels``. Everything beyond the occlusion path loads on first
use, so ``import incrinf`` stays light.
"""

from __future__ import annotations

from incrinf.analysis import AnalysisReport, analyze
from incrinf.cache import LookupStatus, RuntimeCache, make_key, runtime_cache
from incrinf.errors import CaptureError, MissingExtraError
from incrinf.explain.drilldown import DrillDown
from incrinf.explain.occlusion import occlusion
from incrinf.explain.result import OcclusionResult, OcclusionStats
from incrinf.explain.tuning import tune
from incrinf.explain.tuning_profile import TuningProfile
from incrinf.graph import Graph, NodeKind, capture
from incrinf.lazy import lazy_exports

__version__ = "0.1.0"

# loaded on first use (a module path ending in ":" is the module itself)
_LAZY = {
    "StreamSession": "incrinf.stream.session",
    "StreamConfig": "incrinf.stream.config",
    "OffloadingSession": "incrinf.offload.session",
    "OffloadConfig": "incrinf.offload.config",
    "QuantizedDepthwiseConv2d": "incrinf.kernels.quantized_module",
    "depthwise_conv2d_int8": "incrinf.kernels.depthwise_int8",
    "explain_dataset": "incrinf.explain.dataset",
    "models": "incrinf.models:",
    "captum": "incrinf.captum:",
    "monai": "incrinf.monai:",
    "kernels": "incrinf.kernels:",
    "stream": "incrinf.stream:",
    "offload": "incrinf.offload:",
}

__all__ = [
    "AnalysisReport",
    "CaptureError",
    "DrillDown",
    "Graph",
    "LookupStatus",
    "MissingExtraError",
    "NodeKind",
    "OcclusionResult",
    "OcclusionStats",
    "RuntimeCache",
    "TuningProfile",
    "analyze",
    "capture",
    "make_key",
    "occlusion",
    "runtime_cache",
    "tune",
    *_LAZY,
]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
