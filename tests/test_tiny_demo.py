"""configs/tiny.py, the README's first command: it starts from the shipped stage-1 toy model (the
files its manifest describes), evaluates before and during the run, and ends with a summary.

Whether the no-VT accuracy rises over the full run is a measurement (README, 3 seeds), not a
test: the full run takes ~2 minutes. Here a 4-step run checks every piece of what it shows."""

import re
import subprocess
import sys

import pytest
from conftest import subprocess_env

from configs import tiny
from opsd_jax.toy import data as toy_data
from opsd_jax.toy import tasks as toy_tasks
from scripts import make_toy_stage1

# A slow file (train.py processes): outside the fast tier, pytest -m 'not slow'.
pytestmark = pytest.mark.slow


def test_the_shipped_stage1_model_is_what_its_manifest_says():
    """Every file's sha256 is the one make_toy_stage1.py recorded, on a clean commit; the model
    it describes reads the VT image (with VT far above without)."""
    manifest = make_toy_stage1.read_manifest(tiny.STAGE1_MODEL)
    assert make_toy_stage1.file_hashes(tiny.STAGE1_MODEL) == manifest["sha256"]
    assert {"ema.safetensors", "llm_config.json", "vit_config.json", "tokenizer.json"} <= set(
        manifest["sha256"]
    )
    assert manifest["command"].startswith("python scripts/make_toy_stage1.py")
    assert re.fullmatch(r"[0-9a-f]{40}", manifest["commit"]), manifest["commit"]
    accuracy = manifest["heldout_accuracy_fp32_checkpoint"]
    assert accuracy["teacher_context_with_vt"] > accuracy["student_context_no_vt"] + 0.3


def test_chance_accuracy_is_known_only_for_uniform_answers():
    assert toy_tasks.chance_accuracy(["toy_majority"]) == 0.25
    assert toy_tasks.chance_accuracy(["toy_maze", "toy_maze"]) == 0.5
    assert toy_tasks.chance_accuracy(["toy_maze", "toy_majority"]) is None  # they differ
    assert toy_tasks.chance_accuracy(["toy_count"]) is None


def test_tiny_config_starts_from_stage1_evaluates_and_summarises(tmp_path):
    # A small toy data set written first (train.py reuses it): writing the default 4096 rows
    # is not what this test is about.
    toy_data.write_toy_data(
        str(tmp_path / "toy" / "data"), seed=0, num_train=320, num_test=64, tasks=["toy_majority"]
    )
    command = [
        sys.executable,
        "train.py",
        "--config",
        "configs/tiny.py",
        f"--config.results_dir={tmp_path}",
        "--config.total_steps=4",
        "--config.eval_every=2",
        "--config.eval_samples_per_dataset=16",
        "--config.eval_batch_size=16",
        "--config.warmup_steps=1",
        "--config.log_every=1",
    ]
    result = subprocess.run(
        command,
        cwd=make_toy_stage1.ROOT,
        env=subprocess_env(1),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-4000:]
    assert f"model {tiny.STAGE1_MODEL}:" in out
    for step in (0, 2, 4):
        for context in (r"student context \(without VT\)", r"teacher context \(with VT\)"):
            assert re.search(
                rf"\[step {step}\] held-out accuracy, {context}: \d+\.\d% of 16 "
                rf"samples",
                out,
            ), out[-3000:]
    # A sampled completion in the toy task's words, not byte noise.
    assert re.search(r"\[step \d\] completion: <think>Most dots are \w+\.</think><answer>", out)
    table = out[out.index("held-out accuracy (16 samples, greedy, chance 25%):") :]
    assert re.search(r"step \| +no VT \(student\) \| with VT \(teacher context\)", table)
    for step in (0, 2, 4):
        assert re.search(rf"\n +{step} \| +\d+\.\d% \| +\d+\.\d%\n", table), table[:600]
    assert re.search(r"no VT: \d+\.\d% at step 0 -> \d+\.\d% at step 4", table)
    assert re.search(
        r"a held-out answer without VT \(step 4, (right|wrong); reference '\w+'\): "
        r"'.*<answer>",
        table,
    )
    assert (tmp_path / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert table.index("summary.png") < table.index("next:")
