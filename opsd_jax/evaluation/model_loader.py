"""A model to evaluate, from an HF directory and/or a training checkpoint (the evaluation
scripts' and the toy experiment's loader; train.py evaluates its live student instead)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import jax
from flax import nnx

from opsd_jax import run_config as run_config_lib
from opsd_jax.io import lora_export, saved_items
from opsd_jax.io.hf_load import load_hf
from opsd_jax.parallel.mesh import make_mesh


def load_model(
    model_dir: str | None = None,
    checkpoint: str | None = None,
    *,
    which: str = "params",
    compute_dtype: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    weights: str | None = None,
    log: Callable[[str], None] | None = None,
):
    """(model, tokenizer, run config or None) from an HF directory and/or a training checkpoint.

    With `checkpoint`, the architecture and tokenizer come from `model_dir` or, when that is
    None, from the `model_path` in the checkpoint's saved config; the `which` item
    ('params' | 'ema_params') is then restored into it; a LoRA run's checkpoint (adapters
    only) gives the base with that item's adapters merged in (lora_export.restore_merged).
    """
    run_config = None
    step_dir = None
    if checkpoint:
        step_dir = saved_items.step_dir_of(checkpoint)
        run_config = saved_items.saved_config(step_dir)
        if model_dir is None:
            model_dir = run_config_lib.model_dir(run_config or {})
            if model_dir is None:
                raise ValueError(
                    f"--checkpoint {checkpoint}: its config names no model_path; "
                    "give --model_dir (the HF directory the run started from)"
                )
    if model_dir is None:
        raise ValueError("give --model_dir (an HF directory) or --checkpoint (a training run)")
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory {model_dir!r} does not exist")
    if compute_dtype is None:
        compute_dtype = run_config_lib.complete(run_config).compute_dtype
    start = time.perf_counter()
    # With a checkpoint the HF weights are not read: its params fill the abstract ones directly.
    model, _, tokenizer = load_hf(
        model_dir,
        mesh=mesh,
        weights=weights,
        config_changes={"llm": {"compute_dtype": compute_dtype}},
        read_params=step_dir is None,
    )
    if step_dir is not None:
        graphdef, abstract, rest = nnx.split(model, nnx.Param, ...)
        if lora_export.lora_checkpoint(step_dir) is not None:
            # A LoRA run saves its adapters alone: they are folded into the base they were
            # trained on (model_dir's weights, checked by digest), as the HF export does.
            params = lora_export.restore_merged(
                step_dir, model_dir, mesh or make_mesh(devices=jax.devices()[:1]), which=which
            )
        else:
            params = saved_items.restore_model_params(step_dir, abstract, which=which)
        model = nnx.merge(graphdef, params, rest)
    if log is not None:
        source = f"{which} of {step_dir} on " if step_dir else ""
        log(
            f"model: {source}{model_dir} ({compute_dtype}), {tokenizer.vocab_length} tokenizer "
            f"ids, loaded in {time.perf_counter() - start:.1f}s"
        )
    return model, tokenizer, run_config
