"""Which weights a training run starts from: the PyTorch launcher's rules (init_weights.py).

The toy HF directory holds a model.safetensors and an ema.safetensors with different values, so
every copy (student, EMA teacher, fixed teacher) can be traced to the file it came from.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from configs import smoke
from models.configs import BagelConfig
from opsd_jax.io import hf_layout, hf_load, init_weights
from opsd_jax.io.checkpoint import Checkpointer
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.run_config import trained_split
from opsd_jax.toy import model as toy_model
from opsd_jax.training import train_step

RUNTIME = {"llm": {"compute_dtype": "float32", "attention_backend": "reference", "remat": "none"}}


@pytest.fixture(scope="module")
def two_files(tmp_path_factory):
    """model.safetensors (seed 0) and ema.safetensors (seed 1) in one directory."""
    out = tmp_path_factory.mktemp("both")
    toy_model.write_toy_model(out, dtype="fp32", weights_name="model", seed=0)
    tensors = toy_model.toy_tensors(BagelConfig.tiny(), seed=1)
    toy_model.write_weights(out, tensors, "fp32", "ema", num_shards=1)
    return out


@pytest.fixture(scope="module")
def mesh():
    return mesh_lib.make_mesh(devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def file_params(two_files):
    """{stem: params} loaded straight from each file."""
    out = {}
    for stem in ("model", "ema"):
        model, _, _ = hf_load.load_hf(two_files, config_changes=RUNTIME, weights=stem)
        out[stem] = nnx.state(model, nnx.Param)
    return out


def run_config(model_path, **changes):
    config = smoke.get_config()
    with config.unlocked():
        config.model_path = str(model_path)
        config.toy_data = False
        for key, value in changes.items():
            config[key] = value
    return config


def assert_same(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 0
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_differ(a, b):
    assert any(
        not np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def load(config, mesh, **kwargs):
    split = trained_split.TrainedSplit.of_config(config)
    return init_weights.load(config, mesh, split=split, config_changes=RUNTIME, **kwargs)


def test_the_two_files_differ(file_params):
    assert_differ(file_params["model"], file_params["ema"])


def test_auto_student_from_model_file_ema_teacher_from_ema_file(two_files, mesh, file_params):
    start = load(run_config(two_files, teacher_mode="ema"), mesh)
    assert_same(start.params, file_params["model"])
    assert_same(start.teacher_source, file_params["ema"])
    assert "student from model.safetensors" in start.description
    assert "ema teacher from ema.safetensors" in start.description


def test_auto_fixed_teacher_is_the_model_file(two_files, mesh, file_params):
    # The launcher loads the fixed teacher from model.safetensors (resume_from_ema=False), the
    # student's own file here, so init_state copies the student.
    start = load(run_config(two_files, teacher_mode="fixed"), mesh)
    assert_same(start.params, file_params["model"])
    assert start.teacher_source is None


def test_finetune_from_ema_starts_the_student_from_the_ema_file(two_files, mesh, file_params):
    start = load(run_config(two_files, teacher_mode="ema", finetune_from_ema=True), mesh)
    assert_same(start.params, file_params["ema"])
    assert start.teacher_source is None  # the EMA teacher copies it: the same weights


def test_an_explicit_file_starts_every_copy(two_files, mesh, file_params):
    start = load(run_config(two_files, teacher_mode="ema", weights="ema"), mesh)
    assert_same(start.params, file_params["ema"])
    assert start.teacher_source is None


def test_a_full_resume_reads_one_file_only(two_files, mesh, file_params):
    start = load(run_config(two_files, teacher_mode="ema"), mesh, full_resume=True)
    assert start.teacher_source is None  # the checkpoint brings the teacher


def test_a_lora_resume_reads_its_base_from_the_file_its_first_launch_used(
    two_files, mesh, file_params
):
    """finetune_from_ema with LoRA: the base is ema.safetensors at the first launch, and again
    at a resume (the checkpoint holds adapters only); the recorded identity names it both times."""
    config = run_config(
        two_files, lora_rank=4, lora_targets=".*", teacher_mode="ema", finetune_from_ema=True
    )
    first = load(config, mesh)
    resumed = load(config, mesh, full_resume=True)
    assert_same(first.params, file_params["ema"])
    assert_same(resumed.params, file_params["ema"])
    assert first.base == resumed.base == init_weights.base_identity(config)
    assert first.base["weights"] == "ema"


def test_file_choice_with_one_file_and_errors(two_files, tmp_path):
    only_ema = tmp_path / "only_ema"
    toy_model.write_toy_model(only_ema, dtype="fp32", weights_name="ema")
    assert hf_load.initial_weights(only_ema) == hf_load.InitialWeights("ema", "ema", "ema")
    only_model = tmp_path / "only_model"
    toy_model.write_toy_model(only_model, dtype="fp32", weights_name="model")
    assert hf_load.initial_weights(only_model) == hf_load.InitialWeights("model", "model", "model")
    assert hf_load.initial_weights(two_files, finetune_from_ema=True) == hf_load.InitialWeights(
        "ema", "ema", "model"
    )
    with pytest.raises(
        hf_layout.HFCheckpointError, match="finetune_from_ema=True .*ema.safetensors"
    ):
        hf_load.initial_weights(only_model, finetune_from_ema=True)
    with pytest.raises(hf_layout.HFCheckpointError, match="weights='model'"):
        hf_load.initial_weights(two_files, "model", finetune_from_ema=True)
    with pytest.raises(hf_layout.HFCheckpointError, match="no weights found"):
        hf_load.initial_weights(tmp_path, "auto")


def test_resume_model_only(two_files, mesh, file_params, tmp_path):
    """From a checkpoint: student = its params (its EMA with finetune_from_ema), EMA teacher =
    its EMA; the fixed teacher stays the HF model file."""
    params = jax.tree.map(lambda x: x + 1.0, file_params["model"])
    ema = jax.tree.map(lambda x: x - 1.0, file_params["model"])
    config = run_config(two_files, teacher_mode="ema")
    state = train_step.init_state(
        params, train_step.make_optimizer(config), "ema", jax.random.key(0), teacher_source=ema
    )
    checkpoints = tmp_path / "checkpoints"
    with Checkpointer(checkpoints, save_every=1) as checkpointer:
        checkpointer.save(1, state, data_state=None, config=config.to_dict(), force=True)
    resume = dict(resume_from=str(checkpoints), resume_model_only=True)

    start = load(run_config(two_files, teacher_mode="ema", **resume), mesh)
    assert_same(start.params, params)
    assert_same(start.teacher_source, ema)

    start = load(run_config(two_files, teacher_mode="ema", finetune_from_ema=True, **resume), mesh)
    assert_same(start.params, ema)
    assert start.teacher_source is None

    start = load(run_config(two_files, teacher_mode="fixed", **resume), mesh)
    assert_same(start.params, params)
    assert_same(start.teacher_source, file_params["model"])

    # A run saved with a fixed teacher has no EMA to fine-tune from.
    fixed = train_step.init_state(
        params, train_step.make_optimizer(config), "fixed", jax.random.key(0), teacher_source=ema
    )
    fixed_checkpoints = tmp_path / "fixed"
    with Checkpointer(fixed_checkpoints, save_every=1) as checkpointer:
        checkpointer.save(1, fixed, data_state=None, config={"teacher_mode": "fixed"}, force=True)
    with pytest.raises(ValueError, match="teacher_mode='fixed', so it has no EMA weights"):
        load(
            run_config(
                two_files,
                teacher_mode="ema",
                finetune_from_ema=True,
                resume_from=str(fixed_checkpoints),
                resume_model_only=True,
            ),
            mesh,
        )
