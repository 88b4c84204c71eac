"""The GPU decode attention over the stacked KV cache (models/decode_attention_pallas.py).

Without a GPU: the kernel runs in the Pallas interpreter against the XLA decode attention on the
layer's slice (the path CPUs take), alone and through attention.cache_attention's per-device
dispatch on a decode mesh, and lowers to Triton IR for an H100. That the compiled sampler runs
it in place and copies no layer's cache is tests/test_gpu_compile.py's.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention
from models import decode_attention_pallas as dap
from models.attention_pallas import lower_for_gpu
from opsd_jax.parallel import mesh as mesh_lib


def cache_case(rng, layers, rows, slots, kv_heads, group, dim, dtype):
    """(q, k, v, the sampler's cache of k and v: [L, B, S, 2, Hkv, D])."""
    q = jnp.asarray(rng.normal(size=(rows, kv_heads * group, dim)), dtype)
    k, v = (
        jnp.asarray(rng.normal(size=(layers, rows, slots, kv_heads, dim)), dtype) for _ in range(2)
    )
    return q, k, v, jnp.stack([k, v], axis=3)


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype, tol, min_programs, slots, splits",
    [
        (jnp.float32, 2e-6, dap.MIN_PROGRAMS, 256, 4),
        (jnp.bfloat16, 2e-2, dap.MIN_PROGRAMS, 256, 4),
        (jnp.float32, 2e-6, 1, 256, 1),
        (jnp.float32, 2e-6, dap.MIN_PROGRAMS, 320, 5),  # the combine's block pads 5 splits to 8
    ],
)
def test_kernel_matches_the_xla_decode_attention(dtype, tol, min_programs, slots, splits):
    """BAGEL's GQA group of 7 (padded to 16 query rows inside the kernel), lengths 0, 1, a
    block edge, mid-block and full; every layer of the stack. Split over the key blocks (the
    default: 5 rows x 2 kv heads ask for more splits than the blocks, so one block a split,
    a power of two of them or not) and unsplit."""
    rng = np.random.default_rng(0)
    q, k, v, cache = cache_case(
        rng, layers=3, rows=5, slots=slots, kv_heads=2, group=7, dim=32, dtype=dtype
    )
    assert dap.grid(5, 2, slots, min_programs=min_programs)[2] == splits
    lengths = jnp.array([0, 1, 64, 150, slots], jnp.int32)
    for layer in range(3):
        got = dap.filled_cache_attention(
            q, cache, jnp.int32(layer), lengths, min_programs=min_programs, interpret=True
        )
        want = attention.decode_attention(q, k[layer], v[layer], lengths)
        assert got.dtype == q.dtype and got.shape == q.shape
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol
        )
    assert not np.asarray(got[0], np.float32).any()  # a row of length 0 returns 0


def test_slots_past_a_rows_length_do_not_matter():
    """NaN in every slot at and past each row's length (in its last key block, in the splits
    past it and beyond) leaves the output exactly as it was."""
    rng = np.random.default_rng(1)
    q, k, v, cache = cache_case(
        rng, layers=2, rows=4, slots=640, kv_heads=1, group=4, dim=16, dtype=jnp.float32
    )
    lengths = jnp.array([0, 3, 250, 640], jnp.int32)
    past = jnp.arange(640)[None, :, None, None, None] >= lengths[:, None, None, None, None]
    poisoned = jnp.where(past[None], jnp.nan, cache)  # keys and values
    want = attention.decode_attention(q, k[1], v[1], lengths)
    # 10 blocks: 3 splits of 3 blocks and one of 1 (4 rows x 3 splits >= 12 programs).
    assert dap.grid(4, 1, 640, min_programs=12) == (4, 1, 4)
    for min_programs in (12, 1):
        run = lambda c, m=min_programs: dap.filled_cache_attention(  # noqa: E731
            q, c, jnp.int32(1), lengths, min_programs=m, interpret=True
        )
        clean, got = run(cache), run(poisoned)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(clean))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-6)


def test_the_recipes_decode_shapes_fill_an_h100():
    """Each device's share at the recipe's shapes (16 rows, 4 kv heads, 7170 slots): tensor 4 x
    data 2 gives 8 rows x 1 kv head, the replicated copy 2 rows x 4 kv heads. Unsplit, either
    is 8 programs on 132 SMs; split, at least 2 per SM, and never an empty split."""
    for rows, kv_heads in ((8, 1), (2, 4)):
        assert dap.grid(rows, kv_heads, 7170, min_programs=1) == (rows, kv_heads, 1)
        programs = math.prod(dap.grid(rows, kv_heads, 7170))
        assert programs >= dap.MIN_PROGRAMS == 264, programs
        per_split = dap.blocks_per_split(rows, kv_heads, 7170)
        assert (dap.grid(rows, kv_heads, 7170)[2] - 1) * per_split < math.ceil(7170 / 64)


def test_a_cache_of_any_length_from_one_block_up():
    """7170 slots (the recipe's) or 100: the last key block starts early and masks the slots
    the block before it covered; each row's result is the XLA one."""
    rng = np.random.default_rng(5)
    q, k, v, cache = cache_case(
        rng, layers=2, rows=5, slots=100, kv_heads=2, group=3, dim=16, dtype=jnp.float32
    )
    lengths = jnp.array([1, 36, 64, 65, 100], jnp.int32)
    got = dap.filled_cache_attention(q, cache, jnp.int32(1), lengths, interpret=True)
    want = attention.decode_attention(q, k[1], v[1], lengths)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-6)


def test_shapes_it_does_not_take_are_refused_and_routed_to_xla():
    assert dap.supported(128, 7170) and dap.supported(128, 64)
    assert not dap.supported(72, 7170) and not dap.supported(128, 63)
    rng = np.random.default_rng(2)
    q, k, v, cache = cache_case(
        rng, layers=1, rows=2, slots=40, kv_heads=1, group=2, dim=16, dtype=jnp.float32
    )
    with pytest.raises(ValueError, match="at least 64 slots"):
        dap.filled_cache_attention(q, cache, 0, jnp.array([5, 9]), interpret=True)
    lengths = jnp.array([5, 9], jnp.int32)
    np.testing.assert_array_equal(  # cache_attention falls back to the XLA path
        np.asarray(attention.cache_attention(q, cache, 0, lengths, backend="pallas")),
        np.asarray(attention.decode_attention(q, k[0], v[0], lengths)),
    )


@pytest.mark.parametrize("layout, tensor", [("replicated", None), ("tensor", 2)])
def test_per_device_dispatch_on_a_decode_mesh_matches_one_device(layout, tensor):
    """cache_attention under the sampler's decode mesh and rules: rows over 'data', kv heads
    (and their query heads) over 'tensor', each device running the kernel on its own part."""
    rng = np.random.default_rng(3)
    q, k, v, cache = cache_case(
        rng, layers=2, rows=4, slots=128, kv_heads=2, group=3, dim=16, dtype=jnp.float32
    )
    lengths = jnp.array([1, 60, 65, 128], jnp.int32)
    want = attention.decode_attention(q, k[1], v[1], lengths)
    view = mesh_lib.decode_mesh(mesh_lib.make_mesh(), layout, tensor)
    with mesh_lib.use_mesh(view, mesh_lib.DECODE_RULES):
        run = jax.jit(lambda *a: attention.cache_attention(*a, backend="pallas", interpret=True))
        got = run(q, cache, jnp.int32(1), lengths)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-6)


def test_kernel_lowers_to_triton_for_an_h100():
    rng = np.random.default_rng(4)
    q, k, v, cache = cache_case(
        rng, layers=2, rows=2, slots=128, kv_heads=1, group=7, dim=128, dtype=jnp.bfloat16
    )
    text = lower_for_gpu(
        dap.filled_cache_attention, q, cache, jnp.int32(1), jnp.array([3, 128], jnp.int32)
    )
    assert "__gpu$xla.gpu.triton" in text and dap.KERNEL_NAME in text


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
def test_xla_decode_in_place_on_a_gpu_equals_its_einsums(monkeypatch, dtype, tol):
    """On a GPU XLA's decode attention sums float32 products in reduce fusions that read the
    cache in place (attention.DECODE_IN_PLACE_ON_GPU), the scores in one sum or, with few kv
    heads per device, one query head at a time, the output over all slots at once or, with
    many rows per device, in chunks of slots; elsewhere two einsums. The same attention every
    way, an empty row (length 0) included."""
    from models import gpu_support

    rng = np.random.default_rng(8)
    q, k, v, _ = cache_case(
        rng, layers=1, rows=3, slots=40, kv_heads=2, group=7, dim=16, dtype=dtype
    )
    lengths = jnp.array([0, 17, 40], jnp.int32)
    want = attention.decode_attention(q, k[0], v[0], lengths)
    monkeypatch.setattr(gpu_support, "compiling_for_gpu", lambda: True)  # as on a GPU
    monkeypatch.setattr(attention, "VALUE_SUM_CHUNK", 16)
    assert attention.value_chunks(40) == 4  # chunks of 10 slots, the 17-slot row across two
    heads = attention.PER_QUERY_HEAD_SCORES_BELOW
    rows = attention.CHUNKED_VALUE_SUM_MIN_ROWS
    # (kv heads, rows) per device: scores a query head at a time, or in one sum with the output
    # in one sum or in chunks
    for per_device in ((1, rows), (heads, rows - 1), (heads, rows)):
        got = attention.decode_attention(q, k[0], v[0], lengths, *per_device)
        assert got.dtype == want.dtype == dtype
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol
        )
        assert not np.any(np.asarray(got[0], np.float32))  # length 0: zeros
    monkeypatch.setattr(attention, "DECODE_IN_PLACE_ON_GPU", False)
    np.testing.assert_array_equal(
        np.asarray(attention.decode_attention(q, k[0], v[0], lengths)), np.asarray(want)
    )


def test_a_runs_model_decodes_on_the_xla_path_on_a_gpu(monkeypatch):
    """The backend a run hands its model (run_config.model_runtime) is 'auto' as configured,
    resolved where the model traces: resolved at the start, on a GPU it was 'pallas' by name,
    which took every rollout through the decode kernel that failed on the GPU."""
    from configs import tiny
    from models import gpu_support
    from opsd_jax import run_config
    from opsd_jax.trainer import start

    def no_kernel(name):
        raise AssertionError(f"the kernel {name} was asked for")

    monkeypatch.setattr(gpu_support, "unsupported_reason", lambda: None)  # as on a GPU
    monkeypatch.setattr(gpu_support, "import_kernel", no_kernel)
    backend = run_config.model_runtime(tiny.get_config())["attention_backend"]
    assert start.attention_line(backend) == "attention backend pallas (auto; decode: XLA's)"
    rng = np.random.default_rng(7)
    q, k, v, cache = cache_case(
        rng, layers=1, rows=2, slots=64, kv_heads=1, group=2, dim=16, dtype=jnp.float32
    )
    lengths = jnp.array([9, 64], jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(attention.cache_attention(q, cache, 0, lengths, backend=backend)),
        np.asarray(attention.decode_attention(q, k[0], v[0], lengths)),
    )


def test_auto_decodes_on_the_xla_path_where_it_resolves_to_pallas(monkeypatch):
    """The kernel failed its parity check on a GPU (attention.DECODE_KERNEL_IN_AUTO): "auto"
    must not reach it even where it resolves to Pallas (a GPU); "pallas" named still does."""
    from models import gpu_support

    def no_kernel(name):
        raise AssertionError(f"the kernel {name} was asked for")

    monkeypatch.setattr(gpu_support, "unsupported_reason", lambda: None)  # as on a GPU
    monkeypatch.setattr(gpu_support, "import_kernel", no_kernel)
    assert attention.resolve_backend("auto") == "pallas"
    rng = np.random.default_rng(6)
    q, k, v, cache = cache_case(
        rng, layers=1, rows=2, slots=64, kv_heads=1, group=2, dim=16, dtype=jnp.float32
    )
    lengths = jnp.array([5, 64], jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(attention.cache_attention(q, cache, 0, lengths, backend="auto")),
        np.asarray(attention.decode_attention(q, k[0], v[0], lengths)),
    )
    with pytest.raises(AssertionError, match="was asked for"):
        attention.cache_attention(q, cache, 0, lengths, backend="pallas")
