"""LoRA adapters on the model's projections (flax's `nnx.LoRA`), and their merge into the weights.

`attach(model, rank, alpha, targets, rngs)` gives every `Projection` whose path (e.g.
`language_model/layers/und/q_proj`) matches the regular expression `targets` in full an
`nnx.LoRA` over its flattened input and output features: the projection computes
`x W + (alpha / rank) (x A) B`, A of [in, rank], B of [rank, out], B zero at first, so an
attached model computes what it did before. In a layer stack (a kernel with a leading layers
axis) the adapters are stacked the same way (layers.stack_layers), so the scan over
the layers slices them with the weights. Their parameters are `nnx.LoRAParam`, a subclass of
`nnx.Param`: `nnx.split(model, nnx.LoRAParam, nnx.Param, ...)` gives adapters, base, the rest.

`merged(model)` is the model with each adapter folded into its kernel, W + (alpha / rank) A B
computed in fp32 and cast to the kernel's dtype, and no adapter left: its graph is that of a
model never given adapters, the model the HF export writes and the sampler's decode copy fuses
(opsd_jax/sampling/decode_copy.py merges before it fuses: fusing q/k/v of an unmerged model
would drop their adapters).

Why flax's LoRA and not qwix's interception: our projections run their einsum inside a custom
VJP (layers.weight_einsum) and their layers inside `nnx.scan`, which qwix's lazily created,
call-intercepting adapters do not pass through; an `nnx.LoRA` is an ordinary submodule of the
projection, created with the model's stacked layout.
"""

from __future__ import annotations

import math
import re

import jax.numpy as jnp
from flax import nnx

from models.layers import Projection, stack_layers


def projection_paths(model: nnx.Module) -> dict[str, Projection]:
    """Every Projection of `model` by its path ('language_model/layers/und/q_proj')."""
    return {
        "/".join(map(str, path)): node
        for path, node in nnx.iter_graph(model)
        if isinstance(node, Projection)
    }


def _contracted_dims(projection: Projection) -> int:
    """How many of the kernel's leading axes the projection's einsum contracts with x's
    trailing ones. LoRA needs the einsum to be x[batch..., in...] times W[in..., out...] into
    [batch..., out...]: then (x flattened to [batch..., in]) A B is its low-rank update."""
    inputs, output = projection.equation.split("->")
    x_spec, w_spec = inputs.split(",")
    n_in = sum(1 for axis in w_spec if axis in x_spec)
    batch = x_spec[: len(x_spec) - n_in]
    if x_spec[len(batch) :] != w_spec[:n_in] or output != batch + w_spec[n_in:]:
        raise ValueError(f"einsum {projection.equation!r} is not x[..., in] W[in, out]")
    return n_in


def matching_paths(model: nnx.Module, targets: str) -> list[str]:
    """The paths of `model`'s projections that `targets` matches in full, in model order (an
    abstract model will do: nothing is read). A pattern that is no regular expression or matches
    nothing is an error naming it and some of the paths."""
    try:
        pattern = re.compile(targets)
    except re.error as e:
        raise ValueError(f"lora_targets={targets!r}: not a regular expression ({e})") from None
    paths = list(projection_paths(model))
    chosen = [path for path in paths if pattern.fullmatch(path)]
    if not chosen:
        raise ValueError(
            f"lora_targets={targets!r} matches no projection of the model (paths such as "
            f"{', '.join(paths[:4])}, ...)"
        )
    return chosen


def attach(
    model: nnx.Module,
    rank: int,
    alpha: float,
    targets: str,
    rngs: nnx.Rngs,
    dtype=None,
) -> list[str]:
    """Give every Projection whose path matches `targets` (re.fullmatch) an adapter of `rank`,
    scaled by alpha / rank, computing in `dtype` (None: the input's). Returns the paths, in
    model order. A `targets` that matches nothing, or a rank below 1, is an error naming it."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"lora_rank={rank!r}: must be an integer >= 1 (0 is no LoRA)")
    projections = projection_paths(model)
    chosen = {path: projections[path] for path in matching_paths(model, targets)}
    for path, projection in chosen.items():
        if projection.lora is not None:
            raise ValueError(f"{path}: has an adapter already")
        n_in = _contracted_dims(projection)
        # In a layer stack the kernel has a leading layers axis its per-layer names lack.
        stacked = projection.kernel.ndim == len(projection.kernel_names) + 1
        shape = projection.kernel.shape[1:] if stacked else projection.kernel.shape
        in_features, out_features = math.prod(shape[:n_in]), math.prod(shape[n_in:])
        # Small and read whole by every device: replicated (no logical axis names).
        metadata = {"out_sharding": (None, None), "eager_sharding": False}

        def make(layer_rngs, in_features=in_features, out_features=out_features):
            return nnx.LoRA(
                in_features,
                rank,
                out_features,
                dtype=dtype,
                rngs=layer_rngs,
                a_metadata=metadata,
                b_metadata=metadata,
            )

        projection.lora = (
            stack_layers(make, projection.kernel.shape[0], rngs) if stacked else make(rngs)
        )
        projection.lora_scale = alpha / rank
        projection.lora_in_dims = n_in
    return list(chosen)


def has_adapters(model: nnx.Module) -> bool:
    return any(p.lora is not None for p in projection_paths(model).values())


def merged(model: nnx.Module) -> nnx.Module:
    """`model` with every adapter folded into its kernel (module docstring); `model` itself is
    left as it is (a model without adapters is returned as it is)."""
    if not has_adapters(model):
        return model
    model = nnx.clone(model)  # new Variables: the caller's model keeps its adapters
    for projection in projection_paths(model).values():
        if projection.lora is None:
            continue
        kernel = projection.kernel
        a = projection.lora.lora_a[...].astype(jnp.float32)
        b = projection.lora.lora_b[...].astype(jnp.float32)
        update = projection.lora_scale * jnp.matmul(a, b)  # [(layers,) in, out]
        merged_kernel = kernel[...].astype(jnp.float32) + update.reshape(kernel.shape)
        kernel[...] = merged_kernel.astype(kernel.dtype)
        # Back to the class defaults: the graph of a model that never had adapters.
        del projection.lora, projection.lora_scale, projection.lora_in_dims
    return model
