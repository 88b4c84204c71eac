"""bench/gpu_check.py's `attention` section: the range kernel against cuDNN and the chunked
backend, forward + backward, at 4k / 10k / 16k / 40k tokens of BAGEL's LLM layout
(bench/attention.py, each case in its own process). Fails on a case that could not run."""

from __future__ import annotations

import os
import subprocess
import sys

from gpu_sections.common import ROOT, emit, failure_line


def run(args):
    """bench/attention.py's table for the three backends at BAGEL's LLM layout."""
    command = [
        sys.executable,
        os.path.join(ROOT, "bench", "attention.py"),
        "--check",
        "--repeats",
        str(args.repeats),
    ]
    if args.dry_run:  # in one process: a dry run's peaks mean nothing (saves two jax starts)
        command += [
            "--in-process",
            "--seq-lens",
            "256",
            "--backends",
            "pallas",
            "chunked",
            "--interpret",
            "--q-heads",
            "4",
            "--kv-heads",
            "1",
            "--head-dim",
            "128",
        ]
    else:
        command += [
            "--seq-lens",
            "4096",
            "10240",
            "16384",
            "40960",
            "--backends",
            "pallas",
            "cudnn",
            "chunked",
            "--q-heads",
            "28",
            "--kv-heads",
            "4",
            "--head-dim",
            "128",
            "--dtype",
            "bfloat16",
            "--max-run-gib",
            "100",
        ]
    env = dict(os.environ, **({"JAX_PLATFORMS": "cpu"} if args.dry_run else {}))
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    for line in done.stdout.splitlines():
        parts = line.split()
        if parts and parts[0].isdigit() and len(parts) >= 8:
            emit(
                section="attention",
                case=f"T={parts[0]} {parts[1]}",
                value=f"f+b {parts[4]} ms ({parts[5]} TF/s), fwd {parts[2]} ms",
                unit=" ".join(parts[8:]) or "",
                ok=parts[4] != "—" or args.dry_run,
            )
    if done.returncode:
        tail = failure_line(done.stderr)
        emit(
            section="attention",
            case="bench/attention.py",
            value=f"exit {done.returncode}",
            unit=tail[:120],
            ok=False,
            kind="check",
        )
