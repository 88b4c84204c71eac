"""Whether the GPU kernels (models/attention_pallas.py, decode_attention_pallas.py) can run here,
asked without importing them.

Why a module of its own: the kernels import Pallas's Triton backend, which jax 0.12 deprecates
("will be removed in a future JAX version"). `attention.resolve_backend('auto')` asks this on
every machine; on a CPU it must not import the kernels, so that CPU runs do not depend on that
backend existing (tests/test_attention.py checks a CPU run never imports them).
"""

from __future__ import annotations

import importlib
import importlib.util

import jax

MIN_COMPUTE_CAPABILITY = (8, 0)  # Ampere: Triton's bf16 tensor-core dots
# The Pallas backend both kernels are written for (deprecated in jax 0.12; docs/gpus.md has the
# migration path).
TRITON_BACKEND = "jax.experimental.pallas.triton"
INSTEAD = (
    "choose attention_backend='cudnn' (cuDNN's fused attention, on the GPU) or 'chunked' (XLA, "
    "any device); docs/gpus.md says where the kernels move next"
)


def triton_backend_missing() -> bool:
    """Whether this jax lacks Pallas's Triton backend (asked without importing it)."""
    try:
        return importlib.util.find_spec(TRITON_BACKEND) is None
    except (ImportError, ValueError):  # jax.experimental.pallas itself is gone
        return True


def import_kernel(name: str):
    """models.<name>, one of the Pallas kernel modules; where this jax has no Pallas Triton
    backend, an ImportError naming the attention backends to choose instead."""
    try:
        return importlib.import_module(f"models.{name}")
    except ImportError as e:
        if not triton_backend_missing():
            raise
        raise ImportError(
            f"attention_backend='pallas' needs Pallas's Triton backend ({TRITON_BACKEND}), which "
            f"jax {jax.__version__} does not have; {INSTEAD}"
        ) from e


def compiling_for_gpu_without_one() -> bool:
    """Whether the trace in progress compiles for GPU devices this process cannot run on: the
    active mesh is over compile-only GPU devices (opsd_jax/programs/gpu_target.py) or an
    abstract GPU mesh (`lower_for_gpu`), while jax itself runs on another backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh is None or mesh.empty else getattr(mesh, "abstract_device", None)
    return device is not None and device.platform == "gpu" and jax.default_backend() != "gpu"


def compiling_for_gpu() -> bool:
    """Whether the trace in progress is for GPU devices: jax runs on one, or the program is
    compiled for a GPU target without one (`compiling_for_gpu_without_one`)."""
    return jax.default_backend() == "gpu" or compiling_for_gpu_without_one()


def unsupported_reason() -> str | None:
    """Why the compiled kernel cannot run on the default JAX device, or None when it can (or
    when the program is compiled for a GPU target without one, where nothing runs: the target
    files we ship are all sm90)."""
    if compiling_for_gpu_without_one():
        return None
    if jax.default_backend() != "gpu":
        return f"the default JAX backend is {jax.default_backend()!r}, not an NVIDIA GPU"
    device = jax.devices()[0]
    capability = str(getattr(device, "compute_capability", ""))
    try:
        major, minor = (int(x) for x in capability.split("."))
    except ValueError:
        return f"{device.device_kind} reports no NVIDIA compute capability ({capability!r})"
    if (major, minor) < MIN_COMPUTE_CAPABILITY:
        return (
            f"{device.device_kind} is sm{major}{minor}; the kernel needs sm80 or newer "
            "(A100, H100, H200, ...)"
        )
    if triton_backend_missing():
        return f"jax {jax.__version__} has no Pallas Triton backend ({TRITON_BACKEND}); {INSTEAD}"
    return None
