"""train.py with non-finite values injected at chosen steps (a test helper, not a test module).

    OPSD_INJECT="2:grads,4:loss" python tests/train_with_injected_nans.py --config ...

Runs train.py's own `main` unchanged; only the OPSD grad step is wrapped: at each listed step
its first micro-batch returns NaN gradients ('grads') or an infinite loss ('loss'), the two ways
a real step goes bad. Kept out of the product: train.py has no injection hook.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
from absl import app

import train
from opsd_jax import train_step


def _injections() -> dict[int, str]:
    plan = {}
    for item in filter(None, os.environ.get("OPSD_INJECT", "").split(",")):
        step, kind = item.split(":")
        if kind not in ("grads", "loss"):
            raise ValueError(f"OPSD_INJECT: unknown kind {kind!r} (allowed: grads, loss)")
        plan[int(step)] = kind
    return plan


def _make_poisoned_grad_step(*args, **kwargs):
    grad_step = _real_make_grad_step(*args, **kwargs)
    config = train._CONFIG.value
    plan, accum = _injections(), config.gradient_accumulation_steps
    # Calls are mapped to steps from 0, so the run must not resume from a checkpoint.
    checkpoints = config.checkpoint_dir or os.path.join(config.results_dir, "checkpoints")
    assert not (os.path.isdir(checkpoints) and os.listdir(checkpoints)), (
        f"OPSD_INJECT needs a fresh run, but {checkpoints} holds checkpoints"
    )
    calls = [0]

    def poisoned(*step_args):
        grads, metrics = grad_step(*step_args)
        step, micro = divmod(calls[0], accum)  # a fresh run: call i is step i // accum + 1
        calls[0] += 1
        kind = plan.get(step + 1) if micro == 0 else None
        if kind:
            print(f"[inject] step {step + 1}: {kind}", flush=True)
        if kind == "grads":
            grads = jax.tree.map(lambda g: g * jnp.nan, grads)
        elif kind == "loss":
            metrics = dict(metrics, loss=metrics["loss"] + jnp.inf)
        return grads, metrics

    return poisoned


_real_make_grad_step = train_step.make_grad_step
train_step.make_grad_step = _make_poisoned_grad_step

if __name__ == "__main__":
    app.run(train.main, flags_parser=train.parse_flags)
