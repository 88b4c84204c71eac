"""What every section of bench/gpu_check.py shares, inside the section's own process: its rows
(`emit`), the judging of a measured figure against a threshold, timing, the allocator's peak,
the GPU's peaks and the deviceless memory prediction.

A section is a module of this package with a `run(args)` function; bench/gpu_check.py starts
each in its own process (`gpu_check.py --section NAME`) and reads the RESULT lines it prints.
Sections import this module, never the runner.
"""

from __future__ import annotations

import json
import os
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULT = "RESULT "  # prefix of the lines a section's process prints
GIB = 2**30
# HBM bytes/s by GPU (datasheets; bench/scale.py's table); the dense bf16 FLOP/s are
# opsd_jax/training/step_flops.DENSE_BF16_PEAK, the MFU's denominator everywhere.
HBM_BYTES_S = {"h100": 3.35e12, "h200": 4.8e12, "h800": 3.35e12}


def failure_line(text: str) -> str:
    """The line of a failed process's output that says why: its last exception line (jax's
    tracebacks end with a note on filtered frames, not the error), else its last line."""
    lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Exit", "Interrupt")) and " " not in head:
            return line
    return (lines or ["no output"])[-1]


def setup_jax(dry_run: bool, host_devices: int = 1):
    """jax, on the CPU in a dry run (with `host_devices` CPU devices, for a multi-GPU case)."""
    if dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
        if host_devices > 1:
            flag = f"--xla_force_host_platform_device_count={host_devices}"
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import jax

    return jax


def emit(kind="info", **row):
    """One row of the table. kind: 'check' (a threshold was applied: ok says whether it was
    met), 'info' (shown only; ok=False still fails it: a case that could not run), 'not applied'
    (a timing threshold in a dry run) or 'not run' (a case this machine cannot run)."""
    print(RESULT + json.dumps(dict(row, kind=kind)), flush=True)


def judged(args, fraction: float, threshold: float, rule: str) -> dict:
    """ok, kind and the verdict text of a measured `fraction` against `threshold`, `rule` naming
    it ("60% of the roofline"). A dry run's timings mean nothing: the comparison runs, but its
    row never fails and says the threshold was not applied."""
    met = fraction >= threshold
    if args.dry_run:
        return dict(ok=True, kind="not applied", verdict=f"dry run: threshold not applied ({rule})")
    return dict(ok=bool(met), kind="check", verdict=("at least " if met else "below ") + rule)


def timed(fn, *args, repeats=3, fresh=None, read=None):
    """(median seconds of `fn` over `repeats` runs after one warm-up, `read` of the last run's
    output). Each run takes `args`, or, with `fresh`, the arguments `fresh()` makes before the
    clock starts (donated ones must be new each run). No run's output or arguments are held
    while the next run's are made or it runs, so the allocator's peak is one run's, what a
    program's deviceless prediction counts: holding the last output while the next run made its
    own put one tree of gradients (9.10 GiB) above the 4-layer grad step's prediction, and one
    KV cache above each decode round's (7.4 GiB at B = 32), on the first H200."""
    import jax

    times, seen = [], None
    for run in range(repeats + 1):
        arguments = fresh() if fresh else args
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*arguments))
        if run:
            times.append(time.perf_counter() - t0)
        seen = read(out) if read else None
        del out, arguments
    return statistics.median(times), seen


def peak_bytes():
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def target_name(args) -> str:
    if args.target:
        return args.target
    import jax

    kind = jax.devices()[0].device_kind if not args.dry_run else ""
    for name in ("H200", "H800", "H100"):
        if name in kind:
            return name.lower()
    return "h100"


def device_peaks(args):
    """(dense bf16 FLOP/s, HBM bytes/s) of the GPU this runs on (the target's in a dry run)."""
    from opsd_jax.training.step_flops import DENSE_BF16_PEAK

    name = target_name(args)
    return DENSE_BF16_PEAK[name], HBM_BYTES_S[name]


def predicted_peak(lower_for, args, decode: bool = False) -> int | None:
    """Peak bytes of a program compiled for the target GPU without one: `lower_for(mesh)` lowers
    it with its arguments laid out on `mesh` (one compile-only device), under the training rules
    or, for the sampler, the decode rules. A dry run lowers it and stops there (None): the
    compile would take a CPU minute for the peak of tiny shapes, and tests/test_preflight.py
    and test_gpu_compile.py compile these programs for an H100."""
    from opsd_jax.parallel import mesh as mesh_lib
    from opsd_jax.parallel.device_memory import program_peak
    from opsd_jax.programs import gpu_target

    mesh = gpu_target.make_mesh(target_name(args), 1)
    rules = mesh_lib.DECODE_RULES if decode else mesh_lib.LOGICAL_RULES
    with mesh_lib.use_mesh(mesh, rules):
        lowered = lower_for(mesh)
        return None if args.dry_run else program_peak(gpu_target.compile(lowered, mesh))


def memory_row_value(measured: int | None, predicted: int | None, target: str) -> str:
    """A memory row's figures: the allocator's peak over the prediction, or what there is."""
    if predicted is None:
        return f"lowered for {target}, not compiled (dry run)"
    if measured:
        return (
            f"measured {measured / GIB:.2f} GiB / predicted {predicted / GIB:.2f} GiB = "
            f"{measured / predicted:.2f}"
        )
    return f"predicted {predicted / GIB:.3f} GiB (no allocator statistics here)"
