"""Each program of a run, measured on this machine's GPU against what the preflight predicts.

    python bench/program_memory.py --config configs/thinkmorph_7b_1gpu.py --target h100:1
    python bench/program_memory.py --config configs/tiny.py --target h100:1 --program 2

`train.py --compile_only` (opsd_jax/run_config/preflight.py) predicts each program's peak per
device from a compile without a GPU: XLA's assignment of its buffers plus what the run keeps on
the device beside it. This asks the GPU whether the prediction holds. Without `--program` it
runs the preflight, then each of its programs in a process of its own (`--program K`): the
process compiles that program for the GPU here, makes its arguments as zeros and holds the
bytes the preflight counts beside it, runs it once and reads the allocator. A line per program:
the allocator's peak against the prediction, the bytes in use before the run (arguments and
what is beside them) and XLA's assignment on this GPU, so that a gap shows where it is: in the
compile (assignment above the deviceless one) or around it (the allocator's own reserve,
fragmentation, workspaces). The run's own start (loading weights) is not a program here: the
recipe section of bench/gpu_check.py reads a real run's peak for that.

On a CPU (no allocator statistics) each program still runs on zeros and its assignment prints:
the script is known to work before a GPU is rented. Flags after the config's are train.py's
`--config.KEY=VALUE` overrides.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from absl import app, flags

from opsd_jax import run_config
from opsd_jax.run_config import preflight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GIB = 2**30
# What the preflight's verdict means on a GPU: a program's allocator peak at most this many
# times its prediction (issue: the preflight's "fits with 15% free" holds if this holds).
MAX_MEASURED_OVER_PREDICTED = 1.10

_TARGET = flags.DEFINE_string("target", "h100:1", "the preflight's TARGET:DEVICES")
_PROGRAM = flags.DEFINE_integer("program", None, "measure this program alone (from 0)")


def predicted_programs(preflight_output: str) -> list[tuple[str, float]]:
    """(name, predicted GiB per device) of each program line of `train.py --compile_only`."""
    found = re.findall(r"^  (.*): peak ([\d.]+) GiB per device", preflight_output, re.M)
    return [(name, float(gib)) for name, gib in found]


def predictions(argv: list[str], target: str) -> list[tuple[str, float]]:
    """predicted_programs of the preflight of `argv` (train.py's flags) for `target`."""
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), *argv, f"--compile_only={target}"],
        capture_output=True,
        text=True,
    )
    found = predicted_programs(done.stdout)
    if not found:
        raise SystemExit(f"the preflight printed no program:\n{done.stdout[-2000:]}{done.stderr}")
    return found


def measured(argv: list[str], target: str, index: int) -> dict:
    """Program `index` measured in a process of its own: the fields of its `measured` line, or
    {'error': why}."""
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *argv, f"--target={target}"]
        + [f"--program={index}"],
        capture_output=True,
        text=True,
    )
    return measured_line(done)


def measured_line(done: subprocess.CompletedProcess) -> dict:
    """The fields of a `--program K` process's `measured` line, or {'error': why}."""
    line = re.search(r"^measured (\{.*\})$", done.stdout, re.M)
    if line:
        return json.loads(line.group(1))
    lines = (done.stderr or done.stdout or "no output").strip().splitlines()
    return {"error": lines[-1][:200]}


def row(predicted_gib: float, found: dict) -> dict:
    """A program's figures: 'ratio' (None without allocator statistics) and 'figures' (text)."""
    if "error" in found:
        return dict(ratio=None, figures=f"FAILED: {found['error']}")
    assigned, beside = found["assigned"] / GIB, found["beside"] / GIB
    parts = f"assigned here {assigned:.2f} + beside {beside:.2f} GiB"
    if "peak" not in found:
        return dict(
            ratio=None,
            figures=f"predicted {predicted_gib:.2f} GiB; {parts}; no allocator statistics",
        )
    ratio = found["peak"] / GIB / predicted_gib
    return dict(
        ratio=ratio,
        figures=f"measured {found['peak'] / GIB:.2f} GiB / predicted {predicted_gib:.2f} = "
        f"{ratio:.2f} (in use before the run {found['before'] / GIB:.2f}; {parts}; peak before "
        f"the run {found['peak_before_run'] / GIB:.2f})",
    )


def main(argv):
    # The subprocesses get train.py's flags as given: sys.argv less this script's own flags
    # (`--target=X` or `--target X`).
    own = ("--target", "--program")
    passed, args = [], iter(sys.argv[1:])
    for arg in args:
        if arg in own:
            next(args, None)  # its value
        elif not arg.startswith(tuple(f"{flag}=" for flag in own)):
            passed.append(arg)
    target = _TARGET.value
    if _PROGRAM.value is not None:
        sys.exit(preflight.run(run_config.config_flag_value(), target, measure=_PROGRAM.value))
    programs = predictions(passed, target)
    print(f"{len(programs)} programs predicted for {target}; each measured in its own process")
    worst = 0.0
    for index, (name, gib) in enumerate(programs):
        line = row(gib, measured(passed, target, index))
        worst = max(worst, line["ratio"] or 0.0)
        print(f"  {name}: {line['figures']}", flush=True)
    print(
        f"largest measured / predicted: {worst:.2f} (at most {MAX_MEASURED_OVER_PREDICTED} for "
        "the preflight's 15% to hold)"
        if worst
        else "no allocator statistics on this machine: nothing to compare"
    )


if __name__ == "__main__":
    app.run(main, flags_parser=run_config.parse_flags)
