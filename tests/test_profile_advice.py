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


@pytest.fixture
def one_thread(threads):
    torch.set_num_threads(1)


# --- the CPU rules, on real cells -----------------------------------------------------------


DEMO_LINE = "rows = [torch.randn(8) for _ in range(2000)]"


def test_a_loop_of_tiny_ops_is_advised_one_batched_call(ip, capsys):
    ip.run_cell(f"%%profile\n{DEMO_LINE}\nsampled = torch.stack(rows)")
    out = capsys.readouterr().out
    assert "advice" in out and "line 1 ran 1 time: 2,000 calls of aten::randn (" in out
    assert "iterations" not in out  # issue 36, 17b: 2,002 line events are no iterations
    assert "the line's wall under the tracer" in out  # issue 36, 5: what the figure is
    assert "one batched call: torch.randn(2000, 8), not torch.randn(8) 2,000 times" in out
    assert ip.user_ns["sampled"].shape == (2000, 8)
    report = profile(ip, "", f"{DEMO_LINE}\nsampled = torch.stack(rows)")
    [tiny] = [a for a in report.advice if a.rule == "tiny ops"]
    assert tiny.line == "1" and tiny.threshold == profile_rules.TINY_SHARE
    assert tiny.figure > tiny.threshold and f"{tiny.figure:.0%} of the wall" in tiny.text


def tiny_advice(ip, cell: str) -> Advice | None:
    found = [a for a in profile(ip, "", cell).advice if a.rule == "tiny ops"]
    return found[0] if found else None


@pytest.mark.parametrize("call", [
    "torch.randint(0, 100, (8,))", "torch.randint(10, size=(2, 3))", "torch.arange(8)",
    "torch.arange(2, 20, 3, dtype=torch.float64)", "torch.randperm(8)", "torch.full((8,), 3.0)",
    "torch.randn(8)", "torch.randn(2, 3)", "torch.rand(size=(4,))",
    "torch.zeros(8, dtype=torch.int64)", "torch.normal(0.0, 1.0, (8,))", "torch.eye(3)",
    "torch.linspace(0, 1, 5)", "torch.empty((2, 2))",
])
def test_each_batched_call_example_runs_as_typed_and_makes_what_the_cell_made(ip, call):
    """Issue 36, 17: the example is built from the line's own call, and typed, makes the
    cell's tensors, stacked (the same values where the call is not random)."""
    tiny = tiny_advice(ip, f"rows = [{call} for _ in range(3000)]")
    stacked = torch.stack(ip.user_ns["rows"])
    made = eval(tiny.example, ip.user_ns)
    assert (made.shape, made.dtype) == (stacked.shape, stacked.dtype)
    if not call.startswith(("torch.rand", "torch.normal", "torch.empty")):
        assert torch.equal(made, stacked)
    if call == "torch.randperm(8)":  # each row a permutation, as randperm's
        assert (made.sort(1).values == torch.arange(8)).all()
    assert f"make them one batched call: {tiny.example}, not {call} 3,000 times" in tiny.text


@pytest.mark.parametrize("cell", [
    "rows = [torch.arange(i % 7 + 1) for i in range(3000)]",  # sizes the loop binds
    "rows = [torch.full((8,), i) for i in range(3000)]",  # values the loop binds
    "shape = (8,)\nrows = [torch.randn(shape) for _ in range(3000)]",  # an int or a shape?
])
def test_a_factory_call_with_no_batched_form_written_gets_no_example(ip, cell):
    tiny = tiny_advice(ip, cell)
    assert tiny.example is None and "batched call" not in tiny.text


def test_a_bigram_count_is_advised_one_scatter_that_counts_the_same(ip):
    """Issue 36, 5 (makemore part 1): `N[ix1, ix2] += 1` over every pair is one
    index_put_ with accumulate=True; typed with the pairs' indices, it counts the same."""
    ip.run_cell("import random\nrandom.seed(0)\nwords = [''.join(random.choice('abcdefghij') "
                "for _ in range(random.randint(3, 8))) for _ in range(400)]\n"
                "stoi = {s: i + 1 for i, s in enumerate('abcdefghij')}\nstoi['.'] = 0\n"
                "N = torch.zeros((11, 11), dtype=torch.int32)")
    tiny = tiny_advice(ip, BIGRAM)
    assert tiny.line == "6" and "a run)" in tiny.text and "under the tracer" in tiny.text
    assert tiny.example == ("N.index_put_((I1, I2), torch.ones(len(I1), dtype=N.dtype), "
                            "accumulate=True)")
    ns = ip.user_ns
    pairs = [(ns["stoi"][a], ns["stoi"][b]) for w in ns["words"]
             for a, b in zip("." + w, w + ".")]
    typed = dict(ns, N=torch.zeros_like(ns["N"]), I1=torch.tensor([a for a, _ in pairs]),
                 I2=torch.tensor([b for _, b in pairs]))
    eval(tiny.example, typed)
    assert torch.equal(typed["N"], ns["N"])


def test_a_parameter_update_is_advised_one_foreach_call_that_steps_the_same(ip):
    ip.run_cell("torch.manual_seed(0)\n"
                "params = [torch.randn(8, 8, requires_grad=True) for _ in range(7)]\n"
                "sum((p * p).sum() for p in params).backward()\n"
                "before = [p.detach().clone() for p in params]")
    tiny = tiny_advice(ip, "for i in range(200):\n    for p in params:\n"
                           "        p.data += -0.1 * p.grad")
    assert tiny.example == ("torch._foreach_add_([p.data for p in params], "
                            "[p.grad for p in params], alpha=-0.1)")
    ns = ip.user_ns
    copies = [b.clone().requires_grad_() for b in ns["before"]]
    for copy, p in zip(copies, ns["params"]):
        copy.grad = p.grad.clone()
    typed = dict(ns, params=copies)
    for _ in range(200):
        eval(tiny.example, typed)
    assert all(torch.allclose(c, p) for c, p in zip(copies, ns["params"]))


def test_a_gradient_norm_loop_is_not_advised_a_parameter_update(ip):
    """Issue 36, 17b: the loop only reads the grads; following the old advice took an SGD
    step."""
    ip.run_cell("params = [torch.randn(8, 8, requires_grad=True) for _ in range(7)]\n"
                "sum((p * p).sum() for p in params).backward()")
    tiny = tiny_advice(ip, "for i in range(200):\n    total = 0\n    for p in params:\n"
                           "        total += p.grad.pow(2).sum()")
    assert tiny.line == "4" and tiny.example is None
    assert "_foreach_add_" not in tiny.text and "update every parameter" not in tiny.text


def test_slices_of_separate_tensors_are_advised_one_stack(ip):
    """Issue 36, 17b: `[c[:4] for c in chunks]` takes a slice of each of 3,000 tensors:
    there is no one tensor to index, and a slice is no element."""
    ip.run_cell("chunks = list(torch.randn(3000, 8).unbind())")
    tiny = tiny_advice(ip, "heads = [c[:4] for c in chunks]")
    assert tiny.example == "torch.stack(chunks)[:, :4]"
    assert "one element" not in tiny.text and "a slice a tensor" in tiny.text
    assert torch.equal(eval(tiny.example, ip.user_ns), torch.stack(ip.user_ns["heads"]))


def test_tensors_of_several_shapes_get_no_stack(ip):
    ip.run_cell("chunks = [torch.randn(8 + i % 2) for i in range(3000)]")
    tiny = tiny_advice(ip, "heads = [c[:4] for c in chunks]")
    assert tiny.example is None and "stack" not in tiny.text


def test_an_index_by_the_loops_values_is_advised_one_gather(ip):
    ip.run_cell("import random\nrandom.seed(1)\nP = torch.rand(27, 27)\n"
                "pairs = [(random.randrange(27), random.randrange(27)) for _ in range(300)]")
    tiny = tiny_advice(ip, "lps = []\nfor k in range(5):\n    for ix1, ix2 in pairs:\n"
                           "        lps.append(torch.log(P[ix1, ix2]))")
    assert tiny.line == "4" and tiny.example == "P[I1, I2]"
    ns = ip.user_ns
    typed = dict(ns, I1=torch.tensor([a for a, _ in ns["pairs"]] * 5),
                 I2=torch.tensor([b for _, b in ns["pairs"]] * 5))
    assert torch.equal(torch.log(eval(tiny.example, typed)), torch.stack(ns["lps"]))


def test_a_loop_header_that_calls_no_torch_op_is_not_advised(ip):
    """Issue 36, 17b: Python's iteration is no per-call overhead of small ops."""
    ip.run_cell("a = list(range(20000))")
    advice = profile(ip, "", "n = 0\nfor k in range(3):\n    for x, y in zip(a, a[1:]):\n"
                             "        n += 1\nt = torch.ones(3)").advice
    assert "tiny ops" not in rules(advice)


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


def _tiny(body: list, steps: int, **setting) -> list[Advice]:
    """The tiny-ops advice on `body` run `steps` times; `setting`: the cell's `source` (as
    `_stepped` numbers it) and the `kinds` of its names, where the remedy reads them."""
    c, wall = _stepped(body, steps)
    return [a for a in c.advise(wall_s=wall, **setting) if a.rule == "tiny ops"]


INNER = "for step in range(steps):\n    for p in parameters:\n        {}"  # as _inner numbers it


def test_a_parameter_update_in_a_loop_is_advised_foreach():
    line = "p.data += -0.1 * p.grad"
    [tiny] = _tiny(_inner(line, "aten::mul"), 100, source=INNER.format(line))
    assert tiny.line == "3" and "line 3 ran 1,700 times: 1,700 calls of aten::mul" in tiny.text
    assert tiny.example == ("torch._foreach_add_([p.data for p in parameters], "
                            "[p.grad for p in parameters], alpha=-0.1)")
    assert f"update every parameter in one call: {tiny.example}" in tiny.text
    assert "torch.randn" not in tiny.text


@pytest.mark.parametrize("line, alpha", [
    ("p -= lr * p.grad", "-lr"),
    ("p.data.add_(p.grad, alpha=-lr)", "-lr"),
    ("p.sub_(0.5 * p.grad)", "-0.5"),
])
def test_each_form_of_a_parameter_update_gets_its_own_step(line, alpha):
    [tiny] = _tiny(_inner(line, "aten::mul"), 100, source=INNER.format(line))
    assert tiny.example.endswith(f"alpha={alpha})")


def test_a_gradient_norm_loop_is_not_told_to_update_the_parameters():
    """Issue 36, 17b: `total += p.grad.pow(2).sum()` reads the grads and writes `total`:
    an SGD step (torch._foreach_add_ over the parameters) would change what it only read."""
    line = "total += p.grad.pow(2).sum()"
    [tiny] = _tiny(_inner(line, "aten::sum"), 100, source=INNER.format(line),
                   kinds={"parameters": "tensors"})
    assert "foreach" not in tiny.text and "update every parameter" not in tiny.text
    assert tiny.example is None and tiny.text.endswith("do the work in fewer, larger calls")


BIGRAM = """for w in words:
    chs = ['.'] + list(w) + ['.']
    for ch1, ch2 in zip(chs, chs[1:]):
        ix1 = stoi[ch1]
        ix2 = stoi[ch2]
        N[ix1, ix2] += 1"""


def test_an_in_place_update_of_indexed_elements_is_one_scatter_whatever_op_weighs_most():
    """Issue 36, 5: the bigram count's line spent most in aten::add_ (430 µs against
    aten::select's 397 µs): what the line writes, an indexed in-place add, decides."""
    body = [(3, "for ch1, ch2 in zip(chs, chs[1:]):", None, 200),
            (6, "N[ix1, ix2] += 1", "aten::add_", 12_000, 3_000)]
    [tiny] = _tiny(body * 1200, 10, source=BIGRAM, kinds={"N": "tensor"})
    assert tiny.line == "6" and "12,000 calls of aten::add_ (3 µs in the op" in tiny.text
    assert "the line's wall under the tracer 12 µs a run" in tiny.text  # a hit's, said so
    assert tiny.example == ("N.index_put_((I1, I2), torch.ones(len(I1), dtype=N.dtype), "
                            "accumulate=True)")
    assert "where I1, I2 hold the values of ix1, ix2 over the loop, as tensors" in tiny.text
    assert "fewer, larger calls" not in tiny.text


def test_an_indexed_add_of_values_is_one_scatter_of_them():
    source = ("for k in range(32):\n    for j in range(3):\n        dC[ix[k, j]] += demb[k, j]")
    body = _inner("dC[ix[k, j]] += demb[k, j]", "aten::select")
    [tiny] = _tiny(body, 100, source=source, kinds={"dC": "tensor", "demb": "tensor"})
    assert tiny.example == "dC.index_put_((I1,), V, accumulate=True)"
    assert ("I1 holds the values of ix[k, j] over the loop, as a tensor, and V those of "
            "demb[k, j], stacked") in tiny.text


def test_a_line_that_calls_no_torch_op_gets_no_tiny_ops_advice():
    """Issue 36, 17b: a `for` header (or any line) that calls no torch op spends Python's
    time, not torch's per-call overhead."""
    body = [(2, "for x, y in zip(a, a[1:]):", None, 2_000), (3, "n += 1", None, 1_000)]
    assert _tiny(body * 100, 20) == []


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
    assert ("1,700 calls of aten::randn (2 µs in the op, their median; the line's wall under "
            "the tracer 500 µs a run)") in tiny.text
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
    # issue 36, 17b: the tracer's line events are no iterations; the ops' calls are counted
    assert "line 2 ran 1,001 times: 21,021 calls of aten::std" in tiny.text
    assert "iterations" not in tiny.text
    assert "the line's wall under the tracer 1 µs a call" in tiny.text  # a comprehension's


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


LOADER = """import time
from torch.utils.data import DataLoader, Dataset
class Files(Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        time.sleep(0.002)  # reading and decoding a file
        return torch.full((4,), float(i))
loader = DataLoader(Files(), batch_size=8{workers})"""


def test_a_loader_whose_dataset_loads_is_advised_workers(ip, monkeypatch):
    """The loading (2 ms a row in __getitem__) and the step (20 ms a batch) are as long:
    one worker overlaps them."""
    monkeypatch.setattr(profile_rules, "cores", lambda: 2)
    ip.run_cell(LOADER.format(workers=""))
    report = profile(ip, "--steps 0", "for batch in loader:\n    time.sleep(0.02)")
    [pipe] = [a for a in report.advice if a.rule == "input pipeline"]
    assert pipe.line == "1" and pipe.figure > profile_rules.LOADER_SHARE
    assert "give it workers, num_workers=1 (2 cores), persistent_workers=True" in pipe.text
    assert "pin_memory" not in pipe.text  # no CUDA device here
    assert pipe.example is None


def test_a_loader_whose_loading_nothing_overlaps_is_not_advised(ip, monkeypatch):
    """The loop does nothing but load: one worker would load as long, and start first."""
    monkeypatch.setattr(profile_rules, "cores", lambda: 2)
    ip.run_cell(LOADER.format(workers=""))
    report = profile(ip, "--steps 0", "for batch in loader:\n    s = batch.sum()")
    assert "input pipeline" not in rules(report.advice)


def test_a_loader_with_workers_is_not_advised(ip):
    ip.run_cell(LOADER.format(workers=", num_workers=1"))
    report = profile(ip, "--steps 0", "for batch in loader:\n    time.sleep(0.02)")
    assert "input pipeline" not in rules(report.advice)


TEXTBOOK = """from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
X, Y = torch.randn(4096, 20), torch.randint(0, 2, (4096,))
ds = TensorDataset(X, Y)
{loader}
model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)"""
STEP = "    loss = torch.nn.functional.cross_entropy(model(xb), yb)\n    loss.backward()"


def loader_advice(ip, cell: str) -> Advice | None:
    """The input-pipeline advice on `cell`, run once before (a warm run: autograd's first
    backward is slow), on one thread (a busy machine's cores stretch a small matmul on two
    threads from 20 µs to 7 ms, and the model's share with it)."""
    ip.run_cell(cell)
    found = [a for a in profile(ip, "", cell).advice if a.rule == "input pipeline"]
    return found[0] if found else None


def test_a_tensor_dataset_is_advised_one_index_a_batch_not_workers(ip, one_thread):
    """Issue 36, 4: the textbook loop's time in its DataLoader is per-row indexing of
    tensors in memory (two selects a row, a stack a batch); workers made it 5x slower.
    The loader advised, typed, gives the same batches: each row once, 64 a batch."""
    ip.run_cell(TEXTBOOK.format(loader="loader = DataLoader(ds, batch_size=256, shuffle=True)"))
    pipe = loader_advice(ip, f"for xb, yb in loader:\n{STEP}")
    assert pipe.example == ("DataLoader(ds, sampler=BatchSampler(RandomSampler(ds), 256, "
                            "drop_last=False), batch_size=None)")
    assert ("indexing tensors in memory one row at a time (512 index calls and a stack a "
            "batch)") in pipe.text
    assert f"index each batch at once, {pipe.example}" in pipe.text
    assert "num_workers" not in pipe.text and "workers would not speed it" in pipe.text
    ip.run_cell("from torch.utils.data import BatchSampler, RandomSampler")
    batches = list(eval(pipe.example, ip.user_ns))
    assert [len(xb) for xb, _ in batches] == [256] * 16
    rows = torch.cat([xb for xb, _ in batches])
    assert torch.equal(rows[rows[:, 0].argsort()], ip.user_ns["X"][ip.user_ns["X"][:, 0].argsort()])


@pytest.mark.parametrize("loader, said", [
    ("loader = DataLoader(torch.utils.data.Subset(ds, range(3000)), batch_size=200)",
     "DataLoader(loader.dataset, sampler=BatchSampler(SequentialSampler(loader.dataset), 200, "
     "drop_last=False), batch_size=None)"),
    ("loader = DataLoader(ds, batch_size=300, shuffle=True, drop_last=True)",
     "DataLoader(ds, sampler=BatchSampler(RandomSampler(ds), 300, drop_last=True), "
     "batch_size=None)"),
], ids=["a subset, in order", "drop_last"])
def test_the_one_index_a_batch_loader_keeps_the_loaders_order_and_batches(ip, loader, said,
                                                                         one_thread):
    ip.run_cell(TEXTBOOK.format(loader=loader))
    pipe = loader_advice(ip, f"for xb, yb in loader:\n{STEP}")
    assert pipe.example == said
    ip.run_cell("from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler")
    typed = [len(xb) for xb, _ in eval(pipe.example, ip.user_ns)]
    assert typed == [len(xb) for xb, _ in ip.user_ns["loader"]]


def test_a_loader_made_in_the_cell_over_a_tensor_dataset_is_advised_one_index_a_batch(
        ip, one_thread):
    ip.run_cell(TEXTBOOK.format(loader=""))
    cell = f"for xb, yb in DataLoader(ds, batch_size=256, shuffle=True):\n{STEP}"
    pipe = loader_advice(ip, cell)
    assert ("DataLoader(ds, sampler=BatchSampler(RandomSampler(ds), batch_size, "
            "drop_last=False), batch_size=None)") in pipe.text
    assert pipe.example is None and "num_workers" not in pipe.text


def test_a_dataset_that_indexes_tensors_is_read_from_its_ops(ip, one_thread):
    """A dataset of the notebook's that only indexes its tensors reads as a TensorDataset
    does, from the ops each batch called."""
    ip.run_cell(TEXTBOOK.format(loader="") + "\n" + (
        "class Rows(torch.utils.data.Dataset):\n    def __len__(self):\n        return 4096\n"
        "    def __getitem__(self, i):\n        return X[i], Y[i]\n"
        "loader = DataLoader(Rows(), batch_size=256)"))
    pipe = loader_advice(ip, f"for xb, yb in loader:\n{STEP}")
    assert "indexing tensors in memory one row at a time" in pipe.text
    assert "num_workers" not in pipe.text


def test_a_loader_that_indexes_a_batch_at_once_is_not_advised(ip):
    """Neither remedy would help: one index a batch already, and workers would add the
    crossing."""
    ip.run_cell(TEXTBOOK.format(loader=(
        "loader = DataLoader(ds, sampler=torch.utils.data.BatchSampler("
        "torch.utils.data.RandomSampler(ds), 256, drop_last=False), batch_size=None)")))
    assert loader_advice(ip, f"for xb, yb in loader:\n{STEP}") is None


def _loader_events(next_ns: int, inside: list[tuple[str, int]] = (),
                   wall_ns: int = 1_000_000) -> tuple[list[Event], dict[str, tuple[str, str]]]:
    """A loop line whose DataLoader __next__ (one batch) took `next_ns` of the wall, calling
    the `inside` ops (name, ns) one after the other."""
    events = [Event("tdm:In[1] 2: for batch in loader:", "line", 0, wall_ns),
              Event("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "op",
                    10, 10 + next_ns)]
    t = 20
    for name, ns in inside:
        events.append(Event(name, "op", t, t + ns))
        t += ns + 1
    return events, {events[0].name: ("2", "for batch in loader:")}


def test_a_loader_under_its_share_of_the_wall_is_not_advised():
    events, names = _loader_events(40_000)  # 4%: under tb's 5%
    advice = advise(events, analyse(events, names), names, Setting(1e-3, cores=4))
    assert "input pipeline" not in rules(advice)


def test_with_a_cuda_device_the_loader_advice_adds_pinned_copies():
    events, names = _loader_events(500_000_000, wall_ns=10**9)  # half a second's loading
    advice = advise(events, analyse(events, names), names, Setting(1.0, cores=4, cuda=True))
    [pipe] = [a for a in advice if a.rule == "input pipeline"]
    assert pipe.line == "2" and "num_workers=1 (4 cores)" in pipe.text  # 1 overlaps the rest
    assert "pin_memory=True with .to(device, non_blocking=True)" in pipe.text


def test_as_many_workers_are_advised_as_bring_the_loading_under_the_rest():
    events, names = _loader_events(900_000_000, wall_ns=10**9)  # 0.9 s loading, 0.1 s rest
    advice = advise(events, analyse(events, names), names, Setting(1.0, cores=16))
    [pipe] = [a for a in advice if a.rule == "input pipeline"]
    assert "num_workers=9 (16 cores)" in pipe.text


def test_rows_indexed_one_at_a_time_read_from_the_ops_alone():
    events, names = _loader_events(
        500_000, [("aten::select", 2_000)] * 128 + [("aten::stack", 20_000)] * 2)
    advice = advise(events, analyse(events, names), names, Setting(1e-3, cores=4))
    [pipe] = [a for a in advice if a.rule == "input pipeline"]
    assert "one row at a time (128 index calls and a stack a batch)" in pipe.text
    assert pipe.example is None
    assert "where the dataset takes a list of indices (a TensorDataset does)" in pipe.text


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
