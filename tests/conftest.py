"""Test setup: 8 simulated CPU devices, so mesh and sharding code runs without accelerators.

XLA reads the flag when jax first initialises its backends, so it must be set before jax is
imported anywhere; conftest.py is loaded by pytest before any test module.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Make the repository root importable (models/, opsd_jax/) without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
