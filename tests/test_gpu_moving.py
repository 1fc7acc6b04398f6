"""`moving/` between the CPU and a CUDA GPU: training carries across, restore carries back."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from IPython.core.error import UsageError

from torch_device_magic.moving import move, restore

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CPU = torch.device("cpu")


def model_and_adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    dev = next(model.parameters()).device
    x, y = torch.randn(32, 8, generator=gen).to(dev), torch.randn(32, 1, generator=gen).to(dev)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def test_adam_steps_agree_on_cpu_and_cuda_after_moving_both_ways():
    ref_model, ref_opt = model_and_adam()
    model = copy.deepcopy(ref_model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for seed in range(3):
        step(ref_model, ref_opt, seed)

    ns = {"model": model, "opt": opt}
    params = list(model.parameters())
    step(model, opt, 0)  # state made on the CPU
    move(ns, ns, torch.device("cuda"))
    assert all(p.is_cuda for p in params) and params == list(model.parameters())
    state = opt.state[params[0]]
    assert state["exp_avg"].is_cuda and state["step"].device == CPU
    step(model, opt, 1)  # on the GPU
    move(ns, ns, CPU)
    assert all(p.device == CPU for p in params) and state["exp_avg"].device == CPU
    step(model, opt, 2)  # back on the CPU

    for p, ref in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-6)
    for p, ref in zip(params, ref_opt.param_groups[0]["params"], strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[p][key], ref_opt.state[ref][key])


def test_restore_carries_the_cells_training_back_and_optimizer_state_follows():
    model, opt = model_and_adam()
    ns = {"model": model, "opt": opt}
    before = [p.detach().clone() for p in model.parameters()]
    moved = move(ns, ns, torch.device("cuda"), restorable=True)
    step(model, opt, 0)  # the cell: Adam makes its state on the GPU
    restore(ns, moved)
    params = list(model.parameters())
    assert all(p.device == CPU for p in params)
    assert any(not torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert opt.state[params[0]]["exp_avg"].device == CPU
    step(model, opt, 1)  # and training goes on on the CPU


def test_values_views_and_grads_survive_the_round_trip():
    base = torch.arange(12.0)
    view = base[3:9].view(2, 3)
    w = torch.randn(4, requires_grad=True)
    w.grad = torch.ones(4)
    ns = {"base": base, "view": view, "w": w}
    expected = base.clone(), w.detach().clone()
    move(ns, ns, torch.device("cuda"))
    assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    view.mul_(10)
    move(ns, ns, CPU)
    assert torch.equal(base[3:9], expected[0][3:9] * 10)
    assert torch.equal(w.detach(), expected[1]) and w.is_leaf and w.grad.device == CPU


def test_a_weakly_referenced_tensor_is_swapped_in_place():
    t = torch.ones(3)
    ref = weakref.ref(t)
    result = move({"t": t}, ["t"], torch.device("cuda"))
    assert ref() is t and t.is_cuda and result.not_followed == []


def test_a_real_out_of_memory_during_a_move_moves_nothing_and_is_one_line(ip):
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - 3 * 2**30, dtype=torch.uint8, device="cuda")  # 3 GiB left
    a, b = torch.ones(2**29), torch.ones(2**29)  # 2 GiB each: the first fits, not both
    ip.user_ns.update(a=a, b=b)
    try:
        with pytest.raises(UsageError) as err:
            ip.run_line_magic("device", "cuda --move")
    finally:
        del hog
        torch.cuda.empty_cache()
    message = str(err.value)
    assert "\n" not in message and message.startswith("Could not move ")
    assert message.endswith("nothing was moved.")
    assert ip.user_ns["a"] is a and ip.user_ns["b"] is b
    assert a.device == b.device == CPU
    assert "device" not in ip.user_ns  # the session device was not set either


def test_lazy_conjugate_and_negative_views_keep_their_values():
    c, r = torch.randn(4, dtype=torch.cfloat), torch.randn(4)
    ns = {"c": c, "cc": c.conj(), "r": r, "n": r._neg_view()}
    expected = {k: v.resolve_conj().resolve_neg().clone() for k, v in ns.items()}
    move(ns, ns, torch.device("cuda"))
    assert ns["cc"].is_conj() and ns["n"].is_neg()
    for k, v in ns.items():
        assert torch.equal(v.cpu().resolve_conj().resolve_neg(), expected[k]), k

