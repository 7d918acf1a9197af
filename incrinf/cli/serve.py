"""``incrinf serve``: run the offload server for a zoo model."""

from __future__ import annotations

import argparse
import os
import signal

from incrinf.cli.common import input_shape, positive_int


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="zoo model name (incrinf.models)")
    p.add_argument("--weights", help="state-dict file for a torchvision architecture")
    p.add_argument("--input", type=input_shape, help="frame shape served, e.g. 3x128x128 (default: model's)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1; no TLS)")
    p.add_argument("--port", type=_port, default=8765, help="TCP port, 0 = any free one (default 8765)")
    p.add_argument("--token", default=os.environ.get("INCRINF_TOKEN"),
                   help="bearer token required from clients (default: $INCRINF_TOKEN; none = open)")
    p.add_argument("--max-request-bytes", type=positive_int, default=16 << 20,
                   help="larger requests get 413 (default 16 MiB)")
    p.add_argument("--threads", type=positive_int, help="torch threads for inference")
    p.add_argument("--workers", type=positive_int, default=2, help="concurrent inference requests")
    p.add_argument("--profile-repeats", type=positive_int, default=5, help="timed passes of the start-up profile")


def run(args: argparse.Namespace) -> int:
    import torch

    from incrinf import models
    from incrinf.offload.server import ModelService, OffloadServer

    if args.threads:
        torch.set_num_threads(args.threads)
    meta = models.info(args.model)
    shape = args.input or (3, meta.input_size, meta.input_size)
    model = models.load(args.model, args.weights)
    print(f"incrinf serve: profiling {args.model} at {tuple(shape)} ...", flush=True)
    service = ModelService(model, shape, name=args.model, mean=meta.mean, std=meta.std,
                           profile_repeats=args.profile_repeats)
    server = OffloadServer(service, host=args.host, port=args.port, token=args.token,
                           max_request_bytes=args.max_request_bytes, workers=args.workers)

    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    server.start()
    auth = "bearer token required" if args.token else "open: no token"
    full_ms = service.profile.full_seconds * 1e3
    print(f"incrinf serve: {args.model} on {server.url} ({auth}; full model {full_ms:.1f} ms, "
          f"{torch.get_num_threads()} threads)", flush=True)
    server.serve_forever()
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to the main ``incrinf`` parser."""
    p = subparsers.add_parser("serve", help="offload server for camera streams (full, cached, split inference)")
    add_arguments(p)
    p.set_defaults(func=run)
    return p

