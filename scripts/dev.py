#!/usr/bin/env python3
"""The two commands of the README, runnable with nothing but Python 3.10+ and pip.

    python3 scripts/dev.py demo   # run demo.ipynb on a real kernel, print what it showed
    python3 scripts/dev.py test   # ruff, mypy, lint-imports, the suite in two envs, one summary

Each creates (or reuses) its own virtual environment: `.venv` with the current
IPython, and for `test` also `.venv-colab` pinned to what Google Colab ships
(IPython 7.34, ipykernel 6.17.1). The CPU build of torch goes in first: an
unpinned `torch` would pull a multi-GB CUDA build. Set TORCH_SPEC (and
TORCH_INDEX_URL) to install another torch.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
ENVS = {
    "current": (ROOT / ".venv", []),
    "colab": (ROOT / ".venv-colab", ["ipython==7.34.0", "ipykernel==6.17.1"]),
}


def _python(env: Path) -> Path:
    return env / ("Scripts" if os.name == "nt" else "bin") / "python"


def _run(cmd: list, **kw) -> int:
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, **kw).returncode


def ensure_env(name: str) -> Path:
    """Create or reuse the named virtual environment; reinstall only when its inputs change."""
    env, pins = ENVS[name]
    py = _python(env)
    key = hashlib.sha256(
        "\n".join(
            [sys.version, TORCH_SPEC, *pins, (ROOT / "pyproject.toml").read_text()]
        ).encode()
    ).hexdigest()
    stamp = env / ".stamp"
    if py.exists() and stamp.exists() and stamp.read_text() == key:
        return py
    print(f"setting up {env.name} ({name} IPython) ...", flush=True)
    if not py.exists():
        venv.create(env, with_pip=True)
    pip = [py, "-m", "pip", "install", "-qq", "--disable-pip-version-check"]
    index = os.environ.get("TORCH_INDEX_URL")
    torch_cmd = [*pip, TORCH_SPEC] + (["--index-url", index] if index else [])
    if _run(torch_cmd) or _run([*pip, "-e", ".[test,plot,bench,dev]", *pins]):
        sys.exit(f"could not install the {name} environment in {env}")
    stamp.write_text(key)
    return py


def _counts(output: str) -> dict[str, int]:
    """Read pytest's closing line ('3 failed, 10 passed, 2 skipped in 4.2s')."""
    last = [ln for ln in output.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    found = re.findall(r"(\d+) (passed|failed|skipped|errors?)", last[-1] if last else "")
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for n, word in found:
        counts["failed" if word.startswith("error") else word] += int(n)
    return counts


def ensure_chromium() -> None:
    """Install Debian's chromium for the browser test if it is missing and apt-get can."""
    if shutil.which("chromium"):
        return
    if not shutil.which("apt-get") or os.geteuid() != 0:
        print("chromium is missing and cannot be installed here (needs root and apt-get): "
              "the browser test will skip", flush=True)
        return
    print("installing chromium for the browser test ...", flush=True)
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL,
             "env": {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}}
    install = ["apt-get", "install", "-y", "-qq", "chromium"]
    if _run(install, **quiet) and (_run(["apt-get", "update", "-qq"], **quiet)
                                   or _run(install, **quiet)):
        print("could not install chromium: the browser test will skip", flush=True)


def test(pytest_args: list[str]) -> int:
    py = ensure_env("current")
    ensure_chromium()
    print("== ruff check", flush=True)
    lint_rc = _run([py, "-m", "ruff", "check", "."])
    print("== mypy", flush=True)  # the package, as configured in pyproject.toml
    lint_rc |= _run([py, "-m", "mypy"])
    print("== lint-imports", flush=True)  # the layers, as contracted in pyproject.toml
    lint_rc |= _run([py.parent / ("lint-imports.exe" if os.name == "nt" else "lint-imports")])
    totals = {"passed": 0, "failed": 1 if lint_rc else 0, "skipped": 0}
    for name in ENVS:
        env_py = ensure_env(name)
        print(f"== pytest ({name} IPython)", flush=True)
        # A behaviour that does not depend on IPython's version is tested once.
        once = ["-m", "not once"] if name != "current" else []
        proc = subprocess.run(
            [str(env_py), "-m", "pytest", "-q", "-rs", *once, *pytest_args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        print(proc.stdout, flush=True)
        counts = _counts(proc.stdout)
        if proc.returncode and not counts["failed"]:
            counts["failed"] = 1  # a crash, or no test collected
        for k in totals:
            totals[k] += counts[k]
    print(f"summary: {totals['passed']} passed, {totals['failed']} failed, "
          f"{totals['skipped']} skipped")
    return 1 if totals["failed"] or not totals["passed"] else 0


def demo() -> int:
    py = ensure_env("current")
    return _run([py, ROOT / "scripts" / "run_demo.py"])


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("demo", "test"):
        print(__doc__)
        return 2
    return demo() if argv[0] == "demo" else test(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
