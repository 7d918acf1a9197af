"""Exceptions raised by incrinf."""


class CaptureError(RuntimeError):
    """A model could not be captured as a graph (``torch.fx`` failed to trace it)."""
