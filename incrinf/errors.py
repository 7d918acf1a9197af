"""Exceptions raised by incrinf."""


class CaptureError(RuntimeError):
    """A model could not be captured as a graph (``torch.fx`` failed to trace it)."""


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the ``pip install`` that adds it."""
