"""The machinery the losses share (online.py, offline.py): argument checks, chunked work over
the vocabulary with a recomputing backward pass, the sharded top-k, the per-entry divergence
terms, token log-probabilities and the reductions. Names without a leading underscore are used
by the package's other modules; of them only `token_logprobs` and the constants are part of the
package's public API (__init__.py). Names with one are this module's own.

Why chunks: at C ~ 4k loss rows and V ~ 152k, one fp32 [C, V] tensor is 2.5 GB and a naive JSD
(log-softmax of both sides, mixture, entries, their gradients) needs ~30 GB of temporaries for
value and gradient (bench/losses.py). So no [C, V] fp32 tensor exists here; work over the
vocabulary runs in chunks of `chunk_rows` loss rows (taken along C, for all leading rows at once,
so a chunk is [prod(leading dims), chunk_rows, V]):

* top-k mode (default k = 256): per chunk, the teacher's top-k ids are selected and the teacher
  mass they hold is measured; then both sides are gathered at those ids in their input dtype
  and only the [..., C, k] slices are upcast to fp32;
* full-vocabulary mode and token log-probabilities: a loop over chunks with a hand-written VJP
  that recomputes each chunk in the backward pass and writes its gradient slice in place.

Chunks never split the leading (batch) dims, and the top-k selection carries a partitioning
rule, so with packed rows sharded over devices each device works on its own rows only.

One module, a little over 400 lines: the chunk loop, its backward pass and the per-entry terms it
evaluates are one mechanism, read together.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from models.vocab import mask_vocab

REDUCTIONS = ("seq_mean", "token_mean", "token_sum")
CLIP_MODES = ("entry", "token")
# Loss rows per chunk: [128, 152064] fp32 is 74 MiB per intermediate and per leading row.
DEFAULT_CHUNK_ROWS = 128


# ----------------------------------------------------------------------------------------------
# Argument checking
# ----------------------------------------------------------------------------------------------


def static_number(name, value):
    """`value` as a Python float; a traced value cannot decide Python branches, so reject it."""
    try:
        return float(value)
    except (TypeError, jax.errors.ConcretizationTypeError) as err:
        raise ValueError(
            f"{name} must be a Python number (static under jit), got {value!r}"
        ) from err


def check_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def check_common(logits, mask, reduction, chunk_rows, per_entry, sample_ids, num_samples):
    """Shape and option checks shared by the losses; returns the resolved number of samples."""
    check_choice("reduction", reduction, REDUCTIONS)
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


def check_vocab_limit(vocab_limit, vocab):
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


def compute_dtype(dtype):
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


def loop_over_chunks(entry_fn, chunk, arrays):
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


def chunked_entries(entry_fn: Callable, chunk: int, diff_input, *const_inputs):
    """Evaluate `entry_fn(diff_chunk, *const_chunks) -> (values [L, n], aux)` over C-chunks.

    `values` is differentiable with respect to `diff_input` only; `aux` (a pytree of
    [L, n, ...] arrays) and all `const_inputs` are treated as constants. A plain loop under
    autodiff would keep every chunk's intermediates (or accumulate a full-size zero cotangent
    per chunk), so the VJP is written by hand: the backward pass re-runs each chunk under
    `jax.vjp` and writes its [L, n, V] gradient slice into one buffer of the input's dtype.
    """

    @jax.custom_vjp
    def run(diff, *consts):
        return loop_over_chunks(entry_fn, chunk, (diff, *consts))

    def run_fwd(diff, *consts):
        return loop_over_chunks(entry_fn, chunk, (diff, *consts)), (diff, consts)

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


def as_leading_rows(array, mask):
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


def divergence_entries(student_logp, teacher_logp, beta):
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


def jsd_rows(student, teacher, valid, *, beta, temperature, clip, clip_mode, vocab_limit=None):
    """Generalized JSD of each loss row over the last axis, before the temperature**2 factor.

    `student` and `teacher` are [..., n, K] logits over the support (a top-k slice or the full
    vocabulary), `valid` [..., n]. Returns (row values [..., n], clipped counts [..., n]);
    invalid rows give 0 for both.
    """
    dtype = compute_dtype(student.dtype)
    keep = valid[..., None]
    student = mask_vocab(jnp.where(keep, student.astype(dtype), 0.0), vocab_limit) / temperature
    teacher = mask_vocab(jnp.where(keep, teacher.astype(dtype), 0.0), vocab_limit) / temperature
    student_logp = student - jax.nn.logsumexp(student, axis=-1, keepdims=True)
    teacher_logp = teacher - jax.nn.logsumexp(teacher, axis=-1, keepdims=True)
    entries = divergence_entries(student_logp, teacher_logp, beta)
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
def top_k_ids(values, k):
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


top_k_ids.def_partition(
    partition=_top_k_partition,
    infer_sharding_from_operands=lambda k, mesh, arg_shapes, result_shape: _top_k_sharding(
        mesh, arg_shapes[0]
    ),
    sharding_rule="... v -> ... k",
    need_replication_factors=("v",),
)


def teacher_top_k(teacher, valid, k, temperature, vocab_limit=None):
    """For a chunk of teacher rows [..., n, V]: top-k ids, the logits there, the mass they hold.

    The selection uses the input (bf16) logits. Each chunk is upcast exactly before lax.top_k
    because XLA:CPU only has a fast TopK kernel for fp32 (for bf16 it sorts whole rows, ~20x
    slower); the cast is monotone and exact, so the selected set is the same. Ids at or past
    `vocab_limit` are -inf, so they are never selected (k < vocab_limit) and hold no mass.
    """
    dtype = compute_dtype(teacher.dtype)
    keep = valid[..., None]
    exact = mask_vocab(jnp.where(keep, teacher.astype(dtype), 0.0), vocab_limit)
    ids = top_k_ids(exact, k)
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
    dtype = compute_dtype(logits.dtype)
    scaled = mask_vocab(jnp.where(valid[..., None], logits.astype(dtype), 0.0), vocab_limit)
    scaled = scaled / temperature
    ids = jnp.clip(jnp.where(valid, token_ids, 0), 0, logits.shape[-1] - 1)
    picked = jnp.take_along_axis(scaled, ids[..., None].astype(jnp.int32), axis=-1)[..., 0]
    logp = picked - jax.nn.logsumexp(scaled, axis=-1)
    return jnp.where(valid, logp, 0.0), ()


def token_logprobs(
    logits,
    token_ids,
    mask=None,
    *,
    temperature=1.0,
    chunk_rows=DEFAULT_CHUNK_ROWS,
    vocab_limit=None,
):
    """log softmax(logits / temperature)[token_ids] for every entry, shape [..., C] (fp32).

    Differentiable with respect to `logits`; the log-sum-exp runs over chunks of `chunk_rows`
    loss rows so no [C, V] fp32 tensor exists. Entries with mask False give 0. `token_ids` must
    lie in [0, V) (out-of-range ids are clamped). `vocab_limit`: the softmax runs over ids below
    it only (see `mask_vocab`), as the sampler's does.
    """
    mask = jnp.ones(logits.shape[:-1], bool) if mask is None else mask
    check_common(logits, mask, "token_sum", chunk_rows, {"token_ids": token_ids}, None, None)
    temperature = static_number("temperature", temperature)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    vocab_limit = check_vocab_limit(vocab_limit, logits.shape[-1])

    def row_fn(z, ids, ok):
        return _token_logprob_rows(z, ids, ok, temperature=temperature, vocab_limit=vocab_limit)

    logp, _ = chunked_entries(
        row_fn,
        chunk_rows,
        as_leading_rows(logits, mask),
        as_leading_rows(token_ids, mask),
        as_leading_rows(mask, mask).astype(bool),
    )
    return logp.reshape(mask.shape)


def flat_sample_ids(mask, sample_ids):
    if sample_ids is None:
        # One sample per leading row: entry (r, c) belongs to sample r.
        return jnp.arange(mask.size, dtype=jnp.int32) // mask.shape[-1]
    return sample_ids.reshape(-1).astype(jnp.int32)


def reduce_entries(per_entry, valid, sample_ids, num_samples, reduction):
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


def valid_mean(values, valid):
    return jnp.sum(jnp.where(valid, values, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def base_diagnostics(per_entry, valid, mask, sample_mean, sample_count):
    return {
        "per_token": per_entry.reshape(mask.shape),
        "per_sample": sample_mean,
        "sample_count": sample_count,
        "num_tokens": jnp.sum(valid).astype(jnp.float32),
    }
