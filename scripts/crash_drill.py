"""Crash drill: kill train.py with SIGKILL at random moments, resume each time, compare.

What: runs the tiny config once without interruption, then runs it again but kills the process
(SIGKILL: no handler, no cleanup, as a machine or OOM kill) `--kills` times, restarting with
`auto_resume` after each kill, and finally checks that the last checkpoint's params are
bit-identical to the uninterrupted run's. Kills are of two kinds, in random order:
- 'save': right after the k-th step line (k = 1 or 2), as soon as that step's asynchronous
  checkpoint save has a half-written `<step>/` folder (no commit marker yet) on disk;
- 'startup': at a random moment between launch and the first step line (imports, restore,
  compilation).
Every relaunch must resume from the newest *complete* step on disk, never a half-written one.

Why: a half-written checkpoint must never be restored and a resumed run must continue exactly.
tests/test_train_cli.py runs this drill with five kills on every CI run; run it on your machine
with as many steps, kills and seeds as you like.

    python scripts/crash_drill.py [--kills 5] [--steps 8] [--seed 0] [--out /tmp/crash_drill]

`--straight DIR` compares against an uninterrupted run already made (tests/test_train_cli.py
runs the drill so, against its reference run); it must lie outside --out. The drill deletes
--out before it starts, so it refuses a non-empty --out that is not a previous drill's (marked
by its `crash_drill.json`) unless `--overwrite` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The drill reads the disk itself rather than through opsd_jax/io/checkpoint.py, so that it
# referees the code under test independently.
COMMIT_MARKER = "commit_success.txt"  # orbax writes it last (see opsd_jax/io/checkpoint.py)
# The drill's own output: the file that marks a folder as one (so a rerun may delete it) and the
# folders it writes there.
DRILL_MARKER = "crash_drill.json"
DRILL_FOLDERS = {"straight", "killed"}


@dataclasses.dataclass
class Launch:
    """What one train.py launch of the drill did."""

    kill: str | None  # 'save', 'startup', or None for the launch that ran to the end
    committed_before: int | None  # newest complete step on disk at launch
    resumed_at: int | None  # the step train.py said it resumed at (None: no resume line)
    listing_before: str
    listing_after: str
    killed_mid_save: bool  # the step it was saving is half-written on disk after the kill
    output: str


def listing(checkpoint_dir: str) -> str:
    """The step folders, complete ones plain and half-written ones marked with '*'."""
    if not os.path.isdir(checkpoint_dir):
        return "none"
    names = sorted(os.listdir(checkpoint_dir))
    marks = [
        n if os.path.exists(os.path.join(checkpoint_dir, n, COMMIT_MARKER)) else n + "*"
        for n in names
    ]
    return " ".join(marks) or "none"


def newest_complete_step(checkpoint_dir: str) -> int | None:
    if not os.path.isdir(checkpoint_dir):
        return None
    steps = [
        int(n)
        for n in os.listdir(checkpoint_dir)
        if n.isdigit() and os.path.exists(os.path.join(checkpoint_dir, n, COMMIT_MARKER))
    ]
    return max(steps, default=None)


def _save_state(checkpoint_dir: str, step: int) -> str:
    """'writing', 'complete' or 'not started' for one step's checkpoint."""
    if os.path.exists(os.path.join(checkpoint_dir, str(step), COMMIT_MARKER)):
        return "complete"
    # orbax's commit-file protocol writes `<step>/` in place and puts the marker in it last.
    if os.path.isdir(os.path.join(checkpoint_dir, str(step))):
        return "writing"
    return "not started"


def kill_plan(kills: int, rng: random.Random) -> list[tuple[str, float]]:
    """`kills` kills in random order, three in five during a save: ('save', k-th step line) or
    ('startup', seconds after launch). A launch commits at most one new step (two if its save
    finished before the drill saw it being written), so runs of more than `kills` steps leave
    the final launch work to do."""
    saves = (3 * kills + 4) // 5
    plan = [("save", float(rng.randint(1, 2))) for _ in range(saves)]
    plan += [("startup", rng.uniform(0.5, 6.0)) for _ in range(kills - saves)]
    rng.shuffle(plan)
    return plan


def _launch(command, cwd, env, checkpoint_dir, kill, rng, timeout) -> tuple[int, str, bool]:
    """Run train.py once; kill it as `kill` says (None: let it finish). Returns the exit code,
    the output, and whether a 'save' kill left the step it was saving half-written."""
    env = dict(env, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: queue.Queue = queue.Queue()

    def read():  # drain the pipe in the background so the trainer never blocks on it
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    start, output, step_lines, done, saving = time.monotonic(), [], 0, False, None
    while not done and kill is not None:
        kind, value = kill
        wait = start + value - time.monotonic() if kind == "startup" else 1.0
        try:
            line = lines.get(timeout=max(wait, 0.0))
        except queue.Empty:
            line = ""
        if line is None:
            done = True
            break
        output.append(line)
        if time.monotonic() - start > timeout:
            break
        if kind == "startup" and (line.startswith("step ") or time.monotonic() - start >= value):
            break  # the random moment came (or training began first: kill right there)
        if kind == "save" and line.startswith("step "):
            step_lines += 1
            if step_lines == int(value):
                # The step's checkpoint is saved asynchronously right after its line: wait for
                # its half-written folder, then kill a random few milliseconds into the save.
                saving = int(line.split()[1].split("/")[0])  # "step N/T | ..."
                deadline = time.monotonic() + 10.0
                while time.monotonic() < deadline:
                    state = _save_state(checkpoint_dir, saving)
                    if state != "not started":
                        break
                    time.sleep(0.001)
                if state == "writing":
                    time.sleep(rng.uniform(0.0, 0.01))
                break
    if not done and kill is not None:
        process.send_signal(signal.SIGKILL)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    while not done and (line := lines.get()) is not None:  # done: the reader's end was read
        output.append(line)
    mid_save = saving is not None and _save_state(checkpoint_dir, saving) == "writing"
    return process.returncode, "".join(output), mid_save


def kill_and_resume(
    command: list[str],
    *,
    cwd: str,
    env: dict,
    checkpoint_dir: str,
    kills: int,
    rng: random.Random,
    timeout: float = 600,
    log=print,
) -> list[Launch]:
    """Launch `command` (train.py with auto_resume and a checkpoint every step) until it
    completes, SIGKILLing the first `kills` launches per `kill_plan`. Raises RuntimeError if a
    launch fails in any other way."""
    launches = []
    for kill in [*kill_plan(kills, rng), None]:
        before, committed = listing(checkpoint_dir), newest_complete_step(checkpoint_dir)
        rc, output, mid_save = _launch(command, cwd, env, checkpoint_dir, kill, rng, timeout)
        if rc not in (0, -signal.SIGKILL) or (kill is None) != (rc == 0):
            raise RuntimeError(
                f"launch {len(launches) + 1} ({kill}): exit code {rc}\n{output[-4000:]}"
            )
        resumed = re.search(r"resumed from .* at step (\d+)", output)
        launch = Launch(
            kill=kill and kill[0],
            committed_before=committed,
            resumed_at=int(resumed.group(1)) if resumed else None,
            listing_before=before,
            listing_after=listing(checkpoint_dir),
            killed_mid_save=mid_save,
            output=output,
        )
        launches.append(launch)
        what = f"kill {len(launches)} ({launch.kill}" if kill else "final launch"
        what += ", mid-save)" if mid_save else (")" if kill else "")
        log(
            f"{what}: checkpoint dirs before [{launch.listing_before}], after "
            f"[{launch.listing_after}] (* = not complete); resumed at {launch.resumed_at}"
        )
    return launches


def _command(results_dir: str, steps: int) -> list[str]:
    return [
        sys.executable,
        "train.py",
        "--config",
        "configs/smoke.py",
        f"--config.results_dir={results_dir}",
        f"--config.total_steps={steps}",
        "--config.save_every=1",
        "--config.log_every=1",
        "--config.max_checkpoints=2",
        "--config.progress_bar=False",
        "--config.lr_scheduler=constant",
        "--config.warmup_steps=0",
    ]


def is_inside(path: str, folder: str) -> bool:
    """Whether `path` is `folder` or lies under it (symlinks resolved)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def straight_problem(straight: str | None, out: str, steps: int) -> str | None:
    """What is wrong with `--straight` as the drill's reference run, or None: an uninterrupted
    run (its toy data and a complete checkpoint of step `steps`), apart from --out (which the
    drill deletes, and where it writes its own run)."""
    if straight is None:
        return None
    if not os.path.isdir(straight):
        return f"--straight {straight}: no such directory"
    if is_inside(straight, out):
        return f"--straight {straight} lies inside --out {out}, which the drill deletes"
    if is_inside(out, straight):
        return f"--out {out} lies inside --straight {straight}: give an --out outside it"
    if not os.path.isdir(os.path.join(straight, "toy")):
        return f"--straight {straight}: no toy/ folder (not a results_dir of the drill's command)"
    if _save_state(os.path.join(straight, "checkpoints"), steps) != "complete":
        return (
            f"--straight {straight}: no complete checkpoint of step {steps} "
            f"(the drill compares with an uninterrupted run of --steps {steps})"
        )
    return None


def out_problem(out: str, overwrite: bool) -> str | None:
    """Why the drill must not delete `out`, or None: it is empty, missing, a previous drill's
    output (its marker file, or only the drill's own folders, as drills before the marker left
    them), or --overwrite says to replace it."""
    if not os.path.exists(out):
        return None
    if not os.path.isdir(out):
        return f"--out {out} is a file; the drill writes a folder there"
    if overwrite:
        return None
    names = set(os.listdir(out))
    if not names or DRILL_MARKER in names or names <= DRILL_FOLDERS:
        return None
    return (
        f"--out {out} holds files that are not a crash drill's output "
        f"({', '.join(sorted(names)[:3])}{', ...' if len(names) > 3 else ''}); "
        "the drill deletes --out first: give another --out, or --overwrite to replace it"
    )


def saved_arrays(checkpoint_dir: str | os.PathLike, step: int, item: str = "params") -> list:
    """One item (params, opt_state, ema_params) of a saved step as host arrays, leaf by leaf
    (restored as saved: no restore target needed)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    restored = ocp.StandardCheckpointer().restore(os.path.join(checkpoint_dir, str(step), item))
    return [np.asarray(x) for x in jax.tree.leaves(restored)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="/tmp/crash_drill")
    parser.add_argument(
        "--straight",
        default=None,
        help="the results_dir of an uninterrupted run of the drill's command with --steps "
        "steps, to compare against (and take the toy data from) instead of running one",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty --out that is not a previous drill's output",
    )
    args = parser.parse_args(argv)
    if args.kills < 1 or args.steps <= args.kills:
        parser.error("--kills must be >= 1 and --steps > --kills")
    # Everything the delete below could destroy or the drill needs is checked before it.
    problem = straight_problem(args.straight, args.out, args.steps) or out_problem(
        args.out, args.overwrite
    )
    if problem:
        raise SystemExit(f"error: {problem}")
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    with open(os.path.join(args.out, DRILL_MARKER), "w", encoding="utf-8") as f:
        json.dump({"written_by": "scripts/crash_drill.py", "steps": args.steps}, f)
        f.write("\n")
    straight = args.straight or os.path.join(args.out, "straight")
    killed = os.path.join(args.out, "killed")
    # One device per launch (a forced device count in the caller's XLA_FLAGS is dropped); the
    # caller's other flags stay, so launches share its compilation cache entries.
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(
        f for f in flags if not f.startswith("--xla_force_host_platform_device_count")
    )

    start = time.perf_counter()
    if args.straight is None:
        print(f"uninterrupted run of {args.steps} steps ...", flush=True)
        result = subprocess.run(
            _command(straight, args.steps), cwd=ROOT, env=env, capture_output=True, text=True
        )
        if result.returncode != 0:
            print(result.stdout[-3000:], result.stderr[-3000:])
            return 1
    os.makedirs(killed)
    shutil.copytree(os.path.join(straight, "toy"), os.path.join(killed, "toy"))
    checkpoints = os.path.join(killed, "checkpoints")
    launches = kill_and_resume(
        _command(killed, args.steps),
        cwd=ROOT,
        env=env,
        checkpoint_dir=checkpoints,
        kills=args.kills,
        rng=random.Random(args.seed),
    )
    # A launch resumed from anything but the newest complete step, or (the one that finished)
    # started afresh though a complete step was on disk.
    wrong = [
        i + 1
        for i, x in enumerate(launches)
        if x.resumed_at != x.committed_before and (x.resumed_at is not None or x.kill is None)
    ]
    print(
        f"run completed after {args.kills} kills "
        f"({sum(x.kill == 'save' for x in launches)} during a save, "
        f"{sum(x.kill == 'startup' for x in launches)} at startup); "
        f"{sum(x.killed_mid_save for x in launches)} landed while a checkpoint was written; "
        f"launches that resumed from anything but the newest complete step: {wrong or 'none'}"
    )

    a = saved_arrays(os.path.join(straight, "checkpoints"), args.steps)
    b = saved_arrays(checkpoints, args.steps)
    identical = len(a) == len(b) > 0 and all(
        x.shape == y.shape and (x == y).all() for x, y in zip(a, b)
    )
    print(
        f"final params bit-identical to the uninterrupted run: {identical} "
        f"({len(a)} arrays; {time.perf_counter() - start:.0f}s)"
    )
    return 0 if identical and not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
