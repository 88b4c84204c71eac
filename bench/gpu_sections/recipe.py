"""bench/gpu_check.py's `recipe` section, the first it runs: the one-GPU LoRA recipe's real step.

The real 28-layer BAGEL-7B shapes with LoRA, configs/thinkmorph_7b_1gpu.py's pack rows,
micro-batches, 1024 new tokens and LoRA settings, random weights made in memory
(`weights='random'`: nothing written but the configs and the tokenizer), on the toy data, for
RECIPE_STEPS steps of train.py. Rows: the measured step time split into sample / step / pack,
beside what bench/scale.py projects for it (SCALE_STEP_S); the allocator's peak beside the
preflight's (`train.py --compile_only`, compiled for the same run) largest program. The toy
prompts are short: the prefill is not the recipe's, its decode of 1024 tokens is (a random model
rarely stops). The dry run does the same at the tiny model's sizes.
"""

from __future__ import annotations

import math
import os
import re
import tempfile

from gpu_sections.common import emit, target_name
from gpu_sections.launches import launch_env, logged, memory_line, mismatch, split, train, why

RECIPE_STEPS = 3  # the step reported: the second
RECIPE = "configs/thinkmorph_7b_1gpu.py"
# What bench/scale.py projects for this recipe's step on one H100: `bench/scale.py --target h100
# --devices 1 --config configs/thinkmorph_7b_1gpu.py`, 2026-12-06 (docs/performance.md: a run's
# packs and 'auto' decode, the cache read in place), at its assumed MFU: the figure the measured
# step is read against.
SCALE_STEP_S = 25.28


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


def recipe_at_7b(args, workdir: str, env: dict, target: str) -> None:
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
    preflight, _ = train([*run_args, f"--compile_only={target}:1"], env)
    predicted = re.search(r"largest: (.*), ([\d.]+) GiB of", preflight.stdout)
    done, seconds = train(run_args, env)
    rows = logged(results)
    measured = memory_line(done.stdout)
    problem = None
    if done.returncode:
        problem = f"exit {done.returncode}: {why(done)}"
    elif len(rows) < RECIPE_STEPS or not all(math.isfinite(r.get("loss", math.nan)) for r in rows):
        problem = f"losses logged: {[r.get('loss') for r in rows]}"
    where = "tiny (dry run)" if args.dry_run else "28 x 7B layers, random weights in memory"
    emit(
        section="recipe",
        case=f"one-GPU LoRA recipe: {where}, {RECIPE_STEPS} steps",
        value=problem or f"step {split(rows, 2)}; {mismatch(rows)}",
        unit="FAILED"
        if problem
        else f"step 2; launch {seconds:.0f} s; bench/scale.py projects {SCALE_STEP_S} s a step "
        "on one H100",
        ok=problem is None,
        kind="check",
    )
    emit(
        section="recipe",
        case="one-GPU LoRA recipe, memory",
        value=(
            f"measured {measured or 'n/a'} GiB / preflight "
            + (f"{predicted.group(2)} GiB ({predicted.group(1)})" if predicted else "failed")
        ),
        unit="allocator peak / the preflight's largest program for this run",
        ok=preflight.returncode in (0, 1) and predicted is not None,
    )


def run(args):
    with tempfile.TemporaryDirectory(prefix="gpu_check_recipe_") as workdir:
        recipe_at_7b(args, workdir, launch_env(args), target_name(args))
