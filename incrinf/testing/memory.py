"""Peak bytes of the tensors a piece of code allocates, counted exactly (not sampled, not the allocator's view).

:class:`TensorMemory` is a ``TorchDispatchMode``: every tensor an operator returns with storage of its own counts
from then until the last tensor on that storage is garbage (in-place results and views count nothing new).
Tensors made before the block (a model's weights, a store's tables) are not counted. What operators allocate
internally and free before returning (oneDNN scratch space) and the allocator's own overhead are not tensors and
not counted: this measures what incrinf keeps alive, the quantity its plans predict.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorMemory(TorchDispatchMode):
    """Context manager counting the live bytes of tensors made inside it.

    Attributes:
        peak: the most bytes live at once.
        live: bytes live now.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._holders: dict[int, int] = {}  # storage address -> tensors alive on it

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        before = {_address(t) for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t, t.untyped_storage().nbytes(), before)
        return out

    def _track(self, tensor: torch.Tensor, nbytes: int, inputs: set[int]) -> None:
        address = _address(tensor)
        if address in inputs and address not in self._holders:
            return  # an in-place result or a view of a tensor made before the block
        if address not in self._holders:
            self._holders[address] = 0
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self._holders[address] += 1
        weakref.finalize(tensor, self._release, address, nbytes)

    def _release(self, address: int, nbytes: int) -> None:
        count = self._holders.get(address, 0) - 1
        if count > 0:
            self._holders[address] = count
            return
        self._holders.pop(address, None)
        self.live -= nbytes


def _address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()
