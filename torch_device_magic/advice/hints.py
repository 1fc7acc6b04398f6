"""Hints on the classic device errors, shown after the traceback (which stays as it was).

    In [4]: y = model(x)
    RuntimeError: Expected all tensors to be on the same device, ... cuda:0 and cpu!
    Hint (torch_device_magic): the tensors this operation got are on different devices.
      The cell uses: model (cuda:0), x (cpu)
      Fix: run the cell with %%ondevice cuda:0 (moves what it uses there), or .to(device) each one.

Eight errors get one: tensors on different devices, out of memory (CUDA's
`OutOfMemoryError`, and MPS's plain RuntimeError), a CUDA checkpoint loaded
without CUDA, CUDA used in a forked subprocess (a DataLoader worker), a
launcher that forks refusing a kernel where CUDA is up (accelerate's
`notebook_launcher`, Lightning's `ddp_notebook`; both name the cell that
initialised CUDA, as the report noted it), and the
DataLoader under a non-CPU default device (keyed on that default and a frame in
`torch/utils/data`, because the message differs per device: a generator error
on CUDA, `.item()` on meta); and two of torch.compile's: the recompile limit
made an error (`fullgraph=True`), with the reasons torch recorded, and a CUDA
graph's output read after a later run overwrote it, with the names that hold one.
Every other error gets None. Nothing here touches CUDA unless its runtime is
already up.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import os
import re
import traceback
import types
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import torch

from ..cells import cell_attributes, code_words
from ..devices import cuda_other_processes, others_note
from ..namespace import TensorRow, scan
from ..probes import free_and_total, guarded, torch_default_device
from ..reach import reach
from ..units import fmt_bytes
from .compiles import recompile_limit_reasons
from .holders import release_frames

PREFIX = "Hint (torch_device_magic):"
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)  # torch.* from 2.5
_MISMATCH = re.compile(
    r"Expected all tensors to be on the same device|is not on the expected device"
)
_DEVICE = re.compile(r"\b(?:cuda|mps|xpu)(?::\d+)?\b|\bcpu\b|\bmeta\b")
_DATA_DIR = os.sep + os.path.join("torch", "utils", "data") + os.sep
_MAX_NAMES = 6
_MPS_OOM = "MPS backend out of memory"  # a plain RuntimeError, not OutOfMemoryError
_FORKED = "Cannot re-initialize CUDA in forked subprocess"
# "__mp_main__" where the kernel's main module has a file that spawn re-imported
_UNPICKLE = re.compile(r"Can't get attribute '([^']+)' on <module '__(?:mp_)?main__'")
_WORKER_DIED = re.compile(r"DataLoader worker \(pid\(s\) [^)]*\) exited unexpectedly")
_MP_DIR = os.sep + "multiprocessing" + os.sep
_OVERWRITTEN = "output of CUDAGraphs that has been overwritten by a subsequent run"
_LAUNCHER = re.compile(  # accelerate's notebook_launcher (two messages), Lightning's launcher
    r"CUDA has been initialized before the `notebook_launcher`"
    r"|avoid running any instruction using `torch\.cuda`"
    r"|can't create new processes if CUDA is already initialized"
)


def hint(
    error: BaseException,
    namespace: dict[str, object],
    source: str,
    session_device: torch.device | None,
    cell_default: torch.device | None = None,
    cuda_start: str | None = None,
    restored: bool = False,
) -> str | None:
    """The hint block for `error` raised by the cell `source`, or None for other errors.

    `cell_default` is the default device a `%%ondevice` cell ran under, which is
    no longer in force when the hint is made (`restored`: its --restore sent back what
    it moved); `cuda_start` says which cell initialised CUDA ("CUDA initialised by
    cell [7]: ..."), where that is known.

    For an out-of-memory error it also clears the local variables of the
    traceback's frames and `sys.last_*`, so that their tensors can be freed.
    """
    message = str(error)
    if isinstance(error, KeyboardInterrupt):
        return _fork_hang(error)
    if (_UNPICKLE.search(message) or isinstance(error, BrokenProcessPool)
            or (isinstance(error, RuntimeError) and _WORKER_DIED.search(message))):
        return _notebook_object(error, message, namespace, source)
    if isinstance(error, OOM) or (isinstance(error, RuntimeError) and _MPS_OOM in message):
        return _out_of_memory(error, namespace)
    if isinstance(error, (RuntimeError, ValueError)) and _LAUNCHER.search(message):
        return _launcher(cuda_start)
    if type(error).__name__ == "FailOnRecompileLimitHit":
        return _recompile_limit()
    if not isinstance(error, RuntimeError):
        return None
    if _OVERWRITTEN in message:
        return _overwritten(namespace)
    if _FORKED in message:  # also re-raised by the DataLoader from its worker
        return _forked(session_device, cuda_start)
    if _MISMATCH.search(message):
        return _mismatch(message, namespace, source, session_device, cell_default, restored)
    if "Attempting to deserialize object on" in message:
        return _checkpoint(session_device)
    default = cell_default or torch_default_device()
    if default is not None and default.type != "cpu" and _raised_in_data_loading(error):
        return _data_loader(default, session_device, cell_default is not None)
    return None


def _mismatch(
    message: str, namespace: dict[str, object], source: str, session: torch.device | None,
    cell_device: torch.device | None, restored: bool = False,
) -> str:
    """The names the cell uses, their devices, and the fix; `cell_device` is the device of
    the `%%ondevice` the cell ran under, which moved what the cell uses already (and sent
    it back where `restored`)."""
    used = [name for name in code_words(source) if name in namespace]
    reached = reach(namespace, used, cell_attributes(source))  # and what the code it can call reads
    used += sorted(reached.names - set(used))
    rows = scan({name: namespace[name] for name in used}).rows
    rows.sort(key=lambda r: used.index(r.name))
    lines = [f"{PREFIX} the tensors this operation got are on different devices."]
    if rows:
        shown = ", ".join(f"{r.name} ({r.device})" for r in rows[:_MAX_NAMES])
        lines.append(f"  The cell uses: {shown}{', ...' if len(rows) > _MAX_NAMES else ''}")
    found = [d for r in rows for d in r.device.split(", ")] + _DEVICE.findall(message)
    target = str(cell_device or session or next(
        (d for d in found if d not in ("cpu", "meta")), "DEV"
    ))
    held = "; ".join(map(str, reached.unfollowed[:3]))
    if "meta" in found and target != "meta":  # nothing can be copied off meta
        lines.append(
            "  Fix: meta tensors hold no data, so they cannot be moved to a real device: "
            "build them there, or give a module storage with .to_empty(device=device) "
            "and load its weights (load_state_dict)."
        )
    elif cell_device is not None:  # not "run it under %%ondevice": it just did
        return "\n".join(lines + _not_moved(cell_device, rows, held, restored))
    else:
        lines.append(
            f"  Fix: run the cell with %%ondevice {target} (moves what it uses there), "
            "or .to(device) each one."
        )
    if held:
        lines.append(f"  %%ondevice cannot move these (.to(device) them yourself): {held}.")
    return "\n".join(lines)


def _not_moved(device: torch.device, rows: list[TensorRow], held: str,
               restored: bool = False) -> list[str]:
    """What a cell that ran under `%%ondevice DEVICE` uses that is elsewhere all the same
    (a name it bound there, what a closure or a module of the user's keeps: `held`), or
    where such a tensor comes from, and how to bring it. `restored`: --restore sent back
    what moved, so where the names' tensors are now says nothing."""
    target = str(device)
    elsewhere = "" if restored else ", ".join(
        f"{r.name} ({r.device})" for r in rows if not _all_on(r, device))
    what = "; ".join(filter(None, (elsewhere, held)))
    moved = f"  %%ondevice {target} moved what the cell uses before it ran"
    if restored:
        moved += " (--restore has sent it back since)"
    if what:
        return [f"{moved}, but not these: {what}.",
                f"  Fix: .to('{target}') them yourself, or pass them to the function as "
                "arguments (what the cell names moves)."]
    return [f"{moved}; the other tensor is one it cannot see: one the cell made on the CPU "
            "(torch.from_numpy, torch.load without map_location, device='cpu'), or one an "
            "object keeps in its attributes.",
            f"  Fix: .to('{target}') it where it is made, or pass it to the function as an "
            "argument."]


def _all_on(row: TensorRow, device: torch.device) -> bool:
    """Whether a name's tensors are all on `device` (on any of its type's where it names
    no index: `%%ondevice cuda` puts them on the current one)."""
    return all(d == str(device) or (device.index is None and d.split(":")[0] == device.type)
               for d in row.device.split(", "))


def _out_of_memory(error: BaseException, namespace: dict[str, object]) -> str:
    release_frames(error)
    lines = [f"{PREFIX} the accelerator ran out of memory."]
    free = _free_and_total(str(error))
    if free is not None:
        lines[0] = f"{PREFIX} out of memory: {fmt_bytes(free[0])} free of {fmt_bytes(free[1])}."
    rows = sorted(
        (r for r in scan(namespace).rows if _on_accelerator(r)), key=lambda r: -r.nbytes
    )
    if rows:
        largest = ", ".join(f"{r.name} {fmt_bytes(r.nbytes)} ({r.device})" for r in rows[:3])
        lines.append(f"  Largest in the namespace: {largest} (see %tensors)")
    index = _oom_gpu(str(error))
    others = () if index is None else cuda_other_processes(index)
    if others:
        lines.append(f"  {others_note(f'cuda:{index}', others)}.")
    lines += [
        "  To get memory back: del what you no longer need, then %gpufree.",
        "  Smaller batches, %%nograd for inference, or half precision need less.",
        "  The traceback's frames were cleared so that their tensors can be freed.",
    ]
    return "\n".join(lines)


def _free_and_total(message: str) -> tuple[int, int] | None:
    """Free and total bytes of the GPU that ran out, if its runtime is up (never started here)."""
    index = _oom_gpu(message)
    device = torch.device("cuda") if index is None else torch.device("cuda", index)
    return free_and_total(device)  # None for a broken context: the hint goes on without it


def _oom_gpu(message: str) -> int | None:
    """The index of the CUDA GPU a CUDA out-of-memory message names, or None."""
    match = re.search(r"GPU (\d+) has a total capacity", message)
    return int(match.group(1)) if match else None


def _on_accelerator(row: TensorRow) -> bool:
    return any(d not in ("cpu", "meta") for d in row.device.split(", "))


def _overwritten(namespace: dict[str, object]) -> str:
    """The names whose tensors a CUDA graph's later run overwrote (torch makes reading
    their storage raise), and the fix."""
    dead = []
    for name, value in namespace.items():
        if isinstance(value, torch.Tensor) and not name.startswith("_"):
            try:
                value.untyped_storage()
            except RuntimeError as err:
                if _OVERWRITTEN in str(err):
                    dead.append(name)
    lines = [f"{PREFIX} a compiled function's output (CUDA graphs: mode=\"reduce-overhead\") "
             "was overwritten by a later run of it."]
    if dead:
        shown = ", ".join(dead[:_MAX_NAMES]) + (", ..." if len(dead) > _MAX_NAMES else "")
        lines.append(f"  Held by: {shown}")
    lines.append("  Fix: keep an output past the next call with .clone() (kept = out.clone()), "
                 "or call torch.compiler.cudagraph_mark_step_begin() before each call.")
    return "\n".join(lines)


def _recompile_limit() -> str:
    function, reasons = recompile_limit_reasons()
    lines = [f"{PREFIX} {function} reached torch.compile's recompile limit "
             "(fullgraph=True, or fail_on_recompile_limit_hit, makes that an error)."]
    if reasons:
        lines.append("  Recompiled for: " + "; ".join(reasons[-3:]))
    lines.append("  Fix: pass what changes as a tensor, mark a changing size dynamic "
                 "(torch._dynamo.mark_dynamic(x, 0)), or raise "
                 "torch._dynamo.config.recompile_limit.")
    return "\n".join(lines)


def _checkpoint(session: torch.device | None) -> str:
    target = "cpu" if session is None else str(session)
    return (
        f"{PREFIX} this checkpoint was saved on a CUDA GPU that this machine does not have.\n"
        f"  Load it onto the session device: torch.load(path, map_location={target!r}) "
        "(or map_location=device)."
    )


def _forked(session: torch.device | None, cuda_start: str | None) -> str:
    target = "cuda" if session is None or session.type != "cuda" else str(session)
    return (
        f"{PREFIX} a forked subprocess (a DataLoader worker) used CUDA, which cannot "
        "start again in a child of a process that already started it.\n"
        + _started_by(cuda_start)
        + "  Fix: DataLoader(..., multiprocessing_context='spawn') (or "
        "torch.multiprocessing.set_start_method('spawn')); or keep CUDA out of the workers "
        f"(%device {target} --no-default leaves factory functions on the CPU: move each "
        "batch with .to(device)); or start the workers before anything uses CUDA "
        "(iter(loader) with persistent_workers=True, first thing in the notebook)."
    )


def _launcher(cuda_start: str | None) -> str:
    return (
        f"{PREFIX} a launcher that forks (notebook_launcher, Lightning's ddp_notebook) needs "
        "a kernel where CUDA has not been initialised.\n"
        + _started_by(cuda_start)
        + "  Fix: restart the kernel and launch before that cell runs, or keep its CUDA "
        "work (a .cuda(), .to('cuda'), a torch.cuda call) inside the function you launch."
    )


def _started_by(cuda_start: str | None) -> str:
    """The line that names the cell which initialised CUDA, where the report noted one."""
    return "" if cuda_start is None else f"  {cuda_start}.\n"


def _raised_in_data_loading(error: BaseException) -> bool:
    return any(
        _DATA_DIR in frame.f_code.co_filename for frame, _ in traceback.walk_tb(error.__traceback__)
    )


def _data_loader(default: torch.device, session: torch.device | None, ondevice: bool) -> str:
    if ondevice:
        who, off = "%%ondevice", "iterate it in a cell that does not run under %%ondevice"
    elif session == default:
        who, off = "%device", "%config TorchDeviceMagics.set_torch_default = False"
    else:
        who, off = "torch.set_default_device", "torch.set_default_device(None)"
    lines = [
        f"{PREFIX} the DataLoader draws its shuffling on torch's default device, "
        f"which {who} set to {default}.",
        f"  Either keep factory functions on the CPU: {off}",
    ]
    if default.type == "meta":
        # Meta makes no random numbers, and a CPU generator does not help: the DataLoader
        # draws its seed into a tensor it makes on the default device.
        lines.append("  or iterate it under `with torch.device('cpu'):` (the CPU for the "
                     "tensors made inside only)")
    else:
        lines.append(
            f"  or give it a generator there: DataLoader(..., generator=torch.Generator("
            f"device={str(default)!r}))"
        )
    return "\n".join(lines)


def _notebook_object(
    error: BaseException, message: str, namespace: dict[str, object], source: str
) -> str | None:
    """Workers started with spawn or forkserver import `__main__` afresh: in a notebook
    that is the kernel's launcher, so a class or function defined in a cell is missing
    there. The worker says so ("Can't get attribute 'X' on <module '__main__'>") on its
    stderr, which the notebook does not show; the cell gets a broken process pool (the
    notebook's functions and classes the cell names are the suspects), or a DataLoader
    worker that died (its dataset, collate_fn and worker_init_fn are looked at)."""
    names = _UNPICKLE.findall(message)
    if isinstance(error, BrokenProcessPool):
        words = dict.fromkeys(re.findall(r"[A-Za-z_]\w*", source))
        names = [name for name in words if name in namespace and _main_name(namespace[name])
                 and isinstance(namespace[name], (type, types.FunctionType))]
    elif not names:
        loader: Any = next((it for it in _frame_selves(error) if hasattr(it, "_workers")), None)
        if loader is None or not any(_start_method(w) != "fork" for w in loader._workers):
            return None
        parts = (loader._dataset, loader._collate_fn, loader._worker_init_fn)
        names = [_main_name(part) for part in parts if _main_name(part)]
        if not names:
            return None
    fork = "fork" in multiprocessing.get_all_start_methods()
    return (
        f"{PREFIX} worker processes started with spawn or forkserver import the notebook's "
        f"__main__ afresh and cannot find {', '.join(dict.fromkeys(names))}, defined in a "
        "cell, to unpickle.\n"
        "  Fix: move it into a .py file next to the notebook and import it from there"
        + (" (or use fork: multiprocessing_context='fork')." if fork else ".")
    )


def _main_name(obj: object) -> str | None:
    """The name of a class or function defined in a notebook cell that `obj` is or is an
    instance of; None otherwise."""
    made = obj if isinstance(obj, (type, types.FunctionType)) else type(obj)
    return made.__qualname__ if made.__module__ == "__main__" else None


def _fork_hang(error: BaseException) -> str | None:
    """Ctrl-C while waiting on a process forked after torch ran intra-op (OpenMP)
    threads: libgomp is not fork-safe, so the child hangs the moment it uses them."""
    waited = [p for p in _frame_selves(error) if isinstance(p, multiprocessing.process.BaseProcess)]
    forked = [p for p in waited if _start_method(p) == "fork" and guarded(p.is_alive)]
    if not forked or torch.get_num_threads() < 2:
        return None
    return (
        f"{PREFIX} interrupted while waiting on a forked process (pid {forked[0].pid}). A "
        "child forked after torch ran work on several threads hangs in OpenMP (libgomp) "
        "as soon as it runs torch ops in parallel.\n"
        "  Fix: call torch.set_num_threads(1) first thing in the child, or start it with "
        "spawn: multiprocessing.get_context('spawn').Process(...)."
    )


def _frame_selves(error: BaseException) -> list[object]:
    """The `self` of each frame of `error`'s traceback in multiprocessing or the DataLoader
    (where a worker is waited on)."""
    found = []
    for frame, _ in traceback.walk_tb(error.__traceback__):
        path = frame.f_code.co_filename
        if (_MP_DIR in path or _DATA_DIR in path) and "self" in frame.f_code.co_varnames:
            found.append(frame.f_locals.get("self"))
    return found


def _start_method(process: object) -> str | None:
    """How `process` starts: its context's method, else the default one."""
    return getattr(process, "_start_method", None) or multiprocessing.get_start_method(
        allow_none=True) or multiprocessing.get_context().get_start_method()
