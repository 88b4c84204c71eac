"""Activation layout by logical names: the model names its axes, the rules in context decide.

The model code calls `constrain(x, ("act_batch", "act_length", "act_embed"))` at the few places
that fix the layout (embedding output, each layer's input, q/k/v, attention output, MLP hidden,
logits), and runs attention per device with `per_row_shard_map`. Neither knows about meshes or
parallelism strategies: the names are resolved through the logical-axis rules that the caller
activated (`flax.nnx.logical_axis_rules`, done by `opsd_jax.parallel.mesh.use_mesh`) on the mesh that is
set (`jax.set_mesh`). With no mesh or no rules in context both are no-ops, so the model runs
unchanged on one device and in tests that never set a layout.

Why constraints at all: under Auto sharding XLA propagates whatever layout it meets first. The
parameters are sharded over their hidden dimension (FSDP), and without constraints that layout
spreads from the embedding gather into every activation (rows replicated, hidden split): each
layer then all-reduces the whole batch's partial sums. Pinning the activations to "rows over the
batch axes, hidden whole" makes XLA gather the (small, bf16) weight shards instead.

A mesh axis that does not divide the dimension it would split is dropped from that dimension
(e.g. 4 sampler rows on 8 devices stay replicated): a layout rule never turns into a shape error.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
from flax.core import spmd
from jax.sharding import PartitionSpec

LogicalNames = Sequence[str | None]


def _active_mesh():
    """The abstract mesh set by `jax.set_mesh`, or None when there is none / it is manual."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return None
    # Inside a shard_map the axes are Manual: the code there is already per device.
    if any(t == jax.sharding.AxisType.Manual for t in mesh.axis_types):
        return None
    return mesh


def _mesh_axes_for(name: str | None, rules: dict) -> tuple[str, ...]:
    if name is None:
        return ()
    axes = rules.get(name)
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_spec(shape: Sequence[int], names: LogicalNames, mesh=None, rules=None):
    """PartitionSpec for an array of `shape` whose axes have logical `names`, or None when no
    layout is active. Mesh axes that do not divide their dimension (or are already used by an
    earlier dimension) are dropped, from the last one backwards."""
    mesh = _active_mesh() if mesh is None else mesh
    rules = spmd.get_logical_axis_rules() if rules is None else rules
    if mesh is None or not rules:
        return None
    if len(names) != len(shape):
        raise ValueError(f"logical names {tuple(names)} do not match shape {tuple(shape)}")
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for size, name in zip(shape, names):
        axes = [a for a in _mesh_axes_for(name, table) if a in mesh.shape and a not in used]
        while axes and size % math.prod(mesh.shape[a] for a in axes):
            axes.pop()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*spec)


def per_device(shape: Sequence[int], names: LogicalNames) -> tuple[int, ...]:
    """Each device's share of an array of `shape` laid out by the active rules' mapping of
    `names` (the whole shape without a layout): what the code the compiler emits for one device
    sees, where a choice of formulation depends on it."""
    spec = logical_spec(shape, names)
    if spec is None:
        return tuple(shape)
    return jax.sharding.NamedSharding(_active_mesh(), spec).shard_shape(tuple(shape))


def constrain(x: jax.Array, names: LogicalNames) -> jax.Array:
    """`x` with its layout pinned to the rules' mapping of `names` (no-op without a layout)."""
    spec = logical_spec(x.shape, names)
    if spec is None:
        return x
    return jax.lax.with_sharding_constraint(x, spec)


def per_row_shard_map(
    fn: Callable, arg_names: Sequence[LogicalNames], out_names: LogicalNames
) -> Callable:
    """`fn` run by every device on its own rows (and heads), via `jax.shard_map`.

    `arg_names[i]` are the logical names of positional argument i, `out_names` those of the
    single output. Without an active layout `fn` is returned unchanged. Used for attention:
    its kernels index rows and tiles by position, which Auto sharding cannot split, so without
    this XLA would all-gather q, k and v and compute every row on every device.
    """

    def wrapped(*args):
        mesh = _active_mesh()
        rules = spmd.get_logical_axis_rules()
        if mesh is None or not rules:
            return fn(*args)
        in_specs = tuple(logical_spec(a.shape, n, mesh, rules) for a, n in zip(args, arg_names))
        out = jax.eval_shape(fn, *args)
        out_spec = logical_spec(out.shape, out_names, mesh, rules)
        # Every argument sharded along the same axes as the output must agree on them, which
        # holds when rows / heads divide over their axes (the divisibility rule above gives all
        # arrays with the same leading size the same spec).
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(
            *args
        )

    return wrapped


# The names of the model's recurring activation shapes.
ROWS_EMBED = ("act_batch", "act_length", "act_embed")  # [B, T, D] hidden states
ROWS_HEADS = ("act_batch", "act_length", "act_heads", None)  # [B, T, H, Dh] queries, outputs
ROWS_KV_HEADS = ("act_batch", "act_length", "act_kv_heads", None)  # [B, S, Hkv, Dh] keys, values
ROWS_MLP = ("act_batch", "act_length", "act_mlp")  # [B, T, F] MLP hidden
ROWS_IDS = ("act_batch", "act_length")  # [B, T] ids, positions, key ranges


# A weight in use meets activations: its axes take the activation layout (hidden whole, heads,
# MLP and vocab as the activations split them). Parameter names not listed stay whole.
_IN_USE = {
    "embed": "act_embed",
    "vit_embed": "act_embed",
    "q_heads": "act_heads",
    "kv_heads": "act_kv_heads",
    "mlp": "act_mlp",
    "vocab": "act_vocab",
}


def in_use_names(param_names: LogicalNames) -> tuple[str | None, ...]:
    """The logical names of a weight as the computation uses it (gathered over FSDP)."""
    return tuple(_IN_USE.get(name) for name in param_names)


def vocab_names(ndim: int) -> tuple[str | None, ...]:
    """[B, ..., V] logits: rows over the batch axes, vocab over 'tensor'."""
    return ("act_batch",) + (None,) * (ndim - 2) + ("act_vocab",)
