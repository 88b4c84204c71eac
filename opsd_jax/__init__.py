"""opsd-jax: on-policy self-distillation (Visual-OPSD) for BAGEL-family models, in JAX/Flax.

On import: where jax's CUDA plugin is installed (requirements-gpu.txt, requirements-test.txt)
but the machine has no NVIDIA driver, jax's first backend start prints a `cuInit(0) failed`
traceback and then falls back to the CPU. Choosing the CPU up front gives the same result
without it. Nothing changes where JAX_PLATFORMS is set or a driver is present.
"""

import importlib.util as _importlib_util
import os as _os
import sys as _sys


def cuda_plugin_installed() -> bool:
    """Whether jax's CUDA plugin (12, as requirements-gpu.txt pins, or 13) is installed, found
    without importing jax. Without any jax plugin the `jax_plugins` namespace itself is missing,
    and find_spec raises instead."""
    for name in ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"):
        try:
            if _importlib_util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:
            return False
    return False


def _no_nvidia_driver() -> bool:
    return not (_os.path.exists("/proc/driver/nvidia/version") or _os.path.exists("/dev/nvidiactl"))


if not _os.environ.get("JAX_PLATFORMS") and _no_nvidia_driver() and cuda_plugin_installed():
    _os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in _sys.modules:  # imported already: its config read the variable; no backend yet
        _sys.modules["jax"].config.update("jax_platforms", "cpu")

# jax's GPU client takes 75% of the GPU's memory unless told otherwise (an H200 measured
# 2026-12-04: "104.85 GiB" of 139.8), while the preflight (opsd_jax/run_config/preflight.py)
# passes a run whose programs leave 15% free: on one 80 GB H100 that is 67 GiB against jax's
# 59. The allocator gets 90% here unless the variable is set; jax reads it when its GPU backend
# starts, after this import.
ALLOCATOR_FRACTION_VARIABLE = "XLA_PYTHON_CLIENT_MEM_FRACTION"
_os.environ.setdefault(ALLOCATOR_FRACTION_VARIABLE, "0.90")
