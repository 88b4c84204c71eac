"""Memory and speed of the generalized-JSD loss paths, value and gradient w.r.t. the student.

Three ways to compute the default OPSD loss (beta 0.5, tau 1, per-entry clip 0.05, seq_mean) on
C completion rows over a V-entry vocabulary, bf16 logits:

* top-k     - opsd_jax.training.losses, teacher top-k support (k = 256 by default);
* chunked   - opsd_jax.training.losses, full vocabulary, rows in chunks (top_k = 0);
* naive     - full vocabulary in one go: fp32 log-softmax of both sides over [C, V], as a
              straightforward port of the PyTorch loss would do.

For each, XLA's memory analysis of the compiled jit(value_and_grad) gives the temp (working)
memory: what the computation needs beyond its inputs and outputs, which are the same for all
three (two [C, V] bf16 inputs, one [C, V] bf16 gradient). It is known without running, so the
naive path is analysed even at sizes that cannot run here. Times are the median wall time of
the compiled executable on random logits. The naive path is timed at a smaller C (it needs
~30 GB of temp memory at C = 4096, V = 152064), and the other two are timed there as well so
the three can be compared.

    python bench/losses.py [--rows 4096] [--vocab 152064] [--top-k 256] [--time-rows-small 256]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

# Run as a plain script from anywhere: make the repository root importable.
import jax
import jax.numpy as jnp

from opsd_jax.training import losses

MIB = 1 << 20
BETA, TEMPERATURE, CLIP = 0.5, 1.0, 0.05


def naive_jsd(student, teacher, mask):
    """Same loss as losses.generalized_jsd(top_k=0) with every [C, V] intermediate in fp32."""
    student_logp = jax.nn.log_softmax(student.astype(jnp.float32) / TEMPERATURE)
    teacher_logp = jax.nn.log_softmax(teacher.astype(jnp.float32) / TEMPERATURE)
    p, q = jnp.exp(student_logp), jnp.exp(teacher_logp)
    log_m = jnp.logaddexp(math.log(BETA) + teacher_logp, math.log1p(-BETA) + student_logp)
    entries = BETA * q * (teacher_logp - log_m) + (1 - BETA) * p * (student_logp - log_m)
    entries = jnp.where(entries > CLIP, CLIP, entries)
    rows = jnp.where(mask, entries.sum(-1), 0.0)
    return jnp.sum(rows) / jnp.maximum(jnp.sum(mask), 1) * TEMPERATURE**2


def library_jsd(top_k, chunk_rows):
    def loss(student, teacher, mask):
        value, _ = losses.generalized_jsd(
            student,
            teacher,
            mask,
            beta=BETA,
            temperature=TEMPERATURE,
            top_k=top_k,
            clip=CLIP,
            chunk_rows=chunk_rows,
        )
        return value

    return loss


def compile_value_and_grad(loss, rows, vocab):
    logits = jax.ShapeDtypeStruct((rows, vocab), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((rows,), jnp.bool_)
    return jax.jit(jax.value_and_grad(loss)).lower(logits, logits, mask).compile()


def random_inputs(rows, vocab, seed=0):
    """Teacher logits ~ 3 N(0, 1); the student is the teacher plus N(0, 1) noise (bf16)."""
    teacher_key, noise_key = jax.random.split(jax.random.key(seed))

    @jax.jit
    def make():
        teacher = 3.0 * jax.random.normal(teacher_key, (rows, vocab), jnp.bfloat16)
        student = teacher + jax.random.normal(noise_key, (rows, vocab), jnp.bfloat16)
        return student, teacher, jnp.ones((rows,), bool)

    return jax.block_until_ready(make())


def time_compiled(compiled, inputs, repeats):
    """(median seconds, loss value) over `repeats` runs of an ahead-of-time compiled function."""
    times, value = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        value, grad = jax.block_until_ready(compiled(*inputs))
        times.append(time.perf_counter() - start)
        del grad
    return statistics.median(times), float(value)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096, help="completion rows C")
    parser.add_argument("--vocab", type=int, default=152064, help="vocabulary size V")
    parser.add_argument("--top-k", type=int, default=256)
    parser.add_argument("--chunk-rows", type=int, default=losses.DEFAULT_CHUNK_ROWS)
    parser.add_argument(
        "--time-rows-small",
        type=int,
        default=256,
        help="C at which all three paths are timed (the naive one only there)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per setting")
    parser.add_argument("--skip-full-run", action="store_true", help="only time the small C")
    args = parser.parse_args()

    paths = {
        f"top-k (k={args.top_k})": library_jsd(args.top_k, args.chunk_rows),
        f"chunked full vocab ({args.chunk_rows} rows)": library_jsd(0, args.chunk_rows),
        "naive full vocab (fp32 [C, V])": naive_jsd,
    }
    print(
        f"generalized JSD value+grad, V={args.vocab}, bf16 logits, beta={BETA}, clip={CLIP}, "
        f"{jax.devices()[0].platform} x{jax.device_count()}"
    )
    print(
        f"inputs 2 x [C, V] bf16 = {2 * args.rows * args.vocab * 2 / MIB:.0f} MiB and gradient "
        f"output {args.rows * args.vocab * 2 / MIB:.0f} MiB at C={args.rows}: not counted below"
    )

    # Memory at the full size, for all three paths.
    temp_mib = {}
    compiled_full = {}
    for name, loss in paths.items():
        compiled = compile_value_and_grad(loss, args.rows, args.vocab)
        temp_mib[name] = compiled.memory_analysis().temp_size_in_bytes / MIB
        compiled_full[name] = compiled

    # Time: the library paths at the full size, all three at the small size.
    timings = {}
    settings = [(args.time_rows_small, list(paths))]
    if not args.skip_full_run:
        settings.insert(0, (args.rows, list(paths)[:2]))
    for rows, names in settings:
        inputs = random_inputs(rows, args.vocab)
        for name in names:
            if rows == args.rows:
                compiled = compiled_full[name]
            else:
                compiled = compile_value_and_grad(paths[name], rows, args.vocab)
            timings[name, rows] = time_compiled(compiled, inputs, args.repeats)
        del inputs

    header = f"{'path':<34} {'temp MiB @C=' + str(args.rows):>16}"
    for rows, _ in settings:
        header += f" {'s @C=' + str(rows):>11} {'loss @C=' + str(rows):>12}"
    print(header)
    for name in paths:
        line = f"{name:<34} {temp_mib[name]:>16.1f}"
        for rows, _ in settings:
            if (name, rows) in timings:
                seconds, value = timings[name, rows]
                line += f" {seconds:>11.2f} {value:>12.5f}"
            else:
                line += f" {'(no run)':>11} {'':>12}"
        print(line)

    naive = temp_mib["naive full vocab (fp32 [C, V])"]
    top_k = temp_mib[f"top-k (k={args.top_k})"]
    ratio = naive / top_k
    verdict = "OK" if ratio > 50 else "FAIL"
    print(f"top-k temp memory = 1/{ratio:.0f} of naive (requirement: < 1/50): {verdict}")
    print(
        f"naive timed at C={args.time_rows_small} only: at C={args.rows} it needs "
        f"{naive / 1024:.1f} GiB of temp memory"
    )


if __name__ == "__main__":
    main()
