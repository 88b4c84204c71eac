"""Several processes, one training run: JAX's distributed runtime and process-local batches.

One process per host (GPU box or TPU VM). `initialize(config)` starts JAX's own distributed
runtime (`jax.distributed.initialize`) before any device is touched; after it every process sees
every device of the run (`jax.devices()`) and owns the ones on its host.

Each process reads, decodes and packs only its own samples (opsd_jax/data/pipeline.py hands
each one its blocks of the global sample stream). Its host arrays become one global jax.Array
with `jax.make_array_from_process_local_data`: process p's rows are the p-th block of rows.
That needs the same local shapes on every process: training micro-batches have shapes fixed by
the config (`put_micro_batches`); for sampler prompts `put_rows` first agrees on the largest row
length / patch count / loss-entry count (one tiny all-gather) and pads to it.

The global layout of a micro-batch is process-major: [process 0's samples, process 1's, ...].
A sample's global index inside its micro-batch is `process_index * local_samples + i`, so the
per-sample loss ids (`loss_sample`) are shifted by that offset, and a single-process run of the
same stream sees the same samples in the same rows.

With one process every function here is a cheap no-op-like path (no collectives).
"""

from __future__ import annotations

import os

import jax
import numpy as np

from models.pack import Pack, pack_sizes, pad_pack
from opsd_jax.parallel import mesh as mesh_lib

# Environment fallbacks for the config keys (JAX itself reads JAX_COORDINATOR_ADDRESS).
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def settings_without_distributed(config) -> list[str]:
    """The multi-host settings given while `distributed` is off, as 'key=value' words.

    Each would be ignored: N hosts launched that way train N separate runs, each believing it is
    the whole job. The run config refuses them (run_config/checks.py) instead of running alone.
    """
    if config.distributed:
        return []
    given = [
        f"{key}={config[key]!r}"
        for key, unset in (("coordinator_address", ""), ("num_processes", -1), ("process_id", -1))
        if config[key] != unset
    ]
    given += [
        f"${name}={os.environ[name]!r}"
        for name in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
        if os.environ.get(name)
    ]
    return given


def initialize(config) -> str | None:
    """`jax.distributed.initialize` when `config.distributed` is set; call before any device use.

    The coordinator address, process count and process id come from the config keys
    `coordinator_address`, `num_processes`, `process_id`, else from the environment variables
    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, else from JAX's cluster
    auto-detection (SLURM, Open MPI, Kubernetes, Cloud TPU).

    Returns a line for the console when the runtime started with one process only (legal, and
    what a one-host test wants, but on a cluster it means the launch did not reach the others).
    """
    if not config.distributed:
        return None
    address = config.coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    num_processes = config.num_processes if config.num_processes > 0 else None
    num_processes = num_processes or _env_int(ENV_NUM_PROCESSES)
    process_id = config.process_id if config.process_id >= 0 else _env_int(ENV_PROCESS_ID)
    jax.distributed.initialize(
        coordinator_address=address, num_processes=num_processes, process_id=process_id
    )
    if jax.process_count() == 1:
        return (
            "distributed=True with 1 process: JAX's distributed runtime started, and this run "
            "trains alone (num_processes=1)"
        )
    return None


def is_main() -> bool:
    """The process that prints, logs and writes shared files."""
    return jax.process_index() == 0


def to_host(x) -> np.ndarray:
    """An array's full value on this host, also when other processes hold parts of it."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def all_processes(values) -> np.ndarray:
    """[process_count, ...]: every process's `values` (same shape everywhere), process order."""
    values = np.asarray(values)
    if jax.process_count() == 1:
        return values[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(values)).reshape(
        (jax.process_count(),) + values.shape
    )


def barrier(name: str) -> None:
    """Wait until every process reaches this point (no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def rows_array(values: np.ndarray, like: jax.Array) -> jax.Array:
    """Host values for *all* rows (the same on every process) as a global array whose rows are
    sharded like `like`'s leading axis."""
    values = np.asarray(values)
    sharding = getattr(like, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return jax.numpy.asarray(values)
    spec = jax.sharding.PartitionSpec(sharding.spec[0] if sharding.spec else None)
    row_sharding = jax.sharding.NamedSharding(sharding.mesh, spec)
    return jax.make_array_from_callback(values.shape, row_sharding, lambda index: values[index])


# ---- process-local Packs -> one global Pack -------------------------------------------------


def rows_divide(num_rows: int, mesh) -> bool:
    """Whether `num_rows` split evenly over the mesh's batch axes (data x fsdp)."""
    return num_rows % int(np.prod([mesh.shape[a] for a in mesh_lib.BATCH_AXES])) == 0


def put_rows(pack: Pack, mesh, *, sample_offset: int = 0, rows_are_global: bool = False) -> Pack:
    """A Pack's rows onto the mesh, split over its batch axes (data x fsdp).

    By default each process passes its own rows (the same count on every process): shapes are
    agreed across processes and padded, and `loss_sample` is shifted by `sample_offset` (this
    process's first sample in the global micro-batch). With `rows_are_global` every process
    passes the same full pack (evaluation reads the whole held-out set on every host), and each
    device's shard is cut from it.

    With one process (or global rows) and a row count the batch axes do not divide, the pack
    stays on the host: a jitted consumer then replicates it, which is correct, just not split.
    With several processes the trainer's validation guarantees rows that divide.
    """
    if mesh is None:
        return pack
    if sample_offset and pack.loss_sample is not None:
        pack = pack.replace(loss_sample=pack.loss_sample + sample_offset)
    if rows_are_global or jax.process_count() == 1:
        if not rows_divide(pack.num_rows, mesh):
            return pack

        def put(x):
            if x is None:
                return None
            x = np.asarray(x)
            sharding = mesh_lib.batch_sharding(mesh, x.ndim)
            return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

        return jax.tree.map(put, pack)

    row_length, patches, loss = all_processes(pack_sizes(pack)).max(axis=0).tolist()
    pack = pad_pack(pack, row_length, patches, loss)

    def put_local(x):
        if x is None:
            return None
        return jax.make_array_from_process_local_data(mesh_lib.batch_sharding(mesh, x.ndim), x)

    return jax.tree.map(put_local, pack)


def local_row_offset(array: jax.Array) -> int:
    """The first global row this process holds of a row-sharded array (its rows are contiguous)."""
    starts = [shard.index[0].start or 0 for shard in array.addressable_shards]
    return min(starts)


# ---- stacked micro-batches: the train step's input -----------------------------------------


def micro_batch_sharding(mesh, ndim: int) -> jax.sharding.NamedSharding:
    """[micro-batch, rows, ...]: rows over data x fsdp, everything else replicated."""
    spec = jax.sharding.PartitionSpec(None, mesh_lib.BATCH_AXES, *([None] * (ndim - 2)))
    return jax.sharding.NamedSharding(mesh, spec)


def put_micro_batches(packs: list[Pack], mesh, *, sample_offset: int = 0) -> Pack:
    """This process's micro-batch Packs (one fixed shape) -> one global Pack on the mesh, every
    array stacked [micro-batch, rows, ...]; `loss_sample` shifted as in `put_rows`. The shapes
    are fixed by the config, so processes need not agree on them first. Any pytree of row-major
    arrays goes the same way (the offline cache's dict of per-entry arrays)."""
    return put_stacked_micro_batches(stack_micro_batches(packs), mesh, sample_offset=sample_offset)


def stack_micro_batches(packs: list):
    """Micro-batch pytrees of one shape -> one pytree, every array stacked [micro-batch, ...]."""
    return jax.tree.map(lambda *xs: np.stack(xs), *packs)


def put_stacked_micro_batches(stacked, mesh, *, sample_offset: int = 0):
    """`put_micro_batches` of micro-batches already stacked [micro-batch, rows, ...] on the
    host (opsd_jax/training/pack_memory.py packs them in place)."""
    if sample_offset and isinstance(stacked, Pack) and stacked.loss_sample is not None:
        stacked = stacked.replace(loss_sample=stacked.loss_sample + sample_offset)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(micro_batch_sharding(mesh, x.ndim), x),
        stacked,
    )


def abstract_micro_batches(local_pack: Pack, num_micro: int, mesh) -> Pack:
    """What `put_micro_batches` returns for `num_micro` Packs shaped like `local_pack` (this
    process's rows), as ShapeDtypeStructs: the argument of the ahead-of-time compile."""

    def abstract(x):
        shape = (num_micro, x.shape[0] * jax.process_count(), *x.shape[1:])
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=micro_batch_sharding(mesh, x.ndim + 1))

    return jax.tree.map(abstract, local_pack)
