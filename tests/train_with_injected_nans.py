"""train.py with non-finite values injected at chosen steps (a test helper, not a test module).

    OPSD_INJECT="2:grads,4:loss" python tests/train_with_injected_nans.py --config ...

Runs train.py's own `main` unchanged; only the loss the train step is built from is wrapped:
at each listed step every micro-batch gives NaN gradients with a finite loss ('grads') or an
infinite loss ('loss'), the two ways a real step goes bad. The compiled step reads the step
number from its state, so the injection is part of the one program compiled before step 1,
and "[inject] step N: kind" is printed from the device as the step runs. Kept out of the
product: train.py has no injection hook.
"""

import os

import jax
import jax.numpy as jnp
from absl import app
from jax.sharding import NamedSharding, PartitionSpec

import train
from opsd_jax import run_config
from opsd_jax.training import train_step


def _injections() -> dict[int, str]:
    plan = {}
    for item in filter(None, os.environ.get("OPSD_INJECT", "").split(",")):
        step, kind = item.split(":")
        if kind not in ("grads", "loss"):
            raise ValueError(f"OPSD_INJECT: unknown kind {kind!r} (allowed: grads, loss)")
        plan[int(step)] = kind
    return plan


@jax.custom_vjp
def _nan_gradient(x):
    """0, whose gradient is NaN wherever a non-zero cotangent reaches it."""
    return jnp.zeros((), x.dtype)


def _nan_gradient_fwd(x):
    return _nan_gradient(x), x


def _nan_gradient_bwd(x, g):
    return (jnp.where(g != 0, jnp.full_like(x, jnp.nan), jnp.zeros_like(x)),)


_nan_gradient.defvjp(_nan_gradient_fwd, _nan_gradient_bwd)


def _make_poisoned_train_step(loss_fn, optimizer, **kwargs):
    plan = _injections()
    if not plan:  # then this is plain train.py, and a test relying on it would prove nothing
        raise SystemExit(
            "OPSD_INJECT is empty: give the steps to poison, e.g. OPSD_INJECT='2:grads,4:loss'"
        )
    steps = {
        kind: jnp.array([s for s, k in plan.items() if k == kind] or [-1])
        for kind in ("grads", "loss")
    }
    current = {}  # the step being traced (a tracer of the outer function below)

    def poisoned_loss(params, teacher_params, packs):
        loss, metrics = loss_fn(params, teacher_params, packs)
        step = current["step"] + 1
        first = jax.tree.leaves(params)[0]
        loss = loss + jnp.where(jnp.isin(step, steps["grads"]), _nan_gradient(first), 0.0)
        bad_loss = jnp.where(jnp.isin(step, steps["loss"]), jnp.inf, 0.0)
        return loss + bad_loss, dict(metrics, loss=metrics["loss"] + bad_loss)

    inner = _real_make_train_step(poisoned_loss, optimizer, **kwargs)

    def report(step):
        kind = plan.get(int(step) + 1)
        if kind:
            print(f"[inject] step {int(step) + 1}: {kind}", flush=True)

    def train_step_with_injections(state, micro_batches):
        current["step"] = state.step
        jax.debug.callback(report, state.step, ordered=True)
        return inner(state, micro_batches)

    shardings = kwargs.get("state_shardings")
    out_shardings = None
    if shardings is not None:
        mesh = jax.tree.leaves(shardings)[0].mesh
        out_shardings = (shardings, NamedSharding(mesh, PartitionSpec()))
    return jax.jit(train_step_with_injections, donate_argnums=(0,), out_shardings=out_shardings)


_real_make_train_step = train_step.make_train_step
train_step.make_train_step = _make_poisoned_train_step

if __name__ == "__main__":
    app.run(train.run, flags_parser=run_config.parse_flags)
