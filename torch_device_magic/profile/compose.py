"""`%%profile` composed: the capture records, the recording is read, the advice is made from
what was read, and the report renders what it is given (`profile_cell`). The one module of
the profile that knows the advice."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ..advice import compiles
from ..advice.profile_rules import (
    Advice,
    advise,
    data_parallel,
    loader,
    name_kinds,
    read_setting,
)
from ..advice.rank_rules import advise_ranks
from ..errors import first_sentence
from ..kineto.peaks import Claim
from . import ranks
from .capture import Capture, Recorded
from .lines import LineTracer
from .reading import Read, read
from .tables import ProfileReport, mfu_claim
from .traces import TraceFiles

_log = logging.getLogger(__name__)


def profile_cell(
    capture: Capture, show_partial: Callable[[ProfileReport], None], traces: TraceFiles,
    namespace: Mapping[str, Any] | None = None, reads: Collection[str] = (),
    peak_flops: float | dict[str, float] | None = None, rank_folder: str | None = None,
) -> tuple[ProfileReport | None, Any]:
    """Run `capture` and make its report: the report (None, said in one line, where the
    profile could not be read) and the cell's value. A cell that raises shows its partial
    report through `show_partial`, then its error propagates. `namespace` and `reads` (the
    user's names that the cell reads) are for the advice; `peak_flops`, the user's peak
    (TorchDeviceMagics.peak_flops), for the MFU. The ranks a launcher starts in the cell
    are profiled too, their traces in `rank_folder` (else the session's)."""
    __tracebackhide__ = True
    capture.mark = compiles.records  # torch.compile's record as recording begins

    def report(recorded: Recorded) -> ProfileReport:
        return _with_ranks(_report(capture, recorded, traces, namespace or {}, reads,
                                   peak_flops), launched, rank_folder)

    folder = (lambda: rank_folder) if rank_folder else (
        lambda: ranks.FOLDERS.new(capture.label))
    with ranks.launches(capture.options, folder) as launched:
        recorded, value = capture(lambda partial: show_partial(report(partial)))
    if recorded is None:
        return None, value
    try:
        return report(recorded), value
    except Exception as err:  # the cell ran: its value is kept, and our fault said
        _log.debug("the profile could not be made", exc_info=True)
        print(f"%%profile could not read the profile: {first_sentence(err, named=True)}")
        return None, value


def _report(
    capture: Capture, recorded: Recorded, traces: TraceFiles, namespace: Mapping[str, Any],
    reads: Collection[str], peak_flops: float | dict[str, float] | None = None,
) -> ProfileReport:
    opts, tracer = capture.options, recorded.tracer
    got = read(recorded, opts, capture.cell_file, capture.source, capture.label, traces)
    claim = mfu_claim(got.analysis, got.wall_s, recorded.cuda, peak_flops)
    advice = _advice(got, recorded, namespace, reads, capture.source, claim)
    why = None
    if recorded.partial is not None:
        what = "interrupted" if isinstance(recorded.partial, KeyboardInterrupt) else (
            f"the cell raised {type(recorded.partial).__name__}")
        why = f"{what}; the profile covers the cell up to there"
    plain = recorded.plain_wall_s
    return ProfileReport(
        label=capture.label, runs=opts.runs, wall_s=got.wall_s, measurement=recorded.measured,
        analysis=got.analysis, trace_path=got.trace_path, plain_wall_s=None if why else plain,
        plain_from=recorded.plain_from if plain else None, partial=why,
        notes=got.notes, profiler=recorded.recording.prof, sort=opts.sort,
        timeline=got.timeline, trace_bytes=got.trace_bytes, trace_temporary=opts.trace is None,
        loops=tracer.loops_run() if tracer is not None else [],
        full_steps=opts.steps if tracer is not None and tracer.windowed else 0,
        events=len(got.events),
        step_events=tracer.step_events(got.sessions) if tracer is not None else 0,
        advice=advice,
        flops_per_step=_flops_per_step(got, tracer, opts.steps), claim=claim,
    )


# --- the ranks a launcher started (issue 40) ------------------------------------------------


def _with_ranks(report: ProfileReport, launched: ranks.Launches,
                asked: str | None) -> ProfileReport:
    """The report with a record per rank that the cell launched, and the straggler; where
    the user `asked` for a folder of the ranks' traces and none started, one line."""
    if launched.made is None:
        if asked:
            report.notes.append(f"--trace {asked}: the cell started no ranks, so nothing was "
                                "written there (a folder is for a launcher's ranks' traces)")
        return report
    try:
        report.ranks = ranks.read_ranks(launched.made)
        slow = ranks.straggler(report.ranks)
        report.straggler = slow.rank if slow is not None else None
        report.ranks_table = ranks.table(report.ranks, launched.expected, launched.made, slow)
        device = any(r.device_busy is not None for r in report.ranks)
        report.advice.extend(advise_ranks(report.ranks, slow, device))
    except Exception as err:  # ours: the launcher's own report is still shown
        _log.debug("the ranks could not be read", exc_info=True)
        report.notes.append(f"the ranks' profiles could not be read: {first_sentence(err, True)}")
    return report


def _flops_per_step(got: Read, tracer: LineTracer | None, full_steps: int) -> float | None:
    """Under the steps window, the counted FLOPs of one recorded step of the windowed
    loops: those of their lines, over the steps recorded in full (each loop's first and
    `full_steps` more, each time entered)."""
    if tracer is None or not tracer.windowed or not got.analysis.work.flops:
        return None
    lines: set[str] = set()
    steps = 0
    for header, entries in tracer.loop_steps.items():
        if max(entries) > full_steps + 1:
            body = range(header + tracer.shift, tracer.loops[header].stop + tracer.shift)
            lines |= {str(n) for n in body}
            steps += sum(min(n, full_steps + 1) for n in entries)
    flops = sum(r.flops for r in got.analysis.lines if r.where in lines)
    return flops / steps if flops and steps else None


def _advice(
    got: Read, recorded: Recorded, namespace: Mapping[str, Any], reads: Collection[str],
    source: str, claim: Claim | None = None,
) -> list[Advice]:
    measured, tracer, timeline = recorded.measured, recorded.tracer, got.timeline
    peak = measured.device_top_bytes() if measured is not None else None
    try:
        setting = read_setting(got.wall_s, recorded.cuda, peak, recorded.mark or ())
        setting.loops = tracer.loop_lines() if tracer is not None else []
        top = timeline.largest[0] if timeline is not None and timeline.largest else None
        if top is not None and top.line is not None:  # --memory: the peak's top line
            setting.largest = (str(top.line), top.bytes, top.text)
        # read after the run: the cell may have made the model
        values = [(n, namespace[n]) for n in sorted(reads) if n in namespace]
        setting.data_parallel = data_parallel(values)
        setting.source, setting.kinds, setting.loader = source, name_kinds(values), loader(
            values, namespace)
        setting.claim = claim
        names = tracer.names if tracer is not None else {}
        return advise(got.events, got.analysis, names, setting)
    except Exception as err:  # ours: the profile itself is still shown
        _log.debug("the advice failed", exc_info=True)
        got.notes.append(f"the advice could not be made: {first_sentence(err, True)}")
        return []
