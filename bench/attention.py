"""Speed and memory of attention backends, forward and forward + backward, on BAGEL-style rows.

Each row is packed with samples ("segments") of 4096 tokens (the last may be shorter), each
opening with a 256-token bidirectional image block followed by causal text. For every sequence
length and backend this reports:

  fwd ms, f+b ms   median wall time (after a warm-up) of the jitted forward, and of
                   grad(sum(out * cotangent)) w.r.t. q, k, v (which includes the forward);
  TF/s             useful throughput: FLOPs of the *visible* (query, key) pairs only, 4*D per pair
                   and head for the forward, 3.5x that for forward + backward (the FlashAttention
                   convention; recomputation is not counted), so a backend that skips hidden
                   tiles and one that computes the dense square are compared on the same work;
  temp MiB         XLA's compiled temp memory of the forward + backward (known even where running
                   would not fit);
  peak MiB         the device allocator's peak while running that case (GPU memory_stats; each
                   case runs in its own process so the peak is its own), "—" where unavailable.

Backends: reference, chunked, dense (CPU layout of the dense mask; rows up to 4096 tokens),
cudnn (dense mask; GPU, bf16), pallas (the Triton kernel; GPU sm80+, or the Pallas interpreter
with --interpret: slow, small T only), auto.

On an H100/H200, BAGEL-7B's attention layout (28 query heads, 4 kv heads, head dim 128, bf16):

    python bench/attention.py --seq-lens 4096 10240 16384 40960 --backends pallas cudnn chunked \\
        --q-heads 28 --kv-heads 4 --head-dim 128 --dtype bfloat16 --max-run-gib 100 --check

On a CPU (defaults: small heads, float32):

    python bench/attention.py [--seq-lens 2048 4096] [--backends chunked] [--repeats 3]
    python bench/attention.py --seq-lens 256 --backends pallas chunked --interpret
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from models import attention as attention_lib
from models.attention import attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MIB = 1 << 20
SEGMENT_LEN = 4096
IMAGE_LEN = 256
RESULT = "RESULT "  # prefix of the one line a --case subprocess prints


def packed_row(length):
    """Segment ids, k_start, k_end for one row: segments of SEGMENT_LEN, each image then text."""
    seg = np.zeros(length, np.int32)
    k_start = np.zeros(length, np.int32)
    k_end = np.arange(1, length + 1, dtype=np.int32)  # causal text by default
    for i, start in enumerate(range(0, length, SEGMENT_LEN)):
        end = min(start + SEGMENT_LEN, length)
        seg[start:end] = i + 1
        k_start[start:end] = start
        image_end = min(start + IMAGE_LEN, end)
        k_end[start:image_end] = image_end
    return seg, k_start, k_end


def visible_pairs(length):
    """(query, key) pairs the mask lets through, per row (every range lies inside its segment)."""
    seg, k_start, k_end = packed_row(length)
    return int(np.sum(np.where(seg != 0, k_end - k_start, 0)))


def make_inputs(length, batch, hq, hkv, d, dtype):
    rng = np.random.default_rng(0)
    seg, k_start, k_end = (np.tile(x, (batch, 1)) for x in packed_row(length))

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    q, cotangent = normal(batch, length, hq, d), normal(batch, length, hq, d)
    k, v = normal(batch, length, hkv, d), normal(batch, length, hkv, d)
    return (q, k, v, cotangent, seg, seg, k_start, k_end)


def attention_fn(backend, args):
    """attention(q, k, v, q_seg, kv_seg, k_start, k_end) for a backend and this run's tiles."""
    if backend == "pallas":
        from models import attention_pallas

        blocks = attention_pallas.BlockSizes(*args.pallas_blocks, stages=args.pallas_stages)

        def run(q, k, v, q_seg, kv_seg, k_start, k_end):
            return attention_pallas.range_attention(
                q,
                k,
                v,
                q_segment_ids=q_seg,
                kv_segment_ids=kv_seg,
                k_start=k_start,
                k_end=k_end,
                block_sizes=blocks,
                interpret=args.interpret,
            )

        return run

    def run(q, k, v, q_seg, kv_seg, k_start, k_end):
        return attention(
            q,
            k,
            v,
            q_segment_ids=q_seg,
            kv_segment_ids=kv_seg,
            k_start=k_start,
            k_end=k_end,
            backend=backend,
            q_block=args.q_block,
            kv_block=args.kv_block,
        )

    return run


def forward(backend, args):
    fn = attention_fn(backend, args)
    return jax.jit(lambda q, k, v, cotangent, *ids: fn(q, k, v, *ids))


def fwd_bwd(backend, args):
    fn = attention_fn(backend, args)

    def run(q, k, v, cotangent, *ids):
        def loss(q, k, v):
            out = fn(q, k, v, *ids)
            return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return jax.jit(run)


def median_ms(compiled, inputs, repeats):
    jax.block_until_ready(compiled(*inputs))  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_mib():
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / MIB


def refusal(backend, args):
    """Why this backend cannot run here (None if it can)."""
    on_gpu = jax.default_backend() == "gpu"
    if backend == "pallas" and not args.interpret:
        from models import gpu_support

        reason = gpu_support.unsupported_reason()
        if reason:
            return f"refused: {reason} (--interpret runs the Pallas interpreter, small T only)"
    if backend == "cudnn" and not on_gpu:
        return "refused: cudnn needs a CUDA GPU"
    if backend == "cudnn" and args.dtype not in ("bfloat16", "float16"):
        return "refused: cudnn needs --dtype bfloat16 or float16"
    return None


def measure(backend, length, args):
    """One case in this process: a dict of the table's columns (None where not measured)."""
    result = dict(temp_mib=None, fwd_ms=None, fb_ms=None, peak_mib=None, note="")
    if (reason := refusal(backend, args)) is not None:
        return dict(result, note=reason)
    inputs = make_inputs(
        length, args.batch, args.q_heads, args.kv_heads, args.head_dim, jnp.dtype(args.dtype)
    )
    try:
        compiled_fb = fwd_bwd(backend, args).lower(*inputs).compile()
        compiled_f = forward(backend, args).lower(*inputs).compile()
    except Exception as e:  # e.g. the dense mask does not even compile at this size
        return dict(result, note=f"compile failed: {type(e).__name__}: {str(e)[:120]}")
    temp = compiled_fb.memory_analysis().temp_size_in_bytes / MIB
    result["temp_mib"] = temp
    if temp > args.max_run_gib * 1024:
        return dict(result, note=f"not run: temp > {args.max_run_gib:g} GiB")
    try:
        result["fwd_ms"] = median_ms(compiled_f, inputs, args.repeats)
        result["fb_ms"] = median_ms(compiled_fb, inputs, args.repeats)
    except Exception as e:  # out of memory at run time
        return dict(result, note=f"run failed: {type(e).__name__}: {str(e)[:120]}")
    result["peak_mib"] = peak_mib()
    if args.check and backend not in ("chunked", "reference"):
        result["note"] = check_against_chunked(compiled_f, compiled_fb, inputs, args)
    return result


def check_against_chunked(compiled_f, compiled_fb, inputs, args):
    """Largest error of (out, dq, dk, dv) against the chunked backend (itself tested against the
    dense reference), each relative to max(1, max |chunked value|)."""
    got = (compiled_f(*inputs),) + tuple(compiled_fb(*inputs))
    want = (forward("chunked", args)(*inputs),) + tuple(fwd_bwd("chunked", args)(*inputs))
    errors = []
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        errors.append(float(np.max(np.abs(a - b))) / max(1.0, float(np.max(np.abs(b)))))
    return "vs chunked out/dq/dk/dv " + " ".join(f"{e:.1e}" for e in errors)


def measure_isolated(backend, length, args):
    """measure() in a fresh process, so the device's peak memory is this case's alone and an
    out-of-memory crash costs one row of the table, not the run."""
    command = [sys.executable, os.path.abspath(__file__), "--case", backend, str(length)]
    command += [a for a in sys.argv[1:]]
    done = subprocess.run(command, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return dict(
        temp_mib=None,
        fwd_ms=None,
        fb_ms=None,
        peak_mib=None,
        note=f"process failed ({done.returncode}): {tail[:120]}",
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument(
        "--backends", nargs="+", default=["reference", "chunked"], choices=attention_lib.BACKENDS
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--q-heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--q-block", type=int, default=512, help="chunked backend's q tile")
    parser.add_argument("--kv-block", type=int, default=512, help="chunked backend's kv tile")
    parser.add_argument(
        "--pallas-blocks",
        type=int,
        nargs=4,
        default=[128, 64, 64, 64],
        metavar=("Q", "K", "Q_BWD", "K_BWD"),
        help="pallas kernel's tiles",
    )
    parser.add_argument(
        "--pallas-stages", type=int, default=2, help="pallas kernels' pipeline stages"
    )
    parser.add_argument(
        "--interpret",
        action="store_true",
        help="run the pallas backend in the Pallas interpreter (CPU; slow)",
    )
    parser.add_argument(
        "--max-run-gib",
        type=float,
        default=6.0,
        help="compile but do not run a case whose temp memory exceeds this",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="also report each backend's error against chunked (out and grads)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run every case in this process (the peak column is then cumulative)",
    )
    parser.add_argument("--case", nargs=2, metavar=("BACKEND", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.case:  # a subprocess of measure_isolated
        backend, length = args.case[0], int(args.case[1])
        print(RESULT + json.dumps(measure(backend, length, args)), flush=True)
        return

    device = jax.devices()[0]
    print(
        f"jax {jax.__version__} on {device.platform} ({device.device_kind}); B={args.batch} "
        f"Hq={args.q_heads} Hkv={args.kv_heads} D={args.head_dim} {args.dtype}; chunked tiles "
        f"{args.q_block}/{args.kv_block}, pallas tiles {args.pallas_blocks} "
        f"in {args.pallas_stages} stages"
        f"{' (interpreted)' if args.interpret else ''}; segments of {SEGMENT_LEN} opening "
        f"with a {IMAGE_LEN}-token image block"
    )
    resolved = {b: attention_lib.resolve_backend(b) for b in args.backends}
    if "auto" in resolved:
        print(f"auto = {resolved['auto']} here")
    header = (
        f"{'T':>6}  {'backend':<10} {'fwd ms':>9} {'TF/s':>6} {'f+b ms':>9} {'TF/s':>6} "
        f"{'temp MiB':>10} {'peak MiB':>10}  note"
    )
    print(header)
    print("-" * len(header))
    memory = {}
    for length in args.seq_lens:
        flops = 4.0 * visible_pairs(length) * args.batch * args.q_heads * args.head_dim
        for backend in args.backends:
            run = measure if args.in_process else measure_isolated
            r = run(backend, length, args)
            memory[backend, length] = r["temp_mib"]

            def num(x, fmt):
                return "—" if x is None else format(x, fmt)

            def tflops(ms, factor):
                return None if ms is None else factor * flops / (ms * 1e-3) / 1e12

            print(
                f"{length:>6}  {backend:<10} {num(r['fwd_ms'], '.2f'):>9} "
                f"{num(tflops(r['fwd_ms'], 1.0), '.4g'):>6} {num(r['fb_ms'], '.2f'):>9} "
                f"{num(tflops(r['fb_ms'], 3.5), '.4g'):>6} {num(r['temp_mib'], '.1f'):>10} "
                f"{num(r['peak_mib'], '.1f'):>10}  {r['note']}".rstrip(),
                flush=True,
            )

    def ratio(a, b):
        return None if not a or not b else a / b

    scaling = ratio(memory.get(("chunked", 16384)), memory.get(("chunked", 4096)))
    saving = ratio(memory.get(("reference", 16384)), memory.get(("chunked", 16384)))
    if scaling is not None or saving is not None:
        print()
        print(
            "chunked memory 16k / 4k:       "
            + ("—" if scaling is None else f"{scaling:.2f}")
            + "  (target <= 5)"
        )
        print(
            "reference / chunked memory 16k: "
            + ("—" if saving is None else f"{saving:.1f}")
            + "  (target >= 8)"
        )


if __name__ == "__main__":
    main()
