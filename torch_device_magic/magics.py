"""The IPython layer: configuration traits and thin magic bodies over the pure modules.

Each magic parses its line with `@magic_arguments` (so `%device?` documents
itself), calls into a module that knows nothing of IPython, and displays or
returns what it got. A `DeviceMagicError` from below becomes IPython's own
`UsageError`: one sentence, no traceback, nothing changed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from types import MethodType
from typing import Any

import torch
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, kwds, magic_arguments, parse_argstring
from IPython.display import display
from traitlets import Bool, Float, Int, TraitError, observe, validate

from . import cells, devices, gpumem, hints, holders, moving, profile, reach
from .advice import Advisor
from .devcompare import compare, devices_to_compare
from .devices import EXAMPLES, device_table, resolve, take_inventory
from .errors import DeviceMagicError
from .gpufree import free_memory
from .history import save_plot
from .hooks import CellReporter
from .namespace import scan
from .session import Session
from .units import parse_bytes


def user_errors(method: Callable) -> Callable:
    """Turn the package's `DeviceMagicError` into the exact `UsageError` IPython prints cleanly."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        try:
            return method(*args, **kwargs)
        except DeviceMagicError as err:
            message = str(err)
        # Raised out here, the UsageError has no __context__: the DeviceMagicError's
        # frames (a failed move's plan, with the user's tensors) are not kept with it.
        raise UsageError(message)

    return wrapper


def parse(magic: MethodType, line: str, cell: bool = False) -> Any:
    """Parse a magic's line (`cell`: its `%%` form's); a mistake names the magic as typed
    and where to read its options."""
    name = magic.__name__
    typed = f"%%{name}" if cell else f"%{name}"
    try:
        args = parse_argstring(magic, line)
    except UsageError as err:
        raise UsageError(f"{typed}: {err} (see %{name}? for its options)") from err
    except ValueError as err:  # unbalanced quotes, from the line splitter
        raise UsageError(f"{typed}: cannot read {line!r}: {err}") from err
    for key, value in vars(args).items():
        if isinstance(value, str):
            setattr(args, key, unquote(value))
        elif isinstance(value, list):
            setattr(args, key, [unquote(v) if isinstance(v, str) else v for v in value])
    return args


def cell_form(name: str, body: str, cell: str | None) -> str:
    """The cell of a magic that is only a cell magic; its line form is a mistake."""
    if cell is None:
        raise DeviceMagicError(f"%{name} is a cell magic: put %%{name} on a cell's first "
                               f"line and {body} under it")
    return cell


def unquote(text: str) -> str:
    """`"my file.csv"` as `my file.csv`: IPython's line splitter keeps the quotes."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


@magics_class
class TorchDeviceMagics(Magics):
    """PyTorch device magics: choosing, moving, measuring, comparing; hints on device errors."""

    set_torch_default = Bool(
        True,
        help="Make the %device choice torch's default device for factory functions "
        "(as torch.set_default_device, paid by factory calls only). It breaks "
        "DataLoader(shuffle=True) on a non-CPU "
        "default; set False to only bind `device` (%device DEV --no-default: for one "
        "choice). Only a default that we set is ever undone.",
    ).tag(config=True)

    auto_report = Bool(
        True,
        help="Show one line after every cell: wall time, device time, device and host "
        "memory change and peak. %devreport on|off is the same switch: the latest choice "
        "wins, and lasts through %reload_ext. It resets torch's peak memory counter "
        "before each cell (the session's peak is in %devhistory).",
    ).tag(config=True)
    report_min_seconds = Float(
        0.0,
        help="Show the per-cell line only for cells that take at least this many seconds "
        "(a finite number; 0 = unset; with both thresholds unset every cell is shown).",
    ).tag(config=True)
    report_min_bytes = Int(
        0,
        help="Show the per-cell line only for cells whose memory change or peak, on the "
        "device or the host, reaches this many bytes (0 = unset).",
    ).tag(config=True)
    sync = Bool(
        True,
        help="Synchronise the accelerator before stopping a cell's clock, so that queued "
        "kernels count. Only done where a CUDA context (or other runtime) already exists.",
    ).tag(config=True)
    hints = Bool(
        True,
        help="After the traceback of a classic device error (tensors on different devices, "
        "out of memory, a CUDA checkpoint without CUDA, DataLoader under a non-CPU default "
        "device), print a short block starting 'Hint (torch_device_magic):'.",
    ).tag(config=True)

    advice = Bool(
        True,
        help="Under the per-cell line, a note when a cell left something to act on: a "
        "torch.compile compile, recompile or graph break; a large displayed result kept in "
        "Out; inference that keeps an autograd graph; a peak near the device's capacity. "
        "Each is also the record's `notes` in %devhistory -o.",
    ).tag(config=True)

    _shell: InteractiveShell | None = None

    def __init__(self, shell: InteractiveShell | None) -> None:
        # State first: traits set in ipython_config.py fire observers during super().__init__
        # (a configured set_torch_default reaches the session that way).
        self.reporter = CellReporter()
        self.session = Session()
        self._advisor: Advisor | None = None  # made with the shell, once
        self._failed_under: tuple[int, torch.device] | None = None  # (id(error), %%ondevice's)
        self._profiling = False  # a %%profile cell is running
        self.traces = profile.TraceFiles()  # %%profile's unnamed traces: the last one is kept
        super().__init__(shell=shell)

    @property
    def shell(self) -> InteractiveShell:
        """The shell the magics are loaded in: every magic needs one."""
        assert self._shell is not None, "TorchDeviceMagics needs a shell"
        return self._shell

    @shell.setter
    def shell(self, shell: InteractiveShell | None) -> None:  # Magics.__init__ sets it
        self._shell = shell

    @validate("report_min_seconds", "report_min_bytes")
    def _not_negative(self, proposal: Any) -> Any:
        if not math.isfinite(proposal.value):
            raise TraitError(
                f"{proposal.trait.name} must be a finite number, 0 (unset) or more, "
                f"not {proposal.value}"
            )
        if proposal.value < 0:
            raise TraitError(f"{proposal.trait.name} must be 0 (unset) or more")
        return proposal.value

    @observe("auto_report", "report_min_seconds", "report_min_bytes", "sync", "hints", "advice")
    def _report_settings_changed(self, change: Any) -> None:
        self.apply_report_settings()

    def apply_report_settings(self) -> None:
        """Hand the report and hint traits to the hooks; hook the report on or off."""
        reporter = self.reporter
        reporter.min_seconds, reporter.min_bytes = self.report_min_seconds, self.report_min_bytes
        reporter.sync = self.sync
        if self._shell is None:
            return
        if self.auto_report and not reporter.registered:
            reporter.register(self.shell)
        elif not self.auto_report and reporter.registered:
            reporter.unregister(self.shell)
        reporter.set_hint(self.shell, self._hint if self.hints else None)
        if self.advice and self._advisor is None:
            self._advisor = Advisor(self.shell)
        reporter.advise = self._advisor.notes if self.advice and self._advisor else None

    def _hint(self, error: BaseException, source: str) -> str | None:
        failed, self._failed_under = self._failed_under, None
        cell_default = failed[1] if failed is not None and failed[0] == id(error) else None
        cuda_start = self.reporter.cuda_start
        return hints.hint(error, self.shell.user_ns, source, self.session.device, cell_default,
                          None if cuda_start is None else str(cuda_start))

    @observe("set_torch_default")
    def _torch_default_switched(self, change: Any) -> None:
        self.session.set_torch_default(change.new)

    def close(self) -> None:
        """Undo what loading and the magics changed: the hooks, and the session's state."""
        self.reporter.unregister(self.shell)
        self.reporter.set_hint(self.shell, None)
        self.session.close(self.shell.user_ns)
        self.traces.close()

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
    @argument(
        "--no-default",
        action="store_true",
        help="only bind `device`: leave torch's default device as it is for this choice "
        "(no cost on every torch call, and DataLoader(shuffle=True) works)",
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
        a CUDA context; MIG instances with their own memory) and marks the
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
            cuda_start = self.reporter.cuda_start
            display(device_table(take_inventory(), self.session.device,
                                 None if cuda_start is None else str(cuda_start)))
            return
        if args.spec == "reset":
            dev, why = None, "cpu (torch's default device restored)"
        else:
            dev, why = self._resolve(args.spec)
        if args.move:  # first: a move that fails changes nothing, the current device neither
            moved = moving.move(self.shell.user_ns, self._all_names(), dev or torch.device("cpu"),
                                keep_data=True)
        self.session.set_device(dev, self.shell.user_ns, torch_default=not args.no_default)
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
        if self.session.device is None:
            raise DeviceMagicError(
                "%%ondevice needs a device: name one (%%ondevice cuda) or set the session "
                "device with %device"
            )
        return self.session.device

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
        cell then runs with DEV as torch's default device, which comes back
        afterwards.

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
          argument's tensors. Names inside nested magics (`%time f(x)`) are
          not seen.
        - Moved objects keep their identity: their tensors are swapped in
          place, so a name, a list entry, a weak reference, a module attribute
          and an optimizer that held the same tensor still do, with its
          autograd hooks and lazy conj/neg bits. Where a view the cell does not
          name or an earlier autograd graph holds a tensor, that one gets
          `.data` (to or from meta: they keep the old tensor, and a backward
          through such a graph fails, saying why); -v lists them. A tensor with
          an autograd history arrives detached from it. A view moved with its
          base stays its view (one storage, one version counter).
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
        names = (self._all_names() if args.all
                 else cells.names_read(self.shell, cell))
        # and what the code it can call reads (the notebook's functions, a module's forward)
        found = reach.reach(self.shell.user_ns, names, cells.attributes_read(self.shell, cell))
        names = sorted({*names, *found.names})
        moved, failed, hold = None, False, moving.SigintHold()
        try:  # entered before the move: a Ctrl-C just after it still restores
            moved = moving.move(self.shell.user_ns, names, dev, restorable=args.restore,
                                keep_data=True)
            # A Ctrl-C once the move was done goes to the SIGINT handler now, inside the
            # try: if it raises (Python's does), what moved is restored below.
            moving.deliver(moved)
            if args.verbose:
                table = moved.table()
                table.notes = [*table.notes, *found.notes()]
                display(table)
            with torch.device(dev):
                return run()
        except BaseException as err:
            if moved is not None:  # the cell's error, not the move's
                # The hint comes after the default is restored: tell it what was in force.
                self._failed_under, failed = (id(err), dev), True
            raise
        finally:
            if args.restore and moved is not None:
                # First, and in C: a Ctrl-C from the cell's end on waits for the restore.
                hold.replaced = hold.engage()
                self._restore(moved, hold, failed, args.verbose)

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
            self.session.set_nograd(on)
            print("autograd is off for the cells that follow (%nograd off turns it back on)"
                  if on else "autograd is back on")
            return None
        if args.mode is not None:
            raise DeviceMagicError(f"%%nograd takes no argument but --inference, got {args.mode!r}")
        with torch.inference_mode() if args.inference else torch.no_grad():
            return cells.run(self.shell, cell)

    @magic_arguments()
    @argument(
        "--device",
        help="a filter: only names holding a tensor on this device (cuda matches every "
        "cuda:N; a device this machine lacks matches nothing)",
    )
    @argument(
        "--min-bytes",
        default="0",
        help="only names holding at least this much: 1048576, 1MiB or 1.5GB",
    )
    @argument(
        "-o", dest="output", action="store_true", help="return the rows instead of showing them"
    )
    @argument(
        "--hidden", action="store_true",
        help="list instead what no name holds but keeps tensors alive: Out[n] and _, the last "
        "traceback, autograd graphs, optimizer state",
    )
    @line_magic
    @user_errors
    def tensors(self, line: str) -> Any:
        """List the tensors, modules and optimizers in the namespace: a %whos for PyTorch.

        In [1]: %tensors
        tensors in the namespace (3 names)
        name   kind            device  dtype    shape                bytes  grad
        -----  --------------  ------  -------  ---------------  ---------  ------------
        model  module Linear   cuda:0  float32  1.0M params        4.0 MiB  grad 4.0 MiB
        opt    optimizer Adam  cuda:0  float32  2 param tensors    8.0 MiB
        x      tensor          cpu     float32  (64, 1024)       256.0 KiB
        total: cpu 256.0 KiB, cuda:0 16.0 MiB (shared storage counted once, gradients included)

        A row's bytes are the storages the name keeps alive (a view counts its
        whole base); a module's are its parameters and buffers, an optimizer's
        its state; a sparse tensor's are its indices and values. Totals per
        device count shared storage once. Warnings name a module whose
        parameters span devices, an optimizer whose state is on another device
        than its parameters, and an object that raised when looked into (it is
        skipped). At most 100,000 objects are looked at per name (its kind then
        says "first 100,000 items"). `--device` and `--min-bytes` filter the
        rows; `-o` returns them (TensorRow).

        `--hidden` lists what keeps tensors alive behind the names: displayed
        results (Out[n], _), the last traceback's locals, the autograd graph a
        stored tensor keeps (its saved activations), optimizer state; each
        storage counted once, none that a name holds. On an accelerator it says
        how much of the allocator's allocated memory stays unaccounted. `-o`
        returns the holders (Holder: name, nbytes per device, fix, kind).
        """
        args = parse(self.tensors, line)
        if args.hidden:
            if args.device is not None or parse_bytes(args.min_bytes):
                raise DeviceMagicError("%tensors --hidden takes no filter (--device, --min-bytes)")
            found = holders.hidden(self.shell.user_ns, self.shell.user_ns_hidden)
            if args.output:
                return found.holders
            display(found)
            return None
        try:
            device = None if args.device is None else devices.parse(args.device)
        except DeviceMagicError as err:  # its message offers `auto`, which names no tensor's device
            raise DeviceMagicError(
                f"{args.device!r} is not a device: --device filters by where tensors are, "
                "e.g. cpu, cuda, cuda:1, mps, xpu or meta"
            ) from err
        report = scan(
            self.shell.user_ns, self.shell.user_ns_hidden, device, parse_bytes(args.min_bytes)
        )
        if args.output:
            return report.rows
        display(report)
        return None

    @magic_arguments()
    @argument(
        "devices",
        nargs="*",
        help="two or more devices, the first being the reference: cpu cuda, cuda:0 cuda:1, cpu mps",
    )
    @argument("-n", dest="runs", type=int, default=5, help="timed runs per device (default 5)")
    @argument("--warmup", type=int, default=1, help="untimed runs per device first (default 1)")
    @argument(
        "-o", dest="output", action="store_true", help="return the comparison instead of showing it"
    )
    @line_cell_magic
    @user_errors
    def devcompare(self, line: str, cell: str | None = None) -> Any:
        """Run the cell on each device, timed, and say how far the results differ.

        In [1]: %%devcompare cpu cuda
           ...: a @ b
        %%devcompare: 5 runs per device after 1 warm-up
        device    median   spread (min … max)  speed-up  max |difference| vs cpu
        ------  --------  -------------------  --------  -----------------------
        cpu     312.4 ms  305.1 ms … 330.9 ms  1.00×
        cuda      4.1 ms      4.0 ms … 4.3 ms  76.20×    3.1e-05

        On each device the cell gets copies of what it reads that holds tensors
        (models, optimizers, containers, and objects holding them such as a
        TensorDataset or an LR scheduler), also what the code it can call reads
        (`loss = train_step()` trains copies of the global model and optimizer,
        never yours; a forward hook fills a copy of your `activations` dict),
        with that device as torch's
        default and as `device` (the CPU runs with no default device installed,
        even under %device). A function that reaches tensors through no name of
        the notebook (a module of your own's globals, a closure, a default
        argument) is refused in one line and nothing runs; installed code
        (torch, the standard library, site-packages) is not looked into.
        Tensors are copied straight to the device; one already there is shared
        unless the first warm-up, run under a guard that stops it before any
        write into it, shows the cell writes it (then it is copied; --warmup 0
        copies everything). Copies that do not fit in the free memory are
        refused in one line; each device's are freed before the next device's.
        Afterwards the namespace is exactly as before: nothing the cell bound
        or changed stays, and the random state of the CPU, the devices and
        your own generators the cell reaches is as it was. Times are wall times with the
        device synchronised; the difference is the largest absolute difference
        between the devices' values of the cell's last expression (tensors, or
        lists, tuples and dicts of them): NaN in the same places is equal, NaN
        against a number reads "NaN in different places", meta is "not
        comparable". `cpu` and `cpu:0` are one device. `-o` returns a Comparison
        (devices: median_s, min_s, max_s, speedup, max_abs_diff).
        """
        __tracebackhide__ = True
        args = parse(self.devcompare, line)
        if cell is None:
            raise DeviceMagicError("%%devcompare is a cell magic: put the code to compare under it")
        if args.runs < 1 or args.warmup < 0:
            raise DeviceMagicError("%%devcompare needs -n 1 or more and --warmup 0 or more")
        cuda = any(d.startswith("cuda") for d in args.devices)
        chosen = devices_to_compare(args.devices, take_inventory(probe_cuda_runtime=cuda))
        run = cells.compiled(self.shell, cell)
        hidden = self.shell.user_ns_hidden  # IPython's own names (In, Out, _): never copied
        result = compare(self.shell.user_ns, run, cells.names_read(self.shell, cell), chosen,
                         args.runs, args.warmup, hidden, cells.attributes_read(self.shell, cell))
        if args.output:
            return result
        display(result)
        return None

    @magic_arguments()
    @line_magic
    @user_errors
    def gpufree(self, line: str) -> None:
        """Collect garbage and empty the accelerators' allocator cache; say how much came back.

        In [1]: del activations
        In [2]: %gpufree
        garbage collected (1,204 objects); cuda:0: 6.0 GiB came back (cached 8.1 GiB → 2.1 GiB,
        in tensors 2.0 GiB → 2.0 GiB)

        It first lets go of what keeps tensors alive that no name holds: the
        displayed results (Out[n], _n, _, __, ___) and the last traceback's
        frames, and says what each released (%tensors --hidden lists them);
        it names the autograd graphs that stored tensors still keep.
        Only accelerators already in use are touched (no CUDA context is created).
        Memory held by live tensors stays: `del` them first (%tensors lists them).
        On a machine without one it collects garbage and says so.
        """
        parse(self.gpufree, line)
        shell = self.shell
        print(free_memory(
            lambda: holders.release(shell.user_ns, shell.user_ns_hidden, shell.displayhook)
        ))

    @magic_arguments()
    @argument("mode", nargs="?", default="status", help="on, off, or status (the default)")
    @line_magic
    @user_errors
    def devreport(self, line: str) -> None:
        """Turn the line after every cell on or off, or say how it is set.

        In [1]: %devreport off
        per-cell report: off (every cell; synchronise: on); 12 cells in the history (%devhistory)

        The line shows wall time, device time (where the cell did accelerator
        work), device allocated change and peak, and host RSS change and peak.
        With `report_min_seconds` or `report_min_bytes` set (0 = unset), only
        cells reaching one of them are shown; every measured cell is kept in the
        history, shown or not. The device is synchronised before the clock stops
        only where its runtime is already up (`sync`); no CUDA context is ever
        created.

        It is the same switch as `%config TorchDeviceMagics.auto_report =
        True/False`: whichever was used last wins, and it lasts through
        `%reload_ext`. Where an accelerator is in use, the report resets
        torch's process-wide peak counter before each cell, so
        `torch.cuda.max_memory_allocated()` then covers one cell only; the
        session's peak is in `%devhistory`.
        """
        args = parse(self.devreport, line)
        if args.mode not in ("on", "off", "status"):
            raise DeviceMagicError(f"%devreport takes on, off or status, not {args.mode!r}")
        if args.mode != "status":
            self.auto_report = args.mode == "on"
            # %config keeps its value in the shell's config, which %reload_ext reads
            # again: the switch goes there too, so that the latest choice wins.
            self.shell.config[type(self).__name__]["auto_report"] = self.auto_report
        print(self.reporter.status())

    @magic_arguments(name="%gpumem")  # its usage reads %%gpumem
    @argument("-o", dest="output", action="store_true",
              help="return the report object instead of the cell's value (fields wall_s, "
              "device_s, device_delta_bytes, device_peak_bytes, device_reserved_delta_bytes, "
              "host_delta_bytes, host_peak_bytes; None where not measured)")
    @argument("-q", dest="quiet", action="store_true", help="do not display the report")
    @argument("--device", help="the accelerator to measure, one this machine has, or cpu "
              "for host memory only (default: the session device if it is an accelerator, "
              "else the current device of the runtime in use)")
    @line_cell_magic  # the line form is there for `%gpumem?`: it says it is a cell magic
    @user_errors
    def gpumem(self, line: str, cell: str | None = None) -> Any:
        """Run the cell and report what it did to accelerator memory.

        In [1]: %%gpumem
           ...: y = model(x)

        Shows allocated before -> after, the peak above the start (the
        process-wide peak counter is reset for this), the allocator cache
        (reserved) change, device-wide used memory from NVML (the CUDA context
        and other processes included), wall time with the device synchronised,
        device time on the current stream (work on other streams is outside it),
        the allocator backend, host RSS change and peak, and the five largest
        tensors bound to names the cell created or rebound (the storage each
        keeps alive). Where the cell had child processes (DataLoader workers,
        torch.multiprocessing, notebook_launcher), a row per worker: its pid,
        whether it still runs, its peak RSS, its PSS at the end (shared pages
        split between the processes sharing them) and, where NVML lists it,
        its GPU memory. Without an accelerator in use (or with
        `--device cpu`) it says so and reports host memory only. The cell is
        not reported a second time by the per-cell line. `-o` makes the report
        the cell's output instead of its last value (as `%%timeit -o` does);
        `-q` leaves only that output. A cell that raises shows no report.
        """
        __tracebackhide__ = True
        cell = cell_form("gpumem", "the code to measure", cell)
        args = parse(self.gpumem, line, cell=True)
        device = None if args.device is None else self._resolve(args.device)[0]
        if device is not None and device.type == "meta":
            raise DeviceMagicError("%%gpumem --device meta: meta tensors hold no memory, so "
                                   "there is nothing to measure (--device cpu: host memory)")
        report, value = gpumem.measure(self.shell.user_ns, cells.compiled(self.shell, cell), device)
        self.reporter.adopt(report)
        if args.output:
            return report
        if not args.quiet:
            display(report)
        return value

    @magic_arguments(name="%profile")  # its usage reads %%profile
    @argument("-n", dest="runs", type=int, default=1,
              help="profiled runs (default 1); each run repeats the cell's side effects")
    @argument("--warmup", type=int, default=0,
              help="unprofiled runs first (default 0); they repeat the side effects too, and "
              "the last one is the plain run the overview compares with")
    @argument("--sort", default="self",
              help="the op table's order: self (CPU time, the default), total, device, memory")
    @argument("--top", type=int, default=10, help="rows of the op and kernel tables (default 10)")
    @argument("--trace", metavar="PATH",
              help="write the Chrome/Perfetto trace there (default: a temporary file, shown, "
              "kept until the next %%%%profile or the session's end)")
    @argument("--steps", type=int, default=5,
              help="where the cell has a loop, record STEPS of its steps in full from the "
              "second (ops, memory, trace; default 5) and time the lines of every step; 0 "
              "records all")
    @argument("--memory", action="store_true",
              help="also draw the cell's memory over time, offline, its largest allocations "
              "labelled by line: from the CUDA allocator's history where the cell used CUDA "
              "(its snapshot saved for pytorch.org/memory_viz), else from the profiler's "
              "memory events")
    @argument("--threads", action="store_true",
              help="also record the ops of the threads the cell starts (every thread; this "
              "torch then records no memory allocations)")
    @argument("-f", dest="functions", action="append", default=[], metavar="NAME",
              help="also give the lines of this function (defined elsewhere: a notebook "
              "function, a method, a module's forward); repeatable")
    @argument("-o", dest="output", action="store_true",
              help="return the ProfileReport instead of the cell's value (.ops, .kernels, "
              ".lines, .trace_path, .profiler for key_averages())")
    @line_cell_magic  # the line form is there for `%profile?`: it says it is a cell magic
    @user_errors
    def profile(self, line: str, cell: str | None = None) -> Any:
        """Profile the cell with torch.profiler: where its time and memory go, by op and by line.

        In [1]: %%profile
           ...: loss = loss_fn(model(x), y)
           ...: loss.backward()

        Shows an overview (wall time; where a GPU's activity was recorded, its busy
        time and share of the wall, kernel launches, host-device copies and
        synchronisations, naming an .item() or .cpu() that a loop repeats), then
        the table by line: for each line of the cell, and of the functions it
        defines, its hits, wall time, torch CPU time, device time and memory
        allocated, each event counted once, on the innermost line running when
        it happened (a line that calls a function of the cell gets only what ran
        on it outside that function's lines, as those have their own rows); then
        the top ops (calls, self and total CPU time, device time, memory
        allocated, the most frequent input shapes) and on a GPU the top kernels.

        The cell runs as a cell: Out[n], tracebacks at its lines, names bound.
        `-n` and `--warmup` run it more than once, and each run repeats its side
        effects (appends, training steps). The trace goes to `--trace PATH` or a
        temporary file (only the last one is kept, deleted at unload and exit),
        stamped rank 0 so Holistic Trace Analysis reads it. A loop at the cell's
        top level is recorded in full over its steps 2 to 6 (`--steps`), and its
        lines timed over every step, so that a long loop costs about what it
        costs without the profiler.
        `--memory` adds the memory over the cell's time, drawn inline without
        network, its largest allocations labelled by line: from the CUDA
        allocator's history where the cell used CUDA, else from the
        profiler's memory events.

        Cost: the profiler adds a few µs to every op and each traced line a few
        more; the overview compares with a warm plain run of the same code where
        one is known (the last warm-up, else the last run of a cell with this
        code that ran before, blank lines and trailing spaces aside) and the
        per-cell line says "(profiled)". Ops of threads the cell starts are
        recorded with `--threads` (every thread; torch 2.13 then records no
        memory allocations), else the overview says the cell started threads.
        CUDA is recorded only where it was already up when recording began (a
        warm-up that starts it counts): %%profile never starts it. Where the
        device's activity could not be recorded (CUPTI missing or refused) the
        overview says so and shows the CPU side only. A cell that raises (or
        Ctrl-C) shows its partial profile, then its own traceback; the profiler
        is stopped either way (a Ctrl-C while it starts or stops waits until
        that is done). It cannot run under another %%profile or while a
        torch.profiler records. A torch.profiler the cell itself starts works
        as it would without %%profile: torch records one profile at a time, so
        the cell then gets no profile, said in one line.
        """
        __tracebackhide__ = True
        cell = cell_form("profile", "the code to profile", cell)
        args = parse(self.profile, line, cell=True)
        options = profile.Options(
            args.runs, args.warmup, args.sort, args.top, args.trace, args.memory,
            threads=args.threads, steps=args.steps,
        )
        options.check()
        profile.refuse_if_recording(self._profiling)
        functions = profile.functions(
            self.shell.user_ns, args.functions, functools.partial(cells.cell_label, self.shell)
        )
        run, filename = cells.compile_cell(self.shell, cell)
        reads = cells.names_read(self.shell, cell)  # and what the code it calls reads
        reads |= reach.reach(self.shell.user_ns, reads,
                             cells.attributes_read(self.shell, cell)).names
        capture = profile.Capture(
            run, filename, f"In[{cells.cell_number(self.shell)}]", options, functions,
            *self.reporter.plain_run(cell), source=cell,
            loops=profile.outer_loops(self.shell.transform_cell(cell)), traces=self.traces,
            namespace=self.shell.user_ns, reads=reads,
        )
        self.reporter.mark_profiled()
        self._profiling = True
        try:
            report, value = capture(display)
        finally:
            self._profiling = False
        if args.output:
            return report
        if report is not None:
            display(report)
        return value

    @magic_arguments()
    @argument("-o", dest="output", action="store_true", help="return the records")
    @argument("--csv", metavar="PATH", help="write the records to a CSV file (~ is your home; "
              'a path with spaces goes in quotes: --csv "my cells.csv")')
    @argument("--plot", action="store_true", help="plot time and memory per cell (matplotlib); a "
              "terminal that shows no images gets a PNG file, and its path")
    @line_magic
    @user_errors
    def devhistory(self, line: str) -> Any:
        """Show, return, save or plot what the per-cell report measured.

        In [1]: %devhistory --csv cells.csv
        wrote 12 records to cells.csv

        Records carry the `%%gpumem -o` fields plus `cell`; the last 1000
        measured cells are kept. Under the table: the session peak per device
        (the most allocated in any kept cell), since the report resets torch's
        process-wide peak counter before each cell. `--plot` needs matplotlib;
        in a terminal that shows no images it saves a PNG in the temporary
        folder and prints its path. Columns that no kept cell has (the device's,
        on a CPU machine) are left out.
        """
        args = parse(self.devhistory, line)
        history = self.reporter.history
        if args.csv is not None:
            print(f"wrote {history.write_csv(args.csv)} records to {args.csv}")
        if args.plot:
            figure = history.plot()
            formatter = self.shell.display_formatter
            if formatter is not None and "image/png" in formatter.active_types:
                display(figure)
            else:  # a terminal that shows no images would print only `<Figure size ...>`
                print(f"this terminal shows no images: the plot is in {save_plot(figure)}")
        if args.output:
            return history.records()
        if not (args.csv is not None or args.plot):
            display(history.table())
        return None


def load(ip: Any, started: tuple[float, int | None] | None = None) -> None:
    """Register the magics and the per-cell hooks on `ip`; the line of the cell that loads
    them counts from `started` (the clock and RSS when loading began)."""
    magics = TorchDeviceMagics(ip)
    ip.register_magics(magics)
    if started is not None:
        magics.reporter.loading(started)
    magics.apply_report_settings()


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
