"""What a run trains and what it holds frozen: one answer, made once from the config.

Every stage that used to test `config.lora_rank` or `config.teacher_mode` on its own (the
weights' start, the train state, the resume, the preflight, the FLOP count, the console) asks a
`TrainedSplit` instead, so a new way of training (adapters, a teacher of another checkpoint) is
added here and nowhere else decides it:

- `adapters`: None for full fine-tuning; else the LoRA adapters that train (rank, alpha,
  targets) over the frozen base, held once in the compute dtype;
- `teacher`: what the train state keeps for the teacher: 'self' (the student itself: nothing
  held), 'ema' / 'fixed' (a copy of what trains: the params, or with LoRA the adapters, over
  the student's base), or 'checkpoint' (another model's whole weights from `teacher_path`,
  frozen in the compute dtype, never saved: the checkpoints record its identity). SFT and
  offline runs run no teacher in their step: 'self' (an offline run's `teacher_path`, if any,
  is the teacher its cache was collected from: `cache_teacher_path`);
- `teachers`: every teacher the step runs, one name each ('self', 'ema', 'fixed' or a
  checkpoint's path), and with `teacher_by_source` (dataset name -> teacher) which one scores
  each data source's samples; without it the one teacher scores every sample;
- `frozen_flags`: which of freeze_vit / freeze_llm / freeze_und are set (full fine-tuning).

The builders of the train state from that split live here too (`abstract_train_state`,
`init_train_state`, `split_for_training`, the LoRA adapters' `attach_adapters` /
`with_adapters` / `lora_target_paths`): they are the split made into arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from models import lora
from opsd_jax.training import train_step

# What the train state holds for the teacher (TrainedSplit.teacher_copy).
NO_TEACHER_COPY = "none"  # 'self' (or a mode without a teacher forward)
TEACHER_PARAMS = "params"  # an EMA / fixed copy of the trained params (LoRA: adapters)
TEACHER_WEIGHTS = "weights"  # another checkpoint's whole weights, frozen (teacher_weights)


@dataclasses.dataclass(frozen=True)
class Adapters:
    """LoRA: adapters of `rank` on the projections matching `targets`, scaled alpha / rank."""

    rank: int
    alpha: float
    targets: str


STUDENT_TEACHERS = ("self", "ema", "fixed")  # teachers made of the student's own weights


def parse_teacher_by_source(text: str) -> tuple[tuple[str, str], ...]:
    """`teacher_by_source`'s pairs, in the order given: 'jigsaw=ema, charts=/models/tm-7b' ->
    (('jigsaw', 'ema'), ('charts', '/models/tm-7b')); () for ''. A teacher is 'self', 'ema',
    'fixed' or a BAGEL-layout HF directory. ValueError naming the item that is not name=teacher
    or a name given twice."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, teacher = (x.strip() for x in item.partition("="))
        if not sep or not name or not teacher:
            raise ValueError(f"teacher_by_source: {item!r} is not dataset_name=teacher")
        if name in dict(pairs):
            raise ValueError(f"teacher_by_source: dataset {name!r} is given twice")
        pairs.append((name, teacher))
    return tuple(pairs)


@dataclasses.dataclass(frozen=True)
class TrainedSplit:
    adapters: Adapters | None
    teacher: str  # train_step.TEACHER_MODES: the train step's teacher
    teacher_path: str  # teacher_mode='checkpoint': the teacher's HF directory; '' otherwise
    compute_dtype: str  # the frozen base and a checkpoint teacher are held in it
    fixed_teacher_dtype: str
    frozen_flags: tuple[str, ...] = ()  # the freeze_* flags set (full fine-tuning only)
    mode: str = "opsd"  # opsd | sft | offline: only an OPSD step runs a teacher
    # Dataset name -> its teacher ('self' | 'ema' | 'fixed' | a checkpoint path), every dataset
    # of the run in the data config's order; () when one teacher scores every sample.
    teacher_by_source: tuple[tuple[str, str], ...] = ()

    @property
    def teachers(self) -> tuple[str, ...]:
        """Every teacher the train step runs, in a fixed order (the mapping's first mention):
        'self', 'ema', 'fixed' or a checkpoint teacher's path. () without a teacher forward."""
        if self.mode != "opsd":
            return ()
        if not self.teacher_by_source:
            return (self.teacher_path if self.teacher == "checkpoint" else self.teacher,)
        return tuple(dict.fromkeys(teacher for _, teacher in self.teacher_by_source))

    @property
    def checkpoint_paths(self) -> tuple[str, ...]:
        """The teachers loaded from their own checkpoints, in `teachers`' order."""
        return tuple(t for t in self.teachers if t not in STUDENT_TEACHERS)

    @property
    def source_names(self) -> tuple[str, ...]:
        """The data sources the teachers are chosen by (the data config's datasets, in its
        order; OPSD, or offline with a cache collected per source), or () when one teacher
        scores every sample. The step logs each one's loss."""
        return tuple(name for name, _ in self.teacher_by_source)

    def step_teachers(self, models: tuple = ()) -> train_step.StepTeachers:
        """The train step's teachers (training/step_teachers.py): `models`, one TeacherModel
        per checkpoint teacher in `checkpoint_paths`' order."""
        kinds = tuple(t if t in STUDENT_TEACHERS else "checkpoint" for t in self.teachers)
        of_source = tuple(self.teachers.index(t) for _, t in self.teacher_by_source if kinds)
        names = self.source_names if of_source else ()
        return train_step.StepTeachers(kinds or ("self",), tuple(models), of_source, names)

    @property
    def lora(self) -> bool:
        return self.adapters is not None

    @property
    def teacher_copy(self) -> str:
        """What the train state keeps for the teacher: NO_TEACHER_COPY, TEACHER_PARAMS (in
        `teacher_params`, checkpointed) or TEACHER_WEIGHTS (in `teacher_weights`, not)."""
        if self.teacher in ("ema", "fixed"):
            return TEACHER_PARAMS
        return TEACHER_WEIGHTS if self.checkpoint_paths else NO_TEACHER_COPY

    @property
    def teacher_is_copy(self) -> bool:
        """The teacher is an EMA / fixed copy of what trains (kept in `teacher_params`)."""
        return self.teacher_copy == TEACHER_PARAMS

    @property
    def separate_teacher(self) -> bool:
        """A teacher of the train step is another model (its own graph and weights, held in
        the train state's `teacher_weights`, one per checkpoint teacher)."""
        return bool(self.checkpoint_paths)

    @property
    def cache_teacher_path(self) -> str:
        """An offline run's: the checkpoint its teacher cache was collected from ('' for the
        student's own starting weights)."""
        return self.teacher_path if self.mode == "offline" else ""

    @property
    def cache_teacher_by_source(self) -> tuple[tuple[str, str], ...]:
        """An offline run's teacher per data source ('self': model_path's weights, or a
        checkpoint's path), each source's cache collected from its own; () for one teacher."""
        return self.teacher_by_source if self.mode == "offline" else ()

    @classmethod
    def of_config(cls, config) -> TrainedSplit:
        """The split a run config asks for."""
        adapters = None
        if config.lora_rank:
            adapters = Adapters(
                int(config.lora_rank), float(config.lora_alpha), config.lora_targets
            )
        flags = ("freeze_vit", "freeze_llm", "freeze_und")
        teacher = config.teacher_mode if config.mode == "opsd" else "self"
        by_source = ()
        if config.teacher_by_source and config.mode != "sft":
            given = dict(parse_teacher_by_source(config.teacher_by_source))
            names = [d["name"] for d in config.data.datasets]
            by_source = tuple((name, given[name]) for name in names if name in given)
        if by_source and config.mode == "opsd":
            # What the state keeps: a student copy if one is used (at most one, checks.py),
            # else nothing ('self' among them) or the checkpoint teachers' weights alone.
            used = {t for _, t in by_source}
            copies = [t for t in ("ema", "fixed") if t in used]
            teacher = copies[0] if copies else "self" if "self" in used else "checkpoint"
        return cls(
            adapters=adapters,
            teacher=teacher,
            teacher_by_source=by_source,
            teacher_path=(
                config.teacher_path if config.teacher_mode == "checkpoint" and not by_source else ""
            ),
            compute_dtype=config.compute_dtype,
            fixed_teacher_dtype=config.fixed_teacher_dtype,
            frozen_flags=() if adapters else tuple(f for f in flags if config[f]),
            mode=config.mode,
        )

    def describe(self) -> str:
        """One line for the console: what trains, what is frozen."""
        if self.adapters:
            trains = (
                f"LoRA adapters (rank {self.adapters.rank}) on {self.adapters.targets!r}, the "
                f"base frozen in {self.compute_dtype}"
            )
        elif self.frozen_flags:
            trains = "every parameter but " + ", ".join(self.frozen_flags) + "'s groups"
        else:
            trains = "every parameter"
        if self.mode != "opsd":
            cache = f"the cache collected from {self.cache_teacher_path or 'model_path'}"
            if self.cache_teacher_by_source:
                cache = "the cache collected per data source: " + "; ".join(
                    f"{source} from {'model_path' if name == 'self' else name}"
                    for source, name in self.cache_teacher_by_source
                )
            return f"trains {trains}; teacher: " + ("none" if self.mode == "sft" else cache)
        named = {
            "self": "the student itself",
            "ema": "an EMA of what trains",
            "fixed": f"the starting weights of what trains, frozen in {self.fixed_teacher_dtype}",
        }

        def teacher(name: str) -> str:
            return named.get(name, f"{name}, frozen in {self.compute_dtype} (not saved)")

        if not self.teacher_by_source:
            return f"trains {trains}; teacher: {teacher(self.teachers[0])}"
        return f"trains {trains}; teachers by data source: " + "; ".join(
            f"{source}: {teacher(name)}" for source, name in self.teacher_by_source
        )


# ---- LoRA's adapters ---------------------------------------------------------------------------


def attach_adapters(model: nnx.Module, config) -> list[str]:
    """LoRA adapters on `model`'s projections as the config asks (lora_rank, lora_alpha,
    lora_targets; their A drawn from global_seed, computing in compute_dtype); the paths."""
    return lora.attach(
        model,
        config.lora_rank,
        float(config.lora_alpha),
        config.lora_targets,
        rngs=nnx.Rngs(config.global_seed),
        dtype=config.compute_dtype,
    )


def with_adapters(graphdef, params, rest, config, mesh) -> tuple:
    """(graphdef, params, rest) of the model with the config's LoRA adapters attached (params:
    every nnx.Param, the adapters' nnx.LoRAParams among them, replicated over `mesh`: small,
    and read whole by every device); as given without LoRA."""
    if not TrainedSplit.of_config(config).lora:
        return graphdef, params, rest
    model = nnx.merge(graphdef, params, rest)
    attach_adapters(model, config)
    graphdef, adapters, params, rest = nnx.split(model, nnx.LoRAParam, nnx.Param, ...)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    adapters = jax.tree.map(lambda x: jax.device_put(x, replicated), adapters)
    return graphdef, nnx.merge_state(adapters, params), rest


def lora_target_paths(config, model_config) -> list[str]:
    """The projections `lora_targets` adapts in a model of `model_config`, found on an
    abstract model (nothing allocated or read); ValueError when it matches none."""
    from models.bagel import Bagel  # the model class only here: run_config is read by every script

    abstract = nnx.eval_shape(lambda: Bagel(model_config, rngs=nnx.Rngs(0)))
    return lora.matching_paths(abstract, config.lora_targets)


# ---- the train state --------------------------------------------------------------------------


def split_for_training(state: nnx.State, config) -> tuple[Any, Any]:
    """(params, base) of a model's nnx.Param state: without LoRA (all of it, None); with LoRA
    (the adapters, the rest cast to compute_dtype: the frozen base held once). Traceable."""
    if not TrainedSplit.of_config(config).lora:
        return state, None
    adapters, base = nnx.split_state(state, nnx.LoRAParam, ...)
    dtype = jax.numpy.dtype(config.compute_dtype)
    return adapters, jax.tree.map(lambda x: x.astype(dtype), base)


def abstract_train_state(config, abstract_params, abstract_teacher_weights=None) -> tuple:
    """(the optimizer, the frozen parameter groups, the TrainState as abstract arrays laid out
    like `abstract_params`) as the config sets them up: what the train step compiles for.
    `abstract_params`: the model's whole nnx.Param state (with LoRA, adapters and base);
    `abstract_teacher_weights`: a checkpoint teacher's nnx.Param state, as it is held."""
    split = TrainedSplit.of_config(config)
    params, base = abstract_params, None
    if split.lora:  # the base laid out as the weights it is cast from
        params, weights = nnx.split_state(abstract_params, nnx.LoRAParam, ...)
        dtype = jax.numpy.dtype(config.compute_dtype)
        base = jax.tree.map(
            lambda p: jax.ShapeDtypeStruct(p.shape, dtype, sharding=p.sharding), weights
        )
    if split.separate_teacher and abstract_teacher_weights is None:
        raise ValueError("teacher_mode='checkpoint': give the teacher's weights (abstract)")
    optimizer = train_step.make_optimizer(config)
    frozen = train_step.frozen_groups(config, params)
    state = train_step.abstract_state(
        params,
        optimizer,
        split.teacher,
        jax.random.key(config.global_seed),
        fixed_teacher_dtype=config.fixed_teacher_dtype,
        frozen=frozen,
        abstract_base=base,
        abstract_teacher_weights=abstract_teacher_weights if split.separate_teacher else None,
    )
    return optimizer, frozen, state


def init_train_state(config, optimizer, frozen, params, teacher_source=None, teacher_weights=None):
    """A fresh TrainState from the model's nnx.Param state (`params`; with LoRA adapters and
    base, split here and the base cast to compute_dtype) and, for a checkpoint teacher, its
    weights (held as given). Traceable: train.py jits it into the abstract state's layout."""
    params, base = split_for_training(params, config)
    return train_step.init_state(
        params,
        optimizer,
        TrainedSplit.of_config(config).teacher,
        jax.random.key(config.global_seed),
        fixed_teacher_dtype=config.fixed_teacher_dtype,
        teacher_source=teacher_source,
        frozen=frozen,
        base=base,
        teacher_weights=teacher_weights,
    )
