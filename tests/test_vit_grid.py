"""The ViT position grid comes from the checkpoint (vit_config.json image_size // patch_size).

A toy checkpoint with image_size 112 (a grid of 8 per side, not BAGEL's 70) loads, its images
get r*8 + c ids, an image or transform too large for the grid is an error naming the sizes, and
the model never turns an out-of-range id into NaN.
"""

import builders
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from models.bagel import Bagel, sincos_2d_table
from models.configs import BagelConfig
from opsd_jax.data.data_config import DatasetSpec
from opsd_jax.data.image_transform import ImageTransform, prepare_vit_image
from opsd_jax.data.pipeline import prepare_sample
from opsd_jax.data.sources import RawSample
from opsd_jax.io import hf_load
from opsd_jax.toy import model as toy_model

GRID8 = BagelConfig.tiny(
    llm=dict(compute_dtype="float32", remat="none", attention_backend="reference"),
    vit=dict(image_size=112),
)
TOY_TRANSFORM = ImageTransform(112, 56, 14)


def picture(width, height):
    rng = np.random.default_rng(width * height)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


def data_config(**changes):
    return builders.data_config([DatasetSpec("d", "unused")], **changes)


def test_the_grid_is_the_checkpoints(tmp_path):
    directory = toy_model.write_toy_model(tmp_path / "grid8", dtype="fp32", config=GRID8)
    model, config, _ = hf_load.load_hf(directory)
    assert config.vit_max_num_patch_per_side == 8
    assert BagelConfig.tiny().vit_max_num_patch_per_side == 70
    assert model.vit_model.position_embedding.shape == (64, 32)
    np.testing.assert_array_equal(np.asarray(model.vit_pos_embed[...]), sincos_2d_table(8, 64))


def test_images_get_ids_on_the_models_grid_and_too_large_ones_are_named():
    config = data_config(image_transform=TOY_TRANSFORM).for_model(GRID8)
    assert (config.vit_patch_size, config.vit_max_patches_per_side) == (14, 8)
    raw = RawSample("p", "d", "q", "a", picture(84, 56), [picture(112, 112)], [], None)
    sample = prepare_sample(raw, config)
    rows, cols = np.divmod(sample.problem_image.position_ids, 8)
    assert (sample.problem_image.grid_h, sample.problem_image.grid_w) == (4, 6)
    np.testing.assert_array_equal(rows, np.repeat(np.arange(4), 6))
    np.testing.assert_array_equal(cols, np.tile(np.arange(6), 4))
    assert sample.vt_images[0].position_ids.max() == 63
    # A 196 px transform makes up to 14 patches per side: more than the grid of 8.
    with pytest.raises(
        ValueError,
        match=r"a 200x150 image resized to 196x140 px is 14x10 "
        r"patches .* grid of 8 per side .* max_size <= 112",
    ):
        prepare_vit_image(picture(200, 150), ImageTransform(196, 56, 14), max_patches_per_side=8)


def test_a_transform_larger_than_the_grid_is_a_config_error():
    with pytest.raises(ValueError, match=r"image_transform.max_size=980 .* grid of 8 .* <= 112"):
        data_config().for_model(GRID8)  # vit_chat: 980 px
    with pytest.raises(ValueError, match=r"stride=7 is not a multiple of the ViT's patch_size=14"):
        data_config(image_transform=ImageTransform(112, 56, 7))


def test_an_out_of_range_id_never_gives_nan():
    model = Bagel(GRID8, rngs=nnx.Rngs(0))
    patches = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (1, 3, 588)), jnp.float32)
    image_ids = jnp.ones((1, 3), jnp.int32)
    inside = model.image_embeddings(patches, jnp.asarray([[63, 63, 63]]), image_ids)
    outside = model.image_embeddings(patches, jnp.asarray([[63, 64, 5000]]), image_ids)
    assert np.isfinite(np.asarray(outside)).all()
    np.testing.assert_allclose(outside, inside, rtol=1e-6)  # clipped to the last row
