"""A small DDP training loop on the CPU (gloo), a rank's function for the ranks tests and
bench: a module, as torch's spawn start method needs (it imports the function by name)."""

from __future__ import annotations

import datetime
import os
import signal
import time

import torch
import torch.distributed as dist


def _setup(rank: int, world: int, store: str, backend: str = "gloo", width: int = 64,
           batch: int = 32) -> tuple:
    """gloo on the CPU, or nccl with one GPU per rank (scripts/gpu-check)."""
    # bounded: a rank left waiting for one that died gives up after 30 s (gloo's default is
    # 30 min); the store is a fresh file per launch (a test's tmp_path), no port reused
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    torch.manual_seed(0)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Linear(width, width, device=device),
        device_ids=[rank] if backend == "nccl" else None)
    return (model, torch.optim.SGD(model.parameters(), lr=0.01),
            torch.randn(batch, width, device=device))


def train(rank: int, world: int, store: str, steps: int = 8, slow: int = -1,
          fail: int = -1, killed: int = -1, backend: str = "gloo", hold: int = -1,
          work: int = 0, width: int = 64, batch: int = 32, sync_mib: int = 0) -> None:
    """`steps` steps of DDP on a linear model; rank `slow` sleeps 100 ms a step, rank `fail`
    raises ValueError at its third step, rank `killed` is killed (SIGKILL) there, rank `hold`
    holds 512 MiB more than the others through its steps; every rank does `work` matmuls of
    256x256 a step besides (its own work, outside collectives) and all_reduces `sync_mib` MiB
    more (a sync of its own); the model is a `width` x `width` linear layer on a batch of
    `batch` rows."""
    model, opt, x = _setup(rank, world, store, backend, width, batch)
    held = torch.ones(2**27) if rank == hold else None  # 512 MiB of float32, touched
    w = torch.randn(256, 256, device=x.device)
    synced = torch.ones(sync_mib * 2**18, device=x.device)
    try:
        for step in range(steps):
            if rank == slow:
                time.sleep(0.1)
            for _ in range(work):
                w = torch.tanh(w @ w)
            if sync_mib:
                dist.all_reduce(synced)
            if rank == fail and step == 2:
                raise ValueError(f"rank {rank} failed on purpose")
            if rank == killed and step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    finally:
        del held
        dist.destroy_process_group()


def elastic_train(store: str, steps: int = 8) -> None:
    """The same, as torch elastic's entry point: the rank and world size from its env."""
    model, opt, x = _setup(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), store)
    for _ in range(steps):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    dist.destroy_process_group()


def cuda_child() -> None:
    """A forked child that uses CUDA (no process group): it must work under %%profile where
    it works without."""
    assert torch.ones(4, device="cuda").sum().item() == 4
