"""Memory and speed of attention backends, forward + backward, on BAGEL-style packed rows.

Each row is packed with samples ("segments") of 4096 tokens (the last may be shorter), each
opening with a 256-token bidirectional image block followed by causal text. For every sequence
length and backend this reports the compiled temp memory of grad(sum(out * cotangent)) w.r.t.
q, k, v (from XLA's memory analysis, so it is known even where running would not fit) and the
median wall time after a warm-up run.

    python bench/attention.py [--seq-lens 2048 4096] [--backends chunked] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# Run as a plain script from anywhere: make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from models.attention import attention  # noqa: E402

MIB = 1 << 20
SEGMENT_LEN = 4096
IMAGE_LEN = 256


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


def make_inputs(length, batch, hq, hkv, d, dtype):
    rng = np.random.default_rng(0)
    seg, k_start, k_end = (np.tile(x, (batch, 1)) for x in packed_row(length))

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    q, cotangent = normal(batch, length, hq, d), normal(batch, length, hq, d)
    k, v = normal(batch, length, hkv, d), normal(batch, length, hkv, d)
    return (q, k, v, cotangent, seg, seg, k_start, k_end)


def fwd_bwd(backend, q_block, kv_block):
    def run(q, k, v, cotangent, q_seg, kv_seg, k_start, k_end):
        def loss(q, k, v):
            out = attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, k_start=k_start,
                            k_end=k_end, backend=backend, q_block=q_block, kv_block=kv_block)
            return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return jax.jit(run)


def measure(backend, length, args):
    """(temp MiB or None, median ms or None, note)."""
    inputs = make_inputs(length, args.batch, args.q_heads, args.kv_heads, args.head_dim,
                         jnp.dtype(args.dtype))
    try:
        compiled = fwd_bwd(backend, args.q_block, args.kv_block).lower(*inputs).compile()
    except Exception as e:  # e.g. the dense mask does not even compile at this size
        return None, None, f"compile failed: {type(e).__name__}"
    temp = compiled.memory_analysis().temp_size_in_bytes
    if temp > args.max_run_gib * (1 << 30):
        return temp / MIB, None, f"not run: temp > {args.max_run_gib:g} GiB"
    jax.block_until_ready(compiled(*inputs))  # warm-up
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        times.append((time.perf_counter() - t0) * 1e3)
    return temp / MIB, statistics.median(times), ""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--backends", nargs="+", default=["reference", "chunked"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--q-heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--q-block", type=int, default=512)
    parser.add_argument("--kv-block", type=int, default=512)
    parser.add_argument("--max-run-gib", type=float, default=6.0,
                        help="compile but do not run a case whose temp memory exceeds this")
    args = parser.parse_args()

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; B={args.batch} "
          f"Hq={args.q_heads} Hkv={args.kv_heads} D={args.head_dim} {args.dtype}; "
          f"blocks {args.q_block}/{args.kv_block}; segments of {SEGMENT_LEN} opening with a "
          f"{IMAGE_LEN}-token image block; fwd+bwd")
    header = f"{'T':>6}  {'backend':<10} {'temp MiB':>10} {'time ms':>10}  note"
    print(header)
    print("-" * len(header))
    memory = {}
    for length in args.seq_lens:
        for backend in args.backends:
            mib, ms, note = measure(backend, length, args)
            memory[backend, length] = mib
            mib_s = "—" if mib is None else f"{mib:.1f}"
            ms_s = "—" if ms is None else f"{ms:.1f}"
            print(f"{length:>6}  {backend:<10} {mib_s:>10} {ms_s:>10}  {note}".rstrip(), flush=True)

    def ratio(a, b):
        return None if not a or not b else a / b

    scaling = ratio(memory.get(("chunked", 16384)), memory.get(("chunked", 4096)))
    saving = ratio(memory.get(("reference", 16384)), memory.get(("chunked", 16384)))
    print()
    print("chunked memory 16k / 4k:       "
          + ("—" if scaling is None else f"{scaling:.2f}") + "  (target <= 5)")
    print("reference / chunked memory 16k: "
          + ("—" if saving is None else f"{saving:.1f}") + "  (target >= 8)")


if __name__ == "__main__":
    main()
