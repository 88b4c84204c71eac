"""The rollout's mismatch with the policy the step trains (train_step.rollout_mismatch).

The sampler records the log-prob of every token it draws; the train step recomputes the
student's log-prob of the same token in its own forward (another program: packed rows instead
of a KV cache). In float32 on the toy model the two agree to float rounding; a decode copy that
differs from the trained weights (here: perturbed by 1%) shows as a gap orders of magnitude
larger, which is what the metric is for (a wrong decode kernel, a stale or badly merged copy).
"""

import builders
import jax
import numpy as np
import pytest
from flax import nnx
from test_opsd_packs import SPECIAL, encode
from test_train_step import OPTIONS, SAMPLES

from models.bagel import Bagel
from models.configs import BagelConfig
from opsd_jax.data.opsd_packs import (
    build_training_packs,
    prompt_items,
    prompt_pack_of,
    sampled_logprobs,
)
from opsd_jax.sampling import sampler
from opsd_jax.training import train_step

TEMPERATURE = 0.7
# The float32 bound the issue asks for; the toy model measures ~3e-6 at most (train.py's log).
FLOAT32_GAP = 1e-4


@pytest.fixture(scope="module")
def toy():
    model = Bagel(
        BagelConfig.tiny(llm=dict(compute_dtype="float32", remat="none")), rngs=nnx.Rngs(0)
    )
    return nnx.split(model, nnx.Param, ...)


def rollout(graphdef, params, rest, seed=0):
    """Completions of the 4 samples from the model with `params`, and their drawn log-probs."""
    prompts = prompt_pack_of([prompt_items(s, encode, OPTIONS) for s in SAMPLES], SPECIAL)
    out = sampler.sample(
        nnx.merge(graphdef, params, rest),
        prompts,
        jax.random.key(seed),
        special=SPECIAL,
        vocab_limit=1024,
        max_new_tokens=12,
        temperature=TEMPERATURE,
        cache_dtype="float32",
    )
    drawn = [out.logprobs[b, : out.lengths[b]] for b in range(len(SAMPLES))]
    return out.rows(), drawn


def mismatch(toy, completions, drawn):
    graphdef, params, rest = toy
    packs = build_training_packs(
        SAMPLES, completions, encode, OPTIONS, SPECIAL, num_rows=2, max_forward_tokens=256
    )
    sampled = sampled_logprobs(packs, drawn)
    # Every completion token has its draw at its entry; the closing <|im_end|> has none.
    assert np.isfinite(sampled).sum() == sum(len(c) for c in packs.completions) > 0
    assert not np.isfinite(sampled[~packs.student.loss_mask]).any()
    settings = builders.loss_settings(num_samples=len(SAMPLES), sample_temperature=TEMPERATURE)
    loss_fn = train_step.make_opsd_loss(graphdef, rest, settings, "self")
    _, metrics = jax.jit(loss_fn)(params, None, (packs.student, packs.teacher, sampled))
    return {k: float(v) for k, v in metrics.items() if k.startswith("rollout/")}


def test_the_rollout_and_the_trained_policy_agree_in_float32(toy):
    got = mismatch(toy, *rollout(*toy))
    assert got["rollout/logprob_gap_max"] <= FLOAT32_GAP, got
    assert 0 <= got["rollout/logprob_gap_mean"] <= got["rollout/logprob_gap_max"]
    assert 0 <= got["rollout/mismatch_kl"] < 1e-8, got


def test_a_perturbed_decode_copy_shows_as_a_gap(toy):
    graphdef, params, rest = toy
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    perturbed = jax.tree.unflatten(
        tree, [x * (1 + 0.01 * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys)]
    )
    got = mismatch(toy, *rollout(graphdef, perturbed, rest))
    assert got["rollout/logprob_gap_max"] > 100 * FLOAT32_GAP, got
    assert got["rollout/mismatch_kl"] > 0


def test_the_wrong_temperature_shows_as_a_gap(toy):
    """The step must compare under the rollout's own temperature (sample_temperature)."""
    graphdef, params, rest = toy
    completions, drawn = rollout(*toy)
    packs = build_training_packs(
        SAMPLES, completions, encode, OPTIONS, SPECIAL, num_rows=2, max_forward_tokens=256
    )
    settings = builders.loss_settings(num_samples=len(SAMPLES), sample_temperature=1.0)
    loss_fn = train_step.make_opsd_loss(graphdef, rest, settings, "self")
    _, metrics = loss_fn(
        params, None, (packs.student, packs.teacher, sampled_logprobs(packs, drawn))
    )
    assert float(metrics["rollout/logprob_gap_max"]) > 100 * FLOAT32_GAP


def test_entries_follow_a_cut_completion():
    """A completion cut to fit max_forward_tokens keeps the draws of the tokens it keeps."""
    completions = [list(range(10, 10 + n)) for n in (3, 40, 5, 2)]
    drawn = [-np.arange(1, len(c) + 1, dtype=np.float32) / 10 for c in completions]
    packs = build_training_packs(
        SAMPLES, completions, encode, OPTIONS, SPECIAL, num_rows=2, max_forward_tokens=50
    )
    sampled = sampled_logprobs(packs, drawn)
    student = packs.student
    for k, (index, kept) in enumerate(zip(packs.kept, packs.completions)):
        rows, cols = np.nonzero((student.loss_sample == k) & student.loss_mask)
        np.testing.assert_array_equal(student.loss_targets[rows, cols][: len(kept)], kept)
        np.testing.assert_array_equal(sampled[rows, cols][: len(kept)], drawn[index][: len(kept)])
        assert np.isnan(sampled[rows[-1], cols[-1]])  # the closing <|im_end|>
    assert packs.num_truncated >= 1  # the 40-token completion was cut
    assert np.isnan(sampled_logprobs(packs, None)).all()
