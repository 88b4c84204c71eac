"""bench/gpu_check.py's `grad_step` section: where a 7B grad step's time goes, from one process.

One BAGEL-7B-shaped grad step (the recipe's student and teacher rows: a 70 x 70-patch problem
image, a VT image, 1152 scored tokens; the full SigLIP; LM layers of the 7B width) timed at
each layer count of `--sweep` (1, 2 and 4 by default: all 28 do not fit one GPU with a teacher
and gradients). A row per count: the step's time, its MFU as MaxText counts it (analytic model
FLOPs, opsd_jax/training/step_flops.py: no remat, attention over the pairs the packs allow,
the ViT with its attention, lm_head at the loss rows) and its HFU (the remat re-forward on
top). Then the fit over the counts: the per-layer marginal time and MFU, the fixed part (ViT,
lm_head, loss, the step's own overheads) and the 28-layer extrapolation, the figure
bench/scale.py's projection assumes (MIN_GRAD_STEP_MFU: the row fails below it). The largest
count's allocator peak is shown next to its deviceless prediction.
"""

from __future__ import annotations

from gpu_sections.common import (
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

# The grad step's MFU at 28 layers (extrapolated): the MFU bench/scale.py's projection assumes
# (its `--mfu` default). Below it, every step time and run length scale.py projects is
# optimistic.
MIN_GRAD_STEP_MFU = 0.5
SWEEP = (1, 2, 4)  # LM layers of the timed grad steps
FULL_DEPTH = 28  # BAGEL-7B's LM layers: the extrapolation's


def bagel_packs(config, rows, student_len, teacher_len, entries, image_side, rng):
    """A student and a teacher Pack as OPSD builds them: [image, question, completion] and
    [image, question, VT image, completion] per row, the completion scored, the patch axis
    padded as a run pads it (numpy)."""
    import numpy as np

    from models.pack import pad_pack
    from opsd_jax.data.pack_shapes import round_up
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

    def patches(samples):  # rounded up as the run's pack shapes are (pack_shapes.MULTIPLE)
        return round_up(
            max(sum(len(i.patches) for i in s if isinstance(i, Image)) for s in samples)
        )

    student = pack_samples(students, student_len, num_rows=rows, special=special)
    teacher = pack_samples(teachers, teacher_len, num_rows=rows, special=special)
    student = pad_pack(student, student_len, patches(students), entries)
    teacher = pad_pack(teacher, teacher_len, patches(teachers), entries)
    return student, teacher


def step_case(args, layers: int, remat: str = "full", vit_backend: str = "auto"):
    """(model config, student pack, teacher pack, loss settings) of the grad step at `layers`
    LM layers under `remat`, the ViT's attention on `vit_backend` ('auto': the LLM's) (the dry
    run: the tiny model, short rows, and any GPU-only ViT backend as 'reference')."""
    import numpy as np

    from configs import thinkmorph_7b
    from models.configs import BagelConfig
    from opsd_jax import run_config

    llm = dict(
        compute_dtype="bfloat16",
        remat=remat,
        attention_backend="pallas" if not args.dry_run else "chunked",
        vit_attention_backend=vit_backend
        if not args.dry_run or vit_backend not in ("pallas", "cudnn")
        else "reference",
        num_hidden_layers=layers,
    )
    if not args.dry_run:  # the problem image's 70 x 70 patches: the largest image here
        llm["vit_image_patches"] = 70 * 70
    if args.dry_run:
        config = BagelConfig.tiny(llm=llm)
        student_len, teacher_len, entries, side = 256, 384, 64, 8
    else:  # the recipe's rows: a 70 x 70-patch problem image (4900), a VT image, C = 1152
        config = BagelConfig.bagel_7b(llm=llm)
        student_len, teacher_len, entries, side = 6144, 10240, 1152, 70
    student, teacher = bagel_packs(
        config, 1, student_len, teacher_len, entries, side, np.random.default_rng(0)
    )
    settings = run_config.loss_settings(thinkmorph_7b.get_config())
    return config, student, teacher, settings


def build_step(
    args, layers: int, mesh, remat: str = "full", flags: str = "xla", vit_backend: str = "auto"
):
    """(the grad step compiled with the `flags` option set, its arguments on `mesh`, the case)
    at `layers` LM layers under `remat`, the ViT's attention on `vit_backend`, with random
    weights and an EMA teacher copy."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models.bagel import Bagel
    from opsd_jax.parallel import mesh as mesh_lib
    from opsd_jax.training import step_compiler_flags, train_step

    config, student, teacher, settings = step_case(args, layers, remat, vit_backend)
    model = mesh_lib.create_sharded_model(lambda: Bagel(config, rngs=nnx.Rngs(0)), mesh)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    step = train_step.make_grad_step(graphdef, rest, settings, "ema")
    put = lambda p: jax.tree.map(  # noqa: E731
        lambda x: jax.device_put(x, mesh_lib.batch_sharding(mesh, x.ndim)), p
    )
    arguments = (params, jax.tree.map(jnp.copy, params), put(student), put(teacher))
    options = step_compiler_flags.step_compiler_options(flags, config)
    with mesh_lib.use_mesh(mesh):
        compiled = step.lower(*arguments).compile(compiler_options=options)
    return compiled, arguments, (config, student, teacher, settings)


def predicted_step_peak(args, layers: int) -> int | None:
    """The grad step's peak bytes compiled for the target GPU without one (None in a dry run)."""
    import jax
    from flax import nnx

    from models.bagel import Bagel
    from opsd_jax.parallel import mesh as mesh_lib
    from opsd_jax.programs import gpu_target
    from opsd_jax.training import train_step

    config, student, teacher, settings = step_case(args, layers)
    make = lambda: Bagel(config, rngs=nnx.Rngs(0))  # noqa: E731
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

    return predicted_peak(lower_for, args)


def step_flops_at(config, student, teacher, layers: int):
    """The analytic FLOPs of the grad step at `layers` LM layers (model and executed)."""
    from opsd_jax.training import step_flops

    config = config.replace(llm=dict(num_hidden_layers=layers))
    return step_flops.opsd_step_flops(
        config,
        student,
        teacher,
        step_flops.Trained(),
        remat=config.llm.remat,
        vit_remat=config.llm.vit_remat,
    )


def run(args):
    jax = setup_jax(args.dry_run)
    import numpy as np

    from opsd_jax.parallel import mesh as mesh_lib
    from opsd_jax.training.step_flops import utilisation

    peak_flops, _ = device_peaks(args)
    mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
    sweep = sorted(set(args.sweep))
    seconds, case = {}, None
    first = (args.remats[0], args.step_flags[0], args.vit_backends[0])
    for layers in sweep:
        step, arguments, case = build_step(args, layers, mesh, *first)
        with mesh_lib.use_mesh(mesh):
            seconds[layers], _ = timed(step, *arguments, repeats=args.repeats)
        flops = step_flops_at(case[0], case[1], case[2], layers)
        mfu = utilisation(flops.model, seconds[layers], peak_flops)
        hfu = utilisation(flops.executed, seconds[layers], peak_flops)
        emit(
            section="grad_step",
            case=f"{layers} LM layer(s) + SigLIP, student {case[1].row_length} / teacher "
            f"{case[2].row_length} tokens" + (" (dry run: tiny)" if args.dry_run else ""),
            value=f"{seconds[layers] * 1e3:.1f} ms, MFU {mfu:.1%}, HFU {hfu:.1%}",
            unit=f"model {flops.model / 1e12:.2f} TFLOP (MaxText's count), executed "
            f"{flops.executed / 1e12:.2f}; median of {args.repeats} runs",
            ok=True,
        )
        del step, arguments
    # The largest count's peak, read before the other variants run (a lighter remat saves
    # more, so its step's peak is larger): the prediction below is this step's.
    measured = peak_bytes()
    if len(sweep) >= 2:
        config, student, teacher = case[:3]
        slope, fixed = np.polyfit(sweep, [seconds[n] for n in sweep], 1)
        per_layer = (
            step_flops_at(config, student, teacher, 2).model
            - step_flops_at(config, student, teacher, 1).model
        )
        depth = FULL_DEPTH
        full_s = fixed + depth * slope
        full_mfu = utilisation(
            step_flops_at(config, student, teacher, depth).model, full_s, peak_flops
        )
        judge = judged(
            args,
            full_mfu,
            MIN_GRAD_STEP_MFU,
            f"an MFU of {MIN_GRAD_STEP_MFU:.0%}, scale.py's --mfu",
        )
        emit(
            section="grad_step",
            case=f"fit over {', '.join(map(str, sweep))} layers -> {depth} layers",
            value=f"{full_s * 1e3:.0f} ms, MFU {full_mfu:.1%}",
            unit=f"{judge['verdict']}; per layer {slope * 1e3:.1f} ms at MFU "
            f"{utilisation(per_layer, slope, peak_flops):.1%}; fixed (ViT, lm_head, loss) "
            f"{fixed * 1e3:.1f} ms",
            ok=judge["ok"],
            kind=judge["kind"],
        )
    # Each other remat policy, option set and ViT attention backend at the largest layer count:
    # the same step, before and after (the first of each is the sweep's).
    others = [(remat, first[1], first[2]) for remat in args.remats[1:]]
    others += [(first[0], flags, first[2]) for flags in args.step_flags[1:]]
    others += [(first[0], first[1], vit) for vit in args.vit_backends[1:]]
    for remat, flags, vit in others:
        step, arguments, case = build_step(args, sweep[-1], mesh, remat, flags, vit)
        with mesh_lib.use_mesh(mesh):
            taken, _ = timed(step, *arguments, repeats=args.repeats)
        flops = step_flops_at(case[0], case[1], case[2], sweep[-1])
        emit(
            section="grad_step",
            case=f"{sweep[-1]} LM layer(s), remat {remat}, flags {flags}, ViT attention {vit} "
            f"(against {', '.join(first)})"
            + (" (dry run: 'reference')" if args.dry_run and vit in ("pallas", "cudnn") else ""),
            value=f"{taken * 1e3:.1f} ms, MFU {utilisation(flops.model, taken, peak_flops):.1%}",
            unit=f"{seconds[sweep[-1]] / taken:.2f}x the first step's speed; HFU "
            f"{utilisation(flops.executed, taken, peak_flops):.1%}",
            ok=True,
        )
        del step, arguments
    predicted = predicted_step_peak(args, sweep[-1])
    emit(
        section="memory",
        case=f"grad_step, {sweep[-1]} layer(s)",
        value=memory_row_value(measured, predicted, target_name(args)),
        unit="allocator peak / deviceless compile for the target",
        ok=True,
    )
