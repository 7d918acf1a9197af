"""Offloading camera-stream frames to a server: :class:`OffloadingSession` (client side, schedules every frame
among local, offloaded and hybrid execution), :class:`OffloadServer` / :class:`ModelService` (``incrinf
serve``). Needs the ``[serve]`` extra for the server (aiohttp)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "OffloadingSession": "session",
    "OffloadFrameStats": "session",
    "ModelService": "server",
    "OffloadServer": "server",
    "OffloadClient": "client",
    "OffloadError": "client",
    "RateLimited": "client",
    "ServerConfig": "config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'incrinf.offload' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"incrinf.offload.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
