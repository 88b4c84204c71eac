"""train.py as a user runs it: the tiny config end to end, and config errors before compute."""

import copy
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import ml_collections
import numpy as np
import pytest
from conftest import run_python, subprocess_env

from configs import smoke
from models.configs import BagelConfig
from opsd_jax import run_config
from opsd_jax.run_config import checks
from opsd_jax.toy.model import write_toy_model
from scripts import crash_drill

ROOT = pathlib.Path(__file__).resolve().parents[1]


def train_command(*overrides):
    return [
        sys.executable,
        "train.py",
        "--config",
        "configs/smoke.py",
        "--config.progress_bar=False",
        *overrides,
    ]


def run_train(*overrides, timeout=600, log_compiles=False, env=None):
    env = env or subprocess_env(1)  # one CPU device, as on a user's laptop
    if log_compiles:  # jax logs every compilation (stderr), merged in order with the console
        env.update(JAX_LOG_COMPILES="1", PYTHONUNBUFFERED="1")
        return subprocess.run(
            train_command(*overrides),
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )
    return subprocess.run(
        train_command(*overrides),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_corrupted_toy_data(data_dir, seed=0):
    """The toy data set with ~10% broken training rows of every kind the pipeline knows."""
    from opsd_jax.toy import data as toy

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


# Shared by the tests below: 6 steps in one uninterrupted run, a checkpoint after every step.
COMMON = [
    "--config.total_steps=6",
    "--config.save_every=1",
    "--config.log_every=1",
    "--config.max_checkpoints=2",
    "--config.lr_scheduler=constant",
    "--config.warmup_steps=0",
]


def reference_args(results_dir, *overrides):
    return [f"--config.results_dir={results_dir}", *COMMON, *overrides]


def assert_same_params(a_dir, b_dir, step):
    leaves_a, leaves_b = (
        crash_drill.saved_arrays(a_dir, step),
        crash_drill.saved_arrays(b_dir, step),
    )
    assert len(leaves_a) == len(leaves_b) > 0
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
    """A compilation cache of this file's own for its train.py runs (crash_drill's launches
    included), empty when the first of them, the straight run, starts: that run then compiles
    and writes every program of its config, and the runs after it read them."""
    cache = tmp_path_factory.mktemp("compilation_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAX_COMPILATION_CACHE_DIR", str(cache))
        yield cache


# The straight run's settings beyond COMMON: held-out evaluation at the last step (greedy, 2
# samples per dataset). It reads the params only, so the run stays the reference of the
# resumed runs below.
STRAIGHT = ["--config.eval_every=6", "--config.eval_samples_per_dataset=2"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, compilation_cache):
    """The uninterrupted reference run, on toy data with ~10% broken rows."""
    del compilation_cache  # (set up first)
    root = tmp_path_factory.mktemp("straight")
    write_corrupted_toy_data(root / "toy" / "data")
    result = run_train(*reference_args(root), *STRAIGHT, log_compiles=True)
    return root, result


@pytest.mark.slow
def test_tiny_config_trains_saves_logs_and_counts_bad_rows(straight):
    """The run completes on data with ~10% broken rows; they are skipped, counted per reason in
    the logs and in a final summary."""
    root, result = straight
    assert result.returncode == 0, result.stdout[-6000:]
    skipped = re.search(r"skipped rows: (.*)", result.stdout)
    assert skipped and skipped.group(1) != "none", result.stdout[-2000:]  # counted per reason
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["5", "6"]  # 2 kept
    for step in ("5", "6"):
        assert (root / "checkpoints" / step / "commit_success.txt").exists()
    assert list(root.glob("events.out.tfevents.*"))
    records = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    # Step 0: the held-out evaluation of the starting weights (eval_at_start), then the steps.
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 6]
    assert "eval/accuracy" in records[0] and "loss" not in records[0]
    records = records[1:]
    assert all(r["loss"] == r["loss"] and r["completion_length"] > 0 for r in records)
    # The rollout's log-probs against the trained student's (a float32 run: rounding only).
    assert all(0 <= r["rollout/logprob_gap_max"] <= 1e-4 for r in records), records[-1]
    assert all(r["rollout/mismatch_kl"] < 1e-8 for r in records), records[-1]
    assert sum(v for k, v in records[-1].items() if k.startswith("data/skipped/")) > 0
    assert "step 6/6" in result.stdout and "done: 6 steps" in result.stdout
    # A float32 run's rollouts decode with a float32 KV cache, as its evaluation does.
    assert "decode copy (float32, KV cache float32)" in result.stdout, result.stdout[:3000]
    assert not (root / "run.lock").exists()  # the run gave its directory back
    # The held-out accuracy is on the console, and the run ends with what to run next.
    assert re.search(
        r"\[step 6\] held-out accuracy, student context \(without VT\): "
        r"\d+\.\d% of 4 samples \(toy_maze \d",
        result.stdout,
    ), result.stdout[-3000:]
    assert (root / "eval" / "step6_student_summary.json").is_file()
    assert (root / "eval" / "step0_student_summary.json").is_file()
    # The end-of-run summary: both evaluations in the table, the change, the plot.
    table = result.stdout[result.stdout.index("held-out accuracy (4 samples, greedy") :]
    assert re.search(r"\n\s+0 \|\s+\d+\.\d%\n\s+6 \|\s+\d+\.\d%\n", table), table[:800]
    assert re.search(
        r"no VT: \d+\.\d% at step 0 -> \d+\.\d% at step 6 \([+-]\d+\.\d points", table
    ), table[:800]
    assert (root / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tail = result.stdout[result.stdout.index("next:") :]
    assert f"python scripts/evaluate.py --checkpoint {root}" in tail
    assert f"python scripts/plot_run.py {root}" in tail
    assert f"python scripts/convert_hf.py jax-to-hf --ckpt {root / 'checkpoints'}" in tail


FAKE_WANDB = '''"""A stand-in for the optional wandb package: appends init's arguments to a file."""
import json, os, types


def init(**kwargs):
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps({k: kwargs.get(k) for k in ("project", "id", "resume")}) + "\\n")
    return types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)
'''


def fake_wandb_env(tmp_path):
    """A subprocess environment whose `import wandb` finds FAKE_WANDB; its init log file."""
    package = tmp_path / "fake_wandb" / "wandb"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_WANDB)
    env = subprocess_env(1)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package.parent), env.get("PYTHONPATH")]))
    env["FAKE_WANDB_LOG"] = str(tmp_path / "wandb_inits.jsonl")
    return env, tmp_path / "wandb_inits.jsonl"


@pytest.mark.slow
def test_the_train_step_compiles_before_step_1_and_nothing_after(straight):
    """JAX_LOG_COMPILES=1: the train step compiles once, ahead of time, with its console line
    before training starts; after step 1's line no training program compiles at all (the
    sampler may still meet a new prompt length; nothing else compiles)."""
    root, result = straight
    assert result.returncode == 0, result.stdout[-6000:]
    lines = result.stdout.splitlines()
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1/6"))
    announced = [i for i, line in enumerate(lines) if line.startswith("compiling the train step")]
    assert len(announced) == 1 and announced[0] < first_step, result.stdout[-6000:]
    assert re.match(
        r"compiling the train step for 2 x 1 rows x \(student 512 tokens / 128 "
        r"patches, teacher 1024 tokens / 256 patches\), 64 loss entries per row: "
        r"[\d.]+ s",
        lines[announced[0]],
    ), lines[announced[0]]
    compiled = [line for line in lines if "Compiling jit(train_step)" in line]
    assert len(compiled) == 1, compiled
    later = [
        re.search(r"Compiling (\S+)", line).group(1)
        for line in lines[first_step:]
        if "Compiling " in line
    ]
    # The sampler, for a prompt length it has not met (and the held-out evaluation's greedy
    # rounds, with its sampling key folded once): no training program.
    sampling = ("jit(prefill_rows)", "jit(decode_round)", "jit(_threefry_fold_in)")
    assert all(name in sampling for name in later), later


def cache_counts(output: str, cache) -> tuple[int, int]:
    """(programs read from the compilation cache, programs compiled and written) of a run."""
    counts = re.search(
        rf"compilation cache {re.escape(str(cache))}: (\d+) programs read "
        r"from it, (\d+) compiled and written",
        output,
    )
    assert counts, output[-3000:]
    return int(counts.group(1)), int(counts.group(2))


@pytest.mark.slow
def test_a_second_identical_run_compiles_nothing_the_first_compiled(
    straight, compilation_cache, tmp_path
):
    """JAX's persistent compilation cache, on by default (here this file's own folder, empty
    before the straight run): the first run of a config compiles and writes every program,
    a second identical run reads them all."""
    root, result = straight
    assert result.returncode == 0
    assert f"compilation cache: {compilation_cache}" in result.stdout
    first_read, first_compiled = cache_counts(result.stdout, compilation_cache)
    # (The first run may read back what it wrote itself: a program met twice in one run.)
    assert first_compiled >= 3  # train step, decode copy, sampler rounds, ...
    shutil.copytree(root / "toy", tmp_path / "toy")
    run = run_train(*reference_args(tmp_path), *STRAIGHT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    second_read, second_compiled = cache_counts(run.stdout, compilation_cache)
    assert second_compiled == 0 and second_read == first_read + first_compiled, (
        (first_read, first_compiled),
        (second_read, second_compiled),
    )
    assert re.search(
        r"compiling the train step .* s \(read from the compilation cache\)", run.stdout
    ), run.stdout[-3000:]


@pytest.mark.slow
def test_preempted_run_saves_exits_0_and_resumes_bit_identically(straight, tmp_path):
    """SIGTERM (a preemption) after step 1: the run saves where it is and exits 0; the next
    run resumes there and its final params are bit-identical to the uninterrupted run's. Both
    launches log to one W&B run (a fake wandb records the init arguments)."""
    root, result = straight
    assert result.returncode == 0
    # No periodic checkpoints in this run, so the one it leaves is the one the signal made.
    shutil.copytree(root / "toy", tmp_path / "toy")
    wandb_env, wandb_inits = fake_wandb_env(tmp_path)
    env = dict(wandb_env, PYTHONUNBUFFERED="1")
    wandb_args = ("--config.wandb_project=opsd",)
    command = train_command(*reference_args(tmp_path, "--config.save_every=1000", *wandb_args))
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = []
    for line in process.stdout:
        output.append(line)
        if line.startswith("step 1/6"):
            process.send_signal(signal.SIGTERM)
    process.wait(timeout=300)
    output = "".join(output)
    assert process.returncode == 0, output[-4000:]
    stopped = re.search(r"stopped by SIGTERM after step (\d)", output)
    assert stopped, output[-3000:]
    saved = int(stopped.group(1))
    assert saved < 6, output[-3000:]  # not run to the end
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [str(saved)]
    assert (tmp_path / "checkpoints" / str(saved) / "commit_success.txt").exists()

    resumed = run_train(*reference_args(tmp_path, *wandb_args), env=wandb_env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"at step {saved}" in resumed.stdout
    assert "save_every: 1000 -> 1" in resumed.stdout  # the resume names what it changed
    assert "(weights not read: a checkpoint gives them)" in resumed.stdout  # one state in memory
    assert_same_params(root / "checkpoints", tmp_path / "checkpoints", 6)
    first, second = (json.loads(line) for line in wandb_inits.read_text().splitlines())
    assert first["project"] == second["project"] == "opsd"
    assert len(first["id"]) == 16 and second["id"] == first["id"]  # the same W&B run, continued
    assert first["resume"] == second["resume"] == "allow"
    saved_config = json.loads((tmp_path / "checkpoints" / "6" / "config" / "metadata").read_text())
    assert saved_config["wandb_runid"] == first["id"]


@pytest.mark.slow
def test_killed_five_times_resumes_from_complete_checkpoints_bit_identically(
    straight, tmp_path, capsys
):
    """scripts/crash_drill.py against the reference run: SIGKILL five times at random moments,
    three of them during an asynchronous checkpoint save, restarting with auto_resume each
    time: every launch resumes from the newest complete step (never a half-written one), and
    the final params are bit-identical."""
    root, result = straight
    assert result.returncode == 0
    argv = ["--kills", "5", "--steps", "6", "--seed", "0", "--straight", str(root)]
    code = crash_drill.main([*argv, "--out", str(tmp_path / "drill")])
    printed = capsys.readouterr().out
    assert code == 0, printed[-4000:]
    # (The drill's own tally, and its per-launch lines: seed 0 plans three save kills.)
    assert "after 5 kills (3 during a save, 2 at startup)" in printed, printed[-3000:]
    # At least one kill left the step it was saving half-written, and no launch resumed from
    # such a step: each resumed from the newest complete step it found.
    assert re.search(r"kill \d \(save, mid-save\)", printed), printed[-3000:]
    assert "resumed from anything but the newest complete step: none" in printed
    assert "final params bit-identical to the uninterrupted run: True" in printed
    assert re.search(r"final launch: checkpoint dirs before \[\d", printed), printed[-3000:]


@pytest.mark.slow
def test_train_refuses_a_teacher_change_on_resume_before_any_compute(straight, tmp_path):
    """The issue's case: an 'ema' run resumed with teacher_mode=fixed is one clear refusal."""
    root, result = straight
    assert result.returncode == 0
    shutil.copytree(root / "toy", tmp_path / "toy")
    shutil.copytree(root / "checkpoints", tmp_path / "checkpoints")
    refused = run_train(
        f"--config.results_dir={tmp_path}",
        "--config.total_steps=7",
        "--config.teacher_mode=fixed",
        timeout=300,
    )
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "teacher_mode: 'ema' -> 'fixed'" in refused.stderr
    assert "allow_config_change=True" in refused.stderr and "Traceback" not in refused.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["5", "6"]  # untouched


@pytest.mark.slow
def test_generate_answers_an_image_with_the_trained_checkpoint(straight, tmp_path):
    """scripts/generate.py on the run's results_dir: its saved config gives the model, the
    image size and the prompt; the last step's params are restored; a completion is printed."""
    from PIL import Image

    root, result = straight
    assert result.returncode == 0
    image = tmp_path / "picture.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (90, 120, 3), np.uint8)).save(image)
    command = [
        sys.executable,
        "scripts/generate.py",
        "--checkpoint",
        str(root),
        "--image",
        str(image),
        "--question",
        "Which way out?",
        "--max_new_tokens",
        "6",
    ]
    run = subprocess.run(
        command, cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"model: params of {root / 'checkpoints' / '6'} on " in run.stderr, run.stderr
    summary = re.search(r"^answer: .*; (\d+) tokens, (\d+) round\(s\), ", run.stderr, re.M)
    assert summary and 1 <= int(summary.group(1)) <= 6, run.stderr
    assert run.stdout.strip() and run.stdout.count("\n") >= 1  # the completion


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_logged_and_stop_the_run(tmp_path):
    """NaN gradients injected at step 2 and an infinite loss at steps 4-6: step 2 is skipped
    (params, optimizer state and EMA unchanged) and training goes on; three bad steps in a row
    exceed max_consecutive_bad_steps=2, so the run saves and stops with an error naming the
    last good step, whose state the saved checkpoint holds."""
    env = dict(subprocess_env(1), OPSD_INJECT="2:grads,4:loss,5:loss,6:loss")
    command = [
        sys.executable,
        "tests/train_with_injected_nans.py",
        *train_command(
            f"--config.results_dir={tmp_path}",
            "--config.total_steps=8",
            "--config.save_every=1",
            "--config.max_checkpoints=10",
            "--config.log_every=1",
            "--config.max_consecutive_bad_steps=2",
        )[2:],
    ]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    # A stop the config asked for: one line, not a traceback.
    assert result.returncode == 1 and "Traceback" not in result.stderr, output[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("train.py: error: 3 consecutive")
    assert re.findall(r"\[inject\] step (\d+): (\w+)", output) == [
        ("2", "grads"),
        ("4", "loss"),
        ("5", "loss"),
        ("6", "loss"),
    ]
    assert (
        "3 consecutive steps with a non-finite loss or gradient (limit max_consecutive_bad_steps=2)"
    ) in output, output[-3000:]
    assert "Saved step 6" in output and "those after step 3, the last good step" in output
    assert re.search(
        r"step 2: non-finite loss or gradient, update skipped \(1 in a row\); "
        r"samples \['\w+",
        output,
    ), output[-3000:]
    assert "step 6: non-finite loss or gradient, update skipped (3 in a row)" in output

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["nonfinite"]) for r in records] == [
        (1, 0.0),
        (2, 1.0),
        (3, 0.0),
        (4, 1.0),
        (5, 1.0),
    ]
    checkpoints = tmp_path / "checkpoints"
    assert sorted(int(p.name) for p in checkpoints.iterdir()) == [1, 2, 3, 4, 5, 6]
    saved = crash_drill.saved_arrays
    for item in ("params", "opt_state", "ema_params"):
        for a, b in [(1, 2), (3, 4), (3, 5), (3, 6)]:  # skipped steps changed nothing
            leaves_a, leaves_b = saved(checkpoints, a, item), saved(checkpoints, b, item)
            assert len(leaves_a) == len(leaves_b) > 0
            for x, y in zip(leaves_a, leaves_b):
                np.testing.assert_array_equal(x, y, err_msg=f"{item} step {a} vs {b}")
    pairs = zip(saved(checkpoints, 2, "params"), saved(checkpoints, 3, "params"))
    changed = [not np.array_equal(x, y) for x, y in pairs]
    assert any(changed)  # step 3 was a good step and trained


def test_unknown_config_keys_are_one_message_with_the_nearest_names(tmp_path):
    result = run_train(
        f"--config.results_dir={tmp_path}",
        "--config.lr_schedular=cosine",
        "--config.nonexistent_key=1",
        "--config.data.image_transform.max_sise=3",
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        "train.py: unknown config keys for configs/smoke.py:",
        "  --config.lr_schedular: no such key; did you mean lr_scheduler?",
        "  --config.nonexistent_key: no such key; nothing similar (configs/common.py lists every "
        "key)",
        "  --config.data.image_transform.max_sise: no such key; did you mean "
        "data.image_transform.max_size, data.image_transform.max_pixels, "
        "data.image_transform.min_size?",
    ]
    assert not (tmp_path / "checkpoints").exists()
    missing = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/nope.py"],
        cwd=ROOT,
        env=subprocess_env(1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert missing.returncode == 2
    assert missing.stderr == "train.py: --config configs/nope.py: no such file\n"


def test_no_config_is_one_message_and_help_still_prints():
    def train(*args):
        return run_python("train.py", *args, timeout=300)

    missing = train()
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr == (
        "train.py: --config is required: python train.py --config configs/<name>.py\n"
    )
    helped = train("--help")
    # absl prints the usage (the docstring) and exits 1, as after any --help.
    assert "Visual-OPSD training" in helped.stdout and "Traceback" not in helped.stderr


def test_bad_values_are_all_named_before_any_compute(tmp_path):
    result = run_train(
        f"--config.results_dir={tmp_path}",
        "--config.teacher_mode=mentor",
        "--config.jsd_beta=2.0",
        "--config.model_path=/nonexistent",
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        "train.py: bad training config:",
        "  teacher_mode='mentor': allowed values are 'self', 'ema', 'fixed', 'checkpoint'",
        "  jsd_beta=2.0: must be a number in [0, 1]",
        "  model_path='/nonexistent': not a directory",
    ]
    assert "mesh" not in result.stdout  # stopped before building anything


def _valid_config(tmp_path):
    config = smoke.get_config()
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
            "teacher_mode='mentor': allowed values are 'self', 'ema', 'fixed', 'checkpoint'",
        ),
        ("jsd_beta", 1.5, "jsd_beta=1.5: must be a number in [0, 1]"),
        ("jsd_top_k", -3, "jsd_top_k=-3: must be >= 0"),
        ("jsd_loss_kind", "kl", "jsd_loss_kind='kl': allowed values are 'jsd', 'tinker'"),
        ("lr_scheduler", "step", "lr_scheduler='step'"),
        ("num_replicate", 3, "does not match the 1 devices"),
        ("rows_per_micro_batch", 3, "rows_per_micro_batch=3 exceeds samples_per_micro_batch=2"),
        ("model_path", "/nonexistent/model", "model_path='/nonexistent/model': not a directory"),
        ("compute_dtype", "fp8", "compute_dtype='fp8'"),
        (
            "sampler_layout",
            "fsdp",
            "sampler_layout='fsdp': allowed values are 'replicated', 'tensor'",
        ),
        ("sample_prompt_buckets", (512, 256), "sample_prompt_buckets=(512, 256): must be"),
        ("sample_prompt_buckets", (), "sample_prompt_buckets=(): must be"),
        ("rollout_lookahead", 5, "rollout_lookahead=5: must be an integer in 0..4"),
        ("rollout_prefill_rows", -2, "rollout_prefill_rows=-2: must be an integer >= 0"),
        ("mode", "sft", "rollout_lookahead=1 with mode='sft': only an OPSD run samples"),
        ("jsd_weight", -1.0, "jsd_weight=-1.0: must be >= 0"),
        ("ce_weight", -0.5, "ce_weight=-0.5: must be >= 0"),
        ("min_lr", 1e-3, "min_lr=0.001 exceeds lr=0.0001: the cosine 'decay' would raise"),
        ("results_dir", "", "results_dir is empty"),
        ("pack_row_tokens", 256, "pack_row_tokens=256 < pack_student_row_tokens=512"),
        ("pack_row_patches", 64, "pack_row_patches=64 < pack_student_row_patches=128"),
    ],
)
def test_bad_configs_are_named(tmp_path, key, value, message):
    config = _valid_config(tmp_path)
    if key == "mode":  # a lookahead, valid for OPSD, named when the mode samples nothing
        with config.unlocked():
            config.rollout_lookahead = 1
            config.teacher_mode = "self"
    run_config.validate(config, num_devices=1)  # the base is valid
    with config.unlocked():
        config[key] = value
    with pytest.raises(ValueError) as error:
        run_config.validate(config, num_devices=1)
    assert message in str(error.value)


def test_a_loss_with_nothing_to_learn_from_is_refused(tmp_path):
    config = _valid_config(tmp_path)
    with config.unlocked():
        config.jsd_weight, config.ce_weight = 0.0, 1.0
    run_config.validate(config, num_devices=1)  # CE alone still trains
    with config.unlocked():
        config.ce_weight = 0.0
    with pytest.raises(ValueError, match="jsd_weight=0 and ce_weight=0 with mode='opsd': the"):
        run_config.validate(config, num_devices=1)


def test_the_data_sections_values_are_named_before_anything_reads_them(tmp_path):
    """What the data pipeline would refuse once the run reads its data (after the lock, the
    toy data, the model load), refused with the other values, each under its data.* key; the
    image size against the ViT grid of model_path's own vit_config.json."""
    base = _valid_config(tmp_path)

    def problems(change):
        config = copy.deepcopy(base)
        with config.unlocked():
            change(config)
        with pytest.raises(ValueError) as error:
            run_config.validate(config, num_devices=1)
        return str(error.value)

    def heldout(c):
        c.data.heldout_fraction = 1.5

    def stride(c):
        c.data.image_transform.stride = 15

    def fraction_of_rows(c):
        c.data.datasets = [dict(c.data.datasets[0], num_used_data=2e3)]

    assert "data.heldout_fraction must be in [0, 1), got 1.5" in problems(heldout)
    assert "data.image_transform.stride=15 is not a multiple" in problems(stride)
    assert "num_used_data=2000.0: must be an integer" in problems(fraction_of_rows)

    # smoke's 112-px images are 8 patches a side; a checkpoint whose ViT grid is 6 cannot take them.
    model = write_toy_model(
        tmp_path / "model", config=BagelConfig.tiny(vit=dict(image_size=14 * 6)), weights=False
    )

    def small_grid(c):
        c.model_path = str(model)

    assert (
        "max_size=112 px allows 8 patches of 14 px per side, more than the model's ViT "
        "position grid of 6" in problems(small_grid)
    )


def test_mesh_and_process_settings_that_cannot_work_are_named(tmp_path):
    """num_tensor must divide every head count (the heads are sharded over it), stay inside a
    host, and a process id must be below the process count."""
    assert checks.tensor_problems(smoke.get_config(), BagelConfig.bagel_7b()) == []
    config = _valid_config(tmp_path)
    with config.unlocked():
        config.num_tensor = 8
    (problem,) = checks.tensor_problems(config, BagelConfig.bagel_7b())
    assert problem.startswith(
        "num_tensor=8 does not divide the LLM's query heads (28), the LLM's key / value heads (4)"
    )
    with pytest.raises(ValueError, match=r"num_tensor=8 may not span hosts"):
        run_config.validate(config, num_devices=8, num_processes=2)
    with config.unlocked():
        config.num_tensor = 16  # more than the devices: named, not a ZeroDivisionError
    with pytest.raises(ValueError, match=r"does not match the 8 devices"):
        run_config.validate(config, num_devices=8, num_processes=2)
    config = _valid_config(tmp_path)
    with config.unlocked():
        config.distributed, config.num_processes, config.process_id = True, 2, 2
    with pytest.raises(ValueError, match=r"process_id=2 with num_processes=2: process ids run"):
        run_config.validate(config)


def test_dense_attention_is_refused_for_long_rows(tmp_path):
    config = _valid_config(tmp_path)
    with config.unlocked():
        config.attention_backend = "dense"
    run_config.validate(config, num_devices=1)  # the tiny config's rows are short
    with config.unlocked():
        config.pack_row_tokens = 10240
    with pytest.raises(ValueError, match="attention_backend='dense' with 10240-token rows"):
        run_config.validate(config, num_devices=1)


def test_freeze_und_is_accepted_unless_nothing_is_left_to_train(tmp_path):
    config = _valid_config(tmp_path)
    with config.unlocked():
        config.freeze_und = True
    run_config.validate(config, num_devices=1)  # trains lm_head alone
    with config.unlocked():
        config.freeze_llm = True
    with pytest.raises(ValueError, match="freeze_und=True and freeze_llm=True: nothing left"):
        run_config.validate(config, num_devices=1)


@pytest.mark.parametrize("damage", ["corrupt"])  # a missing column: tests/test_data.py
def test_a_broken_data_file_is_one_error_naming_it_before_any_compute(tmp_path, damage):
    """A parquet file that does not open, or one without a required column, stops the run at
    start with one line naming the file (and the column): a whole file is not a bad row."""
    import pyarrow.parquet as pq

    from opsd_jax.toy import data as toy

    toy.write_toy_data(str(tmp_path / "toy" / "data"), seed=0, num_train=16, num_test=4)
    path = tmp_path / "toy" / "data" / "toy_count" / "data" / "train-00000-of-00001.parquet"
    if damage == "corrupt":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # footer lost
    else:
        pq.write_table(pq.read_table(path).drop_columns(["question"]), path)
    result = run_train(f"--config.results_dir={tmp_path}", timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    last = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("train.py: ") and str(path) in last, result.stderr[-2000:]
    assert (
        "not a readable parquet file" if damage == "corrupt" else "no column 'question'"
    ) in last
    assert "Traceback" not in result.stderr and not (tmp_path / "checkpoints").exists()


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory):
    return write_toy_model(tmp_path_factory.mktemp("toy_model") / "model", dtype="fp32")


def damaged_copy(toy_model, tmp_path, damage):
    """A copy of the toy HF directory with one thing wrong, as a user's download can be."""
    from safetensors.numpy import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(toy_model, model)
    weights = model / "ema.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "no_tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
            (model / name).unlink(missing_ok=True)
    else:
        tensors = load_file(str(weights))
        key = "connector.fc1.bias"
        if damage == "missing_tensor":
            del tensors[key]
        else:  # mis-shaped
            tensors[key] = np.zeros(tensors[key].shape[0] + 1, tensors[key].dtype)
        save_file(tensors, str(weights), metadata={"format": "pt"})
    return model


def test_a_truncated_model_file_is_one_error_line(toy_model, tmp_path):
    """train.py and convert_hf.py on an HF directory whose weight file was cut short: one
    `error:` line naming the file, no traceback (nor orbax's at shutdown), nothing written."""
    model = damaged_copy(toy_model, tmp_path, "truncated")
    result = run_train(
        f"--config.results_dir={tmp_path / 'run'}", f"--config.model_path={model}", timeout=300
    )
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"train.py: error: {model}/ema.safetensors" in result.stderr
    assert "truncated" in result.stderr
    convert = subprocess.run(
        [
            sys.executable,
            "scripts/convert_hf.py",
            "hf-to-jax",
            "--hf_dir",
            str(model),
            "--out",
            str(tmp_path / "converted"),
        ],
        cwd=ROOT,
        env=subprocess_env(1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert convert.returncode == 1 and "Traceback" not in convert.stderr, convert.stderr[-3000:]
    assert f"error: {model}/ema.safetensors" in convert.stderr
    assert not (tmp_path / "converted").exists()


@pytest.mark.parametrize(
    "damage,message",
    [
        ("no_tokenizer", "no tokenizer files"),
        ("missing_tensor", "connector.fc1.bias"),
        ("misshaped_tensor", "connector.fc1.bias"),
    ],
)
def test_other_broken_model_directories_raise_what_train_prints_as_one_line(
    toy_model, tmp_path, damage, message
):
    """The loader's error for each damage is one of the errors train.py and convert_hf.py print
    as one line (the truncated case above runs them end to end), and names the directory."""
    import train
    from opsd_jax.io.hf_load import load_hf
    from scripts import convert_hf

    model = damaged_copy(toy_model, tmp_path, damage)
    with pytest.raises(Exception) as caught:
        load_hf(str(model))
    assert isinstance(caught.value, train.USER_ERRORS)
    assert isinstance(caught.value, convert_hf.USER_ERRORS)
    assert str(model) in str(caught.value) and message in str(caught.value)


def test_an_unwritable_results_dir_and_a_broken_config_file_are_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    result = run_train(f"--config.results_dir={blocker / 'run'}", timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"cannot create the run directory {blocker / 'run'}" in result.stderr
    config = tmp_path / "broken.py"
    config.write_text(
        "from configs import smoke\n\ndef get_config()\n    return smoke.get_config()\n"
    )
    result = subprocess.run(
        [sys.executable, "train.py", "--config", str(config)],
        cwd=ROOT,
        env=subprocess_env(1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip() == f"train.py: --config {config}:3: expected ':'"


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_during_the_first_compile_is_one_line_and_exit_130(tmp_path, signal_number):
    # SIGTERM (a preemption) there as Ctrl-C: without a handler Python would end the process at
    # once, without a line, and leave the run lock behind for the rescheduled job to trip on.
    # The compilation cache off: the train step's compile (seconds) is the window the signal
    # must land in, not the fraction of a second a cached read takes. And SIGINT back to its
    # default in the child: a test run started in the background by a shell inherits SIGINT
    # ignored, Python then installs no KeyboardInterrupt for it, and the run trains to its end.
    process = subprocess.Popen(
        train_command(f"--config.results_dir={tmp_path}", "--config.compilation_cache_dir=off"),
        cwd=ROOT,
        env=dict(subprocess_env(1), PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    for line in process.stdout:
        if line.startswith("model "):  # loaded: the train step's compile comes next
            process.send_signal(signal_number)
            break
    out, err = process.communicate(timeout=300)
    assert process.returncode == 130, out[-2000:] + err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("train.py: interrupted")
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
    assert not (tmp_path / "run.lock").exists()  # released: the same command starts again


def test_missing_dataset_and_mesh_divisibility_are_named(tmp_path):
    config = _valid_config(tmp_path)
    with config.unlocked():
        config.data.datasets = [dict(name="gone", path=str(tmp_path / "gone"))]
    with pytest.raises(ValueError, match=r"data.datasets\[0\] \(gone\): path .* does not exist"):
        run_config.validate(config, num_devices=1)
    config = _valid_config(tmp_path)
    with config.unlocked():
        config.samples_per_micro_batch = 8
        config.rows_per_micro_batch = 4
    with pytest.raises(ValueError, match="must be a multiple of data x fsdp = 8"):
        run_config.validate(config, num_devices=8)
    # Several processes: each feeds an equal share of every micro-batch.
    config = _valid_config(tmp_path)
    with config.unlocked():
        config.samples_per_micro_batch = 6
        config.rows_per_micro_batch = 6
        config.num_replicate = 3
        config.num_shard = 2
    run_config.validate(config, num_devices=6, num_processes=3)
    with pytest.raises(ValueError, match="samples_per_micro_batch=6 must be a multiple of the 4 "):
        run_config.validate(config, num_devices=6, num_processes=4)
    assert isinstance(config, ml_collections.ConfigDict)


def test_shipped_configs_load_and_the_paper_recipe_is_exact(tmp_path):
    from configs import sanity, thinkmorph_7b

    paper = thinkmorph_7b.get_config()
    # docs/opsd_loss.md §b.1 (Visual-OPSD paper, Appendix C).
    expected = dict(
        teacher_mode="ema",
        ema_decay=0.995,
        jsd_beta=0.5,
        jsd_temperature=1.0,
        jsd_top_k=256,
        jsd_token_clip=0.05,
        ce_weight=0.0,
        jsd_weight=1.0,
        sample_max_new_tokens=1024,
        sample_max_image_skips=1,
        max_forward_tokens=10240,
        lr=1e-5,
        min_lr=1e-7,
        warmup_steps=200,
        lr_scheduler="cosine",
        beta1=0.9,
        beta2=0.95,
        eps=1e-15,
        max_grad_norm=1.0,
        gradient_accumulation_steps=2,
        total_steps=1000,
        save_every=500,
    )
    assert {k: paper[k] for k in expected} == expected
    assert [(d["name"], d["num_used_data"]) for d in paper.data.datasets] == [
        ("Visual_Search", 6990),
        ("Spatial_Navigation", 6000),
        ("Jigsaw_Assembly", 6000),
        ("Chart_Refocus", 6000),
    ]
    assert dict(paper.data.image_transform) == dict(
        max_size=980, min_size=378, stride=14, max_pixels=2_007_040
    )
    with paper.unlocked():
        paper.model_path = str(tmp_path)
        paper.data_root = str(tmp_path)
    for spec in paper.data.datasets:
        (tmp_path / spec["name"]).mkdir()
    run_config.resolve_paths(paper)
    run_config.validate(paper, num_devices=8)
    run_config.validate(sanity.get_config(), num_devices=1)
