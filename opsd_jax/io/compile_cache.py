"""JAX's persistent compilation cache, on by default: a second start compiles nothing it has met.

At 7B each sampler program compiles in 10-15 s deviceless (longer on a GPU) and the train step in
over a minute, on every start and every resume. JAX can keep compiled executables on disk, keyed
by the program, the compile options, the jax / XLA version and the device kind, so a cached
entry is only ever reused for the very same program on the same kind of device; a cache shared
by runs (and configs) is therefore safe, and the default is one folder per user.

`compilation_cache_dir` (config): "auto" = $JAX_COMPILATION_CACHE_DIR when set, else
DEFAULT_DIR; "" or "off" = no cache; anything else is the folder. In a one-process run every
program is cached, not only those over JAX's default one second of compile time: small ones
(the sampler's per-shape programs on a CPU) add up over a start too (see `enable` for runs of
several processes).

`CacheCounter` counts what the cache did (JAX's monitoring events), for the console line a run
ends with and for the test that a second identical run compiles nothing.
"""

from __future__ import annotations

import os

import jax
from jax import monitoring

DEFAULT_DIR = "~/.cache/opsd-jax/jax-compilation-cache"
OFF = ("", "off")
ENV = "JAX_COMPILATION_CACHE_DIR"

# JAX's monitoring events (jax/_src/compiler.py): a compile that consulted the cache, and one
# the cache answered.
_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"
_HIT = "/jax/compilation_cache/cache_hits"


def resolve(setting: str) -> str | None:
    """The cache folder for the config value, or None when the cache is off."""
    if setting in OFF:
        return None
    if setting == "auto":
        setting = os.environ.get(ENV) or DEFAULT_DIR
    return os.path.abspath(os.path.expanduser(setting))


def enable(directory: str, every_program: bool = True) -> None:
    """Use `directory` as JAX's persistent cache (before the first compile); `every_program`
    also caches programs under JAX's one-second threshold. A run of several processes keeps
    the threshold: with small cross-process programs read from the cache, the processes of a
    two-process CPU run hung in their first all-gather (tests/test_multihost.py)."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:  # train.py prints this as its one-line error
        raise type(e)(
            f"compilation_cache_dir={directory!r} cannot be created ({e.strerror}): "
            "give another folder, or '' to turn the cache off"
        ) from None
    jax.config.update("jax_compilation_cache_dir", directory)
    if every_program:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class CacheCounter:
    """Compiles that went through the cache since construction: `read` answered by it,
    `compiled` not (compiled here, then written)."""

    def __init__(self):
        self.requests = self.read = 0
        monitoring.register_event_listener(self._on_event)

    def _on_event(self, event: str, **kwargs) -> None:
        del kwargs
        if event == _REQUEST:
            self.requests += 1
        elif event == _HIT:
            self.read += 1

    @property
    def compiled(self) -> int:
        return self.requests - self.read

    def describe(self, directory: str) -> str:
        return (
            f"compilation cache {directory}: {self.read} programs read from it, "
            f"{self.compiled} compiled and written"
        )
