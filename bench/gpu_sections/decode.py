"""bench/gpu_check.py's `decode` section: the sampler's decode round and its attention kernel.

The decode round on a bf16 copy of the whole BAGEL-7B LM at B rows (one process per B: 1, 8,
32): tokens/s next to the HBM roofline (the weights and the filled KV cache read once per
step), the allocator's peak next to the deviceless prediction; in the B = 8 process, the round
again with XLA's attention output summed over all slots at once (the default sums chunks of
them: `one_value_sum`) and the decode attention kernel alone at the recipe's per-device share;
with 4+ GPUs, the round at B = 8 on the 'tensor' decode layout over 4 of them (its own process).

Fails: at B = 8, tokens/s below MIN_DECODE_ROOFLINE of the roofline (on one GPU and on the
'tensor' layout, per-device bytes); the kernel alone below MIN_KERNEL_HBM of HBM bandwidth.
"""

from __future__ import annotations

import math

from gpu_sections.common import (
    GIB,
    device_peaks,
    emit,
    judged,
    memory_row_value,
    peak_bytes,
    predicted_peak,
    setup_jax,
    target_name,
    timed,
)

# Decode at DECODE_CHECK_BATCH rows (the recipe's rows per device): tokens/s at least this part
# of the HBM roofline (weights and filled cache read once per step). B = 1 and 32 are shown only.
MIN_DECODE_ROOFLINE = 0.60
DECODE_CHECK_BATCH = 8
DECODE_BATCHES = (1, 8, 32)  # rows of the decode round, each in its own process
# The decode attention kernel alone: bytes it must move per second, as a part of HBM bandwidth.
MIN_KERNEL_HBM = 0.60
# The 'tensor' decode case: this many GPUs (BAGEL's 28 / 4 / 16 heads split into whole heads).
DECODE_TENSOR = 4


def run(args):
    """The decode round at B = args.decode_batch rows on a bf16 copy of the whole LM: on one
    device, or with --decode-tensor T on the sampler's 'tensor' layout over T devices (heads,
    MLP and vocabulary split T ways, rows and cache laid out as the sampler pins them). The copy
    is made in place as zeros (decode reads every weight whatever its value), so this process
    never holds fp32 weights and its allocator peak is the decode program's own."""
    jax = setup_jax(args.dry_run, host_devices=DECODE_TENSOR if args.decode_tensor > 1 else 1)
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from models.bagel import Bagel
    from models.configs import BagelConfig
    from models.sharding import logical_spec
    from opsd_jax.data.packing import SpecialTokens
    from opsd_jax.parallel import mesh as mesh_lib
    from opsd_jax.sampling import decode_copy, layout_choice, sampler

    config = (BagelConfig.tiny if args.dry_run else BagelConfig.bagel_7b)(
        llm=dict(compute_dtype="bfloat16")
    )
    lm = config.llm
    batch = args.decode_batch
    # The largest tensor size up to the one asked that splits every head count into whole heads:
    # BAGEL's (28 / 4 / 16) take 4; the dry run's tiny model (4 / 2 / 2) takes 2, on the same path.
    tensor = mesh_lib.tensor_size_for(layout_choice.head_counts(config), args.decode_tensor)
    prompt_len, new_tokens = (64, 16) if args.dry_run else (4096, 256)
    slots = sampler.cache_slots_for(prompt_len, new_tokens)
    cache_shape = sampler.cache_shape_for(
        lm.num_hidden_layers, batch, slots, lm.num_key_value_heads, lm.head_dim
    )
    special = SpecialTokens(*range(lm.vocab_size - 4, lm.vocab_size))
    settings = sampler.round_settings(special, lm.vocab_size, new_tokens, 1.0, True)
    rules = mesh_lib.DECODE_RULES
    make = lambda: Bagel(config, rngs=nnx.Rngs(0))  # noqa: E731

    def fresh_state():
        rows = lambda dtype, *tail: jnp.zeros((batch,) + tail, dtype)  # noqa: E731
        return sampler.DecodeState(
            cache=jnp.zeros(cache_shape, jnp.bfloat16),
            kv_length=jnp.full((batch,), prompt_len, jnp.int32),
            rope=jnp.full((batch,), prompt_len, jnp.int32),
            tokens=rows(jnp.int32, new_tokens),
            logprobs=rows(jnp.float32, new_tokens),
            length=rows(jnp.int32),
            budget=jnp.full((batch,), new_tokens, jnp.int32),
            active=jnp.ones((batch,), bool),
            finished=rows(jnp.bool_),
        )

    def abstract_copy(on_mesh, tensor_size):
        graphdef, abstract = mesh_lib.abstract_model(make, on_mesh)
        layout = "tensor" if tensor_size > 1 else "replicated"
        view = mesh_lib.decode_mesh(on_mesh, layout, tensor_size)
        copy_graphdef, copy = decode_copy.abstract_decode_copy(
            graphdef, abstract, view, jnp.bfloat16
        )
        return copy_graphdef, view, copy

    abstract_state = jax.eval_shape(fresh_state)
    abstract_key = jax.eval_shape(lambda: jax.random.key(0))

    def state_shardings(view):
        """The state as the sampler pins it (sampler.pinned): rows over the batch axes, the
        cache's kv heads as the decode rules say."""

        def names(x):
            if x.ndim == len(sampler.CACHE_NAMES):
                return sampler.CACHE_NAMES
            return ("act_batch",) + (None,) * (x.ndim - 1)

        return jax.tree.map(
            lambda x: NamedSharding(view, logical_spec(x.shape, names(x), view, rules)),
            abstract_state,
        )

    def lower_for(on_mesh):
        graphdef, view, copy = abstract_copy(on_mesh, 1)
        on_view = lambda x, sharding: jax.ShapeDtypeStruct(  # noqa: E731
            x.shape, x.dtype, sharding=sharding
        )
        shardings = state_shardings(view)
        return sampler.decode_round.lower(
            graphdef,
            copy,
            jax.tree.map(on_view, abstract_state, shardings),
            on_view(abstract_key, NamedSharding(view, PartitionSpec())),
            on_view(jax.ShapeDtypeStruct((batch,), jnp.int32), shardings.length),
            settings,
            rules,
        )

    # The prediction is for one GPU: the 'tensor' case skips it (one compile fewer).
    predicted = predicted_peak(lower_for, args, decode=True) if tensor == 1 else None

    mesh = mesh_lib.make_mesh(devices=jax.devices()[:tensor])
    graphdef, view, copy = abstract_copy(mesh, tensor)
    weights = jax.jit(
        lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), copy),
        out_shardings=jax.tree.map(lambda x: x.sharding, copy),
    )()

    def shard_bytes(shape, dtype, sharding):  # what one device holds of it
        return math.prod(sharding.shard_shape(shape)) * jnp.dtype(dtype).itemsize

    # Per device: its shard of the LM's weights on the decode path (not the embedding table, of
    # which a step reads B rows) and of the cache.
    read = sum(
        shard_bytes(x.shape, x.dtype, x.sharding)
        for p, x in jax.tree_util.tree_flatten_with_path(weights)[0]
        if "language_model" in jax.tree_util.keystr(p)
        and "embed_tokens" not in jax.tree_util.keystr(p)
    )
    shardings = state_shardings(view)
    cache_share = shard_bytes(cache_shape, jnp.bfloat16, shardings.cache)  # K and V
    fresh = jax.jit(fresh_state, out_shardings=shardings)
    checked = batch == DECODE_CHECK_BATCH
    # B = 1 and 32 are shown only: one timed run after the warm-up is enough for them.
    repeats = args.repeats if checked else 1

    def timed_round():
        """(median seconds of a round, tokens it sampled, the compiled round), traced afresh."""
        with mesh_lib.use_mesh(view, rules):
            key = jax.device_put(jax.random.key(0), NamedSharding(view, PartitionSpec()))
            row_ids = jax.device_put(jnp.arange(batch, dtype=jnp.int32), shardings.length)
            compiled = sampler.decode_round.lower(
                graphdef, weights, fresh(), key, row_ids, settings, rules
            ).compile()
            seconds, tokens = timed(
                compiled,
                repeats=repeats,
                fresh=lambda: (weights, fresh(), key, row_ids),  # the state is donated
                read=lambda state: int(state.length.sum()) + batch,  # + the fed <|im_start|>
            )
        return seconds, tokens, compiled

    seconds, tokens, compiled = timed_round()
    _, hbm_bw = device_peaks(args)
    mean_cache = cache_share * (prompt_len + new_tokens / 2) / slots
    # tokens/s reading each byte once per step; the devices of the 'tensor' case read their
    # shares in parallel, each step yielding B tokens.
    roofline = hbm_bw / (read + mean_cache) * batch
    tokens_s = tokens / seconds
    if checked:
        rule = f"{MIN_DECODE_ROOFLINE:.0%} of the roofline"
        judge = judged(args, tokens_s / roofline, MIN_DECODE_ROOFLINE, rule)
    else:
        judge = dict(
            ok=True, kind="info", verdict=f"informative (checked at B={DECODE_CHECK_BATCH})"
        )
    where = f" on 'tensor' x{tensor}" if tensor > 1 else ""
    emit(
        section="decode",
        case=f"B={batch}{where}, prompt {prompt_len}, {new_tokens} new tokens",
        value=f"{tokens_s:.0f} tokens/s, roofline {roofline:.0f} ({tokens_s / roofline:.0%})",
        unit=f"{judge['verdict']}; weights {read / GIB:.2f} GiB + cache {mean_cache / GIB:.2f} "
        f"GiB per step{' per device' if tensor > 1 else ''}",
        ok=judge["ok"],
        kind=judge["kind"],
    )
    if tensor > 1:
        return
    emit(
        section="memory",
        case=f"decode B={batch}",
        value=memory_row_value(peak_bytes(), predicted, target_name(args)),
        unit="allocator peak / deviceless compile for the target",
        ok=True,
    )
    if checked:  # after the memory row, so that its allocator peak is the round's alone
        if tensor == 1:
            one_value_sum(timed_round, tokens_s, batch)
        del weights
        decode_kernel_alone(args)


def one_value_sum(timed_round, tokens_s: float, batch: int):
    """The same round with XLA's decode attention summing its output over all slots at once,
    against the chunks of slots a device with 4 kv heads and 8+ rows takes by default
    (models/attention.py CHUNKED_VALUE_SUM_MIN_ROWS): chosen by the compiled program's bytes
    (20.743 against 22.098 GiB a token for the one-GPU recipe), timed here."""
    import jax

    from models import attention

    chosen = attention.CHUNKED_VALUE_SUM_MIN_ROWS
    attention.CHUNKED_VALUE_SUM_MIN_ROWS = 10**9
    jax.clear_caches()  # the form is chosen when the round is traced
    try:
        seconds, tokens, _ = timed_round()
    finally:
        attention.CHUNKED_VALUE_SUM_MIN_ROWS = chosen
        jax.clear_caches()
    emit(
        section="decode",
        case=f"B={batch}, the output in one sum of the slots (not in chunks)",
        value=f"{tokens / seconds:.0f} tokens/s",
        unit=f"the chunks' round {tokens_s / (tokens / seconds):.2f}x its speed (the default "
        f"from {chosen} rows a device, attention.CHUNKED_VALUE_SUM_MIN_ROWS)",
        ok=True,
    )


def decode_kernel_alone(args):
    """The sampler's decode attention kernel (models/decode_attention_pallas.py) alone, at the
    recipe's per-device share under tensor 4 x data 2: 8 rows, one kv head with its 7 query
    heads, every row at 6656 of 7170 slots, 28 layers. Bytes per call: each row's K and V up to
    its length, and the partial outputs the kernel writes and the split combine reads back."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from models import decode_attention_pallas as kernel

    layers, rows, slots, length = (2, 2, 256, 200) if args.dry_run else (28, 8, 7170, 6656)
    q_heads, kv_heads, dim = 7, 1, 128
    # Passes over the layers per dispatch: one pass moves ~0.9 GB, ~0.2 ms at an H200's 4.8
    # TB/s, of which a jitted call's own dispatch and sync (tens of us) would be a large part;
    # over ten passes they are a few percent.
    passes = 1 if args.dry_run else 10
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (rows, q_heads, dim), jnp.bfloat16)
    cache = jax.random.normal(keys[1], (layers, rows, slots, 2, kv_heads, dim), jnp.bfloat16)
    lengths = jnp.full((rows,), length, jnp.int32)

    @jax.jit
    def all_layers(q, cache, lengths):
        # One loop over the layers as the sampler's scan makes it, so one dispatch covers them
        # all; each call's output is the next one's query, so calls neither overlap nor vanish.
        def call(i, q):
            layer = i % layers
            return kernel.filled_cache_attention(q, cache, layer, lengths, interpret=args.dry_run)

        return lax.fori_loop(0, passes * layers, call, q)

    grid = kernel.grid(rows, kv_heads, slots)
    case = f"kernel alone: {layers} x [{rows}, {q_heads}q/{kv_heads}kv], {length}/{slots} slots"
    try:
        seconds, _ = timed(all_layers, q, cache, lengths, repeats=1 if args.dry_run else 5)
    except Exception as error:  # a row that names the case, not only the process's exit
        import traceback

        traceback.print_exc()
        emit(
            section="decode",
            case=case,
            value="error",
            unit=f"{type(error).__name__}: {error}"[:160],
            ok=False,
            kind="check",
        )
        return
    # The kernel writes a float32 output and log-sum-exp per row, kv head, split and query head,
    # which the combine kernel reads back.
    partials = 4 * rows * kv_heads * grid[2] * (q_heads // kv_heads) * (dim + 1)
    per_call = rows * length * kv_heads * dim * 2 * 2 + 2 * partials  # bf16 K, V; partials w + r
    achieved = passes * layers * per_call / seconds
    _, hbm_bw = device_peaks(args)
    rule = f"{MIN_KERNEL_HBM:.0%} of HBM bandwidth"
    judge = judged(args, achieved / hbm_bw, MIN_KERNEL_HBM, rule)
    emit(
        section="decode",
        case=case,
        value=f"{achieved / 1e9:.0f} GB/s ({achieved / hbm_bw:.0%} of "
        f"{hbm_bw / 1e12:.2f} TB/s), {math.prod(grid)} programs",
        unit=f"{judge['verdict']}; grid {grid}, {per_call / 2**20:.1f} MiB per call",
        ok=judge["ok"],
        kind=judge["kind"],
    )
