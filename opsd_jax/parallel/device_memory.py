"""What a compiled program, or a tree of sharded arrays, takes of one device's memory.

Both are figures of a compile, not of a device: they hold for compile-only GPU devices
(opsd_jax/programs/gpu_target.py) as for real ones, which is what lets train.py --compile_only
and the benches say whether a run fits before it runs.
"""

from __future__ import annotations

import math

import jax


def program_peak(compiled) -> int:
    """A compiled program's own peak per device, as XLA assigned its buffers: its arguments,
    its outputs less those that reuse donated arguments, and its temp buffers."""
    memory = compiled.memory_analysis()
    return (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )


def bytes_per_device(tree) -> int:
    """The bytes one device holds of a tree of sharded arrays (or ShapeDtypeStructs with a
    sharding): each leaf's shard."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )


def allocator_peak() -> tuple[int, int] | None:
    """(the most bytes this process's first device held at once, its limit) as its allocator
    reports them; None where it reports nothing (a CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" not in stats:
        return None
    return stats["peak_bytes_in_use"], stats.get("bytes_limit", 0)


def measure_on_zeros(compiled, beside_bytes: int, mesh) -> dict:
    """Run `compiled` once on zero arguments laid out as it takes them, with `beside_bytes`
    more held on each device of `mesh` (what a run keeps there beside the program), and read
    the first device's allocator. Returns bytes: 'assigned' (program_peak: XLA's assignment on
    these devices), 'beside', and where the allocator reports them (not a CPU's) 'before'
    (in use when the run starts: arguments and what is beside them), 'peak' (the most in use
    at once since the process started: its compile, the zeros being made, the run) and
    'peak_before_run' (the same, read before the run)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    def stats():
        return jax.local_devices()[0].memory_stats() or {}

    def zeros(info, sharding):
        if jax.dtypes.issubdtype(info.dtype, jax.dtypes.prng_key):  # a key of the default impl
            data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))

            def make():
                return jax.random.wrap_key_data(jnp.zeros(info.shape + data.shape, data.dtype))
        else:

            def make():
                return jnp.zeros(info.shape, info.dtype)

        return jax.jit(make, out_shardings=sharding)()

    args, kwargs = jax.tree.map(zeros, compiled.args_info, compiled.input_shardings)
    beside = None
    if beside_bytes:
        flat = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
        beside = jax.jit(
            lambda: jnp.zeros((mesh.size * beside_bytes,), jnp.uint8), out_shardings=flat
        )()
    jax.block_until_ready((args, kwargs, beside))
    found = dict(assigned=program_peak(compiled), beside=beside_bytes)
    ready = stats()
    jax.block_until_ready(compiled(*args, **kwargs))
    done = stats()
    if "peak_bytes_in_use" in done:
        found.update(
            before=ready["bytes_in_use"],
            peak_before_run=ready["peak_bytes_in_use"],
            peak=done["peak_bytes_in_use"],
        )
    return found
