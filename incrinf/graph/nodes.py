"""The captured graph's data: typed nodes in topological order (no ``torch.fx`` objects leak out of them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class NodeKind(str, Enum):
    """How a node moves update regions (DESIGN.md)."""

    INPUT = "input"
    LOCAL = "local"  # conv / pool: region grows by the Krypton equations
    PAD = "pad"  # constant padding: region shifts
    POINTWISE = "pointwise"  # region unchanged
    MERGE = "merge"  # add / mul / concat of aligned maps: bounding box
    GLOBAL = "global"  # everything else: region becomes the whole tensor
    CONSTANT = "constant"  # does not depend on the input (parameters, buffers)
    META = "meta"  # produces no tensor (sizes, shapes): re-evaluated, never a region
    OUTPUT = "output"


class Operator(str, Enum):
    """What a node computes, as far as the engine needs to know (anything else is ``OTHER``)."""

    INPUT = "input"
    OUTPUT = "output"
    CONSTANT = "constant"
    CONV = "conv"  # zero-padded convolution, any number of spatial dims, any groups
    MAX_POOL = "max_pool"
    AVG_POOL = "avg_pool"
    ADAPTIVE_MAX_POOL = "adaptive_max_pool"  # local only when its bins tile the input
    ADAPTIVE_AVG_POOL = "adaptive_avg_pool"
    WINDOWED = "windowed"  # a module declaring its own window geometry and ``without_padding()``
    PAD = "pad"  # constant padding
    BATCH_NORM = "batch_norm"  # an eval-mode batch-norm module: y = x * scale + shift per channel
    ARITHMETIC = "arithmetic"  # + - * / of tensors or scalars
    CAT = "cat"
    OTHER = "other"


@dataclass(frozen=True)
class LocalGeometry:
    """Geometry of a sliding-window operator along its spatial axes (1, 2 or 3 of them, outermost first).

    Attributes:
        kernel: effective kernel extent ``dilation * (k - 1) + 1`` per axis.
        stride: stride per axis.
        pad_before: padding before the first element per axis.
        pad_after: padding after the last element per axis, including the extra reach of ``ceil_mode``
            windows.
        dilation: dilation per axis.
        pad_value: value the padded border holds (0 for conv and avg pool, -inf for max pool).
    """

    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    pad_before: tuple[int, ...]
    pad_after: tuple[int, ...]
    dilation: tuple[int, ...] = (1, 1)
    pad_value: float = 0.0

    @property
    def is_window(self) -> bool:
        """Whether outputs read more than their own position (not a 1x1, stride-1, unpadded operator)."""
        return any(k != 1 for k in self.kernel) or any(s != 1 for s in self.stride) or any(self.pad_before) \
            or any(self.pad_after)


@dataclass
class Node:
    """One captured node.

    Attributes:
        name: the node's unique name.
        kind: how the node moves regions.
        operator: what it computes (for the engine's operator handling).
        op: short human description of the operation.
        inputs: names of the nodes whose values this node reads.
        shape: output shape for the captured input shape (``None`` for non-tensors).
        geometry: sliding-window geometry of LOCAL nodes.
        shift: padding before the map per spatial axis, for PAD nodes (a region moves by it).
        pad_value: the value a PAD node pads with (LOCAL nodes: ``geometry.pad_value``).
        groups: groups of a convolution (1 otherwise).
        in_channels: input channels of a convolution (0 otherwise).
        inplace: the node overwrites its first input (``relu_``, ``inplace=True`` modules, ``+=``).
        reason: why a node is GLOBAL (or why reuse stops there).
        flops: multiply-accumulates (or element operations) of one full evaluation, batch 1.
        users: names of the nodes reading this one (set by :class:`Graph`).
    """

    name: str
    kind: NodeKind
    op: str
    inputs: list[str]
    shape: tuple[int, ...] | None
    operator: Operator = Operator.OTHER
    geometry: LocalGeometry | None = None
    shift: tuple[int, ...] = ()
    pad_value: float = 0.0
    groups: int = 1
    in_channels: int = 0
    inplace: bool = False
    reason: str = ""
    flops: int = 0
    users: list[str] = field(default_factory=list)
    fx_node: Any = field(default=None, repr=False)  # the traced node: read by incrinf.graph only

    @property
    def is_window(self) -> bool:
        """A LOCAL node whose outputs read a neighbourhood (see :attr:`LocalGeometry.is_window`)."""
        return self.kind == NodeKind.LOCAL and self.geometry is not None and self.geometry.is_window

    @property
    def is_depthwise(self) -> bool:
        """A convolution with one group per input channel (about one multiply-add per element and tap)."""
        return self.operator == Operator.CONV and self.groups > 1 and self.groups == self.in_channels


@dataclass
class Graph:
    """A captured model: typed nodes in topological order plus the traced module.

    Attributes:
        module: the traced module (a ``torch.nn.Module``; calling it runs the model).
        nodes: every node, in topological order; the first is the input, the last the output.
        input_shape: ``(1, C, *spatial)`` the shape the graph was captured for.
        signature: structure-and-shape hash (two models of one architecture share it; weights do not enter).
        attachments: what later layers build once per graph and share (the engine's executors); it lives and dies
            with the graph.
    """

    module: Any
    nodes: list[Node]
    input_shape: tuple[int, ...]
    signature: str
    attachments: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.by_name = {n.name: n for n in self.nodes}
        for node in self.nodes:
            node.users = []
        for node in self.nodes:
            for name in node.inputs:
                self.by_name[name].users.append(node.name)

    @property
    def input(self) -> Node:
        return self.nodes[0]

    @property
    def output(self) -> Node:
        return self.nodes[-1]

    @property
    def spatial_dims(self) -> int:
        """Number of spatial axes of the input (1 for signals, 2 for images, 3 for volumes)."""
        return len(self.input_shape) - 2

    def is_map(self, shape: tuple[int, ...] | None) -> bool:
        """Whether a tensor of ``shape`` is a map over the input's spatial axes (batch, channels..., spatial)."""
        return shape is not None and len(shape) >= self.spatial_dims + 2

    def unknown_ops(self) -> list[Node]:
        """GLOBAL nodes that are global only because incrinf does not know them."""
        return [n for n in self.nodes if n.kind == NodeKind.GLOBAL and n.reason.startswith("unknown")]

    def full_flops(self) -> int:
        """FLOPs of one full inference."""
        return int(sum(n.flops for n in self.nodes))

    def nbytes(self, name: str) -> int:
        """Bytes of a node's float32 output (0 for non-tensors)."""
        shape = self.by_name[name].shape
        return 4 * math.prod(shape) if shape else 0
