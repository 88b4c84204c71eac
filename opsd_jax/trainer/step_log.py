"""The step log: a dispatched step is logged once the next one is dispatched (the host never
waits on the step it just dispatched), with its held-out evaluation, the samples the fixed pack
rows cut or dropped, and its first completion's text; a non-finite step is named with its
samples, and past max_consecutive_bad_steps of them in a row the run saves and stops
(`TooManyBadSteps`). The checkpoint saves go through here too (with the data iterator's state
after the step, the config and, with LoRA, the base's identity).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from opsd_jax.data import pack_shapes
from opsd_jax.evaluation.run_summary import RunSummary
from opsd_jax.parallel import distributed
from opsd_jax.training import step_flops
from opsd_jax.training.metrics import MetricsLogger


@dataclasses.dataclass
class DispatchedStep:
    """A step dispatched to the devices and not yet logged (its metrics are still device
    arrays): `StepLog.finish` logs it once the next step is dispatched."""

    step: int  # the step number it completes (1-based)
    metrics: dict  # the compiled step's metrics (device scalars)
    scalars: dict  # host-side figures: packing, data, completions
    pids: list  # the samples it trained on (named when the step is non-finite)
    tokens: int  # real tokens packed, over all processes
    model_flops: float  # the step's analytic model FLOPs (step_flops), over all processes
    data_state: Any  # the data iterator after this step (saved with it)
    completion: Any  # the first sampled completion's token ids (OPSD), for the text log
    eval_scalars: dict = dataclasses.field(default_factory=dict)  # held-out evaluation at it


class TooManyBadSteps(RuntimeError):
    """More non-finite steps in a row than max_consecutive_bad_steps (the run saved first)."""

    def __init__(self, bad_steps, limit, step, checkpoint_dir, last_good_step):
        super().__init__(
            f"{bad_steps} consecutive steps with a non-finite loss or gradient (limit "
            f"max_consecutive_bad_steps={limit}); stopping. Saved step {step} in "
            f"{checkpoint_dir}: its params, optimizer state and EMA are those after step "
            f"{last_good_step}, the last good step. Lower lr or check the data (the skipped "
            f"samples are logged above)."
        )


def open_logger(config, start_step: int) -> MetricsLogger:
    """The run's metrics logger (its files under results_dir, W&B if wandb_project is set; on
    GPUs whose dense peak is known, the MFU)."""
    device = jax.devices()[0]
    peak = step_flops.dense_peak(device.device_kind) if device.platform == "gpu" else None
    return MetricsLogger(
        config.results_dir,
        total_steps=config.total_steps,
        log_every=config.log_every,
        start_step=start_step,
        progress_bar=config.progress_bar,
        is_main=distributed.is_main(),
        wandb=(
            dict(
                project=config.wandb_project,
                name=config.wandb_name or None,
                mode=config.wandb_mode,
                id=config.wandb_runid,
                resume=config.wandb_resume,
            )
            if config.wandb_project
            else None
        ),
        config=config.to_dict(),
        peak_flops=peak * jax.device_count() if peak else None,
    )


def describe_training(config, start_step: int) -> str:
    """The line that opens the training: its steps, a step's samples and the mode's recipe."""
    recipe = (
        f"SFT, VT context for {config.sft_vt_fraction:.0%} of samples"
        if config.mode == "sft"
        else f"offline: cached teacher, kd_weight {config.kd_weight}, kd_temperature "
        f"{config.kd_temperature}"
        if config.mode == "offline"
        else f"teacher '{config.teacher_mode}', loss '{config.jsd_loss_kind}'"
        if not config.teacher_by_source
        else f"a teacher per data source, loss '{config.jsd_loss_kind}'"
    )
    return (
        f"training steps {start_step}..{config.total_steps}: "
        f"{config.gradient_accumulation_steps} x {config.samples_per_micro_batch} samples "
        f"per step, {recipe}"
    )


class StepLog:
    """The run's log of finished steps, its summary and its checkpoint saves."""

    def __init__(self, config, logger, checkpointer, checkpoint_dir, start, batches, resumed):
        self.config, self.logger, self.checkpointer = config, logger, checkpointer
        self.checkpoint_dir, self.batches = checkpoint_dir, batches
        self.tokenizer, self.lora_base = start.tokenizer, start.lora_base
        self.teachers = start.teacher_identities
        self.teacher_mode = start.split.teacher
        self.last_good_step = start.start_step
        self.local_samples = config.gradient_accumulation_steps * (
            config.samples_per_micro_batch // jax.process_count()
        )
        self.unreported = {"samples": 0, "pack/truncated": 0.0, "pack/dropped": 0.0}
        self.summary = RunSummary()  # every evaluation and logged loss, for the run's end
        if resumed == checkpoint_dir and distributed.is_main():
            # This run's own earlier launches, from the files they left: the summary is the
            # whole run's, from step 0 (what they logged past start_step is trained and logged
            # again).
            self.summary.add_history(config.results_dir, up_to_step=start.start_step)

    def save(self, done: DispatchedStep, state) -> None:
        self.checkpointer.save(
            done.step,
            state,
            data_state=done.data_state,
            config=self.config.to_dict(),
            force=True,
            lora_base=self.lora_base,
            teachers=self.teachers,
            teacher_mode=self.teacher_mode,
        )

    def report_cut_samples(self, step: int, scalars: dict, logged) -> None:
        """On logging steps, say how many samples the fixed pack rows cut or dropped since the
        last report, and which sizes to raise (otherwise it shows only in the metrics)."""
        unreported = self.unreported
        unreported["samples"] += self.local_samples
        for key in ("pack/truncated", "pack/dropped"):
            unreported[key] += scalars.get(key, 0.0)
        cut, dropped = int(unreported["pack/truncated"]), int(unreported["pack/dropped"])
        if logged is None or not (cut or dropped):
            return
        for line in pack_shapes.cut_report(
            cut, dropped, unreported["samples"], self.batches.largest_shapes()
        ):
            self.logger.log_note(step, line)
        unreported.update({"samples": 0, "pack/truncated": 0.0, "pack/dropped": 0.0})

    def finish(self, done: DispatchedStep, state, flush: bool = False) -> None:
        """Log a dispatched step once the next one runs (`flush`: write its window now, the
        run stops there). Past max_consecutive_bad_steps non-finite steps in a row: save, then
        stop. The step after this one was dispatched already, but it changed nothing (the
        compiled step halts past the limit, step counter included), so `state` is still that of
        the last good step: saving it loses no good training."""
        config = self.config
        metrics = {k: float(distributed.to_host(v)) for k, v in done.metrics.items()}
        bad_steps = int(metrics.pop("bad_steps"))
        if metrics["nonfinite"] > 0:
            logging.warning(
                "step %d: non-finite loss or gradient, update skipped (%d in a row); samples %s",
                done.step,
                bad_steps,
                done.pids,
            )
            if bad_steps > config.max_consecutive_bad_steps:
                # Saved with the count afresh: a resume of it (lower lr, other data) trains on
                # rather than halting at once, as the compiled step does past the limit.
                self.save(done, state.replace(bad_steps=jnp.zeros_like(state.bad_steps)))
                self.checkpointer.wait_until_finished()
                raise TooManyBadSteps(
                    bad_steps,
                    config.max_consecutive_bad_steps,
                    done.step,
                    self.checkpoint_dir,
                    self.last_good_step,
                )
        else:
            self.last_good_step = done.step
        scalars = dict(done.scalars, **metrics)
        if done.eval_scalars:
            # The evaluation belongs to its own step: in that step's record when the step is
            # logged, else written now; never averaged into a later window's record.
            if self.logger.logs_at(done.step, force=flush):
                scalars.update(done.eval_scalars)
            else:
                self.logger.log_scalars(done.step, done.eval_scalars)
        samples = config.gradient_accumulation_steps * config.samples_per_micro_batch
        logged = self.logger.log_step(
            done.step,
            scalars,
            samples=samples,
            tokens=done.tokens,
            model_flops=done.model_flops,
            force=flush,
        )
        self.report_cut_samples(done.step, scalars, logged)
        if logged is not None:
            self.summary.add_logged(done.step, logged)
        if logged is not None and done.completion is not None:
            self.logger.log_text(done.step, "completion", self.tokenizer.decode(done.completion))
