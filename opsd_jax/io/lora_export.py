"""A LoRA run's checkpoint out as HF files: the merged model, or the adapters alone.

A LoRA checkpoint (lora_rank > 0) holds adapters only and names the base weights they apply to
(weights_digest.identity, in its meta item). `restore_merged` loads that base from the HF
directory given as the source (refused when its digest differs), attaches adapters of the saved
rank, alpha and targets, restores the checkpoint's adapters (`params`, or the EMA teacher's with
`ema_params`) and folds them in (models/lora.merged: W + (alpha / r) A B in fp32): params that
hf_export.save_hf writes in BAGEL's exact HF layout, as for a full fine-tune.

`save_adapters` writes the adapters alone, in PEFT's naming over BAGEL's HF module names:
`adapter_model.safetensors` with `base_model.model.<HF module>.lora_A.weight` [r, in] and
`.lora_B.weight` [out, r] per layer (in and out flattened in the HF weight's order: our
kernels' input and output axes are the HF matrix's, see hf_layout's LINEAR transforms), and
`adapter_config.json` with r, lora_alpha, the target modules and the base's identity.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from models import lora
from opsd_jax.io import checkpoint, hf_load, saved_items, weights_digest
from opsd_jax.io.checkpoint_format import CheckpointError, abstract_like
from opsd_jax.io.hf_layout import MAPPING

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def lora_checkpoint(ckpt: str | os.PathLike) -> tuple[dict, dict] | None:
    """(the base identity, the saved config) of a LoRA training checkpoint (a step or a
    checkpoints root); None for anything else (a full fine-tune, a params-only export)."""
    try:
        base = saved_items.saved_lora_base(ckpt)
    except (CheckpointError, FileNotFoundError, ValueError):
        return None
    if base is None:
        return None
    return base, saved_items.saved_config(ckpt) or {}


def _adapted_model(ckpt, source, mesh, which: str):
    """The base model of `source` with the checkpoint's adapters attached and restored."""
    found = lora_checkpoint(ckpt)
    if found is None:
        raise CheckpointError(f"{ckpt}: not a LoRA checkpoint (its meta names no LoRA base)")
    base, saved = found
    now = weights_digest.identity(source, base["weights"])
    if now["digest"] != base["digest"]:
        raise CheckpointError(
            f"{ckpt}: its LoRA adapters were trained on {weights_digest.describe(base)}, but "
            f"--source gives {weights_digest.describe(now)}; give the base they were trained on"
        )
    model, _, _ = hf_load.load_hf(source, mesh=mesh, weights=base["weights"])
    lora.attach(
        model,
        int(saved["lora_rank"]),
        float(saved["lora_alpha"]),
        saved["lora_targets"],
        rngs=nnx.Rngs(0),  # replaced by the restore
    )
    adapters = nnx.state(model, nnx.LoRAParam)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    adapters = jax.tree.map(lambda x: jax.device_put(x, replicated), adapters)
    nnx.update(model, saved_items.restore_model_params(ckpt, abstract_like(adapters), which=which))
    return model, base, saved


def restore_merged(ckpt, source, mesh, *, which: str = checkpoint.PARAMS):
    """The nnx.Param state of base + the checkpoint's adapters folded in (a plain model's)."""
    model, _, _ = _adapted_model(ckpt, source, mesh, which)
    return nnx.state(lora.merged(model), nnx.Param)


def _hf_module(path: str) -> tuple[str, bool]:
    """(the HF module name template of the projection at our `path`, whether per layer)."""
    target = path.replace("/", ".") + ".kernel"
    for rule in MAPPING:
        if rule.target == target:
            return rule.hf_key.removesuffix(".weight"), rule.per_layer
    raise ValueError(f"{path}: no HF weight maps to this projection")


def save_adapters(ckpt, source, out, mesh, *, which: str = checkpoint.PARAMS) -> Path:
    """Write the checkpoint's adapters alone to the new directory `out` (module docstring)."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; give a new directory")
    model, base, saved = _adapted_model(ckpt, source, mesh, which)
    tensors, modules = {}, []
    for path, projection in lora.projection_paths(model).items():
        if projection.lora is None:
            continue
        template, per_layer = _hf_module(path)
        a = np.asarray(jax.device_get(projection.lora.lora_a[...]), np.float32)
        b = np.asarray(jax.device_get(projection.lora.lora_b[...]), np.float32)
        layers = range(a.shape[0]) if per_layer else [None]
        for layer in layers:
            name = template.format(layer=layer) if per_layer else template
            a_i, b_i = (a[layer], b[layer]) if per_layer else (a, b)
            tensors[f"base_model.model.{name}.lora_A.weight"] = np.ascontiguousarray(a_i.T)
            tensors[f"base_model.model.{name}.lora_B.weight"] = np.ascontiguousarray(b_i.T)
        modules.append(template.replace("{layer}", "*"))
    out.mkdir(parents=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS))
    config = {
        "peft_type": "LORA",
        "r": int(saved["lora_rank"]),
        "lora_alpha": float(saved["lora_alpha"]),
        "target_modules": modules,
        "opsd_jax_lora_targets": saved["lora_targets"],
        "opsd_jax_item": which,
        "base": base,
    }
    with open(out / ADAPTER_CONFIG, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return out
