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


def function_of(entry: Any, everything: list[Any]) -> tuple[str, int | None]:
    """The user's function an entry compiled (a graph break's resumed part counts as its
    function), and the line a resumed part starts at."""
    name = getattr(entry, "co_name", None)
    if name is None:  # a failed compile: its frame's earlier records carry the name
        frame = str(getattr(entry, "compile_id", "")).split("/")[0]
        name = next((e.co_name for e in reversed(everything) if e.co_name
                     and str(e.compile_id).split("/")[0] == frame), None)
    if name is None:
        return "a function", None
    resumed = _RESUME.match(name)
    return (resumed.group(1), int(resumed.group(2))) if resumed else (name, None)


def where_defined(record: Any) -> str:
    """'double (a cell's line 2)', 'forward (model.py:12)': a compilation record's frame."""
    file = record.co_filename or ""
    if file.startswith("<ipython-input") or "ipykernel" in file:
        return f"{record.co_name} (a cell's line {record.co_firstlineno})"
    return f"{record.co_name} ({os.path.basename(file)}:{record.co_firstlineno})"


def short_reason(text: str | None) -> str:
    """torch's reason, made one short line: its explanation where it gives one."""
    if not text:
        return ""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    explained = next((line for line in lines if line.startswith("Explanation:")), None)
    line = explained.removeprefix("Explanation:").strip() if explained else lines[0]
    line = _COMPILE_ID.sub("", line).split("  #")[0].strip()
    return line if len(line) <= 160 else line[:157] + "..."
