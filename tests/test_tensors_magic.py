"""%tensors: the namespace's tensors by name, totals per device, warnings; pure and wired."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from IPython.core.error import UsageError

from torch_device_magic import namespace
from torch_device_magic.namespace import scan

Batch = namedtuple("Batch", "x y")


@dataclass
class State:
    weights: torch.Tensor
    step: int


def rows(report):
    return {r.name: r for r in report.rows}


def test_shared_storage_is_counted_once_and_a_view_holds_its_base():
    a = torch.ones(1024)
    report = scan({"a": a, "b": a, "v": a[:8], "n": 3, "s": "text"})
    by_name = rows(report)
    assert sorted(by_name) == ["a", "b", "v"]
    assert by_name["v"].shape == "(8,)"
    assert by_name["v"].nbytes == 4096  # the view keeps the whole base alive
    assert report.totals == {"cpu": 4096}
    assert report.shared == ["a, b, v share one storage (4.0 KiB, counted once)"]


def test_mixed_devices_get_a_total_each():
    report = scan({
        "x": torch.zeros(100),
        "m": torch.zeros(10, 10, device="meta", dtype=torch.float16),
        "batch": Batch(torch.zeros(4, dtype=torch.int64), torch.zeros(2, device="meta")),
    })
    by_name = rows(report)
    assert report.totals == {"cpu": 400 + 32, "meta": 200 + 8}
    assert (by_name["m"].device, by_name["m"].dtype) == ("meta", "float16")
    assert (by_name["batch"].kind, by_name["batch"].device) == ("Batch", "cpu, meta")
    assert (by_name["batch"].dtype, by_name["batch"].shape) == ("float32, int64", "2 tensors")


def test_modules_optimizers_and_containers_each_make_one_row():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    report = scan({
        "model": model, "opt": opt, "nested": {"k": [State(torch.ones(2), 1)]}, "fn": print,
    })
    by_name = rows(report)
    assert sorted(by_name) == ["model", "nested", "opt"]
    assert by_name["model"].kind == "module Linear"
    assert by_name["model"].shape == "10 params"
    assert by_name["model"].nbytes == 40
    assert by_name["model"].grad_bytes == 40
    assert by_name["opt"].kind == "optimizer SGD"
    assert by_name["opt"].nbytes == 40  # its momentum buffers; the parameters are the model's
    assert by_name["opt"].grad_bytes is None  # the gradients show on the model's row
    assert scan({"opt": opt}).totals == {"cpu": 40 + 40 + 40}  # alone, it holds them all
    assert by_name["nested"].shape == "1 tensor"
    assert report.totals == {"cpu": 40 + 40 + 40 + 8}  # params, grads, momentum, nested
    assert report.warnings == []


def test_requires_grad_and_grad_read_in_the_grad_column():
    w = torch.ones(3, requires_grad=True)
    g = torch.ones(3, requires_grad=True)
    (g * 2).sum().backward()
    text = str(scan({"w": w, "g": g, "plain": torch.ones(1)}))
    lines = {line.split()[0]: line for line in text.splitlines()[3:6]}
    assert lines["w"].endswith("requires_grad")
    assert lines["g"].endswith("grad 12 B")
    assert lines["plain"].endswith("4 B")


def test_a_module_spanning_devices_is_a_warning():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    report = scan({"model": model})
    assert report.warnings == [
        "model: the Sequential's parameters and buffers are on cpu and meta "
        "(move it whole: %%ondevice DEV or .to(device))"
    ]
    assert "warning: model: the Sequential's" in str(report)


def test_optimizer_state_on_another_device_is_a_warning_but_step_is_not():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert scan({"opt": opt}).warnings == []  # Adam keeps `step` on the CPU on purpose
    state = opt.state[model.weight]
    state["exp_avg"] = state["exp_avg"].to("meta")
    assert scan({"opt": opt}).warnings == [
        "opt: the Adam's state is on meta for parameters on cpu "
        "(%%ondevice moves an optimizer with its state)"
    ]


@pytest.mark.parametrize("optimizer", ["NAdam", "Adam", "RAdam", "ASGD", "Adagrad"])
def test_the_scalars_an_optimizer_keeps_on_the_cpu_on_purpose_are_no_warning(
    ip, tdmdev, capsys, optimizer
):
    """Issue 36, point 17d: NAdam keeps `mu_product` on the CPU for parameters on DEV (as
    every optimizer keeps `step`), and its step runs so; a moment moved to the CPU by
    hand is still a warning."""
    ip.run_cell(f"model = torch.nn.Linear(4, 4, device='tdmdev')\n"
                f"opt = torch.optim.{optimizer}(model.parameters(), foreach=False)\n"
                "model(torch.ones(2, 4, device='tdmdev')).sum().backward(); opt.step()")
    capsys.readouterr()
    ip.run_cell("%tensors")
    assert "warning" not in capsys.readouterr().out
    ip.run_cell("opt.step()")  # the single-tensor path with the state as torch left it
    state = ip.user_ns["opt"].state[ip.user_ns["model"].weight]
    moment = next(k for k, v in state.items() if v.shape == (4, 4))  # exp_avg, sum, ax
    state[moment] = state[moment].cpu()
    ip.run_cell("%tensors")
    assert (f"warning: opt: the {optimizer}'s state is on cpu for parameters on tdmdev:0 "
            "(%%ondevice moves an optimizer with its state)") in capsys.readouterr().out


def test_filters_by_device_and_size():
    ns = {"small": torch.zeros(2), "big": torch.zeros(1000), "m": torch.zeros(5, device="meta")}
    assert [r.name for r in scan(ns, device=torch.device("meta")).rows] == ["m"]
    assert [r.name for r in scan(ns, device=torch.device("cpu")).rows] == ["big", "small"]
    assert [r.name for r in scan(ns, min_bytes=1000).rows] == ["big"]


def test_filters_that_keep_nothing_say_so_and_a_filtered_title_says_which():
    ns = {"small": torch.zeros(2), "m": torch.zeros(5, device="meta")}
    assert str(scan(ns, min_bytes=1024)) == (
        "no tensors, modules or optimizers in the namespace holding at least 1.0 KiB"
    )
    assert str(scan(ns, device=torch.device("cuda"), min_bytes=4)) == (
        "no tensors, modules or optimizers in the namespace on cuda, holding at least 4 B"
    )
    assert str(scan(ns, device=torch.device("meta"))).startswith(
        "tensors in the namespace on meta (1 name)\n"
    )


def test_one_thing_reads_in_the_singular():
    model = torch.nn.Linear(2, 2, bias=False)
    ns = {"pair": [torch.ones(2)], "opt": torch.optim.SGD(model.parameters(), lr=0.1)}
    assert [r.shape for r in scan(ns).rows] == ["1 param tensor", "1 tensor"]


def test_hidden_and_underscore_names_are_skipped():
    t = torch.zeros(1)
    assert scan({"Out": {1: t}, "_": t, "_5": t, "t": t}, hidden={"Out"}).totals == {"cpu": 4}
    assert [r.name for r in scan({"Out": {1: t}, "_": t}, hidden={"Out"}).rows] == []


def test_a_huge_container_is_walked_only_so_far(monkeypatch):
    monkeypatch.setattr(namespace, "WALK_LIMIT", 10)
    report = scan({"data": [torch.zeros(1), *range(50), torch.zeros(1)]})
    assert report.rows[0].kind == "list (first 10 items)"


def test_lazy_modules_do_not_break_the_listing():
    report = scan({"lazy": torch.nn.LazyLinear(3), "x": torch.zeros(1)})
    assert [r.name for r in report.rows] == ["x"]


def test_empty_namespace_says_so():
    assert str(scan({"n": 1})) == "no tensors, modules or optimizers in the namespace"


@pytest.mark.parametrize("text", ["1e400", "1e400KiB", "9" * 400])
def test_a_size_too_large_to_be_a_number_is_a_usage_error(ip, text):
    with pytest.raises(UsageError) as err:
        ip.run_cell(f"%tensors --min-bytes {text}")
    assert type(err.value) is UsageError
    assert str(err.value).startswith(f"{text!r} is not a size")


def test_magic_lists_and_returns_rows(ip, capsys):
    ip.run_cell("a = torch.ones(256); v = a[:2]; m = torch.zeros(3, device='meta'); a")
    capsys.readouterr()
    ip.run_cell("%tensors")
    out = capsys.readouterr().out
    assert out.startswith("tensors in the namespace (3 names)")
    assert "total: cpu 1.0 KiB, meta 12 B" in out
    ip.run_cell("rows = %tensors --device meta -o")
    assert [(r.name, r.device) for r in ip.user_ns["rows"]] == [("m", "meta")]
    ip.run_cell("rows = %tensors --min-bytes 1KiB -o")
    assert [r.name for r in ip.user_ns["rows"]] == ["a", "v"]


def test_a_models_slice_shares_its_weights_in_one_line(ip, capsys):
    """Issue 36, point 20: `backbone = model[:-1]` of 51 layers shares 100 weights and
    biases with `model`: one line for the pair, not one a weight."""
    ip.run_cell("model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(51)])\n"
                "backbone = model[:-1]\nhead = model[-1]\nx = torch.ones(256)\nv = x[:2]")
    capsys.readouterr()
    ip.run_cell("%tensors")
    lines = capsys.readouterr().out.splitlines()
    shared = [line for line in lines if " share " in line]
    assert shared == [
        "backbone, model share 100 storages (14.1 KiB, counted once)",  # 50 x (256 + 32 B)
        "head, model share 2 storages (288 B, counted once)",
        "v, x share one storage (1.0 KiB, counted once)",
    ]
    assert len(lines) < 15


def test_report_renders_html_too():
    bundle = scan({"x": torch.zeros(2)})._repr_mimebundle_()
    html = bundle["text/html"]
    assert "<table>" in html and '<td style="text-align:left">x</td>' in html
    assert bundle["text/plain"].startswith("tensors in the namespace (1 name)")


@pytest.mark.parametrize(("line", "message"), [
    ("%tensors --min-bytes lots", "'lots' is not a size"),
    ("%tensors --device banana", "'banana' is not a device"),
    ("%tensors extra", "%tensors: unrecognized arguments: extra"),
])
def test_bad_input_is_a_usage_error(ip, line, message):
    with pytest.raises(UsageError) as err:
        ip.run_cell(line)
    assert type(err.value) is UsageError
    assert str(err.value).startswith(message)


def test_a_quoted_size_with_a_space_reads_as_the_size(ip):
    ip.run_cell("big = torch.ones(2**18); small = torch.ones(2)")
    rows = ip.run_line_magic("tensors", '--min-bytes "1 MiB" -o')
    assert [r.name for r in rows] == ["big"]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_nested_tensor_with_ragged_dimensions_is_listed(ip):
    ip.run_cell("nt = torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)])")
    [row] = ip.run_line_magic("tensors", "-o")
    assert (row.name, row.shape, row.nbytes) == ("nt", "(2, None, 4)", 80)


def test_adams_cpu_step_counter_does_not_make_the_optimizer_span_devices():
    model = torch.nn.Linear(2, 2, device="meta")
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():  # what Adam.step leaves for parameters on a GPU
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p)}
    report = scan({"opt": opt})
    assert report.rows[0].device == "meta"
    assert report.rows[0].nbytes == 24  # the moments; the steps count in the totals only
    assert report.totals == {"cpu": 8, "meta": 24 + 24}
    assert report.warnings == []


class BadMapping(dict):
    def values(self):
        raise RuntimeError("values are not ready")


@dataclass
class Lazy:
    size: int

    def __getattribute__(self, name):
        if name == "size":
            raise KeyError("not loaded yet")
        return super().__getattribute__(name)


def test_an_object_that_raises_when_read_is_skipped_and_named():
    report = scan({"bad": BadMapping(k=torch.ones(1)), "lazy": Lazy(1), "x": torch.ones(2)})
    assert [r.name for r in report.rows] == ["x"]
    assert report.warnings == [
        "bad: skipped a BadMapping that could not be read (RuntimeError: values are not ready)",
        "lazy: skipped a Lazy that could not be read (KeyError: 'not loaded yet')",
    ]


def test_tensors_and_devcompare_work_beside_objects_that_raise(ip, capsys):
    ip.user_ns.update(bad=BadMapping(), lazy=Lazy(1))
    ip.run_cell("x = torch.ones(2)")
    assert [r.name for r in ip.run_line_magic("tensors", "-o")] == ["x"]
    result = ip.run_cell_magic("devcompare", "cpu meta -n 1 -o", "bad, lazy\n(x * 2).shape")
    assert result.devices[1].max_abs_diff == 0.0


def test_a_list_of_a_million_samples_is_walked_only_so_far():
    import tracemalloc

    # One sample a million times: a million distinct ones would leave the allocator holding
    # memory that later tests measure.
    samples = [(torch.zeros(3).numpy(), 7)] * 1_000_000
    tracemalloc.start()
    try:
        report = scan({"samples": samples, "x": torch.ones(1)})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [r.name for r in report.rows] == ["x"]
    assert peak < 4 * 2**20  # the walk holds a bounded slice, not a copy of the million (8 MB)


def test_a_sparse_tensor_counts_what_it_stores_not_its_dense_size():
    indices = torch.tensor([[0, 99_999], [0, 99_999]])
    sparse = torch.sparse_coo_tensor(indices, torch.tensor([1.0, 2.0]), (100_000, 100_000),
                                    check_invariants=True)
    [row] = scan({"sparse": sparse}).rows
    assert row.nbytes == 2 * 2 * 8 + 2 * 4  # indices and values, not 37 GiB


def test_device_is_a_filter_that_never_offers_auto(ip):
    ip.run_cell("x = torch.ones(2)")
    assert ip.run_line_magic("tensors", "--device cuda:7 -o") == []  # a filter, not checked
    with pytest.raises(UsageError) as err:
        ip.run_cell("%tensors --device auto")
    assert type(err.value) is UsageError
    message = str(err.value)
    assert message.startswith("'auto' is not a device: ") and "auto" not in message[6:]
    assert "--device filters" in message


def test_holds_tensors_looks_into_attributes_but_not_into_code():
    from torch.utils.data import TensorDataset

    from torch_device_magic.namespace import holds_tensors

    model = torch.nn.Linear(2, 2)
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=1.0), 1)
    assert holds_tensors(TensorDataset(torch.ones(2))) and holds_tensors(sched)
    assert holds_tensors({"k": [State(torch.ones(1), 1)]})
    assert not holds_tensors(torch) and not holds_tensors(torch.nn.Linear)
    assert not holds_tensors(lambda: model) and not holds_tensors(list(range(10)))
    assert not holds_tensors(BadMapping(k=torch.ones(1)))  # unreadable: left as it is
