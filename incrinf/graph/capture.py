"""Capture: trace a model with ``torch.fx``, propagate shapes for one input shape, type every node.

Tracing patches process-wide state: while ``torch.fx`` traces, ``nn.Module.__call__`` and ``__getattr__`` are
replaced *for every thread*. Two things follow. Captures from several threads at once would corrupt each
other, so every trace holds one lock. And a thread that merely runs a model (any model) while another thread
traces would walk into the tracer: its calls would be recorded into the graph being traced and it would get
proxies back (both sides fail with ``Unexpected key ...`` errors). The tracer here therefore records only
calls from the thread that is tracing; every other thread's module calls and attribute reads pass through to
the real ones. :func:`captured_graph` keeps one graph per (model, input shape), shared read-only by
everything that runs that model.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import threading
import weakref
from typing import Any

import torch
import torch.fx
import torch.nn as nn
from torch.fx.passes.shape_prop import ShapeProp

from incrinf.errors import CaptureError
from incrinf.graph.classify import WINDOW_FUNCTIONS, WINDOW_MODULES, Classifier, preserves_shape
from incrinf.graph.nodes import Graph, Node, NodeKind

_TRACE_LOCK = threading.RLock()
_GRAPHS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, ...], Graph]] = weakref.WeakKeyDictionary()


def parse_input_shape(input_shape: Any) -> tuple[int, ...]:
    """The model input's shape without its batch axis, ``(C, *spatial)`` with 1-3 spatial axes, or a string
    ``"CxHxW"`` (``"CxL"``, ``"CxDxHxW"``), as ``(1, C, *spatial)``.

    Raises:
        ValueError: anything else.
    """
    if isinstance(input_shape, str):
        try:
            input_shape = tuple(int(p) for p in input_shape.lower().split("x"))
        except ValueError:
            raise ValueError(f"input_shape {input_shape!r} must look like 3x224x224") from None
    try:
        dims = tuple(int(d) for d in input_shape)
    except TypeError:
        raise ValueError(f"input_shape must be (C, *spatial), e.g. (3, 224, 224), got {input_shape!r}") from None
    if not 2 <= len(dims) <= 4 or min(dims) < 1:
        raise ValueError(f"input_shape must be (C, *spatial) without the batch axis, with 1-3 spatial axes and "
                         f"positive sizes, e.g. (3, 224, 224); got {input_shape!r}")
    return (1, *dims)


class _Tracer(torch.fx.Tracer):
    """Keeps modules that declare their own window geometry (``without_padding``) as leaves, and traces only
    the calls of the thread that runs :meth:`trace` (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._tracing_thread: int | None = None

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> torch.fx.Graph:
        self._tracing_thread = threading.get_ident()
        try:
            return super().trace(root, concrete_args)
        finally:
            self._tracing_thread = None

    def _foreign(self) -> bool:
        return threading.get_ident() != self._tracing_thread

    def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._foreign():  # another thread running a model during our trace: a plain call
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if self._foreign():
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return callable(getattr(m, "without_padding", None)) or super().is_leaf_module(m, module_qualified_name)


def trace(model: nn.Module) -> torch.fx.GraphModule:
    """Symbolically trace ``model`` (thread-safe).

    Raises:
        CaptureError: naming the construct ``torch.fx`` could not trace.
    """
    if isinstance(model, torch.fx.GraphModule):
        return model
    if not isinstance(model, nn.Module):
        raise CaptureError(f"expected a torch.nn.Module, got {type(model).__name__}")
    try:
        with _TRACE_LOCK:
            graph = _Tracer().trace(model)
            return torch.fx.GraphModule(model, graph, type(model).__name__)
    except Exception as exc:  # fx raises many types; all mean "cannot capture"
        raise CaptureError(
            f"torch.fx cannot trace {type(model).__name__}: {type(exc).__name__}: {exc}{_innermost_frame(exc)}. "
            "Data-dependent control flow (if/for on tensor values) and non-torch calls on tensors "
            "cannot be captured; wrap such code in a leaf module or make it shape-only."
        ) from exc


def _innermost_frame(exc: BaseException) -> str:
    tb, last = exc.__traceback__, None
    while tb is not None:
        if "torch/fx" not in tb.tb_frame.f_code.co_filename:
            last = tb
        tb = tb.tb_next
    if last is None:
        return ""
    code = last.tb_frame.f_code
    return f" (in {code.co_name}, {code.co_filename}:{last.tb_lineno})"


def has_windows(model: nn.Module) -> bool:
    """Whether the traced model calls any convolution or pooling window, without capturing it for a shape.

    Raises:
        CaptureError: the model cannot be traced.
    """
    gm = trace(model)
    for fx_node in gm.graph.nodes:
        if fx_node.op == "call_module" and isinstance(gm.get_submodule(str(fx_node.target)), WINDOW_MODULES):
            return True
        if fx_node.op == "call_function" and fx_node.target in WINDOW_FUNCTIONS:
            return True
    return False


def capture(model: nn.Module, input_shape: Any) -> Graph:
    """Trace ``model`` and type every node for one input shape.

    Args:
        model: any ``nn.Module`` that ``torch.fx`` can trace. It is put in eval mode.
        input_shape: the input's shape without the batch axis, ``(C, *spatial)`` (1-3 spatial axes), or
            ``"CxHxW"``.

    Returns:
        The typed :class:`Graph` (input shape ``(1, C, *spatial)``).

    Raises:
        CaptureError: the model cannot be traced or fails on an input of that shape.
        ValueError: malformed ``input_shape``.
    """
    shape = parse_input_shape(input_shape)
    if not isinstance(model, nn.Module):
        raise CaptureError(f"expected a torch.nn.Module, got {type(model).__name__}")
    model.eval()  # before tracing: some ops (stochastic depth) bake the training flag into the graph
    gm = trace(model)
    gm.eval()
    param = next(iter(gm.parameters()), None)
    example = torch.zeros(shape, dtype=param.dtype if param is not None else torch.float32,
                          device=param.device if param is not None else "cpu")
    if not _propagate_fake(gm, example):
        try:
            with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):  # ShapeProp prints what it re-raises
                ShapeProp(gm).propagate(example)
        except Exception as exc:
            cause = exc.__cause__ or exc  # ShapeProp wraps the model's own error in one naming the fx node
            raise CaptureError(f"the model fails on an input of shape {shape} ({len(shape) - 2} spatial axes; "
                               f"input_shape is (C, *spatial) without the batch axis): {type(cause).__name__}: "
                               f"{cause}") from exc
    classifier = Classifier(gm, len(shape) - 2)
    nodes = [classifier.classify(fx_node) for fx_node in gm.graph.nodes]
    n_inputs = sum(n.kind == NodeKind.INPUT for n in nodes)
    if n_inputs != 1:
        raise CaptureError(f"expected a model with one input tensor, found {n_inputs}")
    return Graph(gm, nodes, shape, _signature(nodes, shape))


class _FakeShapes(ShapeProp):
    """Shape propagation on fake tensors over the real module: parameters become fake as operators read them
    (``ShapeProp``'s own fake mode first deep-copies the whole module into fake tensors)."""

    def __init__(self, gm: torch.fx.GraphModule, mode: Any) -> None:
        torch.fx.Interpreter.__init__(self, gm)
        self.fake_module = None
        self.fake_mode = mode
        self.real_module = self.module

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        # shape-preserving modules (batch norms, activations) pass their input through: dispatching them on fake
        # tensors costs about a millisecond each and tells nothing new
        module = self.fetch_attr(target)
        if preserves_shape(module) and len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
            return args[0]
        return super().call_module(target, args, kwargs)


def _propagate_fake(gm: torch.fx.GraphModule, example: torch.Tensor) -> bool:
    """Shapes for every node from fake tensors (no arithmetic: a 3-D network's forward pass is seconds of a
    capture otherwise); False when some operator has no fake implementation (the caller then runs the real
    forward pass, which also words the error when the model fails on this shape)."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):  # ShapeProp prints what it re-raises
            _FakeShapes(gm, mode).propagate(example)
    except Exception:  # any failure of the fake path (unsupported op, the model's own error): run it for real
        for fx_node in gm.graph.nodes:
            fx_node.meta.pop("tensor_meta", None)
        return False
    return True


def captured_graph(model: nn.Module, input_shape: Any) -> Graph:
    """:func:`capture`, kept per model object and input shape: one graph per model, shared read-only."""
    shape = parse_input_shape(input_shape)
    with _TRACE_LOCK:
        per_model = _GRAPHS.setdefault(model, {})
        graph = per_model.get(shape)
        if graph is None:
            graph = per_model[shape] = capture(model, shape[1:])
        return graph


def forget_graphs(model: nn.Module) -> None:
    """Drop the graphs kept for ``model`` (call after changing its structure in place)."""
    with _TRACE_LOCK:
        _GRAPHS.pop(model, None)


def _signature(nodes: list[Node], shape: tuple[int, ...]) -> str:
    """Structure-and-shape hash: two models of one architecture share it (weights do not enter)."""
    h = hashlib.sha1(repr(shape).encode())
    for n in nodes:
        h.update(repr((n.name, n.kind.value, n.op, n.inputs, n.shape, n.geometry, n.shift)).encode())
    return h.hexdigest()[:16]

