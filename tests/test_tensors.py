"""tensors.py: the one home of tensor facts, and the three readers that agree through it."""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import torch

from torch_device_magic.gpumem import new_tensors
from torch_device_magic.moving import move
from torch_device_magic.namespace import holds_tensors, scan
from torch_device_magic.tensors import (
    children,
    is_container,
    is_lazy,
    storage_bytes,
    storage_key,
    stored_bytes,
)

META = torch.device("meta")


class Pair(NamedTuple):
    x: object
    y: object


@dataclasses.dataclass
class Batch:
    x: object
    label: str = "a"


def test_children_of_every_container_the_walkers_enter():
    t = torch.zeros(1)
    cases = {
        "dict": ({"a": t}, [("a", t)], False),
        "OrderedDict": (collections.OrderedDict(a=t), [("a", t)], False),
        "defaultdict": (collections.defaultdict(list, a=t), [("a", t)], False),
        "list": ([t, 1], [(0, t), (1, 1)], False),
        "tuple": ((t,), [(0, t)], False),
        "namedtuple": (Pair(t, 2), [(0, t), (1, 2)], False),
        "dataclass": (Batch(t), [("x", t), ("label", "a")], True),
    }
    for what, (obj, pairs, is_attr) in cases.items():
        entries, attr = children(obj)
        assert is_container(type(obj)), what
        assert (list(entries), attr) == (pairs, is_attr), what
    for other in (t, 1, "s", Batch, torch.nn.Linear(1, 1)):
        assert not is_container(type(other))
        assert list(children(other)[0]) == []


def test_byte_counts_storage_keys_and_lazy_parameters():
    a = torch.arange(10.0)
    sparse = torch.eye(1000).to_sparse()
    assert stored_bytes(sparse) == 1000 * 2 * 8 + 1000 * 4  # indices and values
    assert storage_bytes(sparse) == stored_bytes(sparse)
    assert stored_bytes(a[2:]) == 32 and storage_bytes(a[2:]) == 40  # a view holds its base
    assert storage_key(a[2:]) == storage_key(a) != storage_key(a.clone())
    assert is_lazy(torch.nn.LazyLinear(2).weight) and not is_lazy(a)


def test_one_sparse_tensor_a_view_and_a_parameter_read_the_same_bytes_everywhere():
    # %tensors (scan), %%gpumem's largest-tensors table (new_tensors) and the mover's
    # `names` count each of these with tensors.py: a sparse tensor reads what it stores
    # (20,000 bytes, not the dense 4,000,000), a view the storage it is, and a Parameter
    # its data, with its grad apart in %tensors (in the grad column) and moved with it.
    p = torch.nn.Parameter(torch.ones(3, 5))
    p.grad = torch.ones(3, 5)
    ns = {"sparse": torch.eye(1000).to_sparse(), "view": torch.arange(12.0).view(3, 4), "p": p}
    expected = {"sparse": 20_000, "view": 48, "p": 60}
    report = scan(ns)
    assert {r.name: r.nbytes for r in report.rows} == expected
    assert {r.name: r.grad_bytes for r in report.rows}["p"] == 60
    assert {t.name: t.bytes for t in new_tensors(ns, {})} == expected
    moved = move(dict(ns), list(ns), META).names
    assert moved == {**expected, "p": 60 + 60}  # the grad moves with it


@dataclasses.dataclass(slots=True)
class Slotted:
    x: object


def test_holds_tensors_reads_containers_as_the_other_walkers_do():
    # %%devcompare's test of what to copy: a dataclass with slots has no __dict__, yet its
    # fields are read, as %tensors and the mover read them.
    assert holds_tensors(Slotted(torch.zeros(1)))
    assert holds_tensors(collections.defaultdict(list, a=[Pair(1, torch.zeros(1))]))
    assert not holds_tensors(Slotted([1, "a", (2.0,)]))
