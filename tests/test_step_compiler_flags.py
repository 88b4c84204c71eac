"""The train step's XLA:GPU option sets (opsd_jax/training/step_compiler_flags.py).

Compiled for an H100 without one, the tiny grad step under 'maxtext' runs every matmul through
cuBLAS(Lt), where XLA's defaults ('xla') make Triton GEMM fusions of them; every option of the
set is one this jaxlib's XLA knows (an unknown name fails the compile). One LM layer's weight
bytes, the collectives' combine threshold, are counted against the model's own arrays.
"""

import re
from collections import Counter

import pytest
from flax import nnx
from test_gpu_compile import grad_step_program, tiny_grad_step_model

from models.bagel import Bagel
from models.configs import BagelConfig
from opsd_jax.programs import gpu_target
from opsd_jax.training import step_compiler_flags


@pytest.mark.parametrize("model", [BagelConfig.tiny(), BagelConfig.bagel_7b()])
def test_one_layers_weight_bytes_are_the_models_own(model):
    abstract = nnx.eval_shape(lambda: Bagel(model, rngs=nnx.Rngs(0)))
    und = nnx.state(abstract, nnx.Param)["language_model"]["layers"]["und"]
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    stacked = sum(und[name]["kernel"].size for name in names)  # [layers, in, out] each
    per_layer = 4 * stacked // model.llm.num_hidden_layers
    assert step_compiler_flags.layer_weight_bytes(model.llm) == per_layer


def test_an_unknown_set_is_named():
    with pytest.raises(ValueError, match="step_compiler_flags='fast'; allowed"):
        step_compiler_flags.step_compiler_options("fast", BagelConfig.tiny())
    assert step_compiler_flags.step_compiler_options("xla", BagelConfig.tiny()) == {}


def matmul_kernels(flags: str) -> Counter:
    """{fusion kind or library call: count} of the matmuls in the tiny grad step compiled for an
    H100 under the option set `flags`, with MaxText's remat ('minimal_flash'; the ViT on
    'full'): under 'xla', the very program tests/test_remat.py compiles, read from this
    worker's compiled programs when that test ran first."""
    config = tiny_grad_step_model("minimal_flash", "full")
    options = step_compiler_flags.step_compiler_options(flags, config)
    text = grad_step_program(config, gpu_target.make_mesh("h100", 1), **options)
    found = Counter(re.findall(r'"kind":"(__triton_nested_gemm_fusion)"', text))
    found.update(re.findall(r'custom_call_target="(__cublas[^"]*)"', text))
    return found


@pytest.mark.slow
def test_maxtext_runs_every_matmul_through_cublas_where_xla_makes_triton_gemms():
    ours, xla = matmul_kernels("maxtext"), matmul_kernels("xla")
    gemms = xla["__triton_nested_gemm_fusion"]
    assert gemms > 0, xla  # XLA's default, so the check can fail
    assert ours["__triton_nested_gemm_fusion"] == 0, ours
    # cuBLAS calls instead, at least as many as XLA's fusions and its own cuBLAS calls together
    # (the double-buffered layer loop holds its body twice: 95 calls for XLA's 53 fusions and 2
    # cuBLAS calls when this was written).
    lt = "__cublas$lt$matmul"
    assert set(xla) <= {"__triton_nested_gemm_fusion", lt}, xla
    assert ours[lt] >= gemms + xla[lt], (ours, xla)
