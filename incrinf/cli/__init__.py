"""Command line: ``incrinf analyze | explain | tune | stream | serve`` (one module per subcommand)."""

from __future__ import annotations

import argparse
import sys

from incrinf.cli import analyze, explain, serve, stream, tune

_DESCRIPTION = """\
Incremental CNN inference: when an input changes only locally (an occluded patch, a
camera's next frame), recompute only what the change can reach. Run
'incrinf COMMAND --help' for a command's options."""

_EPILOG = """\
start here:
  incrinf explain                          a shipped photo -> heatmap.png
  incrinf explain photo.jpg --out heat.png your image (another model: --model)
  incrinf explain scan.nii.gz --resize 48x96x128
                                           a 3-D volume (needs the [nifti] extra)
  incrinf explain photos/ --out results/   a folder -> results.csv, a gallery
  incrinf stream clip.mp4                  a video, beside plain inference
  incrinf analyze --model resnet18         theoretical speedup, per layer

Guides, the Python API and the Captum/MONAI drop-ins: docs/index.md in the
repository (build the site with: python -m sphinx -b html docs docs/_build/html)."""


def build_parser() -> argparse.ArgumentParser:
    """The ``incrinf`` parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="incrinf", description=_DESCRIPTION, epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
