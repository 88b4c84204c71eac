"""LoRA training (lora_rank > 0): the step trains the adapters alone over a frozen base held
once, the teachers are base + their own adapters, checkpoints hold adapters and name their
base, and train.py resumes a LoRA run (taught by another checkpoint) bit-identically and refuses
a changed base or teacher in one line."""

import json
import re
import shutil

import builders
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from conftest import run_python
from flax import nnx
from test_teacher_checkpoint import write_deeper_teacher
from test_train_cli import assert_same_params
from test_train_step import COMPLETIONS, SAMPLES, fixed_packs, optim_config, stacked

from models import lora
from models.bagel import Bagel
from models.configs import BagelConfig
from opsd_jax import run_config
from opsd_jax.evaluation import model_loader
from opsd_jax.io import hf_load, teacher_checkpoint
from opsd_jax.io.safetensors_io import WeightDirectory
from opsd_jax.parallel import device_memory
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.training import train_step
from scripts import convert_hf

RANK, ALPHA, DECAY = 4, 8.0, 0.5


def lora_config(**changes):
    values = dict(lora_rank=RANK, lora_alpha=ALPHA, lora_targets=".*", compute_dtype="float32")
    return optim_config(**dict(values, **changes))


def lora_state(config, mode):
    """(graphdef, rest, optimizer, TrainState) of the tiny model with the config's adapters."""
    model = Bagel(
        BagelConfig.tiny(llm=dict(compute_dtype="float32", remat="none")), rngs=nnx.Rngs(0)
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    mesh = mesh_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    graphdef, params, rest = run_config.with_adapters(graphdef, params, rest, config, mesh)
    with config.unlocked():
        config.teacher_mode = mode
    optimizer = train_step.make_optimizer(config)
    state = run_config.init_train_state(config, optimizer, (), params)
    return graphdef, rest, optimizer, state


def flat(tree) -> dict:
    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(tree)}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ema", "fixed"])
def test_a_lora_step_moves_the_adapters_alone_and_the_teacher_is_base_plus_its_own(mode):
    config = lora_config()
    graphdef, rest, optimizer, state = lora_state(config, mode)
    adapters, base = flat(state.params), flat(state.base)
    assert adapters and all("/lora/lora_" in path for path in adapters)
    assert not any("lora" in path for path in base)
    assert {path.split("/")[0] for path in adapters} == {"language_model", "vit_model", "connector"}
    # Optimizer moments exist for the adapters only (two per adapter entry, plus counters).
    moments = sum(x.size for x in jax.tree.leaves(state.opt_state))
    assert 2 * sum(a.size for a in adapters.values()) <= moments
    assert moments <= 2 * sum(a.size for a in adapters.values()) + 16

    loss_fn = train_step.make_opsd_loss(graphdef, rest, builders.loss_settings(num_samples=2), mode)
    step = train_step.make_train_step(
        loss_fn,
        optimizer,
        teacher_mode=mode,
        ema_decay=DECAY,
        schedule=train_step.learning_rate_schedule(config),
    )
    micro = stacked(fixed_packs(SAMPLES[:2], COMPLETIONS[:2]))
    # At the start (B = 0) the adapted student is the base model: the loss a model without
    # adapters gives on the same packs.
    plain = Bagel(
        BagelConfig.tiny(llm=dict(compute_dtype="float32", remat="none")), rngs=nnx.Rngs(0)
    )
    plain_graphdef, plain_params, plain_rest = nnx.split(plain, nnx.Param, ...)
    plain_loss = train_step.make_opsd_loss(
        plain_graphdef, plain_rest, builders.loss_settings(num_samples=2), "self"
    )
    one = tuple(jax.tree.map(lambda x: x[0], p) for p in micro)
    expected, _ = plain_loss(plain_params, None, one)
    teacher_before = flat(state.teacher_params)
    state, metrics = step(state, micro)
    np.testing.assert_allclose(float(metrics["loss"]), float(expected), rtol=1e-5)
    assert float(metrics["grad_norm"]) > 0 and float(metrics["nonfinite"]) == 0
    for path, value in flat(state.base).items():  # frozen: bit-identical
        np.testing.assert_array_equal(value, base[path], err_msg=path)
    after = flat(state.params)
    assert any(not np.array_equal(after[p], adapters[p]) for p in adapters if "lora_b" in p)
    teacher = flat(state.teacher_params)
    assert set(teacher) == set(adapters)  # the teacher keeps adapters, not a model copy
    for path in adapters:
        if mode == "ema":  # phi <- d * phi + (1 - d) * theta, on the adapters
            want = DECAY * teacher_before[path] + (1 - DECAY) * after[path]
            np.testing.assert_allclose(teacher[path], want, rtol=1e-6, atol=1e-7, err_msg=path)
        else:  # fixed: the initial adapters, for good
            np.testing.assert_array_equal(teacher[path], teacher_before[path], err_msg=path)


def test_the_base_is_held_in_the_compute_dtype_and_the_model_is_the_merged_one():
    """base in bf16 (held once, shared); model_params = adapters over it, and its forward is
    the merged model's (W + (alpha / r) A B): what the decode copy and the export compute."""
    config = lora_config(compute_dtype="bfloat16")
    graphdef, rest, _, state = lora_state(config, "self")
    assert {x.dtype for x in jax.tree.leaves(state.base)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    model = nnx.merge(graphdef, train_step.model_params(state.params, state.base), rest)
    assert lora.has_adapters(model) and not lora.has_adapters(lora.merged(model))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(lora_rank=-1), "lora_rank=-1: must be an integer >= 0"),
        (dict(lora_alpha=0.0), "lora_alpha=0.0: must be > 0"),
        (dict(lora_targets="(q|k"), "lora_targets='(q|k': not a regular expression"),
        (dict(freeze_vit=True), "freeze_vit=True with lora_rank=4"),
        (
            dict(resume_from="/tmp", resume_model_only=True),
            "resume_model_only=True with lora_rank=4",
        ),
    ],
)
def test_bad_lora_values_are_named(changes, message):
    config = run_config.complete(dict(dict(lora_rank=4, toy_data=True), **changes))
    with pytest.raises(run_config.ConfigError, match=message.replace("(", r"\(")):
        run_config.validate(config, check_files=False)


def test_targets_that_match_nothing_are_named_with_the_model_paths():
    config = run_config.complete(dict(lora_rank=4, lora_targets="language_model/attn/.*"))
    with pytest.raises(ValueError, match="matches no projection of the model"):
        run_config.lora_target_paths(config, BagelConfig.tiny())
    assert len(run_config.lora_target_paths(run_config.complete({}), BagelConfig.tiny())) == 7


# configs/smoke.py with LoRA adapters, as the resumed runs here and in
# tests/test_teacher_by_source.py train it: a checkpoint every 2 steps, every step logged.
LORA_RUN = [
    "configs/smoke.py",
    "--config.progress_bar=False",
    "--config.lora_rank=4",
    "--config.lora_targets=.*",
    "--config.save_every=2",
    "--config.log_every=1",
    "--config.lr_scheduler=constant",
    "--config.warmup_steps=0",
]


@pytest.mark.slow
def test_a_lora_run_taught_by_another_checkpoint_resumes_bit_identically_and_refuses_changes(
    tmp_path,
):
    """A LoRA run taught by a three-layer checkpoint of other weights (one run for both: each
    train.py launch compiles its own programs, and a launch pair costs most of a minute on two
    cores). The checkpoint holds the adapters alone and names the base and the teacher; another
    base or another teacher is refused in one line; the resumed run's params equal the straight
    run's; the export merges the adapters into the base. A LoRA run with an EMA teacher resumes
    the same way in tests/test_teacher_by_source.py (its EMA teacher of one source), and full
    fine-tuning with an EMA teacher in tests/test_train_cli.py."""
    teacher = write_deeper_teacher(tmp_path / "teacher")

    def train(results_dir, *overrides, teacher=teacher):
        return run_python(
            "train.py",
            "--config",
            *LORA_RUN,
            f"--config.results_dir={results_dir}",
            "--config.teacher_mode=checkpoint",
            f"--config.teacher_path={teacher}",
            "--config.total_steps=4",
            *overrides,
        )

    straight = train(tmp_path / "straight")
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    assert "LoRA: " in straight.stdout and "trainable adapter parameters" in straight.stdout
    assert "frozen in float32 (not saved)" in straight.stdout
    assert "3 layers, hidden" in straight.stdout

    # A run stopped after its step-2 save: the straight run's step 2 alone, relaunched on the
    # same model and toy data.
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "2", tmp_path / "resumed/checkpoints/2")
    shutil.copytree(tmp_path / "straight" / "toy", tmp_path / "resumed" / "toy")
    student = tmp_path / "straight" / "toy" / "model"
    same_model = f"--config.model_path={student}"
    step_dir = tmp_path / "resumed" / "checkpoints" / "2"
    # The checkpoint holds the adapters alone and names the base they apply to and the teacher
    # (never saved itself).
    meta = json.loads((step_dir / "meta" / "metadata").read_text())
    assert (
        meta["lora_base"]["weights"] in ("ema", "model") and len(meta["lora_base"]["digest"]) == 64
    )
    assert meta["teacher_checkpoints"] == [teacher_checkpoint.identity(teacher)]
    assert "ema_params" not in meta["items"]
    params_meta = json.loads((step_dir / "params" / "_METADATA").read_text())
    keys = list(params_meta["tree_metadata"])
    assert keys and all("lora" in key for key in keys), keys[:5]

    # Another base at the same path (one weight changed): refused in one line, nothing run.
    weights = next(student.glob("*.safetensors"))
    original = weights.read_bytes()
    changed = bytearray(original)
    changed[-3] ^= 0xFF  # the last tensor's bytes: the header stays valid
    weights.write_bytes(bytes(changed))
    refused = train(tmp_path / "resumed", same_model)
    weights.write_bytes(original)
    assert refused.returncode == 2  # a config error's code
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "its LoRA adapters were trained on" in lines[0], refused.stderr
    assert "step 3/" not in refused.stdout

    # Another teacher (the student's own weights): refused in one line, nothing run.
    refused = train(tmp_path / "resumed", same_model, teacher=student)
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "its run was taught by" in lines[0], refused.stderr
    assert "step 3/" not in refused.stdout

    resumed = train(tmp_path / "resumed", same_model)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout
    assert_same_params(
        tmp_path / "straight" / "checkpoints", tmp_path / "resumed" / "checkpoints", 4
    )
    # The export: the merged model in BAGEL's HF layout is base + (alpha / r) B A, computed
    # here in numpy from the source's weights and the adapters written alone (PEFT names).
    run = tmp_path / "resumed"
    for out, extra in (("hf", []), ("adapters", ["--adapters_only"])):
        ckpt, out = str(run / "checkpoints"), str(run / out)
        convert_hf.main(
            ["jax-to-hf", "--ckpt", ckpt, "--source", str(student), "--out", out, *extra]
        )
    config = json.loads((run / "adapters" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base"]["digest"] == meta["lora_base"]["digest"]
    adapters = safetensors.numpy.load_file(str(run / "adapters" / "adapter_model.safetensors"))
    base, merged = WeightDirectory(student), WeightDirectory(run / "hf")
    assert sorted(merged.keys()) == sorted(base.keys())
    scale = config["lora_alpha"] / config["r"]
    checked = 0
    for key in base.keys():
        module = key.removesuffix(".weight")
        a = adapters.get(f"base_model.model.{module}.lora_A.weight")
        w, m = base.array(key).astype(np.float64), merged.array(key).astype(np.float64)
        if a is None:
            np.testing.assert_array_equal(m, w, err_msg=key)  # not adapted: unchanged
            continue
        b = adapters[f"base_model.model.{module}.lora_B.weight"].astype(np.float64)
        want = w + scale * b @ a.astype(np.float64)
        # Written in the source's dtype: to its rounding (bf16: 2^-8 relative).
        rtol = 2.0**-8 if base.info(key).dtype == "BF16" else 1e-6
        np.testing.assert_allclose(m, want, rtol=rtol, atol=1e-7, err_msg=key)
        assert not np.allclose(m, w)  # trained adapters: the weight moved
        checked += 1
    assert checked == 2 * 7 + 2 * 6 + 1 + 2  # LM: 2 layers x 7; ViT: 2 x 6 + patch; connector

    # The evaluation scripts (--checkpoint, as the run's closing lines print) read the same
    # merged model: the export's weights, to the export's rounding to the source dtype.
    evaluated, _, _ = model_loader.load_model(checkpoint=str(run), compute_dtype="float32")
    exported, _, _ = hf_load.load_hf(
        run / "hf", config_changes={"llm": {"compute_dtype": "float32"}}
    )
    pairs = zip(
        nnx.to_flat_state(nnx.state(evaluated, nnx.Param)),
        nnx.to_flat_state(nnx.state(exported, nnx.Param)),
    )
    for (path, ours), (same_path, theirs) in pairs:
        assert path == same_path
        np.testing.assert_allclose(
            np.asarray(ours.get_value(), np.float32),
            np.asarray(theirs.get_value(), np.float32),
            rtol=2.0**-8,
            atol=1e-7,
            err_msg=str(path),
        )


def test_on_a_mesh_the_base_is_sharded_as_the_weights_and_the_adapters_replicated():
    """The layout the train step is compiled for, on 8 devices (fsdp): the frozen base keeps
    the weights' FSDP shards (a replicated base would hold the whole model on every device),
    the adapters and their optimizer moments and EMA are whole on every device (small; their
    gradient is one all-reduce)."""
    config = lora_config(compute_dtype="bfloat16", teacher_mode="ema")
    mesh = mesh_lib.make_mesh(1, None, 1)
    assert mesh.devices.size == 8

    def make():
        model = Bagel(BagelConfig.tiny(), rngs=nnx.Rngs(0))
        run_config.attach_adapters(model, config)
        return model

    _, abstract = mesh_lib.abstract_model(make, mesh)
    params, _ = nnx.split_state(abstract, nnx.Param, ...)
    _, _, state = run_config.abstract_train_state(config, params)
    weights = nnx.split_state(params, nnx.LoRAParam, ...)[1]
    for (path, b), w in zip(nnx.to_flat_state(state.base), jax.tree.leaves(weights)):
        assert b.dtype == jnp.bfloat16 and b.sharding == w.sharding, path
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.base))
    assert device_memory.bytes_per_device(state.base) < 0.3 * whole  # the kernels are split
    for tree in (state.params, state.teacher_params, state.opt_state):
        for x in jax.tree.leaves(tree):
            assert x.sharding.is_fully_replicated, x


@pytest.mark.parametrize("mode", ["self", "ema"])
def test_the_layer_loop_stacks_no_copy_of_the_frozen_base_for_the_teacher(mode):
    """A teacher that shares the student's weights ('self': all of them; 'ema' / 'fixed': the
    LoRA base) must read them, not what the student's forward wrote back into its Variables (the
    layer loop's outputs): the loop then stacked a bf16 copy of every layer's base weights for
    the teacher, 13 GiB per device of the one-GPU 7B recipe's step (15.99 GiB of temp buffers
    against 4.03 GiB, compiled for an H100). Read from the compiled CPU program: its layer loops
    build no array shaped like a stacked base weight (the adapters' gradients they do build)."""
    config = lora_config(compute_dtype="bfloat16", lora_targets=".*")
    model = Bagel(BagelConfig.tiny(llm=dict(remat="full", unroll_layers=False)), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    mesh = mesh_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    graphdef, params, rest = run_config.with_adapters(graphdef, params, rest, config, mesh)
    adapters, base = run_config.split_for_training(params, config)
    step = train_step.make_grad_step(graphdef, rest, builders.loss_settings(num_samples=2), mode)
    student, teacher = fixed_packs(SAMPLES[:2], COMPLETIONS[:2])
    teacher_params = None if mode == "self" else adapters
    text = step.lower(adapters, teacher_params, student, teacher, base).compile().as_text()
    stacked = {
        ",".join(map(str, x.shape)) for x in jax.tree.leaves(base) if x.ndim >= 3
    }  # [layers, in, out] kernels of the LM and the ViT
    assert "2,64,128" in stacked  # the LM's gate / up kernels, so the check can fail
    built = set(re.findall(r"= bf16\[([\d,]+)\]\{[^}]*\} dynamic-update-slice\(", text))
    assert not built & stacked, sorted(built & stacked)
    assert re.search(r"= f32\[[\d,]+\]\{[^}]*\} dynamic-update-slice\(", text)  # adapters' grads
