"""The IPython layer: configuration traits and thin magic bodies over the pure modules.

Each magic parses its line with `@magic_arguments` (so `%device?` documents
itself), calls into a module that knows nothing of IPython, and displays or
returns what it got. A `DeviceMagicError` from below becomes IPython's own
`UsageError`: one sentence, no traceback, nothing changed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display
from traitlets import Bool, observe

from . import cells, moving
from .devices import EXAMPLES, device_table, resolve, take_inventory, torch_default_device
from .errors import DeviceMagicError
from .hooks import CellReporter


def user_errors(method: Callable) -> Callable:
    """Turn the package's `DeviceMagicError` into the exact `UsageError` IPython prints cleanly."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        try:
            return method(*args, **kwargs)
        except DeviceMagicError as err:
            raise UsageError(str(err)) from None

    return wrapper


def parse(magic: Callable, line: str) -> Any:
    """Parse a magic's line; a mistake names the magic and where to read its options."""
    name = magic.__name__
    try:
        return parse_argstring(magic, line)
    except UsageError as err:
        raise UsageError(f"%{name}: {err} (see %{name}? for its options)") from None
    except ValueError as err:  # unbalanced quotes, from the line splitter
        raise UsageError(f"%{name}: cannot read {line!r}: {err}") from None


@magics_class
class TorchDeviceMagics(Magics):
    """PyTorch device magics: %device, %%ondevice, %%nograd and the per-cell report."""

    set_torch_default = Bool(
        True,
        help="Make the %device choice torch's default device for factory functions "
        "(torch.set_default_device). It costs a little on every torch call and breaks "
        "DataLoader(shuffle=True) on a non-CPU default; set False to only bind `device`.",
    ).tag(config=True)

    def __init__(self, shell: Any) -> None:
        # State first: traits set in ipython_config.py fire observers during super().__init__.
        self.session_device: torch.device | None = None
        self.reporter = CellReporter()
        self._default_at_load = torch_default_device()
        self._grad_before_nograd: bool | None = None
        super().__init__(shell=shell)

    @observe("set_torch_default")
    def _torch_default_switched(self, change: Any) -> None:
        self._apply_default()

    def _apply_default(self) -> None:
        if self.session_device is not None and self.set_torch_default:
            torch.set_default_device(self.session_device)
        else:
            torch.set_default_device(self._default_at_load)

    def set_session_device(self, dev: torch.device | None) -> None:
        """Bind `device` in the namespace and (per `set_torch_default`) torch's default."""
        self.session_device = dev
        self._apply_default()
        self.shell.user_ns["device"] = dev if dev is not None else torch.device("cpu")

    def close(self) -> None:
        """Undo what loading and the magics changed: hooks, default device, grad mode."""
        self.reporter.unregister(self.shell)
        if self.session_device is not None:
            self.session_device = None
            self._apply_default()
        if self._grad_before_nograd is not None:
            torch.set_grad_enabled(self._grad_before_nograd)
            self._grad_before_nograd = None

    @magic_arguments()
    @argument(
        "spec",
        nargs="?",
        help=f"where new work runs: {EXAMPLES}; 'reset' returns to torch's default (the CPU). "
        "Omit it to list the devices.",
    )
    @argument(
        "--move",
        action="store_true",
        help="also move the namespace's tensors, models and optimizers there (as "
        "%%%%ondevice --all does)",
    )
    @line_magic
    @user_errors
    def device(self, line: str) -> None:
        """Choose where new work runs, or list the devices.

        In [1]: %device auto
        device = cuda:1 (NVIDIA H200, 139.1 of 139.8 GiB free, the most of 2 GPUs)

        The choice is bound as `device` in the namespace and becomes torch's
        default device for factory functions (`torch.zeros(3)` lands there),
        unless `%config TorchDeviceMagics.set_torch_default = False`.
        `%device` alone lists every device (read through NVML, without creating
        a CUDA context) and marks the session device with `*`. `--move` also
        moves every tensor, model and optimizer in the namespace there, all or
        nothing, as `%%ondevice --all` does (`%device reset --move` to the CPU).
        """
        args = parse(self.device, line)
        if args.spec is None:
            if args.move:
                raise DeviceMagicError("%device --move needs a device, e.g. %device cuda --move")
            display(device_table(take_inventory(), self.session_device))
            return
        if args.spec == "reset":
            dev, why = None, "cpu (torch's default device restored)"
        else:
            dev, why = self._resolve(args.spec)
        if args.move:
            moved = moving.move(self.shell.user_ns, self._all_names(), dev or torch.device("cpu"))
        self.set_session_device(dev)
        print(f"device = {why}")
        if args.move:
            display(moved.table())

    def _resolve(self, spec: str) -> tuple[torch.device, str]:
        """The device `spec` names on this machine, and the line that says what it is."""
        return resolve(spec, take_inventory(probe_cuda_runtime=spec.startswith("cuda")))

    def _cell_device(self, spec: str | None) -> torch.device:
        """The device `%%ondevice` runs on: the one named, else the session device."""
        if spec is not None:
            return self._resolve(spec)[0]
        if self.session_device is None:
            raise DeviceMagicError(
                "%%ondevice needs a device: name one (%%ondevice cuda) or set the session "
                "device with %device"
            )
        return self.session_device

    def _all_names(self) -> list[str]:
        """The user's names: not IPython's own (In, Out, _i3, _) nor hidden ones."""
        hidden = self.shell.user_ns_hidden
        return [n for n in self.shell.user_ns if not n.startswith("_") and n not in hidden]

    @magic_arguments()
    @argument(
        "spec",
        nargs="?",
        help=f"where the cell runs: {EXAMPLES}. Omit it to use the session device set "
        "by %%device.",
    )
    @argument("--all", action="store_true", help="move every name, not only those the cell uses")
    @argument(
        "--restore",
        action="store_true",
        help="after the cell, success or failure, send what moved back where it came from",
    )
    @argument("-v", "--verbose", action="store_true", help="say what moved, how much and how fast")
    @line_cell_magic
    @user_errors
    def ondevice(self, line: str, cell: str | None = None) -> Any:
        """Run a cell on a device, moving there what the cell uses, with nothing lost.

        In [1]: %%ondevice cuda -v
           ...: loss = train_one_epoch(model, opt, batch)
        moved 44.7 MiB to cuda:0 in 9.8 ms
        name   bytes
        -----  --------
        batch  1.2 MiB
        model  21.7 MiB
        opt    21.7 MiB

        The tensors, Parameters, modules, optimizers (their state too) and
        containers of them (list, tuple, dict, namedtuple, dataclass) that the
        cell names move first, all or nothing: if any copy fails (out of
        memory, a dtype the device lacks), nothing changes, the cell does not
        run, and the error says what failed, its size and what was free. The
        cell then runs with DEV as torch's default device, which comes back
        afterwards.

        Choices where the contract is silent:
        - Names are found in the cell's own code (what it reads, and the roots
          of `a.b[c]`), not inside the functions it calls: a training function
          that uses a global optimizer needs that optimizer named, or --all.
          Names inside nested magics (`%time f(x)`) are not seen either.
        - Moved objects keep their identity: their tensors are swapped in
          place, so a name, a list entry and a module attribute that held the
          same tensor still do. Where torch refuses that (a weak reference, a
          view the cell does not name, a live autograd graph), `.data` is set,
          or, to and from meta, the holders walked get a new tensor; -v lists
          them. A tensor with an autograd history arrives detached from it.
        - Optimizer state follows its parameters; `step` stays on the CPU
          unless the group is capturable or fused, as torch keeps it.
        - --all moves every name of yours (not `_`-prefixed or IPython's own).
        - --restore sends back what the names held, with what the cell did to
          it; optimizer state and parameters the cell added to a moved model
          go back with it; anything else the cell made stays on DEV. From
          meta the originals come back as they were, optimizer steps included.
        - A move of a GiB or more shows a progress bar that goes away when done.
        """
        __tracebackhide__ = True
        if cell is None:
            raise DeviceMagicError(
                "%ondevice is a cell magic: put %%ondevice DEV on the first line of the cell"
            )
        args = parse(self.ondevice, line)
        dev = self._cell_device(args.spec)
        if args.all:
            names = self._all_names()
        else:
            names = moving.cell_names(self.shell.transform_cell(cell))
        moved = moving.move(self.shell.user_ns, names, dev, restorable=args.restore)
        if args.verbose:
            display(moved.table())
        try:
            with torch.device(dev):
                return cells.run(self.shell, cell)
        finally:
            if args.restore:
                back = moving.restore(self.shell.user_ns, moved)
                if args.verbose:
                    display(back.table())

    @magic_arguments()
    @argument("mode", nargs="?", help="line form only: 'on' or 'off' for the cells that follow")
    @argument(
        "--inference",
        action="store_true",
        help="use torch.inference_mode() instead of torch.no_grad() (faster; tensors made "
        "in the cell can never join autograd later)",
    )
    @line_cell_magic
    @user_errors
    def nograd(self, line: str, cell: str | None = None) -> Any:
        """Run a cell without autograd (`%%nograd`), or switch it off for later cells.

        In [1]: %%nograd
           ...: y = model(x)        # no graph is built; y.requires_grad is False

        `%nograd on` turns autograd off for the cells that follow, `%nograd off`
        turns it back on. The cell form restores grad mode even when the cell
        raises or is interrupted.
        """
        __tracebackhide__ = True
        args = parse(self.nograd, line)
        if cell is None:
            if args.mode not in ("on", "off") or args.inference:
                raise DeviceMagicError(
                    "%nograd takes 'on' or 'off' (use %%nograd [--inference] as a cell magic)"
                )
            self._set_nograd(args.mode == "on")
            return None
        if args.mode is not None:
            raise DeviceMagicError(f"%%nograd takes no argument but --inference, got {args.mode!r}")
        with torch.inference_mode() if args.inference else torch.no_grad():
            return cells.run(self.shell, cell)

    def _set_nograd(self, on: bool) -> None:
        if on:
            if self._grad_before_nograd is None:
                self._grad_before_nograd = torch.is_grad_enabled()
            torch.set_grad_enabled(False)
            print("autograd is off for the cells that follow (%nograd off turns it back on)")
        else:
            torch.set_grad_enabled(
                True if self._grad_before_nograd is None else self._grad_before_nograd
            )
            self._grad_before_nograd = None
            print("autograd is back on")


def load(ip: Any) -> None:
    """Register the magics and the per-cell hooks on `ip`."""
    magics = TorchDeviceMagics(ip)
    ip.register_magics(magics)
    magics.reporter.register(ip)


def unload(ip: Any) -> None:
    """Remove the magics and hooks and restore the default device and grad mode."""
    magics = ip.magics_manager.registry.pop(TorchDeviceMagics.__name__, None)
    if magics is None:
        return
    magics.close()
    for table in ip.magics_manager.magics.values():
        for name, fn in list(table.items()):
            if getattr(fn, "__self__", None) is magics:
                del table[name]
    if magics in ip.configurables:
        ip.configurables.remove(magics)
