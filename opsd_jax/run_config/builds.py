"""What a run's config becomes: one function per object, each reading the keys of
configs/common.py (where every default lives, and only there).

Every builder takes a full config (a config file's ConfigDict), a run's saved config (a dict from
a checkpoint, perhaps written by an older version) or just a few changes (`{"jsd_top_k": 0}`):
`complete` lays any of them over the defaults first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from configs import common
from models import configs as model_configs
from opsd_jax.data import pack_shapes
from opsd_jax.data.data_config import DataConfig
from opsd_jax.data.opsd_packs import (
    DEFAULT_REFERENCE_INTRO,
    DEFAULT_SYSTEM_PROMPT,
    DEFAULT_TRANSITION_PROMPT,
    PromptOptions,
)
from opsd_jax.run_config.trained_split import TrainedSplit
from opsd_jax.sampling import layout_choice
from opsd_jax.toy.assets import toy_data_dir, toy_model_dir
from opsd_jax.training import train_step


def defaults() -> ml_collections.ConfigDict:
    """Every key at its default (configs/common.py)."""
    return common.base_config()


def complete(config: Mapping[str, Any] | ml_collections.ConfigDict | None):
    """`config` laid over the defaults, as a ConfigDict. A config made from `base_config()`
    (every config file) is returned as it is; keys the defaults do not know (a saved config
    of an older version) are left out."""
    full = defaults()
    if isinstance(config, ml_collections.ConfigDict) and all(k in config for k in full):
        return config
    _lay_over(full, config.to_dict() if hasattr(config, "to_dict") else dict(config or {}))
    return full


def _lay_over(target: ml_collections.ConfigDict, values: Mapping[str, Any]) -> None:
    for key, value in values.items():
        if key not in target:
            continue
        if isinstance(target[key], ml_collections.ConfigDict) and isinstance(value, Mapping):
            _lay_over(target[key], value)
        else:
            target[key] = value


def mesh_shape(config, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes the config asks for on `num_devices` devices."""
    data, tensor = config.num_replicate, config.num_tensor
    fsdp = config.num_shard if config.num_shard != -1 else num_devices // max(data * tensor, 1)
    return data, fsdp, tensor


def resolve_paths(config) -> None:
    """Paths the config leaves to the run, filled in place, once: relative dataset paths are
    read under `data_root` (then emptied, so a saved config is resolved already); a toy
    config's empty dataset paths are where the run writes the toy data; an offline run's empty
    `offline_cache_dir` is `<results_dir>/teacher_cache` (so two offline runs with their own
    results_dir never share a cache by accident)."""
    specs = []
    for spec in config.data.datasets:
        spec = dict(spec)
        path = spec.get("path", "")
        if not path and config.toy_data:
            path = os.path.join(toy_data_dir(config.results_dir), spec.get("name", ""))
        elif path and config.data_root and not os.path.isabs(path):
            path = os.path.join(config.data_root, path)
        specs.append(dict(spec, path=path))
    with config.unlocked():
        config.data.datasets = specs
        config.data_root = ""
        if config.mode == "offline" and not config.offline_cache_dir:
            config.offline_cache_dir = os.path.join(config.results_dir, "teacher_cache")


def model_dir(config) -> str | None:
    """The config's `model_path`; for a toy config without one, where the run writes the toy
    model; else None."""
    config = complete(config)
    if config.model_path:
        return config.model_path
    return toy_model_dir(config.results_dir) if config.toy_data else None


def model_runtime(config) -> dict:
    """The model's runtime options (the `llm` config changes every loader takes: compute
    dtype, the attention backend, its tile, remat, the layer loop), named alike in the run
    config and the model config, and the one derived from the data
    (models/configs.DERIVED_RUNTIME_FIELDS).

    'auto' stays 'auto': the model resolves it where it traces (models/attention.py), so a
    program compiled for a GPU target without one (the preflight) takes the GPU's path, and the
    decode keeps XLA's attention where 'auto' means Pallas (attention.DECODE_KERNEL_IN_AUTO).
    Resolved here, it was this machine's choice ('chunked' in a CPU preflight) and, on a GPU,
    'pallas' by name, which runs the decode kernel too."""
    config = complete(config)
    runtime = {key: config[key] for key in model_configs.RUNTIME_FIELDS}
    # The ViT's cudnn backend lays a row's images out in rows of this length (attention_cudnn).
    runtime["vit_image_patches"] = pack_shapes.image_patches(config.data.image_transform)
    return runtime


def cache_dtype_for(compute_dtype: str) -> str:
    """The sampler's KV-cache dtype: float32 for float32 compute (exact), else bfloat16."""
    return "float32" if compute_dtype == "float32" else "bfloat16"


def loss_settings(config, vocab_limit: int | None = None) -> train_step.LossSettings:
    """The loss knobs; `vocab_limit` is the tokenizer length (the sampler's limit too)."""
    config = complete(config)
    return train_step.LossSettings(
        jsd_weight=config.jsd_weight,
        ce_weight=config.ce_weight,
        jsd_loss_kind=config.jsd_loss_kind,
        jsd_beta=config.jsd_beta,
        jsd_temperature=config.jsd_temperature,
        jsd_top_k=config.jsd_top_k,
        jsd_token_clip=config.jsd_token_clip,
        jsd_clip_mode=config.jsd_clip_mode,
        reduction=config.loss_reduction,
        num_samples=config.samples_per_micro_batch,
        vocab_limit=vocab_limit,
        kd_weight=config.kd_weight,
        kd_temperature=config.kd_temperature,
        kd_use_vt_weights=config.kd_use_vt_weights,
        kd_student_norm=config.kd_student_norm,
        sample_temperature=config.sample_temperature if config.sample_do_sample else 1.0,
    )


def prompt_options(config, noise_vt: bool | None = None) -> PromptOptions:
    """The prompt wording and views; an empty text is our default wording (as the trainer's).
    `noise_vt` overrides the config's (the evaluation scripts' flag)."""
    config = complete(config)
    return PromptOptions(
        use_system_prompt=config.use_system_prompt,
        system_prompt=config.system_prompt or DEFAULT_SYSTEM_PROMPT,
        use_reference_intro=config.use_reference_intro,
        reference_intro=config.reference_intro or DEFAULT_REFERENCE_INTRO,
        use_transition_prompt=config.use_transition_prompt,
        transition_prompt=config.transition_prompt or DEFAULT_TRANSITION_PROMPT,
        instruction_suffix=config.instruction_suffix,
        privileged_thoughts=config.privileged_thoughts,
        privileged_answer=config.privileged_answer,
        noise_vt=config.noise_vt if noise_vt is None else noise_vt,
        max_reference_rounds=config.max_reference_rounds,
        noise_seed=config.global_seed,
        offline_target=config.offline_target,
    )


def data_config(config, datasets: Sequence[str] = (), image_transform: Any = None) -> DataConfig:
    """The DataConfig: `config.data` with the top-level `max_reference_rounds` (VT images per
    sample, also the teacher prompt's) and `global_seed`; call `.for_model` next.

    `datasets` (`name=path` strings, or bare paths named by their folder, e.g. from the command
    line) replace the config's; `image_transform` replaces its image transform. The config's
    own paths are resolved as `resolve_paths` does."""
    config = complete(config)
    data = config.data.to_dict()
    if datasets:
        specs = []
        for text in datasets:
            name, sep, path = text.partition("=")
            if not sep:  # a bare path: the folder name is the dataset name
                name, path = os.path.basename(os.path.normpath(text)), text
            if not os.path.exists(path):
                raise FileNotFoundError(f"--data {text}: path {path!r} does not exist")
            specs.append({"name": name, "path": path})
        data["datasets"] = specs
    else:
        resolved = complete(config.to_dict())  # a copy: the caller's config stays as it is
        resolve_paths(resolved)
        data["datasets"] = [dict(spec) for spec in resolved.data.datasets]
        for spec in data["datasets"]:
            if not os.path.exists(spec["path"]):
                raise FileNotFoundError(
                    f"dataset {spec.get('name')!r}: path {spec['path']!r} does not exist (a toy "
                    "config writes its data when it first trains; else give --data name=path)"
                )
    if not data["datasets"]:
        raise ValueError("no datasets: give --config (with data.datasets) or --data name=path")
    if image_transform is not None:
        data["image_transform"] = image_transform
    return DataConfig.from_dict(dict(data, **_data_fields_on_top(config)))


def data_fields(config) -> dict:
    """Every DataConfig field the config sets except the datasets (`config.data` and the
    top-level keys the data reads), for a DataConfig made without a config file."""
    config = complete(config)
    data = {k: v for k, v in config.data.to_dict().items() if k != "datasets"}
    return dict(data, **_data_fields_on_top(config))


def _data_fields_on_top(config) -> dict:
    # VT images per sample (also the teacher prompt's) and the seed of the data order.
    return dict(max_reference_rounds=config.max_reference_rounds, seed=config.global_seed)


def rollout_cache_bytes(config, model_config, shapes: dict) -> int:
    """The sampler's KV cache at capacity (what `sampler_layout='auto'` weighs): every prompt
    row of a step, each with a student row's share of tokens (prompt + completion; a row holds
    samples_per_micro_batch / rows_per_micro_batch samples). `shapes`: pack_shapes(config)."""
    per_micro = config.samples_per_micro_batch
    slots = (
        shapes["student"][-1].row_length * config.rows_per_micro_batch // per_micro
        if "student" in shapes
        else config.max_forward_tokens
    )
    return layout_choice.cache_nbytes(
        model_config,
        config.gradient_accumulation_steps * per_micro,
        slots,
        cache_dtype_for(config.compute_dtype),
    )


def train_step_for(
    config, loss_fn, optimizer, abstract_state, frozen: tuple[str, ...] = (), teachers=None
):
    """The one compiled train step as the config sets it up (teacher mode, EMA decay, learning
    rate schedule, bad-step limit), its state laid out like `abstract_state`. `teachers`: the
    loss's StepTeachers, when it was made with them (it then takes each teacher's state)."""
    return train_step.make_train_step(
        loss_fn,
        optimizer,
        teacher_mode=TrainedSplit.of_config(config).teacher if teachers is None else teachers,
        ema_decay=config.ema_decay,
        schedule=train_step.learning_rate_schedule(config),
        frozen=frozen,
        max_bad_steps=config.max_consecutive_bad_steps,
        state_shardings=train_step.shardings_of(abstract_state),
        sum_micro_batches=config.loss_reduction == "token_sum",
    )
