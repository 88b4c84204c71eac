"""What a session with a GPU runs first: one command, one table, measured on the GPU.

    pip install -r requirements-gpu.txt
    python bench/gpu_check.py                      # on one H100 / H200, about 5-8 minutes
    python bench/gpu_check.py --dry-run            # anywhere: every step but the timings

Sections, each in its own process (so a crash or an out-of-memory costs one line, and each
program's peak memory is its own):

  parity     the Pallas attention kernel against the dense `reference` backend, forward and
             dq / dk / dv, at BAGEL's LLM shapes (28 query / 4 kv heads, head dim 128) and
             SigLIP's (16 / 16 heads, head dim 72), bf16 inputs, on packed BAGEL-style rows;
             and the sampler's decode attention kernel against XLA's;
  attention  Pallas vs cuDNN vs chunked, forward + backward, at 4k / 10k / 16k / 40k tokens
             (bench/attention.py, each case in its own process);
  grad_step  one BAGEL-7B-shaped grad step (the recipe's student and teacher rows, the full
             SigLIP, `--layers` LM layers of the 7B width: all 28 do not fit one GPU with a
             teacher and gradients), its time and MFU (matmul FLOPs read from the compiled
             program, attention counted analytically, against the GPU's dense bf16 peak);
  decode     the sampler's decode round on a bf16 copy of the whole BAGEL-7B LM at B = 1, 8, 32
             rows: tokens/s next to the HBM roofline (the weights and the filled KV cache read
             once per step);

and for grad_step and decode the peak memory the allocator saw next to what the same program
compiled for the `--target` GPU without one predicts (opsd_jax/parallel/gpu_target.py, the
figure bench/scale.py prints): their ratio says how far to trust scale.py.

`--dry-run` runs all of it on the CPU with tiny shapes (the Pallas kernel in its interpreter,
programs compiled for the target without running them on it), so the script is known to start
and to reach its table; no timing it prints means anything. The last line names what failed.

One script of over 600 lines: what a session with a GPU runs first, as one command (parity,
kernel timings, memory, the table), so a short lease is spent in one call.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RESULT = "RESULT "  # prefix of the lines a section's process prints
SECTIONS = ("parity", "attention", "grad_step", "decode")
DECODE_BATCHES = (1, 8, 32)  # rows of the decode round, each in its own process
# Dense bf16 peak FLOP/s and HBM bytes/s by device kind (datasheets; bench/scale.py's table).
PEAKS = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12), "H800": (989e12, 3.35e12)}
GIB = 2**30


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU, tiny shapes, no meaningful timings: check that it all runs",
    )
    parser.add_argument(
        "--target",
        choices=("h100", "h200", "h800"),
        default=None,
        help="the GPU the predictions are compiled for (default: this GPU's "
        "kind, h100 in a dry run)",
    )
    parser.add_argument("--layers", type=int, default=4, help="LM layers of the grad step")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--section", help=argparse.SUPPRESS)  # run one section, print RESULTs
    parser.add_argument("--decode-batch", type=int, default=1, help=argparse.SUPPRESS)
    return parser.parse_args()


# ---- shared helpers (inside a section's process) ------------------------------------------------


def setup_jax(dry_run: bool):
    if dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import jax

    return jax


def emit(**row):
    print(RESULT + json.dumps(row), flush=True)


def timed(fn, *args, repeats=3):
    """(median seconds of fn(*args) after one warm-up, its last output)."""
    import jax

    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def peak_bytes():
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def program_peak(compiled) -> int:
    m = compiled.memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


def target_name(args) -> str:
    if args.target:
        return args.target
    import jax

    kind = jax.devices()[0].device_kind if not args.dry_run else ""
    for name in ("H200", "H800", "H100"):
        if name in kind:
            return name.lower()
    return "h100"


def device_peaks(args):
    """(dense bf16 FLOP/s, HBM bytes/s) of the GPU this runs on (the target's in a dry run)."""
    return PEAKS[target_name(args).upper()]


def predicted_peak(lower_for, args, decode: bool = False) -> int:
    """Peak bytes of a program compiled for the target GPU without one: `lower_for(mesh)` lowers
    it with its arguments laid out on `mesh` (one compile-only device), under the training rules
    or, for the sampler, the decode rules."""
    from opsd_jax.parallel import gpu_target
    from opsd_jax.parallel import mesh as mesh_lib

    mesh = gpu_target.make_mesh(target_name(args), 1)
    rules = mesh_lib.DECODE_RULES if decode else mesh_lib.LOGICAL_RULES
    with mesh_lib.use_mesh(mesh, rules):
        return program_peak(gpu_target.compile(lower_for(mesh), mesh))


# ---- sections -----------------------------------------------------------------------------------


def section_parity(args):
    """Pallas vs reference, forward and gradients, LLM and SigLIP head layouts."""
    jax = setup_jax(args.dry_run)
    import jax.numpy as jnp
    import numpy as np

    from models.attention import attention
    from models.attention_pallas import range_attention

    rng = np.random.default_rng(0)
    cases = [
        ("LLM 28q/4kv/128", 28, 4, 128, 256 if args.dry_run else 4096),
        ("SigLIP 16/16/72", 16, 16, 72, 128 if args.dry_run else 4900),
    ]
    if args.dry_run:  # fewer heads (the interpreter is slow), the same head dims and grouping
        cases = [(cases[0][0], 4, 1, 128, cases[0][4]), (cases[1][0], 2, 2, 72, cases[1][4])]
    for name, hq, hkv, d, length in cases:
        # Packed rows: samples of 1024 tokens opening with a 256-token image block (LLM), or
        # whole images attending within themselves (SigLIP: one segment per image).
        seg = np.zeros(length, np.int32)
        k_start = np.zeros(length, np.int32)
        k_end = np.arange(1, length + 1, dtype=np.int32)
        sample = 1024 if "LLM" in name else 1225
        for i, start in enumerate(range(0, length, sample)):
            end = min(start + sample, length)
            seg[start:end], k_start[start:end] = i + 1, start
            k_end[start : end if "SigLIP" in name else min(start + 256, end)] = (
                end if "SigLIP" in name else min(start + 256, end)
            )
        ids = [jnp.asarray(x[None]) for x in (seg, seg, k_start, k_end)]
        q = jnp.asarray(rng.normal(size=(1, length, hq, d)), jnp.bfloat16)
        k, v = (jnp.asarray(rng.normal(size=(1, length, hkv, d)), jnp.bfloat16) for _ in "kv")
        cot = jnp.asarray(rng.normal(size=(1, length, hq, d)), jnp.float32)

        def run(fn):
            def loss(q, k, v):
                return jnp.sum(fn(q, k, v).astype(jnp.float32) * cot)

            out = jax.jit(fn)(q, k, v)
            grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
            return [np.asarray(x, np.float32) for x in (out, *grads)]

        def pallas(q, k, v):
            return range_attention(
                q,
                k,
                v,
                q_segment_ids=ids[0],
                kv_segment_ids=ids[1],
                k_start=ids[2],
                k_end=ids[3],
                interpret=args.dry_run,
            )

        def reference(q, k, v):
            return attention(
                q.astype(jnp.float32),
                k.astype(jnp.float32),
                v.astype(jnp.float32),
                q_segment_ids=ids[0],
                kv_segment_ids=ids[1],
                k_start=ids[2],
                k_end=ids[3],
                backend="reference",
            )

        got, want = run(pallas), run(reference)
        errors = [
            float(np.max(np.abs(a - b))) / max(1.0, float(np.max(np.abs(b))))
            for a, b in zip(got, want)
        ]
        # bf16 inputs, fp32 accumulation: the output's bf16 rounding (2^-8) bounds the error.
        emit(
            section="parity",
            case=f"{name}, T={length}",
            value=" / ".join(f"{e:.1e}" for e in errors),
            unit="max error out / dq / dk / dv (vs reference)",
            ok=bool(max(errors) < 2e-2),
        )

    # The sampler's decode attention kernel on the stacked cache against XLA's on the layer's
    # slice, rows of lengths from 1 to the whole cache.
    from models.attention import decode_attention
    from models.decode_attention_pallas import filled_cache_attention

    layers, rows, slots, hq, hkv = (2, 4, 256, 7, 1) if args.dry_run else (2, 8, 4160, 28, 4)
    q = jnp.asarray(rng.normal(size=(rows, hq, 128)), jnp.bfloat16)
    k, v = (
        jnp.asarray(rng.normal(size=(layers, rows, slots, hkv, 128)), jnp.bfloat16) for _ in "kv"
    )
    lengths = jnp.asarray(np.linspace(1, slots, rows).astype(np.int32))
    got = jax.jit(lambda *a: filled_cache_attention(*a, interpret=args.dry_run))(
        q, k, v, jnp.int32(1), lengths
    )
    want = decode_attention(
        q.astype(jnp.float32), k[1].astype(jnp.float32), v[1].astype(jnp.float32), lengths
    )
    error = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
    emit(
        section="parity",
        case=f"decode {hq}q/{hkv}kv/128, {slots} slots",
        value=f"{error:.1e}",
        unit="max error out (vs XLA decode attention, fp32)",
        ok=bool(error < 2e-2),
    )


def section_attention(args):
    """bench/attention.py's table for the three backends at BAGEL's LLM layout."""
    command = [
        sys.executable,
        os.path.join(ROOT, "bench", "attention.py"),
        "--check",
        "--repeats",
        str(args.repeats),
    ]
    if args.dry_run:
        command += [
            "--seq-lens",
            "256",
            "--backends",
            "pallas",
            "chunked",
            "--interpret",
            "--q-heads",
            "4",
            "--kv-heads",
            "1",
            "--head-dim",
            "128",
        ]
    else:
        command += [
            "--seq-lens",
            "4096",
            "10240",
            "16384",
            "40960",
            "--backends",
            "pallas",
            "cudnn",
            "chunked",
            "--q-heads",
            "28",
            "--kv-heads",
            "4",
            "--head-dim",
            "128",
            "--dtype",
            "bfloat16",
            "--max-run-gib",
            "100",
        ]
    env = dict(os.environ, **({"JAX_PLATFORMS": "cpu"} if args.dry_run else {}))
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    for line in done.stdout.splitlines():
        parts = line.split()
        if parts and parts[0].isdigit() and len(parts) >= 8:
            emit(
                section="attention",
                case=f"T={parts[0]} {parts[1]}",
                value=f"f+b {parts[4]} ms ({parts[5]} TF/s), fwd {parts[2]} ms",
                unit=" ".join(parts[8:]) or "",
                ok=parts[4] != "—" or args.dry_run,
            )
    if done.returncode:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        emit(
            section="attention",
            case="bench/attention.py",
            value=f"exit {done.returncode}",
            unit=tail[:120],
            ok=False,
        )


def bagel_packs(config, rows, student_len, teacher_len, entries, image_side, rng):
    """A student and a teacher Pack as OPSD builds them: [image, question, completion] and
    [image, question, VT image, completion] per row, the completion scored (numpy)."""
    import numpy as np

    from models.pack import pad_pack
    from opsd_jax.data.packing import Image, SpecialTokens, Text, pack_samples

    grid = config.vit.image_size // config.vit.patch_size
    vocab = config.llm.vocab_size
    special = SpecialTokens(vocab - 4, vocab - 3, vocab - 2, vocab - 1)

    def image(side_r, side_c):
        pos = (np.arange(side_r)[:, None] * grid + np.arange(side_c)[None]).reshape(-1)
        return Image(rng.uniform(-1, 1, (pos.size, 588)).astype(np.float32), pos.astype(np.int32))

    def text(n, loss=False):
        return Text(rng.integers(0, vocab - 8, n).tolist(), loss=loss)

    completion = text(entries - 1, loss=True)
    problem = image(image_side, image_side)
    vt_rows = max(1, min(image_side, (teacher_len - student_len) // image_side - 1))
    students, teachers = [], []
    for _ in range(rows):
        question_len = student_len - len(problem.patches) - entries - 8
        question = text(max(8, question_len))
        students.append([problem, question, completion])
        teachers.append([problem, question, image(vt_rows, image_side), completion])

    def patches(samples):
        return max(sum(len(i.patches) for i in s if isinstance(i, Image)) for s in samples)

    student = pack_samples(students, student_len, num_rows=rows, special=special)
    teacher = pack_samples(teachers, teacher_len, num_rows=rows, special=special)
    student = pad_pack(student, student_len, patches(students), entries)
    teacher = pad_pack(teacher, teacher_len, patches(teachers), entries)
    return student, teacher


def section_grad_step(args):
    jax = setup_jax(args.dry_run)
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from configs import thinkmorph_7b
    from models.bagel import Bagel
    from models.configs import BagelConfig
    from opsd_jax import run_config
    from opsd_jax.parallel import hlo_stats
    from opsd_jax.parallel import mesh as mesh_lib
    from opsd_jax.training import train_step

    recipe = thinkmorph_7b.get_config()
    llm = dict(
        compute_dtype="bfloat16",
        remat="full",
        attention_backend="pallas" if not args.dry_run else "chunked",
    )
    if args.dry_run:
        config = BagelConfig.tiny(llm=llm)
        student_len, teacher_len, entries, side = 256, 384, 64, 8
    else:  # the recipe's rows: a 70 x 70-patch problem image (4900), a VT image, C = 1152
        config = BagelConfig.bagel_7b(llm=dict(llm, num_hidden_layers=args.layers))
        student_len, teacher_len, entries, side = 6144, 10240, 1152, 70
    mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
    student, teacher = bagel_packs(
        config, 1, student_len, teacher_len, entries, side, np.random.default_rng(0)
    )
    settings = run_config.loss_settings(recipe)
    make = lambda: Bagel(config, rngs=nnx.Rngs(0))  # noqa: E731

    from opsd_jax.parallel import gpu_target

    rest_values = gpu_target.host_rest(make)  # the sin-cos table the step closes over

    def lower_for(on_mesh):
        graphdef, abstract = mesh_lib.abstract_model(make, on_mesh)
        params, _ = nnx.split_state(abstract, nnx.Param, ...)
        step = train_step.make_grad_step(graphdef, rest_values, settings, "ema")
        packs = [
            jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(
                    x.shape, x.dtype, sharding=mesh_lib.batch_sharding(on_mesh, x.ndim)
                ),
                p,
            )
            for p in (student, teacher)
        ]
        return step.lower(params, params, *packs)

    predicted = predicted_peak(lower_for, args)
    model = mesh_lib.create_sharded_model(make, mesh)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    teacher_params = jax.tree.map(jnp.copy, params)
    step = train_step.make_grad_step(graphdef, rest, settings, "ema")
    with mesh_lib.use_mesh(mesh):
        put = lambda p: jax.tree.map(  # noqa: E731
            lambda x: jax.device_put(x, mesh_lib.batch_sharding(mesh, x.ndim)), p
        )
        packs = (put(student), put(teacher))
        # FLOPs from the program right after partitioning: in the final GPU program most GEMMs
        # are cuBLAS custom calls, which a count of `dot` instructions would miss.
        compiled, partitioned = hlo_stats.compile_and_read(
            step.lower(params, teacher_params, *packs)
        )
        seconds, _ = timed(compiled, params, teacher_params, *packs, repeats=args.repeats)
    flops, _ = hlo_stats.dot_flops(partitioned)
    lm = config.llm
    attention_flops = (
        4
        * lm.num_hidden_layers
        * lm.num_attention_heads
        * lm.head_dim
        * (4 * student_len**2 / 2 + teacher_len**2 / 2)
    )  # fwd + bwd + remat, causal
    peak_flops, _ = device_peaks(args)
    mfu = (flops + attention_flops) / seconds / peak_flops
    measured = peak_bytes()
    emit(
        section="grad_step",
        case=f"{lm.num_hidden_layers} x 7B layers + SigLIP, student {student_len} / teacher "
        f"{teacher_len} tokens, C={entries}"
        if not args.dry_run
        else "tiny (dry run)",
        value=f"{seconds * 1e3:.1f} ms, MFU {mfu:.1%}",
        unit="median of the runs",
        ok=True,
    )
    emit(
        section="memory",
        case="grad_step",
        value=(
            f"measured {measured / GIB:.2f} GiB / predicted {predicted / GIB:.2f} GiB = "
            f"{measured / predicted:.2f}"
            if measured
            else f"predicted {predicted / GIB:.3f} GiB; compiled here "
            f"{program_peak(compiled) / GIB:.3f} GiB"
        ),
        unit="allocator peak / deviceless compile for the target",
        ok=True,
    )


def section_decode(args):
    """The decode round at B = args.decode_batch rows on a bf16 copy of the whole LM. The copy
    is made in place as zeros (decode reads every weight whatever its value), so this process
    never holds fp32 weights and its allocator peak is the decode program's own."""
    jax = setup_jax(args.dry_run)
    import jax.numpy as jnp
    from flax import nnx

    from models.bagel import Bagel
    from models.configs import BagelConfig
    from opsd_jax.parallel import mesh as mesh_lib
    from opsd_jax.sampling import decode_copy, sampler

    config = (BagelConfig.tiny if args.dry_run else BagelConfig.bagel_7b)(
        llm=dict(compute_dtype="bfloat16")
    )
    lm = config.llm
    batch = args.decode_batch
    prompt_len, new_tokens = (64, 16) if args.dry_run else (4096, 256)
    slots = sampler.cache_slots_for(prompt_len, new_tokens)
    cache_shape = (lm.num_hidden_layers, batch, slots, lm.num_key_value_heads, lm.head_dim)
    settings = sampler.RoundSettings(
        1.0, True, lm.vocab_size - 4, lm.vocab_size - 3, lm.vocab_size, new_tokens + 1
    )
    rules = mesh_lib.DECODE_RULES
    make = lambda: Bagel(config, rngs=nnx.Rngs(0))  # noqa: E731

    def fresh_state():
        zeros = jnp.zeros(cache_shape, jnp.bfloat16)
        rows = lambda dtype, *tail: jnp.zeros((batch,) + tail, dtype)  # noqa: E731
        return sampler.DecodeState(
            cache=(zeros, jnp.zeros_like(zeros)),
            kv_length=jnp.full((batch,), prompt_len, jnp.int32),
            rope=jnp.full((batch,), prompt_len, jnp.int32),
            tokens=rows(jnp.int32, new_tokens),
            logprobs=rows(jnp.float32, new_tokens),
            length=rows(jnp.int32),
            budget=jnp.full((batch,), new_tokens, jnp.int32),
            active=jnp.ones((batch,), bool),
            finished=rows(jnp.bool_),
        )

    def abstract_copy(on_mesh):
        graphdef, abstract = mesh_lib.abstract_model(make, on_mesh)
        view = mesh_lib.decode_mesh(on_mesh, "replicated")
        return graphdef, view, decode_copy.abstract_decode_copy(abstract, view, jnp.bfloat16)

    abstract_state = jax.eval_shape(fresh_state)
    abstract_key = jax.eval_shape(lambda: jax.random.key(0))

    def lower_for(on_mesh):
        graphdef, view, copy = abstract_copy(on_mesh)
        put = lambda x: jax.ShapeDtypeStruct(  # noqa: E731
            x.shape,
            x.dtype,
            sharding=jax.sharding.NamedSharding(view, jax.sharding.PartitionSpec()),
        )
        return sampler.decode_round.lower(
            graphdef,
            copy,
            jax.tree.map(put, abstract_state),
            put(abstract_key),
            put(jax.ShapeDtypeStruct((batch,), jnp.int32)),
            settings,
            rules,
        )

    predicted = predicted_peak(lower_for, args, decode=True)

    mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
    graphdef, view, copy = abstract_copy(mesh)
    weights = jax.jit(
        lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), copy),
        out_shardings=jax.tree.map(lambda x: x.sharding, copy),
    )()
    read = sum(
        x.nbytes
        for p, x in jax.tree_util.tree_flatten_with_path(weights)[0]
        if "language_model" in jax.tree_util.keystr(p)
        and "embed_tokens" not in jax.tree_util.keystr(p)
    )
    with mesh_lib.use_mesh(view, rules):
        row_ids = jnp.arange(batch, dtype=jnp.int32)
        compiled = sampler.decode_round.lower(
            graphdef, weights, fresh_state(), jax.random.key(0), row_ids, settings, rules
        ).compile()
        times, tokens = [], 0
        for _ in range(args.repeats + 1):  # the first run warms up
            state = fresh_state()  # donated: a fresh one per run
            t0 = time.perf_counter()
            state = jax.block_until_ready(compiled(weights, state, jax.random.key(0), row_ids))
            times.append(time.perf_counter() - t0)
            tokens = int(state.length.sum()) + batch  # sampled + the fed <|im_start|>
    seconds = statistics.median(times[1:])
    _, hbm_bw = device_peaks(args)
    mean_cache = 2 * math.prod(cache_shape) * 2 * (prompt_len + new_tokens / 2) / slots
    roofline = hbm_bw / (read + mean_cache) * batch  # tokens/s reading each byte once per step
    tokens_s = tokens / seconds
    emit(
        section="decode",
        case=f"B={batch}, prompt {prompt_len}, {new_tokens} new tokens",
        value=f"{tokens_s:.0f} tokens/s, roofline {roofline:.0f} ({tokens_s / roofline:.0%})",
        unit=f"weights {read / GIB:.2f} GiB + cache {mean_cache / GIB:.2f} GiB per step",
        ok=True,
    )
    measured = peak_bytes()
    emit(
        section="memory",
        case=f"decode B={batch}",
        value=(
            f"measured {measured / GIB:.2f} GiB / predicted {predicted / GIB:.2f} GiB = "
            f"{measured / predicted:.2f}"
            if measured
            else f"predicted {predicted / GIB:.3f} GiB; compiled here "
            f"{program_peak(compiled) / GIB:.3f} GiB"
        ),
        unit="allocator peak / deviceless compile for the target",
        ok=True,
    )


# ---- the driver ---------------------------------------------------------------------------------


def run_section(name, args, *extra) -> list[dict]:
    """One section in a fresh process; its RESULT rows, or one failed row."""
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--section",
        name,
        "--layers",
        str(args.layers),
        "--repeats",
        str(args.repeats),
        *extra,
    ]
    command += ["--dry-run"] if args.dry_run else []
    command += ["--target", args.target] if args.target else []
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    rows = [
        json.loads(line[len(RESULT) :])
        for line in done.stdout.splitlines()
        if line.startswith(RESULT)
    ]
    if done.returncode:
        tail = [line for line in done.stderr.strip().splitlines() if line.strip()] or ["no output"]
        rows.append(
            dict(
                section=name,
                case="process",
                value=f"exit {done.returncode}",
                unit=tail[-1][:160],
                ok=False,
            )
        )
    for row in rows:
        row.setdefault("seconds", time.perf_counter() - t0)
    return rows


def main():
    args = parse_args()
    if args.section:
        globals()[f"section_{args.section}"](args)
        return
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    device = jax.devices()[0]
    print(
        f"bench/gpu_check.py: jax {jax.__version__} on {device.platform} ({device.device_kind})"
        + (" -- DRY RUN: tiny shapes on the CPU, timings mean nothing" if args.dry_run else "")
    )
    if not args.dry_run and device.platform != "gpu":
        sys.exit("no GPU here: pip install -r requirements-gpu.txt on a GPU machine, or --dry-run")
    t0 = time.perf_counter()
    rows = []
    for name in args.sections:
        runs = [("--decode-batch", str(b)) for b in DECODE_BATCHES] if name == "decode" else [()]
        section_rows = [row for extra in runs for row in run_section(name, args, *extra)]
        rows += section_rows
        for row in section_rows:
            print(
                f"  {row['section']:<10} {row['case']:<58} {row['value']:<44} "
                f"{'' if row['ok'] else 'FAILED '}{row['unit']}",
                flush=True,
            )
    failed = [f"{r['section']}: {r['case']}" for r in rows if not r["ok"]]
    print(
        f"\n{len(rows)} rows in {time.perf_counter() - t0:.0f} s; "
        + (f"FAILED: {'; '.join(failed)}" if failed else "nothing failed")
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
