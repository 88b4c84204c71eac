"""The batched KV-cache sampler: exactness against full forwards, independence, EOS/budget, skips."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.bagel import Bagel
from models.configs import BagelConfig
from opsd_jax.data.image_transform import patchify, vit_position_ids
from opsd_jax.data.packing import Image, SpecialTokens, Text, pack_samples
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.sampling import sampler
from opsd_jax.training import losses

SPECIAL = SpecialTokens(im_start=1000, im_end=1001, vision_start=1002, vision_end=1003)
VOCAB_LIMIT = 1004  # ids 1004..1023 are padding rows of the tiny embedding table


@pytest.fixture(scope="module")
def model():
    return Bagel(BagelConfig.tiny(llm=dict(compute_dtype="float32")), rngs=nnx.Rngs(0))


def prompts(seed=0):
    rng = np.random.default_rng(seed)

    def image(h, w):
        pixels = rng.uniform(-1, 1, (14 * h, 14 * w, 3)).astype(np.float32)
        return Image(patchify(pixels), vit_position_ids(h, w))

    return [
        [image(2, 2), Text([5, 6, 7])],
        [Text([8, 9])],
        [image(1, 3), Text([10, 11, 12, 13, 14]), Text([15])],
    ]


def prompt_pack(samples, row_length=24):
    return pack_samples(samples, row_length=row_length, special=SPECIAL, one_sample_per_row=True)


@functools.partial(jax.jit, static_argnums=0)
def _logits_at(graphdef, state, pack, row):
    model = nnx.merge(graphdef, state)
    return model.logits_at(model(pack), row)


def full_forward_logits(model, prompt, completion):
    """Next-token logits after `<|im_start|> completion` from a full packed forward (no cache)."""
    pack = pack_samples([prompt + [Text(completion)]], row_length=48, special=SPECIAL)
    length = int((pack.segment_ids[0] > 0).sum())
    # The last real token is the closing <|im_end|>; the one before it is the newest input.
    row = jnp.asarray([[length - 2]])
    logits = np.array(_logits_at(*nnx.split(model), pack, row)[0, 0], np.float64)
    logits[VOCAB_LIMIT:] = -np.inf
    return logits


def test_greedy_decode_equals_argmax_of_full_forward(model):
    samples = prompts()
    out = sampler.sample(
        model,
        prompt_pack(samples),
        jax.random.key(0),
        special=SPECIAL,
        vocab_limit=VOCAB_LIMIT,
        max_new_tokens=6,
        do_sample=False,
        cache_dtype="float32",
    )
    for b, prompt in enumerate(samples):
        completion = []
        for _ in range(6):
            token = int(np.argmax(full_forward_logits(model, prompt, completion)))
            if token == SPECIAL.im_end:
                break
            completion.append(token)
        assert out.row(b) == completion
        assert out.lengths[b] == 6 and not out.finished[b]


def test_logprobs_match_the_forward_and_seeds_reproduce(model):
    samples = prompts(1)
    kwargs = dict(
        special=SPECIAL,
        vocab_limit=VOCAB_LIMIT,
        max_new_tokens=5,
        temperature=0.7,
        cache_dtype="float32",
    )
    out = sampler.sample(model, prompt_pack(samples), jax.random.key(3), **kwargs)
    for b, prompt in enumerate(samples):
        tokens = out.row(b)
        assert all(t < VOCAB_LIMIT for t in tokens)
        for i, token in enumerate(tokens):
            logits = full_forward_logits(model, prompt, tokens[:i]) / 0.7
            expected = logits[token] - np.logaddexp.reduce(logits[np.isfinite(logits)])
            np.testing.assert_allclose(out.logprobs[b, i], expected, atol=2e-4)
    again = sampler.sample(model, prompt_pack(samples), jax.random.key(3), **kwargs)
    np.testing.assert_array_equal(again.tokens, out.tokens)
    other = sampler.sample(model, prompt_pack(samples), jax.random.key(4), **kwargs)
    assert not np.array_equal(other.tokens, out.tokens)


def test_sampler_and_losses_share_one_vocab_limit(model):
    """The log-prob the sampler records for a token is the one the losses compute from the same
    logits with the same vocab_limit (losses.mask_vocab on both sides): padded rows are no token
    for either. Without the limit the loss's softmax would also spread over ids 1004..1023."""
    samples = prompts(2)[:1]
    # The sampling settings of the test above: its compiled decode is reused.
    out = sampler.sample(
        model,
        prompt_pack(samples),
        jax.random.key(5),
        special=SPECIAL,
        vocab_limit=VOCAB_LIMIT,
        max_new_tokens=5,
        temperature=0.7,
        cache_dtype="float32",
    )
    tokens = out.row(0)
    pack = pack_samples([samples[0] + [Text(tokens)]], row_length=48, special=SPECIAL)
    length = int((pack.segment_ids[0] > 0).sum())
    # Rows predicting each completion token: the one before it (<|im_start|> for the first).
    rows = jnp.arange(length - 2 - len(tokens), length - 2)[None]
    logits = _logits_at(*nnx.split(model), pack, rows)
    ids, mask = jnp.asarray([tokens]), jnp.ones((1, len(tokens)), bool)
    shared = losses.token_logprobs(logits, ids, mask, temperature=0.7, vocab_limit=VOCAB_LIMIT)
    np.testing.assert_allclose(shared[0], out.logprobs[0, : len(tokens)], atol=2e-4)
    whole = losses.token_logprobs(logits, ids, mask, temperature=0.7)
    assert np.abs(np.asarray(whole[0]) - out.logprobs[0, : len(tokens)]).max() > 1e-3


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_row_decodes_the_same_alone_or_in_a_batch(model, do_sample):
    samples = prompts(2)
    kwargs = dict(
        special=SPECIAL,
        vocab_limit=VOCAB_LIMIT,
        max_new_tokens=5,
        do_sample=do_sample,
        cache_dtype="float32",
    )
    batch = sampler.sample(model, prompt_pack(samples), jax.random.key(5), **kwargs)
    for b in range(len(samples)):
        alone = sampler.sample(
            model, prompt_pack([samples[b]]), jax.random.key(5), row_ids=np.array([b]), **kwargs
        )
        assert alone.row(0) == batch.row(b)
        np.testing.assert_allclose(
            alone.logprobs[0, : alone.lengths[0]], batch.logprobs[b, : batch.lengths[b]], atol=1e-5
        )


def test_sampling_on_an_fsdp_mesh_matches_one_device(model):
    mesh = mesh_lib.make_mesh(num_replicate=2)
    graphdef, state = nnx.split(model)
    abstract = mesh_lib.abstract_model(lambda: Bagel(model.config, rngs=nnx.Rngs(0)), mesh)[1]
    shardings = jax.tree.map(lambda x: x.sharding, abstract)
    sharded = nnx.merge(graphdef, jax.device_put(state, shardings))
    assert len(sharded.language_model.embed_tokens[...].sharding.device_set) == 8
    samples = prompts(3) + prompts(4) + prompts(5)[:2]  # 8 rows: one per device
    kwargs = dict(
        special=SPECIAL,
        vocab_limit=VOCAB_LIMIT,
        max_new_tokens=4,
        do_sample=False,
        cache_dtype="float32",
    )
    with jax.set_mesh(mesh):
        pack = jax.tree.map(
            lambda x: jax.device_put(x, mesh_lib.batch_sharding(mesh, x.ndim)),
            prompt_pack(samples),
        )
        out = sampler.sample(sharded, pack, jax.random.key(0), **kwargs)
    ref = sampler.sample(model, prompt_pack(samples), jax.random.key(0), **kwargs)
    np.testing.assert_array_equal(out.tokens, ref.tokens)


# ---- scripted model: exact control over EOS, budget and image-skip rounds --------------------

SKIP_ID = 50  # decodes to the plain text "<image_start>"


def decode_text(ids):
    return "".join("<image_start>" if i == SKIP_ID else f"[{i}]" for i in ids)


class ScriptedModel(nnx.Module):
    """Emits script[r][k] as its k-th new token, where r is the row's (single) prompt text id.

    It reads its state from the sampler's own KV cache (the "values" are the fed token ids), so
    it also checks that rows see only their own slots and that appended tokens are written.
    The prompt is `<|im_start|> r ... <|im_end|>` (any tokens may follow r); k counts the
    cached tokens after the prompt's `<|im_end|>` other than `<|im_start|>`: the completion so
    far plus each skip's appended `<|im_end|>` (which stands for the EOS that ended the round,
    so the script continues past it).
    """

    def __init__(self, scripts: list[list[int]], vocab: int = 1024):
        table = np.full((len(scripts), 16), SPECIAL.im_end, np.int32)
        for r, script in enumerate(scripts):
            table[r, : len(script)] = script
        self.table = nnx.Variable(jnp.asarray(table))
        self.vocab = vocab

    def prefill(self, pack):
        b, t = pack.tokens.shape
        kv = jnp.broadcast_to(pack.tokens[None, :, :, None, None], (1, b, t, 1, 1))
        return None, (kv.astype(jnp.float32), kv.astype(jnp.float32))

    def decode_step(self, tokens, positions, cache, write_slots, kv_lengths):
        rows = jnp.arange(tokens.shape[0])
        fed = tokens.astype(jnp.float32)[:, None, None, None]  # as key and value
        cache = cache.at[0, rows, write_slots].set(fed, mode="drop")  # [1, B, S, 2, 1, 1]
        ids = cache[0, :, :, 1, 0, 0].astype(jnp.int32)  # [B, S], the values
        slots = jnp.arange(ids.shape[1])[None]
        prompt_end = jnp.argmax(ids == SPECIAL.im_end, axis=1)[:, None]  # the prompt's own
        counted = (slots > prompt_end) & (slots < kv_lengths[:, None])
        position = jnp.sum(counted & (ids != SPECIAL.im_start), axis=1)
        next_token = self.table[...][ids[:, 1], position]
        return jax.nn.one_hot(next_token, self.vocab) * 30.0, cache


def scripted_pack(num_rows):
    return pack_samples(
        [[Text([r])] for r in range(num_rows)],
        row_length=4,
        special=SPECIAL,
        one_sample_per_row=True,
    )


def scripted_settings(max_new_tokens, max_image_skips):
    """The sampling settings the scripted model is run with (greedy, float32 cache)."""
    return dict(
        special=SPECIAL,
        vocab_limit=VOCAB_LIMIT,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        max_image_skips=max_image_skips,
        decode_text=decode_text,
        cache_dtype="float32",
    )


def run_scripted(scripts, max_new_tokens, max_image_skips):
    return sampler.sample(
        ScriptedModel(scripts),
        scripted_pack(len(scripts)),
        jax.random.key(0),
        **scripted_settings(max_new_tokens, max_image_skips),
    )


def test_eos_stops_a_row_and_the_budget_stops_the_rest():
    out = run_scripted([[7, 8, SPECIAL.im_end], [9] * 12], max_new_tokens=5, max_image_skips=0)
    assert out.row(0) == [7, 8] and out.finished[0]  # EOS not appended
    assert out.row(1) == [9] * 5 and not out.finished[1]
    np.testing.assert_array_equal(out.rounds, [1, 1])


def test_image_skip_rounds():
    eos = SPECIAL.im_end
    scripts = [
        [7, SKIP_ID, eos, 11, 12, eos],  # skip: <image_start> then EOS -> a second round
        [7, 8, eos],  # no <image_start>: no skip
        [SKIP_ID, eos, 13, 13, 13, 13, 13, 13],  # skip, then the budget runs out mid-round
        [7, SKIP_ID, eos, SKIP_ID, eos, 14, eos],  # a second skip exceeds max_image_skips=1
    ]
    out = run_scripted(scripts, max_new_tokens=6, max_image_skips=1)
    # Rounds concatenate without the later <|im_start|>; the appended <|im_end|> costs budget.
    assert out.row(0) == [7, SKIP_ID, 11, 12] and out.finished[0] and out.rounds[0] == 2
    assert out.row(1) == [7, 8] and out.finished[1] and out.rounds[1] == 1
    assert out.row(2) == [SKIP_ID, 13, 13, 13, 13] and not out.finished[2] and out.rounds[2] == 2
    assert out.row(3) == [7, SKIP_ID, SKIP_ID] and out.finished[3] and out.rounds[3] == 2
    no_skips = run_scripted(scripts[:1], max_new_tokens=6, max_image_skips=0)
    assert no_skips.row(0) == [7, SKIP_ID] and no_skips.rounds[0] == 1


def test_bad_arguments_are_refused(model):
    pack = prompt_pack(prompts())
    common = dict(special=SPECIAL, vocab_limit=VOCAB_LIMIT)
    with pytest.raises(ValueError, match="decode_text"):
        sampler.sample(
            model, pack, jax.random.key(0), max_new_tokens=4, max_image_skips=1, **common
        )
    with pytest.raises(ValueError, match="max_new_tokens"):
        sampler.sample(model, pack, jax.random.key(0), max_new_tokens=0, **common)
    two_per_row = pack_samples(prompts()[1:], row_length=32, special=SPECIAL)
    with pytest.raises(ValueError, match="exactly one prompt"):
        sampler.sample(model, two_per_row, jax.random.key(0), max_new_tokens=4, **common)


def test_sample_rows_draws_from_the_softmax_and_never_a_masked_entry():
    log_probs = jax.nn.log_softmax(jnp.asarray([[2.0, -jnp.inf, 1.0, 0.0, -jnp.inf, -1.0]]), -1)
    draws = jax.vmap(lambda k: sampler.sample_rows(k[None], log_probs)[0])(
        jax.random.split(jax.random.key(0), 40000)
    )
    counts = np.bincount(np.asarray(draws), minlength=6) / 40000
    expected = np.exp(np.asarray(log_probs[0]))
    assert counts[1] == 0 and counts[4] == 0
    # 40k draws: the standard error of each frequency is <= 0.0025; allow 4 of them.
    np.testing.assert_allclose(counts, expected, atol=0.01)
