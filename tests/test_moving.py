"""`moving/` on the `cpu` and `meta` devices: every guarantee, fault injection, restore."""

from __future__ import annotations

import collections
import copy
import gc
import os
import signal
import subprocess
import sys
import threading
import tracemalloc
import types
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from faults import FailOnAllocation, settle, sigint_on
from pythonpath import child_env

from torch_device_magic import moving, probes
from torch_device_magic.cells import cell_names
from torch_device_magic.errors import DeviceMagicError
from torch_device_magic.moving import move, restore

pytestmark = pytest.mark.once  # nothing here depends on IPython's version

META = torch.device("meta")
CPU = torch.device("cpu")


@pytest.fixture(params=["cpu", "meta"])
def target(request) -> torch.device:
    """The device moved to; everything starts on the CPU, so `cpu` is the no-op move."""
    return torch.device(request.param)


def storage(t: torch.Tensor) -> int:
    """Which storage a tensor uses (data pointers are all 0 on meta)."""
    return t.untyped_storage()._cdata


def moved_all(ns: dict, dev: torch.device, **kw) -> moving.MoveResult:
    return move(ns, list(ns), dev, **kw)


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclass
class Batch:
    inputs: torch.Tensor
    labels: torch.Tensor


@dataclass(frozen=True)
class Frozen:
    t: torch.Tensor


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model with BatchNorm buffers and Adam state after one step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, 3)).pow(2).sum().backward()
    opt.step()
    return model, opt


def snapshot(ns: dict) -> dict:
    """Everything a failed move must leave as it was: objects, devices, values."""
    seen = {}
    for name, obj in ns.items():
        seen[name] = obj
        if isinstance(obj, torch.Tensor):
            seen[name, "value"] = (obj.device, obj.detach().clone(), obj.grad)
        if isinstance(obj, torch.nn.Module):
            for k, t in [*obj.named_parameters(), *obj.named_buffers()]:
                seen[name, k] = (t, t.device, t.detach().clone(), t.grad)
        if isinstance(obj, torch.optim.Optimizer):
            for p, state in obj.state.items():
                for k, v in state.items():
                    seen[name, id(p), k] = (v, v.device, v.clone())
    return seen


def assert_unchanged(ns: dict, before: dict) -> None:
    after = snapshot(ns)
    assert after.keys() == before.keys()
    for key, old in before.items():
        new = after[key]
        if not isinstance(old, tuple):
            assert new is old, key
            continue
        for a, b in zip(old, new, strict=True):
            if isinstance(a, torch.Tensor) and a.device.type != "meta" and not a.is_leaf:
                continue
            if isinstance(a, torch.Tensor) and a.grad_fn is None and b is not a:
                assert torch.equal(a, b), key  # clones: equal values
            else:
                assert a is b or a == b, key


# --- which names a cell refers to -------------------------------------------------------


def test_cell_names_are_loads_and_the_roots_of_chains():
    code = "y = model(x).sum()\nbatch['a'].data[0] += w.grad\nopt.step()\nz += 1\ndel gone"
    assert cell_names(code) == {"model", "x", "batch", "w", "opt", "z"}


def test_cell_names_skip_plain_stores_and_reach_into_functions():
    assert cell_names("a = 1\nfor i in r: pass\ndef f():\n    return g(h)") == {"r", "g", "h"}


def test_cell_names_of_invalid_code_are_empty():
    assert cell_names("x = (") == set()


# --- identity, aliasing, views ----------------------------------------------------------


def test_a_name_keeps_its_object_and_two_names_stay_one_object(target):
    a = torch.arange(6.0)
    ns = {"a": a, "b": a}
    moved_all(ns, target)
    assert ns["a"] is a and ns["b"] is a
    assert a.device == target


def test_a_tensor_reached_twice_moves_once(target):
    model = torch.nn.Linear(3, 3)
    w = model.weight
    ns = {"model": model, "w": w, "box": {"w": w, "again": [w, (w,)]}}
    result = moved_all(ns, target)
    assert ns["box"]["again"][1][0] is w and w.device == target
    if target == META:
        # counted under the first name that reaches it, in sorted order
        assert result.names == {"box": w.nbytes, "model": model.bias.nbytes}


def test_tensors_found_again_are_dropped_and_the_others_keep_their_place_on_meta():
    # The walk plans a tensor each time it finds one; the plan then keeps the first of each,
    # so the names' bytes, leafness and notes of the tensors after a dropped one must follow.
    w = torch.randn(2, requires_grad=True)
    y = w * 2  # with history
    x, zeros = torch.zeros(3), [torch.zeros(0), torch.zeros(0)]
    a, g = torch.zeros(1), torch.zeros(1)
    a.grad = g
    base = torch.arange(4.0)
    ns = {"a": [x, y, x, y, w, *zeros], "b": [w, x, a, g, base, base[1:], base], "c": torch.ones(5)}
    result = moved_all(ns, META)
    assert result.names == {"a": 12 + 8 + 8, "b": 4 + 4 + 16, "c": 20}
    assert result.not_followed == ["a[1]: moved without its autograd history"]
    assert w.is_leaf and w.requires_grad and not x.requires_grad
    assert a.grad is g and g.device == META
    assert storage(base) == storage(ns["b"][5]) and storage(zeros[0]) != storage(zeros[1])
    assert all(t.device == META for t in [*ns["a"], *ns["b"], ns["c"]])


def test_grads_that_form_a_cycle_are_walked_once():
    a, b = torch.zeros(1), torch.zeros(1)
    a.grad, b.grad = b, a  # each holds the other, so neither can be swapped
    result = move({"a": a}, ["a"], META)
    assert result.names == {"a": 8} and len(result.not_followed) == 2


def test_the_storage_key_is_the_storage():
    base = torch.arange(4.0)
    tensors = [base, base[1:], base[1:].data, torch.zeros(4, device=META), torch.zeros(0)]
    assert [moving.plan.storage_id(t) for t in tensors] == [storage(t) for t in tensors]


def test_views_keep_sharing_storage_with_their_base(target):
    base = torch.arange(24.0)
    view = base[2:14].view(3, 4)
    t = view.t()
    ints = base.view(torch.int32)
    ns = {"base": base, "view": view, "t": t, "ints": ints}
    moved_all(ns, target)
    assert {storage(x) for x in (base, view, t, ints)} == {storage(base)}
    assert (view.storage_offset(), view.shape, view.stride()) == (2, (3, 4), (4, 1))
    assert (t.shape, t.stride()) == ((4, 3), (1, 4))
    assert ints.dtype == torch.int32 and base.device == target


def saved_then_changed_in_place(data: torch.Tensor, first: torch.Tensor) -> None:
    """Save `first` in a graph, change `data` in place: autograd must refuse the backward."""
    w = torch.ones(first.shape, requires_grad=True, device=first.device)
    loss = (w * first).sum()  # mul saves `first`
    data.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("restorable", [False, True])
def test_a_view_moved_with_its_base_stays_its_view_sharing_the_version_counter(
    target, restorable
):
    data = torch.arange(6.0)
    first = data[:2]
    ns = {"data": data, "first": first}
    moved = moved_all(ns, target, restorable=restorable)
    assert first._base is data and first.device == target and storage(first) == storage(data)
    data.add_(1)
    assert first._version == data._version  # one counter: autograd sees changes to either
    saved_then_changed_in_place(data, first)
    if restorable:  # and back (from meta: the originals)
        restore(ns, moved)
        assert ns["first"]._base is ns["data"] and ns["data"].device == CPU
        saved_then_changed_in_place(ns["data"], ns["first"])


def test_a_view_of_a_view_and_a_lazy_conjugate_view_keep_their_base_and_bits():
    z = torch.tensor([1 + 2j, 3 + 4j, 5 + 6j])
    tail = z[1:]
    last = tail[1:]  # torch makes it a view of `z` itself
    conj = z[:2].conj()
    negated = z._neg_view()
    ns = {"z": z, "tail": tail, "last": last, "conj": conj, "negated": negated}
    moved_all(ns, META)
    assert tail._base is z and last._base is z and conj._base is z
    assert conj.is_conj() and not z.is_conj() and negated.is_neg() and not z.is_neg()
    assert {storage(t) for t in ns.values()} == {storage(z)}


def test_a_view_named_alone_moves_without_its_base(target):
    base = torch.arange(1000.0)
    ns = {"v": base[10:20]}
    result = moved_all(ns, target)
    assert ns["v"].shape == (10,) and ns["v"].device == target
    if target == META:
        assert result.nbytes == 40  # only the view's elements, not the whole storage


def test_the_names_that_share_a_moved_storage_move_with_it_once_on_meta():
    base = torch.arange(12.0)
    view, alias, other = base[4:8], base.detach(), torch.ones(2)
    ns = {"base": base, "view": view, "alias": alias, "other": other}
    result = move(ns, ["view"], META, others=lambda: list(ns))
    assert base.device == alias.device == view.device == META and other.device == CPU
    assert sorted(result.joined) == ["alias", "base"] and result.nbytes == 48
    assert view._base is base and storage(view) == storage(base) == storage(alias)


def test_views_of_a_shared_span_rebuild_at_their_offsets_on_meta():
    base = torch.arange(10, dtype=torch.float64)
    a, b = base[3:5], base[7:]
    ns = {"a": a, "b": b}
    result = moved_all(ns, META)
    assert storage(a) == storage(b)
    assert b.storage_offset() - a.storage_offset() == 4
    assert result.nbytes <= base.nbytes


def test_a_leaf_and_its_detached_alias_share_storage_and_count_once_on_meta():
    w = torch.nn.Parameter(torch.randn(4))
    alias = w.detach()
    ns = {"a": {"alias": alias}, "w": w, "x": torch.zeros(2)}
    result = moved_all(ns, META)
    assert storage(w) == storage(alias) and w.device == META
    assert w.is_leaf and w.requires_grad and not alias.requires_grad
    assert result.names == {"a": 16, "x": 8}  # the storage under the first name reaching it


# --- autograd ---------------------------------------------------------------------------


def test_a_leaf_stays_a_leaf_that_requires_grad(target):
    w = torch.randn(3, requires_grad=True)
    frozen = torch.randn(3)
    ns = {"w": w, "frozen": frozen}
    moved_all(ns, target)
    assert w.is_leaf and w.requires_grad and w.grad_fn is None
    assert frozen.is_leaf and not frozen.requires_grad


def test_grad_moves_with_its_tensor_and_stays_the_same_object(target):
    w = torch.randn(3, requires_grad=True)
    (w * 2).sum().backward()
    g = w.grad
    ns = {"w": w, "g": g}
    moved_all(ns, target)
    assert w.grad is g and g.device == target and w.device == target


def test_grad_of_a_frozen_parameter_moves_too(target):
    p = torch.nn.Parameter(torch.randn(3))
    p.sum().backward()
    p.requires_grad_(False)
    moved_all({"p": p}, target)
    assert p.grad is not None and p.grad.device == target


def test_a_backward_through_a_graph_made_before_the_move_fails_and_says_why():
    w = torch.ones(3, requires_grad=True)
    loss = (w * 2).sum()  # its graph holds w's old C++ tensor
    result = move({"w": w}, ["w"], META)
    assert result.not_followed == [
        "w: moved, but a view or an autograd graph made before still holds its old data on cpu"
    ]
    with pytest.raises(RuntimeError, match="w was moved to another device after this"):
        loss.backward()


def test_where_data_can_be_set_a_graph_made_before_sees_the_move():
    # Between devices of one kind (cpu and cuda), a tensor that a graph holds gets `.data`
    # after the commit, so that a backward pass through that graph still reaches it. Here
    # on the CPU, with a copy on the CPU standing for one on another device.
    w = torch.ones(3, requires_grad=True)
    w.grad = torch.zeros(3)
    grad = w.grad
    loss = (w * 2).sum()
    copy = w.detach().clone().requires_grad_()
    copy.grad = grad
    moving.commit._swap_impl(w, copy)  # the commit's swap: `copy` now holds the old C++ tensor
    plan = moving.plan._Plan.to(CPU)
    plan.tensors, plan.keys, plan.grads = [w], ["w"], {id(w): (w, grad)}
    plan.runs = [moving.plan._Run(0, 1, None, False, None)]
    notes = moving.commit._held_elsewhere(plan, [copy], [0])
    assert notes == [
        "w: moved with .data because an autograd graph or a view holds it; "
        "views of its old storage and autograd graphs that saved it stay behind"
    ]
    loss.backward()
    assert w.grad is grad and torch.equal(w.grad, torch.full((3,), 2.0))


def test_a_tensor_with_history_arrives_without_it_and_says_so():
    w = torch.randn(3, requires_grad=True)
    y = w * 2
    result = move({"y": y}, ["y"], META)
    assert y.device == META and y.grad_fn is None
    assert result.not_followed == ["y: moved without its autograd history"]


def test_a_parameter_stays_a_parameter_with_its_attributes(target):
    p = torch.nn.Parameter(torch.randn(2, 2))
    p.tag = "keep me"
    moved_all({"p": p}, target)
    assert type(p) is torch.nn.Parameter and p.requires_grad and p.tag == "keep me"
    assert p.device == target


# --- modules and optimizers ---------------------------------------------------------------


def test_a_module_moves_in_place_with_its_parameters_and_buffers(target):
    model, opt = trained()
    params = list(model.parameters())
    mean = model[1].running_mean
    ns = {"model": model}
    moved_all(ns, target)
    assert ns["model"] is model
    assert list(model.parameters()) == params and all(
        a is b for a, b in zip(model.parameters(), params, strict=True)
    )
    assert model[1].running_mean is mean and mean.device == target
    assert all(p.device == target and p.grad.device == target for p in params)
    assert opt.param_groups[0]["params"][0] is model[0].weight


def test_optimizer_state_follows_its_parameters_and_step_stays_on_the_cpu(target):
    model, opt = trained()
    state = opt.state[model[0].weight]
    exp_avg, step = state["exp_avg"], state["step"]
    moved_all({"model": model, "opt": opt}, target)
    assert state["exp_avg"] is exp_avg and exp_avg.device == target
    assert state["step"] is step and step.device == CPU
    assert set(opt.state) == set(model.parameters())


def test_an_optimizer_named_alone_brings_its_parameters():
    model, opt = trained()
    move({"opt": opt}, ["opt"], META)
    assert all(p.device == META for p in model.parameters())
    assert model[1].running_mean.device == CPU  # a buffer is not the optimizer's


def test_capturable_optimizer_steps_follow_their_parameters():
    model, opt = trained()
    opt.param_groups[0]["capturable"] = True
    move({"opt": opt}, ["opt"], META)
    assert opt.state[model[0].weight]["step"].device == META


def test_lazy_parameters_are_left_alone():
    lazy = torch.nn.LazyLinear(3)
    result = move({"lazy": lazy}, ["lazy"], META)
    assert result.names == {}


# --- containers ---------------------------------------------------------------------------


def containers():
    t = torch.randn(2)
    factory = list
    return t, {
        "list": [t],
        "tuple": (t,),
        "dict": {"k": t},
        "ordered": collections.OrderedDict(k=t),
        "default": collections.defaultdict(factory, k=t),
        "named": Pair(t, t),
        "dataclass": Batch(t, t),
        "frozen": Frozen(t),
        "nested": {"a": [({"b": [t]},)]},
    }


@pytest.mark.parametrize("kind", list(containers()[1]))
def test_every_container_type_keeps_its_object_and_type(target, kind):
    t, boxes = containers()
    box = boxes[kind]
    before = copy.copy(box) if not isinstance(box, tuple) else box
    ns = {"box": box}
    moved_all(ns, target)
    assert ns["box"] is box and type(box) is type(before)
    assert t.device == target
    if kind == "default":
        assert box.default_factory is list


def test_deep_nesting_and_cycles_are_walked_once():
    t = torch.randn(2)
    deep: list = [t]
    for _ in range(5000):
        deep = [deep]
    loop: list = [t]
    loop.append(loop)
    result = move({"deep": deep, "loop": loop}, ["deep", "loop"], META)
    assert t.device == META and result.nbytes == t.nbytes


def test_other_objects_are_left_untouched():
    class Holder:
        def __init__(self) -> None:
            self.t = torch.randn(2)

    holder = Holder()
    ns = {"holder": holder, "n": 3, "s": "text", "dev": CPU}
    result = moved_all(ns, META)
    assert holder.t.device == CPU and result.names == {}


def test_a_walk_stops_after_its_limit_and_says_what_it_did_not_walk(monkeypatch):
    monkeypatch.setattr(moving.plan, "WALK_LIMIT", 1000)
    first, last = torch.zeros(1), torch.zeros(1)
    samples = [(first, "a"), *[(i, "label") for i in range(5000)], (last, "z")]
    result = move({"samples": samples, "x": torch.zeros(2)}, ["samples", "x"], META)
    assert first.device == META and last.device == CPU  # the walk stopped before it
    assert result.skipped == ["samples past its first 1,000 objects other than tensors"]
    assert result.names == {"samples": 4, "x": 8}
    assert "not walked: samples past its first 1,000" in result.table().text()


def test_a_million_samples_cost_a_bounded_walk():
    np = pytest.importorskip("numpy")
    t = torch.zeros(1)
    samples = [(np.zeros(2), 0)] * 1_000_000  # one sample a million times: cheap to build
    tracemalloc.start()
    try:
        result = move({"data": samples, "t": t}, ["data", "t"], META)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20  # the walk does not hold a million entries at once
    assert result.skipped == ["data past its first 100,000 objects other than tensors"]
    assert t.device == META


class RaisingItems(dict):
    def items(self):
        raise RuntimeError("no items today. Really")


@dataclass
class RaisingField:
    t: torch.Tensor

    def __getattribute__(self, name: str):
        if name == "t":
            raise ValueError("cannot read t")
        return super().__getattribute__(name)


def test_objects_that_raise_when_walked_are_skipped_and_named():
    hidden, ok = torch.zeros(1), torch.zeros(2)
    ns = {"bad": RaisingItems(t=hidden), "box": [RaisingField(hidden)], "ok": ok}
    result = moved_all(ns, META)
    assert ok.device == META and hidden.device == CPU
    assert result.skipped == [
        "bad, where its RaisingItems raised RuntimeError: no items today",
        "box[0], where its RaisingField raised ValueError: cannot read t",
    ]
    assert "not walked: bad, where its RaisingItems raised" in result.table().text()


def test_names_missing_from_the_namespace_are_ignored():
    assert move({}, ["nope"], META).names == {}


# --- references that cannot follow --------------------------------------------------------


def refuse_swaps(monkeypatch, *refused: torch.Tensor) -> None:
    """Make torch refuse to swap `refused` (as a C++ weak reference, or torch < 2.3, would)."""
    swap = moving.commit._swap_impl

    def refusing(a, b):
        if any(a is t or b is t for t in refused):
            raise RuntimeError("Expected no weakrefs to t1's Tensor object")
        swap(a, b)

    monkeypatch.setattr(moving.commit, "_swap_impl", refusing)


def test_a_weakly_referenced_tensor_keeps_its_identity(target):
    t = torch.randn(2)
    ref = weakref.ref(t)
    box = {"pair": Pair(t, t), "list": [t]}
    ns = {"t": t, "box": box}
    result = moved_all(ns, target)
    assert ns["t"] is t and ref() is t and t.device == target
    assert box["list"][0] is t and box["pair"] == (t, t) and result.not_followed == []


def test_a_dict_of_tensors_keeps_identity_wherever_it_is_observable(target):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    d = {f"t{i}": torch.zeros(4) for i in range(100)}  # as in the benchmark
    d["w"] = model.weight
    alias, ref = d["t0"], weakref.ref(d["t1"])
    ns = {"d": d, "alias": alias}
    move(ns, ["d"], target)
    assert ns["d"] is d and d["t0"] is alias and ref() is d["t1"]
    assert model.weight is d["w"] and opt.param_groups[0]["params"][0] is d["w"]
    assert all(t.device == target for t in d.values())


def test_only_what_nothing_else_observes_is_rebound_the_rest_keeps_identity():
    # A tensor only its dict holds may come back as a new object (nothing can tell); one
    # with any other way to reach it keeps its identity.
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    named, weak, base = torch.zeros(2), torch.zeros(2), torch.zeros(4)
    ref = weakref.ref(weak)
    d = {"lone": torch.zeros(2), "named": named, "weak": weak, "tagged": torch.zeros(2),
         "param": torch.nn.Parameter(torch.zeros(2)), "view": base[1:], "base": base,
         "w": model.weight, "leaf": torch.zeros(2, requires_grad=True)}
    d["tagged"].tag = "keep me"
    ids = {k: id(t) for k, t in d.items()}  # only `d` holds lone, tagged, param, view, leaf
    with torch.no_grad():
        model.bias.mul_(1)
    move({"d": d, "opt": opt}, ["d"], META)
    assert id(d["lone"]) != ids["lone"] and d["lone"].device == META  # rebound: unobservable
    assert d["named"] is named and d["weak"] is weak and ref() is weak
    assert id(d["tagged"]) == ids["tagged"] and d["tagged"].tag == "keep me"
    assert id(d["param"]) == ids["param"] and type(d["param"]) is torch.nn.Parameter
    assert [id(d[k]) for k in ("view", "leaf")] == [ids["view"], ids["leaf"]]
    assert d["base"] is base and d["leaf"].requires_grad
    assert d["w"] is model.weight and opt.param_groups[0]["params"][0] is model.weight
    assert all(t.device == META for t in d.values())


def test_a_tensor_torch_will_not_swap_is_replaced_where_walked_and_reported(monkeypatch):
    t = torch.randn(2)
    refuse_swaps(monkeypatch, t)
    box = {"pair": Pair(t, t), "list": [t]}
    ns = {"t": t, "box": box}
    result = moved_all(ns, META)
    new = ns["t"]
    assert new is not t and new.device == META and t.device == CPU
    assert box["list"][0] is new and box["pair"] == (new, new) and type(box["pair"]) is Pair
    assert result.not_followed == [  # named by the first place it was found
        "box['pair'][0]: replaced by a new tensor because torch refused to swap it; "
        "references the cell does not name keep the old one"
    ]


def test_a_module_parameter_that_cannot_swap_is_rebound_in_module_and_optimizer(monkeypatch):
    model, opt = trained()
    old = model[0].weight
    refuse_swaps(monkeypatch, old)
    moved_all({"model": model, "opt": opt}, META)
    new = model[0].weight
    assert new is not old and old.device == CPU
    assert type(new) is torch.nn.Parameter and new.device == META and new.grad.device == META
    assert opt.param_groups[0]["params"][0] is new and new in opt.state and old not in opt.state


def test_a_base_whose_unnamed_view_holds_it_moves_and_the_view_stays():
    base = torch.arange(4.0)
    view = base[1:]
    ns = {"base": base}
    result = move(ns, ["base"], META)
    assert ns["base"] is base and base.device == META and view.device == CPU
    assert torch.equal(view, torch.arange(1.0, 4.0))
    assert result.not_followed == [
        "base: moved, but a view or an autograd graph made before still holds its old data on cpu"
    ]


# --- all or nothing -----------------------------------------------------------------------


def workload() -> dict:
    model, opt = trained()
    base = torch.arange(8.0)
    w = torch.randn(3, requires_grad=True)
    w.grad = torch.ones(3)
    return {
        "model": model,
        "opt": opt,
        "base": base,
        "view": base[2:],
        "w": w,
        "batch": Batch(torch.ones(2), torch.zeros(2)),
        "xs": [torch.randn(2)] * 2,
    }


def allocations() -> int:
    with FailOnAllocation(META, 0) as counter:
        moved_all(workload(), META)
    return counter.count


@pytest.mark.parametrize("n", [1, 2, 5, 9, "last"])
def test_a_failing_copy_changes_nothing_and_names_what_failed(n):
    if n == "last":
        n = allocations()
    ns = workload()
    before = snapshot(ns)
    with pytest.raises(DeviceMagicError) as info, FailOnAllocation(META, n) as faults:
        moved_all(ns, META)
    message = str(info.value)
    assert message.startswith("Could not move ") and message.endswith("nothing was moved.")
    assert "to meta: out of memory" in message and " B)" in message
    assert info.value.__cause__ is None and info.value.__context__ is None
    assert_unchanged(ns, before)
    assert faults.made and not faults.alive()  # the copies made are freed


def test_an_interrupted_move_changes_nothing_and_its_traceback_holds_no_copies():
    ns = workload()
    before = snapshot(ns)
    interrupt = FailOnAllocation(META, 3, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt) as info, interrupt:
        moved_all(ns, META)
    assert info.tb is not None  # the frames are still alive here
    assert_unchanged(ns, before)
    assert interrupt.made and not interrupt.alive()


def test_the_error_names_the_object_and_its_size():
    ns = {"batch": {"inputs": torch.zeros(256)}}
    expected = r"Could not move batch\['inputs'\] \(1.0 KiB\) to meta: out of memory;"
    with pytest.raises(DeviceMagicError, match=expected), FailOnAllocation(META, 1):
        moved_all(ns, META)


@pytest.mark.parametrize("bar", [False, True])  # with a bar, copies are made one at a time
def test_the_error_names_the_tensor_whose_copy_failed(monkeypatch, bar):
    if bar:
        monkeypatch.setattr(moving.copy, "_BAR_MIN_BYTES", 1)
    ns = {"d": {f"t{i}": torch.zeros(4) for i in range(4)}}
    failing = pytest.raises(DeviceMagicError, match=r"move d\['t2'\] \(16 B\)")
    with failing, FailOnAllocation(META, 3):
        moved_all(ns, META)
    assert all(t.device == CPU for t in ns["d"].values())


TORCH_ESSAY = (
    "Could not run 'aten::_to_copy' with arguments from the 'NestedTensorMeta' backend. "
    "This could be because the operator doesn't exist for this backend, or was omitted. "
    "'aten::_to_copy' is only available for these backends: [CPU, CUDA, " + "X, " * 300 + "]"
    "\n\nUndefined: registered at RegisterCompositeExplicitAutograd_0.cpp:4472"
)


def test_a_long_torch_error_is_cut_to_its_first_sentence():
    ns = {"x": torch.zeros(4)}
    fault = FailOnAllocation(META, 1, NotImplementedError(TORCH_ESSAY))
    with pytest.raises(DeviceMagicError) as info, fault:
        moved_all(ns, META)
    assert str(info.value) == (
        "Could not move x (16 B) to meta: Could not run 'aten::_to_copy' with arguments "
        "from the 'NestedTensorMeta' backend; nothing was moved."
    )


def test_a_meta_tensor_cannot_move_to_the_cpu_and_nothing_changes():
    a, m = torch.ones(2), torch.empty(2, device=META)
    ns = {"a": a, "m": m}
    with pytest.raises(DeviceMagicError, match="on the meta device, which holds no data"):
        moved_all(ns, CPU)
    assert ns["m"] is m and m.device == META


class Two(tuple):
    """A tuple subclass whose constructor takes two arguments: rebuilding it fails."""

    def __new__(cls, a, b):
        return super().__new__(cls, (a, b))


def test_an_error_in_the_commit_undoes_it_and_says_so_in_one_line(monkeypatch):
    ns = workload()
    t = torch.randn(2)
    ns["odd"] = Two(t, "label")
    refuse_swaps(monkeypatch, t)  # so that its holder must be rebuilt, after the others moved
    before = snapshot(ns)
    with pytest.raises(DeviceMagicError) as info:
        moved_all(ns, META)
    message = str(info.value)
    assert message.startswith("Could not move to meta: TypeError: ") and "\n" not in message
    assert message.endswith("; nothing was moved.")
    assert info.value.__cause__ is None and info.value.__context__ is None
    assert_unchanged(ns, before)
    assert ns["odd"][0] is t and t.device == CPU


BIG = 300_000
RESTORE_INTERRUPTED = "Ctrl-C during --restore: it finished first, everything went back"


def interrupted_move(ns: dict, restorable: bool, delay: float, when,
                     timers: list[threading.Timer] | None = None):
    """`move` with a real SIGINT sent `delay` seconds after `when` (the start, or the first
    swap, whose timer the caller arms into `timers`): the result, or None where the
    interrupt stopped it. A signal that comes only after `move` returned (a loaded machine
    runs the timer late) is not the move's."""
    timers = [] if timers is None else timers
    if when == "start":
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        timers.append(timer)
    try:
        result = move(ns, ["big"], META, restorable=restorable)
    except KeyboardInterrupt:
        result = None
    try:
        for timer in timers:
            timer.join()  # the signal is sent; Python handles it within a few bytecodes
        for _ in range(10_000):
            pass
    except KeyboardInterrupt:
        pass  # sent after the move had returned
    return result


@pytest.mark.parametrize(("when", "delay", "restorable"), [
    ("commit", 0.0, True), ("commit", 0.0, False), ("commit", 0.005, True),
    ("commit", 0.002, False), ("start", 0.1, True), ("start", 0.4, False),
])
def test_a_real_sigint_during_a_big_move_moves_all_or_nothing(
    monkeypatch, restorable, when, delay
):
    tensors = [torch.full((1,), float(i)) for i in range(BIG)]
    ns = {"big": tensors}
    if when == "commit":  # a signal sent once the commit started: it lands in it or after
        swap_all = moving.commit._swap_all

        def swapping(*args, **kwargs):
            if not armed:
                armed.append(threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)))
                armed[0].start()
            return swap_all(*args, **kwargs)

        armed: list[threading.Timer] = []
        for module in (moving.commit, moving.restoring):  # where it is called
            monkeypatch.setattr(module, "_swap_all", swapping)
    result = interrupted_move(ns, restorable, delay, when, armed if when == "commit" else None)
    assert ns["big"] is tensors
    devices = {t.device.type for t in tensors}
    assert devices == ({"meta"} if result is not None else {"cpu"})  # never a mix
    if restorable:
        if result is not None:
            restore(ns, result)
        assert all(t.device == CPU for t in tensors)
        assert torch.equal(torch.cat(tensors), torch.arange(float(BIG)))  # no data lost
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sigint_during_a_restore_waits_until_it_ends(monkeypatch):
    tensors = [torch.full((1,), float(i)) for i in range(1000)]
    ns = {"big": tensors}
    result = move(ns, ["big"], META, restorable=True)
    swap_all = moving.commit._swap_all

    def swapping(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # at once, before the swaps back
        return swap_all(*args, **kwargs)

    for module in (moving.commit, moving.restoring):  # where it is called
        monkeypatch.setattr(module, "_swap_all", swapping)
    back = restore(ns, result)  # the caller raises KeyboardInterrupt, once it has this
    assert back.interrupted and back.said == [RESTORE_INTERRUPTED]
    assert all(t.device == CPU for t in tensors)
    assert torch.equal(torch.cat(tensors), torch.arange(1000.0))


@pytest.mark.parametrize("delay", [0.0, 0.003, 0.03])
def test_a_real_sigint_anywhere_in_a_restore_from_meta_loses_nothing(monkeypatch, delay):
    n = BIG // 3  # a restore of a tenth of a second or more: each delay lands in it
    tensors = [torch.full((1,), float(i)) for i in range(n)]
    ns = {"big": tensors}
    result = move(ns, ["big"], META, restorable=True)
    timers: list[threading.Timer] = []
    sigint_on(monkeypatch, moving.restoring, "_put_back_originals", delay, timers)
    back = None
    try:
        back = restore(ns, result)
        settle(timers)
    except KeyboardInterrupt:  # only once the restore is done
        settle(timers)
    assert ns["big"] is tensors and all(t.device == CPU for t in tensors)
    assert torch.equal(torch.cat(tensors), torch.arange(float(n)))
    if back is not None and back.interrupted:
        assert back.said == [RESTORE_INTERRUPTED]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.fixture
def user_handler():
    """A notebook's own "stop after this epoch" SIGINT handler: it notes each signal."""
    stops: list[int] = []

    def stop_after_this_epoch(signum, frame):
        stops.append(signum)

    signal.signal(signal.SIGINT, stop_after_this_epoch)
    try:
        yield stop_after_this_epoch, stops
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.mark.parametrize("restorable", [False, True])
def test_a_users_sigint_handler_gets_a_signal_sent_in_the_commit(
    monkeypatch, user_handler, restorable
):
    handler, stops = user_handler
    tensors = [torch.full((1,), float(i)) for i in range(1000)]
    ns = {"big": tensors}
    swap_all = moving.commit._swap_all

    def swapping(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # lands in the commit
        return swap_all(*args, **kwargs)

    for module in (moving.commit, moving.restoring):  # where it is called
        monkeypatch.setattr(module, "_swap_all", swapping)
    try:
        result = move(ns, ["big"], META, restorable=restorable)
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C cancelled the move instead of reaching the user's handler")
    assert all(t.device == META for t in tensors)  # the move was done
    assert signal.getsignal(signal.SIGINT) is handler
    if restorable:  # held for the caller, which has the result and can restore
        assert stops == [] and result.interrupted == 1
        moving.deliver(result)
    assert stops == [signal.SIGINT] and not result.interrupted
    if restorable:
        back = restore(ns, result)  # a second signal, in the restore's swaps
        assert stops == [signal.SIGINT] and back.interrupted == 1
        moving.deliver(back)
        assert stops == [signal.SIGINT] * 2 and back.said == [RESTORE_INTERRUPTED]
        assert torch.equal(torch.cat(tensors), torch.arange(1000.0))
        assert signal.getsignal(signal.SIGINT) is handler


def test_restore_from_meta_gives_back_what_a_name_rebound_to_meta_held():
    images, model, keep = torch.arange(24.0).reshape(2, 3, 4), torch.nn.Linear(4, 2), torch.ones(2)
    weight = model.weight.detach().clone()
    ns = {"images": images, "model": model, "keep": keep, "view": images[0]}
    result = moved_all(ns, META, restorable=True)
    ns["images"] = ns["images"].flatten(1)  # the shape check's own result: data-less
    ns["model"] = [torch.nn.Linear(4, 2, device=META)]  # a container of meta ones
    ns["keep"] = torch.zeros(3)  # holds data: the cell's result stays
    del ns["view"]
    back = restore(ns, result)
    assert ns["images"] is images and torch.equal(images, torch.arange(24.0).reshape(2, 3, 4))
    assert ns["model"] is model and torch.equal(model.weight, weight)
    assert torch.equal(ns["keep"], torch.zeros(3)) and "view" not in ns
    assert back.said == [
        "--restore from meta gave back what the names images, model held: "
        "the cell bound them to meta tensors, which hold no data"
    ]


# --- restore ------------------------------------------------------------------------------


def test_restore_from_meta_brings_the_originals_back_as_they_were():
    ns = workload()
    before = snapshot(ns)
    pointers = {k: t.data_ptr() for k, t in ns["model"].state_dict().items()}
    result = moved_all(ns, META, restorable=True)
    assert ns["base"].device == META
    back = restore(ns, result)
    assert_unchanged(ns, before)
    assert {k: t.data_ptr() for k, t in ns["model"].state_dict().items()} == pointers
    assert storage(ns["view"]) == storage(ns["base"])
    assert back.names == result.names


def test_restore_from_meta_undoes_an_optimizer_step_taken_there():
    ns = workload()
    model, opt = ns["model"], ns["opt"]
    before = snapshot(ns)
    result = moved_all(ns, META, restorable=True)
    with torch.device(META):
        model(torch.randn(8, 3)).sum().backward()
    opt.step()
    restore(ns, result)
    assert_unchanged(ns, before)


def test_restore_leaves_what_the_cell_made_on_the_device():
    x = torch.ones(2)
    ns = {"x": x}
    result = moved_all(ns, META, restorable=True)
    ns["x"] = ns["x"] * 2
    ns["new"] = torch.zeros(1, device=META)
    restore(ns, result)
    assert x.device == CPU and torch.equal(x, torch.ones(2))
    assert ns["new"].device == META


def test_restore_puts_back_a_tensor_that_was_replaced(monkeypatch):
    t = torch.ones(2)
    ref = weakref.ref(t)
    refuse_swaps(monkeypatch, t)
    ns = {"t": t, "box": [t]}
    result = moved_all(ns, META, restorable=True)
    assert ns["t"] is not t
    restore(ns, result)
    assert ns["t"] is t and ns["box"][0] is t and ref() is t and t.device == CPU


def test_restore_needs_a_restorable_move():
    with pytest.raises(ValueError, match="restorable=True"):
        restore({}, move({}, [], META))


def test_a_restored_move_lets_go_of_the_originals():
    ns = {"t": torch.ones(3)}
    ref = weakref.ref(ns["t"])
    result = move(ns, ["t"], META, restorable=True)
    restore(ns, result)
    del ns["t"]
    assert ref() is None  # `result` is still alive: a traceback may hold it
    with pytest.raises(ValueError, match="once"):
        restore(ns, result)


# --- restore from meta gives back the very objects, whatever the cell did ------------------


def holders(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """What a restore must give back: each object, its data, grad and optimizer state."""
    params = list(model.parameters())
    return {
        "params": params,
        "values": [p.detach().clone() for p in params],
        "grads": [p.grad for p in params],
        "grad_values": [p.grad.clone() for p in params],
        "buffers": list(model.buffers()),
        "state": [dict(opt.state[p]) for p in params],
        "moments": [opt.state[p]["exp_avg"].clone() for p in params],
    }


def assert_given_back(model, opt, kept: dict, box: list) -> None:
    """The same objects, on the CPU, with their data, grads, leafness and Adam state, held by
    the model, the optimizer and `box` (a holder the cell does not name); training works."""
    params = list(model.parameters())
    assert all(a is b for a, b in zip(params, kept["params"], strict=True))
    assert all(a is b for a, b in zip(box, kept["params"], strict=True))
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], params, strict=True))
    assert all(a is b for a, b in zip(model.buffers(), kept["buffers"], strict=True))
    for p, value, grad, grad_value, state, moment in zip(
        params, kept["values"], kept["grads"], kept["grad_values"], kept["state"],
        kept["moments"], strict=True,
    ):
        assert p.device == CPU and p.is_leaf and p.requires_grad and torch.equal(p, value)
        assert p.grad is grad and torch.equal(grad, grad_value)
        assert opt.state[p]["exp_avg"] is state["exp_avg"]
        assert torch.equal(state["exp_avg"], moment)
    assert len(opt.state_dict()["state"]) == len(params)  # KeyError on a parameter left behind
    opt.zero_grad()
    model(torch.randn(8, 3)).pow(2).sum().backward()
    opt.step()
    assert not torch.equal(params[0], kept["values"][0])  # training changes the model
    assert int(opt.state[params[0]]["step"]) == 2  # Adam goes on from its moments


@pytest.mark.parametrize("named", [["model"], ["model", "opt"]])
def test_restore_from_meta_gives_back_the_objects_when_the_cells_graph_survives(named):
    model, opt = trained()
    kept = holders(model, opt)
    box = list(kept["params"])
    ns = {"model": model, "opt": opt, "x": torch.randn(8, 3)}
    result = move(ns, [*named, "x"], META, restorable=True)
    ns["loss"] = model(ns["x"]).pow(2).sum()  # kept: its graph holds the meta tensors
    ns["Out"] = {1: ns["loss"]}
    restore(ns, result)
    assert ns["loss"].device == META  # what the cell made stays
    assert_given_back(model, opt, kept, box)


def test_restore_from_meta_gives_back_the_objects_when_a_traceback_holds_the_meta_ones():
    model, opt = trained()
    kept = holders(model, opt)
    box = list(kept["params"])
    ns = {"model": model}
    result = move(ns, ["model"], META, restorable=True)

    def forward() -> None:
        hidden = model[0](torch.ones(2, 3, device=META))  # noqa: F841 (the frame keeps it)
        model(torch.ones(2, 5, device=META))  # a shape error, what meta is used to find

    with pytest.raises(RuntimeError) as failed:
        forward()
    restore(ns, result)
    assert failed.tb is not None  # its frames are still alive
    assert_given_back(model, opt, kept, box)


def test_restore_from_meta_gives_back_a_tensor_the_cell_made_a_view_of():
    a = torch.arange(6.0)
    buffers = torch.nn.Module()
    buffers.register_buffer("a", a)
    box, mapping = [a], {"a": a}
    ns = {"a": a}
    result = move(ns, ["a"], META, restorable=True)
    ns["v"] = a[2:]  # a view of the meta tensor
    restore(ns, result)
    assert ns["a"] is a and box[0] is a and mapping["a"] is a and buffers.a is a
    assert a.device == CPU and torch.equal(a, torch.arange(6.0))
    assert ns["v"].device == META


def test_restore_from_meta_gives_back_a_tensors_autograd_history():
    w = torch.ones(3, requires_grad=True)
    loss = (w * 3).sum()
    box = [loss]
    ns = {"loss": loss}
    result = move(ns, ["loss"], META, restorable=True)
    assert ns["loss"].shape == ()  # the cell only reads it
    restore(ns, result)
    assert ns["loss"] is loss and box[0] is loss and loss.device == CPU
    assert loss.grad_fn is not None and loss.item() == 9
    loss.backward()
    assert torch.equal(w.grad, torch.full((3,), 3.0))


def test_restore_from_meta_gives_back_leafness_grads_and_hooks():
    w = torch.ones(3, requires_grad=True)
    w.grad = torch.zeros(3)
    grad = w.grad
    w.register_hook(lambda g: g * 10)
    ns = {"w": w}
    result = move(ns, ["w"], META, restorable=True)
    w.grad = None  # as zero_grad() does
    restore(ns, result)
    assert w.is_leaf and w.requires_grad and w.grad is grad and w.device == CPU
    w.sum().backward()
    assert torch.equal(w.grad, torch.full((3,), 10.0))


# --- every move keeps what a tensor carries -------------------------------------------------


def test_autograd_hooks_still_run_after_a_move():
    w = torch.ones(3, requires_grad=True)
    p = torch.nn.Parameter(torch.ones(3))
    calls = []
    w.register_hook(lambda g: calls.append("pre") or g * 10)
    p.register_post_accumulate_grad_hook(lambda t: calls.append("post"))
    ns = {"w": w, "p": p}
    moved_all(ns, META)
    (w * p).sum().backward()
    assert calls == ["pre", "post"] and w.grad.device == META


def test_lazy_conjugate_and_negative_views_keep_their_bits():
    c = torch.randn(4, dtype=torch.cfloat)
    r = torch.randn(4)
    ns = {"c": c, "cc": c.conj(), "r": r, "n": r._neg_view()}
    moved_all(ns, META)
    assert ns["cc"].is_conj() and not c.is_conj() and storage(ns["cc"]) == storage(c)
    assert ns["n"].is_neg() and not r.is_neg() and storage(ns["n"]) == storage(r)


def test_lbfgs_state_in_lists_follows_its_parameters():
    w = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.LBFGS([w], history_size=3, max_iter=4)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (w**4).sum()
        loss.backward()
        return loss

    opt.step(closure)
    state = opt.state[w]
    lists = [state[k] for k in ("old_dirs", "old_stps", "ro", "al")]
    tensors = [t for items in lists for t in items if isinstance(t, torch.Tensor)]
    assert tensors and all(t.device == CPU for t in tensors)
    move({"opt": opt}, ["opt"], META)
    assert w.device == META and all(t.device == META for t in tensors)
    assert state["d"].device == META and state["prev_flat_grad"].device == META


# --- inference mode ---------------------------------------------------------------------


def test_a_move_in_inference_mode_makes_the_kind_of_tensor_it_found():
    model, opt = trained()
    with torch.inference_mode():
        made_there = torch.ones(2)
    ns = {"model": model, "opt": opt, "made_there": made_there}
    with torch.inference_mode():  # %%nograd --inference around the move
        moved_all(ns, META)
    assert not any(p.is_inference() for p in model.parameters())
    assert not opt.state[model[0].weight]["exp_avg"].is_inference()
    assert made_there.is_inference() and made_there.device == META
    model(torch.randn(8, 3, device=META)).sum().backward()  # refused for inference tensors
    opt.step()
    assert model[0].weight.grad.device == META


# --- tensor subclasses that keep their data in Python attributes --------------------------


class Wrapped(torch.Tensor):
    """A traceable wrapper subclass, as DTensor and NF4 are: its data is `inner`, a tensor
    in a Python attribute; its C++ tensor holds none."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapped:
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, dtype=inner.dtype, device=inner.device
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inners, ctx, size, stride):
        return Wrapped(inners["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = torch.utils._pytree.tree_map_only
        args, kwargs = unwrap(Wrapped, lambda w: w.inner, (args, kwargs or {}))
        return unwrap(torch.Tensor, Wrapped, func(*args, **kwargs))


def subclassed() -> dict:
    """One of each kind, each with an attribute of the user's own."""
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    masked = torch.masked.masked_tensor(torch.arange(3.0), torch.tensor([True, False, True]))
    ns = {"nested": nested, "masked": masked, "wrapped": Wrapped(torch.arange(3.0))}
    for name, t in ns.items():
        t.note = name
    return ns


def data_of(ns: dict) -> dict:
    """Where each one's data is: the tensors in its Python attributes."""
    return {
        "nested": {ns["nested"]._values.device, ns["nested"]._offsets.device},
        "masked": {ns["masked"].get_data().device, ns["masked"].get_mask().device},
        "wrapped": {ns["wrapped"].inner.device},
    }


@pytest.mark.filterwarnings("ignore:The PyTorch API of:UserWarning")
def test_subclasses_that_keep_their_data_in_attributes_move_it_and_keep_identity():
    ns = subclassed()
    before = dict(ns)
    result = moved_all(ns, META)
    assert data_of(ns) == {key: {META} for key in ns}
    assert all(ns[k] is before[k] and ns[k].device == META for k in ns)
    assert [t.note for t in ns.values()] == list(ns) and not result.not_followed
    assert ns["nested"].shape[0] == 2 and (ns["wrapped"] * 2).inner.device == META


@pytest.mark.filterwarnings("ignore:The PyTorch API of:UserWarning")
def test_subclasses_moved_to_meta_restorably_come_back_as_the_same_objects():
    ns = subclassed()
    before = dict(ns)
    moved = moved_all(ns, META, restorable=True)
    assert data_of(ns) == {key: {META} for key in ns}  # the cell sees them on meta: copies
    assert len(moved.not_followed) == 3
    assert "nested: a NestedTensor keeps its data in Python attributes" in moved.not_followed[1]
    restore(ns, moved)
    assert all(ns[k] is before[k] for k in ns) and data_of(ns) == {key: {CPU} for key in ns}
    assert torch.equal(ns["wrapped"].inner, torch.arange(3.0))


class Tagged(torch.Tensor):
    """A subclass whose `.to` does not carry what it keeps in an attribute."""


def test_a_subclass_whose_own_to_leaves_data_behind_is_refused_in_one_line():
    t = torch.ones(3).as_subclass(Tagged)
    t.scale = torch.ones(1)
    ns = {"t": t, "x": torch.zeros(2)}
    before = snapshot(ns)
    with pytest.raises(DeviceMagicError) as err:
        moved_all(ns, META)
    assert str(err.value) == (
        "Could not move t (12 B) to meta: it is a Tagged, which keeps tensors in Python "
        "attributes, and its own .to left scale on cpu; nothing was moved."
    )
    assert_unchanged(ns, before)
    assert t.device == CPU and t.scale.device == CPU


def test_a_copy_failing_with_a_key_error_says_so_in_a_sentence(monkeypatch):
    # torch's jagged nested tensors look up their offsets in a registry of weak references:
    # a miss raises KeyError(<weakref at 0x...>), whose message is that weak reference.
    t = torch.ones(3).as_subclass(Tagged)
    t.scale = torch.ones(1)

    def to(self, *args, **kwargs):
        raise KeyError(weakref.ref(self))

    monkeypatch.setattr(Tagged, "to", to)
    with pytest.raises(DeviceMagicError) as err:
        move({"t": t}, ["t"], META)
    assert str(err.value) == (
        "Could not move t (12 B) to meta: its class's own .to (Tagged.to) failed with a "
        "KeyError; nothing was moved."
    )


# --- what a move refuses before copying ----------------------------------------------------


def test_a_move_out_of_meta_is_refused_before_any_copy(monkeypatch):
    ns = {"a": torch.ones(3), "z": torch.ones(3, device=META)}
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *args: collected.append(args))
    with FailOnAllocation(CPU, 0) as copies, pytest.raises(DeviceMagicError) as err:
        move(ns, ["a", "z"], torch.device("cpu"))
    assert str(err.value) == (
        "Could not move z (12 B) to cpu: it is on the meta device, which holds no data; "
        "nothing was moved."
    )
    assert copies.count == 0 and collected == []


# --- the walk keeps no class alive -----------------------------------------------------------


def test_a_class_the_walk_looked_at_is_not_kept_alive():
    namespace: dict = {}
    exec("class Thing:\n    pass", namespace)
    ns = {"thing": namespace["Thing"](), "x": torch.zeros(1)}
    ref = weakref.ref(namespace["Thing"])
    moved_all(ns, META)
    del namespace, ns
    gc.collect()
    assert ref() is None


# --- reporting ----------------------------------------------------------------------------


def test_the_result_renders_names_bytes_and_time():
    ns = {"x": torch.zeros(256), "y": torch.zeros(2)}
    text = moved_all(ns, META).table().text()
    assert text.splitlines()[0].startswith("moved 1.0 KiB to meta in ")
    rows = [line.split(maxsplit=1) for line in text.splitlines()[3:]]
    assert rows == [["x", "1.0 KiB"], ["y", "8 B"]]


def test_nothing_to_move_says_so():
    assert (
        move({"x": torch.zeros(1)}, ["x"], CPU).table().text().startswith("nothing to move to cpu")
    )


def test_a_big_move_shows_a_progress_bar_that_goes_away(monkeypatch, capsys):
    monkeypatch.setattr(moving.copy, "_BAR_MIN_BYTES", 1024)
    moved_all({"x": torch.zeros(256)}, META)
    err = capsys.readouterr().err
    assert "moving to meta" in err and err.endswith("\r")  # leave=False clears the line


def test_without_ipywidgets_the_bar_is_text_not_a_widget_that_warns(monkeypatch, capsys):
    # In Jupyter without ipywidgets, tqdm.auto's widget warns "IProgress not found".
    widget = types.ModuleType("tqdm.auto")

    def notebook_bar(*args, **kwargs):
        raise AssertionError("IProgress not found. Please update jupyter and ipywidgets.")

    widget.tqdm = notebook_bar
    monkeypatch.setitem(sys.modules, "tqdm.auto", widget)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # cannot be imported
    monkeypatch.setattr(moving.copy, "_BAR_MIN_BYTES", 1024)
    moved_all({"x": torch.zeros(256)}, META)
    assert "moving to meta" in capsys.readouterr().err


def test_a_restore_from_meta_says_what_it_did():
    ns = {"x": torch.zeros(256), "y": [torch.zeros(2), torch.ones(2)]}
    back = restore(ns, moved_all(ns, META, restorable=True))
    title = back.table().text().splitlines()[0]
    assert title == "restored 3 tensors from meta (the originals put back)"


@pytest.mark.parametrize("up", [False, True])
def test_timings_wait_for_an_accelerator_only_where_its_runtime_is_up(monkeypatch, up):
    synced = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: up)
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    for dev in ("cpu", "meta", "cuda:0"):
        probes.synchronize(torch.device(dev))
    assert synced == ([torch.device("cuda:0")] if up else [])


def test_a_small_move_shows_nothing(capsys):
    moved_all({"x": torch.zeros(256)}, META)
    assert capsys.readouterr().err == ""


@pytest.mark.cuda  # a CPU build never starts CUDA: only a CUDA build can fail this
def test_moving_on_cpu_and_meta_never_touches_cuda():
    """In a fresh process: in this one an earlier test (a CUDA one) may have started it."""
    code = ("import torch\n"
            "from test_moving import META, moved_all, workload\n"
            "moved_all(workload(), META)\n"
            "print(torch.cuda.is_initialized())")
    run = subprocess.run([sys.executable, "-c", code], env=child_env(Path(__file__).parent),
                         capture_output=True, text=True, timeout=300)
    assert run.stdout.split() == ["False"], run.stderr[-2000:]


@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_tensors_move_with_their_layout_and_bytes(layout):
    dense = torch.eye(4)
    sparse = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    parts = (sparse._indices(), sparse._values()) if layout == "coo" else (
        sparse.crow_indices(), sparse.col_indices(), sparse.values())
    expected, kind = sum(p.nbytes for p in parts), sparse.layout
    ns = {"s": sparse}
    ns = {"s": sparse, "again": [sparse]}
    result = move(ns, ["again", "s"], torch.device("meta"))
    assert ns["s"].device.type == "meta"
    assert ns["s"].layout == kind
    assert result.names == {"again": expected}  # counted once, under the first name


def test_what_an_optimizer_holds_keeps_its_identity_though_nothing_else_holds_it():
    w = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.LBFGS([w], history_size=3, max_iter=4)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = ((w - 1) ** 4).sum()
        loss.backward()
        return loss

    opt.step(closure)
    dirs = opt.state[w]["old_dirs"]  # only its list holds each of these
    ids = [id(t) for t in dirs]
    assert ids
    move({"opt": opt}, ["opt"], META)
    assert opt.state[w]["old_dirs"] is dirs and [id(t) for t in dirs] == ids
    assert all(t.device == META for t in dirs)


def test_every_column_of_a_plan_is_dropped_with_a_tensor_found_again():
    # The plan's per-tensor columns are declared once (`_COLUMNS`) and compressed together:
    # one added without being declared would keep its entry for each tensor found again.
    t, u = torch.zeros(2), torch.ones(1, requires_grad=True)
    ns = {"a": [t, u, t, t], "b": [u]}
    planned = moving.plan._Plan
    for plan in (planned.to(META), planned(None, {id(t): META, id(u): META}, {})):
        plan.walk(ns, ["a", "b"])
        columns = {k: v for k, v in vars(plan).items() if isinstance(v, list) and len(v) == 5}
        assert columns == {}  # 5 found, 2 kept
        lists = [getattr(plan, k) for k in moving.plan._COLUMNS]
        assert [len(c) for c in lists if isinstance(c, list)] == [2] * (2 + (plan.device is None))
        assert plan.requiring_grad == [1] and plan.names == [("a", 0, 2), ("b", 2, 2)]
        assert [plan.where(i) for i in (0, 1)] == [((None, "a", False), 0, False),
                                                  ((None, "a", False), 1, False)]


def test_a_sigint_once_a_restorable_move_is_done_comes_with_its_result(monkeypatch):
    """Ctrl-C after the commit (while waiting for the copies, say): the move is done, and
    the result that can undo it reaches the caller, which then raises KeyboardInterrupt."""
    x = torch.arange(4.0)
    ns = {"x": x}
    monkeypatch.setattr(probes, "synchronize", lambda dev: os.kill(os.getpid(), signal.SIGINT))
    moved = move(ns, ["x"], META, restorable=True)
    assert moved.interrupted and x.is_meta
    restore(ns, moved)
    assert ns["x"] is x and torch.equal(x, torch.arange(4.0))
    y = torch.arange(4.0)
    with pytest.raises(KeyboardInterrupt):  # nothing to undo with: raised at once
        move({"y": y}, ["y"], META)
