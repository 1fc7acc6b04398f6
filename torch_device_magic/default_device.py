"""Torch's default device as `%device` sets it: installed, undone, and kept out of forks.

    owner = DefaultDevice()
    owner.install(torch.device("meta"))   # torch.zeros(1) lands on meta
    torch.set_default_device("cpu")       # the user's own choice ...
    owner.release()                       # ... stays: only what we installed is undone

`torch.set_default_device` installs a TorchFunctionMode (a `DeviceContext`) that
every torch call then passes through, factory function or not: a small training
step took 1.3-1.5x as long (bench/README.md). Ours costs only the factory calls:
the factory functions that torch's mode fills `device=` in for (its
`_device_constructors()`) are replaced, in `torch`, `torch.fft` and
`torch.nested`, by wrappers that fill it in by torch's rule (a `device` not given
or None), while a default of ours is in force in some thread; they are put back
when none is. torch's own slot for the default (`torch._GLOBAL_DEVICE_CONTEXT`,
one per thread) holds our `FactoryDefault`, so `torch.get_default_device()`,
`torch.set_default_device` by hand (which ends ours through its `__exit__`) and
torch.compile's guard (`torch.utils._device.CURRENT_DEVICE`) see it as torch's own.

`for_cell` installs the same for one cell (`%%ondevice`, `%%devcompare`'s runs).
As torch's, it is thread-local: other threads, autograd's device threads
included, get the CPU. A `with torch.device(...)` block is a DeviceContext on
the mode stack: the wrappers leave its factory calls to it.
Other modes on the stack see `device=` already filled in. A factory bound to
another name before ours was installed (`from torch import zeros`, and torch's
own `random_split`) is not filled in.

A forked child (a DataLoader worker) inherits the default, and `default_collate`'s
`torch.as_tensor` then makes its tensors there: on CUDA that is "Cannot
re-initialize CUDA in forked subprocess". So a forked child drops ours at once.
`os.register_at_fork` cannot be undone: the handler is registered once per
process and does nothing while no `DefaultDevice` of ours is installed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
from torch.utils import _device as utils_device

from .probes import default_context, torch_default_device

_NOT_OURS = object()
_installed: weakref.ref[DefaultDevice] | None = None  # whose default a forked child drops
_fork_handler_registered = False


class _ThreadDefault(threading.local):
    device: torch.device | None = None  # a thread where none of ours was entered: none


_thread = _ThreadDefault()
_in_force = 0  # FactoryDefaults entered and not exited, over all threads
_lock = threading.Lock()


class FactoryDefault:
    """What torch's slot holds for a default of ours: `device`, and `__enter__`/`__exit__`
    as `torch.set_default_device` calls them on a `DeviceContext`, with no mode."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.old_device: torch.device | None = None

    def __enter__(self) -> FactoryDefault:
        global _in_force
        self.old_device = getattr(utils_device, "CURRENT_DEVICE", None)
        utils_device.CURRENT_DEVICE = self.device
        _thread.device = self.device
        with _lock:
            _in_force += 1
            if _in_force == 1:
                _swap(wrapped=True)
        return self

    def __exit__(self, *exc: object) -> None:
        global _in_force
        utils_device.CURRENT_DEVICE = self.old_device
        _thread.device = None
        with _lock:
            _in_force -= 1
            if _in_force == 0:
                _swap(wrapped=False)


def _wrap(factory: Callable[..., Any], namespace: ModuleType, name: str) -> Callable[..., Any]:
    @functools.wraps(factory)
    def with_default(*args: Any, **kwargs: Any) -> Any:
        device = _thread.device
        if (
            device is not None
            and kwargs.get("device") is None
            and not (torch._C._len_torch_function_stack() and _device_mode_on())
        ):
            kwargs["device"] = device
        return factory(*args, **kwargs)

    # Named where it is bound (not `_VariableFunctionsClass.zeros`), so that pickle, which
    # stores a function by its name, finds it there.
    with_default.__module__, with_default.__qualname__ = namespace.__name__, name
    return with_default


def _device_mode_on() -> bool:
    """Whether a DeviceContext (a `with torch.device(...)` block) is on the mode stack."""
    return any(
        isinstance(torch._C._get_function_stack_at(i), utils_device.DeviceContext)
        for i in range(torch._C._len_torch_function_stack())
    )


_Binding = tuple[ModuleType, str, Callable[..., Any], Callable[..., Any]]


@functools.cache
def _bindings() -> list[_Binding]:
    """(namespace, name, torch's factory, our wrapper) for each name a factory is bound to."""
    factories = {id(f): f for f in utils_device._device_constructors()}
    found: list[_Binding] = []
    for namespace in (torch, torch.fft, torch.nested):
        for name, value in list(vars(namespace).items()):  # a copy: imports add to it
            factory = factories.get(id(value))
            if factory is not None and factory is value:
                found.append((namespace, name, factory, _wrap(factory, namespace, name)))
    with contextlib.suppress(Exception):  # TorchScript is optional; its tables are torch's
        from torch.jit import _builtins

        for _, _, factory, wrapper in found:
            # `torch.jit.script` compiles `torch.zeros` as the op, not as Python code
            # (where torch's mode does not apply either).
            op = _builtins._find_builtin(factory)
            if op is not None:
                _builtins._register_builtin(wrapper, op)
    return found


def _swap(wrapped: bool) -> None:
    """Put our wrappers in place of torch's factories, or torch's back; a name that another
    has rebound since is left to them."""
    for namespace, name, factory, wrapper in _bindings():
        now, new = (factory, wrapper) if wrapped else (wrapper, factory)
        if getattr(namespace, name) is now:
            setattr(namespace, name, new)
    if not wrapped:
        # torch.compile builds its table of torch's functions from their names once: built
        # while ours stood in, it would not know torch's own now (a graph break; an error
        # under fullgraph). Cleared, it is built again at its next compile.
        rules = sys.modules.get("torch._dynamo.trace_rules")
        if rules is not None:
            with contextlib.suppress(Exception):
                rules.clear_lru_cache()


class DefaultDevice:
    """Torch's default device, changed by us and undone only where it is still ours."""

    def __init__(self) -> None:
        self._context: object = _NOT_OURS  # torch's slot right after our last change
        self._before: torch.device | None = None  # the default in force when we took over

    def owns(self) -> bool:
        """Whether torch's default device is still the one we set (nobody changed it since)."""
        return self._context is not _NOT_OURS and default_context() is self._context

    def install(self, dev: torch.device | None) -> None:
        """Make `dev` torch's default device (None: none, so factory functions use the CPU)."""
        global _installed
        if not self.owns():
            self._before = torch_default_device()
        torch.set_default_device(None)  # ends the default in force, through its __exit__
        if dev is not None:
            context = FactoryDefault(torch.device(dev))
            context.__enter__()
            _set_slot(context)
        self._context = default_context()
        _installed = weakref.ref(self)
        _register_fork_handler()

    def after_release(self) -> torch.device | None:
        """The default device that `release` would leave in force: the one before ours
        while ours is, else the one in force now (set by hand, or none)."""
        return self._before if self.owns() else torch_default_device()

    def release(self) -> None:
        """Put back the default that was in force before ours, if ours is still in force."""
        global _installed
        if self.owns():
            torch.set_default_device(self._before)
        self._context = _NOT_OURS
        if _installed is not None and _installed() is self:
            _installed = None

    def _drop_in_forked_child(self) -> None:
        global _lock, _in_force
        _lock = threading.Lock()  # a thread that held it at the fork does not run here
        context, self._context = self._context, _NOT_OURS
        if isinstance(context, FactoryDefault) and default_context() is context:
            _in_force = 1  # other threads' defaults went with their threads: the wrappers go
            context.__exit__(None, None, None)
            _set_slot(None)


@contextlib.contextmanager
def for_cell(dev: torch.device) -> Iterator[None]:
    """`dev` as torch's default device in the block (an `%%ondevice` cell, a comparison's
    runs), installed as `%device` installs it: no mode, so the block's other torch calls
    cost nothing more and their warnings name the user's lines. For the CPU none at all
    (the default in force is lifted). The default in force before comes back after, on an
    error or Ctrl-C too, unless the block set one by hand, which stays."""
    context: Any = default_context()
    if isinstance(context, FactoryDefault) and context.device == dev:
        yield  # already ours (`%device DEV`, then `%%ondevice`): nothing to change
        return
    with lifted():
        if dev.type == "cpu":
            yield
            return
        ours = FactoryDefault(dev)
        ours.__enter__()
        _set_slot(ours)
        try:
            yield
        finally:
            if default_context() is ours:
                ours.__exit__(None, None, None)
                _set_slot(None)


@contextlib.contextmanager
def lifted() -> Iterator[None]:
    """No default device in the block (factory functions use the CPU), then the very same
    one back: its identity is how `DefaultDevice` knows the default it installed, so
    `torch.set_default_device(before)` would not do. One the block set by hand stays."""
    context: Any = default_context()
    if context is None:
        yield
        return
    context.__exit__(None, None, None)
    _set_slot(None)
    try:
        yield
    finally:
        if default_context() is None:
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
        # Never break a fork: on a fault the child keeps the default, as it would without us.
        with contextlib.suppress(Exception):
            owner._drop_in_forked_child()


def _register_fork_handler() -> None:
    global _fork_handler_registered
    if not _fork_handler_registered and hasattr(os, "register_at_fork"):  # not on Windows
        os.register_at_fork(after_in_child=_in_forked_child)
        _fork_handler_registered = True
