"""BAGEL's LM against PyTorch (transformers' Qwen3) and the packing / MoT properties."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch_qwen3
from flax import nnx

from models.configs import BagelConfig
from models.qwen2_mot import Qwen2MoT


def tiny_llm(**changes):
    return BagelConfig.tiny(llm=dict(compute_dtype="float32", **changes)).llm


def causal_ranges(segment_lengths, total):
    """segment_ids, k_start, k_end, positions for causal text segments packed in one row."""
    seg = np.zeros(total, np.int32)
    k_start = np.zeros(total, np.int32)
    k_end = np.zeros(total, np.int32)
    pos = np.zeros(total, np.int32)
    offset = 0
    for i, n in enumerate(segment_lengths):
        sl = slice(offset, offset + n)
        seg[sl] = i + 1
        k_start[sl] = offset
        k_end[sl] = np.arange(offset, offset + n) + 1
        pos[sl] = np.arange(n)
        offset += n
    return seg, k_start, k_end, pos


@functools.partial(jax.jit, static_argnums=0)
def _jitted_logits(graphdef, state, tokens, positions, seg, k_start, k_end, gen_mask):
    lm = nnx.merge(graphdef, state)
    hidden = lm(
        lm.embed(tokens),
        positions=positions,
        segment_ids=seg,
        k_start=k_start,
        k_end=k_end,
        gen_mask=gen_mask,
    )
    return lm.logits(hidden)


def forward(lm, tokens, positions, seg, k_start, k_end, gen_mask=None):
    """Logits [B, T, V] of a (jitted) forward; 1-D inputs are treated as one row."""
    as_batch = lambda x: None if x is None else jnp.asarray(np.atleast_2d(x))  # noqa: E731
    graphdef, state = nnx.split(lm)
    args = (tokens, positions, seg, k_start, k_end, gen_mask)
    return np.asarray(_jitted_logits(graphdef, state, *map(as_batch, args)))


@pytest.fixture(scope="module")
def torch_pair():
    """Two different torch reference models (the second serves as a distinct gen expert)."""
    config = tiny_llm()
    return torch_qwen3.make_torch_qwen3(config, seed=0), torch_qwen3.make_torch_qwen3(config, 1)


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_logits_match_torch_qwen3(torch_pair, backend):
    config = tiny_llm(attention_backend=backend)
    lm = Qwen2MoT(config, rngs=nnx.Rngs(0))
    torch_qwen3.copy_into(lm, torch_pair[0])
    rng = np.random.default_rng(0)
    for length in (1, 9, 23, 64):
        tokens = rng.integers(0, config.vocab_size, (3, length)).astype(np.int32)
        positions = np.tile(np.arange(length, dtype=np.int32), (3, 1))
        seg, k_start, k_end, _ = causal_ranges([length], length)
        tile = lambda x: np.tile(x, (3, 1))  # noqa: E731
        ours = forward(lm, tokens, positions, tile(seg), tile(k_start), tile(k_end))
        ref = torch_qwen3.torch_logits(torch_pair[0], tokens, positions)
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    # Explicit, non-consecutive position ids (an image block shares one id, as in BAGEL).
    positions = np.array([[0, 1, 2, 2, 2, 2, 2, 3, 4, 5, 5, 5, 6, 7]], np.int32)
    length = positions.shape[1]
    tokens = rng.integers(0, config.vocab_size, (1, length)).astype(np.int32)
    seg, k_start, k_end, _ = causal_ranges([length], length)
    ours = forward(lm, tokens, positions, seg, k_start, k_end)
    ref = torch_qwen3.torch_logits(torch_pair[0], tokens, positions)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_packed_row_equals_separate_forwards_and_padding_is_inert():
    config = tiny_llm()
    lm = Qwen2MoT(config, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(1)
    lengths = [7, 11, 5]
    total = 32  # 9 padding slots at the end
    tokens = rng.integers(1, config.vocab_size, total).astype(np.int32)
    seg, k_start, k_end, pos = causal_ranges(lengths, total)
    packed = forward(lm, tokens, pos, seg, k_start, k_end)[0]
    offset = 0
    for n in lengths:
        sl = slice(offset, offset + n)
        s, ks, ke, p = causal_ranges([n], n)
        alone = forward(lm, tokens[sl], p, s, ks, ke)[0]
        np.testing.assert_allclose(packed[sl], alone, atol=1e-5, rtol=0)
        offset += n
    # Different padding tokens, and a longer padded row, leave every real token unchanged.
    tokens2 = tokens.copy()
    tokens2[offset:] = rng.integers(1, config.vocab_size, total - offset)
    np.testing.assert_array_equal(
        forward(lm, tokens2, pos, seg, k_start, k_end)[0][:offset], packed[:offset]
    )
    pad = 13
    longer = [
        np.concatenate([x, np.zeros(pad, np.int32)]) for x in (tokens, pos, seg, k_start, k_end)
    ]
    np.testing.assert_allclose(forward(lm, *longer)[0][:offset], packed[:offset], atol=1e-6, rtol=0)


def test_bidirectional_image_block_and_causal_text():
    config = tiny_llm()
    lm = Qwen2MoT(config, rngs=nnx.Rngs(2))
    rng = np.random.default_rng(2)
    # One segment: 3 text tokens, a 5-token bidirectional block at [3, 8), then 4 text tokens.
    n = 12
    tokens = rng.integers(1, config.vocab_size, n).astype(np.int32)
    seg = np.ones(n, np.int32)
    k_start = np.zeros(n, np.int32)
    k_end = np.arange(n, dtype=np.int32) + 1
    k_end[3:8] = 8
    pos = np.array([0, 1, 2, 3, 3, 3, 3, 3, 4, 5, 6, 7], np.int32)
    base = forward(lm, tokens, pos, seg, k_start, k_end)[0]

    def changed_rows(index):
        t = tokens.copy()
        t[index] = (t[index] + 1) % config.vocab_size
        out = forward(lm, t, pos, seg, k_start, k_end)[0]
        return set(np.nonzero(np.abs(out - base).max(axis=-1) > 0)[0].tolist())

    # The last block token is seen by the whole block and everything after it, nothing before.
    assert changed_rows(7) == set(range(3, 12))
    # A text token only influences itself and later tokens (causal).
    assert changed_rows(9) == {9, 10, 11}
    assert changed_rows(1) == set(range(1, 12))


def test_mot_routing(torch_pair):
    """Und weights from torch model A, gen weights from torch model B (sharing A's embeddings)."""
    torch_a, torch_b = torch_pair
    torch_b.model.embed_tokens.weight.data.copy_(torch_a.model.embed_tokens.weight.data)
    torch_b.lm_head.weight.data.copy_(torch_a.lm_head.weight.data)
    config = tiny_llm(build_gen_expert=True)
    lm = Qwen2MoT(config, rngs=nnx.Rngs(3))
    torch_qwen3.copy_into(lm, torch_a, expert="und")
    rng = np.random.default_rng(3)
    n = 16
    tokens = rng.integers(0, config.vocab_size, (1, n)).astype(np.int32)
    seg, k_start, k_end, pos = causal_ranges([n], n)
    no_gen = np.zeros(n, bool)
    mixed = np.zeros(n, bool)
    mixed[-4:] = True  # gen tokens at the end: earlier (causal) tokens must not change

    # With gen = und weights, every routing gives the same output.
    lm.init_moe()
    und_only = forward(lm, tokens, pos, seg, k_start, k_end, no_gen)
    for gen_mask in (mixed, np.ones(n, bool), rng.random(n) < 0.5):
        np.testing.assert_allclose(
            forward(lm, tokens, pos, seg, k_start, k_end, gen_mask), und_only, atol=1e-6, rtol=0
        )

    # With distinct gen weights: all-und = torch A, all-gen = torch B, mixed changes only gen rows.
    torch_qwen3.copy_into(lm, torch_b, expert="gen")
    ref_a = torch_qwen3.torch_logits(torch_a, tokens, pos[None])
    ref_b = torch_qwen3.torch_logits(torch_b, tokens, pos[None])
    np.testing.assert_allclose(
        forward(lm, tokens, pos, seg, k_start, k_end, no_gen), ref_a, atol=1e-4, rtol=0
    )
    np.testing.assert_allclose(
        forward(lm, tokens, pos, seg, k_start, k_end, np.ones(n, bool)), ref_b, atol=1e-4, rtol=0
    )
    out = forward(lm, tokens, pos, seg, k_start, k_end, mixed)[0]
    np.testing.assert_array_equal(out[:-4], und_only[0][:-4])
    assert np.abs(out[-4:] - und_only[0][-4:]).max(axis=-1).min() > 1e-3


def test_understanding_only_model_has_no_gen_weights_and_ignores_gen_mask():
    config = tiny_llm()
    lm = Qwen2MoT(config, rngs=nnx.Rngs(4))
    paths = ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(lm))]
    assert not any("gen" in p for p in paths)
    with pytest.raises(ValueError, match="build_gen_expert"):
        lm.init_moe()


def test_full_remat_gives_same_gradients_as_no_remat():
    config = tiny_llm(remat="full")
    lm = Qwen2MoT(config, rngs=nnx.Rngs(5))
    n = 10
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, config.vocab_size, (1, n)))
    seg, k_start, k_end, pos = (jnp.asarray(x[None]) for x in causal_ranges([n], n))
    graphdef, state = nnx.split(lm)

    def loss(state):
        model = nnx.merge(graphdef, state)
        h = model(model.embed(tokens), positions=pos, segment_ids=seg, k_start=k_start, k_end=k_end)
        return jnp.mean(model.logits(h) ** 2)

    grads = jax.jit(jax.grad(loss))(state)
    # Same gradients as the no-remat model built from the same seed.
    base = Qwen2MoT(tiny_llm(remat="none"), rngs=nnx.Rngs(5))
    base_graphdef, base_state = nnx.split(base)

    def base_loss(state):
        model = nnx.merge(base_graphdef, state)
        h = model(model.embed(tokens), positions=pos, segment_ids=seg, k_start=k_start, k_end=k_end)
        return jnp.mean(model.logits(h) ** 2)

    base_grads = jax.jit(jax.grad(base_loss))(base_state)
    for g, b in zip(jax.tree.leaves(grads), jax.tree.leaves(base_grads)):
        np.testing.assert_allclose(g, b, atol=1e-6, rtol=1e-5)
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


def _where_route(gen_index, fn, und, gen, *inputs):
    """The routing MoT had before gathering: both experts on every token, a per-token select."""
    und_out = fn(und, *inputs)
    if gen is None or gen_index is None:
        return und_out
    rows, length = inputs[0].shape[:2]
    mask = jax.vmap(lambda m, i: m.at[i].set(True, mode="drop"))(
        jnp.zeros((rows, length), bool), gen_index
    )
    gen_out = fn(gen, *inputs)

    def pick(u, g):
        return jnp.where(mask.reshape(mask.shape + (1,) * (u.ndim - 2)), g, u)

    return jax.tree.map(pick, und_out, gen_out)


def _fresh_logits(lm, tokens, positions, seg, k_start, k_end, gen_mask):
    """A forward traced anew (not from a jit cache), so a patched `route` takes effect."""
    graphdef, state = nnx.split(lm)

    @jax.jit
    def run(state, gen_mask):
        model = nnx.merge(graphdef, state)
        hidden = model(
            model.embed(tokens),
            positions=positions,
            segment_ids=seg,
            k_start=k_start,
            k_end=k_end,
            gen_mask=gen_mask,
        )
        return model.logits(hidden)

    return np.asarray(run(state, gen_mask))


@pytest.mark.parametrize("capacity", [0, 7])
def test_gathered_gen_routing_equals_the_where_routing(capacity, monkeypatch):
    """Distinct und / gen weights, mixed und and gen tokens in two packed rows (a row of 7 gen
    tokens fills a capacity of 7 exactly; another row has 3, scattered)."""
    from models import qwen2_mot

    config = tiny_llm(build_gen_expert=True, gen_token_capacity=capacity)
    lm = Qwen2MoT(config, rngs=nnx.Rngs(6))  # und and gen drawn independently: they differ
    rng = np.random.default_rng(6)
    n = 24
    seg, k_start, k_end, pos = (np.tile(x, (2, 1)) for x in causal_ranges([10, 14], n))
    tokens = rng.integers(0, config.vocab_size, (2, n)).astype(np.int32)
    gen_mask = np.zeros((2, n), bool)
    gen_mask[0, 12:19] = True  # a block of gen tokens in the second segment
    gen_mask[1, [2, 9, 17]] = True
    args = (tokens, pos, seg, k_start, k_end)
    gathered = _fresh_logits(lm, *args, gen_mask)
    und_only = _fresh_logits(lm, *args, None)
    monkeypatch.setattr(qwen2_mot, "route", _where_route)
    reference = _fresh_logits(lm, *args, gen_mask)
    np.testing.assert_allclose(gathered, reference, atol=1e-6, rtol=0)
    # Not vacuous: the gen tokens (and the causal tokens after them) do use other weights.
    assert np.abs(gathered - und_only)[0, 12].max() > 1e-3
    np.testing.assert_array_equal(gathered[1, :2], und_only[1, :2])


def test_more_gen_tokens_than_the_capacity_fails_clearly():
    config = tiny_llm(build_gen_expert=True, gen_token_capacity=2)
    lm = Qwen2MoT(config, rngs=nnx.Rngs(7))
    n = 8
    seg, k_start, k_end, pos = (x[None] for x in causal_ranges([n], n))
    gen_mask = np.zeros((1, n), bool)
    gen_mask[0, 3:6] = True
    with pytest.raises(Exception, match="gen_token_capacity=2"):
        _fresh_logits(lm, np.ones((1, n), np.int32), pos, seg, k_start, k_end, gen_mask)


def _bagel_dot_flops(config, pack) -> float:
    from models.bagel import Bagel
    from opsd_jax.programs import hlo_stats

    graphdef, state = nnx.split(Bagel(config, rngs=nnx.Rngs(0)))

    def hidden(state, pack):
        return nnx.merge(graphdef, state)(pack)

    compiled = jax.jit(hidden).lower(state, pack).compile()
    return hlo_stats.dot_flops(compiled.as_text())[0]


def test_a_gen_expert_model_on_a_pack_without_gen_tokens_does_an_und_only_models_work():
    """The packer's understanding pack (text and an image) marks no gen token; the compiled
    forward of a model built with the gen expert has exactly the und-only model's matmuls."""
    from models.bagel import BagelConfig as Config
    from opsd_jax.data.image_transform import patchify, vit_position_ids
    from opsd_jax.data.packing import Image, SpecialTokens, Text, pack_samples

    rng = np.random.default_rng(8)
    special = SpecialTokens(1020, 1021, 1022, 1023)
    image = Image(
        patchify(rng.uniform(-1, 1, (56, 56, 3)).astype(np.float32)), vit_position_ids(4, 4)
    )
    sample = [Text([5, 6, 7]), image, Text(list(range(10, 30)), loss=True)]
    pack = pack_samples([sample, sample], 64, special=special)
    pack = jax.tree.map(jnp.asarray, pack)
    und_config = Config.tiny(llm=dict(compute_dtype="float32"))
    gen_config = und_config.replace(llm=dict(build_gen_expert=True))
    und_flops = _bagel_dot_flops(und_config, pack)
    assert und_flops > 0
    assert _bagel_dot_flops(gen_config, pack) == und_flops
    # The same pack with gen tokens marked does run the gen expert (the count sees it):
    # on every row position with the default capacity, on 8 slots per row with capacity 8.
    marked = pack.replace(gen_mask=jnp.zeros(pack.tokens.shape, bool).at[:, 40:44].set(True))
    whole_row = _bagel_dot_flops(gen_config, marked)
    eight = _bagel_dot_flops(gen_config.replace(llm=dict(gen_token_capacity=8)), marked)
    assert und_flops < eight < whole_row


@pytest.mark.parametrize("shards", [1, 2])
def test_fused_projections_compute_what_the_separate_ones_do(shards):
    """fuse_projections (the decode copy's layout: q/k/v and gate/up each one projection, in
    `shards` groups) gives the same logits as the separate projections, with nonzero q/k/v
    biases, and leaves no separate projection behind."""
    from models.qwen2_mot import Expert, fuse_projections

    config = tiny_llm(build_gen_expert=True)
    lm = Qwen2MoT(config, rngs=nnx.Rngs(5))
    rng = np.random.default_rng(5)
    experts = [m for _, m in nnx.iter_modules(lm) if isinstance(m, Expert)]
    assert len(experts) == 2  # und and gen
    for expert in experts:
        for projection in (expert.q_proj, expert.k_proj, expert.v_proj):
            projection.bias[...] = rng.normal(size=projection.bias.shape).astype(np.float32)
    n = 14
    tokens = rng.integers(0, config.vocab_size, (2, n)).astype(np.int32)
    seg, k_start, k_end, pos = causal_ranges([5, 9], n)
    tile = lambda x: np.tile(x, (2, 1))  # noqa: E731
    gen = tile(np.arange(n) >= 10)
    args = (tokens, tile(pos), tile(seg), tile(k_start), tile(k_end), gen)
    separate = forward(lm, *args)
    assert fuse_projections(lm, shards) == shards
    for expert in experts:
        assert expert.fused_shards == shards and not hasattr(expert, "q_proj")
        assert expert.qkv_proj.kernel.shape[2] == shards
    np.testing.assert_allclose(forward(lm, *args), separate, atol=1e-5, rtol=0)
