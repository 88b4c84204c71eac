"""The remat policies as the GPU runs them: how often the grad step runs the attention kernel.

Compiled for an H100 without one (the tiny model, the Pallas range kernel, the OPSD grad step):
under 'full' remat the backward reruns each layer's forward, the attention kernel included;
under 'minimal_flash' (MaxText's policy: the matmul outputs without batch dims and the flash
attention's output kept) it does not, so the forward kernel runs once per layer stack and
pass. `vit_remat` sets the ViT's policy apart from the LLM's. Counted from the compiled
program's Triton calls by kernel name, so a policy that stops keeping the kernel's outputs (a
renamed kernel, a policy that no longer matches) fails here.
"""

import pytest
from test_gpu_compile import grad_step_program

from models import layers
from models.configs import BagelConfig
from opsd_jax.programs import gpu_target

pytestmark = pytest.mark.slow  # two deviceless compiles of a grad step


def kernel_calls(remat: str, vit_remat: str) -> dict[str, int]:
    """{kernel name: Triton calls} in the tiny grad step compiled for an H100."""
    mesh = gpu_target.make_mesh("h100", 1)
    config = BagelConfig.tiny(
        llm=dict(
            compute_dtype="bfloat16",
            remat=remat,
            vit_remat=vit_remat,
            attention_backend="pallas",
            unroll_layers=False,
        )
    )
    text = grad_step_program(config, mesh)
    names = (layers.ATTENTION_FORWARD_KERNEL, "range_attention_dq", "range_attention_dkdv")
    return {name: text.count(f'name = "{name}"') for name in names}


def test_minimal_flash_keeps_the_attention_kernels_output_for_the_backward():
    forward, dq, dkdv = (
        layers.ATTENTION_FORWARD_KERNEL,
        "range_attention_dq",
        "range_attention_dkdv",
    )
    # The student's LLM and ViT stacks, the teacher's LLM and ViT stacks: one forward each, and
    # one dQ and one dK/dV for each of the student's two (the layers are a loop: one call each).
    lightest = kernel_calls("minimal_flash", "same")
    assert lightest == {forward: 4, dq: 2, dkdv: 2}, lightest
    # The ViT back on 'full': its backward reruns its forward kernel, the LLM's still does not.
    vit_full = kernel_calls("minimal_flash", "full")
    assert vit_full == {forward: 5, dq: 2, dkdv: 2}, vit_full
