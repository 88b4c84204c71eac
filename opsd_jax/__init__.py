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
    """Whether jax's CUDA 12 plugin is installed, found without importing jax. Without any jax
    plugin the `jax_plugins` namespace itself is missing, and find_spec raises instead."""
    try:
        return _importlib_util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        return False


def _no_nvidia_driver() -> bool:
    return not (_os.path.exists("/proc/driver/nvidia/version") or _os.path.exists("/dev/nvidiactl"))


if not _os.environ.get("JAX_PLATFORMS") and _no_nvidia_driver() and cuda_plugin_installed():
    _os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in _sys.modules:  # imported already: its config read the variable; no backend yet
        _sys.modules["jax"].config.update("jax_platforms", "cpu")
