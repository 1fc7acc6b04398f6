"""torch_device_magic: IPython magics that pick a PyTorch device, move the namespace
there, run cells without autograd and report time and memory after every cell.

    In [1]: %load_ext torch_device_magic
    In [2]: %device auto
    no GPU available: using the CPU

Loading imports nothing from CUDA and creates no CUDA context.
"""

__version__ = "0.1.0"


def load_ipython_extension(ip) -> None:
    """Called by `%load_ext torch_device_magic`."""
    started = _load_started()  # before torch is imported: the load cell's line counts it
    from .magics import load

    load(ip, started)


def unload_ipython_extension(ip) -> None:
    """Called by `%unload_ext torch_device_magic` (and by `%reload_ext`)."""
    from .magics import unload

    unload(ip)


def _load_started() -> tuple[float, int | None]:
    """The clock and the RSS as loading begins, the kernel's high-water mark reset (Linux).

    Read with the standard library alone, since `probes` imports torch, whose import
    is most of what loading costs; `probes.ProcHighWater` reads the same files.
    """
    import os
    import time

    started = time.perf_counter()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        with open("/proc/self/statm", "rb") as f:
            return started, int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return started, None
