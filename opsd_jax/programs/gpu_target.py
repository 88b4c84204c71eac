"""Compile for an NVIDIA GPU on a machine that has none: compile-only CUDA devices.

Why: a program compiled by XLA:CPU does not show what XLA:GPU will run. The GPU compiler fuses
differently, inserts other copies, assigns other buffers and forms its own collectives, so a
figure about a GPU (memory per device, HBM bytes per decode step) must come from a program
compiled for that GPU. jax can do that without one: `get_topology_desc(platform="cuda",
target_config=...)` gives compile-only devices described by a GpuTargetConfig text proto (the
SM count, shared memory, HBM size and bandwidth, compute capability, toolkit versions); a mesh
over them lowers and compiles like a real one, Pallas (Triton) kernels included, and nothing
can run on it. Buffer assignment, fusions, collectives, copies and the thunk sequence are
real; kernel speeds are not (nothing is autotuned without a device).

The target files are data (gpu_targets/*.txtpb, each naming its source). The CUDA plugin
(requirements-gpu.txt, also in requirements-test.txt) must be installed; with
`JAX_PLATFORMS=cpu` jax never calls `cuInit`, so this works on a machine without a driver and
no log shows the plugin's failed GPU start.

    mesh = gpu_target.make_mesh("h100", devices=8)          # ('data', 'fsdp', 'tensor')
    with mesh_lib.use_mesh(mesh):
        compiled = gpu_target.compile(jax.jit(f).lower(*abstract_args))

Do not use `jit(f).trace(...).lower(lowering_platforms=("cuda",)).compile()`: it compiles for
the CPU, silently.
"""

from __future__ import annotations

import functools
import os
import re

import jax
import numpy as np
from jax.experimental import topologies

import opsd_jax

TARGETS = ("h100", "h200", "h800")
TARGET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets")

# XLA options a compile without a device needs. The sort behind lax.top_k (the JSD's teacher
# top-k) is rewritten into a CUB custom call whose scratch size XLA asks the CUDA runtime for,
# which fails without a device (cudaErrorInvalidDevice); disabled, XLA keeps its own sort.
DEVICELESS_OPTIONS = {"xla_gpu_deviceless_cub_mode": "DEVICELESS_CUB_DISABLED"}


def plugin_available() -> bool:
    """Whether jax's CUDA plugin is installed (it is what compiles for the GPU)."""
    return opsd_jax.cuda_plugin_installed()


def target_config(target: str) -> str:
    """The GpuTargetConfig text of `target` (one of TARGETS)."""
    if target not in TARGETS:
        raise ValueError(f"GPU target {target!r}: known targets are {', '.join(TARGETS)}")
    with open(os.path.join(TARGET_DIR, f"{target}.txtpb")) as f:
        return f.read()


def memory_bytes(target: str) -> int:
    """The memory of one `target` GPU in bytes (its target config's device_memory_size)."""
    return int(re.search(r"device_memory_size:\s*(\d+)", target_config(target)).group(1))


def sm_count(target: str) -> int:
    """The streaming multiprocessors of `target` (its target config's core_count)."""
    return int(re.search(r"core_count:\s*(\d+)", target_config(target)).group(1))


@functools.lru_cache(maxsize=None)
def devices(target: str, count: int) -> tuple:
    """`count` compile-only devices of `target`, as one host holds them."""
    if not plugin_available():
        raise RuntimeError(
            "compiling for a GPU needs jax's CUDA plugin: pip install -r requirements-gpu.txt "
            "(no GPU or driver is needed; run with JAX_PLATFORMS=cpu on a machine without one)"
        )
    if count < 1:
        raise ValueError(f"a GPU target needs at least one device, got {count}")
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=target_config(target), topology=f"1x1x{count}"
    )
    return tuple(topology.devices)


def make_mesh(
    target: str,
    devices_count: int,
    num_replicate: int = 1,
    num_tensor: int = 1,
    num_shard: int | None = None,
) -> jax.sharding.Mesh:
    """The training mesh ('data', 'fsdp', 'tensor') over compile-only devices of `target`."""
    from opsd_jax.parallel import mesh as mesh_lib

    return mesh_lib.make_mesh(
        num_replicate, num_shard, num_tensor, devices=list(devices(target, devices_count))
    )


def is_gpu_mesh(mesh) -> bool:
    """Whether `mesh` is over GPU devices (compile-only or real)."""
    return np.asarray(mesh.devices).reshape(-1)[0].platform == "gpu"


def compiler_options(mesh) -> dict:
    """The XLA options a compile for `mesh` needs: DEVICELESS_OPTIONS on compile-only GPU
    devices (no GPU present), none otherwise."""
    return dict(DEVICELESS_OPTIONS) if is_gpu_mesh(mesh) and jax.default_backend() != "gpu" else {}


def compile(lowered, mesh, **options):  # noqa: A001 (the verb is jax's too)
    """`lowered.compile()` with the options a compile for `mesh` needs (see compiler_options)."""
    return lowered.compile(compiler_options={**compiler_options(mesh), **options})


def host_rest(make_model):
    """The model's non-parameter state (BAGEL's fixed 2-D sin-cos table) as values on the host
    CPU. A train step closes over it (train.py's does); a program compiled for compile-only
    devices cannot make it on them, since nothing runs there."""
    from flax import nnx

    with jax.default_device(jax.devices("cpu")[0]):
        return jax.jit(lambda: nnx.split_state(nnx.state(make_model()), nnx.Param, ...)[1])()
