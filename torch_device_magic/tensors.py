"""Facts about tensors that every walker of the namespace needs, each in one place.

    >>> storage_key(a) == storage_key(a[2:])  # views share their base's storage
    True
    >>> stored_bytes(torch.eye(1000).to_sparse())  # what is stored, not the dense size
    20000
    >>> storage_bytes(a[2:]) == storage_bytes(a)  # what a view keeps alive: its base
    True

`%tensors`, `%%gpumem` and the mover all count and group tensors with these, so
that one tensor reads the same everywhere; and they walk containers with `children`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import Tensor

# The mappings whose methods run no code of the user's.
PLAIN_MAPPINGS = frozenset({dict, collections.OrderedDict, collections.defaultdict})
WALK_LIMIT = 100_000  # objects looked at per name: a list of ten million floats stays quick

# `t.untyped_storage()._cdata` without building a storage object on the way
storage_id = getattr(torch._C, "_storage_id", lambda t: t.untyped_storage()._cdata)

_COMPRESSED = ("values", "crow_indices", "col_indices")
_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: _COMPRESSED,
    torch.sparse_bsr: _COMPRESSED,
    torch.sparse_csc: ("values", "ccol_indices", "row_indices"),
    torch.sparse_bsc: ("values", "ccol_indices", "row_indices"),
}


def stored_bytes(t: Tensor) -> int:
    """Bytes of `t`'s data; a sparse tensor's are those of its index and value tensors."""
    parts = _SPARSE_PARTS.get(t.layout)
    with contextlib.suppress(RuntimeError):
        return t.nbytes if parts is None else sum(getattr(t, name)().nbytes for name in parts)
    return 0


def storage_bytes(t: Tensor) -> int:
    """Bytes of the storage `t` keeps alive (a view's whole base), once per `storage_key`;
    a sparse tensor's are its `stored_bytes`."""
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return stored_bytes(t)


def storage_key(t: Tensor) -> int:
    """What identifies the storage of `t`: tensors that share one get the same key."""
    try:
        return storage_id(t)
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return id(t)


def is_lazy(t: Tensor) -> bool:
    """A lazy module's parameter that has no shape or data yet (`nn.LazyLinear`)."""
    return torch.nn.parameter.is_lazy(t)


def is_container(cls: type) -> bool:
    """Whether objects of type `cls` are containers that `children` reads (dict, list,
    tuple, namedtuple, dataclass, and their subclasses: OrderedDict, defaultdict, ...)."""
    return issubclass(cls, (dict, list, tuple)) or (
        dataclasses.is_dataclass(cls) and isinstance(cls, type)
    )


def children(obj: object) -> tuple[Iterator[tuple[object, object]], bool]:
    """A container's (key, value) pairs, read lazily but a dataclass's fields, and whether
    the keys are attribute names; an object that is no container has none.

    May raise what the container raises when read (a mapping whose `items()` raises)."""
    if isinstance(obj, dict):
        if type(obj) not in PLAIN_MAPPINGS:  # a subclass may make either view raise
            obj.values()
        return iter(obj.items()), False
    if isinstance(obj, (list, tuple)):
        return enumerate(obj), False
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return iter([(f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj)]), True
    return iter(()), False
