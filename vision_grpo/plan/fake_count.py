"""Counting memory on fake tensors (`torch._subclasses.FakeTensorMode`: every op with its real shapes, dtypes and
autocast rules, no data): a model built on the meta device made runnable (`materialise_fake`), and the live storage
bytes after every op with their peak (`LiveBytes`). vision_grpo/plan/formulas.py counts transformers' own modules with
them where a closed form would restate too many terms; the tests and benchmarks/memory_plan.py measure with them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@functools.cache
def materialise_fake(model: torch.nn.Module, dtype: torch.dtype | None = None, trainable: bool | None = None) -> None:
    """Give a model built on the meta device fake CPU parameters and buffers of the same shapes (in `dtype` and with
    `requires_grad=trainable` where given): called under the `FakeTensorMode` that will run it, so its forward runs
    transformers' real code with real shapes and dtypes, and no data."""
    for module in model.modules():
        for name, value in list(module._parameters.items()):
            if value is not None:
                fake = torch.empty(value.shape, dtype=dtype or value.dtype, device="cpu")
                grad = value.requires_grad if trainable is None else trainable
                module._parameters[name] = torch.nn.Parameter(fake, requires_grad=grad)
        for name, value in list(module._buffers.items()):
            if value is not None:
                module._buffers[name] = torch.zeros(value.shape, dtype=value.dtype, device="cpu")


class LiveBytes(TorchDispatchMode):
    """Bytes of live tensor storages after every op (allocations seen as outputs, frees as expired storages), and
    their peak: what the caching allocator must hold at once, on fake tensors as on real ones."""

    def __init__(self, exclude: set[int]) -> None:
        super().__init__()
        self.exclude = exclude  # storages of the weights: their views (a transpose, a slice) allocate nothing
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.sweep()
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage._cdata not in self.live and storage._cdata not in self.exclude:
                    self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out

    def sweep(self) -> None:
        for key, (ref, size) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.current -= size

    def start(self) -> int:
        """Reset the peak to the bytes live now, and return them (the baseline of a region)."""
        self.sweep()
        self.peak = self.current
        return self.current
