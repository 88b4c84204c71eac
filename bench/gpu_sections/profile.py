"""bench/gpu_check.py's `profile` section (`--profile`): one grad step traced, reduced to GPU time
by kernel class, on the machine that ran it.

The grad step of the `grad_step` section at its largest layer count runs once to warm up, then
once under `jax.profiler.trace` (a perfetto trace, no extra package). The runner starts this
process with XLA's command buffers off (`--xla_gpu_enable_command_buffer=`), so each kernel is
its own event, attributed by name, instead of one CUDA graph launch. The trace is reduced to a
CSV of GPU time per kernel class (`KERNEL_CLASSES`: the attention kernels' forward / dq / dkdv,
GEMMs, fusions, sort and top-k, collectives, copies, the rest), a few hundred bytes to keep; the
trace itself stays in the results folder beside it.
"""

from __future__ import annotations

import collections
import csv
import glob
import gzip
import json
import os
import re

from gpu_sections.common import emit, setup_jax

# (class, pattern of the kernel's name), first match wins.
KERNEL_CLASSES = (
    ("attention forward", r"range_attention_forward"),
    ("attention dq", r"range_attention_dq"),
    ("attention dkdv", r"range_attention_dkdv"),
    ("decode attention", r"filled_cache_attention|combine_cache_splits"),
    ("collective", r"nccl|all-reduce|all-gather|reduce-scatter|all_reduce|all_gather"),
    ("gemm", r"gemm|cutlass|xmma|cublas|nvjet|sm\d+_.*(tn|nt|nn|tt)|matmul|dot"),
    ("sort and top-k", r"sort|top_?k"),
    ("copy", r"memcpy|memset|copy"),
    ("fusion", r"fusion|reduce|scatter|gather|transpose|convert"),
)


def kernel_class(name: str) -> str:
    for label, pattern in KERNEL_CLASSES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def device_time_by_class(trace_path: str) -> tuple[str, dict[str, tuple[float, int]]]:
    """(the processes read, {class: (microseconds, events)}) of a perfetto trace's complete
    events on the GPU's processes ('/device:GPU:...'; on a CPU, the host's, for a dry run)."""
    with gzip.open(trace_path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    devices = {pid for pid, name in names.items() if name.startswith("/device:GPU")}
    read = devices or set(names)
    totals: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in read:
            total = totals[kernel_class(e.get("name", ""))]
            total[0] += float(e.get("dur", 0.0))
            total[1] += 1
    where = ", ".join(sorted(names[p] for p in read))
    return where, {k: (v[0], v[1]) for k, v in totals.items()}


def write_csv(path: str, by_class: dict[str, tuple[float, int]]) -> None:
    total = sum(us for us, _ in by_class.values()) or 1.0
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["class", "ms", "share", "events"])
        for label, (us, count) in sorted(by_class.items(), key=lambda kv: -kv[1][0]):
            writer.writerow([label, f"{us / 1e3:.3f}", f"{us / total:.3f}", count])


def run(args):
    jax = setup_jax(args.dry_run)
    from gpu_sections.grad_step import build_step
    from opsd_jax.parallel import mesh as mesh_lib

    mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
    layers = max(args.sweep)
    step, arguments, _ = build_step(args, layers, mesh)
    folder = os.path.join(args.results_dir, "profile")
    with mesh_lib.use_mesh(mesh):
        jax.block_until_ready(step(*arguments))  # compile and warm up
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            jax.block_until_ready(step(*arguments))
    traces = sorted(glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True))
    where, by_class = device_time_by_class(traces[-1])
    path = os.path.join(args.results_dir, "grad_step_profile.csv")
    write_csv(path, by_class)
    total = sum(us for us, _ in by_class.values())
    top = sorted(by_class.items(), key=lambda kv: -kv[1][0])[:4]
    emit(
        section="profile",
        case=f"grad step, {layers} layer(s), command buffers off ({where})",
        value=", ".join(f"{label} {us / max(total, 1e-9):.0%}" for label, (us, _) in top),
        unit=f"{total / 1e3:.1f} ms of kernels by class: {path}",
        ok=bool(by_class),
    )
