"""Per-node timing of a captured graph and split execution (prefix on one machine, suffix on another).

The scheduler's cost model needs, on each end, how long every node of the model takes (CacheInf profiles
every operator on robot and server). :func:`time_nodes` runs the captured graph node by node with a
``torch.fx`` Interpreter and takes each node's median over a few repeats; the per-node times are then
rescaled so they add up to the measured time of one plain forward pass (the interpreter's per-node overhead
is not part of the model's cost).

A *split point* is a node after which exactly one tensor is still needed by the rest of the graph: the
prefix runs up to it on the client, that tensor crosses the network, the suffix runs on the server
(:class:`SplitRunner`). Nodes that do not depend on the input (parameters, constants) are re-evaluated on
each side and never cross.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from incrinf.graph import Graph, SplitPoint, split_points
from incrinf.graph.execute import extract, run_nodes


@dataclass
class NodeTimes:
    """Per-node times of one graph on one machine.

    Attributes:
        names: node names in topological order (all nodes of the graph).
        seconds: (n_nodes,) per-node seconds, scaled so that their sum equals ``full_seconds``.
        full_seconds: median time of one plain forward pass.
        raw_seconds: (n_nodes,) per-node medians before scaling (include interpreter overhead).
    """

    names: list[str]
    seconds: np.ndarray
    full_seconds: float
    raw_seconds: np.ndarray

    def prefix(self, index: int) -> float:
        """Seconds of nodes ``0..index`` inclusive."""
        return float(self.seconds[: index + 1].sum())

    def suffix(self, index: int) -> float:
        """Seconds of nodes after ``index``."""
        return float(self.seconds[index + 1:].sum())

    def scaled(self, factor: float) -> NodeTimes:
        """The same times on a device ``factor`` times slower."""
        return NodeTimes(self.names, self.seconds * factor, self.full_seconds * factor, self.raw_seconds * factor)

    def to_json(self) -> dict:
        return {"names": self.names, "seconds": self.seconds.tolist(), "full_seconds": self.full_seconds,
                "raw_seconds": self.raw_seconds.tolist()}

    @classmethod
    def from_json(cls, data: dict) -> NodeTimes:
        names = [str(n) for n in data["names"]]
        seconds = np.asarray(data["seconds"], dtype=np.float64)
        raw = np.asarray(data.get("raw_seconds", data["seconds"]), dtype=np.float64)
        if seconds.shape != (len(names),) or raw.shape != seconds.shape or not np.all(np.isfinite(seconds)):
            raise ValueError("malformed node times: names and seconds disagree")
        return cls(names, seconds, float(data["full_seconds"]), raw)


class SplitRunner:
    """Runs a captured graph in two halves around a :class:`~incrinf.graph.SplitPoint`.

    Each half is a module generated once per split (:func:`incrinf.graph.execute.extract`), so it runs as plain
    Python code without interpreter overhead, like the full model.

    Args:
        graph: the captured graph (both ends must capture the same architecture at the same input shape:
            compare ``graph.signature``).
    """

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.splits = {s.name: s for s in split_points(graph)}
        self._halves: dict[str, tuple[torch.nn.Module, torch.nn.Module]] = {}

    def split(self, name: str) -> SplitPoint:
        if name not in self.splits:
            raise KeyError(f"{name!r} is not a split point; choose one of {list(self.splits)}")
        return self.splits[name]

    def halves(self, name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
        """(prefix, suffix) modules of split ``name``: ``suffix(prefix(x)) == model(x)``."""
        if name not in self._halves:
            self.split(name)
            prefix = extract(self.graph, [self.graph.input.name], [name])
            suffix = extract(self.graph, [name], [self.graph.output.name])
            self._halves[name] = (prefix, suffix)
        return self._halves[name]

    @torch.no_grad()
    def prefix(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Run the graph up to and including split node ``name``.

        Args:
            x: (1, C, H, W) model input.
            name: a split point.

        Returns:
            The tensor live at the split (shape ``split(name).shape``).
        """
        return self.halves(name)[0](x)

    @torch.no_grad()
    def suffix(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Run the rest of the graph after split node ``name``, starting from its tensor.

        Raises:
            ValueError: ``tensor`` does not have the split's shape.
        """
        split = self.split(name)
        if tuple(tensor.shape) != split.shape:
            raise ValueError(f"split {name!r} expects a tensor of shape {split.shape}, got {tuple(tensor.shape)}")
        return self.halves(name)[1](tensor)


@torch.no_grad()
def time_nodes(graph: Graph, example: torch.Tensor, repeats: int = 5, warmup: int = 1) -> NodeTimes:
    """Time every node of ``graph`` on this machine.

    Args:
        graph: captured graph.
        example: (1, C, H, W) input of the captured shape.
        repeats: timed passes (median per node).
        warmup: untimed passes first.

    Returns:
        The :class:`NodeTimes`.
    """
    samples = np.zeros((repeats, len(graph.nodes)))
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    for rep in range(warmup + repeats):
        def timed(node, run, rep=rep):
            t0 = time.perf_counter()
            value = run()
            if rep >= warmup:
                samples[rep - warmup, index[node.name]] = time.perf_counter() - t0
            return value

        run_nodes(graph, example, timed)
    module = graph.module
    full = []
    for _ in range(max(repeats, 5)):  # the total is what predictions rest on: never fewer than 5 samples
        t0 = time.perf_counter()
        module(example)
        full.append(time.perf_counter() - t0)
    raw = np.median(samples, axis=0)
    full_seconds = statistics.median(full)
    scale = full_seconds / raw.sum() if raw.sum() > 0 else 1.0
    return NodeTimes([n.name for n in graph.nodes], raw * scale, full_seconds, raw)


def model_digest(model: torch.nn.Module) -> str:
    """Hash of a model's parameters and buffers (names, shapes, values).

    Client and server compare it before offloading: the same architecture with different weights would
    silently give different outputs.
    """
    import hashlib

    h = hashlib.blake2b(digest_size=12)
    for name, tensor in list(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
