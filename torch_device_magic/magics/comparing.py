"""`%%devcompare`."""

from __future__ import annotations

from typing import Any

from IPython.core.magic import line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from .. import cells
from ..devcompare import compare, devices_to_compare
from ..devices import take_inventory
from ..errors import DeviceMagicError
from .arguments import parse, user_errors
from .core import MagicsGroup


@magics_class
class TorchDeviceCompareMagics(MagicsGroup):
    """`%%devcompare`: one cell on several devices, timed, its results compared."""

    @magic_arguments()
    @argument(
        "devices",
        nargs="*",
        help="two or more devices, the first (not meta) being the reference: cpu cuda, cuda:0 "
        "cuda:1, cpu mps",
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
        copies everything; a write torch's version counters do not see, through
        .data, a storage or a raw pointer, in a later run only, stops it, saying
        so). Copies that do not fit in the free memory are refused in one line;
        each device's are freed before the next device's. Afterwards the
        namespace is exactly as before: nothing the cell bound or changed stays,
        and the random state of the CPU, the devices, Python's `random`,
        NumPy's and your own generators the cell reaches is as it was; each
        device's runs start from the same states. Times are wall times with the
        device synchronised; the difference is the largest absolute difference
        between the devices' values of the cell's last expression (tensors,
        numbers, NumPy arrays and scalars, or lists, tuples and dicts of them):
        NaN in the same places is equal, NaN against a number reads "NaN in
        different places", meta is "not comparable". meta computes nothing, so
        it cannot come first (the reference); its times read no speed-up.
        One device named twice is refused, however spelled (`cpu cpu:0`,
        `cuda cuda:0` where cuda:0 is the current one). `-o` returns a
        Comparison (devices: median_s, min_s, max_s, speedup, max_abs_diff).
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
        self.core.reporter.say_live("comparing")
        hidden = self.shell.user_ns_hidden  # IPython's own names (In, Out, _): never copied
        result = compare(self.shell.user_ns, run, cells.names_read(self.shell, cell), chosen,
                         args.runs, args.warmup, hidden, cells.attributes_read(self.shell, cell))
        if args.output:
            return result
        display(result)
        return None
