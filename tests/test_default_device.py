"""The default device as `%device` installs it (default_device.py): every factory function
torch's own default fills in, nothing paid by the other calls, and torch left as it was."""

from __future__ import annotations

import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import warnings

import pytest
import torch
from pythonpath import child_env
from torch.utils._device import _device_constructors

from torch_device_magic import default_device
from torch_device_magic.default_device import DefaultDevice

pytestmark = pytest.mark.once  # nothing here depends on IPython's version

META = torch.device("meta")
torch_zeros = torch.zeros  # torch's own: no default is in force as this module loads
_i, _v = torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0])
_rows, _cols, _blocks = torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.ones(2, 1, 1)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # quantized tensors are deprecated
    _quantized = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)

# One call of each factory function that torch's default device fills `device=` in for.
CALLS: dict[str, tuple[tuple, dict]] = {
    "torch.arange": ((3,), {}),
    "torch.as_tensor": (([1, 2],), {}),
    "torch.asarray": (([1, 2],), {}),
    "torch.bartlett_window": ((4,), {}),
    "torch.blackman_window": ((4,), {}),
    "torch.empty": ((2,), {}),
    "torch.empty_permuted": (((2, 3), (1, 0)), {}),
    "torch.empty_quantized": (([2], _quantized), {}),
    "torch.empty_strided": (((2,), (1,)), {}),
    "torch.eye": ((2,), {}),
    "torch.fft.fftfreq": ((4,), {}),
    "torch.fft.rfftfreq": ((4,), {}),
    "torch.full": (((2,), 1.0), {}),
    "torch.hamming_window": ((4,), {}),
    "torch.hann_window": ((4,), {}),
    "torch.kaiser_window": ((4,), {}),
    "torch.linspace": ((0, 1, 3), {}),
    "torch.logspace": ((0, 1, 3), {}),
    "torch.nested.nested_tensor": (([torch.ones(2), torch.ones(3)],), {}),
    "torch.ones": ((2,), {}),
    "torch.rand": ((2,), {}),
    "torch.randint": ((5, (2,)), {}),
    "torch.randn": ((2,), {}),
    "torch.randperm": ((3,), {}),
    "torch.range": ((0, 2), {}),
    "torch.scalar_tensor": ((1.0,), {}),
    "torch.sparse_bsc_tensor": ((_rows, _cols, _blocks, (2, 2)), {}),
    "torch.sparse_bsr_tensor": ((_rows, _cols, _blocks, (2, 2)), {}),
    "torch.sparse_compressed_tensor": ((_rows, _cols, _v, (2, 2)), {"layout": torch.sparse_csr}),
    "torch.sparse_coo_tensor": ((_i, _v, (2, 2)), {}),
    "torch.sparse_csc_tensor": ((_rows, _cols, _v, (2, 2)), {}),
    "torch.sparse_csr_tensor": ((_rows, _cols, _v, (2, 2)), {}),
    "torch.tensor": (([1, 2],), {}),
    "torch.tril_indices": ((3, 3), {}),
    "torch.triu_indices": ((3, 3), {}),
    "torch.zeros": ((2,), {}),
}


@pytest.fixture(autouse=True)
def restored():
    """Each test starts and ends with no default device."""
    torch.set_default_device(None)
    yield
    torch.set_default_device(None)


@pytest.fixture
def ours():
    owner = DefaultDevice()
    yield owner
    owner.release()


def resolve(name: str):
    """What `name` ("torch.fft.fftfreq") is bound to now."""
    found = torch
    for part in name.split(".")[1:]:
        found = getattr(found, part)
    return found


def outcome(name: str, **extra) -> str:
    """Where `name`'s call in CALLS puts its tensor, or the error it raises."""
    args, kwargs = CALLS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated (range), prototype (nested), beta (sparse)
        try:
            return resolve(name)(*args, **kwargs, **extra).device.type
        except Exception as error:
            return f"{type(error).__name__}: {str(error).splitlines()[0]}"


def python_calls(func, *args, **kwargs) -> list[str]:
    """The Python functions that ran inside `func(*args, **kwargs)`."""
    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            seen.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        func(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return seen


def test_the_table_names_every_factory_torch_fills_in():
    """A factory that a later torch adds to its list fails here until CALLS has it, and
    then fails below if `%device` does not fill it in."""
    assert {resolve(name) for name in CALLS} == set(_device_constructors())


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_factory_under_our_default_acts_as_given_the_device(name, ours):
    given = outcome(name, device=META)
    assert given != outcome(name)  # on the CPU it differs: a factory missed would show
    ours.install(META)
    assert outcome(name) == given


def test_other_torch_calls_run_no_python_under_our_default(ours):
    """torch's own default is a TorchFunctionMode: every torch call, factory or not, went
    through its Python `__torch_function__` (1.3-1.5x a small training step)."""
    x = torch.ones(3)
    ours.install(torch.device("cpu"))  # the CPU's kernels are C++ (meta's are Python)
    assert torch.get_default_device() == torch.device("cpu")
    assert python_calls(torch.add, x, x) == [] and python_calls(torch.mm, x[None], x[:, None]) == []
    assert python_calls(torch.zeros, 1) == ["with_default"]  # a factory: ours, once
    ours.install(META)
    assert torch.zeros(1).device == META and torch.nn.Linear(2, 2).weight.device == META


def test_other_threads_get_the_cpu_as_under_torchs_own(ours):
    ours.install(META)
    seen: list[torch.device] = []
    thread = threading.Thread(target=lambda: seen.append(torch.zeros(1).device))
    thread.start()
    thread.join()
    assert seen == [torch.device("cpu")] and torch.zeros(1).device == META


def test_a_backward_on_the_device_sees_the_default_as_under_torchs_own(tdmdev, ours):
    """Autograd runs a device's backward in a thread of its own: torch's own default does
    not reach it in torch 2.13 (a factory there makes a CPU tensor), and ours does as it."""
    made: list[torch.device] = []

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            made.append(torch.ones(1).device)
            return grad * 2

    x = torch.ones(2, device="tdmdev", requires_grad=True)
    torch.set_default_device("tdmdev")
    Double.apply(x).sum().backward()
    torch.set_default_device(None)
    ours.install(torch.device("tdmdev"))
    Double.apply(x).sum().backward()
    assert made[0] == made[1]


def test_a_with_device_block_wins_inside_our_default_and_ours_comes_back(ours):
    ours.install(META)
    with torch.device("cpu"):  # %%ondevice cpu
        assert torch.zeros(1).device.type == "cpu" and torch.get_default_device().type == "cpu"
        assert torch.nn.Linear(2, 2).weight.device.type == "cpu"
    assert torch.zeros(1).device == META and torch.get_default_device() == META


def test_another_torch_function_mode_leaves_our_default_in_force(ours):
    class Counting(torch.overrides.TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    ours.install(META)
    with Counting():
        made = torch.zeros(1)
    assert made.device == META and Counting.calls == 1


def test_release_gives_torch_its_own_functions_back(ours):
    originals = {name: resolve(name) for name in CALLS}
    ours.install(META)
    ours.release()
    assert {name for name in CALLS if resolve(name) is not originals[name]} == set()


def test_a_factory_rebound_meanwhile_is_left_to_whoever_rebound_it(ours):
    original = torch.empty
    ours.install(META)

    def theirs(*args, **kwargs):
        return "theirs"

    torch.empty = theirs  # as accelerate's init_empty_weights does, for a while
    try:
        ours.release()
        assert torch.empty is theirs and torch.zeros(1).device.type == "cpu"
    finally:
        torch.empty = original


def test_factories_pickle_by_name_under_our_default(ours):
    """pickle stores a function by its module and name (a `partial(torch.zeros, 3)` sent
    to a spawned worker): the wrappers are found under the names torch's are."""
    ours.install(META)
    assert [n for n in CALLS if pickle.loads(pickle.dumps(resolve(n))) is not resolve(n)] == []


def test_torch_jit_script_compiles_factories_as_under_torchs_own(ours):
    def make(n: int) -> torch.Tensor:
        return torch.zeros(n)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script, since 2.10
        torch.set_default_device(META)
        torchs = torch.jit.script(make)(2).device
        torch.set_default_device(None)
        ours.install(META)
        assert torch.jit.script(make)(2).device == torchs


def test_torch_compile_knows_torchs_factories_again_after_release():
    """torch.compile first used under our default builds its table of torch's functions
    with ours in their place; after release it must know torch's own again (else: a graph
    break, or under fullgraph an error). A fresh process: the table is built once."""
    code = (
        "import torch\n"
        "from torch_device_magic.default_device import DefaultDevice\n"
        "ours = DefaultDevice()\n"
        "ours.install(torch.device('meta'))\n"
        "def f(x):\n"
        "    return x + torch.zeros(3) + torch.arange(3)\n"
        "g = torch.compile(f, backend='eager', fullgraph=True)\n"
        "under = g(torch.ones(3)).device\n"
        "ours.release()\n"
        "again = g(torch.ones(3)).device\n"  # compiled under the default: guarded on it
        "torch._dynamo.reset()\n"
        "fresh = torch.compile(f, backend='eager', fullgraph=True)(torch.ones(3)).device\n"
        "print(under, again, fresh)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=child_env(), timeout=300)
    assert run.stdout.split() == ["meta", "cpu", "cpu"], run.stderr[-2000:]


def test_a_child_forked_while_another_thread_swaps_the_functions_drops_the_default(ours):
    """A fork copies a lock that another thread holds as held, and that thread does not
    run in the child: the child must not wait for it."""
    ours.install(META)
    read, write = os.pipe()
    with default_device._lock:  # as if another thread were swapping the functions now
        pid = os.fork()
        if pid == 0:  # the child: answer, and never return into pytest
            try:
                os.write(write, f"{torch.zeros(1).device} {torch.zeros is torch_zeros}".encode())
            finally:
                os._exit(0)
    os.close(write)
    ready, _, _ = select.select([read], [], [], 60)
    answer = os.read(read, 100).decode() if ready else "the child hung"
    if not ready:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(read)
    assert answer == "cpu True" and torch.zeros(1).device == META
