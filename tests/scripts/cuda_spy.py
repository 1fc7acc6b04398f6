"""Load the extension and run a few cells with every torch.cuda function spied on.

Prints a JSON object: the torch.cuda functions that this package called (torch's
own internals, such as an import of torch._inductor under the meta device, are
not ours), and whether CUDA ended up initialised. Run in a fresh process so that
nothing imported earlier hides a call.
"""

import json
import sys
import types

import torch

CALLS: list[str] = []
ALLOWED = set(sys.argv[1:])  # functions a test lets through (read-only flags)


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

config = Config()
config.HistoryManager.hist_file = ":memory:"
ip = InteractiveShell.instance(config=config)
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
    "%unload_ext torch_device_magic",
]:
    result = ip.run_cell(cell, store_history=True)
    if not result.success:
        sys.exit(f"cell failed: {cell!r}: {result.error_in_exec or result.error_before_exec}")
print(json.dumps({
    "calls": [c for c in CALLS if c not in ALLOWED],
    "initialized": torch.cuda.is_initialized(),
}))
