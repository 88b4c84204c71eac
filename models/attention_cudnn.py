"""The "cudnn" attention backend: cuDNN's fused attention, with no [T, S] mask where the rows allow.

jax.nn.dot_product_attention(implementation="cudnn") takes a mask only as a dense bias
[B, 1, T, S], which cuDNN reads for every head and cannot skip blocks by (measured on an H200
at the LLM's shapes: 3.5x slower than the Pallas range kernel at 10240 tokens, docs/gpus.md).
It also takes per-row sequence lengths, a padding mask that needs no array at all. A ViT row
is images attending within themselves then padding, so per call a lax.switch picks:

1. lengths: every row is one segment from position 0 plus padding (a ViT row of one image):
   cuDNN with the rows' lengths (`padding_lengths`);
2. segments: with `segment_length` L > 0, every row's segments are whole blocks (each query
   sees exactly its own run of equal ids), at most ceil(T / L) of them and none longer than L:
   each segment is gathered to the start of a row of its own, [B * ceil(T / L), L], cuDNN runs
   with their lengths, and the outputs are gathered back (`segment_layout`). For the ViT, L is
   the most patches one image has (`vit_image_patches`), so a row sized for k such images
   holds k;
3. otherwise the dense mask as a bias (the contract's general case, e.g. causal text).

Each branch computes exactly the contract (models/attention.py): a query with nothing visible
gets 0 and no position outside a segment gets a gradient. `implementation` is
jax.nn.dot_product_attention's: tests give "xla" to run the same selection on a CPU.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from models.attention import dense_mask


def cudnn_attention(
    q, k, v, q_seg, kv_seg, k_start, k_end, *, implementation="cudnn", segment_length=0
):
    """The per-device kernel of backend "cudnn" (the module docstring): q [B, T, Hq, D],
    k / v [B, S, Hkv, D], the ids and ranges as models/attention.attention takes them."""
    if implementation == "cudnn":
        from models import gpu_support  # a compile for a GPU target without one may use it too

        if jax.default_backend() != "gpu" and not gpu_support.compiling_for_gpu_without_one():
            raise ValueError(
                f"backend='cudnn' needs a CUDA GPU; the default JAX backend is "
                f"{jax.default_backend()!r}. Use backend='chunked' instead."
            )
        if q.dtype not in (jnp.bfloat16, jnp.float16):
            raise ValueError(f"backend='cudnn' needs bfloat16 or float16 inputs, got {q.dtype}")
    q_len, kv_len, plain = padding_lengths(q_seg, kv_seg, k_start, k_end)
    q_valid = (q_seg != 0)[:, :, None, None]
    kv_valid = (kv_seg != 0)[:, :, None, None]

    def fused(q, k, v, **masking):
        return jax.nn.dot_product_attention(q, k, v, implementation=implementation, **masking)

    def with_mask(q, k, v):
        mask = dense_mask(q_seg, kv_seg, k_start, k_end)
        # A query with no visible key (not only padding) gets exactly 0.
        return jnp.where(jnp.any(mask, axis=-1)[:, 0, :, None, None], fused(q, k, v, mask=mask), 0)

    def with_lengths(q, k, v):
        # Padding positions get no gradient whatever cuDNN leaves in them (its value for a
        # query with no keys is not specified): zero cotangent in, zero gradient out.
        q = jnp.where(q_valid, q, lax.stop_gradient(q))
        k, v = (jnp.where(kv_valid, x, lax.stop_gradient(x)) for x in (k, v))
        return fused(q, k, v, query_seq_lengths=q_len, key_value_seq_lengths=kv_len)

    branches = [with_mask, with_lengths]  # in the order of PATHS
    if segment_length and q.shape[1] == k.shape[1]:
        layout = segment_layout(q_seg, kv_seg, k_start, k_end, segment_length)

        def with_segments(q, k, v):
            # Each segment at the start of its own row; a fill position (past a segment's
            # length, or an unused row) reads 0 and its gradient goes nowhere.
            rows = (_gather_rows(x, layout.gather, layout.rows, segment_length) for x in (q, k, v))
            lengths = layout.lengths.reshape(-1)
            out = fused(*rows, query_seq_lengths=lengths, key_value_seq_lengths=lengths)
            return _gather_rows(out.reshape(q.shape[0], -1, *q.shape[2:]), layout.back, 1, None)

        branches.append(with_segments)
    choice = path_taken(q_seg, kv_seg, k_start, k_end, segment_length)
    out = lax.switch(choice, branches, q, k, v)
    # cuDNN's value for a query with nothing visible is not specified; the contract is 0.
    return jnp.where(q_valid, out, jnp.zeros((), out.dtype)).astype(q.dtype)


# The branches of `cudnn_attention`, by the index `path_taken` gives.
PATHS = ("dense mask", "lengths", "a row per image")


def path_taken(q_segment_ids, kv_segment_ids, k_start, k_end, segment_length=0) -> jax.Array:
    """The index in PATHS of the branch `cudnn_attention` takes for these rows (traced)."""
    plain = padding_lengths(q_segment_ids, kv_segment_ids, k_start, k_end)[2]
    if not segment_length or q_segment_ids.shape[1] != kv_segment_ids.shape[1]:
        return plain.astype(jnp.int32)
    fits = segment_layout(q_segment_ids, kv_segment_ids, k_start, k_end, segment_length).fits
    return jnp.where(plain, 1, jnp.where(fits, 2, 0))


def padding_lengths(q_segment_ids, kv_segment_ids, k_start, k_end):
    """(q_len [B], kv_len [B], plain): `plain` (a scalar) is True when every row's mask is a
    padding mask, (t < q_len) & (j < kv_len) for its valid queries: the row's keys are one
    segment from position 0 (kv_len of them, then padding), its queries that segment from
    position 0 (q_len of them, then padding), and each query's range covers all kv_len keys.
    A ViT row holding one image is such a row (so is a row of padding only); a row of two
    images or of causal text is not. cuDNN then needs the two lengths and no [T, S] mask."""
    q_valid, kv_valid = q_segment_ids != 0, kv_segment_ids != 0
    q_len = jnp.sum(q_valid, axis=-1, dtype=jnp.int32)
    kv_len = jnp.sum(kv_valid, axis=-1, dtype=jnp.int32)
    t = jnp.arange(q_segment_ids.shape[1])
    j = jnp.arange(kv_segment_ids.shape[1])
    segment = kv_segment_ids[:, :1]  # the row's one segment if plain (0: a row of padding)
    keys_ok = (kv_valid == (j < kv_len[:, None])) & (~kv_valid | (kv_segment_ids == segment))
    sees_all = (q_segment_ids == segment) & (k_start <= 0) & (k_end >= kv_len[:, None])
    queries_ok = (q_valid == (t < q_len[:, None])) & (~q_valid | sees_all)
    return q_len, kv_len, jnp.all(keys_ok) & jnp.all(queries_ok)


class SegmentLayout(NamedTuple):
    """Where each segment of a [B, T] row goes in rows of their own, [B, rows, length]."""

    fits: jax.Array  # scalar: every row's segments are whole blocks and fit the layout
    rows: int  # segment rows per row, ceil(T / length)
    gather: jax.Array  # [B, rows * length]: the position each one reads (T: a fill)
    back: jax.Array  # [B, T]: where each position's output lies in the segment rows
    lengths: jax.Array  # [B, rows]: each segment row's length (0: unused)


def segment_layout(q_segment_ids, kv_segment_ids, k_start, k_end, length: int) -> SegmentLayout:
    """The layout of `cudnn_attention`'s segments branch (self-attention, T == S): a segment is
    a run of equal non-zero ids; it fits when each of its queries sees exactly the run
    (k_start = run start, k_end = run end, the same ids for queries and keys), the row has at
    most ceil(T / length) of them and none is longer than `length`."""
    B, T = q_segment_ids.shape
    rows = -(-T // length)  # a row of images of up to `length` patches each holds this many
    t = jnp.arange(T, dtype=jnp.int32)
    valid = q_segment_ids != 0
    change = q_segment_ids[:, 1:] != q_segment_ids[:, :-1]
    first = jnp.concatenate([jnp.ones((B, 1), bool), change], axis=1)
    last = jnp.concatenate([change, jnp.ones((B, 1), bool)], axis=1)
    run_start = lax.cummax(jnp.where(first, t, 0), axis=1)
    run_end = lax.cummin(jnp.where(last, t + 1, T), axis=1, reverse=True)
    slot = jnp.cumsum(first & valid, axis=1, dtype=jnp.int32) - 1  # the segment's row
    whole = (k_start == run_start) & (k_end == run_end) & (slot < rows)
    whole &= run_end - run_start <= length
    fits = jnp.all(q_segment_ids == kv_segment_ids) & jnp.all(~valid | whole)
    # Each segment's start and length, written at its first position into its row's slot.
    at = (jnp.arange(B)[:, None], jnp.where(first & valid, slot, rows))  # rows: dropped
    starts = jnp.zeros((B, rows), jnp.int32).at[at].set(t[None], mode="drop")
    lengths = jnp.zeros((B, rows), jnp.int32).at[at].set(run_end - run_start, mode="drop")
    offset = jnp.arange(length, dtype=jnp.int32)
    gather = jnp.where(offset < lengths[..., None], starts[..., None] + offset, T)
    back = jnp.where(valid & (slot < rows), slot * length + t - run_start, rows * length)
    return SegmentLayout(fits, rows, gather.reshape(B, rows * length), back, lengths)


def _gather_rows(x, index, rows, length):
    """x [B, N, ...] read at index [B, M] along axis 1 (out of range: 0), then split into
    [B * rows, length, ...] rows (`length` None: left as [B, M, ...])."""
    index = index.reshape(index.shape + (1,) * (x.ndim - 2))
    out = jnp.take_along_axis(x, index, axis=1, mode="fill", fill_value=0)
    if length is None:
        return out
    return out.reshape(x.shape[0] * rows, length, *x.shape[2:])
