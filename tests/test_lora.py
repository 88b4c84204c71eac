"""LoRA adapters on the model's projections (models/lora.py): what attaching changes (nothing,
until trained), the merge W + (alpha/r) A B against an independent float64 product, the graph
after the merge, gradients, and the decode copy of an adapted model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close_to_scale
from flax import nnx

from models import lora
from models.bagel import Bagel
from models.configs import BagelConfig
from opsd_jax.data.image_transform import patchify, vit_position_ids
from opsd_jax.data.packing import Image, SpecialTokens, Text, pack_samples
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.sampling import decode_copy

SPECIAL = SpecialTokens(im_start=1000, im_end=1001, vision_start=1002, vision_end=1003)
LM_TARGETS = r"language_model/layers/und/(q|k|v|o|gate|up|down)_proj"
RANK, ALPHA = 4, 8.0


def tiny_model():
    return Bagel(BagelConfig.tiny(llm=dict(compute_dtype="float32")), rngs=nnx.Rngs(0))


def a_pack():
    rng = np.random.default_rng(0)
    pixels = rng.uniform(-1, 1, (14 * 2, 14 * 3, 3)).astype(np.float32)
    image = Image(patchify(pixels), vit_position_ids(2, 3))
    sample = [image, Text([11, 12, 13, 14]), Text([21, 22, 23], loss=True)]
    return jax.tree.map(jnp.asarray, pack_samples([sample], row_length=24, special=SPECIAL))


def logits_of(model, pack):
    return np.asarray(model.language_model.logits(model(pack)))


def with_random_b(model, seed=1):
    """The adapters' B matrices made non-zero (as training makes them)."""
    rng = np.random.default_rng(seed)
    for projection in lora.projection_paths(model).values():
        if projection.lora is not None:
            b = projection.lora.lora_b
            b[...] = jnp.asarray(rng.normal(0, 0.05, b.shape), jnp.float32)
    return model


def test_attached_adapters_change_nothing_until_trained():
    model, pack = tiny_model(), a_pack()
    before = logits_of(model, pack)
    paths = lora.attach(model, RANK, ALPHA, LM_TARGETS, nnx.Rngs(1))
    assert len(paths) == 7 and all(p.startswith("language_model/layers/und/") for p in paths)
    np.testing.assert_array_equal(logits_of(model, pack), before)  # B = 0: x A B = 0 exactly
    adapters, base, _ = nnx.split(model, nnx.LoRAParam, nnx.Param, ...)[1:]
    shapes = {"/".join(map(str, p)): x.shape for p, x in nnx.to_flat_state(adapters)}
    layers = model.config.llm.num_hidden_layers
    q = "language_model/layers/und/q_proj/lora"
    assert shapes[f"{q}/lora_a"] == (layers, 64, RANK)  # [layers, hidden, r]
    assert shapes[f"{q}/lora_b"] == (layers, RANK, 4 * 16)  # [layers, r, heads x head dim]
    assert len(shapes) == 14
    assert not any("lora" in "/".join(map(str, p)) for p, _ in nnx.to_flat_state(base))


def test_merged_kernels_are_w_plus_scaled_ab_and_compute_the_adapted_model():
    model, pack = tiny_model(), a_pack()
    lora.attach(model, RANK, ALPHA, LM_TARGETS, nnx.Rngs(1))
    with_random_b(model)
    adapted = logits_of(model, pack)
    merged = lora.merged(model)
    assert lora.has_adapters(model) and not lora.has_adapters(merged)  # the input is kept
    for path, projection in lora.projection_paths(model).items():
        kernel = np.asarray(projection.kernel[...], np.float64)
        if projection.lora is None:
            expected = kernel
        else:  # an independent product: float64 numpy, per layer
            a = np.asarray(projection.lora.lora_a[...], np.float64)
            b = np.asarray(projection.lora.lora_b[...], np.float64)
            expected = kernel + (ALPHA / RANK) * np.einsum("lir,lro->lio", a, b).reshape(
                kernel.shape
            )
        got = lora.projection_paths(merged)[path].kernel[...]
        assert_close_to_scale(got, expected, rel=1e-6, err_msg=path)
    assert_close_to_scale(logits_of(merged, pack), adapted, rel=1e-5)
    assert np.abs(adapted - logits_of(tiny_model(), pack)).max() > 1e-3  # the adapters matter
    # The merged model's graph is that of a model never given adapters.
    assert nnx.split(merged)[0] == nnx.split(tiny_model())[0]


def test_gradients_reach_every_adapter_and_only_the_adapters_move():
    model, pack = tiny_model(), a_pack()
    lora.attach(model, RANK, ALPHA, LM_TARGETS, nnx.Rngs(1))
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)

    @jax.jit
    def grads(adapters, rest):
        def loss(adapters):
            # The base as new Variables at the grad's trace level (as train_step's loss does).
            model = nnx.merge(graphdef, adapters, jax.tree.map(lambda x: x, rest))
            return jnp.mean(model(pack) ** 2)

        return jax.grad(loss)(adapters)

    flat = dict(nnx.to_flat_state(grads(adapters, rest)))
    # B = 0 at first: only B has a gradient (dA = x^T dy B^T); once B moves, A has one too.
    for path, g in flat.items():
        nonzero = bool(np.all(np.abs(np.asarray(g[...])).reshape(g.shape[0], -1).max(1) > 0))
        assert nonzero == (path[-1] == "lora_b"), path
    with_random_b(model)
    adapters = nnx.split(model, nnx.LoRAParam, ...)[1]
    for path, g in nnx.to_flat_state(grads(adapters, rest)):
        assert np.all(np.abs(np.asarray(g[...])).reshape(g.shape[0], -1).max(1) > 0), path


def test_the_decode_copy_of_an_adapted_model_is_the_merged_models():
    model = with_random_b(tiny_model_with_adapters())
    mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
    copies = [
        decode_copy.make_decode_copy(
            *nnx.split(m), layout="replicated", mesh=mesh, dtype="bfloat16"
        )
        for m in (model, lora.merged(model))
    ]
    assert copies[0].graphdef == copies[1].graphdef
    for (path, x), (_, y) in zip(
        nnx.to_flat_state(copies[0].state), nnx.to_flat_state(copies[1].state), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]), err_msg=str(path))


def tiny_model_with_adapters():
    model = tiny_model()
    lora.attach(model, RANK, ALPHA, LM_TARGETS, nnx.Rngs(1))
    return model


@pytest.mark.parametrize(
    "rank, targets, message",
    [
        (4, r"language_model/layers/und/qq_proj", "matches no projection of the model"),
        (4, r"(", "not a regular expression"),
        (0, LM_TARGETS, "lora_rank=0: must be an integer >= 1"),
        (-2, LM_TARGETS, "lora_rank=-2"),
    ],
)
def test_bad_adapters_are_named(rank, targets, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        lora.attach(tiny_model(), rank, ALPHA, targets, nnx.Rngs(1))


def test_the_vit_and_connector_take_adapters_too():
    model, pack = tiny_model(), a_pack()
    paths = lora.attach(model, RANK, ALPHA, r"(vit_model/layers/.*|connector/fc[12])", nnx.Rngs(1))
    assert "connector/fc1" in paths and "vit_model/layers/q_proj" in paths
    with_random_b(model)
    assert_close_to_scale(logits_of(lora.merged(model), pack), logits_of(model, pack), rel=1e-5)
