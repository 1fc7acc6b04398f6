"""%gpufree: garbage collected, accelerator caches emptied only where a runtime is up."""

from __future__ import annotations

import weakref

import pytest
import torch
from fakegpu import FakeMachine, Gpu
from IPython.core.error import UsageError

from torch_device_magic import gpufree
from torch_device_magic.gpufree import FreeReport, free_memory
from torch_device_magic.probes import Counters

GIB = 2**30


class Cycle:
    """An object only a reference cycle keeps alive: gc.collect() frees it."""

    def __init__(self) -> None:
        self.me = self
        self.data = torch.ones(1000)


@pytest.mark.skipif(torch.cuda.is_initialized(), reason="a CUDA context exists in this process")
def test_without_an_accelerator_in_use_it_collects_garbage_and_says_so(ip, capsys):
    ref = weakref.ref(Cycle())
    assert ref() is not None
    ip.run_line_magic("gpufree", "")  # not run_cell: the per-cell report would print too
    out = capsys.readouterr().out
    assert ref() is None
    assert out.startswith("garbage collected (")
    assert out.rstrip().endswith("no accelerator in use, so no allocator cache to empty")
    assert len(out.strip().splitlines()) == 1
    assert not torch.cuda.is_initialized()


class FakeGpu:
    """An accelerator whose allocator reads 8 GiB cached before and 2 GiB after."""

    name, kind = "cuda:0", "cuda"

    def __init__(self) -> None:
        self.readings = iter([Counters(2 * GIB, None, 8 * GIB, 1), Counters(GIB, None, 2 * GIB, 1)])

    def counters(self) -> Counters:
        return next(self.readings)


def test_says_how_much_each_accelerator_gave_back(monkeypatch):
    emptied = []
    monkeypatch.setattr(gpufree, "accelerators_in_use", lambda: [FakeGpu()])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    report = free_memory()
    assert emptied == [True]
    assert report.released_bytes == 6 * GIB
    assert str(report).endswith(
        "cuda:0: 6.0 GiB came back (cached 8.0 GiB → 2.0 GiB, in tensors 2.0 GiB → 1.0 GiB)"
    )


def test_unreadable_counters_read_n_a():
    unknown = Counters(None, None, None, None)
    report = FreeReport(3, {"mps:0": unknown}, {"mps:0": unknown})
    assert report.released_bytes == 0
    assert str(report).endswith("mps:0: n/a came back (cached n/a → n/a, in tensors n/a → n/a)")


def test_report_without_accelerators_reads_one_line():
    report = FreeReport(collected=1234, before={}, after={})
    assert str(report) == (
        "garbage collected (1,234 objects); no accelerator in use, so no allocator cache to empty"
    )
    assert report.released_bytes == 0


def test_arguments_are_a_usage_error(ip):
    with pytest.raises(UsageError, match="%gpufree: unrecognized arguments: now"):
        ip.run_cell("%gpufree now")


def test_on_cuda_it_empties_the_cache_and_collects_ipc_memory_of_used_gpus_only(monkeypatch):
    machine = FakeMachine([Gpu(), Gpu()]).install(monkeypatch)
    machine.start_cuda(0)
    machine.allocate(0, GIB, keep=False)
    report = free_memory()
    assert ("empty_cache", None) in machine.calls and ("ipc_collect", None) in machine.calls
    assert list(report.before) == ["cuda:0"]  # cuda:1 has no context: not read, not touched
    assert machine.contexts == {0}
