"""What a session with a GPU runs first: one command, one table, measured on the GPU.

    pip install -r requirements-gpu.txt
    python bench/gpu_check.py                      # on one H100 / H200: at most 10 minutes
    python bench/gpu_check.py --dry-run            # anywhere: every step but the timings

The sections, in the order a short lease should spend its minutes (the figure that matters
most first), each in its own process so that a crash or an out-of-memory costs one line and each
program's peak memory is its own; each is a module of bench/gpu_sections/ whose docstring says
what it measures and when it fails:

  recipe     the one-GPU LoRA recipe's real 28-layer step, 3 steps of train.py (random weights
             in memory): step time split into sample / step / pack beside bench/scale.py's
             projection, the allocator's peak beside the preflight's;
  memory     (with --memory) each program of that recipe in its own process, run once on
             zeros with what the preflight counts beside it: the allocator's peak against the
             preflight's prediction (bench/program_memory.py);
  grad_step  the 7B-width grad step at 1, 2 and 4 LM layers with the ViT: per-layer marginal
             time and MFU as MaxText counts it, the fixed part, the 28-layer extrapolation;
  profile    (with --profile) one grad step traced with command buffers off, reduced to a CSV
             of GPU time by kernel class;
  parity     the range kernel, cuDNN as the ViT's backend and the decode kernel against
             references (the decode kernel twice, bit for bit);
  decode     the decode round at B = 1, 8, 32 against the HBM roofline, the kernel alone;
  attention  the range kernel against cuDNN and the chunked backend at 4k .. 40k tokens;
  train      train.py at a few 7B-width layers, full and LoRA, with a save and a resume;
  tiles      (with --tiles) the range kernel's tiles and stages swept at the recipe's 6144 and
             10240 tokens, the fastest per length marked (not applied).

Each section's rows are appended to `<results-dir>/gpu_check.jsonl` as the section ends (the
device tool's $OUT by default), so nothing measured is lost when the lease ends. `--budget-s`
(BUDGET_S by default) skips a section that its estimate (ESTIMATE_S) says would not finish in
the time left, and stops one that runs past it; the row says so, and the summary counts it as
not run. A dry run charges each section its estimate instead of the CPU's time, so that
`--dry-run --budget-s N` shows which sections a GPU run with that budget would reach, however
slow or loaded the CPU is.

`--dry-run` runs all of it on the CPU with tiny shapes (the Pallas kernels in their interpreter,
programs compiled for the target without running them on it, except the memory rows', which
are lowered for it only, the 'tensor' decode case on four forced CPU devices), so the script is
known to start and to reach its table; no timing it prints means anything, so no timing
threshold is applied (the row says so), but every comparison runs.
The last line counts the checks passed, not run and not applied, and names what failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import time

from gpu_sections import decode, grad_step
from gpu_sections.common import RESULT, failure_line

# In the order they run by default; 'memory' runs after recipe when --memory asks for it,
# 'profile' after grad_step when --profile does, 'tiles' last when --tiles does.
SECTIONS = (
    "recipe",
    "memory",
    "grad_step",
    "profile",
    "parity",
    "decode",
    "attention",
    "train",
    "tiles",
)
OPT_IN = ("memory", "profile", "tiles")
DEFAULT_SECTIONS = tuple(s for s in SECTIONS if s not in OPT_IN)
# The whole run on one GPU, compiles included: a lease's command limit with room to rerun.
BUDGET_S = 10 * 60
# What each section is expected to take on one H100 / H200, compiles included (estimates until
# a GPU run measures them: the results file has each section's seconds). A section whose
# estimate does not fit in the time left is skipped.
ESTIMATE_S = {
    "recipe": 300,
    "memory": 420,  # the preflight, then 6 programs of the 7B recipe, each compiled and run
    "grad_step": 240,
    "profile": 90,
    "parity": 60,
    "decode": 180,  # with the B = 8 round timed twice (its output summed in chunks, then not)
    "attention": 120,
    "train": 240,
    "tiles": 240,
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU, tiny shapes, no meaningful timings: check that it all runs",
    )
    parser.add_argument(
        "--target",
        choices=("h100", "h200", "h800"),
        default=None,
        help="the GPU the predictions are compiled for (default: this GPU's "
        "kind, h100 in a dry run)",
    )
    parser.add_argument(
        "--sweep",
        type=int,
        nargs="+",
        default=list(grad_step.SWEEP),
        help="LM layer counts of the grad step (the fit needs two or more)",
    )
    parser.add_argument(
        "--remats",
        nargs="+",
        default=["full", "minimal_flash"],
        help="the grad step's remat policies: the sweep runs under the first, each other is "
        "timed at the sweep's largest layer count beside it",
    )
    parser.add_argument(
        "--step-flags",
        nargs="+",
        default=["xla", "maxtext"],
        help="the grad step's XLA:GPU option sets (step_compiler_flags): the sweep compiles "
        "with the first, each other is timed at the sweep's largest layer count beside it",
    )
    parser.add_argument(
        "--vit-backends",
        nargs="+",
        default=["auto"],
        help="the ViT's attention backends (vit_attention_backend; 'auto': the LLM's): the "
        "sweep runs the first, each other is timed at the sweep's largest layer count beside "
        "it (e.g. auto cudnn: SigLIP's head dim 72 unpadded)",
    )
    parser.add_argument(
        "--train-layers", type=int, default=2, help="LM layers of the train section's model"
    )
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(DEFAULT_SECTIONS))
    parser.add_argument("--memory", action="store_true", help="add the memory section")
    parser.add_argument("--profile", action="store_true", help="add the profile section")
    parser.add_argument("--tiles", action="store_true", help="add the tiles section")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--decode-batches",
        type=int,
        nargs="+",
        default=list(decode.DECODE_BATCHES),
        help="rows of the one-GPU decode rounds, one process each (B = 8 is the checked one)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="skip a section whose estimate does not fit the time left; stop one past it "
        f"(default: {BUDGET_S} s on a GPU, none in a dry run, which charges each section its "
        "estimate instead of the CPU's time)",
    )
    parser.add_argument(
        "--results-dir",
        default=os.environ.get("OUT") or os.path.join("results", "gpu_check"),
        help="where gpu_check.jsonl (every row, appended as each section ends) and the "
        "profile go (default: $OUT, else results/gpu_check)",
    )
    parser.add_argument("--section", help=argparse.SUPPRESS)  # run one section, print RESULTs
    parser.add_argument("--decode-batch", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--decode-tensor", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.budget_s is None:
        args.budget_s = math.inf if args.dry_run else BUDGET_S
    if args.memory and "memory" not in args.sections:
        at = args.sections.index("recipe") + 1 if "recipe" in args.sections else 0
        args.sections.insert(at, "memory")
    if args.profile and "profile" not in args.sections:
        at = args.sections.index("grad_step") + 1 if "grad_step" in args.sections else 0
        args.sections.insert(at, "profile")
    if args.tiles and "tiles" not in args.sections:
        args.sections.append("tiles")
    return args


def section_command(name, args, *extra) -> list[str]:
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--section",
        name,
        "--sweep",
        *map(str, args.sweep),
        "--remats",
        *args.remats,
        "--step-flags",
        *args.step_flags,
        "--vit-backends",
        *args.vit_backends,
        "--repeats",
        str(args.repeats),
        "--train-layers",
        str(args.train_layers),
        "--results-dir",
        args.results_dir,
        *extra,
    ]
    command += ["--dry-run"] if args.dry_run else []
    command += ["--target", args.target] if args.target else []
    return command


def run_section(name, args, *extra, env, timeout: float) -> list[dict]:
    """One section in a fresh process (environment `env`, stopped after `timeout` seconds);
    its RESULT rows, or one failed row that names why."""
    t0 = time.perf_counter()
    try:
        done = subprocess.run(
            section_command(name, args, *extra),
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
        stdout, code, why = done.stdout, done.returncode, failure_line(done.stderr)
    except subprocess.TimeoutExpired as stopped:
        out = stopped.stdout or b""
        stdout = out.decode() if isinstance(out, bytes) else out
        code, why = "timeout", f"stopped after {timeout:.0f} s: past the budget"
    rows = [
        json.loads(line[len(RESULT) :]) for line in stdout.splitlines() if line.startswith(RESULT)
    ]
    if code:
        rows.append(
            dict(
                section=name,
                case="process",
                value=f"exit {code}",
                unit=why[:160],
                ok=False,
                kind="check",
            )
        )
    for row in rows:
        row.setdefault("seconds", round(time.perf_counter() - t0, 1))
    return rows


def section_runs(name, args, tensor_case: bool) -> list[tuple]:
    """The processes of a section: one, or for decode one per batch (and the 'tensor' case)."""
    if name != "decode":
        return [()]
    runs = [("--decode-batch", str(b)) for b in args.decode_batches]
    if tensor_case:
        batch = str(decode.DECODE_CHECK_BATCH)
        runs.append(("--decode-batch", batch, "--decode-tensor", str(decode.DECODE_TENSOR)))
    return runs


def skipped(name: str, value: str, unit: str) -> dict:
    return dict(section=name, case="section", value=value, unit=unit, ok=True, kind="not run")


def append(path: str, rows: list[dict]) -> None:
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main():
    args = parse_args()
    if args.section:
        importlib.import_module(f"gpu_sections.{args.section}").run(args)
        return
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    # The sections run with the environment as given; this process only asks jax which devices
    # there are, and must not hold (preallocate) GPU memory they need meanwhile.
    child_env = dict(os.environ)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    device = jax.devices()[0]
    header = (
        f"bench/gpu_check.py: jax {jax.__version__} on {device.platform} ({device.device_kind})"
    )
    print(
        header
        + (" -- DRY RUN: tiny shapes on the CPU, timings mean nothing" if args.dry_run else "")
    )
    if not args.dry_run and device.platform != "gpu":
        sys.exit("no GPU here: pip install -r requirements-gpu.txt on a GPU machine, or --dry-run")
    os.makedirs(args.results_dir, exist_ok=True)
    results = os.path.join(args.results_dir, "gpu_check.jsonl")
    append(results, [dict(run=header, time=time.strftime("%Y-%m-%d %H:%M:%S"), args=vars(args))])
    print(f"rows appended to {results} as each section ends")
    gpus = len(jax.devices())
    # A dry run runs the 'tensor' decode case on forced CPU devices, so that its path is known
    # to work before a machine with 4 GPUs does.
    tensor_case = gpus >= decode.DECODE_TENSOR or args.dry_run
    t0 = time.perf_counter()
    spent = 0.0  # the seconds charged against --budget-s so far
    rows = []
    for name in args.sections:
        left = args.budget_s - spent
        env = dict(child_env)
        if name == "profile":  # every kernel its own event, not one CUDA graph launch
            flags = f"{env.get('XLA_FLAGS', '')} --xla_gpu_enable_command_buffer="
            env["XLA_FLAGS"] = flags.strip()
        ran = ESTIMATE_S[name] <= left
        if not ran:
            section_rows = [
                skipped(
                    name,
                    "not run: budget",
                    f"{left:.0f} s of --budget-s left, about {ESTIMATE_S[name]} s needed",
                )
            ]
        else:
            # A dry run's CPU time says nothing of the GPU's: no section is stopped there.
            timeout = max(left, 60) if math.isfinite(left) and not args.dry_run else None
            section_rows = [
                row
                for extra in section_runs(name, args, tensor_case)
                for row in run_section(name, args, *extra, env=env, timeout=timeout)
            ]
        if name == "decode" and not tensor_case:
            section_rows.append(
                dict(
                    section="decode",
                    case=f"B={decode.DECODE_CHECK_BATCH} on 'tensor' x{decode.DECODE_TENSOR}",
                    value=f"not run: {gpus} GPU(s)",
                    unit=f"the 'tensor' decode layout needs {decode.DECODE_TENSOR} GPUs",
                    ok=True,
                    kind="not run",
                )
            )
        if args.dry_run:
            spent += ESTIMATE_S[name] if ran else 0
        else:
            spent = time.perf_counter() - t0
        append(results, section_rows)
        rows += section_rows
        for row in section_rows:
            print(
                f"  {row['section']:<10} {row['case']:<58} {row['value']:<44} "
                f"{'' if row['ok'] else 'FAILED '}{row['unit']}",
                flush=True,
            )
    summary(rows, time.perf_counter() - t0, spent, args)


def summary(rows: list[dict], elapsed: float, spent: float, args) -> None:
    failed = [f"{r['section']}: {r['case']}" for r in rows if not r["ok"]]
    kinds = [r.get("kind", "info") for r in rows if r["ok"]]
    tally = [f"{kinds.count('check')} checks passed"]
    if kinds.count("not applied"):
        tally.append(f"{kinds.count('not applied')} thresholds not applied (dry run)")
    not_run = [f"{r['case']}, {r['value']}" for r in rows if r["ok"] and r.get("kind") == "not run"]
    if not_run:
        tally.append(f"{len(not_run)} not run ({'; '.join(not_run)})")
    tally.append(f"{kinds.count('info')} informative")
    over = f", over the {args.budget_s:.0f}-s budget" if spent > args.budget_s else ""
    print(
        f"\n{len(rows)} rows in {elapsed:.0f} s{over}: {', '.join(tally)}; "
        + (f"FAILED: {'; '.join(failed)}" if failed else "nothing failed")
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
