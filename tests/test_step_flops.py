"""The analytic FLOPs of a grad step (opsd_jax/training/step_flops.py) against the compiled one.

With remat off and the dense `reference` attention (every [query, key] pair of a row computed),
the matmul FLOPs XLA reads from the compiled grad step are what the analytic count says when it
counts pairs `dense`: a wrong factor for a part (the backward, the lm_head's loss rows, the ViT,
the connector, a frozen group) shows as a difference.
"""

import builders
import jax
import numpy as np
import pytest
from flax import nnx
from test_train_step import COMPLETIONS, SAMPLES, packs_for

from models.bagel import Bagel
from models.configs import REMAT_CHOICES, BagelConfig
from models.pack import Pack
from opsd_jax import run_config
from opsd_jax.programs import hlo_stats
from opsd_jax.run_config import trained_split
from opsd_jax.training import step_flops, train_step


def compiled_matmul_flops(config, trained_groups=(), lora=None):
    """The grad step's dot FLOPs, read from its program right after partitioning."""
    model = Bagel(config, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    student, teacher = two_packs()
    settings = builders.loss_settings(num_samples=2)
    step = train_step.make_grad_step(graphdef, rest, settings, "ema")
    _, partitioned = hlo_stats.compile_and_read(step.lower(params, params, student, teacher))
    flops, floor = hlo_stats.dot_flops(partitioned)
    assert floor == 0  # every loop's trip count known
    return flops, student, teacher


def two_packs():
    """(student, teacher) of two samples with images, the second with a VT image."""
    packs = packs_for(SAMPLES[:2], COMPLETIONS[:2], num_rows=2)
    return packs.student, packs.teacher


TINY = BagelConfig.tiny(
    llm=dict(compute_dtype="float32", remat="none", attention_backend="reference")
)


def test_the_analytic_count_is_the_compiled_programs_matmuls():
    flops, student, teacher = compiled_matmul_flops(TINY)
    assert student.has_images and teacher.has_images and student.loss_rows is not None
    counted = step_flops.opsd_step_flops(TINY, student, teacher, dense=True)
    assert counted.remat == 0
    np.testing.assert_allclose(counted.model, flops, rtol=1e-6)
    # Every part is there: leaving any one out would miss by more than the tolerance.
    assert min(counted.parts.values()) / flops > 1e-3, counted.parts


def test_allowed_pairs_are_fewer_than_dense_ones_and_follow_the_ranges():
    student, _ = two_packs()
    allowed, dense = (step_flops.counts_of(student, d) for d in (False, True))
    assert 0 < allowed.llm_pairs < dense.llm_pairs
    assert 0 < allowed.vit_pairs <= dense.vit_pairs
    assert allowed.tokens == dense.tokens == student.segment_ids.size
    # A causal row of n text tokens, by hand: n (n + 1) / 2 pairs.
    n = 6
    t = np.arange(8)[None]
    causal = Pack(
        tokens=np.zeros((1, 8), np.int32),
        positions=t,
        segment_ids=(t < n).astype(np.int32),
        k_start=np.zeros((1, 8), np.int32),
        k_end=t + 1,
    )
    assert step_flops.counts_of(causal) == step_flops.PackCounts(8, n * (n + 1) // 2)
    # Micro-batches stacked on a leading axis count as their sum.
    stacked = causal.replace(
        **{k: np.stack([v, v]) for k, v in vars(causal).items() if v is not None}
    )
    assert step_flops.counts_of(stacked) == step_flops.PackCounts(16, n * (n + 1))


def test_remat_adds_the_re_forward_to_the_executed_count_only():
    student, teacher = two_packs()
    plain = step_flops.opsd_step_flops(TINY, student, teacher)
    full = step_flops.opsd_step_flops(TINY, student, teacher, remat="full")
    assert full.model == plain.model and full.executed > plain.executed == plain.model
    # The re-forward is one more forward of the student's layers (LLM and ViT).
    once = step_flops.forward_flops(TINY, step_flops.counts_of(student), None)
    layers = once.parts["llm_matmul"] + once.parts["llm_attention"] + once.parts["vit_attention"]
    assert layers < full.remat < once.model


class _Freezes:
    """The freeze flags train_step.frozen_groups reads."""

    def __init__(self, **flags):
        self.freeze_vit = self.freeze_llm = self.freeze_und = False
        self.__dict__.update(flags)


@pytest.mark.parametrize(
    "flags, trained",
    [
        (dict(freeze_vit=True), {"connector", "llm", "lm_head"}),
        (dict(freeze_llm=True), {"vit", "connector"}),
        (dict(freeze_und=True), {"lm_head"}),
    ],
)
def test_frozen_groups_count_what_the_compiled_step_runs(flags, trained):
    """The grads of the trainable groups only, as the train step takes them: a frozen group's
    weights get no gradient, and no backward runs below the lowest trained weight."""
    model = Bagel(TINY, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    frozen = train_step.frozen_groups(_Freezes(**flags), params)
    loss_fn = train_step.make_opsd_loss(
        graphdef, rest, builders.loss_settings(num_samples=2), "ema"
    )
    student, teacher = two_packs()

    @jax.jit
    def grads(params, teacher_params, student, teacher):
        trainable, kept = train_step.split_params(params, frozen)

        def loss_of(trainable):
            merged = train_step.merge_params(trainable, jax.tree.map(lambda x: x, kept), params)
            return loss_fn(merged, teacher_params, (student, teacher))

        return jax.value_and_grad(loss_of, has_aux=True)(trainable)

    _, partitioned = hlo_stats.compile_and_read(grads.lower(params, params, student, teacher))
    flops, _ = hlo_stats.dot_flops(partitioned)
    counted = step_flops.opsd_step_flops(
        TINY, student, teacher, step_flops.Trained.of_split(_split(**flags)), dense=True
    )
    assert counted.parts.keys() >= {"llm_matmul", "lm_head", "vit_matmul", "connector"}
    np.testing.assert_allclose(counted.model, flops, rtol=1e-6)
    assert step_flops.Trained.of_split(_split(**flags)).weights == trained


def _split(**flags):
    """The TrainedSplit of a run config with these freeze flags (full fine-tuning)."""
    return trained_split.TrainedSplit.of_config(run_config.complete(flags))


def test_every_remat_policy_says_what_it_reruns():
    assert set(step_flops.RERUN) == set(REMAT_CHOICES)
    student, teacher = two_packs()
    executed = {
        remat: step_flops.opsd_step_flops(TINY, student, teacher, remat=remat).remat
        for remat in REMAT_CHOICES
    }
    assert executed["none"] == executed["minimal_flash"] == 0
    assert 0 < executed["dots_no_batch"] < executed["full"]
    vit_only = step_flops.opsd_step_flops(
        TINY, student, teacher, remat="minimal_flash", vit_remat="full"
    ).remat
    assert 0 < vit_only < executed["full"]


def test_the_peak_is_known_by_jax_device_kind():
    assert step_flops.dense_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert step_flops.dense_peak("NVIDIA H200") == 989e12
    assert step_flops.dense_peak("cpu") is None
    assert step_flops.utilisation(989e12, 2.0, 989e12, devices=2) == 0.25
    assert jax.devices()  # the CPU backend this file compiles on
