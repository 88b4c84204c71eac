"""Continuous batching: a fixed pool of slots over one KV cache, refilled as rows finish.

`sampler.sample` decodes a batch until its longest row ends, so at ThinkMorph's completion
lengths (mean 452 tokens before Visual-OPSD, 201 after, capped at 1024) most rows of a batch
sit finished while one runs to the cap. The engine keeps B slots busy instead:

- `insert`: waiting prompts are prefilled (images through the ViT) in the prompt buckets, a
  group of rows at a time (a power of two up to the free slots), and their cache rows and
  per-row state are written into free slots only (`_insert_rows`);
- a decode chunk (`decode_chunk`, one jitted while loop, a CUDA graph on the GPU as the
  sampler's rounds are) runs until `chunk_steps` tokens are done, every slot has stopped, or a
  slot has stopped while prompts wait;
- on the host, a stopped row either leaves with its tokens, log-probs and rounds, or, when it
  ended a round on `<|im_end|>` with `<image_start>` in the round's text, gets `<|im_end|>`
  appended and starts its next round in the same slot (BAGEL's image-skip rounds, as
  `sampler.sample` runs them).

Same draws as `sampler.sample`: a token of a sample is drawn with
`fold_in(fold_in(fold_in(rng, round), sample id), step within the round)`, so a completion does
not depend on its slot, the pool size or the order prompts arrive in
(tests/test_engine.py compares the two). Compiled shapes are fixed per run: the pool (B slots
of `prompt_length + max_new_tokens + rounds` cache slots), the insert groups (powers of two up
to B) and the prompt buckets.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd

from models.pack import Pack
from models.sharding import constrain
from opsd_jax.data.opsd_packs import bucket, bucket_in
from opsd_jax.data.packing import SpecialTokens
from opsd_jax.parallel.distributed import to_host
from opsd_jax.sampling import sampler
from opsd_jax.sampling.decode_copy import DecodeCopy
from opsd_jax.sampling.sampler import (
    SAMPLER_COMPILER_OPTIONS,
    Completions,
    DecodeState,
    RoundSettings,
)


@flax.struct.dataclass
class PoolState:
    """The pool's device state: the sampler's per-row decode state over B slots, and what a
    slot needs to continue its row's draws wherever the row sits."""

    decode: DecodeState
    feed: jax.Array  # [B] the token each slot feeds next (<|im_start|> at a round's start)
    step: jax.Array  # [B] tokens drawn in the slot's current round
    round: jax.Array  # [B] the round (0, then 1 per image skip)
    sample_id: jax.Array  # [B] the global sample id of the slot's row


def _pinned(state: PoolState) -> PoolState:
    rows = lambda x: constrain(x, ("act_batch",))  # noqa: E731
    return PoolState(
        decode=sampler.pinned(state.decode),
        feed=rows(state.feed),
        step=rows(state.step),
        round=rows(state.round),
        sample_id=rows(state.sample_id),
    )


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _empty_pool(pool_size: int, cache_shape: tuple, new_tokens: int, cache_dtype, rules=()):
    del rules  # in the cache key only
    zeros = lambda dtype, *shape: jnp.zeros((pool_size, *shape), dtype)  # noqa: E731
    decode = DecodeState(
        cache=jnp.zeros(cache_shape, cache_dtype),
        kv_length=zeros(jnp.int32),
        rope=zeros(jnp.int32),
        tokens=zeros(jnp.int32, new_tokens),
        logprobs=zeros(jnp.float32, new_tokens),
        length=zeros(jnp.int32),
        budget=zeros(jnp.int32),
        active=zeros(bool),
        finished=zeros(bool),
    )
    i32 = zeros(jnp.int32)
    return _pinned(PoolState(decode=decode, feed=i32, step=i32, round=i32, sample_id=i32))


@functools.partial(jax.jit, static_argnums=(4, 5), donate_argnums=(0,))
def _insert_rows(pool: PoolState, rows: DecodeState, slots, sample_ids, bos_id: int, rules=()):
    """Prefilled `rows` into the pool's `slots` (a slot past the pool: a padding row, dropped),
    each starting its first round."""
    del rules
    put = lambda x, new: x.at[slots].set(new.astype(x.dtype), mode="drop")  # noqa: E731
    decode = pool.decode
    fields = {
        f.name: put(getattr(decode, f.name), getattr(rows, f.name))
        for f in dataclasses.fields(decode)
        if f.name != "cache"
    }
    cache = decode.cache.at[:, slots].set(rows.cache.astype(decode.cache.dtype), mode="drop")
    return _pinned(
        PoolState(
            decode=DecodeState(cache=cache, **fields),
            feed=put(pool.feed, jnp.full(slots.shape, bos_id, jnp.int32)),
            step=put(pool.step, jnp.zeros(slots.shape, jnp.int32)),
            round=put(pool.round, jnp.zeros(slots.shape, jnp.int32)),
            sample_id=put(pool.sample_id, sample_ids),
        )
    )


@functools.partial(
    jax.jit,
    static_argnums=(0, 4, 5),
    donate_argnums=(2,),
    compiler_options=SAMPLER_COMPILER_OPTIONS,
)
def _next_round(graphdef, params, pool: PoolState, rows, settings: RoundSettings, rules=()):
    """Image skip: append <|im_end|> to the cache of `rows` (it counts against their budget)
    and start their next round (<|im_start|> fed first, step 0)."""
    del rules
    model = nnx.merge(graphdef, params)
    end = jnp.full(rows.shape, settings.eos_id, jnp.int32)
    _, decode = sampler.feed_tokens(model, pool.decode, end, rows)
    decode = decode.replace(budget=decode.budget - rows, active=pool.decode.active | rows)
    return _pinned(
        pool.replace(
            decode=decode,
            feed=jnp.where(rows, settings.bos_id, pool.feed),
            step=jnp.where(rows, 0, pool.step),
            round=pool.round + rows,
        )
    )


@functools.partial(
    jax.jit,
    static_argnums=(0, 4, 5, 7),
    donate_argnums=(2,),
    compiler_options=SAMPLER_COMPILER_OPTIONS,
)
def decode_chunk(
    graphdef,
    params,
    pool: PoolState,
    rng,
    settings: RoundSettings,
    chunk_steps: int,
    stop_when_a_row_ends,
    rules=(),
):
    """Decode every active slot until `chunk_steps` tokens are done, no slot is active, or (with
    `stop_when_a_row_ends`, while prompts wait for a slot) a slot has stopped."""
    del rules

    def keys_of(pool):  # the sampler's draw: rng, then round, then sample id, then step
        def one(round_, sample_id, step):
            key = jax.random.fold_in(jax.random.fold_in(rng, round_), sample_id)
            return jax.random.fold_in(key, step)

        return jax.vmap(one)(pool.round, pool.sample_id, pool.step)

    def cond(carry):
        _, pool, done, some_stopped = carry
        waiting_for_a_slot = stop_when_a_row_ends & some_stopped
        return (done < chunk_steps) & jnp.any(pool.decode.active) & ~waiting_for_a_slot

    def body(carry):
        params, pool, done, some_stopped = carry
        model = nnx.merge(graphdef, params)
        active = pool.decode.active
        token, logprob, decode = sampler.sample_step(
            model, pool.decode, pool.feed, keys_of(pool) if settings.do_sample else None, settings
        )
        stopped = active & ~decode.active
        pool = pool.replace(
            decode=decode,
            feed=jnp.where(active, token, pool.feed),
            step=pool.step + active,
        )
        return params, _pinned(pool), done + 1, some_stopped | jnp.any(stopped)

    start = (params, pool, jnp.zeros((), jnp.int32), jnp.zeros((), bool))
    _, pool, done, _ = jax.lax.while_loop(cond, body, start)
    return pool, done


@dataclasses.dataclass
class _Row:
    """A prompt row's progress on the host."""

    index: int  # its row in the prompt pack (the order completions are returned in)
    round_start: int = 0  # completion tokens before its current round


class Engine:
    """B slots over one KV cache; `run(prompt_pack, rng)` samples one completion per row."""

    def __init__(
        self,
        model: nnx.Module | DecodeCopy,
        *,
        pool_size: int,
        special: SpecialTokens,
        vocab_limit: int,
        max_new_tokens: int,
        prompt_length: int,
        temperature: float = 1.0,
        do_sample: bool = True,
        max_image_skips: int = 0,
        decode_text: Callable[[list[int]], str] | None = None,
        cache_dtype: str = "bfloat16",
        chunk_steps: int = 64,
        prompt_buckets: Sequence[int] | None = None,
    ):
        """model: a `DecodeCopy` (run under its mesh and rules) or an nnx model (run as it is).
        prompt_length: the longest prompt row the pool takes (its cache has
        `sampler.cache_slots_for(prompt_length, max_new_tokens, max_image_skips)` slots a row).
        chunk_steps: decode steps per chunk at most (the host looks at the pool between chunks).
        prompt_buckets: row lengths a prefill group is cut to (default: powers of two)."""
        sampler.check_settings(max_new_tokens, temperature, do_sample, max_image_skips, decode_text)
        if pool_size < 1 or chunk_steps < 1:
            raise ValueError(f"pool_size and chunk_steps must be >= 1: {pool_size}, {chunk_steps}")
        self.graphdef, self.params, self._context = sampler.model_parts(model)
        self.pool_size, self.special, self.chunk_steps = pool_size, special, chunk_steps
        self.max_new_tokens, self.max_image_skips = max_new_tokens, max_image_skips
        self.decode_text, self.cache_dtype = decode_text, jnp.dtype(cache_dtype)
        self.prompt_length = prompt_length
        self.cache_slots = sampler.cache_slots_for(prompt_length, max_new_tokens, max_image_skips)
        self.buckets = sorted(prompt_buckets) if prompt_buckets else None
        self.settings = sampler.round_settings(
            special, vocab_limit, max_new_tokens, temperature, do_sample
        )
        self.shapes: set[tuple] = set()  # (group rows, row length, patches) prefilled so far
        self.decode_steps = 0  # decode steps run (each advances every active slot by a token)

    # ---- the host loop ---------------------------------------------------------------------

    def run(self, prompt_pack: Pack, rng: jax.Array, row_ids=None) -> Completions:
        """One completion per prompt row, in row order (the same as `sampler.sample`'s for the
        same rng and row ids; row_ids: each row's global sample id, default 0..R-1)."""
        sampler.check_prompt_pack(prompt_pack)
        pack = jax.tree.map(to_host, prompt_pack)
        rows = pack.num_rows
        row_ids = np.arange(rows) if row_ids is None else np.asarray(row_ids)
        if row_ids.shape != (rows,):
            raise ValueError(f"row_ids has shape {row_ids.shape}, expected ({rows},)")
        lengths = (pack.segment_ids > 0).sum(axis=1)
        if lengths.max() > self.prompt_length:
            raise ValueError(
                f"a prompt of {lengths.max()} tokens is longer than the engine's prompt_length "
                f"{self.prompt_length}"
            )
        out = Completions(
            tokens=np.zeros((rows, self.max_new_tokens), np.int32),
            lengths=np.zeros(rows, np.int32),
            logprobs=np.zeros((rows, self.max_new_tokens), np.float32),
            finished=np.zeros(rows, bool),
            rounds=np.ones(rows, np.int32),
        )
        with self._context():
            rules = tuple(spmd.get_logical_axis_rules())
            pool = None  # made at the first insert, from the prefilled cache's shape
            waiting = collections.deque(range(rows))
            slots: list[_Row | None] = [None] * self.pool_size
            while waiting or any(slots):
                free = [s for s, row in enumerate(slots) if row is None]
                if waiting and free:
                    group = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
                    pool = self._insert(pool, pack, group, free, row_ids, rules)
                    for slot, index in zip(free, group):
                        slots[slot] = _Row(index)
                pool, steps = decode_chunk(
                    self.graphdef,
                    self.params,
                    pool,
                    rng,
                    self.settings,
                    self.chunk_steps,
                    np.bool_(bool(waiting)),
                    rules,
                )
                self.decode_steps += int(to_host(steps))
                pool = self._retire(pool, slots, out, rules)
        return out

    def _insert(self, pool, pack: Pack, group, free, row_ids, rules):
        """Prefill the prompts of `group` (pack rows) into the first free slots: a power of two
        of rows (padding rows repeat the first and are dropped), cut to the group's bucket."""
        size = 1 << (len(group) - 1).bit_length()
        rows = np.array(group + [group[0]] * (size - len(group)))
        sub = jax.tree.map(lambda x: x[rows], pack)
        sub = _cut_to_bucket(sub, self.buckets)
        self.shapes.add((size, sub.row_length, sub.vit_patches.shape[1] if sub.has_images else 0))
        prefilled = sampler.prefill_rows(
            self.graphdef,
            self.params,
            sub,
            self.max_new_tokens,
            self.cache_slots,
            self.cache_dtype,
            rules,
        )
        if pool is None:
            layers, _, cache_slots, two, kv_heads, head_dim = prefilled.cache.shape
            shape = (layers, self.pool_size, cache_slots, two, kv_heads, head_dim)
            pool = _empty_pool(self.pool_size, shape, self.max_new_tokens, self.cache_dtype, rules)
        slots = np.full(size, self.pool_size, np.int32)  # past the pool: dropped
        slots[: len(group)] = free[: len(group)]
        ids = np.asarray(row_ids)[rows].astype(np.int32)
        return _insert_rows(pool, prefilled, slots, ids, self.special.im_start, rules)

    def _retire(self, pool, slots: list, out: Completions, rules):
        """Rows that stopped in the last chunk: the next image-skip round in their slot, or
        their completion out and the slot freed."""
        decode = pool.decode
        active, finished, length, budget, rounds = map(
            to_host, (decode.active, decode.finished, decode.length, decode.budget, pool.round)
        )
        stopped = [s for s, row in enumerate(slots) if row is not None and not active[s]]
        if not stopped:
            return pool
        tokens, logprobs = to_host(decode.tokens), to_host(decode.logprobs)
        skip = np.zeros(self.pool_size, bool)
        for s in stopped:
            row = slots[s]
            if rounds[s] < self.max_image_skips and sampler.wants_image_skip(
                finished[s], budget[s], tokens[s, row.round_start : length[s]], self.decode_text
            ):
                skip[s] = True
                row.round_start = int(length[s])
                continue
            i = row.index
            out.tokens[i], out.logprobs[i] = tokens[s], logprobs[s]
            out.lengths[i], out.finished[i] = length[s], finished[s]
            out.rounds[i] = rounds[s] + 1
            slots[s] = None
        if skip.any():
            pool = _next_round(self.graphdef, self.params, pool, skip, self.settings, rules)
        return pool


def _cut_to_bucket(pack: Pack, buckets: Sequence[int] | None) -> Pack:
    """`pack` (left-aligned prompt rows) cut, as `prompt_pack_of` rounds prompts, to the least
    bucket that holds its longest row and its patches (never past the pack's own sizes)."""
    round_up = bucket if buckets is None else (lambda n: bucket_in(n, buckets))
    longest = int((pack.segment_ids > 0).sum(axis=1).max())
    length = min(round_up(longest), pack.row_length)
    pack = pack.replace(
        **{
            name: getattr(pack, name)[:, :length]
            for name in ("tokens", "positions", "segment_ids", "k_start", "k_end", "gen_mask")
            if getattr(pack, name) is not None
        }
    )
    if pack.has_images:
        patches = int((pack.vit_image_ids > 0).sum(axis=1).max())
        count = min(round_up(patches), pack.vit_patches.shape[1])
        pack = pack.replace(
            **{
                name: getattr(pack, name)[:, :count]
                for name in ("vit_patches", "vit_pos_ids", "vit_slots", "vit_image_ids")
            }
        )
    return pack
