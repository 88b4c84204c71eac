"""bench/gpu_check.py's `train` section: train.py itself on one GPU, save and resume included.

A BAGEL-HF-layout model of the 7B width with `--train-layers` LM layers (random weights,
written by the project's model maker, opsd_jax/toy/model.py) on the toy data: train.py runs
TRAIN_STEPS steps saving at the last, then a second launch resumes and runs RESUMED_STEPS more;
once full fine-tuning, once LoRA (rank LORA_RANK). A row each: it fails on a non-zero exit, a
missing resume or a non-finite loss, and shows the resumed step's time split into sample / step
/ pack (train.py's metrics.jsonl).
"""

from __future__ import annotations

import math
import os
import tempfile

from gpu_sections.common import emit
from gpu_sections.launches import launch_env, logged, mismatch, split, train, why

# The first launch runs TRAIN_STEPS (saving at its last), the resumed one RESUMED_STEPS more. A
# launch's first step compiles (or reads from the cache) the sampler and its last is logged
# without phase times, so the step reported is the resumed launch's second.
TRAIN_STEPS = 2
RESUMED_STEPS = 3
LORA_RANK = 16


def launches(args, workdir: str, env: dict) -> None:
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
        first, seconds = train([*run_args, f"--config.total_steps={TRAIN_STEPS}"], env)
        resumed = second_seconds = None
        if first.returncode == 0:
            resumed, second_seconds = train(
                [*run_args, f"--config.total_steps={TRAIN_STEPS + RESUMED_STEPS}"], env
            )
        rows = logged(results)
        losses = [row.get("loss") for row in rows]
        problem = None
        if first.returncode:
            problem = f"first launch exit {first.returncode}: {why(first)}"
        elif resumed.returncode:
            problem = f"resumed launch exit {resumed.returncode}: {why(resumed)}"
        elif f"at step {TRAIN_STEPS}" not in resumed.stdout:
            problem = "the second launch did not resume from the saved step"
        elif len(rows) < TRAIN_STEPS + RESUMED_STEPS or not all(
            isinstance(x, float) and math.isfinite(x) for x in losses
        ):
            problem = f"losses logged: {losses}"
        emit(
            section="train",
            case=f"{name}: {layers}, {TRAIN_STEPS} steps + save + resume + {RESUMED_STEPS}",
            value=problem or f"step {split(rows, TRAIN_STEPS + 2)}; {mismatch(rows)}",
            unit=(
                "FAILED"
                if problem
                else f"step {TRAIN_STEPS + 2} (resumed); launches {seconds:.0f} s + "
                f"{second_seconds:.0f} s"
            ),
            ok=problem is None,
            kind="check",
        )


def run(args):
    with tempfile.TemporaryDirectory(prefix="gpu_check_train_") as workdir:
        launches(args, workdir, launch_env(args))
