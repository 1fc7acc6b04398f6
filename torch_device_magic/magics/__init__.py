"""The IPython layer: the traits and thin magic bodies over the pure modules.

As IPython splits its own magics (`IPython/core/magics/`), one `Magics` class per group:

- `running`: where work runs (`%device`, `%%ondevice`, `%%nograd`);
- `measuring`: `%%gpumem`, `%devhistory`, `%devreport`;
- `memory`: `%tensors`, `%gpufree`;
- `profiling`: `%%profile`;
- `comparing`: `%%devcompare`.

Each reads the traits and the session's state from the one `TorchDeviceMagics` (`core`),
the configurable that `%config TorchDeviceMagics` lists. Each magic parses its line with
`@magic_arguments` (so `%device?` documents itself), calls into a module that knows
nothing of IPython, and displays or returns what it got. A `DeviceMagicError` from below
becomes IPython's own `UsageError` (`arguments.user_errors`): one sentence, no
traceback, nothing changed.
"""

from __future__ import annotations

from typing import Any

from .comparing import TorchDeviceCompareMagics
from .core import MagicsGroup, TorchDeviceMagics
from .measuring import TorchDeviceMeasureMagics
from .memory import TorchDeviceMemoryMagics
from .profiling import TorchDeviceProfileMagics
from .running import TorchDeviceRunMagics

GROUPS: tuple[type[MagicsGroup], ...] = (
    TorchDeviceRunMagics, TorchDeviceMeasureMagics, TorchDeviceMemoryMagics,
    TorchDeviceProfileMagics, TorchDeviceCompareMagics,
)
__all__ = ["GROUPS", "TorchDeviceMagics", "load", "unload"]


def load(ip: Any, started: tuple[float, int | None] | None = None) -> None:
    """Register the magics and the per-cell hooks on `ip`; the line of the cell that loads
    them counts from `started` (the clock and RSS when loading began)."""
    magics = TorchDeviceMagics(ip)
    for line in magics.refused_config:
        print(line)
    ip.register_magics(magics, *(group(magics) for group in GROUPS))
    if started is not None:
        magics.reporter.loading(started)
    magics.apply_report_settings()


def unload(ip: Any) -> None:
    """Remove the magics and hooks and restore the default device and grad mode."""
    registry = ip.magics_manager.registry
    magics = registry.pop(TorchDeviceMagics.__name__, None)
    if magics is None:
        return
    magics.close()
    ours = [magics, *(registry.pop(g.__name__) for g in GROUPS if g.__name__ in registry)]
    for table in ip.magics_manager.magics.values():
        for name, fn in list(table.items()):
            if any(getattr(fn, "__self__", None) is m for m in ours):
                del table[name]
    for m in ours:
        if m in ip.configurables:
            ip.configurables.remove(m)
