"""Decode attention that reads the KV cache in place and only up to each row's filled length:
a Pallas kernel for NVIDIA GPUs (Triton backend).

Contract: `attention.decode_attention(q, cache[layer, :, :, 0], cache[layer, :, :, 1],
kv_lengths)`, with the whole stacked cache ([L, B, S, 2, Hkv, D]: keys and values of a slot
side by side, as the sampler holds it) and the layer index as arguments instead of the layer's
slices.

Why a kernel: compiled for an H100 (bench/scale.py), XLA materialised each layer's K and V
slice of the stacked cache on every decode step (a dynamic slice, or a pad to a multiple of 8
feeding cuBLAS) and then read the copy: three cache passes per token instead of one, and every
pass over all S slots however few were filled. This kernel is a custom call that takes the
cache buffer itself (no slice exists), and each program loops over the key blocks of its own
row up to that row's length, so the bytes a step reads grow with the filled length.

Grid (B, Hkv, splits), flash-decoding: one program per row, kv head and split of the cache,
holding that kv head's G = Hq / Hkv query heads as one [Gp, D] tile (G padded with zero rows to
16, Triton's smallest dot, in registers: each head's [D] row loaded from the whole query, so no
padded copy of q exists, which would be one more kernel a layer). A decode step has few rows and
kv heads per device (the recipe under tensor 4 x data 2: 8 rows x 1 kv head), so a grid of
(B, Hkv) alone ran 8 programs on a GPU of 132 SMs; the split axis cuts the key blocks into
contiguous ranges so that the grid has at least MIN_PROGRAMS programs (`grid`). Each program
loops over the key blocks of its range up to its row's length (`block_k` slots a step: scores in
float32, an online softmax in the log2 domain, masked past the length) and stores the G real
rows of its normalised partial output and its log2-sum-exp (a masked store into 16-row blocks).
A second kernel, grid (B, Hkv, G), loads the splits of one query head (a masked load of a
power-of-two block: the split axis is allocated that long, the splits past the real ones never
written nor read), combines them (weights 2^(lse - max lse)) and writes it in q's dtype:
two kernels a layer where the padding and XLA's combine took four (a pad, then an exp, a reduce
and a convert fusion). A split wholly past the row's length runs no block and weighs 0; a row of
length 0 returns 0.

Correct by construction, on every jax the GPU path meets: every block divides the array it
tiles and lies inside it at every program (tests/test_pallas_blocks.py traces both kernels at the
recipes' shapes), and every partial tile (the G of 16 query rows, the real of a power of two of
splits) is loaded or stored through an explicit mask. Nothing
relies on the bounds mask jax 0.12's Triton lowering adds to an overhanging block and jax
0.11's does not (there, the 16-row block over 7 heads wrote into the next split's rows and the
last program past the end of the array: a parity error of 2.4 on the first H200).

Requirements: S >= `block_k` (any S: the last block starts early enough to end at slot S - 1),
D a power of two >= 16 (BAGEL: 128); `supported(...)` says whether a shape qualifies, and
attention.cache_attention falls back to the XLA path when it does not. Sharding: like every
pallas_call it must run per device (attention.cache_attention wraps it in a shard_map). The
Triton backend has no scalar prefetch, so the layer index travels as a [1] array and the lengths
as a [B] array that each program reads one element of. `interpret=True` runs it in the Pallas
interpreter on any backend (tests).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_F32 = jnp.float32
_LOG2_E = math.log2(math.e)
BLOCK_K = 64  # key slots per loop step
MIN_QUERY_ROWS = 16  # Triton's smallest dot tile
# Programs the grid should have at least: 2 per SM of an H100 / H200 SXM (132 SMs), so that
# every SM has work and a second program to switch to while the first waits on HBM.
MIN_PROGRAMS = 2 * 132
# The kernel's name in the compiled program (a Triton custom call's backend config), by which
# opsd_jax/programs/hbm_traffic.py and bench/scale.py tell it from other custom calls.
KERNEL_NAME = "filled_cache_attention"
COMBINE_KERNEL_NAME = "combine_cache_splits"


def supported(head_dim: int, num_slots: int, block_k: int = BLOCK_K) -> bool:
    """Whether the kernel takes a cache of this head dim and slot count."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and num_slots >= block_k


def blocks_per_split(
    batch: int,
    kv_heads: int,
    num_slots: int,
    block_k: int = BLOCK_K,
    min_programs: int = MIN_PROGRAMS,
) -> int:
    """Key blocks each split covers: as many as leave batch x kv_heads x splits >= min_programs
    (at least one), so every split but the last covers the same number and none is empty."""
    blocks = pl.cdiv(num_slots, block_k)
    wanted = max(1, pl.cdiv(min_programs, batch * kv_heads))
    return max(1, blocks // wanted)


def grid(
    batch: int,
    kv_heads: int,
    num_slots: int,
    block_k: int = BLOCK_K,
    min_programs: int = MIN_PROGRAMS,
) -> tuple[int, int, int]:
    """The kernel's launch grid for a device's share of the cache: (rows, kv heads, splits),
    rows x kv heads x splits >= min_programs where the cache has that many key blocks (else one
    split per block)."""
    per_split = blocks_per_split(batch, kv_heads, num_slots, block_k, min_programs)
    return (batch, kv_heads, pl.cdiv(pl.cdiv(num_slots, block_k), per_split))


def _kernel(
    layer_ref,
    length_ref,
    q_ref,
    cache_ref,
    o_ref,
    lse_ref,
    *,
    scale,
    block_k,
    num_slots,
    split_blocks,
    group,
):
    row, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, length = layer_ref[0], length_ref[row]
    rows, dim = o_ref.shape
    real = jnp.arange(rows) < group  # the padding rows: never stored nor read
    # [Gp, D]: the G query heads of this kv head, one [D] load each from the whole [B, Hkv, G, D]
    # query, placed in rows 0..G-1 of a zero tile (no padded copy of q, which would be one more
    # kernel a layer, and no load of a block past the array's G rows).
    q = jnp.zeros((rows, dim), q_ref.dtype)
    for g in range(group):
        q = jnp.where(jnp.arange(rows)[:, None] == g, q_ref[row, head, g, :][None, :], q)

    def key_block(kb, carry):
        acc, m, l = carry
        # The last block of a cache whose slots are not a multiple of block_k starts early, so
        # that it ends at the last slot; the slots it shares with the block before are masked.
        start = jnp.minimum(kb * block_k, num_slots - block_k)
        span = pl.ds(start, block_k)
        k = cache_ref[layer, row, span, 0, head, :]  # [block_k, D], read in place
        s = plgpu.dot(q, k, trans_b=True) * scale  # [Gp, block_k], log2 domain
        slot = start + jnp.arange(block_k)
        filled = (slot >= kb * block_k) & (slot < length)
        s = jnp.where(filled[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # Every block holds at least one filled slot, so m_new is finite after the first.
        p = jnp.exp2(s - m_new[:, None])
        rescale = jnp.exp2(m - m_new)
        # Slots past the length in the last block may hold anything (0 x NaN is NaN).
        v = jnp.where(filled[:, None], cache_ref[layer, row, span, 1, head, :], 0)
        acc = rescale[:, None] * acc + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_new, rescale * l + jnp.sum(p, axis=1)

    init = (
        jnp.zeros((rows, dim), _F32),
        jnp.full((rows,), -jnp.inf, _F32),
        jnp.zeros((rows,), _F32),
    )
    # This split's key blocks, up to the row's last filled block (none when it starts past it).
    first = split * split_blocks
    last = jnp.minimum(first + split_blocks, pl.cdiv(length, block_k))
    acc, m, l = lax.fori_loop(first, jnp.maximum(first, last), key_block, init)
    seen = l > 0
    out = jnp.where(seen[:, None], acc / jnp.where(seen, l, 1.0)[:, None], 0.0)
    plgpu.store(o_ref, out, mask=real[:, None])
    lse = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), -jnp.inf)
    plgpu.store(lse_ref, lse, mask=real)


def _combine_kernel(partial_ref, lse_ref, o_ref, *, splits):
    """One query head of one row and kv head: its [splits, D] normalised partial outputs and
    [splits] log2-sum-exps (loaded from a power-of-two block; the stored splits past `splits`
    are masked off the load, never read) -> the attention over all splits, [D] in the output's
    dtype (0 where none saw a slot)."""
    real = jnp.arange(lse_ref.shape[0]) < splits  # [splits, a power of two]
    lse = plgpu.load(lse_ref, mask=real, other=-jnp.inf)
    partial = plgpu.load(partial_ref, mask=real[:, None], other=0.0)
    top = jnp.max(lse)
    weight = jnp.exp2(lse - jnp.where(top > -jnp.inf, top, 0.0))  # 0 for empty splits
    total = jnp.sum(weight)
    out = jnp.sum(weight[:, None] * partial, axis=0) / jnp.where(total > 0, total, 1.0)
    o_ref[...] = out.astype(o_ref.dtype)  # 0 where total is 0: every partial is 0 then


def filled_cache_attention(
    q,
    cache,
    layer,
    kv_lengths,
    *,
    block_k: int = BLOCK_K,
    min_programs: int = MIN_PROGRAMS,
    interpret: bool = False,
) -> jax.Array:
    """One query per row against layer `layer` of the stacked cache, slots < kv_lengths[b].

    q: [B, Hq, D]; cache: [L, B, S, 2, Hkv, D] (keys at 0, values at 1 of its axis 3); layer:
    int32 scalar; kv_lengths: [B].
    Returns [B, Hq, D] in q.dtype (float32 scores, softmax, partial outputs and combine).
    min_programs: the grid's least size (`grid`); 1 runs one program per row and kv head.
    """
    batch, q_heads, head_dim = q.shape
    if cache.ndim != 6 or cache.shape[3] != 2 or cache.shape[1] != batch:
        raise ValueError(f"bad shapes q {q.shape}, cache {cache.shape} (want [L, B, S, 2, Hkv, D])")
    kv_heads, num_slots = cache.shape[4], cache.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"bad shapes q {q.shape}, cache {cache.shape}: q heads % kv heads")
    if not supported(head_dim, num_slots, block_k):
        raise ValueError(
            f"filled_cache_attention needs a power-of-two head dim >= 16 and at "
            f"least {block_k} slots; got {cache.shape}"
        )
    group = q_heads // kv_heads
    rows = max(MIN_QUERY_ROWS, pl.next_power_of_2(group))
    # Free reshape; the kernel loads a program's G heads as `rows` (Triton's least dot) rows.
    grouped = q.reshape(batch, kv_heads, group, head_dim).astype(cache.dtype)
    split_blocks = blocks_per_split(batch, kv_heads, num_slots, block_k, min_programs)
    splits = grid(batch, kv_heads, num_slots, block_k, min_programs)[2]
    # The combine loads all of a head's splits as one power-of-two block, so the partials are
    # allocated with that many; the kernel's grid writes the first `splits` of them.
    stored_splits = pl.next_power_of_2(splits)
    whole = lambda x: pl.BlockSpec(x.shape, lambda b, h, s: (0,) * x.ndim)  # noqa: E731
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    lengths = jnp.asarray(kv_lengths, jnp.int32)
    partial, lse = pl.pallas_call(
        functools.partial(
            _kernel,
            scale=_LOG2_E / math.sqrt(head_dim),
            block_k=block_k,
            num_slots=num_slots,
            split_blocks=split_blocks,
            group=group,
        ),
        grid=(batch, kv_heads, splits),
        in_specs=[whole(layer), whole(lengths), whole(grouped), whole(cache)],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, kv_heads, stored_splits, rows, head_dim), _F32),
            jax.ShapeDtypeStruct((batch, kv_heads, stored_splits, rows), _F32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=KERNEL_NAME,
    )(layer, lengths, grouped, cache)
    # The combine: one program per row, kv head and query head, all its splits in one load,
    # with warps enough to hold them (64 floats a thread; 4 warps at the recipe's 38 splits).
    combine_warps = min(32, max(4, stored_splits * head_dim // (64 * 32)))
    out = pl.pallas_call(
        functools.partial(_combine_kernel, splits=splits),
        grid=(batch, kv_heads, group),
        in_specs=[
            pl.BlockSpec(
                (None, None, stored_splits, None, head_dim), lambda b, h, g: (b, h, 0, g, 0)
            ),
            pl.BlockSpec((None, None, stored_splits, None), lambda b, h, g: (b, h, 0, g)),
        ],
        out_specs=pl.BlockSpec((None, None, None, head_dim), lambda b, h, g: (b, h, g, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, kv_heads, group, head_dim), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=combine_warps, num_stages=1),
        interpret=interpret,
        name=COMBINE_KERNEL_NAME,
    )(partial, lse)
    return out.reshape(batch, q_heads, head_dim)
