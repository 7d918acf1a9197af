"""Command line: ``incrinf analyze | explain | tune | stream | serve`` (one module per subcommand)."""

from __future__ import annotations

import argparse
import sys

from incrinf.cli import analyze, explain, serve, stream, tune


def build_parser() -> argparse.ArgumentParser:
    """The ``incrinf`` parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="incrinf", description="Incremental CNN inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (analyze, explain, tune, stream, serve):
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``incrinf`` command: 0 on success, 2 on a reported error."""
    from incrinf.errors import CaptureError, MissingExtraError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, CaptureError, FileNotFoundError, RuntimeError, MissingExtraError) as exc:
        print(f"incrinf {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
