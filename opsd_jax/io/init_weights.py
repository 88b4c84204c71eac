"""Where a training run's weights start: the student, and the EMA or fixed teacher.

The rules are the PyTorch Visual-OPSD launcher's (scripts/visual_opsd/train_visual_opsd.py with
FSDPCheckpoint.try_load_ckpt in train/fsdp_utils.py), so a recipe moved from there starts from
the same weights:

* from the HF directory `model_path` (`weights='auto'`, see `hf_load.initial_weights`): the student
  from `model.safetensors`, the EMA teacher from `ema.safetensors` when both exist, the fixed
  teacher from `model.safetensors`; one file present starts every copy;
* `finetune_from_ema`: the student starts from the EMA weights too (the HF `ema.safetensors`, or
  a `resume_model_only` checkpoint's EMA);
* `resume_from` with `resume_model_only`: the student from the checkpoint's params, the EMA
  teacher from its EMA when it kept one (else the student's weights); the fixed teacher stays
  the HF `model_path` weights (the launcher loads it from model_path whatever it resumes);
* a full resume (auto-resume or `resume_from` without `resume_model_only`) restores everything
  from the checkpoint, so no second file is read here.

What trains and which teacher copy is kept is the caller's `split` (run_config.TrainedSplit).
With LoRA the student's file is the frozen base of every copy: the EMA / fixed teachers are that
base with adapters of their own (train_step.TrainState), so no teacher file is read. A teacher of
another checkpoint (teacher_mode='checkpoint') is not read here either: io/teacher_checkpoint.py.
`base` then names the weights (weights_digest.identity) for the checkpoints to record. A full
resume of a LoRA run reads the base here too (a checkpoint holds the adapters only).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
from flax import nnx

from opsd_jax.io import hf_load, weights_digest
from opsd_jax.io.checkpoint_format import EMA_PARAMS, PARAMS
from opsd_jax.io.saved_items import restore_model_params, saved_teacher_mode
from opsd_jax.io.tokenizer import BagelTokenizer


@dataclasses.dataclass
class StartingWeights:
    graphdef: Any
    params: Any  # nnx.State of the student's nnx.Params
    rest: Any  # the non-Param state (fixed tables)
    model_config: Any  # models.configs.BagelConfig
    tokenizer: BagelTokenizer
    teacher_source: Any  # nnx.State of Params the EMA / fixed teacher starts from; None: params
    description: str  # for the console: which file / item each copy starts from
    base: dict | None = None  # LoRA: the base weights' identity (weights_digest.identity)


def base_identity(config) -> dict:
    """LoRA: the identity (weights_digest.identity) of the base `load` starts from: the
    student's weights file of model_path (with weights='random', the seed it is drawn from).
    The same at every launch of a run, resumes included: the adapters apply to that file."""
    if config.weights == hf_load.RANDOM_WEIGHTS:
        return {
            "model_path": os.path.abspath(config.model_path),
            "weights": hf_load.RANDOM_WEIGHTS,
            "digest": f"random initialisation, seed {config.global_seed}",
        }
    stem = hf_load.initial_weights(
        config.model_path, config.weights, finetune_from_ema=config.finetune_from_ema
    )
    return weights_digest.identity(config.model_path, stem.student)


def load(config, mesh, *, split, config_changes=None, full_resume: bool = False) -> StartingWeights:
    """The model, tokenizer and starting weights a training `config` asks for, on `mesh`;
    `split`: the config's run_config.TrainedSplit."""
    if config.weights == hf_load.RANDOM_WEIGHTS:
        return _random_start(config, split, mesh, config_changes, full_resume)
    model_only = bool(config.resume_from) and config.resume_model_only and not full_resume
    # A full resume reads no student weights, except a LoRA run's frozen base: that is read
    # again from the file the run's first launch started from (ema.safetensors with
    # finetune_from_ema), or its adapters would land on other weights.
    from_ema = config.finetune_from_ema and (split.lora or not full_resume)
    files = hf_load.initial_weights(
        config.model_path, config.weights, finetune_from_ema=from_ema and not model_only
    )
    model, model_config, tokenizer = hf_load.load_hf(
        config.model_path, mesh=mesh, config_changes=config_changes, weights=files.student
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    del model
    described = {"student": f"{files.student}.safetensors"}
    teacher = split.teacher
    if split.lora:
        base = base_identity(config)
        description = (
            f"frozen base from {files.student}.safetensors (digest {base['digest'][:12]}), "
            f"LoRA adapters of rank {split.adapters.rank} from seed {config.global_seed}"
        )
        if split.teacher_is_copy:
            description += f"; the {teacher} teacher: the base + its own adapters"
        return StartingWeights(
            graphdef, params, rest, model_config, tokenizer, None, description, base
        )

    def hf_params(stem):
        if stem == files.student:
            return params
        _, state = hf_load.load_weights(config.model_path, model_config, weights=stem, mesh=mesh)
        return nnx.state(nnx.merge(graphdef, state), nnx.Param)

    teacher_source = None
    if teacher == "fixed" and not full_resume:
        # Loaded before any checkpoint replaces `params`: the fixed teacher is the HF weights.
        teacher_source = hf_params(files.fixed_teacher)
        described["fixed teacher"] = f"{files.fixed_teacher}.safetensors"
    if model_only:
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
        )
        saved_mode = saved_teacher_mode(config.resume_from)
        if from_ema and saved_mode != "ema":
            # Its 'ema_params' item, if any, holds a fixed teacher: not an EMA of the student.
            raise ValueError(
                f"finetune_from_ema=True: resume_from={config.resume_from!r} was "
                f"saved with teacher_mode={saved_mode!r}, so it has no EMA weights"
            )
        item = EMA_PARAMS if from_ema else PARAMS
        params = restore_model_params(config.resume_from, abstract, which=item)
        described["student"] = f"{config.resume_from} {item}"
        if teacher == "ema" and not from_ema:
            if saved_mode == "ema":
                teacher_source = restore_model_params(
                    config.resume_from, abstract, which=EMA_PARAMS
                )
                described["ema teacher"] = f"{config.resume_from} {EMA_PARAMS}"
    elif teacher == "ema" and not full_resume:
        teacher_source = hf_params(files.ema_teacher)
        described["ema teacher"] = f"{files.ema_teacher}.safetensors"
    if teacher_source is params:
        teacher_source = None  # init_state copies the student's
    if split.teacher_is_copy and teacher_source is None and not full_resume:
        described[f"{teacher} teacher"] = "the student's weights"
    description = ", ".join(f"{who} from {what}" for who, what in described.items())
    return StartingWeights(
        graphdef, params, rest, model_config, tokenizer, teacher_source, description
    )


def _random_start(config, split, mesh, config_changes, full_resume: bool) -> StartingWeights:
    """weights='random': the model of model_path's configs drawn from global_seed (a benchmark
    at real shapes); every teacher copy starts from the student's weights."""
    model, model_config, tokenizer = hf_load.random_model(
        config.model_path, mesh, config.global_seed, config_changes=config_changes
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    description = f"random weights (seed {config.global_seed}) for every copy"
    base = base_identity(config) if split.lora else None
    return StartingWeights(graphdef, params, rest, model_config, tokenizer, None, description, base)
