"""The LM under an 8-device CPU mesh with the FSDP rules: params really sharded, same numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close_to_scale, assert_trees_close_to_scale
from flax import nnx

from models.configs import BagelConfig
from models.qwen2_mot import Qwen2MoT
from opsd_jax.parallel import mesh as mesh_lib


def _config():
    return BagelConfig.tiny(llm=dict(compute_dtype="float32")).llm


def _batch(config, rows=8, length=24, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, (rows, length)).astype(np.int32)
    positions = np.tile(np.arange(length, dtype=np.int32), (rows, 1))
    k_end = positions + 1
    return dict(
        tokens=tokens,
        positions=positions,
        segment_ids=np.ones_like(tokens),
        k_start=np.zeros_like(tokens),
        k_end=k_end,
    )


def _loss_and_grads(graphdef, state, batch):
    def loss(state):
        lm = nnx.merge(graphdef, state)
        hidden = lm(
            lm.embed(batch["tokens"]),
            positions=batch["positions"],
            segment_ids=batch["segment_ids"],
            k_start=batch["k_start"],
            k_end=batch["k_end"],
        )
        return jnp.mean(lm.logits(hidden) ** 2)

    return jax.value_and_grad(loss)(state)


@pytest.mark.parametrize("num_replicate", [1, 2])
def test_fsdp_sharded_params_and_same_results(num_replicate):
    config = _config()
    mesh = mesh_lib.make_mesh(num_replicate=num_replicate)
    num_shard = 8 // num_replicate
    assert dict(mesh.shape) == {"data": num_replicate, "fsdp": num_shard, "tensor": 1}
    lm = mesh_lib.create_sharded_model(lambda: Qwen2MoT(config, rngs=nnx.Rngs(0)), mesh)

    embed = lm.embed_tokens[...]
    assert embed.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    assert embed.sharding.shard_shape(embed.shape) == (
        config.vocab_size,
        config.hidden_size // num_shard,
    )
    q_kernel = lm.layers.und.q_proj.kernel[...]  # [layers, embed, heads, head_dim]
    assert q_kernel.sharding.shard_shape(q_kernel.shape)[1] == config.hidden_size // num_shard
    down = lm.layers.und.down_proj.kernel[...]  # [layers, mlp, embed]
    assert down.sharding.shard_shape(down.shape)[2] == config.hidden_size // num_shard
    assert len(embed.addressable_shards) == 8

    # Same parameters, unsharded on one device, give the same loss and gradients.
    graphdef, state = nnx.split(lm)
    host_state = jax.device_get(state)
    batch = _batch(config)
    with mesh_lib.use_mesh(mesh):
        sharded_batch = {
            k: jax.device_put(v, mesh_lib.batch_sharding(mesh)) for k, v in batch.items()
        }
        step = jax.jit(_loss_and_grads, static_argnums=0)
        loss, grads = step(graphdef, state, sharded_batch)
    ref_loss, ref_grads = jax.jit(_loss_and_grads, static_argnums=0)(graphdef, host_state, batch)
    assert_close_to_scale(loss, ref_loss, rel=1e-5)  # a mean of squares: its own scale
    assert_trees_close_to_scale(grads, ref_grads, rel=1e-4)
    # Gradients come back sharded like their parameters (FSDP: no gathered copy kept).
    assert grads["embed_tokens"][...].sharding.spec == embed.sharding.spec


def test_mesh_that_does_not_divide_the_devices_fails():
    with pytest.raises(ValueError, match="num_replicate=3"):
        mesh_lib.make_mesh(num_replicate=3)
    with pytest.raises(ValueError, match="does not match the 8 available devices"):
        mesh_lib.make_mesh(num_replicate=2, num_shard=2)


def test_sharded_multimodal_forward_matches_single_device():
    from models.bagel import Bagel
    from opsd_jax.data.image_transform import patchify, vit_position_ids
    from opsd_jax.data.packing import Image, SpecialTokens, Text, pack_samples

    config = BagelConfig.tiny(llm=dict(compute_dtype="float32"))
    mesh = mesh_lib.make_mesh()
    model = mesh_lib.create_sharded_model(lambda: Bagel(config, rngs=nnx.Rngs(0)), mesh)
    table = model.vit_pos_embed[...]
    assert table.sharding.shard_shape(table.shape) == (4900, config.llm.hidden_size // 8)
    patch_kernel = model.vit_model.layers.fc1.kernel[...]  # [layers, vit_embed, mlp]
    assert patch_kernel.sharding.shard_shape(patch_kernel.shape)[1] == config.vit.hidden_size // 8

    rng = np.random.default_rng(0)
    special = SpecialTokens(im_start=1000, im_end=1001, vision_start=1002, vision_end=1003)
    samples = []
    for i in range(8):
        h, w = 1 + i % 3, 2 + i % 2
        pixels = rng.uniform(-1, 1, (14 * h, 14 * w, 3)).astype(np.float32)
        samples.append(
            [
                Image(patchify(pixels), vit_position_ids(h, w)),
                Text([3 + i, 4, 5]),
                Text([6, 7], loss=True),
            ]
        )
    pack = pack_samples(samples, row_length=24, num_rows=8, special=special)
    graphdef, state = nnx.split(model)

    def forward(state, pack):
        m = nnx.merge(graphdef, state)
        return m.logits_at(m(pack), pack.loss_rows)

    with mesh_lib.use_mesh(mesh):
        sharded_pack = jax.tree.map(
            lambda x: jax.device_put(x, mesh_lib.batch_sharding(mesh, x.ndim)), pack
        )
        logits = jax.jit(forward)(state, sharded_pack)
    ref = jax.jit(forward)(jax.device_get(state), pack)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=1e-5, rtol=1e-5)
