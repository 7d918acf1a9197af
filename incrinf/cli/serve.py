"""``incrinf serve``: run the offload server for a zoo model."""

from __future__ import annotations

import argparse
import signal
import sys

from incrinf.cli.common import input_shape, non_negative, non_negative_int, positive_int


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    from incrinf.offload.config import DEFAULT_MAX_REQUEST_BYTES, ServerConfig

    defaults = ServerConfig()
    p.add_argument("--model", required=True, help="zoo model name (incrinf.models; an unknown name lists them)")
    p.add_argument("--weights", help="state-dict file for a torchvision architecture")
    p.add_argument("--input", type=input_shape, help="frame shape served, e.g. 3x128x128 (default: model's)")
    p.add_argument("--host", default="127.0.0.1",
                   help="interface to bind (default 127.0.0.1; any other needs a token or --insecure)")
    p.add_argument("--port", type=_port, default=8765, help="TCP port, 0 = any free one (default 8765)")
    auth = p.add_argument_group("authentication and TLS")
    auth.add_argument("--token-file", help="file of accepted bearer tokens, one per line, each its own credential "
                      "(default: $INCRINF_TOKEN; neither = no authentication)")
    auth.add_argument("--token", help="one accepted bearer token (visible in the process list: prefer --token-file "
                      "or $INCRINF_TOKEN)")
    auth.add_argument("--insecure", action="store_true",
                      help="allow a non-loopback --host without a token (anyone who reaches the port may use it)")
    auth.add_argument("--tls-cert", help="PEM certificate chain: serve HTTPS only (with --tls-key)")
    auth.add_argument("--tls-key", help="PEM private key of --tls-cert")
    limits = p.add_argument_group("limits")
    limits.add_argument("--rate", type=non_negative, default=defaults.requests_per_second,
                        help="requests per second per credential, beyond it 429 + Retry-After "
                        f"(default {defaults.requests_per_second:g}; 0 = no limit)")
    limits.add_argument("--burst", type=positive_int, default=defaults.burst,
                        help=f"requests a credential may send at once (default {defaults.burst})")
    limits.add_argument("--sessions-per-token", type=non_negative_int, default=defaults.sessions_per_token,
                        help=f"open stream caches per credential (default {defaults.sessions_per_token}; 0 = no limit)")
    limits.add_argument("--max-sessions", type=positive_int, default=256,
                        help="open stream caches in all (default 256; the least recently used is dropped)")
    limits.add_argument("--session-ttl", type=non_negative, default=600.0,
                        help="seconds before an idle stream cache expires (default 600)")
    limits.add_argument("--max-request-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="larger requests get 413 (default 16 MiB)")
    p.add_argument("--threads", type=positive_int, help="torch threads for inference")
    p.add_argument("--workers", type=positive_int, default=2, help="concurrent inference requests")
    p.add_argument("--timing-repeats", "--profile-repeats", dest="timing_repeats", type=positive_int, default=5,
                   help="timed passes when measuring the model's per-node times at start-up (default 5)")


def _warn(message: str) -> None:
    print(f"incrinf serve: warning: {message}", file=sys.stderr, flush=True)


def _tokens(args: argparse.Namespace) -> tuple[str, ...]:
    """The accepted tokens: ``--token-file`` and ``--token`` if given, else ``$INCRINF_TOKEN``."""
    import warnings

    from incrinf.offload.credentials import InsecureTokenFile, check_token, env_token, read_token_file

    tokens: list[str] = []
    if args.token_file:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", InsecureTokenFile)
            tokens += read_token_file(args.token_file)
        for warning in caught:
            _warn(str(warning.message))
    if args.token is not None:
        _warn("--token is visible to every user of this machine in the process list (ps); "
              "use --token-file or $INCRINF_TOKEN")
        tokens.append(check_token(args.token))
    if not tokens and env_token():
        tokens.append(env_token())
    return tuple(tokens)


def server_config(args: argparse.Namespace):
    """The :class:`~incrinf.offload.config.ServerConfig` of the command line, checked before the model loads.

    Raises:
        ValueError: a public interface without a token (and without --insecure), bad TLS files or limits.
    """
    from incrinf.offload.config import ServerConfig
    from incrinf.offload.credentials import server_ssl_context

    if args.session_ttl <= 0:
        raise ValueError("--session-ttl must be > 0 seconds")
    config = ServerConfig(host=args.host, port=args.port, tokens=_tokens(args), insecure=args.insecure,
                          tls_cert=args.tls_cert, tls_key=args.tls_key, max_request_bytes=args.max_request_bytes,
                          workers=args.workers, requests_per_second=args.rate, burst=args.burst,
                          sessions_per_token=args.sessions_per_token)
    if config.tls:
        server_ssl_context(config.tls_cert, config.tls_key)  # unreadable or mismatched files fail now
    if config.public and not config.tokens:
        _warn(f"serving {config.host} without a token (--insecure): anyone who can reach the port may use it")
    elif config.public and not config.tls:
        _warn("tokens cross the network in clear text: add --tls-cert and --tls-key")
    return config


def run(args: argparse.Namespace) -> int:
    config = server_config(args)
    import torch

    from incrinf import models
    from incrinf.offload.server import ModelService, OffloadServer

    if args.threads:
        torch.set_num_threads(args.threads)
    meta = models.info(args.model)
    shape = args.input or (3, meta.input_size, meta.input_size)
    model = models.load(args.model, args.weights)
    print(f"incrinf serve: timing {args.model} at {tuple(shape)} ...", flush=True)
    service = ModelService(model, shape, name=args.model, mean=meta.mean, std=meta.std,
                           timing_repeats=args.timing_repeats, max_sessions=args.max_sessions,
                           session_ttl=args.session_ttl)
    server = OffloadServer(service, config)

    # a stop request, not an exception: SIGTERM may arrive before serve_forever is inside its try block
    signal.signal(signal.SIGTERM, lambda signum, frame: server.request_stop())
    server.start()
    auth = f"bearer token required ({len(config.tokens)} accepted)" if config.tokens else "open: no token"
    full_ms = service.times.full_seconds * 1e3
    print(f"incrinf serve: {args.model} on {server.url} ({auth}; full model {full_ms:.1f} ms, "
          f"{torch.get_num_threads()} threads)", flush=True)
    server.serve_forever()
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to the main ``incrinf`` parser."""
    p = subparsers.add_parser(
        "serve", help="offload server for camera streams (full, cached, split inference)",
        description="Serve a zoo model to incrinf.OffloadingSession clients over HTTP(S): whole frames, changed "
                    "pixels against a per-camera cache, or the tail of a split model. Binds 127.0.0.1 unless "
                    "--host says otherwise.")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


if __name__ == "__main__":  # ``python -m incrinf.cli.serve ...``, as benchmarks/schedule.py starts the server
    from incrinf.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
