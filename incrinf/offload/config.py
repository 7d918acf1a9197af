"""Offload settings: one frozen, validated configuration for each end of the link.

:class:`OffloadConfig` configures the client, :class:`~incrinf.offload.session.OffloadingSession` (server address
and credentials, policy, scheduling, timeouts and back-off, the stream settings of its cached options).
:class:`ServerConfig` configures :class:`~incrinf.offload.server.OffloadServer` and ``incrinf serve``.

The server is safe by default: it binds loopback; binding any other interface needs at least one token (or an
explicit ``insecure=True``); TLS is on when a certificate and key are given; every credential has a request rate
and a number of open stream caches it may use.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from incrinf.offload.credentials import check_token, is_loopback, server_address
from incrinf.offload.policy import Policy
from incrinf.stream.config import StreamConfig

DEFAULT_MAX_REQUEST_BYTES = 16 << 20


@dataclass(frozen=True)
class ServerConfig:
    """How the offload server listens, authenticates and limits its clients.

    Attributes:
        host: interface to bind. Anything but loopback (127.0.0.0/8, ::1, ``localhost``) needs ``tokens``
            unless ``insecure``.
        port: TCP port, 0 for any free one.
        tokens: accepted bearer tokens, one per client or team (each is its own credential: its own caches,
            session cap and rate). Empty: no authentication. Never printed (``repr`` leaves them out).
        insecure: allow a public interface without tokens (anyone who can reach the port may use the server).
        tls_cert: PEM certificate chain; with ``tls_key`` the server speaks HTTPS only.
        tls_key: PEM private key of ``tls_cert``.
        max_request_bytes: larger request bodies get 413.
        workers: concurrent inference threads.
        requests_per_second: sustained requests per credential (0: no limit); beyond it 429 with ``Retry-After``.
        burst: requests a credential may send at once after being idle.
        sessions_per_token: open stream caches per credential (0: no limit beyond the service's total); beyond
            it ``POST /session`` gets 429 with ``Retry-After`` (when the credential's oldest idle cache expires).
    """

    host: str = "127.0.0.1"
    port: int = 0
    tokens: tuple[str, ...] = field(default=(), repr=False)
    insecure: bool = False
    tls_cert: str | None = None
    tls_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    workers: int = 2
    requests_per_second: float = 200.0
    burst: int = 400
    sessions_per_token: int = 32

    def __post_init__(self) -> None:
        tokens = (self.tokens,) if isinstance(self.tokens, str) else tuple(self.tokens or ())
        object.__setattr__(self, "tokens", tuple(dict.fromkeys(check_token(t) for t in tokens)))
        if not isinstance(self.host, str):
            raise ValueError(f"host must be a string, got {self.host!r}")
        if not (isinstance(self.port, int) and 0 <= self.port <= 65535):
            raise ValueError(f"port must be in 0..65535, got {self.port!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and its key (tls_cert and tls_key)")
        for name in ("max_request_bytes", "workers", "burst"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not (isinstance(self.sessions_per_token, int) and self.sessions_per_token >= 0):
            raise ValueError(f"sessions_per_token must be an integer >= 0 (0: no limit), "
                             f"got {self.sessions_per_token!r}")
        if not (self.requests_per_second >= 0 and math.isfinite(self.requests_per_second)):
            raise ValueError(f"requests_per_second must be a finite number >= 0 (0: no limit), "
                             f"got {self.requests_per_second!r}")
        if not self.public_ok:
            raise ValueError(f"refusing to serve on {self.host!r} without a token: anyone who can reach it could use "
                             "the server. Give tokens (a token file or $INCRINF_TOKEN), bind 127.0.0.1, or pass "
                             "insecure=True (--insecure) if the network is trusted")

    @property
    def public(self) -> bool:
        """Whether the server is reachable from other machines."""
        return not is_loopback(self.host)

    @property
    def public_ok(self) -> bool:
        return not self.public or bool(self.tokens) or self.insecure

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def limits_json(self) -> dict[str, Any]:
        """The limits as ``/health`` reports them (no secrets)."""
        return {"requests_per_second": self.requests_per_second, "burst": self.burst,
                "sessions_per_token": self.sessions_per_token, "max_request_bytes": self.max_request_bytes}

    @classmethod
    def build(cls, config: ServerConfig | None = None, *, token: str | None = None, **settings: Any) -> ServerConfig:
        """``config`` (default: the defaults) with ``settings`` replaced; ``token=`` is one token (``tokens``).

        Raises:
            TypeError: a setting this class does not have (the message lists the valid ones).
            ValueError: a setting out of range, or a public interface without a token.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise TypeError(f"unknown server setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}, "
                            "token")
        base = config or cls()
        if token:
            settings["tokens"] = (*settings.get("tokens", base.tokens), token)
        return dataclasses.replace(base, **settings)


@dataclass(frozen=True)
class OffloadConfig:
    """How an offloading session reaches its server and schedules its frames.

    Attributes:
        offload: URL of the offload server, ``http://host:port`` or ``https://host:port``; None: local only.
        policy: a :class:`~incrinf.offload.policy.Policy` or its name: ``"auto"`` (choose per frame) or one way
            for every frame (``"local_full"``, ``"local_cached"``, ``"offload_full"``,
            ``"offload_changed_pixels"``, ``"hybrid"``). Policies that offload need ``offload``.
        split: the node after which ``"hybrid"`` hands the model to the server; None: the best of the
            ``max_splits`` candidates, each frame. Only with ``policy="hybrid"``.
        token: bearer token of the server; None reads ``$INCRINF_TOKEN`` (unset: no token); ``""`` sends none.
            Never printed (``repr`` leaves it out).
        ca_file: PEM file of the authority that signed the server's TLS certificate (``https://`` servers;
            default: the system's trust store).
        verify: verify the server's TLS certificate and host name (keep True outside tests).
        input_size: (H, W) of the frames; None: the server's, else the zoo model's input size.
        mean: per-channel normalisation mean of uint8 frames; None: the zoo entry's for a model given by name,
            else the server's, else the camera-stream default (:data:`~incrinf.normalization.FRAME_MEAN`, the
            same as :class:`~incrinf.stream.StreamSession`'s).
        std: per-channel normalisation standard deviation, chosen the same way.
        budget: seconds a frame may take: offload timeouts leave enough of it for a local fallback (None:
            ``max_timeout`` only).
        max_timeout: longest offload request, seconds.
        local_slowdown: emulate a local device this many times slower (>= 1): every local computation sleeps
            ``local_slowdown - 1`` times its measured duration (benchmarks of a robot CPU).
        lookahead: frames over which a switch to another option must pay off (hysteresis).
        margin: relative saving over the current option that a switch needs.
        backoff_initial: first retry delay after a failed offload, seconds (doubling up to ``backoff_cap``).
        backoff_cap: longest retry delay, seconds.
        probe_interval: seconds between link probes while frames run locally (0: no probes).
        max_splits: split nodes ``"auto"`` and ``"hybrid"`` consider (those with the smallest tensors).
        timing_repeats: timed passes of the model when measuring its per-node times at start-up.
        keep_stats: per-frame records kept in ``session.stats`` (the newest; None: all). A stream never ends,
            and every record costs about 0.7 KB.
        stream: the camera-stream settings of the cached options
            (:class:`~incrinf.stream.config.StreamConfig`): change threshold and cell, ``max_ratio`` of changed
            cells from which a full frame is computed or sent, matcher, keyframe interval, and the local
            session's guards and feature threshold.
    """

    offload: str | None = None
    policy: Policy = Policy.AUTO
    split: str | None = None
    token: str | None = field(default=None, repr=False)
    ca_file: str | None = None
    verify: bool = True
    input_size: tuple[int, int] | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    budget: float | None = None
    max_timeout: float = 2.0
    local_slowdown: float = 1.0
    lookahead: int = 10
    margin: float = 0.1
    backoff_initial: float = 0.25
    backoff_cap: float = 8.0
    probe_interval: float = 0.25
    max_splits: int = 3
    timing_repeats: int = 5
    keep_stats: int | None = 1000
    stream: StreamConfig = field(default_factory=StreamConfig)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "policy", Policy.of(self.policy))
        if self.offload is not None:
            _check_url(self.offload)
        elif self.policy.offloads:
            raise ValueError(f"policy {self.policy.value!r} needs a server: give offload='http://host:port'")
        if self.split is not None:
            if not isinstance(self.split, str) or not self.split:
                raise ValueError(f"split must be a node name, got {self.split!r}")
            if self.policy is not Policy.HYBRID:
                raise ValueError(f"split is the hybrid policy's split node; policy is {self.policy.value!r}")
        if self.token:
            check_token(self.token)
        elif self.token is not None and self.token != "":
            raise ValueError("token must be a string")
        if self.ca_file is not None:
            if not isinstance(self.ca_file, (str, os.PathLike)):
                raise ValueError(f"ca_file must be a path, got {self.ca_file!r}")
            set_(self, "ca_file", os.fspath(self.ca_file))
            if self.offload is not None and not self.offload.startswith("https://"):
                raise ValueError("ca_file verifies an https:// server; the offload URL is not https")
        _check(isinstance(self.verify, bool), "verify must be True or False", self.verify)
        if self.input_size is not None:
            size = tuple(self.input_size) if isinstance(self.input_size, (tuple, list)) else ()
            _check(len(size) == 2 and all(_is_int(v) and v >= 1 for v in size),
                   "input_size must be (H, W), two positive integers", self.input_size)
            set_(self, "input_size", (int(size[0]), int(size[1])))
        for name in ("mean", "std"):
            value = getattr(self, name)
            if value is not None:
                values = tuple(value) if isinstance(value, (tuple, list)) else ()
                _check(bool(values) and all(_is_number(v) for v in values),
                       f"{name} must be one number per channel", value)
                set_(self, name, tuple(float(v) for v in values))
        _check(self.std is None or min(self.std) > 0, "std must be positive", self.std)
        _check(self.mean is None or self.std is None or len(self.mean) == len(self.std),
               "mean and std need the same number of channels", (self.mean, self.std))
        _check(self.budget is None or (_is_number(self.budget) and self.budget > 0),
               "budget must be > 0 seconds or None", self.budget)
        for name, lowest, strict in (("max_timeout", 0.0, True), ("local_slowdown", 1.0, False),
                                     ("margin", 0.0, False), ("backoff_initial", 0.0, True),
                                     ("probe_interval", 0.0, False)):
            value = getattr(self, name)
            ok = _is_number(value) and (value > lowest if strict else value >= lowest)
            _check(ok, f"{name} must be a number {'>' if strict else '>='} {lowest:g}", value)
            set_(self, name, float(value))
        _check(_is_number(self.backoff_cap) and self.backoff_cap >= self.backoff_initial,
               f"backoff_cap must be >= backoff_initial ({self.backoff_initial:g})", self.backoff_cap)
        set_(self, "backoff_cap", float(self.backoff_cap))
        for name, lowest in (("lookahead", 1), ("max_splits", 0), ("timing_repeats", 1)):
            value = getattr(self, name)
            _check(_is_int(value) and value >= lowest, f"{name} must be an integer >= {lowest}", value)
            set_(self, name, int(value))
        _check(self.keep_stats is None or (_is_int(self.keep_stats) and self.keep_stats >= 1),
               "keep_stats must be a positive integer or None (all)", self.keep_stats)
        _check(isinstance(self.stream, StreamConfig), "stream must be a StreamConfig", self.stream)

    @property
    def deciding(self) -> bool:
        """Whether the scheduler chooses among several options per frame (``auto``, or ``hybrid`` without a
        pinned split node)."""
        return self.policy is Policy.AUTO or (self.policy is Policy.HYBRID and self.split is None)

    @classmethod
    def build(cls, config: OffloadConfig | StreamConfig | None = None, **settings: Any) -> OffloadConfig:
        """``config`` (default: the defaults) with ``settings`` replaced. A setting of
        :class:`~incrinf.stream.config.StreamConfig` (``pixel_threshold=``, ``max_ratio=``, ...) replaces that field of
        :attr:`stream`; a ``StreamConfig`` given as ``config`` is taken as the stream settings.

        Raises:
            TypeError: a setting neither class has (the message lists the valid ones).
            ValueError: a setting out of range.
        """
        if isinstance(config, StreamConfig):
            config = cls(stream=config)
        elif config is not None and not isinstance(config, cls):
            raise TypeError(f"config must be an OffloadConfig (or a StreamConfig), got {type(config).__name__}")
        base = config or cls()
        if "profile_repeats" in settings:
            warnings.warn("profile_repeats is now called timing_repeats", DeprecationWarning, stacklevel=3)
            settings.setdefault("timing_repeats", settings.pop("profile_repeats"))
        own = {f.name for f in dataclasses.fields(cls)}
        stream_names = {f.name for f in dataclasses.fields(StreamConfig)}
        unknown = sorted(set(settings) - own - stream_names)
        if unknown:
            raise TypeError(f"unknown offload setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(own))}, "
                            "or any StreamConfig setting")
        stream = {k: settings.pop(k) for k in list(settings) if k in stream_names and k not in own}
        if stream:
            settings["stream"] = StreamConfig.build(settings.get("stream", base.stream), **stream)
        return dataclasses.replace(base, **settings)


def _check_url(url: Any) -> None:
    if not isinstance(url, str):
        raise ValueError(f"offload must be a URL string, got {type(url).__name__}")
    server_address(url)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, message: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{message}, got {value!r}")
