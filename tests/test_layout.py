"""The compute layout, read from the compiled program (8 CPU devices, tiny model).

Numbers that match one device prove numerics, not layout: these tests read the per-device HLO
right after SPMD partitioning (opsd_jax/programs/hlo_stats.py) and check what crosses the interconnect.
Under pure FSDP only weights (all-gather, compute dtype) and weight gradients (reduce-scatter;
all-reduce for the small replicated ones) may move; any collective whose shape is not a
parameter's is an activation collective, which is a layout bug.
"""

import builders
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_opsd_packs import SPECIAL, encode, sample

from models import attention as attention_lib
from models.bagel import Bagel
from models.configs import BagelConfig
from opsd_jax.data.opsd_packs import build_training_packs
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.programs import hlo_stats
from opsd_jax.training import train_step

OPTIONS = builders.prompt_options(system_prompt="ab", reference_intro="c", transition_prompt="d")
SMALL = 64  # elements: scalars and per-sample loss sums may be all-reduced


def activation_collectives(found, weights):
    return hlo_stats.activation_collectives(found, weights, splits={8})  # pure FSDP over 8


def describe(collectives):
    return "\n".join(
        f"{c.kind} x{c.count}: {[str(s) for s in c.operands]} -> {[str(s) for s in c.results]}"
        for c in collectives
    )


@pytest.fixture(scope="module")
def fsdp_setup():
    config = BagelConfig.tiny(llm=dict(compute_dtype="bfloat16", remat="full"))
    mesh = mesh_lib.make_mesh()  # data 1 x fsdp 8: pure FSDP
    model = mesh_lib.create_sharded_model(lambda: Bagel(config, rngs=nnx.Rngs(0)), mesh)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    samples = [sample(f"s{i}", "q" * (1 + i % 3)) for i in range(8)]
    packs = build_training_packs(
        samples,
        [[10 + i, 11, 12] for i in range(8)],
        encode,
        OPTIONS,
        SPECIAL,
        num_rows=8,
        max_forward_tokens=256,
    )
    with mesh_lib.use_mesh(mesh):
        student = jax.tree.map(
            lambda x: jax.device_put(x, mesh_lib.batch_sharding(mesh, x.ndim)), packs.student
        )
        teacher = jax.tree.map(
            lambda x: jax.device_put(x, mesh_lib.batch_sharding(mesh, x.ndim)), packs.teacher
        )
    return mesh, graphdef, params, rest, student, teacher


@pytest.mark.slow
def test_grad_step_moves_only_bf16_weights_and_gradients(fsdp_setup):
    mesh, graphdef, params, rest, student, teacher = fsdp_setup
    grad_step = train_step.make_grad_step(
        graphdef, rest, builders.loss_settings(num_samples=8), "ema"
    )
    with mesh_lib.use_mesh(mesh):
        text = hlo_stats.partitioned_hlo(grad_step.lower(params, params, student, teacher))
    found = hlo_stats.collectives(text)
    bad = activation_collectives(found, (params, rest))
    assert not bad, f"activation collectives in the grad step:\n{describe(bad)}"
    gathers = [c for c in found if c.kind == "all-gather"]
    scatters = [c for c in found if c.kind == "reduce-scatter"]
    assert gathers and scatters  # FSDP: weights gathered, gradients reduce-scattered
    # With bf16 compute, weights cross the interconnect in bf16 (cast before the gather).
    wide = [c for c in gathers + scatters if c.dtypes != {"bf16"}]
    assert not wide, f"weight collectives not in bf16:\n{describe(wide)}"
    # Every stacked layer weight is gathered inside the layer loops (count = layers x passes).
    layers = BagelConfig.tiny().llm.num_hidden_layers
    assert any(c.count >= layers for c in gathers)


def test_without_the_rules_activations_cross_devices(fsdp_setup):
    """The check above can fail: with the mesh but no activation rules (plain propagation), the
    hidden dimension inherits the weights' FSDP split and activations are all-reduced."""
    mesh, graphdef, params, rest, student, _ = fsdp_setup

    def make_forward():  # a new function per trace: jax caches traces by function, not rules
        def forward(params, pack):
            model = nnx.merge(graphdef, params, rest)
            return model.logits_at(model(pack), pack.loss_rows)

        return jax.jit(forward)

    with jax.set_mesh(mesh):  # mesh only: the model's constraints are no-ops
        text = hlo_stats.partitioned_hlo(make_forward().lower(params, student))
    assert activation_collectives(hlo_stats.collectives(text), (params, rest))
    with mesh_lib.use_mesh(mesh):
        text = hlo_stats.partitioned_hlo(make_forward().lower(params, student))
    assert not activation_collectives(hlo_stats.collectives(text), (params, rest))


@pytest.mark.parametrize("backend", ["chunked", "reference"])
def test_attention_runs_per_device_on_its_rows(backend):
    mesh = mesh_lib.make_mesh(num_replicate=2, num_shard=2, num_tensor=2)
    rows, length, heads, kv_heads, dim = 8, 40, 4, 2, 16
    rng = np.random.default_rng(0)
    q = rng.standard_normal((rows, length, heads, dim)).astype(np.float32)
    k, v = (rng.standard_normal((rows, length, kv_heads, dim)).astype(np.float32) for _ in "kv")
    segments = np.ones((rows, length), np.int32)
    segments[:, 30:] = 0
    k_start = np.zeros((rows, length), np.int32)
    k_end = np.tile(np.arange(1, length + 1, dtype=np.int32), (rows, 1))

    def attend(q, k, v):
        return attention_lib.attention(
            q,
            k,
            v,
            q_segment_ids=segments,
            kv_segment_ids=segments,
            k_start=k_start,
            k_end=k_end,
            backend=backend,
            q_block=16,
            kv_block=16,
        )

    expected = attend(q, k, v)
    row_heads = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(mesh_lib.BATCH_AXES, None, "tensor", None)
    )
    with mesh_lib.use_mesh(mesh):
        args = [jax.device_put(x, row_heads) for x in (q, k, v)]
        lowered = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(attend(*a) ** 2), (0, 1, 2)))
        found = hlo_stats.collectives(hlo_stats.partitioned_hlo(lowered.lower(*args)))
        out = jax.jit(attend)(*args)
    big = [c for c in found if any(np.prod(s.dims) > SMALL for s in c.operands)]
    assert not big, f"attention moved q/k/v between devices:\n{describe(big)}"
    assert out.sharding.spec[0] == mesh_lib.BATCH_AXES and out.sharding.spec[2] == "tensor"
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-5)


@pytest.mark.slow
def test_tensor_parallel_forward_equals_one_device():
    """Heads, MLP and vocab split over 'tensor' (data 2 x fsdp 2 x tensor 2): same logits."""
    config = BagelConfig.tiny(llm=dict(compute_dtype="float32"))
    mesh = mesh_lib.make_mesh(num_replicate=2, num_shard=2, num_tensor=2)
    model = mesh_lib.create_sharded_model(lambda: Bagel(config, rngs=nnx.Rngs(0)), mesh)
    graphdef, state = nnx.split(model)
    samples = [sample(f"s{i}", "q" * (1 + i % 3)) for i in range(8)]
    packs = build_training_packs(
        samples,
        [[10 + i, 11] for i in range(8)],
        encode,
        OPTIONS,
        SPECIAL,
        num_rows=8,
        max_forward_tokens=256,
    )

    def forward(state, pack):
        m = nnx.merge(graphdef, state)
        return m.logits_at(m(pack), pack.loss_rows)

    expected = jax.jit(forward)(jax.device_get(state), packs.teacher)
    with mesh_lib.use_mesh(mesh):
        pack = jax.tree.map(
            lambda x: jax.device_put(x, mesh_lib.batch_sharding(mesh, x.ndim)), packs.teacher
        )
        logits = jax.jit(forward)(state, pack)
    assert logits.sharding.spec[-1] == "tensor"  # vocab split, as the rules say
    scale = float(np.abs(np.asarray(expected)).max())
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), atol=1e-5 * scale)
