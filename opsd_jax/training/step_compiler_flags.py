"""The XLA:GPU options the train step is compiled with, in one place (`step_compiler_flags`).

Named sets, so a run, the preflight and bench/gpu_check.py mean the same thing by a name:

- 'xla': XLA's defaults. The setting until a GPU measures another set faster (#54: each flag
  is kept only where the measurement shows it), so nothing changes by default.
- 'maxtext': what MaxText's GPU recipes set for Llama2-7B at 49.7% MFU on H100s: every matmul
  through cuBLAS(Lt) instead of XLA's Triton GEMM fusions (compiled for an H100 without one,
  the tiny grad step's 53 Triton GEMM fusions and 2 cuBLAS-Lt calls become 95 cuBLAS-Lt calls
  in the double-buffered layer loop: tests/test_step_compiler_flags.py), the latency-hiding
  scheduler (collectives overlap the layer's compute), collectives combined up to one LM
  layer's fp32 weights (the FSDP gathers and gradient reduce-scatters of a layer go as one
  transfer, not one per matrix), the async collectives on the highest-priority stream, and the
  layer loop double-buffered (the next layer's gathers start during this one).

XLA:CPU ignores XLA:GPU's options, so a CPU run's step is the same program under either set.
The sampler has its own options (sampling/sampler.py, SAMPLER_COMPILER_OPTIONS).
"""

from __future__ import annotations

STEP_FLAG_SETS = ("xla", "maxtext")


def layer_weight_bytes(llm) -> int:
    """One LM layer's matmul weights in fp32 (the understanding expert: q, k, v, o, the MLP's
    three), for a Qwen2Config `llm`."""
    attention = llm.num_attention_heads * llm.head_dim
    key_value = 2 * llm.num_key_value_heads * llm.head_dim
    weights = llm.hidden_size * (2 * attention + key_value) + 3 * llm.hidden_size * (
        llm.intermediate_size
    )
    return 4 * weights


def step_compiler_options(name: str, model_config) -> dict:
    """The options of set `name` for a model of `model_config` (a BagelConfig): what
    `lowered.compile(compiler_options=...)` takes."""
    if name not in STEP_FLAG_SETS:
        raise ValueError(f"step_compiler_flags={name!r}; allowed: {STEP_FLAG_SETS}")
    if name == "xla":
        return {}
    layer = layer_weight_bytes(model_config.llm)
    return {
        "xla_gpu_enable_triton_gemm": False,
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_all_gather_combine_threshold_bytes": layer,
        "xla_gpu_reduce_scatter_combine_threshold_bytes": layer,
        "xla_gpu_all_reduce_combine_threshold_bytes": layer,
        "xla_gpu_enable_highest_priority_async_stream": True,
        "xla_gpu_enable_while_loop_double_buffering": True,
    }
