"""Make the stage-1 toy checkpoint the tiny default starts from (opsd_jax/toy/stage1/).

    python scripts/make_toy_stage1.py [--seed 0] [--work results/toy_stage1]
        [--out opsd_jax/toy/stage1] [--steps N] [--eval_samples N]

`--steps` and `--eval_samples` (default: configs/toy_sft.py's total_steps and 128) make a
smaller model for a quick check of the script itself; the shipped model uses the defaults.

Visual-OPSD needs a model that already answers better with the visual thought (VT) than
without: a random model has nothing to distil. This is that model for the toy task
`toy_majority`, made the way scripts/toy_experiment.py makes its stage 1:

1. `train.py --config configs/toy_sft.py` (SFT from a random toy BAGEL, three quarters of the
   samples with the VT image in context) into `--work`, with a held-out evaluation of the last
   step in both contexts;
2. the last step exported to the BAGEL HF layout of the toy model it started from (bf16
   `ema.safetensors`, tokenizer, configs) in `--out`, written to a temporary folder and renamed;
3. `MANIFEST.json` next to it: this command, the commit it ran on, the sha256 of every file,
   and the stage-1 held-out accuracies (the fp32 checkpoint before the bf16 export).

configs/tiny.py loads the result as its `model_path`; tests/test_tiny_demo.py checks the files
against the manifest, so a changed checkpoint without a new manifest fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_OUT = os.path.join(ROOT, "opsd_jax", "toy", "stage1")
MANIFEST = "MANIFEST.json"
EVAL_SAMPLES = 128  # held-out samples of the stage-1 evaluation (as in configs/tiny.py)


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_hashes(directory: str) -> dict[str, str]:
    """{file name: sha256} of every file in `directory` but the manifest."""
    return {
        name: sha256_of(os.path.join(directory, name))
        for name in sorted(os.listdir(directory))
        if name != MANIFEST
    }


def read_manifest(directory: str) -> dict:
    with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
        return json.load(f)


def git_commit() -> str:
    """HEAD, with '+changes' when the work tree differs from it (the manifest says so)."""

    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout

    commit = git("rev-parse", "HEAD").strip() or "unknown"
    return commit + (
        "+changes" if git("status", "--porcelain", "--untracked-files=no").strip() else ""
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="global_seed of the SFT run (and data)")
    parser.add_argument(
        "--work",
        default=os.path.join(ROOT, "results", "toy_stage1"),
        help="the SFT run's results_dir (kept)",
    )
    parser.add_argument("--out", default=DEFAULT_OUT, help="the HF directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument(
        "--steps", type=int, default=None, help="SFT steps (default: configs/toy_sft.py's)"
    )
    parser.add_argument(
        "--eval_samples", type=int, default=EVAL_SAMPLES, help="held-out samples per context"
    )
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")
    if args.eval_samples < 1:
        raise SystemExit(f"--eval_samples must be >= 1, got {args.eval_samples}")
    out, work = os.path.abspath(args.out), os.path.abspath(args.work)
    if os.path.exists(out) and not args.overwrite:
        raise SystemExit(f"{out} exists; pass --overwrite to replace it")
    if os.path.exists(work):
        raise SystemExit(f"{work} exists (an earlier SFT run); remove it or pass another --work")
    start = time.perf_counter()

    # ---- 1. stage 1: SFT, then the held-out evaluation of its last step ----------------------
    from configs import toy_sft

    default_steps = toy_sft.get_config().total_steps
    steps = args.steps or default_steps
    command = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        "--config",
        os.path.join(ROOT, "configs", "toy_sft.py"),
        f"--config.results_dir={work}",
        f"--config.global_seed={args.seed}",
        f"--config.total_steps={steps}",
        f"--config.eval_every={steps}",
        "--config.eval_at_start=False",
        "--config.eval_contexts=student,teacher",
        f"--config.eval_samples_per_dataset={args.eval_samples}",
    ]
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").split()  # one CPU device, as a user's laptop
    env["XLA_FLAGS"] = " ".join(
        f for f in flags if not f.startswith("--xla_force_host_platform_device_count")
    )
    print(f"stage 1: SFT, {steps} steps, seed {args.seed}, into {work}", flush=True)
    if subprocess.run(command, cwd=ROOT, env=env, check=False).returncode != 0:
        raise SystemExit("train.py configs/toy_sft.py failed (its output is above)")
    accuracy = {}
    for context in ("student", "teacher"):
        with open(os.path.join(work, "eval", f"step{steps}_{context}_summary.json")) as f:
            accuracy[context] = json.load(f)["overall"]

    # ---- 2. export to the toy model's HF layout ------------------------------------------------
    from opsd_jax.io import hf_export

    source = os.path.join(work, "toy", "model")
    step_dir = os.path.join(work, "checkpoints", str(steps))
    params = hf_export.restore_for_export(step_dir, source)
    partial = out + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    hf_export.save_hf(params, partial, source)

    # ---- 3. the manifest: how it was made and what it holds ------------------------------------
    manifest = {
        "what": "stage-1 toy BAGEL for configs/tiny.py: SFT on toy_majority from random init",
        "command": f"python scripts/make_toy_stage1.py --seed {args.seed}"
        + (f" --steps {steps}" if steps != default_steps else "")
        + (f" --eval_samples {args.eval_samples}" if args.eval_samples != EVAL_SAMPLES else ""),
        "commit": git_commit(),
        "sft_config": "configs/toy_sft.py",
        "seed": args.seed,
        "steps": steps,
        "heldout_accuracy_fp32_checkpoint": {
            "student_context_no_vt": accuracy["student"]["accuracy"],
            "teacher_context_with_vt": accuracy["teacher"]["accuracy"],
            "num_samples": accuracy["student"]["num_samples"],
            "data_seed": args.seed,
        },
        "sha256": file_hashes(partial),
    }
    with open(os.path.join(partial, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    if os.path.exists(out):
        shutil.rmtree(out)
    os.rename(partial, out)
    print(
        f"wrote {out} in {time.perf_counter() - start:.0f} s: held-out accuracy without VT "
        f"{accuracy['student']['accuracy']:.1%}, with VT {accuracy['teacher']['accuracy']:.1%} "
        f"({accuracy['student']['num_samples']} samples)"
    )
    for name, digest in manifest["sha256"].items():
        print(f"  {digest}  {name}")


if __name__ == "__main__":
    main()
