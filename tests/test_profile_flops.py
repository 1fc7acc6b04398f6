"""`%%profile`'s FLOP count: exact against the arithmetic, within 5% of FlopCounterMode on a
training loop, per step under the steps window, and nothing said where nothing was counted."""

from __future__ import annotations

import pytest
from torch.utils.flop_counter import FlopCounterMode

from torch_device_magic.units import fmt_flops


def profiled(ip, cell: str, line: str = "-o --steps 0"):
    return ip.run_cell(f"%%profile {line}\n{cell}").result


SETUP = ("import torch\nimport torch.nn.functional as F\n"
         "a = torch.randn(64, 32); b = torch.randn(32, 16)\n"
         "A = torch.randn(3, 64, 32); B = torch.randn(3, 32, 16)\n"
         "x = torch.randn(2, 3, 17, 17); w = torch.randn(8, 3, 3, 3)\n"
         "wt = torch.randn(3, 4, 3, 3)\n"
         "q = torch.randn(2, 4, 16, 8)")
MNK = 2 * 64 * 32 * 16


@pytest.mark.parametrize(("cell", "flops"), [
    ("y = a @ b", MNK),
    ("y = torch.addmm(torch.zeros(16), a, b)", MNK),
    ("y = torch.nn.functional.linear(a, b.t(), torch.zeros(16))", MNK),
    ("y = torch.bmm(A, B)", 3 * MNK),
    ("y = torch.baddbmm(torch.zeros(3, 64, 16), A, B)", 3 * MNK),
    # out 8x8 (stride 2, padding 1): 2 * N * C_out * C_in * k * k * H_out * W_out
    ("y = F.conv2d(x, w, stride=2, padding=1)", 2 * 2 * 8 * 3 * 9 * 9 * 9),
    ("y = F.conv2d(x, w, padding=2, dilation=2)", 2 * 2 * 8 * 3 * 9 * 17 * 17),
    # transposed: over the input's points, 2 * N * H_in * W_in * prod(weight)
    ("y = F.conv_transpose2d(x, wt, stride=2)", 2 * 2 * 17 * 17 * 3 * 4 * 9),
    # attention: q @ k^T and p @ v, 2 * b * h * s * s * d each
    ("y = F.scaled_dot_product_attention(q, q, q)", 2 * (2 * 2 * 4 * 16 * 16 * 8)),
])
def test_each_counted_op_is_the_arithmetic_exactly(ip, cell, flops):
    ip.run_cell(SETUP)
    report = profiled(ip, cell)
    assert report.flops == flops
    assert report.flops_per_second == pytest.approx(flops / report.wall_s)


def test_a_small_cnns_training_loop_agrees_with_flop_counter_mode(ip):
    ip.run_cell(SETUP + "\nnn = torch.nn\n"
                "model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),"
                " nn.Conv2d(8, 4, 3, stride=2), nn.Flatten(), nn.LazyLinear(10))\n"
                "model(x)\nopt = torch.optim.SGD(model.parameters(), lr=0.01)")
    step = ("for _ in range(3):\n    opt.zero_grad()\n"
            "    loss = model(x).square().mean()\n    loss.backward()\n    opt.step()")
    report = profiled(ip, step)
    with FlopCounterMode(display=False) as counter:
        ip.run_cell(step)
    assert counter.get_total_flops() > 0
    assert report.flops == pytest.approx(counter.get_total_flops(), rel=0.05)
    rows = {r.name: r.flops for r in report.ops}
    assert rows.get("aten::convolution_backward", 0) > 0 or report.flops  # backward counted


def test_under_the_steps_window_a_steps_flops_and_the_recorded_rate_are_said(ip, capsys):
    ip.run_cell(SETUP)
    report = profiled(ip, "for i in range(40):\n    c = a @ b\n    e = c.relu()", "-o")
    assert report.full_steps == 5
    assert report.flops == 6 * MNK  # the six steps recorded, not 40
    assert report.flops_per_step == MNK
    assert report.flops_per_second == pytest.approx(report.flops / report.analysis.recorded_s)
    ip.run_cell("%%profile\nfor i in range(40):\n    c = a @ b\n    e = c.relu()")
    out = capsys.readouterr().out
    assert (f"{fmt_flops(MNK)} a step of the loop, {fmt_flops(6 * MNK)} in 6 matmuls "
            "recorded") in out
    assert "over the recorded wall" in out


def test_the_tables_give_the_ops_flops_and_the_lines_rate(ip, capsys):
    ip.run_cell(SETUP)
    ip.run_cell("%%profile\nc = a @ b\nd = c.relu()")
    out = capsys.readouterr().out
    assert f"{fmt_flops(MNK)} in 1 matmul, " in out
    mm = next(line for line in out.splitlines() if line.startswith("aten::mm "))
    assert fmt_flops(MNK) in mm
    relu = next(line for line in out.splitlines() if line.rstrip().endswith("d = c.relu()"))
    assert "FLOP" not in relu  # blank: no counted work
    report = profiled(ip, "c = a @ b\nd = c.relu()")
    line = next(r for r in report.lines if r.code == "c = a @ b")
    took = line.device_s or line.cpu_s
    assert line.flops == MNK and line.flops_per_second == pytest.approx(MNK / took)


def test_a_cell_without_counted_ops_shows_no_flop_figure(ip, capsys):
    ip.run_cell("%%profile\ny = (torch.ones(50) * 2 + 1).sum()")
    assert "FLOP" not in capsys.readouterr().out
    report = profiled(ip, "y = (torch.ones(50) * 2 + 1).sum()")
    assert report.flops == 0 and report.flops_per_second is None
    assert report.flops_per_step is None


def test_no_mfu_is_claimed_on_the_cpu(ip):
    ip.run_cell(SETUP)
    report = profiled(ip, "y = a @ b")
    assert report.flops == MNK and report.mfu is None and report.peak_flops is None


def test_no_dispatch_mode_runs_around_the_cell_a_compiled_function_included(ip, monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    entered = []
    real = TorchDispatchMode.__enter__

    def spy(self):
        entered.append(type(self).__name__)
        return real(self)

    monkeypatch.setattr(TorchDispatchMode, "__enter__", spy)
    ip.run_cell("import torch\ng = torch.compile(lambda t: (t @ t).relu(), backend='eager')\n"
                "t = torch.randn(8, 8)\ng(t)")
    entered.clear()  # what compiling entered, if anything
    report = profiled(ip, "y = g(t)\nz = t @ t")
    assert entered == []  # counted from the recorded ops and shapes: no FlopCounterMode
    assert report.flops == 2 * (2 * 8 * 8 * 8)


@pytest.mark.parametrize(("n", "per_second", "text"), [
    (6.7e8, False, "670 MFLOP"), (4.12e10, True, "41.2 GFLOP/s"), (65536, False, "65.5 kFLOP"),
    (999, False, "999 FLOP"), (1.5e15, True, "1.5 PFLOP/s")])
def test_flops_read_in_human_units(n, per_second, text):
    assert fmt_flops(n, per_second) == text


def test_a_lines_rate_is_over_its_device_time_where_the_device_was_recorded():
    from torch_device_magic.kineto.analysis import LineRow

    on_gpu = LineRow("2", "y = a @ b", hits=1, wall_s=0.010, cpu_s=0.004, device_s=0.002,
                     allocated_bytes=0, flops=10**9)
    assert on_gpu.flops_per_second == pytest.approx(5e11)  # the kernels' time, not the CPU's
    on_cpu = LineRow("2", "y = a @ b", 1, 0.010, 0.004, None, 0, flops=10**9)
    assert on_cpu.flops_per_second == pytest.approx(2.5e11)
    idle = LineRow("3", "z = y.relu()", 1, 0.010, 0.004, 0.001, 0)
    assert idle.flops_per_second is None  # blank: no counted work
