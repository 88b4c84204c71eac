"""The distillation losses, one package with one public API (the names below; the modules'
other names are the package's own):

- online.py: generalized JSD, the sampled-token ("tinker") loss and completion CE (OPSD, SFT);
- offline.py: the KL against a teacher cached once, and the entries the collector caches;
- kernels.py: what they share (argument checks, chunked work over the vocabulary with a
  recomputing backward pass, the sharded top-k, token log-probabilities, the reductions).

The student and the teacher are run teacher-forced on the same sampled completion; row t of the
loss compares their next-token distributions (see docs/opsd_loss.md, section a).
All three losses take logits already gathered at the completion rows, shape [..., C, V] (bf16 in
training, fp32/fp64 in tests), and a `mask` [..., C] of valid entries.

How they stay within memory at C ~ 4k rows and V ~ 152k (chunks over the vocabulary, a
sharded top-k): kernels.py.

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

from models.vocab import mask_vocab
from opsd_jax.training.losses.kernels import (
    CLIP_MODES,
    DEFAULT_CHUNK_ROWS,
    REDUCTIONS,
    token_logprobs,
)
from opsd_jax.training.losses.offline import (
    STUDENT_NORMS,
    cached_top_k_kl,
    teacher_cache_entries,
)
from opsd_jax.training.losses.online import completion_ce, generalized_jsd, tinker_loss

__all__ = [
    "CLIP_MODES",
    "DEFAULT_CHUNK_ROWS",
    "REDUCTIONS",
    "STUDENT_NORMS",
    "cached_top_k_kl",
    "completion_ce",
    "generalized_jsd",
    "mask_vocab",
    "teacher_cache_entries",
    "tinker_loss",
    "token_logprobs",
]
