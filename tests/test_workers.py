"""The cell's other processes: DataLoader workers, torch.multiprocessing, shell children.

Real child processes on this machine. What exited children used is read through
`getrusage(RUSAGE_CHILDREN)`, which keeps the largest child ever reaped by the
process: so the tests that read it run their cells in a child forked from pytest,
whose count starts from nothing (`in_a_fresh_process`).
"""

from __future__ import annotations

import csv
import json
import multiprocessing
import os
import subprocess
import time
import traceback
from collections.abc import Callable

import pytest
from fakegpu import GIB, FakeMachine, Gpu
from test_gpu_measure import in_fresh_process

from torch_device_magic import workers
from torch_device_magic.measure import Meter
from torch_device_magic.workers import CONTAINER_NOTE, NONE, CellWorkers, ChildWatch

MIB = 2**20

TOUCH = (
    "from torch.utils.data import DataLoader, Dataset\n"
    "KEEP = []\n"
    "class Touch(Dataset):  # each worker touches `mib` MiB once, and keeps it\n"
    "    def __init__(self, mib):\n"
    "        self.mib = mib\n"
    "    def __len__(self):\n"
    "        return 8\n"
    "    def __getitem__(self, i):\n"
    "        if not KEEP and self.mib:\n"
    "            KEEP.append(torch.ones(self.mib * 2**18))\n"
    "        return i\n"
    "def loader(mib, **kw):\n"
    "    return DataLoader(Touch(mib), num_workers=2, multiprocessing_context='fork', **kw)\n"
)


def records(ip, n: int) -> list[dict]:
    """The last `n` cells' records, with the line each showed as `line`."""
    kept = ip.magics_manager.registry["TorchDeviceMagics"].reporter.history.records()[-n:]
    return [{**r.as_dict(), "line": r.summary()} for r in kept]


def in_a_fresh_process(ip, cells: list[str]) -> list[dict]:
    """Run `cells` in `ip` inside a child forked from this process; their records."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer, and never return into pytest
        try:
            for cell in cells:
                ip.run_cell(cell, store_history=True)
            answer = json.dumps(records(ip, len(cells)))
        except BaseException:
            answer = json.dumps({"error": traceback.format_exc()})
        finally:
            with os.fdopen(write, "w") as out:
                out.write(answer)
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as got:
        found = json.loads(got.read())
    os.waitpid(pid, 0)
    assert not isinstance(found, dict), found["error"]
    return found


def test_a_data_loaders_workers_that_exited_are_counted_with_the_larger_peak(ip):
    ip.run_cell(TOUCH)
    idle, touched, smaller = in_a_fresh_process(ip, [
        "batches = list(loader(0))",  # first: getrusage keeps the largest so far
        "batches = list(loader(64))",
        "batches = list(loader(0))",  # smaller than the largest so far: only a bound
    ])
    for cell in (idle, touched):
        assert (cell["workers"]["count"], cell["workers"]["exited"]) == (2, 2)
        assert cell["workers"]["peak_bound"] is False
        assert cell["workers"]["pss_bytes"] is None  # none alive at the end
        assert ", workers 2 (exited), largest peak " in cell["line"]
    # A worker's peak counts the pages it shares with the kernel: the 64 MiB are on top.
    assert touched["workers"]["peak_bytes"] - idle["workers"]["peak_bytes"] >= 60 * MIB
    assert (smaller["workers"]["count"], smaller["workers"]["peak_bound"]) == (2, True)
    assert smaller["workers"]["peak_bytes"] == touched["workers"]["peak_bytes"]
    assert ", largest peak ≤ " in smaller["line"]


def test_live_workers_show_their_peak_and_pss_and_idle_ones_leave_later_cells(ip):
    ip.run_cell(TOUCH)
    ip.run_cell("idle = iter(loader(0, persistent_workers=True)); next(idle); next(idle)")
    ip.run_cell("del idle")  # their shutdown
    ip.run_cell("touched = iter(loader(64, persistent_workers=True)); next(touched); next(touched)")
    ip.run_cell("x = 1")  # two workers alive, not busy in this cell
    idle, shutdown, touched, quiet = records(ip, 4)
    for cell in (idle, touched):
        assert (cell["workers"]["count"], cell["workers"]["exited"]) == (2, 0)
        assert ", workers 2, largest peak " in cell["line"] and ", PSS " in cell["line"]
    assert touched["workers"]["peak_bytes"] - idle["workers"]["peak_bytes"] >= 60 * MIB
    # PSS splits what the workers share with the kernel; their own 64 MiB each count whole.
    assert touched["workers"]["pss_bytes"] - idle["workers"]["pss_bytes"] >= 120 * MIB
    assert (shutdown["workers"]["count"], shutdown["workers"]["exited"]) == (2, 2)
    assert quiet["workers"] is None and "workers" not in quiet["line"]
    ip.run_cell("del touched")


def test_gpumem_gives_a_row_per_worker_and_devhistory_a_column(ip, capsys):
    ip.run_cell(TOUCH)
    report = ip.run_cell(
        "%%gpumem -o\ntouched = iter(loader(64, persistent_workers=True)); next(touched)"
    ).result
    assert (report.workers.count, report.workers.exited) == (2, 0)
    pids = sorted(w.pid for w in report.processes)
    assert len(pids) == 2 and all(w.peak_bytes >= 64 * MIB for w in report.processes)
    text = str(report)
    assert "the cell's worker processes" in text
    for pid in pids:
        row = next(line for line in text.splitlines() if line.startswith(f"{pid} "))
        assert row.split()[1] == "running"
    assert "\nworkers  " in text
    ip.run_cell("del touched")
    capsys.readouterr()
    ip.run_cell("%devhistory")
    table = capsys.readouterr().out
    assert table.splitlines()[1].split()[-1] == "workers"
    assert "  2, largest peak " in table and "  2 (exited), largest peak " in table


def test_a_record_keeps_the_workers_as_one_sub_record_and_the_csv_a_column_each(ip, tmp_path):
    ip.run_cell(TOUCH)
    ip.run_cell("batches = list(loader(0))")
    ip.run_cell("x = 1")
    loaded, quiet = ip.run_cell("%devhistory -o").result[-2:]
    assert isinstance(loaded.workers, CellWorkers) and quiet.workers is None
    assert (loaded.workers.count, loaded.workers.exited) == (2, 2)
    ip.run_cell(f"%devhistory --csv {tmp_path}/cells.csv")
    with open(tmp_path / "cells.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    loaded_row, quiet_row = rows[-3:-1]  # then the %devhistory -o cell
    assert "workers" not in loaded_row
    assert (loaded_row["workers_count"], loaded_row["workers_exited"]) == ("2", "2")
    assert int(loaded_row["workers_peak_bytes"]) == loaded.workers.peak_bytes
    assert all(quiet_row[f"workers_{name}"] == "" for name in ("count", "exited", "note"))


def test_torch_multiprocessing_fork_with_gloo_under_our_default_device(ip, tmp_path):
    """start_processes(fork) works with %device set (the children drop our default
    device: a meta tensor would hold no memory and gloo would refuse it), and the
    launch cell shows both processes with their 64 MiB."""
    ip.run_cell("%device meta")
    ip.run_cell(
        "import torch.distributed as dist, torch.multiprocessing as tmp\n"
        "def nothing(rank):\n"
        "    pass\n"
        "def train(rank, path):\n"
        "    torch.set_num_threads(1)  # OpenMP used before a fork hangs in the child (libgomp)\n"
        "    dist.init_process_group('gloo', init_method=f'file://{path}', rank=rank, "
        "world_size=2)\n"
        "    t = torch.ones(2**24)  # 64 MiB, on the CPU: the default device was dropped\n"
        "    dist.all_reduce(t)\n"
        "    assert t.device.type == 'cpu' and t[0].item() == 2\n"
        "    dist.destroy_process_group()\n"
    )
    rendezvous = tmp_path / "rendezvous"
    nothing, launch = in_a_fresh_process(ip, [
        "tmp.start_processes(nothing, nprocs=2, start_method='fork')",
        f"tmp.start_processes(train, args=({str(rendezvous)!r},), nprocs=2, start_method='fork')",
    ])
    assert launch["workers"] | {"peak_bytes": None} == {
        "count": 2, "exited": 2, "uncounted": False, "peak_bytes": None, "peak_bound": False,
        "pss_bytes": None, "device_bytes": None, "note": None, "exit_codes": []}
    assert launch["workers"]["peak_bytes"] - nothing["workers"]["peak_bytes"] >= 64 * MIB
    assert ", workers 2 (exited), largest peak " in launch["line"]
    assert ip.run_cell("torch.zeros(1).device.type").result == "meta"  # the kernel keeps it


def test_a_childs_children_count_too_and_an_exit_fork_did_not_start_is_seen(ip):
    ip.run_cell(
        "import multiprocessing, os, subprocess\n"
        "fork = multiprocessing.get_context('fork')\n"
        "def parent(pids):\n"
        "    sleeper = subprocess.Popen(['sleep', '30'])  # the child's own child\n"
        "    pids.put(sleeper.pid)\n"
        "    sleeper.wait()\n"
        "pids = fork.SimpleQueue()\n"
        "tree = fork.Process(target=parent, args=(pids,))\n"
        "tree.start()\n"
        "grandchild = pids.get()"
    )
    ip.run_cell("os.system('true')")  # not forked by Python: seen as it exits
    ip.run_cell("os.kill(grandchild, 9); tree.join()")
    started, shell, ended = records(ip, 3)
    assert (started["workers"]["count"], started["workers"]["exited"]) == (2, 0)
    # The tree idles through the next cell: only the shell's exit is the cell's.
    assert (shell["workers"]["count"], shell["workers"]["uncounted"]) == (1, True)
    assert ", workers 1+ (exited), largest peak " in shell["line"]
    assert (ended["workers"]["count"], ended["workers"]["exited"]) == (2, 2)


def test_a_cell_without_children_records_no_workers_and_says_nothing(ip):
    ip.run_cell("y = torch.ones(3)")
    (cell,) = records(ip, 1)
    assert cell["workers"] is None
    assert "workers" not in cell["line"]


# --- device memory per worker: NVML's per-process list on the fake GPU machine ----------------


def live_child() -> multiprocessing.Process:
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
    child.start()
    return child


@pytest.mark.parametrize("listed, shown, note", [
    ("child", GIB, None),  # NVML names the worker by the pid this machine knows
    ("other", None, CONTAINER_NOTE),  # a container: NVML's ids are the host's
    ("none", None, None),  # no process on the GPU: no figure, and nothing to explain
])
def test_each_workers_gpu_memory_comes_from_nvmls_process_list(monkeypatch, listed, shown, note):
    gpu = Gpu()
    FakeMachine([gpu]).install(monkeypatch)
    meter = Meter()
    meter.start()
    child = live_child()
    try:
        gpu.processes = {"child": {child.pid: GIB}, "other": {4_000_000: GIB}, "none": {}}[listed]
        m = meter.stop()
    finally:
        child.kill()
        child.join()
        meter.close()
    assert (m.workers.count, m.workers.device_bytes, m.workers.note) == (1, shown, note)
    (worker,) = meter.workers.processes
    assert worker.pid == child.pid and worker.device_bytes == shown
    if note:
        assert f"({note})" in m.summary() and "GPU 0 B" not in m.summary()
    if shown:
        assert ", GPU 1.0 GiB" in m.summary()


def test_without_nvml_the_workers_have_no_gpu_figure_and_no_note(monkeypatch):
    FakeMachine([Gpu()], nvml=False).install(monkeypatch)
    meter = Meter()
    meter.start()
    child = live_child()
    try:
        m = meter.stop()
    finally:
        child.kill()
        child.join()
        meter.close()
    assert (m.workers.count, m.workers.device_bytes, m.workers.note) == (1, None, None)


# --- the real launches on a GPU (scripts/gpu-check) ---------------------------------------------


@pytest.mark.parametrize("device, tensor_mib", [
    ("cpu", 64),
    pytest.param("cuda", 256, marks=pytest.mark.cuda),
])
def test_a_fork_launch_works_with_the_extension_loaded(device, tensor_mib):
    """In a new process (on a GPU, pytest's own asked `torch.cuda.is_available()`, after
    which no forked child can use CUDA): no CUDA context before the launch, our default
    device dropped in the children, and the cell shows both workers (on CUDA, each
    one's GPU memory from NVML's process list)."""
    ran = in_fresh_process([
        f"%device {device}",
        "extra = [torch.cuda.is_initialized()]",
        "import torch.multiprocessing as tmp\n"
        "ready = tmp.get_context('fork').Barrier(3)\n"
        "def train(rank, ready):\n"
        "    from torch_device_magic.probes import torch_default_device\n"
        "    assert torch_default_device() is None\n"
        f"    where = {device!r}\n"
        "    if where == 'cuda':  # a GPU each, where there are several\n"
        "        where = f'cuda:{rank % torch.cuda.device_count()}'\n"
        f"    t = torch.ones({tensor_mib} * 2**18, device=where)\n"
        "    ready.wait(timeout=120)  # held until the parent's cell has ended\n"
        "    ready.wait(timeout=120)\n"
        "procs = tmp.start_processes(train, args=(ready,), nprocs=2, start_method='fork', "
        "join=False)\n"
        "ready.wait(timeout=120)",
        "ready.wait(timeout=120)\nwhile not procs.join(): pass",
        "extra += [torch.cuda.is_initialized()]",
    ])
    launch = ran["records"][-3]  # then the join, and the last look
    assert ran["extra"] == [False, False]
    assert (launch["workers"]["count"], launch["workers"]["exited"]) == (2, 0), launch["summary"]
    if device == "cpu":
        assert launch["workers"]["peak_bytes"] >= tensor_mib * MIB
    elif launch["workers"]["note"] is None:  # outside a container NVML names them
        assert launch["workers"]["device_bytes"] >= 2 * tensor_mib * MIB
        assert ", GPU " in launch["summary"]


@pytest.mark.cuda
def test_accelerate_notebook_launcher_works_with_the_extension_loaded():
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("notebook_launcher starts processes only for two GPUs or more")
    cell = in_fresh_process([
        "%device cuda",
        "from accelerate import notebook_launcher\n"
        "def train():\n"
        "    from accelerate import Accelerator\n"
        "    t = torch.ones(2**26, device=Accelerator().device)\n"
        "notebook_launcher(train, num_processes=2)",
    ])["records"][-1]
    assert (cell["workers"]["count"], cell["workers"]["exited"]) == (2, 2)
    assert cell["workers"]["peak_bytes"] is not None


# --- which processes are the cell's (issue 20, points 8-11) -----------------------------------

ZOMBIE = (
    "import multiprocessing, time\n"
    "fork = multiprocessing.get_context('fork')\n"
    "def state(pid):\n"
    "    with open(f'/proc/{pid}/stat') as f:\n"
    "        return f.read().rsplit(')', 1)[1].split()[0]\n"
)


def test_a_finished_unjoined_process_is_a_worker_of_the_cell_it_exited_in_only(ip):
    ip.run_cell(ZOMBIE)
    ip.run_cell(
        "done = fork.Process(target=int); done.start()\n"
        "while state(done.pid) != 'Z':  # exited, and nobody joins it: a zombie\n"
        "    time.sleep(0.01)"
    )
    ip.run_cell("x = 1")
    ip.run_cell("x = 2")
    ip.run_cell("done.join()")  # reaped here, but it exited two cells ago
    exited, later, again, joined = records(ip, 4)
    assert ", workers 1 (exited), largest peak n/a" in exited["line"]
    for cell in (later, again, joined):
        assert "workers" not in cell["line"]
        assert cell["workers"] is None


DYING = ZOMBIE + (
    "import os, signal\n"
    "def child(code):  # exits at once with `code`; a negative one: killed by that signal\n"
    "    pid = os.fork()\n"
    "    if pid == 0:\n"
    "        os.kill(os.getpid(), -code) if code < 0 else os._exit(code)\n"
    "    return pid\n"
    "def wait_dead(*pids):  # exited, not reaped: as a parent blocked elsewhere leaves them\n"
    "    while any(state(p) != 'Z' for p in pids):\n"
    "        time.sleep(0.01)\n"
)


def test_workers_that_died_while_the_cell_waited_say_their_exit_codes(ip):
    """Children that died while the cell waited on them (a launch whose workers failed,
    its parent blocked on a barrier): the line gives their exit codes; a clean exit
    (code 0) keeps the line as it was."""
    ip.run_cell(DYING)
    ip.run_cell("died = child(1), child(-signal.SIGKILL); wait_dead(*died)")
    ip.run_cell("[os.waitpid(p, 0) for p in died]; fine = child(0); wait_dead(fine)")
    ip.run_cell("os.waitpid(fine, 0)")
    died, fine, _ = records(ip, 3)
    assert ", workers 2 (exited: codes 1, -9), largest peak " in died["line"]
    assert died["workers"]["exit_codes"] == (1, -9)
    assert ", workers 1 (exited), largest peak " in fine["line"]
    assert fine["workers"]["exit_codes"] == (0,)


def test_a_worker_the_cell_joined_has_no_code_and_says_so_only_beside_one_that_died(ip):
    """A worker that the cell's own code reaped (a `join`) has no exit code left to read:
    the code that joined it has it (`Process.exitcode`). Alone it reads 'exited', even
    where it failed; beside a worker whose code says it died, '?'."""
    ip.run_cell(DYING)
    ip.run_cell("failed = fork.Process(target=os._exit, args=(5,)); failed.start(); failed.join()")
    ip.run_cell("fine = fork.Process(target=int); fine.start(); fine.join()\n"
                "died = child(2); wait_dead(died)")
    ip.run_cell("os.waitpid(died, 0)")
    joined, beside, _ = records(ip, 3)
    assert ip.user_ns["failed"].exitcode == 5
    assert ", workers 1 (exited), largest peak " in joined["line"]
    assert joined["workers"]["exit_codes"] == ()
    assert ", workers 2 (exited: codes 2, ?), largest peak " in beside["line"]
    assert beside["workers"]["exit_codes"] == (2,)


def test_a_reused_pid_is_a_new_process(ip):
    """A worker reaped in the cell and another forked with its pid: one exited, one
    running; the second's exit is the cell it really exits in."""
    if not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("needs /proc/sys/kernel/ns_last_pid writable (root) to hand out a pid again")
    ip.run_cell(
        ZOMBIE + "def again(pid):  # a sleeping child, with `pid` where the kernel allows\n"
        "    with open('/proc/sys/kernel/ns_last_pid', 'w') as f:\n"
        "        f.write(str(pid - 1))\n"
        "    child = fork.Process(target=time.sleep, args=(30,))\n"
        "    child.start()\n"
        "    return child\n"
    )
    for _ in range(10):  # other processes on the machine may take the pid first
        ip.run_cell("first = fork.Process(target=time.sleep, args=(30,)); first.start()")
        ip.run_cell("first.kill(); first.join(); second = again(first.pid)")
        ip.run_cell("second.kill(); second.join()")
        if ip.user_ns["second"].pid == ip.user_ns["first"].pid:
            break
    else:
        pytest.skip("another process took the pid every time")
    _, both, second = records(ip, 3)
    assert ", workers 2 (1 exited), largest peak " in both["line"]
    assert ", workers 1 (exited), largest peak " in second["line"]


def test_a_peak_reaped_cells_ago_is_only_a_bound_and_subprocess_children_are_seen(ip):
    """getrusage keeps the session's largest reaped child: a script's 512 MiB two cells
    before is not the peak of a later cell's children. The script's own cell shows it
    (exactly: the figure rose there) as one exited child at least (nothing counted it)."""
    # A child's peak counts what it shared with this process until its exec: the script
    # makes 512 MiB more than this process holds, so that its own peak is the higher.
    script, between, spawned, _ = in_a_fresh_process(ip, [
        "import multiprocessing, resource, subprocess, sys, time\n"
        "big = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 + (512 << 20)\n"
        "subprocess.run([sys.executable, '-c', f'b = b\"x\" * {big}'], check=True)",
        "x = 1",
        # a spawned child (and multiprocessing's resource tracker, which is no worker),
        # and a shell child's exit
        "slow = multiprocessing.get_context('spawn').Process(target=time.sleep, args=(30,))\n"
        "slow.start()\n"
        "subprocess.run(['true'], check=True)",
        "slow.kill(); slow.join()",
    ])
    assert ", workers 1+ (exited), largest peak " in script["line"]
    assert script["workers"]["peak_bytes"] >= 512 * MIB
    assert script["workers"]["peak_bound"] is False
    assert between["workers"] is None
    assert ", workers 2+ (1 exited), largest peak ≤ " in spawned["line"]
    assert spawned["workers"]["peak_bound"] is True


def test_a_shell_child_of_a_large_kernel_has_no_peak_of_its_own_shown(ip):
    """Until its exec a child shares this process's pages, and getrusage counts them as
    its peak: a `true` run from a kernel holding 600 MiB is not a 600 MiB worker."""
    (child,) = in_a_fresh_process(ip, [
        "import subprocess\n"
        "held = bytearray(600 << 20); held[::4096] = b'x' * len(held[::4096])\n"
        "subprocess.run(['true'], check=True)",
    ])
    assert child["workers"]["peak_bound"] is True
    assert ", workers 1+ (exited), largest peak ≤ " in child["line"]


def test_a_running_popen_is_seen_in_a_process_that_had_children(ip):
    ip.run_cell("import subprocess\nsleeper = subprocess.Popen(['sleep', '30'])")
    ip.run_cell("sleeper.kill(); sleeper.wait()")
    started, ended = records(ip, 2)
    assert ", workers 1, largest peak " in started["line"]
    assert started["workers"]["exited"] == 0 and started["workers"]["pss_bytes"] is not None
    assert ", workers 1 (exited), largest peak " in ended["line"]


@pytest.mark.parametrize("helper", ["resource_tracker", "forkserver"])
def test_multiprocessings_helpers_are_not_the_cells_workers(ip, helper):
    ip.run_cell(ZOMBIE)
    (cell,) = in_a_fresh_process(ip, [
        f"import multiprocessing.{helper} as helper\n"
        "helper.ensure_running()\n"
        "child = fork.Process(target=int); child.start(); child.join()"
    ])
    assert ", workers 1 (exited), largest peak " in cell["line"]


def in_a_child(check: Callable[[], list]) -> list:
    """`check()`'s answer, run in a child forked from this process (which has no child)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            answer = check()
        except BaseException:
            answer = [traceback.format_exc()]
        finally:
            with os.fdopen(write, "w") as out:
                out.write(json.dumps(answer))
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as got:
        answer = json.loads(got.read())
    os.waitpid(pid, 0)
    return answer


def test_a_quick_cell_without_a_child_known_reads_nothing_and_a_longer_one_sees_a_shell_child():
    def check() -> list:
        watch = ChildWatch()
        watch.start()  # the first start looks: no child
        watch.stop(elapsed_s=50e-6)
        looked: list[str] = []
        watch._listed = lambda: looked.append("listed") or set()  # type: ignore[method-assign]
        usage = watch._usage
        watch.start()
        quick = watch.stop(elapsed_s=50e-6)  # quicker than any process's start and end
        first = [quick is NONE, looked[:], watch._usage is usage]
        watch.start()
        subprocess.run(["true"], check=True)  # not forked by Python: seen as it is reaped
        found = watch.stop(elapsed_s=0.01)
        return [*first, found.count, found.exited, found.uncounted, looked]

    assert in_a_child(check) == [True, [], True, 1, 1, True, ["listed"]]


def test_a_pid_multiprocessing_still_lists_but_another_process_has_is_no_worker(monkeypatch):
    """multiprocessing keeps a Process reaped through `exitcode` among its children, so
    its pid may since name a process of someone else's (here: pytest's parent)."""
    other = os.getppid()
    monkeypatch.setattr(workers, "_mp_children", lambda: [object()])
    monkeypatch.setattr(workers, "_mp_pids", lambda: {other})
    watch = ChildWatch()
    try:
        watch.start()
        found = watch.stop(elapsed_s=0.01)
    finally:
        watch.close()
    assert other not in {w.pid for w in found.processes}


def test_gpumem_does_not_take_a_pool_idle_in_its_cell_for_its_workers(ip):
    """%%gpumem measures with a Meter of its own, which has not seen the pool start: the
    workers alive before its cell and idle in it are not its."""
    ip.run_cell(TOUCH)
    ip.run_cell("pool = loader(0, persistent_workers=True); batches = list(pool)")  # then idle
    report = ip.run_cell("%%gpumem -o\nx = sum(range(10**5))").result
    ip.run_cell("del pool")
    assert report.workers is None and report.processes == []
    assert "workers" not in str(report)
