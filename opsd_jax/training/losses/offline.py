"""Offline distillation losses: a teacher cached once (its top-k log-probs per completion entry,
opsd_jax/training/offline/cache.py), the student trained against it without a teacher forward. The
conventions (masks, samples, reductions, diagnostics) are the package's (__init__.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from opsd_jax.training.losses.kernels import (
    DEFAULT_CHUNK_ROWS,
    as_leading_rows,
    base_diagnostics,
    check_choice,
    check_common,
    check_vocab_limit,
    chunked_entries,
    compute_dtype,
    divergence_entries,
    flat_sample_ids,
    jsd_rows,
    loop_over_chunks,
    mask_vocab,
    reduce_entries,
    static_number,
    top_k_ids,
)

STUDENT_NORMS = ("full", "top_k")


def teacher_cache_entries(
    teacher_logits,
    reference_logits,
    mask,
    top_k,
    *,
    chunk_rows=DEFAULT_CHUNK_ROWS,
    vocab_limit=None,
):
    """What the offline cache keeps per entry, from one teacher and one reference forward.

    Returns (top_logprobs [..., C, k] fp32, top_ids [..., C, k] int32, kl [..., C] fp32):
    the teacher's k most likely ids and their log-probabilities (log-softmax over the whole
    vocabulary at temperature 1, as the PyTorch collector stores them: any temperature can be
    applied later, since a top-k renormalisation at tau only needs log-probs up to a constant),
    and KL(teacher || reference) over the full vocabulary at temperature 1 (the VT-sensitivity
    weight when the reference is the same model without the VT images). Entries with mask
    False give 0 / id 0. Chunked over C like the losses, so no [C, V] fp32 tensor exists.
    """
    teacher = as_leading_rows(lax.stop_gradient(teacher_logits), mask)
    reference = as_leading_rows(lax.stop_gradient(reference_logits), mask)
    valid = as_leading_rows(mask, mask).astype(bool)
    vocab_limit = check_vocab_limit(vocab_limit, teacher.shape[-1])
    vocab = teacher.shape[-1] if vocab_limit is None else vocab_limit
    if not 0 < top_k <= vocab:
        raise ValueError(f"top_k must be in [1, {vocab}] (the usable vocabulary), got {top_k}")

    def chunk(t, r, ok):
        dtype = compute_dtype(t.dtype)
        exact = mask_vocab(jnp.where(ok[..., None], t.astype(dtype), 0.0), vocab_limit)
        ids = top_k_ids(exact, top_k)
        logp = jnp.take_along_axis(exact, ids, axis=-1) - jax.nn.logsumexp(
            exact, axis=-1, keepdims=True
        )
        # Forward KL(teacher || reference) at tau 1, unclipped: the beta = 0 generalized JSD row.
        kl, _ = jsd_rows(
            r,
            t,
            ok,
            beta=0.0,
            temperature=1.0,
            clip=0.0,
            clip_mode="entry",
            vocab_limit=vocab_limit,
        )
        keep = ok[..., None]
        # A KL is >= 0; fp32 cancellation gives ~-1e-9 where the views agree (before the first
        # VT image), which as a weight would flip the sign of a term.
        kl = jnp.maximum(kl, 0.0)
        return (jnp.where(keep, logp, 0.0), jnp.where(keep, ids, 0).astype(jnp.int32), kl)

    top_logprobs, top_ids, kl = loop_over_chunks(chunk, chunk_rows, (teacher, reference, valid))
    shape = mask.shape
    return (
        top_logprobs.reshape(shape + (top_k,)),
        top_ids.reshape(shape + (top_k,)),
        kl.reshape(shape),
    )


def _lse_rows(logits, valid, *, temperature, vocab_limit):
    dtype = compute_dtype(logits.dtype)
    scaled = mask_vocab(jnp.where(valid[..., None], logits.astype(dtype), 0.0), vocab_limit)
    return jnp.where(valid, jax.nn.logsumexp(scaled / temperature, axis=-1), 0.0), ()


def _normalise_weights(weights, valid, sample_ids, num_samples):
    """Entry weights rescaled to mean 1 over each sample's valid entries (a constant).

    Then any reduction of w * l gives, per sample, sum(w l) / sum(w): the PyTorch offline
    trainer's VT-weighted mean. A sample whose weights sum to 0 falls back to weight 1 per
    entry (a plain mean), as there.
    """
    w = jnp.where(valid, lax.stop_gradient(weights).astype(jnp.float32), 0.0)
    segments = jnp.where(
        valid & (sample_ids >= 0) & (sample_ids < num_samples), sample_ids, num_samples
    )
    total = jax.ops.segment_sum(w, segments, num_samples + 1)
    count = jax.ops.segment_sum(valid.astype(jnp.float32), segments, num_samples + 1)
    total, count = total[segments], count[segments]
    return jnp.where(total > 0, w * count / jnp.where(total > 0, total, 1.0), 1.0)


def cached_top_k_kl(
    student_logits,
    teacher_top_logprobs,
    teacher_top_ids,
    mask,
    temperature=1.0,
    reduction="seq_mean",
    *,
    weights=None,
    student_norm="full",
    sample_ids=None,
    num_samples=None,
    chunk_rows=DEFAULT_CHUNK_ROWS,
    vocab_limit=None,
):
    """Forward KL from a cached teacher top-k to the student, per completion entry.

    q = softmax(teacher_top_logprobs / tau) over the k cached ids (the teacher renormalised on
    its top-k, exactly as `generalized_jsd` does it from logits); the student's log-probs at
    those ids are, with `student_norm`:
      'full'  (PyTorch offline trainer): log-softmax over the whole vocabulary at tau, gathered,
              so student mass outside the teacher's top-k is penalised too;
      'top_k' (docs/opsd_loss.md a.1, the online loss): renormalised over the k ids, so the value equals
              generalized_jsd(beta=0, top_k=k, clip=0) on the teacher's logits.
    Per entry l_t = tau**2 * sum_i q_i (log q_i - log p_i). `weights` [..., C] (VT-sensitivity)
    make each sample's value sum(w l) / sum(w) instead of the mean (see `_normalise_weights`);
    then `reduction` as everywhere (module docstring). Gradients flow into the student only.

    Returns (loss, diagnostics) with the common keys.
    """
    num_samples = check_common(
        student_logits, mask, reduction, chunk_rows, {"weights": weights}, sample_ids, num_samples
    )
    check_choice("student_norm", student_norm, STUDENT_NORMS)
    if (
        teacher_top_ids.shape != teacher_top_logprobs.shape
        or teacher_top_ids.shape[:-1] != mask.shape
    ):
        raise ValueError(
            f"teacher_top_logprobs {teacher_top_logprobs.shape} and teacher_top_ids "
            f"{teacher_top_ids.shape} must both be {mask.shape} + (k,)"
        )
    temperature = static_number("temperature", temperature)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    vocab_limit = check_vocab_limit(vocab_limit, student_logits.shape[-1])

    student = as_leading_rows(student_logits, mask)
    valid = as_leading_rows(mask, mask).astype(bool)
    keep = valid[..., None]
    ids = jnp.where(keep, as_leading_rows(teacher_top_ids, mask), 0).astype(jnp.int32)
    dtype = compute_dtype(student.dtype)
    student_top = jnp.where(keep, jnp.take_along_axis(student, ids, axis=-1).astype(dtype), 0.0)
    student_top = student_top / temperature
    if student_norm == "full":
        lse, _ = chunked_entries(
            lambda z, ok: _lse_rows(z, ok, temperature=temperature, vocab_limit=vocab_limit),
            chunk_rows,
            student,
            valid,
        )
        student_logp = student_top - lse[..., None]
    else:
        student_logp = student_top - jax.nn.logsumexp(student_top, axis=-1, keepdims=True)
    teacher = jnp.where(keep, as_leading_rows(teacher_top_logprobs, mask).astype(dtype), 0.0)
    teacher = lax.stop_gradient(teacher) / temperature
    teacher_logp = teacher - jax.nn.logsumexp(teacher, axis=-1, keepdims=True)
    rows = jnp.sum(divergence_entries(student_logp, teacher_logp, 0.0), axis=-1)

    valid = valid.reshape(-1)
    per_entry = jnp.where(valid, rows.reshape(-1), 0.0) * temperature**2
    flat_ids = flat_sample_ids(mask, sample_ids)
    if weights is not None:
        scale = _normalise_weights(weights.reshape(-1), valid, flat_ids, num_samples)
        per_entry = per_entry * scale
    loss, sample_mean, sample_count = reduce_entries(
        per_entry, valid, flat_ids, num_samples, reduction
    )
    return loss, base_diagnostics(per_entry, valid, mask, sample_mean, sample_count)
