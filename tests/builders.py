"""The tests' short way to a run's objects: each at the defaults of configs/common.py (through
opsd_jax/run_config, as a run makes it), with the fields a test names changed."""

import dataclasses

from opsd_jax import run_config


def loss_settings(**changes):
    """A LossSettings at the defaults, `changes` (its own field names) applied."""
    return dataclasses.replace(run_config.loss_settings({}), **changes)


def prompt_options(**changes):
    """PromptOptions at the defaults (our wording), `changes` applied."""
    return dataclasses.replace(run_config.prompt_options({}), **changes)


def data_fields(**changes) -> dict:
    """The DataConfig fields a run config sets, at the defaults (no datasets), `changes` applied."""
    return dict(run_config.data_fields({}), **changes)


def data_config(datasets, **changes):
    """A DataConfig of `datasets` (DatasetSpecs or dicts; paths are not checked) at the defaults."""
    from opsd_jax.data.data_config import DataConfig

    return DataConfig.from_dict(dict(data_fields(**changes), datasets=list(datasets)))


def offline_grad_step(graphdef, rest, settings):
    """jit(params, pack, cache) -> (grads, metrics) of one offline micro-batch: the train
    step's offline loss differentiated alone (the optimizer left out)."""
    import jax

    from opsd_jax.training import train_step

    loss_fn = train_step.make_offline_loss(graphdef, rest, settings)

    @jax.jit
    def grad_step(params, pack, cache):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, None, (pack, cache))
        return grads, metrics

    return grad_step


def refuse_loads(monkeypatch, check: str, *targets) -> None:
    """Replace each (module, name) in `targets` by a function that fails the test if called:
    a script's `check` must stop it before any of these loads."""

    def refused(*args, **kwargs):
        raise AssertionError(f"loaded before {check} was checked")

    for module, name in targets:
        monkeypatch.setattr(module, name, refused)


def small_train_state(value: float):
    """A tiny replicated TrainState (a [4, 2] param, its negation as the optimizer state, the
    step and the rng key from `value`) for checkpoint tests that are not about the model."""
    import jax
    import numpy as np

    from opsd_jax.parallel import mesh as mesh_lib
    from opsd_jax.training import train_step

    replicated = jax.sharding.NamedSharding(mesh_lib.make_mesh(), jax.sharding.PartitionSpec())
    put = lambda x: jax.device_put(np.asarray(x, np.float32), replicated)  # noqa: E731
    return train_step.TrainState(
        step=jax.device_put(np.int32(value), replicated),
        params={"w": put(np.full((4, 2), value))},
        opt_state=(put(np.full((4, 2), -value)),),
        teacher_params=None,
        rng=jax.random.key(int(value)),
        bad_steps=jax.device_put(np.int32(0), replicated),
    )
