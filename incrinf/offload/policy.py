"""How an offloading session runs a frame: the policies a user picks and the options the scheduler chooses among.

A :class:`Policy` is what the user asks for: one way for every frame, or :attr:`Policy.AUTO` (the scheduler
chooses per frame). An :class:`Option` is one concrete way to run one frame: a policy other than ``AUTO`` and,
for :attr:`Policy.HYBRID`, the node after which the client hands the rest of the model to the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# Names an earlier version accepted, and what replaces them.
_RENAMED = {"offload_cached": "offload_changed_pixels"}


class Policy(str, Enum):
    """Where an offloading session computes its frames.

    - ``AUTO``: choose per frame among every option below, from measured costs.
    - ``LOCAL_FULL``: the whole model on this machine.
    - ``LOCAL_CACHED``: this machine's incremental stream session (recomputes what changed).
    - ``OFFLOAD_FULL``: send the frame; the server runs the whole model.
    - ``OFFLOAD_CHANGED_PIXELS``: send only the changed pixels (tiles plus the homography to the previous
      frame); the server rebuilds the frame from its copy of the previous one and runs the whole model.
    - ``HYBRID``: run the model up to a split node here, send that tensor, the server runs the rest.
    """

    AUTO = "auto"
    LOCAL_FULL = "local_full"
    LOCAL_CACHED = "local_cached"
    OFFLOAD_FULL = "offload_full"
    OFFLOAD_CHANGED_PIXELS = "offload_changed_pixels"
    HYBRID = "hybrid"

    def __str__(self) -> str:
        return self.value

    @property
    def offloads(self) -> bool:
        """Whether running a frame this way needs the server."""
        return self in (Policy.OFFLOAD_FULL, Policy.OFFLOAD_CHANGED_PIXELS, Policy.HYBRID)

    @property
    def keeps_state(self) -> bool:
        """Whether a frame run this way reuses the previous frame's (its first frame rebuilds that state)."""
        return self in (Policy.LOCAL_CACHED, Policy.OFFLOAD_CHANGED_PIXELS)

    @property
    def rebuild(self) -> Policy:
        """The stateless policy whose cost a cold start of this one pays (itself when it keeps no state)."""
        return {Policy.LOCAL_CACHED: Policy.LOCAL_FULL, Policy.OFFLOAD_CHANGED_PIXELS: Policy.OFFLOAD_FULL}.get(
            self, self)

    @classmethod
    def of(cls, value: Policy | str) -> Policy:
        """``value`` as a policy.

        Raises:
            ValueError: an unknown name (the message lists the valid ones), a renamed one (the message gives the
                new name), or a ``"hybrid:<node>"`` string (the split node is its own setting).
            TypeError: neither a policy nor a string.
        """
        if isinstance(value, cls):
            return value
        if not isinstance(value, str):
            raise TypeError(f"policy must be a Policy or its name, got {type(value).__name__}")
        if value in _RENAMED:
            raise ValueError(f"policy {value!r} is now called {_RENAMED[value]!r} (it uploads the changed pixels and "
                             "the server runs the whole model)")
        if value.startswith(cls.HYBRID.value + ":"):
            node = value.split(":", 1)[1]
            raise ValueError(f"policy {value!r}: the split node is a setting of its own now: policy='hybrid', "
                             f"split={node!r}")
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown policy {value!r}; choose one of {', '.join(p.value for p in cls)}") from None


@dataclass(frozen=True)
class Option:
    """One concrete way to run one frame.

    Attributes:
        policy: any policy but :attr:`Policy.AUTO`.
        split: the split node of :attr:`Policy.HYBRID` (required there), else None.
    """

    policy: Policy
    split: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", Policy.of(self.policy))
        if self.policy is Policy.AUTO:
            raise ValueError("auto is a policy, not an option: it chooses among the options per frame")
        if (self.policy is Policy.HYBRID) != (self.split is not None):
            raise ValueError("a hybrid option needs its split node, and only a hybrid option has one")

    def __str__(self) -> str:
        return self.policy.value if self.split is None else f"{self.policy.value} at {self.split}"

    @property
    def offloads(self) -> bool:
        return self.policy.offloads

    @property
    def keeps_state(self) -> bool:
        return self.policy.keeps_state

    @property
    def rebuild(self) -> Option:
        """The option whose cost a cold start of this one pays (see :attr:`Policy.rebuild`)."""
        return self if not self.keeps_state else Option(self.policy.rebuild)


LOCAL_FULL = Option(Policy.LOCAL_FULL)
LOCAL_CACHED = Option(Policy.LOCAL_CACHED)
OFFLOAD_FULL = Option(Policy.OFFLOAD_FULL)
OFFLOAD_CHANGED_PIXELS = Option(Policy.OFFLOAD_CHANGED_PIXELS)
#: the options without a split node, in the order they are listed
SINGLE_OPTIONS = (LOCAL_FULL, LOCAL_CACHED, OFFLOAD_FULL, OFFLOAD_CHANGED_PIXELS)


def hybrid(split: str) -> Option:
    """The hybrid option that splits the model after node ``split``."""
    return Option(Policy.HYBRID, split)

