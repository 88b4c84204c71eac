"""A teacher from another checkpoint (teacher_mode='checkpoint', #55 item 1).

The teacher is another model: its own graph (it may be deeper than the student), its weights
frozen in the compute dtype and never saved. It scores exactly as a fixed teacher holding the
same weights would, it stays bit-identical through the step, with LoRA it sits beside the
student's base, its tokenizer and shapes are checked against the student's (the first
difference named). train.py's run taught by another checkpoint (resumed bit-identically, another
teacher refused in one line) is tests/test_lora_training.py's LoRA run.
"""

import builders
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_train_step import COMPLETIONS, SAMPLES, fixed_packs, optim_config, stacked

from models.bagel import Bagel
from models.configs import BagelConfig
from opsd_jax import run_config
from opsd_jax.io import teacher_checkpoint
from opsd_jax.io.hf_load import load_hf
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.run_config import checks
from opsd_jax.toy import data as toy_data
from opsd_jax.toy import model as toy_model
from opsd_jax.training import train_step

FP32 = dict(compute_dtype="float32", remat="none")


def split(config: BagelConfig, seed: int):
    return nnx.split(Bagel(config, rngs=nnx.Rngs(seed)), nnx.Param, ...)


def step_for(graphdef, rest, config, mode, teacher_model=None):
    settings = builders.loss_settings(num_samples=2)
    loss_fn = train_step.make_opsd_loss(graphdef, rest, settings, mode, teacher_model)
    return train_step.make_train_step(
        loss_fn,
        train_step.make_optimizer(config),
        teacher_mode=mode,
        ema_decay=0.5,
        schedule=train_step.learning_rate_schedule(config),
    )


def test_a_checkpoint_teacher_scores_as_a_fixed_teacher_holding_its_weights():
    """Same shapes, so the 'fixed' path (the student's graph over the teacher's weights) is an
    independent reference: the step's metrics and the updated student agree exactly, and the
    teacher's weights come out bit-identical."""
    tiny = BagelConfig.tiny(llm=FP32)
    graphdef, params, rest = split(tiny, 0)
    teacher_graphdef, teacher_params, teacher_rest = split(tiny, 1)
    config = optim_config()
    packs = fixed_packs(SAMPLES[:2], COMPLETIONS[:2])
    micro = stacked(packs)
    optimizer = train_step.make_optimizer(config)

    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731  (each step donates its state)
    fixed = train_step.init_state(
        copy(params), optimizer, "fixed", jax.random.key(0), teacher_source=copy(teacher_params)
    )
    ours = train_step.init_state(
        copy(params),
        optimizer,
        "checkpoint",
        jax.random.key(0),
        teacher_weights=copy(teacher_params),
    )
    assert ours.teacher_params is None
    model = train_step.TeacherModel(teacher_graphdef, teacher_rest)
    want_state, want = step_for(graphdef, rest, config, "fixed")(fixed, micro)
    got_state, got = step_for(graphdef, rest, config, "checkpoint", model)(ours, micro)
    assert float(want["jsd"]) > 0
    for key in ("loss", "jsd", "grad_norm"):
        assert float(got[key]) == float(want[key]), key
    for a, b in zip(jax.tree.leaves(got_state.params), jax.tree.leaves(want_state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(got_state.teacher_weights), jax.tree.leaves(teacher_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # And the teacher matters: the student's own weights as the teacher give another loss (the
    # loss alone, a forward: a third step would compile a backward and an update for this).
    settings = builders.loss_settings(num_samples=2)
    own_loss = train_step.make_opsd_loss(graphdef, rest, settings, "self")
    _, own = jax.jit(own_loss)(params, None, packs)
    assert float(own["jsd"]) > 0 and float(own["jsd"]) != float(got["jsd"])


def test_a_deeper_teacher_runs_on_its_own_graph():
    """A teacher of three layers for a two-layer student: its logits are its own model's on the
    teacher packs (computed here by calling that model), the loss the one they give."""
    tiny = BagelConfig.tiny(llm=FP32)
    deeper = tiny.replace(llm=dict(num_hidden_layers=3))
    graphdef, params, rest = split(tiny, 0)
    teacher_graphdef, teacher_params, teacher_rest = split(deeper, 1)
    settings = builders.loss_settings(num_samples=2)
    student_pack, teacher_pack = fixed_packs(SAMPLES[:2], COMPLETIONS[:2])
    model = train_step.TeacherModel(teacher_graphdef, teacher_rest)
    loss_fn = train_step.make_opsd_loss(graphdef, rest, settings, "checkpoint", model)
    loss, _ = jax.jit(loss_fn)(params, teacher_params, (student_pack, teacher_pack))

    student = nnx.merge(graphdef, params, rest)
    teacher = nnx.merge(teacher_graphdef, teacher_params, teacher_rest)
    want, _ = train_step.completion_loss(
        student.logits_at(student(student_pack), student_pack.loss_rows),
        teacher.logits_at(teacher(teacher_pack), teacher_pack.loss_rows),
        student_pack,
        settings,
    )
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    assert len(teacher_params["language_model"]["layers"]["und"]["q_proj"]["kernel"]) == 3


def test_with_lora_the_teacher_sits_beside_the_students_base():
    """LoRA: two frozen models (the student's base, the teacher), adapters alone trained; at the
    start (B = 0) the loss is the full fine-tuning one of the base against that teacher."""
    tiny = BagelConfig.tiny(llm=FP32)
    graphdef, params, rest = split(tiny, 0)
    teacher_graphdef, teacher_params, teacher_rest = split(tiny, 1)
    model = train_step.TeacherModel(teacher_graphdef, teacher_rest)
    micro = stacked(fixed_packs(SAMPLES[:2], COMPLETIONS[:2]))
    full = optim_config()
    _, want = step_for(graphdef, rest, full, "checkpoint", model)(
        train_step.init_state(
            jax.tree.map(jnp.copy, params),
            train_step.make_optimizer(full),
            "checkpoint",
            jax.random.key(0),
            teacher_weights=jax.tree.map(jnp.copy, teacher_params),
        ),
        micro,
    )

    config = optim_config(
        lora_rank=4,
        lora_alpha=8.0,
        lora_targets=".*",
        teacher_mode="checkpoint",
        compute_dtype="float32",
    )
    mesh = mesh_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    lgraphdef, lparams, lrest = run_config.with_adapters(graphdef, params, rest, config, mesh)
    optimizer = train_step.make_optimizer(config)
    state = run_config.init_train_state(
        config, optimizer, (), lparams, teacher_weights=teacher_params
    )
    assert state.base is not None and state.teacher_params is None
    before = [np.asarray(x) for x in jax.tree.leaves(state.teacher_weights)]
    step = step_for(lgraphdef, lrest, config, "checkpoint", model)
    state, got = step(state, micro)
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(state.teacher_weights), before):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert all("lora" in "/".join(map(str, p)) for p, _ in nnx.to_flat_state(state.params))


def test_the_state_holds_the_teacher_sharded_as_the_weights_and_in_the_compute_dtype():
    config = optim_config(compute_dtype="bfloat16", teacher_mode="checkpoint", teacher_path="t")
    mesh = mesh_lib.make_mesh(1, None, 1)
    _, abstract = mesh_lib.abstract_model(lambda: Bagel(BagelConfig.tiny(), rngs=nnx.Rngs(0)), mesh)
    params = nnx.split_state(abstract, nnx.Param, ...)[0]
    held = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(p.shape, jnp.bfloat16, sharding=p.sharding), params
    )
    _, _, state = run_config.abstract_train_state(config, params, held)
    assert state.teacher_params is None
    for (path, t), p in zip(nnx.to_flat_state(state.teacher_weights), jax.tree.leaves(params)):
        assert t.dtype == jnp.bfloat16 and t.sharding == p.sharding, path
    # What the preflight counts: the teacher's bf16 weights beside the fp32 params and moments.
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    alone = run_config.abstract_train_state(optim_config(teacher_mode="self"), params)[2]
    count = sum(x.size for x in jax.tree.leaves(params))
    assert nbytes(state) == nbytes(alone) + 2 * count
    with pytest.raises(ValueError, match="give the teacher's weights"):
        run_config.abstract_train_state(config, params)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(teacher_mode="checkpoint"), "teacher_mode='checkpoint' with an empty teacher_path"),
        (dict(teacher_path="/x"), "teacher_path='/x' with teacher_mode='ema'"),
        (
            dict(teacher_mode="checkpoint", teacher_path="/nowhere"),
            "teacher_path='/nowhere': not a BAGEL HF directory",
        ),
    ],
)
def test_bad_teacher_settings_are_named(changes, message):
    config = run_config.complete(dict(toy_data=True, **changes))
    with pytest.raises(checks.ConfigError, match=message):
        checks.validate(config)


def toy_corpus() -> list[str]:
    tasks = toy_data.tasks_for(["toy_maze", "toy_count"])
    return toy_data.toy_corpus_text(seed=0, tasks=tasks).splitlines()


def write_deeper_teacher(directory, corpus=None) -> str:
    """A toy teacher of other weights (seed 1) and three layers, with the toy run's tokenizer
    (configs/smoke.py's toy model is seed 0 over the same corpus): its directory."""
    deeper = BagelConfig.tiny().replace(llm=dict(num_hidden_layers=3))
    return toy_model.write_toy_model(
        directory, seed=1, corpus=corpus or toy_corpus(), config=deeper
    )


@pytest.fixture(scope="module")
def toy_dirs(tmp_path_factory):
    """A toy student (seed 0), a toy teacher of other weights and three layers (seed 1), both
    with the toy run's tokenizer; and two teachers that cannot score the student's packs."""
    root = tmp_path_factory.mktemp("teachers")
    corpus = toy_corpus()
    tiny = BagelConfig.tiny()
    dirs = {
        "student": toy_model.write_toy_model(root / "student", seed=0, corpus=corpus),
        "teacher": write_deeper_teacher(root / "teacher", corpus),
        "other_tokenizer": toy_model.write_toy_model(
            root / "other_tokenizer", seed=1, corpus=corpus[: len(corpus) // 3]
        ),
        "other_patch": toy_model.write_toy_model(
            root / "other_patch",
            seed=1,
            corpus=corpus,
            config=tiny.replace(vit=dict(patch_size=7)),
        ),
    }
    return dirs


def load_teacher(toy_dirs, name):
    mesh = mesh_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    _, student_config, tokenizer = load_hf(toy_dirs["student"], mesh=mesh, read_params=False)
    return teacher_checkpoint.load(
        toy_dirs[name],
        mesh,
        student_config=student_config,
        student_tokenizer=tokenizer,
        config_changes={"llm": dict(compute_dtype="bfloat16")},
    )


def test_the_teacher_loads_frozen_in_the_compute_dtype_and_is_named_by_its_digest(toy_dirs):
    teacher = load_teacher(toy_dirs, "teacher")
    assert teacher.model_config.llm.num_hidden_layers == 3
    assert {x.dtype for x in jax.tree.leaves(teacher.params)} == {jnp.dtype(jnp.bfloat16)}
    assert teacher.identity == teacher_checkpoint.identity(toy_dirs["teacher"])
    assert teacher.identity["digest"] != teacher_checkpoint.identity(toy_dirs["student"])["digest"]
    assert "3 layers" in teacher.describe()


@pytest.mark.parametrize(
    "name, message",
    [
        ("other_tokenizer", "tokenizer ids against the student's"),
        ("other_patch", "the ViT patch size: 7 against the student's"),
    ],
)
def test_a_teacher_that_reads_the_packs_otherwise_is_refused_naming_the_difference(
    toy_dirs, name, message
):
    with pytest.raises(teacher_checkpoint.TeacherMismatch, match=message):
        load_teacher(toy_dirs, name)


class _Tokenizer:
    """What tokenizer_difference reads of a BagelTokenizer."""

    def __init__(self, vocab, special=(0, 1, 2, 3)):
        self.vocab, self.special = vocab, special
        self.vocab_length = len(vocab)
        self.hf = self

    def get_vocab(self):
        return dict(self.vocab)

    def special_tokens(self):
        return self.special


def test_the_first_token_read_otherwise_is_named():
    ours = _Tokenizer({"a": 0, "b": 1, "c": 2, "d": 3})
    assert teacher_checkpoint.tokenizer_difference(ours, _Tokenizer(ours.vocab)) is None
    swapped = _Tokenizer({"a": 0, "c": 1, "b": 2, "d": 3})
    assert (
        teacher_checkpoint.tokenizer_difference(ours, swapped)
        == "id 1 is 'c' for the teacher and 'b' for the student"
    )
    other_special = _Tokenizer(ours.vocab, special=(0, 1, 3, 2))
    assert "special ids" in teacher_checkpoint.tokenizer_difference(ours, other_special)
