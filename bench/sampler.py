"""Sampler throughput: prefill time, decode tokens/s, the decode loop's overhead, refresh cost.

For each batch size B the script prefills B prompts ([16x16-patch image, 20-token question])
and samples `--new-tokens` tokens per row, then times bare decode steps of the same model for
the same B (one token per row through every layer with the KV cache, in a jitted loop of the
same length; no sampling, no stopping logic, no bookkeeping). The ratio of the sampler's per-step time to the bare loop's per-step time is the cost
of the loop, sampling and bookkeeping. The compiled temp memory of a decode round next to the
cache size shows that the (donated) cache is updated in place, not copied.

The sampler decodes on a decode copy (opsd_jax/sampling/decode_copy.py: the fp32 params cast to the
compute dtype, laid out by `--layout`); `refresh ms` is the time to make it (once per training
step), next to the rollout time (prefill + decode round) it serves. `fp32 params tok/s` decodes
on the fp32 parameters as the sampler did before the copy existed, in the same run.

    python bench/sampler.py                       # tiny and the ~64M config, B = 1, 8, 32, 128
    python bench/sampler.py --configs m64 --batch-sizes 1 32
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd

from models.bagel import Bagel
from models.configs import BagelConfig
from opsd_jax.data.image_transform import patchify, vit_position_ids
from opsd_jax.data.packing import Image, SpecialTokens, Text, pack_samples
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.sampling import decode_copy, sampler

CONFIGS = {"tiny": BagelConfig.tiny, "m64": BagelConfig.small_64m}


def prompt_pack(config, batch, special, rng):
    samples = []
    for _ in range(batch):
        pixels = rng.uniform(-1, 1, (14 * 16, 14 * 16, 3)).astype(np.float32)
        image = Image(patchify(pixels), vit_position_ids(16, 16))
        question = rng.integers(1, special.im_start, 20).tolist()
        samples.append([image, Text(question)])
    return pack_samples(samples, row_length=256 + 2 + 22, special=special, one_sample_per_row=True)


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


@functools.partial(jax.jit, static_argnums=(0, 3), donate_argnums=(2,))
def bare_decode_steps(graphdef, params, state, steps):
    """`steps` plain decode steps in the same kind of jitted loop as the sampler's: the forward
    with its in-place cache write (sampler.feed_tokens), feeding a fixed token; no sampling, no stop
    logic, no token bookkeeping."""
    tokens = jnp.full(state.kv_length.shape, 5, jnp.int32)

    def cond(carry):
        return carry[2] < steps

    def body(carry):
        params, state, step, acc = carry
        logits, state = sampler.feed_tokens(
            nnx.merge(graphdef, params), state, tokens, state.active
        )
        # max over the vocabulary: the whole lm_head is computed, as when sampling.
        return params, state, step + 1, acc + jnp.max(logits, axis=-1).astype(jnp.float32)

    acc = jnp.zeros(tokens.shape, jnp.float32)
    _, state, _, acc = jax.lax.while_loop(cond, body, (params, state, jnp.int32(0), acc))
    return acc, state


def bench_config(name, batch_sizes, new_tokens, repeats, layout):
    config = CONFIGS[name]()
    model = Bagel(config, rngs=nnx.Rngs(0))
    graphdef, fp32_params = nnx.split(model)
    mesh = mesh_lib.make_mesh()

    def refresh():
        return decode_copy.make_decode_copy(
            graphdef, fp32_params, layout=layout, mesh=mesh, dtype=config.llm.compute_dtype
        )

    refresh().delete()  # compile
    refresh_s = timed(lambda: refresh().state, repeats)
    copy = refresh()
    # The copy has its own module structure (fused projections): its state decodes only with its
    # own graphdef; the fp32 params with the training model's.
    decode_model = (copy.graphdef, copy.state)
    fp32_model = (graphdef, fp32_params)
    lm_params = sum(x.size for x in jax.tree.leaves(nnx.state(model.language_model, nnx.Param)))
    vocab = config.llm.vocab_size
    special = SpecialTokens(*range(vocab - 4, vocab))
    settings = sampler.round_settings(special, vocab - 4, new_tokens, 1.0, True)
    print(
        f"\nconfig {name}: {lm_params / 1e6:.1f}M LM parameters, {config.llm.compute_dtype} "
        f"compute, bf16 cache, prompt = 256 patches + 20 text tokens, {new_tokens} new tokens; "
        f"'{layout}' decode copy {copy.nbytes / 2**20:.1f} MiB, refresh "
        f"{refresh_s * 1e3:.1f} ms"
    )
    header = (
        f"{'B':>5} {'prefill ms':>11} {'fp32 params tok/s':>18} {'decode tok/s':>13} "
        f"{'step ms':>9} {'bare step ms':>13} {'overhead':>9} {'refresh ms':>11} "
        f"{'rollout s':>10} {'cache MiB':>10} {'round temp MiB':>15}"
    )
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    results, bare_results = {}, {}
    with copy.activate():  # the decode mesh and rules, as sampler.sample(copy) runs
        rules = tuple(spmd.get_logical_axis_rules())
    for batch in batch_sizes:
        pack = prompt_pack(config, batch, special, rng)
        slots = sampler.cache_slots_for(pack.row_length, new_tokens)
        row_ids = jnp.arange(batch, dtype=jnp.int32)

        def prefill(model=decode_model):
            return sampler.prefill_rows(*model, pack, new_tokens, slots, jnp.bfloat16, rules)

        def decode(model=decode_model):
            state = prefill(model)
            jax.block_until_ready(state)
            start = time.perf_counter()
            state = sampler.decode_round(*model, state, jax.random.key(1), row_ids, settings, rules)
            jax.block_until_ready(state)
            return time.perf_counter() - start, int(state.length.sum())

        with copy.activate():
            jax.block_until_ready(prefill())  # compile
            prefill_s = timed(prefill, repeats)
            decode()  # compile
            runs = [decode() for _ in range(repeats)]
            # Before the decode copy: the same sampler on the fp32 params (cast at every use).
            decode(fp32_model)  # compile
            fp32_runs = [decode(fp32_model) for _ in range(repeats)]
        decode_s = float(np.median([r[0] for r in runs]))
        fp32_decode_s = float(np.median([r[0] for r in fp32_runs]))
        generated = runs[0][1]
        steps = generated / batch + 1  # every row also feeds <|im_start|>

        state = prefill()
        lowered = sampler.decode_round.lower(
            *decode_model, state, jax.random.key(1), row_ids, settings, rules
        )
        round_temp = lowered.compile().memory_analysis().temp_size_in_bytes
        cache_bytes = state.cache.size * state.cache.dtype.itemsize

        bare_steps = int(round(steps))

        def bare():
            fresh = prefill()
            jax.block_until_ready(fresh)
            start = time.perf_counter()
            jax.block_until_ready(bare_decode_steps(*decode_model, fresh, bare_steps))
            return time.perf_counter() - start

        bare()  # compile
        bare_s = float(np.median([bare() for _ in range(repeats)])) / bare_steps
        step_s = decode_s / steps
        results[batch] = generated / decode_s
        bare_results[batch] = batch / bare_s
        print(
            f"{batch:>5} {prefill_s * 1e3:>11.1f} {runs[0][1] / fp32_decode_s:>18.1f} "
            f"{generated / decode_s:>13.1f} {step_s * 1e3:>9.2f} {bare_s * 1e3:>13.2f} "
            f"{step_s / bare_s - 1:>+9.1%} {refresh_s * 1e3:>11.1f} "
            f"{prefill_s + decode_s:>10.3f} {cache_bytes / 2**20:>10.1f} "
            f"{round_temp / 2**20:>15.1f}"
        )
    if 1 in results and 32 in results:
        print(
            f"decode tokens/s B=32 / B=1: {results[32] / results[1]:.2f}x (target >= 3.5x); "
            f"the bare forward alone: {bare_results[32] / bare_results[1]:.2f}x, the ceiling "
            "for any sampler of this model on this machine"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["tiny", "m64"], choices=sorted(CONFIGS))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32, 128])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layout", default="replicated", choices=sorted(mesh_lib.SAMPLER_LAYOUTS))
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.device_count()} device)")
    for name in args.configs:
        bench_config(name, args.batch_sizes, args.new_tokens, args.repeats, args.layout)


if __name__ == "__main__":
    main()
