"""Torch's default device as `%device` sets it: installed, undone, and kept out of forks.

    owner = DefaultDevice()
    owner.install(torch.device("meta"))   # torch.zeros(1) lands on meta
    torch.set_default_device("cpu")       # the user's own choice ...
    owner.release()                       # ... stays: only what we installed is undone

`torch.set_default_device` installs a TorchFunctionMode (a `DeviceContext`) in a
thread-local slot. Which one is ours is told by identity, so a default that the
user set by hand, before or after, is never changed.

A forked child (a DataLoader worker) inherits the mode, and `default_collate`'s
`torch.as_tensor` then makes its tensors there: on CUDA that is "Cannot
re-initialize CUDA in forked subprocess". So a forked child drops our mode at
once. `os.register_at_fork` cannot be undone: the handler is registered once per
process and does nothing while no `DefaultDevice` of ours is installed.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from .probes import default_context, torch_default_device

_NOT_OURS = object()
_installed: weakref.ref[DefaultDevice] | None = None  # whose mode a forked child drops
_fork_handler_registered = False


class DefaultDevice:
    """Torch's default device, changed by us and undone only where it is still ours."""

    def __init__(self) -> None:
        self._mode: object = _NOT_OURS  # torch's slot right after our last change
        self._before: torch.device | None = None  # the default in force when we took over

    def owns(self) -> bool:
        """Whether torch's default device is still the one we set (nobody changed it since)."""
        return self._mode is not _NOT_OURS and default_context() is self._mode

    def install(self, dev: torch.device | None) -> None:
        """Make `dev` torch's default device (None: none, so factory functions use the CPU)."""
        global _installed
        if not self.owns():
            self._before = torch_default_device()
        torch.set_default_device(dev)
        self._mode = default_context()
        _installed = weakref.ref(self)
        _register_fork_handler()

    def release(self) -> None:
        """Put back the default that was in force before ours, if ours is still in force."""
        global _installed
        if self.owns():
            torch.set_default_device(self._before)
        self._mode = _NOT_OURS
        if _installed is not None and _installed() is self:
            _installed = None

    def _drop_in_forked_child(self) -> None:
        """Take our mode off the child's stack (other modes stay: they are not ours)."""
        mode, self._mode = self._mode, _NOT_OURS
        if mode is None or default_context() is not mode:
            return
        # Not torch.set_default_device(None): under a `with torch.device(...)` block
        # (%%ondevice) its exit asserts that our mode is the only DeviceContext.
        stack = [torch._C._pop_torch_function_stack()
                 for _ in range(torch._C._len_torch_function_stack())]
        for other in reversed(stack):
            if other is not mode:
                torch._C._push_on_torch_function_stack(other)
        _set_slot(None)
        utils_device = getattr(torch.utils, "_device", None)
        if utils_device is not None and hasattr(utils_device, "CURRENT_DEVICE"):  # torch.compile's
            utils_device.CURRENT_DEVICE = getattr(mode, "old_device", None)


@contextlib.contextmanager
def lifted() -> Iterator[None]:
    """No default device in the block (factory functions use the CPU, and no mode costs on
    every torch call), then the very same one back: its identity is how `DefaultDevice`
    knows the default it installed, so `torch.set_default_device(before)` would not do."""
    context: Any = default_context()
    if context is None:
        yield
        return
    context.__exit__(None, None, None)
    _set_slot(None)
    try:
        yield
    finally:
        context.__enter__()
        _set_slot(context)


def _set_slot(context: object) -> None:
    slot = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)
    if isinstance(slot, threading.local):
        slot.device_context = context
    else:
        torch._GLOBAL_DEVICE_CONTEXT = context  # type: ignore[assignment]  # 2.1-2.2: no local


def _in_forked_child() -> None:
    owner = _installed() if _installed is not None else None
    if owner is not None:
        # Never break a fork: on a fault the child keeps the mode, as it would without us.
        with contextlib.suppress(Exception):
            owner._drop_in_forked_child()


def _register_fork_handler() -> None:
    global _fork_handler_registered
    if not _fork_handler_registered and hasattr(os, "register_at_fork"):  # not on Windows
        os.register_at_fork(after_in_child=_in_forked_child)
        _fork_handler_registered = True
