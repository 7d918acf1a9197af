"""What an offloading session did per frame, and the bounded log that keeps it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, SupportsIndex

from incrinf.offload.policy import Option


class FrameLog(list):
    """A list of per-frame records that keeps only the newest ``maxlen`` (None: all).

    A camera stream never ends: an unbounded log grows by a record per frame (about 0.7 KB) for as long as the
    process lives. Old records are dropped in chunks of a tenth of ``maxlen``, so appending stays O(1)
    amortised; between drops the log holds up to ``1.1 * maxlen`` records. Indexing and slicing work as on a
    list (index 0 is the oldest record kept); each record's own ``index`` field is its frame number.

    Args:
        maxlen: records kept, >= 1, or None.
        items: initial records.

    Attributes:
        dropped: records dropped so far (``dropped + len(log)`` frames were logged).
    """

    def __init__(self, maxlen: int | None = None, items: Iterable[Any] = ()) -> None:
        if maxlen is not None and maxlen < 1:
            raise ValueError(f"maxlen must be >= 1 or None, got {maxlen}")
        super().__init__(items)
        self.maxlen = maxlen
        self.dropped = 0
        self._trim()

    def append(self, item: Any) -> None:
        super().append(item)
        self._trim()

    def extend(self, items: Iterable[Any]) -> None:
        super().extend(items)
        self._trim()

    def insert(self, index: SupportsIndex, item: Any) -> None:
        super().insert(index, item)
        self._trim()

    def _trim(self) -> None:
        if self.maxlen is None or len(self) <= self.maxlen + self.maxlen // 10:
            return
        excess = len(self) - self.maxlen
        del self[:excess]
        self.dropped += excess


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
