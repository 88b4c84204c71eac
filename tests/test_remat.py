"""The remat policies as the GPU runs them: how often the grad step runs the attention kernel.

Compiled for an H100 without one (the tiny model, the Pallas range kernel, the OPSD grad step):
under 'full' remat the backward reruns each layer's forward, the attention kernel included;
under 'minimal_flash' (MaxText's policy: the matmul outputs without batch dims and the flash
attention's output kept) it does not, so the forward kernel runs once per layer stack and
pass. `vit_remat` sets the ViT's policy apart from the LLM's. One compile holds both policies,
the LLM on 'minimal_flash' and the ViT on 'full'; each kernel call is told to its stack by its
query heads. Counted from the compiled program's Triton calls by kernel name, so a policy that
stops keeping the kernel's outputs (a renamed kernel, a policy that no longer matches), or the
two policies given to the wrong stacks, fails here.
"""

import re
from collections import Counter

import pytest
from flax import nnx
from test_gpu_compile import grad_step_program, tiny_grad_step_model

from models import layers
from models.bagel import Bagel
from models.configs import BagelConfig
from opsd_jax.programs import gpu_target

FORWARD, DQ, DKDV = layers.ATTENTION_FORWARD_KERNEL, "range_attention_dq", "range_attention_dkdv"


def kernel_calls(config: BagelConfig) -> Counter:
    """{(kernel name, 'llm' | 'vit'): Triton calls} in the tiny grad step compiled for an H100.

    A forward or dQ call's stack is told by the heads of its first output, [batch, tokens,
    query heads, head dim]; a dK/dV call's output has the KV heads, which the stacks may share,
    so those are counted together ('both')."""
    stacks = {config.llm.num_attention_heads: "llm", config.vit.num_attention_heads: "vit"}
    assert len(stacks) == 2, stacks  # the tiny stacks differ in query heads
    text = grad_step_program(config, gpu_target.make_mesh("h100", 1))
    calls = Counter()
    for line in text.splitlines():
        kernel = re.search(r'name = "(range_attention_\w+)"', line)
        if not kernel:
            continue
        if kernel.group(1) == DKDV:
            calls[DKDV, "both"] += 1
            continue
        output = re.match(r"\s*%\S+ = \(?\w+\[\d+,\d+,(\d+),\d+\]", line)
        assert output, line[:300]
        calls[kernel.group(1), stacks[int(output.group(1))]] += 1
    return calls


@pytest.mark.parametrize("vit_remat, expected", [("same", "minimal_flash"), ("full", "full")])
def test_the_vits_remat_is_the_llms_unless_set_apart(vit_remat, expected):
    model = nnx.eval_shape(
        lambda: Bagel(tiny_grad_step_model("minimal_flash", vit_remat), rngs=nnx.Rngs(0))
    )
    assert model.vit_model.remat == expected


@pytest.mark.slow  # a deviceless compile of a grad step
def test_minimal_flash_keeps_the_attention_kernels_output_and_full_reruns_it():
    calls = kernel_calls(tiny_grad_step_model("minimal_flash", "full"))
    # Forward: each stack once in the student and once in the teacher; the student's ViT again
    # in its backward ('full'), the LLM not ('minimal_flash' kept the output). Under the
    # policies swapped the LLM's would be 3 and the ViT's 2; under 'minimal_flash' alone, 2 and
    # 2. One dQ and one dK/dV per student stack (the layers are a loop: one call each).
    assert calls == {
        (FORWARD, "llm"): 2,
        (FORWARD, "vit"): 3,
        (DQ, "llm"): 1,
        (DQ, "vit"): 1,
        (DKDV, "both"): 2,
    }, calls
