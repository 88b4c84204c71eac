"""The Pallas range-attention kernel (models/attention_pallas.py) without a GPU.

The kernels run in the Pallas interpreter (interpret=True: the same kernel code, executed by
XLA on the CPU) against the dense `reference` backend on BAGEL-shaped packs, and are lowered to
Triton IR for an H100 to catch what the interpreter does not check (power-of-two tiles, ops the
Triton backend lacks, a moved jax API). Shapes are small: interpreting is slow.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention_pallas as ap
from models import gpu_support
from models.attention import attention, resolve_backend


def bagel_pack(rng, fills, length):
    """Rows of several samples, each text and image blocks, then padding (segment 0).

    Inside a sample every token's k_start is the sample start; a text token's k_end is t + 1
    (causal), an image token's k_end is the end of its block (bidirectional). Rows are filled to
    `fills[b]` tokens; padding gets arbitrary ranges, which must not matter.
    """
    rows = len(fills)
    seg = np.zeros((rows, length), np.int32)
    k_start = rng.integers(0, length + 1, (rows, length)).astype(np.int32)
    k_end = rng.integers(0, length + 1, (rows, length)).astype(np.int32)
    for b, fill in enumerate(fills):
        t, sample = 0, 1
        while t < fill:
            end = min(fill, t + int(rng.integers(16, 56)))
            start = t
            while t < end:
                n = min(end - t, int(rng.integers(2, 13)))
                k_start[b, t : t + n] = start
                if (t - start) % 2:  # alternate text runs and image blocks
                    k_end[b, t : t + n] = t + n
                else:
                    k_end[b, t : t + n] = np.arange(t + 1, t + n + 1)
                t += n
            seg[b, start:end] = sample
            sample += 1
    return seg, k_start, k_end


def normal(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.normal(size=shape), dtype)


@functools.lru_cache(maxsize=None)
def out_and_grads(backend, blocks=None):
    """jit'd (out, dq, dk, dv) of sum(out * cotangent) for 'pallas' (interpreted) or a backend."""

    def run(q, k, v, cotangent, q_seg, kv_seg, k_start, k_end):
        ids = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg, k_start=k_start, k_end=k_end)

        def f(q, k, v):
            if backend == "pallas":
                return ap.range_attention(q, k, v, **ids, block_sizes=blocks, interpret=True)
            return attention(q, k, v, **ids, backend=backend, q_block=16, kv_block=16)

        out, vjp = jax.vjp(f, q, k, v)
        return (out,) + vjp(cotangent.astype(out.dtype))

    return jax.jit(run)


def max_err(got, want):
    """Largest absolute error, relative to the reference's scale where that exceeds 1."""
    want = np.asarray(want, np.float64)
    scale = max(1.0, float(np.max(np.abs(want))))
    return float(np.max(np.abs(np.asarray(got, np.float64) - want))) / scale


# (rows' fills, T, S, Hq, Hkv, D, blocks): self-attention over a pack with GQA; and queries that
# are the tail of a longer pack (prefill against a cache), a group of 3, an odd head dim (padded).
CASES = {
    "self_gqa2": ((128, 97, 40), 128, 128, 4, 2, 32, ap.BlockSizes(32, 32, 32, 16)),
    "tail_gqa3_d24": ((96, 61), 32, 96, 6, 2, 24, ap.BlockSizes(16, 32, 16, 32)),
}


def case_inputs(name, dtype=jnp.float32, seed=0):
    fills, T, S, Hq, Hkv, D, blocks = CASES[name]
    rng = np.random.default_rng(seed)
    seg, k_start, k_end = bagel_pack(rng, fills, S)
    tail = slice(S - T, S)
    packing = (seg[:, tail], seg, k_start[:, tail], k_end[:, tail])
    B = len(fills)
    q, k, v = normal(rng, (B, T, Hq, D)), normal(rng, (B, S, Hkv, D)), normal(rng, (B, S, Hkv, D))
    cotangent = normal(rng, (B, T, Hq, D))
    return blocks, (q, k, v, cotangent) + packing


@pytest.mark.parametrize("name", sorted(CASES))
def test_fp32_matches_reference(name):
    blocks, inputs = case_inputs(name)
    got = out_and_grads("pallas", blocks)(*inputs)
    want = out_and_grads("reference")(*inputs)
    errors = [max_err(a, b) for a, b in zip(got, want)]
    print(f"{name} fp32 max error out/dq/dk/dv: " + " ".join(f"{e:.1e}" for e in errors))
    assert got[0].dtype == jnp.float32 and got[0].shape == want[0].shape
    for part, error in zip(("out", "dq", "dk", "dv"), errors):
        assert error <= 1e-5, (part, error)


def test_bf16_close_to_fp32_reference():
    """bf16 in, fp32 accumulation: about as close to the fp32 reference as `chunked` in bf16."""
    blocks, inputs = case_inputs("self_gqa2", seed=1)
    bf16 = tuple(x.astype(jnp.bfloat16) for x in inputs[:3]) + inputs[3:]
    got = out_and_grads("pallas", blocks)(*bf16)
    chunked = out_and_grads("chunked")(*bf16)
    want = out_and_grads("reference")(*inputs)
    errors = [max_err(a, b) for a, b in zip(got, want)]
    chunked_errors = [max_err(a, b) for a, b in zip(chunked, want)]
    print(
        "bf16 max error out/dq/dk/dv: pallas "
        + " ".join(f"{e:.1e}" for e in errors)
        + " | chunked "
        + " ".join(f"{e:.1e}" for e in chunked_errors)
    )
    assert all(a.dtype == jnp.bfloat16 for a in got)
    assert errors[0] <= 1e-2 and max(errors[1:]) <= 2e-2, errors
    assert max(errors) <= 2 * max(chunked_errors) + 1e-3


def test_padding_and_empty_queries_are_exactly_zero():
    blocks = ap.BlockSizes(16, 16, 16, 16)
    rng = np.random.default_rng(2)
    seg, k_start, k_end = bagel_pack(rng, (0, 20, 48), 48)  # row 0 is all padding
    k_end[1, 3] = k_start[1, 3]  # a real token whose range is empty
    k_start[2, 7], k_end[2, 7] = 30, 30
    q, k, v, cotangent = (normal(rng, (3, 48, 2, 16)) for _ in range(4))
    out, dq, dk, dv = out_and_grads("pallas", blocks)(q, k, v, cotangent, seg, seg, k_start, k_end)
    empty = (seg == 0) | (k_end <= k_start)
    for x in (out, dq):
        assert np.all(np.isfinite(x))
        assert np.all(np.asarray(x)[empty] == 0.0)
    for x in (dk, dv):  # no query sees a padding key
        assert np.all(np.isfinite(x)) and np.all(np.asarray(x)[seg == 0] == 0.0)
    want = out_and_grads("reference")(q, k, v, cotangent, seg, seg, k_start, k_end)
    assert max(max_err(a, b) for a, b in zip((out, dq, dk, dv), want)) <= 1e-5


def test_kv_blocks_no_query_sees_are_never_read():
    """NaN in key blocks outside every query block's interval: a kernel that read them (even
    masked, since 0 * NaN = NaN in p @ v) would return NaN."""
    blocks = ap.BlockSizes(16, 16, 16, 16)
    rng = np.random.default_rng(3)
    seg, k_start, k_end = bagel_pack(rng, (32, 64), 64)
    q, k, v, cotangent = (normal(rng, (2, 64, 2, 16)) for _ in range(4))
    poisoned = (np.arange(64) >= 32)[None, :, None, None] & (np.arange(2) == 0)[:, None, None, None]
    k_bad, v_bad = (jnp.where(poisoned, jnp.nan, x) for x in (k, v))
    got = out_and_grads("pallas", blocks)(q, k_bad, v_bad, cotangent, seg, seg, k_start, k_end)
    want = out_and_grads("reference")(q, k, v, cotangent, seg, seg, k_start, k_end)
    for a, b in zip(got, want):
        assert np.all(np.isfinite(a))
        assert max_err(a, b) <= 1e-5


def test_block_plans():
    # Row 0: samples [0, 40) and [40, 64), causal; row 1: all padding.
    seg = np.zeros((2, 64), np.int32)
    seg[0, :40], seg[0, 40:] = 1, 2
    k_start = np.zeros((2, 64), np.int32)
    k_start[0, 40:] = 40
    k_end = np.tile(np.arange(1, 65, dtype=np.int32), (2, 1))
    lo, hi = ap._kv_block_ranges(seg, k_start, k_end, 16, 16, 64)
    np.testing.assert_array_equal(lo[0], [0, 0, 0, 2])  # q block 3 (48..63) starts at key 40
    np.testing.assert_array_equal(hi[0], [1, 2, 3, 4])
    assert np.all(lo[1] > hi[1])  # nothing to do
    qlo, qhi = ap._q_block_ranges(lo, hi, 4)
    np.testing.assert_array_equal(qlo[0], [0, 1, 2, 3])
    np.testing.assert_array_equal(qhi[0], [3, 3, 4, 4])  # kv block 0 is seen by q blocks 0..2
    np.testing.assert_array_equal(qhi[1] - qlo[1], [0, 0, 0, 0])


@pytest.mark.parametrize("hq, hkv, d", [(28, 4, 128), (16, 16, 72)])  # BAGEL's LLM, SigLIP
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_lowers_to_triton_for_an_h100(hq, hkv, d):
    """Forward, dQ and dK/dV lower to Triton IR at the real head layouts, bf16, default tiles.
    Fails loudly if jax's Pallas Triton API or lowering moves (its Triton backend is deprecated
    in jax 0.12)."""

    def grads(q, k, v, seg, k_start, k_end):
        def loss(q, k, v):
            out = ap.range_attention(
                q, k, v, q_segment_ids=seg, kv_segment_ids=seg, k_start=k_start, k_end=k_end
            )
            return jnp.sum(out.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    t = 1000
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    i32 = jax.ShapeDtypeStruct((2, t), jnp.int32)
    text = ap.lower_for_gpu(
        grads, bf16(2, t, hq, d), bf16(2, t, hkv, d), bf16(2, t, hkv, d), i32, i32, i32
    )
    for kernel in ("range_attention_forward", "range_attention_dq", "range_attention_dkdv"):
        assert f'name = "{kernel}"' in text, kernel
    assert text.count("__gpu$xla.gpu.triton") == 3


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_the_pipeline_stages_reach_every_triton_call():
    """BlockSizes.stages (what bench/gpu_check.py --tiles sweeps) is each kernel's num_stages."""

    def grads(blocks):
        def of(q, k, v, seg, k_start, k_end):
            def loss(q, k, v):
                out = ap.range_attention(
                    q,
                    k,
                    v,
                    q_segment_ids=seg,
                    kv_segment_ids=seg,
                    k_start=k_start,
                    k_end=k_end,
                    block_sizes=blocks,
                )
                return jnp.sum(out.astype(jnp.float32))

            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

        return of

    t = 512
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    i32 = jax.ShapeDtypeStruct((1, t), jnp.int32)
    arrays = (bf16(1, t, 4, 128), bf16(1, t, 1, 128), bf16(1, t, 1, 128), i32, i32, i32)
    for stages in (2, 3):
        text = ap.lower_for_gpu(grads(ap.BlockSizes(stages=stages)), *arrays)
        assert re.findall(r"num_stages = (\d+)", text) == [str(stages)] * 3
    with pytest.raises(ValueError, match="stages must be an integer in 1..5"):
        ap.BlockSizes(stages=0)


def test_cpu_refuses_pallas_and_auto_is_chunked():
    assert jax.default_backend() == "cpu"
    assert resolve_backend("auto") == "chunked"
    assert resolve_backend("cudnn") == "cudnn"
    assert "not an NVIDIA GPU" in gpu_support.unsupported_reason()
    rng = np.random.default_rng(4)
    seg, k_start, k_end = bagel_pack(rng, (24,), 32)
    q = normal(rng, (1, 32, 2, 16))
    ids = dict(q_segment_ids=seg, kv_segment_ids=seg, k_start=k_start, k_end=k_end)
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        attention(q, q, q, **ids, backend="pallas")
    np.testing.assert_array_equal(
        attention(q, q, q, **ids, backend="auto"), attention(q, q, q, **ids, backend="chunked")
    )
    with pytest.raises(ValueError, match="power of two"):
        ap.BlockSizes(q=24)
