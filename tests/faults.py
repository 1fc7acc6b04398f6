"""Fault injection: out of memory (or any error) at the n-th tensor made on a device."""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class FailOnAllocation(TorchDispatchMode):
    """Raise `error` (OutOfMemoryError) at the n-th tensor created on `device`; n=0 only counts.

    `alive()` lists the tensors it saw created there that are still alive.
    """

    def __init__(self, device: torch.device, n: int, error: BaseException | None = None) -> None:
        super().__init__()
        self.device, self.n, self.count = torch.device(device), n, 0
        self.made: list[weakref.ref] = []
        self.error = error or torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 MiB")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inplace = func._schema.name.endswith("_")
        if isinstance(out, torch.Tensor) and out.device == self.device and not inplace:
            self.count += 1
            self.made.append(weakref.ref(out))
            if self.count == self.n:
                del out
                raise self.error
        return out

    def alive(self) -> list[torch.Tensor]:
        gc.collect()
        return [t for t in (ref() for ref in self.made) if t is not None]
