"""Memory: `%tensors` (what the namespace holds, and what holds tensors behind it) and
`%gpufree`."""

from __future__ import annotations

from typing import Any

from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from .. import devices
from ..advice import holders
from ..errors import DeviceMagicError
from ..gpufree import free_memory
from ..namespace import scan
from ..units import parse_bytes
from .arguments import parse, user_errors
from .core import MagicsGroup


@magics_class
class TorchDeviceMemoryMagics(MagicsGroup):
    """Memory: what holds tensors, and giving the allocators' cache back."""

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
        device count shared storage once; names sharing storage get one line
        per set of names ("backbone, model share 100 storages"). Warnings name
        a module whose parameters span devices, an optimizer whose state is on
        another device than its parameters (not the 0-dim scalars, such as
        `step`, that torch's optimizers keep on the CPU on purpose), and an
        object that raised when looked into (it is skipped). At most 100,000
        objects are looked at per name (its kind then says "first 100,000
        items"). `--device` and `--min-bytes` filter the rows; `-o` returns
        them (TensorRow).

        `--hidden` lists what keeps tensors alive behind the names: displayed
        results (Out[n], _n, _, with what their graphs saved; the fix names
        every one that holds a result, which %gpufree lets go of), the last
        traceback's locals, the autograd graph a stored tensor keeps (its saved
        activations), optimizer state; each storage counted once, none that a
        name holds. On an accelerator it says
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
