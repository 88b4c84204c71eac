"""A run's config, from the command line to the objects it becomes, in one place.

configs/common.py holds every key with its only default; configs/<name>.py change some. Here:

- command_line.py: `parse_flags` (the config file read once, every unknown `--config.KEY`
  named with the nearest valid keys), `config_flag_value`, `config_error`, `load_config_file`;
- checks.py: `validate`, every bad value named before anything compiles (`ConfigError`);
- builds.py: what a config becomes, one function each: `complete` (any config, a saved one or a
  few changes laid over the defaults), `mesh_shape`, `resolve_paths`, `model_dir`,
  `model_runtime`, `loss_settings`, `prompt_options`, `data_config` (`data_fields`),
  `cache_dtype_for`, `rollout_cache_bytes`, `train_step_for`;
- trained_split.py: what the run trains and what it holds frozen (`TrainedSplit.of_config`: full
  or LoRA, the teacher's kind), asked by every stage, and the train state made from it
  (`abstract_train_state`, `init_train_state`, `split_for_training`, LoRA's `attach_adapters`,
  `with_adapters`, `lora_target_paths`);
- preflight.py: `train.py --compile_only=TARGET:DEVICES`, every program of the run compiled for
  compile-only GPUs and its peak memory per device against the device's.

train.py, the scripts, the benches and the evaluation all build through these, so a key means
the same thing everywhere.
"""

from opsd_jax.run_config.builds import (
    cache_dtype_for,
    complete,
    data_config,
    data_fields,
    defaults,
    loss_settings,
    mesh_shape,
    model_dir,
    model_runtime,
    prompt_options,
    resolve_paths,
    rollout_cache_bytes,
    train_step_for,
)
from opsd_jax.run_config.checks import MODES, ConfigError, tensor_problems, validate
from opsd_jax.run_config.command_line import (
    config_error,
    config_flag_value,
    config_keys,
    load_config_file,
    parse_flags,
    unknown_keys,
)
from opsd_jax.run_config.trained_split import (
    TrainedSplit,
    abstract_train_state,
    attach_adapters,
    init_train_state,
    lora_target_paths,
    split_for_training,
    with_adapters,
)

__all__ = [
    "MODES",
    "ConfigError",
    "TrainedSplit",
    "abstract_train_state",
    "attach_adapters",
    "init_train_state",
    "lora_target_paths",
    "split_for_training",
    "tensor_problems",
    "with_adapters",
    "cache_dtype_for",
    "complete",
    "config_error",
    "config_flag_value",
    "config_keys",
    "data_config",
    "data_fields",
    "defaults",
    "load_config_file",
    "loss_settings",
    "mesh_shape",
    "model_dir",
    "model_runtime",
    "parse_flags",
    "prompt_options",
    "resolve_paths",
    "rollout_cache_bytes",
    "train_step_for",
    "unknown_keys",
    "validate",
]
