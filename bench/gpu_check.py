"""What a session with a GPU runs first: one command, one table, measured on the GPU.

    pip install -r requirements-gpu.txt
    python bench/gpu_check.py                      # on one H100 / H200: at most 8 minutes
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
             once per step); in the B = 8 process, the decode attention kernel alone at the
             recipe's per-device share; with 4+ GPUs, the round at B = 8 on the 'tensor' decode
             layout over 4 of them (its own process);
  train      train.py itself (bench/gpu_check_train.py): a 7B-width model of `--train-layers`
             layers in the BAGEL HF layout, full and LoRA, a few steps with a save and a
             resume, the step split into sample / step / pack; on an H200 the one-GPU LoRA
             recipe at the real 28 layers (random weights in memory), its step time and peak
             memory next to the preflight's;

and for grad_step and decode the peak memory the allocator saw next to what the same program
compiled for the `--target` GPU without one predicts (opsd_jax/programs/gpu_target.py, the
figure bench/scale.py prints): their ratio says how far to trust scale.py.

What fails (the thresholds are the named constants below; a failing row says which it missed):

  parity     an error above PARITY_MAX_ERROR (2e-2, the output's bf16 rounding with margin);
  attention  a case bench/attention.py could not run;
  grad_step  MFU below MIN_GRAD_STEP_MFU (0.5: the MFU bench/scale.py's projection assumes);
  train      a train.py launch that fails, does not resume, or logs a non-finite loss;
  decode     at B = 8, tokens/s below MIN_DECODE_ROOFLINE (60%) of the HBM roofline, on one
             GPU and on the 'tensor' layout with 4 (per-device bytes: its weight shard and its
             cache share); the kernel alone below MIN_KERNEL_HBM (60%) of the HBM bandwidth.
             B = 1 and 32 are informative. With fewer than 4 GPUs the 'tensor' case is one row
             "not run: N GPU(s)", which the summary counts as not run, not as passed;
  any        a section's process that exits with an error.

Budget: at most 8 minutes on one H200, compiles included (BUDGET_S; the summary says when it
ran over). Hence one process per section or decode batch and no more, one compile per program
timed (plus one deviceless compile per memory prediction), and one timed run after the warm-up
for the informative decode batches.

`--dry-run` runs all of it on the CPU with tiny shapes (the Pallas kernels in their interpreter,
programs compiled for the target without running them on it, the 'tensor' decode case on four
forced CPU devices), so the script is known to start and to reach its table; no timing it prints
means anything, so no timing threshold is applied (the row says so), but every comparison runs.
The last line counts the checks passed, not run and not applied, and names what failed.

One script of over 900 lines: what a session with a GPU runs first, as one command (parity,
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
SECTIONS = ("parity", "attention", "grad_step", "decode", "train")
DECODE_BATCHES = (1, 8, 32)  # rows of the decode round, each in its own process

# ---- thresholds: every figure a row is judged by ------------------------------------------------
# Parity: largest error (relative to max(1, |reference|); the decode kernel's outputs are
# averages of V rows, of order 1); bf16 inputs with fp32 accumulation round the output to
# 2^-8, so an error past 2e-2 is a wrong kernel, not rounding.
PARITY_MAX_ERROR = 2e-2
# The grad step's MFU floor: the MFU bench/scale.py's projection assumes (its `--mfu` default).
# Below it, every step time and run length scale.py projects is optimistic.
MIN_GRAD_STEP_MFU = 0.5
# Decode at DECODE_CHECK_BATCH rows (the recipe's rows per device): tokens/s at least this part
# of the HBM roofline (weights and filled cache read once per step). B = 1 and 32 are shown only.
MIN_DECODE_ROOFLINE = 0.60
DECODE_CHECK_BATCH = 8
# The decode attention kernel alone: bytes it must move per second, as a part of HBM bandwidth.
MIN_KERNEL_HBM = 0.60
# The 'tensor' decode case: this many GPUs (BAGEL's 28 / 4 / 16 heads split into whole heads).
DECODE_TENSOR = 4
# The whole script on one H200, compiles included (the summary says when it ran over).
BUDGET_S = 8 * 60
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
    parser.add_argument(
        "--train-layers", type=int, default=2, help="LM layers of the train section's model"
    )
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--decode-batches",
        type=int,
        nargs="+",
        default=list(DECODE_BATCHES),
        help="rows of the one-GPU decode rounds, one process each (B = 8 is the checked one)",
    )
    parser.add_argument("--section", help=argparse.SUPPRESS)  # run one section, print RESULTs
    parser.add_argument("--decode-batch", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--decode-tensor", type=int, default=1, help=argparse.SUPPRESS)
    return parser.parse_args()


# ---- shared helpers (inside a section's process) ------------------------------------------------


def failure_line(text: str) -> str:
    """The line of a failed process's output that says why: its last exception line (jax's
    tracebacks end with a note on filtered frames, not the error), else its last line."""
    lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Exit", "Interrupt")) and " " not in head:
            return line
    return (lines or ["no output"])[-1]


def setup_jax(dry_run: bool, host_devices: int = 1):
    """jax, on the CPU in a dry run (with `host_devices` CPU devices, for a multi-GPU case)."""
    if dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
        if host_devices > 1:
            flag = f"--xla_force_host_platform_device_count={host_devices}"
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import jax

    return jax


def emit(kind="info", **row):
    """One row of the table. kind: 'check' (a threshold was applied: ok says whether it was
    met), 'info' (shown only; ok=False still fails it: a case that could not run), 'not applied'
    (a timing threshold in a dry run) or 'not run' (a case this machine cannot run)."""
    print(RESULT + json.dumps(dict(row, kind=kind)), flush=True)


def judged(args, fraction: float, threshold: float, rule: str) -> dict:
    """ok, kind and the verdict text of a measured `fraction` against `threshold`, `rule` naming
    it ("60% of the roofline"). A dry run's timings mean nothing: the comparison runs, but its
    row never fails and says the threshold was not applied."""
    met = fraction >= threshold
    if args.dry_run:
        return dict(ok=True, kind="not applied", verdict=f"dry run: threshold not applied ({rule})")
    return dict(ok=bool(met), kind="check", verdict=("at least " if met else "below ") + rule)


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
    from opsd_jax.parallel import mesh as mesh_lib
    from opsd_jax.parallel.device_memory import program_peak
    from opsd_jax.programs import gpu_target

    mesh = gpu_target.make_mesh(target_name(args), 1)
    rules = mesh_lib.DECODE_RULES if decode else mesh_lib.LOGICAL_RULES
    with mesh_lib.use_mesh(mesh, rules):
        return program_peak(gpu_target.compile(lower_for(mesh), mesh))


# ---- sections -----------------------------------------------------------------------------------


def section_train(args):
    """train.py itself: bench/gpu_check_train.py (beside this script)."""
    import gpu_check_train

    gpu_check_train.section_train(args, emit, target_name(args))


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
        ok = max(errors) <= PARITY_MAX_ERROR
        emit(
            section="parity",
            case=f"{name}, T={length}",
            value=" / ".join(f"{e:.1e}" for e in errors),
            unit=f"max error out / dq / dk / dv (vs reference), "
            f"{'at most' if ok else 'above'} {PARITY_MAX_ERROR:.0e}",
            ok=bool(ok),
            kind="check",
        )

    # The sampler's decode attention kernel on the stacked cache against XLA's on the layer's
    # slice, rows of lengths from 1 to the whole cache.
    from models.attention import decode_attention
    from models.decode_attention_pallas import filled_cache_attention

    layers, rows, slots, hq, hkv = (2, 4, 256, 7, 1) if args.dry_run else (2, 8, 4160, 28, 4)
    q = jnp.asarray(rng.normal(size=(rows, hq, 128)), jnp.bfloat16)
    cache = jnp.asarray(rng.normal(size=(layers, rows, slots, 2, hkv, 128)), jnp.bfloat16)
    lengths = jnp.asarray(np.linspace(1, slots, rows).astype(np.int32))
    got = jax.jit(lambda *a: filled_cache_attention(*a, interpret=args.dry_run))(
        q, cache, jnp.int32(1), lengths
    )
    k, v = (cache[1, :, :, i].astype(jnp.float32) for i in (0, 1))
    want = decode_attention(q.astype(jnp.float32), k, v, lengths)
    error = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
    ok = error <= PARITY_MAX_ERROR
    emit(
        section="parity",
        case=f"decode {hq}q/{hkv}kv/128, {slots} slots",
        value=f"{error:.1e}",
        unit=f"max error out (vs XLA decode attention, fp32), "
        f"{'at most' if ok else 'above'} {PARITY_MAX_ERROR:.0e}",
        ok=bool(ok),
        kind="check",
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
        tail = failure_line(done.stderr)
        emit(
            section="attention",
            case="bench/attention.py",
            value=f"exit {done.returncode}",
            unit=tail[:120],
            ok=False,
            kind="check",
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
    from opsd_jax.parallel import mesh as mesh_lib
    from opsd_jax.parallel.device_memory import program_peak
    from opsd_jax.programs import hlo_stats
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

    from opsd_jax.programs import gpu_target

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
    judge = judged(
        args, mfu, MIN_GRAD_STEP_MFU, f"an MFU of {MIN_GRAD_STEP_MFU:.0%}, scale.py's --mfu"
    )
    emit(
        section="grad_step",
        case=f"{lm.num_hidden_layers} x 7B layers + SigLIP, student {student_len} / teacher "
        f"{teacher_len} tokens, C={entries}"
        if not args.dry_run
        else "tiny (dry run)",
        value=f"{seconds * 1e3:.1f} ms, MFU {mfu:.1%}",
        unit=f"{judge['verdict']}; median of {args.repeats} runs",
        ok=judge["ok"],
        kind=judge["kind"],
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
    from opsd_jax.parallel import mesh as mesh_lib
    from opsd_jax.parallel.device_memory import program_peak
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
    settings = sampler.RoundSettings(
        1.0, True, lm.vocab_size - 4, lm.vocab_size - 3, lm.vocab_size, new_tokens + 1
    )
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
    with mesh_lib.use_mesh(view, rules):
        key = jax.device_put(jax.random.key(0), NamedSharding(view, PartitionSpec()))
        row_ids = jax.device_put(jnp.arange(batch, dtype=jnp.int32), shardings.length)
        compiled = sampler.decode_round.lower(
            graphdef, weights, fresh(), key, row_ids, settings, rules
        ).compile()
        times, tokens = [], 0
        for _ in range(repeats + 1):  # the first run warms up
            state = fresh()  # donated: a fresh one per run
            t0 = time.perf_counter()
            state = jax.block_until_ready(compiled(weights, state, key, row_ids))
            times.append(time.perf_counter() - t0)
            tokens = int(state.length.sum()) + batch  # sampled + the fed <|im_start|>
    seconds = statistics.median(times[1:])
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
    if predicted is None:
        return
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
    if checked:  # after the memory row, so that its allocator peak is the round's alone
        del weights, state
        decode_kernel_alone(args)


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


# ---- the driver ---------------------------------------------------------------------------------


def run_section(name, args, *extra, env=None) -> list[dict]:
    """One section in a fresh process (environment `env`); its RESULT rows, or one failed row."""
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--section",
        name,
        "--layers",
        str(args.layers),
        "--repeats",
        str(args.repeats),
        "--train-layers",
        str(args.train_layers),
        *extra,
    ]
    command += ["--dry-run"] if args.dry_run else []
    command += ["--target", args.target] if args.target else []
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    rows = [
        json.loads(line[len(RESULT) :])
        for line in done.stdout.splitlines()
        if line.startswith(RESULT)
    ]
    if done.returncode:
        rows.append(
            dict(
                section=name,
                case="process",
                value=f"exit {done.returncode}",
                unit=failure_line(done.stderr)[:160],
                ok=False,
                kind="check",
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
    # The sections run with the environment as given; this process only asks jax which devices
    # there are, and must not hold (preallocate) GPU memory they need meanwhile.
    child_env = dict(os.environ)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    device = jax.devices()[0]
    print(
        f"bench/gpu_check.py: jax {jax.__version__} on {device.platform} ({device.device_kind})"
        + (" -- DRY RUN: tiny shapes on the CPU, timings mean nothing" if args.dry_run else "")
    )
    if not args.dry_run and device.platform != "gpu":
        sys.exit("no GPU here: pip install -r requirements-gpu.txt on a GPU machine, or --dry-run")
    gpus = len(jax.devices())
    # A dry run runs the 'tensor' decode case on forced CPU devices, so that its path is known
    # to work before a machine with 4 GPUs does.
    tensor_case = gpus >= DECODE_TENSOR or args.dry_run
    t0 = time.perf_counter()
    rows = []
    for name in args.sections:
        runs = [()]
        if name == "decode":
            runs = [("--decode-batch", str(b)) for b in args.decode_batches]
            if tensor_case:
                batch = str(DECODE_CHECK_BATCH)
                runs.append(("--decode-batch", batch, "--decode-tensor", str(DECODE_TENSOR)))
        section_rows = [
            row for extra in runs for row in run_section(name, args, *extra, env=child_env)
        ]
        if name == "decode" and not tensor_case:
            section_rows.append(
                dict(
                    section="decode",
                    case=f"B={DECODE_CHECK_BATCH} on 'tensor' x{DECODE_TENSOR}",
                    value=f"not run: {gpus} GPU(s)",
                    unit=f"the 'tensor' decode layout needs {DECODE_TENSOR} GPUs",
                    ok=True,
                    kind="not run",
                )
            )
        rows += section_rows
        for row in section_rows:
            print(
                f"  {row['section']:<10} {row['case']:<58} {row['value']:<44} "
                f"{'' if row['ok'] else 'FAILED '}{row['unit']}",
                flush=True,
            )
    elapsed = time.perf_counter() - t0
    failed = [f"{r['section']}: {r['case']}" for r in rows if not r["ok"]]
    kinds = [r.get("kind", "info") for r in rows if r["ok"]]
    tally = [f"{kinds.count('check')} checks passed"]
    if kinds.count("not applied"):
        tally.append(f"{kinds.count('not applied')} thresholds not applied (dry run)")
    not_run = [f"{r['case']}, {r['value']}" for r in rows if r["ok"] and r.get("kind") == "not run"]
    if not_run:
        tally.append(f"{len(not_run)} not run ({'; '.join(not_run)})")
    tally.append(f"{kinds.count('info')} informative")
    # The budget is a GPU's: a dry run's CPU time says nothing about it.
    over = elapsed > BUDGET_S and not args.dry_run
    over = f", over the {BUDGET_S / 60:.0f}-minute budget" if over else ""
    print(
        f"\n{len(rows)} rows in {elapsed:.0f} s{over}: {', '.join(tally)}; "
        + (f"FAILED: {'; '.join(failed)}" if failed else "nothing failed")
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
