"""OPSD distillation losses: generalized JSD, the sampled-token ("tinker") loss and completion CE;
for offline mode, the teacher's cached entries and the KL against them (end of the file).

The student and the teacher are run teacher-forced on the same sampled completion; row t of the
loss compares their next-token distributions (see shared/reference/opsd_loss_spec.md, section a).
All three losses take logits already gathered at the completion rows, shape [..., C, V] (bf16 in
training, fp32/fp64 in tests), and a `mask` [..., C] of valid entries.

Why this module is shaped the way it is: at C ~ 4k rows and V ~ 152k, one fp32 [C, V] tensor is
2.5 GB and a naive JSD (log-softmax of both sides, mixture, entries, their gradients) needs
~30 GB of temporaries for value and gradient (bench/losses.py). So no [C, V] fp32 tensor exists
here; work over the vocabulary runs in chunks of `chunk_rows` loss rows (taken along C, for all
leading rows at once, so a chunk is [prod(leading dims), chunk_rows, V]):

* top-k mode (default k = 256): per chunk, the teacher's top-k ids are selected and the teacher
  mass they hold is measured; then both sides are gathered at those ids in their input dtype
  and only the [..., C, k] slices are upcast to fp32;
* full-vocabulary mode and token log-probabilities: a loop over chunks with a hand-written VJP
  that recomputes each chunk in the backward pass and writes its gradient slice in place.

Chunks never split the leading (batch) dims, and the top-k selection carries a partitioning
rule, so with packed rows sharded over devices each device works on its own rows only.

Conventions shared by all losses
--------------------------------
* Hyper-parameters (beta, temperature, top_k, clip, clip_mode, reduction, chunk_rows,
  num_samples, ...) are Python values, static under `jax.jit` (pass them by keyword through
  `functools.partial` or `static_argnames`). The beta endpoints 0 and 1 are decided in Python.
* The teacher is a constant: no gradient flows into `teacher_logits`.
* Computation runs in fp32 (fp64 when the logits are fp64, for gradient checks).
* Invalid entries (mask False) contribute exactly 0 and may hold any values, including NaN or
  -inf: their rows are replaced by zeros before any arithmetic.
* Samples. `sample_ids` [..., C] int says which sample each entry belongs to (a packed row may
  hold several samples; ids are global, 0 <= id < num_samples, and `num_samples` is then
  required). With `sample_ids=None` every leading row (each index of the flattened leading dims)
  is one sample and num_samples = prod(leading dims). Valid entries with an out-of-range id are
  left out of `seq_mean` and of the per-sample values, but still count for `token_*`.
* Reductions over the per-entry values l_t (0 where invalid):
  - 'seq_mean' (default; the PyTorch seed's behaviour): mean over each sample's valid entries,
    then mean over the samples that have at least one valid entry;
  - 'token_mean': sum over valid entries / number of valid entries (OPSD's micro-batch mean);
  - 'token_sum': plain sum (Tinker's convention; divide by a global token count yourself for a
    gradient-accumulation-invariant mean).
  An input without any valid entry gives loss 0.
* Every loss returns `(loss, diagnostics)`. The diagnostics always contain
  'per_token' [..., C] (l_t in loss units, 0 where invalid), 'per_sample' [num_samples] (mean of
  l_t over the sample's valid entries, 0 for a sample without any), 'sample_count'
  [num_samples] (its number of valid entries, float32) and 'num_tokens' (valid entries). Scalar
  statistics are plain means over valid entries whatever the reduction.
"""

from __future__ import annotations

import functools
import math
import operator
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

REDUCTIONS = ("seq_mean", "token_mean", "token_sum")
CLIP_MODES = ("entry", "token")
# Loss rows per chunk: [128, 152064] fp32 is 74 MiB per intermediate and per leading row.
DEFAULT_CHUNK_ROWS = 128


# ----------------------------------------------------------------------------------------------
# Argument checking
# ----------------------------------------------------------------------------------------------


def _static_number(name, value):
    """`value` as a Python float; a traced value cannot decide Python branches, so reject it."""
    try:
        return float(value)
    except (TypeError, jax.errors.ConcretizationTypeError) as err:
        raise ValueError(
            f"{name} must be a Python number (static under jit), got {value!r}"
        ) from err


def _check_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _check_common(logits, mask, reduction, chunk_rows, per_entry, sample_ids, num_samples):
    """Shape and option checks shared by the losses; returns the resolved number of samples."""
    _check_choice("reduction", reduction, REDUCTIONS)
    if logits.ndim < 2:
        raise ValueError(f"logits must have shape [..., C, V], got shape {logits.shape}")
    if logits.shape[-1] == 0 or math.prod(logits.shape[:-1]) == 0:
        raise ValueError(f"logits must have non-empty C and V dims, got shape {logits.shape}")
    entry_shape = logits.shape[:-1]
    if mask.shape != entry_shape:
        raise ValueError(f"mask must have shape {entry_shape} (logits without V), got {mask.shape}")
    for name, array in per_entry.items():
        if array is not None and array.shape != entry_shape:
            raise ValueError(f"{name} must have shape {entry_shape}, got {array.shape}")
    if not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
    leading_rows = math.prod(entry_shape[:-1])
    if sample_ids is None:
        if num_samples is not None and num_samples != leading_rows:
            raise ValueError(
                f"num_samples={num_samples} but sample_ids is None, which means one sample per "
                f"leading row ({leading_rows}); pass sample_ids or leave num_samples as None"
            )
        return leading_rows
    if sample_ids.shape != entry_shape:
        raise ValueError(f"sample_ids must have shape {entry_shape}, got {sample_ids.shape}")
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(
            f"num_samples must be a positive int when sample_ids is given, got {num_samples!r}"
        )
    return num_samples


def mask_vocab(logits, vocab_limit):
    """`logits` [..., V] with every id >= `vocab_limit` set to -inf (None: unchanged).

    The embedding / lm_head table has more rows than the tokenizer has ids (Qwen2.5: 152064 vs
    151665 + BAGEL's added tokens); the rows past the tokenizer are no token at all. The sampler
    never draws them and the losses must not put mass on them either (a teacher top-k would
    otherwise pick them), so both mask them through this one function.
    """
    if vocab_limit is None or vocab_limit >= logits.shape[-1]:
        return logits
    ids = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.where(ids < vocab_limit, logits, jnp.array(-jnp.inf, logits.dtype))


def _check_vocab_limit(vocab_limit, vocab):
    """`vocab_limit` as an int in [1, V], or None."""
    if vocab_limit is None:
        return None
    try:
        vocab_limit = operator.index(vocab_limit)
    except TypeError as err:
        raise ValueError(f"vocab_limit must be an int or None, got {vocab_limit!r}") from err
    if not 1 <= vocab_limit:
        raise ValueError(f"vocab_limit must be >= 1, got {vocab_limit}")
    return min(vocab_limit, vocab)


def _compute_dtype(dtype):
    """fp32 for bf16/fp16/fp32 logits, fp64 for fp64 ones (used by gradient checks)."""
    return jnp.promote_types(dtype, jnp.float32)


# ----------------------------------------------------------------------------------------------
# Chunked evaluation along the entry axis, with an in-place backward pass
# ----------------------------------------------------------------------------------------------
#
# Arrays here are [L, C, ...]: L = the flattened leading dims (packed rows), C = loss entries.
# Chunks are slices along C that keep all L leading rows. Slicing along C rather than along a
# flattened [L * C] axis leaves the leading (batch) dim whole, so when it is sharded over
# devices every device loops over its own rows and nothing is gathered across devices.

ENTRY_AXIS = 1


def _chunk_start(index, num_entries, chunk):
    # The last chunk is shifted back so it ends at the last entry instead of running past it: no
    # padded copy of the [L, C, V] input is needed. The entries it shares with the previous chunk
    # are computed twice and written twice with the same values, which is harmless because
    # every output entry depends only on its own input entry.
    return jnp.minimum(index * chunk, num_entries - chunk)


def _slice_entries(array, start, size):
    return lax.dynamic_slice_in_dim(array, start, size, axis=ENTRY_AXIS)


def _write_entries(array, update, start):
    return lax.dynamic_update_slice_in_dim(array, update, start, axis=ENTRY_AXIS)


def _loop_over_chunks(entry_fn, chunk, arrays):
    """entry_fn applied to C-chunks of `arrays` (all [L, C, ...]); outputs are [L, C, ...]."""
    num_entries = arrays[0].shape[ENTRY_AXIS]
    chunk = min(chunk, num_entries)
    num_chunks = -(-num_entries // chunk)
    if num_chunks == 1:
        return entry_fn(*arrays)
    first = [lax.slice_in_dim(a, 0, chunk, axis=ENTRY_AXIS) for a in arrays]
    shapes = jax.eval_shape(entry_fn, *first)
    init = jax.tree.map(
        lambda s: jnp.zeros(s.shape[:1] + (num_entries,) + s.shape[2:], s.dtype), shapes
    )

    def body(index, outputs):
        start = _chunk_start(index, num_entries, chunk)
        results = entry_fn(*(_slice_entries(a, start, chunk) for a in arrays))
        return jax.tree.map(lambda out, res: _write_entries(out, res, start), outputs, results)

    return lax.fori_loop(0, num_chunks, body, init)


def _chunked_entries(entry_fn: Callable, chunk: int, diff_input, *const_inputs):
    """Evaluate `entry_fn(diff_chunk, *const_chunks) -> (values [L, n], aux)` over C-chunks.

    `values` is differentiable with respect to `diff_input` only; `aux` (a pytree of
    [L, n, ...] arrays) and all `const_inputs` are treated as constants. A plain loop under
    autodiff would keep every chunk's intermediates (or accumulate a full-size zero cotangent
    per chunk), so the VJP is written by hand: the backward pass re-runs each chunk under
    `jax.vjp` and writes its [L, n, V] gradient slice into one buffer of the input's dtype.
    """

    @jax.custom_vjp
    def run(diff, *consts):
        return _loop_over_chunks(entry_fn, chunk, (diff, *consts))

    def run_fwd(diff, *consts):
        return _loop_over_chunks(entry_fn, chunk, (diff, *consts)), (diff, consts)

    def run_bwd(residuals, cotangents):
        diff, consts = residuals
        values_cotangent = cotangents[0]
        num_entries = diff.shape[ENTRY_AXIS]
        size = min(chunk, num_entries)
        num_chunks = -(-num_entries // size)

        def chunk_grad(diff_piece, const_pieces, ct_piece):
            _, vjp = jax.vjp(lambda d: entry_fn(d, *const_pieces)[0], diff_piece)
            return vjp(ct_piece)[0].astype(diff.dtype)

        if num_chunks == 1:
            grad = chunk_grad(diff, consts, values_cotangent)
        else:

            def body(index, grad):
                start = _chunk_start(index, num_entries, size)
                update = chunk_grad(
                    _slice_entries(diff, start, size),
                    [_slice_entries(c, start, size) for c in consts],
                    _slice_entries(values_cotangent, start, size),
                )
                return _write_entries(grad, update, start)

            grad = lax.fori_loop(0, num_chunks, body, jnp.zeros_like(diff))
        return (grad, *(None for _ in consts))

    run.defvjp(run_fwd, run_bwd)
    return run(diff_input, *const_inputs)


def _as_leading_rows(array, mask):
    """[..., C, (V)] -> [L, C, (V)] with L = prod(leading dims); a free reshape."""
    return array.reshape((-1, mask.shape[-1]) + array.shape[mask.ndim :])


# ----------------------------------------------------------------------------------------------
# Per-entry divergence terms
# ----------------------------------------------------------------------------------------------


def _weighted_log_ratio(weight, log_weight, log_other):
    """weight * (log_weight - log_other), defined as 0 where weight == 0.

    The inner `where`s keep -inf log-probabilities (padded vocabulary) out of the arithmetic:
    a single outer `where` would still give NaN gradients through the unused 0 * inf branch.
    """
    live = weight > 0
    safe_log_weight = jnp.where(live, log_weight, 0.0)
    safe_log_other = jnp.where(live, log_other, 0.0)
    return jnp.where(live, weight * (safe_log_weight - safe_log_other), 0.0)


def _log_mixture(student_logp, teacher_logp, beta):
    """log(beta * q + (1 - beta) * p) in log space, finite wherever p > 0 or q > 0.

    Written out (max + log1p(exp(min - max))) rather than with jnp.logaddexp so that an input of
    -inf on one side gets an exact zero gradient; entries where both sides are -inf give 0 and
    are zeroed by the caller.
    """
    weighted_teacher = math.log(beta) + teacher_logp
    weighted_student = math.log1p(-beta) + student_logp
    high = jnp.maximum(weighted_teacher, weighted_student)
    low = jnp.minimum(weighted_teacher, weighted_student)
    safe_high = jnp.where(jnp.isfinite(high), high, 0.0)
    return safe_high + jnp.log1p(jnp.exp(low - safe_high))


def _divergence_entries(student_logp, teacher_logp, beta):
    """Per-entry contributions e_i whose sum over the support is the generalized JSD.

    beta == 0: q (log q - log p), summing to KL(teacher || student) (forward);
    beta == 1: p (log p - log q), summing to KL(student || teacher) (reverse);
    otherwise beta * q (log q - log m) + (1 - beta) * p (log p - log m), m = beta q + (1 - beta) p.
    """
    p = jnp.exp(student_logp)
    q = jnp.exp(teacher_logp)
    if beta == 0.0:
        return _weighted_log_ratio(q, teacher_logp, student_logp)
    if beta == 1.0:
        return _weighted_log_ratio(p, student_logp, teacher_logp)
    log_m = _log_mixture(student_logp, teacher_logp, beta)
    return beta * _weighted_log_ratio(q, teacher_logp, log_m) + (1.0 - beta) * _weighted_log_ratio(
        p, student_logp, log_m
    )


def _clip_above(value, cap):
    # torch.clamp(max=c) semantics: gradient 1 where value <= c, 0 where value > c. jnp.minimum
    # would split the gradient 0.5/0.5 at exact ties.
    return jnp.where(value > cap, cap, value)


def _jsd_rows(student, teacher, valid, *, beta, temperature, clip, clip_mode, vocab_limit=None):
    """Generalized JSD of each loss row over the last axis, before the temperature**2 factor.

    `student` and `teacher` are [..., n, K] logits over the support (a top-k slice or the full
    vocabulary), `valid` [..., n]. Returns (row values [..., n], clipped counts [..., n]);
    invalid rows give 0 for both.
    """
    dtype = _compute_dtype(student.dtype)
    keep = valid[..., None]
    student = mask_vocab(jnp.where(keep, student.astype(dtype), 0.0), vocab_limit) / temperature
    teacher = mask_vocab(jnp.where(keep, teacher.astype(dtype), 0.0), vocab_limit) / temperature
    student_logp = student - jax.nn.logsumexp(student, axis=-1, keepdims=True)
    teacher_logp = teacher - jax.nn.logsumexp(teacher, axis=-1, keepdims=True)
    entries = _divergence_entries(student_logp, teacher_logp, beta)
    clipped = jnp.zeros(valid.shape, dtype)
    if clip > 0 and clip_mode == "entry":
        over = entries > clip
        clipped = jnp.sum(over, axis=-1).astype(dtype)
        entries = _clip_above(entries, clip)
    rows = jnp.sum(entries, axis=-1)
    if clip > 0 and clip_mode == "token":
        clipped = (rows > clip).astype(dtype)
        rows = _clip_above(rows, clip)
    zero = jnp.zeros((), dtype)
    return jnp.where(valid, rows, zero), jnp.where(valid, clipped, zero)


@functools.partial(custom_partitioning, static_argnums=(1,))
def _top_k_ids(values, k):
    """Ids of the k largest entries along the last axis, [..., V] -> [..., k].

    lax.top_k alone is all-gathered by the SPMD partitioner when its batch dims are sharded
    (checked with jax 0.12: every device would select over every device's rows). The rule
    below keeps the leading dims' sharding and replicates only the vocabulary axis.
    """
    return lax.top_k(values, k)[1]


def _top_k_sharding(mesh, operand):
    spec = tuple(operand.sharding.spec)
    spec = spec + (None,) * (len(operand.shape) - len(spec))
    return NamedSharding(mesh, PartitionSpec(*spec[:-1], None))


def _top_k_partition(k, mesh, arg_shapes, result_shape):
    sharding = _top_k_sharding(mesh, arg_shapes[0])
    return mesh, lambda values: lax.top_k(values, k)[1], sharding, (sharding,)


_top_k_ids.def_partition(
    partition=_top_k_partition,
    infer_sharding_from_operands=lambda k, mesh, arg_shapes, result_shape: _top_k_sharding(
        mesh, arg_shapes[0]
    ),
    sharding_rule="... v -> ... k",
    need_replication_factors=("v",),
)


def _teacher_top_k(teacher, valid, k, temperature, vocab_limit=None):
    """For a chunk of teacher rows [..., n, V]: top-k ids, the logits there, the mass they hold.

    The selection uses the input (bf16) logits. Each chunk is upcast exactly before lax.top_k
    because XLA:CPU only has a fast TopK kernel for fp32 (for bf16 it sorts whole rows, ~20x
    slower); the cast is monotone and exact, so the selected set is the same. Ids at or past
    `vocab_limit` are -inf, so they are never selected (k < vocab_limit) and hold no mass.
    """
    dtype = _compute_dtype(teacher.dtype)
    keep = valid[..., None]
    exact = mask_vocab(jnp.where(keep, teacher.astype(dtype), 0.0), vocab_limit)
    ids = _top_k_ids(exact, k)
    top_logits = jnp.take_along_axis(teacher, ids, axis=-1)
    scaled = exact / temperature
    log_mass = jax.nn.logsumexp(jnp.take_along_axis(scaled, ids, axis=-1), axis=-1)
    log_total = jax.nn.logsumexp(scaled, axis=-1)
    mass = jnp.where(valid, jnp.exp(log_mass - log_total), 0.0)
    return ids, top_logits, mass


# ----------------------------------------------------------------------------------------------
# Token log-probabilities and reductions
# ----------------------------------------------------------------------------------------------


def _token_logprob_rows(logits, token_ids, valid, *, temperature, vocab_limit=None):
    dtype = _compute_dtype(logits.dtype)
    scaled = mask_vocab(jnp.where(valid[..., None], logits.astype(dtype), 0.0), vocab_limit)
    scaled = scaled / temperature
    ids = jnp.clip(jnp.where(valid, token_ids, 0), 0, logits.shape[-1] - 1)
    picked = jnp.take_along_axis(scaled, ids[..., None].astype(jnp.int32), axis=-1)[..., 0]
    logp = picked - jax.nn.logsumexp(scaled, axis=-1)
    return jnp.where(valid, logp, 0.0), ()


def token_logprobs(logits, token_ids, mask=None, *, temperature=1.0, chunk_rows=DEFAULT_CHUNK_ROWS,
                   vocab_limit=None):  # fmt: skip
    """log softmax(logits / temperature)[token_ids] for every entry, shape [..., C] (fp32).

    Differentiable with respect to `logits`; the log-sum-exp runs over chunks of `chunk_rows`
    loss rows so no [C, V] fp32 tensor exists. Entries with mask False give 0. `token_ids` must
    lie in [0, V) (out-of-range ids are clamped). `vocab_limit`: the softmax runs over ids below
    it only (see `mask_vocab`), as the sampler's does.
    """
    mask = jnp.ones(logits.shape[:-1], bool) if mask is None else mask
    _check_common(logits, mask, "token_sum", chunk_rows, {"token_ids": token_ids}, None, None)
    temperature = _static_number("temperature", temperature)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    vocab_limit = _check_vocab_limit(vocab_limit, logits.shape[-1])

    def row_fn(z, ids, ok):
        return _token_logprob_rows(z, ids, ok, temperature=temperature, vocab_limit=vocab_limit)

    logp, _ = _chunked_entries(
        row_fn,
        chunk_rows,
        _as_leading_rows(logits, mask),
        _as_leading_rows(token_ids, mask),
        _as_leading_rows(mask, mask).astype(bool),
    )
    return logp.reshape(mask.shape)


def _flat_sample_ids(mask, sample_ids):
    if sample_ids is None:
        # One sample per leading row: entry (r, c) belongs to sample r.
        return jnp.arange(mask.size, dtype=jnp.int32) // mask.shape[-1]
    return sample_ids.reshape(-1).astype(jnp.int32)


def _reduce(per_entry, valid, sample_ids, num_samples, reduction):
    """(loss, per_sample_mean [S], sample_count [S]) from flat per-entry values and validity."""
    count = valid.astype(per_entry.dtype)
    in_range = valid & (sample_ids >= 0) & (sample_ids < num_samples)
    # Entries that belong to no sample go to an overflow segment that is then dropped.
    segments = jnp.where(in_range, sample_ids, num_samples)
    sample_sum = jax.ops.segment_sum(per_entry, segments, num_samples + 1)[:num_samples]
    sample_count = jax.ops.segment_sum(count, segments, num_samples + 1)[:num_samples]
    sample_mean = sample_sum / jnp.maximum(sample_count, 1.0)
    if reduction == "token_sum":
        loss = jnp.sum(per_entry)
    elif reduction == "token_mean":
        loss = jnp.sum(per_entry) / jnp.maximum(jnp.sum(count), 1.0)
    else:
        present = (sample_count > 0).astype(per_entry.dtype)
        loss = jnp.sum(sample_mean * present) / jnp.maximum(jnp.sum(present), 1.0)
    return loss, sample_mean, sample_count.astype(jnp.float32)


def _valid_mean(values, valid):
    return jnp.sum(jnp.where(valid, values, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def _base_diagnostics(per_entry, valid, mask, sample_mean, sample_count):
    return {
        "per_token": per_entry.reshape(mask.shape),
        "per_sample": sample_mean,
        "sample_count": sample_count,
        "num_tokens": jnp.sum(valid).astype(jnp.float32),
    }


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
    num_samples = _check_common(
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
    _check_choice("clip_mode", clip_mode, CLIP_MODES)
    beta = _static_number("beta", beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1], got {beta}")
    temperature = _static_number("temperature", temperature)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    clip = _static_number("clip", clip)
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

    vocab_limit = _check_vocab_limit(vocab_limit, student_logits.shape[-1])
    vocab = student_logits.shape[-1] if vocab_limit is None else vocab_limit
    student = _as_leading_rows(student_logits, mask)
    teacher = _as_leading_rows(lax.stop_gradient(teacher_logits), mask)
    valid = _as_leading_rows(mask, mask).astype(bool)
    row_options = {"beta": beta, "temperature": temperature, "clip": clip, "clip_mode": clip_mode}

    if 0 < top_k < vocab:
        # Teacher-only work (selection, gathered logits, captured mass) is a constant; only the
        # student's gather below is differentiated, and its gradient is a scatter of [L, C, k].
        top_ids, teacher_top, topk_mass = _loop_over_chunks(
            lambda t, ok: _teacher_top_k(t, ok, top_k, temperature, vocab_limit), chunk_rows,
            (teacher, valid),
        )  # fmt: skip
        student_top = jnp.take_along_axis(student, lax.stop_gradient(top_ids), axis=-1)
        # The support holds only ids below vocab_limit (k < vocab_limit): nothing to mask.
        rows, clipped = _jsd_rows(student_top, teacher_top, valid, **row_options)
        support = top_k
        mass = _valid_mean(topk_mass, valid)
    else:
        rows, clipped = _chunked_entries(
            lambda s, t, ok: _jsd_rows(s, t, ok, vocab_limit=vocab_limit, **row_options),
            chunk_rows, student, teacher, valid,
        )  # fmt: skip
        support = vocab
        mass = jnp.ones((), rows.dtype)

    valid = valid.reshape(-1)
    per_entry = rows.reshape(-1) * temperature**2
    flat_ids = _flat_sample_ids(mask, sample_ids)
    loss, sample_mean, sample_count = _reduce(per_entry, valid, flat_ids, num_samples, reduction)
    diagnostics = _base_diagnostics(per_entry, valid, mask, sample_mean, sample_count)
    # In float: valid entries x vocabulary can exceed the int32 range.
    num_valid = jnp.maximum(jnp.sum(valid), 1).astype(rows.dtype)
    clip_denominator = num_valid * (support if clip_mode == "entry" else 1)
    diagnostics["clip_fraction"] = jnp.sum(clipped) / clip_denominator
    diagnostics["teacher_topk_mass"] = mass
    diagnostics["negative_fraction"] = _valid_mean((per_entry < 0).astype(rows.dtype), valid)
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
            teacher_logits, token_ids, mask, temperature=temperature, chunk_rows=chunk_rows,
            vocab_limit=vocab_limit,
        )  # fmt: skip
        diagnostics["k1_reverse_kl"] = _valid_mean(
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
    num_samples = _check_common(
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
    temperature = _static_number("temperature", temperature)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    kl_coef = _static_number("kl_coef", kl_coef)
    advantage_clip = _static_number("advantage_clip", advantage_clip)
    if (
        sample_temperature is not None
        and _static_number("sample_temperature", sample_temperature) != temperature
    ):
        warnings.warn(
            f"tinker_loss: loss temperature {temperature} differs from the sampling temperature "
            f"{sample_temperature}; the sampled-token KL estimate is biased",
            stacklevel=2,
        )

    valid = mask.reshape(-1).astype(bool)
    log_p = token_logprobs(
        student_logits, token_ids, mask, temperature=temperature, chunk_rows=chunk_rows,
        vocab_limit=vocab_limit,
    ).reshape(-1)  # fmt: skip
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

    flat_ids = _flat_sample_ids(mask, sample_ids)
    loss, sample_mean, sample_count = _reduce(per_entry, valid, flat_ids, num_samples, reduction)
    diagnostics = _base_diagnostics(per_entry, valid, mask, sample_mean, sample_count)
    stats = lax.stop_gradient
    diagnostics["k1_reverse_kl"] = _valid_mean(stats(behaviour - log_q), valid)
    diagnostics["importance_ratio_mean"] = _valid_mean(stats(ratio), valid)
    diagnostics["importance_ratio_max"] = jnp.max(jnp.where(valid, stats(ratio), 0.0))
    diagnostics["advantage_mean"] = _valid_mean(advantage, valid)
    clipped = (advantage != raw_advantage).astype(ratio.dtype)
    diagnostics["advantage_clip_fraction"] = _valid_mean(clipped, valid)
    surrogate = jnp.where(valid, -advantage * stats(log_p), 0.0)
    diagnostics["pytorch_surrogate"] = _reduce(surrogate, valid, flat_ids, num_samples,
                                               reduction)[0]  # fmt: skip
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
    num_samples = _check_common(
        student_logits,
        mask,
        reduction,
        chunk_rows,
        {"token_ids": token_ids},
        sample_ids,
        num_samples,
    )
    valid = mask.reshape(-1).astype(bool)
    log_p = token_logprobs(student_logits, token_ids, mask, chunk_rows=chunk_rows,
                           vocab_limit=vocab_limit).reshape(-1)  # fmt: skip
    per_entry = jnp.where(valid, -log_p, 0.0)
    flat_ids = _flat_sample_ids(mask, sample_ids)
    loss, sample_mean, sample_count = _reduce(per_entry, valid, flat_ids, num_samples, reduction)
    return loss, _base_diagnostics(per_entry, valid, mask, sample_mean, sample_count)


# ----------------------------------------------------------------------------------------------
# Offline distillation: a teacher cached once (top-k log-probs), the student trained against it
# ----------------------------------------------------------------------------------------------

STUDENT_NORMS = ("full", "top_k")


def teacher_cache_entries(teacher_logits, reference_logits, mask, top_k, *,
                          chunk_rows=DEFAULT_CHUNK_ROWS, vocab_limit=None):  # fmt: skip
    """What the offline cache keeps per entry, from one teacher and one reference forward.

    Returns (top_logprobs [..., C, k] fp32, top_ids [..., C, k] int32, kl [..., C] fp32):
    the teacher's k most likely ids and their log-probabilities (log-softmax over the whole
    vocabulary at temperature 1, as the PyTorch collector stores them: any temperature can be
    applied later, since a top-k renormalisation at tau only needs log-probs up to a constant),
    and KL(teacher || reference) over the full vocabulary at temperature 1 (the VT-sensitivity
    weight when the reference is the same model without the VT images). Entries with mask
    False give 0 / id 0. Chunked over C like the losses, so no [C, V] fp32 tensor exists.
    """
    teacher = _as_leading_rows(lax.stop_gradient(teacher_logits), mask)
    reference = _as_leading_rows(lax.stop_gradient(reference_logits), mask)
    valid = _as_leading_rows(mask, mask).astype(bool)
    vocab_limit = _check_vocab_limit(vocab_limit, teacher.shape[-1])
    vocab = teacher.shape[-1] if vocab_limit is None else vocab_limit
    if not 0 < top_k <= vocab:
        raise ValueError(f"top_k must be in [1, {vocab}] (the usable vocabulary), got {top_k}")

    def chunk(t, r, ok):
        dtype = _compute_dtype(t.dtype)
        exact = mask_vocab(jnp.where(ok[..., None], t.astype(dtype), 0.0), vocab_limit)
        ids = _top_k_ids(exact, top_k)
        logp = jnp.take_along_axis(exact, ids, axis=-1) - jax.nn.logsumexp(exact, axis=-1,
                                                                           keepdims=True)
        # Forward KL(teacher || reference) at tau 1, unclipped: the beta = 0 generalized JSD row.
        kl, _ = _jsd_rows(r, t, ok, beta=0.0, temperature=1.0, clip=0.0, clip_mode="entry",
                          vocab_limit=vocab_limit)  # fmt: skip
        keep = ok[..., None]
        # A KL is >= 0; fp32 cancellation gives ~-1e-9 where the views agree (before the first
        # VT image), which as a weight would flip the sign of a term.
        kl = jnp.maximum(kl, 0.0)
        return (jnp.where(keep, logp, 0.0), jnp.where(keep, ids, 0).astype(jnp.int32), kl)

    top_logprobs, top_ids, kl = _loop_over_chunks(chunk, chunk_rows, (teacher, reference, valid))
    shape = mask.shape
    return (top_logprobs.reshape(shape + (top_k,)), top_ids.reshape(shape + (top_k,)),
            kl.reshape(shape))  # fmt: skip


def _lse_rows(logits, valid, *, temperature, vocab_limit):
    dtype = _compute_dtype(logits.dtype)
    scaled = mask_vocab(jnp.where(valid[..., None], logits.astype(dtype), 0.0), vocab_limit)
    return jnp.where(valid, jax.nn.logsumexp(scaled / temperature, axis=-1), 0.0), ()


def _normalise_weights(weights, valid, sample_ids, num_samples):
    """Entry weights rescaled to mean 1 over each sample's valid entries (a constant).

    Then any reduction of w * l gives, per sample, sum(w l) / sum(w): the PyTorch offline
    trainer's VT-weighted mean. A sample whose weights sum to 0 falls back to weight 1 per
    entry (a plain mean), as there.
    """
    w = jnp.where(valid, lax.stop_gradient(weights).astype(jnp.float32), 0.0)
    segments = jnp.where(valid & (sample_ids >= 0) & (sample_ids < num_samples), sample_ids,
                         num_samples)  # fmt: skip
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
      'top_k' (spec a.1, the online loss): renormalised over the k ids, so the value equals
              generalized_jsd(beta=0, top_k=k, clip=0) on the teacher's logits.
    Per entry l_t = tau**2 * sum_i q_i (log q_i - log p_i). `weights` [..., C] (VT-sensitivity)
    make each sample's value sum(w l) / sum(w) instead of the mean (see `_normalise_weights`);
    then `reduction` as everywhere (module docstring). Gradients flow into the student only.

    Returns (loss, diagnostics) with the common keys.
    """
    num_samples = _check_common(student_logits, mask, reduction, chunk_rows,
                                {"weights": weights}, sample_ids, num_samples)  # fmt: skip
    _check_choice("student_norm", student_norm, STUDENT_NORMS)
    if teacher_top_ids.shape != teacher_top_logprobs.shape or \
            teacher_top_ids.shape[:-1] != mask.shape:  # fmt: skip
        raise ValueError(f"teacher_top_logprobs {teacher_top_logprobs.shape} and teacher_top_ids "
                         f"{teacher_top_ids.shape} must both be {mask.shape} + (k,)")  # fmt: skip
    temperature = _static_number("temperature", temperature)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    vocab_limit = _check_vocab_limit(vocab_limit, student_logits.shape[-1])

    student = _as_leading_rows(student_logits, mask)
    valid = _as_leading_rows(mask, mask).astype(bool)
    keep = valid[..., None]
    ids = jnp.where(keep, _as_leading_rows(teacher_top_ids, mask), 0).astype(jnp.int32)
    dtype = _compute_dtype(student.dtype)
    student_top = jnp.where(keep, jnp.take_along_axis(student, ids, axis=-1).astype(dtype), 0.0)
    student_top = student_top / temperature
    if student_norm == "full":
        lse, _ = _chunked_entries(
            lambda z, ok: _lse_rows(z, ok, temperature=temperature, vocab_limit=vocab_limit),
            chunk_rows, student, valid,
        )  # fmt: skip
        student_logp = student_top - lse[..., None]
    else:
        student_logp = student_top - jax.nn.logsumexp(student_top, axis=-1, keepdims=True)
    teacher = jnp.where(keep, _as_leading_rows(teacher_top_logprobs, mask).astype(dtype), 0.0)
    teacher = lax.stop_gradient(teacher) / temperature
    teacher_logp = teacher - jax.nn.logsumexp(teacher, axis=-1, keepdims=True)
    rows = jnp.sum(_divergence_entries(student_logp, teacher_logp, 0.0), axis=-1)

    valid = valid.reshape(-1)
    per_entry = jnp.where(valid, rows.reshape(-1), 0.0) * temperature**2
    flat_ids = _flat_sample_ids(mask, sample_ids)
    if weights is not None:
        scale = _normalise_weights(weights.reshape(-1), valid, flat_ids, num_samples)
        per_entry = per_entry * scale
    loss, sample_mean, sample_count = _reduce(per_entry, valid, flat_ids, num_samples, reduction)
    return loss, _base_diagnostics(per_entry, valid, mask, sample_mean, sample_count)
