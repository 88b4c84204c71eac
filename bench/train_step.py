"""Train-step figures: time split, tokens/s, compiled memory per shape bucket, recompilations.

Runs the trainer's pieces (sampler -> student/teacher packs -> grad step -> update) on the toy
model and toy data, with completion lengths drawn at random each step (the sampler's output is
cut to a random length), so the packs fall into different length buckets. It prints:

* the mean time per step split into sample / pack / grad / update, and tokens/s;
* the compiled temp memory of the grad step for every (student, teacher) shape bucket met;
* how many new compilations happened after the warm-up (target: 0).

    python bench/train_step.py [--steps 20] [--warmup 8] [--results-dir /tmp/bench_train]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import train  # noqa: E402
from configs import tiny  # noqa: E402
from opsd_jax import evaluation, sampler, train_step  # noqa: E402
from opsd_jax.data.pipeline import make_iterator  # noqa: E402
from opsd_jax.data.sources import DataConfig  # noqa: E402
from opsd_jax.hf import load_hf  # noqa: E402
from opsd_jax.opsd_packs import build_prompt_pack, build_training_packs  # noqa: E402


def compiled_count(*functions) -> int:
    return sum(f._cache_size() for f in functions)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--results-dir", default="/tmp/opsd_bench_train_step")
    args = parser.parse_args()

    config = tiny.get_config()
    with config.unlocked():
        config.results_dir = args.results_dir
    train.prepare_toy_assets(config)
    model, _, tokenizer = load_hf(config.model_path, config_changes={"llm": dict(
        compute_dtype=config.compute_dtype, remat=config.remat)})  # fmt: skip
    special = tokenizer.special_tokens()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    data_config = DataConfig.from_dict(dict(config.data.to_dict(), seed=0)).for_model(model.config)
    data = make_iterator(data_config, "train")
    options = evaluation.prompt_options_from_config(config)
    optimizer = train_step.make_optimizer(config, params)
    state = train_step.init_state(params, optimizer, config.teacher_mode, jax.random.key(0))
    settings = train.loss_settings(config, tokenizer.vocab_length)
    grad_step = train_step.make_grad_step(graphdef, rest, settings,
                                          config.teacher_mode)  # fmt: skip
    apply_update = train_step.make_apply_update(optimizer, config.teacher_mode, config.ema_decay)
    per_micro, accum = config.samples_per_micro_batch, config.gradient_accumulation_steps
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; toy model, {accum} x "
          f"{per_micro} samples per step, completions cut to 1..{config.sample_max_new_tokens} "
          f"tokens at random")  # fmt: skip

    timings = {"sample": [], "pack": [], "grad": [], "update": []}
    tokens_per_step, buckets = [], {}
    functions = (grad_step, apply_update, sampler._decode_round, sampler._prefill)
    compiles_after_warmup = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            compiles_after_warmup = compiled_count(*functions)
        samples = data.take(accum * per_micro)
        t0 = time.perf_counter()
        prompt = build_prompt_pack(samples, tokenizer.encode, options, special)
        completions = sampler.sample(
            nnx.merge(graphdef, state.params, rest), prompt, jax.random.key(step),
            special=special, vocab_limit=tokenizer.vocab_length,
            max_new_tokens=config.sample_max_new_tokens, max_image_skips=0,
        )  # fmt: skip
        t1 = time.perf_counter()
        grads, pack_s, grad_s, tokens = None, 0.0, 0.0, 0
        for micro in range(accum):
            chunk = range(micro * per_micro, (micro + 1) * per_micro)
            # Warm-up walks completion lengths from 1 to the maximum, so every loss-entry bucket
            # (powers of two) is compiled once; after it, lengths are random.
            if step < args.warmup:
                top = config.sample_max_new_tokens
                lengths = [max(1, round(top * step / max(args.warmup - 1, 1)))] * per_micro
            else:
                lengths = rng.integers(1, config.sample_max_new_tokens + 1, per_micro)
            cut = [completions.row(i)[:n] for i, n in zip(chunk, lengths)]
            p0 = time.perf_counter()
            packs = build_training_packs([samples[i] for i in chunk], cut, tokenizer.encode,
                                         options, special, num_rows=config.rows_per_micro_batch,
                                         max_forward_tokens=config.max_forward_tokens)  # fmt: skip
            p1 = time.perf_counter()
            micro_grads, _ = grad_step(state.params, state.teacher_params, packs.student,
                                       packs.teacher)  # fmt: skip
            jax.block_until_ready(micro_grads)
            p2 = time.perf_counter()
            grads = micro_grads if grads is None else jax.tree.map(np.add, grads, micro_grads)
            pack_s, grad_s = pack_s + p1 - p0, grad_s + p2 - p1
            tokens += int(
                (packs.student.segment_ids > 0).sum() + (packs.teacher.segment_ids > 0).sum()
            )
            key = (packs.student.tokens.shape, packs.student.vit_patches.shape[1],
                   packs.teacher.tokens.shape, packs.teacher.vit_patches.shape[1],
                   packs.student.loss_rows.shape)  # fmt: skip
            if key not in buckets:
                lowered = grad_step.lower(state.params, state.teacher_params, packs.student,
                                          packs.teacher)  # fmt: skip
                buckets[key] = lowered.compile().memory_analysis().temp_size_in_bytes
        u0 = time.perf_counter()
        state, _ = apply_update(state, grads, accum)
        jax.block_until_ready(state)
        u1 = time.perf_counter()
        if step >= args.warmup:
            timings["sample"].append(t1 - t0)
            timings["pack"].append(pack_s)
            timings["grad"].append(grad_s)
            timings["update"].append(u1 - u0)
            tokens_per_step.append(tokens)
    new_compiles = compiled_count(*functions) - compiles_after_warmup

    total = sum(np.mean(v) for v in timings.values())
    print(f"\nmean step time over {args.steps} steps: {total * 1e3:.1f} ms  "
          + "  ".join(f"{k} {np.mean(v) * 1e3:.1f} ms ({np.mean(v) / total:.0%})"
                      for k, v in timings.items()))  # fmt: skip
    print(f"tokens/s (student + teacher pack tokens): {np.mean(tokens_per_step) / total:.0f}")
    print("\ngrad-step compiled temp memory per shape bucket "
          "(student rows x length, patches | teacher rows x length, patches | loss entries):")  # fmt: skip
    for (s_shape, s_patches, t_shape, t_patches, loss), temp in sorted(buckets.items()):
        print(f"  {s_shape[0]} x {s_shape[1]:>4}, {s_patches:>4} | {t_shape[0]} x {t_shape[1]:>4}, "
              f"{t_patches:>4} | {loss[1]:>3}: {temp / 2**20:8.2f} MiB")  # fmt: skip
    print(f"\nnew compilations after the {args.warmup}-step warm-up: {new_compiles} (target: 0)")


if __name__ == "__main__":
    main()
