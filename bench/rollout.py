"""Rollout decode throughput: the continuous-batching engine against static batches, one run.

    python bench/rollout.py                                  # B = 16, 64 prompts, means 201, 452
    python bench/rollout.py --prompts 6 --slots 2 --cap 12 --means 4 --rollout-steps 3   # quick

ThinkMorph's completions average 452 tokens before Visual-OPSD and 201 after (the paper's
Appendix G), capped at 1024. A static batch (`sampler.sample`, as the evaluator and the training
rollout run it today) decodes until its longest row ends; the engine
(opsd_jax/sampling/engine.py) refills a slot as soon as its row ends.

The model is the tiny BAGEL (random weights, float32) behind `ForcedLengths`, which ends sample
i's completion after exactly lengths[i] tokens (its `<|im_end|>` logit forced then, masked
before), so both sides decode the same tokens, greedily. The lengths are drawn from an
exponential distribution of the stated mean, rounded, capped at `--cap` and at least 1 (seeded;
the printed mean is the drawn one). Each side runs the prompts twice and the second pass is
timed (the first compiles). Useful tokens/s: the completion tokens over the timed wall time.

Then the training rollout's phase per step (`--rollout-steps` steps of B prompts, one engine
across them, as trainer/rollout.py runs it) with rollout_lookahead 0 and 1: with lookahead the
next step's prompts take the slots a step's finished rows free, so a step starts with rows
already under way. The weights do not change here (no train step), so both give the same
completions, which the bench checks.

On a CPU the tiny model's decode step is cheap against the host's work per call, so the ratio
of decode steps (printed beside it) says more than the ratio of times about a GPU, where a 7B
decode step is what the time is spent on.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.bagel import Bagel
from models.configs import BagelConfig
from opsd_jax.data.packing import SpecialTokens, Text, pack_samples
from opsd_jax.sampling import engine as engine_lib
from opsd_jax.sampling import sampler

import rollout_schedule  # bench/rollout_schedule.py, beside this script  # isort: skip

SPECIAL = SpecialTokens(im_start=1000, im_end=1001, vision_start=1002, vision_end=1003)
VOCAB_LIMIT = 1004  # the tiny model's 1024 embedding rows past the special ids are padding
FIRST_KEY = 10  # prompt i is `<|im_start|> (FIRST_KEY + i) <|im_end|>`


class ForcedLengths(nnx.Module):
    """`model`, with the completion of the prompt whose first token is k ended after exactly
    lengths[k] tokens. The length and the prompt's size ride in one extra cache layer (slots 0
    and 1 of its keys), so they follow the row into whatever slot it is decoded in."""

    def __init__(self, model, lengths_by_token: np.ndarray, eos_id: int):
        self.model = model
        self.lengths = nnx.Variable(jnp.asarray(lengths_by_token, jnp.int32))
        self.eos_id = eos_id

    def prefill(self, pack):
        out, (k, v) = self.model.prefill(pack)
        _, rows, length, heads, dim = k.shape
        target = self.lengths[...][pack.tokens[:, 1]].astype(k.dtype)
        prompt = (pack.segment_ids > 0).sum(axis=1).astype(k.dtype)
        extra = jnp.zeros((1, rows, length, heads, dim), k.dtype)
        extra = extra.at[0, :, 0].set(target[:, None, None]).at[0, :, 1].set(prompt[:, None, None])
        return out, (jnp.concatenate([k, extra]), jnp.concatenate([v, extra]))

    def decode_step(self, tokens, positions, cache, write_slots, kv_lengths):
        logits, inner = self.model.decode_step(
            tokens, positions, cache[:-1], write_slots, kv_lengths
        )
        target = cache[-1, :, 0, 0, 0, 0].astype(jnp.int32)
        prompt = cache[-1, :, 1, 0, 0, 0].astype(jnp.int32)
        done = (kv_lengths - prompt - 1) >= target  # tokens fed after <|im_start|>
        is_eos = (jnp.arange(logits.shape[-1]) == self.eos_id)[None]
        big = jnp.asarray(1e4, logits.dtype)
        logits = jnp.where(
            done[:, None], jnp.where(is_eos, big, -big), jnp.where(is_eos, -big, logits)
        )
        return logits, jnp.concatenate([inner, cache[-1:]])


def static_batches(model, pack, rows: int, settings: dict) -> list[list[int]]:
    """Today's shape: consecutive batches of `rows` prompts, each decoded until its longest row
    ends."""
    completions = []
    for first in range(0, pack.num_rows, rows):
        index = np.arange(first, min(first + rows, pack.num_rows))
        part = jax.tree.map(lambda x: x[index], pack)
        out = sampler.sample(model, part, jax.random.key(0), row_ids=index, **settings)
        completions += out.rows()
    return completions


def rollout_phase(model, lengths: np.ndarray, slots: int, lookahead: int, settings: dict):
    """The training rollout's shape: step after step, `slots` prompts each, one engine across
    the steps (`trainer/rollout.py`). With `lookahead` k the next k steps' prompts are queued
    behind the step's, take the slots its finished rows free, and pause when it is done.
    Returns (seconds per step, decode steps per step, completions by prompt)."""
    keys = FIRST_KEY + np.arange(len(lengths))
    steps = len(lengths) // slots
    packs = [
        pack_samples(
            [[Text([int(k)])] for k in keys[s * slots : (s + 1) * slots]],
            row_length=8,
            special=SPECIAL,
            one_sample_per_row=True,
        )
        for s in range(steps)
    ]
    engine = engine_lib.Engine(model, pool_size=slots, prompt_length=8, **settings)
    submitted, seconds, completions = {}, [], []
    for step in range(steps):
        start = time.perf_counter()
        for at in range(step, min(step + lookahead + 1, steps)):
            if at not in submitted:
                ids = np.arange(at * slots, (at + 1) * slots)
                submitted[at] = engine.submit(packs[at], jax.random.key(0), row_ids=ids)
        batch = engine.finish(submitted.pop(step), version=step)
        seconds.append(time.perf_counter() - start)
        completions += batch.out.rows()
    return float(np.mean(seconds)), engine.decode_steps / steps, completions


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16, help="B: slots, and static batch rows")
    parser.add_argument("--cap", type=int, default=1024, help="max new tokens")
    parser.add_argument("--means", type=float, nargs="+", default=[201, 452])
    parser.add_argument("--chunk-steps", type=int, default=64, help="the engine's decode chunk")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rollout-steps",
        type=int,
        default=8,
        help="training steps of B prompts for the rollout phase, lookahead 0 against 1 (0: skip)",
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if not 1 <= args.prompts <= VOCAB_LIMIT - 24 - FIRST_KEY:
        sys.exit(f"--prompts must be in 1..{VOCAB_LIMIT - 24 - FIRST_KEY} (one key token each)")
    base = Bagel(BagelConfig.tiny(llm=dict(compute_dtype="float32")), rngs=nnx.Rngs(0))
    keys = FIRST_KEY + np.arange(args.prompts)
    pack = pack_samples(
        [[Text([int(k)])] for k in keys], row_length=8, special=SPECIAL, one_sample_per_row=True
    )
    settings = dict(
        special=SPECIAL,
        vocab_limit=VOCAB_LIMIT,
        max_new_tokens=args.cap,
        do_sample=False,
        cache_dtype="float32",  # the forced lengths ride in the cache: exact integers
    )
    print(
        f"bench/rollout.py: jax {jax.__version__} on {jax.devices()[0].platform}; tiny BAGEL, "
        f"{args.prompts} prompts, B = {args.slots}, cap {args.cap}, greedy, exponential lengths"
    )
    for mean in args.means:
        lengths = rollout_schedule.exponential_lengths(args.prompts, mean, args.cap, args.seed)
        table = np.ones(1024, np.int32)
        table[keys] = lengths
        model = ForcedLengths(base, table, SPECIAL.im_end)
        useful = int(lengths.sum())

        engine = engine_lib.Engine(
            model,
            pool_size=args.slots,
            prompt_length=pack.row_length,
            chunk_steps=args.chunk_steps,
            **settings,
        )
        sides = {
            "static": lambda m=model: static_batches(m, pack, args.slots, settings),
            "engine": lambda e=engine: e.run(pack, jax.random.key(0)).rows(),
        }
        timings, results = {}, {}
        for name, run in sides.items():
            run()  # compiles
            engine.decode_steps = 0
            start = time.perf_counter()
            results[name] = run()
            timings[name] = time.perf_counter() - start
        got = [len(r) for r in results["engine"]]
        assert got == lengths.tolist(), "the forced lengths were not decoded"
        same = results["engine"] == results["static"]
        static_steps = rollout_schedule.static_steps(lengths, args.slots)
        rate = {name: useful / seconds for name, seconds in timings.items()}
        print(
            f"mean {mean:g} (drawn {lengths.mean():.1f}, max {lengths.max()}): "
            f"engine {rate['engine']:.0f} tok/s, static {rate['static']:.0f} tok/s, "
            f"{rate['engine'] / rate['static']:.2f}x; decode steps engine {engine.decode_steps}, "
            f"static {static_steps} ({static_steps / engine.decode_steps:.2f}x); "
            f"same completions: {same}"
        )
        if args.rollout_steps:
            step_lengths = rollout_schedule.exponential_lengths(
                args.rollout_steps * args.slots, mean, args.cap, args.seed
            )
            table = np.ones(1024, np.int32)
            table[FIRST_KEY + np.arange(len(step_lengths))] = step_lengths
            model = ForcedLengths(base, table, SPECIAL.im_end)
            phase = {}
            for lookahead in (0, 1, 0, 1):  # the first of each compiles; the second is timed
                phase[lookahead] = rollout_phase(
                    model, step_lengths, args.slots, lookahead, settings
                )
            (exact, exact_steps, exact_rows), (ahead, ahead_steps, ahead_rows) = phase[0], phase[1]
            assert [len(r) for r in exact_rows] == step_lengths.tolist()
            print(
                f"mean {mean:g} (drawn {step_lengths.mean():.1f}), training rollout, "
                f"{args.rollout_steps} steps of {args.slots}: per step lookahead 0 "
                f"{exact * 1e3:.0f} ms ({exact_steps:.1f} decode steps), lookahead 1 "
                f"{ahead * 1e3:.0f} ms ({ahead_steps:.1f} decode steps), {ahead / exact:.2f}x "
                f"the time, {ahead_steps / exact_steps:.2f}x the steps; same completions: "
                f"{ahead_rows == exact_rows}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
