"""The sampling engine's programs as the preflight (preflight.py) compiles them: what each holds
of a device, beside what stays there while it runs.

The engine (opsd_jax/sampling/engine.py) decodes through a pool of slots over one KV cache:
a prefill of waiting prompts, their insert into free slots, decode chunks over the pool and,
with image skips, a next round's start. Between those programs buffers outlive the program
that made them: the prefilled rows' cache until the insert has copied it, the pool while a
later prefill runs. A program's own peak misses them, so each is compiled here with what is
alive beside it counted in (ENGINE_PROGRAMS says how each engine program is counted).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.pack import Pack
from models.sharding import logical_spec
from opsd_jax.data.packing import SpecialTokens
from opsd_jax.parallel import device_memory
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.sampling import engine, pool_programs, sampler
from opsd_jax.sampling.row_placement import first_group_rows

# The sampling engine's jitted programs (opsd_jax/sampling/engine.py) and how the preflight
# counts each: compiled as the engine runs it, or held within one that is. tests/test_engine.py
# fails on a program the engine runs that is not named here.
ENGINE_PROGRAMS = {
    "prefill_rows": "compiled (the pool's cache beside it where a prefill can meet one)",
    "pool_of_rows": "compiled where prompts fill an empty pool (a rollout without lookahead)",
    "insert_rows": "compiled where a pool can hold rows (the pool and the prefilled rows)",
    "decode_chunk": "compiled",
    "next_round": "compiled when the run has image skips",
    "empty_pool": "within insert_rows (it makes the pool beside the prefilled rows)",
    "grown": "within insert_rows (the old pool and the new, before the prefill)",
}

# Structural ids for shapes only: no tokenizer is read (the ids are never looked at).
SHAPE_SPECIAL = SpecialTokens(im_start=1, im_end=2, vision_start=3, vision_end=4)


def compile_engine_programs(
    compile_and_report,
    name,
    model_config,
    view,
    copy_graphdef,
    copy,
    rows,
    prefill_rows,
    prompt_length,
    patches,
    new_tokens,
    image_skips,
    cache_dtype,
    resident,
    pool_in_prefill: bool,
) -> None:
    """The sampling engine's programs (opsd_jax/sampling/engine.py) for a pool of `rows` slots
    at `prompt_length`, under the decode mesh and rules, each with what else is on the device
    while it runs (`resident`: the train state, and what else the caller counts):

    - the prefill of `prefill_rows` prompts (`rows`, the whole pool, unless the engine
      prefills in smaller groups); where a prefill can meet a pool that holds rows
      (`pool_in_prefill`: a lookahead's paused rows, an evaluation's prompts waiting for
      slots, a later group) the pool's cache is beside it;
    - where a prefill can meet a pool holding rows, the insert of the prefilled rows into the
      pool: both caches at once, beside the copy; elsewhere (a rollout without lookahead,
      whose prompts fill the empty pool in order) the pool made of the prefilled rows;
    - the decode chunk over the pool, the program that decodes;
    - with image skips, the next round's start (the image-end token fed through the model).
    The pool's growth to a longer bucket (old and new pool at once, before the prefill) holds
    no more than the insert does. Each goes to `compile_and_report(name, lower, mesh, beside)`,
    `lower()` lowering it when asked (preflight.run's measure mode lowers one program only)."""
    rules = mesh_lib.DECODE_RULES

    def sharding_for(shape, names):
        return jax.sharding.NamedSharding(view, logical_spec(shape, names, view, rules))

    def on_view(shape, dtype, names):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding_for(shape, names))

    def per_row(dtype, *tail, count=rows):
        return on_view((count,) + tail, dtype, ("act_batch",) + (None,) * len(tail))

    # A prefill group's rows as the engine places them: padded per device share to a power of
    # two (row_placement.placed_rows), here for the first group, into the empty pool.
    with mesh_lib.use_mesh(view, rules):
        group = first_group_rows(rows, prefill_rows)

    def replicated(dtype, *shape):
        return on_view(shape, dtype, (None,) * len(shape))

    def in_group(dtype, *tail):
        return per_row(dtype, *tail, count=group)

    prompt = Pack(
        tokens=in_group(jnp.int32, prompt_length),
        positions=in_group(jnp.int32, prompt_length),
        segment_ids=in_group(jnp.int32, prompt_length),
        k_start=in_group(jnp.int32, prompt_length),
        k_end=in_group(jnp.int32, prompt_length),
        vit_patches=in_group(jnp.float32, patches, model_config.vit.patch_dim),
        vit_pos_ids=in_group(jnp.int32, patches),
        vit_slots=in_group(jnp.int32, patches),
        vit_image_ids=in_group(jnp.int32, patches),
    )
    slots = sampler.cache_slots_for(prompt_length, new_tokens, image_skips)
    llm = model_config.llm

    def decode_state(count):  # the state of `count` rows
        shape = sampler.cache_shape_for(
            llm.num_hidden_layers, count, slots, llm.num_key_value_heads, llm.head_dim
        )
        return sampler.abstract_decode_state(shape, new_tokens, sharding_for, cache_dtype)

    prefilled = decode_state(group)
    key = jax.random.key(0)  # the engine's slots draw from the run's key's data and impl
    key_data = jax.random.key_data(key)
    pool = pool_programs.abstract_pool(decode_state(rows), sharding_for, key_data.shape)
    pool_bytes = device_memory.bytes_per_device(pool)
    copy_bytes = device_memory.bytes_per_device(copy)

    def on_view_mesh(lower):  # a lowering under the decode mesh and rules, when it is asked for
        def lowered():
            with mesh_lib.use_mesh(view, rules):
                return lower()

        return lowered

    beside = " (beside a pool holding rows)" if pool_in_prefill else ""
    compile_and_report(
        f"{name}: prefill{f' of {group} rows' if group < rows else ''}{beside}",
        on_view_mesh(
            lambda: sampler.prefill_rows.lower(
                copy_graphdef, copy, prompt, new_tokens, slots, cache_dtype, rules
            )
        ),
        view,
        resident + (pool_bytes if pool_in_prefill else 0),
    )
    if pool_in_prefill:
        insert = on_view_mesh(
            lambda: pool_programs.insert_rows.lower(
                pool,
                prefilled,
                replicated(jnp.int32, group),  # the slots
                replicated(jnp.int32, group),  # the rows' sample ids
                replicated(key_data.dtype, *key_data.shape),
                SHAPE_SPECIAL.im_start,
                rules,
                in_group(jnp.int32),  # a row's slot among its devices' (row_placement)
            )
        )
        compile_and_report(f"{name}: insert into the pool", insert, view, resident + copy_bytes)
    else:  # every row in one group (a power of two or the whole pool: `rows` here)
        fill = on_view_mesh(
            lambda: pool_programs.pool_of_rows.lower(
                prefilled,
                replicated(jnp.int32, rows),  # the rows' sample ids
                replicated(key_data.dtype, *key_data.shape),
                SHAPE_SPECIAL.im_start,
                rules,
            )
        )
        compile_and_report(f"{name}: the pool from the rows", fill, view, resident + copy_bytes)
    settings = sampler.round_settings(SHAPE_SPECIAL, llm.vocab_size, new_tokens, 1.0, True)
    chunk = on_view_mesh(
        lambda: pool_programs.decode_chunk.lower(
            copy_graphdef,
            copy,
            pool,
            str(jax.random.key_impl(key)),
            settings,
            engine.CHUNK_STEPS,
            per_row(jnp.bool_),  # the watched slots
            rules,
        )
    )
    compile_and_report(f"{name}: decode chunk", chunk, view, resident)
    if image_skips:
        next_round = on_view_mesh(
            lambda: pool_programs.next_round.lower(
                copy_graphdef, copy, pool, per_row(jnp.bool_), settings, rules
            )
        )
        compile_and_report(f"{name}: next round (image skip)", next_round, view, resident)
