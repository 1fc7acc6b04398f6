"""`reach`: what the code a cell can call reads from the namespace, and what it cannot follow."""

from __future__ import annotations

import sys

import pytest
import torch

from torch_device_magic import reach
from torch_device_magic.cells import cell_attributes, cell_names

pytestmark = pytest.mark.once  # nothing here depends on IPython's version

NOTEBOOK = """\
import functools
import torch
import torch.nn.functional as F
model = torch.nn.Linear(2, 2); opt = torch.optim.SGD(model.parameters(), lr=0.1)
batch = torch.ones(3, 2); scale = 2.0; g = torch.Generator()
def loss_of(out):
    return F.relu(out).sum() * scale
def train_step():
    opt.zero_grad()
    return loss_of(model(batch))
@torch.no_grad()
def evaluate():
    return [model(b) for b in [batch]]
class Trainer:
    def fit(self):
        return train_step()
    @property
    def steps(self):
        return counter
trainer = Trainer()
later = functools.partial(train_step)
noise = lambda: torch.rand(2, generator=g)
def recursive(n):
    return recursive(n - 1) if n else batch
counter = 0
"""


@pytest.fixture
def notebook():
    ns = {"__name__": "__main__"}
    exec(NOTEBOOK, ns)
    return ns


def reached(ns: dict, cell: str) -> reach.Reach:
    return reach.reach(ns, cell_names(cell), cell_attributes(cell))


@pytest.mark.parametrize(("cell", "names"), [
    ("loss = train_step()", {"opt", "loss_of", "model", "batch", "F", "scale"}),
    ("evaluate()", {"model", "batch"}),  # through torch.no_grad's wrapper
    ("later()", {"opt", "loss_of", "model", "batch", "F", "scale"}),
    ("noise()", {"torch", "g"}),
    ("recursive(3)", {"recursive", "batch"}),
    ("F.relu(batch) + torch.matmul(batch, batch.T)", set()),  # torch is not looked into
    ("scale * 2", set()),
])
def test_reach_follows_the_notebooks_own_functions_transitively(notebook, cell, names):
    found = reached(notebook, cell)
    assert found.names == names and found.unfollowed == []


def test_a_method_is_followed_where_the_cell_names_it(notebook):
    found = reached(notebook, "trainer.fit()\ntrainer.steps")
    assert {"train_step", "opt", "model", "batch", "counter"} <= found.names
    assert found.followed["Trainer.fit"] == []  # train_step is no tensor
    assert found.followed["train_step"] == ["opt", "model", "batch"]
    assert reached(notebook, "trainer").names == set()  # named, nothing of it called


def test_notes_name_only_what_holds_tensors(notebook):
    # loss_of reads F and scale, a module and a number: nothing that moves
    assert reached(notebook, "train_step()").notes() == [
        "followed into train_step: opt, model, batch"]


def test_code_names_are_the_globals_and_attributes_of_nested_code_too():
    ns: dict = {}
    exec("def outer():\n"
         "    global stored\n"
         "    stored = read_here\n"
         "    def inner():\n"
         "        return [nested_read.attr for _ in range(2)]\n"
         "    return inner, (lambda: in_lambda.method())", ns)
    names, attributes = reach.code_names(ns["outer"].__code__)
    assert set(names) == {"stored", "read_here", "nested_read", "range", "in_lambda"}
    assert set(attributes) == {"attr", "method"}


# --- what calling a module runs, and no more ---------------------------------------------

NET = """\
import torch
train_x = torch.randn(8, 2); gallery = [torch.zeros(2)]; mask = torch.ones(2)
activations = {}; seen = []
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(2, 2)
    def forward(self, x):
        return self.helper(self.fc1(x)) * mask
    def helper(self, h):
        return h
    def fit(self):
        return self(train_x)
    def show_examples(self):
        return [self(g) for g in gallery]
model = Net(); x = torch.ones(2)
"""


@pytest.fixture
def net():
    ns = {"__name__": "__main__"}
    exec(NET, ns)
    return ns


def test_calling_a_module_follows_its_forward_not_its_other_methods(net):
    found = reached(net, "out = model(x)")
    assert "mask" in found.names and found.followed["Net.forward"] == ["mask"]
    assert "Net.helper" in found.followed  # forward names it
    assert not {"train_x", "gallery"} & found.names
    assert "followed into Net.forward: mask" in found.notes()


def test_a_constructor_is_followed_where_the_class_is_named_not_through_an_instance(net):
    exec("embeddings = torch.ones(2)\n"
         "class Embedded(Net):\n"
         "    def __init__(self):\n"
         "        super().__init__()\n"
         "        self.table = embeddings.clone()\n"
         "made = Embedded()", net)
    assert "embeddings" not in reached(net, "made(x)").names
    assert "embeddings" in reached(net, "again = Embedded()").names


def test_a_method_the_cell_names_is_followed(net):
    assert {"train_x", "mask"} <= reached(net, "model.fit()").names
    assert "gallery" in reached(net, "model.show_examples()").names


@pytest.mark.parametrize("register", [
    "model.fc1.register_forward_hook(hook)",
    "model.register_forward_pre_hook(lambda m, a: hook(m, a, None))",
    "model.fc1.register_full_backward_hook(lambda m, gi, go: hook(m, gi, go))",
    "model.register_full_backward_pre_hook(lambda m, go: hook(m, go, None))",
    "model.fc1.weight.register_hook(lambda grad: hook(None, None, grad))",
    "model.fc1.weight.register_post_accumulate_grad_hook(lambda p: hook(None, None, p))",
    "handle = torch.nn.modules.module.register_module_forward_hook(hook)",
])
def test_the_hooks_of_a_called_module_are_followed(net, register):
    exec("def hook(module, args, out):\n"
         "    activations['fc1'] = out\n"
         f"{register}", net)
    try:
        found = reached(net, "out = model.forward(x)" if "handle" in net else "out = model(x)")
    finally:
        if "handle" in net:
            net["handle"].remove()
    assert "activations" in found.names
    assert any("hook" in fn for fn in found.followed), found.followed


def test_a_hook_is_labelled_with_what_it_hooks(net):
    exec("activations['fc1'] = torch.ones(2)\n"
         "def save(module, args, out):\n"
         "    activations['fc1'] = out\n"
         "model.fc1.register_forward_hook(save)", net)
    notes = reached(net, "model(x)").notes()
    assert "followed into save (forward hook of model.fc1): activations" in notes


def test_callbacks_kept_on_an_object_installed_code_calls_are_followed_not_others(net):
    exec("from torch.utils.data import DataLoader\n"
         "def collate(batch):\n    return torch.stack(batch) * mask\n"
         "loader = DataLoader([torch.ones(2)], collate_fn=collate)\n"
         "def log_examples():\n    return gallery\n"
         "model.on_epoch = log_examples", net)
    assert "mask" in reached(net, "for b in loader:\n    pass").names
    assert "gallery" not in reached(net, "model(x)").names  # nothing names on_epoch
    assert "gallery" in reached(net, "model.on_epoch()").names


def test_a_tensors_own_hook_is_followed(net):
    exec("def clip(grad):\n    seen.append(mask)\nx.requires_grad_()\nx.register_hook(clip)", net)
    assert {"seen", "mask"} <= reached(net, "x.sum()").names


# --- a module of the user's own, by what is read from it ---------------------------------

@pytest.fixture
def utils(tmp_path, monkeypatch):
    (tmp_path / "tdm_user_utils.py").write_text(
        "import torch\n"
        "MEAN = torch.zeros(2)\n"
        "STD = torch.ones(2)\n"
        "def standardize(x):\n"
        "    return (x - x.mean()) / x.std()\n"
        "def normalise(x):\n"
        "    return (x - MEAN) / STD\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import tdm_user_utils
    yield {"__name__": "__main__", "utils": tdm_user_utils, "x": torch.ones(2)}
    sys.modules.pop("tdm_user_utils", None)


@pytest.mark.parametrize(("cell", "unfollowed"), [
    ("utils.standardize(x)", []),
    ("def prep(t):\n    return utils.standardize(t)\nprep(x)", []),
    ("utils.normalise(x)", ["tdm_user_utils.normalise reads MEAN, STD from its module "
                            "tdm_user_utils"]),
    ("x - utils.MEAN", ["utils is a module of your own that holds MEAN"]),
])
def test_a_users_module_is_judged_by_what_is_read_from_it(utils, cell, unfollowed):
    exec(cell, utils)  # it runs
    assert [str(u) for u in reached(utils, cell).unfollowed] == unfollowed


@pytest.fixture(params=["dist-info", "egg-info"])
def target_dir(request, tmp_path, monkeypatch):
    """`pip install --target DIR` of `tdm_fake` (DIR on sys.path, as PYTHONPATH puts it):
    a package with a `.dist-info` (RECORD), or a module file with an `.egg-info`
    (top_level.txt); and a plain module `tdm_mine` in the notebook's folder, which holds
    metadata of its own (`pip install -e .`). Each has a function that reads a tensor of
    its module's; the notebook calls both."""
    installed, notebook = tmp_path / "target", tmp_path / "notebook"
    installed.mkdir()
    notebook.mkdir()
    code = "import torch\nSTATE = torch.ones(2)\ndef helper(x):\n    return x * STATE\n"
    (notebook / "tdm_mine.py").write_text(code)
    (notebook / "tdm_mine.egg-info").mkdir()
    (notebook / "tdm_mine.egg-info" / "top_level.txt").write_text("tdm_mine\n")
    if request.param == "dist-info":
        (installed / "tdm_fake").mkdir()
        (installed / "tdm_fake" / "__init__.py").write_text(code)
        meta = installed / "tdm_fake-1.0.dist-info"
        meta.mkdir()
        (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: tdm-fake\nVersion: 1.0\n")
        (meta / "RECORD").write_text("tdm_fake/__init__.py,,\ntdm_fake-1.0.dist-info/METADATA,,\n"
                                     "tdm_fake-1.0.dist-info/RECORD,,\n")
    else:
        (installed / "tdm_fake.py").write_text(code)
        meta = installed / "tdm_fake-1.0-py3.11.egg-info"
        meta.mkdir()
        (meta / "PKG-INFO").write_text("Metadata-Version: 1.0\nName: tdm-fake\nVersion: 1.0\n")
        (meta / "top_level.txt").write_text("tdm_fake\n")
    monkeypatch.chdir(notebook)
    monkeypatch.syspath_prepend(str(installed))
    monkeypatch.syspath_prepend("")  # IPython's entry for the notebook's folder
    import tdm_fake
    import tdm_mine
    ns = {"__name__": "__main__", "tdm_fake": tdm_fake, "tdm_mine": tdm_mine, "x": torch.ones(2)}
    exec("def step(v):\n    return tdm_fake.helper(v) + tdm_mine.helper(v)", ns)
    yield ns
    sys.modules.pop("tdm_fake", None)
    sys.modules.pop("tdm_mine", None)


def test_a_package_installed_outside_site_packages_is_not_walked_the_notebooks_folder_is(
        target_dir):
    exec("y = step(x)", target_dir)  # it runs
    found = reached(target_dir, "y = step(x)")
    assert [str(u) for u in found.unfollowed] == [
        "tdm_mine.helper reads STATE from its module tdm_mine"]  # not tdm_fake.helper's


# --- callables given as default arguments, or bound in a partial ------------------------

SCORES = """\
import functools
import torch
weights = torch.ones(3); vals = torch.arange(3.0)
def weighted(v):
    return v * weights
def score(v, metric=weighted):
    return metric(v).sum()
def score_kw(v, *, metric=weighted):
    return metric(v).sum()
score_lambda = lambda v, metric=lambda u: u * weights: metric(v)
def apply(metric, v):
    return metric(v)
bound = functools.partial(apply, weighted)
bound_kw = functools.partial(score, metric=weighted)
partial_default = functools.partial(score)
def by_partial(v, metric=functools.partial(apply, weighted)):
    return metric(v)
"""


@pytest.fixture
def scores():
    ns = {"__name__": "__main__"}
    exec(SCORES, ns)
    return ns


@pytest.mark.parametrize("cell", [
    "s = score(vals)", "s = score_kw(vals)", "s = score_lambda(vals)",
    "s = bound(vals)", "s = bound_kw(vals)", "s = partial_default(vals)",
    "s = by_partial(vals)",
])
def test_a_callable_given_as_a_default_or_bound_in_a_partial_is_followed(scores, cell):
    found = reached(scores, cell)
    assert "weights" in found.names
    assert ["weights"] in found.followed.values()
    assert found.unfollowed == []  # the callable is no tensor: nothing is out of reach


def test_a_tensor_given_as_a_default_is_still_out_of_reach(scores):
    exec("def scaled(v, w=weights):\n    return v * w", scores)
    assert [str(u) for u in reached(scores, "scaled(vals)").unfollowed] == [
        "scaled holds w as default arguments"]


def test_defaults_that_refer_to_each_other_are_looked_at_once(scores):
    exec("def ping(v, other=None):\n    return v\n"
         "def pong(v, other=ping):\n    return v * weights\n"
         "ping.__defaults__ = (pong,)", scores)
    found = reached(scores, "ping(vals)")
    assert found.followed["pong"] == ["weights"] and not found.truncated
