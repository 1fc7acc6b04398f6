"""`TorchDeviceMagics`: the one configurable (every trait `%config TorchDeviceMagics`
lists and `ipython_config.py` sets), the session's state, and the per-cell report's
wiring; and `MagicsGroup`, the base of the groups of magics, which read both from it.
It holds no magic itself: each group is a `Magics` of its own, as IPython's are.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, magics_class
from traitlets import Any as AnyTrait
from traitlets import Bool, Float, Int, TraitError, observe, validate
from traitlets.config import Config
from traitlets.config.loader import DeferredConfig, LazyConfigValue

from .. import profile
from ..advice import hints
from ..advice.notes import Advisor
from ..devices import resolve, take_inventory
from ..hooks import CellReporter
from ..kineto import peaks
from ..session import Session


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

    # --- %%profile's MFU (issue 39) ---
    peak_flops = AnyTrait(
        None, allow_none=True,
        help="%%profile's peak for the MFU, in FLOP/s: one figure (989e12), or a dict by "
        "precision ({'bf16': 989e12, 'tf32': 494e12}; keys among fp32, tf32, bf16, fp16, "
        "fp8), for a GPU that the table of dense peaks lacks or a clock that differs; None "
        "(the default): the table's.",
    ).tag(config=True)

    @validate("peak_flops")
    def _a_peak(self, proposal: Any) -> Any:
        try:
            return peaks.check_yours(proposal.value)
        except ValueError as err:
            raise TraitError(str(err)) from None

    # The live line (issue 37): its own block.
    live_delay = Float(
        1.0,
        help="Show a live line under a cell that runs longer than this many seconds: "
        "elapsed time, where the cell is, device and host memory, cores busy; updated "
        "about once a second and replaced by the report line at the end (0 = off; "
        "%devreport live on|off is the same switch).",
    ).tag(config=True)

    @observe("live_delay")
    def _live_delay_changed(self, change: Any) -> None:
        self.reporter.live.delay_s = change.new

    _shell: InteractiveShell | None = None

    def __init__(self, shell: InteractiveShell | None) -> None:
        # State first: traits set in ipython_config.py fire observers during super().__init__
        # (a configured set_torch_default reaches the session that way).
        self.reporter = CellReporter()
        self.reporter.live.delay_s = type(self).live_delay.default_value  # until configured
        self.session = Session()
        self._advisor: Advisor | None = None  # made with the shell, once
        # (id(error), %%ondevice's device, its --restore): the hint is told what was in force
        self.failed_under: tuple[int, torch.device, bool] | None = None
        self.traces = profile.TraceFiles()  # %%profile's unnamed traces: the last one is kept
        # What the shell's config held for us that a trait refuses: dropped, so that loading
        # goes on (`load` says so in a line each).
        self.refused_config = [] if shell is None else self._drop_refused(shell.config)
        super().__init__(shell=shell)

    @property
    def shell(self) -> InteractiveShell:
        """The shell the magics are loaded in: every magic needs one."""
        assert self._shell is not None, "TorchDeviceMagics needs a shell"
        return self._shell

    @shell.setter
    def shell(self, shell: InteractiveShell | None) -> None:  # Magics.__init__ sets it
        self._shell = shell

    def _drop_refused(self, config: Config) -> list[str]:
        """Take out of `config` the values of ours that our traits refuse (a bad line of
        ipython_config.py, or one %config merged there before it was refused); a sentence
        for each."""
        section = config.get(type(self).__name__, {})
        refused = []
        for name, value in list(section.items()):
            trait = self.traits(config=True).get(name)
            if trait is None or isinstance(value, LazyConfigValue):  # traitlets' own to say
                continue
            try:
                trait._validate(self, value.get_value(trait)  # from the command line
                                if isinstance(value, DeferredConfig) else value)
            except TraitError as err:
                del section[name]
                refused.append(
                    f"torch_device_magic: {type(self).__name__}.{name} = {value!r} in the "
                    f"shell's config is refused ({err}): {getattr(self, name)!r} is used"
                )
        return refused

    def update_config(self, config: Config) -> None:
        """`%config`'s way in. IPython merges the new value into the shell's config before
        it reaches us: where a trait refuses it, the shell's config gets back what it held
        (as ours, which the refusal left unchanged, does), or %reload_ext would stop on it."""
        try:
            super().update_config(config)
        except TraitError:
            name = type(self).__name__
            if self._shell is not None and name in config:
                stored, kept = self.shell.config[name], self.config[name]
                for key in list(config[name]):  # the same dict as `stored` where new there
                    if key in kept:
                        stored[key] = kept[key]
                    else:
                        stored.pop(key, None)
            raise

    @validate("report_min_seconds", "report_min_bytes", "live_delay")
    def _not_negative(self, proposal: Any) -> Any:
        name, value = proposal.trait.name, proposal.value
        zero = "off" if name == "live_delay" else "unset"
        if not math.isfinite(value):
            raise TraitError(f"{name} must be a finite number, 0 ({zero}) or more, not {value}")
        if value < 0:
            raise TraitError(f"{name} must be 0 ({zero}) or more")
        return value

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
        failed, self.failed_under = self.failed_under, None
        ours = failed if failed is not None and failed[0] == id(error) else None
        _, cell_default, restored = ours or (0, None, False)
        cuda_start = self.reporter.cuda_start
        return hints.hint(error, self.shell.user_ns, source, self.session.device, cell_default,
                          None if cuda_start is None else str(cuda_start), restored=restored)

    @observe("set_torch_default")
    def _torch_default_switched(self, change: Any) -> None:
        self.session.set_torch_default(change.new)

    def close(self) -> None:
        """Undo what loading and the magics changed: the hooks, and the session's state."""
        self.reporter.unregister(self.shell)
        self.reporter.set_hint(self.shell, None)
        self.session.close(self.shell.user_ns)
        self.traces.close()


class MagicsGroup(Magics):
    """One group of the magics: the traits and the session's state are its `core`'s."""

    shell: InteractiveShell  # the core's: made only for a core that has a shell

    def __init__(self, core: TorchDeviceMagics) -> None:
        super().__init__(shell=core.shell)
        self.core = core

    def _resolve(self, spec: str) -> tuple[torch.device, str]:
        """The device `spec` names on this machine, and the line that says what it is."""
        return resolve(spec, take_inventory(probe_cuda_runtime=spec.startswith("cuda")))

    def _all_names(self) -> list[str]:
        """The user's names: not IPython's own (In, Out, _i3, _) nor hidden ones."""
        hidden = self.shell.user_ns_hidden
        return [n for n in self.shell.user_ns if not n.startswith("_") and n not in hidden]
