"""train.py as a user runs it: the tiny config end to end, and config errors before compute."""

import json
import pathlib
import re
import shutil
import subprocess
import sys

import ml_collections
import pytest
from conftest import subprocess_env

from configs import tiny
from opsd_jax import train_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_train(*overrides, timeout=600):
    env = subprocess_env(1)  # one CPU device, as on a user's laptop
    command = [sys.executable, "train.py", "--config", "configs/tiny.py",
               "--config.progress_bar=False", *overrides]  # fmt: skip
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _final_params(checkpoint_dir, step):
    """The params item of one saved step, as saved (no restore target needed)."""
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer().restore(checkpoint_dir / str(step) / "params")


def write_corrupted_toy_data(data_dir, seed=0):
    """The toy data set with ~10% broken training rows of every kind the pipeline knows."""
    from scripts import make_toy_data as toy

    toy.write_toy_data(str(data_dir), seed=seed)
    for task in toy.TASKS:
        path = data_dir / task / "data" / "train-00000-of-00001.parquet"
        rows = toy.make_rows(task, "train", 320, seed)
        bad = [dict(r, pid=f"bad_{task}_{i}") for i, r in enumerate(rows[:32])]
        for i, row in enumerate(bad):
            kind = i % 6
            if kind == 0:
                row["problem_image_0"] = {"bytes": b"not an image", "path": "x.png"}
            elif kind == 1:
                png = row["reasoning_image_0"]["bytes"]
                row["reasoning_image_0"] = {"bytes": png[: len(png) // 2], "path": "cut.png"}
            elif kind == 2:
                row["reasoning_image_0"] = None
            elif kind == 3:
                row["question"] = None
            elif kind == 4:
                row["question"] = "  "
            else:
                row["question"] = "q" * 20_000  # over max_question_chars
        mixed = [r for pair in zip(rows[:32], bad) for r in pair] + rows[32:]
        toy.write_parquet(mixed, str(path))


def test_tiny_config_trains_saves_logs_and_resumes_bit_identically(tmp_path):
    """3 steps in one run on toy data with ~10% broken rows; a second run is stopped by SIGTERM
    (a preemption) after step 1 or 2, saves there and exits 0; a third run resumes it: the
    step-3 params are bit-identical, and the broken rows were skipped and counted."""
    import signal

    import jax
    import numpy as np

    common = ["--config.total_steps=3", "--config.save_every=1", "--config.log_every=1",
              "--config.lr_scheduler=constant", "--config.warmup_steps=0"]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    write_corrupted_toy_data(straight / "toy" / "data")
    result = run_train(f"--config.results_dir={straight}", *common)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    skipped = re.search(r"skipped rows: (.*)", result.stdout)
    assert skipped and skipped.group(1) != "none", result.stdout[-2000:]  # counted per reason
    for step in ("1", "2", "3"):
        assert (straight / "checkpoints" / step / "commit_success.txt").exists()
    assert list(straight.glob("events.out.tfevents.*"))
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["loss"] == r["loss"] and r["completion_length"] > 0 for r in records)
    assert sum(v for k, v in records[-1].items() if k.startswith("data/skipped/")) > 0
    assert "step 3/3" in result.stdout and "done: 3 steps" in result.stdout

    # Preempted: SIGTERM as soon as step 1 is logged; no periodic checkpoints in this run, so
    # the one it leaves is the one the signal made it write.
    env = dict(subprocess_env(1), PYTHONUNBUFFERED="1")
    shutil.copytree(straight / "toy", resumed / "toy")
    command = [sys.executable, "train.py", "--config", "configs/tiny.py",
               "--config.progress_bar=False", f"--config.results_dir={resumed}", *common,
               "--config.save_every=1000"]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
    output = []
    for line in process.stdout:
        output.append(line)
        if line.startswith("step 1/3"):
            process.send_signal(signal.SIGTERM)
    process.wait(timeout=300)
    output = "".join(output)
    assert process.returncode == 0, output[-4000:]
    stopped = re.search(r"stopped by SIGTERM after step (\d)", output)
    assert stopped, output[-3000:]
    saved = int(stopped.group(1))
    assert saved in (1, 2), output[-3000:]  # not run to the end
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == [str(saved)]
    assert (resumed / "checkpoints" / str(saved) / "commit_success.txt").exists()

    result = run_train(f"--config.results_dir={resumed}", *common)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"at step {saved}" in result.stdout
    a = _final_params(straight / "checkpoints", 3)
    b = _final_params(resumed / "checkpoints", 3)
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 0
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_typo_in_a_config_key_is_an_error(tmp_path):
    result = run_train(f"--config.results_dir={tmp_path}", "--config.lr_schedular=cosine")
    assert result.returncode != 0
    assert "lr_schedular" in result.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_a_bad_value_fails_before_any_compute(tmp_path):
    result = run_train(f"--config.results_dir={tmp_path}", "--config.teacher_mode=mentor")
    assert result.returncode != 0
    assert "teacher_mode='mentor': allowed values are 'self', 'ema', 'fixed'" in result.stderr
    assert "mesh" not in result.stdout  # stopped before building anything


def _valid_config(tmp_path):
    config = tiny.get_config()
    with config.unlocked():
        config.model_path = str(tmp_path)
        config.toy_data = False
        config.data.datasets = [dict(name="d", path=str(tmp_path), weight=1.0, num_used_data=-1)]
    return config


@pytest.mark.parametrize(
    "key, value, message",
    [
        (
            "teacher_mode",
            "mentor",
            "teacher_mode='mentor': allowed values are 'self', 'ema', 'fixed'",
        ),
        ("jsd_beta", 1.5, "jsd_beta=1.5: must be a number in [0, 1]"),
        ("jsd_top_k", -3, "jsd_top_k=-3: must be >= 0"),
        ("jsd_loss_kind", "kl", "jsd_loss_kind='kl': allowed values are 'jsd', 'tinker'"),
        ("lr_scheduler", "step", "lr_scheduler='step'"),
        ("num_replicate", 3, "does not match the 1 devices"),
        ("rows_per_micro_batch", 3, "rows_per_micro_batch=3 exceeds samples_per_micro_batch=2"),
        ("model_path", "/nonexistent/model", "model_path='/nonexistent/model': not a directory"),
        ("freeze_und", True, "freeze_und=True"),
        ("compute_dtype", "fp8", "compute_dtype='fp8'"),
    ],
)
def test_bad_configs_are_named(tmp_path, key, value, message):
    config = _valid_config(tmp_path)
    train_config.validate(config, num_devices=1)  # the base is valid
    with config.unlocked():
        config[key] = value
    with pytest.raises(ValueError) as error:
        train_config.validate(config, num_devices=1)
    assert message in str(error.value)


def test_missing_dataset_and_mesh_divisibility_are_named(tmp_path):
    config = _valid_config(tmp_path)
    with config.unlocked():
        config.data.datasets = [dict(name="gone", path=str(tmp_path / "gone"))]
    with pytest.raises(ValueError, match=r"data.datasets\[0\] \(gone\): path .* does not exist"):
        train_config.validate(config, num_devices=1)
    config = _valid_config(tmp_path)
    with config.unlocked():
        config.samples_per_micro_batch = 8
        config.rows_per_micro_batch = 4
    with pytest.raises(ValueError, match="must be a multiple of data x fsdp = 8"):
        train_config.validate(config, num_devices=8)
    # Several processes: each feeds an equal share of every micro-batch.
    config = _valid_config(tmp_path)
    with config.unlocked():
        config.samples_per_micro_batch = 6
        config.rows_per_micro_batch = 6
        config.num_replicate = 3
        config.num_shard = 2
    train_config.validate(config, num_devices=6, num_processes=3)
    with pytest.raises(ValueError, match="samples_per_micro_batch=6 must be a multiple of the 4 "):
        train_config.validate(config, num_devices=6, num_processes=4)
    assert isinstance(config, ml_collections.ConfigDict)


def test_shipped_configs_load_and_the_paper_recipe_is_exact(tmp_path):
    from configs import sanity, thinkmorph_7b

    paper = thinkmorph_7b.get_config()
    # opsd_loss_spec.md §b.1 (Visual-OPSD paper, Appendix C).
    expected = dict(teacher_mode="ema", ema_decay=0.995, jsd_beta=0.5, jsd_temperature=1.0,
                    jsd_top_k=256, jsd_token_clip=0.05, ce_weight=0.0, jsd_weight=1.0,
                    sample_max_new_tokens=1024, sample_max_image_skips=1, max_forward_tokens=10240,
                    lr=1e-5, min_lr=1e-7, warmup_steps=200, lr_scheduler="cosine", beta1=0.9,
                    beta2=0.95, eps=1e-15, max_grad_norm=1.0, gradient_accumulation_steps=2,
                    total_steps=1000, save_every=500)  # fmt: skip
    assert {k: paper[k] for k in expected} == expected
    assert [(d["name"], d["num_used_data"]) for d in paper.data.datasets] == [
        ("Visual_Search", 6990), ("Spatial_Navigation", 6000), ("Jigsaw_Assembly", 6000),
        ("Chart_Refocus", 6000)]  # fmt: skip
    assert dict(paper.data.image_transform) == dict(max_size=980, min_size=378, stride=14,
                                                    max_pixels=2_007_040)  # fmt: skip
    with paper.unlocked():
        paper.model_path = str(tmp_path)
        paper.data_root = str(tmp_path)
    for spec in paper.data.datasets:
        (tmp_path / spec["name"]).mkdir()
    train_config.resolve_dataset_paths(paper)
    train_config.validate(paper, num_devices=8)
    train_config.validate(sanity.get_config(), num_devices=1)
