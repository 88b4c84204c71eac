"""bench/gpu_check.py's `tiles` section (with --tiles): the range kernel's tiles and pipeline
stages swept at the recipe's row lengths, forward + backward, the fastest marked per length.

The candidates (models/attention_pallas.py TILE_CANDIDATES: forward q / k, backward q / k,
stages) vary one choice at a time around the kernel's default (128 / 64, 64 / 64, 2 stages);
every one is checked on the CPU to keep its blocks inside its arrays at both lengths
(tests/test_pallas_blocks.py). Each case runs bench/attention.py in its own process at BAGEL's
LLM heads (28 / 4, dim 128, bf16), at the student's 6144 and the teacher's 10240 tokens. The
fastest is printed, not applied: the model keeps its default until a GPU run shows a winner.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

from gpu_sections.common import ROOT, emit, failure_line


def run(args):
    """One bench/attention.py run per candidate; a row per candidate and length, then the
    fastest per length against the default."""
    from models.attention_pallas import TILE_CANDIDATES, TUNED_LENGTHS

    # (q, k, q_bwd, k_bwd, stages) of each candidate: the default first.
    candidates = tuple(dataclasses.astuple(blocks) for blocks in TILE_CANDIDATES)
    candidates = candidates[:2] if args.dry_run else candidates
    lengths = (256,) if args.dry_run else TUNED_LENGTHS
    times = {}  # (candidate, length) -> forward + backward ms
    for candidate in candidates:
        command = [
            sys.executable,
            os.path.join(ROOT, "bench", "attention.py"),
            "--backends",
            "pallas",
            "--repeats",
            str(args.repeats),
            "--seq-lens",
            *map(str, lengths),
            "--pallas-blocks",
            *map(str, candidate[:4]),
            "--pallas-stages",
            str(candidate[4]),
        ]
        if args.dry_run:
            command += ["--interpret", "--q-heads", "4", "--kv-heads", "1", "--head-dim", "128"]
        else:
            command += ["--q-heads", "28", "--kv-heads", "4", "--head-dim", "128"]
            command += ["--dtype", "bfloat16"]
        env = dict(os.environ, **({"JAX_PLATFORMS": "cpu"} if args.dry_run else {}))
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        for line in done.stdout.splitlines():
            parts = line.split()
            if parts and parts[0].isdigit() and len(parts) >= 8 and parts[1] == "pallas":
                if parts[4] != "—":
                    times[candidate, int(parts[0])] = float(parts[4])
                emit(
                    section="tiles",
                    case=f"T={parts[0]} tiles {candidate[0]}/{candidate[1]}, bwd "
                    f"{candidate[2]}/{candidate[3]}, {candidate[4]} stages",
                    value=f"f+b {parts[4]} ms ({parts[5]} TF/s), fwd {parts[2]} ms",
                    unit=" ".join(parts[8:]) or "",
                    ok=parts[4] != "—" or args.dry_run,
                )
        if done.returncode:
            emit(
                section="tiles",
                case=f"tiles {candidate}",
                value=f"exit {done.returncode}",
                unit=failure_line(done.stderr)[:120],
                ok=False,
                kind="check",
            )
    for length in lengths:
        measured = {c: t for (c, n), t in times.items() if n == length}
        if candidates[0] not in measured or not measured:
            continue
        best = min(measured, key=measured.get)
        emit(
            section="tiles",
            case=f"T={length} fastest",
            value=f"{best[0]}/{best[1]}, bwd {best[2]}/{best[3]}, {best[4]} stages: "
            f"{measured[best]:.2f} ms",
            unit=f"{measured[candidates[0]] / measured[best]:.2f}x the default"
            + (" (dry run: no timing means anything)" if args.dry_run else ""),
            ok=True,
        )
