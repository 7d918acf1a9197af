"""Offload server settings: one frozen, validated configuration for :class:`~incrinf.offload.server.OffloadServer`
and ``incrinf serve``.

Safe by default: the server binds loopback; binding any other interface needs at least one token (or an explicit
``insecure=True``); TLS is on when a certificate and key are given; every credential has a request rate and a
number of open stream caches it may use.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from incrinf.offload.credentials import check_token, is_loopback

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
