"""The sampler's copy of the student: compute dtype, decode layout, made on device once per step.

Why: the training parameters are fp32 and FSDP-sharded over their hidden dimension. A decode
step feeds one token per row, so decoding on them all-gathers every layer's weights for every
generated token (the whole model crosses the interconnect per token). Instead, after each
update, `make_decode_copy` casts the parameters to the compute dtype and lays them out for
decoding in one jitted reshard (one all-gather of the bf16 model per step, no host round trip);
the sampler decodes on that copy, and the caller frees it (`DecodeCopy.delete`) after sampling,
so peak memory is the training state + one compute-dtype copy + the KV cache.

Layouts (config `sampler_layout`, opsd_jax/parallel/mesh.py SAMPLER_LAYOUTS and DECODE_RULES):
  replicated  every device holds the whole copy; rows over all devices; a decode step moves
              nothing but per-row scalars.
  tensor      heads, MLP and vocab split over the devices of one host (a head / width split only
              where it divides), rows over the hosts; a decode step all-reduces the layer
              outputs inside the host (Megatron-style). For models that do not fit replicated.

  auto        the one of the two with the least projected rollout time that fits in memory
              (opsd_jax/sampling/layout_choice.py), resolved by `choose_layout`.

Floating parameters of two or more dimensions are cast (the model casts them to the compute
dtype before every use anyway); one-dimensional ones (norm scales, biases: well under 1% of the
bytes) keep their dtype, because some are used in fp32 (the ViT's LayerNorm). So the copy
computes exactly what the training parameters compute, without per-token casts.

The copy's language model holds q/k/v as one projection and gate/up as another
(models/qwen2_mot.py `fuse_projections`, in shards of the layout's tensor axis): one GEMM each
a decode step instead of three and two. Its module structure therefore differs from the
training model's: `DecodeCopy.graphdef` is the copy's own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import lora, qwen2_mot
from models.sharding import logical_spec
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.sampling import layout_choice


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def copy_dtype(x, dtype):
    """The dtype `x` has in the copy (see the module docstring)."""
    return jnp.dtype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 2 else x.dtype


@dataclasses.dataclass
class DecodeCopy:
    """A model state laid out for decoding, with the mesh and rules it was laid out by.

    `sampler.sample(copy, ...)` decodes on it under `activate()`; `delete()` frees its device
    memory at once (the next step's copy must not coexist with this one)."""

    graphdef: nnx.GraphDef
    state: nnx.State
    mesh: jax.sharding.Mesh
    layout: str
    rules: tuple = mesh_lib.DECODE_RULES

    @property
    def model(self) -> nnx.Module:
        return nnx.merge(self.graphdef, self.state)

    def activate(self):
        """The decode mesh and rules as the context (jitted sampler calls run inside it)."""
        return mesh_lib.use_mesh(self.mesh, self.rules)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self.state))

    def delete(self) -> None:
        for x in jax.tree.leaves(self.state):
            x.delete()


def decode_shardings(state: nnx.State, mesh: jax.sharding.Mesh, rules=mesh_lib.DECODE_RULES):
    """The decode layout of `state` (Variables with logical names): a tree of NamedShardings.

    A mesh axis that does not divide its dimension is dropped from it (models/sharding.py), so
    e.g. 28 heads on an 8-device tensor axis stay whole instead of failing."""

    def sharding(variable):
        names = variable.get_metadata().get("out_sharding") or (None,) * variable.ndim
        spec = logical_spec(variable.shape, names, mesh, rules)
        return variable.replace(value=jax.sharding.NamedSharding(mesh, spec))

    return jax.tree.map(sharding, state, is_leaf=_is_variable)


def _copy_model(graphdef: nnx.GraphDef, state: nnx.State, view: jax.sharding.Mesh, dtype):
    """The model of `graphdef` and `state` cast to the copy's dtypes, its projections fused
    in shards of `view`'s tensor axis (traced: under jit or eval_shape)."""
    # LoRA adapters are folded into their kernels first, in fp32 (models/lora.py): the copy
    # holds plain weights, and fusing q/k/v of an unmerged model would drop their adapters.
    graphdef, state = nnx.split(lora.merged(nnx.merge(graphdef, state)))
    model = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(copy_dtype(x, dtype)), state))
    qwen2_mot.fuse_projections(model, view.shape["tensor"])
    return model


def _copy_split(graphdef, state, view, dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """(the copy's graphdef, its abstract state: Variables of ShapeDtypeStructs with their
    logical names), computing nothing."""
    return nnx.split(nnx.eval_shape(lambda s: _copy_model(graphdef, s, view, dtype), state))


def cast_function(graphdef: nnx.GraphDef, state: nnx.State, view: jax.sharding.Mesh, dtype):
    """The jitted state -> copy state on the decode mesh `view` (cached: one compile per run,
    not one per step). `state` may be abstract (ShapeDtypeStructs), e.g. to read its program."""
    return _cast(graphdef, state, view, dtype)[1]


def _cast(graphdef, state, view, dtype) -> tuple[nnx.GraphDef, Any]:
    """(the copy's graphdef, the jitted cast), made once per model, layout and dtype: tracing
    the copy's structure costs a pass over the model, too much to repeat every step."""
    key = (
        graphdef,
        jax.tree.structure(state),
        tuple(x.shape for x in jax.tree.leaves(state)),
        view,
        jnp.dtype(dtype),
    )
    if key not in _CAST_FUNCTIONS:
        # Each device casts its own shard first (the input's layout), so the gather that the
        # out_shardings ask for moves compute-dtype bytes.
        copy_graphdef, abstract = _copy_split(graphdef, state, view, dtype)
        _CAST_FUNCTIONS[key] = (
            copy_graphdef,
            jax.jit(
                lambda s: nnx.state(_copy_model(graphdef, s, view, dtype)),
                out_shardings=decode_shardings(abstract, view),
            ),
        )
    return _CAST_FUNCTIONS[key]


_CAST_FUNCTIONS: dict = {}


def abstract_decode_copy(
    graphdef: nnx.GraphDef, state: nnx.State, view: jax.sharding.Mesh, dtype
) -> tuple[nnx.GraphDef, nnx.State]:
    """(the copy's graphdef, its ShapeDtypeStructs with dtype and decode sharding), allocating
    nothing: what the sampler's programs are compiled for."""
    copy_graphdef, abstract = _copy_split(graphdef, state, view, dtype)

    def with_sharding(x, sharding):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return copy_graphdef, jax.tree.map(with_sharding, abstract, decode_shardings(abstract, view))


def copy_nbytes(state: nnx.State, dtype) -> int:
    """The bytes of the whole decode copy of `state` (arrays or ShapeDtypeStructs)."""
    return sum(x.size * copy_dtype(x, dtype).itemsize for x in jax.tree.leaves(state))


def choose_layout(
    model_config, state: nnx.State, mesh: jax.sharding.Mesh, dtype, cache_bytes: int = 0
) -> layout_choice.Choice:
    """`sampler_layout='auto'` for this model on `mesh`'s devices (`cache_bytes`: the KV
    cache of all rows at capacity, when known)."""
    # One of this process's devices (another process's cannot be asked for its memory).
    device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    free = (
        stats["bytes_limit"] - stats["bytes_in_use"] if stats and "bytes_limit" in stats else None
    )
    return layout_choice.choose(
        copy_bytes=copy_nbytes(state, dtype),
        cache_bytes=cache_bytes,
        heads=layout_choice.head_counts(model_config),
        num_layers=model_config.llm.num_hidden_layers,
        num_devices=mesh.devices.size,
        devices_per_host=jax.local_device_count(),
        platform=device.platform,
        device_kind=getattr(device, "device_kind", ""),
        free_memory=free,
    )


def make_decode_copy(
    graphdef: nnx.GraphDef,
    *states: nnx.State,
    layout: str,
    mesh: jax.sharding.Mesh,
    dtype,
    tensor_size: int | None = None,
    model_config=None,
) -> DecodeCopy:
    """The model `nnx.merge(graphdef, *states)` cast to `dtype` (see the module docstring) and
    laid out by `layout` on the decode view of `mesh`'s devices: one jitted cast + reshard,
    computed on device (states: e.g. the training params and the rest of the model state).
    With `model_config`, 'tensor' splits only as far as every head count divides, and 'auto'
    is resolved (without it, 'auto' decodes replicated)."""
    state = nnx.merge_state(*states) if len(states) > 1 else states[0]
    if layout == "auto":
        if model_config is None:
            layout = "replicated"
        else:
            choice = choose_layout(model_config, state, mesh, dtype)
            layout, tensor_size = choice.layout, tensor_size or choice.tensor_size
    heads = layout_choice.head_counts(model_config) if model_config is not None else ()
    view = mesh_lib.decode_mesh(mesh, layout, tensor_size, heads)
    copy_graphdef, cast = _cast(graphdef, state, view, dtype)
    return DecodeCopy(copy_graphdef, cast(state), view, layout)
