"""Will this run fit and compile on that GPU? Asked of the compiler, before renting the GPU.

    python train.py --config configs/<name>.py --compile_only=h100:1

compiles every program train.py would compile for the run, for `count` compile-only devices of a
GPU target that opsd_jax/programs/gpu_target.py knows (h100, h200, h800), on any machine, with
no GPU: the train step (one per length bucket: grad accumulation, the update, the EMA), and for
an OPSD run the sampler's programs at the largest prompt the config allows (the decode-copy
refresh, then the sampling engine's prefill, insert into its slot pool, decode chunk and, with
image skips, next round: preflight_sampling.py), and for a run that evaluates, the evaluation's
engine programs at its batch size. No weight, data or checkpoint file is read: the model's
shapes come from `model_path`'s llm_config.json and vit_config.json when they are there, else
from the toy model (a toy config) or BAGEL-7B (any other).

Each program's peak memory per device is what XLA:GPU assigned it (arguments + outputs - donated
+ temp) plus what stays on the device while it runs and is not its argument: the train state
(params, optimizer moments, teacher) while the sampler's programs run, the decode copy beside
the insert, the pool's cache beside a prefill that can meet it (with the lookahead, and in an
evaluation), the lookahead's paused rows beside the train step and the evaluation. It passes
when it leaves PREFLIGHT_HEADROOM (15%) of the device's memory free (allocator fragmentation,
NCCL buffers, cuDNN workspaces). MaxText's train_compile.py is the model for this check.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from models.bagel import Bagel
from models.configs import BagelConfig
from opsd_jax.data import pack_shapes
from opsd_jax.data.opsd_packs import bucket_in
from opsd_jax.io.hf_layout import LLM_CONFIG, VIT_CONFIG
from opsd_jax.io.hf_load import read_config
from opsd_jax.parallel import device_memory
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.programs import gpu_target, hbm_traffic
from opsd_jax.run_config import builds, checks, preflight_sampling, trained_split
from opsd_jax.run_config.preflight_sampling import SHAPE_SPECIAL
from opsd_jax.sampling import decode_copy, layout_choice
from opsd_jax.training import step_compiler_flags, train_step
from opsd_jax.training.step_batches import step_batches_for

PREFLIGHT_HEADROOM = 0.15  # the share of device memory a program must leave free
GIB = 2**30


class PreflightError(ValueError):
    """A `--compile_only` value that names no target or device count."""


def parse_target(spec: str) -> tuple[str, int]:
    """'h100:1' -> ('h100', 1); 'h200' is one device. The error names the known targets."""
    name, _, count = spec.strip().lower().partition(":")
    if name not in gpu_target.TARGETS:
        raise PreflightError(
            f"--compile_only={spec}: unknown GPU target {name!r}; known targets: "
            f"{', '.join(gpu_target.TARGETS)} (as TARGET:DEVICES, e.g. h100:8)"
        )
    try:
        devices = int(count) if count else 1
    except ValueError:
        devices = 0
    if devices < 1:
        raise PreflightError(f"--compile_only={spec}: the device count must be a whole number >= 1")
    return name, devices


@dataclasses.dataclass
class ProgramMemory:
    """One compiled program's memory per device (bytes)."""

    name: str
    program: int  # arguments + outputs - donated + temp, as XLA:GPU assigned them
    resident: int  # what else stays on the device while it runs (the train state)
    seconds: float

    @property
    def peak(self) -> int:
        return self.program + self.resident


def model_config_for(config, runtime: dict) -> tuple[BagelConfig, str]:
    """(the run's model config with `runtime`, where its shapes come from), reading only the
    model directory's two config files."""
    directory = builds.model_dir(config)
    if directory and all(
        os.path.isfile(os.path.join(directory, f)) for f in (LLM_CONFIG, VIT_CONFIG)
    ):
        return read_config(directory, llm=runtime), f"{directory}'s {LLM_CONFIG} / {VIT_CONFIG}"
    if config.toy_data and not config.model_path:
        return BagelConfig.tiny(llm=runtime), "the toy model a toy run writes (BagelConfig.tiny)"
    where = (
        f"model_path {config.model_path!r} holds no {LLM_CONFIG}"
        if config.model_path
        else "model_path is empty"
    )
    return BagelConfig.bagel_7b(llm=runtime), f"BAGEL-7B ({where})"


def allowed_share() -> float:
    """The share of a device's memory a program may use: 1 - PREFLIGHT_HEADROOM, or less where
    jax's allocator is given less (XLA_PYTHON_CLIENT_MEM_FRACTION; opsd_jax sets 0.90 unless it
    is set)."""
    import opsd_jax

    fraction = os.environ.get(opsd_jax.ALLOCATOR_FRACTION_VARIABLE, "0.75")  # jax's default
    try:
        allocator = float(fraction)
    except ValueError:
        raise PreflightError(
            f"{opsd_jax.ALLOCATOR_FRACTION_VARIABLE}={fraction!r} is not a number"
        ) from None
    return min(1 - PREFLIGHT_HEADROOM, allocator)


def run(config, spec: str, say: Callable[[str], None] = print, measure: int | None = None) -> int:
    """Compile the run of `config` for `spec` ('h100:8'); print each program's memory; 0 when
    every program leaves PREFLIGHT_HEADROOM of the device free, else 1 (the line says which
    did not). Raises PreflightError for a bad `spec`, ConfigError for a config the devices
    cannot take.

    measure: program number `measure` (in the order the lines print, from 0) is instead
    compiled for this machine's first devices, run once on zero arguments with what the
    preflight counts beside it held there, and its allocator peak printed beside XLA's
    assignment (device_memory.measure_on_zeros, one line starting `measured `); nothing else
    is compiled, and 0 is returned. On a GPU of `spec`'s kind this is what the prediction
    promises, in a process that holds the run's resident state and runs that one program
    (bench/program_memory.py runs each program so)."""
    try:
        return _compile_run(config, spec, say, measure)
    except _Measured:
        return 0


def _compile_run(config, spec: str, say: Callable[[str], None], measure: int | None) -> int:
    """run's body: the exception _Measured ends it in measure mode."""
    target, count = parse_target(spec)
    if measure is None:
        jax.config.update("jax_platforms", "cpu")  # compile-only devices: no GPU is started
    elif len(jax.devices()) < count:
        raise PreflightError(
            f"measuring a program of the run on {count} devices needs them: this machine has "
            f"{len(jax.devices())} ({jax.devices()[0].device_kind})"
        )
    config = builds.complete(config)
    checks.validate(config, count, 1, check_files=False)
    capacity = gpu_target.memory_bytes(target)
    limit = int(capacity * allowed_share())

    # 'auto' stays 'auto': under the compile-only GPU mesh it picks what it picks on the GPU
    # (the Pallas training kernel; the XLA decode attention, models/attention.py).
    runtime = builds.model_runtime(config)
    model_config, source = model_config_for(config, runtime)
    heads = checks.tensor_problems(config, model_config)  # the layout shards the heads
    if heads:
        raise checks.ConfigError(f"bad training config for {source}:\n  " + "\n  ".join(heads))
    data_size, fsdp_size, tensor_size = builds.mesh_shape(config, count)
    if measure is None:
        mesh = gpu_target.make_mesh(target, count, data_size, tensor_size, fsdp_size)
        where = f"compiled for {count} compile-only {target.upper()} device(s) ("
    else:
        devices = jax.devices()[:count]
        mesh = mesh_lib.make_mesh(data_size, fsdp_size, tensor_size, devices=devices)
        kind = devices[0].device_kind
        where = f"program {measure} measured on {count} {kind} device(s) (as {target.upper()}: "
    say(
        f"preflight: {config.mode} run {where}{capacity / GIB:.1f} GiB each, "
        f"{allowed_share():.0%} of it usable: {limit / GIB:.1f} GiB), mesh {dict(mesh.shape)}; "
        f"model shapes from {source}"
    )

    split = trained_split.TrainedSplit.of_config(config)

    def make_model():
        model = Bagel(model_config, rngs=nnx.Rngs(0))
        if split.lora:
            trained_split.attach_adapters(model, config)
        return model

    graphdef, abstract = mesh_lib.abstract_model(make_model, mesh)
    abstract_params, abstract_rest = nnx.split_state(abstract, nnx.Param, ...)
    rest = gpu_target.host_rest(make_model)  # the sin-cos table the train step closes over
    teacher_models, teacher_weights = [], []
    for path in split.checkpoint_paths:  # other models, each held in the compute dtype
        teacher_config, teacher_source = model_config, "the student's (no config files there)"
        if all(os.path.isfile(os.path.join(path, f)) for f in (LLM_CONFIG, VIT_CONFIG)):
            teacher_config = read_config(path, llm=runtime)
            teacher_source = f"its {LLM_CONFIG} / {VIT_CONFIG}"
        say(f"preflight: the teacher {path}: shapes {teacher_source}")

        def make_teacher(teacher_config=teacher_config):
            return Bagel(teacher_config, rngs=nnx.Rngs(0))

        teacher_graphdef, teacher_abstract = mesh_lib.abstract_model(make_teacher, mesh)
        weights = nnx.split_state(teacher_abstract, nnx.Param, ...)[0]
        dtype = jax.numpy.dtype(config.compute_dtype)
        teacher_weights.append(
            jax.tree.map(
                lambda p: jax.ShapeDtypeStruct(p.shape, dtype, sharding=p.sharding), weights
            )
        )
        teacher_models.append(
            train_step.TeacherModel(teacher_graphdef, gpu_target.host_rest(make_teacher))
        )
    teachers = split.step_teachers(tuple(teacher_models))
    teacher_weights = tuple(teacher_weights) or None
    optimizer, frozen, state = trained_split.abstract_train_state(
        config, abstract_params, teacher_weights
    )
    resident = device_memory.bytes_per_device(state)
    say(
        f"train state per device: {resident / GIB:.2f} GiB "
        f"({sum(x.size for x in jax.tree.leaves(abstract_params)):,} parameters)"
    )
    reports, skipped = [], []  # programs compiled; programs passed over in measure mode

    def compile_and_report(name, lower, on_mesh, resident_bytes, options=None):
        """Compile the program `lower()` lowers and report it, or in measure mode, measure
        the program whose number is `measure` and stop (_Measured), skipping the others."""
        index = len(reports) + len(skipped)
        if measure is not None and index != measure:
            skipped.append(name)
            return
        t0 = time.perf_counter()
        compiled = gpu_target.compile(lower(), on_mesh, **(options or {}))
        if measure is not None:
            found = device_memory.measure_on_zeros(compiled, resident_bytes, on_mesh)
            say("measured " + json.dumps(dict(found, program=name, index=index)))
            raise _Measured
        report = ProgramMemory(
            name, device_memory.program_peak(compiled), resident_bytes, time.perf_counter() - t0
        )
        reports.append(report)
        # Which attention the program holds, as the GPU will run it: 'auto' resolves under the
        # compile-only GPU mesh (the Pallas range kernel in training and prefill, XLA's decode).
        kernels = hbm_traffic.pallas_kernels(compiled.as_text())
        say(
            f"  {name}: peak {report.peak / GIB:.2f} GiB per device "
            f"({report.peak / capacity:.0%} of {capacity / GIB:.1f} GiB; compiled in "
            f"{report.seconds:.0f} s; "
            + (f"Pallas kernels: {', '.join(kernels)})" if kernels else "no Pallas kernel)")
        )

    # ---- the train step, every length bucket ------------------------------------------------
    settings = builds.loss_settings(config, vocab_limit=model_config.llm.vocab_size)
    loss_fn = train_step.make_loss(
        config.mode, graphdef, rest, settings, teachers, source_names=split.source_names
    )
    step_fn = builds.train_step_for(config, loss_fn, optimizer, state, frozen, teachers)
    shapes = pack_shapes.pack_shapes(config)
    batches = step_batches_for(
        config.mode,
        config,
        shapes,
        None,  # encode: shapes only
        None,  # prompt options: shapes only
        SHAPE_SPECIAL,
        mesh,
        cache_reader=_ShapeOnlyCache(config.offline_top_k) if config.mode == "offline" else None,
        sources=split.source_names,
        local_samples=config.samples_per_micro_batch,
        local_rows=config.rows_per_micro_batch,
        sample_offset=0,
    )
    # With rollout_lookahead the engine's pool (the paused rows' KV cache, at capacity, split
    # over the devices) stays on the devices through the train step: counted beside it.
    paused = 0
    if config.mode == "opsd" and config.rollout_lookahead:
        paused = builds.rollout_cache_bytes(config, model_config, shapes) // count
        say(
            f"rollout_lookahead {config.rollout_lookahead}: {paused / GIB:.2f} GiB per device of "
            "paused rows' KV cache held through the train step"
        )
    for bucket in range(config.pack_length_buckets):

        def lower_step(bucket=bucket):
            with mesh_lib.use_mesh(mesh):
                return step_fn.lower(state, batches.abstract_batch(bucket))

        compile_and_report(
            f"train step ({batches.describe(bucket)})",
            lower_step,
            mesh,
            paused,  # its arguments are the state
            step_compiler_flags.step_compiler_options(config.step_compiler_flags, model_config),
        )

    # ---- the sampler (OPSD rollouts) and the evaluation ---------------------------------------
    # (name, rows, rows prefilled at once, max new tokens, prompt patches, whether a prefill
    # can meet a pool holding rows, what else stays on the device): a training rollout's
    # prefill meets one only with the lookahead's paused rows or in groups
    # (rollout_prefill_rows); an evaluation's prompts outnumber its slots, and it runs beside
    # the paused rows' pool.
    rollouts = []
    image = pack_shapes.image_patches(config.data.image_transform)
    largest = max(config.sample_prompt_buckets)
    if config.mode == "opsd":
        rows = config.samples_per_micro_batch * config.gradient_accumulation_steps
        prefill = min(config.rollout_prefill_rows or rows, rows)
        # A later prefill group meets the pool the first made, as the lookahead's paused rows.
        beside_pool = bool(config.rollout_lookahead) or prefill < rows
        rollouts.append(
            ("rollout", rows, prefill, config.sample_max_new_tokens, image, beside_pool, 0)
        )
    if config.eval_every:
        contexts = [c for c in config.eval_contexts.split(",") if c]
        images = image * (1 + config.max_reference_rounds) if "teacher" in contexts else image
        new_tokens = config.eval_max_new_tokens or config.sample_max_new_tokens
        rows = config.eval_batch_size
        rollouts.append(("evaluation", rows, rows, new_tokens, images, True, paused))
    if rollouts:
        layout = _decode_layout(
            config, model_config, abstract_params, mesh, shapes, capacity - resident
        )
        heads = layout_choice.head_counts(model_config)
        # 'tensor' splits over one host's devices; here one host holds all `count` of them
        # (jax's local device count is this machine's CPU, not the target's).
        tensor = mesh_lib.tensor_size_for(heads, count) if layout == "tensor" else None
        view = mesh_lib.decode_mesh(mesh, layout, tensor)
        model_state = nnx.merge_state(
            train_step.model_params(state.params, state.base), abstract_rest
        )
        copy_graphdef, copy = decode_copy.abstract_decode_copy(
            graphdef, model_state, view, config.compute_dtype
        )
        refresh = decode_copy.cast_function(graphdef, model_state, view, config.compute_dtype)
        # The train state is live throughout (its params are the refresh's argument), and so
        # are the lookahead's paused rows.
        compile_and_report(
            f"decode-copy refresh ('{layout}' on {dict(view.shape)})",
            lambda: refresh.lower(model_state),
            view,
            resident - device_memory.bytes_per_device((state.params, state.base)) + paused,
        )
        cache_dtype = jnp.dtype(builds.cache_dtype_for(config.compute_dtype))
        for name, rows, prefill, new_tokens, patches, pool_in_prefill, beside in rollouts:
            prompt_patches = bucket_in(min(patches, largest), config.sample_prompt_buckets)
            groups = f" (prefilled {prefill} at a time)" if prefill < rows else ""
            preflight_sampling.compile_engine_programs(
                compile_and_report,
                f"{name}, {rows} rows{groups} of {largest} tokens / {prompt_patches} patches, "
                f"{new_tokens} new tokens",
                model_config,
                view,
                copy_graphdef,
                copy,
                rows,
                prefill,
                largest,
                prompt_patches,
                new_tokens,
                config.sample_max_image_skips,
                cache_dtype,
                resident + beside,
                pool_in_prefill,
            )

    if measure is not None:
        raise PreflightError(
            f"no program {measure} to measure: the run compiles {len(skipped)} (0 to "
            f"{len(skipped) - 1})"
        )
    code, lines = verdict(reports, target, capacity)
    for line in lines:
        say(line)
    return code


def verdict(reports: list[ProgramMemory], target: str, capacity: int) -> tuple[int, list[str]]:
    """(0, a line naming the largest program) when every program's peak leaves
    PREFLIGHT_HEADROOM of `capacity` free; else (1, a line per program that does not, and the
    setting that lowers a rollout's prefill where one of them is)."""
    limit = int(capacity * allowed_share())
    share = f"{allowed_share():.0%} of a {target.upper()}'s {capacity / GIB:.1f} GiB"
    over = [r for r in reports if r.peak > limit]
    if over:
        lines = [
            f"does not fit: {r.name} needs {r.peak / GIB:.2f} GiB per device, more than "
            f"{limit / GIB:.1f} GiB ({share})"
            for r in over
        ]
        if any(r.name.startswith("rollout") and ": prefill" in r.name for r in over):
            lines.append(
                "the rollout's prefill: --config.rollout_prefill_rows=N prefills at most N "
                "prompts at a time (each later group beside the pool; docs/configuration.md)"
            )
        return 1, lines
    worst = max(reports, key=lambda r: r.peak)
    return 0, [
        f"fits: every program leaves {1 - allowed_share():.0%} of a {target.upper()} free "
        f"(largest: {worst.name}, {worst.peak / GIB:.2f} GiB of {limit / GIB:.1f} GiB)"
    ]


class _Measured(Exception):  # noqa: N818 (not an error: the measured program's way out of run)
    """Raised inside `run` once the program it measures has been measured."""


@dataclasses.dataclass
class _ShapeOnlyCache:
    """What an offline step's shapes need of the teacher cache: its top-k."""

    top_k: int


def _decode_layout(config, model_config, params, mesh, shapes, free_memory: int) -> str:
    """The sampler's layout as train.py resolves it ('auto': the least rollout time that fits
    in `free_memory`, what the train state leaves of a device; layout_choice.choose)."""
    if config.sampler_layout != "auto":
        return config.sampler_layout
    device = mesh.devices.flat[0]
    choice = layout_choice.choose(
        copy_bytes=decode_copy.copy_nbytes(params, config.compute_dtype),
        cache_bytes=builds.rollout_cache_bytes(config, model_config, shapes),
        heads=layout_choice.head_counts(model_config),
        num_layers=model_config.llm.num_hidden_layers,
        num_devices=mesh.devices.size,
        devices_per_host=mesh.devices.size,  # one host holds them (gpu_target.devices)
        platform="gpu",
        device_kind=getattr(device, "device_kind", ""),
        free_memory=free_memory,
    )
    return choice.layout
