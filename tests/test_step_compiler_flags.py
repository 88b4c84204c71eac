"""The train step's XLA:GPU option sets (opsd_jax/training/step_compiler_flags.py).

Compiled for an H100 without one, the tiny grad step under 'maxtext' runs every matmul through
cuBLAS(Lt), where XLA's defaults ('xla') make Triton GEMM fusions of them; every option of the
set is one this jaxlib's XLA knows (an unknown name fails the compile). One LM layer's weight
bytes, the collectives' combine threshold, are counted against the model's own arrays.
"""

import re
from collections import Counter

import jax
import pytest
from flax import nnx
from test_gpu_compile import SPECIAL, abstract_split, host_rest

from configs import smoke
from models.bagel import Bagel
from models.configs import BagelConfig
from opsd_jax import run_config
from opsd_jax.data import pack_shapes
from opsd_jax.data.opsd_packs import shaped_pack
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.programs import gpu_target
from opsd_jax.training import step_compiler_flags, train_step


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
    """{fusion kind or library call: count} of the matmuls in the tiny grad step compiled for two
    H100s (FSDP) under the option set `flags`."""
    mesh = gpu_target.make_mesh("h100", 2)
    config = BagelConfig.tiny(
        llm=dict(compute_dtype="bfloat16", attention_backend="pallas", unroll_layers=False)
    )
    graphdef, params, _ = abstract_split(config, mesh)
    run = smoke.get_config()
    step = train_step.make_grad_step(
        graphdef, host_rest(config), run_config.loss_settings(run), "ema"
    )
    shapes = pack_shapes.pack_shapes(run)

    def abstract(name):
        pack = shaped_pack([], shapes[name][0], 2, SPECIAL, [], fixed=True)
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=mesh_lib.batch_sharding(mesh, x.ndim)
            ),
            pack,
        )

    with mesh_lib.use_mesh(mesh):
        lowered = step.lower(params, params, abstract("student"), abstract("teacher"))
    options = step_compiler_flags.step_compiler_options(flags, config)
    text = gpu_target.compile(lowered, mesh, **options).as_text()
    found = Counter(re.findall(r'"kind":"(__triton_nested_gemm_fusion)"', text))
    found.update(re.findall(r'custom_call_target="(__cublas[^"]*)"', text))
    return found


@pytest.mark.slow
def test_maxtext_runs_every_matmul_through_cublas_where_xla_makes_triton_gemms():
    ours, xla = matmul_kernels("maxtext"), matmul_kernels("xla")
    gemms = xla["__triton_nested_gemm_fusion"]
    assert gemms > 0, xla  # XLA's default, so the check can fail
    assert not any(kind.startswith("__cublas") for kind in xla), xla
    assert ours["__triton_nested_gemm_fusion"] == 0, ours
    # cuBLAS calls instead, at least as many (the double-buffered layer loop holds its body
    # twice: 101 calls for XLA's 58 fusions when this was written).
    assert ours["__cublas$lt$matmul"] >= gemms, (ours, xla)
