"""The trainer's log of finished steps (opsd_jax/trainer/step_log.py): where an evaluation's
scalars land, and the window a stopping run writes before it exits."""

import json
import types

import jax.numpy as jnp

from opsd_jax import run_config
from opsd_jax.trainer.step_log import DispatchedStep, StepLog
from opsd_jax.training.metrics import MetricsLogger


def step(number, eval_accuracy=None):
    done = DispatchedStep(
        step=number,
        metrics={"loss": jnp.float32(number), "nonfinite": jnp.float32(0), "bad_steps": 0},
        scalars={},
        pids=[],
        tokens=10,
        model_flops=0.0,
        data_state=None,
        completion=None,
    )
    if eval_accuracy is not None:
        done.eval_scalars["eval/accuracy"] = eval_accuracy
    return done


def test_an_evaluation_is_logged_at_its_own_step_and_a_stop_writes_its_window(tmp_path):
    """log_every=2, evaluations after steps 1 and 2: step 1's is written at step 1 (not
    averaged into step 2's window), step 2's in step 2's record; a run stopping after step 3
    writes step 3's window (force), which a resume would otherwise never log."""
    config = run_config.complete(
        dict(results_dir=str(tmp_path), total_steps=6, log_every=2, progress_bar=False)
    )
    logger = MetricsLogger(str(tmp_path), total_steps=6, log_every=2, progress_bar=False)
    start = types.SimpleNamespace(
        tokenizer=None,
        lora_base=None,
        teacher_identities=[],
        split=types.SimpleNamespace(teacher="ema"),
        start_step=0,
    )
    log = StepLog(config, logger, None, str(tmp_path / "checkpoints"), start, None, None)
    state = None  # finish reads it only to save past max_consecutive_bad_steps
    log.finish(step(1, eval_accuracy=0.5), state)
    log.finish(step(2, eval_accuracy=0.25), state)
    log.finish(step(3), state, flush=True)
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    assert evals == [(1, 0.5), (2, 0.25)]
    assert [(r["step"], r["loss"]) for r in records if "loss" in r] == [(2, 1.5), (3, 3.0)]
