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
