"""Runs cells in a fresh IPython shell with torch_device_magic loaded, for the ranks tests
(tests/test_profile_ranks.py): a process of its own, because a process that has run
multi-threaded CPU ops (the other tests', their modules' at import) forks children that
hang in GNU OpenMP (torch 2.13, with or without %%profile).

    python ranks_shell.py SPEC.json   # {"setup": [...], "cell": "...", "values": {...},
                                      #  "result": "path"}: writes the result there as JSON
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
from typing import Any


def _descendants(pid: int) -> list[int]:
    """The live processes under `pid` (no zombie), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue
            if state != "Z":
                children.setdefault(int(ppid), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return str(pid)


def _report(value: Any) -> dict[str, Any] | None:
    if type(value).__name__ != "ProfileReport":
        return None
    return {"ranks": [dataclasses.asdict(r) for r in value.ranks], "straggler": value.straggler,
            "advice": [{"rule": a.rule, "text": a.text} for a in value.advice],
            "text": str(value), "trace_path": value.trace_path}


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.history_manager.enabled = False
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ip.run_line_magic("load_ext", "torch_device_magic")
        for cell in spec["setup"]:
            ip.run_cell(cell).raise_error()
        ran = ip.run_cell(spec["cell"])
        values = {k: eval(v, ip.user_ns) for k, v in spec.get("values", {}).items()}
    error = ran.error_before_exec or ran.error_in_exec
    left = [_command(p) for p in _descendants(os.getpid())
            if "multiprocessing.resource_tracker" not in _command(p)]
    result = {"error": [type(error).__name__, str(error)] if error else None,
              "report": _report(ran.result), "values": values, "out": out.getvalue(),
              "left": left}
    with open(spec["result"], "w") as f:
        json.dump(result, f, default=str)


if __name__ == "__main__":
    main(sys.argv[1])
