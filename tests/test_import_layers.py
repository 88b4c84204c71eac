"""The package's import contracts (pyproject.toml [tool.importlinter]) hold, and each can fail.

CI runs `lint-imports` on the repo; these run it on a copy of the packages, as they are and with
one import against a contract added (io importing training: the layers; the network importing
opsd_jax; evaluation importing the program readers, which the layers allow), which must break
that contract and be named in the report.
"""

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINT_IMPORTS = pathlib.Path(sys.executable).parent / "lint-imports"  # requirements-test.txt


def lint(tree: pathlib.Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "PYTHONPATH": str(tree)},
    )


def copy_packages(tmp_path: pathlib.Path) -> pathlib.Path:
    for name in ("models", "opsd_jax"):
        shutil.copytree(
            ROOT / name,
            tmp_path / name,
            ignore=shutil.ignore_patterns("__pycache__", "*.safetensors"),
        )
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_layers_hold_and_an_import_against_the_flow_breaks_them(tmp_path):
    tree = copy_packages(tmp_path)
    kept = lint(tree)
    assert kept.returncode == 0 and "3 kept, 0 broken" in kept.stdout, kept.stdout + kept.stderr
    with open(tree / "opsd_jax" / "io" / "tokenizer.py", "a", encoding="utf-8") as f:
        f.write("\nfrom opsd_jax.training import losses  # noqa: E402, F401\n")
    broken = lint(tree)
    assert broken.returncode != 0, broken.stdout
    assert "opsd_jax.io is not allowed to import opsd_jax.training" in broken.stdout
    assert "opsd_jax.io.tokenizer -> opsd_jax.training.losses" in broken.stdout


def test_the_network_importing_opsd_jax_breaks_the_forbidden_contract(tmp_path):
    tree = copy_packages(tmp_path)
    with open(tree / "models" / "pack.py", "a", encoding="utf-8") as f:
        f.write("\nimport opsd_jax  # noqa: E402, F401\n")
    broken = lint(tree)
    assert broken.returncode != 0, broken.stdout
    assert "models.pack -> opsd_jax" in broken.stdout, broken.stdout


def test_a_runtime_package_importing_the_program_readers_breaks_the_forbidden_contract(tmp_path):
    # evaluation sits above programs in the layers: only the forbidden contract catches this.
    tree = copy_packages(tmp_path)
    with open(tree / "opsd_jax" / "evaluation" / "answers.py", "a", encoding="utf-8") as f:
        f.write("\nfrom opsd_jax.programs import hlo_stats  # noqa: E402, F401\n")
    broken = lint(tree)
    assert broken.returncode != 0, broken.stdout
    assert "no runtime package imports the program readers" in broken.stdout, broken.stdout
    assert "opsd_jax.evaluation.answers -> opsd_jax.programs.hlo_stats" in broken.stdout
    assert "1 broken" in broken.stdout, broken.stdout
