"""bench/gpu_check.py's `memory` section (with --memory): does the preflight's promise hold?

Each program of the one-GPU LoRA recipe (configs/thinkmorph_7b_1gpu.py: the train step, the
decode-copy refresh, the sampling engine's prefill, insert, decode chunk and next round) in a
process of its own, as bench/program_memory.py runs them: compiled for this GPU, run once on
zero arguments with the bytes the preflight counts beside it held on the device. A row per
program: the allocator's peak against the preflight's prediction for it, the bytes in use
before the run and XLA's assignment on this GPU (where a gap lies). The dry run does the same
for configs/tiny.py on the CPU, which has no allocator statistics (its rows say so).

Fails: a program whose peak is above MAX_MEASURED_OVER_PREDICTED of its prediction (the
preflight's 15% of headroom would not hold), or that does not run.
"""

from __future__ import annotations

from gpu_sections.common import emit, setup_jax, target_name

RECIPE = "configs/thinkmorph_7b_1gpu.py"


def run(args):
    import os

    setup_jax(args.dry_run)  # JAX_PLATFORMS=cpu for the processes of a dry run
    # Asking jax for this GPU's kind must not reserve its memory: the programs' processes need
    # it (they inherit the setting, as the recipe's launches do: the allocator grows as asked).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import program_memory

    config = "configs/tiny.py" if args.dry_run else RECIPE
    target = f"{target_name(args)}:1"
    argv = ["--config", config]
    limit = program_memory.MAX_MEASURED_OVER_PREDICTED
    for index, (name, gib) in enumerate(program_memory.predictions(argv, target)):
        found = program_memory.measured(argv, target, index)
        line = program_memory.row(gib, found)
        if "error" in found:
            unit, ok, kind = "FAILED", False, "check"
        elif line["ratio"] is None:  # no allocator statistics (a CPU)
            unit, ok, kind = "not compared: no allocator here", True, "info"
        else:
            ok, kind = line["ratio"] <= limit, "check"
            unit = f"{'at most' if ok else 'above'} {limit} x the preflight's prediction"
        emit(
            section="memory",
            case=f"{config}: {name}",
            value=line["figures"],
            unit=unit,
            ok=ok,
            kind=kind,
        )
