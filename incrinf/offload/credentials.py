"""Credentials and transport security of the offload link: bearer tokens, TLS contexts, loopback addresses.

Tokens reach a process three ways, in this order of preference: a token file (``incrinf serve --token-file``,
one token per line), the ``INCRINF_TOKEN`` environment variable (read by the server and by every client
constructor given no token), or a command-line argument, which every user of the machine can read in the
process list (``ps``), so the CLI warns about it.

TLS: the server loads a certificate chain and key (:func:`server_ssl_context`); clients verify the server's
certificate and host name by default against the system's trust store or a CA file (:func:`client_ssl_context`).
"""

from __future__ import annotations

import ipaddress
import os
import ssl
import stat
import warnings
from pathlib import Path
from urllib.parse import urlsplit

ENV_TOKEN = "INCRINF_TOKEN"


class InsecureTokenFile(UserWarning):
    """A token file that other users of the machine can read."""


def check_token(token: str) -> str:
    """``token`` if it can travel in an ``Authorization`` header: non-empty printable ASCII (spaces inside
    are fine), no leading or trailing whitespace.

    Raises:
        ValueError: anything else (the message never contains the token).
    """
    if not isinstance(token, str) or not token:
        raise ValueError("a token must be a non-empty string")
    if token != token.strip() or not all(" " <= ch <= "~" for ch in token):
        raise ValueError("a token must be printable ASCII without leading/trailing whitespace or control "
                         f"characters ({len(token)} characters given)")
    return token


def server_address(url: str) -> tuple[bool, str, int]:
    """``(tls, host, port)`` of an offload server's URL, ``http://host[:port]`` or ``https://host[:port]``.

    Raises:
        ValueError: another scheme, no host, or a bad port.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"offload URL must look like http://host:port or https://host:port, got {url!r}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"offload URL has a bad port: {url!r}") from None
    tls = parts.scheme == "https"
    return tls, parts.hostname, port or (443 if tls else 80)


def env_token() -> str | None:
    """The token in ``$INCRINF_TOKEN`` (None when unset or empty)."""
    value = os.environ.get(ENV_TOKEN, "").strip()
    return check_token(value) if value else None


def client_token(token: str | None) -> str | None:
    """The token a client sends: ``token`` if given, else ``$INCRINF_TOKEN``; ``""`` means none at all."""
    if token is None:
        return env_token()
    return check_token(token) if token else None


def read_token_file(path: str | os.PathLike) -> list[str]:
    """The tokens in a file, one per line (blank lines and lines starting with ``#`` are skipped).

    Warns (:class:`InsecureTokenFile`) when the group or others may read the file.

    Raises:
        FileNotFoundError: no such file. ValueError: no token in it, or a malformed one (named by line).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token file not found: {path}")
    if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        warnings.warn(f"token file {path} is readable by other users: chmod 600 it", InsecureTokenFile,
                      stacklevel=2)
    tokens = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            tokens.append(check_token(line))
        except ValueError as exc:
            raise ValueError(f"{path}, line {number}: {exc}") from None
    if not tokens:
        raise ValueError(f"token file {path} holds no token")
    return tokens


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` exposes the server to this machine only (127.0.0.0/8, ::1, ``localhost``).

    Any other name, and the wildcard addresses (``0.0.0.0``, ``::``, ``""``), count as public.
    """
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def server_ssl_context(cert_file: str | os.PathLike, key_file: str | os.PathLike) -> ssl.SSLContext:
    """A TLS server context (TLS 1.2 or newer) with the certificate chain and private key loaded.

    Raises:
        FileNotFoundError: a file is missing. ValueError: the files are not a matching PEM certificate and key.
    """
    for what, path in (("certificate", cert_file), ("key", key_file)):
        if not Path(path).is_file():
            raise FileNotFoundError(f"TLS {what} file not found: {path}")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(os.fspath(cert_file), os.fspath(key_file))
    except ssl.SSLError as exc:
        raise ValueError(f"cannot load TLS certificate {cert_file} with key {key_file}: {exc}") from None
    return context


def client_ssl_context(ca_file: str | os.PathLike | None = None, verify: bool = True) -> ssl.SSLContext:
    """A TLS client context: verifies the server's certificate and host name against ``ca_file`` (PEM) or the
    system's trust store; ``verify=False`` checks nothing (encryption without authentication: testing only).

    Raises:
        FileNotFoundError: ``ca_file`` is missing. ValueError: it holds no usable certificate.
    """
    if ca_file is not None and not Path(ca_file).is_file():
        raise FileNotFoundError(f"CA file not found: {ca_file}")
    try:
        context = ssl.create_default_context(cafile=os.fspath(ca_file) if ca_file is not None else None)
    except ssl.SSLError as exc:
        raise ValueError(f"cannot load CA file {ca_file}: {exc}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
