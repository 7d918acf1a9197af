"""incrinf: incremental CNN inference for occlusion explanations and camera streams.

Entry points: :func:`analyze` (theoretical speedup), :func:`occlusion` (heat maps) and :func:`tune`,
``incrinf.captum`` (Captum drop-ins), :class:`StreamSession` (camera streams) with :class:`StreamConfig`,
:class:`OffloadingSession` (streams with an offload server), :func:`runtime_cache` (plan cache),
:func:`capture` (the typed graph), and the submodules ``incrinf.models`` (zoo) and ``incrinf.kernels``.
Everything beyond the occlusion path loads on first use, so ``import incrinf`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

from incrinf.analysis import AnalysisReport, analyze
from incrinf.cache import LookupStatus, RuntimeCache, make_key, runtime_cache
from incrinf.errors import CaptureError, MissingExtraError
from incrinf.explain.approx import occlusion
from incrinf.explain.drilldown import DrillDown
from incrinf.explain.occlusion import OcclusionResult
from incrinf.explain.tuning import TuningProfile, tune
from incrinf.graph import Graph, NodeKind, capture

__version__ = "0.1.0"

# name -> (module, attribute or None for the module itself): loaded on first use (PEP 562)
_LAZY = {
    "StreamSession": ("incrinf.stream.session", "StreamSession"),
    "StreamConfig": ("incrinf.stream.config", "StreamConfig"),
    "OffloadingSession": ("incrinf.offload.session", "OffloadingSession"),
    "QuantizedDepthwiseConv2d": ("incrinf.kernels.quantized_module", "QuantizedDepthwiseConv2d"),
    "depthwise_conv2d_int8": ("incrinf.kernels.depthwise_int8", "depthwise_conv2d_int8"),
    "models": ("incrinf.models", None),
    "captum": ("incrinf.captum", None),
    "kernels": ("incrinf.kernels", None),
    "stream": ("incrinf.stream", None),
    "offload": ("incrinf.offload", None),
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


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'incrinf' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    return value if attr is None else getattr(value, attr)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
