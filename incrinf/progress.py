"""Progress bars that suit where they are written: live on a terminal or in a notebook, a line now and then in a
log or a pipe (CI, ``nohup``, a dataset run under a scheduler), where a live bar's carriage-return updates would
pile up as hundreds of lines."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from typing import Any, TextIO

from tqdm import tqdm as _plain
from tqdm.auto import tqdm as _auto
from tqdm.autonotebook import tqdm as _notebook_or_plain  # tqdm.auto imported it first, with its warning silenced

# In Jupyter tqdm draws a widget (stderr is no terminal there, but the bar is live).
_IN_NOTEBOOK = _notebook_or_plain is not _plain

# Seconds between two progress lines in a log (tqdm's ``mininterval``); also how long a transient bar
# (``leave=False``, e.g. one input's positions inside a dataset run) stays silent before its first line.
LOG_INTERVAL_S = 30.0
# Cursor movements tqdm writes to place nested bars: meaningless in a log.
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class _Lines:
    """A file for tqdm that turns its carriage-return redraws into whole lines (a log keeps one line per write)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        line = _ANSI.sub("", text).replace("\r", "").rstrip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(iterable: Iterable | None = None, *, disable: bool = False, **kwargs: Any) -> _plain:
    """A tqdm bar (``iterable`` and ``kwargs`` as tqdm's): live when stderr is a terminal or in a notebook;
    otherwise one plain line at most every :data:`LOG_INTERVAL_S` seconds: a lasting bar (the default) from its
    start to its final state, a transient one (``leave=False``) only while it runs longer than that.

    Args:
        iterable: what to iterate over (optional, as in tqdm).
        disable: no output at all.
        **kwargs: tqdm's (``total``, ``desc``, ``unit``, ``initial``, ``leave``, ...).
    """
    stream = sys.stderr
    live = _IN_NOTEBOOK or (stream is not None and hasattr(stream, "isatty") and stream.isatty())
    if live or disable:
        return _auto(iterable, disable=disable, **kwargs)
    kwargs.pop("dynamic_ncols", None)
    if not kwargs.get("leave", True):
        kwargs["delay"] = LOG_INTERVAL_S
    kwargs.update(file=_Lines(stream), mininterval=LOG_INTERVAL_S, maxinterval=max(LOG_INTERVAL_S, 10.0),
                  ncols=100, ascii=True)
    return _plain(iterable, **kwargs)


__all__ = ["LOG_INTERVAL_S", "progress_bar"]
