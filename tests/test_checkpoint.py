"""Checkpoints: exact round trip, resharding onto another mesh, completeness, pruning, errors.

Why these: a resumed run must continue from bit-identical state (params, EMA teacher, optimizer
moments, step, rng, data position), possibly on a different mesh shape; a save cut short must
never be picked up; and failures must say where they looked. One real checkpoint of the tiny
BAGEL TrainState (FSDP-sharded over 8 devices, one optimizer step taken, ViT frozen so the
optax state covers only part of the params) is shared by most tests, since orbax is slow on 2
cores.
"""

import os

import builders
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from models.bagel import Bagel
from models.configs import BagelConfig
from opsd_jax import run_config
from opsd_jax.io import checkpoint as ckpt_lib
from opsd_jax.io import saved_items
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.trainer import start
from opsd_jax.training import train_step

SAVE_STEP = 10
DATA_STATE = {"grain": {"next_index": 37}, "skipped": {"bad_json": 2}, "num_yielded": 35}
CONFIG = {"teacher_mode": "ema", "lr": 1e-5, "freeze_vit": True, "name": "run", "shape": [2, 4]}


def _optimizer_config():
    # No warmup: the first step already moves the params, so the EMA differs from them.
    return run_config.complete(
        {
            "lr": 1e-3,
            "min_lr": 1e-4,
            "warmup_steps": 0,
            "total_steps": 10,
            "eps": 1e-8,
            "freeze_vit": True,
        }
    )


def _abstract_params(mesh):
    make_model = lambda: Bagel(BagelConfig.tiny(), rngs=nnx.Rngs(0))  # noqa: E731
    _, abstract = mesh_lib.abstract_model(make_model, mesh)
    params, _ = nnx.split_state(abstract, nnx.Param, ...)
    return params


def _random_like(abstract, seed):
    # Random values placed straight into the target shardings: the same sharded nnx.State a
    # created model gives, without compiling the model's init.
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: jax.device_put(rng.standard_normal(s.shape).astype(s.dtype), s.sharding),
        abstract,
    )


def _host(tree):
    """Every leaf on the host (rng keys as their key data), to compare after donation."""
    return jax.tree.map(
        lambda x: np.asarray(
            jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        ),
        tree,
    )


def _assert_same(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
        assert np.array_equal(a, b), jax.tree_util.keystr(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of a perturbed, 8-way FSDP-sharded TrainState, and what it should hold."""
    mesh = mesh_lib.make_mesh()
    params = _random_like(_abstract_params(mesh), seed=0)
    optimizer = train_step.make_optimizer(_optimizer_config())
    frozen = train_step.frozen_groups(_optimizer_config())
    state = train_step.init_state(params, optimizer, "ema", jax.random.key(0), frozen=frozen)
    apply_update = train_step.make_apply_update(optimizer, "ema", ema_decay=0.5, frozen=frozen)
    trainable, _ = train_step.split_params(params, frozen)
    grads = _random_like(ckpt_lib.abstract_like(trainable), seed=1)
    state, _ = apply_update(state, grads, 1)  # moments, count, EMA != params, step 1
    abstract = ckpt_lib.abstract_like(state)
    expected = _host(state)

    directory = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    checkpointer = ckpt_lib.Checkpointer(directory, save_every=SAVE_STEP)
    assert checkpointer.save(SAVE_STEP, state, data_state=DATA_STATE, config=CONFIG)
    # The async save must have copied the arrays off the devices before returning: the next
    # step donates (deletes) these very buffers while the files are still being written.
    leaf = jax.tree.leaves(state.params)[0]
    state, _ = apply_update(state, grads, 1)
    with pytest.raises(RuntimeError, match="deleted or donated"):
        np.asarray(leaf)
    checkpointer.wait_until_finished()
    yield {
        "dir": directory,
        "checkpointer": checkpointer,
        "abstract": abstract,
        "expected": expected,
    }
    checkpointer.close()


def test_round_trip_is_bit_identical(saved):
    checkpointer = saved["checkpointer"]
    assert checkpointer.latest_step() == SAVE_STEP
    state, data_state, config = checkpointer.restore(saved["abstract"])
    _assert_same(_host(state), saved["expected"])
    assert isinstance(state.params, nnx.State)
    assert state.rng.dtype == jax.random.key(0).dtype
    assert int(state.step) == 1
    assert data_state == DATA_STATE
    assert config == CONFIG
    # Same placement as saved.
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(saved["abstract"])):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
    # Not a save step / already saved: nothing written, nothing raised.
    assert not checkpointer.should_save(SAVE_STEP + 1)
    assert not checkpointer.save(SAVE_STEP + 1, state, data_state=None, config=CONFIG)
    assert not checkpointer.save(SAVE_STEP, state, data_state=None, config=CONFIG, force=True)
    assert checkpointer.all_steps() == [SAVE_STEP]


def test_restore_onto_another_mesh_shape(saved):
    mesh = mesh_lib.make_mesh(num_replicate=2)  # 2 data x 4 fsdp, saved from 1 x 8
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1}

    def on_new_mesh(x):
        sharding = x.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(mesh, sharding.spec)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    target = jax.tree.map(on_new_mesh, saved["abstract"])
    target = target.replace(params=_abstract_params(mesh), teacher_params=_abstract_params(mesh))
    state, _, _ = saved["checkpointer"].restore(target, step=SAVE_STEP, directory=saved["dir"])
    _assert_same(_host(state), saved["expected"])
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(target)):
        assert got.sharding == want.sharding
    embed = state.params["language_model"]["embed_tokens"].get_value()
    assert embed.sharding.mesh.shape == mesh.shape
    assert embed.sharding.shard_shape(embed.shape)[1] == embed.shape[1] // 4


def test_restore_model_params(saved):
    abstract = saved["abstract"]
    step_dir = saved["dir"] / str(SAVE_STEP)
    params = saved_items.restore_model_params(saved["dir"], abstract.params)
    _assert_same(_host(params), saved["expected"].params)
    ema = saved_items.restore_model_params(step_dir, abstract.params, which="ema_params")
    _assert_same(_host(ema), saved["expected"].teacher_params)
    assert not np.array_equal(  # the two items really are different arrays
        params["language_model"]["lm_head"].get_value(),
        ema["language_model"]["lm_head"].get_value(),
    )


def test_mismatched_target_names_the_difference(saved):
    params = nnx.to_pure_dict(saved["abstract"].params)
    del params["connector"]
    params["extra"] = jax.ShapeDtypeStruct((3,), jnp.float32, sharding=_replicated())
    head = params["language_model"]["lm_head"]
    params["language_model"]["lm_head"] = jax.ShapeDtypeStruct(
        (head.shape[0], 2 * head.shape[1]), head.dtype, sharding=head.sharding
    )
    with pytest.raises(ckpt_lib.CheckpointError) as error:
        saved_items.restore_model_params(saved["dir"], params)
    message = str(error.value)
    assert "missing in the checkpoint: ['extra']" in message
    assert "not in the target: ['connector/fc1/bias'" in message
    assert "language_model/lm_head: saved (64, 1024), target (64, 2048)" in message


def _replicated():
    return NamedSharding(mesh_lib.make_mesh(), jax.sharding.PartitionSpec())


def test_latest_step_skips_incomplete_and_old_steps_are_pruned(tmp_path):
    directory = tmp_path / "run"
    checkpointer = ckpt_lib.Checkpointer(directory, save_every=1, max_to_keep=2)
    for step in (1, 2, 3):
        assert checkpointer.save(
            step, builders.small_train_state(step), data_state=None, config={"s": step}
        )
    checkpointer.wait_until_finished()
    assert checkpointer.latest_step() == 3
    assert sorted(p.name for p in directory.iterdir()) == ["2", "3"]  # step 1 pruned

    # A save cut short (orbax's temporary directory, never renamed) and a newer step directory
    # without orbax's commit marker (e.g. a partial copy): neither may be picked up.
    (directory / f"4{ckpt_lib.TMP_MARKER}" / "params").mkdir(parents=True)
    (directory / "5" / "params").mkdir(parents=True)
    assert (directory / "3" / ckpt_lib.COMMIT_MARKER).exists()
    assert checkpointer.latest_step() == 3
    abstract = ckpt_lib.abstract_like(builders.small_train_state(0))
    state, data_state, config = checkpointer.restore(abstract)
    assert int(state.step) == 3 and config == {"s": 3} and data_state is None
    np.testing.assert_array_equal(state.params["w"], np.full((4, 2), 3.0))
    np.testing.assert_array_equal(state.opt_state[0], np.full((4, 2), -3.0))
    np.testing.assert_array_equal(
        jax.random.key_data(state.rng), jax.random.key_data(jax.random.key(3))
    )
    with pytest.raises(FileNotFoundError, match=r"5 is an incomplete checkpoint"):
        checkpointer.restore(abstract, step=5)
    with pytest.raises(FileNotFoundError, match=r"incomplete"):
        saved_items.restore_model_params(directory / "5", abstract.params)
    checkpointer.close()

    # A restarted run sees the same latest step.
    with ckpt_lib.Checkpointer(directory, save_every=1) as restarted:
        assert restarted.latest_step() == 3


def test_the_count_of_non_finite_steps_in_a_row_is_resumed(tmp_path):
    """A run stopped (preempted) two bad steps into a streak resumes two into it, so it stops
    where the uninterrupted run would (max_consecutive_bad_steps)."""
    state = builders.small_train_state(3.0)
    state = state.replace(bad_steps=jax.device_put(np.int32(2), state.step.sharding))
    with ckpt_lib.Checkpointer(tmp_path / "run", save_every=1) as checkpointer:
        checkpointer.save(3, state, data_state=None, config={})
        checkpointer.wait_until_finished()
        restored, _, _ = checkpointer.restore(ckpt_lib.abstract_like(builders.small_train_state(0)))
    assert int(restored.bad_steps) == 2


def test_a_start_before_steps_its_directory_already_holds_is_refused(tmp_path, capsys):
    """A fresh start, or a resume of an older step, over a directory with later steps: their
    saves would be skipped (a step already saved is not saved again) and the next resume would
    go back to the old steps. The start is refused; a start at or after the newest step is not."""
    directory = tmp_path / "run" / "checkpoints"
    with ckpt_lib.Checkpointer(directory, save_every=1, max_to_keep=5) as checkpointer:
        for step in (1, 2, 3):
            checkpointer.save(step, builders.small_train_state(step), data_state=None, config={})
        checkpointer.wait_until_finished()
        assert not checkpointer.save(
            2, builders.small_train_state(20), data_state=None, config={}, force=True
        )
        for resumed, later in ((None, "1, 2, 3"), (str(directory / "1"), "2, 3")):
            with pytest.raises(SystemExit) as exited:
                start.check_no_later_steps(checkpointer, str(directory), resumed)
            assert exited.value.code == 2
            assert f"already holds step(s) {later}, after this run's start" in (
                capsys.readouterr().err
            )
        for resumed in (str(directory), str(directory / "3")):
            start.check_no_later_steps(checkpointer, str(directory), resumed)
    with ckpt_lib.Checkpointer(tmp_path / "empty", save_every=1) as fresh:
        start.check_no_later_steps(fresh, str(tmp_path / "empty"), str(directory / "1"))


def test_errors_name_the_directory_and_the_steps(tmp_path, saved):
    empty = tmp_path / "empty"
    with ckpt_lib.Checkpointer(empty, save_every=1) as checkpointer:
        assert checkpointer.latest_step() is None
        with pytest.raises(FileNotFoundError, match=f"no complete checkpoint in {empty}"):
            checkpointer.restore(saved["abstract"])
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match=f"{missing} does not exist"):
        saved_items.restore_model_params(missing, saved["abstract"].params)
    with pytest.raises(FileNotFoundError, match=rf"no checkpoint for step 7; .*\[{SAVE_STEP}\]"):
        saved["checkpointer"].restore(saved["abstract"], step=7)
    # A teacher-less target restores from a checkpoint with a teacher (the item is skipped)...
    no_teacher = saved["abstract"].replace(teacher_params=None)
    state, _, _ = saved["checkpointer"].restore(no_teacher)
    assert state.teacher_params is None
    # ... but not the other way round.
    small = tmp_path / "small"
    with ckpt_lib.Checkpointer(small, save_every=1) as checkpointer:
        checkpointer.save(1, builders.small_train_state(1), data_state=None, config={})
        checkpointer.wait_until_finished()
        target = ckpt_lib.abstract_like(builders.small_train_state(0))
        with pytest.raises(ckpt_lib.CheckpointError, match="no 'ema_params' item"):
            checkpointer.restore(target.replace(teacher_params=target.params))
    with pytest.raises(FileNotFoundError, match=r"no 'ema_params' item; it holds"):
        saved_items.restore_model_params(small, target.params, which="ema_params")
    assert os.path.isdir(small / "1" / "params")


def test_replica_parallel_saves_split_only_arrays_worth_splitting(tmp_path):
    """orbax writes an array held by R replicas as R slices, one jitted program per slice and
    device at the first save; for arrays of a few KB that is all compile and no gain (an
    8-device smoke run's first save compiled 86 of its 98 programs so). Under the size gate
    (ckpt_lib.MIN_REPLICA_SLICE_BYTES) a small replicated array is saved with nothing
    compiled; one whose slice per replica reaches it is still split across the replicas."""
    from jax import monitoring

    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kwargs: (
            compiles.append(event)
            if event == "/jax/core/compile/backend_compile_duration"
            else None
        )
    )
    sharding = _replicated()  # 8 replicas
    rows = 8  # divisible by the replicas, so orbax can split along it
    small = np.arange(rows * 6, dtype=np.float32).reshape(rows, 6)  # 24 B per replica
    large_cols = ckpt_lib.MIN_REPLICA_SLICE_BYTES // 4  # exactly the gate per replica
    large = np.ones((rows, large_cols), np.float32)

    def compiles_in_save(step, params):
        state = builders.small_train_state(step).replace(
            params={k: jax.device_put(v, sharding) for k, v in params.items()}
        )
        before = len(compiles)
        with ckpt_lib.Checkpointer(tmp_path / f"run{step}", save_every=1) as checkpointer:
            assert checkpointer.save(step, state, data_state=None, config={})
            checkpointer.wait_until_finished()
        return len(compiles) - before

    assert compiles_in_save(1, {"small": small}) == 0
    assert compiles_in_save(2, {"large": large}) >= 2  # a slice per replica, each compiled
