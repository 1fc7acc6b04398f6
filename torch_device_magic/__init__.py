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
    from .magics import load

    load(ip)


def unload_ipython_extension(ip) -> None:
    """Called by `%unload_ext torch_device_magic` (and by `%reload_ext`)."""
    from .magics import unload

    unload(ip)
