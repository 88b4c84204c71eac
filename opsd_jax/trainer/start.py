"""The start state of a run: fresh or resumed, the model and tokenizer, the train state.

`open_start` decides fresh vs resume (auto_resume: this run's own newest checkpoint; or
resume_from), says every config key a resume changes and refuses one that contradicts the state
(and LoRA adapters on another base, or another checkpoint teacher than the saved run's), loads
the model and tokenizer (the HF files, a random init, or only their shapes where a checkpoint
gives the weights), attaches the LoRA adapters, loads a checkpoint teacher, and makes the train
state: a fresh one jitted into the layout the step compiles for, or the checkpoint's restored
straight into its shards (peak memory: one state). What trains and what is held frozen is
asked of the config's TrainedSplit (run_config/trained_split.py), never decided here.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from models import attention
from opsd_jax import run_config
from opsd_jax.io import hf_load, init_weights, saved_items, teacher_checkpoint, weights_digest
from opsd_jax.io.checkpoint import Checkpointer, abstract_like
from opsd_jax.io.hf_load import load_hf
from opsd_jax.parallel import distributed
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.training import resume_changes, train_step


@dataclasses.dataclass
class Start:
    """What a run starts from: the model's parts and the train state at `start_step`."""

    graphdef: Any  # the model's nnx graph (with LoRA, its adapters' places)
    rest: Any  # the model's non-Param state
    abstract_params: Any  # every nnx.Param as abstract arrays (with LoRA, adapters and base)
    model_config: Any
    tokenizer: Any
    state: Any  # the TrainState on the devices
    abstract_state: Any  # what the train step compiles for
    optimizer: Any
    frozen: tuple  # the frozen parameter groups
    lora_base: dict | None  # LoRA: the base weights' identity, recorded in every checkpoint
    split: Any  # run_config.TrainedSplit: what trains, what is frozen
    start_step: int
    resumed: str | None  # the checkpoint directory resumed from, or None (a fresh start)
    data_state: Any = None  # the data iterator's saved state (a resume)
    saved_config: dict | None = None  # the resumed checkpoint's config
    # teacher_checkpoint.TeacherCheckpoint of each checkpoint teacher (split.checkpoint_paths'
    # order; their params dropped: the state holds them)
    teachers: tuple = ()

    def step_teachers(self) -> train_step.StepTeachers:
        """The train step's teachers, the checkpoint teachers' graphs with them."""
        return self.split.step_teachers(
            tuple(train_step.TeacherModel(t.graphdef, t.rest) for t in self.teachers)
        )

    @property
    def teacher_flops_config(self):
        """The model config the teacher's forward is counted at (step_flops): the one teacher's
        own when it is another checkpoint; otherwise (the student's own weights, or teachers by
        source, each scoring its share once) None: the student's."""
        one_checkpoint = len(self.split.teachers) == 1 and len(self.teachers) == 1
        return self.teachers[0].model_config if one_checkpoint else None

    @property
    def teacher_identities(self) -> list[dict]:
        """The checkpoint teachers' identities, as every checkpoint records them."""
        return [t.identity for t in self.teachers]


def resumed_from(config, checkpointer: Checkpointer, checkpoint_dir: str) -> str | None:
    """The checkpoint directory the run resumes from: its own (auto_resume, once it has a step),
    else resume_from (a whole-state resume), else None: a fresh start."""
    if config.auto_resume and checkpointer.latest_step() is not None:
        return checkpoint_dir
    if config.resume_from and not config.resume_model_only:
        return config.resume_from
    return None


def check_no_later_steps(checkpointer: Checkpointer, checkpoint_dir: str, resumed: str | None):
    """Refuse a start whose own checkpoint directory already holds steps after its start step
    (a fresh start, or a resume of an older step, over an earlier run's checkpoints): the saves
    of those steps would be skipped, and the next resume would go back to the old ones."""
    if resumed == checkpoint_dir:  # its own newest step: nothing lies after it
        return
    start_step = 0
    if resumed:
        try:
            start_step = int(os.path.basename(saved_items.step_dir_of(resumed)))
        except (FileNotFoundError, ValueError) as e:
            run_config.config_error(f"resume_from={resumed}: {e}")
    later = [step for step in checkpointer.all_steps() if step > start_step]
    if later:
        run_config.config_error(
            f"checkpoint_dir {checkpoint_dir} already holds step(s) "
            f"{', '.join(map(str, later))}, after this run's start at step {start_step}: "
            "its saves of those steps would be skipped and a resume would go back to them; "
            "move or delete them, or give another checkpoint_dir"
            + ("" if resumed else " (or auto_resume=True to continue from them)")
        )


def check_resume(config, resumed: str, say: Callable) -> str | None:
    """Every changed key said (saved -> now); one that contradicts the state refused, and LoRA
    adapters resumed onto another base than theirs. Returns the saved teacher mode."""
    try:
        for line in resume_changes.check(
            saved_items.saved_config(resumed), config.to_dict(), resumed
        ):
            say(line)
    except resume_changes.ResumeConfigError as e:
        run_config.config_error(e)
    saved_teacher = saved_items.saved_teacher_mode(resumed)
    split = run_config.TrainedSplit.of_config(config)
    saved = saved_items.saved_teacher_checkpoints(resumed)
    if split.separate_teacher and saved:  # the same checkpoint teachers, only
        now = [teacher_checkpoint.identity(path) for path in split.checkpoint_paths]
        if sorted(t["digest"] for t in saved) != sorted(t["digest"] for t in now):
            given = "teacher_by_source" if split.teacher_by_source else "teacher_path"
            run_config.config_error(
                f"resume from {resumed}: its run was taught by "
                + ", ".join(map(weights_digest.describe, saved))
                + f", but {given} gives "
                + ", ".join(map(weights_digest.describe, now))
                + "; give the saved run's teachers, or start a new run"
            )
    if split.lora:  # the adapters apply to the base they were trained on, only
        saved_base = saved_items.saved_lora_base(resumed)
        now_base = init_weights.base_identity(config)
        if saved_base is None or saved_base["digest"] != now_base["digest"]:
            run_config.config_error(
                f"resume from {resumed}: its LoRA adapters were trained on "
                + (
                    weights_digest.describe(saved_base)
                    if saved_base
                    else "no recorded base (a full fine-tuning checkpoint)"
                )
                + f", but model_path gives {weights_digest.describe(now_base)}; give the "
                "base they were trained on as model_path, or start a new run"
            )
    return saved_teacher


@dataclasses.dataclass
class _Loaded:
    graphdef: Any
    params: Any
    rest: Any
    model_config: Any
    tokenizer: Any
    teacher_source: Any = None
    description: str | None = None
    lora_base: dict | None = None


def attention_line(backend: str) -> str:
    """The start's line naming the attention that runs: what 'auto' resolves to on this
    machine, and that the decode keeps XLA's attention where that is Pallas."""
    if backend != "auto":
        return f"attention backend {backend}"
    resolved = attention.resolve_backend(backend)
    keeps_xla = resolved == "pallas" and not attention.DECODE_KERNEL_IN_AUTO
    return f"attention backend {resolved} (auto" + ("; decode: XLA's)" if keeps_xla else ")")


def load_model(config, mesh, resumed: str | None, say: Callable) -> _Loaded:
    """The model, tokenizer and starting weights (student, EMA / fixed teacher), with the LoRA
    adapters attached; a full resume reads no weights (the checkpoint gives them)."""
    t0 = time.perf_counter()
    runtime = run_config.model_runtime(config)
    say(attention_line(config.attention_backend))
    split = run_config.TrainedSplit.of_config(config)
    if resumed and not split.lora and config.weights != hf_load.RANDOM_WEIGHTS:
        # The state comes from the checkpoint, restored straight into its shards: the HF
        # weights are not read at all (params stay abstract), so no second copy ever exists.
        model, model_config, tokenizer = load_hf(
            config.model_path, mesh=mesh, config_changes={"llm": runtime}, read_params=False
        )
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        del model
        loaded = _Loaded(graphdef, params, rest, model_config, tokenizer)
    else:  # (a LoRA resume reads its frozen base here: the checkpoint holds adapters only)
        start = init_weights.load(
            config,
            mesh,
            split=split,
            config_changes={"llm": runtime},
            full_resume=bool(resumed),
        )
        loaded = _Loaded(
            start.graphdef,
            start.params,
            start.rest,
            start.model_config,
            start.tokenizer,
            teacher_source=start.teacher_source,
            description=start.description,
            lora_base=start.base,
        )
        del start
    num_params = sum(x.size for x in jax.tree.leaves(loaded.params))
    say(
        f"model {config.model_path}: {num_params:,} parameters (LM, ViT, connector), "
        f"{loaded.tokenizer.vocab_length} tokenizer ids, loaded in {time.perf_counter() - t0:.1f}s"
        + (
            " (weights not read: a checkpoint gives them)"
            if resumed and not loaded.lora_base
            else ""
        )
    )
    if split.lora:  # adapters on the loaded weights, which become the frozen base
        loaded.graphdef, loaded.params, loaded.rest = run_config.with_adapters(
            loaded.graphdef, loaded.params, loaded.rest, config, mesh
        )
        adapters = nnx.split_state(loaded.params, nnx.LoRAParam, ...)[0]
        say(
            f"LoRA: {sum(x.size for x in jax.tree.leaves(adapters)):,} trainable adapter "
            f"parameters (rank {config.lora_rank}, alpha {config.lora_alpha}) on "
            f"{len(jax.tree.leaves(adapters)) // 2} projections "  # an A and a B each
            f"matching {config.lora_targets!r}; the base frozen in {config.compute_dtype}"
        )
    if loaded.description:
        say(f"starting weights: {loaded.description}")
    return loaded


def load_teachers(config, mesh, loaded: _Loaded, say: Callable) -> tuple:
    """The checkpoint teachers (teacher_path, or the paths of teacher_by_source), each checked
    against the student and loaded frozen in the compute dtype, sharded as the student's
    weights; () without one."""
    teachers = []
    for path in run_config.TrainedSplit.of_config(config).checkpoint_paths:
        t0 = time.perf_counter()
        try:
            teacher = teacher_checkpoint.load(
                path,
                mesh,
                student_config=loaded.model_config,
                student_tokenizer=loaded.tokenizer,
                config_changes={"llm": run_config.model_runtime(config)},
            )
        except teacher_checkpoint.TeacherMismatch as e:
            run_config.config_error(e)
        say(f"{teacher.describe()}, loaded in {time.perf_counter() - t0:.1f}s")
        teachers.append(teacher)
    return tuple(teachers)


def fresh_state(
    config, mesh, optimizer, frozen, abstract_state, params, teacher_source, teacher_weights
):
    """A fresh TrainState, jitted into exactly the layout the step is compiled for (the params
    and a checkpoint teacher's weights are donated, so not copied; the optimizer state and
    scalars are made in place on every process)."""
    init = jax.jit(
        lambda params, source, weights: run_config.init_train_state(
            config, optimizer, frozen, params, source, weights
        ),
        out_shardings=train_step.shardings_of(abstract_state),
        donate_argnums=(0, 2),
    )
    with mesh_lib.use_mesh(mesh):
        return init(params, teacher_source, teacher_weights)


def restore_state(config, mesh, checkpointer, resumed, saved_teacher, optimizer, abstract_state):
    """(state, data_state, saved_config, abstract_state) restored from `resumed` into the
    abstract state. A checkpoint of a 'self' or 'checkpoint'-teacher run keeps no teacher copy:
    one allowed to become 'ema' or 'fixed' (resume_changes) restores without it and starts the
    teacher from the student. A checkpoint teacher's weights are the abstract state's own
    arrays, kept as they are."""
    no_saved_teacher = (
        saved_teacher in ("self", "checkpoint") and abstract_state.teacher_params is not None
    )
    target = abstract_state.replace(teacher_params=None) if no_saved_teacher else abstract_state
    state, data_state, saved_config = checkpointer.restore(target, directory=resumed)
    # The base's and the teacher's arrays go to the step (donated): the target keeps shapes.
    abstract_state = abstract_state.replace(
        base=abstract_like(state.base), teacher_weights=abstract_like(state.teacher_weights)
    )
    if no_saved_teacher:
        start_teacher = jax.jit(
            lambda p: (
                train_step.init_state(
                    p,
                    optimizer,
                    run_config.TrainedSplit.of_config(config).teacher,
                    None,
                    fixed_teacher_dtype=config.fixed_teacher_dtype,
                ).teacher_params
            ),
            out_shardings=train_step.shardings_of(abstract_state).teacher_params,
        )
        with mesh_lib.use_mesh(mesh):
            state = state.replace(teacher_params=start_teacher(state.params))
    return state, data_state, saved_config, abstract_state


def open_start(config, mesh, checkpointer, checkpoint_dir: str, say: Callable) -> Start:
    """The run's start: fresh, or resumed from its own or another checkpoint (the resume's
    'resumed from' line is the caller's, once the data iterator has its state)."""
    resumed = resumed_from(config, checkpointer, checkpoint_dir)
    check_no_later_steps(checkpointer, checkpoint_dir, resumed)
    saved_teacher = check_resume(config, resumed, say) if resumed else None
    split = run_config.TrainedSplit.of_config(config)
    say(split.describe())
    loaded = load_model(config, mesh, resumed, say)
    teachers = load_teachers(config, mesh, loaded, say)
    teacher_weights = tuple(t.params for t in teachers) or None
    params = loaded.params
    abstract_params = abstract_like(params)
    optimizer, frozen, abstract_state = run_config.abstract_train_state(
        config, abstract_params, abstract_like(teacher_weights)
    )
    state = data_state = saved_config = None
    if not resumed:
        state = fresh_state(
            config,
            mesh,
            optimizer,
            frozen,
            abstract_state,
            params,
            loaded.teacher_source,
            teacher_weights,
        )
    elif teacher_weights is not None:  # the restore target holds them, read from teacher_path
        abstract_state = abstract_state.replace(teacher_weights=teacher_weights)
    if resumed and split.lora:  # the restore target holds the frozen base, read from model_path
        take_base = jax.jit(
            lambda params: run_config.split_for_training(params, config)[1],
            out_shardings=train_step.shardings_of(abstract_state.base),
        )
        with mesh_lib.use_mesh(mesh):
            abstract_state = abstract_state.replace(base=take_base(params))
    loaded.params = loaded.teacher_source = params = teacher_weights = None
    for teacher in teachers:
        teacher.params = None  # the state holds them now
    if resumed:  # into the abstract state: peak memory is one state
        state, data_state, saved_config, abstract_state = restore_state(
            config, mesh, checkpointer, resumed, saved_teacher, optimizer, abstract_state
        )
    return Start(
        graphdef=loaded.graphdef,
        rest=loaded.rest,
        abstract_params=abstract_params,
        model_config=loaded.model_config,
        tokenizer=loaded.tokenizer,
        state=state,
        abstract_state=abstract_state,
        optimizer=optimizer,
        frozen=frozen,
        lora_base=loaded.lora_base,
        split=split,
        start_step=int(distributed.to_host(state.step)),
        resumed=resumed,
        data_state=data_state,
        saved_config=saved_config,
        teachers=teachers,
    )
