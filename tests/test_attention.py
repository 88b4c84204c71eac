"""Tests for models/attention.py: chunked and dense vs reference vs a naive loop, and the mask's
semantics."""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_python

from models import attention as attention_lib
from models.attention import attention

# --------------------------------------------------------------------------------------------
# Helpers


def random_packing(rng, batch, length, *, max_image=12, allow_empty_row=True):
    """Random packed rows in the BAGEL layout.

    Each row is a sequence of segments (ids 1, 2, ...) followed by padding (id 0). A segment is
    a mix of causal text runs and bidirectional image blocks: every token's k_start is its
    segment's start; a text token's k_end is t + 1, an image token's k_end is its block's end.
    Padding gets arbitrary k_start/k_end, since the output there must be 0 whatever they are.
    Some rows start every range at 0 instead: then only the segment ids keep segments apart,
    which the mask's definition allows.
    """
    seg = np.zeros((batch, length), np.int32)
    k_start = rng.integers(0, length + 1, (batch, length)).astype(np.int32)
    k_end = rng.integers(0, length + 1, (batch, length)).astype(np.int32)
    for b in range(batch):
        if allow_empty_row and rng.random() < 0.05:
            continue  # an all-padding row
        used = length if rng.random() < 0.3 else int(rng.integers(1, length + 1))
        loose = rng.random() < 0.3
        t, seg_id = 0, 1
        while t < used:
            seg_end = t + int(rng.integers(1, used - t + 1))
            start = t
            while t < seg_end:
                n = int(rng.integers(1, min(max_image, seg_end - t) + 1))
                k_start[b, t : t + n] = 0 if loose else start
                if rng.random() < 0.4:  # image block: every token sees the whole block
                    k_end[b, t : t + n] = t + n
                else:  # text run: causal
                    k_end[b, t : t + n] = np.arange(t + 1, t + n + 1)
                t += n
            seg[b, start:seg_end] = seg_id
            seg_id += 1
    return seg, k_start, k_end


def decode_packing(rng, batch, kv_len, q_len):
    """Queries are the last q_len positions of a kv_len packing (decoding against a cache)."""
    seg, k_start, k_end = random_packing(rng, batch, kv_len)
    tail = slice(kv_len - q_len, kv_len)
    return seg[:, tail], seg, k_start[:, tail], k_end[:, tail]


def random_qkv(rng, batch, q_len, kv_len, hq, hkv, d, dtype=jnp.float32):
    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    return normal(batch, q_len, hq, d), normal(batch, kv_len, hkv, d), normal(batch, kv_len, hkv, d)


def ids(q_seg, kv_seg, k_start, k_end):
    return dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg, k_start=k_start, k_end=k_end)


def naive_attention(q, k, v, q_seg, kv_seg, k_start, k_end):
    """Straight from the definition, in float64: one query and one head at a time."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for t in range(T):
            allowed = [
                j
                for j in range(S)
                if k_start[b, t] <= j < k_end[b, t]
                and q_seg[b, t] == kv_seg[b, j]
                and q_seg[b, t] != 0
            ]
            if not allowed:
                continue
            for h in range(Hq):
                kv_h = h // (Hq // Hkv)
                logits = np.array([q[b, t, h] @ k[b, j, kv_h] for j in allowed]) / np.sqrt(D)
                p = np.exp(logits - logits.max())
                p /= p.sum()
                out[b, t, h] = p @ v[b, allowed, kv_h]
    return out


@functools.lru_cache(maxsize=None)
def out_and_grads(backend, q_block=8, kv_block=8):
    """jit'd (output, dq, dk, dv) for loss = sum(out * cotangent); cached so shapes compile once."""

    def run(q, k, v, cotangent, q_seg, kv_seg, k_start, k_end):
        def loss(q, k, v):
            out = attention(
                q,
                k,
                v,
                **ids(q_seg, kv_seg, k_start, k_end),
                backend=backend,
                q_block=q_block,
                kv_block=kv_block,
            )
            return jnp.sum(out.astype(jnp.float32) * cotangent), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return (out,) + grads

    return jax.jit(run)


@functools.lru_cache(maxsize=None)
def forward(backend, q_block=8, kv_block=8):
    """jit'd attention(q, k, v, q_seg, kv_seg, k_start, k_end) for one backend and tiling."""

    def run(q, k, v, q_seg, kv_seg, k_start, k_end):
        return attention(
            q,
            k,
            v,
            **ids(q_seg, kv_seg, k_start, k_end),
            backend=backend,
            q_block=q_block,
            kv_block=kv_block,
        )

    return jax.jit(run)


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


# --------------------------------------------------------------------------------------------
# Chunked vs reference


# (batch, q_len, kv_len, hq, hkv, d, q_block, kv_block, seeds); kv_len != q_len is decode-like.
CONFIGS = [
    (2, 37, 37, 4, 2, 8, 8, 8, 16),
    (1, 64, 64, 4, 1, 16, 16, 8, 14),
    (3, 100, 100, 2, 2, 8, 16, 16, 14),
    (2, 64, 64, 6, 3, 16, 8, 16, 14),
    (1, 100, 100, 4, 2, 16, 32, 8, 12),
    (2, 37, 37, 6, 3, 8, 512, 512, 12),  # blocks larger than the sequence clamp to it
    (2, 13, 50, 4, 2, 8, 8, 16, 12),
    (1, 1, 40, 2, 2, 8, 8, 8, 10),  # single-token decode step
]


def config_id(c):
    return "B{}_T{}_S{}_H{}x{}_D{}_q{}_kv{}".format(*c[:8])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["chunked", "dense"])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_fast_backends_match_reference(config, backend):
    batch, q_len, kv_len, hq, hkv, d, q_block, kv_block, n_seeds = config
    fast = out_and_grads(backend, q_block, kv_block)
    reference = out_and_grads("reference")
    for seed in range(n_seeds):
        rng = np.random.default_rng(1000 * q_len + seed)
        if q_len == kv_len:
            seg, k_start, k_end = random_packing(rng, batch, q_len)
            packing = (seg, seg, k_start, k_end)
        else:
            packing = decode_packing(rng, batch, kv_len, q_len)
        q, k, v = random_qkv(rng, batch, q_len, kv_len, hq, hkv, d)
        cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
        got = fast(q, k, v, cotangent, *packing)
        want = reference(q, k, v, cotangent, *packing)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert not np.isnan(np.asarray(a)).any(), (name, seed)
            assert max_diff(a, b) <= 1e-5, (name, seed, max_diff(a, b))


def test_reference_matches_naive_loop():
    rng = np.random.default_rng(7)
    cases = [(2, 23, 23, 4, 2, 8), (1, 30, 30, 6, 3, 8), (2, 9, 21, 2, 1, 16)]
    for batch, q_len, kv_len, hq, hkv, d in cases:
        if q_len == kv_len:
            seg, k_start, k_end = random_packing(rng, batch, q_len, allow_empty_row=False)
            packing = (seg, seg, k_start, k_end)
        else:
            packing = decode_packing(rng, batch, kv_len, q_len)
        q, k, v = random_qkv(rng, batch, q_len, kv_len, hq, hkv, d)
        got = forward("reference")(q, k, v, *packing)
        want = naive_attention(q, k, v, *packing)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Mask semantics on a hand-made row

# Segment 1 = text 0..3, image 4..11, text 12..15; segment 2 = text 16..21; padding 22..23.
T_HAND = 24


def hand_packing():
    seg = np.array([[1] * 16 + [2] * 6 + [0] * 2], np.int32)
    k_start = np.array([[0] * 16 + [16] * 6 + [0] * 2], np.int32)
    k_end = np.arange(1, T_HAND + 1, dtype=np.int32)[None].copy()
    k_end[0, 4:12] = 12
    k_end[0, 22:] = 0
    return seg, k_start, k_end


def hand_run(backend, loose=False):
    """attention on the hand-made row, as a function of (q, k, v) only.

    loose: every range starts at 0, so only the segment ids separate the two segments.
    """
    seg, k_start, k_end = hand_packing()
    if loose:
        k_start = np.zeros_like(k_start)
    return lambda q, k, v: forward(backend)(q, k, v, seg, seg, k_start, k_end)


def perturbed_at(x, positions):
    return x.at[:, positions].add(1.0)


@pytest.mark.parametrize("backend", ["chunked", "reference", "dense"])
def test_image_block_is_bidirectional_and_text_is_causal(backend):
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 1, T_HAND, T_HAND, 4, 2, 8)
    run = hand_run(backend)
    base = run(q, k, v)

    # A later image token's k/v reaches an earlier token of the same block...
    moved = run(q, perturbed_at(k, 10), perturbed_at(v, 10))
    assert max_diff(moved[:, 5], base[:, 5]) > 1e-3
    # ...but not the text before the block.
    np.testing.assert_array_equal(moved[:, :4], base[:, :4])

    # A future text token is invisible to everything before it, image block included.
    moved = run(q, perturbed_at(k, 14), perturbed_at(v, 14))
    np.testing.assert_array_equal(moved[:, :14], base[:, :14])
    assert max_diff(moved[:, 15], base[:, 15]) > 1e-3

    # Text after the block sees the whole block.
    moved = run(q, perturbed_at(k, 11), perturbed_at(v, 11))
    assert max_diff(moved[:, 12], base[:, 12]) > 1e-3


@pytest.mark.parametrize("loose", [False, True], ids=["segment_ranges", "ranges_from_0"])
@pytest.mark.parametrize("backend", ["chunked", "reference", "dense"])
def test_segments_never_see_each_other(backend, loose):
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, 1, T_HAND, T_HAND, 4, 2, 8)
    run = hand_run(backend, loose)
    seg2 = np.arange(16, 22)
    base = run(q, k, v)
    noise = jnp.asarray(rng.normal(size=(1, 6, 2, 8)) * 10, jnp.float32)
    moved = run(q, k.at[:, seg2].add(noise), v.at[:, seg2].add(noise))
    np.testing.assert_array_equal(moved[:, :16], base[:, :16])  # bit-identical
    assert max_diff(moved[:, 16:22], base[:, 16:22]) > 1e-3


@pytest.mark.parametrize("backend", ["chunked", "reference", "dense"])
def test_padding_and_empty_queries_are_exactly_zero(backend):
    rng = np.random.default_rng(2)
    batch, length = 3, 20
    seg = np.zeros((batch, length), np.int32)
    seg[0, :12] = 1
    seg[2, :] = 1  # row 1 is all padding
    k_start = np.zeros((batch, length), np.int32)
    k_end = np.tile(np.arange(1, length + 1, dtype=np.int32), (batch, 1))
    k_end[2, 5] = 0  # a real token whose range is empty (k_end <= k_start)
    k_start[2, 6], k_end[2, 6] = 7, 7
    q, k, v = random_qkv(rng, batch, length, length, 4, 2, 8)
    cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    out, dq, dk, dv = out_and_grads(backend, 8, 8)(q, k, v, cotangent, seg, seg, k_start, k_end)

    for x in (out, dq, dk, dv):
        assert not bool(jnp.isnan(x).any())
    dead = np.zeros((batch, length), bool)
    dead[0, 12:] = dead[1] = True
    dead[2, 5] = dead[2, 6] = True
    assert np.all(np.asarray(out)[dead] == 0)
    assert np.all(np.asarray(dq)[dead] == 0)
    # Padding keys are never seen, so they get no gradient either.
    assert np.all(np.asarray(dk)[0, 12:] == 0) and np.all(np.asarray(dv)[1] == 0)
    assert np.all(np.asarray(out)[~dead] != 0)


# --------------------------------------------------------------------------------------------
# Precision, memory, errors


@pytest.mark.parametrize("backend", ["chunked", "dense"])
def test_bf16_close_to_fp32_reference(backend):
    rng = np.random.default_rng(3)
    seg, k_start, k_end = random_packing(rng, 2, 64, allow_empty_row=False)
    packing = (seg, seg, k_start, k_end)
    q, k, v = random_qkv(rng, 2, 64, 64, 4, 2, 16)
    cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    got = out_and_grads(backend, 16, 16)(*bf16, cotangent, *packing)
    want = out_and_grads("reference", 16, 16)(q, k, v, cotangent, *packing)
    assert got[0].dtype == jnp.bfloat16
    assert max_diff(got[0], want[0]) <= 2e-2
    for a, b in zip(got[1:], want[1:]):
        assert a.dtype == jnp.bfloat16
        scale = max(1.0, float(jnp.max(jnp.abs(b))))
        assert max_diff(a, b) <= 5e-2 * scale


def test_chunked_memory_is_far_below_reference():
    length, d = 4096, 16
    q = jax.ShapeDtypeStruct((1, length, 1, d), jnp.float32)
    ids_spec = jax.ShapeDtypeStruct((1, length), jnp.int32)

    def temp_bytes(backend):
        def f(q, k, v, q_seg, kv_seg, k_start, k_end):
            def loss(q, k, v):
                return jnp.sum(
                    attention(q, k, v, **ids(q_seg, kv_seg, k_start, k_end), backend=backend)
                )

            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

        compiled = jax.jit(f).lower(q, q, q, *[ids_spec] * 4).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    chunked, reference = temp_bytes("chunked"), temp_bytes("reference")
    assert reference >= length * length * 4  # at least one full fp32 score matrix
    assert chunked * 4 <= reference, (chunked, reference)


def test_bad_arguments_raise():
    rng = np.random.default_rng(4)
    seg, k_start, k_end = random_packing(rng, 1, 8)
    q, k, v = random_qkv(rng, 1, 8, 8, 4, 2, 8)
    with pytest.raises(ValueError, match="backend"):
        attention(q, k, v, **ids(seg, seg, k_start, k_end), backend="flash")
    with pytest.raises(ValueError, match="k_end"):
        attention(q, k, v, **ids(seg, seg, k_start, k_end[:, :5]))
    with pytest.raises(ValueError, match="kv_segment_ids"):
        attention(q, k, v, **ids(seg, seg[:, :5], k_start, k_end))
    with pytest.raises(ValueError, match="heads"):
        attention(
            q,
            k[:, :, :1].repeat(3, axis=2),
            v[:, :, :1].repeat(3, axis=2),
            **ids(seg, seg, k_start, k_end),
        )
    with pytest.raises(ValueError, match="v must"):
        attention(q, k, v[:, :4], **ids(seg, seg, k_start, k_end))
    long = attention_lib.DENSE_MAX_TOKENS + 1
    zeros = jnp.zeros((1, long), jnp.int32)
    with pytest.raises(ValueError, match="backend='dense'.*limit"):
        attention(
            jnp.zeros((1, long, 4, 8)),
            jnp.zeros((1, long, 2, 8)),
            jnp.zeros((1, long, 2, 8)),
            **ids(zeros, zeros, zeros, zeros),
            backend="dense",
        )


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU error path")
def test_cudnn_backend_refuses_cpu():
    rng = np.random.default_rng(5)
    seg, k_start, k_end = random_packing(rng, 1, 8)
    q, k, v = random_qkv(rng, 1, 8, 8, 2, 2, 8, jnp.bfloat16)
    with pytest.raises(ValueError, match="cudnn"):
        attention(q, k, v, **ids(seg, seg, k_start, k_end), backend="cudnn")


@pytest.mark.slow
def test_a_cpu_run_never_imports_the_gpu_kernels():
    """'auto' on a CPU resolves without importing the Pallas kernels, and a forward with it
    imports neither them nor Pallas's Triton backend (deprecated in jax 0.12: its removal must
    not break CPU runs)."""
    script = (
        "import sys\n"
        "import jax\n"
        "import jax.numpy as jnp\n"
        "from flax import nnx\n"
        "from models import attention\n"
        "from models.bagel import Bagel\n"
        "from models.configs import BagelConfig\n"
        "backend = attention.resolve_backend('auto')\n"
        "model = Bagel(BagelConfig.tiny(llm=dict(attention_backend=backend)), rngs=nnx.Rngs(0))\n"
        "from opsd_jax.data.packing import SpecialTokens, Text, pack_samples\n"
        "special = SpecialTokens(1000, 1001, 1002, 1003)\n"
        "pack = pack_samples([[Text([5, 6, 7]), Text([8, 9], loss=True)]], 16, special=special)\n"
        "model(jax.tree.map(jnp.asarray, pack)).block_until_ready()\n"
        "loaded = [m for m in sys.modules if 'attention_pallas' in m or 'pallas.triton' in m]\n"
        "print(backend, loaded)\n"
    )
    result = run_python("-c", script)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "chunked []"


def test_without_pallas_triton_the_pallas_backend_names_what_to_choose(monkeypatch):
    """A jax without Pallas's Triton backend (deprecated in 0.12): asking for the kernels is an
    error that names the backends to use instead, not a bare ImportError of jax's."""
    from models import gpu_support

    def no_triton(name):
        raise ImportError(f"cannot import name 'triton' (importing {name})")

    monkeypatch.setitem(sys.modules, gpu_support.TRITON_BACKEND, None)  # find_spec: absent
    monkeypatch.setattr(gpu_support.importlib, "import_module", no_triton)
    assert gpu_support.triton_backend_missing()
    with pytest.raises(ImportError, match=r"attention_backend='cudnn'.*or 'chunked'"):
        gpu_support.import_kernel("attention_pallas")
    monkeypatch.undo()
    assert not gpu_support.triton_backend_missing()
    assert gpu_support.import_kernel("attention_pallas").range_attention
