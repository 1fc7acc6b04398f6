"""%gpufree: garbage collected, accelerator caches emptied only where a runtime is up."""

from __future__ import annotations

import weakref

import pytest
import torch
from IPython.core.error import UsageError

from torch_device_magic import gpufree
from torch_device_magic.gpufree import FreeReport, Usage, free_memory

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


def test_says_how_much_each_accelerator_gave_back(monkeypatch):
    readings = iter([Usage(2 * GIB, 8 * GIB), Usage(int(1.5 * GIB), 2 * GIB)])
    emptied = []
    monkeypatch.setattr(gpufree, "accelerators_in_use", lambda: ["cuda:0"])
    monkeypatch.setattr(gpufree, "usage", lambda device: next(readings))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    report = free_memory()
    assert emptied == [True]
    assert report.released_bytes == 6 * GIB
    assert str(report).endswith(
        "cuda:0: 6.0 GiB came back (cached 8.0 GiB → 2.0 GiB, in tensors 2.0 GiB → 1.5 GiB)"
    )


def test_report_without_accelerators_reads_one_line():
    report = FreeReport(collected=1234, before={}, after={})
    assert str(report) == (
        "garbage collected (1,234 objects); no accelerator in use, so no allocator cache to empty"
    )
    assert report.released_bytes == 0


def test_arguments_are_a_usage_error(ip):
    with pytest.raises(UsageError, match="%gpufree: unrecognized arguments: now"):
        ip.run_cell("%gpufree now")
