"""The vocabulary rows of the lm_head that are no token."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


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
