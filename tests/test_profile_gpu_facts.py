"""%%profile's tables and advice on what a real GPU gave (issue 28; one H200, torch
2.11.0+cu130, /work/shared/FACTS.md): the kernel names of each dtype, memcpy events
without a size, CUPTI's own rows, a cold first run, a peak near capacity. Each on events
shaped like that capture's, or on the fake CUDA machine; scripts/gpu-check runs the real
cells (tests/test_profile_advice.py's `cuda` tests)."""

from __future__ import annotations

import types

import pytest
import torch
from fakegpu import GIB, FakeMachine, Gpu
from test_profile_advice import Capture, profile, rules

from torch_device_magic.advice import profile_rules
from torch_device_magic.advice.notes import Advisor
from torch_device_magic.advice.profile_rules import Setting, advise, read_setting
from torch_device_magic.kineto.analysis import analyse
from torch_device_magic.kineto.events import Event, from_kineto
from torch_device_magic.profile.tables import ProfileReport

pytestmark = pytest.mark.once  # nothing here depends on IPython's version

FP32 = ("float", "float")

# --- rule 3: tensor cores, from what the op ran with; kernel names second ----------------

# the issue's table: (what ran, the op, its kernel on the H200, the inputs' dtypes, torch's
# TF32 settings, whether it lacked tensor cores)
ROWS = [
    ("fp32, default precision", "aten::mm",
     "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x64x8_stage3_warpsize2x2x1_ffma_aligna4",
     FP32, {}, True),
    ("nn.Linear, fp32", "aten::addmm",
     "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x64x8_stage3_warpsize2x2x1_ffma_aligna4",
     ("float",) * 3, {}, True),
    ("set_float32_matmul_precision('high')", "aten::mm",
     "sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize64x128x32_warpgroupsize1x1x1_execute",
     FP32, {"tf32_matmul": True}, False),
    ("autocast bf16, and bf16 tensors", "aten::mm", "nvjet_sm90_tst_128x64_64x8_1x2_h_bz_NNT",
     ("c10::BFloat16",) * 2, {}, False),
    ("fp16 tensors", "aten::mm", "nvjet_sm90_hsh_128x64_64x8_1x2_h_bz_NNT",
     ("c10::Half",) * 2, {}, False),
    ("conv2d fp32, cuDNN's TF32 on (the default)", "aten::cudnn_convolution",
     "sm80_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nchw_tilesize128x128x16",
     FP32, {"tf32_conv": True}, False),
    ("conv2d fp32, allow_tf32 = False", "aten::cudnn_convolution",
     "sm80_xmma_fprop_implicit_gemm_f32f32_f32f32_f32_nchwkcrs_nchw_tilesize128x128x8",
     FP32, {"tf32_conv": False}, True),
]


def _matmuls(op: str, kernel: str, dtypes: tuple[str, ...]) -> Capture:
    c = Capture()
    for i in range(4):
        t = i * 100_000
        c.line(2, "y = model(x)", t, t + 100_000)
        c.launch(op, kernel, t, 5_000, 90_000, dtypes=dtypes)
    return c


@pytest.mark.parametrize("what, op, kernel, dtypes, tf32, lacking", ROWS,
                         ids=[r[0] for r in ROWS])
def test_tensor_cores_are_decided_by_the_ops_dtypes_and_tf32(what, op, kernel, dtypes, tf32,
                                                             lacking):
    advice = _matmuls(op, kernel, dtypes).advise(wall_s=4e-4, capability=(9, 0), **tf32)
    got = [a for a in advice if a.rule == "tensor cores"]
    assert bool(got) == lacking
    if lacking:
        assert got[0].line == "2" and "4 matmul/conv kernels on line 2 ran in fp32" in got[0].text
        conv = "torch.backends.cudnn.allow_tf32 = True" in got[0].text
        assert conv == (op == "aten::cudnn_convolution")


@pytest.mark.parametrize("what, op, kernel, dtypes, tf32, lacking", ROWS,
                         ids=[r[0] for r in ROWS])
def test_without_recorded_dtypes_the_kernel_name_decides(what, op, kernel, dtypes, tf32,
                                                         lacking):
    # ffma says no tensor cores; nvjet and tf32 say tensor cores; an xmma fprop kernel of
    # f32f32 types says neither, so nothing is claimed
    advice = _matmuls(op, kernel, ()).advise(wall_s=4e-4, capability=(9, 0), **tf32)
    assert ("tensor cores" in rules(advice)) == ("ffma" in kernel)


def test_the_ops_inputs_come_before_the_kernels_name():
    # TF32 on for an fp32 matmul whose kernel reads ffma: torch's setting says it may use
    # them, so "turn TF32 on" would be no advice
    ffma = ROWS[0][2]
    advice = _matmuls("aten::mm", ffma, FP32).advise(wall_s=4e-4, capability=(9, 0),
                                                    tf32_matmul=True)
    assert "tensor cores" not in rules(advice)
    # float64 inputs say nothing of tensor cores: the name decides
    assert "tensor cores" in rules(_matmuls("aten::mm", ffma, ("double", "double")).advise(
        wall_s=4e-4, capability=(9, 0)))


def _autocast_matmuls(inner_kernel: str) -> Capture:
    """Four matmuls as torch.autocast runs them (a CPU capture under autocast has this
    nesting): the user's fp32 matmul casts its inputs to bf16 (aten::to, _to_copy,
    copy_, an elementwise kernel each), then calls a bf16 mm, whose GEMM kernel is the
    matmul's."""
    c = Capture()
    cast = "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>"
    for i in range(4):
        t = i * 100_000
        c.line(2, "y = model(x)", t, t + 100_000)
        c.events.append(Event("aten::matmul", "op", t + 1, t + 90_000, shapes=((64, 64),) * 2,
                              dtypes=FP32))
        for j in range(2):  # each input cast
            at = t + 10 + j * 1_000
            c.events += [Event("aten::to", "op", at, at + 900),
                         Event("aten::_to_copy", "op", at + 10, at + 890)]
            c.launch("aten::copy_", cast, at + 20, 500, 200, shapes=((64, 64),) * 2,
                     dtypes=("c10::BFloat16", "float"))
        c.launch("aten::mm", inner_kernel, t + 3_000, 5_000, 60_000,
                 dtypes=("c10::BFloat16",) * 2)
    return c


@pytest.mark.parametrize("tf32", [{}, {"tf32_matmul": True}])
def test_autocast_matmuls_are_not_advised_tensor_cores(tf32):
    # the outer matmul's inputs are fp32, but its kernels are the casts' and the bf16 mm's
    nvjet = ROWS[3][2]
    advice = _autocast_matmuls(nvjet).advise(wall_s=4e-4, capability=(9, 0), **tf32)
    assert "tensor cores" not in rules(advice)
    # without recorded dtypes the GEMM kernel's name still decides, the casts say nothing
    c = _autocast_matmuls(ROWS[0][2])  # an ffma GEMM: a matmul without tensor cores
    for e in c.events:
        if e.name == "aten::mm":
            e.dtypes = ()
    [got] = [a for a in c.advise(wall_s=4e-4, capability=(9, 0)) if a.rule == "tensor cores"]
    assert got.text.startswith("4 matmul/conv kernels on line 2 ran in fp32")


def test_from_kineto_reads_the_dtypes_of_matmuls_and_copies_only():
    bf16 = torch.ones(4, 4, dtype=torch.bfloat16)
    with torch.profiler.profile(record_shapes=True) as prof:
        bf16 @ bf16
        torch.ones(8).to(torch.float64)
    events = from_kineto(prof.profiler.kineto_results)
    [mm] = [e for e in events if e.name == "aten::mm"]
    assert mm.dtypes[:2] == ("c10::BFloat16", "c10::BFloat16")
    [copy] = [e for e in events if e.name == "aten::copy_"]
    assert copy.dtypes[:2] == ("double", "float") and copy.shapes[1] == (8,)
    assert [e.dtypes for e in events if e.name == "aten::ones"] == [()]  # not asked


@pytest.fixture
def tf32_settings():
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn


def test_the_setting_reads_torchs_tf32_switches(tf32_settings, monkeypatch):
    FakeMachine([Gpu("NVIDIA H200", capability=(9, 0))]).install(monkeypatch).start_cuda()
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True
    s = read_setting(1.0, True, None)
    assert (s.capability, s.tf32_matmul, s.tf32_conv) == ((9, 0), False, True)
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = False
    s = read_setting(1.0, True, None)
    assert (s.tf32_matmul, s.tf32_conv) == (True, False)


# --- rule 5 and the overview: a copy's size from the op that launched it ------------------


MiB = 2**20


def _h2d(kind: str, op: str = "aten::copy_", dtypes: tuple[str, ...] = ("float", "float")):
    """Two copies of 1 Mi floats, as torch 2.11 records them: nbytes 0, no metadata; the
    op that launched each recorded its shapes and dtypes."""
    c = _matmuls("aten::mm", ROWS[3][2], ROWS[3][3])
    for i in range(2):
        t = 1_000_000 + i * 10_000
        c.line(3, "xb = batch.to('cuda')", t, t + 10_000)
        shapes = ((2**20,), (2**20,), ()) if op == "aten::copy_" else ((2**20,),)
        c.events += [
            Event("aten::to", "op", t + 5, t + 9_500),
            Event(op, "op", t + 10, t + 9_000, correlation=70 + i, shapes=shapes,
                  dtypes=dtypes),
            Event("cudaMemcpyAsync", "runtime", t + 20, t + 8_000, correlation=900 + i,
                  linked=70 + i),
            Event(f"Memcpy HtoD ({kind} -> Device)", "memcpy", t + 100, t + 8_100,
                  correlation=900 + i, linked=70 + i),
        ]
    return c


def test_a_copy_without_a_size_takes_its_ops_shapes_and_dtypes():
    c = _h2d("Pageable")
    [copy] = [a for a in c.advise(wall_s=2e-3) if a.rule == "pageable copies"]
    assert copy.figure == 8 * MiB and copy.line == "3"
    assert "2 host-to-device copies on line 3 of 8.0 MiB from pageable memory" in copy.text
    a = analyse(c.events, c.names, device_in_use=True)
    assert (a.copies, a.copy_bytes, a.copies_unsized) == (2, 8 * MiB, 0)
    overview = ProfileReport("In[1]", 1, 2e-3, None, a, None).overview()
    assert "2 host-device copies (8.0 MiB)" in overview
    half = _h2d("Pageable", dtypes=("c10::Half", "c10::Half"))
    assert analyse(half.events, half.names).copy_bytes == 4 * MiB
    assert "pageable copies" not in rules(_h2d("Pinned").advise(wall_s=2e-3))


def test_a_copy_whose_op_recorded_nothing_is_said_of_unknown_size():
    c = _h2d("Pageable", op="aten::_to_copy", dtypes=())
    a = analyse(c.events, c.names, device_in_use=True)
    assert (a.copies, a.copy_bytes, a.copies_unsized) == (2, None, 2)
    assert "2 host-device copies (size unknown)" in ProfileReport(
        "In[1]", 1, 2e-3, None, a, None).overview()
    sized = _h2d("Pageable")
    sized.events[-1].linked = 0  # one copy with no op to ask
    a = analyse(sized.events, sized.names, device_in_use=True)
    assert "2 host-device copies (4.0 MiB; 1 of unknown size)" in ProfileReport(
        "In[1]", 1, 2e-3, None, a, None).overview()


# --- CUPTI's own rows are not the user's ops -----------------------------------------------


class _Kineto:
    """One event as kineto's `_KinetoEvent` answers (the calls from_kineto makes)."""

    def __init__(self, name: str, activity: str, start: int, end: int, device: bool = False,
                 correlation: int = 0, linked: int = 0) -> None:
        self._v = dict(name=name, activity_type=activity, start_ns=start, end_ns=end,
                       correlation_id=correlation, linked_correlation_id=linked)
        self._device = device

    def __getattr__(self, name: str):
        values = {"start_thread_id": 1, "end_thread_id": 1, "is_async": False, "nbytes": 0,
                  "metadata_json": "", "shapes": [], "dtypes": [], "concrete_inputs": [],
                  **self._v}
        return lambda: values[name]

    def device_type(self):
        return torch.autograd.DeviceType.CUDA if self._device else torch.autograd.DeviceType.CPU


def _kineto(*events: _Kineto):
    return types.SimpleNamespace(trace_start_ns=lambda: 0, events=lambda: list(events))


@pytest.mark.parametrize("activity", ["overhead", "cpu_op", ""])
def test_cuptis_own_rows_are_no_ops_and_driver_calls_are_runtime(activity):
    events = from_kineto(_kineto(
        _Kineto("tdm:In[1] 1: y = x @ x", "user_annotation", 0, 10_000),
        _Kineto("aten::mm", "cpu_op", 100, 9_000, correlation=1),
        _Kineto("Activity Buffer Request", activity, 50, 2_000),
        _Kineto("INVALID", activity, 2_100, 2_200),
        _Kineto("Lazy Function Loading", activity, 3_000, 8_000),
        _Kineto("cuLaunchKernelEx", "cuda_driver" if activity == "overhead" else activity,
                2_500, 8_500, correlation=500, linked=1),
        _Kineto("nvjet_sm90_tst_128x64_64x8_1x2_h_bz_NNT", "kernel", 8_600, 9_600, device=True,
                correlation=500, linked=1),
        _Kineto("cuStep", "user_annotation", 9_700, 9_800),  # a user's range of that look
    ))
    kinds = {e.name: e.kind for e in events}
    assert kinds["Activity Buffer Request"] == kinds["INVALID"] == "overhead"
    assert kinds["Lazy Function Loading"] == "overhead" and kinds["cuLaunchKernelEx"] == "runtime"
    a = analyse(events, {"tdm:In[1] 1: y = x @ x": ("1", "y = x @ x")}, device_in_use=True)
    assert sorted(r.name for r in a.ops) == ["aten::mm", "cuStep"] and a.op_calls == 2
    assert [k.name for k in a.kernels] == ["nvjet_sm90_tst_128x64_64x8_1x2_h_bz_NNT"]
    assert a.launches == 1


def test_a_cuLaunchKernelEx_counts_as_a_launch():
    c = Capture()
    for i in range(10):
        t = i * 10_000
        c.line(3, "t = t + 1", t, t + 10_000)
        c.launch("aten::add", "vectorized_elementwise_kernel", t, 5_000, 2_000)
    for e in c.events:
        if e.name == "cudaLaunchKernel":
            e.name = "cuLaunchKernelEx"  # what torch 2.11 on an H200 launched with
    [wait] = [a for a in c.advise(wall_s=1e-4) if a.rule.startswith("device")]
    assert wait.rule == "device waits (launch)" and wait.line == "3"


# --- a cold first run is warm-up, not launch- or host-bound --------------------------------


def _cold(loading_ns: int, runtime: str = "cudaLaunchKernel") -> Capture:
    """A first bf16 matmul: its launch spends `loading_ns` in CUDA's lazy module loading."""
    c = Capture()
    c.line(1, "with torch.autocast('cuda'): y = x @ x", 0, loading_ns + 200_000)
    c.launch("aten::mm", "nvjet_sm90_tst_128x64_64x8_1x2_h_bz_NNT", 1_000, loading_ns + 20_000,
             50_000, dtypes=("c10::BFloat16",) * 2)
    c.events.append(Event("Lazy Function Loading", "overhead", 5_000, 5_000 + loading_ns))
    return c


def test_a_first_run_spent_loading_is_warm_up_not_launch_bound():
    c = _cold(91_800_000)  # 91.8 ms, as on the H200
    advice = c.advise(wall_s=92e-3)
    assert not [a for a in advice if a.rule.startswith("device waits")]
    [warm] = [a for a in advice if a.rule == "warm-up"]
    assert warm.line == "1" and warm.figure > 0.9 and warm.threshold == profile_rules.WARM_UP_WALL
    assert "first-call loading (CUDA loading kernels)" in warm.text
    assert "cold first run" in warm.text
    # issue 36, 6: running again repeats the cell's side effects, and says so
    assert "run the cell again for a warm run's figures (a training cell trains once more)" \
        in warm.text


def test_a_first_item_spent_loading_gets_no_host_advice():
    c = Capture()
    c.line(1, "v = y.sum().item()", 0, 30_000_000)  # the first .item() of a process: 29 ms
    c.launch("aten::sum", "reduce_kernel", 1_000, 10_000, 5_000)
    c.events += [
        Event("Lazy Function Loading", "overhead", 20_000, 29_000_000),
        Event("aten::item", "op", 19_000, 29_900_000, correlation=77),
        Event("Memcpy DtoH (Device -> Pageable)", "memcpy", 29_500_000, 29_510_000, linked=77),
        Event("reduce_kernel", "kernel", 29_600_000, 29_610_000),
    ]
    advice = c.advise(wall_s=30e-3)
    assert "warm-up" in rules(advice)
    assert not [a for a in advice if a.rule in ("device waits (host)", "device waits (launch)")]


def test_a_cold_line_does_not_hide_a_warm_loops_launches():
    # line 1 loads (12 ms); then a loop of tiny kernels, each launched slower than it runs
    c = _cold(12_000_000)
    t0 = 13_000_000
    for i in range(300):
        t = t0 + i * 50_000
        c.line(3, "t = t + 1", t, t + 50_000)
        c.launch("aten::add", "vectorized_elementwise_kernel", t, 20_000, 2_000)
    advice = c.advise(wall_s=(t0 + 300 * 50_000) / 1e9)
    [wait] = [a for a in advice if a.rule.startswith("device waits")]
    assert wait.rule == "device waits (launch)" and wait.line == "3"
    assert "300 of 300 kernels on line 3" in wait.text  # line 1's kernel left out
    assert "warm-up" in rules(advice) and "a cost of the first run only" in advice[0].text


def test_a_first_compile_is_warm_up(ip):
    ip.run_cell("@torch.compile(backend='eager')\ndef double(t):\n    return t * 2")
    report = profile(ip, "", "y = double(torch.randn(3))")
    [warm] = [a for a in report.advice if a.rule == "warm-up"]
    assert warm.line == "1" and "first-call loading (torch.compile compiling)" in warm.text
    again = profile(ip, "", "y = double(torch.randn(3))")  # compiled: a warm run
    assert "warm-up" not in rules(again.advice) and ip.user_ns["y"].shape == (3,)


def test_a_warm_run_gets_no_warm_up_advice():
    c = _cold(5_000)  # a few µs of loading in a 0.2 ms cell
    assert "warm-up" not in rules(c.advise(wall_s=2e-4))


# --- rule 4: near capacity from the per-cell note's figure and test ------------------------


@pytest.fixture
def h200(ip, monkeypatch):
    """The fake H200 (139 GiB) holding 3 GiB before the cell."""
    machine = FakeMachine([Gpu("NVIDIA H200", total=139 * GIB, capability=(9, 0))])
    machine.install(monkeypatch).start_cuda()
    machine.allocate(0, 3 * GIB)
    ip.user_ns["machine"] = machine
    return ip


def test_a_peak_near_capacity_is_advised_as_the_note_says_it(h200):
    # a 125 GiB tensor made and deleted: the peak is 128 GiB with what the device held
    report = profile(h200, "", "machine.allocate(0, 125 * 2**30, keep=False)")
    [mem] = [a for a in report.advice if a.rule == "memory"]
    assert mem.figure == pytest.approx(128 / 139)
    assert "the peak 128.0 GiB is 92% of the device's 139.0 GiB" in mem.text
    note = Advisor(h200)._near_capacity(report.measurement)
    assert note is not None and note.figure == mem.figure and note.text.startswith("peak at 92%")


def test_at_exactly_the_threshold_both_say_it():
    assert profile_rules.NEAR_CAPACITY == 0.9  # the note's figure, and at it both speak
    c = Capture()
    advice = advise(c.events, analyse(c.events, {}), {},
                    Setting(1e-3, cuda=True, peak_bytes=90 * GIB, total_memory=100 * GIB))
    [mem] = [a for a in advice if a.rule == "memory"]
    assert "is 90% of the device's 100.0 GiB (at 90% or more)" in mem.text
