"""Evaluation settings from a training run: prompt options, data, model directory and the
model itself (an HF directory and/or a training checkpoint). Shared by train.py's periodic
evaluation, scripts/evaluate.py, generate.py, collect_traces.py and the benches, so they all
build prompts and data the trainer's way.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx

from opsd_jax.data.opsd_packs import PromptOptions
from opsd_jax.io import checkpoint as checkpoint_lib
from opsd_jax.io.hf_load import load_hf


def prompt_options_from_config(config: Mapping[str, Any], noise_vt: bool | None = None):
    """PromptOptions from a training config (the names of configs/common.py); empty texts keep
    our default wording, as in the trainer."""
    defaults = PromptOptions()
    get = lambda key, default: config.get(key, default)  # noqa: E731
    return PromptOptions(
        use_system_prompt=get("use_system_prompt", defaults.use_system_prompt),
        system_prompt=get("system_prompt", "") or defaults.system_prompt,
        use_reference_intro=get("use_reference_intro", defaults.use_reference_intro),
        reference_intro=get("reference_intro", "") or defaults.reference_intro,
        use_transition_prompt=get("use_transition_prompt", defaults.use_transition_prompt),
        transition_prompt=get("transition_prompt", "") or defaults.transition_prompt,
        instruction_suffix=get("instruction_suffix", defaults.instruction_suffix),
        privileged_thoughts=get("privileged_thoughts", defaults.privileged_thoughts),
        privileged_answer=get("privileged_answer", defaults.privileged_answer),
        noise_vt=get("noise_vt", defaults.noise_vt) if noise_vt is None else noise_vt,
        max_reference_rounds=get("max_reference_rounds", defaults.max_reference_rounds),
        noise_seed=get("global_seed", defaults.noise_seed),
        offline_target=get("offline_target", defaults.offline_target),
    )  # fmt: skip


def data_config_from(config: Mapping[str, Any] | None, datasets: Sequence[str] = (),
                     image_transform: Any = None):  # fmt: skip
    """A DataConfig from a training config's `data` section and/or `name=path` dataset strings.

    `datasets` (e.g. from the command line) replace the config's datasets. Relative config paths
    are read under `data_root`; a toy config whose paths are empty uses
    `<results_dir>/toy/data/<name>` (where the trainer writes the toy set).
    """
    from opsd_jax.data.data_config import DataConfig

    data = dict((config or {}).get("data") or {})
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
    elif config is not None:
        specs = []
        for spec in data.get("datasets") or []:
            spec = dict(spec)
            path = spec.get("path", "")
            if not path and config.get("toy_data"):
                path = os.path.join(config.get("results_dir", ""), "toy", "data", spec["name"])
            elif path and config.get("data_root") and not os.path.isabs(path):
                path = os.path.join(config["data_root"], path)
            if not os.path.exists(path):
                raise FileNotFoundError(
                    f"dataset {spec.get('name')!r}: path {path!r} does not exist (train once with "
                    "this config to write the toy data, or give --data name=path)")  # fmt: skip
            specs.append(dict(spec, path=path))
        data["datasets"] = specs
    if not data.get("datasets"):
        raise ValueError("no datasets: give --config (with data.datasets) or --data name=path")
    if image_transform is not None:
        data["image_transform"] = image_transform
    if config is not None:
        data["max_reference_rounds"] = config.get("max_reference_rounds",
                                                  data.get("max_reference_rounds", 8))  # fmt: skip
        data["seed"] = config.get("global_seed", 0)
    return DataConfig.from_dict(data)


def model_dir_from_config(config: Mapping[str, Any]) -> str | None:
    """A config's `model_path`; for a toy config without one, where the trainer writes the toy
    model (`<results_dir>/toy/model`)."""
    if config.get("model_path"):
        return config["model_path"]
    if config.get("toy_data"):
        return os.path.join(config.get("results_dir", ""), "toy", "model")
    return None


def cache_dtype_for(compute_dtype: str | None) -> str:
    """The sampler's KV-cache dtype: float32 for float32 compute (exact), else bfloat16."""
    return "float32" if compute_dtype == "float32" else "bfloat16"


def load_model(model_dir: str | None = None, checkpoint: str | None = None, *,
               which: str = "params", compute_dtype: str | None = None,
               mesh: jax.sharding.Mesh | None = None, weights: str | None = None,
               log: Callable[[str], None] | None = None):  # fmt: skip
    """(model, tokenizer, run config or None) from an HF directory and/or a training checkpoint.

    With `checkpoint`, the architecture and tokenizer come from `model_dir` or, when that is
    None, from the `model_path` in the checkpoint's saved config; the `which` item
    ('params' | 'ema_params') is then restored into it.
    """
    run_config = None
    step_dir = None
    if checkpoint:
        step_dir = checkpoint_lib.step_dir_of(checkpoint)
        run_config = checkpoint_lib.saved_config(step_dir)
        if model_dir is None:
            model_dir = model_dir_from_config(run_config or {})
            if model_dir is None:
                raise ValueError(f"--checkpoint {checkpoint}: its config names no model_path; "
                                 "give --model_dir (the HF directory the run started from)")  # fmt: skip
    if model_dir is None:
        raise ValueError("give --model_dir (an HF directory) or --checkpoint (a training run)")
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory {model_dir!r} does not exist")
    if compute_dtype is None:
        compute_dtype = (run_config or {}).get("compute_dtype", "bfloat16")
    start = time.perf_counter()
    # With a checkpoint the HF weights are not read: its params fill the abstract ones directly.
    model, _, tokenizer = load_hf(model_dir, mesh=mesh, weights=weights,
                                  config_changes={"llm": {"compute_dtype": compute_dtype}},
                                  read_params=step_dir is None)  # fmt: skip
    if step_dir is not None:
        graphdef, abstract, rest = nnx.split(model, nnx.Param, ...)
        params = checkpoint_lib.restore_model_params(step_dir, abstract, which=which)
        model = nnx.merge(graphdef, params, rest)
    if log is not None:
        source = f"{which} of {step_dir} on " if step_dir else ""
        log(f"model: {source}{model_dir} ({compute_dtype}), {tokenizer.vocab_length} tokenizer "
            f"ids, loaded in {time.perf_counter() - start:.1f}s")  # fmt: skip
    return model, tokenizer, run_config
