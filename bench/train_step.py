"""Train-step figures: time split, tokens/s, padding, compiled memory per bucket, recompilations.

Runs the trainer's pieces (sampler -> student/teacher packs at the config's fixed shapes ->
the one compiled train step) on the toy model and toy data, with completion lengths drawn at
random each step (the sampler's output is cut to a random length). The train step is compiled
ahead of time for every length bucket, as train.py does. It prints:

* the mean time per step split into sample / pack / step, and tokens/s;
* the padding fraction of the student and teacher packs;
* the compiled temp memory of the train step for every length bucket;
* how many new compilations happened after the warm-up (target: 0).

    python bench/train_step.py [--steps 50] [--warmup 8] [--results-dir /tmp/bench_train]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from configs import smoke
from models import attention
from opsd_jax import run_config
from opsd_jax.data import pack_shapes
from opsd_jax.data.opsd_packs import build_prompt_pack, build_training_packs, shaped_pack
from opsd_jax.data.pipeline import make_iterator
from opsd_jax.io.checkpoint import abstract_like
from opsd_jax.io.hf_load import load_hf
from opsd_jax.parallel import distributed
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.sampling import sampler
from opsd_jax.toy import assets as toy_assets
from opsd_jax.training import (
    train_step,
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--results-dir", default="/tmp/opsd_bench_train_step")
    parser.add_argument(
        "--attention-backend",
        default=None,
        choices=attention.BACKENDS,
        help="default: configs/smoke.py's",
    )
    args = parser.parse_args()

    config = smoke.get_config()
    with config.unlocked():
        config.results_dir = args.results_dir
        if args.attention_backend:
            config.attention_backend = args.attention_backend
    toy_assets.prepare_toy_assets(config)
    mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
    model, _, tokenizer = load_hf(
        config.model_path, mesh=mesh, config_changes={"llm": run_config.model_runtime(config)}
    )
    special = tokenizer.special_tokens()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    data_config = run_config.data_config(config).for_model(model.config)
    data = make_iterator(data_config, "train")
    options = run_config.prompt_options(config)
    optimizer = train_step.make_optimizer(config)
    rng = jax.random.key(0)
    abstract = train_step.abstract_state(abstract_like(params), optimizer, config.teacher_mode, rng)
    state = jax.device_put(
        train_step.init_state(params, optimizer, config.teacher_mode, rng),
        train_step.shardings_of(abstract),
    )
    per_micro, accum = config.samples_per_micro_batch, config.gradient_accumulation_steps
    rows = config.rows_per_micro_batch
    loss_fn = train_step.make_opsd_loss(
        graphdef, rest, run_config.loss_settings(config), config.teacher_mode
    )
    step_fn = run_config.train_step_for(config, loss_fn, optimizer, abstract)
    shapes = pack_shapes.pack_shapes(config)
    compiled, temp_memory = [], []
    for bucket in range(config.pack_length_buckets):
        batch = tuple(
            distributed.abstract_micro_batches(
                shaped_pack([], shapes[name][bucket], rows, special, [], fixed=True), accum, mesh
            )
            for name in ("student", "teacher")
        )
        t0 = time.perf_counter()
        with mesh_lib.use_mesh(mesh):
            compiled.append(step_fn.lower(abstract, batch).compile())
        temp_memory.append(compiled[-1].memory_analysis().temp_size_in_bytes)
        print(f"compiling the train step for bucket {bucket}: {time.perf_counter() - t0:.1f} s")
    rng = np.random.default_rng(0)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; toy model, {accum} x "
        f"{per_micro} samples per step, completions cut to 1..{config.sample_max_new_tokens} "
        f"tokens at random"
    )

    timings = {"sample": [], "pack": [], "step": []}
    tokens_per_step, padding = [], {"student": [], "teacher": []}
    compiles_after_warmup = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            compiles_after_warmup = jax_compiles[0]
        samples = data.take(accum * per_micro)
        t0 = time.perf_counter()
        prompt = build_prompt_pack(samples, tokenizer.encode, options, special)
        completions = sampler.sample(
            nnx.merge(graphdef, state.params, rest),
            prompt,
            jax.random.key(step),
            special=special,
            vocab_limit=tokenizer.vocab_length,
            max_new_tokens=config.sample_max_new_tokens,
            max_image_skips=0,
        )
        t1 = time.perf_counter()
        micro, tokens, buckets = [], 0, set()
        for m in range(accum):
            chunk = range(m * per_micro, (m + 1) * per_micro)
            # Warm-up walks completion lengths from 1 to the maximum; after it, random lengths.
            if step < args.warmup:
                top = config.sample_max_new_tokens
                lengths = [max(1, round(top * step / max(args.warmup - 1, 1)))] * per_micro
            else:
                lengths = rng.integers(1, config.sample_max_new_tokens + 1, per_micro)
            cut = [completions.row(i)[:n] for i, n in zip(chunk, lengths)]
            packs = build_training_packs(
                [samples[i] for i in chunk],
                cut,
                tokenizer.encode,
                options,
                special,
                num_rows=rows,
                max_forward_tokens=config.max_forward_tokens,
                shapes=shapes,
            )
            micro.append((packs.student, packs.teacher))
            buckets.add(packs.bucket)
            tokens += int(
                (packs.student.segment_ids > 0).sum() + (packs.teacher.segment_ids > 0).sum()
            )
            for name, fraction in packs.padding_fraction.items():
                padding[name].append(fraction)
        # train.py repacks a step's micro-batches into one bucket; here each is packed alone.
        assert len(buckets) == 1, "micro-batches in different length buckets: use 1 bucket"
        bucket = buckets.pop()
        batch = tuple(distributed.put_micro_batches([p[i] for p in micro], mesh) for i in range(2))
        t2 = time.perf_counter()
        state, metrics = compiled[bucket](state, batch)
        jax.block_until_ready(metrics)
        t3 = time.perf_counter()
        if step >= args.warmup:
            timings["sample"].append(t1 - t0)
            timings["pack"].append(t2 - t1)
            timings["step"].append(t3 - t2)
            tokens_per_step.append(tokens)
    new_compiles = jax_compiles[0] - compiles_after_warmup

    total = sum(np.mean(v) for v in timings.values())
    print(
        f"\nmean step time over {args.steps} steps: {total * 1e3:.1f} ms  "
        + "  ".join(
            f"{k} {np.mean(v) * 1e3:.1f} ms ({np.mean(v) / total:.0%})" for k, v in timings.items()
        )
    )
    print(f"tokens/s (student + teacher pack tokens): {np.mean(tokens_per_step) / total:.0f}")
    print("padding fraction: " + ", ".join(f"{k} {np.mean(v):.1%}" for k, v in padding.items()))
    print(
        "\ntrain-step compiled temp memory per length bucket "
        "(student length, patches | teacher length, patches | loss entries):"
    )
    for bucket, temp in enumerate(temp_memory):
        s_shape, t_shape = shapes["student"][bucket], shapes["teacher"][bucket]
        print(
            f"  {s_shape.row_length:>5}, {s_shape.patches:>4} | {t_shape.row_length:>5}, "
            f"{t_shape.patches:>4} | {t_shape.loss_entries:>4}: {temp / 2**20:8.2f} MiB"
        )
    print(f"\nnew compilations after the {args.warmup}-step warm-up: {new_compiles} (target: 0)")


# Every XLA compilation in the process: the train step, the sampler, and any small op.
jax_compiles = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _secs, **_: (
        jax_compiles.__setitem__(0, jax_compiles[0] + 1)
        if event == "/jax/core/compile/backend_compile_duration"
        else None
    )
)


if __name__ == "__main__":
    main()
