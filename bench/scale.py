"""What one Visual-OPSD step costs at 7B, per device, compiled for the GPU it will run on.

Compiles ahead of time, with abstract arrays only (no weights are materialised), every program
a training step of `BagelConfig.bagel_7b()` (the ThinkMorph-7B shapes, understanding-only) runs:

* the grad step: student forward + backward and teacher forward over one micro-batch of student
  and teacher packs at the shapes the recipe's run compiles (opsd_jax/data/pack_shapes.py), with
  the paper's JSD settings (attention as a run's 'auto' compiles it: the Pallas range kernel on
  a GPU target, XLA's decode attention; `--decode-kernel` names 'pallas', the decode kernel);
* the optimizer / EMA update;
* the decode-copy refresh (fp32 FSDP params -> the bf16 copy in the sampler's layout);
* the sampler's prefill and decode round (one `while_loop` that generates every token of a
  rollout) on that copy, in each `sampler_layout`.

`--target h100|h200|h800` (the default when jax's CUDA plugin is installed) compiles them for
that GPU on compile-only devices, with no GPU present (opsd_jax/programs/gpu_target.py);
`--target cpu` compiles them for simulated CPU devices, the proxy this script used before (its
fusions, copies and buffers are not the GPU's). Per device and program it prints the compiled
memory (arguments, outputs, aliased, temp, peak), the matmul FLOPs counted through the layer
loops, the collectives by kind (read right after SPMD partitioning, loops counted by their trip
counts: opsd_jax/programs/hlo_stats.py), and for the decode round the HBM bytes one decode
step moves, counted kernel by kernel in the optimized program (opsd_jax/programs/
hbm_traffic.py), next to the floor (the bf16 weights on the decode path read once, plus the KV
cache up to the current length), and from XLA:GPU's thunk sequence the launches, the kernels
inside CUDA graphs and the host syncs of one decode step, with the sampler's command buffers
and without any (opsd_jax/programs/thunk_launches.py), and the decode attention kernel's grid
(with `--decode-kernel`).
Then a projection: compute at `--mfu` of peak (attention counted with bidirectional image
blocks), HBM and NVLink from the table below; a decode step as its HBM time plus, at stated
per-event costs (LAUNCH_S, GRAPH_NODE_S, HOST_SYNC_S, layout_choice's collective latency), its
launches, in-graph kernels, host syncs and collectives, all added; the optimizer / EMA update
(its HBM bytes); the host work on the step's path, measured on this machine
(bench/host_work.py); the rollout, the step, hours for the paper recipe (1000 steps) next to
the bytes-only figures this script printed before, and the memory headroom.

    python bench/scale.py                        # configs/thinkmorph_7b.py on 8 H100s
    python bench/scale.py --target h200 --devices 16 --num-replicate 2
    python bench/scale.py --target cpu           # the XLA:CPU proxy, for comparison
    python bench/scale.py --model tiny           # the same report for the tiny model (seconds)

What no compile can know (printed at the end): kernel speeds (nothing is autotuned without a
device; the compute time is an assumed MFU), how much communication overlaps compute (both
bounds are printed), whether the decode kernels reach the HBM bandwidth, and what a launch, a
graph node or a sync really costs (stated, added without overlap: bench/gpu_check.py measures
the decode round itself).

One script of about 1400 lines: every program of a 7B step (grad step, update, prefill, decode
round, decode-copy refresh) compiled for one target and costed the same way. In sections, one
function each, in the order the report prints them, each handed the run's context explicitly
(`Run`: the flags, recipe, target mesh and projection GPU; `Model`: the abstract state and its
bytes per device): set_up, abstract_model, grad_step_section, update_section, then per sampler
layout sampler_layout (refresh_section, prefill_section, decode_round_section,
decode_step_hbm; the 'tensor' layout only where its decode mesh is not the replicated one:
tensor_is_replicated), the projection (grad_step_time, print_decode_times, step_time),
memory_section and print_unknowns.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from typing import Any

# name: (peak dense bf16 FLOP/s, HBM bytes/s, NVLink bytes/s per direction). The memory of
# each is its compile target's (opsd_jax/programs/gpu_targets/), the one the preflight checks
# against: H100 and H800 79.1 GiB, H200 141.0 GiB (Run.hbm_bytes).
GPUS = {
    # H100 SXM5: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3; NVLink 4: 900 GB/s total
    # (450 GB/s each way). NVIDIA H100 Tensor Core GPU datasheet.
    "h100": (989e12, 3.35e12, 450e9),
    # H200 SXM: same compute as H100, HBM3e at 4.8 TB/s, NVLink 900 GB/s total.
    # NVIDIA H200 Tensor Core GPU datasheet.
    "h200": (989e12, 4.8e12, 450e9),
    # H800 SXM (the paper's GPU): H100 compute and HBM, NVLink cut to 400 GB/s total.
    # NVIDIA H800 product brief.
    "h800": (989e12, 3.35e12, 200e9),
}
GIB = 2**30


def gpu_memory_bytes(name: str) -> int:
    """One `name` GPU's memory, as the preflight counts it (its compile target's)."""
    from opsd_jax.programs import gpu_target

    return gpu_target.memory_bytes(name)


def usable_share() -> float:
    """The share of a GPU's memory a program may use, the preflight's: 1 - its 15% headroom
    (allocator fragmentation, NCCL buffers), or less where jax's allocator is given less."""
    from opsd_jax.run_config import preflight

    return preflight.allowed_share()


# What a decode step costs besides its bytes, per event, stated (no compile can know them; the
# counts come from the compiled program, opsd_jax/programs/thunk_launches.py). Added to the HBM
# time as if nothing overlapped (an upper bound): a decode step's kernels are microseconds long,
# so a host that launches them one by one, or waits on a predicate, leaves the GPU idle.
LAUNCH_S = 4e-6  # one launch from the host (a kernel, library call, copy or CUDA graph)
GRAPH_NODE_S = 1e-6  # one kernel inside a CUDA graph (the gap between dependent kernels)
HOST_SYNC_S = 10e-6  # a data-dependent loop's predicate: device -> host copy, wait, relaunch


def default_target() -> str:
    """h100 where jax's CUDA plugin is installed (found without importing jax, whose flags are
    not set yet), else cpu."""
    from opsd_jax import cuda_plugin_installed

    return "h100" if cuda_plugin_installed() else "cpu"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--target",
        choices=("h100", "h200", "h800", "cpu"),
        default=None,
        help="compile for this GPU without one (default h100 when jax's CUDA "
        "plugin is installed), or 'cpu': simulated CPU devices",
    )
    parser.add_argument(
        "--gpu",
        choices=sorted(GPUS),
        default=None,
        help="the GPU of the projection (default: the target; h100 for cpu)",
    )
    parser.add_argument(
        "--mfu",
        type=float,
        default=0.5,
        help="assumed model FLOPs utilisation of the grad step (default 0.5)",
    )
    parser.add_argument("--devices", type=int, default=8, help="devices (default 8)")
    parser.add_argument(
        "--devices-per-host",
        type=int,
        default=8,
        help="GPUs per host: the 'tensor' sampler layout splits inside one",
    )
    parser.add_argument("--num-replicate", type=int, default=1, help="mesh 'data' axis")
    parser.add_argument("--num-tensor", type=int, default=1, help="mesh 'tensor' axis")
    parser.add_argument("--model", choices=("7b", "tiny"), default="7b")
    parser.add_argument(
        "--config",
        default="configs/thinkmorph_7b.py",
        help="the recipe (micro-batches, sampling, LoRA, layout); default the paper's, made "
        "for 8 GPUs, whatever --devices says (for one GPU name configs/thinkmorph_7b_1gpu.py)",
    )
    parser.add_argument(
        "--teacher",
        choices=("self", "ema", "fixed", "checkpoint"),
        default=None,
        help="the teacher (default: the recipe's teacher_mode); 'checkpoint': another model's "
        "weights in compute_dtype beside the student's, projected at the student's shapes",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        help="LoRA adapters of this rank (alpha = rank) on the recipe's lora_targets; 0: full "
        "fine-tuning; default: the recipe's lora_rank",
    )
    parser.add_argument(
        "--rollout-prefill-rows",
        type=int,
        default=None,
        help="prompts the rollout prefills at once (0: all); default: the recipe's",
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=None,
        help="samples (and rows) per micro-batch; default: the recipe's, times num_replicate",
    )
    parser.add_argument(
        "--student-len",
        type=int,
        default=0,
        help="student row length; 0: the recipe's student pack row (opsd_jax/data/"
        "pack_shapes.py: 6272 for the paper's, an image of <= 4900 patches + prompt + 1026)",
    )
    parser.add_argument(
        "--teacher-len",
        type=int,
        default=0,
        help="teacher row length; 0: the recipe's teacher pack row (max_forward_tokens)",
    )
    parser.add_argument(
        "--student-patches",
        type=int,
        default=4900,
        help="the patches of the student row's image (its attention block); the pack's patch "
        "axis is the recipe's (4992 for the paper's), as in a run",
    )
    parser.add_argument(
        "--teacher-patches",
        type=int,
        default=8192,
        help="the patches of the teacher row's images; its patch axis is the recipe's (10240)",
    )
    parser.add_argument(
        "--loss-entries", type=int, default=0, help="C; 0: the recipe's (1152: 1025 rounded up)"
    )
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=0,
        help="sampler prompt rows; 0: the recipe's sample_prompt_buckets bucket "
        "of a ThinkMorph prompt at the largest image (--prompt-patches "
        "image tokens + 256 of text)",
    )
    parser.add_argument("--prompt-patches", type=int, default=4900)
    parser.add_argument(
        "--decode-kernel",
        action="store_true",
        help="decode with the Pallas decode kernel (attention_backend='pallas'), not what a "
        "run's 'auto' compiles (XLA's decode attention until a GPU passes the kernel's parity)",
    )
    parser.add_argument(
        "--skip-host-work",
        action="store_true",
        help="leave the measured host work (bench/host_work.py) out of the step",
    )
    parser.add_argument(
        "--skip-fit",
        action="store_true",
        help="skip the second grad-step compile that finds the largest pack",
    )
    args = parser.parse_args()
    if not 0 < args.mfu <= 1:
        parser.error(f"--mfu must be in (0, 1], got {args.mfu}")
    return args


def configure_environment(args) -> str:
    """The compile target, with the environment jax reads when imported set for it (every
    section imports jax after this)."""
    os.environ["JAX_PLATFORMS"] = "cpu"  # also for a GPU target: compile-only devices
    target = args.target or default_target()
    if target == "cpu":
        flags = [
            f
            for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        ]
        os.environ["XLA_FLAGS"] = " ".join(
            flags + [f"--xla_force_host_platform_device_count={args.devices}"]
        )
    # The GPU compiler's warnings about what it cannot tune without a device, once per program.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return target


@dataclasses.dataclass
class Run:
    """What every section reads: the flags (the prompt bucket and, for the tiny model, its pack
    shapes written into them), the recipe, the mesh of the compile target and the GPU the
    projection is for."""

    args: argparse.Namespace
    recipe: Any  # the recipe's ConfigDict, with --lora-rank applied
    target: str  # h100 / h200 / h800 (compile-only devices) or cpu
    gpu: str  # the GPU of the projection: a GPUS key
    model_config: Any  # BagelConfig
    mesh: Any  # the training mesh ('data', 'fsdp', 'tensor')
    samples: int  # samples (and rows) per micro-batch
    accum: int  # micro-batches per step
    new_tokens: int  # tokens per rollout round
    rounds: int  # rollout rounds (image skips + 1)
    collective_latency: float  # one small collective on a GPU (layout_choice's figure)

    @property
    def on_gpu(self) -> bool:
        return self.target != "cpu"

    @property
    def n(self) -> int:
        return self.args.devices

    @property
    def llm(self):
        return self.model_config.llm

    @property
    def peak_flops(self) -> float:
        return GPUS[self.gpu][0]

    @property
    def hbm_bw(self) -> float:
        return GPUS[self.gpu][1]

    @property
    def link_bw(self) -> float:
        return GPUS[self.gpu][2]

    @property
    def hbm_bytes(self) -> float:
        return gpu_memory_bytes(self.gpu)


@dataclasses.dataclass
class Model:
    """The abstract model and training state (nothing allocated) and their bytes per device."""

    graphdef: Any
    abstract_params: Any
    abstract_rest: Any
    rest: Any  # the non-parameter state on the host, which the train step closes over
    optimizer: Any
    state: Any  # the abstract TrainState train.py compiles its step for
    params_bytes: int
    base_bytes: int  # a LoRA state's frozen base (0 without LoRA)
    teacher_model: Any  # teacher_mode='checkpoint': train_step.TeacherModel; None otherwise
    num_params: int
    lm_matmul: int  # parameters of the LM's layers: the N of the matmul FLOPs
    state_bytes: int  # the train state, live between programs (as the preflight counts it)

    @property
    def resident(self) -> int:
        """Beside the grad step: the train state and the gradient accumulator (params' size)."""
        return self.state_bytes + self.params_bytes


@dataclasses.dataclass
class Grad:
    """The grad step as compiled at the flags' pack lengths."""

    step: Any  # the jitted grad step (compiled again at twice the lengths for the fit)
    memory: Any  # its compiled memory analysis
    table: dict  # its collectives by kind (hlo_stats.summarize)
    flops: float  # matmul FLOPs per device


@dataclasses.dataclass
class Sampling:
    """What every sampler layout shares: the rollout's rows, cache and settings, and the state
    the decode copy is made from."""

    rows: int
    slots: int
    cache_shape: tuple
    settings: Any  # sampler.RoundSettings
    model_state: Any  # the model's params (LoRA: merged with the base) and its rest


@dataclasses.dataclass
class GradTime:
    """The grad step's projected seconds per micro-batch."""

    compute_s: float  # at --mfu, attention with bidirectional image blocks
    comm_s: float  # its collectives at the NVLink bandwidth
    causal_compute_s: float  # every row counted causal (the figure printed before)


def attention_text(backend: str, on_gpu: bool) -> str:
    """The report's words for the attention its programs hold."""
    from models import attention

    if not on_gpu:
        return f"attention: {attention.resolve_backend(backend)}"
    kernel = "the Pallas decode kernel"
    if backend != "pallas":  # a run's 'auto'
        decode = kernel if attention.DECODE_KERNEL_IN_AUTO else "XLA's decode attention"
        return f"attention: the Pallas range kernel, {decode} (a run's 'auto')"
    note = "" if attention.DECODE_KERNEL_IN_AUTO else "; a run's 'auto' decodes on XLA's"
    return f"attention: the Pallas range kernel, {kernel} (--decode-kernel{note})"


def run_shapes(args, recipe) -> None:
    """The pack shapes a run of `recipe` compiles (its largest length bucket), written into
    `args` where the flags leave them to the recipe, and every patch axis as the run pads it:
    the training packs' to the recipe's shapes (pack_shapes.MULTIPLE), the prompt's to its
    prompt bucket. A patch axis of exactly 4900 makes XLA:GPU pad and slice the ViT's
    activations around each of its GEMMs, which a run never pays."""
    from opsd_jax import run_config
    from opsd_jax.data import pack_shapes
    from opsd_jax.data.opsd_packs import bucket_in

    shapes = pack_shapes.pack_shapes(run_config.complete(recipe))
    student, teacher = shapes["student"][-1], shapes["teacher"][-1]
    args.student_len = args.student_len or student.row_length
    args.teacher_len = args.teacher_len or teacher.row_length
    args.loss_entries = args.loss_entries or student.loss_entries

    def axis(patches, recipe_axis, length):  # the recipe's axis when it holds them, as a run's
        return recipe_axis if patches <= recipe_axis else min(length, pack_shapes.round_up(patches))

    args.student_slots = axis(args.student_patches, student.patches, args.student_len)
    args.teacher_slots = axis(args.teacher_patches, teacher.patches, args.teacher_len)
    args.prompt_slots = bucket_in(args.prompt_patches, recipe.sample_prompt_buckets)


def set_up(args, target: str) -> Run:
    """The recipe, model config and mesh for `target`; prints the report's first line."""
    from models.configs import BagelConfig
    from opsd_jax import run_config
    from opsd_jax.parallel import mesh as mesh_lib
    from opsd_jax.programs import gpu_target
    from opsd_jax.sampling import layout_choice

    recipe = run_config.load_config_file(args.config)
    if args.lora_rank is not None:
        with recipe.unlocked():
            recipe.lora_rank, recipe.lora_alpha = args.lora_rank, float(max(args.lora_rank, 1))
    if args.rollout_prefill_rows is not None:
        with recipe.unlocked():
            recipe.rollout_prefill_rows = args.rollout_prefill_rows
    if args.teacher is not None:
        with recipe.unlocked():
            recipe.teacher_mode = args.teacher
            recipe.teacher_path = "<the student's shapes>" if args.teacher == "checkpoint" else ""
    samples = args.samples or recipe.samples_per_micro_batch * args.num_replicate
    new_tokens = recipe.sample_max_new_tokens
    if not args.prompt_len:
        from opsd_jax.data.opsd_packs import bucket_in

        args.prompt_len = bucket_in(args.prompt_patches + 256, recipe.sample_prompt_buckets)
    if args.model == "tiny":  # the same report in seconds, for trying the script out
        make_config = BagelConfig.tiny
        args.student_len, args.teacher_len = 256, 512
        args.student_patches, args.teacher_patches, args.loss_entries = 64, 128, 128
        args.prompt_len, args.prompt_patches, new_tokens = 128, 64, 64
        args.student_slots, args.teacher_slots, args.prompt_slots = 64, 128, 64
    else:
        make_config = BagelConfig.bagel_7b
        run_shapes(args, recipe)
    on_gpu = target != "cpu"
    model_config = make_config(
        llm=dict(
            compute_dtype=recipe.compute_dtype,
            remat=recipe.remat,
            # What a run's 'auto' compiles under the GPU mesh (the Pallas range kernel, XLA's
            # decode attention); --decode-kernel names 'pallas', which adds the decode kernel.
            attention_backend="pallas" if on_gpu and args.decode_kernel else "auto",
        )
    )
    n = args.devices
    if on_gpu:
        mesh = gpu_target.make_mesh(target, n, args.num_replicate, args.num_tensor)
    else:
        mesh = mesh_lib.make_mesh(args.num_replicate, None, args.num_tensor)
    run = Run(
        args=args,
        recipe=recipe,
        target=target,
        gpu=args.gpu or (target if on_gpu else "h100"),
        model_config=model_config,
        mesh=mesh,
        samples=samples,
        accum=recipe.gradient_accumulation_steps,
        new_tokens=new_tokens,
        rounds=recipe.sample_max_image_skips + 1,
        collective_latency=layout_choice.PLATFORMS["gpu"][1],
    )
    where = (
        f"{n} compile-only {target.upper()} devices"
        if on_gpu
        else f"{n} simulated CPU devices (the XLA:CPU proxy)"
    )
    llm = run.llm
    print(
        f"bench/scale.py: {args.model} ({llm.num_hidden_layers} layers, hidden "
        f"{llm.hidden_size}) compiled for {where}, mesh {dict(mesh.shape)}; micro-batch "
        f"{samples} samples in {samples} rows x {run.accum} micro-batches; "
        f"{attention_text(llm.attention_backend, on_gpu)}; projection for {run.gpu} at MFU "
        f"{args.mfu}"
    )
    print(
        f"  packs as the recipe compiles them: student {args.student_len} tokens / "
        f"{args.student_slots} patch slots, teacher {args.teacher_len} / {args.teacher_slots}, "
        f"{args.loss_entries} loss entries; prompts {args.prompt_len} tokens / "
        f"{args.prompt_slots} patch slots"
    )
    if samples % (args.num_replicate * (n // (args.num_replicate * args.num_tensor))):
        sys.exit(f"--samples {samples} must divide over data x fsdp")
    return run


def abstract_model(run: Run) -> Model:
    """The abstract model and training state (no memory); prints their bytes per device."""
    import jax
    from flax import nnx

    from models.bagel import Bagel
    from opsd_jax import run_config
    from opsd_jax.parallel import device_memory
    from opsd_jax.parallel import mesh as mesh_lib
    from opsd_jax.programs import gpu_target
    from opsd_jax.training import train_step

    recipe = run.recipe
    split = run_config.TrainedSplit.of_config(recipe)

    def make_model():
        model = Bagel(run.model_config, rngs=nnx.Rngs(0))
        if split.lora:
            run_config.attach_adapters(model, recipe)
        return model

    graphdef, abstract = mesh_lib.abstract_model(make_model, run.mesh)
    abstract_params, abstract_rest = nnx.split_state(abstract, nnx.Param, ...)
    # The non-parameter state (the fixed sin-cos table) is real where a program closes over it
    # (the train step does), made on the host; as an argument it is abstract like the params.
    rest = gpu_target.host_rest(make_model)

    # The state train.py compiles its step for: optimizer moments and the EMA laid out like
    # their params, counters replicated; with LoRA, of the adapters, and the frozen base.
    # A teacher of another checkpoint is projected at the student's shapes, in compute_dtype.
    teacher_model = teacher_weights = None
    if split.separate_teacher:
        plain = lambda: Bagel(run.model_config, rngs=nnx.Rngs(0))  # noqa: E731
        teacher_graphdef, teacher_abstract = mesh_lib.abstract_model(plain, run.mesh)
        dtype = jax.numpy.dtype(recipe.compute_dtype)
        teacher_weights = jax.tree.map(
            lambda p: jax.ShapeDtypeStruct(p.shape, dtype, sharding=p.sharding),
            nnx.split_state(teacher_abstract, nnx.Param, ...)[0],
        )
        teacher_model = train_step.TeacherModel(teacher_graphdef, gpu_target.host_rest(plain))
    optimizer, _, abstract_state = run_config.abstract_train_state(
        recipe, abstract_params, teacher_weights
    )
    params_bytes = device_memory.bytes_per_device(abstract_state.params)
    opt_bytes = device_memory.bytes_per_device(abstract_state.opt_state)
    teacher_bytes = device_memory.bytes_per_device(
        (abstract_state.teacher_params, abstract_state.teacher_weights)
    )
    base_bytes = device_memory.bytes_per_device(abstract_state.base)
    num_params = sum(x.size for x in jax.tree.leaves(abstract_params))
    lm_matmul = sum(
        x.size
        for p, x in jax.tree_util.tree_flatten_with_path(abstract_params)[0]
        if "layers" in jax.tree_util.keystr(p) and "language_model" in jax.tree_util.keystr(p)
    )
    lora = (
        f"LoRA rank {recipe.lora_rank} adapters on {recipe.lora_targets!r}: "
        f"{sum(x.size for x in jax.tree.leaves(abstract_state.params)) / 1e6:.1f}M trained "
        f"parameters, frozen {recipe.compute_dtype} base {base_bytes / GIB:.2f} GiB; "
        if recipe.lora_rank
        else ""
    )
    print(
        f"\nper device: {lora}params {params_bytes / GIB:.2f} GiB (fp32 master, "
        f"{num_params / 1e9:.2f}B parameters), optimizer state {opt_bytes / GIB:.2f} GiB, "
        f"{split.teacher} teacher {teacher_bytes / GIB:.2f} GiB, gradient accumulator "
        f"{params_bytes / GIB:.2f} GiB"
    )
    return Model(
        graphdef=graphdef,
        abstract_params=abstract_params,
        abstract_rest=abstract_rest,
        rest=rest,
        optimizer=optimizer,
        state=abstract_state,
        params_bytes=params_bytes,
        base_bytes=base_bytes,
        teacher_model=teacher_model,
        num_params=num_params,
        lm_matmul=lm_matmul,
        state_bytes=params_bytes + opt_bytes + teacher_bytes + base_bytes,
    )


# ---- compiling and reading one program ---------------------------------------------------------


def compile_with_thunks(lowered, on_mesh, **options):
    """(hlo_stats.CompiledProgram with XLA:GPU's thunk sequence, seconds)."""
    from opsd_jax.programs import gpu_target, hlo_stats

    t0 = time.perf_counter()
    program = hlo_stats.compile_and_read_all(
        lowered, {**gpu_target.compiler_options(on_mesh), **options}
    )
    return program, time.perf_counter() - t0


def compile_program(lowered, on_mesh):
    """(executable, HLO after SPMD partitioning, seconds) with the target's options."""
    program, seconds = compile_with_thunks(lowered, on_mesh)
    return program.compiled, program.partitioned, seconds


def array(shape, dtype, on_mesh):
    """An abstract array split over the mesh's batch axes along its first dimension."""
    import jax

    from opsd_jax.parallel import mesh as mesh_lib

    spec = jax.sharding.PartitionSpec(mesh_lib.BATCH_AXES, *([None] * (len(shape) - 1)))
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(on_mesh, spec))


def pack(rows, length, patches, entries, on_mesh):
    """An abstract Pack of `rows` rows of `length` tokens, `patches` ViT patches and `entries`
    loss entries (none: a prompt pack)."""
    import jax.numpy as jnp

    from models.pack import Pack

    ids = lambda: array((rows, length), jnp.int32, on_mesh)  # noqa: E731
    vit = lambda: array((rows, patches), jnp.int32, on_mesh)  # noqa: E731
    loss = lambda dtype: array((rows, entries), dtype, on_mesh) if entries else None  # noqa: E731
    return Pack(
        tokens=ids(),
        positions=ids(),
        segment_ids=ids(),
        k_start=ids(),
        k_end=ids(),
        vit_patches=array((rows, patches, 588), jnp.float32, on_mesh),
        vit_pos_ids=vit(),
        vit_slots=vit(),
        vit_image_ids=vit(),
        loss_rows=loss(jnp.int32),
        loss_targets=loss(jnp.int32),
        loss_mask=loss(jnp.bool_),
        loss_sample=loss(jnp.int32),
    )


def report(name, compiled, text, seconds):
    """Prints a program's memory, matmul FLOPs and collectives per device; returns (memory
    analysis, collectives by kind, FLOPs, the collectives found)."""
    from opsd_jax.parallel import device_memory
    from opsd_jax.programs import hlo_stats

    memory = compiled.memory_analysis()
    peak = device_memory.program_peak(compiled)
    found = hlo_stats.collectives(text)
    table = hlo_stats.summarize(found)
    flops, floor = hlo_stats.dot_flops(text)
    print(
        f"\n{name} (compiled in {seconds:.0f} s), per device: arguments "
        f"{memory.argument_size_in_bytes / GIB:.2f} GiB, outputs "
        f"{memory.output_size_in_bytes / GIB:.2f} GiB (aliased "
        f"{memory.alias_size_in_bytes / GIB:.2f}), temp {memory.temp_size_in_bytes / GIB:.2f}"
        f" GiB, peak {peak / GIB:.2f} GiB; matmul FLOPs {flops:.4g}"
        + (f" (of which {floor:.3g} in data-dependent loops, counted once)" if floor else "")
    )
    for kind, row in table.items():
        if row["count"]:
            dtypes = sorted({d for c in found if c.kind == kind for d in c.dtypes})
            print(
                f"  {kind:<18} {row['count']:>6} per call  {row['bytes'] / GIB:9.3f} GiB "
                f"received per device  ({', '.join(dtypes)})"
            )
    return memory, table, flops, found


# ---- the training step: grad step, update ------------------------------------------------------


def compile_grad(run: Run, model: Model, grad_step, teacher_len: int, student_len: int):
    """The grad step compiled over one micro-batch of student and teacher packs of these row
    lengths: (executable, HLO after SPMD partitioning, seconds)."""
    from opsd_jax.parallel import mesh as mesh_lib

    args = run.args
    student = pack(run.samples, student_len, args.student_slots, args.loss_entries, run.mesh)
    teacher = pack(run.samples, teacher_len, args.teacher_slots, args.loss_entries, run.mesh)
    with mesh_lib.use_mesh(run.mesh):
        lowered = grad_step.lower(
            model.state.params,
            model.state.teacher_params
            if model.teacher_model is None
            else model.state.teacher_weights,
            student,
            teacher,
            model.state.base,
        )
        return compile_program(lowered, run.mesh)


def grad_step_section(run: Run, model: Model) -> Grad:
    """Compiles the grad step; prints its report, its activation collectives and its weight
    gathers and gradient reductions against what FSDP should move."""
    from opsd_jax import run_config
    from opsd_jax.programs import hbm_traffic, hlo_stats
    from opsd_jax.training import train_step

    args, samples, n = run.args, run.samples, run.n
    split = run_config.TrainedSplit.of_config(run.recipe)
    grad_step = train_step.make_grad_step(
        model.graphdef,
        model.rest,
        run_config.loss_settings(run.recipe),
        split.teacher,
        model.teacher_model,
    )
    grad_compiled, grad_text, seconds = compile_grad(
        run, model, grad_step, args.teacher_len, args.student_len
    )
    grad_memory, grad_table, grad_flops, grad_found = report(
        f"grad step (student {samples}x{args.student_len}, teacher {samples}x{args.teacher_len}, "
        f"C={args.loss_entries})",
        grad_compiled,
        grad_text,
        seconds,
    )

    # Activation collectives: anything that is not a weight or weight gradient (or a scalar).
    f = n // (args.num_replicate * args.num_tensor)
    splits = {f, args.num_tensor, f * args.num_tensor}
    activations = hlo_stats.activation_collectives(
        grad_found, (model.abstract_params, model.abstract_rest), splits
    )
    print(
        f"  activation collectives: {sum(c.count for c in activations)} per call, "
        f"{sum(c.count * c.moved_bytes for c in activations) / 2**20:.2f} MiB"
        + (
            " (under tensor parallelism the per-layer all-reduces of the split heads and MLP "
            "are expected here)"
            if args.num_tensor > 1
            else ""
        )
    )
    # Weights are gathered over the fsdp axis only (replicas hold the same shards).
    if f == 1:  # no fsdp axis: every device holds whole weights, nothing to gather
        print("  no weight gathers or gradient reduce-scatters: the fsdp axis has 1 device")
    else:
        bf16_param_bytes = model.num_params * 2 / args.num_tensor
        expected_gather = 3 * bf16_param_bytes / f * (f - 1)
        gathered = grad_table["all-gather"]["bytes"]
        print(
            f"  all-gather per micro-batch {gathered / GIB:.3f} GiB vs (student fwd + student bwd "
            f"re-gather + teacher fwd) x bf16 params / {f} x {f - 1} = {expected_gather / GIB:.3f} GiB "
            f"(ratio {gathered / expected_gather:.3f})"
        )
        scattered = grad_table["reduce-scatter"]["bytes"] + grad_table["all-reduce"]["bytes"]
        print(
            f"  gradient reduction per micro-batch {scattered / GIB:.3f} GiB = "
            f"{scattered / (bf16_param_bytes / f * (f - 1)):.3f} x (one bf16 copy of the params x "
            f"{f - 1}/{f}): reduce-scatter in bf16, summed into the fp32 accumulator on each shard"
            + (
                "; with replicas XLA partitions it as one all-reduce over data x fsdp and a slice "
                "(counted as an all-reduce: an upper bound)"
                if args.num_replicate > 1
                else ""
            )
        )
    if run.on_gpu:
        kernels = hbm_traffic.pallas_kernels(grad_compiled.as_text())
        print(f"  Pallas (Triton) kernels in the program: {', '.join(kernels) or 'none'}")
    return Grad(step=grad_step, memory=grad_memory, table=grad_table, flops=grad_flops)


def update_section(run: Run, model: Model) -> float:
    """Compiles the optimizer + EMA update; prints its report and returns its seconds per step
    (its HBM bytes at the projection GPU's bandwidth)."""
    import jax.numpy as jnp

    from opsd_jax.parallel import device_memory
    from opsd_jax.parallel import mesh as mesh_lib
    from opsd_jax.programs import hbm_traffic
    from opsd_jax.training import train_step

    state = model.state
    state_args = (state, state.params, 2, jnp.float32(0))
    from opsd_jax import run_config

    teacher = run_config.TrainedSplit.of_config(run.recipe).teacher
    update = train_step.make_apply_update(model.optimizer, teacher, run.recipe.ema_decay)
    with mesh_lib.use_mesh(run.mesh):
        update_compiled, update_text, seconds = compile_program(update.lower(*state_args), run.mesh)
    update_memory, _, _, _ = report("optimizer + EMA update", update_compiled, update_text, seconds)
    # The update streams the fp32 params, gradients, moments and EMA through HBM once per step:
    # it reads every argument and writes every output at least once (what its kernels are
    # counted to move, where the GPU program shows more, is taken instead).
    # A LoRA state's frozen base passes through the update untouched (forwarded, not copied).
    update_bytes = (
        update_memory.argument_size_in_bytes
        + update_memory.output_size_in_bytes
        - 2 * model.base_bytes
        - 2 * device_memory.bytes_per_device(state.teacher_weights)
    )
    if run.on_gpu:
        counted = hbm_traffic.total_bytes(hbm_traffic.outside_loops(update_compiled.as_text()))
        update_bytes = max(update_bytes, counted)
    update_s = update_bytes / run.hbm_bw
    print(
        f"  HBM per update per device: {update_bytes / GIB:.2f} GiB (its arguments read and "
        f"outputs written once, or its kernels' count if more) -> {update_s * 1e3:.1f} ms per "
        f"step"
    )
    return update_s


# ---- the sampler: refresh, prefill, decode round, per sampler layout ---------------------------
# After each update the params become a bf16 copy in a decode layout (one jitted reshard); the
# sampler prefills and decodes on it under the decode mesh and rules, as sampler.sample(copy)
# does.


@dataclasses.dataclass
class DecodeRound:
    """The decode round as compiled on one layout's copy, and what it costs per token step
    besides its bytes."""

    compiled: Any
    memory: Any  # its compiled memory analysis
    table: dict  # its collectives by kind, counted through the loop at its bound
    cache: Any  # the abstract KV cache (k and v) in the view's layout
    collective_s: float  # per token step, at the stated latency of a small collective
    launches: Any  # per token step with the sampler's command buffers (None on the CPU proxy)
    plain_launches: Any  # the same without command buffers


def sampling_for(run: Run, model: Model) -> Sampling:
    """The rollout's rows, KV-cache shape and settings, and the state the copy is made from."""
    from flax import nnx

    from opsd_jax.run_config.preflight_sampling import SHAPE_SPECIAL
    from opsd_jax.sampling import sampler
    from opsd_jax.training import train_step

    llm = run.llm
    rows = run.samples * run.accum
    slots = sampler.cache_slots_for(run.args.prompt_len, run.new_tokens, run.rounds - 1)
    return Sampling(
        rows=rows,
        slots=slots,
        cache_shape=sampler.cache_shape_for(
            llm.num_hidden_layers, rows, slots, llm.num_key_value_heads, llm.head_dim
        ),
        settings=sampler.round_settings(SHAPE_SPECIAL, llm.vocab_size, run.new_tokens, 1.0, True),
        model_state=nnx.merge_state(
            train_step.model_params(model.state.params, model.state.base), model.abstract_rest
        ),
    )


def decode_view(run: Run, layout: str):
    """The decode mesh of `layout` over the training mesh's devices."""
    from opsd_jax.parallel import mesh as mesh_lib
    from opsd_jax.sampling import layout_choice

    heads = layout_choice.head_counts(run.model_config)
    # The tensor axis splits every head count into whole heads (28 / 4 heads on 8 GPUs: 4).
    return mesh_lib.decode_mesh(
        run.mesh,
        layout,
        mesh_lib.tensor_size_for(heads, min(run.args.devices_per_host, run.n))
        if layout == "tensor"
        else None,
    )


def tensor_is_replicated(run: Run) -> bool:
    """Whether the 'tensor' layout decodes on the replicated layout's mesh (a tensor axis of
    one device: one GPU, or heads that do not split), every weight whole on each device."""
    return dict(decode_view(run, "tensor").shape) == dict(decode_view(run, "replicated").shape)


def refresh_section(run: Run, model: Model, sampling: Sampling, view, layout: str):
    """Compiles the decode-copy refresh to `view`; prints its report and returns (the copy's
    graphdef, the abstract copy, the bytes the refresh moves per device)."""
    from opsd_jax.sampling import decode_copy

    dtype = run.recipe.compute_dtype
    copy_graphdef, copy = decode_copy.abstract_decode_copy(
        model.graphdef, sampling.model_state, view, dtype
    )
    refresh = decode_copy.cast_function(model.graphdef, sampling.model_state, view, dtype)
    refresh_compiled, refresh_text, seconds = compile_program(
        refresh.lower(sampling.model_state), view
    )
    _, refresh_table, _, _ = report(
        f"decode-copy refresh to '{layout}' (decode mesh {dict(view.shape)})",
        refresh_compiled,
        refresh_text,
        seconds,
    )
    return copy_graphdef, copy, sum(row["bytes"] for row in refresh_table.values())


def prefill_section(run: Run, sampling: Sampling, view, layout: str, copy_graphdef, copy):
    """Compiles the sampler's prefill on the copy, of the rollout's first group of prompts
    (all of them unless the recipe's rollout_prefill_rows is smaller); prints its report and
    returns (its memory analysis, its matmul FLOPs per device, its rows)."""
    import jax.numpy as jnp

    from opsd_jax.parallel import mesh as mesh_lib
    from opsd_jax.sampling import sampler
    from opsd_jax.sampling.row_placement import first_group_rows

    args, rows = run.args, sampling.rows
    with mesh_lib.use_mesh(view, mesh_lib.DECODE_RULES):
        group = first_group_rows(rows, run.recipe.rollout_prefill_rows)
        prompt = pack(group, args.prompt_len, args.prompt_slots, 0, view)
        lowered = sampler.prefill_rows.lower(
            copy_graphdef,
            copy,
            prompt,
            run.new_tokens,
            sampling.slots,
            jnp.dtype(jnp.bfloat16),
            mesh_lib.DECODE_RULES,
        )
        prefill_compiled, prefill_text, seconds = compile_program(lowered, view)
    groups = f" at a time, {-(-rows // group)} groups" if group < rows else ""
    prefill_memory, _, prefill_flops, _ = report(
        f"prefill on the '{layout}' copy ({group} prompts{groups} of {args.prompt_len} tokens, "
        f"{args.prompt_patches} patches in {args.prompt_slots} slots; cache of "
        f"{sampling.slots} slots)",
        prefill_compiled,
        prefill_text,
        seconds,
    )
    return prefill_memory, prefill_flops, group


def decode_round_section(
    run: Run, sampling: Sampling, view, layout: str, copy_graphdef, copy
) -> DecodeRound:
    """Compiles the decode round on the copy (on a GPU target also without command buffers);
    prints its report, its launches and host syncs per token step and its collectives."""
    import jax
    import jax.numpy as jnp

    from models import decode_attention_pallas
    from models.sharding import logical_spec
    from opsd_jax.parallel import mesh as mesh_lib
    from opsd_jax.programs import gpu_target, thunk_launches
    from opsd_jax.sampling import sampler

    rows, settings, llm = sampling.rows, sampling.settings, run.llm

    def sharding(shape, names):
        return jax.sharding.NamedSharding(
            view, logical_spec(shape, names, view, mesh_lib.DECODE_RULES)
        )

    view_state = sampler.abstract_decode_state(sampling.cache_shape, run.new_tokens, sharding)
    tokens = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=sharding((rows,), ("act_batch",)))
    with mesh_lib.use_mesh(view, mesh_lib.DECODE_RULES):
        lowered = sampler.decode_round.lower(
            copy_graphdef,
            copy,
            view_state,
            sampler.abstract_key(view),
            tokens,
            settings,
            mesh_lib.DECODE_RULES,
        )
        program, seconds = compile_with_thunks(lowered, view)
        if run.on_gpu:  # the same round without command buffers: every kernel a host launch
            plain = compile_with_thunks(lowered, view, xla_gpu_enable_command_buffer="")[0]
    compiled, text = program.compiled, program.partitioned
    memory, table, _, _ = report(
        f"decode round on the '{layout}' copy ({rows} rows, cache {sampling.slots} slots; one "
        f"while_loop iteration per token)",
        compiled,
        text,
        seconds,
    )
    # Per token: the collectives (counted through the loop at its bound, max_steps trips),
    # and on a GPU the launches, kernels in graphs and host syncs of the thunk sequence.
    collectives = sum(row["count"] for row in table.values()) / settings.max_steps
    launches = plain_launches = None
    if run.on_gpu:
        launches = thunk_launches.per_iteration(
            program.thunk_sequence, program.thunk_metadata, compiled.as_text()
        )
        plain_launches = thunk_launches.per_iteration(
            plain.thunk_sequence, plain.thunk_metadata, plain.compiled.as_text()
        )
        grids = [
            k.grid
            for k in thunk_launches.kernels(
                thunk_launches.parse(program.thunk_sequence),
                decode_attention_pallas.KERNEL_NAME,
            )
        ]
        for name, counted in (("without", plain_launches), ("with", launches)):
            print(
                f"  launches per decode step {name} command buffers: {counted.launches:.0f} "
                f"({counted.graph_launches:.0f} of them CUDA graphs holding "
                f"{counted.graph_kernels:.0f} kernels), host syncs {counted.host_syncs:.0f}"
                + (" (the sampler's XLA options)" if name == "with" else "")
            )
        if grids:
            print(
                f"  decode attention kernel grid {grids[0]} = {math.prod(grids[0])} programs "
                f"per call on {gpu_target.sm_count(run.target)} SMs"
            )
    print(
        f"  collectives per decode step: {collectives:.0f}"
        + (
            f" (2 x {llm.num_hidden_layers} layers + 1 = {2 * llm.num_hidden_layers + 1} "
            "all-reduces of the tensor layout, + the stop test)"
            if layout == "tensor"
            else " (the stop test: any row still active)"
        )
    )
    return DecodeRound(
        compiled=compiled,
        memory=memory,
        table=table,
        cache=view_state.cache,
        collective_s=collectives * run.collective_latency,
        launches=launches,
        plain_launches=plain_launches,
    )


def decode_step_hbm(run: Run, sampling: Sampling, decode: DecodeRound, copy) -> dict:
    """The HBM bytes of one decode step per device (counted kernel by kernel in a GPU program,
    assumed at the floor on the CPU proxy) next to the floor; prints them."""
    import jax

    from models import decode_attention_pallas
    from opsd_jax.parallel import device_memory
    from opsd_jax.programs import hbm_traffic

    llm, slots = run.llm, sampling.slots
    copy_bytes = device_memory.bytes_per_device(copy)
    cache_bytes = device_memory.bytes_per_device(decode.cache)  # k and v, at capacity
    # The floor per decode step: the copy's weights on the decode path (not the ViT, of the
    # embedding table only the rows fed) read once, and each row's cache up to its length.
    vit_bytes = sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for p, x in jax.tree_util.tree_flatten_with_path(copy)[0]
        if "language_model" not in jax.tree_util.keystr(p)
        or "embed_tokens" in jax.tree_util.keystr(p)
    )
    decode_weights = copy_bytes - vit_bytes
    mean_length = run.args.prompt_len + run.new_tokens / 2
    floor = decode_weights + cache_bytes * mean_length / slots
    if run.on_gpu:
        text = decode.compiled.as_text()
        # The Pallas decode attention takes the whole stacked cache and reads, per call, one
        # layer's K and V of each row up to the row's length: counted at the mean length.
        kernels = hbm_traffic.with_reads(
            hbm_traffic.loop_traffic(text),
            decode_attention_pallas.KERNEL_NAME,
            int(cache_bytes / llm.num_hidden_layers * mean_length / slots),
        )
        step_hbm = hbm_traffic.total_bytes(kernels)
        copies = hbm_traffic.data_movement(kernels)
        outside = hbm_traffic.total_bytes(hbm_traffic.outside_loops(text))
        print(
            f"  HBM per decode step per device, from the GPU program: {step_hbm / GIB:.3f} "
            f"GiB in {len(kernels)} kernels, of which {hbm_traffic.total_bytes(copies) / GIB:.3f}"
            f" GiB in {len(copies)} data-movement kernels (copies, slices, pads); floor "
            f"{floor / GIB:.3f} GiB (bf16 decode weights {decode_weights / GIB:.3f} + KV "
            f"cache at the mean length {mean_length:.0f} of {slots} slots "
            f"{cache_bytes * mean_length / slots / GIB:.3f}): {step_hbm / floor:.2f}x the "
            f"floor; {outside / GIB:.3f} GiB once per round outside the loop"
        )
        print("  the decode step's largest kernels (bytes per step):")
        print(hbm_traffic.describe(kernels, top=8))
    else:
        # A CPU program says nothing of a GPU's kernels: assume the floor at full capacity.
        step_hbm = decode_weights + cache_bytes
        print(
            f"  HBM per decode step per device (CPU proxy: assumed, not counted): weights "
            f"{decode_weights / GIB:.3f} + KV cache at capacity {cache_bytes / GIB:.3f} GiB"
        )
    return dict(step_hbm=step_hbm, floor=floor, copy_bytes=copy_bytes, cache_bytes=cache_bytes)


def sampler_layout(run: Run, model: Model, sampling: Sampling, layout: str) -> dict:
    """Every sampler program on `layout`'s copy, compiled and reported; returns the layout's
    times (per token step, per rollout, prefill, refresh) and its sampling peak memory."""
    view = decode_view(run, layout)
    copy_graphdef, copy, refresh_moved = refresh_section(run, model, sampling, view, layout)
    prefill_memory, prefill_flops, group = prefill_section(
        run, sampling, view, layout, copy_graphdef, copy
    )
    decode = decode_round_section(run, sampling, view, layout, copy_graphdef, copy)
    hbm = decode_step_hbm(run, sampling, decode, copy)
    moved = sum(row["bytes"] for row in decode.table.values()) / sampling.settings.max_steps
    bytes_s = max(hbm["step_hbm"] / run.hbm_bw, moved / run.link_bw)
    launches, plain_launches = decode.launches, decode.plain_launches
    if launches is not None:
        launch_s = launches.launches * LAUNCH_S + launches.graph_kernels * GRAPH_NODE_S
        plain_launch_s = plain_launches.launches * LAUNCH_S
        sync_s = launches.host_syncs * HOST_SYNC_S
    else:  # the CPU proxy's program says nothing of a GPU's launches
        launch_s = plain_launch_s = sync_s = 0.0
    token_s = bytes_s + decode.collective_s + launch_s + sync_s
    copy_bytes, cache_bytes = hbm["copy_bytes"], hbm["cache_bytes"]
    # (peak, below) A prefill meets the pool with the lookahead's paused rows, or as a later
    # group of prompts; its own output is its group's share of the cache.
    pool_beside = cache_bytes if run.recipe.rollout_lookahead or group < sampling.rows else 0
    prefilled = cache_bytes * group // sampling.rows
    local_rows = decode.cache.sharding.shard_shape(decode.cache.shape)[1]
    row = dict(
        token_s=token_s,
        bytes_s=bytes_s,
        collective_s=decode.collective_s,
        launch_s=launch_s,
        plain_launch_s=plain_launch_s,
        sync_s=sync_s,
        floor_s=hbm["floor"] / run.hbm_bw,
        # One more row's KV cache read per decode step, half full on average.
        cache_s_per_row=cache_bytes / local_rows / 2 / run.hbm_bw,
        rollout_s=token_s * run.new_tokens,
        refresh_s=refresh_moved / run.link_bw,
        prefill_s=prefill_flops * -(-sampling.rows // group) / (run.peak_flops * run.args.mfu),
        # The engine's programs, counted as the preflight counts them
        # (opsd_jax/run_config/preflight_sampling.py): the prefill writes the rows' cache beside
        # its temp, a decode chunk holds the pool beside its temp; the copy and the train state
        # throughout. With the recipe's lookahead a prefill can meet a pool holding paused rows,
        # and with rollout_prefill_rows a later group the pool the first made: that pool's cache
        # is beside the prefill, and the insert holds both caches. Otherwise the prefilled rows
        # become the pool (no second cache). Evaluation's pool is the preflight's to count
        # (`train.py --compile_only`). No gradient accumulator: it lives inside train.py's one
        # train step program.
        peak=model.state_bytes
        + copy_bytes
        + max(
            cache_bytes + decode.memory.temp_size_in_bytes,  # a decode chunk over the pool
            prefilled + prefill_memory.temp_size_in_bytes + pool_beside,  # a prefill
            prefilled + pool_beside,  # the insert
        ),
    )
    print(
        f"  copy {copy_bytes / GIB:.2f} GiB per device, refreshed once per step by "
        f"{refresh_moved / GIB:.2f} GiB of all-gather per device; KV cache "
        f"{cache_bytes / GIB:.3f} GiB per device; moved per token step "
        f"{moved / 2**20:.3f} MiB"
    )
    return row


# ---- projection --------------------------------------------------------------------------------


def grad_step_time(run: Run, model: Model, grad: Grad) -> GradTime:
    """The grad step's compute (counted matmuls + attention at --mfu) and communication time
    per micro-batch; prints the projection's header and the grad step's lines."""
    from opsd_jax import run_config

    args, samples, n, llm = run.args, run.samples, run.n, run.llm
    split = run_config.TrainedSplit.of_config(run.recipe)
    tokens_student = samples * args.student_len
    tokens_teacher = samples * args.teacher_len
    # The student's forward and backward: 6·N·tokens, or 4·N·tokens with LoRA (a frozen base
    # has no weight gradient; the adapters' matmuls are negligible).
    train_factor = 4 if split.lora else 6
    lm_matmul = model.lm_matmul
    analytic = (
        train_factor * lm_matmul * tokens_student
        + 2 * lm_matmul * tokens_student  # + remat
        + 2 * lm_matmul * tokens_teacher
    ) / n
    # Attention FLOPs (QK^T and PV, 2 FLOPs a multiply-add) per visible query-key pair; the
    # student's counted 4 times (forward, remat re-forward, backward's two), the teacher's once.
    # A row is causal except inside an image, whose tokens see the whole image both ways: the
    # image adds P(P-1)/2 pairs (counted as one image of the row's patches: a split image adds
    # fewer). Before this, every row was counted causal (L^2/2 pairs).
    per_pair = 2 * 2 * llm.num_hidden_layers * llm.num_attention_heads * llm.head_dim * samples / n

    def pairs(length, patches):
        return length * (length + 1) / 2 + patches * (patches - 1) / 2

    attention = per_pair * (
        4 * pairs(args.student_len, args.student_patches)
        + pairs(args.teacher_len, args.teacher_patches)
    )
    causal_attention = per_pair * (4 * args.student_len**2 / 2 + args.teacher_len**2 / 2)
    speed = run.peak_flops * args.mfu
    compute_s = (grad.flops + attention) / speed
    causal_compute_s = (grad.flops + causal_attention) / speed
    table = grad.table
    comm_s = (
        table["all-gather"]["bytes"]
        + table["reduce-scatter"]["bytes"]
        + table["all-reduce"]["bytes"]
    ) / run.link_bw
    print(
        f"\nprojection on {run.gpu} (peak {run.peak_flops / 1e12:.0f} TFLOP/s bf16, assumed MFU "
        f"{args.mfu}; HBM {run.hbm_bw / 1e12:.2f} TB/s, NVLink {run.link_bw / 1e9:.0f} GB/s per "
        f"direction):"
    )
    print(
        f"  grad step: matmul FLOPs {grad.flops:.4g} per device (analytic {train_factor}·N·tokens + remat "
        f"re-forward + teacher 2·N·tokens = {analytic:.4g}, N = {lm_matmul / 1e9:.2f}B LM "
        f"layer params) + attention {attention:.4g} (causal rows with bidirectional image "
        f"blocks of {args.student_patches} / {args.teacher_patches} patches; all causal: "
        f"{causal_attention:.4g})"
    )
    # The same micro-batch in MaxText's count (opsd_jax/training/step_flops.py: no remat, the
    # pairs above, the ViT with its attention), and the MFU the projection's time implies.
    from opsd_jax.training import step_flops

    def counts(length, patches):
        return step_flops.PackCounts(
            tokens=samples * length // n,
            llm_pairs=int(samples * pairs(length, patches) / n),
            patches=samples * patches // n,
            vit_pairs=samples * patches * patches // n,
            loss_entries=samples * args.loss_entries // n,
        )

    maxtext = step_flops.opsd_step_flops(
        run.model_config,
        counts(args.student_len, args.student_patches),
        counts(args.teacher_len, args.teacher_patches),
        step_flops.Trained.of_split(split),
        remat=llm.remat,
    )
    print(
        f"  grad step in MaxText's count: model FLOPs {maxtext.model:.4g} per device "
        f"(executed, remat included: {maxtext.executed:.4g}); at the compute time below that is "
        f"an MFU of {step_flops.utilisation(maxtext.model, compute_s, run.peak_flops):.1%}"
    )
    print(
        f"  grad step: compute {compute_s:.2f} s at MFU {args.mfu}, communication "
        f"{comm_s:.2f} s -> {max(compute_s, comm_s):.2f} s (fully overlapped) .. "
        f"{compute_s + comm_s:.2f} s (none overlapped) per micro-batch"
    )
    return GradTime(compute_s=compute_s, comm_s=comm_s, causal_compute_s=causal_compute_s)


def print_decode_times(run: Run, sampling: Sampling, layouts: dict) -> None:
    """One line per sampler layout: a token step's parts, a rollout, prefill and refresh."""
    rows, new_tokens = sampling.rows, run.new_tokens
    for layout, row in layouts.items():
        print(
            f"  decode on the '{layout}' copy: {row['token_s'] * 1e3:.2f} ms per token step = "
            f"HBM {row['bytes_s'] * 1e3:.2f} + collective latency "
            f"{row['collective_s'] * 1e3:.2f} + launches and kernels in graphs "
            f"{row['launch_s'] * 1e3:.2f} (without command buffers, launches "
            f"{row['plain_launch_s'] * 1e3:.2f}) + host syncs "
            f"{row['sync_s'] * 1e3:.2f} ms (floor {row['floor_s'] * 1e3:.2f} ms) -> "
            f"{rows / run.n / row['token_s']:.0f} tokens/s per GPU; a {new_tokens}-token rollout "
            f"of {rows} rows {row['rollout_s']:.1f} s (bytes only {row['bytes_s'] * new_tokens:.1f}"
            f" s; at the floor {row['floor_s'] * new_tokens:.1f} s), + prefill "
            f"{row['prefill_s']:.2f} s, + refresh {row['refresh_s'] * 1e3:.1f} ms per step"
        )
    if run.on_gpu:
        print(
            f"  (stated costs: {LAUNCH_S * 1e6:.0f} us a host launch, {GRAPH_NODE_S * 1e6:.0f} "
            f"us a kernel in a CUDA graph, {HOST_SYNC_S * 1e6:.0f} us a host sync, "
            f"{run.collective_latency * 1e6:.0f} us a small collective; all added, none "
            f"overlapped)"
        )


def step_time(run: Run, layouts: dict, update_s: float, grad_time: GradTime) -> str:
    """The step and the recipe's hours (micro-batches, sampling in the recipe's layout, update,
    host work); prints them and returns the layout the step samples in."""
    args, recipe, accum = run.args, run.recipe, run.accum
    # The step samples on the copy in the recipe's layout.
    # The recipe's layout; 'auto': the least rollout time among those that fit (as train.py's
    # choice, from the counted programs here instead of its weights-and-cache projection).
    budget = run.hbm_bytes * usable_share()
    layout_used = recipe.sampler_layout
    if layout_used == "auto":
        fitting = [name for name, row in layouts.items() if row["peak"] <= budget] or list(layouts)
        layout_used = min(fitting, key=lambda name: layouts[name]["rollout_s"])
        print(
            f"  sampler_layout 'auto' -> '{layout_used}' (least rollout time of the layouts "
            f"that fit)"
        )
    chosen = layouts[layout_used]
    sampling_s = chosen["rollout_s"] + chosen["prefill_s"] + chosen["refresh_s"]
    # Host work per step, measured on this machine (bench/host_work.py). Added: the training
    # packs, built after the rollout's completions reach the host and before the step can be
    # dispatched. Not added (overlapped): image decode and transform (the data pipeline's
    # threads, prefetched), the prompt packs (train.py builds them before it waits for the
    # previous step, dispatched and not awaited, to finish on the devices) and the pack memory
    # (made on a thread while the previous step and the rollout run).
    host_s = overlapped_s = new_arrays_s = 0.0
    if not args.skip_host_work:
        import host_work  # bench/host_work.py, beside this script

        parts = host_work.measure(recipe)
        host_s, new_arrays_s = parts["training packs"], parts["training packs, new arrays"]
        overlapped_s = parts["total"] - host_s
    compute_s, comm_s = grad_time.compute_s, grad_time.comm_s
    step_low = accum * max(compute_s, comm_s) + sampling_s + update_s + host_s
    step_high = accum * (compute_s + comm_s) + sampling_s + update_s + host_s
    # What this script printed before every cost was counted: bytes-only decode, all-causal
    # attention, no update, no host work.
    bytes_sampling_s = (
        chosen["bytes_s"] * run.new_tokens + chosen["prefill_s"] + chosen["refresh_s"]
    )
    old_low = accum * max(grad_time.causal_compute_s, comm_s) + bytes_sampling_s
    old_high = accum * (grad_time.causal_compute_s + comm_s) + bytes_sampling_s
    hours = lambda s: s * recipe.total_steps / 3600  # noqa: E731
    print(
        f"  optimizer + EMA update {update_s:.2f} s per step; host work measured on this "
        f"machine ({os.cpu_count()} cores): "
        + (
            f"training packs {host_s:.2f} s per step (on the step's path; into new arrays "
            f"{new_arrays_s:.2f} s), image decode, transform, prompt packs and pack memory "
            f"{overlapped_s:.2f} s (overlapped with device work)"
            if not args.skip_host_work
            else "not measured (--skip-host-work)"
        )
    )
    print(
        f"  step: {step_low:.2f} .. {step_high:.2f} s ({accum} micro-batches + "
        f"'{layout_used}' refresh, prefill and rollout {sampling_s:.2f} s + update + host "
        f"work); paper recipe ({recipe.total_steps} steps): {hours(step_low):.2f} .. "
        f"{hours(step_high):.2f} h"
    )
    print(
        f"  counted as before (decode bytes only, all-causal attention, no update or host "
        f"work): step {old_low:.2f} .. {old_high:.2f} s, recipe {hours(old_low):.2f} .. "
        f"{hours(old_high):.2f} h"
    )
    rollout_lengths(run, chosen, layouts.get("replicated", chosen), step_low, step_high)
    return layout_used


def rollout_lengths(
    run: Run, chosen: dict, replicated: dict, step_low: float, step_high: float
) -> None:
    """The rollout and the recipe at completion lengths below the cap: ThinkMorph's completions
    average 452 tokens before Visual-OPSD and 201 after (the paper's Appendix G), drawn here as
    exponential with that mean, capped at the recipe's budget (bench/rollout_schedule.py counts
    the engine's decode steps from the lengths). Exact on-policy (the engine, one slot per
    row: each step's longest row), with rollout_lookahead 1 and 2, beside the all-cap worst
    case above; and evaluation on one GPU, static batches against the engine's stream."""
    import rollout_schedule  # bench/rollout_schedule.py, beside this script

    recipe, token_s = run.recipe, chosen["token_s"]
    rows, cap, steps = run.samples * run.accum, run.new_tokens, 1000
    fixed_low, fixed_high = step_low - chosen["rollout_s"], step_high - chosen["rollout_s"]
    hours = lambda s: s * recipe.total_steps / 3600  # noqa: E731
    print(
        f"  at the paper's lengths (exponential, capped at {cap}; {steps} steps of {rows} rows "
        f"simulated, a decode step {token_s * 1e3:.1f} ms as above):"
    )
    for mean in (452, 201):
        lengths = rollout_schedule.exponential_lengths(steps * rows, mean, cap, seed=0)
        parts = []
        for lookahead in (0, 1, 2):
            decode = rollout_schedule.training_steps(lengths, rows, lookahead).mean()
            low, high = fixed_low + decode * token_s, fixed_high + decode * token_s
            name = "exact on-policy" if lookahead == 0 else f"lookahead {lookahead}"
            parts.append(
                f"{name} {decode:.0f} decode steps, rollout {decode * token_s:.1f} s, recipe "
                f"{hours(low):.2f} .. {hours(high):.2f} h"
            )
        print(f"    mean {mean} (drawn {lengths.mean():.1f}): " + "; ".join(parts))
    # Evaluation: one GPU decoding `rows` at a time reads every weight per decode step, as each
    # device of the 'replicated' copy does; its KV cache is that of all the rows, not of its
    # share (the difference counted as bytes over the HBM).
    extra_cache_s = replicated["cache_s_per_row"] * max(rows - rows / run.n, 0)
    eval_token_s = replicated["token_s"] + extra_cache_s
    for mean in (452, 201):
        lengths = rollout_schedule.exponential_lengths(1000, mean, cap, seed=1)
        static = rollout_schedule.static_steps(lengths, rows) * eval_token_s
        stream = rollout_schedule.stream_steps(lengths, rows) * eval_token_s
        print(
            f"    evaluation on one {run.gpu.upper()}, 1000 samples at mean {mean}, "
            f"greedy, {rows} rows at a time, decode only: static batches {static / 60:.1f} min, "
            f"the engine {stream / 60:.1f} min ({static / stream:.2f}x)"
        )


# ---- memory ------------------------------------------------------------------------------------


def memory_section(run: Run, model: Model, grad: Grad, layout_used: str, sampling_peak: float):
    """The peak memory per device of the grad step and of sampling against the GPU's, and
    (unless --skip-fit) the largest pack that fits each GPU."""
    args, samples, n, hbm_bytes = run.args, run.samples, run.n, run.hbm_bytes
    share = usable_share()
    budget = hbm_bytes * share
    grad_peak = model.resident + grad.memory.temp_size_in_bytes + grad.memory.output_size_in_bytes
    decode_peak = sampling_peak  # training state + copy + cache + the sampler's temp
    print(
        f"\nmemory per device on {run.gpu} ({hbm_bytes / GIB:.1f} GiB, use at most {share:.0%} "
        f"-> {budget / GIB:.1f} GiB): train state {model.state_bytes / GIB:.2f} GiB; grad step "
        f"peak {grad_peak / GIB:.2f} GiB ({grad_peak / hbm_bytes:.0%}, the gradient accumulator "
        f"included); sampling peak "
        f"('{layout_used}' copy) {decode_peak / GIB:.2f} GiB "
        f"({decode_peak / hbm_bytes:.0%})"
    )
    print("  fits" if max(grad_peak, decode_peak) <= budget else "  DOES NOT FIT")
    if args.skip_fit:
        return
    # Temp memory is linear in the pack lengths (attention included): compile once more with
    # both rows twice as long and extrapolate to the HBM budget.
    compiled2, _, _ = compile_grad(
        run, model, grad.step, 2 * args.teacher_len, 2 * args.student_len
    )
    temp1, temp2 = (
        grad.memory.temp_size_in_bytes,
        compiled2.memory_analysis().temp_size_in_bytes,
    )
    slope = (temp2 - temp1) / args.teacher_len  # bytes per teacher token (+ its student share)
    base = grad_peak - slope * args.teacher_len
    ratio = args.student_len / args.teacher_len
    for name in sorted(GPUS):
        room = gpu_memory_bytes(name) * share
        fit = int((room - base) / slope) if slope > 0 else 0
        print(
            f"  largest pack on {name}: teacher rows of {fit:,} tokens with student rows "
            f"of {int(fit * ratio):,} ({samples // (n // args.num_tensor)} row(s) of each "
            f"per device; temp grows {slope / 2**20:.3f} MiB per teacher token, measured "
            f"at {args.teacher_len} and {2 * args.teacher_len})"
        )


def print_unknowns(run: Run) -> None:
    """The report's last line: what no compile without a device can know."""
    print(
        "\nNot known from a compile without a device: kernel speeds (nothing is autotuned; "
        f"compute is assumed at MFU {run.args.mfu}, decode at the full HBM bandwidth), how much "
        "communication overlaps compute (both bounds shown), what a launch, a kernel in a "
        "graph, a host sync or a small collective costs (stated above, added)"
        + (
            ""
            if run.on_gpu
            else "; and on the CPU proxy the GPU's fusions, copies and temp "
            "buffers (its HBM per decode step is assumed at the floor, not counted)"
        )
        + "."
    )


def main():
    args = parse_args()
    run = set_up(args, configure_environment(args))
    model = abstract_model(run)
    grad = grad_step_section(run, model)
    update_s = update_section(run, model)
    sampling = sampling_for(run, model)
    # 'auto' picks one of them (step_time).
    layouts = {"replicated": sampler_layout(run, model, sampling, "replicated")}
    if tensor_is_replicated(run):  # the same copy, so the same programs: compiled once
        print("\n'tensor' layout: a tensor axis of 1, the same programs as 'replicated'")
        layouts["tensor"] = layouts["replicated"]
    else:
        layouts["tensor"] = sampler_layout(run, model, sampling, "tensor")
    grad_time = grad_step_time(run, model, grad)
    print_decode_times(run, sampling, layouts)
    layout_used = step_time(run, layouts, update_s, grad_time)
    memory_section(run, model, grad, layout_used, layouts[layout_used]["peak"])
    print_unknowns(run)


if __name__ == "__main__":
    main()
