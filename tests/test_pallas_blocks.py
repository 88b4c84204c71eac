"""Every Pallas block the project builds lies inside the array it tiles, at the recipes' shapes.

The kernels are traced, not run (opsd_jax/programs/pallas_blocks.py): each pallas_call's block
sizes must divide their arrays and each index map, evaluated at every program of the grid, must
keep its block inside the array. The interpreter pads operands to whole blocks and jax 0.12's
Triton lowering masks an overhanging block; jax 0.11's (the GPU images' jax) does neither, so
only this check sees an overhang on a CPU. The decode kernel failed it before its fix (a 16-row
query block over 7 heads; a combine reading 64 splits of 38), as the synthetic kernels below
still do.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from configs import thinkmorph_7b, thinkmorph_7b_1gpu
from models import attention_pallas, decode_attention_pallas
from models.configs import BagelConfig
from opsd_jax.programs import pallas_blocks
from opsd_jax.sampling import sampler

LLM = BagelConfig.bagel_7b().llm
VIT = BagelConfig.bagel_7b().vit
DTYPE = jnp.bfloat16


def recipe_cache_slots() -> list[int]:
    """The sampler's cache lengths of the two 7B recipes, one per prompt bucket, and each
    before sampler.cache_slots_for rounds it to a multiple of 128: the kernel takes any count
    a caller hands it, and does not rely on that rounding."""
    slots = set()
    for recipe in (thinkmorph_7b, thinkmorph_7b_1gpu):
        config = recipe.get_config()
        for bucket in config.sample_prompt_buckets:
            needed = bucket + config.sample_max_new_tokens + config.sample_max_image_skips + 1
            rounded = sampler.cache_slots_for(
                bucket, config.sample_max_new_tokens, config.sample_max_image_skips
            )
            assert rounded - 128 < needed <= rounded
            slots.update((needed, rounded))
    return sorted(slots)


def decode_case(rows, kv_heads, slots):
    q_heads = LLM.num_attention_heads * kv_heads // LLM.num_key_value_heads
    dim = LLM.hidden_size // LLM.num_attention_heads
    return (
        jax.ShapeDtypeStruct((rows, q_heads, dim), DTYPE),
        jax.ShapeDtypeStruct((LLM.num_hidden_layers, rows, slots, 2, kv_heads, dim), DTYPE),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((rows,), jnp.int32),
    )


# Each device's share: the one-GPU recipe's rollout (16 rows, every head), evaluation one row
# at a time, the 8-GPU recipe's rollout under tensor 4 x data 2 (8 rows, one kv head of 7 query
# heads), and bench/gpu_check.py's parity case (8 rows, every head).
DECODE_SHARES = [(16, 4), (1, 4), (8, 1), (8, 4)]


@pytest.mark.parametrize("rows, kv_heads", DECODE_SHARES)
def test_the_decode_kernels_blocks_lie_inside_their_arrays(rows, kv_heads):
    slots = recipe_cache_slots() + [4160]  # 4160: bench/gpu_check.py's parity case
    assert 7170 in slots and len(slots) > 10
    for n in slots:
        calls, problems = pallas_blocks.overhangs(
            functools.partial(decode_attention_pallas.filled_cache_attention, interpret=True),
            *decode_case(rows, kv_heads, n),
        )
        names = [c.name for c in calls]
        assert names == [
            decode_attention_pallas.KERNEL_NAME,
            decode_attention_pallas.COMBINE_KERNEL_NAME,
        ]
        assert not problems, f"{rows} rows, {kv_heads} kv heads, {n} slots:\n" + "\n".join(problems)


def range_attention_grad(q_heads, kv_heads, dim, tokens, blocks=attention_pallas.BlockSizes()):
    """The range kernel's forward and both backward kernels, traced through jax.grad."""

    def loss(q, k, v, ids, k_start, k_end):
        out = attention_pallas.range_attention(
            q,
            k,
            v,
            q_segment_ids=ids,
            kv_segment_ids=ids,
            k_start=k_start,
            k_end=k_end,
            block_sizes=blocks,
            interpret=True,
        )
        return jnp.sum(out.astype(jnp.float32))

    rows = lambda *shape, dtype=DTYPE: jax.ShapeDtypeStruct((1, tokens, *shape), dtype)  # noqa: E731
    args = (
        rows(q_heads, dim),
        rows(kv_heads, dim),
        rows(kv_heads, dim),
        rows(dtype=jnp.int32),
        rows(dtype=jnp.int32),
        rows(dtype=jnp.int32),
    )
    return pallas_blocks.overhangs(jax.grad(loss, argnums=(0, 1, 2)), *args)


@pytest.mark.parametrize(
    "what, q_heads, kv_heads, dim, tokens",
    [
        # The student's and the teacher's packed rows (one a device), BAGEL-7B's LLM heads.
        ("student", 28, 4, 128, 6144),
        ("teacher", 28, 4, 128, 10240),
        # SigLIP's attention over one 980 x 980 image's 70 x 70 patches (head dim 72: padded).
        ("vit", 16, 16, 72, 4900),
    ],
)
def test_the_range_kernels_blocks_lie_inside_their_arrays(what, q_heads, kv_heads, dim, tokens):
    if what == "vit":
        assert (VIT.num_attention_heads, VIT.hidden_size // VIT.num_attention_heads) == (16, 72)
    calls, problems = range_attention_grad(q_heads, kv_heads, dim, tokens)
    assert len(calls) == 3, [c.name for c in calls]  # forward, dQ, dK/dV
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("blocks", attention_pallas.TILE_CANDIDATES)
@pytest.mark.parametrize("tokens", attention_pallas.TUNED_LENGTHS)
def test_every_tile_candidate_keeps_its_blocks_inside_its_arrays(blocks, tokens):
    """What bench/gpu_check.py's tiles section times on a GPU, at the recipe's lengths."""
    calls, problems = range_attention_grad(28, 4, 128, tokens, blocks)
    assert len(calls) == 3, [c.name for c in calls]
    assert not problems, "\n".join(problems)


def _copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def test_an_overhanging_block_and_a_block_past_the_end_are_found():
    # The decode kernel before its fix, in small: a 16-row block over 7 query heads, and a
    # combine reading a power-of-two block of 16 splits from an array of 10.
    def rows_block(x):
        return pl.pallas_call(
            _copy_kernel,
            grid=(3,),
            in_specs=[pl.BlockSpec((None, 16, 128), lambda i: (i, 0, 0))],
            out_specs=pl.BlockSpec((None, 16, 128), lambda i: (i, 0, 0)),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            interpret=True,
        )(x)

    _, problems = pallas_blocks.overhangs(rows_block, jax.ShapeDtypeStruct((3, 7, 128), DTYPE))
    assert "input 0 (3, 7, 128): dim 1 block 16 does not divide 7" in problems[0]
    assert any("dim 1 block 16 reaches 16 of 7 at 3 of 3 programs" in p for p in problems)

    def splits_block(x):
        return pl.pallas_call(
            _copy_kernel,
            grid=(2,),
            in_specs=[pl.BlockSpec((None, 16, 128), lambda i: (i, 0, 0))],
            out_specs=pl.BlockSpec((None, 16, 128), lambda i: (i, 0, 0)),
            out_shape=jax.ShapeDtypeStruct((2, 16, 128), x.dtype),
            interpret=True,
        )(x)

    _, problems = pallas_blocks.overhangs(splits_block, jax.ShapeDtypeStruct((2, 10, 128), DTYPE))
    assert any("input 0 (2, 10, 128): dim 1 block 16 does not divide 10" in p for p in problems)
    assert not any("output" in p for p in problems)  # the output's blocks are whole

    # A grid one program too long: every block divides, the last one starts past the end.
    def one_too_many(x):
        return pl.pallas_call(
            _copy_kernel,
            grid=(4,),
            in_specs=[pl.BlockSpec((16, 128), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((16, 128), lambda i: (i, 0)),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            interpret=True,
        )(x)

    _, problems = pallas_blocks.overhangs(one_too_many, jax.ShapeDtypeStruct((48, 128), DTYPE))
    assert problems == [
        "pallas_call input 0 (48, 128): dim 0 block 16 reaches 64 of 48 at 1 of 4 programs "
        "(first: program (3,))",
        "pallas_call output 0 (48, 128): dim 0 block 16 reaches 64 of 48 at 1 of 4 programs "
        "(first: program (3,))",
    ]
