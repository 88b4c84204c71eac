"""The OPSD train step: learning in every teacher mode, EMA, accumulation, mesh, freezing, LR."""

import dataclasses

import builders
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close_to_scale, assert_trees_close_to_scale
from flax import nnx
from test_opsd_packs import SPECIAL, encode, sample

from models.bagel import Bagel
from models.configs import BagelConfig
from opsd_jax import run_config
from opsd_jax.data.opsd_packs import build_training_packs
from opsd_jax.data.pack_shapes import PackShape
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.training import train_step

OPTIONS = builders.prompt_options(system_prompt="ab", reference_intro="c", transition_prompt="d")


def optim_config(**changes):
    values = dict(
        lr=3e-3, min_lr=1e-5, warmup_steps=0, total_steps=50, lr_scheduler="constant", eps=1e-8
    )
    return run_config.complete(dict(values, **changes))


@pytest.fixture(scope="module")
def split_model():
    model = Bagel(
        BagelConfig.tiny(llm=dict(compute_dtype="float32", remat="none")), rngs=nnx.Rngs(0)
    )
    return nnx.split(model, nnx.Param, ...)


def packs_for(samples, completions, num_rows=1):
    return build_training_packs(
        samples, completions, encode, OPTIONS, SPECIAL, num_rows=num_rows, max_forward_tokens=256
    )


SAMPLES = [sample("a"), sample("b", "qq", vts=((1, 2),)), sample("c", "qqq"), sample("d")]
COMPLETIONS = [[11, 12, 13], [14, 15], [16, 17, 18, 19], [20]]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["self", "ema", "fixed"])
def test_loss_falls_on_a_repeated_batch(split_model, mode):
    graphdef, params, rest = split_model
    optimizer = train_step.make_optimizer(optim_config(lr=1e-3))
    # The student starts away from the teacher's weights (for 'self' the gap is the context).
    student = jax.tree.map(jnp.copy, params)  # the state is donated: never the fixture itself
    if mode != "self":
        leaves, tree = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.key(1), len(leaves))
        student = jax.tree.unflatten(
            tree, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
        )
    state = train_step.init_state(
        student, optimizer, mode, jax.random.key(0), teacher_source=jax.tree.map(jnp.copy, params)
    )
    settings = builders.loss_settings(num_samples=2, jsd_top_k=0, jsd_token_clip=0.0)
    grad_step = train_step.make_grad_step(graphdef, rest, settings, mode)
    apply_update = train_step.make_apply_update(optimizer, mode, ema_decay=0.5)
    packs = packs_for(SAMPLES[:2], COMPLETIONS[:2])
    losses = []
    for _ in range(8):
        grads, metrics = grad_step(state.params, state.teacher_params, packs.student, packs.teacher)
        state, _ = apply_update(state, grads, 1)
        losses.append(float(metrics["loss"]))
    assert losses[0] > 0 and losses[-1] < 0.5 * losses[0], losses


def test_ema_update_math(split_model):
    graphdef, params, rest = split_model
    optimizer = train_step.make_optimizer(optim_config())
    state = train_step.init_state(
        jax.tree.map(jnp.copy, params), optimizer, "ema", jax.random.key(0)
    )
    before = jax.tree.map(np.asarray, state.params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.01), state.params)
    apply_update = train_step.make_apply_update(optimizer, "ema", ema_decay=0.9)
    state, _ = apply_update(state, grads, 1)
    after = jax.tree.map(np.asarray, state.params)
    expected = jax.tree.map(lambda b, a: 0.9 * b + 0.1 * a, before, after)
    for e, t in zip(jax.tree.leaves(expected), jax.tree.leaves(state.teacher_params)):
        np.testing.assert_allclose(np.asarray(t), e, rtol=1e-6, atol=1e-7)
    assert int(state.step) == 1


@pytest.mark.slow
def test_gradient_accumulation_equals_one_big_batch(split_model):
    graphdef, params, rest = split_model
    two = train_step.make_grad_step(graphdef, rest, builders.loss_settings(num_samples=2), "self")
    four = train_step.make_grad_step(graphdef, rest, builders.loss_settings(num_samples=4), "self")
    first = packs_for(SAMPLES[:2], COMPLETIONS[:2])
    second = packs_for(SAMPLES[2:], COMPLETIONS[2:])
    g1, _ = two(params, None, first.student, first.teacher)
    g2, _ = two(params, None, second.student, second.teacher)
    everything = packs_for(SAMPLES, COMPLETIONS, num_rows=2)
    g, _ = four(params, None, everything.student, everything.teacher)
    # Two half-batch sums against one: the same terms added in another order.
    accumulated = jax.tree.map(lambda a, b: (np.asarray(a) + np.asarray(b)) / 2, g1, g2)
    assert_trees_close_to_scale(accumulated, g, rel=1e-4)


@pytest.mark.slow
def test_step_on_an_8_device_mesh_equals_one_device(split_model):
    graphdef, params, rest = split_model
    mesh = mesh_lib.make_mesh(num_replicate=2)
    config = optim_config()
    optimizer = train_step.make_optimizer(config)
    settings = builders.loss_settings(num_samples=8)
    samples = [sample(f"s{i}", "q" * (1 + i % 3)) for i in range(8)]
    packs = packs_for(samples, [[10 + i, 11] for i in range(8)], num_rows=8)

    def one_step(params, student, teacher):
        state = train_step.init_state(params, optimizer, "ema", jax.random.key(0))
        grads, metrics = train_step.make_grad_step(graphdef, rest, settings, "ema")(
            state.params, state.teacher_params, student, teacher
        )
        grads_copy = jax.tree.map(jnp.copy, grads)
        state, _ = train_step.make_apply_update(optimizer, "ema", 0.9)(state, grads, 1)
        return state, metrics, grads_copy

    ref_state, ref_metrics, ref_grads = one_step(
        jax.tree.map(jnp.copy, params), packs.student, packs.teacher
    )
    abstract = mesh_lib.abstract_model(lambda: nnx.merge(graphdef, params, rest), mesh)[1]
    shardings = nnx.split_state(abstract, nnx.Param, ...)[0]
    shardings = jax.tree.map(lambda x: x.sharding, shardings)
    with mesh_lib.use_mesh(mesh):
        sharded_params = jax.device_put(jax.tree.map(jnp.copy, params), shardings)
        put = lambda pack: jax.tree.map(  # noqa: E731
            lambda x: jax.device_put(x, mesh_lib.batch_sharding(mesh, x.ndim)), pack
        )
        state, metrics, grads = one_step(sharded_params, put(packs.student), put(packs.teacher))
    # The loss (~2e-4) is a JSD of nearly equal distributions: a small difference of
    # log-probabilities of magnitude ~log(vocab), whose fp32 round-off (not the loss's own size)
    # sets what another reduction order may change: one ulp of such a log-probability.
    vocab = params["language_model"]["embed_tokens"][...].shape[0]
    assert_close_to_scale(
        float(metrics["loss"]),
        float(ref_metrics["loss"]),
        rel=float(np.finfo(np.float32).eps),
        scale=np.log(vocab),
    )
    assert_trees_close_to_scale(grads, ref_grads, rel=1e-4)
    # Adam divides by sqrt(v): for gradients near zero it turns round-off into a visible
    # fraction of lr, so the updated params get a tolerance relative to lr (3e-3).
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
    embed = state.params["language_model"]["embed_tokens"][...]
    assert len(embed.sharding.device_set) == 8 and "fsdp" in str(embed.sharding.spec)


def test_tinker_logs_its_k1_value_and_the_pytorch_surrogate():
    packs = packs_for(SAMPLES[:2], COMPLETIONS[:2])
    vocab = int(packs.student.loss_targets.max()) + 1
    keys = jax.random.split(jax.random.key(3))
    student, teacher = (
        jax.random.normal(k, packs.student.loss_targets.shape + (vocab,)) for k in keys
    )
    settings = builders.loss_settings(jsd_loss_kind="tinker", num_samples=2)
    loss, metrics = train_step.completion_loss(student, teacher, packs.student, settings)
    _, diag = train_step.losses.tinker_loss(
        student,
        teacher,
        packs.student.loss_targets,
        packs.student.loss_mask,
        sample_ids=packs.student.loss_sample,
        num_samples=2,
    )
    assert float(metrics["tinker_k1"]) == float(metrics["jsd"]) == float(loss)
    assert float(metrics["tinker_surrogate"]) == float(diag["pytorch_surrogate"])
    assert float(metrics["tinker_surrogate"]) != float(loss)
    jsd_metrics = train_step.completion_loss(
        student, teacher, packs.student, builders.loss_settings(num_samples=2)
    )[1]
    assert not {"tinker_k1", "tinker_surrogate"} & set(jsd_metrics)
    # Its estimate holds only at the sampling temperature (docs/opsd_loss.md): said if not.
    hotter = dataclasses.replace(settings, sample_temperature=0.5)
    with pytest.warns(UserWarning, match="differs from the sampling temperature 0.5"):
        train_step.completion_loss(student, teacher, packs.student, hotter)


def stacked(*micro):
    """Micro-batch pack tuples -> one tuple of packs stacked [micro-batch, rows, ...]."""
    return tuple(jax.tree.map(lambda *x: np.stack(x), *packs) for packs in zip(*micro))


SHAPES = {"student": [PackShape(64, 16, 16)], "teacher": [PackShape(128, 16, 16)]}


def fixed_training_packs(samples, completions):
    """The TrainingPacks of the samples' completions in one row at SHAPES."""
    return build_training_packs(
        samples,
        completions,
        encode,
        OPTIONS,
        SPECIAL,
        num_rows=1,
        max_forward_tokens=256,
        shapes=SHAPES,
    )


def fixed_packs(samples, completions):
    packs = fixed_training_packs(samples, completions)
    return packs.student, packs.teacher


def make_step(split_model, config, mode="ema", num_samples=2, **kwargs):
    graphdef, params, rest = split_model
    optimizer = train_step.make_optimizer(config)
    frozen = train_step.frozen_groups(config)
    loss_fn = train_step.make_opsd_loss(
        graphdef, rest, builders.loss_settings(num_samples=num_samples), mode
    )
    step = train_step.make_train_step(
        loss_fn,
        optimizer,
        teacher_mode=mode,
        ema_decay=0.5,
        frozen=frozen,
        schedule=train_step.learning_rate_schedule(config),
        **kwargs,
    )
    state = train_step.init_state(
        jax.tree.map(jnp.copy, params), optimizer, mode, jax.random.key(0), frozen=frozen
    )
    return step, state, optimizer, loss_fn


@pytest.mark.slow
def test_one_step_with_two_micro_batches_equals_accumulated_grads_then_update(split_model):
    """The scan inside the compiled step = the mean of per-micro-batch gradients, one AdamW
    update, the EMA: the same as grad_step twice + apply_update. The state is donated."""
    graphdef, params, rest = split_model
    config = optim_config()
    step, state, optimizer, _ = make_step(split_model, config)
    micro = [fixed_packs(SAMPLES[:2], COMPLETIONS[:2]), fixed_packs(SAMPLES[2:], COMPLETIONS[2:])]
    grad_step = train_step.make_grad_step(
        graphdef, rest, builders.loss_settings(num_samples=2), "ema"
    )
    ref_state = train_step.init_state(
        jax.tree.map(jnp.copy, params), optimizer, "ema", jax.random.key(0)
    )
    grads = [grad_step(ref_state.params, ref_state.teacher_params, *p) for p in micro]
    summed = jax.tree.map(jnp.add, grads[0][0], grads[1][0])
    loss = (grads[0][1]["loss"] + grads[1][1]["loss"]) / 2
    ref_state, ref_metrics = train_step.make_apply_update(optimizer, "ema", 0.5)(
        ref_state, summed, 2, loss
    )

    leaf = jax.tree.leaves(state.params)[0]
    state, metrics = step(state, stacked(*micro))
    assert leaf.is_deleted()  # donated
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-6)
    np.testing.assert_allclose(
        float(metrics["grad_norm"]), float(ref_metrics["grad_norm"]), rtol=1e-5
    )
    assert int(state.step) == 1 and float(metrics["nonfinite"]) == 0.0
    for a, b in zip(
        jax.tree.leaves((state.params, state.teacher_params, state.opt_state)),
        jax.tree.leaves((ref_state.params, ref_state.teacher_params, ref_state.opt_state)),
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_token_sum_accumulates_to_the_whole_steps_sum(split_model):
    """loss_reduction='token_sum' is a plain sum over the step's tokens: two micro-batches give
    the one big batch's loss and gradient (not their mean, half of it), and the step's token
    count is both micro-batches' tokens."""
    graphdef, params, rest = split_model
    config = optim_config()
    optimizer = train_step.make_optimizer(config)
    settings = builders.loss_settings(num_samples=2, reduction="token_sum")
    step = train_step.make_train_step(
        train_step.make_opsd_loss(graphdef, rest, settings, "self"),
        optimizer,
        teacher_mode="self",
        ema_decay=0.5,
        schedule=train_step.learning_rate_schedule(config),
        sum_micro_batches=True,
    )
    state = train_step.init_state(
        jax.tree.map(jnp.copy, params), optimizer, "self", jax.random.key(0)
    )
    micro = [fixed_packs(SAMPLES[:2], COMPLETIONS[:2]), fixed_packs(SAMPLES[2:], COMPLETIONS[2:])]
    _, metrics = step(state, stacked(*micro))

    whole = train_step.make_grad_step(
        graphdef, rest, dataclasses.replace(settings, num_samples=4), "self"
    )
    everything = packs_for(SAMPLES, COMPLETIONS, num_rows=2)
    grads, want = whole(params, None, everything.student, everything.teacher)
    tokens = sum(len(c) + 1 for c in COMPLETIONS)  # each completion and its <|im_end|>
    assert float(metrics["loss_tokens"]) == float(want["loss_tokens"]) == tokens
    np.testing.assert_allclose(float(metrics["loss"]), float(want["loss"]), rtol=1e-5)
    np.testing.assert_allclose(
        float(metrics["grad_norm"]), float(optax.tree.norm(grads)), rtol=1e-4
    )


@pytest.mark.slow
def test_frozen_vit_is_not_differentiated_and_stays_bit_identical(split_model):
    """freeze_vit: no gradient is computed for the ViT (fewer matmuls in the program), it keeps
    no optimizer moments and never moves; grad_norm is over the trained params only."""
    graphdef, params, rest = split_model
    micro = stacked(fixed_packs(SAMPLES[:2], COMPLETIONS[:2]))
    step, state, _, _ = make_step(split_model, optim_config(freeze_vit=True), mode="self")
    full_step, full_state, _, _ = make_step(split_model, optim_config(), mode="self")

    def matmuls(fn, state):
        return fn.lower(state, micro).as_text().count("dot_general")

    assert matmuls(step, state) < matmuls(full_step, full_state)
    vit_before = jax.tree.map(np.asarray, state.params["vit_model"])
    llm_before = jax.tree.map(np.asarray, state.params["language_model"])
    one = [jax.tree.map(lambda x: x[0], packs) for packs in micro]
    grad_step = train_step.make_grad_step(
        graphdef, rest, builders.loss_settings(num_samples=2), "self"
    )
    grads, _ = grad_step(state.params, None, *one)
    trained = train_step.split_params(grads, ("vit_model",))[0]
    for _ in range(2):
        state, metrics = step(state, micro)
        if _ == 0:
            np.testing.assert_allclose(
                float(metrics["grad_norm"]), float(optax.tree.norm(trained)), rtol=1e-5
            )
    for a, b in zip(jax.tree.leaves(vit_before), jax.tree.leaves(state.params["vit_model"])):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert any(
        not np.array_equal(a, np.asarray(b))
        for a, b in zip(
            jax.tree.leaves(llm_before), jax.tree.leaves(state.params["language_model"])
        )
    )
    # No optimizer moments are kept for the frozen group.
    moments = sum(x.size for x in jax.tree.leaves(state.opt_state))
    trainable = sum(x.size for x in jax.tree.leaves(state.params["language_model"]))
    trainable += sum(x.size for x in jax.tree.leaves(state.params["connector"]))
    assert moments <= 2 * trainable + 16


def test_freeze_und_trains_lm_head_alone(split_model):
    """BAGEL's freeze_und detaches every understanding-token activation; on understanding-only
    data only lm_head has a gradient, so everything else must stay bit-identical and keep no
    optimizer state, even under a gradient that touches every parameter."""
    _, params, _ = split_model
    config = optim_config(freeze_und=True)
    frozen = train_step.frozen_groups(config, params)
    trainable, _ = train_step.split_params(params, frozen)
    flat = {path for path, _ in nnx.to_flat_state(nnx.State(trainable))}
    assert {tuple(p[:2]) for p in flat} == {("language_model", "lm_head")}, flat
    optimizer = train_step.make_optimizer(config)
    state = train_step.init_state(
        jax.tree.map(jnp.copy, params), optimizer, "self", jax.random.key(0), frozen=frozen
    )
    before = {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(state.params)}
    grads = jax.tree.map(jnp.ones_like, trainable)
    state, _ = train_step.make_apply_update(optimizer, "self", 0.0, frozen)(state, grads, 1)
    for path, new in nnx.to_flat_state(state.params):
        moved = not np.array_equal(before[path], np.asarray(new.get_value()))
        assert moved == (tuple(path[:2]) == ("language_model", "lm_head")), path
    lm_head = params["language_model"]["lm_head"][...]
    assert sum(x.size for x in jax.tree.leaves(state.opt_state)) <= 2 * lm_head.size + 16


def test_logged_lr_is_the_applied_one_and_bad_steps_halt_the_state(split_model):
    """lr comes from optax's count, which a skipped step does not advance; past max_bad_steps
    consecutive non-finite steps the step changes nothing, its counter included."""
    config = optim_config(warmup_steps=10, lr=1e-3)
    step, state, _, _ = make_step(split_model, config, max_bad_steps=1)
    good = stacked(fixed_packs(SAMPLES[:2], COMPLETIONS[:2]))
    bad = jax.tree.map(lambda x: x, good)
    bad = (bad[0].replace(vit_patches=bad[0].vit_patches * np.nan), bad[1])
    schedule = train_step.learning_rate_schedule(config)
    logged = []
    for batch in (good, bad, good, bad, bad, good):
        before = jax.tree.map(np.asarray, state.params)
        state, metrics = step(state, batch)
        logged.append((int(state.step), float(metrics["nonfinite"]), float(metrics["lr"])))
    assert [s for s, _, _ in logged] == [1, 2, 3, 4, 5, 5]  # the 6th: halted after 2 in a row
    assert [n for _, n, _ in logged] == [0, 1, 0, 1, 1, 0]
    # Updates applied: steps 1 and 3 (counts 0, 1); the skipped ones log the next count's lr.
    np.testing.assert_allclose(
        [lr for _, _, lr in logged], [float(schedule(c)) for c in (0, 1, 1, 2, 2, 2)], rtol=1e-6
    )
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, np.asarray(b))  # the halted step moved nothing


def test_learning_rate_schedule_values():
    cosine = train_step.learning_rate_schedule(
        optim_config(
            lr=1e-5, min_lr=1e-7, warmup_steps=200, total_steps=1000, lr_scheduler="cosine"
        )
    )
    np.testing.assert_allclose(float(cosine(0)), 0.0)
    np.testing.assert_allclose(float(cosine(100)), 5e-6, rtol=1e-6)
    np.testing.assert_allclose(float(cosine(200)), 1e-5, rtol=1e-6)
    # Halfway through the decay: min + (max - min) / 2.
    np.testing.assert_allclose(float(cosine(600)), 1e-7 + (1e-5 - 1e-7) / 2, rtol=1e-5)
    np.testing.assert_allclose(float(cosine(1000)), 1e-7, rtol=1e-5)
    constant = train_step.learning_rate_schedule(optim_config(lr=2e-5, warmup_steps=10))
    np.testing.assert_allclose(float(constant(5)), 1e-5, rtol=1e-6)
    np.testing.assert_allclose(float(constant(500)), 2e-5, rtol=1e-6)
    with pytest.raises(ValueError, match="lr_scheduler"):
        train_step.learning_rate_schedule(optim_config(lr_scheduler="linear"))


@pytest.mark.parametrize("poison", ["grad", "loss"])
def test_nonfinite_step_leaves_params_optimizer_and_ema_untouched(poison):
    params = {
        "language_model": {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)},
        "vit_model": {"b": jnp.ones(4)},
    }
    optimizer = train_step.make_optimizer(optim_config())
    apply_update = train_step.make_apply_update(optimizer, "ema", ema_decay=0.5)
    state = train_step.init_state(params, optimizer, "ema", jax.random.key(0))
    good = jax.tree.map(lambda p: jnp.full_like(p, 0.1), params)
    state, metrics = apply_update(state, good, 1)  # moments and EMA now differ from init
    assert float(metrics["nonfinite"]) == 0.0
    before = jax.tree.map(np.asarray, (state.params, state.opt_state, state.teacher_params))

    if poison == "grad":
        bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), good)
        state, metrics = apply_update(state, bad, 1)
    else:
        state, metrics = apply_update(state, good, 1, jnp.float32(jnp.inf))
    assert float(metrics["nonfinite"]) == 1.0
    assert int(state.step) == 2  # the batch is consumed, the update is not applied
    after = jax.tree.map(np.asarray, (state.params, state.opt_state, state.teacher_params))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)

    state, metrics = apply_update(state, good, 1)  # training goes on
    assert float(metrics["nonfinite"]) == 0.0
    moved = jax.tree.map(np.asarray, state.params)
    assert not np.array_equal(moved["language_model"]["w"], before[0]["language_model"]["w"])
