"""`%%profile` across a launcher's ranks (issue 40): a small DDP loop on the CPU (gloo),
started from the cell by torch's launchers; each rank's trace, its row, the straggler.

Each launch runs in a fresh IPython shell of its own (tests/scripts/ranks_shell.py), as
in a fresh kernel: this process has run multi-threaded CPU ops (other tests, and test
modules at import), and children forked from it then hang in GNU OpenMP at their first
parallel op, or abort ("Invalid thread pool!"), in torch 2.13 with or without %%profile."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys

import pytest
from IPython.core.error import UsageError

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = ("import os, signal, sys, multiprocessing.process, torch, torch.multiprocessing as mp, "
         "ranks_train")


@pytest.fixture
def fresh(tmp_path):
    """Run `cell` in a fresh shell (after `SETUP` and `store`, a new file store a launch);
    its result: `error` [name, message] or None, `report` (ranks as dicts, straggler,
    advice, text), `values` (the expressions asked, evaluated after the cell), `out` (what
    it printed). A launch that hangs is killed with its process group and fails the test;
    one that leaves a process running fails it too."""
    launches = iter(range(1000))

    def run(cell: str, values: dict[str, str] | None = None, setup: tuple[str, ...] = (),
            timeout: float = 110) -> dict:
        k = next(launches)
        store = tmp_path / f"store{k}"
        spec = tmp_path / f"spec{k}.json"
        result = tmp_path / f"result{k}.json"
        spec.write_text(json.dumps({"setup": [SETUP, f"store = {str(store)!r}", *setup],
                                    "cell": cell, "values": values or {},
                                    "result": str(result)}))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([SCRIPTS, ROOT, *sys.path])}
        proc = subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "ranks_shell.py"),
                                 str(spec)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            pytest.fail(f"the launch hung past {timeout:g} s; its output:\n{output[-3000:]}")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # anything of it still running
        assert proc.returncode == 0 and result.exists(), output[-3000:]
        got = json.loads(result.read_text())
        assert not got["left"], f"the launch left processes running: {got['left']}"
        return got

    return run


def launch(fresh, line: str, n: int, method: str, extra: str = "", **kw) -> dict:
    return fresh(f"%%profile -o {line}\nmp.start_processes(ranks_train.train, args=({n}, "
                 f"store{extra}), nprocs={n}, start_method={method!r})", **kw)


UNDONE = {"start_processes": "torch.multiprocessing.start_processes.__module__",
          "process_start": "multiprocessing.process.BaseProcess.start.__module__"}


def _undone(got: dict) -> bool:
    """Nothing of the launchers' patches stays installed after the cell."""
    return got["values"] == {"start_processes": "torch.multiprocessing.spawn",
                             "process_start": "multiprocessing.process"}


def test_a_rank_made_slow_is_named_and_each_rank_has_a_stamped_trace(fresh, tmp_path):
    folder = tmp_path / "traces"
    folder.mkdir()
    got = launch(fresh, f"--trace {folder}", 2, "fork", ", 12, 1", values=UNDONE)
    report = got["report"]
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert report["straggler"] == 1
    text = report["text"]
    assert "straggler: rank 1" in text and f"traces: {folder}" in text
    # the advice: the slow rank's own work (not the others' wait in their collectives)
    assert [a["rule"] for a in report["advice"]] == ["straggler"]
    assert report["advice"][0]["text"].startswith("rank 1's own work in a step (")
    assert "x the other ranks' (" in report["advice"][0]["text"]
    # against the sleep itself: rank 1's own work 100 ms a step or more, and both ranks'
    # steps 100 ms apart in all (rank 0 waits for it in the all_reduce; where one step's
    # boundary falls within the wait varies, so their sum, less a step for the phase)
    slow = report["ranks"][1]
    assert 0.1 <= statistics.median(slow["own_times"][1:]) < 0.5
    assert all(sum(r["step_times"][1:]) >= 0.1 * 10 for r in report["ranks"])
    for r in report["ranks"]:
        assert r["steps"] == 12 and len(r["step_times"]) == 12 and r["recorded_steps"] == 6
        assert 0 < r["collective_share"] < 1
        assert r["peak"] > 0
        assert r["trace"] == str(folder / f"rank{r['rank']}.pt.trace.json")
        with open(r["trace"]) as f:
            info = json.load(f)["distributedInfo"]
        assert info == {"backend": "gloo", "rank": r["rank"], "world_size": 2}
    assert _undone(got)


@pytest.mark.slow  # spawned ranks import torch each
def test_even_ranks_started_by_spawn_are_called_even(fresh):
    # 2 ranks: a rank of 3 on 2 cores waits; 20 matmuls a step: most of it the ranks' own
    got = launch(fresh, "", 2, "spawn", ", 12, -1, -1, -1, 'gloo', -1, 20")
    report = got["report"]
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert report["straggler"] is None
    assert "the ranks are even" in report["text"]
    trace = report["ranks"][0]["trace"]
    assert os.path.basename(os.path.dirname(trace)).startswith("tdm-ranks-In")  # a temp one
    # the all_reduce a small part of the step, the ranks' memory alike: no advice on them
    assert all(r["collective_share"] < 0.5 for r in report["ranks"])
    assert not any(a["rule"] in ("straggler", "collectives", "uneven memory")
                   for a in report["advice"])


@pytest.mark.slow  # spawned ranks import torch each
def test_collectives_most_of_a_step_and_one_rank_holding_more_are_advised(fresh):
    # each step all_reduces 64 MiB besides the model's gradients: the collectives' share
    sync = launch(fresh, "", 2, "spawn", ", 8, -1, -1, -1, 'gloo', -1, 0, 64, 32, 64")
    report = sync["report"]
    shares = {r["rank"]: r["collective_share"] for r in report["ranks"]}
    assert all(v >= 0.5 for v in shares.values()), shares
    (advice,) = [a["text"] for a in report["advice"] if a["rule"] == "collectives"]
    assert f"rank 0 {shares[0]:.0%}, rank 1 {shares[1]:.0%}" in advice
    assert "no_sync()" in advice and report["straggler"] is None
    # rank 1 holds 512 MiB more through its steps
    held = launch(fresh, "", 2, "spawn", ", 8, -1, -1, -1, 'gloo', 1")["report"]
    peaks = {r["rank"]: r["peak"] for r in held["ranks"]}
    assert peaks[1] - peaks[0] >= 400 * 2**20, peaks
    (advice,) = [a["text"] for a in held["advice"] if a["rule"] == "uneven memory"]
    assert advice.startswith("rank 1 peaks at ") and "rank 0's" in advice


def test_a_rank_that_raises_raises_as_without_profile_and_the_report_says_so(fresh):
    got = launch(fresh, "", 3, "fork", ", 8, -1, 1", values=UNDONE)
    assert got["error"][0] == "ProcessRaisedException"
    assert "rank 1 failed on purpose" in got["error"][1]
    assert "PARTIAL" in got["out"] and "rank 1 (ValueError)" in got["out"]
    assert _undone(got)


def test_a_rank_killed_exits_as_without_profile_and_did_not_come_back(fresh):
    got = launch(fresh, "", 2, "fork", ", 8, -1, -1, 0")
    assert got["error"] == ["ProcessExitedException",
                            "process 0 terminated with signal SIGKILL"]
    assert "did not come back: rank 0" in got["out"]


def test_plain_processes_that_form_a_group_are_ranks(fresh):
    cell = """%%profile -o
import multiprocessing
ctx = multiprocessing.get_context('fork')
ps = [ctx.Process(target=ranks_train.train, args=(r, 2, store, 6)) for r in (0, 1)]
for p in ps:
    p.start()
for p in ps:
    p.join()"""
    got = fresh(cell, values={"exits": "[p.exitcode for p in ps]"})
    ranks = got["report"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["steps"] == 6 and 0 < r["collective_share"] < 1 for r in ranks)
    assert got["values"]["exits"] == [0, 0]


def test_ctrl_c_in_the_notebook_stops_the_ranks_profilers_and_they_run_on(fresh, tmp_path):
    # Jupyter's Ctrl-C reaches only the kernel: the ranks run on, as without %%profile, but
    # their profilers stop at their next step and write what they recorded (60 steps of
    # 100 ms at least: rank 1 sleeps in each, rank 0 waits for it)
    cell = f"""%%profile --trace {tmp_path}
import multiprocessing, threading
ctx = multiprocessing.get_context('fork')
ps = [ctx.Process(target=ranks_train.train, args=(r, 2, store, 60, 1)) for r in (0, 1)]
for p in ps:
    p.start()
threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT)).start()
for p in ps:
    p.join()"""
    got = fresh(cell, values={**UNDONE, "exits": "[p.join(60) or p.exitcode for p in ps]"})
    assert got["error"][0] == "KeyboardInterrupt" and "PARTIAL" in got["out"]
    assert got["values"].pop("exits") == [0, 0]  # they ran all their steps
    assert _undone(got)
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.tdm-summary") as f:
            summary = json.load(f)
        assert 0 < len(summary["step_times"]) < 60  # timed until the cell ended
        assert os.path.getsize(summary["trace"]) > 0


def test_a_cell_that_starts_no_ranks_has_none(ip, tmp_path):
    report = ip.run_cell("%%profile -o\nx = 1 + 1").result
    assert report.ranks == [] and report.straggler is None
    assert "ranks:" not in str(report) and "--trace" not in str(report)
    # a folder asked for the ranks' traces, none started: one line, the folder untouched
    report = ip.run_cell(f"%%profile -o --trace {tmp_path}\nx = 1 + 1").result
    assert report.ranks == [] and os.listdir(tmp_path) == []
    assert (f"--trace {tmp_path}: the cell started no ranks, so nothing was written there"
            in str(report))
    assert report.trace_path and os.path.exists(report.trace_path)  # the cell's own trace


def test_a_folder_that_cannot_be_written_is_refused_before_the_cell(ip, tmp_path,
                                                                   monkeypatch):
    from torch_device_magic.profile import capture

    monkeypatch.setattr(capture.os, "access", lambda path, mode: False)  # as for non-root
    ip.run_cell("ran = 0")
    with pytest.raises(UsageError, match=f"--trace {tmp_path}: that folder cannot be written"):
        ip.run_cell(f"%%profile --trace {tmp_path}\nran += 1")
    assert ip.user_ns["ran"] == 0


def test_torch_elastic_launch_profiles_its_ranks(fresh):
    got = fresh("%%profile -o\nelastic_launch(config, ranks_train.elastic_train)(store, 8)",
                setup=("from torch.distributed.launcher.api import LaunchConfig, elastic_launch\n"
                       "config = LaunchConfig(1, 1, 2, rdzv_backend='c10d', "
                       "rdzv_endpoint='127.0.0.1:0', start_method='fork', "
                       "monitor_interval=0.1, run_id='t')",))
    ranks = got["report"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["steps"] == 8 for r in ranks)


def test_accelerates_notebook_launcher_profiles_its_ranks(fresh):
    pytest.importorskip("accelerate")
    import socket

    with socket.socket() as free:  # its static rendezvous takes a port: a free one
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    got = fresh("%%profile -o\nfrom accelerate import notebook_launcher\n"
                f"notebook_launcher(ranks_train.elastic_train, (store, 8), num_processes=2, "
                f"use_port={port})")
    assert "Launching training on 2 CPUs." in got["out"]  # accelerate's own
    ranks = got["report"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["steps"] == 8 and r["backend"] == "gloo" for r in ranks)


@pytest.mark.cuda
def test_a_forked_child_uses_cuda_under_profile_as_without(fresh):
    cell = """%%profile -o
import multiprocessing
p = multiprocessing.get_context('fork').Process(target=ranks_train.cuda_child)
p.start()
p.join(60)"""
    got = fresh(cell, values={"exit": "p.exitcode", "up": "torch.cuda.is_initialized()"})
    assert got["values"] == {"exit": 0, "up": False}  # the child's CUDA worked; none here
    assert got["report"]["ranks"] == []  # no process group: no rank


def test_the_traces_load_in_hta_as_ranks_0_to_n(fresh, tmp_path):
    if importlib.util.find_spec("hta") is None:
        pytest.skip("HolisticTraceAnalysis is not installed (the hta extra)")
    folder = tmp_path / "traces"
    folder.mkdir()
    got = launch(fresh, f"--trace {folder}", 2, "fork", ", 6")
    hta = importlib.import_module("hta.trace_analysis")
    analysis = hta.TraceAnalysis(trace_dir=str(folder))
    assert sorted(analysis.t.traces) == [0, 1]
    assert len(got["report"]["ranks"]) == 2


def test_forked_ranks_launched_again_and_again_all_end(fresh):
    # without the GIL let go as a rank's function returns, torch's gloo teardown with a
    # profiler on hung one of 3 forked ranks by the third or fourth launch: 8 profiled cells
    def cell(k: int) -> str:
        return (f"%%profile -o\nmp.start_processes(ranks_train.train, args=(3, store + "
                f"'{k}', 8), nprocs=3, start_method='fork')")

    got = fresh(cell(7), setup=tuple(cell(k) for k in range(7)), timeout=300)
    assert got["error"] is None
    assert [r["rank"] for r in got["report"]["ranks"]] == [0, 1, 2]
