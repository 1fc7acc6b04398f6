"""Who holds tensors that no name holds: `%tensors --hidden`, the traceback note, `%gpufree`."""

from __future__ import annotations

import os
import sys
import weakref
from concurrent.futures.process import BrokenProcessPool

import pytest
import torch
from IPython.core.error import UsageError

from torch_device_magic.advice import holders

MIB = 2**20


def cell(ip, source):
    return ip.run_cell(source, store_history=True)


def hidden(ip):
    return {h.name: h for h in ip.run_line_magic("tensors", "--hidden -o")}


def fail(ip, source, error=ValueError):
    with pytest.raises(error):
        cell(ip, source)


@pytest.fixture(autouse=True)
def _no_last_traceback():
    """Each test starts without an earlier test's last traceback."""
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)


# --- %tensors --hidden ------------------------------------------------------------


def test_a_displayed_result_holds_what_del_let_go(ip):
    cell(ip, "big = torch.ones(MIB)".replace("MIB", str(MIB)))
    shown = cell(ip, "big").execution_count
    cell(ip, "del big")
    found = hidden(ip)
    assert list(found) == [f"Out[{shown}]"]  # `_` and `_N` are the same tensor: counted once
    assert found[f"Out[{shown}]"].nbytes == {"cpu": 4 * MIB}


def test_a_result_a_name_still_holds_is_not_hidden(ip):
    cell(ip, "a = torch.ones(1000)")
    cell(ip, "a")
    cell(ip, "a[:10]")  # a view: its storage is a's
    cell(ip, "_b = torch.ones(1000)")
    cell(ip, "_b")  # a name of the user's, though %tensors does not list it
    assert hidden(ip) == {}


def test_a_stored_loss_keeps_its_graph_until_backward(ip):
    cell(ip, "x = torch.randn(512, 512, requires_grad=True)\nloss = x.exp().sum()")
    graph = hidden(ip)["loss's autograd graph"]
    assert graph.nbytes == {"cpu": 512 * 512 * 4}  # exp saved its result; x is the user's
    assert graph.fix == "del loss, or keep loss.detach()"
    cell(ip, "loss.backward()")
    assert hidden(ip) == {}  # backward freed the saved tensors


def test_a_displayed_prediction_that_a_name_holds_keeps_its_graph_through_the_name(ip):
    cell(ip, "x = torch.randn(256, 256, requires_grad=True)\npred = x.exp().exp()")
    cell(ip, "pred")
    assert list(hidden(ip)) == ["pred's autograd graph"]  # not Out[n]: del Out[n] frees nothing


def test_optimizer_state_is_listed(ip):
    cell(ip, "model = torch.nn.Linear(256, 256)\nopt = torch.optim.Adam(model.parameters())\n"
             "model(torch.ones(4, 256)).sum().backward()\nopt.step()")
    state = hidden(ip)["opt's state"]
    assert state.nbytes == {"cpu": 2 * (256 * 256 + 256) * 4}  # exp_avg and exp_avg_sq


def test_the_last_traceback_is_listed_and_the_table_shows(ip, capsys):
    cell(ip, "def f():\n    activations = torch.ones(MIB)\n    raise ValueError('boom')"
         .replace("MIB", str(MIB)))
    fail(ip, "f()")
    assert hidden(ip)["the last traceback"].nbytes == {"cpu": 4 * MIB}
    capsys.readouterr()
    ip.run_line_magic("tensors", "--hidden")
    out = capsys.readouterr().out
    assert "held where no name shows it" in out
    assert "the last traceback  4.0 MiB on cpu  %gpufree" in out


def test_nothing_hidden_says_so(ip, capsys):
    cell(ip, "x = torch.ones(10)")
    capsys.readouterr()
    ip.run_line_magic("tensors", "--hidden")
    assert capsys.readouterr().out.strip() == "held where no name shows it: nothing"


def test_on_an_accelerator_it_says_what_stays_unaccounted():
    report = holders.hidden({"x": torch.ones(10)}, counters={"cuda:0": 2**30, "mps:0": None})
    assert report.reconciled == [
        "cuda:0: the allocator holds 1.0 GiB in tensors; names and the holders above account "
        "for 0 B, 1.0 GiB unaccounted (tensors reached only through closures, modules' "
        "globals or C++ code)"
    ]


def test_filters_with_hidden_are_a_usage_error(ip):
    with pytest.raises(UsageError, match="--hidden takes no filter"):
        ip.run_line_magic("tensors", "--hidden --device cpu")


# --- the note after a failing cell --------------------------------------------------


def big_local(ip, error="ValueError('boom')"):
    cell(ip, f"def f():\n    act = torch.empty(2**25)\n    raise {error}")  # 128 MiB


def last(ip):
    return ip.magics_manager.registry["TorchDeviceMagics"].reporter.history.records()[-1]


NOTE = ("the last traceback keeps tensors alive in its frames' locals (128.0 MiB on cpu): "
        "%gpufree gives it back")


def test_a_failing_cell_whose_traceback_keeps_tensors_gets_a_note(ip, capsys):
    big_local(ip)
    fail(ip, "f()")
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines.count(NOTE) == 1  # under the report line, once: not a hint as well
    assert lines[lines.index(NOTE) - 1].startswith("time ")
    assert "Hint" not in out
    (note,) = last(ip).notes
    assert (note.rule, note.figure, note.where) == ("traceback", 128 * MIB, "the last traceback")
    assert note.text == NOTE
    assert ip.run_line_magic("devhistory", "-o")[-1].notes == (note,)


def test_an_interrupted_cell_gets_it_too(ip, capsys):
    big_local(ip, "KeyboardInterrupt")
    fail(ip, "f()", KeyboardInterrupt)
    assert capsys.readouterr().out.splitlines().count(NOTE) == 1
    assert [n.rule for n in last(ip).notes] == ["traceback"]


def test_small_locals_and_the_users_own_tensors_get_no_note(ip, capsys):
    cell(ip, "big = torch.empty(2**25)\ndef g(t):\n    small = torch.ones(10)\n"
             "    raise ValueError('boom')")
    fail(ip, "g(big)")  # its local t is the user's big: the traceback keeps nothing more
    assert "the last traceback" not in capsys.readouterr().out
    assert last(ip).notes == ()
    fail(ip, "raise ValueError('an ordinary failing cell')")
    assert last(ip).notes == ()


def test_no_note_with_advice_off(ip, capsys):
    ip.run_line_magic("config", "TorchDeviceMagics.advice = False")
    big_local(ip)
    fail(ip, "f()")
    assert "the last traceback" not in capsys.readouterr().out
    assert last(ip).notes == ()


# --- %gpufree ---------------------------------------------------------------------


def test_gpufree_releases_a_displayed_result_and_says_so(ip, capsys):
    cell(ip, "big = torch.ones(MIB)\nref = __import__('weakref').ref(big)".replace("MIB", str(MIB)))
    shown = cell(ip, "big").execution_count
    cell(ip, "kept = torch.ones(10)")
    kept_at = cell(ip, "kept").execution_count
    cell(ip, "del big")
    capsys.readouterr()
    ip.run_line_magic("gpufree", "")
    out = capsys.readouterr().out
    assert out.startswith(f"released Out[{shown}] 4.0 MiB; garbage collected (")
    assert ip.user_ns["ref"]() is None
    assert shown not in ip.user_ns["Out"] and f"_{shown}" not in ip.user_ns
    assert ip.user_ns["Out"][kept_at] is ip.user_ns["kept"]  # a name holds it: it stays
    assert ip.user_ns["_"] is ip.user_ns["kept"]


def test_gpufree_releases_the_last_traceback(ip, capsys):
    cell(ip, "import weakref\nrefs = []\ndef f():\n    act = torch.ones(MIB)\n"
             "    refs.append(weakref.ref(act))\n    raise ValueError('boom')"
         .replace("MIB", str(MIB)))
    fail(ip, "f()")
    assert ip.user_ns["refs"][0]() is not None
    capsys.readouterr()
    ip.run_line_magic("gpufree", "")
    assert capsys.readouterr().out.startswith("released the last traceback 4.0 MiB; ")
    assert ip.user_ns["refs"][0]() is None


def test_the_activations_a_locals_graph_saved_are_the_tracebacks(ip, capsys):
    """A failing function's local prediction keeps its graph's activations (exp's output,
    saved for `* w`): the traceback's, and %gpufree gives them back."""
    cell(ip, f"import weakref\nw = torch.ones({MIB}, requires_grad=True)\nrefs = []\n"
             "def f():\n    act = w.exp()\n    refs.append(weakref.ref(act))\n"
             "    out = act * w\n    del act\n    raise ValueError('boom')")
    fail(ip, "f()")
    assert hidden(ip)["the last traceback"].nbytes == {"cpu": 8 * MIB}
    capsys.readouterr()
    ip.run_line_magic("gpufree", "")
    assert capsys.readouterr().out.startswith("released the last traceback 8.0 MiB; ")
    assert ip.user_ns["refs"][0]() is None


def test_gpufree_leaves_the_users_graphs_and_state_and_names_the_graphs(ip, capsys):
    cell(ip, "x = torch.randn(64, 64, requires_grad=True)\nloss = x.exp().sum()")
    capsys.readouterr()
    ip.run_line_magic("gpufree", "")
    assert capsys.readouterr().out.rstrip().endswith(
        "; still held: loss's autograd graph 16.0 KiB (del loss, or keep loss.detach())")
    assert "loss's autograd graph" in hidden(ip)
    cell(ip, "loss.backward()")
    assert ip.user_ns["x"].grad is not None


def test_graph_walk_reads_a_custom_functions_saved_tensors():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            ctx.save_for_backward(t * 1)
            return t * t

        @staticmethod
        def backward(ctx, grad):
            (t,) = ctx.saved_tensors
            return 2 * t * grad

    x = torch.ones(100, requires_grad=True)
    y = Square.apply(x)
    saved = list(holders.graph_tensors([y]))
    assert [t.shape for t in saved] == [torch.Size([100])]
    assert weakref.ref(saved[0])() is not None


# --- other processes on the GPU -----------------------------------------------------


def device_lines(ip, capsys):
    capsys.readouterr()
    ip.run_line_magic("device", "")
    return [line.strip() for line in capsys.readouterr().out.splitlines()]


def test_device_names_other_processes_on_each_gpu_and_not_this_one(ip, monkeypatch, capsys):
    from fakegpu import GIB, FakeMachine, Gpu

    me = os.getpid()
    FakeMachine([Gpu(processes={4242: 8 * GIB, me: GIB, 77: GIB // 2, 78: None}),
                 Gpu(processes={me: GIB})]).install(monkeypatch)
    lines = device_lines(ip, capsys)
    assert ("cuda:0: other processes hold 8.5 GiB (pid 4242 8.0 GiB, pid 77 512.0 MiB); "
            "an old kernel of yours? shut it down to get it back") in lines
    assert not any(line.startswith("cuda:1: other processes") for line in lines)


def test_device_says_nothing_of_processes_when_there_are_none(ip, monkeypatch, capsys):
    from fakegpu import FakeMachine, Gpu

    FakeMachine([Gpu(processes={os.getpid(): 2**30})]).install(monkeypatch)
    assert not any("other processes" in line for line in device_lines(ip, capsys))


def test_out_of_memory_hint_names_other_processes_on_that_gpu(ip, monkeypatch, capsys):
    from fakegpu import GIB, FakeMachine, Gpu

    machine = FakeMachine([Gpu(processes={4242: 3 * GIB}),
                           Gpu(processes={4243: 70 * GIB})]).install(monkeypatch)
    machine.start_cuda(1)
    fail(ip, "raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB. "
             "GPU 1 has a total capacity of 79.15 GiB of which 1.50 GiB is free.')",
         torch.OutOfMemoryError)
    out = capsys.readouterr().out
    assert "  cuda:1: other processes hold 70.0 GiB (pid 4243 70.0 GiB); " in out
    assert "pid 4242" not in out


# --- hints: workers that cannot unpickle a notebook class, a fork after intra-op threads -----


def test_a_spawned_worker_that_cannot_find_a_notebook_function_gets_a_hint(ip, capsys):
    cell(ip, "import concurrent.futures, multiprocessing\ndef square(v):\n    return v * v")
    fail(ip, "with concurrent.futures.ProcessPoolExecutor(1, mp_context="
             "multiprocessing.get_context('spawn')) as pool:\n    list(pool.map(square, [3]))",
         BrokenProcessPool)  # the worker's AttributeError goes to its stderr only
    out = capsys.readouterr().out
    assert ("Hint (torch_device_magic): worker processes started with spawn or forkserver "
            "import the notebook's __main__ afresh and cannot find square, defined in a "
            "cell, to unpickle.") in out
    assert "Fix: move it into a .py file next to the notebook" in out


@pytest.mark.parametrize("module", ["<module '__main__' (built-in)>",
                                    "<module '__mp_main__' from '/x/ipykernel_launcher.py'>"])
def test_the_unpickling_error_itself_names_the_class(ip, capsys, module):
    fail(ip, f"raise AttributeError(\"Can't get attribute 'Net' on {module}\")", AttributeError)
    assert "cannot find Net, defined in a cell, to unpickle" in capsys.readouterr().out


def test_other_attribute_errors_get_no_hint(ip, capsys):
    fail(ip, "torch.nothing_here", AttributeError)
    assert "Hint" not in capsys.readouterr().out


@pytest.mark.slow
def test_a_spawned_dataloader_worker_that_dies_on_a_notebook_dataset_gets_a_hint(ip, capsys):
    cell(ip, "class Squares(torch.utils.data.Dataset):\n"
             "    def __len__(self):\n        return 4\n"
             "    def __getitem__(self, i):\n        return i * i\n"
             "loader = torch.utils.data.DataLoader(Squares(), num_workers=1, "
             "multiprocessing_context='spawn')")
    fail(ip, "next(iter(loader))", RuntimeError)
    out = capsys.readouterr().out
    assert "cannot find Squares, defined in a cell, to unpickle" in out


def interrupt_join(ip, context):
    cell(ip, f"import multiprocessing, os, signal, threading, time\n"
             f"child = multiprocessing.get_context({context!r}).Process(target=time.sleep, "
             f"args=(60,))\nchild.start()")
    try:
        fail(ip, "threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
                 "child.join()", KeyboardInterrupt)
    finally:
        ip.user_ns["child"].kill()
        ip.user_ns["child"].join()


def test_ctrl_c_while_joining_a_forked_child_suggests_one_thread_or_spawn(ip, capsys):
    torch.set_num_threads(2)
    interrupt_join(ip, "fork")
    out = capsys.readouterr().out
    assert "Hint (torch_device_magic): interrupted while waiting on a forked process (pid " in out
    assert "torch.set_num_threads(1) first thing in the child" in out


@pytest.mark.parametrize("context, threads", [("spawn", 2), ("fork", 1)])
def test_no_fork_hint_for_a_spawned_child_or_one_thread(ip, capsys, context, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        interrupt_join(ip, context)
    finally:
        torch.set_num_threads(before)
    assert "Hint" not in capsys.readouterr().out


def test_device_says_bf16_is_emulated_below_compute_capability_8(ip, monkeypatch, capsys):
    from fakegpu import FakeMachine, Gpu

    FakeMachine([Gpu("Tesla T4", capability=(7, 5))]).install(monkeypatch)
    lines = device_lines(ip, capsys)
    assert ("cuda:0 (Tesla T4): compute capability 7.5 has no native bfloat16; "
            "torch.cuda.is_bf16_supported() may say True, but bf16 is emulated and slow there: "
            "use float16 with torch.amp.GradScaler") in lines
    monkeypatch.undo()
    FakeMachine([Gpu()]).install(monkeypatch)  # an A100: 8.0
    assert not any("bfloat16" in line for line in device_lines(ip, capsys))


def test_a_checkpointed_region_is_not_recomputed_to_count_its_graph(ip):
    cell(ip, "from torch.utils.checkpoint import checkpoint\nruns = []\n"
             "def block(t):\n    runs.append(1)\n    return t.exp().exp()\n"
             "x = torch.randn(1000, requires_grad=True)\n"
             "loss = checkpoint(block, x, use_reentrant=False).sum()")
    hidden(ip)
    assert ip.user_ns["runs"] == [1]  # the saved-tensor hooks were not run


# --- issue 29: only what a holder alone keeps alive, found cheaply -------------------

DATASET = """
class Images:
    def __init__(self):
        self.images = torch.empty(2**25)  # 128 MiB
    def __getitem__(self, i):
        img = self.images[i * 1000:(i + 1) * 1000]
        raise ValueError('boom')
ds = Images()
"""


def test_a_datasets_views_of_its_own_images_are_not_the_tracebacks(ip, capsys):
    """Point 2: `ds` holds the images the traceback's views share: letting go frees nothing."""
    cell(ip, DATASET)
    fail(ip, "ds[0]")
    assert "the last traceback" not in capsys.readouterr().out
    assert last(ip).notes == ()
    assert "the last traceback" not in hidden(ip)
    ip.run_line_magic("gpufree", "")
    assert "released" not in capsys.readouterr().out
    frames = [f for f, _ in __import__("traceback").walk_tb(sys.last_value.__traceback__)]
    assert "img" in frames[-1].f_locals  # kept for %debug


def test_a_tensor_an_object_also_holds_is_not_the_tracebacks(ip, capsys):
    """Point 2: a Trainer's plain attribute, and a module's, hold what the frame holds."""
    cell(ip, "class Trainer:\n    def step(self):\n        self.cache = torch.empty(2**25)\n"
             "        act = self.cache\n        raise ValueError('boom')\n"
             "trainer = Trainer()\nnet = torch.nn.Linear(2, 2)\n"
             "def fwd():\n    net.cache = torch.empty(2**25)\n    act = net.cache\n"
             "    raise ValueError('boom')")
    for source in ("trainer.step()", "fwd()"):
        fail(ip, source)
        assert last(ip).notes == (), source
        assert "the last traceback" not in hidden(ip), source
    assert "the last traceback" not in capsys.readouterr().out


def test_gpufree_says_what_came_back_measured(ip, capsys):
    """Point 2: the figure is what letting go freed, not what was counted before."""
    cell(ip, "def f():\n    act = torch.ones(MIB)\n    view = act[:10]\n"
             "    raise ValueError('boom')".replace("MIB", str(MIB)))
    fail(ip, "f()")
    found = {h.name: h for h in holders.release(ip.user_ns, ip.user_ns_hidden)}
    assert found["the last traceback"].came_back() == {"cpu": 4 * MIB}  # both gone, once


def test_gpufree_says_when_letting_go_of_a_holder_freed_nothing(ip, capsys):
    """A result let go of whose tensors something unseen keeps (here its finaliser) is
    not 'released ... 0 B': nothing came back, and the line says so."""
    cell(ip, "kept = []\nclass Cache:\n    def __init__(self, t):\n        self.t = t\n"
             "    def __del__(self):  # keeps what it held\n        kept.append(self.t)")
    cached = cell(ip, f"Cache(torch.ones({MIB}))").execution_count
    shown = cell(ip, f"torch.ones({MIB})").execution_count
    capsys.readouterr()
    ip.run_line_magic("gpufree", "")
    out = capsys.readouterr().out
    assert out.startswith(f"released Out[{shown}] 4.0 MiB; let go of Out[{cached}], but "
                          "nothing came back (something else still holds its tensors); "
                          "garbage collected (")
    assert " 0 B" not in out and ip.user_ns["kept"][0].numel() == MIB


def test_every_ipython_reference_to_a_result_is_a_holder(ip):
    """Point 3: after `del Out[n]`, `_n`, `_` and the last result still hold it."""
    shown = cell(ip, f"torch.ones({MIB})").execution_count
    cell(ip, f"del Out[{shown}]")
    assert list(hidden(ip)) == [f"_{shown}"]
    assert hidden(ip)[f"_{shown}"].nbytes == {"cpu": 4 * MIB}
    assert hidden(ip)[f"_{shown}"].fix == "%gpufree (_ holds it too)"


@pytest.mark.parametrize(("result", "nbytes"), [
    ("w.sigmoid()", 4 * MIB), ("w.exp() * w", 8 * MIB), (f"torch.ones({2 * MIB})[::2]", 8 * MIB),
    ("w.exp()[::2]", 4 * MIB),
])
def test_what_only_a_results_cpp_holds_is_the_results_and_gpufree_frees_it(
    ip, capsys, result, nbytes
):
    """Issue 36, point 8: a displayed result whose graph saved the result itself (sigmoid
    saves its output) or an activation (exp's, for `* w`), or a view whose base only it
    keeps, is IPython's to hold, `_n` alone after `del Out[n]`; %gpufree lets go of it
    and the memory comes back."""
    cell(ip, f"import weakref\nw = torch.ones({MIB}, requires_grad=True)")
    shown = cell(ip, result).execution_count
    cell(ip, f"ref = weakref.ref(_{shown})\ndel Out[{shown}]")
    found = hidden(ip)
    assert list(found) == [f"_{shown}"] and found[f"_{shown}"].nbytes == {"cpu": nbytes}
    capsys.readouterr()
    ip.run_line_magic("gpufree", "")
    assert capsys.readouterr().out.startswith(f"released _{shown} {nbytes // MIB}.0 MiB; ")
    assert ip.user_ns["ref"]() is None and hidden(ip) == {}


def test_a_results_graph_that_a_name_also_holds_is_not_the_results(ip):
    """The activations a user's `loss` keeps through the same graph are the loss's."""
    cell(ip, f"w = torch.ones({MIB}, requires_grad=True)\nh = w.exp()\nloss = h.sum()")
    shown = cell(ip, "h * w").execution_count
    cell(ip, "del h")
    found = hidden(ip)
    assert set(found) == {f"Out[{shown}]", "loss's autograd graph"}
    assert found["loss's autograd graph"].nbytes == {"cpu": 4 * MIB}  # exp's output: once
    assert found[f"Out[{shown}]"].nbytes == {"cpu": 4 * MIB}  # the product alone


def test_the_results_ipython_keeps_as_double_and_triple_underscore_are_holders(ip):
    """Point 3: one result later, `__` still holds a result whose `Out[n]` and `_n` are
    gone; two later, `___`; three later, nothing."""
    shown = cell(ip, f"torch.ones({MIB})").execution_count
    cell(ip, f"del Out[{shown}], _{shown}")
    ip.user_ns_hidden.pop(f"_{shown}", None)  # IPython's copy of the name: gone too
    cell(ip, "1")
    assert list(hidden(ip)) == ["__"] and hidden(ip)["__"].nbytes == {"cpu": 4 * MIB}
    cell(ip, "2")
    assert list(hidden(ip)) == ["___"]
    cell(ip, "3")  # IPython keeps three results: it is let go of
    assert list(hidden(ip)) == []


def test_gpufree_lets_go_of_the_last_result_too(ip, capsys):
    """Point 3: in the next cell, IPython's last execution result still holds the tensor;
    %gpufree lets go of it as %xdel does, so the memory comes back in that cell."""
    cell(ip, "import weakref\nrefs = []")
    shown = cell(ip, "(lambda t: (refs.append(weakref.ref(t)), t)[1])"
                     f"(torch.ones({MIB}))").execution_count
    capsys.readouterr()
    cell(ip, "%gpufree\nalive = refs[-1]() is not None")
    assert ip.user_ns["alive"] is False
    assert capsys.readouterr().out.startswith(f"released Out[{shown}] 4.0 MiB; ")


def test_a_failing_cell_walks_no_namespace_and_each_object_once(ip, monkeypatch):
    """Point 1: a traceback of 300 frames that all hold one list, beside a namespace
    name holding 100,000 tensors: the note walks neither the namespace nor the list twice."""
    import gc

    from torch_device_magic import namespace

    cell(ip, "data = [torch.zeros(1) for _ in range(100_000)]\n"
             "def deep(items, n):\n    return deep(items, n - 1) if n else items[0].boom\n"
             "def start():\n    return deep([torch.zeros(1) for _ in range(3000)], 300)")
    walked = []
    monkeypatch.setattr(namespace, "_walk", lambda *a: walked.append(a))
    looked: dict[int, int] = {}
    referents = gc.get_referents

    def counted(*objs):
        for obj in objs:
            looked[id(obj)] = looked.get(id(obj), 0) + 1
        return referents(*objs)

    monkeypatch.setattr(gc, "get_referents", counted)
    fail(ip, "start()", AttributeError)
    assert walked == []
    assert max(looked.values()) == 1 and len(looked) > 3000  # the list's tensors, once each


def test_a_traceback_past_the_budget_says_nothing():
    """Point 1: past its budget the walk stops, and the note and --hidden count nothing."""
    def f():
        items = [torch.zeros(1) for _ in range(50)]  # noqa: F841
        raise ValueError("boom")

    try:
        f()
    except ValueError as err:
        assert holders.traceback_bytes(err, budget=1000) == {"cpu": 50 * 4}
        assert holders.traceback_bytes(err, budget=20) is None
        assert holders.traceback_walk(err, budget=20).kept() == {}
