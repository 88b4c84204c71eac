"""On-policy sampling: a batched, jitted KV-cache decode with BAGEL's image-skip rounds.

`sample(model, prompt_pack, rng, ...)` takes B prompt rows (one prompt per row, left-aligned,
with images) and returns each row's completion ids and the log-prob of every sampled token under
the sampling distribution.

1. Prefill: one packed forward over the prompts fills the cache ([L, B, S, 2, Hkv, Dh]: keys,
   after k-norm and RoPE, and values side by side, so a token's pair is one write). Per row we track the cache length and the next RoPE id
   separately: they diverge after an image block, whose tokens share one RoPE id.
2. Decode: one jitted `lax.while_loop` per round. It feeds `<|im_start|>` first (BAGEL's
   generate does), then each step writes the fed token's K/V in place, samples the next token
   (temperature, or greedy), and stops a row at `<|im_end|>` (not appended) or when its budget
   is spent; the loop ends when every row has stopped. Rows never read each other's cache, and
   each row draws from `fold_in(fold_in(fold_in(rng, round), row_id), step)` (`sample` passes
   each round `fold_in(rng, round)`), so a row's random draws do not depend on what else is in
   the batch (its logits can, in the last bits: see engine.py). Vocabulary rows at or past
   `vocab_limit` are never sampled.
3. Image-skip rounds (BAGEL/ThinkMorph quirk): a row that ended a round on `<|im_end|>` right
   and whose round text contains `<image_start>` (detected by decoding: it is ordinary text) gets
   `<|im_end|>` appended to its cache and samples another round, up to `max_image_skips` times.
   The rounds' tokens are concatenated (each later round's leading `<|im_start|>` is not part
   of the completion); `max_new_tokens` is the total over rounds, appended tokens included.

`sample` takes a `DecodeCopy` (opsd_jax/sampling/decode_copy.py: the compute-dtype copy of the
student in a decode layout, made once per training step) and runs under its mesh and rules, or
any nnx model, run as it is under whatever mesh and rules the caller set. The KV cache and the
per-row state are pinned to rows over the batch axes (kv heads over 'tensor'), so with the
weights whole or tensor-split a decode step moves no weight. The state is donated to each
jitted call so the cache is updated in place. With several processes the prompt Pack is the
global one (opsd_jax/parallel/distributed.py `put_rows`) and every process gets every row's completion.

One module of about 550 lines: prefill, the decode round and the image-skip rounds share
the cache layout and the per-row state, and are read together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd

from models.pack import Pack
from models.sharding import constrain
from models.vocab import mask_vocab
from opsd_jax.data import pack_shapes
from opsd_jax.data.packing import SpecialTokens
from opsd_jax.parallel.distributed import rows_array, to_host
from opsd_jax.sampling.decode_copy import DecodeCopy

IMAGE_SKIP_TEXT = "<image_start>"


@dataclasses.dataclass(frozen=True)
class Completions:
    """Host-side sampler output, one entry per prompt row."""

    tokens: np.ndarray  # [B, max_new_tokens] int32, valid up to `lengths`
    lengths: np.ndarray  # [B] completion tokens (no <|im_start|>, no closing <|im_end|>)
    logprobs: np.ndarray  # [B, max_new_tokens] float32: log-prob of each token when sampled
    finished: np.ndarray  # [B] bool: ended on <|im_end|> (False: ran out of budget)
    rounds: np.ndarray  # [B] sampling rounds used (1 + image skips)

    def row(self, b: int) -> list[int]:
        return self.tokens[b, : self.lengths[b]].tolist()

    def rows(self) -> list[list[int]]:
        return [self.row(b) for b in range(len(self.lengths))]


@flax.struct.dataclass
class DecodeState:
    cache: jax.Array  # [L, B, S, 2, Hkv, Dh]: keys at 0, values at 1 of axis 3
    kv_length: jax.Array  # [B] filled cache slots
    rope: jax.Array  # [B] RoPE id of the next fed token
    tokens: jax.Array  # [B, N] completion ids over all rounds
    logprobs: jax.Array  # [B, N]
    length: jax.Array  # [B] completion tokens so far
    budget: jax.Array  # [B] new tokens left (sampled + appended)
    active: jax.Array  # [B] still sampling in this round
    finished: jax.Array  # [B] the last round ended on <|im_end|>


# Logical names of the decode state's axes: rows over the batch axes, kv heads as the rules say.
CACHE_NAMES = (None, "act_batch", None, None, "act_kv_heads", None)  # [L, B, S, 2, Hkv, Dh]


def cache_shape_for(layers: int, rows: int, slots: int, kv_heads: int, head_dim: int) -> tuple:
    """The decode state's cache shape: [L, B, S, 2, Hkv, Dh] (keys, then values)."""
    return (layers, rows, slots, 2, kv_heads, head_dim)


def abstract_decode_state(cache_shape, new_tokens: int, sharding_for, cache_dtype=jnp.bfloat16):
    """A DecodeState of abstract arrays, for compiling decode_round ahead of time (bench/
    scale.py, tests/test_gpu_compile.py). cache_shape: [L, B, S, 2, Hkv, Dh] (cache_shape_for);
    `sharding_for(shape, logical axis names)` lays each array out (e.g. logical_spec on the
    decode mesh under DECODE_RULES): rows over 'act_batch', the cache by CACHE_NAMES."""

    def array(shape, dtype, names):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding_for(shape, names))

    def per_row(dtype, *tail):
        return array((cache_shape[1],) + tail, dtype, ("act_batch",) + (None,) * len(tail))

    return DecodeState(
        cache=array(cache_shape, cache_dtype, CACHE_NAMES),
        kv_length=per_row(jnp.int32),
        rope=per_row(jnp.int32),
        tokens=per_row(jnp.int32, new_tokens),
        logprobs=per_row(jnp.float32, new_tokens),
        length=per_row(jnp.int32),
        budget=per_row(jnp.int32),
        active=per_row(jnp.bool_),
        finished=per_row(jnp.bool_),
    )


def abstract_key(mesh: jax.sharding.Mesh) -> jax.ShapeDtypeStruct:
    """decode_round's random key as an abstract value, replicated on `mesh` (to compile ahead
    of time, as abstract_decode_state does for the state)."""
    key = jax.eval_shape(lambda: jax.random.key(0))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated)


def pinned(state: DecodeState) -> DecodeState:
    """`state` with its layout pinned: without it XLA may replicate the per-row state (and then
    gather each step's tokens) or let the cache follow the weights' layout."""
    rows = lambda x: constrain(x, ("act_batch",) + (None,) * (x.ndim - 1))  # noqa: E731
    return DecodeState(
        cache=constrain(state.cache, CACHE_NAMES),
        **{
            f.name: rows(getattr(state, f.name))
            for f in dataclasses.fields(state)
            if f.name != "cache"
        },
    )


@dataclasses.dataclass(frozen=True)
class RoundSettings:
    """Static (compile-time) sampling settings."""

    temperature: float
    do_sample: bool
    bos_id: int
    eos_id: int
    vocab_limit: int
    max_steps: int


def sample_rows(keys: jax.Array, log_probs: jax.Array) -> jax.Array:
    """One draw per row from softmax(log_probs) by inverting its CDF with one uniform per row.

    Gumbel-max (jax.random.categorical) needs V random numbers per row and step; generating
    them cost more than a small model's whole decode step on CPU. This needs one: the token is
    the first index whose cumulative probability reaches u * total, u in (0, 1]. Zero-probability
    entries (masked vocabulary) have an empty CDF interval and are never drawn.

    Its resolution is float32's: u takes 2^23 values and the CDF's steps near 1 are ~6e-8, so a
    token below about 1e-7 of the total is never drawn and a neighbour takes its share (a review
    counted every u on a 152,064-token distribution with five likely tokens: 1.55e-4 of the
    mass undrawable, a total variation of 1.56e-4 per draw; the log-probs reported stay exact,
    so the rollout-mismatch metric does not show it). Kept: bfloat16 logits, the 7B's, round
    each logit by up to 2^-9 of its size, which moves the distribution far more than this.
    """
    cdf = jnp.cumsum(jnp.exp(log_probs), axis=-1)
    u = 1.0 - jax.vmap(jax.random.uniform)(keys)  # (0, 1]: u = 0 could land on a zero entry
    threshold = u[:, None] * cdf[:, -1:]
    token = jnp.sum(cdf < threshold, axis=-1)
    return jnp.minimum(token, log_probs.shape[-1] - 1).astype(jnp.int32)


def choose_tokens(logits, keys, settings: RoundSettings):
    """(the next token, its log-prob) per row: a draw with each row's key when sampling (keys
    [B]), else the argmax (keys None). Vocabulary rows at or past the limit are never chosen."""
    if settings.do_sample:
        # The draw inverts the CDF over the whole vocabulary: with the vocabulary split over
        # 'tensor', gather the logits once (in their compute dtype) rather than let XLA
        # partition the cumsum in f32. Greedy argmax partitions fine (a max per shard).
        logits = constrain(logits, ("act_batch", None))
    logits = mask_vocab(logits.astype(jnp.float32), settings.vocab_limit)
    scaled = logits / settings.temperature if settings.do_sample else logits
    log_probs = jax.nn.log_softmax(scaled, axis=-1)
    token = sample_rows(keys, log_probs) if settings.do_sample else jnp.argmax(logits, axis=-1)
    token = token.astype(jnp.int32)
    return token, jnp.take_along_axis(log_probs, token[:, None], axis=1)[:, 0]


def sample_step(model, state: DecodeState, feed, keys, settings: RoundSettings):
    """One decode step of the active rows: feed `feed`, choose each row's next token (`keys` as
    in choose_tokens) and record it; a row stops at <|im_end|> (not recorded) or when its budget
    is spent. Returns (token, its log-prob, the state)."""
    capacity = state.tokens.shape[1]
    # Per row (vmap), so the write stays on each device's rows (see DecoderLayer.decode).
    put = jax.vmap(lambda row, at, value: row.at[at].set(value, mode="drop"))
    logits, state = feed_tokens(model, state, feed, state.active)
    token, logprob = choose_tokens(logits, keys, settings)
    is_eos = token == settings.eos_id
    keep = state.active & ~is_eos & (state.budget > 0)
    slot = jnp.where(keep, state.length, capacity)  # out of range: dropped
    state = state.replace(
        tokens=put(state.tokens, slot, token),
        logprobs=put(state.logprobs, slot, logprob),
        length=state.length + keep,
        budget=state.budget - keep,
        finished=jnp.where(state.active, is_eos, state.finished),
    )
    return token, logprob, pinned(state.replace(active=keep & (state.budget > 0)))


def cache_slots_for(prompt_length: int, max_new_tokens: int, max_image_skips: int = 0) -> int:
    """KV-cache slots per row: the prompt row, the completion budget and each round's fed
    <|im_start|> (a skip's appended <|im_end|> counts against the budget), rounded up to a
    multiple of 128 (pack_shapes.MULTIPLE).

    Why rounded: on a GPU XLA splits the decode attention's sum over the slots into blocks, and
    at a slot count with no such factors (7170, the paper recipe's) it pads the products first,
    which kept the layer's value slice from being read in place in the 'tensor' layout: a copy
    of each layer's values every token (0.77 GiB of the step's 5.98, compiled for H100s). At
    7296 nothing is copied; the extra slots cost 1.8% more cache and are never attended."""
    return pack_shapes.round_up(prompt_length + max_new_tokens + (max_image_skips + 1))


def check_prompt_pack(pack: Pack) -> None:
    segments = to_host(pack.segment_ids)
    if segments.max(initial=0) > 1:
        raise ValueError(
            "sample(): every prompt row must hold exactly one prompt (segment id 1); "
            "build it with pack_samples(..., one_sample_per_row=True)"
        )
    real = segments > 0
    if not real.any(axis=1).all():
        raise ValueError("sample(): a prompt row is empty")
    # Left-aligned: real tokens first, padding after.
    if (np.diff(real.astype(np.int8), axis=1) > 0).any():
        raise ValueError("sample(): prompt rows must be left-aligned (padding only at the end)")


# XLA:GPU options of the sampler's programs (ignored by other backends). A decode step feeds
# one token per row, so it is bound by reading the weights from HBM once. With XLA's defaults
# the layer scan's GEMMs are Triton fusions, which cannot read a layer's slice of the stacked
# [layers, ...] weights in place: every token copied each layer's weights into new buffers,
# and the dot merger concatenated q/k/v weights into one matrix per token. Compiled for an H100
# (bench/scale.py), 7B, 16 rows: 40.926 GiB of HBM per decode step with the defaults, 16.596
# GiB with these (the floor, weights + cache, is 14.100 GiB): cuBLAS reads each slice in place
# (dynamic-slice fusion) and q, k, v stay three GEMMs. tests/test_gpu_compile.py holds it.
#
# Command buffers (CUDA graphs): a decode step runs about a thousand small kernels at 7B, and
# launched one by one from the host each costs microseconds. XLA's defaults leave a layer loop
# whose body reads a slice picked by the loop counter (the stacked weights, the cache) outside
# any graph; with WHILE and CONDITIONAL commands and known-count loops unrolled into the graph,
# the token's whole layer stack is one graph launch (opsd_jax/programs/thunk_launches.py counts
# them; bench/scale.py prints the counts with XLA's default command buffers and with these).
# XLA forms them only for a driver of CUDA 12.9 or later (opsd_jax/programs/gpu_targets/*.txtpb
# say so).
# COLLECTIVES_KERNEL is new in jax 0.12's XLA; 0.11's rejects the whole option as an unknown
# enum value, so on an older jax (a GPU image's preinstalled one) the list goes without it.
COMMAND_BUFFER_KINDS_0_11 = (
    "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE,COLLECTIVES"
)
_NEW_XLA = jax.__version_info__ >= (0, 12)
_COMMAND_BUFFER_KINDS = COMMAND_BUFFER_KINDS_0_11 + (",COLLECTIVES_KERNEL" if _NEW_XLA else "")
# Without that type, a small all-reduce (the stop test's, on a mesh of several GPUs), which XLA
# runs as its own Triton kernel by default, is a thunk no command captures, and the token loop
# fell out of the graph: compiled for two H100s under jax 0.11.2, 4 launches and a host sync
# every token. So on a jax before 0.12 the all-reduces are NCCL's, which COLLECTIVES captures:
# no launch and no host sync per token, as under 0.12 (tests/test_gpu_compile.py; the compile
# tests under 0.11.2 in docs/gpus.md). Not yet timed on a GPU.
NCCL_ALL_REDUCES = {"xla_gpu_experimental_use_collective_kernels": ""}
COMMAND_BUFFER_OPTIONS = {
    "xla_gpu_enable_command_buffer": _COMMAND_BUFFER_KINDS,
    "xla_gpu_command_buffer_unroll_loops": True,
    **({} if _NEW_XLA else NCCL_ALL_REDUCES),
}
SAMPLER_COMPILER_OPTIONS = {
    "xla_gpu_enable_triton_gemm": False,
    "xla_gpu_dot_merger_threshold_mb": 0,
    **COMMAND_BUFFER_OPTIONS,
}


# Every jitted function takes the active logical-axis rules as a static argument: jax caches a
# trace per function and mesh, not per rules, and the same mesh may be used with the training
# rules and the decode rules.
# Those given the weights keep every weight as an argument (keep_unused): jit would otherwise
# drop the ones a program does not read (the prefill reads no lm_head, a decode step no ViT),
# and the program's compiled peak, which the preflight reports, would leave out weights that
# are on the device all the same (tests/test_engine.py).
@functools.partial(
    jax.jit,
    static_argnums=(0, 3, 4, 5, 6),
    keep_unused=True,
    compiler_options=SAMPLER_COMPILER_OPTIONS,
)
def prefill_rows(
    graphdef, params, pack: Pack, max_new_tokens: int, cache_slots: int, cache_dtype, rules=()
):
    del rules  # in the cache key only
    model = nnx.merge(graphdef, params)
    _, (k, v) = model.prefill(pack)  # [L, B, T, Hkv, Dh]
    layers, batch, length, kv_heads, head_dim = k.shape
    shape = cache_shape_for(layers, batch, cache_slots, kv_heads, head_dim)
    filled = jnp.stack([k, v], axis=3).astype(cache_dtype)
    cache = jnp.zeros(shape, cache_dtype).at[:, :, :length].set(filled)
    real = pack.segment_ids > 0
    return pinned(
        DecodeState(
            cache=cache,
            kv_length=real.sum(axis=1).astype(jnp.int32),
            rope=(jnp.max(jnp.where(real, pack.positions, -1), axis=1) + 1).astype(jnp.int32),
            tokens=jnp.zeros((batch, max_new_tokens), jnp.int32),
            logprobs=jnp.zeros((batch, max_new_tokens), jnp.float32),
            length=jnp.zeros((batch,), jnp.int32),
            budget=jnp.full((batch,), max_new_tokens, jnp.int32),
            active=jnp.ones((batch,), bool),
            finished=jnp.zeros((batch,), bool),
        )
    )


def feed_tokens(model, state: DecodeState, tokens: jax.Array, write: jax.Array):
    """Write `tokens` (one per row, rows where `write`) into the cache; logits after them."""
    num_slots = state.cache.shape[2]
    slots = jnp.where(write, state.kv_length, num_slots)  # out of range: no write
    kv_length = state.kv_length + write
    logits, cache = model.decode_step(tokens, state.rope, state.cache, slots, kv_length)
    state = state.replace(cache=cache, kv_length=kv_length, rope=state.rope + write)
    return logits, state


@functools.partial(
    jax.jit,
    static_argnums=(0, 5),
    donate_argnums=(2,),
    keep_unused=True,
    compiler_options=SAMPLER_COMPILER_OPTIONS,
)
def _append_token(
    graphdef, params, state: DecodeState, token: jax.Array, rows: jax.Array, rules=()
):
    """Append `token` to the cache of `rows` (it counts against their budget)."""
    del rules  # in the cache key only
    model = nnx.merge(graphdef, params)
    _, state = feed_tokens(model, state, jnp.broadcast_to(token, rows.shape), rows)
    return pinned(state.replace(budget=state.budget - rows, active=rows))


@functools.partial(
    jax.jit,
    static_argnums=(0, 5, 6),
    donate_argnums=(2,),
    keep_unused=True,
    compiler_options=SAMPLER_COMPILER_OPTIONS,
)
def decode_round(
    graphdef, params, state: DecodeState, rng, row_ids, settings: RoundSettings, rules=()
):
    """Feed <|im_start|> to the active rows, then sample until every row has stopped."""
    del rules  # in the cache key only
    batch = state.tokens.shape[0]
    row_keys = jax.vmap(lambda r: jax.random.fold_in(rng, r))(row_ids)

    def cond(carry):
        _, state, _, step = carry
        return (step < settings.max_steps) & jnp.any(state.active)

    def body(carry):
        # The parameters ride in the loop carry (unchanged, not copied) so that the NNX model
        # is merged from values of the loop's own trace, as NNX transforms require.
        params, state, feed, step = carry
        model = nnx.merge(graphdef, params)
        keys = None
        if settings.do_sample:
            keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(row_keys)
        token, _, state = sample_step(model, state, feed, keys, settings)
        return params, state, token, step + 1

    state = pinned(state.replace(finished=state.finished & ~state.active))  # re-decided here
    bos = constrain(jnp.full((batch,), settings.bos_id, jnp.int32), ("act_batch",))
    _, state, _, _ = jax.lax.while_loop(cond, body, (params, state, bos, jnp.zeros((), jnp.int32)))
    return state


def sample(
    model: nnx.Module | DecodeCopy,
    prompt_pack: Pack,
    rng: jax.Array,
    *,
    special: SpecialTokens,
    vocab_limit: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    do_sample: bool = True,
    max_image_skips: int = 0,
    decode_text: Callable[[list[int]], str] | None = None,
    row_ids: np.ndarray | None = None,
    cache_dtype: str = "bfloat16",
) -> Completions:
    """Sample one completion per prompt row (see the module docstring).

    model: a `DecodeCopy` (decoded under its own mesh and rules) or an nnx model (decoded as it
      is, under the caller's context).
    special: the structural ids (`<|im_start|>` is fed first, `<|im_end|>` stops a row).
    vocab_limit: the tokenizer length; logits rows at or past it are never sampled.
    decode_text: ids -> text, needed when max_image_skips > 0 (to find `<image_start>`).
    row_ids: per-row integers mixed into the randomness (default 0..B-1); give each sample a
      stable id to make its draw independent of its batch position.
    """
    check_settings(max_new_tokens, temperature, do_sample, max_image_skips, decode_text)
    check_prompt_pack(prompt_pack)
    batch = prompt_pack.num_rows
    row_ids = np.arange(batch) if row_ids is None else np.asarray(row_ids)
    if row_ids.shape != (batch,):
        raise ValueError(f"row_ids has shape {row_ids.shape}, expected ({batch},)")

    graphdef, params, context = model_parts(model)
    with context():
        return _sample(
            graphdef,
            params,
            prompt_pack,
            rng,
            special,
            vocab_limit,
            max_new_tokens,
            temperature,
            do_sample,
            max_image_skips,
            decode_text,
            row_ids,
            cache_dtype,
        )


def check_settings(max_new_tokens, temperature, do_sample, max_image_skips, decode_text):
    """The sampling settings' errors, each naming its argument."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    if max_image_skips < 0:
        raise ValueError(f"max_image_skips must be >= 0, got {max_image_skips}")
    if max_image_skips and decode_text is None:
        raise ValueError("max_image_skips > 0 needs decode_text (the tokenizer's decode)")


def model_parts(model: nnx.Module | DecodeCopy):
    """(graphdef, params, a context factory) of what sampling runs: a DecodeCopy under its own
    mesh and rules, an nnx model as it is under the caller's."""
    if isinstance(model, DecodeCopy):
        return model.graphdef, model.state, model.activate
    graphdef, params = nnx.split(model)
    return graphdef, params, contextlib.nullcontext


def round_settings(
    special: SpecialTokens, vocab_limit, max_new_tokens, temperature, do_sample
) -> RoundSettings:
    return RoundSettings(
        temperature=float(temperature),
        do_sample=bool(do_sample),
        bos_id=special.im_start,
        eos_id=special.im_end,
        vocab_limit=int(vocab_limit),
        max_steps=max_new_tokens + 1,
    )


def wants_image_skip(finished, budget, round_tokens, decode_text) -> bool:
    """Whether a row that stopped gets another round: it ended on <|im_end|> with room for the
    appended <|im_end|> and at least one more token, and its round's text holds <image_start>."""
    return (
        bool(finished)
        and budget >= 2
        and IMAGE_SKIP_TEXT in decode_text(np.asarray(round_tokens).tolist())
    )


def _sample(
    graphdef,
    params,
    prompt_pack,
    rng,
    special,
    vocab_limit,
    max_new_tokens,
    temperature,
    do_sample,
    max_image_skips,
    decode_text,
    row_ids,
    cache_dtype,
) -> Completions:
    batch = prompt_pack.num_rows
    rules = tuple(spmd.get_logical_axis_rules())
    cache_slots = cache_slots_for(prompt_pack.row_length, max_new_tokens, max_image_skips)
    state = prefill_rows(
        graphdef, params, prompt_pack, max_new_tokens, cache_slots, jnp.dtype(cache_dtype), rules
    )
    settings = round_settings(special, vocab_limit, max_new_tokens, temperature, do_sample)
    # Host-side per-row values go in as arrays sharded like the decode state's rows (with
    # several processes, every jit input must be a global array). The state's, not the prompt's:
    # a DecodeCopy decodes on its own mesh, and jax 0.11 refuses to mix two meshes in one op.
    row_ids = rows_array(row_ids.astype(np.int32), like=state.tokens)
    rounds = np.ones(batch, np.int32)
    round_start = np.zeros(batch, np.int64)
    for round_index in range(max_image_skips + 1):
        state = decode_round(
            graphdef, params, state, jax.random.fold_in(rng, round_index), row_ids, settings, rules
        )
        if round_index == max_image_skips:
            break
        finished, length, budget, tokens = map(
            to_host, (state.finished, state.length, state.budget, state.tokens)
        )
        skip = np.array(
            [
                wants_image_skip(
                    finished[b], budget[b], tokens[b, round_start[b] : length[b]], decode_text
                )
                for b in range(batch)
            ]
        )
        if not skip.any():
            break
        skip_rows = rows_array(skip, like=state.tokens)
        state = _append_token(graphdef, params, state, np.int32(special.im_end), skip_rows, rules)
        rounds += skip
        round_start = np.where(skip, length, round_start)

    # Every process gets every row (small), so host-side decisions agree everywhere.
    return Completions(
        tokens=to_host(state.tokens),
        lengths=to_host(state.length),
        logprobs=to_host(state.logprobs),
        finished=to_host(state.finished),
        rounds=rounds,
    )
