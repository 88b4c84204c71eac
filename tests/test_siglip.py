"""The SigLIP NaViT encoder against transformers' SiglipVisionModel, and its packing rules."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from models.configs import SiglipConfig
from models.siglip import SiglipVisionEncoder, image_ranges
from opsd_jax.data.image_transform import patchify, vit_position_ids

# 84 / 14 = a 6 x 6 patch grid, so a full-size image uses every row of the position table in
# the same order as HF's (non-NaViT) SigLIP, which indexes positions 0..35 row-major.
CONFIG = SiglipConfig(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=2,
    num_hidden_layers=2,
    image_size=84,
)
GRID = CONFIG.num_patches_per_side


def _np(t):
    return t.detach().float().numpy()


@pytest.fixture(scope="module")
def torch_vit():
    torch.manual_seed(0)
    hf_config = transformers.SiglipVisionConfig(
        hidden_size=CONFIG.hidden_size,
        intermediate_size=CONFIG.intermediate_size,
        num_hidden_layers=CONFIG.num_hidden_layers,
        num_attention_heads=CONFIG.num_attention_heads,
        image_size=CONFIG.image_size,
        patch_size=CONFIG.patch_size,
        num_channels=3,
        hidden_act="gelu_pytorch_tanh",
        layer_norm_eps=CONFIG.layer_norm_eps,
        attn_implementation="eager",
    )
    model = transformers.SiglipVisionModel(hf_config).float().eval()
    with torch.no_grad():  # non-trivial norms and biases, so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


def copy_into(encoder: SiglipVisionEncoder, torch_model) -> None:
    vm = getattr(torch_model, "vision_model", torch_model)  # transformers 5 dropped the wrapper
    d, h, dh = CONFIG.hidden_size, CONFIG.num_attention_heads, CONFIG.head_dim
    conv = _np(vm.embeddings.patch_embedding.weight)  # [D, C, py, px]
    # (py, px, c) feature order, the layout BAGEL's checkpoint stores the conv in.
    encoder.patch_embedding.kernel[...] = conv.transpose(0, 2, 3, 1).reshape(d, -1).T
    encoder.patch_embedding.bias[...] = _np(vm.embeddings.patch_embedding.bias)
    encoder.position_embedding[...] = _np(vm.embeddings.position_embedding.weight)
    layers = vm.encoder.layers
    stack = lambda fn: np.stack([fn(layer) for layer in layers])  # noqa: E731
    for ours, theirs in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj")):
        proj = getattr(encoder.layers, ours)
        proj.kernel[...] = stack(
            lambda l: _np(getattr(l.self_attn, theirs).weight).T.reshape(d, h, dh)
        )
        proj.bias[...] = stack(lambda l: _np(getattr(l.self_attn, theirs).bias).reshape(h, dh))
    encoder.layers.out_proj.kernel[...] = stack(
        lambda l: _np(l.self_attn.out_proj.weight).T.reshape(h, dh, d)
    )
    encoder.layers.out_proj.bias[...] = stack(lambda l: _np(l.self_attn.out_proj.bias))
    for name in ("fc1", "fc2"):
        getattr(encoder.layers, name).kernel[...] = stack(
            lambda l: _np(getattr(l.mlp, name).weight).T
        )
        getattr(encoder.layers, name).bias[...] = stack(lambda l: _np(getattr(l.mlp, name).bias))
    for name in ("layer_norm1", "layer_norm2"):
        getattr(encoder.layers, name).scale[...] = stack(lambda l: _np(getattr(l, name).weight))
        getattr(encoder.layers, name).bias[...] = stack(lambda l: _np(getattr(l, name).bias))
    encoder.post_layernorm.scale[...] = _np(vm.post_layernorm.weight)
    encoder.post_layernorm.bias[...] = _np(vm.post_layernorm.bias)


@functools.partial(jax.jit, static_argnums=0)
def _encode(graphdef, state, patches, position_ids, image_ids):
    return nnx.merge(graphdef, state)(patches, position_ids, image_ids)


def encode(encoder, patches, position_ids, image_ids):
    graphdef, state = nnx.split(encoder)
    batch = lambda x: jnp.asarray(x)[None]  # noqa: E731
    return np.asarray(
        _encode(graphdef, state, batch(patches), batch(position_ids), batch(image_ids))
    )[0]


def make_encoder(backend="chunked", seed=0):
    return SiglipVisionEncoder(
        CONFIG,
        compute_dtype="float32",
        attention_backend=backend,
        remat="none",
        rngs=nnx.Rngs(seed),
    )


def random_image(rng, h, w):
    return rng.uniform(-1, 1, (h, w, 3)).astype(np.float32)


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_matches_transformers_siglip(torch_vit, backend):
    encoder = make_encoder(backend)
    copy_into(encoder, torch_vit)
    rng = np.random.default_rng(0)
    for _ in range(2):
        image = random_image(rng, CONFIG.image_size, CONFIG.image_size)
        with torch.no_grad():
            pixels = torch.from_numpy(image.transpose(2, 0, 1)[None].copy())
            ref = _np(torch_vit(pixel_values=pixels).last_hidden_state[0])
        ours = encode(
            encoder,
            patchify(image),
            vit_position_ids(GRID, GRID, GRID),
            np.ones(GRID * GRID, np.int32),
        )
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_packed_images_equal_each_alone_and_padding_is_inert():
    encoder = make_encoder()
    rng = np.random.default_rng(1)
    images = [random_image(rng, 14 * 3, 14 * 5), random_image(rng, 14 * 4, 14 * 2)]
    grids = [(3, 5), (4, 2)]
    alone = [
        encode(encoder, patchify(im), vit_position_ids(*g, GRID), np.ones(g[0] * g[1], np.int32))
        for im, g in zip(images, grids)
    ]
    pad = 5
    patches = np.concatenate([patchify(im) for im in images] + [np.zeros((pad, 588), np.float32)])
    pos = np.concatenate([vit_position_ids(*g, GRID) for g in grids] + [np.zeros(pad, np.int32)])
    ids = np.concatenate([np.full(15, 1), np.full(8, 2), np.zeros(pad)]).astype(np.int32)
    packed = encode(encoder, patches, pos, ids)
    np.testing.assert_allclose(packed[:15], alone[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(packed[15:23], alone[1], atol=1e-5, rtol=0)


def test_smaller_image_uses_top_left_block_of_the_position_table():
    encoder = make_encoder()
    table = np.asarray(encoder.position_embedding[...])
    rng = np.random.default_rng(2)
    image = random_image(rng, 14 * 2, 14 * 3)
    patches = patchify(image)
    ids = vit_position_ids(2, 3, GRID)
    np.testing.assert_array_equal(ids, [0, 1, 2, GRID, GRID + 1, GRID + 2])
    base = encode(encoder, patches, ids, np.ones(6, np.int32))
    # Overwrite every table row outside the top-left 2 x 3 block: the output must not move.
    outside = np.setdiff1d(np.arange(table.shape[0]), ids)
    changed = table.copy()
    changed[outside] += rng.normal(size=(len(outside), table.shape[1])).astype(np.float32)
    encoder.position_embedding[...] = changed
    np.testing.assert_array_equal(encode(encoder, patches, ids, np.ones(6, np.int32)), base)
    # ... while changing a row inside it does.
    changed[GRID + 1] += rng.normal(size=table.shape[1]).astype(
        np.float32
    )  # not a constant: LN removes those
    encoder.position_embedding[...] = changed
    assert np.abs(encode(encoder, patches, ids, np.ones(6, np.int32)) - base).max() > 1e-3


def test_image_ranges_are_each_patch_own_image():
    ids = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0]])
    k_start, k_end = image_ranges(ids)
    np.testing.assert_array_equal(k_start, [[0, 0, 0, 3, 3, 5, 6, 6]])
    np.testing.assert_array_equal(k_end, [[3, 3, 3, 5, 5, 6, 8, 8]])
