"""The packed multimodal forward: sin-cos table, ViT -> connector -> LM composition, packing."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.bagel import Bagel, sincos_2d_table
from models.configs import BagelConfig
from models.pack import Pack
from opsd_jax.data.image_transform import patchify, vit_position_ids
from opsd_jax.data.packing import Image, SpecialTokens, Text, pack_samples

SPECIAL = SpecialTokens(im_start=1000, im_end=1001, vision_start=1002, vision_end=1003)


def tiny_model(seed=0, **llm):
    config = BagelConfig.tiny(llm=dict(compute_dtype="float32", **llm))
    return Bagel(config, rngs=nnx.Rngs(seed))


@functools.partial(jax.jit, static_argnums=0)
def _hidden(graphdef, state, pack):
    return nnx.merge(graphdef, state)(pack)


def hidden_of(model, pack: Pack) -> np.ndarray:
    graphdef, state = nnx.split(model)
    return np.asarray(_hidden(graphdef, state, jax.tree.map(jnp.asarray, pack)))


def test_sincos_table_matches_an_independent_construction():
    grid, dim = 5, 16
    table = sincos_2d_table(grid, dim)
    quarter = dim // 4
    for r in range(grid):
        for c in range(grid):
            row = table[r * grid + c]
            for k in range(quarter):
                w = 1.0 / 10000 ** (k / quarter)
                # First half encodes the column (x), second half the row (y); each [sin, cos].
                expected = [math.sin(c * w), math.cos(c * w), math.sin(r * w), math.cos(r * w)]
                got = [row[k], row[quarter + k], row[2 * quarter + k], row[3 * quarter + k]]
                np.testing.assert_allclose(got, expected, atol=1e-6)
    assert sincos_2d_table(70, 3584).shape == (4900, 3584)
    with pytest.raises(ValueError, match="divisible by 4"):
        sincos_2d_table(4, 10)


def random_image(rng, grid_h, grid_w):
    pixels = rng.uniform(-1, 1, (14 * grid_h, 14 * grid_w, 3)).astype(np.float32)
    return Image(patchify(pixels), vit_position_ids(grid_h, grid_w))


def test_image_blocks_share_one_rope_id_and_advance_the_counter_by_one():
    rng = np.random.default_rng(0)
    sample = [
        random_image(rng, 2, 3),
        Text([5, 6, 7]),
        random_image(rng, 1, 2),
        Text([8], loss=True),
    ]
    pack = pack_samples([sample], row_length=32, special=SPECIAL)
    # [vs, 6 patches, ve] at 0; [ims, 5, 6, 7, ime] at 1..5; [vs, 2 patches, ve] at 6; [ims, 8, ime] at 7..9.
    expected = [0] * 8 + [1, 2, 3, 4, 5] + [6] * 4 + [7, 8, 9]
    np.testing.assert_array_equal(pack.positions[0, :20], expected)
    np.testing.assert_array_equal(pack.tokens[0, :8], [1002, 0, 0, 0, 0, 0, 0, 1003])
    np.testing.assert_array_equal(pack.k_end[0, :8], [8] * 8)  # bidirectional block
    np.testing.assert_array_equal(pack.k_end[0, 8:13], np.arange(9, 14))  # causal text
    np.testing.assert_array_equal(pack.k_end[0, 13:17], [17] * 4)
    np.testing.assert_array_equal(pack.vit_slots[0, :8], [1, 2, 3, 4, 5, 6, 14, 15])
    np.testing.assert_array_equal(pack.vit_image_ids[0, :8], [1] * 6 + [2] * 2)
    # Loss: outputs at <im_start> and '8' predict '8' and <im_end>.
    np.testing.assert_array_equal(pack.loss_rows[0], [17, 18])
    np.testing.assert_array_equal(pack.loss_targets[0], [8, 1001])
    assert pack.segment_ids[0, :20].tolist() == [1] * 20 and pack.segment_ids[0, 20:].max() == 0


def step_by_step_hidden(model, sample_image, question, answer):
    """[image block, question, answer] built by hand from the separately tested parts."""
    lm = model.language_model
    n = len(sample_image.patches)
    ids = [SPECIAL.vision_start] + [0] * n + [SPECIAL.vision_end]
    ids += [SPECIAL.im_start, *question, SPECIAL.im_end, SPECIAL.im_start, *answer, SPECIAL.im_end]
    length = len(ids)
    features = model.vit_model(
        jnp.asarray(sample_image.patches)[None],
        jnp.asarray(sample_image.position_ids)[None],
        jnp.ones((1, n), jnp.int32),
    )
    table = jnp.asarray(sincos_2d_table(70, lm.config.hidden_size))
    image_rows = model.connector(features)[0] + table[sample_image.position_ids]
    embeddings = lm.embed(jnp.asarray(ids)[None]).at[0, 1 : n + 1].set(image_rows)
    positions = np.concatenate([np.zeros(n + 2), 1 + np.arange(length - n - 2)]).astype(np.int32)
    k_end = np.arange(length, dtype=np.int32) + 1
    k_end[: n + 2] = n + 2
    return np.asarray(
        lm(
            embeddings,
            positions=jnp.asarray(positions)[None],
            segment_ids=jnp.ones((1, length), jnp.int32),
            k_start=jnp.zeros((1, length), jnp.int32),
            k_end=jnp.asarray(k_end)[None],
        )
    )[0]


@pytest.mark.slow
def test_packed_forward_equals_step_by_step_and_two_samples_equal_each_alone():
    model = tiny_model()
    rng = np.random.default_rng(1)
    samples = [
        (random_image(rng, 2, 3), [11, 12, 13, 14], [21, 22]),
        (random_image(rng, 3, 2), [15, 16], [23, 24, 25]),
    ]
    alone = []
    for image, question, answer in samples:
        pack = pack_samples(
            [[image, Text(question), Text(answer, loss=True)]], row_length=24, special=SPECIAL
        )
        hidden = hidden_of(model, pack)[0]
        reference = step_by_step_hidden(model, image, question, answer)
        np.testing.assert_allclose(hidden[: len(reference)], reference, atol=1e-5, rtol=0)
        alone.append(reference)
    both = pack_samples(
        [[im, Text(q), Text(a, loss=True)] for im, q, a in samples], row_length=48, special=SPECIAL
    )
    assert both.num_rows == 1 and both.segment_ids.max() == 2
    hidden = hidden_of(model, both)[0]
    n0 = len(alone[0])
    np.testing.assert_allclose(hidden[:n0], alone[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(hidden[n0 : n0 + len(alone[1])], alone[1], atol=1e-5, rtol=0)

    # logits_at = lm_head at exactly the loss rows, aligned with loss_targets.
    rows = jnp.asarray(both.loss_rows)
    logits = np.asarray(model.logits_at(jnp.asarray(hidden)[None], rows))
    full = np.asarray(model.language_model.logits(jnp.asarray(hidden)))
    np.testing.assert_allclose(logits[0], full[both.loss_rows[0]], atol=1e-6)
    np.testing.assert_array_equal(both.loss_sample[0], [0, 0, 0, 1, 1, 1, 1])


def test_text_only_pack_and_refused_configurations():
    model = tiny_model()
    pack = pack_samples(
        [[Text([1, 2, 3]), Text([4, 5], loss=True)]], row_length=16, special=SPECIAL
    )
    assert pack.vit_patches is None
    assert hidden_of(model, pack).shape == (1, 16, 64)
    with pytest.raises(ValueError, match="visual_gen"):
        Bagel(BagelConfig.tiny(visual_gen=True), rngs=nnx.Rngs(0))
    no_vit = Bagel(BagelConfig.tiny(visual_und=False), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(2)
    with pytest.raises(ValueError, match="visual_und=False"):
        no_vit(pack_samples([[random_image(rng, 1, 1), Text([3])]], row_length=8, special=SPECIAL))
    with pytest.raises(ValueError, match="sample 0 needs 9 tokens"):
        pack_samples([[Text([1] * 7)]], row_length=8, special=SPECIAL)


def test_the_vit_runs_on_its_own_attention_backend(monkeypatch):
    """vit_attention_backend: 'auto' is the LLM's backend (as before it existed); another value
    is the ViT's alone, the LLM keeping its own; the hidden states agree across backends."""
    rng = np.random.default_rng(0)
    sample = [random_image(rng, 2, 3), Text([5, 6, 7]), random_image(rng, 1, 2), Text([8], True)]
    pack = pack_samples([sample], row_length=32, special=SPECIAL)
    from models import attention

    called, real = [], attention.attention

    def spy(q, k, v, **kwargs):
        called.append((q.shape[1], kwargs["backend"]))  # rows' length: patches or tokens
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(attention, "attention", spy)
    hidden = {}
    for vit_backend in ("auto", "reference"):
        called.clear()
        model = tiny_model(attention_backend="chunked", vit_attention_backend=vit_backend)
        hidden[vit_backend] = hidden_of(model, pack)
        patches, tokens = pack.vit_patches.shape[1], pack.tokens.shape[1]
        assert patches != tokens
        want = "chunked" if vit_backend == "auto" else vit_backend
        assert set(called) == {(patches, want), (tokens, "chunked")}, called
    np.testing.assert_allclose(hidden["reference"], hidden["auto"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="vit_attention_backend"):
        tiny_model(vit_attention_backend="flash")
