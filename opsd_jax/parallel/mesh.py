"""The device mesh, the logical-axis rules, and sharded model creation.

One mesh with axes ('data', 'fsdp', 'tensor'), all Auto: jax 0.12's `make_mesh` defaults to
Explicit axes, and under them the embedding lookup (table and token ids both sharded over
'fsdp') raises DuplicateSpecError, so the axis types are given explicitly:

* data   — replicas (HYBRID_SHARD's replicate dimension, config `num_replicate`);
* fsdp   — parameter sharding (`num_shard`);
* tensor — optional tensor parallelism (default 1).

Model parameters and activations carry logical axis names (models/ sets them); the rules
below, kept as data, map those names to mesh axes. Changing a parallelism layout means changing
the rules, not the model. `use_mesh(mesh)` sets the mesh and activates the rules: everything
jitted and traced inside it gets the activation layout (models/sharding.py reads both).

Sampling has its own layout (DECODE_RULES on a `decode_mesh` view of the same devices): a decode
step is one token per row, so gathering FSDP-sharded weights for it would move the whole model
per token; the sampler decodes on a compute-dtype copy whose weights are whole (or split over
the tensor axis inside one host) instead (opsd_jax/sampling/decode_copy.py).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# logical name -> mesh axis (or None = replicated). Pure FSDP over 'fsdp', as maxtext's
# pure-fsdp rules, plus Megatron-style tensor splits of heads / MLP / vocab over 'tensor'.
# Parameters: the hidden dimension ('embed') is split over 'fsdp' (each device stores 1/N and
# gathers a layer's weights, in the compute dtype, just before using them). Activations
# ('act_*'): rows over ('data', 'fsdp'), the hidden dimension whole, so under pure FSDP no
# activation ever crosses the interconnect; 'tensor' splits heads, MLP and vocab of both.
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ("act_batch", BATCH_AXES),
    ("act_length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # parameters
    ("batch", BATCH_AXES),
    ("layers", None),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    ("vit_embed", "fsdp"),
    ("vit_positions", None),
    ("patch", None),
)

# The sampler's layout: the training rules without the FSDP split of the hidden dimension, so
# a decode step reads whole weights on every device ('replicated') or its tensor slice of them
# (heads / MLP / vocab over 'tensor', 'tensor' layout); rows stay over ('data', 'fsdp').
_DECODE_CHANGES = {"embed": None, "vit_embed": None}
DECODE_RULES = tuple((name, _DECODE_CHANGES.get(name, axes)) for name, axes in LOGICAL_RULES)

# sampler_layout -> the size of the decode mesh's 'tensor' axis ("host": the devices of one
# process, so tensor-parallel collectives never leave a host, cut down to what splits every
# attention head count when those are given; rows go over the rest). 'auto' is resolved to one
# of the two by opsd_jax/sampling/layout_choice.py before a mesh is made.
SAMPLER_LAYOUTS = {"replicated": 1, "tensor": "host", "auto": None}


def make_mesh(
    num_replicate: int = 1,
    num_shard: int | None = None,
    num_tensor: int = 1,
    devices: list | None = None,
) -> jax.sharding.Mesh:
    """A ('data', 'fsdp', 'tensor') mesh; `num_shard=None` takes the devices left over."""
    devices = list(jax.devices() if devices is None else devices)
    for name, value in (("num_replicate", num_replicate), ("num_tensor", num_tensor)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if num_shard is None:
        if len(devices) % (num_replicate * num_tensor):
            raise ValueError(
                f"num_replicate={num_replicate} x num_tensor={num_tensor} does not divide the "
                f"{len(devices)} available devices"
            )
        num_shard = len(devices) // (num_replicate * num_tensor)
    shape = (num_replicate, num_shard, num_tensor)
    if int(np.prod(shape)) != len(devices):
        raise ValueError(
            f"mesh num_replicate x num_shard x num_tensor = {' x '.join(map(str, shape))} = "
            f"{int(np.prod(shape))} does not match the {len(devices)} available devices"
        )
    return jax.make_mesh(
        shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def tensor_size_for(heads, devices_per_host: int) -> int:
    """The largest t dividing `devices_per_host` and every head count in `heads` (a tensor axis
    that splits attention into whole heads everywhere; with no heads, all the devices)."""
    return max(
        t
        for t in range(1, devices_per_host + 1)
        if devices_per_host % t == 0 and all(h % t == 0 for h in heads)
    )


def decode_mesh(
    mesh: jax.sharding.Mesh,
    layout: str,
    tensor_size: int | None = None,
    heads: tuple[int, ...] = (),
):
    """The sampler's view of `mesh`'s devices: ('data', 'fsdp', 'tensor') = (N / t, 1, t).

    t is 1 for 'replicated'; for 'tensor' the devices of one process, or with `heads` (every
    attention head count of the model) the largest part of them that splits each into whole
    heads (`tensor_size` overrides it). The devices keep the training mesh's order (jit takes arrays
    of both meshes in one call only when the device order agrees), so rows sharded over the
    training mesh's data x fsdp sit on the same devices as over this mesh's data axis when
    t = 1; each group of t consecutive devices must lie in one process.
    """
    if layout not in SAMPLER_LAYOUTS:
        raise ValueError(
            f"sampler_layout={layout!r}: allowed values are {', '.join(map(repr, SAMPLER_LAYOUTS))}"
        )
    if layout == "auto":
        raise ValueError(
            "sampler_layout='auto' is resolved first (opsd_jax/sampling/"
            "layout_choice.py); decode_mesh takes 'replicated' or 'tensor'"
        )
    devices = np.asarray(mesh.devices).reshape(-1)
    if tensor_size is None:
        tensor_size = SAMPLER_LAYOUTS[layout]
        if tensor_size == "host":
            tensor_size = tensor_size_for(heads, min(jax.local_device_count(), devices.size))
    if tensor_size < 1 or devices.size % tensor_size:
        raise ValueError(
            f"sampler_layout={layout!r}: a tensor axis of {tensor_size} devices "
            f"does not divide the {devices.size} devices"
        )
    groups = devices.reshape(-1, 1, tensor_size)
    for group in groups.reshape(-1, tensor_size):
        if len({d.process_index for d in group}) > 1:
            raise ValueError(
                f"sampler_layout={layout!r}: the training mesh's device order puts "
                f"devices of several processes in one tensor group {list(group)}; "
                "use 'replicated' or a process-major mesh"
            )
    return jax.sharding.Mesh(groups, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


@contextlib.contextmanager
def use_mesh(mesh: jax.sharding.Mesh, rules=LOGICAL_RULES):
    """Set `mesh` and activate the logical-axis rules (parameters and activations).

    Jitted functions must be traced inside it to get the activation layout; outside it the
    model's constraints and per-device attention are no-ops (plain sharding propagation). jax
    caches a trace per function and mesh, not per rules: trace a function under one of the two.
    """
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        yield mesh


def batch_sharding(mesh: jax.sharding.Mesh, ndim: int = 2) -> NamedSharding:
    """Leading (row) axis over data x fsdp, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def abstract_model(make_model: Callable[[], nnx.Module], mesh, rules=LOGICAL_RULES):
    """(graphdef, state of ShapeDtypeStructs carrying their target NamedShardings); no memory."""
    with nnx.logical_axis_rules(rules):
        return nnx.get_abstract_model(make_model, mesh)


def create_sharded_model(make_model: Callable[[], nnx.Module], mesh, rules=LOGICAL_RULES):
    """Build a model with every parameter created directly in its sharding (jitted init).

    No device ever holds the full unsharded model: the init function is compiled with the
    target shardings as out_shardings, so each device computes only its shard.
    """
    graphdef, abstract_state = abstract_model(make_model, mesh, rules)
    shardings = jax.tree.map(lambda x: x.sharding, abstract_state)

    @jax.jit(out_shardings=shardings)
    def init():
        return nnx.state(make_model())

    with use_mesh(mesh, rules):
        state = init()
    return nnx.merge(graphdef, state)
