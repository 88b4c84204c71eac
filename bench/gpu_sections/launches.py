"""train.py launched by bench/gpu_check.py's `recipe` and `train` sections, as a user runs it:
its own process (its memory, its compiles, its output), its metrics.jsonl read back."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from gpu_sections.common import ROOT, failure_line


def train(args: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float]:
    """(the finished `python train.py *args`, its seconds)."""
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, env=env
    )
    return done, time.perf_counter() - t0


def why(done: subprocess.CompletedProcess) -> str:
    return failure_line(done.stderr or done.stdout)[:160]


def logged(results_dir: str) -> list[dict]:
    path = os.path.join(results_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def split(rows: list[dict], step: int) -> str:
    """Step `step`'s time, split into its phases."""
    row = next((r for r in rows if r.get("step") == step and "time/step_sec" in r), None)
    if row is None:
        return f"step {step} was logged without phase times"
    parts = {name: row.get(f"time/{name}_sec", 0.0) for name in ("sample", "step", "pack")}
    total = sum(parts.values())
    return f"{total:.2f} s = " + " + ".join(f"{name} {s:.2f}" for name, s in parts.items())


def mismatch(rows: list[dict]) -> str:
    """The rollout's log-prob gap against the trained policy, the largest over the logged steps
    (train_step.rollout_mismatch): a wrong decode path shows here as a number."""
    gaps = [r["rollout/logprob_gap_max"] for r in rows if "rollout/logprob_gap_max" in r]
    means = [r["rollout/logprob_gap_mean"] for r in rows if "rollout/logprob_gap_mean" in r]
    if not gaps:
        return "rollout gap not logged"
    return f"rollout log-prob gap mean {max(means):.2g}, max {max(gaps):.2g}"


def memory_line(stdout: str) -> str | None:
    found = re.search(r"device memory: peak ([\d.]+) GiB", stdout)
    return found.group(1) if found else None


def launch_env(args) -> dict:
    """The environment of a launch: the allocator grows as asked (its peak is the run's)."""
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.dry_run:
        env["JAX_PLATFORMS"] = "cpu"
    return env
