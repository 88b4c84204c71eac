"""The sampler's decode copy (opsd_jax/sampling/decode_copy.py): layout, what a decode round moves, and
the same completions as sampling on the training parameters (8 CPU devices, tiny model)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.core import spmd
from jax.sharding import PartitionSpec as P
from test_layout import describe
from test_sampler import (
    SPECIAL,
    VOCAB_LIMIT,
    ScriptedModel,
    decode_text,
    prompt_pack,
    prompts,
    scripted_pack,
)

from models.bagel import Bagel
from models.configs import BagelConfig
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.programs import hlo_stats
from opsd_jax.sampling import decode_copy, sampler

SMALL = 64  # elements: per-row scalars (token, log-prob, stop flags) may cross devices
NEW_TOKENS = 6


def training_model(compute_dtype):
    """The tiny model as train.py holds it: fp32 params, FSDP over 8 devices, split in two."""
    config = BagelConfig.tiny(llm=dict(compute_dtype=compute_dtype))
    mesh = mesh_lib.make_mesh()  # data 1 x fsdp 8
    model = mesh_lib.create_sharded_model(lambda: Bagel(config, rngs=nnx.Rngs(0)), mesh)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return mesh, model, graphdef, params, rest


@pytest.fixture(scope="module")
def bf16_setup():
    mesh, model, graphdef, params, rest = training_model("bfloat16")
    samples = (prompts(3) + prompts(4) + prompts(5))[:8]  # 8 rows: one per device
    with mesh_lib.use_mesh(mesh):
        pack = jax.tree.map(
            lambda x: jax.device_put(x, mesh_lib.batch_sharding(mesh, x.ndim)), prompt_pack(samples)
        )
    return mesh, model, graphdef, params, rest, pack


def round_collectives(graphdef, state, pack, do_sample=False):
    """The collectives of one compiled decode round, under the active mesh and rules."""
    rules = tuple(spmd.get_logical_axis_rules())
    slots = pack.row_length + NEW_TOKENS + 2
    decode_state = sampler.prefill_rows(
        graphdef, state, pack, NEW_TOKENS, slots, jnp.bfloat16, rules
    )
    settings = sampler.round_settings(SPECIAL, VOCAB_LIMIT, NEW_TOKENS, 1.0, do_sample)
    lowered = sampler.decode_round.lower(
        graphdef,
        state,
        decode_state,
        jax.random.key(0),
        jnp.arange(8, dtype=jnp.int32),
        settings,
        rules,
    )
    return hlo_stats.collectives(hlo_stats.partitioned_hlo(lowered))


def big(found):
    return [c for c in found if any(np.prod(s.dims) > SMALL for s in c.operands + c.results)]


def test_copy_is_compute_dtype_in_the_decode_layout_and_is_freed(bf16_setup):
    mesh, _, graphdef, params, rest, _ = bf16_setup
    copy = decode_copy.make_decode_copy(
        graphdef, params, rest, layout="replicated", mesh=mesh, dtype=jnp.bfloat16
    )
    assert dict(copy.mesh.shape) == {"data": 8, "fsdp": 1, "tensor": 1}
    for x in jax.tree.leaves(copy.state):
        assert x.sharding.is_fully_replicated
        assert x.dtype == (jnp.bfloat16 if x.ndim >= 2 else jnp.float32)  # 1-D: norms, biases
    assert copy.nbytes < sum(x.nbytes for x in jax.tree.leaves((params, rest))) * 0.6
    # The refresh casts each shard, then gathers: only bf16 crosses the interconnect.
    state = nnx.merge_state(params, rest)
    refresh = decode_copy.cast_function(graphdef, state, copy.mesh, jnp.bfloat16).lower(state)
    found = hlo_stats.collectives(hlo_stats.partitioned_hlo(refresh))
    assert found and all(c.kind == "all-gather" and c.dtypes == {"bf16"} for c in big(found))
    leaves = jax.tree.leaves(copy.state)
    copy.delete()
    assert all(x.is_deleted() for x in leaves)
    assert not any(x.is_deleted() for x in jax.tree.leaves(params))  # the training params live on

    tensor = decode_copy.make_decode_copy(
        graphdef, params, rest, layout="tensor", mesh=mesh, dtype=jnp.bfloat16, tensor_size=2
    )
    assert dict(tensor.mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    layers = tensor.state["language_model"]["layers"]["und"]
    # [L, D, t, 2, F/t] and [L, D, t, Hq/t + 2 Hkv/t, Dh]: each device holds its MLP columns
    # and its q, k and v heads.
    assert layers["gate_up_proj"]["kernel"][...].sharding.spec == P(
        None, None, "tensor", None, None
    )
    assert layers["qkv_proj"]["kernel"][...].sharding.spec == P(None, None, "tensor", None, None)
    assert layers["qkv_proj"]["kernel"][...].shape[2:4] == (2, 4 // 2 + 2 * (2 // 2))
    assert tensor.state["language_model"]["lm_head"][...].sharding.spec == P(None, "tensor")
    with pytest.raises(ValueError, match="sampler_layout='pipeline'"):
        mesh_lib.decode_mesh(mesh, "pipeline")


@pytest.mark.slow
def test_replicated_decode_round_moves_no_weight(bf16_setup):
    mesh, _, graphdef, params, rest, pack = bf16_setup
    layers = BagelConfig.tiny().llm.num_hidden_layers
    # Today's way, decoding on the FSDP-sharded training params: every layer's weights are
    # gathered in every layer inside the token loop (the check below can fail). Counted over
    # all gathers: the decode step's layers are unrolled (one gather instruction per layer).
    with mesh_lib.use_mesh(mesh):
        found = round_collectives(graphdef, nnx.merge_state(params, rest), pack)
    gathers = [c for c in big(found) if c.kind == "all-gather"]
    assert sum(c.count for c in gathers) >= layers * (NEW_TOKENS + 1), describe(found)

    copy = decode_copy.make_decode_copy(
        graphdef, params, rest, layout="replicated", mesh=mesh, dtype=jnp.bfloat16
    )
    with copy.activate():
        found = round_collectives(copy.graphdef, copy.state, pack)
    assert not big(found), f"the replicated round moves more than scalars:\n{describe(found)}"
    with copy.activate():
        found = round_collectives(copy.graphdef, copy.state, pack, do_sample=True)
    assert not big(found), f"the sampled round moves more than scalars:\n{describe(found)}"


@pytest.mark.slow
def test_tensor_decode_round_all_reduces_only_layer_outputs(bf16_setup):
    mesh, _, graphdef, params, rest, pack = bf16_setup
    copy = decode_copy.make_decode_copy(
        graphdef, params, rest, layout="tensor", mesh=mesh, dtype=jnp.bfloat16, tensor_size=2
    )
    llm = BagelConfig.tiny().llm
    rows, steps = 8 // copy.mesh.shape["data"], NEW_TOKENS + 1
    for do_sample in (False, True):
        with copy.activate():
            found = round_collectives(copy.graphdef, copy.state, pack, do_sample)
        moved = big(found)
        # Megatron layout: the attention output and the MLP output of each layer (and the
        # embedding of the fed token, whose table is split over the vocabulary) are summed over
        # 'tensor'.
        layer_outputs = [
            c
            for c in moved
            if c.kind == "all-reduce"
            and [s.dims for s in c.operands] == [(rows, 1, llm.hidden_size)]
        ]
        assert sum(c.count for c in layer_outputs) == steps * (2 * llm.num_hidden_layers + 1)
        assert all(c.group_size == 2 for c in layer_outputs)  # inside one tensor group
        # Sampling draws from the whole vocabulary's CDF: the bf16 logits, gathered once a step.
        logits = [
            c
            for c in moved
            if c.kind == "all-gather"
            and c.dtypes == {"bf16"}
            and [s.dims for s in c.results] == [(rows, llm.vocab_size)]
        ]
        assert sum(c.count for c in logits) == (steps if do_sample else 0)
        others = [c for c in moved if c not in layer_outputs + logits]
        assert not others, f"more than layer outputs and logits move:\n{describe(others)}"


@pytest.mark.slow
def test_same_completions_as_sampling_on_the_training_params(bf16_setup, monkeypatch):
    """bf16, one row per device: the copy decodes bit for bit what the sharded params decode
    (greedy and sampled: tokens and log-probs), and a seed reproduces its batch. The prompts
    are on the training mesh, as a caller holds them: every array the copy's decode round takes
    is on the copy's mesh all the same (jax 0.11, the GPU image's, refuses an op whose inputs
    are on two meshes: the row ids on the prompts' mesh failed there)."""
    mesh, model, graphdef, params, rest, pack = bf16_setup
    copy = decode_copy.make_decode_copy(
        graphdef, params, rest, layout="replicated", mesh=mesh, dtype=jnp.bfloat16
    )
    for kwargs in (dict(do_sample=False), dict(temperature=0.7)):
        kwargs.update(special=SPECIAL, vocab_limit=VOCAB_LIMIT, max_new_tokens=NEW_TOKENS)
        with mesh_lib.use_mesh(mesh):
            today = sampler.sample(model, pack, jax.random.key(3), **kwargs)
        with monkeypatch.context() as patch:
            meshes = record_meshes(patch, "decode_round")
            out = sampler.sample(copy, pack, jax.random.key(3), **kwargs)
        assert meshes == {"decode_round": {copy.mesh}}, meshes
        np.testing.assert_array_equal(out.tokens, today.tokens)
        np.testing.assert_array_equal(out.logprobs, today.logprobs)
    again = sampler.sample(copy, pack, jax.random.key(3), **kwargs)
    np.testing.assert_array_equal(again.tokens, out.tokens)


@pytest.mark.slow
def test_tensor_layout_decodes_what_one_device_decodes():
    """fp32 (no bf16 rounding to hide behind): greedy tokens equal the one-device sampler's,
    log-probs to float32 summation order."""
    mesh, model, graphdef, params, rest = training_model("float32")
    samples = prompts(3) + prompts(4) + prompts(5)[:2]
    kwargs = dict(
        special=SPECIAL,
        vocab_limit=VOCAB_LIMIT,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        cache_dtype="float32",
    )
    ref = sampler.sample(
        nnx.merge(graphdef, jax.device_get(params), jax.device_get(rest)),
        prompt_pack(samples),
        jax.random.key(0),
        **kwargs,
    )
    copy = decode_copy.make_decode_copy(
        graphdef, params, rest, layout="tensor", mesh=mesh, dtype=jnp.float32, tensor_size=2
    )
    out = sampler.sample(copy, prompt_pack(samples), jax.random.key(0), **kwargs)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)


def test_image_skip_rounds_and_budgets_on_a_copy(monkeypatch):
    """The scripted model of test_sampler, sampled through a (replicated) decode copy from
    prompts on the training mesh: the rounds' programs take arrays on the copy's mesh only."""
    eos = SPECIAL.im_end
    scripts = [[7, 50, eos, 11, 12, eos], [7, 8, eos], [50, eos] + [13] * 6, [9] * 12] * 2
    model = ScriptedModel(scripts)
    graphdef, state = nnx.split(model)
    mesh = mesh_lib.make_mesh()  # data 1 x fsdp 8; the copy's: data 8
    copy = decode_copy.make_decode_copy(
        graphdef, state, layout="replicated", mesh=mesh, dtype=jnp.float32
    )
    pack = jax.tree.map(
        lambda x: jax.device_put(x, mesh_lib.batch_sharding(mesh, x.ndim)),
        scripted_pack(len(scripts)),
    )
    meshes = record_meshes(monkeypatch, "decode_round", "_append_token")
    out = sampler.sample(
        copy,
        pack,
        jax.random.key(0),
        special=SPECIAL,
        vocab_limit=VOCAB_LIMIT,
        max_new_tokens=6,
        do_sample=False,
        max_image_skips=1,
        decode_text=decode_text,
        cache_dtype="float32",
    )
    assert meshes == {"decode_round": {copy.mesh}, "_append_token": {copy.mesh}}, meshes
    for first in (0, 4):
        row = lambda r: out.row(first + r)  # noqa: E731
        rounds, finished = out.rounds[first:], out.finished[first:]
        assert row(0) == [7, 50, 11, 12] and finished[0] and rounds[0] == 2
        assert row(1) == [7, 8] and finished[1] and rounds[1] == 1
        assert row(2) == [50, 13, 13, 13, 13] and not finished[2] and rounds[2] == 2
        assert row(3) == [9] * 6 and not finished[3] and rounds[3] == 1


def record_meshes(patch, *names) -> dict[str, set]:
    """For each of the sampler's programs `names`, wrapped under `patch`: the meshes of the
    arrays each call takes (jax 0.11, the GPU image's, refuses an op over two meshes)."""
    meshes = {}
    for name in names:

        def spy(*args, _program=getattr(sampler, name), _name=name, **kwargs):
            shardings = [getattr(x, "sharding", None) for x in jax.tree.leaves((args, kwargs))]
            meshes.setdefault(_name, set()).update(
                s.mesh for s in shardings if isinstance(s, jax.sharding.NamedSharding)
            )
            return _program(*args, **kwargs)

        patch.setattr(sampler, name, spy)
    return meshes
