"""The checks of a run config: every bad value is named before anything compiles.

`validate(config, num_devices, num_processes)` collects all problems and raises one ConfigError
listing each with its key and the allowed values, so a long job never dies at step 0 (or step
500) on a typo in a value. Without `num_devices` the device-dependent checks (mesh, batch
divisibility) are left out: train.py runs that first, because no device may be touched before
`jax.distributed.initialize`. (Unknown keys are named earlier, on the command line:
command_line.py.)

One module of about 470 lines: every value check of a run config, so that what a key allows is
found in the one place `validate` names it from.
"""

from __future__ import annotations

import os
import re

from models import attention, configs
from opsd_jax.data import pack_shapes
from opsd_jax.data.data_config import DataConfig
from opsd_jax.io import hf_layout, hf_load
from opsd_jax.parallel import distributed, mesh
from opsd_jax.run_config import builds, trained_split
from opsd_jax.run_config.builds import mesh_shape
from opsd_jax.training import losses, step_compiler_flags, train_step
from opsd_jax.training.offline import cache as offline_cache

MODES = ("opsd", "sft", "offline")

_CHOICES = {
    "mode": MODES,
    "teacher_mode": train_step.TEACHER_MODES,
    "jsd_loss_kind": train_step.LOSS_KINDS,
    "jsd_clip_mode": ("entry", "token"),
    "loss_reduction": losses.REDUCTIONS,
    "lr_scheduler": train_step.LR_SCHEDULERS,
    "compute_dtype": configs.COMPUTE_DTYPES,
    "fixed_teacher_dtype": ("float32", "bfloat16"),
    "attention_backend": attention.BACKENDS,
    "vit_attention_backend": attention.BACKENDS,
    "sampler_layout": tuple(mesh.SAMPLER_LAYOUTS),
    "remat": configs.REMAT_CHOICES,
    "vit_remat": ("same",) + configs.REMAT_CHOICES,
    "step_compiler_flags": step_compiler_flags.STEP_FLAG_SETS,
    "weights": hf_load.WEIGHT_CHOICES,
    "kd_student_norm": losses.STUDENT_NORMS,
    "offline_logprob_dtype": offline_cache.LOGPROB_DTYPES,
    "offline_target": offline_cache.OFFLINE_TARGETS,
    "wandb_mode": ("offline", "online", "disabled"),
    "wandb_resume": ("allow", "must", "never", "auto"),
}

# (key, test, description of what is allowed)
_RANGES = (
    ("jsd_beta", lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]"),
    ("jsd_temperature", lambda v: v > 0, "> 0"),
    ("jsd_top_k", lambda v: v >= 0, ">= 0 (0 = full vocabulary)"),
    ("ema_decay", lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
    ("kd_weight", lambda v: v >= 0, ">= 0"),
    ("jsd_weight", lambda v: v >= 0, ">= 0 (a negative weight trains away from the teacher)"),
    ("ce_weight", lambda v: v >= 0, ">= 0"),
    ("kd_temperature", lambda v: v > 0, "> 0"),
    ("offline_top_k", lambda v: v >= 1, ">= 1"),
    ("offline_shard_samples", lambda v: v >= 1, ">= 1"),
    ("sft_vt_fraction", lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]"),
    ("sample_max_new_tokens", lambda v: v >= 1, ">= 1"),
    ("sample_temperature", lambda v: v > 0, "> 0"),
    ("sample_max_image_skips", lambda v: v >= 0, ">= 0"),
    (
        "rollout_lookahead",
        lambda v: isinstance(v, int) and 0 <= v <= 4,
        "an integer in 0..4 (0 = exactly on-policy)",
    ),
    (
        "rollout_prefill_rows",
        lambda v: isinstance(v, int) and v >= 0,
        "an integer >= 0 (0 = every prompt of a step at once)",
    ),
    ("max_forward_tokens", lambda v: v >= 16, ">= 16"),
    ("attention_block", lambda v: v >= 8, ">= 8"),
    ("max_reference_rounds", lambda v: v >= 1, ">= 1"),
    ("pack_row_tokens", lambda v: v == 0 or v >= 16, ">= 16, or 0 (derived)"),
    ("pack_row_patches", lambda v: v >= 0, ">= 0 (0 = derived)"),
    ("pack_student_row_tokens", lambda v: v == 0 or v >= 16, ">= 16, or 0 (derived)"),
    ("pack_student_row_patches", lambda v: v >= 0, ">= 0 (0 = derived)"),
    ("pack_loss_entries", lambda v: v >= 0, ">= 0 (0 = derived)"),
    (
        "pack_length_buckets",
        lambda v: isinstance(v, int) and 1 <= v <= 8,
        "an int in [1, 8] (each bucket is one more compiled train step)",
    ),
    ("lr", lambda v: v > 0, "> 0"),
    ("min_lr", lambda v: v >= 0, ">= 0"),
    ("warmup_steps", lambda v: v >= 0, ">= 0"),
    ("beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("eps", lambda v: v >= 0, ">= 0"),
    ("max_grad_norm", lambda v: v > 0, "> 0"),
    ("total_steps", lambda v: v >= 1, ">= 1"),
    ("samples_per_micro_batch", lambda v: v >= 1, ">= 1"),
    ("rows_per_micro_batch", lambda v: v >= 1, ">= 1"),
    ("gradient_accumulation_steps", lambda v: v >= 1, ">= 1"),
    ("save_every", lambda v: v >= 1, ">= 1"),
    ("max_checkpoints", lambda v: v >= 1, ">= 1"),
    ("log_every", lambda v: v >= 1, ">= 1"),
    ("max_consecutive_bad_steps", lambda v: v >= 0, ">= 0"),
    ("eval_every", lambda v: v >= 0, ">= 0 (0 = no evaluation)"),
    ("eval_samples_per_dataset", lambda v: v >= 1, ">= 1"),
    ("eval_batch_size", lambda v: v >= 1, ">= 1"),
    ("eval_max_new_tokens", lambda v: v >= 0, ">= 0 (0 = sample_max_new_tokens)"),
    ("num_replicate", lambda v: v >= 1, ">= 1"),
    ("num_shard", lambda v: v == -1 or v >= 1, ">= 1, or -1 for the devices left over"),
    ("num_tensor", lambda v: v >= 1, ">= 1"),
    ("num_processes", lambda v: isinstance(v, int) and (v == -1 or v >= 1), ">= 1, or -1"),
    ("process_id", lambda v: isinstance(v, int) and v >= -1, ">= 0, or -1"),
    (
        "lora_rank",
        lambda v: isinstance(v, int) and v >= 0,
        "an integer >= 0 (0 = full fine-tuning, no adapters)",
    ),
    ("lora_alpha", lambda v: v > 0, "> 0"),
)


class ConfigError(ValueError):
    """A bad training config; the message names every problem (train.py prints it as it is)."""


def validate(
    config,
    num_devices: int | None = None,
    num_processes: int = 1,
    *,
    need_cache: bool = True,
    check_files: bool = True,
) -> None:
    """`need_cache=False`: for scripts/collect_traces.py, which makes the offline cache;
    `check_files=False`: the values only, no path checked (train.py --compile_only reads no
    file: a config for another machine's paths is checked here)."""
    problems = []
    for key, allowed in _CHOICES.items():
        if config[key] not in allowed:
            problems.append(
                f"{key}={config[key]!r}: allowed values are {', '.join(map(repr, allowed))}"
            )
    for key, ok, allowed in _RANGES:
        value = config[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not ok(value):
            problems.append(f"{key}={value!r}: must be {allowed}")
    if config.mode == "sft" and config.teacher_mode != "self":
        # Decided: refuse rather than silently override, so a config never says 'ema' while
        # training without one (SFT has no teacher; 'self' keeps no EMA / fixed copy).
        problems.append(
            f"teacher_mode={config.teacher_mode!r} with mode='sft': SFT has no "
            "teacher; allowed value is 'self' (no EMA / fixed copy is kept)"
        )
    if config.mode == "offline" and config.teacher_mode not in ("self", "checkpoint"):
        problems.append(
            f"teacher_mode={config.teacher_mode!r} with mode='offline': the teacher is "
            "the cache; allowed values are 'self' (collected from model_path, no EMA / fixed "
            "copy is kept) and 'checkpoint' (collected from teacher_path)"
        )
    if config.mode != "opsd" and config.rollout_lookahead:
        problems.append(
            f"rollout_lookahead={config.rollout_lookahead} with mode={config.mode!r}: only an "
            "OPSD run samples (set it to 0)"
        )
    if config.mode == "offline" or not need_cache:
        manifest = os.path.join(config.offline_cache_dir, offline_cache.MANIFEST)
        if not config.offline_cache_dir:
            problems.append(
                "offline_cache_dir is empty: give the teacher cache's directory "
                "(made by scripts/collect_traces.py)"
            )
        elif need_cache and check_files and not os.path.isfile(manifest):
            problems.append(
                f"offline_cache_dir={config.offline_cache_dir!r}: no "
                f"{offline_cache.MANIFEST}; make the cache first: python scripts/"
                "collect_traces.py --config <the same config>"
            )
    contexts = [c for c in str(config.eval_contexts).split(",") if c]
    if config.eval_every and (not contexts or set(contexts) - {"student", "teacher"}):
        problems.append(
            f"eval_contexts={config.eval_contexts!r}: allowed values are 'student', "
            "'teacher' or 'student,teacher'"
        )
    buckets = config.sample_prompt_buckets
    if (
        not isinstance(buckets, (tuple, list))
        or not buckets
        or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 16 for b in buckets)
        or list(buckets) != sorted(set(buckets))
    ):
        problems.append(
            f"sample_prompt_buckets={buckets!r}: must be a non-empty, strictly "
            "increasing list of integers >= 16 (prompt row lengths)"
        )
    if not problems:
        problems += _loss_and_schedule_problems(config)
    if not config.results_dir:
        problems.append("results_dir is empty: give the run's directory (logs, checkpoints)")
    if config.freeze_llm and config.freeze_vit:
        problems.append("freeze_llm=True and freeze_vit=True: nothing left to train")
    if config.freeze_und and config.freeze_llm:
        # freeze_und leaves only lm_head trainable (train_step.frozen_groups), a part of the LM.
        problems.append(
            "freeze_und=True and freeze_llm=True: nothing left to train (freeze_und "
            "trains only lm_head, which freeze_llm freezes)"
        )
    problems += _lora_problems(config)
    if config.teacher_by_source:
        problems += _teacher_by_source_problems(config, check_files)
    else:
        problems += _teacher_problems(config, check_files)
    ignored = distributed.settings_without_distributed(config)
    if ignored:
        problems.append(
            f"{', '.join(ignored)} without distributed=True: these are ignored and this "
            "process would train alone; set --config.distributed=True (or drop them)"
        )
    if 0 < config.num_processes <= config.process_id:
        problems.append(
            f"process_id={config.process_id} with num_processes={config.num_processes}: "
            "process ids run from 0 to num_processes - 1"
        )
    if config.resume_model_only and not config.resume_from:
        problems.append("resume_model_only=True needs resume_from (a checkpoint directory)")
    if check_files and config.resume_from and not os.path.exists(config.resume_from):
        problems.append(f"resume_from={config.resume_from!r}: no such file or directory")
    if check_files and config.model_path and not os.path.isdir(config.model_path):
        problems.append(f"model_path={config.model_path!r}: not a directory")
    if check_files and not config.model_path and not config.toy_data:
        problems.append("model_path is empty: give a BAGEL / ThinkMorph HF directory")
    if not config.toy_data:
        if not config.data.datasets:
            problems.append("data.datasets is empty: list dict(name, path, weight, num_used_data)")
        for i, spec in enumerate(config.data.datasets):
            path = dict(spec).get("path", "")
            if check_files and (not path or not os.path.exists(path)):
                problems.append(
                    f"data.datasets[{i}] ({dict(spec).get('name', '?')}): "
                    f"path {path!r} does not exist"
                )
    problems += _data_problems(config, check_files)
    if num_devices is not None:
        problems += _device_problems(config, num_devices, num_processes)
    if config.rows_per_micro_batch > config.samples_per_micro_batch:
        problems.append(
            f"rows_per_micro_batch={config.rows_per_micro_batch} exceeds "
            f"samples_per_micro_batch={config.samples_per_micro_batch}: some rows "
            "would always be empty"
        )
    if not problems and config.attention_backend == "dense":  # the shapes need sane values
        longest = max(
            shape.row_length
            for shapes in pack_shapes.pack_shapes(config).values()
            for shape in shapes
        )
        if longest > attention.DENSE_MAX_TOKENS:
            problems.append(
                f"attention_backend='dense' with {longest}-token rows: 'dense' keeps "
                "every [query, key] score and takes rows of at most "
                f"{attention.DENSE_MAX_TOKENS} tokens; use 'auto' or 'chunked'"
            )
    if problems:
        raise ConfigError("bad training config:\n  " + "\n  ".join(problems))


def _loss_and_schedule_problems(config) -> list[str]:
    """Values fine alone that contradict each other: a loss with nothing to learn from, a
    cosine decay that would climb, a teacher row smaller than the student row it extends."""
    problems = []
    terms = {"opsd": ("jsd_weight", "ce_weight"), "offline": ("kd_weight", "ce_weight")}
    weights = terms.get(config.mode, ())
    if weights and not any(config[key] for key in weights):
        problems.append(
            f"{' and '.join(f'{key}=0' for key in weights)} with mode={config.mode!r}: the loss "
            "is 0, nothing would train"
        )
    if config.lr_scheduler == "cosine" and config.min_lr > config.lr:
        problems.append(
            f"min_lr={config.min_lr} exceeds lr={config.lr}: the cosine 'decay' would raise the "
            "learning rate to min_lr; lower min_lr"
        )
    if config.mode == "opsd":  # the teacher row holds the student's prompt plus the VT images
        for teacher, student in (
            ("pack_row_tokens", "pack_student_row_tokens"),
            ("pack_row_patches", "pack_student_row_patches"),
        ):
            if config[teacher] and config[student] and config[teacher] < config[student]:
                problems.append(
                    f"{teacher}={config[teacher]} < {student}={config[student]}: a teacher row "
                    "holds its student row's sample and the VT images, so no sample would fit"
                )
    return problems


def tensor_problems(config, model_config) -> list[str]:
    """num_tensor against the model's heads: the training layout shards the query and key /
    value heads of the LLM and the ViT over the tensor axis, so it must divide each count."""
    heads = {
        "the LLM's query heads": model_config.llm.num_attention_heads,
        "the LLM's key / value heads": model_config.llm.num_key_value_heads,
        "the ViT's heads": model_config.vit.num_attention_heads,
    }
    wrong = [f"{name} ({n})" for name, n in heads.items() if n % config.num_tensor]
    if not wrong:
        return []
    return [
        f"num_tensor={config.num_tensor} does not divide {', '.join(wrong)}: the heads are "
        "sharded over the tensor axis; use a divisor of each"
    ]


def _data_problems(config, check_files: bool) -> list[str]:
    """The data section's values, as the data pipeline will check them when the run reads
    its data (DataConfig), named here before anything is loaded; with `check_files`, the image
    transform against the ViT grid of model_path's own config files."""
    problems = []
    specs = [dict(spec) for spec in config.data.datasets]
    for i, spec in enumerate(specs):
        used = spec.get("num_used_data", -1)
        if not isinstance(used, int) or isinstance(used, bool):
            problems.append(
                f"data.datasets[{i}] ({spec.get('name', '?')}): num_used_data={used!r}: must "
                "be an integer (-1 = every row)"
            )
    if problems:
        return problems
    # A toy config lists no data set until it writes its own: check the rest with a stand-in.
    specs = specs or [{"name": "toy", "path": ""}]
    try:
        data = DataConfig.from_dict(dict(builds.data_fields(config), datasets=specs))
        directory = builds.model_dir(config) if check_files else None
        if directory and os.path.isfile(os.path.join(directory, hf_layout.VIT_CONFIG)):
            model_config = hf_load.read_config(directory)
            data.for_model(model_config)  # the checkpoint's ViT grid
            problems += tensor_problems(config, model_config)
    except (ValueError, TypeError) as e:
        problems.append(str(e))  # each names its data.* key
    return problems


def _teacher_problems(config, check_files: bool) -> list[str]:
    """teacher_path against teacher_mode: given exactly when the teacher is another checkpoint
    (whose tokenizer and shapes are compared with the student's when it is loaded)."""
    if config.teacher_mode != "checkpoint":
        if config.teacher_path:
            return [
                f"teacher_path={config.teacher_path!r} with teacher_mode={config.teacher_mode!r}: "
                "the path is read only by teacher_mode='checkpoint' (set it, or drop the path)"
            ]
        return []
    if not config.teacher_path:
        return [
            "teacher_mode='checkpoint' with an empty teacher_path: give the teacher's BAGEL / "
            "ThinkMorph HF directory"
        ]
    problem = _not_a_bagel_directory("teacher_path", config.teacher_path) if check_files else None
    return [problem] if problem else []


def _not_a_bagel_directory(key: str, path: str) -> str | None:
    config_file = os.path.join(path, hf_layout.LLM_CONFIG)
    if os.path.isfile(config_file):
        return None
    return f"{key}={path!r}: not a BAGEL HF directory (no {config_file})"


def _teacher_by_source_problems(config, check_files: bool) -> list[str]:
    """A teacher per data source: every dataset has exactly one, every name is a dataset's,
    at most one student copy (the state keeps one EMA or fixed copy), and each checkpoint
    teacher is a BAGEL directory. The mapping replaces teacher_mode and teacher_path."""
    key = f"teacher_by_source={config.teacher_by_source!r}"
    try:
        pairs = trained_split.parse_teacher_by_source(config.teacher_by_source)
    except ValueError as e:
        return [str(e)]
    if config.mode == "sft":
        return [f"{key} with mode='sft': SFT has no teacher"]
    problems = []
    if config.mode == "offline":  # the cache is collected once: no student copy to score with
        for name, teacher in pairs:
            if teacher in ("ema", "fixed"):
                problems.append(
                    f"{key} with mode='offline': {name!r} -> {teacher!r}; an offline cache is "
                    "collected from 'self' (model_path's weights) or a checkpoint's directory"
                )
    if config.teacher_mode == "checkpoint" or config.teacher_path:
        problems.append(
            f"{key} with teacher_mode={config.teacher_mode!r}, teacher_path="
            f"{config.teacher_path!r}: the mapping names every teacher (a checkpoint by its "
            "path); leave teacher_path empty"
        )
    names = [d["name"] for d in config.data.datasets]
    given = dict(pairs)
    for name in given:
        if name not in names:
            problems.append(f"{key}: {name!r} is no dataset of data.datasets {names}")
    for name in names:
        if name not in given:
            problems.append(f"{key}: dataset {name!r} has no teacher")
    teachers = set(given.values())
    if {"ema", "fixed"} <= teachers:
        problems.append(
            f"{key}: 'ema' and 'fixed' both; the train state keeps one copy of the student "
            "for a teacher, so choose one of them"
        )
    for path in sorted(teachers - set(trained_split.STUDENT_TEACHERS)):
        problem = _not_a_bagel_directory("teacher_by_source", path) if check_files else None
        problems += [problem] if problem else []
    return problems


def _lora_problems(config) -> list[str]:
    """LoRA's keys among themselves and against the freeze flags. (Whether lora_targets
    matches a projection of the model is asked of the model: builds.lora_paths.)"""
    if not config.lora_rank:
        return []
    problems = []
    try:
        re.compile(config.lora_targets)
    except re.error as e:
        problems.append(f"lora_targets={config.lora_targets!r}: not a regular expression ({e})")
    for flag in ("freeze_llm", "freeze_vit", "freeze_und"):
        if config[flag]:
            problems.append(
                f"{flag}=True with lora_rank={config.lora_rank}: with LoRA the whole base "
                "model is frozen and lora_targets chooses what trains; set it False"
            )
    if config.resume_model_only:
        problems.append(
            f"resume_model_only=True with lora_rank={config.lora_rank}: a LoRA run starts "
            "from the HF weights of model_path (export a checkpoint with scripts/convert_hf.py "
            "jax-to-hf and give that directory as model_path)"
        )
    return problems


def _device_problems(config, num_devices: int, num_processes: int) -> list[str]:
    problems = []
    data, fsdp, tensor = mesh_shape(config, num_devices)
    if data * fsdp * tensor != num_devices or fsdp < 1:
        problems.append(
            f"mesh num_replicate={config.num_replicate} x num_shard={config.num_shard} "
            f"x num_tensor={config.num_tensor} does not match the {num_devices} "
            "devices: the product must equal the device count (num_shard=-1 "
            "takes all the devices the other two leave)"
        )
    elif config.rows_per_micro_batch % (data * fsdp):
        problems.append(
            f"rows_per_micro_batch={config.rows_per_micro_batch} must be a multiple of "
            f"data x fsdp = {data * fsdp} (rows are sharded over them)"
        )
    if num_processes > 1 and fsdp >= 1:
        if (data * fsdp) % num_processes:
            problems.append(
                f"data x fsdp = {data * fsdp} (num_replicate={config.num_replicate}, "
                f"num_shard={config.num_shard}) must be a multiple of the {num_processes} "
                f"processes: num_tensor={config.num_tensor} may not span hosts (each process "
                "feeds its own rows)"
            )
        # Each process packs its own share of every micro-batch (distributed.py).
        for key in ("samples_per_micro_batch", "rows_per_micro_batch"):
            if config[key] % num_processes:
                problems.append(
                    f"{key}={config[key]} must be a multiple of the "
                    f"{num_processes} processes (each feeds an equal share)"
                )
        prompts = config.samples_per_micro_batch * config.gradient_accumulation_steps
        if config.mode == "opsd" and prompts % (data * fsdp):
            problems.append(
                f"samples_per_micro_batch x gradient_accumulation_steps = {prompts} "
                f"must be a multiple of data x fsdp = {data * fsdp} with several "
                "processes (the sampler's prompt rows are sharded over them)"
            )
    return problems
