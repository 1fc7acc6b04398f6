"""Load the extension and run cells with every torch.cuda function spied on.

    python cuda_spy.py [--cuda] [--bisect] [ALLOWED_FUNCTION ...]

Prints a JSON object: the torch.cuda functions that this package called (torch's
own internals, such as an import of torch._inductor under the meta device, are
not ours), whether CUDA ended up initialised, and whether a forked child is
clean: torch's fork handler did not mark it as a bad fork, and (with `--cuda`)
it can start CUDA itself, which it cannot once the parent initialised the
driver. `--cuda` adds `%device cuda` and `%device auto` on a GPU, then twenty
reported cells under CUDA as the default device. `%%profile` comes last: torch's
profiler initialises the CUDA driver as it starts. `--bisect` forks after every
cell and adds `first_unclean`, the first cell after which a forked child is not
clean (None where every one is). Run in a fresh process so that nothing
imported earlier hides a call.
"""

import json
import os
import sys
import types

import torch

CALLS: list[str] = []
CUDA = "--cuda" in sys.argv
BISECT = "--bisect" in sys.argv
ALLOWED = {a for a in sys.argv[1:] if not a.startswith("--")}  # what a test lets through


def spy(name, fn):
    def wrapper(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("torch_device_magic"):
            CALLS.append(name)
        return fn(*args, **kwargs)

    return wrapper


for name in dir(torch.cuda):
    obj = getattr(torch.cuda, name)
    if isinstance(obj, types.FunctionType) and not name.startswith("__"):
        setattr(torch.cuda, name, spy(name, obj))

from IPython.core.interactiveshell import InteractiveShell  # noqa: E402
from traitlets.config import Config  # noqa: E402


def forked_child_is_clean() -> bool:
    """A forked child is not a 'bad fork' to torch and, on a GPU, can start CUDA."""
    pid = os.fork()
    if pid == 0:
        try:
            ok = not torch.cuda._is_in_bad_fork()
            if ok and CUDA:
                ok = torch.ones(1, device="cuda").item() == 1.0
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    return os.waitpid(pid, 0)[1] == 0


config = Config()
config.HistoryManager.hist_file = ":memory:"
ip = InteractiveShell.instance(config=config)
first_unclean = None
for cell in [
    "%load_ext torch_device_magic",
    "import torch",
    "x = torch.ones(3)",
    "%device auto",
    "%device",
    "%device meta",
    "%%nograd\ny = torch.zeros(2) * 2",
    "%device reset",
    "%tensors",
    "%gpufree",
    "%reload_ext torch_device_magic",
    "z = x + 1",
    *(["%device auto", "%device cuda", "%device", "%gpufree", "%tensors"] if CUDA else []),
    # reported cells; under `%device cuda` only a factory call would start CUDA
    *[f"z = x * {i}" if i % 2 else "s = sum(range(10))" for i in range(20)],
    "%%profile\nz = x * 2",  # records CUDA only where CUDA is up
    "%%profile -n 2 --warmup 1 --sort device --memory\nz = x + 1",
    "%unload_ext torch_device_magic",
]:
    result = ip.run_cell(cell, store_history=True)
    if not result.success:
        sys.exit(f"cell failed: {cell!r}: {result.error_in_exec or result.error_before_exec}")
    if BISECT and first_unclean is None and not forked_child_is_clean():
        first_unclean = cell


print(json.dumps({
    "calls": [c for c in CALLS if c not in ALLOWED],
    "initialized": torch.cuda.is_initialized(),
    "fork_clean": forked_child_is_clean(),
    **({"first_unclean": first_unclean} if BISECT else {}),
}))
