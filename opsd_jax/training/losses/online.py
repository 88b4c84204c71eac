"""The online OPSD losses: generalized JSD, the sampled-token ("tinker") loss and completion CE.
The conventions all losses share (masks, samples, reductions, diagnostics) are the package's
(__init__.py); the chunked machinery they run on is kernels.py.
"""

from __future__ import annotations

import math
import operator
import warnings

import jax.numpy as jnp
from jax import lax

from opsd_jax.training.losses.kernels import (
    CLIP_MODES,
    DEFAULT_CHUNK_ROWS,
    as_leading_rows,
    base_diagnostics,
    check_choice,
    check_common,
    check_vocab_limit,
    chunked_entries,
    flat_sample_ids,
    jsd_rows,
    loop_over_chunks,
    reduce_entries,
    static_number,
    teacher_top_k,
    token_logprobs,
    valid_mean,
)

# ----------------------------------------------------------------------------------------------
# Public losses
# ----------------------------------------------------------------------------------------------


def generalized_jsd(
    student_logits,
    teacher_logits,
    mask,
    beta=0.5,
    temperature=1.0,
    top_k=256,
    clip=0.05,
    clip_mode="entry",
    reduction="seq_mean",
    *,
    token_ids=None,
    sample_ids=None,
    num_samples=None,
    chunk_rows=DEFAULT_CHUNK_ROWS,
    vocab_limit=None,
):
    """Generalized Jensen-Shannon divergence between student p and teacher q, per completion entry.

    Args:
      student_logits, teacher_logits: [..., C, V], aligned by completion index. Gradients flow
        into the student only.
      mask: [..., C] bool, valid entries.
      beta: teacher weight in the mixture, in [0, 1]. Exactly 0 -> forward KL(q || p); exactly 1
        -> reverse KL(p || q); in between beta KL(q || m) + (1 - beta) KL(p || m), m = beta q +
        (1 - beta) p (bounded by log 2). The interior formula tends to 0 at both ends; the
        endpoints are special cases, as in OPSD, TRL GKD and the PyTorch seed.
      temperature: tau > 0, applied to both sides; the loss is multiplied by tau**2.
      top_k: 0 < k < V restricts both distributions to the teacher's top-k ids and renormalises
        them there (no tail bucket); k <= 0 or k >= V uses the full vocabulary, in row chunks.
      clip: cap c > 0; c <= 0 (or inf) disables. With clip_mode 'entry' (default, the reference
        behaviour) every entry contribution e_i is replaced by c where e_i > c (gradient 0 there)
        before the sum over the support; negative entries are untouched, so the loss can be
        negative. With 'token' the per-entry sum is capped instead.
      reduction: 'seq_mean', 'token_mean' or 'token_sum' (see the module docstring).
      token_ids: optional [..., C] sampled ids; when given, diagnostics include 'k1_reverse_kl'.
      sample_ids, num_samples: sample of each entry (see the module docstring).
      chunk_rows: loss rows per chunk, taken along C for all leading rows at once (the
        working set per chunk is ~prod(leading dims) x chunk_rows x V fp32 values).
      vocab_limit: ids >= vocab_limit (padded table rows, no token) are left out of both
        distributions, the teacher's top-k and the support size (None: every id counts); the
        sampler takes the same limit (see `mask_vocab`).

    Returns:
      (loss, diagnostics). Besides the common keys, diagnostics hold 'clip_fraction' (entry mode:
      capped entries / (valid entries x support size); token mode: capped entries / valid
      entries), 'teacher_topk_mass' (mean teacher probability at temperature tau on the support;
      1 in full-vocabulary mode), 'negative_fraction' (valid entries with a negative value) and,
      if token_ids is given, 'k1_reverse_kl' (mean over valid entries of log p(y) - log q(y) at
      temperature tau over the full vocabulary, without the tau**2 factor).
    """
    num_samples = check_common(
        student_logits,
        mask,
        reduction,
        chunk_rows,
        {"token_ids": token_ids},
        sample_ids,
        num_samples,
    )
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"teacher_logits must have the student's shape {student_logits.shape}, "
            f"got {teacher_logits.shape}"
        )
    check_choice("clip_mode", clip_mode, CLIP_MODES)
    beta = static_number("beta", beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1], got {beta}")
    temperature = static_number("temperature", temperature)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    clip = static_number("clip", clip)
    if math.isnan(clip):
        raise ValueError("clip must be a number (<= 0 or inf disables it), got nan")
    try:
        top_k = operator.index(top_k)
    except TypeError as err:
        raise ValueError(
            f"top_k must be an int (<= 0 or >= V for full vocabulary), got {top_k!r}"
        ) from err
    if math.isinf(clip):
        clip = 0.0

    vocab_limit = check_vocab_limit(vocab_limit, student_logits.shape[-1])
    vocab = student_logits.shape[-1] if vocab_limit is None else vocab_limit
    student = as_leading_rows(student_logits, mask)
    teacher = as_leading_rows(lax.stop_gradient(teacher_logits), mask)
    valid = as_leading_rows(mask, mask).astype(bool)
    row_options = {"beta": beta, "temperature": temperature, "clip": clip, "clip_mode": clip_mode}

    if 0 < top_k < vocab:
        # Teacher-only work (selection, gathered logits, captured mass) is a constant; only the
        # student's gather below is differentiated, and its gradient is a scatter of [L, C, k].
        top_ids, teacher_top, topk_mass = loop_over_chunks(
            lambda t, ok: teacher_top_k(t, ok, top_k, temperature, vocab_limit),
            chunk_rows,
            (teacher, valid),
        )
        student_top = jnp.take_along_axis(student, lax.stop_gradient(top_ids), axis=-1)
        # The support holds only ids below vocab_limit (k < vocab_limit): nothing to mask.
        rows, clipped = jsd_rows(student_top, teacher_top, valid, **row_options)
        support = top_k
        mass = valid_mean(topk_mass, valid)
    else:
        rows, clipped = chunked_entries(
            lambda s, t, ok: jsd_rows(s, t, ok, vocab_limit=vocab_limit, **row_options),
            chunk_rows,
            student,
            teacher,
            valid,
        )
        support = vocab
        mass = jnp.ones((), rows.dtype)

    valid = valid.reshape(-1)
    per_entry = rows.reshape(-1) * temperature**2
    flat_ids = flat_sample_ids(mask, sample_ids)
    loss, sample_mean, sample_count = reduce_entries(
        per_entry, valid, flat_ids, num_samples, reduction
    )
    diagnostics = base_diagnostics(per_entry, valid, mask, sample_mean, sample_count)
    # In float: valid entries x vocabulary can exceed the int32 range.
    num_valid = jnp.maximum(jnp.sum(valid), 1).astype(rows.dtype)
    clip_denominator = num_valid * (support if clip_mode == "entry" else 1)
    diagnostics["clip_fraction"] = jnp.sum(clipped) / clip_denominator
    diagnostics["teacher_topk_mass"] = mass
    diagnostics["negative_fraction"] = valid_mean((per_entry < 0).astype(rows.dtype), valid)
    if token_ids is not None:
        log_p = token_logprobs(
            lax.stop_gradient(student_logits),
            token_ids,
            mask,
            temperature=temperature,
            chunk_rows=chunk_rows,
            vocab_limit=vocab_limit,
        )
        log_q = token_logprobs(
            teacher_logits,
            token_ids,
            mask,
            temperature=temperature,
            chunk_rows=chunk_rows,
            vocab_limit=vocab_limit,
        )
        diagnostics["k1_reverse_kl"] = valid_mean(
            lax.stop_gradient(log_p - log_q).reshape(-1), valid
        )
    return loss, diagnostics


def tinker_loss(
    student_logits,
    teacher_logits,
    token_ids,
    mask,
    sampler_logprobs=None,
    temperature=1.0,
    kl_coef=1.0,
    advantage_clip=0.0,
    reduction="seq_mean",
    *,
    sample_ids=None,
    num_samples=None,
    chunk_rows=DEFAULT_CHUNK_ROWS,
    sample_temperature=None,
    vocab_limit=None,
):
    """Sampled-token reverse KL used as a per-token advantage (loss kind 'tinker').

    For each valid entry with sampled token y (the closing EOS on the last row):
      l(y) = sampler_logprobs if given, else stop_grad(log p(y));
      A    = kl_coef * stop_grad(log q(y) - l(y)), clipped to [-advantage_clip, advantage_clip]
             when advantage_clip > 0 (off by default);
      rho  = exp(log p(y) - stop_grad(l(y)))  (1 in value without sampler log-probs);
      per-entry value -rho * A, reduced by `reduction`.
    log p and log q are log-softmaxes at `temperature` (no tau**2 factor here), from a chunked
    log-sum-exp. Without sampler log-probs the gradient is -A grad log p, whose expectation over
    y ~ p is grad KL(p || q) when y was sampled from p at the same temperature and weights.

    Args beyond generalized_jsd's (vocab_limit as there): token_ids [..., C] sampled ids in
    [0, V); sampler_logprobs
    [..., C] the sampler's recorded log-probs; sample_temperature, if given and different from
    `temperature`, triggers a warning (the estimator is then biased).

    The loss value is therefore -reduce(A) (with rho = 1: the k1 estimate of KL(p || q)), not
    the PyTorch OPSD trainer's -mean(A * log p(y)): same gradient, different number. That one is
    returned as 'pytorch_surrogate' (reduced like the loss), for comparing logs.

    Returns:
      (loss, diagnostics). Besides the common keys: 'k1_reverse_kl' (mean of l(y) - log q(y), the
      k1 estimate of KL(p || q)), 'importance_ratio_mean', 'importance_ratio_max',
      'advantage_mean' and 'advantage_clip_fraction', all over valid entries, and
      'pytorch_surrogate' (-reduce(A * log p(y)), no gradient).
    """
    num_samples = check_common(
        student_logits,
        mask,
        reduction,
        chunk_rows,
        {"token_ids": token_ids, "sampler_logprobs": sampler_logprobs},
        sample_ids,
        num_samples,
    )
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"teacher_logits must have the student's shape {student_logits.shape}, "
            f"got {teacher_logits.shape}"
        )
    temperature = static_number("temperature", temperature)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    kl_coef = static_number("kl_coef", kl_coef)
    advantage_clip = static_number("advantage_clip", advantage_clip)
    if (
        sample_temperature is not None
        and static_number("sample_temperature", sample_temperature) != temperature
    ):
        warnings.warn(
            f"tinker_loss: loss temperature {temperature} differs from the sampling temperature "
            f"{sample_temperature}; the sampled-token KL estimate is biased",
            stacklevel=2,
        )

    valid = mask.reshape(-1).astype(bool)
    log_p = token_logprobs(
        student_logits,
        token_ids,
        mask,
        temperature=temperature,
        chunk_rows=chunk_rows,
        vocab_limit=vocab_limit,
    ).reshape(-1)
    log_q = token_logprobs(
        lax.stop_gradient(teacher_logits),
        token_ids,
        mask,
        temperature=temperature,
        chunk_rows=chunk_rows,
        vocab_limit=vocab_limit,
    ).reshape(-1)
    if sampler_logprobs is None:
        behaviour = lax.stop_gradient(log_p)
    else:
        behaviour = jnp.where(valid, sampler_logprobs.reshape(-1).astype(log_p.dtype), 0.0)
    log_ratio = jnp.where(valid, log_p - lax.stop_gradient(behaviour), 0.0)
    ratio = jnp.exp(log_ratio)
    raw_advantage = kl_coef * lax.stop_gradient(log_q - behaviour)
    advantage = raw_advantage
    if advantage_clip > 0:
        advantage = jnp.clip(raw_advantage, -advantage_clip, advantage_clip)
    per_entry = jnp.where(valid, -ratio * advantage, 0.0)

    flat_ids = flat_sample_ids(mask, sample_ids)
    loss, sample_mean, sample_count = reduce_entries(
        per_entry, valid, flat_ids, num_samples, reduction
    )
    diagnostics = base_diagnostics(per_entry, valid, mask, sample_mean, sample_count)
    stats = lax.stop_gradient
    diagnostics["k1_reverse_kl"] = valid_mean(stats(behaviour - log_q), valid)
    diagnostics["importance_ratio_mean"] = valid_mean(stats(ratio), valid)
    diagnostics["importance_ratio_max"] = jnp.max(jnp.where(valid, stats(ratio), 0.0))
    diagnostics["advantage_mean"] = valid_mean(advantage, valid)
    clipped = (advantage != raw_advantage).astype(ratio.dtype)
    diagnostics["advantage_clip_fraction"] = valid_mean(clipped, valid)
    surrogate = jnp.where(valid, -advantage * stats(log_p), 0.0)
    diagnostics["pytorch_surrogate"] = reduce_entries(
        surrogate, valid, flat_ids, num_samples, reduction
    )[0]
    return loss, diagnostics


def completion_ce(
    student_logits,
    token_ids,
    mask,
    reduction="seq_mean",
    *,
    sample_ids=None,
    num_samples=None,
    chunk_rows=DEFAULT_CHUNK_ROWS,
    vocab_limit=None,
):
    """The student's negative log-likelihood of its own sampled completion (plus closing EOS).

    This is the seed's CE term: self-training on on-policy samples, not SFT on a reference. The
    caller puts the closing EOS id on the last completion row and marks it valid in `mask`. No
    temperature: plain log-softmax (over ids below `vocab_limit`, see `mask_vocab`). Returns
    (loss, diagnostics) with the common keys.
    """
    num_samples = check_common(
        student_logits,
        mask,
        reduction,
        chunk_rows,
        {"token_ids": token_ids},
        sample_ids,
        num_samples,
    )
    valid = mask.reshape(-1).astype(bool)
    log_p = token_logprobs(
        student_logits, token_ids, mask, chunk_rows=chunk_rows, vocab_limit=vocab_limit
    ).reshape(-1)
    per_entry = jnp.where(valid, -log_p, 0.0)
    flat_ids = flat_sample_ids(mask, sample_ids)
    loss, sample_mean, sample_count = reduce_entries(
        per_entry, valid, flat_ids, num_samples, reduction
    )
    return loss, base_diagnostics(per_entry, valid, mask, sample_mean, sample_count)
