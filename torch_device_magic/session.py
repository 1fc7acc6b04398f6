"""The session's state under the magics, and how to undo it: no IPython here.

    session = Session()
    session.set_device(torch.device("meta"), namespace)  # `device` bound; torch's default
    session.set_nograd(True)                              # autograd off for later cells
    session.close(namespace)                              # all of it undone

It holds the session device; the default device that we set (and only that: a
default set by hand, before or after, is never undone); CUDA's current device
that a chosen `cuda:N` replaced; the `device` binding we made; the grad mode
that `%nograd on` replaced. `TorchDeviceMagics` holds one, as IPython's
`AutoreloadMagics` holds its `ModuleReloader`, and hands it the namespace.
"""

from __future__ import annotations

import contextlib
from collections.abc import MutableMapping
from typing import Any

import torch

from . import devices
from .default_device import DefaultDevice
from .devices import canonical
from .errors import DeviceMagicError

_NONE = object()  # no `device` in the namespace


class Session:
    """The session device and what choosing it changed, undone by `close`."""

    def __init__(self, torch_default: bool = True) -> None:
        self.device: torch.device | None = None  # the session device; None: torch's default
        self._torch_default = torch_default  # the `set_torch_default` setting
        self._bind_only = False  # `%device DEV --no-default`: torch's default left alone
        self._default = DefaultDevice()
        self._bound: torch.device | None = None  # what `device` was bound to, by us
        self._user_device: object = _NONE  # the user's own `device`, before we bound ours
        self._cuda_current_before: int | None = None  # CUDA's current device before ours
        self._grad_before_nograd: bool | None = None

    def set_device(
        self, dev: torch.device | None, namespace: MutableMapping[str, Any],
        torch_default: bool = True,
    ) -> None:
        """Make `dev` the session device (None: back to torch's default, see
        `default_after_reset`): CUDA's current device for a `cuda:N`, bound as `device` in
        `namespace` and, unless `torch_default` is False (or the setting is), torch's
        default device."""
        self._follow_current(dev)  # first: if it fails, nothing has changed
        bound = self.default_after_reset() if dev is None else dev
        self.device = dev
        self._bind_only = not torch_default
        self._apply_default()
        held = namespace.get("device", _NONE)
        if self._bound is None or held is not self._bound:  # theirs, not one we bound
            self._user_device = held
        self._bound = namespace["device"] = bound

    def default_after_reset(self) -> torch.device:
        """Where factory calls go once our default is undone: the default that was in force
        before ours (one set by hand with `torch.set_default_device` stays), else the CPU."""
        return canonical(self._default.after_release() or torch.device("cpu"))

    def set_torch_default(self, on: bool) -> None:
        """The `set_torch_default` setting: install the session device as torch's default
        device (on), or undo ours (off)."""
        self._torch_default = on
        self._apply_default()

    def set_nograd(self, on: bool) -> None:
        """Autograd off for the cells that follow (on), or back as it was before (off)."""
        if on:
            if self._grad_before_nograd is None:
                self._grad_before_nograd = torch.is_grad_enabled()
            torch.set_grad_enabled(False)
        else:
            torch.set_grad_enabled(
                True if self._grad_before_nograd is None else self._grad_before_nograd
            )
            self._grad_before_nograd = None

    def close(self, namespace: MutableMapping[str, Any]) -> None:
        """Undo what the session changed: torch's default device (ours only), CUDA's
        current device, `device` (unless the user rebound it) and the grad mode."""
        default = self.default_after_reset()
        self._default.release()  # ours only; forked children are left alone from now on
        with contextlib.suppress(DeviceMagicError):  # unloading goes on regardless
            self._follow_current(None)
        if self.device is not None:
            self.device = None
            if namespace.get("device") is self._bound:  # not rebound by the user
                # Theirs comes back; where there was none, the default (so `.to(device)`
                # in cells that follow still runs).
                before = self._user_device
                namespace["device"] = default if before is _NONE else before
        if self._grad_before_nograd is not None:
            torch.set_grad_enabled(self._grad_before_nograd)
            self._grad_before_nograd = None

    def _apply_default(self) -> None:
        """Make the session device torch's default, or undo ours; another's is left alone."""
        dev = self.device
        if dev is None or not self._torch_default or self._bind_only:
            self._default.release()
        else:
            # Torch's own default already is the CPU, and an installed default device
            # costs on every factory call (see docs/device.md): none for it.
            self._default.install(None if dev.type == "cpu" else dev)

    def _follow_current(self, dev: torch.device | None) -> None:
        """A chosen `cuda:N` also becomes CUDA's current device (so that work and figures
        without an index go there); any other choice puts back the one it replaced."""
        if dev is not None and dev.type == "cuda" and dev.index is not None:
            before = devices.make_current(dev.index)
            if self._cuda_current_before is None:
                self._cuda_current_before = before
        elif self._cuda_current_before is not None:
            devices.make_current(self._cuda_current_before)
            self._cuda_current_before = None
