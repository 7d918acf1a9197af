"""What an offloading session did per frame, and the bounded log that keeps it (the stream's
:class:`~incrinf.stream.stats.FrameLog`)."""

from __future__ import annotations

from dataclasses import dataclass

from incrinf.offload.policy import Option
from incrinf.stream.stats import FrameLog

__all__ = ["FrameLog", "OffloadFrameStats"]


@dataclass
class OffloadFrameStats:
    """What happened to one frame.

    Attributes:
        index: frame number (0-based).
        mode: the :class:`~incrinf.offload.policy.Option` that produced the output (``local_full`` after a
            failed offload); ``mode.policy`` is a :class:`~incrinf.offload.policy.Policy`, ``mode.split`` the
            split node of a hybrid frame.
        chosen: the option the scheduler chose.
        reason: why it was chosen (and why it fell back, if it did).
        predictions: predicted seconds of every option considered.
        predicted_seconds: the prediction for ``chosen``.
        seconds: actual wall time of the frame.
        fallback: an offload failed and the frame was computed locally.
        error: the offload error, if any.
        recompute_fraction: changed share of the frame (cached options; 1 for full work).
        flops_ratio: full FLOPs / computed FLOPs reported by the local cached session (None otherwise).
        bytes_up: request bytes (0 for local).
        bytes_down: response bytes.
        server_seconds: server compute time reported.
        full_upload: an ``offload_changed_pixels`` frame that had to send the whole frame (the server's
            reference rebuilt).
    """

    index: int
    mode: Option
    chosen: Option
    reason: str
    predictions: dict[Option, float]
    predicted_seconds: float
    seconds: float
    fallback: bool = False
    error: str | None = None
    recompute_fraction: float | None = None
    flops_ratio: float | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    server_seconds: float = 0.0
    full_upload: bool = False
