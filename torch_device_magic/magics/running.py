"""Where work runs: `%device`, `%%ondevice`, `%%nograd`."""

from __future__ import annotations

from typing import Any

import torch
from IPython.core.magic import line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, kwds, magic_arguments
from IPython.display import display

from .. import cells, moving, reach
from ..default_device import for_cell
from ..devices import EXAMPLES, device_table, take_inventory
from ..errors import DeviceMagicError
from ..namespace import holds_tensors
from .arguments import parse, user_errors
from .core import MagicsGroup


@magics_class
class TorchDeviceRunMagics(MagicsGroup):
    """Where work runs: the session device, one cell on a device, autograd off."""

    @magic_arguments()
    @argument(
        "spec",
        nargs="?",
        help=f"where new work runs: {EXAMPLES}; 'reset' returns to torch's default (the CPU, "
        "or one set with torch.set_default_device: `device` is bound to it). Omit it to list "
        "the devices.",
    )
    @argument(
        "--move",
        action="store_true",
        help="also move the namespace's tensors, models and optimizers there (as "
        "%%%%ondevice --all does)",
    )
    @argument(
        "--no-default",
        action="store_true",
        help="only bind `device`: leave torch's default device as it is for this choice "
        "(DataLoader(shuffle=True) works)",
    )
    @line_magic
    @user_errors
    def device(self, line: str) -> None:
        """Choose where new work runs, or list the devices.

        In [1]: %device auto
        device = cuda:1 (NVIDIA H200, 139.1 of 139.8 GiB free, the most of 2 GPUs)

        The choice is bound as `device` in the namespace and becomes torch's
        default device for factory functions (`torch.zeros(3)` lands there),
        unless `--no-default` (this choice) or `%config
        TorchDeviceMagics.set_torch_default = False` (every choice); the CPU,
        torch's own default, installs none. Only factory calls pay for that
        default (torch's own costs on every torch call, see the README);
        forked DataLoader workers start without it. A default
        set with `torch.set_default_device` by hand is never undone by us.
        `%device` alone lists every device (read through NVML, without creating
        a CUDA context; MIG instances with their own memory; a PrivateUse1
        accelerator's, each with its memory once its runtime is up) and marks the
        session device with `*`, and under it the cell that initialised CUDA
        ("CUDA initialised by cell [7]: " and its first line of code), as the
        report noted it: a cell that forks or launches (notebook_launcher,
        ddp_notebook) must come before it. `auto` takes the usable GPU with the most free
        memory: a GPU this torch cannot run on (driver too old, compute
        capability not built for) is listed with the reason and skipped. Before
        a CUDA context exists, differing GPUs are listed as `cuda:?` unless
        CUDA_DEVICE_ORDER=PCI_BUS_ID (CUDA counts fastest first, NVML in PCI
        order), and `auto` then takes `cuda`. A chosen `cuda:N` also becomes
        CUDA's current device (queued until CUDA starts; nothing starts now).
        `--move` also moves every tensor, model and optimizer in the namespace
        there, all or nothing, as `%%ondevice --all` does (`%device reset --move`
        to the CPU); to meta, which holds no data, it is refused while a tensor
        holds some (`%%ondevice meta --restore` runs a cell there and gives it back).
        """
        args = parse(self.device, line)
        if args.spec is None:
            if args.move:
                raise DeviceMagicError("%device --move needs a device, e.g. %device cuda --move")
            cuda_start = self.core.reporter.cuda_start
            display(device_table(take_inventory(), self.core.session.device,
                                 None if cuda_start is None else str(cuda_start)))
            return
        session = self.core.session
        if args.spec == "reset":
            dev, target = None, session.default_after_reset()
            why = f"{target} (torch's default device restored{_set_by_hand(target)})"
        else:
            dev, why = self._resolve(args.spec)
            target = dev
        if args.move:  # first: a move that fails changes nothing, the current device neither
            moved = moving.move(self.shell.user_ns, self._all_names(), target,
                                keep_data=True)
        session.set_device(dev, self.shell.user_ns, torch_default=not args.no_default)
        print(f"device = {why}")
        if args.move:
            display(moved.table())

    def _cell_device(self, spec: str | None) -> torch.device:
        """The device `%%ondevice` runs on: the one named, else the session device."""
        if spec is not None:
            return self._resolve(spec)[0]
        if self.core.session.device is None:
            raise DeviceMagicError(
                "%%ondevice needs a device: name one (%%ondevice cuda) or set the session "
                "device with %device"
            )
        return self.core.session.device

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
           ...: loss = train_step(model, opt, batch)
        moved 66.3 MiB to cuda:0 in 9.8 ms
        name      bytes
        -----  --------
        batch   1.2 MiB
        model  21.7 MiB
        opt    43.4 MiB
        opt also holds 21.7 MiB counted under model

        The tensors, Parameters, modules, optimizers (their state too) and
        containers of them (list, tuple, dict, namedtuple, dataclass) that the
        cell names move first, all or nothing: if any copy fails (out of
        memory, a dtype the device lacks), nothing changes, the cell does not
        run, and the error says what failed, its size and what was free. The
        cell then runs with DEV as torch's default device, installed as
        %device installs it (factory calls fill in `device=`; no mode that
        every torch call pays for, so warnings name your lines; for the CPU
        none at all), and the default before comes back afterwards, on an
        error or Ctrl-C too (one the cell sets by hand stays).

        The body is compiled before anything moves: a syntax error shows as a
        plain cell's does and nothing moves; top-level `await` cannot run
        under a cell magic and is refused in one line. `cpu:0` is the CPU.

        Choices where the contract is silent:
        - Names are the global names the cell's code reads (the roots of
          `a.b[c]` too), also inside the functions and lambdas it defines, but
          not their parameters, loop variables or locals; and the globals that
          the code it can call reads, transitively: the notebook's functions,
          lambdas, partials and decorated functions it names, the methods it
          names (`trainer.fit()`), and a module's forward and hooks (calling
          `model(x)` does not follow its other methods). A `train_step()`
          that uses a global model and optimizer moves them.
          What cannot follow stays where it is, and -v names it: the globals
          of a module of your own (`train.py`), a closure's or a default
          argument's tensors. A nested cell magic whose body is Python
          (%%nograd, %%gpumem, %%profile, %%devcompare, %%time, %%timeit,
          %%capture, %%prun) is read as the cell's code, and so is the
          argument of %time, %timeit and %prun past their options; what is
          not Python (%%bash's body, a !command) is not, and one line says
          so where it names tensors.
        - Moved objects keep their identity: their tensors are swapped in
          place, so a name, a list entry, a weak reference, a module attribute
          and an optimizer that held the same tensor still do, with its
          autograd hooks and lazy conj/neg bits. A name of yours that shares a
          moved storage (a view's base, a view, a detached alias, a model whose
          parameter is viewed) moves with it, once, and -v names it; an
          expanded or unfolded view moves as its storage's bytes. Where a view
          no name of yours reaches or an earlier autograd graph holds a tensor,
          that one gets `.data` (to or from meta: they keep the old tensor, and
          a backward through such a graph fails, saying why); -v lists them. A
          tensor with an autograd history arrives detached from it. A view
          moved with its base stays its view (one storage, one version counter).
        - Tensor subclasses that keep their data in Python attributes (jagged
          nested tensors, MaskedTensor, `__tensor_flatten__` wrappers) move
          through their own `.to`; one whose `.to` leaves data behind is
          refused in one line. A move in inference mode makes the kind of
          tensor it found: a model moved under %%nograd --inference trains.
        - -v counts each tensor's bytes once, under the first name reaching
          it, names taken alphabetically but optimizers last (a model's
          parameters count under the model), and says what is shared.
        - The walk looks at up to 100,000 objects other than tensors a name
          and skips objects that raise when read; -v names both. An error or
          Ctrl-C during the move changes nothing.
        - Optimizer state follows its parameters; `step` stays on the CPU
          unless the group is capturable or fused, as torch keeps it.
        - --all moves every name of yours (not `_`-prefixed or IPython's own).
        - Meta holds no data: without --restore, a move there of tensors that hold
          some is refused in one line (tensors already on meta, or empty, may move).
        - --restore sends back what the names held, with what the cell did to
          it, each tensor where it was (a model split across devices comes
          back split); optimizer state and parameters the cell added to a
          moved model go back with it, to the part they joined; anything else
          the cell made, and a name it rebound, stays on DEV. From meta the
          very same objects come back with their data, grad_fn, hooks and
          .grad, optimizer state and steps included, whatever the cell kept
          (a loss, Out, a traceback, a view), and a name the cell bound to
          meta tensors gets its data back: "--restore from meta gave back
          what the name x held: the cell bound it to meta tensors, which hold
          no data".
        - Ctrl-C waits while the commit runs, and from the cell's end until the
          restore is done: "Ctrl-C during --restore: it finished first,
          everything went back". A SIGINT handler of your own gets such a
          Ctrl-C once they are done, and nothing is cancelled; if it raises,
          --restore still restores.
        - A move of a GiB or more shows a progress bar (text unless ipywidgets
          is installed) that goes away when done.
        """
        __tracebackhide__ = True
        if cell is None:
            raise DeviceMagicError(
                "%ondevice is a cell magic: put %%ondevice DEV on a cell's first line and the "
                "code to run under it (%device DEV sets the device for the cells that follow)"
            )
        args = parse(self.ondevice, line)
        dev = self._cell_device(args.spec)
        run = cells.compiled(self.shell, cell)  # a cell that cannot run moves nothing
        source, foreign = cells.python_of(self.shell, cell)  # a nested %%nograd's body too
        names = self._all_names() if args.all else cells.cell_names(source)
        # and what the code it can call reads (the notebook's functions, a module's forward)
        found = reach.reach(self.shell.user_ns, names, cells.cell_attributes(source))
        names = sorted({*names, *found.names})
        unread = None if args.all else self._unread(cell, source, foreign, dev)
        moved, failed, hold = None, False, moving.SigintHold()
        self.core.reporter.say_live(f"moving to {dev}")
        try:  # entered before the move: a Ctrl-C just after it still restores
            moved = moving.move(self.shell.user_ns, names, dev, restorable=args.restore,
                                keep_data=True, others=self._all_names)
            # A Ctrl-C once the move was done goes to the SIGINT handler now, inside the
            # try: if it raises (Python's does), what moved is restored below.
            moving.deliver(moved)
            if unread:
                print(unread)
            if args.verbose:
                table = moved.table()
                table.notes = [*table.notes, *found.notes()]
                display(table)
            self.core.reporter.say_live(f"running on {dev}")
            with for_cell(dev):
                return run()
        except BaseException as err:
            if moved is not None:  # the cell's error, not the move's
                # The hint comes after the default is restored: tell it what was in force.
                self.core.failed_under, failed = (id(err), dev, bool(args.restore)), True
            raise
        finally:
            if args.restore and moved is not None:
                # First, and in C: a Ctrl-C from the cell's end on waits for the restore.
                hold.replaced = hold.engage()
                self._restore(moved, hold, failed, args.verbose)

    def _unread(self, cell: str, source: str, foreign: str | None, dev: torch.device) -> str | None:
        """The line that says what the cell uses where `%%ondevice` reads no Python (a nested
        `%%bash`'s body, a `%magic`'s argument), and so does not move; None where nothing."""
        if foreign is None and "%" not in cell and "!" not in cell:
            return None  # Python throughout: all of it read
        read, ns = set(cells.code_words(source)), self.shell.user_ns
        held = [w for w in cells.code_words(cell) if w not in read and not w.startswith("_")
                and w not in self.shell.user_ns_hidden and w in ns and holds_tensors(ns[w])]
        verb = "holds" if len(held) == 1 else "hold"
        if foreign is not None:
            held_here = f" ({', '.join(held)} {verb} tensors)" if held else ""
            return (f"%%ondevice: the body of %%{foreign} is not Python it can read, so "
                    f"nothing it uses moved to {dev}{held_here}")
        if not held:
            return None
        return (f"%%ondevice: {', '.join(held)} {verb} tensors the cell names only in IPython "
                f"syntax that is not Python (a !command, a %magic's argument), so not moved "
                f"to {dev}")

    def _restore(
        self, moved: moving.MoveResult, hold: moving.SigintHold, failed: bool, verbose: bool
    ) -> None:
        """--restore under `hold`, engaged: what moved goes back and is shown, then the
        Ctrl-Cs held since the cell ended reach the SIGINT handler."""
        with hold:
            try:
                back = moving.restore(self.shell.user_ns, moved, hold)
            except Exception as restore_error:
                if not failed:
                    raise
                # The cell's own error (a sticky CUDA error, say) is the one raised.
                print(f"%%ondevice --restore could not send back what moved: {restore_error}")
            else:
                if verbose and (back.names or back.restored):
                    display(back.table(rows=False))  # the move's table listed the names
                for line in back.said:
                    print(line)

    @magic_arguments()
    @kwds(usage="nograd on|off\n  %%%%nograd [--inference]")  # --inference is for one cell
    @argument("mode", nargs="?", help="line form only: 'on' or 'off' for the cells that follow")
    @argument(
        "--inference",
        action="store_true",
        help="cell form only: use torch.inference_mode() instead of torch.no_grad() (faster; "
        "tensors made in the cell can never join autograd later)",
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
            if args.inference:
                raise DeviceMagicError(
                    "%nograd takes no --inference: inference mode is for one cell "
                    "(%%nograd --inference); %nograd on turns autograd off for the cells "
                    "that follow"
                )
            if args.mode not in ("on", "off"):
                raise DeviceMagicError(
                    "%nograd takes 'on' or 'off' (use %%nograd [--inference] as a cell magic)"
                )
            on = args.mode == "on"
            self.core.session.set_nograd(on)
            print("autograd is off for the cells that follow (%nograd off turns it back on)"
                  if on else "autograd is back on")
            return None
        if args.mode is not None:
            raise DeviceMagicError(f"%%nograd takes no argument but --inference, got {args.mode!r}")
        self.core.reporter.say_live("running without autograd")
        with torch.inference_mode() if args.inference else torch.no_grad():
            return cells.run(self.shell, cell)


def _set_by_hand(default: torch.device) -> str:
    """What `%device reset` says of a default other than the CPU: it is the user's own."""
    return "" if default.type == "cpu" else ": the one torch.set_default_device set"
