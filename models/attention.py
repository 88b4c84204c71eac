"""Attention over packed rows, with the mask given as per-query key ranges plus segment ids.

For batch row b and query position t, key position j is visible iff

    k_start[b, t] <= j < k_end[b, t]
    and q_segment_ids[b, t] == kv_segment_ids[b, j]
    and q_segment_ids[b, t] != 0            (segment id 0 is padding)

Why this form: BAGEL packs several samples into one row and, inside each sample, mixes causal
text with bidirectional image blocks ("causal + full" split). Every such mask is, per query, one
contiguous key interval: a text token sees [segment start, t + 1), a token of an image block sees
[segment start, block end). So two integers per query describe it exactly, and the segment ids
only have to cut off neighbouring samples (and padding) that fall inside the interval. This lets
the chunked kernel build each (query block, key block) tile of the mask on the fly, and skip key
blocks that lie outside every query interval, without ever holding a [T, S] mask in memory.

Queries whose visible set is empty (padding, or k_end <= k_start) return exactly 0 and get zero
gradient, with no NaN on the way.

Backends:
  "chunked"   (default) flash-style online softmax with a custom VJP; memory linear in T and S.
  "reference" dense mask and plain softmax in float32; small, obviously correct, used by tests.
  "dense"     the dense mask and softmax arranged for speed on a CPU: each kv head's query heads
              are stacked into one [G * T, S] product (no repeated keys), one mask shared by all
              heads; memory O(T * S) per head, so only for rows of a few thousand tokens. It
              computes every (query, key) pair, so rows packed with many samples favour
              "chunked", which skips the blocks between them (see configs/smoke.py).
  "cudnn"     jax.nn.dot_product_attention(implementation="cudnn") (attention_cudnn.py): with
              sequence lengths and no mask array where the rows are whole segments (a ViT's
              images), else with the dense mask as a bias; GPU only, fp16/bf16 only, never the
              default.
  "pallas"    flash attention as a Pallas/Triton kernel with block skipping (attention_pallas.py);
              NVIDIA GPUs sm80+ (A100, H100, H200).
  "auto"      "pallas" where it runs, else "chunked" (resolve_backend).

One module of over 500 lines: every backend of the one contract (per-query key ranges) side by
side, so their semantics can be compared line by line.
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
from jax import lax

from models import sharding

BACKENDS = ("chunked", "reference", "dense", "cudnn", "pallas", "auto")

# "dense" holds a float32 [heads, T, S] score tensor per row and layer (and keeps it for the
# backward): 1 GiB per layer for 16 heads at 4096 x 4096. Longer rows are refused.
DENSE_MAX_TOKENS = 4096

_F32 = jnp.float32


def attention(
    q,
    k,
    v,
    *,
    q_segment_ids,
    kv_segment_ids,
    k_start,
    k_end,
    backend: str = "chunked",
    q_block: int = 512,
    kv_block: int = 512,
    cudnn_segment_length: int = 0,
) -> jax.Array:
    """Masked multi-head attention over packed rows (see the module docstring for the mask).

    Args:
      q: [B, T, Hq, D] queries.
      k, v: [B, S, Hkv, D] keys and values; Hq % Hkv == 0 and query head h reads kv head
        h // (Hq // Hkv).
      q_segment_ids, k_start, k_end: [B, T] int32, per query.
      kv_segment_ids: [B, S] int32, per key.
      backend: one of BACKENDS (see the module docstring).
      q_block, kv_block: tile sizes of the chunked backend (clamped to the sequence lengths).
      cudnn_segment_length: the cudnn backend's longest segment for its segments layout (0:
        none; models/attention_cudnn.py).

    Returns:
      [B, T, Hq, D] in q.dtype. Logits and softmax statistics are float32 whatever the input dtype.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    q_segment_ids, kv_segment_ids, k_start, k_end = _check_inputs(
        q, k, v, q_segment_ids, kv_segment_ids, k_start, k_end, q_block, kv_block
    )
    if backend == "reference":
        kernel = _reference
    elif backend == "dense":
        if max(q.shape[1], k.shape[1]) > DENSE_MAX_TOKENS:
            raise ValueError(
                f"backend='dense' holds every [query, key] score in memory; rows of "
                f"{q.shape[1]} queries x {k.shape[1]} keys are over its {DENSE_MAX_TOKENS}-token "
                f"limit. Use 'chunked' (or 'auto')."
            )
        kernel = _dense
    elif backend == "cudnn":
        from models import attention_cudnn  # it builds on dense_mask below

        kernel = functools.partial(
            attention_cudnn.cudnn_attention, segment_length=cudnn_segment_length
        )
    elif resolve_backend(backend) == "pallas":
        from models import gpu_support  # Pallas/Triton is imported only when used

        kernel = _pallas_kernel(gpu_support.import_kernel("attention_pallas").range_attention)
    else:
        kernel = functools.partial(_chunked, q_block=q_block, kv_block=kv_block)
    # Every backend runs per device on its own rows (and heads under tensor parallelism): the
    # kernels slice tiles by row index (a pallas_call cannot be split at all), which sharding
    # propagation cannot do by itself.
    names = _arg_names(q, k)
    per_device = sharding.per_row_shard_map(kernel, names, out_names=names[0])
    return per_device(q, k, v, q_segment_ids, kv_segment_ids, k_start, k_end)


def _pallas_kernel(range_attention):
    def kernel(q, k, v, q_seg, kv_seg, k_start, k_end):
        return range_attention(
            q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, k_start=k_start, k_end=k_end
        )

    return kernel


def _without_heads(names):
    return tuple(None if name in ("act_heads", "act_kv_heads") else name for name in names)


def _head_names(q, q_names, k, kv_names):
    """(q_names, kv_names), the head axes dropped from both unless the kv heads split the same
    way as the query heads (else a device's query heads would miss their kv head)."""
    q_spec = sharding.logical_spec(q.shape, q_names)
    if q_spec is None:
        return q_names, kv_names
    kv_spec = sharding.logical_spec(k.shape, kv_names)
    q_axis, kv_axis = q_names.index("act_heads"), kv_names.index("act_kv_heads")
    if q_spec[q_axis] != kv_spec[kv_axis]:
        return _without_heads(q_names), _without_heads(kv_names)
    return q_names, kv_names


def _arg_names(q, k):
    """Logical names of the attention arguments: rows over the batch axes, heads as
    `_head_names` allows."""
    heads, kv_heads = _head_names(q, sharding.ROWS_HEADS, k, sharding.ROWS_KV_HEADS)
    ids = sharding.ROWS_IDS
    return (heads, kv_heads, kv_heads, ids, ids, ids, ids)


def resolve_backend(name: str) -> str:
    """The backend "auto" stands for on this machine (other names are returned unchanged):
    the Pallas kernel on an NVIDIA GPU it supports (or when compiling for a GPU target without
    one, under a compile-only GPU mesh), else "chunked"."""
    if name != "auto":
        return name
    from models import gpu_support  # not the kernels: a CPU never imports Pallas's Triton backend

    return "pallas" if gpu_support.unsupported_reason() is None else "chunked"


def dense_mask(q_segment_ids, kv_segment_ids, k_start, k_end) -> jax.Array:
    """The full boolean mask [B, 1, T, S] (broadcast over heads). Only for small inputs."""
    j = jnp.arange(kv_segment_ids.shape[1])
    in_range = (k_start[:, :, None] <= j) & (j < k_end[:, :, None])
    same_segment = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    not_padding = (q_segment_ids != 0)[:, :, None]
    return (in_range & same_segment & not_padding)[:, None]


# --------------------------------------------------------------------------------------------
# Argument checking


def _check_inputs(q, k, v, q_seg, kv_seg, k_start, k_end, q_block, kv_block):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, Hq, D], got shape {q.shape}")
    if k.ndim != 4:
        raise ValueError(f"k must be [B, S, Hkv, D], got shape {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {k.shape}, got {v.shape}")
    B, T, Hq, D = q.shape
    Bk, S, Hkv, Dk = k.shape
    if Bk != B:
        raise ValueError(f"k batch size {Bk} does not match q batch size {B}")
    if Dk != D:
        raise ValueError(f"k head dim {Dk} does not match q head dim {D}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k/v heads ({Hkv})")
    named = {
        "q_segment_ids": (q_seg, (B, T)),
        "k_start": (k_start, (B, T)),
        "k_end": (k_end, (B, T)),
        "kv_segment_ids": (kv_seg, (B, S)),
    }
    out = []
    for name, (x, shape) in named.items():
        x = jnp.asarray(x)
        if x.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {x.dtype}")
        out.append(x.astype(jnp.int32))
    for name, blk in (("q_block", q_block), ("kv_block", kv_block)):
        try:
            ok = operator.index(blk) > 0  # block sizes fix shapes, so they must be static ints
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"{name} must be a positive int, got {blk!r}")
    q_seg, k_start, k_end, kv_seg = out
    return q_seg, kv_seg, k_start, k_end


# --------------------------------------------------------------------------------------------
# Reference backend (dense mask)


def _reference(q, k, v, q_seg, kv_seg, k_start, k_end):
    B, T, Hq, D = q.shape
    group = Hq // k.shape[2]
    mask = dense_mask(q_seg, kv_seg, k_start, k_end)  # [B, 1, T, S]
    qf = q.astype(_F32)
    kf = jnp.repeat(k.astype(_F32), group, axis=2)  # repeat-interleave: head h -> kv h // group
    vf = jnp.repeat(v.astype(_F32), group, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", qf, kf) / math.sqrt(D)
    e, denom = _masked_exp(s, mask)
    return jnp.einsum("bhts,bshd->bthd", e / denom, vf).astype(q.dtype)


def _masked_exp(s, mask):
    """exp(s - rowmax) with masked entries at exactly 0, and each row's sum (1 for a row with
    nothing visible): the softmax is e / denom. An all-masked row has max -inf; shifting it by
    0 instead keeps exp() at exactly 0, so its output and gradient are 0 rather than 0/0."""
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.exp(s - m)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    return e, jnp.where(denom > 0, denom, 1.0)


def _dense(q, k, v, q_seg, kv_seg, k_start, k_end):
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    mask = dense_mask(q_seg, kv_seg, k_start, k_end)[:, :, None]  # [B, 1, 1, T, S]
    # Head-major operands: kv head h's G query heads are rows [g * T + t] of one matrix, so
    # each kv head is a single plain [G*T, D] x [D, S] product (the layout XLA:CPU's matmuls
    # take without copies), and the 1/sqrt(D) scale is folded into the small q operand.
    scaled = (q.astype(_F32) * (1.0 / math.sqrt(D))).reshape(B, T, Hkv, G, D)
    q_rows = jnp.einsum("bthgd->bhgtd", scaled).reshape(B, Hkv, G * T, D)
    k_heads = jnp.einsum("bshd->bhsd", k.astype(_F32))
    v_heads = jnp.einsum("bshd->bhsd", v.astype(_F32))
    s = jnp.einsum("bhtd,bhsd->bhts", q_rows, k_heads).reshape(B, Hkv, G, T, S)
    e, denom = _masked_exp(s, mask)
    # Normalise after the product with v: a pass over [T, D] instead of one over [T, S].
    out = jnp.einsum("bhts,bhsd->bhtd", e.reshape(B, Hkv, G * T, S), v_heads)
    out = out.reshape(B, Hkv, G, T, D) / denom
    return jnp.einsum("bhgtd->bthgd", out).reshape(B, T, Hq, D).astype(q.dtype)


# --------------------------------------------------------------------------------------------
# Chunked (flash-style) backend


def _round_up(n, m):
    return -(-n // m) * m


def _chunked(q, k, v, q_seg, kv_seg, k_start, k_end, *, q_block, kv_block):
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    if T == 0 or S == 0:
        return jnp.zeros(q.shape, q.dtype)
    bq, bk = min(operator.index(q_block), T), min(operator.index(kv_block), S)
    Tp, Sp = _round_up(T, bq), _round_up(S, bk)

    # Padded queries and keys get segment 0, which the tile mask already excludes, so padding
    # needs no special case inside the kernel. Clipping the ranges to [0, S] changes nothing
    # about which keys are visible but keeps the kv block bounds inside the array.
    def pad_seq(x, n):
        return jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2))

    q5 = pad_seq(q, Tp).reshape(B, Tp, Hkv, Hq // Hkv, D)  # head h = kv_head * group + g
    out = _flash(
        q5,
        pad_seq(k, Sp),
        pad_seq(v, Sp),
        pad_seq(q_seg, Tp),
        pad_seq(kv_seg, Sp),
        pad_seq(jnp.clip(k_start, 0, S), Tp),
        pad_seq(jnp.clip(k_end, 0, S), Tp),
        bq,
        bk,
    )
    return out.reshape(B, Tp, Hq, D)[:, :T]


def _block_plan(q_seg, k_start, k_end, bq, bk, Sp):
    """Flattened per-(batch, q block) inputs for lax.map/scan, with each block's kv block range.

    A q block only needs kv blocks that intersect the union of its queries' intervals, i.e.
    [min k_start, max k_end) over the queries that see anything at all.
    """
    B, Tp = q_seg.shape
    nq = Tp // bq
    seg = q_seg.reshape(B * nq, bq)
    ks = k_start.reshape(B * nq, bq)
    ke = k_end.reshape(B * nq, bq)
    live = (seg != 0) & (ke > ks)
    lo = jnp.min(jnp.where(live, ks, Sp), axis=1) // bk
    hi = -(-jnp.max(jnp.where(live, ke, 0), axis=1) // bk)  # a dead block gets lo > hi: no work
    batch_index = jnp.repeat(jnp.arange(B, dtype=jnp.int32), nq)
    return batch_index, seg, ks, ke, lo, hi


def _kv_tile(x, b, kb, bk):
    """Rows [kb*bk, (kb+1)*bk) of batch row b of a [B, Sp, ...] array."""
    start = (b, kb * bk) + (0,) * (x.ndim - 2)
    return lax.dynamic_slice(x, start, (1, bk) + x.shape[2:])[0]


def _add_kv_tile(acc, tile, b, kb, bk):
    """acc[b, kb*bk : (kb+1)*bk] += tile, in place inside the loop."""
    updated = _kv_tile(acc, b, kb, bk) + tile
    return lax.dynamic_update_slice(acc, updated[None], (b, kb * bk) + (0,) * (acc.ndim - 2))


def _tile_logits(q_blk, k_blk, seg, ks, ke, kv_seg_blk, kb, bk, scale):
    """Scaled float32 logits of one tile, [Hkv, G, bq, bk], with invisible entries at -inf."""
    j = kb * bk + jnp.arange(bk)
    visible = (
        (ks[:, None] <= j)
        & (j < ke[:, None])
        & (seg[:, None] == kv_seg_blk[None, :])
        & (seg[:, None] != 0)
    )
    s = jnp.einsum("qhgd,khd->hgqk", q_blk, k_blk, preferred_element_type=_F32) * scale
    return jnp.where(visible, s, -jnp.inf)


def _flash_forward(q, k, v, q_seg, kv_seg, k_start, k_end, bq, bk):
    """Returns out [B, Tp, Hkv, G, D] (q.dtype) and lse [B, Tp, Hkv, G] (float32)."""
    B, Tp, Hkv, G, D = q.shape
    Sp = k.shape[1]
    scale = 1.0 / math.sqrt(D)
    plan = _block_plan(q_seg, k_start, k_end, bq, bk, Sp)
    q_blocks = q.reshape(B * (Tp // bq), bq, Hkv, G, D)

    def one_q_block(xs):
        b, seg, ks, ke, lo, hi, q_blk = xs

        def kv_step(kb, carry):
            m, l, acc = carry
            k_blk, v_blk = _kv_tile(k, b, kb, bk), _kv_tile(v, b, kb, bk)
            s = _tile_logits(q_blk, k_blk, seg, ks, ke, _kv_tile(kv_seg, b, kb, bk), kb, bk, scale)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            # Rows with nothing visible so far keep m = -inf; shifting them by 0 makes every
            # exp() below exactly 0 instead of exp(-inf - -inf) = NaN.
            shift = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
            p = jnp.exp(s - shift[..., None])
            rescale = jnp.exp(m - shift)
            l = rescale * l + jnp.sum(p, axis=-1)
            pv = jnp.einsum("hgqk,khd->hgqd", p.astype(v.dtype), v_blk, preferred_element_type=_F32)
            return m_new, l, rescale[..., None] * acc + pv

        init = (
            jnp.full((Hkv, G, bq), -jnp.inf, _F32),
            jnp.zeros((Hkv, G, bq), _F32),
            jnp.zeros((Hkv, G, bq, D), _F32),
        )
        m, l, acc = lax.fori_loop(lo, hi, kv_step, init)
        seen = l > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        # Empty rows get lse 0: any finite value works, since their logits are all -inf and the
        # backward's exp(s - lse) is then exactly 0.
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
        return (jnp.einsum("hgqd->qhgd", out).astype(q.dtype), jnp.einsum("hgq->qhg", lse))

    out, lse = lax.map(one_q_block, plan + (q_blocks,))
    return out.reshape(B, Tp, Hkv, G, D), lse.reshape(B, Tp, Hkv, G)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _flash(q, k, v, q_seg, kv_seg, k_start, k_end, bq, bk):
    return _flash_forward(q, k, v, q_seg, kv_seg, k_start, k_end, bq, bk)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, k_start, k_end, bq, bk):
    out, lse = _flash_forward(q, k, v, q_seg, kv_seg, k_start, k_end, bq, bk)
    # Only O(T + S) residuals: the inputs, the output and one float32 logsumexp per query row.
    return out, (q, k, v, q_seg, kv_seg, k_start, k_end, out, lse)


def _flash_bwd(bq, bk, residuals, d_out):
    q, k, v, q_seg, kv_seg, k_start, k_end, out, lse = residuals
    B, Tp, Hkv, G, D = q.shape
    Sp = k.shape[1]
    nq = Tp // bq
    scale = 1.0 / math.sqrt(D)
    d_out = d_out.astype(q.dtype)
    # rowsum(dO * O) = sum_j P_ij dP_ij, the softmax Jacobian's correction term per query row.
    delta = jnp.einsum("bthgd,bthgd->bthg", d_out.astype(_F32), out.astype(_F32))

    def blocks(x):
        return x.reshape((B * nq, bq) + x.shape[2:])

    plan = _block_plan(q_seg, k_start, k_end, bq, bk, Sp)
    xs = plan + (blocks(q), blocks(d_out), blocks(lse), blocks(delta))

    # dK and dV are accumulated into full-size float32 buffers carried through the (sequential)
    # loop over q blocks; they are O(S), so this keeps memory linear while every tile is visited
    # once, exactly as in the forward.
    def one_q_block(carry, xs):
        dk_acc, dv_acc = carry
        b, seg, ks, ke, lo, hi, q_blk, do_blk, lse_blk, delta_blk = xs
        lse_blk = jnp.einsum("qhg->hgq", lse_blk)
        delta_blk = jnp.einsum("qhg->hgq", delta_blk)

        def kv_step(kb, carry):
            dq, dk_acc, dv_acc = carry
            k_blk, v_blk = _kv_tile(k, b, kb, bk), _kv_tile(v, b, kb, bk)
            s = _tile_logits(q_blk, k_blk, seg, ks, ke, _kv_tile(kv_seg, b, kb, bk), kb, bk, scale)
            p = jnp.exp(s - lse_blk[..., None])  # invisible entries: exp(-inf) = 0
            dv = jnp.einsum(
                "hgqk,qhgd->khd", p.astype(do_blk.dtype), do_blk, preferred_element_type=_F32
            )
            dp = jnp.einsum("qhgd,khd->hgqk", do_blk, v_blk, preferred_element_type=_F32)
            ds = p * (dp - delta_blk[..., None])
            dq = dq + scale * jnp.einsum(
                "hgqk,khd->qhgd", ds.astype(k.dtype), k_blk, preferred_element_type=_F32
            )
            dk = scale * jnp.einsum(
                "hgqk,qhgd->khd", ds.astype(q.dtype), q_blk, preferred_element_type=_F32
            )
            return dq, _add_kv_tile(dk_acc, dk, b, kb, bk), _add_kv_tile(dv_acc, dv, b, kb, bk)

        dq0 = jnp.zeros((bq, Hkv, G, D), _F32)
        dq, dk_acc, dv_acc = lax.fori_loop(lo, hi, kv_step, (dq0, dk_acc, dv_acc))
        return (dk_acc, dv_acc), dq.astype(q.dtype)

    zeros = jnp.zeros(k.shape, _F32)
    (dk, dv), dq = lax.scan(one_q_block, (zeros, zeros), xs)
    dq = dq.reshape(q.shape)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# Whether "auto" runs the decode kernel where it resolves to Pallas. No: on its first run on a
# GPU (an H200, jax 0.11.2, bench/gpu_check.py's parity section, 2026-12-04) the kernel missed
# XLA's decode attention by 2.4 (max abs error; outputs of order 1) at BAGEL's 28 / 4 heads and
# 4160 slots, while the Pallas interpreter matches it to 1e-3 at the same shapes: its blocks
# overhung their arrays, which jax 0.12's lowering masks and jax 0.11's does not. The kernel no
# longer relies on that (tests/test_pallas_blocks.py), but until a GPU run passes, sampling by
# default takes the XLA path, and the kernel runs only where "pallas" is named (its tests,
# bench/scale.py's kernel projections). docs/gpus.md has the figures.
DECODE_KERNEL_IN_AUTO = False


def cache_attention(
    q, cache, layer, kv_lengths, backend: str = "auto", interpret: bool = False
) -> jax.Array:
    """The decode step's attention for layer `layer` of the stacked cache (cache:
    [L, B, S, 2, Hkv, D], keys at 0 and values at 1 of axis 3, so that a token's key and value
    are written in one scatter); q: [B, Hq, D]; key slot j of row b is visible iff
    j < kv_lengths[b].

    With backend "pallas" named (not "auto": `DECODE_KERNEL_IN_AUTO`) and a shape it takes,
    the kernel of models/decode_attention_pallas.py reads the cache in place and only each row's
    filled slots, per device (a shard_map over rows and kv heads). Otherwise `decode_attention`
    on the layer's slices, which XLA partitions by itself. `interpret` runs the kernel in the
    Pallas interpreter (tests, on any backend).
    """
    if backend == "pallas" or (DECODE_KERNEL_IN_AUTO and resolve_backend(backend) == "pallas"):
        from models import gpu_support  # Triton only when used

        kernel = gpu_support.import_kernel("decode_attention_pallas")

        if kernel.supported(cache.shape[-1], cache.shape[2]):
            names = _cache_arg_names(q, cache)
            per_device = sharding.per_row_shard_map(
                functools.partial(kernel.filled_cache_attention, interpret=interpret),
                names,
                out_names=names[0],
            )
            return per_device(q, cache, jnp.asarray(layer, jnp.int32), kv_lengths)
    _, rows_here, _, _, kv_heads_here, _ = sharding.per_device(
        cache.shape, _cache_arg_names(q, cache)[1]
    )
    return decode_attention(
        q, cache[layer, :, :, 0], cache[layer, :, :, 1], kv_lengths, kv_heads_here, rows_here
    )


def _cache_arg_names(q, cache):
    """Logical names of cache_attention's arguments (q [B, Hq, D], the [L, B, S, 2, Hkv, D]
    cache, the layer, the lengths): rows over the batch axes, heads as `_head_names` allows."""
    heads, cache_names = _head_names(
        q,
        ("act_batch", "act_heads", None),
        cache,
        (None, "act_batch", None, None, "act_kv_heads", None),
    )
    return (heads, cache_names, (), ("act_batch",))


# Whether XLA's decode attention reads the cache in place on a GPU (below). Compiled for an H100,
# the one-GPU LoRA recipe's decode step (16 rows, 7170 cache slots) moved 39.70 GiB of HBM per
# token in 757 kernels through the two einsums, 18.74 GiB of it pads and transposes of every
# layer's K and V (a batched GEMM cannot read the [B, S, 2, Hkv, D] cache's strided slices);
# in place, 22.05 GiB in 476 kernels, and the decode round's peak 43.94 -> 37.72 GiB
# (2026-12-06). Faster on a GPU as far as its bytes say; bench/gpu_check.py's decode section
# times the path 'auto' takes.
DECODE_IN_PLACE_ON_GPU = True

# Below this many kv heads per device, the in-place scores are summed one query head of a group
# at a time. Compiled for H100s, the paper recipe's decode round in its 'tensor' layout (tensor
# 4: one kv head and 8 rows per device, 7170 slots) kept the one-sum form's broadcast over the
# group's 7 query heads in a reduce fusion that XLA would not fuse the layer's key slice into:
# every token it copied each layer's keys out of the cache (28 MiB a layer, 0.77 GiB of the
# step's 5.98). Summed per query head, the 7 sums read the keys where they lie, in one fusion.
# With 2 kv heads a device both forms moved data (the one sum more); with 4 (the one-GPU
# recipe, the replicated layouts) the one sum copies nothing, where the per-head sums add
# transposes of the scores (2026-12-06; tests/test_gpu_compile.py checks the tensor layout).
PER_QUERY_HEAD_SCORES_BELOW = 4

# Where a device holds at least PER_QUERY_HEAD_SCORES_BELOW kv heads and this many rows, the
# in-place output sums the slots in chunks of at most VALUE_SUM_CHUNK, then adds the chunks'
# sums. XLA:GPU splits a column reduction longer than 4096 slots (a warp times its tile) into a
# tree: the one-GPU LoRA recipe's 7296 slots became 64 partial sums of 114, f32[16,4,7,64,128]
# written and read again (28 MiB a layer), and the softmax's weights went to it as f32 exp
# (25 MiB more). In 8 chunks of 912 each sum stays whole, the 8 partials are 1.75 MiB, and XLA
# writes the weights once, normalised, in bf16, from one fusion that also takes the row max
# (guarded by the row's length, not by isfinite(max), which took a pass of its own). Compiled
# for one H100 (2026-12-06), HBM per decode step at 7296 slots: 16 rows 22.098 -> 20.743 GiB
# (the floor 18.858) in 448 -> 420 kernels, 8 rows 17.635 -> 16.957, 32 rows 31.026 -> 28.316;
# 16 rows at 2048 / 12288 slots 17.368 -> 17.080 / 26.955 -> 25.759. With 2 or 4 rows a device
# (the 8-GPU 'replicated' layout) or one kv head (the 'tensor' one) XLA copied each layer's
# values out of the cache instead (+0.78 GiB a step), so those keep the one reduction.
# tests/test_gpu_compile.py checks both sides. The chunks are added one by one: summed by
# jnp.sum, XLA merges the two reductions into one and splits it 64 ways again.
CHUNKED_VALUE_SUM_MIN_ROWS = 8
VALUE_SUM_CHUNK = 1024
MAX_VALUE_SUM_CHUNKS = 64  # more would be that many adds a layer: one reduction instead


def value_chunks(num_slots: int) -> int:
    """The fewest chunks of at most VALUE_SUM_CHUNK slots that split num_slots evenly; 1 (one
    reduction) where none of at most MAX_VALUE_SUM_CHUNKS does."""
    for chunks in range(1, MAX_VALUE_SUM_CHUNKS + 1):
        if num_slots % chunks == 0 and num_slots // chunks <= VALUE_SUM_CHUNK:
            return chunks
    return 1


def _in_place_value_sum(weights, v_cache, chunks: int):
    """sum_s weights[b, h, g, s] * v_cache[b, s, h, :] in f32, read from the cache's own layout,
    the slots in `chunks` equal chunks. weights: [B, Hkv, G, S]; returns [B, Hkv, G, D]."""
    batch, num_slots, kv_heads, head_dim = v_cache.shape
    size = num_slots // chunks
    chunked = (batch, kv_heads, weights.shape[2], chunks, size)
    weights = weights.astype(_F32).reshape(chunked)[..., None]  # [B, Hkv, G, chunks, size, 1]
    values = v_cache.astype(_F32).reshape(batch, chunks, size, kv_heads, head_dim)
    values = jnp.moveaxis(values, 3, 1)[:, :, None]  # [B, Hkv, 1, chunks, size, D]
    partial = jnp.sum(weights * values, axis=4)  # [B, Hkv, G, chunks, D]
    return functools.reduce(operator.add, [partial[:, :, :, c] for c in range(chunks)])


def decode_attention(
    q, k_cache, v_cache, kv_lengths, kv_heads_per_device=None, rows_per_device=None
) -> jax.Array:
    """One query per row against a KV cache: the decode step's attention.

    q: [B, Hq, D]; k_cache, v_cache: [B, S, Hkv, D]; key slot j is visible iff j < kv_lengths[b].
    Every cached token precedes the query, so this plain length mask is the whole mask (image
    blocks only occur in the prompt, whose ranges were applied when it was prefilled). A row
    with kv_lengths 0 returns 0. Returns [B, Hq, D] in q.dtype; softmax in float32.

    On a GPU (or compiled for one) the scores and the output are float32 products summed by
    XLA reduce fusions that read the cache where it lies (`DECODE_IN_PLACE_ON_GPU`); elsewhere
    two einsums, whose GEMMs suit a CPU or a TPU. `kv_heads_per_device` and `rows_per_device`
    (default: all of k_cache's) pick the form of the in-place sums (`PER_QUERY_HEAD_SCORES_BELOW`,
    `CHUNKED_VALUE_SUM_MIN_ROWS`); the result is the same to rounding either way.
    """
    batch, num_slots, kv_heads, head_dim = k_cache.shape
    q_heads = q.shape[1]
    if q_heads % kv_heads:
        raise ValueError(
            f"decode_attention: q heads {q_heads} not a multiple of kv heads {kv_heads}"
        )
    from models import gpu_support

    in_place = DECODE_IN_PLACE_ON_GPU and gpu_support.compiling_for_gpu()
    # The in-place sums' forms, by what one device holds (the constants say why).
    few_heads = (kv_heads_per_device or kv_heads) < PER_QUERY_HEAD_SCORES_BELOW
    many_rows = (rows_per_device or batch) >= CHUNKED_VALUE_SUM_MIN_ROWS
    grouped = q.reshape(batch, kv_heads, q_heads // kv_heads, head_dim).astype(k_cache.dtype)
    if in_place:  # [B, Hkv, G, S], summed over D from the cache's own layout
        keys = jnp.moveaxis(k_cache.astype(_F32), 1, 2)[:, :, None, :, :]
        queries = grouped.astype(_F32)[:, :, :, None, :]
        if few_heads:
            groups = range(queries.shape[2])
            sums = [jnp.sum(queries[:, :, g : g + 1] * keys, axis=-1) for g in groups]
            scores = jnp.concatenate(sums, axis=2)
        else:
            scores = jnp.sum(queries * keys, axis=-1)
    else:
        scores = jnp.einsum("bhgd,bshd->bhgs", grouped, k_cache, preferred_element_type=_F32)
    scores = scores / math.sqrt(head_dim)
    visible = (jnp.arange(num_slots)[None, :] < kv_lengths[:, None])[:, None, None, :]
    scores = jnp.where(visible, scores, -jnp.inf)
    max_score = jnp.max(scores, axis=-1, keepdims=True)
    # A row with no filled slot has max -inf: 0 in its place, so its weights are exp(-inf) = 0.
    filled = (kv_lengths > 0)[:, None, None, None]
    weights = jnp.exp(scores - jnp.where(filled, max_score, 0.0))
    weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-30)
    weights = weights.astype(v_cache.dtype)
    if in_place:  # [B, Hkv, G, D], summed over the slots
        chunks = value_chunks(num_slots) if many_rows and not few_heads else 1
        out = _in_place_value_sum(weights, v_cache, chunks)
    else:
        out = jnp.einsum("bhgs,bshd->bhgd", weights, v_cache, preferred_element_type=_F32)
    return out.reshape(batch, q_heads, head_dim).astype(q.dtype)
