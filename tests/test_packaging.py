"""The repo is an installable package: its code imports from anywhere once `pip install -e .`
(or `pip install .`) ran, and nothing puts the repo on sys.path by hand."""

import os
import pathlib
import re
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The one justified exception: an upstream BAGEL checkout, which is not a package.
PATH_EDITS_ALLOWED = {"bench/vs_pytorch.py"}


def test_the_package_imports_outside_the_repo(tmp_path):
    """From a folder outside the repo, as a user's own script runs."""
    done = subprocess.run(
        [sys.executable, "-c", "import configs, models, opsd_jax, train"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert done.returncode == 0, f"not installed? pip install -e .\n{done.stderr}"


def test_no_module_puts_the_repo_on_sys_path():
    edited = re.compile(r"sys\.path\.(insert|append)")
    edits = sorted(
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*.py")
        if not {".venv", "build"} & set(p.relative_to(ROOT).parts)
        and edited.search(p.read_text(encoding="utf-8"))
    )
    assert set(edits) <= PATH_EDITS_ALLOWED, edits


def test_the_dependencies_are_the_runtime_pins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["dynamic"] == ["dependencies"]
    assert project["tool"]["setuptools"]["dynamic"]["dependencies"]["file"] == ["requirements.txt"]
    pins = [
        line
        for line in (ROOT / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert pins and all("==" in line for line in pins), pins
