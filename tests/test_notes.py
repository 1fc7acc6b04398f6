"""The notes under the per-cell line (advice/notes.py): a cell, then the note and the record.

Each note appears when a cell left something to act on, and ordinary cells (a plain
training step, a small displayed tensor, a short cell) get none.
"""

from __future__ import annotations

import csv

import pytest
from fakegpu import GIB, FakeMachine, Gpu, loaded_with_gpu
from IPython.core.interactiveshell import InteractiveShell

from torch_device_magic.advice.hints import PREFIX

MiB = 2**20


def run(ip, cell: str):
    """Run a cell as a notebook does: numbered, in the history, its result in Out."""
    return ip.run_cell(cell, store_history=True)


def last(ip):
    return ip.magics_manager.registry["TorchDeviceMagics"].reporter.history.records()[-1]


def rules(ip) -> list[str]:
    return [note.rule for note in last(ip).notes]


def lines_after_report(out: str) -> list[str]:
    """The lines printed under the last report line."""
    lines = out.splitlines()
    at = max(i for i, line in enumerate(lines) if line.startswith("time "))
    return lines[at + 1:]


@pytest.fixture
def small(monkeypatch):
    """Thresholds a test can reach with tensors of a few MiB (the machine is shared)."""
    from torch_device_magic.advice import notes

    monkeypatch.setattr(notes, "DISPLAYED_MIN_BYTES", 8 * MiB)
    monkeypatch.setattr(notes, "INFERENCE_MIN_BYTES", 8 * MiB)


# --- ordinary cells: no note ---------------------------------------------------------------


def test_ordinary_cells_get_no_note(ip, capsys, small):
    run(ip, "model = torch.nn.Linear(64, 64); opt = torch.optim.SGD(model.parameters(), 0.1)")
    run(ip, "x = torch.randn(32, 64)")
    cells = [
        "loss = model(x).pow(2).mean(); opt.zero_grad(); loss.backward(); opt.step()",
        "torch.ones(3)",  # a small displayed tensor
        "a = 1",  # a short cell
        "big = torch.zeros(4 * 2**20)",  # 16 MiB, kept under a name, not displayed
    ]
    for cell in cells:
        capsys.readouterr()
        run(ip, cell)
        assert last(ip).notes == (), cell
        assert lines_after_report(capsys.readouterr().out) == [], cell


# --- the displayed result --------------------------------------------------------------------


def test_a_large_displayed_tensor_says_out_keeps_it(ip, capsys, small):
    capsys.readouterr()
    n = run(ip, "torch.zeros(4 * 2**20)").execution_count  # 16 MiB that no name holds
    out = capsys.readouterr().out
    expected = (f"Out[{n}] keeps 16.0 MiB on cpu, and _{n} and _ hold it too: %gpufree lets "
                "go of them all (or end the line with ';')")
    assert lines_after_report(out) == [expected]
    note = last(ip).notes[0]
    assert (note.rule, note.figure, note.where) == ("displayed", 16 * MiB, f"Out[{n}]")
    assert ip.user_ns["Out"][n] is ip.user_ns["_"]  # the note changed nothing


@pytest.mark.parametrize("result", ["torch.zeros(4 * 2**20)", "w.sigmoid()", "w.exp() * w"])
def test_following_the_displayed_notes_fix_frees_the_result(ip, capsys, small, result):
    """Issue 36, point 8: the note names what holds the result (`del Out[n]` alone frees
    nothing) and its fix, followed, frees it: a result whose own graph saved it
    (`sigmoid`), or saved activations (`exp` before `* w`), as a plain one."""
    run(ip, "import weakref\nw = torch.ones(4 * 2**20, requires_grad=True)\n"
            "def watched(t):\n    global ref\n    ref = weakref.ref(t)\n    return t")
    capsys.readouterr()
    n = run(ip, f"watched({result})").execution_count
    note = lines_after_report(capsys.readouterr().out)
    assert note[0].startswith(f"Out[{n}] keeps ") and f"_{n} and _ hold it too: %gpufree" in note[0]
    run(ip, f"del Out[{n}]")
    assert ip.user_ns["ref"]() is not None  # as the note says: _n and _ still hold it
    run(ip, "%gpufree")
    assert ip.user_ns["ref"]() is None


def test_a_small_result_with_a_graph_gets_no_note(ip, capsys, small):
    run(ip, "w = torch.ones(1000, requires_grad=True)")
    for cell in ("w.sigmoid()", "w.exp() * w"):
        capsys.readouterr()
        run(ip, cell)
        assert last(ip).notes == () and lines_after_report(capsys.readouterr().out) == [], cell


def test_a_displayed_result_that_a_name_holds_gets_no_note(ip, capsys, small):
    """Issue 29, point 3: `del Out[n]` would free nothing while `x` holds the tensor."""
    run(ip, "x = torch.zeros(4 * 2**20)")
    for cell in ("x", "x[:3]", "(x, x[1:])"):
        capsys.readouterr()
        run(ip, cell)
        assert last(ip).notes == (), cell
        assert lines_after_report(capsys.readouterr().out) == [], cell


def test_a_displayed_tuple_counts_each_storage_once(ip, small):
    run(ip, "(lambda t: (t, t[:10], torch.zeros(2 * 2**20)))(torch.zeros(4 * 2**20))")
    assert [n.figure for n in last(ip).notes] == [24 * MiB]  # t[:10] is t's storage


def test_the_displayed_result_is_quiet_with_a_semicolon_and_when_advice_is_off(ip, small):
    run(ip, "torch.zeros(4 * 2**20);")
    assert last(ip).notes == ()
    run(ip, "%config TorchDeviceMagics.advice = False")
    run(ip, "torch.zeros(4 * 2**20)")
    assert last(ip).notes == ()
    run(ip, "%config TorchDeviceMagics.advice = True")
    run(ip, "torch.zeros(4 * 2**20)")
    assert rules(ip) == ["displayed"]


def test_a_result_that_raises_when_looked_at_leaves_the_line_and_no_note(ip, capsys, small):
    run(ip, "class Odd(dict):\n    def values(self):\n        raise RuntimeError('no')\n")
    capsys.readouterr()
    run(ip, "Odd(a=torch.zeros(4 * 2**20))")
    out = capsys.readouterr().out
    assert last(ip).notes == () and lines_after_report(out) == []
    assert "could not" not in out


def test_notes_go_to_the_csv_and_the_html_bundle(ip, tmp_path, small):
    run(ip, "torch.zeros(4 * 2**20)")
    record = last(ip)
    html = record.bundle()["text/html"]
    assert html.count('class="tdm-report"') == 1 and "keeps 16.0 MiB on cpu" in html
    path = tmp_path / "cells.csv"
    run(ip, f"%devhistory --csv {path}")
    rows = list(csv.DictReader(path.open()))
    assert "keeps 16.0 MiB on cpu" in rows[-1]["notes"]


# --- inference under autograd ----------------------------------------------------------------

MODEL = (
    "model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256),"
    " torch.nn.ReLU()) for _ in range(3)])\n"
    "x = torch.randn(8192, 256)"  # each activation 8 MiB
)


def test_inference_with_autograd_on_says_what_the_graph_holds(ip, capsys, small):
    run(ip, MODEL)
    run(ip, "model.eval()")
    capsys.readouterr()
    run(ip, "pred = model(x)")
    notes = last(ip).notes
    assert [n.rule for n in notes] == ["inference"]
    # Saved for backward: each ReLU's result (the next Linear's input, the same tensor),
    # x and the weights (which the user holds anyway), and `pred` (held by its name):
    # the first two ReLUs' results, 8 MiB each, are what the graph alone keeps.
    assert notes[0].figure == 16 * MiB
    assert lines_after_report(capsys.readouterr().out) == [
        "pred keeps an autograd graph holding 16.0 MiB: for inference run the cell under "
        "%%nograd, or torch.no_grad()"
    ]
    assert ip.user_ns["pred"].grad_fn is not None  # nothing changed


def test_the_inference_note_reads_the_graph_without_unpacking_what_it_saved(ip, small):
    """Unpacking a saved tensor runs the saved-tensor hooks (a checkpoint's recompute, an
    offloaded tensor's copy back): the note reads them packed."""
    run(ip, MODEL)
    run(ip, "model.eval(); unpacked = []\n"
            "hooks = torch.autograd.graph.saved_tensors_hooks(\n"
            "    lambda t: t, lambda t: unpacked.append(1) or t)\n"
            "hooks.__enter__()")
    try:
        run(ip, "pred = model(x)")
        notes = last(ip).notes
    finally:
        run(ip, "hooks.__exit__(None, None, None)")
    assert [n.rule for n in notes] == ["inference"] and notes[0].figure == 16 * MiB
    assert ip.user_ns["unpacked"] == []


def test_inference_is_quiet_under_no_grad_in_training_mode_and_with_backward(ip, small):
    run(ip, MODEL)
    run(ip, "model.eval()")
    run(ip, "with torch.no_grad():\n    pred = model(x)")
    assert last(ip).notes == ()
    run(ip, "%%nograd\npred2 = model(x)")
    assert last(ip).notes == ()
    run(ip, "model.train()")
    run(ip, "pred3 = model(x)")  # a training forward: its graph is wanted
    assert last(ip).notes == ()
    run(ip, "model.eval()")
    run(ip, "out = model(x); out.sum().backward()")
    assert last(ip).notes == ()


@pytest.mark.parametrize("cell", [
    "x = torch.randn(8192, 256, requires_grad=True)\nscores = model(x)",
    "x = torch.randn(8192, 256).requires_grad_()\nscores = model(x)",
    "x = torch.randn(8192, 256)\nx.requires_grad = True\nscores = model(x)",
    # a `with` block's names are seen (the inference below it gets its note): here the
    # cell's enable_grad is what keeps it quiet
    "with torch.enable_grad():\n    scores = model(x)",
    "torch.set_grad_enabled(True)\nscores = model(x)",
])
def test_a_cell_that_asks_for_gradients_is_not_inference(ip, small, cell):
    """Issue 29, point 4: a saliency cell (model in eval, its input made to require
    grad, the backward in the next cell) is not told to drop autograd."""
    run(ip, MODEL)
    run(ip, "model.eval()")
    run(ip, cell)
    assert ip.user_ns["scores"].grad_fn is not None
    assert last(ip).notes == ()
    run(ip, "scores.sum().backward()")  # what %%nograd would have broken


def test_an_input_made_to_require_grad_in_an_earlier_cell_is_not_inference(ip, small):
    """A saliency notebook makes its input in one cell and runs the model in the next:
    the model's input is a leaf that asks for its gradient (`x.grad`, the saliency)."""
    run(ip, MODEL)
    run(ip, "model.eval()")
    run(ip, "x.requires_grad_()")
    run(ip, "scores = model(x)")
    assert last(ip).notes == ()
    run(ip, "scores.sum().backward()")
    assert ip.user_ns["x"].grad is not None


def test_a_cell_that_asks_for_none_is_inference_still(ip, small):
    """The other side of point 4: requires_grad=False, or an input that is not a leaf
    (the result of another model), is still inference with a graph kept."""
    run(ip, MODEL)
    run(ip, "model.eval()")
    run(ip, "x2 = torch.randn(8192, 256, requires_grad=False)\nscores = model(x2)")
    assert rules(ip) == ["inference"]
    run(ip, "stem = torch.nn.Linear(256, 256).eval()\nfeats = stem(x)")
    run(ip, "scores2 = model(feats)")
    assert rules(ip) == ["inference"]


@pytest.mark.parametrize("cell", [
    "with torch.autocast('cpu', dtype=torch.bfloat16):\n    pred = model(x)",
    "for chunk in x.split(4096):\n    pred = model(chunk)",
])
def test_inference_inside_a_block_gets_the_note(ip, small, cell):
    """The names a cell binds in its `with` and `for` blocks are its own: an inference
    under autocast, or over the batches of a loop, keeps a graph all the same."""
    run(ip, MODEL)
    run(ip, "model.eval()")
    run(ip, cell)
    assert rules(ip) == ["inference"]
    assert last(ip).notes[0].where == "pred"


# --- torch.compile -----------------------------------------------------------------------------

COMPILED = """\
def step(x):
    y = x * 2
    print("between")
    return y + 1
fast = torch.compile(step, backend="eager")
fast(torch.ones(32));
"""


def test_a_compile_says_frames_time_and_the_graph_breaks_line(ip, capsys):
    capsys.readouterr()
    run(ip, COMPILED)
    notes = last(ip).notes
    assert [n.rule for n in notes] == ["compiled", "graph_break"]
    assert notes[0].text.startswith("compiled step: 2 frames in ")
    assert notes[1].text.startswith("graph break in step at line 3: ")
    assert "print" in notes[1].text
    out = lines_after_report(capsys.readouterr().out)
    assert out == [n.text for n in notes]
    run(ip, "fast(torch.ones(32));")  # the same shapes: nothing compiles
    assert last(ip).notes == ()


TWO_BREAKS = """\
def step(x):
    y = x * 2
    print("between")
    y = y + 1
    torch._dynamo.graph_break()
    return y - 1
fast2 = torch.compile(step, backend="eager")
fast2(torch.ones(32));
"""


def test_two_graph_breaks_in_one_function_are_two_notes_each_with_its_reason(ip):
    """The second resumed part's reason does not take the first break's place: each
    break is said at its own line with its own reason."""
    run(ip, "import torch._dynamo")
    run(ip, TWO_BREAKS)
    breaks = [n.text for n in last(ip).notes if n.rule == "graph_break"]
    assert [t.split(": ")[0] for t in breaks] == ["graph break in step at line 3",
                                                  "graph break in step at line 5"]
    assert "print" in breaks[0] and "print" not in breaks[1]  # torch.compiler's own words


def test_a_recompile_gives_torchs_reason_and_the_count_to_the_limit(ip):
    run(ip, COMPILED)
    run(ip, "fast(torch.ones(17));")
    (note,) = last(ip).notes
    assert note.rule == "recompiled"
    assert note.text == ("recompiled step: tensor 'x' size mismatch at index 0. expected 32, "
                         "actual 17 (2 of 8 before the recompile limit)")


def test_the_recompile_limit_says_the_function_runs_uncompiled(ip):
    run(ip, "import torch._dynamo\ntorch._dynamo.config.recompile_limit")
    limit = ip.user_ns["Out"][ip.execution_count - 1]
    run(ip, "def add(x, k):\n    return x + k\n"
            "fast_add = torch.compile(add, backend='eager', dynamic=False)")
    run(ip, f"for k in range({limit + 2}):\n    fast_add(torch.ones(3), k)")
    by_rule = {n.rule: n for n in last(ip).notes}
    assert by_rule["recompile_limit"].text == (
        f"add hit the recompile limit ({limit}) and now runs uncompiled; "
        f"the last reason: k == {limit - 1}")
    assert by_rule["recompiled"].text.endswith(f"({limit} of {limit} before the recompile limit)")


def test_two_functions_of_one_name_are_two_functions(ip):
    """Issue 29, point 5: a GAN's G and D (one frame each) are not one function split by a
    graph break, and their recompiles are not merged."""
    run(ip, "class G(torch.nn.Module):\n    def forward(self, x):\n        return x * 2\n"
            "class D(torch.nn.Module):\n    def forward(self, x):\n        return x + 1\n"
            "g = torch.compile(G(), backend='eager', dynamic=False)\n"
            "d = torch.compile(D(), backend='eager', dynamic=False)")
    run(ip, "g(torch.ones(3)); d(torch.ones(3));")
    texts = [n.text.split(": ")[0] for n in last(ip).notes]
    assert texts == ["compiled forward (a cell's line 2)", "compiled forward (a cell's line 5)"]
    assert all(": 1 frame in " in n.text for n in last(ip).notes)
    run(ip, "g(torch.ones(4)); d(torch.ones(4));")
    notes = last(ip).notes
    assert [n.rule for n in notes] == ["recompiled", "recompiled"]
    assert [n.where for n in notes] == ["forward (a cell's line 2)", "forward (a cell's line 5)"]
    assert all(n.figure == 2 and " times" not in n.text for n in notes)


def profiled(ip, cell: str):
    """%%profile's rule 10 and the note under the same cell."""
    advice = ip.run_cell(f"%%profile -o\n{cell}", store_history=True).result.advice
    (rule,) = [a for a in advice if a.rule == "recompiles"]
    return rule, {n.rule: n for n in last(ip).notes}


def test_profiles_recompile_advice_counts_as_the_notes_do(ip):
    """Issue 29, point 6: 3 recompiles of a function with a graph break are 3, not 6, and
    they are the function's, not its resumed part's."""
    run(ip, COMPILED.replace('backend="eager"', 'backend="eager", dynamic=False'))
    rule, notes = profiled(ip, "for n in (17, 9, 5):\n    fast(torch.ones(n))")
    assert rule.figure == 3
    assert rule.text.startswith("torch.compile recompiled 3 times in this cell, last step "
                                "(a cell's line 1): tensor 'x' size mismatch at index 0. "
                                "expected 9, actual 5; keep that input fixed")
    assert notes["recompiled"].text.startswith("recompiled step 3 times: ")


def test_profiles_recompile_advice_says_the_limit(ip):
    """Point 6: 7 recompiles and then the limit read 7 and the limit, never `None (:None)`."""
    run(ip, "import torch._dynamo\nlimit = torch._dynamo.config.recompile_limit\n"
            "def add(x, k):\n    return x + k\n"
            "fast_add = torch.compile(add, backend='eager', dynamic=False)\n"
            "fast_add(torch.ones(3), 0);")
    limit = ip.user_ns["limit"]
    rule, notes = profiled(ip, f"for k in range(1, {limit + 1}):\n    fast_add(torch.ones(3), k)")
    assert rule.figure == limit - 1
    assert rule.text.startswith(
        f"torch.compile recompiled {limit - 1} times in this cell, last add (a cell's line 3): "
        f"k == {limit - 1}; add then hit the recompile limit ({limit}) and now runs "
        "uncompiled; keep that input fixed")
    assert notes["recompiled"].text.startswith(f"recompiled add {limit - 1} times: ")
    assert "recompile_limit" in notes


@pytest.mark.slow
def test_an_inductor_compile_is_said_once(ip):
    run(ip, "def mlp(x):\n    return torch.relu(x @ x.T).sum()\nfast_mlp = torch.compile(mlp)")
    run(ip, "fast_mlp(torch.randn(16, 16));")
    (note,) = last(ip).notes
    assert note.rule == "compiled" and note.text.startswith("compiled mlp: 1 frame in ")
    run(ip, "fast_mlp(torch.randn(16, 16));")
    assert last(ip).notes == ()


# --- near capacity -----------------------------------------------------------------------------


def gpu(shell, monkeypatch) -> FakeMachine:
    return loaded_with_gpu(shell, monkeypatch, Gpu("A", total=80 * GIB))


def test_a_peak_near_the_devices_capacity_says_so(shell, capsys, monkeypatch):
    gpu(shell, monkeypatch)
    run(shell, "machine.allocate(0, 8 * 2**30)")  # 8 GiB kept from before
    capsys.readouterr()
    run(shell, "machine.allocate(0, 66 * 2**30, keep=False)")  # peak 74 of 80 GiB
    assert lines_after_report(capsys.readouterr().out) == [
        "peak at 92% of cuda:0: a larger batch will likely run out of memory; "
        "see %%profile --memory"
    ]
    note = last(shell).notes[0]
    assert note.rule == "near_capacity" and note.figure == pytest.approx(74 / 80)


def test_a_peak_below_90_percent_is_quiet(shell, monkeypatch):
    gpu(shell, monkeypatch)
    run(shell, "machine.allocate(0, 70 * 2**30, keep=False)")
    assert last(shell).notes == ()


# --- is the GPU busy ---------------------------------------------------------------------------


@pytest.fixture
def short_cells(monkeypatch):
    """Cells of any length get the GPU's busy share read (a test's cell is short)."""
    from torch_device_magic.advice import notes

    monkeypatch.setattr(notes, "BUSY_MIN_S", 0.0)


def test_a_gpu_busy_for_part_of_the_cell_says_so(shell, capsys, monkeypatch, short_cells):
    machine = gpu(shell, monkeypatch)
    machine.sample(0, [100, 100], at_us=1)  # before the cell: not counted
    capsys.readouterr()
    run(shell, "import os; machine.run(0, 5); machine.sample(0, [10, 30, 20], pid=os.getpid())")
    assert lines_after_report(capsys.readouterr().out) == [
        "GPU busy 20% of the cell: the GPU waited, on input or on Python; %%profile shows where"
    ]
    assert last(shell).gpu_busy == pytest.approx(20)


def test_memory_held_by_an_idle_gpu_says_so(shell, capsys, monkeypatch, short_cells):
    gpu(shell, monkeypatch)
    run(shell, "machine.allocate(0, 8 * 2**30)")
    capsys.readouterr()
    # kernels of 50 ms: the report reads NVML's samples from the cell's start as its end
    # less its wall, so a busy machine's delay before the report must not pass the samples
    run(shell, "machine.run(0, 50); machine.sample(0, [0, 3, 0])")
    assert lines_after_report(capsys.readouterr().out) == [
        "cuda:0 held 8.0 GiB and was busy 1% of the cell: the GPU waited, on input or on "
        "Python; %%profile shows where"
    ]


def test_a_busy_gpu_no_samples_and_foreign_pids_say_nothing(shell, monkeypatch, short_cells):
    gpu(shell, monkeypatch)
    run(shell, "import os; machine.run(0, 5); machine.sample(0, [90, 95], pid=os.getpid())")
    assert last(shell).notes == () and last(shell).gpu_busy == pytest.approx(92.5)
    run(shell, "machine.run(0, 5)")  # NVML has no samples in the cell
    assert last(shell).notes == () and last(shell).gpu_busy is None
    # Only a pid that is none of ours ran kernels (a container hides the host's pids).
    run(shell, "machine.run(0, 5); machine.sample(0, [10, 10], pid=4_000_000)")
    assert last(shell).notes == () and last(shell).gpu_busy is None


def test_another_process_on_the_gpu_leaves_our_share(shell, monkeypatch, short_cells):
    gpu(shell, monkeypatch)
    run(shell, "import os; machine.run(0, 5); machine.sample(0, [80, 80], pid=4_000_000)\n"
               "machine.cuda[0].process_samples.append((os.getpid(), "
               "machine.cuda[0].samples[-1][0], 20))")
    assert last(shell).gpu_busy == pytest.approx(10)  # 20% in one of two samples
    assert [n.rule for n in last(shell).notes] == ["gpu_busy"]


def test_a_short_cell_does_not_read_nvml(shell, monkeypatch):
    gpu(shell, monkeypatch)
    run(shell, "machine.run(0, 5); machine.sample(0, [1, 1])")
    assert last(shell).notes == () and last(shell).gpu_busy is None


# --- hints for failing compiled cells ----------------------------------------------------------


def show(ip, cell: str):
    """Run a failing cell as a notebook does: the traceback printed, not raised."""
    return InteractiveShell.run_cell(ip, cell, store_history=True)


def test_the_recompile_limit_made_an_error_gets_a_hint_with_the_reasons(ip, capsys):
    run(ip, "import torch._dynamo\n"
            "def shift(x, k):\n    return x + k\n"
            "strict = torch.compile(shift, backend='eager', dynamic=False, fullgraph=True)")
    capsys.readouterr()
    result = show(ip, "for k in range(torch._dynamo.config.recompile_limit + 1):\n"
                      "    strict(torch.ones(3), k)")
    assert type(result.error_in_exec).__name__ == "FailOnRecompileLimitHit"
    out = capsys.readouterr().out
    limit = ip.user_ns["torch"]._dynamo.config.recompile_limit
    assert f"{PREFIX} shift reached torch.compile's recompile limit" in out
    assert f"  Recompiled for: k == {limit - 3}; k == {limit - 2}; k == {limit - 1}\n" in out
    assert "torch._dynamo.mark_dynamic(x, 0)" in out


def test_an_overwritten_cuda_graph_output_names_who_holds_one(ip, capsys):
    # torch makes reading a dead CUDA-graph output's storage raise (on a CUDA build
    # only): a tensor subclass plays such an output here.
    run(ip, f"MESSAGE = {OVERWRITTEN!r}\n"
            "class Dead(torch.Tensor):\n"
            "    def untyped_storage(self):\n"
            "        raise RuntimeError(MESSAGE)\n"
            "out = torch.ones(3).as_subclass(Dead); fine = torch.ones(3)")
    capsys.readouterr()
    show(ip, "raise RuntimeError(MESSAGE)")
    out = capsys.readouterr().out
    assert f"{PREFIX} a compiled function's output (CUDA graphs" in out
    assert "  Held by: out\n" in out and ".clone()" in out


OVERWRITTEN = ("Error: accessing tensor output of CUDAGraphs that has been overwritten by a "
               "subsequent run. Stack trace: File \"<cell>\", line 2. To prevent overwriting, "
               "clone the tensor outside of torch.compile()")
