"""Tests for opsd_jax.training.losses: the generalized JSD, the sampled-token (tinker) loss and the CE.

Values are checked against float64 numpy references written from the definitions in
docs/opsd_loss.md (section a) and from the documented formula of TRL's
`generalized_jsd_loss`, re-derived here rather than imported. Gradients are checked by finite
differences (jax.test_util.check_grads, float64) and, for the tinker loss, by Monte-Carlo
against the exact gradient of KL(p || q).

Compilation dominates the run time on CPU, so most tests share one input shape (SHAPE) and the
same static hyper-parameters, and read per-entry values from the diagnostics rather than
switching reductions: the jit cache then serves several tests from one compile.
"""

import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close_to_scale
from jax.test_util import check_grads

from opsd_jax.training import losses

SHAPE = (2, 5, 9)  # [rows, entries per row, vocabulary]

# Jitted entry points with the hyper-parameters static, as the trainer will call them.
HYPER_PARAMETERS = (
    "beta",
    "temperature",
    "top_k",
    "clip",
    "clip_mode",
    "reduction",
    "num_samples",
    "chunk_rows",
    "kl_coef",
    "advantage_clip",
    "sample_temperature",
)


def jit_with_static_hyper_parameters(fn):
    names = [n for n in HYPER_PARAMETERS if n in inspect.signature(fn).parameters]
    return jax.jit(fn, static_argnames=names)


JSD = jit_with_static_hyper_parameters(losses.generalized_jsd)
TINKER = jit_with_static_hyper_parameters(losses.tinker_loss)
CE = jit_with_static_hyper_parameters(losses.completion_ce)


def assert_nats_close(actual, expected, rel=1e-5):
    """A loss value (nats) against a float64 reference or another code path of the loss.

    Every value is a sum or difference of log-probabilities of about 1 nat or more, and fp32
    round-off follows those terms, not the result, which can be near 0 (the KL of nearly equal
    distributions, a mean log-ratio, a small entry of a per-token table). So the tolerance is
    absolute: rel x the larger of the reference's largest |value| and 1 nat."""
    expected = np.asarray(expected, np.float64)
    assert_close_to_scale(actual, expected, rel, scale=max(float(np.abs(expected).max()), 1.0))


# ----------------------------------------------------------------------------------------------
# numpy references
# ----------------------------------------------------------------------------------------------


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    top = np.max(x, axis=-1, keepdims=True)
    return x - top - np.log(np.sum(np.exp(x - top), axis=-1, keepdims=True))


def np_support(zs, zt, top_k):
    """Both logit arrays restricted to the teacher's top-k ids (all ids when k <= 0 or >= V)."""
    zs, zt = np.asarray(zs, np.float64), np.asarray(zt, np.float64)
    if 0 < top_k < zs.shape[-1]:
        ids = np.argsort(-zt, axis=-1, kind="stable")[..., :top_k]
        return np.take_along_axis(zs, ids, -1), np.take_along_axis(zt, ids, -1)
    return zs, zt


def np_entries(zs, zt, beta, temperature=1.0, top_k=0):
    """Per-entry generalized JSD contributions, [..., K], from probabilities (no log-space)."""
    zs, zt = np_support(zs, zt, top_k)
    log_p, log_q = np_log_softmax(zs / temperature), np_log_softmax(zt / temperature)
    p, q = np.exp(log_p), np.exp(log_q)
    if beta == 0:
        return q * (log_q - log_p)
    if beta == 1:
        return p * (log_p - log_q)
    log_m = np.log(beta * q + (1 - beta) * p)
    return beta * q * (log_q - log_m) + (1 - beta) * p * (log_p - log_m)


def np_forward_kl(zs, zt):
    log_p, log_q = np_log_softmax(zs), np_log_softmax(zt)
    return np.sum(np.exp(log_q) * (log_q - log_p), axis=-1)


def np_reverse_kl(zs, zt):
    log_p, log_q = np_log_softmax(zs), np_log_softmax(zt)
    return np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)


def np_trl_generalized_jsd(student_logits, teacher_logits, labels, beta, temperature):
    """TRL's documented `generalized_jsd_loss` (reduction 'batchmean', labels -100 = ignored).

    Built from torch's kl_div(input, target, log_target=True) = exp(target) * (target - input):
    beta 0 -> kl_div(student, teacher); beta 1 -> kl_div(teacher, student); otherwise a mixture
    log-prob logsumexp(student + log(1 - beta), teacher + log beta) and
    beta * kl_div(mixture, teacher) + (1 - beta) * kl_div(mixture, student). Sum over the vocab
    and the kept positions, divided by the number of kept positions. No temperature**2 factor.
    """

    def kl_div(inp, target):
        return np.exp(target) * (target - inp)

    student = np_log_softmax(np.asarray(student_logits) / temperature)
    teacher = np_log_softmax(np.asarray(teacher_logits) / temperature)
    if beta == 0:
        jsd = kl_div(student, teacher)
    elif beta == 1:
        jsd = kl_div(teacher, student)
    else:
        mixture = np.logaddexp(student + np.log(1 - beta), teacher + np.log(beta))
        jsd = beta * kl_div(mixture, teacher) + (1 - beta) * kl_div(mixture, student)
    keep = labels != -100
    return jsd[keep].sum() / keep.sum()


def np_token_logprobs(z, ids, temperature=1.0):
    log_p = np_log_softmax(np.asarray(z, np.float64) / temperature)
    return np.take_along_axis(log_p, np.asarray(ids)[..., None], -1)[..., 0]


def pair(seed, shape=SHAPE, scale=2.0):
    """Random student and teacher logits (float32)."""
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=shape) * scale, jnp.float32) for _ in range(2))


def jsd(zs, zt, mask=None, **kwargs):
    """Jitted generalized_jsd with clip off unless asked and every entry valid unless given."""
    kwargs.setdefault("clip", 0.0)
    mask = jnp.ones(zs.shape[:-1], bool) if mask is None else mask
    return JSD(zs, zt, mask, **kwargs)


# ----------------------------------------------------------------------------------------------
# generalized JSD: values
# ----------------------------------------------------------------------------------------------


# (beta, top_k) settings evaluated together in one compiled function, shared by several tests.
TABLE_SETTINGS = tuple((b, k) for b in (0.0, 1e-3, 0.1, 0.5, 0.9, 1.0) for k in (4, 0))


@jax.jit
def per_token_table(zs, zt):
    """{(beta, top_k): per-entry values} without clip, every entry valid."""
    mask = jnp.ones(zs.shape[:-1], bool)
    return {
        (beta, top_k): losses.generalized_jsd(zs, zt, mask, beta, top_k=top_k, clip=0.0)[1][
            "per_token"
        ]
        for beta, top_k in TABLE_SETTINGS
    }


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("top_k", [4, 0])
def test_zero_when_logits_equal(beta, top_k):
    z, _ = pair(0)
    np.testing.assert_allclose(per_token_table(z, z)[beta, top_k], 0.0, atol=1e-6)


@pytest.mark.parametrize("beta, top_k", [(0.1, 0), (0.5, 0), (0.9, 0), (0.1, 4), (0.5, 4)])
def test_interior_beta_bounded_by_binary_entropy(beta, top_k):
    # Large logits make p and q nearly disjoint, pushing the value close to its upper bound.
    zs, zt = pair(1, scale=8.0)
    per_token = np.asarray(per_token_table(zs, zt)[beta, top_k])
    bound = -beta * math.log(beta) - (1 - beta) * math.log(1 - beta)
    assert bound <= math.log(2) + 1e-12
    assert per_token.min() >= -1e-6
    assert per_token.max() <= bound + 1e-5
    assert per_token.max() > 0.5 * bound  # the check is not vacuous
    expected = np_entries(zs, zt, beta, top_k=top_k).sum(-1)
    np.testing.assert_allclose(per_token, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("top_k", [4, 0])
def test_endpoints_equal_independent_kl(top_k):
    zs, zt = pair(2)
    support_s, support_t = np_support(zs, zt, top_k)
    table = per_token_table(zs, zt)
    assert_nats_close(table[0.0, top_k], np_forward_kl(support_s, support_t))
    assert_nats_close(table[1.0, top_k], np_reverse_kl(support_s, support_t))


def test_endpoint_is_not_the_limit_of_the_interior_formula():
    # The exact-0 special case is forward KL, while beta -> 0 in the interior formula tends to 0
    # (about beta * KL); a float-equality switch, as in every reference implementation.
    zs, zt = pair(3)
    table = per_token_table(zs, zt)
    forward, near_zero = np.asarray(table[0.0, 0]), np.asarray(table[1e-3, 0])
    assert (near_zero > 0).all() and (near_zero < 0.01 * forward).all()


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("top_k", [4, 0])
def test_swap_symmetry(beta, top_k):
    zs, zt = pair(4)
    if top_k:
        # Both roles must see the same support: make student and teacher rank ids alike.
        zs = zt + 0.5 * pair(40)[0]
        zs, zt = jnp.sort(zs, axis=-1), jnp.sort(zt, axis=-1)
    direct = per_token_table(zs, zt)[beta, top_k]
    swapped = per_token_table(zt, zs)[round(1.0 - beta, 6), top_k]
    assert_nats_close(direct, swapped)


@jax.jit
def trl_case_losses(zs, zt, mask):
    """{(beta, temperature): token_mean loss over the full vocabulary, no clip}."""
    return {
        (beta, tau): losses.generalized_jsd(
            zs, zt, mask, beta, tau, top_k=0, clip=0.0, reduction="token_mean"
        )[0]
        for beta, tau in TRL_CASES
    }


TRL_CASES = ((0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (0.5, 2.0))


@pytest.mark.parametrize("beta, temperature", TRL_CASES)
def test_matches_trl_generalized_jsd_semantics(beta, temperature):
    zs, zt = pair(5)
    mask = np.ones(SHAPE[:2], bool)
    mask[0, 3:] = mask[1, 4:] = False
    labels = np.where(mask, 1, -100)
    loss = trl_case_losses(zs, zt, jnp.asarray(mask))[beta, temperature]
    expected = np_trl_generalized_jsd(zs, zt, labels, beta, temperature)
    # TRL has no temperature**2 factor; the PyTorch OPSD trainer (and this module) does.
    assert_nats_close(loss, expected * temperature**2)


def test_top_k_at_least_vocab_equals_full_vocabulary():
    zs, zt = pair(6)
    full, _ = jsd(zs, zt, top_k=0)
    for top_k in (SHAPE[-1], -1):
        assert_nats_close(jsd(zs, zt, top_k=top_k)[0], full, rel=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_top_k_path_matches_full_vocabulary_when_dropped_mass_is_negligible(beta):
    # Exercise the gather path against the chunked full-vocabulary path: the one dropped id has
    # probability ~exp(-1e4) under both distributions.
    zs, zt = (np.array(z) for z in pair(7))
    zs[..., 5] = zt[..., 5] = -1e4
    zs, zt = jnp.asarray(zs), jnp.asarray(zt)
    top, _ = jsd(zs, zt, beta=beta, top_k=SHAPE[-1] - 1)
    full, _ = jsd(zs, zt, beta=beta, top_k=0)
    assert_nats_close(top, full)


def test_top_k_renormalises_both_sides_on_teacher_ids():
    zs, zt = pair(8)
    _, diag = jsd(zs, zt, beta=0.5, top_k=4, temperature=1.5)
    expected = np_entries(zs, zt, 0.5, temperature=1.5, top_k=4).sum(-1) * 1.5**2
    assert_nats_close(diag["per_token"], expected)


def test_bf16_inputs_select_on_bf16_and_compute_in_fp32():
    zs, zt = (z.astype(jnp.bfloat16) for z in pair(9, shape=(2, 4, 32)))
    loss, diag = jsd(zs, zt, top_k=6)
    assert loss.dtype == jnp.float32
    expected = np_entries(np.asarray(zs, np.float64), np.asarray(zt, np.float64), 0.5, top_k=6)
    np.testing.assert_allclose(diag["per_token"], expected.sum(-1), rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# clip
# ----------------------------------------------------------------------------------------------


# Settings that must all behave as "no clip": infinite and non-positive caps, a huge finite cap.
NO_CLIP_SETTINGS = (
    (4, math.inf, "entry"),
    (4, 1e9, "token"),
    (0, math.inf, "token"),
    (0, 1e9, "entry"),
    (0, -1.0, "entry"),
    (4, 0.0, "entry"),
    (0, 0.0, "entry"),
)


@jax.jit
def no_clip_table(zs, zt):
    """{(top_k, clip, clip_mode): (loss, clip_fraction)}."""
    mask = jnp.ones(zs.shape[:-1], bool)
    table = {}
    for top_k, clip, clip_mode in NO_CLIP_SETTINGS:
        loss, diag = losses.generalized_jsd(
            zs, zt, mask, top_k=top_k, clip=clip, clip_mode=clip_mode
        )
        table[top_k, clip, clip_mode] = (loss, diag["clip_fraction"])
    return table


@pytest.mark.parametrize("top_k, clip, clip_mode", NO_CLIP_SETTINGS[:5])
def test_infinite_or_nonpositive_clip_equals_no_clip(top_k, clip, clip_mode):
    table = no_clip_table(*pair(10))
    value, clip_fraction = table[top_k, clip, clip_mode]
    assert_nats_close(value, table[top_k, 0.0, "entry"][0], rel=1e-6)
    assert float(clip_fraction) == 0.0


def reference_entries(z, zt, beta, top_k):
    """Independent jax version of the per-entry terms (probability space), differentiable."""
    if 0 < top_k:
        ids = jnp.argsort(-zt, axis=-1)[..., :top_k]
        z, zt = jnp.take_along_axis(z, ids, -1), jnp.take_along_axis(zt, ids, -1)
    a, b = jax.nn.log_softmax(z), jax.nn.log_softmax(zt)
    p, q = jnp.exp(a), jnp.exp(b)
    if beta == 0:
        return q * (b - a)
    m = jnp.log(beta * q + (1 - beta) * p)
    return beta * q * (b - m) + (1 - beta) * p * (a - m)


@pytest.mark.parametrize("beta, top_k", [(0.0, 4), (0.5, 0)])
def test_entry_clip_caps_values_and_zeroes_gradient_exactly_on_capped_entries(beta, top_k):
    zs, zt = pair(11)
    cap = 0.02
    entries = np_entries(zs, zt, beta, top_k=top_k)
    capped = entries > cap
    assert capped.any() and (~capped).any()

    def loss(z):
        return jsd(z, zt, beta=beta, top_k=top_k, clip=cap, reduction="token_sum")

    (value, diag), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(zs)
    assert_nats_close(value, np.where(capped, cap, entries).sum())
    np.testing.assert_allclose(diag["clip_fraction"], capped.mean(), rtol=1e-6)

    # Reference: the unclipped per-entry terms with the capped ones dropped by a constant mask.
    def reference(z):
        return jnp.sum(jnp.where(capped, 0.0, reference_entries(z, zt, beta, top_k)))

    np.testing.assert_allclose(grad, jax.jit(jax.grad(reference))(zs), atol=1e-6)


def test_entry_clip_leaves_negative_entries_so_the_loss_can_be_negative():
    zs, zt = pair(12, scale=4.0)

    # Forward KL with a tiny cap: positive entries are frozen at the cap, the negative ones (ids
    # where the student over-predicts) remain, so the loss is negative, as OPSD's README notes,
    # and the gradient comes from those negative entries only.
    def loss(z):
        return jsd(z, zt, beta=0.0, top_k=0, clip=1e-7)

    (value, diag), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(zs)
    entries = np_entries(zs, zt, 0.0)
    expected = np.where(entries > 1e-7, 1e-7, entries).sum(-1).mean()
    assert_nats_close(value, expected)
    assert float(value) < 0 and float(diag["negative_fraction"]) == 1.0
    assert np.abs(np.asarray(grad)).max() > 0


def test_token_clip_caps_per_token_sum():
    zs, zt = pair(13)
    rows = np_entries(zs, zt, 0.5).sum(-1)
    cap = float(np.round(np.median(rows), 3))
    over = rows > cap
    assert over.any() and (~over).any()

    def loss(z):
        return jsd(z, zt, top_k=0, clip=cap, clip_mode="token", reduction="token_sum")

    (value, diag), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(zs)
    assert_nats_close(value, np.where(over, cap, rows).sum())
    np.testing.assert_allclose(diag["clip_fraction"], over.mean(), rtol=1e-6)
    np.testing.assert_array_equal(np.abs(np.asarray(grad)).sum(-1) == 0, over)


# ----------------------------------------------------------------------------------------------
# chunking, masking, -inf, reductions
# ----------------------------------------------------------------------------------------------


def all_losses(z, zt, ids, mask, top_k, chunk_rows):
    """JSD (clipped, with k1) + tinker + CE, for checks that must hold for every loss."""
    loss, diag = losses.generalized_jsd(
        z, zt, mask, top_k=top_k, clip=0.03, token_ids=ids, chunk_rows=chunk_rows
    )
    tinker, _ = losses.tinker_loss(z, zt, ids, mask, chunk_rows=chunk_rows)
    ce, _ = losses.completion_ce(z, ids, mask, chunk_rows=chunk_rows)
    return loss + tinker + ce, (diag["per_token"], diag["k1_reverse_kl"])


@functools.partial(jax.jit, static_argnames="chunk_rows")
def all_losses_table(z, zt, ids, mask, chunk_rows):
    """{top_k: (value, (per_token, k1), gradient)} for the top-k and full-vocabulary paths."""
    table = {}
    for top_k in (4, 0):
        value_and_grad = jax.value_and_grad(all_losses, has_aux=True)
        (value, aux), grad = value_and_grad(z, zt, ids, mask, top_k, chunk_rows)
        table[top_k] = (value, aux, grad)
    return table


@pytest.mark.parametrize("top_k", [4, 0])
def test_chunked_equals_unchunked(top_k):
    zs, zt = pair(14)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, SHAPE[-1], SHAPE[:2]))
    mask = jnp.ones(SHAPE[:2], bool)
    # 10 rows: chunks of 3 leave an overlapping last chunk; 64 is a single unchunked call.
    value_3, aux_3, grad_3 = all_losses_table(zs, zt, ids, mask, 3)[top_k]
    value_64, aux_64, grad_64 = all_losses_table(zs, zt, ids, mask, 64)[top_k]
    assert_nats_close(value_3, value_64, rel=1e-6)
    assert_nats_close(aux_3[0], aux_64[0], rel=1e-6)
    assert_nats_close(aux_3[1], aux_64[1], rel=1e-6)
    assert_close_to_scale(grad_3, grad_64, rel=1e-5)


def test_invalid_entries_may_hold_garbage():
    zs, zt = (np.array(z) for z in pair(15))
    mask = np.ones(SHAPE[:2], bool)
    mask[0, 3:] = mask[1, 4] = False
    dirty_s, dirty_t = zs.copy(), zt.copy()
    dirty_s[~mask] = np.nan
    dirty_t[~mask] = -np.inf
    ids = jnp.zeros(SHAPE[:2], jnp.int32)
    m = jnp.asarray(mask)
    clean_table = all_losses_table(zs, zt, ids, m, 3)
    dirty_table = all_losses_table(dirty_s, dirty_t, ids, m, 3)
    for top_k in (4, 0):
        clean, _, clean_grad = clean_table[top_k]
        dirty, _, dirty_grad = dirty_table[top_k]
        assert_nats_close(dirty, clean, rel=1e-6)
        assert_close_to_scale(dirty_grad, clean_grad, rel=1e-6)
        assert (np.asarray(dirty_grad)[~mask] == 0).all()


PADDED_SETTINGS = ((0.0, 0), (0.5, 0), (1.0, 0), (0.5, 4))
PADDED_CLIP = 0.05


@jax.jit
def padded_table(zs, zt):
    """{(beta, top_k): (loss, gradient)} with the entry clip on."""
    mask = jnp.ones(zs.shape[:-1], bool)
    table = {}
    for beta, top_k in PADDED_SETTINGS:

        def loss(z, beta=beta, top_k=top_k):
            return losses.generalized_jsd(z, zt, mask, beta, top_k=top_k, clip=PADDED_CLIP)[0]

        table[beta, top_k] = jax.value_and_grad(loss)(zs)
    return table


@pytest.mark.parametrize("beta, top_k", PADDED_SETTINGS)
def test_padded_minus_inf_vocabulary_is_safe(beta, top_k):
    zs, zt = (np.array(z) for z in pair(16))
    # The last 3 vocabulary entries are padding (-inf on both sides), as with a padded lm_head.
    zs[..., 6:] = zt[..., 6:] = -np.inf
    entries = np_entries(zs[..., :6], zt[..., :6], beta, top_k=top_k)
    expected = np.where(entries > PADDED_CLIP, PADDED_CLIP, entries).sum(-1).mean()
    value, grad = padded_table(zs, zt)[beta, top_k]
    assert_nats_close(value, expected)
    grad = np.asarray(grad)
    assert np.isfinite(grad).all() and np.abs(grad).max() > 0
    assert (grad[..., 6:] == 0).all()


LIMIT_SETTINGS = ((0.5, 3), (0.5, 0), (1.0, 0))  # (beta, top_k): top-k and full vocabulary


@functools.partial(jax.jit, static_argnames="vocab_limit")
def limited_table(zs, zt, ids, vocab_limit):
    """{loss: (value and diagnostics, gradient)} for every loss with `vocab_limit`."""
    mask = jnp.ones(ids.shape, bool)
    table = {}
    for beta, top_k in LIMIT_SETTINGS:

        def jsd_loss(z, beta=beta, top_k=top_k):
            value, diag = losses.generalized_jsd(
                z,
                zt,
                mask,
                beta,
                top_k=top_k,
                clip=PADDED_CLIP,
                token_ids=ids,
                vocab_limit=vocab_limit,
            )
            return value, (diag["teacher_topk_mass"], diag["k1_reverse_kl"], diag["clip_fraction"])

        table[f"jsd beta={beta} top_k={top_k}"] = jax.value_and_grad(jsd_loss, has_aux=True)(zs)
    table["tinker"] = jax.value_and_grad(
        lambda z: losses.tinker_loss(z, zt, ids, mask, vocab_limit=vocab_limit)[0]
    )(zs)
    table["ce"] = jax.value_and_grad(
        lambda z: losses.completion_ce(z, ids, mask, vocab_limit=vocab_limit)[0]
    )(zs)
    return table


def test_ids_past_vocab_limit_are_no_tokens_for_any_loss():
    """Padded lm_head rows (ids >= vocab_limit, no token): the teacher puts almost all its mass
    on one of them and the student on another; with vocab_limit every loss, the teacher's top-k
    and the diagnostics equal those on the logits cut at the limit, and no gradient reaches them."""
    limit = 6
    zs, zt = (np.array(z) for z in pair(31))
    zt[..., 7] = 40.0
    zs[..., 8] = 40.0
    ids = jnp.asarray(np.random.default_rng(5).integers(0, limit, SHAPE[:-1]))
    limited = limited_table(zs, zt, ids, vocab_limit=limit)
    cut = limited_table(zs[..., :limit], zt[..., :limit], ids, vocab_limit=None)
    for key, (value, grad) in limited.items():
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), value, cut[key][0]
        )
        np.testing.assert_allclose(grad[..., :limit], cut[key][1], rtol=1e-5, atol=1e-7)
        assert (np.asarray(grad[..., limit:]) == 0).all(), key
    # Without the limit the padded ids dominate: this test would see it.
    unlimited = limited_table(zs, zt, ids, vocab_limit=None)
    for beta, top_k in LIMIT_SETTINGS:
        key = f"jsd beta={beta} top_k={top_k}"
        assert abs(float(unlimited[key][0][0]) - float(cut[key][0][0])) > 1e-2, key


def test_sharded_leading_rows_need_no_cross_device_gather():
    # The trainer shards packed rows over devices; chunking along C and the top-k partitioning
    # rule must keep every device on its own rows (only the small per-sample sums are reduced).
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    zs, zt = pair(24, shape=(8, 6, 40))
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 40, (8, 6)))

    def per_token_and_grads(z, z_t, token_ids):
        mask = jnp.ones(token_ids.shape, bool)
        table = {}
        for top_k in (4, 0):

            def loss(z, top_k=top_k):
                value, diag = losses.generalized_jsd(
                    z, z_t, mask, top_k=top_k, token_ids=token_ids, chunk_rows=4
                )
                return value, diag["per_token"]

            table[top_k] = jax.value_and_grad(loss, has_aux=True)(z)
        return table

    sharded_inputs = [jax.device_put(x, rows) for x in (zs, zt, ids)]
    compiled = jax.jit(per_token_and_grads).lower(*sharded_inputs).compile()
    hlo = compiled.as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    table = compiled(*sharded_inputs)
    for top_k in (4, 0):
        (_, per_token), grad = table[top_k]
        entries = np_entries(zs, zt, 0.5, top_k=top_k)
        expected = np.where(entries > 0.05, 0.05, entries).sum(-1)
        assert_nats_close(per_token, expected)
        assert grad.sharding.is_equivalent_to(rows, grad.ndim)


def test_reductions_and_sample_ids():
    zs, zt = pair(17)
    # Row 0 holds samples 0 (2 entries) and 1 (3 entries); row 1 holds sample 2 (3 entries) then
    # padding; sample 3 has no valid entry and must not count in seq_mean.
    sample_ids = np.array([[0, 0, 1, 1, 1], [2, 2, 2, -1, -1]])
    mask = sample_ids >= 0
    per_token = np_entries(zs, zt, 0.5).sum(-1) * mask
    sample_means = np.array([per_token[sample_ids == s].mean() for s in range(3)])
    cases = {
        "seq_mean": sample_means.mean(),
        "token_mean": per_token.sum() / mask.sum(),
        "token_sum": per_token.sum(),
    }
    for reduction, expected in cases.items():
        loss, diag = jsd(
            zs,
            zt,
            jnp.asarray(mask),
            top_k=0,
            reduction=reduction,
            sample_ids=jnp.asarray(sample_ids),
            num_samples=4,
        )
        assert_nats_close(loss, expected)
        assert_nats_close(diag["per_sample"], np.append(sample_means, 0.0))
        np.testing.assert_array_equal(diag["sample_count"], [2, 3, 3, 0])
        assert float(diag["num_tokens"]) == 8
    # No valid entry at all: loss 0, not NaN.
    empty, _ = jsd(zs, zt, jnp.zeros(SHAPE[:2], bool), top_k=0)
    assert float(empty) == 0.0


def test_default_samples_are_leading_rows():
    zs, zt = pair(18, shape=(2, 3, 4, 5))
    mask = np.random.default_rng(1).random((2, 3, 4)) > 0.3
    mask[..., 0] = True
    loss, diag = jsd(zs, zt, jnp.asarray(mask), top_k=3)
    per_token = np_entries(zs, zt, 0.5, top_k=3).sum(-1) * mask
    per_sample = per_token.sum(-1).reshape(-1) / mask.sum(-1).reshape(-1)
    assert diag["per_sample"].shape == (6,) and diag["per_token"].shape == (2, 3, 4)
    assert_nats_close(diag["per_sample"], per_sample)
    assert_nats_close(loss, per_sample.mean())


def test_diagnostics_values():
    zs, zt = pair(19)
    ids = np.random.default_rng(2).integers(0, SHAPE[-1], SHAPE[:2])
    _, diag = jsd(zs, zt, top_k=4, temperature=2.0, clip=0.01, token_ids=jnp.asarray(ids))
    entries = np_entries(zs, zt, 0.5, temperature=2.0, top_k=4)
    np.testing.assert_allclose(diag["clip_fraction"], (entries > 0.01).mean(), rtol=1e-6)
    teacher = np.exp(np_log_softmax(np.asarray(zt) / 2.0))
    mass = np.sort(teacher, -1)[..., -4:].sum(-1).mean()
    np.testing.assert_allclose(diag["teacher_topk_mass"], mass, rtol=1e-5)
    k1 = np_token_logprobs(zs, ids, 2.0) - np_token_logprobs(zt, ids, 2.0)
    assert_nats_close(diag["k1_reverse_kl"], k1.mean())
    assert float(jsd(zs, zt, top_k=0)[1]["teacher_topk_mass"]) == 1.0


# ----------------------------------------------------------------------------------------------
# gradients by finite differences (float64)
# ----------------------------------------------------------------------------------------------

# (beta, top_k, clip): both endpoints, the interior formula, top-k and full vocabulary, with and
# without clip.
GRADIENT_CASES = [(0.0, 4, 0.0), (0.3, 4, 0.05), (1.0, 0, 0.0), (0.5, 0, 0.05)]


def test_jsd_gradients_match_finite_differences():
    with jax.enable_x64(True):
        rng = np.random.default_rng(3)
        zs, zt = rng.normal(size=(2, 3, 7)), rng.normal(size=(2, 3, 7))
        mask = jnp.asarray([[True, True, False], [True, True, True]])

        # One jitted sum over all cases (with independent random weights) keeps compiles few;
        # a wrong gradient in any term still shows up in the random direction check_grads uses.
        weights = rng.uniform(0.5, 1.5, len(GRADIENT_CASES))

        @jax.jit
        def loss(z):
            total = 0.0
            for weight, (beta, top_k, clip) in zip(weights, GRADIENT_CASES, strict=True):
                value, _ = losses.generalized_jsd(z, zt, mask, beta, 1.3, top_k, clip, chunk_rows=2)
                total = total + weight * value
            return total

        check_grads(loss, (zs,), order=1, modes=["rev"], eps=1e-6, atol=1e-7, rtol=1e-6)


def test_tinker_and_ce_gradients_match_finite_differences():
    with jax.enable_x64(True):
        rng = np.random.default_rng(4)
        zs, zt = rng.normal(size=(2, 3, 6)), rng.normal(size=(2, 3, 6))
        ids = jnp.asarray(rng.integers(0, 6, (2, 3)))
        sampler = jnp.asarray(rng.normal(size=(2, 3)) - 2.0)
        mask = jnp.asarray([[True, False, True], [True, True, True]])

        # With recorded sampler log-probs the advantage is a constant, so finite differences of
        # the value equal the surrogate's gradient.
        @jax.jit
        def loss(z):
            tinker, _ = losses.tinker_loss(
                z, zt, ids, mask, sampler_logprobs=sampler, temperature=0.7, chunk_rows=2
            )
            ce, _ = losses.completion_ce(z, ids, mask, chunk_rows=2)
            return tinker + 0.7 * ce

        check_grads(loss, (zs,), order=1, modes=["rev"], eps=1e-6, atol=1e-7, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# tinker loss and CE
# ----------------------------------------------------------------------------------------------


def test_tinker_gradient_expectation_is_reverse_kl_gradient():
    vocab, num_draws, temperature = 5, 20000, 1.5
    rng = np.random.default_rng(5)
    theta, teacher = (jnp.asarray(2.0 * rng.normal(size=vocab), jnp.float32) for _ in range(2))
    p = np.exp(np_log_softmax(np.asarray(theta) / temperature))
    draws = rng.choice(vocab, size=num_draws, p=p)
    ids = jnp.asarray(draws.reshape(1, num_draws))
    mask = jnp.ones((1, num_draws), bool)
    teacher_rows = jnp.broadcast_to(teacher, (1, num_draws, vocab))
    # The sampler's recorded log-probs, here on-policy (equal to the learner's).
    recorded = jnp.asarray(np_log_softmax(np.asarray(theta) / temperature)[draws][None])

    @jax.jit
    def surrogate_grads(th):
        def surrogate(th, sampler):
            student_rows = jnp.broadcast_to(th, (1, num_draws, vocab))
            loss, _ = losses.tinker_loss(
                student_rows,
                teacher_rows,
                ids,
                mask,
                sampler_logprobs=sampler,
                temperature=temperature,
                reduction="token_mean",
                chunk_rows=num_draws,
            )
            return loss

        return jax.grad(surrogate)(th, None), jax.grad(surrogate)(th, recorded)

    def reverse_kl(th):
        log_p = jax.nn.log_softmax(th / temperature)
        return jnp.sum(jnp.exp(log_p) * (log_p - jax.nn.log_softmax(teacher / temperature)))

    exact = jax.grad(reverse_kl)(theta)
    estimate, estimate_recorded = surrogate_grads(theta)
    # The standard error is below 0.002 per component here; 0.012 is a 6-sigma margin.
    assert np.abs(np.asarray(exact)).max() > 0.05
    np.testing.assert_allclose(estimate, exact, atol=0.012)
    np.testing.assert_allclose(estimate_recorded, estimate, rtol=1e-4, atol=1e-6)


def test_tinker_values_and_diagnostics():
    zs, zt = pair(20)
    ids = np.random.default_rng(6).integers(0, SHAPE[-1], SHAPE[:2])
    mask = np.ones(SHAPE[:2], bool)
    mask[0, 4] = False
    log_p, log_q = np_token_logprobs(zs, ids), np_token_logprobs(zt, ids)
    sampler = log_p - 0.3  # a stale sampler: ratio exp(0.3) everywhere
    args = (zs, zt, jnp.asarray(ids), jnp.asarray(mask))

    loss, diag = TINKER(*args, reduction="token_mean")
    assert_nats_close(loss, -(log_q - log_p)[mask].mean())
    assert_nats_close(diag["k1_reverse_kl"], (log_p - log_q)[mask].mean())
    # The PyTorch trainer's logged value: -mean(A log p), A = log q - log p.
    assert_nats_close(diag["pytorch_surrogate"], -((log_q - log_p) * log_p)[mask].mean())

    loss, diag = TINKER(
        *args,
        sampler_logprobs=jnp.asarray(sampler),
        kl_coef=2.0,
        advantage_clip=1.0,
        reduction="token_sum",
    )
    advantage = np.clip(2.0 * (log_q - sampler), -1.0, 1.0)
    assert_nats_close(loss, -(np.exp(0.3) * advantage)[mask].sum())
    np.testing.assert_allclose(diag["importance_ratio_mean"], np.exp(0.3), rtol=1e-5)
    clipped = (np.abs(2.0 * (log_q - sampler)) > 1.0)[mask].mean()
    np.testing.assert_allclose(diag["advantage_clip_fraction"], clipped, rtol=1e-6)

    # The warning is raised while tracing, so eval_shape checks it without compiling.
    with pytest.warns(UserWarning, match="sampling temperature"):
        jax.eval_shape(functools.partial(losses.tinker_loss, sample_temperature=1.1), *args)


def test_tinker_has_the_gradient_of_the_pytorch_surrogate():
    """Our value -mean(A) and PyTorch's -mean(A log p) differ; their gradients must not."""
    zs, zt = pair(25)
    ids = jnp.asarray(np.random.default_rng(8).integers(0, SHAPE[-1], SHAPE[:2]))
    mask = jnp.ones(SHAPE[:2], bool)

    def ours(z):
        return losses.tinker_loss(z, zt, ids, mask, reduction="token_mean")[0]

    def pytorch(z):
        log_p = jnp.take_along_axis(jax.nn.log_softmax(z), ids[..., None], -1)[..., 0]
        log_q = jnp.take_along_axis(jax.nn.log_softmax(zt), ids[..., None], -1)[..., 0]
        return -jnp.mean(jax.lax.stop_gradient(log_q - log_p) * log_p)

    grad_ours, grad_pytorch = jax.jit(lambda z: (jax.grad(ours)(z), jax.grad(pytorch)(z)))(zs)
    assert float(jnp.abs(grad_pytorch).max()) > 1e-3  # not vacuous
    assert_close_to_scale(grad_ours, grad_pytorch, rel=1e-5)
    assert abs(float(ours(zs)) - float(pytorch(zs))) > 1e-3  # the logged numbers do differ


def test_completion_ce_is_nll_of_sampled_tokens():
    zs, _ = pair(21)
    zs = zs.astype(jnp.bfloat16)
    ids = np.random.default_rng(7).integers(0, SHAPE[-1], SHAPE[:2])
    mask = np.ones(SHAPE[:2], bool)
    mask[1, 2:] = False
    nll = -np_token_logprobs(np.asarray(zs, np.float64), ids)
    loss, diag = CE(zs, jnp.asarray(ids), jnp.asarray(mask))
    assert_nats_close(loss, np.mean([nll[0].mean(), nll[1, :2].mean()]))
    assert_nats_close(diag["per_token"], nll * mask)


# ----------------------------------------------------------------------------------------------
# API: jit with static arguments, argument errors
# ----------------------------------------------------------------------------------------------


def test_jit_value_and_grad_with_bf16_inputs():
    zs, zt = (z.astype(jnp.bfloat16) for z in pair(22))
    mask = jnp.ones(SHAPE[:2], bool)
    loss_fn = functools.partial(
        losses.generalized_jsd,
        beta=0.5,
        temperature=1.0,
        top_k=4,
        clip=0.05,
        clip_mode="entry",
        reduction="seq_mean",
        chunk_rows=3,
    )
    value, grad = jax.jit(jax.value_and_grad(lambda z, t, m: loss_fn(z, t, m)[0]))(zs, zt, mask)
    entries = np_entries(np.asarray(zs, np.float64), np.asarray(zt, np.float64), 0.5, top_k=4)
    assert_nats_close(value, np.minimum(entries, 0.05).sum(-1).mean())
    assert grad.dtype == jnp.bfloat16 and grad.shape == zs.shape


def test_bad_arguments_raise_value_error():
    zs, zt = pair(23)
    mask = jnp.ones(SHAPE[:2], bool)
    ids = jnp.zeros(SHAPE[:2], jnp.int32)
    bad_calls = {
        "reduction": lambda: losses.generalized_jsd(zs, zt, mask, reduction="mean"),
        "clip_mode": lambda: losses.generalized_jsd(zs, zt, mask, clip_mode="row"),
        "beta": lambda: losses.generalized_jsd(zs, zt, mask, beta=1.5),
        "temperature": lambda: losses.generalized_jsd(zs, zt, mask, temperature=0.0),
        "teacher_logits": lambda: losses.generalized_jsd(zs, zt[:, :2], mask),
        "mask": lambda: losses.generalized_jsd(zs, zt, mask[:, :2]),
        "num_samples": lambda: losses.generalized_jsd(zs, zt, mask, sample_ids=ids),
        "top_k": lambda: losses.generalized_jsd(zs, zt, mask, top_k=2.5),
        "chunk_rows": lambda: losses.completion_ce(zs, ids, mask, chunk_rows=0),
        "sampler_logprobs": lambda: losses.tinker_loss(
            zs, zt, ids, mask, sampler_logprobs=jnp.zeros(3)
        ),
    }
    for name, call in bad_calls.items():
        with pytest.raises(ValueError, match=name):
            call()
    with pytest.raises(ValueError, match="beta"):
        jax.jit(lambda b: losses.generalized_jsd(zs, zt, mask, beta=b)[0])(0.5)
