"""Phase 3, the commit: every tensor gets its copy in place, all or nothing; `move`."""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import itertools
import logging
import operator
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import probes
from ..errors import DeviceMagicError, first_sentence
from ..tensors import children, is_container
from ..units import fmt_bytes
from .copy import _copy_all, _failure, _inference
from .plan import (
    _IS_META,
    _REBINDABLE,
    UNHELD,
    _canonical,
    _first_target,
    _label,
    _pick,
    _Plan,
    _plan_move,
)
from .result import MoveResult, _Undo

_log = logging.getLogger(__name__)
_swap_impl: Callable[[Tensor, Tensor], None] | None = getattr(
    torch._C, "_swap_tensor_impl", None
)  # torch >= 2.3
_USE_COUNT: Callable[[Tensor], int] = Tensor._use_count  # type: ignore[attr-defined]  # unstubbed
# What `sys.getrefcount` reads, in a `map` over the plan's list, for a tensor with one holder.
_HELD_ONCE = UNHELD + 1
_PLAIN_REFERENTS = len(gc.get_referents(torch.empty(0)))  # a tensor without attributes
_MISSING = object()


def move(
    ns: dict,
    names: Iterable[str],
    device: torch.device,
    *,
    restorable: bool = False,
    keep_data: bool = False,
    others: Callable[[], Iterable[str]] | None = None,
) -> MoveResult:
    """Move to `device` what `names` hold in `ns`, all or nothing (`restorable`: for `restore`).
    With `keep_data` (the user's own objects, not copies), a move to meta that would drop
    data with no way back (not `restorable`) is refused before anything changes. Each of
    the names `others()` gives (the namespace's other names; called only where a planned
    storage has users the move has not) that holds a tensor sharing storage with what
    moves (a view's base, a view, a `detach`ed alias) moves too, and the result says so
    (`joined`): a storage moves once, with everything that sees it.

    Each tensor's bytes count once, under the first name that reaches it, taking the names
    in alphabetical order but those bound to an optimizer last: a model's parameters count
    under the model, an optimizer's under it only where no name of a model reaches them.
    The result says what a name holds that is counted under another (`counted_under`)."""
    device = _canonical(device)
    plan, joined = _plan_move(ns, names, device, others)
    names = [name for name, _, _ in plan.names]
    if keep_data and not restorable and device.type == "meta":
        _refuse_dropping_data(plan)
    undo = None
    if restorable:
        undo = _Undo(names, {}, plan.module_home)
        if device.type == "meta":  # nothing comes back from meta: keep the originals
            undo.originals = []
            undo.optimizer_state, undo.values = plan.optimizer_snapshots()
            undo.bindings = {name: ns[name] for name in names}
    result = _execute(plan, ns, device, undo)
    result.joined = joined
    return result


def _refuse_dropping_data(plan: _Plan) -> None:
    """Refuse a move to meta of anything that holds data (those already on meta hold none,
    and the plan leaves them out): meta keeps shapes only."""
    held = [(name, n) for name, first, last in plan.names if (n := sum(plan.nbytes[first:last]))]
    if not held:
        return
    what = ", ".join(f"{name} ({fmt_bytes(n)})" for name, n in held[:3])
    if len(held) > 3:
        what += f" and {len(held) - 3} more"
    raise DeviceMagicError(
        f"Moving {what} to meta would lose {'its' if len(held) == 1 else 'their'} data for "
        "good (meta tensors hold none); nothing was moved: %%ondevice meta --restore runs a "
        "cell on meta and gives back what it moved"
    )


def _execute(
    plan: _Plan, ns: dict, device: torch.device | None, undo: _Undo | None, held: bool = False
) -> MoveResult:
    """Copy, then commit; `held`: the caller holds SIGINT (a restore), so nothing cancels it."""
    # In inference mode (`%%nograd --inference`) copies would be inference tensors, which
    # autograd and optimizers refuse for good: the move makes the kind it finds.
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return _execute_as_found(plan, ns, device, undo, held, _inference(plan.tensors))
    return _execute_as_found(plan, ns, device, undo, held, ())


def _execute_as_found(
    plan: _Plan,
    ns: dict,
    device: torch.device | None,
    undo: _Undo | None,
    held: bool,
    inference: Collection[int],
) -> MoveResult:
    start = time.perf_counter()
    if plan.device is None or plan.device.type != "meta":  # (the plan leaves meta ones out)
        # Nothing can be copied out of meta: refused before any copy is made.
        on_meta = next(itertools.compress(itertools.count(), map(_IS_META, plan.tensors)), None)
        if on_meta is not None:
            raise DeviceMagicError(_failure(plan, [on_meta], plan.targets[on_meta], None))
    news = _copy_all(plan, inference)
    if isinstance(news, str):
        raise DeviceMagicError(news)  # outside any except block: no tensors ride on it
    home = undo.home if undo is not None else None
    if home is not None:
        for t in plan.tensors:
            home[id(t)] = t.device
    history = [
        f"{_label(plan.where(i))}: moved without its autograd history" for i in plan.with_history
    ]
    hold = _sigint_held() if not held else contextlib.nullcontext(_Caught())
    with hold as interrupted:  # from the commit until the result is made
        notes, rebound = _commit(ns, plan, news, undo, interrupted)
        if home is not None:
            for old, new in rebound.items():
                home[id(new)] = home.pop(old)
        by_name = {name: sum(plan.nbytes[first:last]) for name, first, last in plan.names}
        target = device if device is not None else _first_target(plan)
        try:  # the copies may still be queued: the time is the time they took
            probes.synchronize(target)
        except Exception:  # a sticky CUDA error: the cell's next CUDA call raises it again
            _log.debug("synchronising after the move failed", exc_info=True)
        result = MoveResult(
            target,
            {name: n for name, n in by_name.items() if n},
            time.perf_counter() - start,
            history + notes,
            undo,
            plan.skipped,
            to=", ".join(sorted(set(map(str, plan.targets)))) if device is None else "",
            counted_under=plan.counted_notes(),
        )
        if interrupted and undo is not None:  # only it can undo this: the caller delivers
            result.interrupted = len(interrupted)
            interrupted.clear()
    return result


def _commit(
    ns: dict, plan: _Plan, news: list[Tensor], undo: _Undo | None, interrupted: _Caught
) -> tuple[list[str], dict[int, Tensor]]:
    """Phase 3, all or nothing: give every tensor its copy in place; rebind what torch will
    not change. An error undoes what was done and says so in one line; so does SIGINT under
    Python's own handler, which waits for the commit to end, then goes on (a user's own
    handler gets it once the commit is done)."""
    undo_log: list[Callable[[], object]] = []  # what undoes each change made, run last first
    keep_originals = undo is not None and undo.originals is not None
    failure = None
    # Under `_execute`'s SIGINT hold: `interrupted` holds what it caught so far.
    try:
        # Once restorable, the move keeps the very objects: none is rebound.
        notes, replaced, swapped = _apply(
            ns, plan, news, undo_log, rebind=undo is None, keep_originals=keep_originals
        )
    except Exception as exc:
        failure = (
            f"Could not move to {_first_target(plan)}: {type(exc).__name__}: "
            f"{first_sentence(exc)}; nothing was moved."
        )
    rolled_back = failure is None and interrupted.raises and bool(interrupted)
    if failure is not None or rolled_back:
        for step in reversed(undo_log):
            step()
    elif keep_originals:  # each swapped copy holds an original
        assert undo is not None and undo.originals is not None
        undo.originals.extend(zip(_pick(plan.tensors, swapped), _pick(news, swapped)))
        undo.rebound.update({id(new): plan.tensors[i] for i, new in replaced.items()})
    else:  # done: what follows needs no undoing
        notes += _held_elsewhere(plan, news, swapped)
    news.clear()  # frees the old data
    if failure is not None:
        raise DeviceMagicError(failure)  # outside the except block: no tensors ride on it
    if rolled_back:
        raise KeyboardInterrupt  # Ctrl-C during the commit: nothing was moved
    return notes, {id(plan.tensors[i]): new for i, new in replaced.items()}


def _apply(
    ns: dict,
    plan: _Plan,
    news: list[Tensor],
    undo_log: list[Callable[[], object]],
    rebind: bool,
    keep_originals: bool = False,
) -> tuple[list[str], dict[int, Tensor], Sequence[int]]:
    """The commit's changes, each logged in `undo_log` with what undoes it; returns the notes,
    the new tensors that replace those (by index) that could not be changed in place, and
    the indices of those swapped. With `rebind`, what nothing else can observe is rebound.
    With `keep_originals` (a restorable move to meta), a subclass that keeps its data in
    Python attributes is replaced for the cell, so that its original object comes back."""
    tensors = plan.tensors
    undo_log.append(functools.partial(_reattach_grads, list(plan.grads.values()), {}))
    lone = _lone(plan) if rebind else []
    at = _others(len(tensors), lone)
    special = set(plan.special)
    if keep_originals and special:
        at = [i for i in at if i not in special]
    refused = _swap_all(tensors, news, at)
    swapped = at if not refused else [i for i in at if i not in set(refused)]
    undo_log.append(functools.partial(_swap_all, tensors, news, swapped))
    if special:  # their data is in their attributes: those follow the C++ tensor
        states = [i for i in swapped if i in special]
        undo_log.append(functools.partial(_swap_states, tensors, news, states))
        _swap_states(tensors, news, states)
        if keep_originals:
            refused += sorted(special)
    for holder, run in lone:  # in C, one holder at a time
        keys = _pick(plan.keys, run)
        undo_log.append(functools.partial(_set_all, holder, keys, _pick(tensors, run)))
        _set_all(holder, keys, _pick(news, run))
    skip = set(refused)
    for i in plan.requiring_grad:
        if i not in skip:
            _carry_hooks(tensors[i])
    notes: list[str] = []
    replaced: dict[int, Tensor] = {}
    for i in refused:
        t, new = tensors[i], news[i]
        why = "torch cannot swap it" if _swap_impl is None else "torch refused to swap it"
        if keep_originals and i in special:
            replaced[i] = _like(t, new)
            notes.append(
                f"{_label(plan.where(i))}: a {type(t).__name__} keeps its data in Python "
                f"attributes: the cell sees a copy on {new.device}, the restore gives back "
                "the original object"
            )
        elif i not in special and torch._has_compatible_shallow_copy_type(t, new):
            undo_log.append(functools.partial(setattr, t, "data", t.data))
            t.data = new
            notes.append(
                f"{_label(plan.where(i))}: moved with .data because {why}; "
                "views of its old storage and autograd graphs that saved it stay behind"
            )
        else:
            replaced[i] = _like(t, new)
            notes.append(
                f"{_label(plan.where(i))}: replaced by a new tensor because {why}; "
                "references the cell does not name keep the old one"
            )
    by_id = {id(tensors[i]): new for i, new in replaced.items()}
    if replaced:
        _rebind(ns, [name for name, _, _ in plan.names], by_id, undo_log)
    _reattach_grads(plan.grads.values(), by_id)
    return notes, replaced, swapped


def _lone(plan: _Plan) -> list[tuple[dict | list, Sequence[int]]]:
    """The tensors that nothing can observe but one plain dict or list that holds them,
    by holder: rebinding their entries to the copies is then the same as swapping, and
    cheaper. Each fact is read over the whole plan in C."""
    tensors = plan.tensors
    n = len(tensors)
    lone: list[bool] | None = None  # None: all
    unlike = [plan.requiring_grad, plan.with_history, *plan.shared.values()]
    facts = _lone_facts(tensors)
    every = not any(unlike) and all(operator.countOf(v, want) == n for v, want in facts[:-1])
    # The last fact for all at once, in one list: each has its type at least, so n types
    # and nothing else means that none has attributes.
    if not every or len(gc.get_referents(*tensors)) != n * _PLAIN_REFERENTS:
        lone = [True] * n
        for values, want in _lone_facts(tensors):
            lone = list(map(operator.and_, lone, map(operator.eq, values, itertools.repeat(want))))
        # Autograd hooks; views, whose old ones would keep the old storage until the end
        for i in itertools.chain.from_iterable(unlike):
            lone[i] = False
    found: list[tuple[dict | list, Sequence[int]]] = []
    for run in plan.runs:
        holder = run.holder
        if isinstance(holder, (dict, list)) and type(holder) in _REBINDABLE:
            at: Sequence[int] = range(run.start, run.end)
            if lone is not None:
                at = list(itertools.compress(at, lone[run.start : run.end]))
            if at:
                found.append((holder, at))
    return found


def _lone_facts(tensors: list[Tensor]) -> list[tuple[Iterator[object], object]]:
    """What makes each of `tensors` unobservable but through one holder, lazily, the
    cheapest first: (each one's value, the value needed)."""
    return [
        (map(sys.getrefcount, tensors), _HELD_ONCE),  # no name, module, optimizer, list...
        (map(weakref.getweakrefcount, tensors), 0),
        (map(_USE_COUNT, tensors), 1),  # its C++ tensor: no view, graph or grad
        (map(type, tensors), Tensor),  # not a Parameter, nor a subclass
        # No attributes of its own: nothing but its type, read without making its `__dict__`
        (map(len, map(gc.get_referents, tensors)), _PLAIN_REFERENTS),
    ]


def _others(n: int, lone: list[tuple[dict | list, Sequence[int]]]) -> Sequence[int]:
    """The indices below `n` that are not in `lone`'s."""
    if not lone:
        return range(n)
    if sum(len(at) for _, at in lone) == n:  # each index is in one run at most
        return []
    taken = set(itertools.chain.from_iterable(at for _, at in lone))
    return [i for i in range(n) if i not in taken]


def _set_all(holder: dict | list, keys: list, values: list) -> None:
    if isinstance(holder, dict):
        holder.update(zip(keys, values))  # each key is there: the order stays
    else:
        collections.deque(map(holder.__setitem__, keys, values), maxlen=0)  # the loop in C


def _held_elsewhere(plan: _Plan, olds: list[Any], swapped: Sequence[int]) -> list[str]:
    """After a commit, the old C++ tensors (held by the swapped copies, `olds`, at the
    indices `swapped`) that something outside the move holds (an autograd graph, a view the
    move does not include): where torch allows it (not to or from meta), their tensors get
    them back with the new data (`.data`), so that those holders see the move too; else a
    backward pass through such a graph fails, saying why. Returns the notes."""
    # Each old one is held once by its copy; more means another holder, unless it is a
    # view's base or a grad that the move holds as well: those go once the others go.
    counts = map(_USE_COUNT, _pick(olds, swapped))
    held = [swapped[j] for j, n in enumerate(counts) if n > 1]
    if not held:
        return []
    keep = set(held)
    olds[:] = [old if i in keep else None for i, old in enumerate(olds)]
    special = set(plan.special)
    notes = []
    for i in held:
        t, old, what = plan.tensors[i], olds[i], _label(plan.where(i))
        if _USE_COUNT(old) == 1:
            continue
        if i not in special and torch._has_compatible_shallow_copy_type(t, old):
            assert _swap_impl is not None  # it swapped them in the commit
            _swap_impl(t, old)  # `t` gets its old C++ tensor back, then the new data
            t.data = old
            _reattach_grads([plan.grads[id(t)]] if id(t) in plan.grads else [], {})
            notes.append(
                f"{what}: moved with .data because an autograd graph or a view holds it; "
                "views of its old storage and autograd graphs that saved it stay behind"
            )
        else:
            _poison(old, what)
            notes.append(
                f"{what}: moved, but a view or an autograd graph made before still holds "
                f"its old data on {old.device}"
            )
    return notes


def _swap_all(
    olds: list[Tensor], news: list[Tensor], at: Sequence[int] | None = None
) -> list[int]:
    """Swap the C++ tensors of each of `olds` and its copy (those at the indices `at`, else
    all): the copy then holds the old one. Returns the indices torch refused. Swapping
    again undoes it."""
    if at is None:
        at = range(len(olds))
    if _swap_impl is None:  # torch < 2.3
        return list(at)
    olds, news = _pick(olds, at), _pick(news, at)
    # Unlike `torch.utils.swap_tensors`, with no check that nothing else holds the old C++
    # tensor: whatever does (a view, an autograd graph) keeps it, as it was.
    refused: list[int] = []
    done: collections.deque = collections.deque(maxlen=1)  # the last position swapped
    start = 0
    while start < len(olds):
        done.clear()
        rest = (itertools.islice(column, start, None) for column in (olds, news))
        pairs = map(_swap_impl, *rest)
        try:  # the loop in C: about 40 ns a tensor less than in Python
            done.extend(zip(itertools.count(start), pairs))
        except RuntimeError:  # a C++ weak reference to it
            failed = done[0][0] + 1 if done else start
            refused.append(at[failed])
            start = failed + 1
            continue
        break
    return refused


def _carry_hooks(t: Tensor) -> None:
    """Register again on `t`'s new C++ tensor the autograd hooks that the old one held."""
    # They are kept on the Python object too; setting them registers them with autograd.
    for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        hooks = getattr(t, name, None)
        if hooks:
            setattr(t, name, hooks)


def _poison(old: Tensor, what: str) -> None:
    """Make a backward pass through a graph made before the move fail, saying why, instead
    of putting its gradient into the old tensor that nobody sees (as swap_tensors does)."""
    edge = getattr(torch.autograd.graph, "get_gradient_edge", None)  # torch >= 2.2
    if edge is None or not (old.is_leaf and old.requires_grad):
        return

    def refuse(grad_outputs: object) -> None:
        raise RuntimeError(
            f"{what} was moved to another device after this autograd graph was made; "
            "run the forward pass again"
        )

    edge(old).node.register_prehook(refuse)


def _like(t: Tensor, new: Tensor) -> Tensor:
    """`new` as the same kind of object as `t`: Parameter class, attributes, leafness (the
    attributes a subclass's own `.to` gave `new` stay: they hold its moved data)."""
    if isinstance(t, torch.nn.Parameter):
        new = type(t)(new.detach(), requires_grad=t.requires_grad)
    elif type(new) is not type(t):
        new = new.as_subclass(type(t))
    mine = new.__dict__
    for key, value in t.__dict__.items():
        mine.setdefault(key, value)
    return new


def _swap_states(olds: list[Tensor], news: list[Tensor], at: Iterable[int]) -> None:
    """Swap the Python attributes that each copy at the indices `at` has (what its class's
    own `.to` gave it: its data) with its tensor's; those only the tensor has (the user's
    own) stay. Swapping again undoes it."""
    for i in at:
        mine, theirs = olds[i].__dict__, news[i].__dict__
        for key in list(theirs):
            a, b = mine.pop(key, _MISSING), theirs.pop(key, _MISSING)
            if b is not _MISSING:
                mine[key] = b
            if a is not _MISSING:
                theirs[key] = a


def _rebind(
    ns: dict, names: list[str], replaced: dict[int, Tensor], undo_log: list[Callable[[], object]]
) -> None:
    """Point every holder reachable from `names` at the replacements (tuples are rebuilt),
    logging in `undo_log` what puts each holder back."""
    memo: dict[int, object] = {}
    for name in names:
        if name in ns:
            old = ns[name]
            if (new := _rebound(old, replaced, memo, undo_log)) is not old:
                undo_log.append(functools.partial(ns.__setitem__, name, old))
                ns[name] = new


def _rebound(
    obj: object, replaced: dict[int, Tensor], memo: dict[int, object], log: list
) -> object:
    i = id(obj)
    if i in replaced:
        return replaced[i]
    if i in memo or isinstance(obj, Tensor):
        return memo.get(i, obj)
    memo[i] = obj

    def sub(v: object) -> object:
        return _rebound(v, replaced, memo, log)

    def put(holder: Any, key: object, new: object) -> None:
        log.append(functools.partial(holder.__setitem__, key, holder[key]))
        holder[key] = new

    if isinstance(obj, torch.nn.Module):
        for m in obj.modules():
            for kind in (m._parameters, m._buffers):
                for k, t in list(kind.items()):
                    if id(t) in replaced:
                        put(kind, k, replaced[id(t)])
    elif isinstance(obj, torch.optim.Optimizer):
        for group in obj.param_groups:
            put(group["params"], slice(None), [sub(p) for p in group["params"]])
        for p in [p for p in obj.state if id(p) in replaced]:
            moved = replaced[id(p)]
            log.append(functools.partial(_rekey, obj.state, moved, p))
            obj.state[moved] = obj.state.pop(p)
        for state in obj.state.values():
            sub(state)
    elif isinstance(obj, tuple):
        items = [sub(v) for v in obj]
        if any(a is not b for a, b in zip(items, obj, strict=True)):
            made: Any = type(obj)
            memo[i] = made._make(items) if hasattr(obj, "_fields") else made(items)
    elif is_container(type(obj)):
        entries, is_attr = children(obj)
        for key, entry in list(entries):
            if (new := sub(entry)) is entry:
                continue
            if is_attr:  # a dataclass's field, frozen ones too
                field_name = str(key)
                log.append(functools.partial(object.__setattr__, obj, field_name, entry))
                object.__setattr__(obj, field_name, new)
            else:
                put(obj, key, new)
    return memo[i]


def _rekey(mapping: dict, old: object, new: object) -> None:
    mapping[new] = mapping.pop(old)


def _reattach_grads(grads: Iterable[tuple[Tensor, Tensor]], replaced: dict[int, Tensor]) -> None:
    for t, g in grads:
        t = replaced.get(id(t), t)
        g = replaced.get(id(g), g)
        if t.grad is not g:
            t.grad = g


class _Caught(list):
    """The frames of the SIGINTs caught while held; `raises`: whether the handler they go to
    is Python's own, which raises KeyboardInterrupt (a user's "stop after this epoch" one
    does not: what it is sent must not cancel anything)."""

    raises = True


class SigintHold:
    """SIGINT (Ctrl-C, a notebook's stop button) held: from `engage` on, each signal is
    caught (`caught`) instead of handled; leaving `with hold:` puts back the handler that
    `engage` replaced and, unless an error is on its way, hands it each signal caught
    (Python's raises at the first; a user's own sees every press, as it would have).

    Only in the main thread (where Python handles signals), where a Python handler is in
    force when the hold is made. `engage` is a call into C with no Python frame around it
    (`hold.replaced = hold.engage()`): Python runs a signal's handler only where it checks
    for one (entering a Python function, after a call), so one that came since the
    caller's last check is caught by the check after the swap, and none lands in between.
    """

    def __init__(self) -> None:
        self.caught = _Caught()
        main = threading.current_thread() is threading.main_thread()
        self.able = main and callable(signal.getsignal(signal.SIGINT))
        self.engage: Callable[[], Any] = (
            functools.partial(signal.signal, signal.SIGINT, self._catch)
            if self.able
            else functools.partial(signal.getsignal, signal.SIGINT)  # swaps nothing
        )
        self.replaced: Any = None  # the handler `engage` replaced (its caller sets it)

    def _catch(self, signum: int, frame: object) -> None:
        self.caught.append(frame)

    def __enter__(self) -> SigintHold:
        return self

    def __exit__(self, kind: object, error: object, tb: object) -> None:
        if not self.able:
            return
        previous = self.replaced
        signal.signal(signal.SIGINT, previous)
        caught = list(self.caught)
        self.caught.clear()
        if kind is None and callable(previous):
            for frame in caught:
                previous(signal.SIGINT, frame)


@contextlib.contextmanager
def _sigint_held() -> Iterator[_Caught]:
    """Hold SIGINT until the block ends (see `SigintHold`)."""
    hold = SigintHold()
    hold.replaced = hold.engage()
    hold.caught.raises = hold.replaced is signal.default_int_handler
    with hold:
        yield hold.caught
