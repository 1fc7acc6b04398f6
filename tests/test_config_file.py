"""Loading from ipython_config.py, and traits set there, in a real `ipython` process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import IPython
import pytest
from pythonpath import child_env

COLORS = "nocolor" if IPython.version_info[0] >= 9 else "NoColor"


def run_ipython(tmp_path: Path, config: str, code: str) -> str:
    profile = tmp_path / "profile_default"
    profile.mkdir(parents=True)
    (profile / "ipython_config.py").write_text(config)
    proc = subprocess.run(
        [sys.executable, "-W", "default", "-m", "IPython", f"--colors={COLORS}", "-c", code],
        capture_output=True, text=True, timeout=120, env=child_env(IPYTHONDIR=str(tmp_path)),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Warning" not in proc.stdout + proc.stderr  # importing and loading warn of nothing
    return proc.stdout


@pytest.mark.parametrize("torch_default", [True, False])
def test_extension_and_traits_load_from_ipython_config(tmp_path, torch_default):
    config = (
        'c.InteractiveShellApp.extensions = ["torch_device_magic"]\n'
        f"c.TorchDeviceMagics.set_torch_default = {torch_default}\n"
    )
    code = "%device meta\nimport torch; print('zeros on', torch.zeros(1).device.type)"
    out = run_ipython(tmp_path, config, code)
    assert "device = meta" in out
    assert f"zeros on {'meta' if torch_default else 'cpu'}" in out


def test_devreport_on_outlasts_a_reload_after_the_config_files_off(tmp_path):
    config = (
        'c.InteractiveShellApp.extensions = ["torch_device_magic"]\n'
        "c.TorchDeviceMagics.auto_report = False\n"
    )
    out = run_ipython(tmp_path, config, "%devreport on\n%reload_ext torch_device_magic\n"
                      "%devreport status")
    statuses = [line for line in out.splitlines() if line.startswith("per-cell report:")]
    assert statuses[-1].startswith("per-cell report: on"), out
