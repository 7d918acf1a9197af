"""The local side of an offloading session: the incremental :class:`~incrinf.stream.session.StreamSession` (or a
full-inference stand-in for models it cannot cache), and an emulated slower device."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from incrinf.normalization import Normalization
from incrinf.stream.config import StreamConfig


class SlowDevice:
    """Emulates a device ``slowdown`` times slower than this one: after each computation, sleep
    ``(slowdown - 1)`` times its measured duration.

    Args:
        slowdown: >= 1.
    """

    def __init__(self, slowdown: float = 1.0) -> None:
        if slowdown < 1:
            raise ValueError(f"slowdown must be >= 1, got {slowdown}")
        self.slowdown = slowdown

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.slowdown > 1:
                time.sleep((time.perf_counter() - t0) * (self.slowdown - 1))


class FullInferenceStandIn:
    """Stand-in for the local incremental session: plain full inference, recompute fraction 1.

    Args:
        model: the model.
        normalization: how frames become model inputs.
    """

    def __init__(self, model: nn.Module, normalization: Normalization) -> None:
        self.model, self.normalization = model, normalization

    @torch.no_grad()
    def __call__(self, frame: np.ndarray) -> torch.Tensor:
        return self.model(self.normalization.tensor(frame))

    def reset(self) -> None:
        pass

    @property
    def last_recompute_fraction(self) -> float:
        return 1.0

    @property
    def last_flops_ratio(self) -> float:
        return 1.0


class StreamSessionBackend:
    """Adapter over :class:`incrinf.stream.session.StreamSession` (the incremental local engine).

    The adapter reads only the session's newest stats record, so it keeps the session's list of them short
    (``StreamSession.stats`` grows by one record per frame).

    Args:
        factory: builds a fresh ``StreamSession`` (called again on :meth:`reset`).
    """

    _KEEP_STATS = 64

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.factory = factory
        self.session = factory()

    def __call__(self, frame: np.ndarray) -> torch.Tensor:
        output = self.session(frame)
        stats = getattr(self.session, "stats", None)
        if isinstance(stats, list) and len(stats) > 2 * self._KEEP_STATS:
            del stats[:-self._KEEP_STATS]
        return output

    def reset(self) -> None:
        reset = getattr(self.session, "reset", None)
        if callable(reset):
            reset()
        else:
            self.session = self.factory()

    def _last(self, field_name: str) -> float:
        stats = getattr(self.session, "stats", None)
        value = getattr(stats[-1], field_name, None) if stats else None
        return 1.0 if value is None else float(value)

    @property
    def last_recompute_fraction(self) -> float:
        return self._last("recompute_fraction")

    @property
    def last_flops_ratio(self) -> float:
        """Full FLOPs / computed FLOPs of the last frame (StreamSession's convention)."""
        return self._last("flops_ratio")


def local_backend(factory: Callable[[], Any] | None, model: nn.Module, input_size: tuple[int, int],
                   normalization: Normalization, config: StreamConfig, options: dict[str, Any] | None) -> Any:
    """The local cached engine: ``factory()`` if given, else the incremental ``StreamSession``, else the
    full-inference stand-in (models ``StreamSession`` cannot cache, e.g. without convolutions)."""
    if factory is not None:
        return StreamSessionBackend(factory)
    from incrinf.stream.session import StreamSession

    def build() -> Any:
        return StreamSession(model, config, input_size=input_size, mean=normalization.mean, std=normalization.std,
                             **(options or {}))

    try:
        return StreamSessionBackend(build)
    except (ValueError, TypeError):
        return FullInferenceStandIn(model, normalization)
