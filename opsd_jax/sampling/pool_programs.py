"""The slot pool's device programs: the state of B slots over one KV cache, and the jitted
programs that change it (empty, fill from prefilled rows, insert prefilled rows, start an
image-skip round, decode a chunk, grow the cache).

The host side that decides which prompt goes into which slot and when a row leaves is
engine.py; the programs here know nothing of batches or prompts, only of slots. Each program
keeps the pool's rows sharded over the batch axes (`pinned`) and donates the pool it is given,
so the pool's cache exists once on the device. Those given the weights keep all of them as
arguments, read or not (keep_unused, as sampler.py's programs: the compiled peak counts them).

A token of a sample is drawn with
`fold_in(fold_in(fold_in(rng, round), sample id), step within the round)` (`decode_chunk`), as
`sampler.sample` draws it, so a completion does not depend on the slot it sits in.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from models.sharding import constrain, per_device, per_row_shard_map
from opsd_jax.sampling import sampler
from opsd_jax.sampling.sampler import SAMPLER_COMPILER_OPTIONS, DecodeState, RoundSettings


@flax.struct.dataclass
class PoolState:
    """The pool's device state: the sampler's per-row decode state over B slots, and what a
    slot needs to continue its row's draws wherever the row sits."""

    decode: DecodeState
    feed: jax.Array  # [B] the token each slot feeds next (<|im_start|> at a round's start)
    step: jax.Array  # [B] tokens drawn in the slot's current round
    round: jax.Array  # [B] the round (0, then 1 per image skip)
    sample_id: jax.Array  # [B] the global sample id of the slot's row
    key: jax.Array  # [B, ...] the key data of the rng the slot's row draws from (its batch's)


def pinned(state: PoolState) -> PoolState:
    rows = lambda x: constrain(x, ("act_batch",) + (None,) * (x.ndim - 1))  # noqa: E731
    return PoolState(
        decode=sampler.pinned(state.decode),
        feed=rows(state.feed),
        step=rows(state.step),
        round=rows(state.round),
        sample_id=rows(state.sample_id),
        key=rows(state.key),
    )


def abstract_pool(decode: DecodeState, sharding_for, key_shape: tuple = (2,)) -> PoolState:
    """A PoolState of abstract arrays over `decode`'s slots (sampler.abstract_decode_state, with
    the same `sharding_for(shape, logical axis names)`), for compiling the pool's programs ahead
    of time (the preflight, tests/test_gpu_compile.py). key_shape: the key data's (threefry's)."""
    slots = decode.length.shape[0]

    def per_slot(dtype, *tail):
        shape = (slots, *tail)
        names = ("act_batch",) + (None,) * len(tail)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding_for(shape, names))

    return PoolState(
        decode=decode,
        feed=per_slot(jnp.int32),
        step=per_slot(jnp.int32),
        round=per_slot(jnp.int32),
        sample_id=per_slot(jnp.int32),
        key=per_slot(jnp.uint32, *key_shape),
    )


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def empty_pool(
    pool_size: int, cache_shape: tuple, new_tokens: int, cache_dtype, key_shape: tuple, rules=()
):
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
    key = zeros(jnp.uint32, *key_shape)
    return pinned(PoolState(decode=decode, feed=i32, step=i32, round=i32, sample_id=i32, key=key))


@functools.partial(jax.jit, static_argnums=(3, 4), donate_argnums=(0,))
def pool_of_rows(rows: DecodeState, sample_ids, key, bos_id: int, rules=()):
    """A pool whose slot i holds prefilled row i, each starting its first round, drawing from
    `key` (key data): what empty_pool then insert_rows into every slot in order make, but the
    rows' state is donated and becomes the pool's, so no second cache is made or written."""
    del rules
    slots = sample_ids.shape[0]
    zeros = jnp.zeros((slots,), jnp.int32)
    return pinned(
        PoolState(
            decode=rows,
            feed=jnp.full((slots,), bos_id, jnp.int32),
            step=zeros,
            round=zeros,
            sample_id=sample_ids.astype(jnp.int32),
            key=jnp.broadcast_to(key, (slots, *key.shape)),
        )
    )


@functools.partial(jax.jit, static_argnums=(5, 6), donate_argnums=(0,))
def insert_rows(
    pool: PoolState,
    rows: DecodeState,
    slots,
    sample_ids,
    key,
    bos_id: int,
    rules=(),
    local_slots=None,
):
    """Prefilled `rows` into the pool's `slots` (a slot past the pool: a padding row, dropped),
    each starting its first round, drawing from `key` (key data).

    local_slots ([R], laid out as the rows are): given when each row lies on the devices that
    hold its slot (the engine deals them so: row_placement.placed_rows), each row's slot among
    those devices' own (past their share: dropped). Each device then writes its own rows into
    its own share of the cache, in place, and nothing crosses devices. Without it, where the rows
    are split over devices, XLA partitions a scatter, which gathers the rows first: a temp of
    7.49 GiB in the paper recipe's insert on 8 H100s."""
    del rules
    put = lambda x, new: x.at[slots].set(new.astype(x.dtype), mode="drop")  # noqa: E731
    decode = pool.decode
    fields = {
        f.name: put(getattr(decode, f.name), getattr(rows, f.name))
        for f in dataclasses.fields(decode)
        if f.name != "cache"
    }
    new = rows.cache.astype(decode.cache.dtype)
    if local_slots is not None:  # each device its own rows into its own slots
        names = sampler.CACHE_NAMES
        write = per_row_shard_map(write_rows, (names, names, ("act_batch",)), names)
        cache = write(decode.cache, new, local_slots)
    elif per_device(decode.cache.shape, sampler.CACHE_NAMES)[1] == decode.cache.shape[1]:
        cache = write_rows(decode.cache, new, slots)  # every row on each device
    else:  # rows split over devices, not placed: the scatter, which XLA partitions
        cache = decode.cache.at[:, slots].set(new, mode="drop")
    keys = jnp.broadcast_to(key, (slots.shape[0], *key.shape))
    return pinned(
        PoolState(
            decode=DecodeState(cache=cache, **fields),
            feed=put(pool.feed, jnp.full(slots.shape, bos_id, jnp.int32)),
            step=put(pool.step, jnp.zeros(slots.shape, jnp.int32)),
            round=put(pool.round, jnp.zeros(slots.shape, jnp.int32)),
            sample_id=put(pool.sample_id, sample_ids),
            key=put(pool.key, keys),
        )
    )


def write_rows(cache: jax.Array, rows_cache: jax.Array, slots: jax.Array) -> jax.Array:
    """`cache` [L, B, S, ...] with row i of `rows_cache` [L, R, S, ...] written at row slots[i]
    (a slot past the pool, B: a padding row, dropped), one row at a time, in place.

    Not `cache.at[:, slots].set(...)`: XLA:GPU scatters along the leading axis, so it moved the
    whole cache's row axis to the front and back again (two transposes, a temp of one cache:
    6.23 GiB of the one-GPU recipe's insert, whose peak was 51.08 GiB). A dropped row writes
    back what its clamped slot holds, so a dynamic_update_slice, which clamps rather than
    drops, changes nothing there. For a cache whose rows are split over devices XLA gathers
    the rows a dynamic slice reads (the paper recipe's insert on 8 H100s: 33.74 GiB against
    30.00 for the scatter, whose partitioning gathers too): there insert_rows runs it on each
    device's own rows and slots (its `local_slots`)."""
    pool_rows = cache.shape[1]

    def write(i, cache):
        slot = slots[i]
        inside = slot < pool_rows
        at = jnp.where(inside, slot, 0)
        kept = jax.lax.dynamic_slice_in_dim(cache, at, 1, axis=1)
        new = jax.lax.dynamic_slice_in_dim(rows_cache, i, 1, axis=1).astype(cache.dtype)
        return jax.lax.dynamic_update_slice_in_dim(cache, jnp.where(inside, new, kept), at, axis=1)

    return jax.lax.fori_loop(0, slots.shape[0], write, cache)


@functools.partial(
    jax.jit,
    static_argnums=(0, 4, 5),
    donate_argnums=(2,),
    keep_unused=True,
    compiler_options=SAMPLER_COMPILER_OPTIONS,
)
def next_round(graphdef, params, pool: PoolState, rows, settings: RoundSettings, rules=()):
    """Image skip: append <|im_end|> to the cache of `rows` (it counts against their budget)
    and start their next round (<|im_start|> fed first, step 0)."""
    del rules
    model = nnx.merge(graphdef, params)
    end = jnp.full(rows.shape, settings.eos_id, jnp.int32)
    _, decode = sampler.feed_tokens(model, pool.decode, end, rows)
    decode = decode.replace(budget=decode.budget - rows, active=pool.decode.active | rows)
    return pinned(
        pool.replace(
            decode=decode,
            feed=jnp.where(rows, settings.bos_id, pool.feed),
            step=jnp.where(rows, 0, pool.step),
            round=pool.round + rows,
        )
    )


@functools.partial(
    jax.jit,
    static_argnums=(0, 3, 4, 5, 7),
    donate_argnums=(2,),
    keep_unused=True,
    compiler_options=SAMPLER_COMPILER_OPTIONS,
)
def decode_chunk(
    graphdef,
    params,
    pool: PoolState,
    key_impl: str,
    settings: RoundSettings,
    chunk_steps: int,
    watched,
    rules=(),
):
    """Decode every active slot until `chunk_steps` tokens are done, no slot is active, or a
    `watched` slot ([B] bool: every slot while prompts wait for one, else those of the batch
    being finished) has stopped. key_impl: the
    PRNG implementation of the slots' key data. Returns the pool, the decode steps run and the
    slot-steps that drew a token (their ratio over the pool size: the slots' occupancy)."""
    del rules

    def keys_of(pool):  # the sampler's draw: rng, then round, then sample id, then step
        def one(key_data, round_, sample_id, step):
            rng = jax.random.wrap_key_data(key_data, impl=key_impl)
            key = jax.random.fold_in(jax.random.fold_in(rng, round_), sample_id)
            return jax.random.fold_in(key, step)

        return jax.vmap(one)(pool.key, pool.round, pool.sample_id, pool.step)

    def cond(carry):
        _, pool, done, _, watched_stopped = carry
        return (done < chunk_steps) & jnp.any(pool.decode.active) & ~watched_stopped

    def body(carry):
        params, pool, done, busy, watched_stopped = carry
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
        busy = busy + jnp.sum(active, dtype=jnp.int32)
        watched_stopped = watched_stopped | jnp.any(stopped & watched)
        return params, pinned(pool), done + 1, busy, watched_stopped

    zero = jnp.zeros((), jnp.int32)
    _, pool, done, busy, _ = jax.lax.while_loop(cond, body, (params, pool, zero, zero, False))
    return pool, done, busy


@functools.partial(jax.jit, static_argnums=(1, 2))  # a new cache shape: nothing to donate to
def grown(pool: PoolState, cache_slots: int, rules=()):
    del rules
    cache = pool.decode.cache
    extra = cache_slots - cache.shape[2]
    cache = jnp.pad(cache, [(0, 0), (0, 0), (0, extra)] + [(0, 0)] * (cache.ndim - 3))
    return pinned(pool.replace(decode=pool.decode.replace(cache=cache)))
