"""%%profile's advice: each rule fires on a cell (or events) where it should, and stays
quiet where it should not.

The CPU rules run on real cells; the rules that need a GPU get events shaped like a
real CUDA capture's (kernels, their launches, memcpy kinds) and the device's settings,
fed to `advise` as plain data. scripts/gpu-check runs a real cell for them on a GPU.
DataParallel's rule runs on real cells on the fake GPUs (tests/fakegpu.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fakegpu import FakeMachine, Gpu

from torch_device_magic.advice import profile_rules
from torch_device_magic.advice.profile_rules import Advice, Setting, advise
from torch_device_magic.kineto.analysis import analyse
from torch_device_magic.kineto.events import Event


def profile(ip, line: str, cell: str):
    return ip.run_cell(f"%%profile -o {line}\n{cell}").result


def rules(advice: list[Advice]) -> list[str]:
    return [a.rule for a in advice]


@pytest.fixture
def threads():
    """The test may change torch's threads: put them back."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


# --- the CPU rules, on real cells -----------------------------------------------------------


DEMO_LINE = "rows = [torch.randn(8) for _ in range(2000)]"


def test_a_loop_of_tiny_ops_is_advised_one_batched_call(ip, capsys):
    ip.run_cell(f"%%profile\n{DEMO_LINE}\nsampled = torch.stack(rows)")
    out = capsys.readouterr().out
    assert "advice" in out and "line 1 ran 1 time (2,002 iterations of its loop" in out
    assert "2,000 calls of aten::randn" in out
    assert "one batched call (torch.randn(2000, 8), not torch.randn(8) 2,000 times)" in out
    assert ip.user_ns["sampled"].shape == (2000, 8)
    report = profile(ip, "", f"{DEMO_LINE}\nsampled = torch.stack(rows)")
    [tiny] = [a for a in report.advice if a.rule == "tiny ops"]
    assert tiny.line == "1" and tiny.threshold == profile_rules.TINY_SHARE
    assert tiny.figure > tiny.threshold and f"{tiny.figure:.0%} of the wall" in tiny.text


def test_one_batched_call_gets_no_tiny_ops_advice(ip, capsys, monkeypatch):
    monkeypatch.setattr(profile_rules, "cores", torch.get_num_threads)  # no threads advice
    report = profile(ip, "", "sampled = torch.randn(2000, 8)\nrows = list(sampled)")
    assert "tiny ops" not in rules(report.advice)
    ip.run_cell("%%profile\nsampled = torch.randn(2000, 8) @ torch.randn(8, 8)")
    assert "advice" not in capsys.readouterr().out  # nothing crosses: no section


MAKEMORE_4 = """parameters = [torch.randn(8, 8) for _ in range(7)]
for p in parameters:
    p.requires_grad = True
model = torch.nn.Linear(8, 1)
xx, yy = torch.randn(64, 8), torch.randn(64, 1)
{step}for i in range(2000):
    y_pred = {forward}
    loss = ((y_pred - yy) ** 2).mean()"""


@pytest.mark.parametrize("step, forward", [
    ("", "model(xx)"),
    ("def step():\n    return model(xx)\n", "step()"),  # its line runs under line 8's
], ids=["in the loop", "in a function the loop calls"])
def test_a_line_run_once_a_training_step_after_a_short_loop_gets_no_tiny_ops_advice(
        ip, step, forward):
    """makemore part 4's shape (issue 29, points 14 and 16): a 7-step loop first, then
    2,000 training steps whose forward and loss run once a step, each on the last step's
    weights: sequential work, set against the 2,000 steps of its own loop."""
    report = profile(ip, "", MAKEMORE_4.format(step=step, forward=forward))
    assert [(loop.line, loop.steps) for loop in report.loops] == [
        ("2", [7]), ("8" if step else "6", [2000])]
    assert "tiny ops" not in rules(report.advice)


def _stepped(body: list[tuple[int, str, str | None, int]], steps: int,
             header: tuple[int, str] = (1, "for step in range(steps):"),
             c: Capture | None = None) -> tuple[Capture, float]:
    """A cell's outer loop (its `header`'s line and code) of `steps` steps, each running
    `body` in order: (line, code, the op it calls or None, its ns, and the op's ns where
    not all but 20 of them); after what `c` holds where given. The capture and its wall."""
    c = c or Capture()
    t = max((e.end_ns for e in c.events), default=0)
    c.loops.append((range(header[0], max(n for n, *_ in body) + 1), steps))
    for _ in range(steps + 1):  # the header's last check ends the loop
        c.line(*header, t, t + 100)
        t += 100
        if _ == steps:
            break
        for n, code, op, ns, *op_ns in body:
            c.line(n, code, t, t + ns)
            if op is not None:
                c.events.append(Event(op, "op", t + 10, t + 10 + (op_ns or [ns - 20])[0]))
            t += ns
    return c, t / 1e9


def _inner(code: str, op: str, n: int = 17, ns: int = 10_000, at: int = 2,
           op_ns: int | None = None) -> list:
    """An inner loop (its header on line `at`) over `n` items whose body (the next line)
    is `code`, its op taking `op_ns` of the line's `ns` (all but 20 by default)."""
    header = (at, "for p in parameters:", None, 200)
    return [header, (at + 1, code, op, ns, op_ns or ns - 20)] * n + [header]


def _tiny(body: list, steps: int) -> list[Advice]:
    c, wall = _stepped(body, steps)
    return [a for a in c.advise(wall_s=wall) if a.rule == "tiny ops"]


def test_a_parameter_update_in_a_loop_is_advised_foreach():
    [tiny] = _tiny(_inner("p.data += -0.1 * p.grad", "aten::mul"), 100)
    assert tiny.line == "3" and "line 3 ran 1,700 times: 1,700 calls of aten::mul" in tiny.text
    assert "foreach=True" in tiny.text and "torch._foreach_add_" in tiny.text
    assert "torch.randn" not in tiny.text


def test_indexing_in_a_loop_is_advised_one_gather():
    [tiny] = _tiny(_inner("dC[ix[k, j]] += demb[k, j]", "aten::select"), 100)
    assert "index once with a tensor of all the indices" in tiny.text


def test_a_line_of_unknown_kind_is_said_slow_without_an_example():
    [tiny] = _tiny(_inner("out.append(torch.tanh(p))", "aten::tanh"), 100)
    assert tiny.text.endswith("do the work in fewer, larger calls")


def test_an_op_whose_calls_take_the_bound_is_work_not_overhead_and_below_it_is_advised():
    at = int(profile_rules.TINY_CALL_S * 1e9)
    line = "out.append(torch.tanh(p))"
    assert _tiny(_inner(line, "aten::tanh", ns=at + 10_000, op_ns=at), 100) == []
    assert _tiny(_inner(line, "aten::tanh", ns=at + 10_000, op_ns=at - 1), 100)


def test_a_busy_machine_neither_hides_tiny_ops_nor_makes_work_look_tiny():
    """The bound is on the op's calls (their median), not on the line's wall a call: a
    machine busy with other work stretched torch.randn(8)'s line from 6 to 34-50 µs a
    call and a 64x64 matmul's from 12 to 100-830 µs, while their ops' median calls read
    2 and 18-21 µs; a 128x128 matmul's read 30-38 µs, busy or not (2 cores, measured)."""
    line = "out.append(torch.randn(8))"
    [tiny] = _tiny(_inner(line, "aten::randn", ns=500_000, op_ns=2_000), 100)
    assert "1,700 calls of aten::randn at 500 µs a call (2 µs in the op)" in tiny.text
    matmul = "out.append(w @ w)"  # 128x128: work, on an idle machine
    assert _tiny(_inner(matmul, "aten::matmul", ns=40_000, op_ns=30_000), 100) == []


def test_a_line_of_small_selects_around_big_matmuls_is_work():
    """The op the line spends most in decides, not the most called one: `x[i] @ w` calls
    aten::select as often as aten::matmul, but the matmul's 600 µs a call are work."""
    line = "outs = [x[i] @ w for i in range(1500)]"
    body = [(2, line, "aten::select", 2_000), (2, line, "aten::matmul", 600_000)]
    assert _tiny(body, 1500) == []


def test_a_comprehension_counts_the_statements_runs_not_its_iterations():
    line = "ud.append([((lr * p.grad).std() / p.data.std()).log10().item() for p in parameters])"
    body = [(2, line, "aten::std", 1_000)] * 21 + [(3, "i += 1", None, 100)]
    [tiny] = _tiny(body, 1001)
    assert "line 2 ran 1,001 times (21,021 iterations of its loop or comprehension)" in tiny.text
    assert "21,021 calls of aten::std" in tiny.text


@pytest.mark.parametrize("body", [
    _inner("x = layer(x)", "aten::linear"),  # 17 layers in sequence, each on the last's output
    [(2, "y_pred = model(xx)", "aten::linear", 20_000),  # a full-batch step: once a step
     (3, "loss = ((y_pred - yy) ** 2).mean()", "aten::mean", 2_000)],
], ids=["a chain of layers", "a step of gradient descent"])
def test_sequential_work_gets_no_tiny_ops_advice(body):
    assert _tiny(body, 2000 if len(body) == 2 else 100) == []


def test_each_line_is_set_against_the_steps_of_its_own_loop():
    """makemore part 4's shape: 7 parameters made trainable in a loop, then the training
    loop, whose full-batch step runs once a step and whose inner loop indexes."""
    c, _ = _stepped([(2, "p.requires_grad = True", None, 200)], 7,
                    header=(1, "for p in parameters:"))
    c, wall = _stepped([(4, "y_pred = model(xx)", "aten::linear", 60_000),
                        *_inner("dC[ix[k, j]] += demb[k, j]", "aten::select", n=4,
                                ns=5_000, at=5)],
                       1000, header=(3, "for i in range(1000):"), c=c)
    assert c.loops == [(range(1, 3), 7), (range(3, 7), 1000)]
    [tiny] = [a for a in c.advise(wall_s=wall) if a.rule == "tiny ops"]
    assert tiny.line == "6" and "line 6 ran 4,000 times" in tiny.text  # 4 a step: advised
    assert "index once with a tensor of all the indices" in tiny.text


LOADER = """from torch.utils.data import DataLoader, Dataset
class Slow(Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        return torch.randn(64, 64) @ torch.randn(64, 64)
loader = DataLoader(Slow(), batch_size=4{workers})
total = 0.0
for batch in loader:
    total += float(batch.sum())"""


def test_a_loader_in_the_cells_process_is_advised_workers(ip):
    report = profile(ip, "--steps 0", LOADER.format(workers=""))
    [pipe] = [a for a in report.advice if a.rule == "input pipeline"]
    assert pipe.line == "9" and pipe.figure > profile_rules.LOADER_SHARE
    assert f"num_workers={max(profile_rules.cores() - 1, 1)}" in pipe.text
    assert "pin_memory" not in pipe.text  # no CUDA device here
    assert isinstance(ip.user_ns["total"], float)


def test_a_loader_with_workers_is_not_advised(ip):
    report = profile(ip, "--steps 0", LOADER.format(workers=", num_workers=1"))
    assert "input pipeline" not in rules(report.advice)


def _loader_events(next_ns: int) -> tuple[list[Event], dict[str, tuple[str, str]]]:
    """A loop line whose DataLoader __next__ took `next_ns` of a 1 ms wall."""
    events = [Event("tdm:In[1] 2: for batch in loader:", "line", 0, 1_000_000),
              Event("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "op",
                    10, 10 + next_ns)]
    return events, {events[0].name: ("2", "for batch in loader:")}


def test_a_loader_under_its_share_of_the_wall_is_not_advised():
    events, names = _loader_events(40_000)  # 4%: under tb's 5%
    advice = advise(events, analyse(events, names), names, Setting(1e-3, cores=4))
    assert "input pipeline" not in rules(advice)


def test_with_a_cuda_device_the_loader_advice_adds_pinned_copies():
    events, names = _loader_events(500_000)
    advice = advise(events, analyse(events, names), names, Setting(1e-3, cores=4, cuda=True))
    [pipe] = [a for a in advice if a.rule == "input pipeline"]
    assert pipe.line == "2" and "num_workers=3 (4 cores)" in pipe.text
    assert "pin_memory=True with .to(device, non_blocking=True)" in pipe.text


def test_a_fault_in_a_rule_leaves_the_profile_and_says_so(ip, monkeypatch):
    def broken(facts):
        raise ZeroDivisionError("a rule's own bug")

    monkeypatch.setattr(profile_rules, "RULES", (broken,))
    report = profile(ip, "", "y = torch.ones(3) + 1")
    assert report.advice == [] and report.lines and ip.user_ns["y"].tolist() == [2.0] * 3
    assert any(n.startswith("the advice could not be made: ") for n in report.notes)


MATMULS = "for _ in range(4):\n    y = torch.randn(400, 400) @ torch.randn(400, 400)"


def test_cpu_work_on_few_threads_is_advised_the_cores(ip, threads, monkeypatch):
    monkeypatch.setattr(profile_rules, "cores", lambda: 8)
    ip.run_cell("torch.set_num_threads(1)")
    [cpu] = [a for a in profile(ip, "", MATMULS).advice if a.rule == "CPU threads"]
    assert (cpu.figure, cpu.threshold) == (1, 8)
    assert "on 1 thread, far below the 8 cores" in cpu.text
    assert "torch.set_num_threads(8)" in cpu.text
    assert torch.get_num_threads() == 1  # advised, not changed


def test_cpu_work_on_more_threads_than_cores_is_advised(ip, threads, monkeypatch):
    monkeypatch.setattr(profile_rules, "cores", lambda: 1)
    ip.run_cell("torch.set_num_threads(2)")
    [cpu] = [a for a in profile(ip, "", MATMULS).advice if a.rule == "CPU threads"]
    assert "on 2 threads, above the 1 core" in cpu.text


def test_threads_matching_the_cores_are_not_advised(ip, threads, monkeypatch):
    monkeypatch.setattr(profile_rules, "cores", lambda: threads)
    assert "CPU threads" not in rules(profile(ip, "", MATMULS).advice)


# --- the GPU rules, on events shaped like a CUDA capture's ---------------------------------


class Capture:
    """Events as from_kineto reads them from a CUDA capture: a line range, the op, its
    cudaLaunchKernel (correlation shared with its kernel; linked to the op) and the kernel."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.names: dict[str, tuple[str, str]] = {}
        self.loops: list[tuple[range, int]] = []  # the cell's outer loops: lines, steps
        self._id = 0

    def line(self, n: int, code: str, start: int, end: int) -> None:
        name = f"tdm:In[1] {n}: {code}"
        self.names[name] = (str(n), code)
        self.events.append(Event(name, "line", start, end))

    def launch(self, op: str, kernel: str, start: int, launch_ns: int, kernel_ns: int,
               shapes: tuple = ((64, 64), (64, 64)), parent: str | None = None,
               dtypes: tuple = ()) -> None:
        self._id += 1
        op_id, cupti = self._id, 100_000 + self._id
        end = start + launch_ns + 2
        if parent is not None:
            self.events.append(Event(parent, "op", start, end + 1, shapes=shapes))
        self.events += [
            Event(op, "op", start + 1, end, correlation=op_id, shapes=shapes,
                  **({"dtypes": dtypes} if dtypes else {})),
            Event("cudaLaunchKernel", "runtime", start + 1, start + 1 + launch_ns,
                  correlation=cupti, linked=op_id),
            Event(kernel, "kernel", start + launch_ns, start + launch_ns + kernel_ns,
                  correlation=cupti, linked=op_id),
        ]

    def advise(self, **setting) -> list[Advice]:
        a = analyse(self.events, self.names, device_in_use=True)
        return advise(self.events, a, self.names, Setting(cuda=True, loops=self.loops,
                                                          **setting))


def _loop(kernel_ns: int, launch_ns: int = 5_000, period: int = 100_000,
          kernel: str = "ampere_sgemm_64x64_nn") -> Capture:
    c = Capture()
    for i in range(10):
        t = i * period
        c.line(3, "y = model(x)", t, t + launch_ns + 3)
        c.line(4, "log.append(y.shape)", t + launch_ns + 3, t + period)
        c.launch("aten::mm", kernel, t, launch_ns, kernel_ns, parent="aten::matmul")
    return c


def test_a_host_bound_device_is_advised_bigger_batches():
    [wait] = [a for a in _loop(20_000).advise(wall_s=1e-3) if a.rule.startswith("device")]
    assert wait.rule == "device waits (host)" and wait.line == "4"  # the line the host ran
    assert "most while line 4 ran" in wait.text
    assert wait.figure == pytest.approx(0.2) and wait.threshold == profile_rules.DEVICE_BUSY
    assert "busy 20% of the wall (under 50%)" in wait.text and "bigger batch" in wait.text


def test_a_launch_bound_device_is_advised_compile_or_graphs():
    [wait] = [a for a in _loop(2_000, period=10_000).advise(wall_s=1e-4)
              if a.rule.startswith("device")]
    assert wait.rule == "device waits (launch)" and wait.line == "3"
    assert "10 of 10 kernels on line 3 ran shorter than their launch" in wait.text
    assert "torch.compile or CUDA graphs" in wait.text


def test_a_sync_bound_device_is_advised_to_keep_values_on_it():
    c = _loop(20_000)
    for i in range(3):  # a loop line that reads a value each time
        t = 1_000_000 + 100 * i
        c.line(5, "s += y.sum().item()", t, t + 100)
        c.events += [
            Event("aten::item", "op", t + 10, t + 90, correlation=50 + i),
            Event("aten::_local_scalar_dense", "op", t + 20, t + 80, correlation=60 + i),
            Event("cudaStreamSynchronize", "runtime", t + 40, t + 70, linked=60 + i),
            Event("Memcpy DtoH (Device -> Pageable)", "memcpy", t + 30, t + 40,
                  linked=60 + i, nbytes=4),
        ]
    [wait] = [a for a in c.advise(wall_s=2e-3) if a.rule.startswith("device")]
    assert wait.rule == "device waits (sync)"
    assert ".item() 3 times on line 5" in wait.text and "on the device until the end" in wait.text


def test_boolean_mask_indexing_in_a_loop_is_a_sync_wait():
    c = _loop(20_000)
    for i in range(3):  # x[x > 0]: aten::index syncs in its nonzero to size the result
        t = 1_000_000 + 100 * i
        c.line(6, "pos = y[y > 0]", t, t + 100)
        c.events += [
            Event("aten::index", "op", t + 5, t + 95, correlation=80 + i),
            Event("aten::nonzero", "op", t + 10, t + 90, correlation=90 + i),
            Event("cudaMemcpyAsync", "runtime", t + 30, t + 40, linked=90 + i),
            Event("cudaStreamSynchronize", "runtime", t + 40, t + 70, linked=90 + i),
        ]
    [wait] = [a for a in c.advise(wall_s=2e-3) if a.rule.startswith("device")]
    assert "boolean-mask indexing 3 times on line 6" in wait.text


def test_a_busy_device_is_not_advised_about_waits():
    assert not [a for a in _loop(90_000).advise(wall_s=1e-3) if a.rule.startswith("device")]


def test_fp32_matmuls_without_tensor_cores_are_advised_autocast():
    [tc] = [a for a in _loop(90_000).advise(wall_s=1e-3, capability=(8, 0))
            if a.rule == "tensor cores"]
    assert tc.line == "3" and tc.figure == 10
    assert "10 matmul/conv kernels on line 3 ran in fp32 without tensor cores" in tc.text
    assert "capability 8.0" in tc.text and "set_float32_matmul_precision('high')" in tc.text


def test_tensor_core_kernels_or_an_older_device_are_not_advised_autocast():
    bf16 = _loop(90_000, kernel="sm80_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x32")
    assert "tensor cores" not in rules(bf16.advise(wall_s=1e-3, capability=(8, 0)))
    assert "tensor cores" not in rules(_loop(90_000).advise(wall_s=1e-3, capability=(6, 1)))


GiB = 2**30


def test_a_peak_near_the_devices_memory_is_advised():
    c = _loop(90_000)
    [mem] = [a for a in c.advise(wall_s=1e-3, peak_bytes=76 * GiB, total_memory=80 * GiB,
                                 reserved_bytes=78 * GiB) if a.rule == "memory"]
    assert mem.figure == pytest.approx(0.95) and mem.threshold == profile_rules.NEAR_CAPACITY
    assert "95% of the device's 80.0 GiB (at 90% or more)" in mem.text
    assert "checkpointing" in mem.text and "expandable_segments" not in mem.text
    [mem] = [a for a in c.advise(wall_s=1e-3, peak_bytes=50 * GiB, total_memory=52 * GiB,
                                 reserved_bytes=80 * GiB) if a.rule == "memory"]
    assert "expandable_segments:True" in mem.text  # reserved far above allocated
    [mem] = [a for a in c.advise(wall_s=1e-3, peak_bytes=76 * GiB, total_memory=80 * GiB,
                                 largest=("2", 60 * GiB, "h = model(x)")) if a.rule == "memory"]
    assert mem.line == "2"  # --memory: the line whose allocation made the peak
    assert mem.text.endswith("the largest allocation: line 2 (60.0 GiB): h = model(x)")


def test_a_peak_well_under_the_devices_memory_is_not_advised():
    advice = _loop(90_000).advise(wall_s=1e-3, peak_bytes=40 * GiB, total_memory=80 * GiB)
    assert "memory" not in rules(advice)


def _copies(kind: str) -> Capture:
    c = _loop(90_000)
    for i in range(2):
        t = 2_000_000 + i * 10_000
        c.line(2, "x = batch.to('cuda')", t, t + 10_000)
        c.events += [
            Event("aten::copy_", "op", t + 10, t + 9_000, correlation=70 + i),
            Event(f"Memcpy HtoD ({kind} -> Device)", "memcpy", t + 100, t + 8_100,
                  linked=70 + i, nbytes=2 * 2**20),
        ]
    return c


def test_pageable_copies_are_advised_pinned_memory():
    [copy] = [a for a in _copies("Pageable").advise(wall_s=3e-3) if a.rule == "pageable copies"]
    assert copy.line == "2" and copy.figure == 4 * 2**20
    assert "2 host-to-device copies on line 2 of 4.0 MiB from pageable memory took 16" in copy.text
    assert ".pin_memory()" in copy.text and "non_blocking=True" in copy.text


def test_pinned_copies_are_not_advised():
    assert "pageable copies" not in rules(_copies("Pinned").advise(wall_s=3e-3))


def _convs(shapes: list[tuple]) -> Capture:
    c = Capture()
    for i, s in enumerate(shapes):
        t = i * 100_000
        c.line(4, "out = net(images)", t, t + 100_000)
        c.launch("aten::cudnn_convolution", "cudnn_infer_sm80_xmma_fprop_f16", t, 5_000, 80_000,
                 shapes=s, parent="aten::convolution")
    return c


FIXED = [((32, 3, 64, 64), (16, 3, 3, 3))] * 4


def test_fixed_shape_convolutions_without_autotuning_are_advised_benchmark():
    [cudnn] = [a for a in _convs(FIXED).advise(wall_s=4e-4) if a.rule == "cuDNN autotuning"]
    assert cudnn.line == "4" and "4 convolutions on line 4 of fixed shapes" in cudnn.text
    assert "torch.backends.cudnn.benchmark = True" in cudnn.text


def test_autotuning_on_or_changing_shapes_are_not_advised_benchmark():
    assert "cuDNN autotuning" not in rules(_convs(FIXED).advise(wall_s=4e-4,
                                                                  cudnn_benchmark=True))
    changing = [((n, 3, 64, 64), (16, 3, 3, 3)) for n in (1, 2, 3, 4)]
    assert "cuDNN autotuning" not in rules(_convs(changing).advise(wall_s=4e-4))


# --- the GPU rules on real cells (scripts/gpu-check runs them) --------------------------------


@pytest.fixture
def on_gpu(ip):
    """x on the GPU before the capture (CUDA up: the capture records it)."""
    ip.run_cell("x = torch.randn(1024, 1024, device='cuda'); torch.cuda.synchronize()")
    benchmark = torch.backends.cudnn.benchmark
    yield ip
    torch.backends.cudnn.benchmark = benchmark


def gpu_rules(ip, cell: str) -> dict[str, Advice]:
    return {a.rule: a for a in profile(ip, "--steps 0", cell).advice}


@pytest.mark.cuda
def test_on_a_gpu_the_device_waits_for_the_host_line(on_gpu):
    got = gpu_rules(on_gpu, "for _ in range(20):\n    y = x @ x\n"
                            "    s = sum(i * i for i in range(20000))")
    assert got["device waits (host)"].line == "3"
    assert "device waits (host)" not in gpu_rules(on_gpu, "for _ in range(20):\n    y = x @ x")


@pytest.mark.cuda
def test_on_a_gpu_tiny_kernels_wait_for_their_launches(on_gpu):
    got = gpu_rules(on_gpu, "t = torch.ones(16, device='cuda')\nfor _ in range(300):\n"
                            "    t = t + 1")
    assert got["device waits (launch)"].line == "3"


@pytest.mark.cuda
def test_on_a_gpu_an_item_in_a_loop_is_a_sync_wait(on_gpu):
    on_gpu.run_cell("v = torch.randn(64, 64, device='cuda')")
    got = gpu_rules(on_gpu, "for _ in range(50):\n    s = (v @ v).sum().item()")
    assert ".item() 50 times on line 2" in got["device waits (sync)"].text


@pytest.mark.cuda
def test_on_a_gpu_a_mask_in_a_loop_is_a_sync_wait(on_gpu):
    on_gpu.run_cell("v = torch.randn(64, 64, device='cuda')")
    got = gpu_rules(on_gpu, "for _ in range(50):\n    p = v[v > 0]")
    assert "boolean-mask indexing 50 times on line 2" in got["device waits (sync)"].text


@pytest.mark.cuda
def test_on_a_gpu_fp32_matmuls_are_advised_tensor_cores(on_gpu):
    if torch.cuda.get_device_capability() < (7, 0):
        pytest.skip("no tensor cores on this device")
    assert gpu_rules(on_gpu, "for _ in range(3):\n    y = x @ x")["tensor cores"].line == "2"
    quiet = gpu_rules(on_gpu, "with torch.autocast('cuda', dtype=torch.bfloat16):\n"
                              "    for _ in range(3):\n        y = x @ x")
    assert "tensor cores" not in quiet


@pytest.mark.cuda
def test_on_a_gpu_half_precision_and_tf32_are_not_advised_tensor_cores(on_gpu):
    if torch.cuda.get_device_capability() < (7, 0):
        pytest.skip("no tensor cores on this device")
    on_gpu.run_cell("h = x.half()\nb = x.bfloat16()\nconv = torch.nn.Conv2d(3, 16, 3).cuda()\n"
                    "imgs = torch.randn(8, 3, 64, 64, device='cuda')")
    autocast = ("for _ in range(3):\n    with torch.autocast('cuda', dtype=torch.bfloat16):\n"
                "        y = x @ x")
    for cell in ("for _ in range(3):\n    y = h @ h", "for _ in range(3):\n    y = b @ b",
                 autocast):
        assert "tensor cores" not in gpu_rules(on_gpu, cell)
    cudnn = torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = True  # torch's default
        assert "tensor cores" not in gpu_rules(on_gpu, "for _ in range(3):\n    y = conv(imgs)")
        torch.backends.cudnn.allow_tf32 = False
        got = gpu_rules(on_gpu, "for _ in range(3):\n    y = conv(imgs)")["tensor cores"]
        assert "torch.backends.cudnn.allow_tf32 = True" in got.text
    finally:
        torch.backends.cudnn.allow_tf32 = cudnn


@pytest.mark.cuda
def test_on_a_gpu_the_profilers_own_rows_are_no_ops(on_gpu):
    report = profile(on_gpu, "--steps 0 --top 100",
                     "b = x.bfloat16()\nfor _ in range(3):\n    y = (b @ b).float().sum().item()")
    names = {r.name for r in report.analysis.ops} | {k.name for k in report.analysis.kernels}
    assert not names & {"Activity Buffer Request", "INVALID", "Lazy Function Loading",
                        "cuLaunchKernelEx"}
    assert report.analysis.copies and report.analysis.copies_unsized == 0  # .item()'s sized


@pytest.mark.cuda
def test_on_a_gpu_a_peak_near_capacity_is_advised(on_gpu):
    total = torch.cuda.get_device_properties(0).total_memory
    free, _ = torch.cuda.mem_get_info()
    size = int(total * 0.92) - torch.cuda.memory_allocated()
    if size > free - 2**28:
        pytest.skip("not enough free device memory to reach 92%")
    cell = f"y = x @ x\nbig = torch.empty({size}, dtype=torch.uint8, device='cuda')\ndel big"
    got = gpu_rules(on_gpu, cell)
    assert got["memory"].figure > profile_rules.NEAR_CAPACITY
    [mem] = [a for a in profile(on_gpu, "--memory", cell).advice if a.rule == "memory"]
    assert mem.line == "2" and "the largest allocation: line 2" in mem.text
    torch.cuda.empty_cache()
    assert "memory" not in gpu_rules(on_gpu, "y = x @ x")


@pytest.mark.cuda
def test_on_a_gpu_pageable_copies_are_advised_pinning(on_gpu):
    on_gpu.run_cell("h = torch.randn(2**20)\np = torch.randn(2**20).pin_memory()")
    got = gpu_rules(on_gpu, "a = h.to('cuda')\nb = h.to('cuda')")
    # 2 copies of 4 MiB: kineto 2.11 gives them 0 bytes, their copy_ ops the sizes
    assert got["pageable copies"].line == "1" and "8.0 MiB" in got["pageable copies"].text
    assert "pageable copies" not in gpu_rules(on_gpu, "a = p.to('cuda', non_blocking=True)\n"
                                                      "b = p.to('cuda', non_blocking=True)")


@pytest.mark.cuda
def test_on_a_gpu_fixed_convolutions_are_advised_autotuning(on_gpu):
    on_gpu.run_cell("conv = torch.nn.Conv2d(3, 16, 3).cuda()\n"
                    "imgs = torch.randn(8, 3, 64, 64, device='cuda')\n"
                    "torch.backends.cudnn.benchmark = False")
    cell = "for _ in range(4):\n    out = conv(imgs)"
    assert gpu_rules(on_gpu, cell)["cuDNN autotuning"].line == "2"
    on_gpu.run_cell("torch.backends.cudnn.benchmark = True")
    assert "cuDNN autotuning" not in gpu_rules(on_gpu, cell)


# --- torch.compile (rule 10), on real cells ------------------------------------------------


COMPILED = """import torch._dynamo
@torch.compile(backend="eager")
def double(t):
    return t * 2
double(torch.randn(3))"""


def test_a_recompile_in_the_cell_names_the_function_and_the_reason(ip):
    ip.run_cell(COMPILED)  # compiled once, before the profile
    [re] = [a for a in profile(ip, "", "double(torch.randn(3, 4))").advice
            if a.rule == "recompiles"]
    assert re.figure == 1
    assert "recompiled 1 time in this cell, last double (a cell's line 2)" in re.text
    assert "rank mismatch" in re.text and "mark_dynamic" in re.text


def test_the_docs_rule_10_example_is_what_the_rule_says(ip):
    """docs/profile.md's example line for rule 10 is this cell's advice, to the letter
    (its "(...)" stands for the end of the line)."""
    docs = (Path(__file__).parents[1] / "docs" / "profile.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| 10 | recompiles |"))
    example = row.rsplit("| `", 1)[1].removesuffix("` |")
    ip.run_cell(COMPILED)
    [re] = [a for a in profile(ip, "", "double(torch.randn(3, 4))").advice
            if a.rule == "recompiles"]
    said, _, _ = example.partition(" (...)")
    assert re.text.startswith(said)


def test_no_recompile_in_the_cell_is_not_advised(ip):
    ip.run_cell(COMPILED)
    ip.run_cell("double(torch.randn(3, 4))")  # recompiled before the profile
    assert "recompiles" not in rules(profile(ip, "", "double(torch.randn(3, 4))").advice)


# --- DataParallel (rule 8), on real cells on the fake GPUs -------------------------------


@pytest.fixture
def parallel(ip):
    """A DataParallel made before the fake GPUs are installed (on this CPU-only torch it
    keeps its module where it is and runs it as it is), held three ways."""
    dp = torch.nn.DataParallel(torch.nn.Linear(4, 4))
    ip.user_ns.update(dp=dp, net=torch.nn.Sequential(dp), plain=torch.nn.Linear(4, 4))
    ip.run_cell("def step():\n    return dp(torch.ones(2, 4))")
    return ip


@pytest.mark.parametrize("cell, name", [
    ("y = dp(torch.ones(2, 4))", "dp"),  # the cell reads it
    ("y = net(torch.ones(2, 4))", "net"),  # a module it reads holds one
    ("y = step()", "dp"),  # a function it calls reads it
])
def test_data_parallel_on_several_gpus_is_advised_ddp(parallel, monkeypatch, cell, name):
    machine = FakeMachine([Gpu(), Gpu()]).install(monkeypatch)
    machine.start_cuda()
    [dp] = [a for a in profile(parallel, "", cell).advice if a.rule == "DataParallel"]
    assert (dp.figure, dp.threshold) == (2, profile_rules.DATA_PARALLEL_GPUS)
    assert dp.text.startswith(f"{name} is a torch.nn.DataParallel on 2 GPUs")
    assert "DistributedDataParallel" in dp.text and parallel.user_ns["y"].shape == (2, 4)


@pytest.mark.parametrize("gpus, started, cell", [
    (1, True, "y = dp(torch.ones(2, 4))"),  # one GPU: nothing to gain
    (2, True, "y = plain(torch.ones(2, 4))"),  # no DataParallel read
    (2, False, "y = dp(torch.ones(2, 4))"),  # CUDA not started: its devices are not asked
])
def test_data_parallel_on_one_gpu_or_none_is_not_advised(parallel, monkeypatch, gpus, started,
                                                         cell):
    machine = FakeMachine([Gpu() for _ in range(gpus)]).install(monkeypatch)
    if started:
        machine.start_cuda()
    assert "DataParallel" not in rules(profile(parallel, "", cell).advice)
    assert started or machine.initialized is False
