"""bench/gpu_check.py's `train` section: train.py itself on one GPU, as a user runs it.

1. A BAGEL-HF-layout model of the 7B width with `--train-layers` LM layers (random weights,
   written by the project's model maker, opsd_jax/toy/model.py) on the toy data: train.py runs
   TRAIN_STEPS steps saving at the last, then a second launch resumes and runs one more; once
   full fine-tuning, once LoRA (rank LORA_RANK). A row each: it fails on a non-zero exit, a
   missing resume or a non-finite loss, and shows the resumed step's time split into sample /
   step / pack (train.py's metrics.jsonl).
2. On an H200 (and in a dry run, with the tiny model): the real 28-layer 7B shapes with LoRA,
   the one-GPU recipe's (configs/thinkmorph_7b_1gpu.py) pack rows, micro-batches, 1024 new
   tokens and LoRA settings, random weights made in memory (`weights='random'`: nothing written
   but the configs and tokenizer), for RECIPE_STEPS steps; the measured step time and the
   allocator's peak next to what the preflight (`train.py --compile_only`) compiled for the same
   run, and what bench/scale.py projects for it (printed by `bench/scale.py --config
   configs/thinkmorph_7b_1gpu.py --devices 1`, not run here: minutes of compiles). The toy
   prompts are short: the prefill is not the recipe's, its decode of 1024 tokens is (a random
   model rarely stops).

Each train.py runs as its own process: its memory, its compiles (the persistent compilation
cache, on by default, serves the resumed launch), its output.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The first launch runs TRAIN_STEPS (saving at its last), the resumed one RESUMED_STEPS more. A
# launch's first step compiles (or reads from the cache) the sampler and its last is logged
# without phase times, so the step reported is the resumed launch's second.
TRAIN_STEPS = 2
RESUMED_STEPS = 3
LORA_RANK = 16
RECIPE_STEPS = 3  # the step reported: the second
RECIPE = "configs/thinkmorph_7b_1gpu.py"


def _train(args: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, env=env
    )
    return done, time.perf_counter() - t0


def _why(done: subprocess.CompletedProcess) -> str:
    from gpu_check import failure_line

    return failure_line(done.stderr or done.stdout)[:160]


def _logged(results_dir: str) -> list[dict]:
    path = os.path.join(results_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _split(rows: list[dict], step: int) -> str:
    """Step `step`'s time, split into its phases."""
    row = next((r for r in rows if r.get("step") == step and "time/step_sec" in r), None)
    if row is None:
        return f"step {step} was logged without phase times"
    parts = {name: row.get(f"time/{name}_sec", 0.0) for name in ("sample", "step", "pack")}
    total = sum(parts.values())
    return f"{total:.2f} s = " + " + ".join(f"{name} {s:.2f}" for name, s in parts.items())


def _memory_line(stdout: str) -> str | None:
    found = re.search(r"device memory: peak ([\d.]+) GiB", stdout)
    return found.group(1) if found else None


def few_layers(args, emit, workdir: str, env: dict) -> None:
    from models.configs import BagelConfig
    from opsd_jax.toy.model import write_toy_model

    if args.dry_run:
        config, layers = BagelConfig.tiny(), "tiny"
    else:
        config = BagelConfig.bagel_7b(llm=dict(num_hidden_layers=args.train_layers))
        layers = f"{args.train_layers} x 7B-width layers"
    model_dir = write_toy_model(os.path.join(workdir, "model"), config=config, dtype="bf16")
    common = [
        "--config",
        "configs/smoke.py",
        f"--config.model_path={model_dir}",
        "--config.progress_bar=False",
        "--config.log_every=1",
        f"--config.save_every={TRAIN_STEPS}",
        "--config.eval_every=0",
    ]
    if not args.dry_run:  # the GPU's choices, not the CPU's of configs/smoke.py
        common += [
            "--config.compute_dtype=bfloat16",
            "--config.remat=full",
            "--config.unroll_layers=False",
            "--config.attention_block=512",
        ]
    cases = [
        ("full", []),
        ("LoRA", [f"--config.lora_rank={LORA_RANK}", f"--config.lora_alpha={LORA_RANK}"]),
    ]
    if args.dry_run:
        # On a CPU the full-rank launch, save and resume are tests/test_train_cli.py's; the dry
        # run keeps the LoRA case, the one this section adds to them.
        emit(
            section="train",
            case="full: tiny (dry run)",
            value="not run: dry run",
            unit="full fine-tuning's launch, save and resume run in tests/test_train_cli.py",
            ok=True,
            kind="not run",
        )
        cases = cases[1:]
    for name, extra in cases:
        results = os.path.join(workdir, name)
        run_args = [*common, *extra, f"--config.results_dir={results}"]
        first, seconds = _train([*run_args, f"--config.total_steps={TRAIN_STEPS}"], env)
        resumed = second_seconds = None
        if first.returncode == 0:
            resumed, second_seconds = _train(
                [*run_args, f"--config.total_steps={TRAIN_STEPS + RESUMED_STEPS}"], env
            )
        rows = _logged(results)
        losses = [row.get("loss") for row in rows]
        problem = None
        if first.returncode:
            problem = f"first launch exit {first.returncode}: {_why(first)}"
        elif resumed.returncode:
            problem = f"resumed launch exit {resumed.returncode}: {_why(resumed)}"
        elif f"at step {TRAIN_STEPS}" not in resumed.stdout:
            problem = "the second launch did not resume from the saved step"
        elif len(rows) < TRAIN_STEPS + RESUMED_STEPS or not all(
            isinstance(x, float) and math.isfinite(x) for x in losses
        ):
            problem = f"losses logged: {losses}"
        emit(
            section="train",
            case=f"{name}: {layers}, {TRAIN_STEPS} steps + save + resume + {RESUMED_STEPS}",
            value=problem or f"step {_split(rows, TRAIN_STEPS + 2)}",
            unit=(
                "FAILED"
                if problem
                else f"step {TRAIN_STEPS + 2} (resumed); launches {seconds:.0f} s + "
                f"{second_seconds:.0f} s"
            ),
            ok=problem is None,
            kind="check",
        )


def recipe_shapes(args) -> list[str]:
    """The one-GPU recipe's pack rows, micro-batches, sampling and LoRA, as overrides of
    configs/smoke.py (its toy data: no ThinkMorph files are needed)."""
    from opsd_jax import run_config
    from opsd_jax.data import pack_shapes

    recipe = run_config.load_config_file(RECIPE)
    if args.dry_run:  # the same settings at the tiny model's sizes
        return [
            f"--config.lora_rank={recipe.lora_rank}",
            f"--config.lora_alpha={recipe.lora_alpha}",
            "--config.samples_per_micro_batch=1",
            "--config.rows_per_micro_batch=1",
            "--config.gradient_accumulation_steps=4",
        ]
    shapes = pack_shapes.pack_shapes(recipe)
    student, teacher = shapes["student"][-1], shapes["teacher"][-1]
    keys = {
        "pack_row_tokens": teacher.row_length,
        "pack_row_patches": teacher.patches,
        "pack_student_row_tokens": student.row_length,
        "pack_student_row_patches": student.patches,
        "pack_loss_entries": teacher.loss_entries,
        "max_forward_tokens": recipe.max_forward_tokens,
        "sample_max_new_tokens": recipe.sample_max_new_tokens,
        "samples_per_micro_batch": recipe.samples_per_micro_batch,
        "rows_per_micro_batch": recipe.rows_per_micro_batch,
        "gradient_accumulation_steps": recipe.gradient_accumulation_steps,
        "lora_rank": recipe.lora_rank,
        "lora_alpha": recipe.lora_alpha,
        "lr": recipe.lr,
        "jsd_top_k": recipe.jsd_top_k,
        "ema_decay": recipe.ema_decay,
        "compute_dtype": recipe.compute_dtype,
        "remat": recipe.remat,
        "unroll_layers": False,
        "attention_block": recipe.attention_block,
    }
    return [f"--config.{key}={value}" for key, value in keys.items()]


def recipe_at_7b(args, emit, workdir: str, env: dict, target: str) -> None:
    from models.configs import BagelConfig
    from opsd_jax.toy.model import write_toy_model

    config = BagelConfig.tiny() if args.dry_run else BagelConfig.bagel_7b()
    model_dir = write_toy_model(os.path.join(workdir, "model_28"), config=config, weights=False)
    results = os.path.join(workdir, "recipe")
    run_args = [
        "--config",
        "configs/smoke.py",
        f"--config.model_path={model_dir}",
        "--config.weights=random",
        "--config.progress_bar=False",
        "--config.log_every=1",
        "--config.eval_every=0",
        f"--config.save_every={10 * RECIPE_STEPS}",  # the run's final save only
        f"--config.total_steps={RECIPE_STEPS}",
        f"--config.results_dir={results}",
        *recipe_shapes(args),
    ]
    preflight, _ = _train([*run_args, f"--compile_only={target}:1"], env)
    predicted = re.search(r"largest: (.*), ([\d.]+) GiB of", preflight.stdout)
    done, seconds = _train(run_args, env)
    rows = _logged(results)
    measured = _memory_line(done.stdout)
    problem = None
    if done.returncode:
        problem = f"exit {done.returncode}: {_why(done)}"
    elif len(rows) < RECIPE_STEPS or not all(math.isfinite(r.get("loss", math.nan)) for r in rows):
        problem = f"losses logged: {[r.get('loss') for r in rows]}"
    where = "tiny (dry run)" if args.dry_run else "28 x 7B layers, random weights in memory"
    emit(
        section="train",
        case=f"one-GPU LoRA recipe: {where}, {RECIPE_STEPS} steps",
        value=problem or f"step {_split(rows, 2)}",
        unit="FAILED" if problem else f"step 2; launch {seconds:.0f} s",
        ok=problem is None,
        kind="check",
    )
    emit(
        section="memory",
        case="one-GPU LoRA recipe",
        value=(
            f"measured {measured or 'n/a'} GiB / preflight "
            + (f"{predicted.group(2)} GiB ({predicted.group(1)})" if predicted else "failed")
        ),
        unit="allocator peak / the preflight's largest program for this run",
        ok=preflight.returncode in (0, 1) and predicted is not None,
    )


def section_train(args, emit, target: str) -> None:
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the allocator peak is the run's
    if args.dry_run:
        env["JAX_PLATFORMS"] = "cpu"
    with tempfile.TemporaryDirectory(prefix="gpu_check_train_") as workdir:
        few_layers(args, emit, workdir, env)
        if args.dry_run or target == "h200":
            recipe_at_7b(args, emit, workdir, env, target)
        else:
            emit(
                section="train",
                case="one-GPU LoRA recipe at 28 x 7B layers",
                value=f"not run: {target.upper()}",
                unit="runs on an H200 (141 GB: the recipe with room to measure)",
                ok=True,
                kind="not run",
            )
