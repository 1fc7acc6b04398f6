"""tdmdev: the project's own PrivateUse1 test device, whose memory is host memory.

    import testdevice
    testdevice.load()          # builds once (cached), names the device "tdmdev"; idempotent
    x = torch.ones(3).to("tdmdev")
    torch.accelerator.current_accelerator()  # device(type='tdmdev')
    with testdevice.memory_limit(1 << 20): ...  # past 1 MiB a device raises OutOfMemoryError

The C++ (tdmdev.cpp) is built with torch's own extension builder into
`_build/<torch>-<python>/` next to it (git ignores it) and rebuilt only when the
source, torch or Python changes. Loading it cannot be undone in a process: from
then on torch.accelerator names tdmdev as the accelerator. The functions below
are `torch.tdmdev`, shaped like `torch.cuda`'s so that generic code finds them.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

NAME = "tdmdev"
_SOURCE = Path(__file__).with_name("tdmdev.cpp")
_library = _loaded = False


def build_dir() -> Path:
    """Where the built library is kept: one folder per torch installation (each
    virtual environment its own, so that two do not rebuild over each other)."""
    where = hashlib.sha1(torch.__file__.encode()).hexdigest()[:8]
    tag = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-{where}"
    return Path(__file__).with_name("_build") / tag


def load_library() -> None:
    """Build (or reuse) the library and load it, without naming the device; idempotent.

    Until `load()` names it, torch.accelerator does not see it, but autograd does:
    it sizes its per-device queues at the process's first backward, so a backward
    on tdmdev works only if the library was loaded before that one.
    Raises whatever the build raised (no compiler, no ninja, a compile error).
    """
    global _library
    if _library:
        return
    from torch.utils.cpp_extension import load as build

    where = build_dir()
    where.mkdir(parents=True, exist_ok=True)
    # is_python_module=False: the library registers itself with torch (kernels,
    # hooks, allocator, device guard) and its ops; it has no Python module.
    build(
        NAME,
        [str(_SOURCE)],
        build_directory=str(where),
        is_python_module=False,
        extra_cflags=["-O1"],
        verbose=False,
    )
    _library = True


def load() -> None:
    """`load_library()`, then make "tdmdev" a device name and torch.accelerator's; idempotent."""
    global _loaded
    if _loaded:
        return
    load_library()
    torch.utils.rename_privateuse1_backend(NAME)
    torch._register_device_module(NAME, sys.modules[__name__])
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    _loaded = True


# --- torch.tdmdev ------------------------------------------------------------------


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return _loaded


def _is_in_bad_fork() -> bool:
    return False


def manual_seed_all(seed: int) -> None:
    """Random numbers come from the CPU generator (through the CPU fallback)."""


def device_count() -> int:
    return torch.ops.tdmdev.device_count()  # torch.accelerator.device_count() asks this


def current_device() -> int:
    return torch.accelerator.current_device_index()


def set_device(device: int | str | torch.device) -> None:
    torch.accelerator.set_device_index(device)


def device(device: int | str | torch.device | None) -> contextlib.AbstractContextManager:
    """`with torch.tdmdev.device(d):` d is the current device inside (storage moves use it)."""
    index = device if isinstance(device, int) or device is None else torch.device(device).index
    return torch.accelerator.device_index(index)


def synchronize(device: int | str | torch.device | None = None) -> None:
    torch.accelerator.synchronize(device)


def current_stream(device: int | str | torch.device | None = None) -> torch.Stream:
    return torch.accelerator.current_stream(device)


def Event(enable_timing: bool = False, **kwargs) -> torch.Event:
    """A torch.Event on tdmdev, made the way `torch.cuda.Event(enable_timing=True)` is."""
    return torch.Event(NAME, enable_timing=enable_timing, **kwargs)


def memory_stats(device: int | str | torch.device | None = None) -> dict:
    return torch.accelerator.memory_stats(device)


def memory_allocated(device: int | str | torch.device | None = None) -> int:
    return torch.accelerator.memory_allocated(device)


def max_memory_allocated(device: int | str | torch.device | None = None) -> int:
    return torch.accelerator.max_memory_allocated(device)


def memory_reserved(device: int | str | torch.device | None = None) -> int:
    return torch.accelerator.memory_reserved(device)


def reset_peak_memory_stats(device: int | str | torch.device | None = None) -> None:
    torch.accelerator.reset_peak_memory_stats(device)


def mem_get_info(device: int | str | torch.device | None = None) -> tuple[int, int]:
    """(free, total) bytes: under a memory limit, what is left of it."""
    return torch.accelerator.get_memory_info(device)


def empty_cache() -> None:
    """Nothing is cached: every free goes straight back to the host."""


def set_memory_limit(nbytes: int | None) -> None:
    """Each device raises torch.OutOfMemoryError past `nbytes` reserved; None: no limit."""
    torch.ops.tdmdev.set_memory_limit(nbytes or 0)


def get_memory_limit() -> int | None:
    return torch.ops.tdmdev.memory_limit() or None


@contextlib.contextmanager
def memory_limit(nbytes: int | None) -> Iterator[None]:
    """The limit `nbytes` inside the block, the previous one after."""
    before = get_memory_limit()
    set_memory_limit(nbytes)
    try:
        yield
    finally:
        set_memory_limit(before)
