"""`sampler_layout='auto'`: the decode layout with the least projected rollout time that fits.

A decode step feeds one token per row, so its time is memory traffic: every device reads its
share of the decode copy's weights and its rows' KV cache once per step. Per device and step:

  replicated   the whole copy + cache / N                       (no collective)
  tensor (t)   copy / t + cache / N, + (2 x layers + 1) all-reduces of the layer outputs

(in the tensor layout t devices hold t times the rows, each a 1/t slice of the kv heads, so the
cache share is the same). t is the largest tensor axis inside one host that splits the query
and kv heads of the LLM and the ViT into whole heads (`mesh.tensor_size_for`): BAGEL-7B's 28 query /
4 kv heads on 8 GPUs give t = 4 with rows over the other 2, where an axis of 8 would leave the
attention weights and the whole cache replicated on every device.

Figures (PLATFORMS): the memory bandwidth a step reads at and the latency of one small
all-reduce. A GPU's bandwidth is its datasheet's (by device kind, else the H100's); a CPU's
devices share one memory and its collectives are thread hand-offs, so its latency is long and
the tensor layout pays only for models far larger than a CPU run holds. A layout fits when the
copy and its cache share fit in the device's free memory (known on GPUs and TPUs; assumed on a
CPU). Ties go to 'replicated' (nothing moves per token).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from opsd_jax.parallel.mesh import tensor_size_for

# platform: (memory bytes/s per device, seconds per small all-reduce inside a host)
PLATFORMS = {
    "gpu": (3.35e12, 10e-6),  # H100 SXM HBM3; NVLink all-reduce of a few KB ~10 us
    "tpu": (1.6e12, 10e-6),
    "cpu": (20e9, 100e-6),
}
# GPU device kinds with another bandwidth than PLATFORMS["gpu"] (NVIDIA datasheets).
DEVICE_BANDWIDTH = {
    "NVIDIA H200": 4.8e12,
    "NVIDIA A100-SXM4-80GB": 2.0e12,
    "NVIDIA A100-SXM4-40GB": 1.56e12,
}
MEMORY_HEADROOM = 0.15  # of a device's free memory kept free (allocator, collectives' buffers)


def head_counts(model_config) -> tuple[int, ...]:
    """Every attention head count the decode copy splits: LLM query and kv heads, ViT heads."""
    llm, vit = model_config.llm, model_config.vit
    return (llm.num_attention_heads, llm.num_key_value_heads, vit.num_attention_heads)


def cache_nbytes(model_config, rows: int, slots: int, dtype) -> int:
    """The sampler's K and V cache (sampler.prefill_rows: [layers, rows, slots, 2, kv heads,
    head dim]) of `rows` rows at `slots` capacity."""
    llm = model_config.llm
    return (
        2
        * llm.num_hidden_layers
        * rows
        * slots
        * llm.num_key_value_heads
        * llm.head_dim
        * np.dtype(dtype).itemsize
    )


@dataclasses.dataclass(frozen=True)
class Projection:
    layout: str
    tensor_size: int
    step_seconds: float  # one decode step (one token per row)
    device_bytes: int  # the copy's and the cache's share per device
    fits: bool


@dataclasses.dataclass(frozen=True)
class Choice:
    layout: str  # 'replicated' or 'tensor'
    tensor_size: int
    projections: tuple[Projection, ...]

    def describe(self, new_tokens: int) -> str:
        """One line: the choice and the projections it was made from."""
        parts = []
        for p in self.projections:
            name = p.layout if p.layout == "replicated" else f"tensor {p.tensor_size}"
            fit = "" if p.fits else ", does not fit"
            parts.append(
                f"{name} {p.step_seconds * new_tokens:.3g} s per {new_tokens}-token "
                f"rollout ({p.device_bytes / 2**30:.3g} GiB per device{fit})"
            )
        chosen = self.layout if self.layout == "replicated" else f"tensor {self.tensor_size}"
        return f"sampler_layout 'auto' -> '{chosen}': projected " + "; ".join(parts)


def choose(
    *,
    copy_bytes: int,
    cache_bytes: int,
    heads: Sequence[int],
    num_layers: int,
    num_devices: int,
    devices_per_host: int,
    platform: str,
    device_kind: str = "",
    free_memory: int | None = None,
) -> Choice:
    """The layout for a copy of `copy_bytes` (whole) and a KV cache of `cache_bytes` (all
    rows at capacity) on `num_devices` devices of `platform`."""
    bandwidth, latency = PLATFORMS.get(platform, PLATFORMS["gpu"])
    if platform == "gpu":
        bandwidth = next(
            (bw for kind, bw in DEVICE_BANDWIDTH.items() if device_kind.startswith(kind)), bandwidth
        )
    budget = None if free_memory is None else free_memory * (1 - MEMORY_HEADROOM)
    t = tensor_size_for(heads, min(devices_per_host, num_devices))
    projections = []
    for layout, size in (("replicated", 1), ("tensor", t)):
        if layout == "tensor" and size == 1:
            continue  # nothing to split: the same as replicated
        device_bytes = copy_bytes // size + cache_bytes // num_devices
        # What must fit is more than a step reads: the engine's insert holds the prefilled
        # rows' cache beside the pool's (opsd_jax/run_config/preflight_sampling.py).
        held = device_bytes + cache_bytes // num_devices
        collectives = 0 if size == 1 else 2 * num_layers + 1
        projections.append(
            Projection(
                layout,
                size,
                device_bytes / bandwidth + collectives * latency,
                device_bytes,
                fits=budget is None or held <= budget,
            )
        )
    fitting = [p for p in projections if p.fits] or projections  # none fits: the least bad
    best = min(fitting, key=lambda p: (p.step_seconds, p.layout != "replicated"))
    return Choice(best.layout, best.tensor_size, tuple(projections))
