"""Flash attention over per-query key ranges, as a Pallas kernel for NVIDIA GPUs (Triton backend).

Same contract as models/attention.py: query t of row b sees key j iff k_start <= j < k_end, the
segment ids match and are not 0 (padding); a query that sees nothing returns exactly 0 and gets
zero gradient. GQA (query head h reads kv head h // (Hq // Hkv)), any float dtype in, float32
logits, softmax statistics and accumulators.

Why a kernel of our own: the `chunked` backend skips key blocks but runs as an XLA loop of small
einsums, and `cudnn` needs the dense [B, 1, T, S] mask (a dense bias inside jax, no block
skipping). jax's own `jax.experimental.pallas.ops.gpu.attention.mha` is the model here, with its
causal / segment-id test replaced by the range test. tokamax 0.0.17 installs on jax 0.12.0.1, but
its Pallas-Triton backward turns the mask into a dense [B, 1, T, S] array and its range-aware
Mosaic kernels are Hopper/Blackwell only (and need its private `base.Mask`), so it is not used.

How block skipping works: outside the kernel, each q block gets the kv block interval
[lo, hi) = [min k_start // bk, ceil(max k_end / bk)) over its live queries (`_kv_block_ranges`,
the same plan as attention._block_plan); the forward and dQ kernels loop only over that interval.
The dK/dV kernel needs the transpose: for each kv block the interval of q blocks whose [lo, hi)
contains it (`_q_block_ranges`). Inside a visited tile the exact mask is rebuilt from the
[bq] / [bk] id vectors, so no [T, S] array exists in the forward or the backward. The triton
backend has no scalar prefetch, so the intervals travel as small int32 arrays that each program
reads one element of.

Kernels (all with a grid over (block, batch, head)):
  forward  grid (T/bq, B, Hq):  out and a log2-domain logsumexp per query row.
  dQ       grid (T/bq, B, Hq):  the same kv loop, recomputing P from the logsumexp.
  dK, dV   grid (S/bk, B, Hkv): loops over the Hq/Hkv query heads of its kv head and over the q
                                blocks that see the kv block, so GQA needs no per-q-head dK/dV
                                buffer and no atomics.
rowsum(dO * O) is a plain XLA reduction.

Hardware: NVIDIA GPUs of compute capability 8.0 or newer (Ampere A100, Ada, Hopper H100/H200),
where Triton has bf16 tensor-core dots; `unsupported_reason()` refuses anything else. Written for
and tuned (block sizes) for H100/H200. jax 0.12 marks its Pallas Triton backend deprecated (a
DeprecationWarning at lowering) in favour of Mosaic GPU; the kernel uses only public
`jax.experimental.pallas(.triton)` names, and tests/test_attention_pallas.py lowers all three
kernels to Triton IR for an H100 so a moved API fails there, on CPU.

Head dims are padded to a power of two (>= 16), as Triton tiles must be: free for BAGEL's LLM
(128), a ~1.8x compute overhead for SigLIP's 72.

Sharding: a pallas_call is an opaque custom call to XLA's SPMD partitioner, which cannot split
it by rows; under jit with row-sharded activations it must run inside a shard_map over the row
axes (each device on its own rows: attention runs per device), or XLA
gathers its operands. That wrapper belongs to the caller's sharding layer, not to this kernel.

Without a GPU, `interpret=True` runs the very same kernels in the Pallas interpreter (slow; for
tests). The product never does that: attention.resolve_backend('auto') picks this kernel only on
a supported GPU.

One module of over 500 lines: the forward kernel, the two backward kernels and the block-range
tables they share are one flash-attention mechanism.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from models.gpu_support import unsupported_reason
from models.layers import ATTENTION_FORWARD_KERNEL

_F32 = jnp.float32
_LOG2_E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two, >= 16 for Triton's dot) and the software-pipeline stages of
    every kernel. The forward holds a [q, D] accumulator per program, the backward kernels two
    [*, D] float32 accumulators, hence smaller tiles there. bench/gpu_check.py's `tiles` section
    times candidates at the recipe's lengths (bench/gpu_sections/tiles.py)."""

    q: int = 128
    k: int = 64
    q_bwd: int = 64
    k_bwd: int = 64
    stages: int = 2

    def __post_init__(self):
        for name in ("q", "k", "q_bwd", "k_bwd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {value!r}")
        if not isinstance(self.stages, int) or not 1 <= self.stages <= 5:
            raise ValueError(f"BlockSizes.stages must be an integer in 1..5, got {self.stages!r}")


# The tiles the kernel is tuned among (bench/gpu_check.py --tiles times each at the recipe's
# row lengths, TUNED_LENGTHS): one choice varied at a time around the default, which is first.
TILE_CANDIDATES = (
    BlockSizes(),
    BlockSizes(stages=3),
    BlockSizes(k=128),
    BlockSizes(q=64),
    BlockSizes(k_bwd=128),
    BlockSizes(q_bwd=128),
)
TUNED_LENGTHS = (6144, 10240)  # the student's and the teacher's rows of the 7B recipes


def range_attention(
    q,
    k,
    v,
    *,
    q_segment_ids,
    kv_segment_ids,
    k_start,
    k_end,
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool = False,
) -> jax.Array:
    """Masked attention (contract of models/attention.attention) with the Pallas kernels.

    q: [B, T, Hq, D]; k, v: [B, S, Hkv, D]; q_segment_ids, k_start, k_end: [B, T] ints;
    kv_segment_ids: [B, S] ints. Returns [B, T, Hq, D] in q.dtype.

    interpret=True runs the kernels in the Pallas interpreter on any backend (tests); otherwise a
    supported NVIDIA GPU is required and anything else is refused with the reason.
    """
    if not interpret and (reason := unsupported_reason()) is not None:
        raise ValueError(
            f"attention backend 'pallas' needs an NVIDIA GPU of compute capability >= 8.0: "
            f"{reason}. Use backend 'chunked' (or 'auto') instead."
        )
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or Hq % Hkv:
        raise ValueError(f"bad shapes q {q.shape}, k {k.shape}, v {v.shape}")
    if T == 0 or S == 0:
        return jnp.zeros(q.shape, q.dtype)
    bs = block_sizes
    Tp = _round_up(T, max(bs.q, bs.q_bwd))
    Sp = _round_up(S, max(bs.k, bs.k_bwd))
    Dp = max(16, pl.next_power_of_2(D))

    # Padded queries and keys get segment 0, so the tile mask already excludes them; zero head
    # dims change no logit and give zero output columns. Clipping the ranges to [0, S] keeps the
    # block intervals inside the array without changing which keys are visible.
    def pad(x, n, d=None):
        widths = [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
        if d is not None:
            widths[-1] = (0, d - x.shape[-1])
        return jnp.pad(x, widths)

    as_int = lambda x: jnp.asarray(x).astype(jnp.int32)  # noqa: E731
    out = _attention(
        pad(q, Tp, Dp),
        pad(k, Sp, Dp),
        pad(v, Sp, Dp),
        pad(as_int(q_segment_ids), Tp),
        pad(as_int(kv_segment_ids), Sp),
        pad(jnp.clip(as_int(k_start), 0, S), Tp),
        pad(jnp.clip(as_int(k_end), 0, S), Tp),
        _Static(bs, 1.0 / math.sqrt(D), interpret),
    )
    return out[:, :T, :, :D]


@dataclasses.dataclass(frozen=True)
class _Static:
    """Hashable non-array arguments of the custom VJP."""

    blocks: BlockSizes
    scale: float  # 1 / sqrt(true head dim), not of the padded one
    interpret: bool


def _round_up(n, m):
    return -(-n // m) * m


# --------------------------------------------------------------------------------------------
# Block plans (outside the kernels, O(T / block) numbers per row)


def _kv_block_ranges(q_seg, k_start, k_end, bq, bk, Sp):
    """Per (row, q block): the kv block interval [lo, hi) holding every key its queries see.

    A block with no live query gets lo > hi, so its loop runs zero times.
    """
    B, Tp = q_seg.shape
    seg, ks, ke = (x.reshape(B, Tp // bq, bq) for x in (q_seg, k_start, k_end))
    live = (seg != 0) & (ke > ks)
    lo = jnp.min(jnp.where(live, ks, Sp), axis=2) // bk
    hi = -(-jnp.max(jnp.where(live, ke, 0), axis=2) // bk)
    return lo.astype(jnp.int32), hi.astype(jnp.int32)


def _q_block_ranges(lo, hi, nk):
    """Per (row, kv block): the q block interval [first, last + 1) of q blocks whose kv interval
    contains it ([0, 0) if none). Blocks in between that do not see it are masked, not skipped;
    with BAGEL's segment-local ranges the q blocks seeing a kv block are contiguous anyway.
    """
    nq = lo.shape[1]
    kb = jnp.arange(nk, dtype=jnp.int32)
    sees = (lo[:, :, None] <= kb) & (kb < hi[:, :, None])  # [B, nq, nk], tiny
    any_ = jnp.any(sees, axis=1)
    first = jnp.argmax(sees, axis=1)
    last = nq - 1 - jnp.argmax(sees[:, ::-1], axis=1)
    return (
        jnp.where(any_, first, 0).astype(jnp.int32),
        jnp.where(any_, last + 1, 0).astype(jnp.int32),
    )


# --------------------------------------------------------------------------------------------
# Kernels. Logits are kept in the log2 domain (scaled by log2(e)) so the softmax uses exp2.


def _masked_logits(q, k, seg, ks, ke, kv_seg, k0, qk_scale):
    """[bq, bk] float32 logits (log2 domain) of one tile, -inf where the range mask hides a key."""
    bk = k.shape[0]
    j = k0 + jnp.arange(bk, dtype=jnp.int32)[None, :]
    visible = (
        (ks[:, None] <= j)
        & (j < ke[:, None])
        & (seg[:, None] == kv_seg[None, :])
        & (seg[:, None] != 0)
    )
    s = plgpu.dot(q, k, trans_b=True) * qk_scale
    return jnp.where(visible, s, -jnp.inf)


def _forward_kernel(
    lo_ref,
    hi_ref,
    seg_ref,
    ks_ref,
    ke_ref,
    kv_seg_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    lse_ref,
    *,
    qk_scale,
    bk,
):
    i = pl.program_id(0)
    q, seg, ks, ke = q_ref[...], seg_ref[...], ks_ref[...], ke_ref[...]
    bq, dp = q.shape

    def kv_step(kb, carry):
        acc, m, l = carry
        span = pl.ds(kb * bk, bk)
        s = _masked_logits(q, k_ref[span, :], seg, ks, ke, kv_seg_ref[span], kb * bk, qk_scale)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # Rows with nothing visible yet keep m = -inf; shifting them by 0 makes every exp2 below
        # exactly 0 instead of exp2(-inf - -inf) = NaN.
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp2(s - shift[:, None])
        rescale = jnp.exp2(m - shift)
        v = v_ref[span, :]
        acc = rescale[:, None] * acc + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_new, rescale * l + jnp.sum(p, axis=1)

    init = (jnp.zeros((bq, dp), _F32), jnp.full((bq,), -jnp.inf, _F32), jnp.zeros((bq,), _F32))
    acc, m, l = lax.fori_loop(lo_ref[i], hi_ref[i], kv_step, init)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    o_ref[...] = jnp.where(seen[:, None], acc / l_safe[:, None], 0.0).astype(o_ref.dtype)
    # Empty rows: any finite lse works, their logits are all -inf so exp2(s - lse) = 0.
    lse_ref[...] = jnp.where(seen, m + jnp.log2(l_safe), 0.0)


def _dq_kernel(
    lo_ref,
    hi_ref,
    seg_ref,
    ks_ref,
    ke_ref,
    kv_seg_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    *,
    qk_scale,
    scale,
    bk,
):
    i = pl.program_id(0)
    q, do = q_ref[...], do_ref[...]
    seg, ks, ke = seg_ref[...], ks_ref[...], ke_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def kv_step(kb, dq):
        span = pl.ds(kb * bk, bk)
        k = k_ref[span, :]
        s = _masked_logits(q, k, seg, ks, ke, kv_seg_ref[span], kb * bk, qk_scale)
        p = jnp.exp2(s - lse[:, None])  # hidden entries: exp2(-inf) = 0
        dp = plgpu.dot(do, v_ref[span, :], trans_b=True)
        ds = p * (dp - delta[:, None])
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(lo_ref[i], hi_ref[i], kv_step, jnp.zeros(q.shape, _F32))
    dq_ref[...] = (scale * dq).astype(dq_ref.dtype)


def _dkdv_kernel(
    qlo_ref,
    qhi_ref,
    seg_ref,
    ks_ref,
    ke_ref,
    kv_seg_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    qk_scale,
    scale,
    bq,
    group,
):
    j = pl.program_id(0)
    k, v, kv_seg = k_ref[...], v_ref[...], kv_seg_ref[...]
    bk, dp = k.shape

    def q_head(g, carry):  # the query heads that share this kv head
        def q_step(qb, carry):
            dk, dv = carry
            span = pl.ds(qb * bq, bq)
            q, do = q_ref[span, g, :], do_ref[span, g, :]
            s = _masked_logits(
                q, k, seg_ref[span], ks_ref[span], ke_ref[span], kv_seg, j * bk, qk_scale
            )
            p = jnp.exp2(s - lse_ref[g, span][:, None])
            dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True)
            dp = plgpu.dot(do, v, trans_b=True)
            ds = p * (dp - delta_ref[g, span][:, None])
            return dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True), dv

        return lax.fori_loop(qlo_ref[j], qhi_ref[j], q_step, carry)

    zeros = jnp.zeros((bk, dp), _F32)
    dk, dv = lax.fori_loop(0, group, q_head, (zeros, zeros))
    dk_ref[...] = (scale * dk).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _compiler_params(rows, dp, stages):
    """8 warps only for the big forward tile with a wide head (as jax's mha); else 4."""
    return plgpu.CompilerParams(num_warps=8 if rows >= 128 and dp >= 128 else 4, num_stages=stages)


# --------------------------------------------------------------------------------------------
# pallas_calls and the custom VJP (all arrays padded: T, S to the block sizes, D to Dp)


def _forward(q, k, v, q_seg, kv_seg, k_start, k_end, static):
    B, Tp, Hq, Dp = q.shape
    Sp, Hkv = k.shape[1], k.shape[2]
    bq, bk, group = static.blocks.q, static.blocks.k, Hq // Hkv
    nq = Tp // bq
    lo, hi = _kv_block_ranges(q_seg, k_start, k_end, bq, bk, Sp)
    row = lambda n: pl.BlockSpec((None, n), lambda i, b, h: (b, 0))  # noqa: E731
    q_rows = pl.BlockSpec((None, bq), lambda i, b, h: (b, i))
    kv_head = pl.BlockSpec((None, Sp, None, Dp), lambda i, b, h: (b, 0, h // group, 0))
    q_tile = pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0))
    return pl.pallas_call(
        functools.partial(_forward_kernel, qk_scale=static.scale * _LOG2_E, bk=bk),
        grid=(nq, B, Hq),
        in_specs=[row(nq), row(nq), q_rows, q_rows, q_rows, row(Sp), q_tile, kv_head, kv_head],
        out_specs=[q_tile, pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, Hq, Tp), _F32)],
        compiler_params=_compiler_params(bq, Dp, static.blocks.stages),
        interpret=static.interpret,
        name=ATTENTION_FORWARD_KERNEL,  # what the 'minimal_flash' remat keeps
    )(lo, hi, q_seg, k_start, k_end, kv_seg, q, k, v)


def _backward(q, k, v, q_seg, kv_seg, k_start, k_end, out, lse, d_out, static):
    B, Tp, Hq, Dp = q.shape
    Sp, Hkv = k.shape[1], k.shape[2]
    bq, bk, group = static.blocks.q_bwd, static.blocks.k_bwd, Hq // Hkv
    nq, nk = Tp // bq, Sp // bk
    qk_scale = static.scale * _LOG2_E
    d_out = d_out.astype(q.dtype)
    # rowsum(dO * O): the softmax Jacobian's correction term per query row, [B, Hq, Tp].
    delta = jnp.einsum("bthd,bthd->bht", d_out.astype(_F32), out.astype(_F32))
    lo, hi = _kv_block_ranges(q_seg, k_start, k_end, bq, bk, Sp)
    row = lambda n: pl.BlockSpec((None, n), lambda i, b, h: (b, 0))  # noqa: E731

    q_rows = pl.BlockSpec((None, bq), lambda i, b, h: (b, i))
    q_tile = pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0))
    kv_head = pl.BlockSpec((None, Sp, None, Dp), lambda i, b, h: (b, 0, h // group, 0))
    stat = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, qk_scale=qk_scale, scale=static.scale, bk=bk),
        grid=(nq, B, Hq),
        in_specs=[
            row(nq),
            row(nq),
            q_rows,
            q_rows,
            q_rows,
            row(Sp),
            q_tile,
            kv_head,
            kv_head,
            q_tile,
            stat,
            stat,
        ],
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(bq, Dp, static.blocks.stages),
        interpret=static.interpret,
        name="range_attention_dq",
    )(lo, hi, q_seg, k_start, k_end, kv_seg, q, k, v, d_out, lse, delta)

    qlo, qhi = _q_block_ranges(lo, hi, nk)
    # One program per (kv block, row, kv head) sees all `group` query heads of that kv head.
    q_group = pl.BlockSpec((None, Tp, group, Dp), lambda j, b, h: (b, 0, h, 0))
    group_stat = pl.BlockSpec((None, group, Tp), lambda j, b, h: (b, h, 0))
    kv_tile = pl.BlockSpec((None, bk, None, Dp), lambda j, b, h: (b, j, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, qk_scale=qk_scale, scale=static.scale, bq=bq, group=group),
        grid=(nk, B, Hkv),
        in_specs=[
            row(nk),
            row(nk),
            row(Tp),
            row(Tp),
            row(Tp),
            pl.BlockSpec((None, bk), lambda j, b, h: (b, j)),
            q_group,
            kv_tile,
            kv_tile,
            q_group,
            group_stat,
            group_stat,
        ],
        out_specs=[kv_tile, kv_tile],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_compiler_params(bk, Dp, static.blocks.stages),
        interpret=static.interpret,
        name="range_attention_dkdv",
    )(qlo, qhi, q_seg, k_start, k_end, kv_seg, q, k, v, d_out, lse, delta)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(q, k, v, q_seg, kv_seg, k_start, k_end, static):
    return _forward(q, k, v, q_seg, kv_seg, k_start, k_end, static)[0]


def _attention_fwd(q, k, v, q_seg, kv_seg, k_start, k_end, static):
    out, lse = _forward(q, k, v, q_seg, kv_seg, k_start, k_end, static)
    # O(T + S) residuals: the inputs, the output and one float32 logsumexp per query row and head.
    return out, (q, k, v, q_seg, kv_seg, k_start, k_end, out, lse)


def _attention_bwd(static, residuals, d_out):
    dq, dk, dv = _backward(*residuals, d_out, static)
    return dq, dk, dv, None, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


# --------------------------------------------------------------------------------------------
# Lowering without a GPU


GPU_FOR_LOWERING = "NVIDIA H100 80GB HBM3"


def lower_for_gpu(fn, *args, device_kind: str = GPU_FOR_LOWERING) -> str:
    """StableHLO text of jit(fn)(*args) lowered for CUDA on a machine without one.

    The Triton lowering runs in-process (jax picks the target from an abstract device), so this
    checks on CPU that every kernel lowers to Triton IR (power-of-two tiles, supported ops); it
    does not run ptxas or the kernel. To compile for a GPU (ptxas included) without one, use
    compile-only devices (opsd_jax/programs/gpu_target.py).
    """
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    # Pallas custom calls carry no export compatibility guarantee; nothing here is serialized.
    unchecked = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with jax.sharding.use_abstract_mesh(mesh):
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=unchecked)(
            *args
        )
    return exported.mlir_module()
