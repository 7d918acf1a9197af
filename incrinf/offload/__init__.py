"""Offloading camera-stream frames to a server: :class:`OffloadingSession` (client side, schedules every frame
among local, offloaded and hybrid execution, configured by an :class:`OffloadConfig` with a :class:`Policy`),
:class:`OffloadServer` / :class:`ModelService` (``incrinf serve``, configured by a :class:`ServerConfig`). Needs
the ``[serve]`` extra for the server (aiohttp)."""

from incrinf.lazy import lazy_exports

_EXPORTS = {
    "OffloadingSession": ".session",
    "OffloadFrameStats": ".session",
    "ModelService": ".server",
    "OffloadServer": ".server",
    "OffloadClient": ".client",
    "OffloadError": ".client",
    "RateLimited": ".client",
    "ServerConfig": ".config",
    "OffloadConfig": ".config",
    "Policy": ".policy",
    "Option": ".policy",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
