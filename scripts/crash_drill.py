"""Crash drill: kill train.py with SIGKILL at random moments, resume each time, compare.

What: runs the tiny config once without interruption, then runs it again but kills the process
(SIGKILL: no handler, no cleanup — a machine or OOM kill) `--kills` times at random moments
(some of them while a checkpoint is being written, by killing right after a step's console line
when every step is saved), restarting with `auto_resume` after each kill, and finally checks that
the last checkpoint's params are bit-identical to the uninterrupted run's.

Why: a half-written checkpoint must never be restored and a resumed run must continue exactly;
this shows it end to end. It restarts the trainer several times (each restart loads and
compiles again), so it lives here and not in the CI test run; tests/test_train_cli.py covers
SIGTERM (preemption) and tests/test_checkpoint.py a half-written step.

    python scripts/crash_drill.py [--kills 5] [--steps 8] [--seed 0] [--out /tmp/crash_drill]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _command(results_dir: str, steps: int) -> list[str]:
    return [sys.executable, "train.py", "--config", "configs/tiny.py",
            f"--config.results_dir={results_dir}", f"--config.total_steps={steps}",
            "--config.save_every=1", "--config.log_every=1", "--config.max_checkpoints=2",
            "--config.progress_bar=False", "--config.lr_scheduler=constant",
            "--config.warmup_steps=0"]  # fmt: skip


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    return env


def _steps(checkpoint_dir: str) -> str:
    """The step directories, complete ones plain and half-written ones marked with '*'."""
    if not os.path.isdir(checkpoint_dir):
        return "none"
    names = sorted(os.listdir(checkpoint_dir))
    marks = [n if os.path.exists(os.path.join(checkpoint_dir, n, "commit_success.txt")) else n + "*"
             for n in names]  # fmt: skip
    return " ".join(marks) or "none"


def _params(checkpoint_dir: str, step: int):
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    restored = ocp.StandardCheckpointer().restore(os.path.join(checkpoint_dir, str(step), "params"))
    return [np.asarray(x) for x in jax.tree.leaves(restored)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="/tmp/crash_drill")
    args = parser.parse_args()
    if args.kills < 1 or args.steps < 2:
        parser.error("--kills must be >= 1 and --steps >= 2")
    rng = random.Random(args.seed)
    shutil.rmtree(args.out, ignore_errors=True)
    straight, killed = os.path.join(args.out, "straight"), os.path.join(args.out, "killed")

    start = time.perf_counter()
    print(f"uninterrupted run of {args.steps} steps ...", flush=True)
    result = subprocess.run(_command(straight, args.steps), cwd=ROOT, env=_env(),
                            capture_output=True, text=True)  # fmt: skip
    if result.returncode != 0:
        print(result.stdout[-3000:], result.stderr[-3000:])
        return 1
    os.makedirs(killed)
    shutil.copytree(os.path.join(straight, "toy"), os.path.join(killed, "toy"))

    checkpoints = os.path.join(killed, "checkpoints")
    kills = 0
    while True:
        before = _steps(checkpoints)
        process = subprocess.Popen(_command(killed, args.steps), cwd=ROOT, env=_env(),
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        # Kill after a random number of step lines, then a random delay: with a checkpoint
        # saved after every step, many kills land inside an (async) save.
        target_lines = rng.randint(1, 2)
        seen, output = 0, []
        for line in process.stdout:
            output.append(line)
            if kills < args.kills and line.startswith("step "):
                seen += 1
                if seen == target_lines:
                    time.sleep(rng.uniform(0.0, 0.3))
                    process.send_signal(signal.SIGKILL)
                    break
        process.wait()
        if process.returncode == -signal.SIGKILL:
            kills += 1
            print(f"kill {kills}: checkpoint dirs before [{before}], after [{_steps(checkpoints)}] "
                  "(* = not complete)", flush=True)  # fmt: skip
            continue
        if process.returncode != 0:
            print("".join(output)[-4000:])
            return 1
        break
    print(f"run completed after {kills} kills")

    a, b = (
        _params(os.path.join(straight, "checkpoints"), args.steps),
        _params(checkpoints, args.steps),
    )
    identical = len(a) == len(b) and all(
        (x == y).all() and x.shape == y.shape for x, y in zip(a, b)
    )
    print(f"final params bit-identical to the uninterrupted run: {identical} "
          f"({len(a)} arrays; {time.perf_counter() - start:.0f}s)")  # fmt: skip
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
