"""The toy Visual-OPSD experiment (issue #9), one command: SFT -> Visual-OPSD vs noise-VT control.

    python scripts/toy_experiment.py [--seed 0] [--out results/toy_experiment/seed0] [--quick]
        [--offline]

The claim under test: a model that reasons better when it sees the visual-thought (VT) image
(teacher context) transfers part of that ability to itself without it (student context) by
on-policy self-distillation, and replacing the VT image by noise removes the effect.

1. Stage 1, configs/toy_sft.py: SFT from random init on `toy_majority` (opsd_jax/toy/tasks.py),
   three quarters of the samples with the VT image in context, so the model reads VT images
   well and the bare problem image less well.
2. Stage 2, configs/toy_opsd.py: Visual-OPSD from the stage-1 weights with the EMA teacher
   (arm `opsd`), and the same with the VT pixels replaced by noise (arm `control`).
   With --offline, a third arm: the stage-1 model cached once as teacher
   (scripts/collect_traces.py), then configs/toy_offline.py (CE + KD against the cache).
3. Held-out exact-match accuracy (greedy decoding, the pipeline's `eval` split, which no stage
   trains on) in the student context (no VT) and the teacher context (with VT) after stage 1
   and at every stage-2 checkpoint; the training JSD of both arms from their metrics.jsonl.

Writes under --out: `sft/`, `opsd/`, `control/` (each a train.py results_dir with checkpoints
and metrics.jsonl), `results.json` (every figure), `results.md` (the table) and `results.png`
(accuracy and JSD against steps, both arms). Each stage runs train.py in a subprocess, exactly as
a user would; evaluation runs here with opsd_jax.evaluation.evaluate. `--quick` runs a few steps of each
stage on a small data set (a smoke test of the whole chain, not a measurement). --out records
the mode and seed in `toy_experiment.json`; a run of another mode or seed there is refused, as
it would reuse the data and checkpoints (--quick's default --out is its own, `seed<seed>_quick`).

One script of about 550 lines: the experiment's sequence (stage 1, the runs per seed, the
control, the table) in the order it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time

from opsd_jax.toy import data as toy_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TASK = "toy_majority"
ARMS = ("opsd", "control")  # stage-2 arms; --offline adds "offline"
ARM_NAMES = {
    "opsd": "Visual-OPSD (VT teacher)",
    "control": "control (noise-VT teacher)",
    "offline": "offline Visual-OPSD (cached VT teacher, CE + KD)",
}
# The distillation term each arm logs: the on-policy JSD, or the offline KD against the cache.
DISTILL_METRIC = {"opsd": "jsd", "control": "jsd", "offline": "kd"}

# Stage lengths and evaluation size: (full, quick).
SETTINGS = {
    "full": dict(
        sft_steps=None,
        opsd_steps=None,
        save_every=None,
        num_train=None,
        num_test=None,
        eval_samples=256,
    ),
    "quick": dict(
        sft_steps=3, opsd_steps=2, save_every=2, num_train=48, num_test=16, eval_samples=16
    ),
}


def log(message: str) -> None:
    print(f"[toy_experiment {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ----------------------------------------------------------------------------------------------
# Stages (train.py in a subprocess)
# ----------------------------------------------------------------------------------------------


class TrainRun:
    """train.py (or another script taking a --config, `script`) with `config_file` and overrides
    in a subprocess; its output goes to `log_path`, with its step lines echoed (shortened) as
    progress."""

    def __init__(
        self,
        config_file: str,
        results_dir: str,
        overrides: list[str],
        log_path: str,
        script: str = "train.py",
    ):
        command = [
            sys.executable,
            os.path.join(ROOT, script),
            "--config",
            os.path.join(ROOT, config_file),
            f"--config.results_dir={results_dir}",
            "--config.progress_bar=False",
            *overrides,
        ]
        env = dict(os.environ)
        # One CPU device (the toy runs are single-device); other XLA flags are kept.
        flags = env.get("XLA_FLAGS", "").split()
        env["XLA_FLAGS"] = " ".join(
            f for f in flags if not f.startswith("--xla_force_host_platform_device_count")
        )
        env["PYTHONUNBUFFERED"] = "1"  # progress lines as they happen, not per 4 kB block
        self.name, self.config_file, self.log_path, self.script = (
            os.path.basename(results_dir),
            config_file,
            log_path,
            script,
        )
        self.start = time.perf_counter()
        # Set at the run's first step line (its programs are compiled and in the compilation
        # cache by then) or when its output ends.
        self.first_step = threading.Event()
        self.process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        with open(self.log_path, "w", encoding="utf-8") as out:
            for line in self.process.stdout:
                out.write(line)
                if line.startswith("step "):  # one line per log_every steps
                    self.first_step.set()
                    fields = line.split(" | ")
                    keep = [f for f in fields if f.split(" ")[0] in ("ce", "jsd", "kd", "loss")]
                    log(f"  {self.name}: {fields[0]} | {' | '.join(keep)}")
        self.first_step.set()

    def wait(self) -> None:
        self.process.wait()
        self.pump.join()
        if self.process.returncode != 0:
            with open(self.log_path, encoding="utf-8") as f:
                tail = f.read()[-4000:]
            raise RuntimeError(
                f"{self.script} {self.config_file} failed (exit "
                f"{self.process.returncode}); log {self.log_path}:\n{tail}"
            )
        log(f"  {self.name} done in {time.perf_counter() - self.start:.0f}s")


def link_toy_assets(results_dir: str, toy_dir: str) -> None:
    """Share stage 1's toy data and model with a stage-2 run (train.py reuses what exists)."""
    os.makedirs(results_dir, exist_ok=True)
    link = os.path.join(results_dir, "toy")
    if not os.path.exists(link):
        os.symlink(os.path.relpath(toy_dir, results_dir), link)


# ----------------------------------------------------------------------------------------------
# Evaluation (in this process)
# ----------------------------------------------------------------------------------------------


class Evaluator:
    """Held-out accuracy of checkpoints of one model directory, in the student or teacher context.

    The model and the held-out samples are loaded once; each checkpoint's params are restored
    into the same graph, so the sampler compiles once per context.
    """

    def __init__(self, model_dir: str, run_config: dict, eval_samples: int | None, batch_size=64):
        from flax import nnx

        from opsd_jax import run_config as run_config_lib
        from opsd_jax.evaluation import evaluate as evaluation
        from opsd_jax.io.hf_load import load_hf

        self.evaluation, self.run_config = evaluation, run_config_lib
        # Only the architecture: every accuracy restores a checkpoint's params into it, so the
        # HF weights are never read (the params stay abstract, with their shardings).
        model, _, self.tokenizer = load_hf(
            model_dir, config_changes={"llm": {"compute_dtype": "float32"}}, read_params=False
        )
        self.graphdef, self.abstract, self.rest = nnx.split(model, nnx.Param, ...)
        data_config = run_config_lib.data_config(run_config).for_model(model.config)
        self.samples = evaluation.load_eval_samples(data_config, "eval", log=log)
        if eval_samples:
            self.samples = self.samples[:eval_samples]
        self.batch_size = min(batch_size, len(self.samples))
        self.max_new_tokens = run_config["sample_max_new_tokens"]

    def accuracy(
        self, step_dir: str, run_config: dict, context: str, noise_vt=False, save_as=None
    ) -> float:
        """Held-out accuracy; with `save_as` (a path prefix) also the generations and summary."""
        from flax import nnx

        from opsd_jax.io.saved_items import restore_model_params

        params = restore_model_params(step_dir, self.abstract, which="params")
        model = nnx.merge(self.graphdef, params, self.rest)
        options = self.run_config.prompt_options(run_config, noise_vt=noise_vt)
        result = self.evaluation.evaluate(
            model,
            self.samples,
            self.tokenizer,
            options=options,
            context=context,
            max_new_tokens=self.max_new_tokens,
            do_sample=False,
            batch_size=self.batch_size,
            cache_dtype="float32",
        )
        if save_as:
            self.evaluation.save_results(
                result, os.path.dirname(save_as), os.path.basename(save_as)
            )
        return float(result.summary["overall"]["accuracy"])


def step_dirs(results_dir: str) -> dict[int, str]:
    root = os.path.join(results_dir, "checkpoints")
    steps = sorted(
        int(n)
        for n in os.listdir(root)
        if n.isdigit() and os.path.isfile(os.path.join(root, n, "commit_success.txt"))
    )
    return {step: os.path.join(root, str(step)) for step in steps}


def read_metric(results_dir: str, key: str) -> list[tuple[int, float]]:
    path = os.path.join(results_dir, "metrics.jsonl")
    points = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if key in record:
                points.append((int(record["step"]), float(record[key])))
    return points


def thought_answer_agreement(generations_path: str) -> float:
    """Share of generations whose thought names the colour their <answer> gives (the SFT target
    always agrees; on-policy distillation trains the answer token on its own and may not)."""
    with open(generations_path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    agree = 0
    for record in records:
        thought = re.search(r"Most dots are (\w+)", record["generation"])
        agree += bool(thought) and thought.group(1) == (record["extracted"] or "").strip()
    return agree / max(len(records), 1)


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    sft = results["stage1"]
    quick = ", quick" if results["quick"] else ""
    lines = [
        f"# Toy Visual-OPSD experiment (seed {results['seed']}{quick})",
        "",
        (
            f"Held-out exact-match accuracy on `{TASK}` ({results['num_eval']} samples, greedy). "
            "Student = problem image + question; teacher = plus the VT image."
        ),
        "",
        "| model | student (no VT) | teacher (VT) | teacher (noise VT) | train JSD (KD) first -> last |",
        "|---|---:|---:|---:|---:|",
        (
            f"| stage 1: SFT ({sft['steps']} steps) | {sft['student']:.1%} | "
            f"{sft['teacher']:.1%} | {sft['teacher_noise']:.1%} | - |"
        ),
    ]
    arms = list(results["arms"])
    for arm in arms:
        r = results["arms"][arm]
        jsd = r["jsd"]
        jsd_text = f"{jsd[0][1]:.4f} -> {jsd[-1][1]:.4f}" if jsd else "-"
        name = ARM_NAMES[arm]
        lines.append(
            f"| stage 2: {name}, {r['steps']} steps | {r['student']:.1%} | "
            f"{r['teacher']:.1%} | - | {jsd_text} |"
        )
    lines += [
        "",
        "Student accuracy at each stage-2 checkpoint:",
        "",
        "| step | " + " | ".join(arms) + " |",
        "|---:|" + "---:|" * len(arms),
    ]
    steps = sorted({s for arm in arms for s, _ in results["arms"][arm]["student_curve"]})
    for step in steps:
        cells = []
        for arm in arms:
            curve = dict(results["arms"][arm]["student_curve"])
            cells.append(f"{curve[step]:.1%}" if step in curve else "-")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    agreement = ", ".join(
        f"{arm} {results['arms'][arm]['thought_answer_agreement']:.0%}" for arm in arms
    )
    lines += [
        "",
        f"Final students whose thought names the colour they answer: {agreement}.",
        f"Wall time: {results['wall_seconds']:.0f} s.",
        "",
    ]
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colours = {"opsd": "tab:blue", "control": "tab:red", "offline": "tab:green"}
    labels = {"opsd": "Visual-OPSD", "control": "noise-VT control", "offline": "offline (KD)"}
    for arm in results["arms"]:
        r = results["arms"][arm]
        student = r["student_curve"]
        left.plot(
            [s for s, _ in student],
            [a for _, a in student],
            "o-",
            color=colours[arm],
            label=f"{labels[arm]}: student (no VT)",
        )
        right.plot(
            [s for s, _ in r["jsd"]],
            [v for _, v in r["jsd"]],
            color=colours[arm],
            label=labels[arm],
        )
    sft = results["stage1"]
    left.axhline(sft["teacher"], color="gray", ls="--", label="stage 1: teacher (VT)")
    left.axhline(sft["student"], color="gray", ls=":", label="stage 1: student (no VT)")
    left.set(
        xlabel="stage-2 step",
        ylabel="held-out accuracy",
        ylim=(0, 1.02),
        title="held-out exact match",
    )
    right.set(
        xlabel="stage-2 step", ylabel="train JSD (offline: KD) vs the teacher", title="training JSD"
    )
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.suptitle(f"toy Visual-OPSD, seed {results['seed']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------

# What a run in --out was made with: every stage reuses what --out holds (the data, the
# checkpoints: train.py resumes them), so a run of another mode or seed there would mix the two.
RUN_RECORD = "toy_experiment.json"
STAGE_DIRS = ("sft", *ARMS, "offline")


def run_description(record: dict) -> str:
    return f"a {'--quick' if record.get('quick') else 'full'} run of seed {record.get('seed')}"


def claim_out(out: str, record: dict) -> str | None:
    """Why this run (`record`: its mode's SETTINGS, quick and seed) must not use `out`, or None
    after writing `record` there (its RUN_RECORD) for the runs after it."""
    path = os.path.join(out, RUN_RECORD)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        if saved != record:
            return (
                f"--out {out} holds {run_description(saved)} (its {RUN_RECORD}), this is "
                f"{run_description(record)}: pass the --quick and --seed it was made with, "
                "or another --out"
            )
        return None
    if any(os.path.isdir(os.path.join(out, name)) for name in STAGE_DIRS):
        return (
            f"--out {out} holds a run of unknown mode and seed (no {RUN_RECORD}: an older "
            "version's); give another --out, or remove it"
        )
    os.makedirs(out, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    return None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="global_seed of every stage (and data)")
    parser.add_argument(
        "--out",
        default=None,
        help="default: results/toy_experiment/seed<seed> (with --quick: seed<seed>_quick); "
        "one --out holds one mode and seed",
    )
    parser.add_argument("--quick", action="store_true", help="a few steps of each stage (CI)")
    parser.add_argument(
        "--offline",
        action="store_true",
        help="add the offline arm: cache the stage-1 model as teacher once "
        "(scripts/collect_traces.py), then configs/toy_offline.py",
    )
    args = parser.parse_args(argv)
    stage2_arms = ARMS + (("offline",) if args.offline else ())
    default_name = f"seed{args.seed}" + ("_quick" if args.quick else "")
    out = os.path.abspath(args.out or os.path.join(ROOT, "results", "toy_experiment", default_name))
    mode = SETTINGS["quick" if args.quick else "full"]
    problem = claim_out(out, dict(mode, quick=args.quick, seed=args.seed))
    if problem:
        raise SystemExit(f"error: {problem}")
    start = time.perf_counter()
    seed = [f"--config.global_seed={args.seed}"]

    def steps(key, flag):
        return [f"--config.{flag}={mode[key]}"] if mode[key] else []

    # ---- data: written here so --quick can make a small set; train.py reuses it -------------
    sft_dir = os.path.join(out, "sft")
    toy_dir = os.path.join(sft_dir, "toy")
    data_dir = os.path.join(toy_dir, "data")
    if not os.path.isdir(os.path.join(data_dir, TASK)):
        log(f"writing {TASK} data (seed {args.seed}) to {data_dir}")
        toy_data.write_toy_data(
            data_dir,
            seed=args.seed,
            num_train=mode["num_train"],
            num_test=mode["num_test"],
            tasks=[TASK],
        )

    # ---- stage 1: SFT ---------------------------------------------------------------------------
    log("stage 1: SFT from random init (configs/toy_sft.py)")
    sft_overrides = seed + steps("sft_steps", "total_steps") + steps("sft_steps", "save_every")
    if args.quick:
        sft_overrides += ["--config.log_every=2", "--config.warmup_steps=1"]
    TrainRun("configs/toy_sft.py", sft_dir, sft_overrides, os.path.join(out, "sft.log")).wait()
    sft_steps = step_dirs(sft_dir)
    sft_last = sft_steps[max(sft_steps)]

    # ---- stage 2: Visual-OPSD and the noise-VT control, side by side (independent runs) ---------
    # The arms differ only in data (noise_vt), so they compile the same programs: each on-policy
    # arm starts once the one before it has made its first step, and reads them all from the
    # compilation cache instead of compiling them again at the same time (tests/
    # test_toy_experiment.py's `--quick` run on 2 cores: 82.94 -> 70.24 s of user CPU).
    arm_dirs = {arm: os.path.join(out, arm) for arm in stage2_arms}
    runs = []
    for arm in stage2_arms:
        config_file = "configs/toy_offline.py" if arm == "offline" else "configs/toy_opsd.py"
        log(
            f"stage 2 [{arm}]: {ARM_NAMES[arm]} from stage 1 ({config_file}"
            f"{', noise_vt=True' if arm == 'control' else ''})"
        )
        link_toy_assets(arm_dirs[arm], toy_dir)
        overrides = seed + [f"--config.resume_from={os.path.join(sft_dir, 'checkpoints')}"]
        if arm == "offline":
            # The teacher is the stage-1 model, cached once before the student trains.
            overrides.append(f"--config.offline_cache_dir={os.path.join(arm_dirs[arm], 'cache')}")
            TrainRun(
                config_file,
                arm_dirs[arm],
                overrides,
                os.path.join(out, "collect.log"),
                script="scripts/collect_traces.py",
            ).wait()
        else:
            overrides.append(f"--config.noise_vt={arm == 'control'}")
        overrides += steps("opsd_steps", "total_steps") + steps("save_every", "save_every")
        if args.quick:
            overrides += ["--config.log_every=1", "--config.warmup_steps=1"]
        same_programs = [run for run in runs if run.config_file == config_file]
        if same_programs:
            same_programs[-1].first_step.wait()
        runs.append(
            TrainRun(config_file, arm_dirs[arm], overrides, os.path.join(out, f"{arm}.log"))
        )
    for run in runs:
        run.wait()

    # ---- evaluation ----------------------------------------------------------------------------
    from opsd_jax.io import saved_items

    sft_config = saved_items.saved_config(sft_last)
    evaluator = Evaluator(os.path.join(toy_dir, "model"), sft_config, mode["eval_samples"])
    log(f"evaluating on {len(evaluator.samples)} held-out samples")
    generations = os.path.join(out, "eval")  # per-sample generations of the final models
    stage1 = {
        "steps": max(sft_steps),
        "student": evaluator.accuracy(
            sft_last, sft_config, "student", save_as=os.path.join(generations, "sft_student")
        ),
        "teacher": evaluator.accuracy(
            sft_last, sft_config, "teacher", save_as=os.path.join(generations, "sft_teacher")
        ),
        "teacher_noise": evaluator.accuracy(sft_last, sft_config, "teacher", noise_vt=True),
    }
    log(
        f"stage 1: student {stage1['student']:.1%}, teacher {stage1['teacher']:.1%}, "
        f"teacher with noise VT {stage1['teacher_noise']:.1%}"
    )
    arms = {}
    for arm in stage2_arms:
        checkpoints = step_dirs(arm_dirs[arm])
        config = saved_items.saved_config(checkpoints[max(checkpoints)])
        curve = [(0, stage1["student"])]
        last = checkpoints[max(checkpoints)]
        for step, step_dir in checkpoints.items():
            save_as = os.path.join(generations, f"{arm}_student") if step_dir == last else None
            curve.append((step, evaluator.accuracy(step_dir, config, "student", save_as=save_as)))
            log(f"{arm} step {step}: student {curve[-1][1]:.1%}")
        # The teacher context with the real VT image in both arms: did distillation hurt it?
        teacher = evaluator.accuracy(last, config, "teacher", noise_vt=False)
        arms[arm] = {
            "steps": max(checkpoints),
            "student": curve[-1][1],
            "teacher": teacher,
            "student_curve": curve,
            "jsd": read_metric(arm_dirs[arm], DISTILL_METRIC[arm]),
            "thought_answer_agreement": thought_answer_agreement(
                os.path.join(generations, f"{arm}_student_generations.jsonl")
            ),
        }
        log(f"{arm}: student {curve[-1][1]:.1%}, teacher (VT) {teacher:.1%}")

    results = {
        "seed": args.seed,
        "quick": args.quick,
        "num_eval": len(evaluator.samples),
        "stage1": stage1,
        "arms": arms,
        "wall_seconds": time.perf_counter() - start,
    }
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    table = markdown(results)
    with open(os.path.join(out, "results.md"), "w", encoding="utf-8") as f:
        f.write(table)
    plot(results, os.path.join(out, "results.png"))
    print(table)
    log(f"wrote {out}/results.md, results.png, results.json in {results['wall_seconds']:.0f}s")
    return results


if __name__ == "__main__":
    main()
