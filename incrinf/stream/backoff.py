"""The back-off policy: after frames that tried the cache in vain, a stretch of plain frames that skip the attempt.

An attempt (the still-camera test, keypoint matching, the change mask, planning) that ends in a full frame is a
*miss*; so is an audited frame whose cached output missed the quality target, and a cached frame that did not beat
full inference (with the speed guard: its decision time and engine cost, the calibrated cost model's price of what it
computed, against the predicted full frame; without it, a
moving camera's frame that saved less than 1.25x of the multiply-adds). ``backoff_after`` misses in a row start a
stretch of frames that run plain inference without trying. Without the speed guard stretches double (2, 4, ...) up to
``max_backoff``. With it, a stretch starts only while the latest attempts saved nothing (misses that cost a few
milliseconds of decision each are worth it while the hits between them save a good part of a frame): the median
attempt's net saving, not the sum, so that one frame caught by a load spike (a cached frame of 97 ms against full
frames measured at 36 ms before the spike; a full frame then took 90 ms) does not outweigh the frames around it that
saved; and lasts just long enough for the attempt ending it to cost at most 2% of the stretch's time: doubling would
only delay noticing that the cache pays again.

A stretch started by a miss that the pixels told (the still-camera test and the frame quarters' shifts,
:meth:`~incrinf.stream.change_finder.ChangeFinder.rule_out`, measured a motion that misaligns the cache) ends on a
plain frame too: the probe after it asks the pixels again first, and the cache is refilled only when they cannot
tell; filling it for a probe that the pixels then rule out would cost the maps' writes for nothing.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from incrinf.stream.config import StreamConfig
from incrinf.stream.stats import Cause

# A moving camera's cached frame that computed more than 1 / this of the full multiply-adds counts as a miss
# (without the speed guard): under camera motion the change can reach nearly every position, and the bookkeeping
# then makes the frame slower than plain inference (measured: 1.7x slower on a panning 128 px synthetic camera).
MIN_SAVING = 1.25
# Attempts whose net seconds saved decide whether misses start a back-off (with the speed guard).
SAVINGS_WINDOW = 8
# Share of a back-off stretch's time that the attempt ending it may cost (with the speed guard).
ATTEMPT_BUDGET = 0.02


class BackOff:
    """Counts misses and runs back-off stretches (see the module docstring).

    Args:
        config: the session's settings (``backoff_after``, ``max_backoff``, ``speed_guard``).

    Attributes:
        misses: misses in a row.
        stretch: length of the current (or last) stretch, in frames.
        skip: frames of the current stretch still to run plain.
        pixel_probe: the previous frame ended a stretch that a miss told by the pixels started, without filling the
            cache: this frame's probe asks the pixels first.
    """

    def __init__(self, config: StreamConfig) -> None:
        self.config = config
        self.reset()

    def reset(self) -> None:
        self.misses = self.stretch = self.skip = 0
        self.pixel_probe = self._told_by_pixels = False
        self._savings: deque[float] = deque(maxlen=SAVINGS_WINDOW)

    @property
    def active(self) -> bool:
        """This frame belongs to a stretch: run it plain, without trying the cache."""
        return self.skip > 0

    def keeps_plain(self, pixels_first: bool = True) -> bool:
        """Whether this stretch frame need not fill the cache: more stretch frames follow, or it ends a stretch that a
        miss told by the pixels started and the probe after it asks the pixels first (``pixels_first``: the stream
        gives no homographies, which the probe would use with the cache instead)."""
        return self.skip > 1 or (self.skip == 1 and self._told_by_pixels and pixels_first)

    def paid(self, cause: Cause | None, attempt: bool, flops_saving: float, predicted_full: float, seconds: float,
             overhead: float, missed_audit: bool = False, warming: bool = False) -> bool | None:
        """Whether a frame that tried the cache paid for trying (None: it did not try).

        An audit (or near-tie check) that held is the quality guard's cost, no attempt; one that missed is a miss:
        the cached run was in vain (its output was replaced by full inference's), and it cost the decision and the
        cached run on top of the full frame.

        Args:
            cause: why the frame ran full, or None for a cached frame.
            attempt: the frame tried the cache (it was no first frame, keyframe, stretch frame ...).
            flops_saving: a moving camera's full / computed multiply-adds (``inf`` for a still camera).
            predicted_full: the predicted engine time of a full frame (NaN: unknown).
            seconds: the frame's decision time and engine cost (a cached run: the cost model's price of what it
                computed; an audit's full run excluded).
            overhead: the decision's time alone (what a miss cost).
            missed_audit: the frame was an audit whose cached output missed the target.
            warming: the first frame of its size to run the cached path: it pays one-time costs (its box shapes'
                kernels, the maps' first touches), so with the speed guard (which judges by time) it counts when
                it paid (a hit) and is no miss otherwise, its net saving left out (one such frame sized stretches
                of tens of frames on the still clips).
        """
        if not attempt or (cause == Cause.AUDIT and not missed_audit):
            return None
        if cause is not None:
            hit = False
        elif self.config.speed_guard:
            hit = not seconds >= predicted_full  # NaN (no prediction yet): paid
        else:
            hit = flops_saving >= MIN_SAVING
        if warming and self.config.speed_guard:  # judged by time: one-time costs are no miss
            return True if hit else None
        if self.config.speed_guard:
            net = -seconds if missed_audit else -overhead if cause is not None else predicted_full - seconds
            self._savings.append(0.0 if math.isnan(net) else net)
        return hit

    def count(self, cause: Cause | None, paid: bool | None, full_seconds: float, told_by_pixels: bool = False) -> None:
        """Take one frame's outcome (``paid`` from :meth:`paid`; ``full_seconds``: a full frame's time, which sizes
        a stretch with the speed guard; ``told_by_pixels``: a miss that the pixels alone ruled out)."""
        self.pixel_probe = False
        if paid:
            self.misses = self.stretch = self.skip = 0
        elif cause == Cause.BACKING_OFF:
            self.skip -= 1
            self.pixel_probe = self.skip == 0 and self._told_by_pixels
        elif paid is not None:
            self.misses += 1
            if not self._starts(self.misses, self._savings):
                return
            if not self.config.speed_guard:
                self.stretch = min(max(2 * self.stretch, 2), self.config.max_backoff)
            else:
                self.stretch = min(max(2, self._budgeted(full_seconds)), self.config.max_backoff)
            self.skip = self.stretch
            self._told_by_pixels = told_by_pixels

    def starts_with_miss(self, overhead: float) -> bool:
        """Whether one more miss, an attempt that ended in a full frame after ``overhead`` seconds of decision,
        would start a stretch (the frame after it then runs plain: the miss need not refill the cache)."""
        savings = list(self._savings)
        if self.config.speed_guard:
            savings.append(-overhead)
        return self._starts(self.misses + 1, savings[-SAVINGS_WINDOW:])

    def _starts(self, misses: int, savings: deque[float] | list[float]) -> bool:
        """Whether ``misses`` in a row, with the latest attempts' net ``savings``, start a stretch."""
        if not self.config.max_backoff or misses < self.config.backoff_after:
            return False
        # with the speed guard, the hits between the misses may pay for them
        return not (self.config.speed_guard and savings and statistics.median(savings) > 0)

    def _budgeted(self, full_seconds: float) -> int:
        """The shortest stretch whose one attempt at its end costs at most 2% of the stretch's time: the misses'
        measured overhead over 2% of a full frame's time."""
        misses = [-v for v in self._savings if v < 0]
        if not misses or not full_seconds > 0:
            return 0
        return int(math.ceil(statistics.median(misses) / (ATTEMPT_BUDGET * full_seconds)))
