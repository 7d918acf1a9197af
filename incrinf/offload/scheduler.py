"""Cache-aware scheduling: per frame, local or offloaded or split execution, with or without cache.

Options (:class:`~incrinf.offload.policy.Option`; CacheInf, ``seeds/000`` and ANCHORS.md):

- ``local_full``: the whole model on the client.
- ``local_cached``: the client's incremental stream session (recomputes the changed fraction ``x``).
- ``offload_full``: send the frame, the server runs the model.
- ``offload_changed_pixels``: send only the changed tiles + homography; the server rebuilds the frame from its
  reference copy and runs the whole model (uplink bytes ~ ``x`` x frame bytes).
- ``hybrid`` at a split node: the client runs the graph up to the node, the server the rest.

Cost model, per option, in seconds (every term is measured, none is a constant of the code):

- local compute: the client's per-node times (:class:`~incrinf.offload.timing.NodeTimes`, times the emulated
  slowdown), times an online correction (EWMA of actual / timed); cached local compute is CacheInf's
  ``x * T(before cache point) + T(after)``, times its own learned correction;
- server compute: the server's per-node times (``GET /profile``), corrected by the compute times it reports;
- network: :class:`~incrinf.offload.client.LinkEstimator` (RTT and bandwidth from real transfers) applied to
  the option's payload: frame bytes, ``x`` x frame bytes + boxes, or the split tensor's bytes, plus output;
- client overheads of offloading (encoding, matching + change mask for ``offload_changed_pixels``): EWMA of
  measured values;
- ``x``: the predicted recompute fraction, an EWMA of the fractions recently measured on the chosen side.

Switching into an option that keeps state costs one rebuild: its first frame is a full one (full local
inference, or a full frame upload). Hysteresis (:meth:`Scheduler.decide`): leave the current option only when
the predicted saving over a look-ahead window of ``lookahead`` frames exceeds the switching cost plus a margin;
if the current option becomes unavailable (server down) the best available one is taken at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from incrinf.graph import SplitPoint
from incrinf.offload.policy import LOCAL_FULL, SINGLE_OPTIONS, Option, Policy, hybrid
from incrinf.offload.timing import NodeTimes


class Ewma:
    """Exponentially weighted moving average with a prior value.

    Args:
        value: prior.
        alpha: weight of each new sample.
        lo: lower clamp of samples.
        hi: upper clamp of samples.
    """

    def __init__(self, value: float, alpha: float = 0.3, lo: float = -math.inf, hi: float = math.inf) -> None:
        self.value, self.alpha, self.lo, self.hi = value, alpha, lo, hi
        self.count = 0

    def add(self, sample: float) -> float:
        if math.isfinite(sample):
            sample = min(self.hi, max(self.lo, sample))
            self.value = sample if self.count == 0 and self.alpha >= 1 else \
                (1 - self.alpha) * self.value + self.alpha * sample
            self.count += 1
        return self.value


@dataclass(frozen=True)
class Prediction:
    """Predicted time of one option for the next frame, by part (seconds)."""

    local: float
    network: float
    server: float
    overhead: float

    @property
    def total(self) -> float:
        return self.local + self.network + self.server + self.overhead


@dataclass
class Decision:
    """The scheduler's choice for one frame.

    Attributes:
        option: the chosen option.
        reason: why, in words.
        predictions: option -> predicted seconds of every option considered (available ones).
        switch_cost: predicted extra seconds of switching into ``option`` (cache rebuild), 0 if staying.
    """

    option: Option
    reason: str
    predictions: dict[Option, float] = field(default_factory=dict)
    switch_cost: float = 0.0

    @property
    def predicted(self) -> float:
        return self.predictions.get(self.option, math.nan)


@dataclass
class Payloads:
    """Bytes each option moves (request + response, without HTTP overhead).

    Attributes:
        frame: bytes of one uint8 frame (H * W * C).
        output: bytes of the model output (float32).
        header: fixed per-request message overhead (headers, metadata, boxes).
        splits: split name -> float32 bytes of the tensor live there.
    """

    frame: int
    output: int
    header: int = 600
    splits: dict[str, int] = field(default_factory=dict)

    def of(self, option: Option, x: float) -> float:
        if option.policy is Policy.OFFLOAD_FULL:
            return self.frame + self.output + self.header
        if option.policy is Policy.OFFLOAD_CHANGED_PIXELS:
            return x * self.frame + self.output + self.header + 64  # + boxes and the homography
        if option.policy is Policy.HYBRID:
            return self.splits[option.split] + self.output + self.header
        return 0.0


class CostModel:
    """Predicts each option's time from profiles, link estimates and online corrections.

    Args:
        local: the client's per-node times (already scaled by any emulated slowdown).
        server: the server's per-node times (from ``GET /profile``), or None without a server.
        payloads: bytes per option.
        splits: the hybrid split points considered.
        cache_point: index of the first node after which local caching stops paying (CacheInf's cache point:
            the first global node); ``x`` scales only the nodes up to it.
    """

    def __init__(self, local: NodeTimes, server: NodeTimes | None, payloads: Payloads,
                 splits: Iterable[SplitPoint] = (), cache_point: int | None = None) -> None:
        self.local = local
        self.server = server
        self.payloads = payloads
        self.splits = {s.name: s for s in splits}
        n = len(local.names)
        self.cache_point = n - 1 if cache_point is None else cache_point
        self.before = local.prefix(self.cache_point)
        self.after = local.suffix(self.cache_point)
        # Online corrections, actual / modelled, and measured client overheads.
        self.local_scale = Ewma(1.0, 0.3, 0.2, 5.0)
        self.cached_scale = Ewma(1.0, 0.3, 0.2, 10.0)
        self.server_scale = Ewma(1.0, 0.3, 0.05, 20.0)
        # per policy: every hybrid split shares one overhead (encoding the tensor)
        self.overhead = {Policy.OFFLOAD_FULL: Ewma(0.0005, 0.3, 0.0),
                         Policy.OFFLOAD_CHANGED_PIXELS: Ewma(0.0, 0.3, 0.0),
                         Policy.HYBRID: Ewma(0.0005, 0.3, 0.0), Policy.LOCAL_CACHED: Ewma(0.0, 0.3, 0.0)}

    def options(self) -> list[Option]:
        return [*SINGLE_OPTIONS, *(hybrid(name) for name in self.splits)]

    def local_cached_model(self, x: float) -> float:
        """Uncorrected local cached compute for change fraction ``x``."""
        return min(1.0, max(0.0, x)) * self.before + self.after

    def predict(self, option: Option, x: float, link) -> Prediction:
        """Predicted time of ``option`` with change fraction ``x`` on ``link`` (a ``LinkEstimator``)."""
        from incrinf.offload.client import HTTP_OVERHEAD_BYTES

        policy = option.policy
        if policy is Policy.LOCAL_FULL:
            return Prediction(self.local.full_seconds * self.local_scale.value, 0.0, 0.0, 0.0)
        if policy is Policy.LOCAL_CACHED:
            local = self.local_cached_model(x) * self.local_scale.value * self.cached_scale.value
            return Prediction(local, 0.0, 0.0, self.overhead[policy].value)
        if self.server is None:
            raise ValueError(f"option {option} needs the server's node times")
        network = link.predict(self.payloads.of(option, x) + HTTP_OVERHEAD_BYTES)
        if policy is Policy.HYBRID:
            index = self.splits[option.split].index
            return Prediction(self.local.prefix(index) * self.local_scale.value, network,
                              self.server.suffix(index) * self.server_scale.value, self.overhead[policy].value)
        return Prediction(0.0, network, self.server.full_seconds * self.server_scale.value,
                          self.overhead[policy].value)

    # --- learning ---------------------------------------------------------------------------------------

    def observe_local_full(self, seconds: float) -> None:
        self.local_scale.add(seconds / self.local.full_seconds)

    def observe_local_cached(self, seconds: float, x: float) -> None:
        modelled = self.local_cached_model(x) * self.local_scale.value
        if modelled > 0:
            self.cached_scale.add(seconds / modelled)

    def observe_server(self, seconds: float, option: Option) -> None:
        if self.server is None or seconds <= 0:
            return
        split = option.split
        modelled = self.server.suffix(self.splits[split].index) if split else self.server.full_seconds
        if modelled > 0:
            self.server_scale.add(seconds / modelled)

    def observe_overhead(self, option: Option, seconds: float) -> None:
        if option.policy in self.overhead:
            self.overhead[option.policy].add(seconds)


class Scheduler:
    """Chooses an option per frame from a :class:`CostModel`, with switching costs and hysteresis.

    Args:
        cost: the cost model.
        policy: a :class:`~incrinf.offload.policy.Policy` (or its name): ``auto`` chooses among every option,
            ``hybrid`` among the split nodes (or only ``split``), any other policy pins its option.
        split: the pinned split node of ``hybrid`` (one of the cost model's splits), or None.
        lookahead: frames over which a switch must pay off.
        margin: extra relative saving required to switch (fraction of the current option's time).
        x_alpha: EWMA weight of the change-fraction predictor.
        x_prior: predicted change fraction before any measurement.
    """

    def __init__(self, cost: CostModel, policy: Policy | str = Policy.AUTO, lookahead: int = 10, margin: float = 0.1,
                 x_alpha: float = 0.3, x_prior: float = 0.5, split: str | None = None) -> None:
        self.policy = Policy.of(policy)
        if split is not None and (self.policy is not Policy.HYBRID or split not in cost.splits):
            raise ValueError(f"split {split!r} is not one of the hybrid split nodes {list(cost.splits)}")
        self.split = split
        self.cost = cost
        self.lookahead = lookahead
        self.margin = margin
        # the recompute fraction predicted for each policy that keeps state
        self.x = {p: Ewma(x_prior, x_alpha, 0.0, 1.0) for p in Policy if p.keeps_state}
        self.current: Option | None = None
        self.warm: set[Option] = set()  # options that keep state and hold the previous frame

    @property
    def deciding(self) -> bool:
        """Whether more than one option is a candidate (``auto``, or ``hybrid`` without a pinned split)."""
        return self.policy is Policy.AUTO or (self.policy is Policy.HYBRID and self.split is None)

    def predicted_x(self, option: Option) -> float:
        return self.x[option.policy].value if option.keeps_state else 1.0

    def predictions(self, link, server_up: bool, offload_limit: float = math.inf) -> dict[Option, float]:
        """Predicted seconds of every available option; offload options predicted to take longer than
        ``offload_limit`` (the request timeout: they would time out) are left out."""
        out = {}
        for option in self._candidates(server_up):
            seconds = self.cost.predict(option, self.predicted_x(option), link).total
            if not (option.offloads and seconds > offload_limit):
                out[option] = seconds
        return out

    def _candidates(self, server_up: bool) -> list[Option]:
        if self.policy is Policy.AUTO:
            options = self.cost.options()
        elif self.policy is Policy.HYBRID:
            options = [hybrid(self.split)] if self.split else [hybrid(name) for name in self.cost.splits]
        else:
            options = [Option(self.policy)]
        if not server_up or self.cost.server is None:
            options = [o for o in options if not o.offloads]
        return options

    def switch_cost(self, option: Option, predictions: dict[Option, float], link) -> float:
        """Extra seconds of entering ``option`` now: a rebuild when it keeps state and that state is cold."""
        if option in self.warm or not option.keeps_state:
            return 0.0
        full = predictions.get(option.rebuild)
        if full is None:
            full = self.cost.predict(option.rebuild, 1.0, link).total
        return max(0.0, full - predictions[option])

    def decide(self, link, server_up: bool, offload_limit: float = math.inf) -> Decision:
        """Choose the option for the next frame.

        Args:
            link: the client's ``LinkEstimator``.
            server_up: whether offloading may be tried now (the server is not in back-off).
            offload_limit: the offload request timeout; options predicted slower are not tried.
        """
        predictions = self.predictions(link, server_up, offload_limit)
        if not predictions:  # pinned to an offload option while the server is down or too slow
            predictions = {LOCAL_FULL: self.cost.predict(LOCAL_FULL, 1.0, link).total}
            why = "server down" if server_up is False else "predicted to exceed the timeout"
            return Decision(LOCAL_FULL, f"{self.policy.value} unavailable ({why}): local fallback", predictions)
        if not self.deciding:
            return Decision(next(iter(predictions)), "pinned by policy", predictions)
        w = self.lookahead
        costs = {o: self.switch_cost(o, predictions, link) if o != self.current else 0.0 for o in predictions}
        best = min(predictions, key=lambda o: w * predictions[o] + costs[o])
        if self.current not in predictions:
            why = "start" if self.current is None else f"{self.current} unavailable"
            return Decision(best, f"{why}: best over {w} frames", predictions, costs[best])
        if best == self.current:
            return Decision(best, "stay: best predicted", predictions)
        stay = w * predictions[self.current]
        move = w * predictions[best] + costs[best]
        if stay - move > self.margin * stay:
            return Decision(best, f"switch from {self.current}: {w}-frame saving {stay - move:.4f}s > "
                                  f"margin {self.margin * stay:.4f}s (rebuild {costs[best]:.4f}s)",
                            predictions, costs[best])
        return Decision(self.current, f"hold (hysteresis): {best} saves only {stay - move:.4f}s over {w} frames",
                        predictions)

    def committed(self, option: Option, warm_after: bool) -> None:
        """Record the option that actually ran; ``warm_after``: its state now holds this frame."""
        self.current = option
        self.warm = {option} if warm_after and option.keeps_state else set()

    def observe_x(self, option: Option, x: float) -> None:
        if option.keeps_state:
            self.x[option.policy].add(x)
