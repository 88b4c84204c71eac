"""Offline vs on-policy Visual-OPSD: step time on the same samples, and cache bytes per sample.

One run, the toy model and toy data (configs/offline_tiny.py), one device:

* collects the teacher cache of the toy rows (offline_collect.collect, as scripts/collect_traces.py);
* times, on the same samples every step, the on-policy step (sample completions -> student and
  teacher packs -> the compiled train step with the EMA teacher's forward) and the offline step
  (text-only pack + cache read -> the compiled train step), both as train.py runs them: packs
  at the config's fixed shapes (opsd_jax/data/pack_shapes.py) into `train_step.make_train_step`
  (one donated jit: gradient, update, EMA), after a warm-up that compiles both;
* prints their ratio, and the cache bytes per sample: measured on the toy cache, and for a 7B
  shape (top-256 of a 152,064-id vocabulary, `--tokens_7b` target tokens) by writing one
  synthetic sample through the same shard writer (random ids: an upper bound for compression).

    python bench/offline.py [--steps 6] [--warmup 2] [--max_new_tokens 64] [--tokens_7b 1024]

The on-policy step samples up to `--max_new_tokens` (default 64, about the toy targets' length)
and trains on them; the offline step trains on the whole reference target. Token counts per
step are printed next to the times.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from configs import offline_tiny
from opsd_jax import run_config
from opsd_jax.data import pack_shapes
from opsd_jax.data.opsd_packs import build_prompt_pack, build_training_packs
from opsd_jax.data.pipeline import make_iterator
from opsd_jax.io.hf_load import load_hf
from opsd_jax.parallel import distributed
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.sampling import sampler
from opsd_jax.toy import assets as toy_assets
from opsd_jax.training import train_step
from opsd_jax.training.offline import cache as offline_cache
from opsd_jax.training.offline import collect as offline_collect
from opsd_jax.training.offline import views as offline_views

VOCAB_7B = 152_064
TOP_K_7B = 256
SAMPLES_7B = 24_990  # the paper's ThinkMorph training rows


def synthetic_bytes(tokens: int, top_k: int, vocab: int, logprob_dtype: str) -> int:
    """Parquet bytes of one cached sample of `tokens` target tokens at this shape."""
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(vocab, top_k, replace=False) for _ in range(tokens)])
    logits = np.sort(rng.standard_normal((tokens, top_k)) * 3.0, axis=-1)[:, ::-1]
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True) * 1.5)
    directory = tempfile.mkdtemp(prefix="opsd-bench-offline-")
    try:
        writer = offline_cache.ShardWriter(directory, 0, logprob_dtype, shard_samples=1)
        writer.add("synthetic/0", rng.integers(0, vocab, tokens), ids, logprobs, rng.random(tokens))
        return offline_cache.cache_bytes(directory)[0]
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tokens_7b", type=int, default=1024)
    # 64: about the toy targets' length, so both arms train on about as many tokens.
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--results-dir", default="/tmp/opsd_bench_offline")
    args = parser.parse_args()

    config = offline_tiny.get_config()
    with config.unlocked():
        config.results_dir = args.results_dir
        config.offline_cache_dir = os.path.join(args.results_dir, "teacher_cache")
    toy_assets.prepare_toy_assets(config)
    model, model_config, tokenizer = load_hf(
        config.model_path, config_changes={"llm": run_config.model_runtime(config)}
    )
    special, encode = tokenizer.special_tokens(), tokenizer.encode
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    data_config = run_config.data_config(config).for_model(model_config)
    options = run_config.prompt_options(config)
    mesh = mesh_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1])

    # ---- the cache --------------------------------------------------------------------------------
    shutil.rmtree(config.offline_cache_dir, ignore_errors=True)
    manifest = offline_cache.make_manifest(
        model_config,
        tokenizer,
        options,
        top_k=config.offline_top_k,
        logprob_dtype=config.offline_logprob_dtype,
        max_forward_tokens=config.max_forward_tokens,
    )
    summary = offline_collect.collect(
        collect_step=offline_collect.make_collect_step(
            graphdef, rest, top_k=config.offline_top_k, vocab_limit=tokenizer.vocab_length
        ),
        params=params,
        tokenizer=tokenizer,
        data_config=data_config,
        options=options,
        mesh=mesh,
        directory=config.offline_cache_dir,
        manifest=manifest,
        samples_per_batch=config.samples_per_micro_batch,
        rows_per_batch=config.rows_per_micro_batch,
        max_forward_tokens=config.max_forward_tokens,
        shard_samples=config.offline_shard_samples,
        log=lambda line: None,
    )
    reader = offline_cache.CacheReader(config.offline_cache_dir)

    # ---- the two steps on the same samples ---------------------------------------------------------
    # The on-policy arm: the same config in mode 'opsd' with the EMA teacher, its student rows
    # and loss entries derived for two `--max_new_tokens` completions per row (no cuts).
    online_config = config.copy_and_resolve_references()
    with online_config.unlocked():
        online_config.mode, online_config.teacher_mode = "opsd", "ema"
        online_config.sample_max_new_tokens = args.max_new_tokens
        online_config.pack_student_row_tokens = online_config.pack_loss_entries = 0
    optimizer = train_step.make_optimizer(config)
    copy = lambda: jax.tree.map(np.array, params)  # noqa: E731  (each arm donates its own)
    online_state = train_step.init_state(copy(), optimizer, "ema", jax.random.key(0))
    offline_state = train_step.init_state(copy(), optimizer, "self", jax.random.key(0))
    settings = run_config.loss_settings(config, tokenizer.vocab_length)
    schedule = train_step.learning_rate_schedule(config)
    online_step = train_step.make_train_step(
        train_step.make_opsd_loss(graphdef, rest, settings, "ema"),
        optimizer,
        teacher_mode="ema",
        ema_decay=config.ema_decay,
        schedule=schedule,
    )
    offline_step = train_step.make_train_step(
        train_step.make_offline_loss(graphdef, rest, settings),
        optimizer,
        teacher_mode="self",
        ema_decay=0.0,
        schedule=schedule,
    )
    online_shapes = pack_shapes.pack_shapes(online_config)
    offline_shapes = pack_shapes.pack_shapes(config)["offline"]
    rows, per_step = config.rows_per_micro_batch, config.samples_per_micro_batch

    def stacked(*parts):  # one micro-batch per step: [1, rows, ...] on the mesh
        return tuple(distributed.put_micro_batches([part], mesh) for part in parts)

    data = make_iterator(data_config, "train")
    samples = data.take(per_step)  # the same samples every step
    times, tokens = {"on-policy": [], "offline": []}, {"on-policy": [], "offline": []}
    split = {"on-policy": [], "offline": []}  # (sample, pack [+ cache read], train step)
    lost = {"on-policy": 0, "offline": 0}  # samples cut or dropped by the fixed shapes
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        prompt = build_prompt_pack(samples, encode, options, special)
        completions = sampler.sample(
            nnx.merge(graphdef, online_state.params, rest),
            prompt,
            jax.random.key(step),
            special=special,
            vocab_limit=tokenizer.vocab_length,
            max_new_tokens=args.max_new_tokens,
            max_image_skips=0,
        )
        ts = time.perf_counter()
        packs = build_training_packs(
            samples,
            [completions.row(i) for i in range(per_step)],
            encode,
            options,
            special,
            num_rows=rows,
            max_forward_tokens=config.max_forward_tokens,
            shapes=online_shapes,
        )
        batch = stacked(packs.student, packs.teacher)
        tp = time.perf_counter()
        with mesh_lib.use_mesh(mesh):
            online_state, _ = online_step(online_state, batch)
        jax.block_until_ready(online_state)
        t1 = time.perf_counter()
        offline = offline_views.offline_batch(
            samples,
            reader,
            encode,
            options,
            special,
            num_rows=rows,
            max_forward_tokens=config.max_forward_tokens,
            shapes=offline_shapes,
        )
        batch = stacked(offline.pack, offline.cache)
        tq = time.perf_counter()
        with mesh_lib.use_mesh(mesh):
            offline_state, _ = offline_step(offline_state, batch)
        jax.block_until_ready(offline_state)
        t2 = time.perf_counter()
        if step >= args.warmup:
            times["on-policy"].append(t1 - t0)
            times["offline"].append(t2 - t1)
            split["on-policy"].append((ts - t0, tp - ts, t1 - tp))
            split["offline"].append((0.0, tq - t1, t2 - tq))
            tokens["on-policy"].append(int(packs.student.loss_mask.sum()))
            tokens["offline"].append(int(offline.pack.loss_mask.sum()))
        lost["on-policy"] += packs.num_truncated + packs.num_dropped
        lost["offline"] += offline.num_dropped

    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; toy model "
        f"({sum(x.size for x in jax.tree.leaves(params)):,} parameters), {per_step} samples "
        f"per step in {rows} rows, {args.steps} timed steps after {args.warmup} warm-up"
    )
    for arm in times:
        print(
            f"  {arm:>9}: {np.mean(times[arm]) * 1e3:8.1f} ms/step, "
            f"{np.mean(tokens[arm]):.0f} trained tokens/step; sample / pack (+ cache read) / "
            "train step "
            + " / ".join(f"{x * 1e3:.1f}" for x in np.mean(split[arm], 0))
            + f" ms; {lost[arm]} samples cut or dropped"
        )
    ratio = np.mean(times["on-policy"]) / np.mean(times["offline"])
    print(f"  on-policy / offline step time: {ratio:.2f}x")

    total, count = offline_cache.cache_bytes(config.offline_cache_dir)
    entries = np.mean([len(reader.lookup(k).target_ids) for k in reader.keys()])
    print(
        f"\ncache, tiny: {count} samples ({summary.seconds:.1f}s to collect), {total / count:,.0f}"
        f" bytes/sample, {entries:.0f} target tokens/sample, top-{config.offline_top_k} "
        f"{config.offline_logprob_dtype}"
    )
    for dtype in ("float16", "float32"):
        size = synthetic_bytes(args.tokens_7b, TOP_K_7B, VOCAB_7B, dtype)
        raw = args.tokens_7b * (TOP_K_7B * (np.dtype(dtype).itemsize + 4) + 4 + 4)
        print(
            f"cache, 7B shape: {args.tokens_7b} target tokens, top-{TOP_K_7B} {dtype} + int32 "
            f"ids: {size / 1e6:.2f} MB/sample (raw {raw / 1e6:.2f} MB), "
            f"{size * SAMPLES_7B / 1e9:.1f} GB for {SAMPLES_7B:,} samples"
        )


if __name__ == "__main__":
    main()
