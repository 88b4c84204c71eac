"""scripts/toy_experiment.py --quick: every stage runs a few steps and every artefact is written."""

import json
import pathlib
import subprocess
import sys

import pytest
from conftest import subprocess_env

# A slow file (train.py processes): outside the fast tier, pytest -m 'not slow'.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_quick_toy_experiment_writes_table_plot_and_checkpoints(tmp_path):
    env = subprocess_env(1)  # one CPU device, as the experiment's train.py runs use
    command = [
        sys.executable,
        "scripts/toy_experiment.py",
        "--quick",
        "--seed",
        "0",
        "--out",
        str(tmp_path),
    ]
    result = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for stage, step in (("sft", 3), ("opsd", 2), ("control", 2)):
        assert (tmp_path / stage / "checkpoints" / str(step) / "commit_success.txt").exists()
        assert (tmp_path / stage / "metrics.jsonl").exists()
    table = (tmp_path / "results.md").read_text()
    assert "| stage 1: SFT (3 steps) |" in table and "control (noise-VT teacher)" in table
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((tmp_path / "results.json").read_text())
    for arm in ("opsd", "control"):
        curve = results["arms"][arm]["student_curve"]
        assert [step for step, _ in curve] == [0, 2]
        assert all(0.0 <= accuracy <= 1.0 for _, accuracy in curve)
        assert len(results["arms"][arm]["jsd"]) == 2  # logged every step in --quick
        assert 0.0 <= results["arms"][arm]["thought_answer_agreement"] <= 1.0
    assert (tmp_path / "eval" / "opsd_student_generations.jsonl").exists()
    assert "[toy_experiment" in result.stdout  # progress lines
