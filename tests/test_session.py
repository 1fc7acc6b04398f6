"""The session engine without a shell: device, default device, CUDA's current device, grad mode."""

from __future__ import annotations

import pytest
import torch

from torch_device_magic import devices
from torch_device_magic.errors import DeviceMagicError
from torch_device_magic.probes import torch_default_device
from torch_device_magic.session import Session

META, CPU = torch.device("meta"), torch.device("cpu")


@pytest.fixture(autouse=True)
def restored():
    """Each test starts and ends with autograd on and no default device."""
    torch.set_grad_enabled(True)
    torch.set_default_device(None)
    yield
    torch.set_grad_enabled(True)
    torch.set_default_device(None)


@pytest.fixture
def current(monkeypatch):
    """CUDA's current device, faked at the probe: the calls made, and what each replaced."""
    state = {"current": 0, "calls": []}

    def make_current(index: int) -> int:
        state["calls"].append(index)
        before, state["current"] = state["current"], index
        return before

    monkeypatch.setattr(devices, "make_current", make_current)
    return state


def test_set_device_binds_device_and_makes_it_torchs_default():
    ns: dict = {}
    session = Session()
    session.set_device(META, ns)
    assert session.device == META and ns["device"] == META
    assert torch_default_device() == META and torch.zeros(1).device == META


def test_the_cpu_installs_no_default_device():
    ns: dict = {}
    session = Session()
    session.set_device(META, ns)
    session.set_device(CPU, ns)
    assert ns["device"] == CPU and torch_default_device() is None


def test_the_default_is_set_only_when_asked():
    ns: dict = {}
    session = Session()
    session.set_device(META, ns, torch_default=False)  # %device meta --no-default
    assert ns["device"] == META and torch_default_device() is None
    session.set_device(META, ns)
    assert torch_default_device() == META
    session.set_torch_default(False)  # %config TorchDeviceMagics.set_torch_default = False
    assert torch_default_device() is None and session.device == META
    session.set_torch_default(True)
    assert torch_default_device() == META
    off = Session(torch_default=False)
    off.set_device(META, ns)
    assert torch_default_device() == META  # still the first session's: the second set none
    session.close(ns)
    assert torch_default_device() is None


def test_reset_puts_back_no_default_and_binds_the_cpu():
    ns: dict = {}
    session = Session()
    session.set_device(META, ns)
    session.set_device(None, ns)  # %device reset
    assert session.device is None and ns["device"] == CPU and torch_default_device() is None


def test_a_default_set_by_hand_afterwards_is_never_undone():
    ns: dict = {}
    session = Session()
    session.set_device(META, ns)
    torch.set_default_device("meta")  # the user's own, though to the same device
    session.set_device(None, ns)
    assert torch_default_device() == META
    session.set_torch_default(False)
    session.close(ns)
    assert torch_default_device() == META


def test_a_default_set_by_hand_before_comes_back():
    torch.set_default_device("meta")
    ns: dict = {}
    session = Session()
    session.set_device(CPU, ns)  # the CPU: no default device while it is chosen
    assert torch_default_device() is None
    session.close(ns)
    assert torch_default_device() == META
    assert ns["device"] == META  # the default at load, as `device` was not rebound


def test_nograd_on_and_off():
    session = Session()
    session.set_nograd(True)
    assert not torch.is_grad_enabled()
    session.set_nograd(True)  # twice: off still means "as before the first"
    session.set_nograd(False)
    assert torch.is_grad_enabled()


def test_nograd_off_returns_to_the_grad_mode_before_on():
    torch.set_grad_enabled(False)  # the user's own, before %nograd on
    session = Session()
    session.set_nograd(True)
    session.set_nograd(False)
    assert not torch.is_grad_enabled()


def test_close_undoes_everything(current):
    ns: dict = {}
    session = Session()
    session.set_device(torch.device("cuda", 1), ns, torch_default=False)  # no CUDA started
    session.set_device(META, ns)
    session.set_nograd(True)
    assert current["calls"] == [1, 0]  # a non-CUDA choice already put CUDA's current back
    session.set_device(torch.device("cuda", 1), ns, torch_default=False)
    session.close(ns)
    assert current["calls"] == [1, 0, 1, 0] and current["current"] == 0
    assert session.device is None and ns["device"] == CPU
    assert torch_default_device() is None and torch.is_grad_enabled()
    session.close(ns)  # twice: nothing more to undo
    assert current["calls"] == [1, 0, 1, 0] and torch.is_grad_enabled()


def test_close_keeps_a_device_name_the_user_rebound():
    ns: dict = {}
    session = Session()
    session.set_device(META, ns)
    ns["device"] = "mine"
    session.close(ns)
    assert ns["device"] == "mine" and torch_default_device() is None


def test_a_failed_switch_of_cudas_current_device_changes_nothing(monkeypatch):
    def fails(index: int) -> int:
        raise DeviceMagicError(f"cannot make cuda:{index} CUDA's current device: broken")

    monkeypatch.setattr(devices, "make_current", fails)
    ns: dict = {}
    session = Session()
    session.set_device(META, ns)
    with pytest.raises(DeviceMagicError, match="cuda:2"):
        session.set_device(torch.device("cuda", 2), ns)
    assert session.device == META and ns["device"] == META and torch_default_device() == META
    session.close(ns)
    assert torch_default_device() is None


def test_close_gives_back_a_device_name_the_user_had_before():
    ns = {"device": "the user's own"}
    session = Session()
    session.set_device(META, ns)
    session.set_device(CPU, ns)
    assert ns["device"] == CPU
    session.close(ns)
    assert ns["device"] == "the user's own"
