"""The sampler's decode layout: a tensor axis that splits every head count into whole heads, and
`sampler_layout='auto'` (the least projected rollout time that fits)."""

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from test_decode_copy import training_model

from models.configs import BagelConfig
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.sampling import decode_copy, layout_choice

GIB = 2**30
BAGEL_7B_HEADS = (28, 4, 16)  # LLM query heads, kv heads, ViT heads


def test_the_tensor_axis_splits_every_head_count():
    assert layout_choice.head_counts(BagelConfig.bagel_7b()) == BAGEL_7B_HEADS
    assert mesh_lib.tensor_size_for(BAGEL_7B_HEADS, 8) == 4  # not 8: 28 and 4 do not split 8 ways
    assert mesh_lib.tensor_size_for(BAGEL_7B_HEADS, 2) == 2
    assert mesh_lib.tensor_size_for((4, 2, 2), 8) == 2  # the tiny model
    assert mesh_lib.tensor_size_for((6,), 4) == 2 and mesh_lib.tensor_size_for((3,), 8) == 1
    assert mesh_lib.tensor_size_for((), 8) == 8


def seven_b(platform="gpu", free_memory=None, **changes):
    """BAGEL-7B's decode copy (bf16) and the paper recipe's cache (16 rows, 6146 slots)."""
    cache = layout_choice.cache_nbytes(BagelConfig.bagel_7b(), 16, 6146, jnp.bfloat16)
    assert cache == 16 * 6146 * 28 * 2 * 4 * 128 * 2  # k and v, 28 layers, 4 kv heads of 128
    arguments = dict(
        copy_bytes=int(15.0 * GIB),
        cache_bytes=cache,
        heads=BAGEL_7B_HEADS,
        num_layers=28,
        num_devices=8,
        devices_per_host=8,
        platform=platform,
        device_kind="NVIDIA H100 80GB HBM3",
        free_memory=free_memory,
    )
    arguments.update(changes)
    return layout_choice.choose(**arguments)


def test_auto_takes_the_gqa_tensor_layout_for_7b_on_gpus_and_replicated_for_the_toy_on_cpus():
    choice = seven_b()
    assert (choice.layout, choice.tensor_size) == ("tensor", 4)
    replicated, tensor = choice.projections
    assert tensor.device_bytes < replicated.device_bytes / 3  # a quarter of the weights each
    assert "'auto' -> 'tensor 4'" in choice.describe(1024)
    # The toy model on 8 CPU devices: its weights are tiny, the collectives' latency is not.
    toy = seven_b(
        platform="cpu",
        copy_bytes=2 * 2**20,
        cache_bytes=2**20,
        heads=(4, 2, 2),
        num_layers=2,
        device_kind="cpu",
    )
    assert (toy.layout, toy.tensor_size) == ("replicated", 1)
    # One device: nothing to split.
    single = seven_b(num_devices=1, devices_per_host=1)
    assert single.layout == "replicated" and len(single.projections) == 1


def test_auto_keeps_to_what_fits():
    # 12 GiB free: the 15 GiB replicated copy does not fit, the tensor one does.
    choice = seven_b(free_memory=12 * GIB, num_layers=10_000)  # tensor slower by latency
    assert [p.fits for p in choice.projections] == [False, True]
    assert choice.layout == "tensor"
    assert "does not fit" in choice.describe(1024)
    # Plenty of memory and the same latency: the faster one wins.
    assert seven_b(free_memory=60 * GIB, num_layers=10_000).layout == "replicated"
    # 18.5 GiB free (15.7 usable): the replicated copy and its 0.66 GiB share of the cache fit,
    # but the engine's insert holds a second share (the prefilled rows' beside the pool's).
    choice = seven_b(free_memory=18.5 * GIB, num_layers=10_000)
    replicated = choice.projections[0]
    assert replicated.device_bytes <= 0.85 * 18.5 * GIB < replicated.device_bytes + 0.65 * GIB
    assert [p.fits for p in choice.projections] == [False, True]


def test_the_tensor_copy_splits_attention_and_auto_resolves(monkeypatch):
    """On 8 CPU devices the tiny model's 4 / 2 heads split 2 ways: the copy's k / v weights
    are sharded, where an axis of all 8 devices would leave them whole on every device."""
    mesh, _, graphdef, params, rest = training_model("bfloat16")
    config = BagelConfig.tiny()
    copy = decode_copy.make_decode_copy(
        graphdef, params, rest, layout="tensor", mesh=mesh, dtype=jnp.bfloat16, model_config=config
    )
    assert dict(copy.mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    # q, k and v in one [L, D, t, Hq/t + 2 Hkv/t, Dh] kernel: each device its own heads.
    qkv = copy.state["language_model"]["layers"]["und"]["qkv_proj"]["kernel"][...]
    assert qkv.shape[2] == 2 and qkv.sharding.spec == P(None, None, "tensor", None, None)
    copy.delete()
    # The old choice, all the host's devices: the kv heads stay whole (replicated) per device.
    eight = decode_copy.make_decode_copy(
        graphdef, params, rest, layout="tensor", mesh=mesh, dtype=jnp.bfloat16, tensor_size=8
    )
    qkv = eight.state["language_model"]["layers"]["und"]["qkv_proj"]["kernel"][...]
    assert qkv.shape[2] == 1 and qkv.sharding.is_fully_replicated, qkv.sharding
    eight.delete()
    # 'auto' on the CPU: replicated (see above); a mesh is never made for 'auto' itself.
    auto = decode_copy.make_decode_copy(
        graphdef, params, rest, layout="auto", mesh=mesh, dtype=jnp.bfloat16, model_config=config
    )
    assert auto.layout == "replicated" and dict(auto.mesh.shape)["tensor"] == 1
    auto.delete()
    with pytest.raises(ValueError, match="'auto' is resolved first"):
        mesh_lib.decode_mesh(mesh, "auto")
