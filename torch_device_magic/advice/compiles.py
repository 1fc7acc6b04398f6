"""torch.compile's records of what it compiled, as the notes, the hints and `%%profile`'s
rules read them; never importing torch's compiler (that takes seconds): only where the
user's code imported it.

A record (torch._dynamo.utils.CompilationMetrics) names the frame it compiled
(`co_name`, `compile_id` "frame/attempt"), why it recompiled, why it failed, its
graph breaks (`restart_reasons`), and why CUDA graphs were skipped.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

UTILS = "torch._dynamo.utils"  # the module holding the records, where it was imported
_RESUME = re.compile(r"torch_dynamo_resume_in_(\w+?)_at_(\d+)$")
_COMPILE_ID = re.compile(r"^\[?(\d+)/\d+\]?:?\s*")


def records() -> list[Any]:
    """torch.compile's record of its compilations so far, [] where the user's code did not
    import dynamo."""
    utils = sys.modules.get(UTILS)
    return list(utils.get_compilation_metrics()) if utils is not None else []


def last_record() -> object:
    """The newest record, None where there is none."""
    utils = sys.modules.get(UTILS)
    found = getattr(utils, "_compilation_metrics", None)
    return found[-1] if found else None


def recorded_since(utils: Any, seen: object) -> bool:
    """Whether torch recorded a compilation after `seen` (the newest record seen before)."""
    found: Any = getattr(utils, "_compilation_metrics", None)
    return bool(found) and found[-1] is not seen


def records_since(utils: Any, seen: object) -> tuple[list[Any], list[Any]]:
    """The records after `seen`, oldest first, and all of them."""
    everything = utils._compilation_metrics
    new = []
    for entry in reversed(everything):
        if entry is seen:
            break
        new.append(entry)
    new.reverse()
    return new, list(everything)


def recompile_limit() -> int | None:
    """torch's recompile limit (`cache_size_limit` before it was renamed), where dynamo's
    config was imported."""
    config = sys.modules.get("torch._dynamo.config")
    limit = getattr(config, "recompile_limit", getattr(config, "cache_size_limit", None))
    return limit if isinstance(limit, int) else None


def hit_limit(entry: Any) -> bool:
    """Whether a compilation record is a function reaching the recompile limit (an error
    under fullgraph=True, else the function runs uncompiled)."""
    fail = entry.fail_reason or ""
    return (entry.fail_type == "FailOnRecompileLimitHit" or "recompile limit" in fail
            or "cache size limit" in fail)


def recompile_limit_reasons() -> tuple[str, list[str]]:
    """The function that last hit torch.compile's recompile limit, and the reasons torch
    recorded for its recompiles (oldest first, each once); ("a function", []) where torch
    recorded none. For the hint after a cell that failed there (`fullgraph=True`)."""
    utils = sys.modules.get(UTILS)
    everything = list(getattr(utils, "_compilation_metrics", ()))
    hit = next((e for e in reversed(everything) if hit_limit(e)), None)
    if hit is None:
        return "a function", []
    frame = str(hit.compile_id).split("/")[0]
    reasons = [short_reason(e.recompile_reason) for e in everything
               if e.recompile_reason and str(e.compile_id).split("/")[0] == frame]
    return function_of(hit, everything)[0], list(dict.fromkeys(reasons))


Code = tuple[str, int | None, str]  # a user's function: its file, first line and name


@dataclass
class Function:
    """What torch.compile did to one of the user's functions, from some of its records:
    the function's own frame and the parts after its graph breaks (resumed frames)."""

    code: Code
    first: list[float] = field(default_factory=list)  # its frames compiled anew: their times
    recompiles: int = 0  # times it compiled again (a resumed part recompiles with it)
    versions: int = 0  # compiled versions it has now
    reason: str = ""  # why it first recompiled here
    last: str = ""  # why it last recompiled (or hit the recompile limit)
    breaks: list[tuple[int | None, str]] = field(default_factory=list)  # (line, reason)
    limit: str | None = None  # it hit the recompile limit: the last reason
    cudagraphs: list[str] = field(default_factory=list)  # why CUDA graphs were skipped
    _parts: dict[int | None, int] = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return self.code[2]

    def where(self) -> str:
        """'double (a cell's line 2)', 'forward (model.py:12)'."""
        file, line, name = self.code
        if file.startswith("<ipython-input") or "ipykernel" in file:
            return f"{name} (a cell's line {line})"
        return f"{name} ({os.path.basename(file)}:{line})"


def functions(new: list[Any], everything: list[Any]) -> list[Function]:
    """The user's functions that `new` records compiled, each once: keyed by its code
    (file, first line, name), never by its bare name alone (a GAN's two `forward`s are
    two functions); a resumed part counts as its function's, a failed compile as its
    frame's. `everything`: all records, to name those."""
    found: dict[Code, Function] = {}
    # the graph breaks' reasons, oldest first, until their resumed parts give their lines:
    # a frame's break resumes in the next part, which may break again
    pending: dict[Code, list[str]] = {}
    for entry in new:
        code, line = code_of(entry, everything)
        f = found.setdefault(code, Function(code))
        if hit_limit(entry):
            f.limit = f.last = short_reason(entry.recompile_reason)
            continue
        first = not entry.cache_size
        if entry.recompile_reason and not first:
            why = short_reason(entry.recompile_reason)
            if line is None or not f.last:  # the function's own reason over a resumed part's
                f.last = why
            f.reason = f.reason or why
            f._parts[line] = f._parts.get(line, 0) + 1
            f.recompiles = max(f._parts.values())
            f.versions = max(f.versions, entry.cache_size + 1)
        elif first and not entry.fail_reason:
            f.first.append(entry.entire_frame_compile_time_s or 0.0)
        if entry.restart_reasons and first:
            pending.setdefault(code, []).append(short_reason(sorted(entry.restart_reasons)[0]))
        if line is not None and first and pending.get(code):
            f.breaks.append((line, pending[code].pop(0)))
        if getattr(entry, "cudagraph_skip_reason", None):
            f.cudagraphs.append(short_reason(entry.cudagraph_skip_reason))
    for code, reasons in pending.items():
        found[code].breaks += [(None, reason) for reason in reasons]  # lines not known yet
    return list(found.values())


def code_of(entry: Any, everything: list[Any]) -> tuple[Code, int | None]:
    """The user's function an entry compiled (file, first line, name), and the line a
    resumed part starts at (None for the function's own frame)."""
    name = getattr(entry, "co_name", None)
    file = getattr(entry, "co_filename", None) or ""
    first = getattr(entry, "co_firstlineno", None)
    if name is None:  # a failed compile: its frame's earlier records carry the code
        frame = _frame(entry)
        known = next((e for e in reversed(everything) if e.co_name and _frame(e) == frame), None)
        if known is None:
            return ("", None, "a function"), None
        name, file, first = known.co_name, known.co_filename or "", known.co_firstlineno
    resumed = _RESUME.match(name)
    if resumed is None:
        return (file, first, name), None
    parent, line = resumed.group(1), int(resumed.group(2))
    # the function it resumes: the nearest of that name in that file starting above it
    starts = [e.co_firstlineno for e in everything if e.co_name == parent
              and (e.co_filename or "") == file and (e.co_firstlineno or 0) <= line]
    return (file, max(starts) if starts else None, parent), line


def _frame(entry: Any) -> str:
    return str(getattr(entry, "compile_id", "")).split("/")[0]


def function_of(entry: Any, everything: list[Any]) -> tuple[str, int | None]:
    """The name of the user's function an entry compiled, and the line a resumed part
    starts at."""
    (_, _, name), line = code_of(entry, everything)
    return name, line


def short_reason(text: str | None) -> str:
    """torch's reason, made one short line: its explanation where it gives one."""
    if not text:
        return ""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    explained = next((line for line in lines if line.startswith("Explanation:")), None)
    line = explained.removeprefix("Explanation:").strip() if explained else lines[0]
    line = _COMPILE_ID.sub("", line).split("  #")[0].strip()
    return line if len(line) <= 160 else line[:157] + "..."
