"""`%%profile`'s MFU (issue 39): the counted FLOP/s over the device's dense peak for the
precision the counted ops ran in, the peak printed beside it. On the fake GPU: the cell
runs on the CPU (its ops, shapes and dtypes recorded as kineto records them), and each
counted op's kernel is added to the recorded events as a CUDA capture would have it."""

from __future__ import annotations

import pytest
import torch
from fakegpu import GIB, FakeMachine, Gpu
from test_profile_advice import Capture
from traitlets import TraitError

from torch_device_magic.advice.profile_rules import Setting, advise
from torch_device_magic.kineto import analysis as kineto_analysis
from torch_device_magic.kineto import names, peaks
from torch_device_magic.kineto.analysis import analyse
from torch_device_magic.kineto.events import Event
from torch_device_magic.kineto.flops import Work
from torch_device_magic.profile import reading

pytestmark = pytest.mark.once  # nothing here depends on IPython's version

H100_SXM = Gpu("NVIDIA H100 80GB HBM3", total=80 * GIB, capability=(9, 0), multiprocessors=132)
SETUP = ("import torch\n"
         "a = torch.randn(256, 128); b = torch.randn(128, 64)\n"
         "ah, bh = a.bfloat16(), b.bfloat16()")
MNK = 2 * 256 * 128 * 64


@pytest.fixture
def precision():
    """The test may change torch's fp32 matmul precision: put it back."""
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def on_gpu(ip, monkeypatch, gpu: Gpu, kernel: str = "nvjet_sm90_tst_128x64_64x8_1x2_h_bz_NNT"):
    """`gpu` behind torch.cuda, CUDA up, and each counted op's kernel (named `kernel`) in
    what %%profile reads, lasting as long as its op."""
    FakeMachine([gpu]).install(monkeypatch).start_cuda()
    real = reading.analyse

    def with_kernels(events, *args, **kwargs):
        ops = [e for e in events if e.kind == "op" and e.name in names.FLOP_OPS]
        events += [Event(kernel, "kernel", op.start_ns, op.end_ns, correlation=900_000 + i,
                         linked=op.correlation) for i, op in enumerate(ops)]
        return real(events, *args, **kwargs)

    monkeypatch.setattr(reading, "analyse", with_kernels)
    ip.run_cell(SETUP)
    return ip


def profiled(ip, cell: str, capsys=None):
    report = ip.run_cell(f"%%profile -o\n{cell}").result
    assert report is not None
    return report


def test_a_known_gpu_gets_its_dense_bf16_peak_beside_the_mfu(ip, monkeypatch, capsys):
    on_gpu(ip, monkeypatch, H100_SXM)
    report = profiled(ip, "y = ah @ bh")
    assert report.flops == MNK
    peak = report.peak_flops
    assert (peak.row, peak.dtype, peak.flops, peak.assumed) == ("H100 SXM", "bf16", 989.4e12,
                                                                 None)
    assert report.mfu == pytest.approx(report.flops_per_second / 989.4e12)
    ip.run_cell("%%profile\ny = ah @ bh")
    out = capsys.readouterr().out
    assert report.mfu > 0 and "| MFU " in out
    assert "of the H100 SXM's bf16 dense peak (989 TFLOP/s)" in out


@pytest.mark.parametrize(("share", "said"), [
    (0.384, "38%"), (0.0041, "0.41%"), (0.00003, "under 0.01%"), (1.2, "120%")])
def test_an_mfu_reads_as_a_percentage_however_small(share, said):
    assert peaks.percent(share) == said


def test_an_unknown_gpu_gets_the_rate_and_one_line_on_its_peak(ip, monkeypatch, capsys):
    on_gpu(ip, monkeypatch, Gpu("NVIDIA Made Up 9000", capability=(9, 0)))
    report = profiled(ip, "y = ah @ bh")
    assert report.mfu is None and report.peak_flops is None and report.flops_per_second
    ip.run_cell("%%profile\ny = ah @ bh")
    out = capsys.readouterr().out
    assert "the peak of NVIDIA Made Up 9000 is unknown; %config TorchDeviceMagics.peak_flops" \
        in out
    assert "MFU" not in out


@pytest.mark.usefixtures("precision")
@pytest.mark.parametrize(("setting", "dtype", "shown"), [
    ("highest", "fp32", "67 TFLOP/s"), ("high", "tf32", "495 TFLOP/s")])
def test_fp32_matmuls_are_held_against_tf32_where_torch_lets_them_use_it(
        ip, monkeypatch, capsys, setting, dtype, shown):
    on_gpu(ip, monkeypatch, H100_SXM, kernel="sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n")
    ip.run_cell(f"torch.set_float32_matmul_precision('{setting}')")
    report = profiled(ip, "y = a @ b")
    assert report.peak_flops.dtype == dtype
    ip.run_cell("%%profile\ny = a @ b")
    assert f"of the H100 SXM's {dtype} dense peak ({shown})" in capsys.readouterr().out


def test_tf32_is_read_at_the_cells_end(ip, monkeypatch, precision):
    on_gpu(ip, monkeypatch, H100_SXM)
    torch.set_float32_matmul_precision("highest")
    report = profiled(ip, "y = a @ b\ntorch.backends.cuda.matmul.allow_tf32 = True")
    assert report.peak_flops.dtype == "tf32"


def test_a_mig_slice_gets_its_share_of_the_peak(ip, monkeypatch, capsys):
    slice_ = Gpu("NVIDIA A100-SXM4-40GB MIG 1g.5gb", total=5 * GIB, mig=True, multiprocessors=14)
    on_gpu(ip, monkeypatch, slice_)
    report = profiled(ip, "y = ah @ bh")
    assert report.peak_flops.row == "A100" and report.peak_flops.share == pytest.approx(14 / 108)
    assert report.peak_flops.flops == pytest.approx(312e12 * 14 / 108)
    ip.run_cell("%%profile\ny = ah @ bh")
    assert ("of the MIG 1g.5gb slice's share (14 of its 108 multiprocessors) of the A100's "
            "bf16 dense peak (40.4 TFLOP/s)") in capsys.readouterr().out


def test_a_mig_slice_whose_multiprocessors_are_unknown_gets_no_mfu(ip, monkeypatch, capsys):
    on_gpu(ip, monkeypatch, Gpu("NVIDIA A100-SXM4-40GB MIG 1g.5gb", total=5 * GIB, mig=True))
    assert profiled(ip, "y = ah @ bh").mfu is None
    ip.run_cell("%%profile\ny = ah @ bh")
    assert "no MFU on a MIG slice (1g.5gb) whose multiprocessors could not be read" in \
        capsys.readouterr().out


def test_mixed_dtypes_are_held_against_most_flops_and_say_so(ip, monkeypatch, capsys):
    on_gpu(ip, monkeypatch, H100_SXM)
    cell = "y = ah @ bh\nz = ah @ bh\nw = a[:64] @ b"  # bf16: 2 MNK, fp32: MNK / 4
    report = profiled(ip, cell)
    assert report.peak_flops.dtype == "bf16"
    ip.run_cell(f"%%profile\n{cell}")
    assert "bf16 dense peak (989 TFLOP/s); 89% of the counted FLOPs were bf16, the rest fp32" \
        in capsys.readouterr().out


def test_your_peak_is_used_and_said_so(ip, monkeypatch, capsys):
    on_gpu(ip, monkeypatch, Gpu("NVIDIA Made Up 9000", capability=(9, 0)))
    ip.run_line_magic("config", "TorchDeviceMagics.peak_flops = {'bf16': 2e12}")
    report = profiled(ip, "y = ah @ bh")
    assert report.peak_flops == peaks.Peak("yours", "bf16", 2e12, "TorchDeviceMagics.peak_flops")
    assert report.mfu == pytest.approx(report.flops_per_second / 2e12)
    ip.run_cell("%%profile\ny = ah @ bh")
    assert "of your bf16 peak (2 TFLOP/s)" in capsys.readouterr().out
    ip.run_line_magic("config", "TorchDeviceMagics.peak_flops = 5e12")  # one figure: every dtype
    assert profiled(ip, "y = a @ b").peak_flops.flops == 5e12
    ip.run_line_magic("config", "TorchDeviceMagics.peak_flops = {'fp16': 2e12}")
    assert profiled(ip, "y = ah @ bh").mfu is None
    ip.run_cell("%%profile\ny = ah @ bh")
    assert "no MFU: TorchDeviceMagics.peak_flops gives no bf16 peak" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["-1", "0", "float('inf')", "'fast'", "{'bf17': 1e12}",
                                 "{'bf16': -2}", "{}", "True"])
def test_a_bad_peak_is_refused_in_one_sentence_and_changes_nothing(ip, caplog, bad):
    core = ip.magics_manager.registry["TorchDeviceMagics"]
    ip.run_line_magic("config", "TorchDeviceMagics.peak_flops = 3e12")
    ip.run_line_magic("config", f"TorchDeviceMagics.peak_flops = {bad}")
    assert core.peak_flops == 3e12
    assert "peak_flops must be a peak in FLOP/s above 0 (989e12), a dict of them" in caplog.text
    with pytest.raises(TraitError, match=r"with keys among fp32, tf32, bf16, fp16, fp8, or None"):
        core.peak_flops = eval(bad)
    ip.run_line_magic("reload_ext", "torch_device_magic")  # the shell's config kept it too
    assert ip.magics_manager.registry["TorchDeviceMagics"].peak_flops == 3e12


def test_the_cpu_gets_the_rate_and_never_an_mfu(ip, capsys):
    ip.run_cell(SETUP)
    ip.run_line_magic("config", "TorchDeviceMagics.peak_flops = 1e12")  # not even yours
    report = profiled(ip, "y = ah @ bh")
    assert report.flops == MNK and report.flops_per_second
    assert report.mfu is None and report.peak_flops is None
    ip.run_cell("%%profile\ny = ah @ bh")
    out = capsys.readouterr().out
    assert "GFLOP/s" in out or "MFLOP/s" in out
    assert "MFU" not in out and "dense peak" not in out and "peak_flops" not in out


def test_compiled_kernels_are_not_in_the_count_and_give_no_mfu(ip, monkeypatch, capsys):
    on_gpu(ip, monkeypatch, H100_SXM)
    real = reading.analyse

    def with_triton(events, *args, **kwargs):  # a compiled graph's kernel beside the matmul
        events.append(Event("triton_poi_fused_relu_0", "kernel", 10, 20, correlation=7))
        return real(events, *args, **kwargs)

    monkeypatch.setattr(reading, "analyse", with_triton)
    report = profiled(ip, "y = ah @ bh")
    assert report.flops == MNK and report.mfu is None and report.peak_flops is None
    ip.run_cell("%%profile\ny = ah @ bh")
    assert ("torch.compile's code ran (1 Triton kernel), whose own work is not in the count: "
            "no MFU") in capsys.readouterr().out


def test_a_compiled_graphs_calls_on_the_cpu_are_said_not_counted():
    ops = [Event("## Call CompiledFxGraph abc ##", "op", 0, 100),
           Event("aten::mm", "op", 10, 90, shapes=((4, 4), (4, 4)), dtypes=("float",) * 2)]
    a = analyse(ops)
    assert a.compiled_calls == 1 and a.work.flops == 2 * 4 * 4 * 4
    said = peaks.claim(a.work, 1e9, None, compiled_calls=a.compiled_calls)
    assert said.mfu is None
    assert said.text == ("torch.compile's code ran (1 call of its graphs), whose own work is "
                         "not in the count")
    assert kineto_analysis.COMPILED_CALLS in ops[0].name


# --- the table: which row a name is, and what it holds ------------------------------------


@pytest.mark.parametrize(("name", "sms", "memory", "row", "assumed"), [
    ("NVIDIA H100 80GB HBM3", 132, 80, "H100 SXM", False),
    ("NVIDIA H100 PCIe", 114, 80, "H100 PCIe", False),
    ("NVIDIA H100 NVL", 132, 94, "H100 NVL", False),
    ("NVIDIA H100", 114, 80, "H100 PCIe", True),  # a bare name: the multiprocessors say
    ("NVIDIA H100", 132, 94, "H100 NVL", True),
    ("NVIDIA H100", 132, 80, "H100 SXM", True),
    ("NVIDIA H100", None, None, None, False),  # cannot be told: no MFU
    ("NVIDIA H200", 132, 141, "H200 SXM", True),
    ("NVIDIA H200 NVL", 132, 141, "H200 NVL", False),
    ("NVIDIA GH200 480GB", 132, 96, None, False),  # not an H200
    ("NVIDIA A100-SXM4-40GB", 108, 40, "A100", False),
    ("NVIDIA A100 80GB PCIe", 108, 80, "A100", False),
    ("NVIDIA L4", 58, 23, "L4", False), ("NVIDIA L40S", 142, 45, "L40S", False),
    ("NVIDIA L40", 142, 45, "L40", False), ("NVIDIA A10", 72, 23, "A10", False),
    ("NVIDIA A10G", 80, 23, "A10", True), ("NVIDIA A40", 84, 45, "A40", False),
    ("Tesla T4", 40, 15, "T4", False), ("Tesla V100-SXM2-16GB", 80, 16, "V100 SXM2", False),
    ("Tesla V100-PCIE-32GB", 80, 32, "V100 PCIe", False),
    ("Tesla V100S-PCIE-32GB", 80, 32, "V100S PCIe", False),
    ("NVIDIA GeForce RTX 4090", 128, 24, "RTX 4090", False),
    ("NVIDIA GeForce RTX 3090", 82, 24, "RTX 3090", False),
    ("NVIDIA GeForce RTX 3090 Ti", 84, 24, None, False),
])
def test_each_name_finds_its_row_or_none(name, sms, memory, row, assumed):
    found, why, _ = peaks.lookup(peaks.Device(name, sms, memory and memory * GIB, (9, 0)))
    assert (found.name if found else None) == row
    assert bool(why) == assumed


def test_a_bare_h100_whose_form_cannot_be_told_claims_no_mfu():
    work = Work(flops=10**12, by_dtype={"c10::BFloat16": 10**12}, on_device=10**12)
    said = peaks.claim(work, 1e14, peaks.Device("NVIDIA H100", None, None, (9, 0)))
    assert said.mfu is None
    assert "no MFU on NVIDIA H100: its name does not say SXM, PCIe or NVL" in said.text
    assumed = peaks.claim(work, 1e14, peaks.Device("NVIDIA H100", 132, 80 * GIB, (9, 0)))
    assert assumed.peak.assumed == "132 multiprocessors and 80 GiB: the SXM form"
    assert assumed.text.endswith("; 132 multiprocessors and 80 GiB: the SXM form")


def test_gpus_without_bf16_or_tf32_have_no_such_row():
    for row in ("T4", "V100 SXM2", "V100 PCIe"):
        assert "bf16" not in peaks.ROWS[row].tflops and "tf32" not in peaks.ROWS[row].tflops
    work = Work(flops=10**12, by_dtype={"c10::BFloat16": 10**12}, on_device=10**12)
    said = peaks.claim(work, 1e12, peaks.Device("Tesla T4", 40, 15 * GIB, (7, 5)))
    assert said.mfu is None and "the T4 has no bf16 peak in the table" in said.text
    fp32 = Work(flops=10**12, by_dtype={"float": 10**12}, on_device=10**12)
    t4 = peaks.claim(fp32, 1e12, peaks.Device("Tesla T4", 40, 15 * GIB, (7, 5)),
                     tf32_matmul=True)  # no TF32 before Ampere, whatever torch allows
    assert t4.peak.dtype == "fp32" and t4.peak.flops == 8.1e12


def test_fp32_convolutions_follow_cudnns_tf32_switch():
    work = Work(flops=10**12, by_dtype={"float": 10**12}, conv_by_dtype={"float": 10**12},
                on_device=10**12)
    a100 = peaks.Device("NVIDIA A100-SXM4-80GB", 108, 80 * GIB, (8, 0))
    assert peaks.claim(work, 1e12, a100, tf32_conv=True).peak.dtype == "tf32"
    assert peaks.claim(work, 1e12, a100, tf32_conv=False).peak.dtype == "fp32"


# --- the advice: what bounds a low MFU, and what is left at a high one ---------------------


def _matmul_capture(kernel_ns: int, period: int, n: int = 10) -> Capture:
    c = Capture()
    for i in range(n):
        t = i * period
        c.line(2, "y = ah @ bh", t, t + period)
        c.launch("aten::mm", "nvjet_sm90_tst", t, 5_000, kernel_ns,
                 shapes=((4096, 4096), (4096, 4096)), dtypes=("c10::BFloat16",) * 2)
    return c


def _advise(c: Capture, wall_s: float, **setting) -> list:
    a = analyse(c.events, c.names, device_in_use=True)
    rate = a.work.flops / wall_s
    claim = peaks.claim(a.work, rate, peaks.Device("NVIDIA H100 80GB HBM3", 132, 80 * GIB,
                                                   (9, 0)))
    return [x for x in advise(c.events, a, c.names, Setting(wall_s, cuda=True, claim=claim,
                                                           capability=(9, 0), **setting))
            if x.rule == "MFU"]


def test_a_high_mfu_says_the_matmuls_are_near_the_limit():
    # 10 matmuls of 2 * 4096^3 = 137 GFLOP each in 1.5 ms of wall: 916 TFLOP/s, 93%
    c = _matmul_capture(kernel_ns=140_000, period=150_000)
    [said] = _advise(c, wall_s=1.5e-3)
    assert said.figure == pytest.approx(2 * 4096**3 * 10 / 1.5e-3 / 989.4e12)
    assert said.threshold == 0.6
    assert "at 60% or more: the matmuls are near the limit" in said.text
    assert "the rest of the cell (the device idle 7% of the wall" in said.text


def test_a_low_mfu_names_the_rule_that_bounds_it():
    # the same matmuls, the device idle between them: 9% MFU, the device busy 10%
    c = _matmul_capture(kernel_ns=150_000, period=1_500_000)
    [said] = _advise(c, wall_s=15e-3)
    assert said.threshold == 0.3 and said.figure < 0.3
    assert "while the counted ops' kernels took 100% of the device's busy time" in said.text
    assert "what bounds it is the 'device waits (host)' advice's (the device busy 10% of " \
        "the wall)" in said.text


def test_a_low_mfu_of_busy_slow_kernels_says_their_own_rate():
    c = _matmul_capture(kernel_ns=1_400_000, period=1_500_000)  # busy, but slow kernels
    [said] = _advise(c, wall_s=15e-3)
    assert "the counted kernels themselves ran at 98.2 TFLOP/s over their own time, 10% " \
        "of the peak" in said.text


def test_the_mfu_advice_is_quiet_where_it_does_not_apply():
    c = _matmul_capture(kernel_ns=140_000, period=300_000)  # 46%: neither low nor high
    assert _advise(c, wall_s=3e-3) == []
    c = _matmul_capture(kernel_ns=1_000, period=1_500_000)  # low, but the matmuls are little
    c.launch("aten::add", "elementwise_kernel", 20_000_000, 5_000, 10_000_000)  # of the device
    assert _advise(c, wall_s=30e-3) == []
    c = _matmul_capture(kernel_ns=140_000, period=150_000)
    a = analyse(c.events, c.names, device_in_use=True)  # no claim (the CPU, unknown GPU)
    assert [x for x in advise(c.events, a, c.names, Setting(1.5e-3, cuda=True))
            if x.rule == "MFU"] == []


# --- on a real GPU (scripts/gpu-check) -------------------------------------------------------


@pytest.mark.cuda
def test_on_a_gpu_a_large_bf16_matmul_loop_reads_30_to_100_percent_of_the_peak(ip):
    ip.run_cell("import torch\nx = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)"
                "\nfor _ in range(3):\n    y = x @ x\ntorch.cuda.synchronize()")  # cuBLAS loaded
    report = profiled(ip, "for _ in range(200):\n    y = x @ x\ntorch.cuda.synchronize()")
    assert report.flops == 200 * 2 * 8192**3
    if report.peak_flops is None:
        pytest.skip(f"no MFU on {torch.cuda.get_device_name()}: {report.claim.text}")
    assert report.peak_flops.dtype == "bf16"
    assert 0.30 <= report.mfu <= 1.0, report.claim.text


def test_the_docs_lines_are_what_the_code_says():
    bf16 = Work(flops=10**12, by_dtype={"c10::BFloat16": 10**12}, on_device=10**12)
    h100 = peaks.Device("NVIDIA H100 80GB HBM3", 132, 80 * GIB, (9, 0))
    assert peaks.claim(bf16, 0.38 * 989.4e12, h100).text == (
        "MFU 38% of the H100 SXM's bf16 dense peak (989 TFLOP/s)")
    mig = peaks.Device("NVIDIA H100 80GB HBM3 MIG 1g.10gb", 16, 10 * GIB, (9, 0))
    assert peaks.claim(bf16, 0.21 * 989.4e12 * 16 / 132, mig).text == (
        "MFU 21% of the MIG 1g.10gb slice's share (16 of its 132 multiprocessors) of the "
        "H100 SXM's bf16 dense peak (120 TFLOP/s)")
    mixed = Work(flops=9 * 10**11, by_dtype={"c10::BFloat16": 8 * 10**11, "float": 10**11},
                 on_device=9 * 10**11)
    assert peaks.claim(mixed, 0.12 * 989.4e12, h100).text == (
        "MFU 12% of the H100 SXM's bf16 dense peak (989 TFLOP/s); 89% of the counted FLOPs "
        "were bf16, the rest fp32")
    assert peaks.claim(bf16, 0.41 * 700e12, h100, yours={"bf16": 700e12}).text == (
        "MFU 41% of your bf16 peak (700 TFLOP/s)")
    assert peaks.claim(bf16, 0.6 * 989.4e12, h100, compiled_kernels=12).text == (
        "torch.compile's code ran (12 Triton kernels), whose own work is not in the count: "
        "no MFU")


def test_counted_work_on_the_cpu_beside_the_gpu_claims_no_mfu_past_one_percent():
    h100 = peaks.Device("NVIDIA H100 80GB HBM3", 132, 80 * GIB, (9, 0))
    bf16 = {"c10::BFloat16": 10**12}
    said = peaks.claim(Work(flops=10**12, by_dtype=bf16, on_device=9 * 10**11), 1e14, h100)
    assert said.mfu is None and said.text == "no MFU: 10% of the counted FLOPs ran on the CPU"
    a_metric = peaks.claim(Work(flops=10**12, by_dtype=bf16, on_device=10**12 - 10**9), 1e14,
                           h100)  # a small CPU matmul beside the GPU's: 0.1%
    assert a_metric.mfu == pytest.approx(1e14 / 989.4e12)
