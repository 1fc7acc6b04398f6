"""Move what a cell's names hold to a device, all or nothing, losing nothing.

    >>> result = move(user_ns, cells.cell_names(code), torch.device("cuda:0"))
    >>> result.names, result.nbytes, result.seconds, result.not_followed

Three phases, so that a failure changes nothing, one module each; each module
imports only those above it here:

- `result`: `MoveResult`, what a move or a restore did, and `_Undo`, what a
  restore needs;
- `plan`: phase 1;
- `copy`: phase 2;
- `commit`: phase 3, `move`, which runs the three, and `SigintHold`;
- `restoring`: `restore`, a move back (from meta: the originals put back).

The phases:

1. *Plan*: walk the named objects (containers, modules and optimizers once
   each, memoised by `id`; at most `WALK_LIMIT` other objects a name, as
   `%tensors` does; an object that raises when read is skipped; the result
   names both) and group the tensors by storage, which also finds a tensor
   reached twice: it is planned once. Where a planned storage has users the
   plan has not (its use count says so, a view's base that only its views
   hold aside), the namespace's other names (`others`) are walked, and those
   that hold one join the move, so that a storage moves with all that see it.
2. *Copy*: one copy per storage (a singleton with `.to`, a shared storage as
   one span of bytes from which every tensor of the group is rebuilt with its
   own offset, sizes and strides, so views keep sharing storage, and its lazy
   conjugate and negative bits; a view that overlaps itself, `expand`ed or
   `unfold`ed, is copied so too, alone). On failure
   the copies are dropped and a `DeviceMagicError` is raised from a frame that
   holds none of them (a traceback keeps its frames' tensors alive,
   pytorch#27600).
3. *Commit*: each tensor gets its copy in place. We swap only the C++ tensor
   (the last step of `torch.utils.swap_tensors`), so the Python object keeps
   its identity, class (a Parameter stays a Parameter), attributes and
   autograd hooks, and every reference to it, weak ones too, sees the move.
   Where something else holds the old C++ tensor (a view the cell does not
   name, an autograd graph), the tensor gets it back with the new data
   (`.data`) once the commit is done, so that those holders see the move; to
   or from meta, where torch refuses that, they keep the old one, and a
   backward pass through such a graph fails saying why. Where torch cannot
   swap (before 2.3) `.data` is set, or else the holders we walked are rebound
   to a new tensor; the result lists each of these. A tensor that nothing can
   observe but the one plain dict or list that holds it (no other reference,
   no weak one, no view or graph, a plain tensor without attributes, not
   restorable) is not swapped: its entry is rebound to the copy, which nobody
   can tell apart and costs less (`_lone`). Leaves stay leaves with
   `requires_grad`, `.grad` is moved and reattached; a tensor with an autograd
   history arrives without it.
   The commit is all or nothing too: an error in it undoes what it did, and
   SIGINT (Ctrl-C, a notebook's stop button) waits until it ends, then cancels
   the move; a handler of the user's own gets it then instead, cancelling nothing.

`restore` from `meta` needs no data: after the swap, each copy holds the
original C++ tensor, which is swapped back into the very object it came from,
with its data, `grad_fn`, hooks and `.grad`. Whatever the cell left holding the
meta ones (a kept graph, `Out`, a traceback, a view) keeps those, but a name the
cell bound to meta tensors gets its original back. A restore holds SIGINT from
start to end: it is never left half done. `%%ondevice --restore` engages that
hold (`SigintHold`) as the cell's code ends, so that no Ctrl-C lands between the
two. Each tensor goes back where it was; what the cell added to a module, where
the submodule it joined came from. `move(..., keep_data=True)` refuses a move to
meta of tensors that hold data unless it is restorable: nothing would bring the
data back.

Optimizer state follows its parameters by torch's own rule: `step` stays where
it is unless the group is `capturable` or `fused`. Nothing here touches
`torch.cuda` unless a device involved is CUDA.
"""

from .commit import SigintHold, move
from .restoring import restore
from .result import MoveResult, deliver

__all__ = ["MoveResult", "SigintHold", "deliver", "move", "restore"]
