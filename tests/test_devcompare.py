"""%%devcompare on cpu and meta: copies in, namespace exactly as before, honest comparisons."""

from __future__ import annotations

import math
import sys
import warnings
from collections import namedtuple

import pytest
import torch
from IPython.core.error import UsageError

from torch_device_magic import devcompare
from torch_device_magic.devcompare import Comparison, DeviceTiming, difference
from torch_device_magic.probes import torch_default_device

Pair = namedtuple("Pair", "x y")
NAN, INF = math.nan, math.inf


def snapshot(ip):
    """Every binding by identity, each tensor's device and values, torch's default device."""
    ns = ip.user_ns
    tensors = {k: (v.device, v.clone()) for k, v in ns.items() if isinstance(v, torch.Tensor)}
    return {k: id(v) for k, v in ns.items()}, tensors, torch_default_device()


def assert_unchanged(ip, before):
    ids, tensors, default = snapshot(ip)
    assert ids == before[0]
    for name, (dev, values) in before[1].items():
        assert tensors[name][0] == dev and torch.equal(tensors[name][1], values), name
    assert default == before[2]


@pytest.fixture
def nsip(ip):
    ip.run_cell(
        "a = torch.arange(6.0).reshape(2, 3); v = a[0]; w = torch.ones(3, requires_grad=True)\n"
        "model = torch.nn.Linear(3, 2); opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "seen = []"
    )
    return ip


def compare(ip, line, cell):
    return ip.run_cell_magic("devcompare", line, cell)


def test_cpu_meta_leaves_the_namespace_exactly_as_before(nsip):
    before = snapshot(nsip)
    result = compare(
        nsip, "cpu meta -n 2 --warmup 1 -o",
        "a += 1\nmodel.weight.data.zero_()\nopt.zero_grad()\nnew_name = model(v)\nnew_name",
    )
    assert_unchanged(nsip, before)
    assert isinstance(result, Comparison)
    assert [d.device for d in result.devices] == ["cpu", "meta"]
    assert [len(d.runs_s) for d in result.devices] == [2, 2]
    assert result.devices[0].speedup == 1.0 and result.devices[1].max_abs_diff is None


def test_each_device_gets_its_own_copies_default_device_and_device_name(nsip):
    compare(nsip, "cpu meta -n 1 --warmup 0",
            "seen.append((str(device), str(torch.zeros(1).device), str(a.device)))")
    # `seen` holds no tensor, so it is not copied: the one place a cell can leave a trace
    assert nsip.user_ns["seen"] == [("cpu", "cpu", "cpu"), ("meta", "meta", "meta")]


def test_copies_keep_aliases_and_views_on_every_device(nsip):
    result = compare(
        nsip, "cpu meta -n 1 -o",
        "(v.untyped_storage()._cdata == a.untyped_storage()._cdata,\n"
        " opt.param_groups[0]['params'][0] is model.weight)",
    )
    assert result.devices[1].max_abs_diff == 0.0  # (True, True) on both devices


def test_an_input_with_autograd_history_is_copied_too(nsip):
    nsip.run_cell("y = w * 2")
    result = compare(nsip, "cpu meta -n 1 -o", "y.shape[0]")
    assert result.devices[1].max_abs_diff == 0.0


def test_compare_needs_no_shell_only_a_namespace_and_a_run_function():
    x = torch.arange(3.0)
    ns = {"x": x, "seen": [], "n": 1}

    def run():
        ns["seen"].append(ns["x"].device.type)
        ns["bound"] = ns["n"] = 2
        return ns["x"] * 2

    cpu, meta = torch.device("cpu"), torch.device("meta")
    result = devcompare.compare(ns, run, ["x", "seen", "n", "absent"], [cpu, meta], 2, 1)
    assert ns == {"x": x, "seen": ["cpu"] * 3 + ["meta"] * 3, "n": 1} and ns["x"] is x
    assert [d.device for d in result.devices] == ["cpu", "meta"]
    assert [len(d.runs_s) for d in result.devices] == [2, 2]


def test_ipythons_own_names_are_never_copied(nsip):
    nsip.run_cell("a.sum()", store_history=True)  # Out now holds a tensor
    out = nsip.user_ns["Out"]
    assert any(isinstance(v, torch.Tensor) for v in out.values())
    compare(nsip, "cpu meta -n 1 --warmup 0", "seen.append(id(Out))")
    assert nsip.user_ns["seen"] == [id(out), id(out)]


def test_a_failure_says_on_which_device_and_restores_everything(nsip, capsys):
    before = snapshot(nsip)
    with pytest.raises(RuntimeError, match="cannot be called on meta tensors"):
        nsip.run_cell("%%devcompare cpu meta\nlost = 1\n(a @ a.T).sum().item()")
    assert "%%devcompare: the cell failed on meta" in capsys.readouterr().err
    assert_unchanged(nsip, before)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_inputs_that_cannot_be_copied_are_one_short_sentence(nsip):
    nsip.run_cell("nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])")
    before = {k: id(v) for k, v in nsip.user_ns.items()}  # torch.equal refuses nested tensors
    with pytest.raises(UsageError) as err:
        nsip.run_cell("%%devcompare cpu meta\nnt")
    assert type(err.value) is UsageError
    assert str(err.value) == (
        "%%devcompare could not copy the cell's inputs: Could not run 'aten::new_empty' "
        "with arguments from the 'NestedTensorCPU' backend"
    )
    assert {k: id(v) for k, v in nsip.user_ns.items()} == before


def test_inputs_that_cannot_move_do_not_say_the_cell_failed(nsip, capsys):
    nsip.run_cell("m = torch.ones(2, device='meta')")
    with pytest.raises(UsageError, match=r"Could not move m .* to cpu: it is on the meta device"):
        nsip.run_cell("%%devcompare cpu meta\nran = m")
    assert "the cell failed" not in capsys.readouterr().err
    assert "ran" not in nsip.user_ns


def test_the_table_reads_well(nsip, capsys):
    nsip.run_cell("%%devcompare cpu meta -n 3\na @ a.T")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "%%devcompare: 3 runs per device after 1 warm-up"
    assert out[1].split("  ")[0] == "device"
    assert "max |difference| vs cpu" in out[1]
    assert out[3].startswith("cpu") and "1.00×" in out[3]
    assert out[4].startswith("meta") and out[4].split()[-3:] == ["n/a", "not", "comparable"]


def test_speedup_is_relative_to_the_first_device():
    comparison = Comparison(
        [DeviceTiming("cpu", [0.4, 0.2, 0.3], 1.0, None),
         DeviceTiming("cuda:0", [0.01, 0.03, 0.02], 15.0, 1e-6)],
        warmup=2,
    )
    assert comparison.devices[1].median_s == 0.02
    text = str(comparison)
    assert "15.00×" in text and "1e-06" in text and "after 2 warm-ups" in text
    assert "<table>" in comparison._repr_mimebundle_()["text/html"]


@pytest.mark.parametrize(("a", "b", "expected"), [
    (torch.ones(3), torch.ones(3), 0.0),
    (torch.ones(3), torch.tensor([1.0, 1.5, 0.75]), 0.5),
    (torch.ones(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), 1.0),
    (torch.ones(3), torch.ones(3, device="meta"), None),
    (torch.ones(3), torch.ones(4), None),
    ([torch.ones(1), {"k": torch.zeros(1)}], [torch.ones(1), {"k": torch.ones(1)}], 1.0),
    (Pair(torch.ones(1), 2.0), Pair(torch.ones(1), 2.5), 0.5),
    ([torch.ones(1)], (torch.ones(1),), None),
    ({"k": 1}, {"j": 1}, None),
    (None, None, None),
    (3, 3.25, 0.25),
    (torch.empty(0), torch.empty(0), 0.0),
    (torch.tensor([NAN, 1.0, INF]), torch.tensor([NAN, 1.5, INF]), 0.5),
    (torch.tensor([NAN, 1.0]), torch.tensor([NAN, 1.0], dtype=torch.float64), 0.0),
    ((NAN, torch.ones(1)), (NAN, torch.ones(1)), 0.0),
])
def test_difference(a, b, expected):
    assert difference(a, b) == expected


@pytest.mark.parametrize(("a", "b"), [
    (torch.tensor([NAN, 1.0]), torch.tensor([1.0, NAN])),
    (torch.tensor([NAN]), torch.tensor([1.0])),
    ([2.0, NAN], [2.0, 1.0]),
    ([torch.tensor([NAN]), 5.0], [torch.tensor([0.0]), 1.0]),
])
def test_nan_where_the_other_has_a_number_is_a_nan_difference(a, b):
    assert math.isnan(difference(a, b))


def test_nan_in_different_places_says_so():
    comparison = Comparison(
        [DeviceTiming("cpu", [0.1], 1.0, None), DeviceTiming("cpu:1", [0.1], 1.0, 0.0),
         DeviceTiming("cpu:2", [0.1], 1.0, NAN)], warmup=1,
    )
    rows = str(comparison).splitlines()[3:]
    assert rows[1].split()[-1] == "0" and rows[2].endswith("NaN in different places")


BAD = [
    ("%%devcompare cpu\n1", "%%devcompare needs at least two devices"),
    ("%%devcompare cpu cpu\n1", "%%devcompare got one device twice: cpu and cpu are the same"),
    ("%%devcompare cpu meta cpu:0\n1",
     "%%devcompare got one device twice: cpu and cpu:0 are the same device (cpu)"),
    ("%%devcompare cpu banana\n1", "'banana' is not a device"),
    ("%%devcompare cpu meta -n 0\n1", "%%devcompare needs -n 1 or more"),
    ("%devcompare cpu meta", "%%devcompare is a cell magic"),
]
if not torch.cuda.is_available():
    BAD.append(("%%devcompare cpu cuda\n1", "cuda is not available"))


@pytest.mark.parametrize(("cell", "message"), BAD)
def test_bad_input_is_a_usage_error_and_changes_nothing(nsip, cell, message):
    before = snapshot(nsip)
    with pytest.raises(UsageError) as err:
        nsip.run_cell(cell)
    assert type(err.value) is UsageError
    assert str(err.value).startswith(message)
    assert_unchanged(nsip, before)


def test_objects_holding_tensors_are_copied_not_mutated(nsip):
    nsip.run_cell(
        "from torch.utils.data import TensorDataset\n"
        "class Holder: pass\n"
        "ds = TensorDataset(torch.ones(3)); h = Holder(); h.t = torch.ones(2); h.n = 1\n"
        "sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)"
    )
    ns = nsip.user_ns
    t, before_ds = ns["h"].t, ns["ds"].tensors[0].clone()
    compare(nsip, "cpu meta -n 2", "ds.tensors[0].add_(1)\nh.t = h.t * 2\nh.n += 1\n"
            "opt.step()\nsched.step()")
    assert torch.equal(ns["ds"].tensors[0], before_ds)
    assert ns["h"].t is t and ns["h"].n == 1
    assert ns["opt"].param_groups[0]["lr"] == 0.1 and ns["sched"].last_epoch == 0


def test_a_scheduler_named_alone_does_not_decay_the_real_learning_rate(ip):
    ip.run_cell(
        "model = torch.nn.Linear(2, 2); opt = torch.optim.SGD(model.parameters(), lr=1.0)\n"
        "sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the copies must not make torch warn of an override
        compare(ip, "cpu meta -n 3", "sched.optimizer.step()\nsched.step()")
    assert ip.user_ns["opt"].param_groups[0]["lr"] == 1.0


def test_the_random_state_is_as_if_the_comparison_never_ran(nsip):
    nsip.run_cell("torch.manual_seed(0); expected = torch.rand(1); torch.manual_seed(0)")
    compare(nsip, "cpu meta -n 2", "torch.rand(3) + torch.randn(2, device=device).sum()")
    nsip.run_cell("after = torch.rand(1)")
    assert torch.equal(nsip.user_ns["after"], nsip.user_ns["expected"])


def test_the_cpu_runs_under_no_device_mode_even_with_a_session_device(nsip):
    nsip.run_cell("%device meta")
    compare(nsip, "cpu meta -n 1 --warmup 0",
            "modes = torch.overrides._get_current_function_mode_stack()\n"
            "seen.append((torch.get_default_device().type, [type(m).__name__ for m in modes]))")
    assert nsip.user_ns["seen"][0] == ("cpu", [])
    assert nsip.user_ns["seen"][1][0] == "meta"
    assert torch_default_device() == torch.device("meta")


def test_tensors_are_copied_straight_to_the_target(monkeypatch):
    """Tensors elsewhere than the target are not deep-copied where they are (on a GPU, a
    same-GPU copy; on the host, a second host copy) but copied once, to the target,
    keeping what they are."""

    deep_copied = []
    real = torch.UntypedStorage.__deepcopy__
    monkeypatch.setattr(torch.UntypedStorage, "__deepcopy__",
                        lambda self, memo: deep_copied.append(self) or real(self, memo))
    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    a = torch.arange(6.0).reshape(2, 3)
    w = torch.ones(2, requires_grad=True)
    ns = {"model": model, "a": a, "v": a[1], "w": w, "y": w * 2, "pair": [a, model.weight]}
    copies = devcompare._copies(ns, list(ns), torch.device("meta"), set()).copies
    assert deep_copied == []
    m, pair = copies["model"], copies["pair"]
    assert m is not model and m.weight.device.type == "meta"
    assert type(m.weight) is torch.nn.Parameter and m.weight.requires_grad
    assert pair[1] is m.weight and pair[0] is copies["a"]  # aliases stay aliases
    assert copies["v"].untyped_storage()._cdata == copies["a"].untyped_storage()._cdata
    assert copies["v"].storage_offset() == 3
    assert copies["w"].is_leaf and copies["w"].requires_grad and copies["w"].device.type == "meta"
    assert copies["y"].device.type == "meta" and copies["y"].grad_fn is None
    assert all(t.device.type == "cpu" for t in (a, w, model.weight))  # the originals stay


@pytest.mark.cuda
def test_gpu_inputs_reach_the_cpu_without_a_second_copy_on_the_gpu(nsip):
    nsip.run_cell("big = torch.arange(2**26, device='cuda', dtype=torch.float32)")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    compare(nsip, "cpu meta -n 1 --warmup 0", "seen.append(big.device.type)\n(big * 2).shape")
    assert nsip.user_ns["seen"] == ["cpu", "meta"]
    assert torch.cuda.max_memory_allocated() == held  # nothing was cloned on the GPU
    assert nsip.user_ns["big"].device.type == "cuda"


@pytest.mark.cuda
def test_the_gpus_random_state_is_kept_too(nsip):
    nsip.run_cell(
        "torch.cuda.manual_seed(0); expected = torch.rand(1, device='cuda')\n"
        "torch.cuda.manual_seed(0)"
    )
    compare(nsip, "cpu cuda -n 2", "torch.rand(3, device=device)")
    nsip.run_cell("after = torch.rand(1, device='cuda')")
    assert torch.equal(nsip.user_ns["after"], nsip.user_ns["expected"])


def test_after_comparing_on_the_cpu_our_default_device_is_still_ours(ip):
    ip.run_cell("%device meta")
    ip.run_cell("x = torch.ones(2, device='cpu')")
    ip.run_cell_magic("devcompare", "cpu meta -n 1 --warmup 0", "x + 1")
    assert torch_default_device() == torch.device("meta")  # back after the cpu side
    ip.run_cell("%device reset")  # it knows the default as its own and undoes it
    assert torch_default_device() is None and torch.empty(1).device.type == "cpu"


# --- the functions a cell calls: copies, never the user's objects ---------------------------

TRAIN_STEP = (
    "torch.manual_seed(0)\n"
    "model = torch.nn.Linear(3, 2); opt = torch.optim.Adam(model.parameters(), lr=0.1)\n"
    "batch = torch.randn(4, 3); seen = []\n"
    "def loss_of(out):\n"
    "    return torch.nn.functional.relu(out).pow(2).sum()\n"
    "def train_step():\n"
    "    opt.zero_grad()\n"
    "    loss = loss_of(model(batch))\n"
    "    loss.backward()\n"
    "    opt.step()\n"
    "    seen.append(loss.device.type)\n"
    "    return loss.detach()\n"
    "train_step(); seen.clear()"  # a real step first: Adam has moments and step counts
)


def training_state(ns):
    model, opt = ns["model"], ns["opt"]
    return ([p.detach().clone() for p in model.parameters()],
            [p.grad.clone() for p in model.parameters()],
            [{k: v.clone() for k, v in s.items()} for s in opt.state.values()])


def assert_same_training_state(ns, before):
    params, grads, state = training_state(ns)
    assert all(map(torch.equal, params, before[0])), "the model was trained"
    assert all(map(torch.equal, grads, before[1])), "the gradients changed"
    for now, then in zip(state, before[2]):
        assert now.keys() == then.keys() and all(torch.equal(now[k], then[k]) for k in now)


def test_a_notebook_function_trains_copies_never_the_users_model(ip):
    ip.run_cell(TRAIN_STEP)
    ns = ip.user_ns
    before, opt = training_state(ns), ns["opt"]
    assert [int(s["step"]) for s in opt.state.values()] == [1, 1]
    result = compare(ip, "cpu meta -n 2 -o", "loss = train_step()\nloss")
    assert_same_training_state(ns, before)
    assert [int(s["step"]) for s in opt.state.values()] == [1, 1]
    assert ns["opt"] is opt and "loss" not in ns
    assert ns["seen"] == ["cpu"] * 3 + ["meta"] * 3  # the function ran on each device's copies
    assert result.devices[1].max_abs_diff is None  # computed on meta: no values to compare


def test_the_difference_of_a_function_cell_is_computed_on_the_other_device(ip, tdmdev):
    ip.run_cell(TRAIN_STEP)
    ns = ip.user_ns
    before = training_state(ns)
    result = compare(ip, "cpu tdmdev:0 -n 2 -o", "train_step()")
    assert ns["seen"] == ["cpu"] * 3 + ["tdmdev"] * 3
    assert result.devices[1].max_abs_diff == 0.0  # each device trained its own copy alike
    assert_same_training_state(ns, before)
    assert all(p.device.type == "cpu" for p in ns["model"].parameters())


def test_methods_lambdas_and_decorated_functions_are_followed(ip):
    ip.run_cell(
        "from functools import partial\n"
        "w = torch.zeros(3)\n"
        "class Trainer:\n"
        "    def fit(self):\n"
        "        return bump()\n"
        "@torch.no_grad()\n"
        "def bump():\n"
        "    w.add_(1)\n"
        "    return (lambda: w.sum())()\n"
        "trainer = Trainer(); later = partial(bump)"
    )
    for cell in ("trainer.fit()", "bump()", "later()", "Trainer().fit()"):
        compare(ip, "cpu meta -n 2", cell)
        assert torch.equal(ip.user_ns["w"], torch.zeros(3)), cell


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module of the user's own (a `train.py` next to the notebook) holding a model."""
    (tmp_path / "tdm_user_train.py").write_text(
        "import torch\n"
        "model = torch.nn.Linear(2, 2)\n"
        "def fit():\n"
        "    with torch.no_grad():\n"
        "        model.weight.zero_()\n"
        "    return model.weight.sum()\n"
        "def pure(x):\n"
        "    return x * 2\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "tdm_user_train"
    sys.modules.pop("tdm_user_train", None)


REFUSED = "%%devcompare cannot run this cell on copies: "
NOTHING_RAN = ", which it would change for real; nothing ran (pass them as arguments, or " \
    "define the function in the notebook)"


@pytest.mark.parametrize(("setup", "cell", "why"), [
    ("from tdm_user_train import fit", "fit()",
     "tdm_user_train.fit reads model from its module tdm_user_train"),
    ("import tdm_user_train", "tdm_user_train.fit()",
     "tdm_user_train.fit reads model from its module tdm_user_train"),
    ("import tdm_user_train", "tdm_user_train.model.weight.sum()",
     "tdm_user_train is a module of your own that holds model"),
    ("def make():\n    m = model\n    return lambda: m.weight.sum()\nstep = make()", "step()",
     "step keeps m in a closure"),
    ("def step(m=model):\n    return m.weight.sum()", "step()",
     "step holds m as default arguments"),
    ("def saving(store):\n    def save(m, a, out):\n        store['out'] = out\n    return save\n"
     "model.register_forward_hook(saving({'out': model.weight}))", "model(torch.ones(2))",
     "saving.<locals>.save (forward hook of model) keeps store in a closure"),
])
def test_a_function_whose_tensors_cannot_be_copied_is_refused_in_one_line(
        ip, user_module, setup, cell, why):
    ip.run_cell(f"from tdm_user_train import model\n{setup}")
    weight = ip.user_ns["model"].weight.detach().clone()
    with pytest.raises(UsageError) as err:
        ip.run_cell(f"%%devcompare cpu meta\nran = {cell}")
    assert type(err.value) is UsageError
    assert str(err.value) == REFUSED + why + NOTHING_RAN
    assert "ran" not in ip.user_ns and torch.equal(ip.user_ns["model"].weight, weight)


def test_torch_and_a_modules_pure_functions_are_not_refused(ip, user_module):
    ip.run_cell("import torch.nn.functional as F\nfrom tdm_user_train import pure\n"
                "x = torch.randn(3)\ndef mine(t):\n    return F.relu(torch.matmul(t, t)) + pure(t)")
    result = compare(ip, "cpu meta -n 1 -o", "F.relu(x) + torch.matmul(x, x) + pure(x) + mine(x)")
    assert [d.device for d in result.devices] == ["cpu", "meta"]


@pytest.mark.parametrize("before", ["model(x)", "pass"])  # the dict filled, or still empty
def test_a_forward_hook_writing_into_a_global_writes_into_its_copy(ip, before):
    ip.run_cell(
        "model = torch.nn.Sequential(torch.nn.Linear(3, 2)); x = torch.ones(3)\n"
        "activations = {}\n"
        "def save(module, args, out):\n"
        "    activations['fc1'] = out.detach()\n"
        "model[0].register_forward_hook(save)\n"
        f"{before}"
    )
    activations = ip.user_ns["activations"]
    kept = dict(activations)
    compare(ip, "cpu meta -n 2", "out = model(x)")
    assert ip.user_ns["activations"] is activations and activations == kept
    assert all(t.device.type == "cpu" for t in activations.values())


def test_a_users_module_holding_tensors_its_function_does_not_read_is_not_refused(
        ip, tmp_path, monkeypatch):
    (tmp_path / "tdm_user_utils.py").write_text(
        "import torch\nMEAN = torch.zeros(3)\n"
        "def standardize(x):\n    return (x - x.mean()) / x.std()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        ip.run_cell("import tdm_user_utils as utils\nx = torch.arange(3.0)\n"
                    "def prep(t):\n    return utils.standardize(t) * 2")
        result = compare(ip, "cpu meta -n 1 -o", "prep(x)")
        assert [d.device for d in result.devices] == ["cpu", "meta"]
    finally:
        sys.modules.pop("tdm_user_utils", None)


def test_a_data_loader_with_persistent_workers_is_compared_its_workers_left_alone(ip):
    ip.run_cell(
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "ds = TensorDataset(torch.arange(8.0).reshape(8, 1))\n"
        "loader = DataLoader(ds, batch_size=4, num_workers=1, persistent_workers=True)\n"
        "model = torch.nn.Linear(1, 1)\n"
        "def evaluate():\n"
        "    with torch.device('cpu'):  # the loader draws its seed on the default device\n"
        "        batches = [xb for (xb,) in loader]\n"
        "    seen.append(batches[0].device.type)\n"
        "    with torch.no_grad():\n"
        "        return sum(model(xb.to(device)).sum() for xb in batches)\n"
        "device = torch.device('cpu'); seen = []; expected = evaluate(); seen.clear()"
    )
    ns = ip.user_ns
    workers = ns["loader"]._iterator
    try:
        result = compare(ip, "cpu meta -n 2 -o", "evaluate()")
        assert result.devices[0].max_abs_diff is None and len(result.devices[1].runs_s) == 2
        # what the workers read stays where it is (a forked worker cannot use CUDA): the
        # cell's loop moves the batches it gets
        assert ns["seen"] == ["cpu"] * 6
        assert ns["loader"]._iterator is workers  # the user's live workers are not touched
        ip.run_cell("again = evaluate()")
        assert torch.equal(ns["again"], ns["expected"])
    finally:
        workers._shutdown_workers()  # not left to later tests, whose reports count them


def test_an_iterator_over_a_data_loader_is_refused_in_one_line_saying_what_to_do(ip):
    ip.run_cell(
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "loader = DataLoader(TensorDataset(torch.arange(4.0)), batch_size=2)\n"
        "it = iter(loader)"
    )
    with pytest.raises(UsageError) as err:
        ip.run_cell("%%devcompare cpu meta\nran = next(it)")
    assert str(err.value) == (
        "%%devcompare cannot copy an iterator over a DataLoader that the cell reads "
        "(`iter(loader)`: its place in the epoch and its worker processes cannot be copied); "
        "nothing ran (iterate the DataLoader itself in the cell: for batch in loader)")
    assert "ran" not in ip.user_ns
    assert next(ip.user_ns["it"])[0].tolist() == [0.0, 1.0]  # its place in the epoch kept


# --- generators ---------------------------------------------------------------------------

def test_the_users_own_generators_are_put_back(ip):
    ip.run_cell(
        "from torch.utils.data import DataLoader\n"
        "g = torch.Generator().manual_seed(0); h = torch.Generator().manual_seed(1)\n"
        "loader = DataLoader(list(range(10)), batch_size=5, shuffle=True, generator=h)\n"
        "def draw():\n    return torch.rand(2, generator=g, device='cpu')\n"
        "expected = (torch.rand(3, generator=g), draw(), [b.tolist() for b in loader])\n"
        "g.manual_seed(0); h.manual_seed(1)"
    )
    compare(ip, "cpu meta -n 2",
            "with torch.device('cpu'):  # the DataLoader refuses a meta default device\n"
            "    batch = next(iter(loader))\n"
            "torch.rand(3, generator=g, device='cpu')\n"
            "draw()")
    ip.run_cell("after = (torch.rand(3, generator=g), draw(), [b.tolist() for b in loader])")
    expected, after = ip.user_ns["expected"], ip.user_ns["after"]
    assert torch.equal(after[0], expected[0]) and torch.equal(after[1], expected[1])
    assert after[2] == expected[2]


# --- memory: what the cell only reads is shared, what it writes is copied ------------------

def test_a_tensor_the_cell_only_reads_is_not_copied_on_its_own_device(ip):
    ip.run_cell("from torch.utils.data import TensorDataset\n"
                "ds = TensorDataset(torch.arange(1000.0)); seen = []")
    address = ip.user_ns["ds"].tensors[0].untyped_storage().data_ptr()
    compare(ip, "cpu meta -n 2",
            "seen.append((device.type, ds.tensors[0].untyped_storage().data_ptr()))\n"
            "ds[3][0] * 2")
    on_cpu = {ptr for dev, ptr in ip.user_ns["seen"] if dev == "cpu"}
    assert on_cpu == {address}  # the user's own storage, read in place


@pytest.mark.parametrize("write", [
    "x.add_(1)",
    "x.data.mul_(0)",
    "torch.add(x, 1, out=x)",
    "v = x[2:]; v.zero_()",
    "if x.device.type == 'cpu':\n    x.numpy()[:] = 7",
    "y = torch.zeros(3)\ny.set_(x.untyped_storage()); y.fill_(5)",
    "try:\n    x.add_(1)\nexcept BaseException:\n    pass",
    "torch.optim.SGD([x.requires_grad_()], lr=1.0).step() if False else x.resize_(1)",
    # through no operator, past the version counter: apply_ and map_ are CPU-only
    "if x.device.type == 'cpu':\n    x.apply_(lambda v: v + 1)",
    "if x.device.type == 'cpu':\n    x.map_(x, lambda a, b: a + b)",
    "if x.device.type == 'cpu':\n    x.map2_(x, x, lambda a, b, c: a + b + c)",
])
def test_a_write_into_a_shared_tensor_gets_a_copy_and_the_users_stays(ip, write):
    ip.run_cell("x = torch.arange(6.0); seen = []")
    x, values = ip.user_ns["x"], ip.user_ns["x"].clone()
    compare(ip, "cpu meta -n 2", f"seen.append(device.type)\n{write}")
    assert ip.user_ns["x"] is x and x.shape == values.shape and torch.equal(x, values)
    assert ip.user_ns["seen"].count("cpu") >= 3  # the cell did run on the CPU


def test_an_optimizer_step_on_shared_parameters_gets_copies(ip):
    ip.run_cell(TRAIN_STEP)
    before = training_state(ip.user_ns)
    compare(ip, "cpu meta -n 2", "opt.zero_grad()\nmodel(batch).sum().backward()\nopt.step()")
    assert_same_training_state(ip.user_ns, before)


def test_warmup_zero_copies_everything(ip):
    ip.run_cell("x = torch.arange(6.0); seen = []")
    x, values = ip.user_ns["x"], ip.user_ns["x"].clone()
    compare(ip, "cpu meta -n 2 --warmup 0", "seen.append(x.data_ptr())\nx.add_(1)")
    assert x.data_ptr() not in ip.user_ns["seen"] and torch.equal(x, values)


def test_copies_that_do_not_fit_are_refused_with_the_sizes(ip, monkeypatch):
    ip.run_cell("x = torch.ones(1024, 256); ran = []")  # 1 MiB
    monkeypatch.setattr(devcompare, "free_bytes", lambda dev: 512 * 1024)
    with pytest.raises(UsageError) as err:
        ip.run_cell("%%devcompare cpu meta --warmup 0\nran.append(x.sum())")
    assert str(err.value) == ("%%devcompare needs 1.0 MiB on the host for its copies of the "
                              "cell's inputs, and 512.0 KiB is free there: nothing ran")
    assert ip.user_ns["ran"] == []


def test_a_warmup_started_again_starts_from_the_same_random_state(ip):
    ip.run_cell("x = torch.arange(6.0); seen = []\n"
                "torch.manual_seed(0); first = torch.rand(1).item(); torch.manual_seed(0)")
    compare(ip, "cpu meta -n 1", "seen.append(torch.rand(1, device='cpu').item())\nx.add_(1)")
    seen, first = ip.user_ns["seen"], ip.user_ns["first"]
    assert seen[0] == seen[1] == first  # the stopped warm-up, then the one on a copy
    assert torch.equal(ip.user_ns["x"], torch.arange(6.0))


def test_a_write_only_later_runs_make_stops_the_comparison_and_says_so(ip):
    ip.run_cell("x = torch.arange(6.0); seen = []")
    with pytest.raises(UsageError) as err:
        ip.run_cell("%%devcompare cpu meta -n 3\nseen.append(1)\nif len(seen) > 2:\n    x.add_(1)")
    assert str(err.value) == (
        "%%devcompare stopped: a timed run on cpu wrote into x, which the guarded warm-up run "
        "did not; those values have changed (run it with --warmup 0, which copies everything)")
    assert len(ip.user_ns["seen"]) == 3  # it stopped after the first run that wrote


def test_every_device_runs_under_no_device_mode_its_warnings_at_the_users_line(ip, tdmdev):
    ip.run_cell("seen = []")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compare(ip, "cpu tdmdev:1 -n 1 --warmup 0",
                "modes = torch.overrides._get_current_function_mode_stack()\n"
                "seen.append((torch.zeros(1).device, [type(m).__name__ for m in modes]))\n"
                "s = torch.nn.functional.softmax(torch.ones(2))\n"
                "g = (torch.ones(2, requires_grad=True) * 2).grad")
    assert ip.user_ns["seen"] == [(torch.device("cpu"), []), (torch.device("tdmdev:1"), [])]
    lines = [w.lineno for w in caught if w.category is not DeprecationWarning
             and ("softmax" in str(w.message) or ".grad" in str(w.message))]
    assert lines == [3, 4, 3, 4]  # the cell's lines on each device, not torch/utils/_device.py
    assert torch_default_device() is None


@pytest.mark.parametrize("nested", ["%%nograd", "%%time", "%%capture out"])
def test_a_nested_cell_magic_of_python_compares_its_body_on_copies(nsip, nested):
    before = snapshot(nsip)
    compare(nsip, "cpu meta -n 1 --warmup 0", f"{nested}\nseen.append(model(a).device.type)")
    assert nsip.user_ns["seen"] == ["cpu", "meta"]  # the copies moved to each device
    assert_unchanged(nsip, before)


@pytest.mark.parametrize("write", [
    "x.apply_(lambda v: v + 1)",
    "x.data[0] = 3",
    "x.untyped_storage().fill_(0)",
    "x.untyped_storage()[0] = 9",
    "import ctypes; ctypes.memset(x.untyped_storage().data_ptr(), 0, 8) if x.is_cpu else 0",
])
def test_a_later_write_past_the_version_counters_stops_the_comparison_and_says_so(ip, write):
    ip.run_cell("x = torch.arange(6.0); seen = []")
    with pytest.raises(UsageError) as err:
        ip.run_cell(f"%%devcompare cpu meta -n 3\nseen.append(1)\nif len(seen) > 2:\n    {write}")
    assert str(err.value) == (
        "%%devcompare stopped: a run on cpu wrote into x unseen by the guarded warm-up run and "
        "by torch's version counters (through .data, a storage, apply_ or a raw pointer); "
        "those values have changed (run it with --warmup 0, which copies everything)")
    assert len(ip.user_ns["seen"]) == 4  # it stopped after the CPU's runs, meta's never ran


def test_a_shared_tensor_on_another_accelerator_is_checked_there_too(ip, tdmdev):
    ip.run_cell("x = torch.arange(6.0, device='tdmdev:0'); seen = []")
    with pytest.raises(UsageError, match="a run on tdmdev:0 wrote into x unseen"):
        ip.run_cell("%%devcompare cpu tdmdev:0 -n 3\nseen.append(1)\n"
                    "if x.device.type == 'tdmdev' and len(seen) > 5:\n    x.data.fill_(1)")
    assert len(ip.user_ns["seen"]) == 8  # 4 on the CPU (on a copy), 4 on tdmdev:0


# --- Python's and NumPy's random state ----------------------------------------------------

def test_pythons_and_numpys_random_states_are_put_back_and_each_device_starts_from_them(ip):
    pytest.importorskip("numpy")
    ip.run_cell(
        "import random\nimport numpy as np\n"
        "def seeded():\n"
        "    random.seed(0); np.random.seed(0)\n"
        "    return np.random.default_rng(1), random.Random(2)\n"
        "rng, pyrng = seeded()\n"
        "expected = (random.random(), np.random.rand(), rng.random(), pyrng.random())\n"
        "rng, pyrng = seeded()"
    )
    result = compare(ip, "cpu meta -n 2 -o",
                     "[random.random(), np.random.rand(2), rng.random(), pyrng.random()]")
    assert result.devices[1].max_abs_diff == 0.0  # each device drew the same numbers
    ip.run_cell("after = (random.random(), np.random.rand(), rng.random(), pyrng.random())")
    assert ip.user_ns["after"] == ip.user_ns["expected"]


# --- the devices named ---------------------------------------------------------------------

@pytest.mark.parametrize("line", ["tdmdev tdmdev:0", "cpu tdmdev:0 tdmdev", "tdmdev:0 tdmdev:0"])
def test_one_accelerator_named_twice_under_two_spellings_is_refused(ip, tdmdev, line):
    ip.run_cell("ran = []")
    first, second = [d for d in line.split() if d.startswith("tdmdev")]
    with pytest.raises(UsageError) as err:
        ip.run_cell(f"%%devcompare {line}\nran.append(1)")
    assert str(err.value) == (
        f"%%devcompare got one device twice: {first} and {second} are the same device "
        "(tdmdev:0); compare different devices, e.g. %%devcompare cpu cuda")
    assert ip.user_ns["ran"] == []


def test_two_devices_of_one_accelerator_are_compared(ip, tdmdev):
    result = compare(ip, "tdmdev tdmdev:1 -n 1 --warmup 0 -o", "torch.ones(2).device.index")
    assert [d.device for d in result.devices] == ["tdmdev", "tdmdev:1"]


@pytest.mark.cuda
def test_cuda_and_its_current_device_by_index_are_one_device(ip):
    index = torch.cuda.current_device()
    with pytest.raises(UsageError, match=rf"cuda and cuda:{index} are the same device"):
        ip.run_cell(f"%%devcompare cuda cuda:{index}\n1")


def test_meta_is_no_reference_since_it_computes_nothing(ip):
    ip.run_cell("ran = []")
    with pytest.raises(UsageError) as err:
        ip.run_cell("%%devcompare meta cpu\nran.append(1)")
    assert str(err.value) == (
        "%%devcompare cannot take meta as the reference, since it computes nothing: put a "
        "device that does first, e.g. %%devcompare cpu meta")
    assert ip.user_ns["ran"] == []


# --- NumPy results ---------------------------------------------------------------------------

def test_numpy_scalars_and_arrays_are_compared_as_numbers_and_tensors():
    np = pytest.importorskip("numpy")
    assert difference(np.float32(1.5), np.float32(1.5)) == 0.0
    assert difference(np.int64(3), np.int64(5)) == 2.0
    assert difference(np.float32(1.5), 1.75) == 0.25
    assert difference(np.arange(4.0)[::-1], np.arange(4.0)[::-1]) == 0.0
    assert difference([np.ones(2)], [np.array([1.0, 1.5], dtype=np.float32)]) == 0.5
    assert math.isnan(difference(np.array([NAN]), np.array([1.0])))
    assert difference(np.ones(2), np.ones(3)) is None
    assert difference(np.array(["a"]), np.array(["a"])) is None  # not numbers


def test_numpy_results_equal_on_both_devices_read_no_difference(ip, tdmdev):
    pytest.importorskip("numpy")
    ip.run_cell("import numpy as np; x = torch.arange(6.0)")
    result = compare(ip, "cpu tdmdev:0 -n 1 -o",
                     "y = (x * 2).cpu()\n(y.numpy(), np.float32(y.sum().item()), np.int64(3))")
    assert result.devices[1].max_abs_diff == 0.0
