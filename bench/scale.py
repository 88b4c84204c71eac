"""What one Visual-OPSD step costs at 7B, per device, without a GPU.

Compiles ahead of time, on N simulated CPU devices and with abstract arrays only (no weights are
materialised), the real programs of a training step for `BagelConfig.bagel_7b()` (the
ThinkMorph-7B shapes, understanding-only):

* the grad step: student forward + backward and teacher forward over one micro-batch of student
  and teacher packs, with the paper's JSD settings;
* the optimizer / EMA update;
* the sampler's decode round (one `while_loop` that generates every token of a rollout), on
  the FSDP-sharded fp32 params (how it ran before the decode copy) and on the bf16 decode copy
  in each `sampler_layout` (opsd_jax/sampling/decode_copy.py), with the copy's per-step refresh.

From each program it prints, per device: the bytes of params / optimizer state / EMA teacher,
the compiled argument / output / temp sizes, the FLOPs of every matmul counted through the
layer loops (next to the analytic 6·N·tokens), and the collective bytes by kind, counting
collectives inside loops by their trip count (opsd_jax/parallel/hlo_stats.py reads the program right
after SPMD partitioning: what a GPU build would move, in the dtypes it would move). Then a
roofline projection for a GPU from the table below, the memory headroom, the largest teacher
pack that fits, and the hours for the paper recipe (1000 steps).

    python bench/scale.py                        # configs/thinkmorph_7b.py on 8 devices, H100
    python bench/scale.py --devices 16 --num-replicate 2 --gpu h200
    python bench/scale.py --devices 64 --num-replicate 8
    python bench/scale.py --model tiny           # the same report for the tiny model (seconds)

What a CPU compile cannot know: the GPU's fusions and kernel efficiency (the matmul FLOPs are
exact, the time is a roofline at peak), how much communication overlaps compute (both bounds
are printed), and the CPU's temp buffers differ from a GPU's (the memory figures are the CPU
compiler's, which widens some bf16 buffers to f32: an upper bound, roughly). Attention tiles
run in loops whose trip count depends on the data; their FLOPs are added analytically.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name: (peak dense bf16 FLOP/s, HBM bytes/s, NVLink bytes/s per direction, HBM bytes)
GPUS = {
    # H100 SXM5: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB; NVLink 4: 900 GB/s total
    # (450 GB/s each way). NVIDIA H100 Tensor Core GPU datasheet.
    "h100": (989e12, 3.35e12, 450e9, 80e9),
    # H200 SXM: same compute as H100, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s total.
    # NVIDIA H200 Tensor Core GPU datasheet.
    "h200": (989e12, 4.8e12, 450e9, 141e9),
    # H800 SXM (the paper's GPU): H100 compute and HBM, NVLink cut to 400 GB/s total.
    # NVIDIA H800 product brief.
    "h800": (989e12, 3.35e12, 200e9, 80e9),
}
HEADROOM = 0.15  # keep this share of HBM free (allocator fragmentation, NCCL buffers, ...)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated devices (default 8)")
    parser.add_argument("--num-replicate", type=int, default=1, help="mesh 'data' axis")
    parser.add_argument("--num-tensor", type=int, default=1, help="mesh 'tensor' axis")
    parser.add_argument("--model", choices=("7b", "tiny"), default="7b")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    parser.add_argument("--samples", type=int, default=None,
                        help="samples (and rows) per micro-batch; default: the recipe's, "
                             "times num_replicate")  # fmt: skip
    parser.add_argument("--student-len", type=int, default=6144,
                        help="student row length (image <= 4900 patches + question + 1025)")
    parser.add_argument("--teacher-len", type=int, default=10240,
                        help="teacher row length (max_forward_tokens)")
    parser.add_argument("--student-patches", type=int, default=4900)
    parser.add_argument("--teacher-patches", type=int, default=8192)
    parser.add_argument("--loss-entries", type=int, default=1152, help="C: 1025 rounded up")
    parser.add_argument("--prompt-len", type=int, default=5120, help="sampler prompt rows")
    parser.add_argument("--skip-fit", action="store_true",
                        help="skip the second grad-step compile that finds the largest pack")
    return parser.parse_args()


def main():
    args = parse_args()
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]  # fmt: skip
    os.environ["XLA_FLAGS"] = " ".join(
        flags + [f"--xla_force_host_platform_device_count={args.devices}"])  # fmt: skip
    os.environ["JAX_PLATFORMS"] = "cpu"

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from configs import thinkmorph_7b
    from models.bagel import Bagel
    from models.configs import BagelConfig
    from models.pack import Pack
    from models.sharding import logical_spec
    from opsd_jax.parallel import hlo_stats
    from opsd_jax.parallel import mesh as mesh_lib
    from opsd_jax.sampling import decode_copy, sampler
    from opsd_jax.training import train_config, train_step

    recipe = thinkmorph_7b.get_config()
    samples = args.samples or recipe.samples_per_micro_batch * args.num_replicate
    accum = recipe.gradient_accumulation_steps
    new_tokens = recipe.sample_max_new_tokens
    rounds = recipe.sample_max_image_skips + 1
    if args.model == "tiny":  # the same report in seconds, for trying the script out
        make_config = BagelConfig.tiny
        args.student_len, args.teacher_len = 256, 512
        args.student_patches, args.teacher_patches, args.loss_entries = 64, 128, 128
        args.prompt_len, new_tokens = 128, 64
    else:
        make_config = BagelConfig.bagel_7b
    model_config = make_config(llm=dict(compute_dtype=recipe.compute_dtype, remat=recipe.remat,
                                        attention_backend="chunked"))  # fmt: skip
    llm = model_config.llm
    peak_flops, hbm_bw, link_bw, hbm_bytes = GPUS[args.gpu]
    mesh = mesh_lib.make_mesh(args.num_replicate, None, args.num_tensor)
    n = args.devices
    print(f"bench/scale.py: {args.model} ({llm.num_hidden_layers} layers, hidden "
          f"{llm.hidden_size}) on {n} simulated devices, mesh {dict(mesh.shape)}; micro-batch "
          f"{samples} samples in {samples} rows x {accum} micro-batches; GPU {args.gpu}")  # fmt: skip
    if samples % (args.num_replicate * (n // (args.num_replicate * args.num_tensor))):
        sys.exit(f"--samples {samples} must divide over data x fsdp")

    # ---- abstract model and state (no memory) -----------------------------------------------
    def make_model():
        return Bagel(model_config, rngs=nnx.Rngs(0))

    graphdef, abstract = mesh_lib.abstract_model(make_model, mesh)
    abstract_params, abstract_rest = nnx.split_state(abstract, nnx.Param, ...)
    rest_shardings = jax.tree.map(lambda x: x.sharding, abstract_rest)

    # The non-parameter state (the fixed sin-cos table) is real: the jitted programs close over
    # it. XLA drops the parameters' initialisation, which nothing returns.
    @jax.jit(out_shardings=rest_shardings)
    def make_rest():
        return nnx.split_state(nnx.state(make_model()), nnx.Param, ...)[1]

    with mesh_lib.use_mesh(mesh):
        rest = make_rest()
    optimizer = train_step.make_optimizer(recipe)

    def shard_bytes(tree):
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                   for x in jax.tree.leaves(tree))  # fmt: skip

    # The state train.py compiles its step for: optimizer moments and the EMA laid out like
    # their params, counters replicated.
    abstract_state = train_step.abstract_state(abstract_params, optimizer, "ema",
                                               jax.random.key(0))  # fmt: skip
    params_bytes = shard_bytes(abstract_state.params)
    opt_bytes = shard_bytes(abstract_state.opt_state)
    teacher_bytes = shard_bytes(abstract_state.teacher_params)
    num_params = sum(x.size for x in jax.tree.leaves(abstract_params))
    lm_matmul = sum(x.size for p, x in jax.tree_util.tree_flatten_with_path(abstract_params)[0]
                    if "layers" in jax.tree_util.keystr(p)
                    and "language_model" in jax.tree_util.keystr(p))  # fmt: skip
    gib = 2**30
    print(f"\nper device: params {params_bytes / gib:.2f} GiB (fp32 master, {num_params / 1e9:.2f}"
          f"B parameters), optimizer state {opt_bytes / gib:.2f} GiB, EMA teacher "
          f"{teacher_bytes / gib:.2f} GiB, gradient accumulator {params_bytes / gib:.2f} GiB")  # fmt: skip
    resident = params_bytes + opt_bytes + teacher_bytes + params_bytes

    # ---- programs -----------------------------------------------------------------------------

    def array(shape, dtype):
        spec = jax.sharding.PartitionSpec(mesh_lib.BATCH_AXES, *([None] * (len(shape) - 1)))
        return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))

    def pack(length, patches, entries):
        ids = lambda: array((samples, length), jnp.int32)  # noqa: E731
        vit = lambda: array((samples, patches), jnp.int32)  # noqa: E731
        return Pack(tokens=ids(), positions=ids(), segment_ids=ids(), k_start=ids(), k_end=ids(),
                    vit_patches=array((samples, patches, 588), jnp.float32), vit_pos_ids=vit(),
                    vit_slots=vit(), vit_image_ids=vit(),
                    loss_rows=array((samples, entries), jnp.int32),
                    loss_targets=array((samples, entries), jnp.int32),
                    loss_mask=array((samples, entries), jnp.bool_),
                    loss_sample=array((samples, entries), jnp.int32))  # fmt: skip

    grad_step = train_step.make_grad_step(graphdef, rest, train_config.loss_settings(recipe), "ema")

    def compile_grad(teacher_len, student_len):
        student = pack(student_len, args.student_patches, args.loss_entries)
        teacher = pack(teacher_len, args.teacher_patches, args.loss_entries)
        t0 = time.perf_counter()
        with mesh_lib.use_mesh(mesh):
            lowered = grad_step.lower(abstract_state.params, abstract_state.teacher_params,
                                      student, teacher)  # fmt: skip
            compiled, text = hlo_stats.compile_and_read(lowered)
        return compiled, text, time.perf_counter() - t0

    def report(name, compiled, text, seconds):
        memory = compiled.memory_analysis()
        found = hlo_stats.collectives(text)
        table = hlo_stats.summarize(found)
        flops, floor = hlo_stats.dot_flops(text)
        print(f"\n{name} (compiled in {seconds:.0f} s): arguments "
              f"{memory.argument_size_in_bytes / gib:.2f} GiB, outputs "
              f"{memory.output_size_in_bytes / gib:.2f} GiB, temp {memory.temp_size_in_bytes / gib:.2f}"
              f" GiB per device; matmul FLOPs {flops:.4g} per device"
              + (f" (of which {floor:.3g} in data-dependent loops, counted once)" if floor else ""))  # fmt: skip
        for kind, row in table.items():
            if row["count"]:
                dtypes = sorted({d for c in found if c.kind == kind for d in c.dtypes})
                print(f"  {kind:<18} {row['count']:>6} per call  {row['bytes'] / gib:9.3f} GiB "
                      f"received per device  ({', '.join(dtypes)})")  # fmt: skip
        return memory, table, flops, found

    grad_compiled, grad_text, seconds = compile_grad(args.teacher_len, args.student_len)
    grad_memory, grad_table, grad_flops, grad_found = report(
        f"grad step (student {samples}x{args.student_len}, teacher {samples}x{args.teacher_len}, "
        f"C={args.loss_entries})", grad_compiled, grad_text, seconds)  # fmt: skip

    # Activation collectives: anything that is not a weight or weight gradient (or a scalar).
    f = n // (args.num_replicate * args.num_tensor)
    splits = {f, args.num_tensor, f * args.num_tensor}
    activations = hlo_stats.activation_collectives(grad_found, (abstract_params, rest), splits)
    print(f"  activation collectives: {sum(c.count for c in activations)} per call, "
          f"{sum(c.count * c.moved_bytes for c in activations) / 2**20:.2f} MiB"
          + (" (under tensor parallelism the per-layer all-reduces of the split heads and MLP "
             "are expected here)" if args.num_tensor > 1 else ""))  # fmt: skip
    # Weights are gathered over the fsdp axis only (replicas hold the same shards).
    bf16_param_bytes = num_params * 2 / args.num_tensor
    expected_gather = 3 * bf16_param_bytes / f * (f - 1)
    gathered = grad_table["all-gather"]["bytes"]
    print(f"  all-gather per micro-batch {gathered / gib:.3f} GiB vs (student fwd + student bwd "
          f"re-gather + teacher fwd) x bf16 params / {f} x {f - 1} = {expected_gather / gib:.3f} GiB "
          f"(ratio {gathered / expected_gather:.3f})")  # fmt: skip
    scattered = grad_table["reduce-scatter"]["bytes"] + grad_table["all-reduce"]["bytes"]
    print(f"  gradient reduction per micro-batch {scattered / gib:.3f} GiB = "
          f"{scattered / (bf16_param_bytes / f * (f - 1)):.3f} x (one bf16 copy of the params x "
          f"{f - 1}/{f}): reduce-scatter in bf16, summed into the fp32 accumulator on each shard"
          + ("; with replicas XLA partitions it as one all-reduce over data x fsdp and a slice "
             "(counted as an all-reduce: an upper bound)" if args.num_replicate > 1 else ""))  # fmt: skip

    state_args = (abstract_state, abstract_state.params, 2, jnp.float32(0))
    with mesh_lib.use_mesh(mesh):
        t0 = time.perf_counter()
        update = train_step.make_apply_update(optimizer, "ema", recipe.ema_decay)
        update_compiled, update_text = hlo_stats.compile_and_read(update.lower(*state_args))
    update_memory, update_table, _, _ = report("optimizer + EMA update", update_compiled,
                                               update_text, time.perf_counter() - t0)  # fmt: skip

    # ---- the decode round (rollouts of every sample of the step) ------------------------------
    rows = samples * accum
    slots = args.prompt_len + new_tokens + rounds
    cache_spec = jax.sharding.PartitionSpec(None, mesh_lib.BATCH_AXES)
    cache_shape = (llm.num_hidden_layers, rows, slots, llm.num_key_value_heads, llm.head_dim)
    cache = jax.ShapeDtypeStruct(cache_shape, jnp.bfloat16,
                                 sharding=jax.sharding.NamedSharding(mesh, cache_spec))  # fmt: skip

    def per_row(dtype, *tail):
        return array((rows,) + tail, dtype)

    decode_state = sampler.DecodeState(
        cache=(cache, cache), kv_length=per_row(jnp.int32), rope=per_row(jnp.int32),
        tokens=per_row(jnp.int32, new_tokens), logprobs=per_row(jnp.float32, new_tokens),
        length=per_row(jnp.int32), budget=per_row(jnp.int32), active=per_row(jnp.bool_),
        finished=per_row(jnp.bool_))  # fmt: skip
    settings = sampler._RoundSettings(temperature=1.0, do_sample=True, bos_id=1, eos_id=2,
                                      vocab_limit=llm.vocab_size, max_steps=new_tokens + 1)  # fmt: skip
    model_state = nnx.merge_state(abstract_state.params, rest)
    with mesh_lib.use_mesh(mesh):
        t0 = time.perf_counter()
        lowered = sampler._decode_round.lower(graphdef, model_state, decode_state,
                                              jax.random.key(0), per_row(jnp.int32), settings)  # fmt: skip
        decode_compiled, decode_text = hlo_stats.compile_and_read(lowered)
    _, decode_table, _, _ = report(
        f"decode round ({rows} rows, cache {slots} slots; one while_loop iteration per token)",
        decode_compiled, decode_text, time.perf_counter() - t0)  # fmt: skip
    # The round's loop runs at most max_steps times (it can stop early); counts are at that bound.
    per_token_moved = sum(row["bytes"] for row in decode_table.values()) / settings.max_steps
    cache_bytes = 2 * math.prod(cache_shape) * 2 / (n // args.num_tensor)
    # Per generated token each device reads its weights once (the sampler's parameters as they
    # are: fp32 shards today, then gathered) and its rows' cache.
    weight_read = params_bytes + per_token_moved
    per_token_hbm = weight_read + cache_bytes
    print(f"  per generated token per device: collectives inside the loop "
          f"{per_token_moved / gib:.3f} GiB, HBM read ~{per_token_hbm / gib:.3f} GiB "
          f"(weights + KV cache {cache_bytes / gib:.3f} GiB)")  # fmt: skip

    # ---- the decode copy, per sampler layout (what the sampler decodes on) ---------------------
    # After each update the params become a bf16 copy in a decode layout (one jitted reshard);
    # the decode round runs on it under the decode mesh and rules, as sampler.sample(copy) does.
    layouts = {}
    for layout in mesh_lib.SAMPLER_LAYOUTS:
        view = mesh_lib.decode_mesh(mesh, layout)
        copy = decode_copy.abstract_decode_copy(model_state, view, recipe.compute_dtype)
        refresh = decode_copy.cast_function(model_state, view, recipe.compute_dtype)
        _, refresh_text = hlo_stats.compile_and_read(refresh.lower(model_state))
        refresh_table = hlo_stats.summarize(hlo_stats.collectives(refresh_text))
        refresh_moved = sum(row["bytes"] for row in refresh_table.values())

        def on_view(shape, dtype, names, view=view):
            spec = logical_spec(shape, names, view, mesh_lib.DECODE_RULES)
            return jax.ShapeDtypeStruct(shape, dtype,
                                        sharding=jax.sharding.NamedSharding(view, spec))  # fmt: skip

        def rows_of(dtype, *tail, on_view=on_view):
            return on_view((rows,) + tail, dtype, ("act_batch",) + (None,) * len(tail))

        view_cache = on_view(cache_shape, jnp.bfloat16, sampler._CACHE_NAMES)
        view_state = sampler.DecodeState(
            cache=(view_cache, view_cache), kv_length=rows_of(jnp.int32), rope=rows_of(jnp.int32),
            tokens=rows_of(jnp.int32, new_tokens), logprobs=rows_of(jnp.float32, new_tokens),
            length=rows_of(jnp.int32), budget=rows_of(jnp.int32), active=rows_of(jnp.bool_),
            finished=rows_of(jnp.bool_))  # fmt: skip
        with mesh_lib.use_mesh(view, mesh_lib.DECODE_RULES):
            t0 = time.perf_counter()
            lowered = sampler._decode_round.lower(graphdef, copy, view_state, jax.random.key(0),
                                                  rows_of(jnp.int32), settings,
                                                  mesh_lib.DECODE_RULES)  # fmt: skip
            compiled, text = hlo_stats.compile_and_read(lowered)
        memory, table, _, _ = report(
            f"decode round on the '{layout}' bf16 decode copy (decode mesh {dict(view.shape)})",
            compiled, text, time.perf_counter() - t0)  # fmt: skip
        copy_bytes = shard_bytes(copy)
        view_cache_bytes = 2 * shard_bytes(view_cache)
        moved = sum(row["bytes"] for row in table.values()) / settings.max_steps
        hbm_read = copy_bytes + view_cache_bytes  # each step reads its weights and rows' cache
        token_s = max(hbm_read / hbm_bw, moved / link_bw)
        layouts[layout] = dict(
            token_s=token_s, rollout_s=token_s * new_tokens, refresh_s=refresh_moved / link_bw,
            peak=resident + copy_bytes + memory.temp_size_in_bytes + view_cache_bytes)  # fmt: skip
        print(f"  copy {copy_bytes / gib:.2f} GiB per device, refreshed once per step by "
              f"{refresh_moved / gib:.2f} GiB of all-gather per device; per token step per "
              f"device: HBM read ~{hbm_read / gib:.3f} GiB (copy + KV cache "
              f"{view_cache_bytes / gib:.3f} GiB), moved {moved / 2**20:.3f} MiB")  # fmt: skip

    # ---- projection ----------------------------------------------------------------------------
    tokens_student = samples * args.student_len
    tokens_teacher = samples * args.teacher_len
    analytic = (6 * lm_matmul * tokens_student + 2 * lm_matmul * tokens_student  # + remat
                + 2 * lm_matmul * tokens_teacher) / n  # fmt: skip
    attention = (2 * 2 * llm.num_hidden_layers * llm.num_attention_heads * llm.head_dim *
                 samples * (4 * args.student_len**2 / 2 + args.teacher_len**2 / 2)) / n  # fmt: skip
    compute_s = (grad_flops + attention) / peak_flops
    comm_s = (grad_table["all-gather"]["bytes"] + grad_table["reduce-scatter"]["bytes"]
              + grad_table["all-reduce"]["bytes"]) / link_bw  # fmt: skip
    print(f"\nprojection on {args.gpu} (peak {peak_flops / 1e12:.0f} TFLOP/s bf16, HBM "
          f"{hbm_bw / 1e12:.2f} TB/s, NVLink {link_bw / 1e9:.0f} GB/s per direction):")  # fmt: skip
    print(f"  grad step: matmul FLOPs {grad_flops:.4g} per device (analytic 6·N·tokens + remat "
          f"re-forward + teacher 2·N·tokens = {analytic:.4g}, N = {lm_matmul / 1e9:.2f}B LM "
          f"layer params) + attention ~{attention:.3g} (causal, analytic)")  # fmt: skip
    print(f"  grad step: compute {compute_s:.2f} s at peak, communication {comm_s:.2f} s -> "
          f"{max(compute_s, comm_s):.2f} s (fully overlapped) .. {compute_s + comm_s:.2f} s "
          f"(none overlapped) per micro-batch")  # fmt: skip
    decode_token_s = max(per_token_hbm / hbm_bw, per_token_moved / link_bw)
    rollout_s = decode_token_s * new_tokens
    rows_per_device = rows // (n // args.num_tensor)
    print(f"  decode on the FSDP params (before the decode copy): {decode_token_s * 1e3:.2f} ms "
          f"per token step (HBM {per_token_hbm / hbm_bw * 1e3:.2f} "
          f"ms, interconnect {per_token_moved / link_bw * 1e3:.2f} ms) -> "
          f"{rows_per_device / decode_token_s:.0f} tokens/s per GPU; a {new_tokens}-token rollout "
          f"of {rows} rows {rollout_s:.1f} s; bound reading bf16 weights + cache once per step "
          f"{(num_params * 2 / (n if args.num_tensor > 1 else 1) + cache_bytes) / hbm_bw * 1e3:.2f} ms")  # fmt: skip
    for layout, row in layouts.items():
        print(f"  decode on the '{layout}' copy: {row['token_s'] * 1e3:.2f} ms per token step -> "
              f"{rows / n / row['token_s']:.0f} tokens/s per GPU; a {new_tokens}-token rollout of "
              f"{rows} rows {row['rollout_s']:.1f} s, + refresh {row['refresh_s'] * 1e3:.1f} ms "
              f"per step")  # fmt: skip
    # The step samples on the copy in the recipe's layout.
    sampling_s = layouts[recipe.sampler_layout]["rollout_s"] + layouts[recipe.sampler_layout][
        "refresh_s"]
    step_low = accum * max(compute_s, comm_s) + sampling_s
    step_high = accum * (compute_s + comm_s) + sampling_s
    hours = lambda s: s * recipe.total_steps / 3600  # noqa: E731
    print(f"  step: {step_low:.1f} .. {step_high:.1f} s ({accum} micro-batches + "
          f"'{recipe.sampler_layout}' refresh and rollout); "
          f"paper recipe ({recipe.total_steps} steps): {hours(step_low):.1f} .. "
          f"{hours(step_high):.1f} h")  # fmt: skip

    # ---- memory --------------------------------------------------------------------------------
    grad_peak = resident + grad_memory.temp_size_in_bytes + grad_memory.output_size_in_bytes
    decode_peak = layouts[recipe.sampler_layout]["peak"]  # training state + copy + cache
    budget = hbm_bytes * (1 - HEADROOM)
    print(f"\nmemory per device on {args.gpu} ({hbm_bytes / 1e9:.0f} GB, keep {HEADROOM:.0%} free "
          f"-> {budget / gib:.1f} GiB): resident state {resident / gib:.2f} GiB; grad step peak "
          f"{grad_peak / gib:.2f} GiB ({grad_peak / hbm_bytes:.0%}); decode peak "
          f"('{recipe.sampler_layout}' copy) "
          f"{decode_peak / gib:.2f} GiB ({decode_peak / hbm_bytes:.0%})")  # fmt: skip
    print("  fits" if max(grad_peak, decode_peak) <= budget else "  DOES NOT FIT")
    if not args.skip_fit:
        # Temp memory is linear in the pack lengths (attention included): compile once more with
        # both rows twice as long and extrapolate to the HBM budget.
        compiled2, _, _ = compile_grad(2 * args.teacher_len, 2 * args.student_len)
        temp1, temp2 = grad_memory.temp_size_in_bytes, compiled2.memory_analysis().temp_size_in_bytes
        slope = (temp2 - temp1) / args.teacher_len  # bytes per teacher token (+ its student share)
        base = grad_peak - slope * args.teacher_len
        ratio = args.student_len / args.teacher_len
        for gpu in sorted(GPUS):
            room = GPUS[gpu][3] * (1 - HEADROOM)
            fit = int((room - base) / slope) if slope > 0 else 0
            print(f"  largest pack on {gpu}: teacher rows of {fit:,} tokens with student rows of "
                  f"{int(fit * ratio):,} ({samples // (n // args.num_tensor)} row(s) of each per "
                  f"device; temp grows {slope / 2**20:.3f} MiB per teacher token, measured at "
                  f"{args.teacher_len} and {2 * args.teacher_len})")  # fmt: skip
    print("\nNot known from a CPU compile: GPU fusion and kernel efficiency (times above are at "
          "peak FLOP/s), how much communication overlaps compute (both bounds shown), and GPU "
          "temp sizes (the CPU compiler's are shown; it widens some bf16 buffers to f32).")


if __name__ == "__main__":
    main()
