"""The held-out evaluation during training: every eval_every steps (and at the last; at step 0
with eval_at_start), greedy, on the live student, in each of eval_contexts, every prompt through the engine in the
rollout's decode layout and KV-cache dtype.

Each evaluation's accuracy goes to the log as a note and to the run's summary, its records
under <results_dir>/eval/ (opsd_jax/evaluation/run_summary.py names them), and its scalars are
logged with the step it follows.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from flax import nnx

from opsd_jax.evaluation import evaluate as evaluation
from opsd_jax.evaluation.run_summary import EVAL_DIR, RunSummary, eval_name
from opsd_jax.io import disk_errors
from opsd_jax.parallel import distributed
from opsd_jax.training import train_step


class HeldOut:
    """The run's held-out samples and their evaluation (no samples when eval_every is 0)."""

    def __init__(self, config, mesh, start, data_config, options, rollout, say: Callable):
        """rollout: the run's `Rollout`, whose decode layout and KV-cache dtype it decodes in."""
        self.config, self.mesh, self.options, self.rollout = config, mesh, options, rollout
        self.graphdef, self.rest, self.tokenizer = start.graphdef, start.rest, start.tokenizer
        self.samples, self.contexts = [], [c for c in config.eval_contexts.split(",") if c]
        if config.eval_every:
            self.samples = evaluation.load_eval_samples(
                data_config, "eval", max_per_dataset=config.eval_samples_per_dataset
            )
            say(
                f"evaluation every {config.eval_every} steps on {len(self.samples)} held-out "
                f"samples, context(s) {', '.join(self.contexts)}"
            )

    def __bool__(self) -> bool:
        return bool(self.samples)

    def due(self, step: int) -> bool:
        """Whether the step that completes `step` is evaluated."""
        config = self.config
        return bool(self.samples) and (step % config.eval_every == 0 or step == config.total_steps)

    def run(self, step: int, state, logger, summary: RunSummary) -> dict:
        """The evaluation of `state` (after `step`): its scalars, each context's prefixed."""
        config, scalars = self.config, {}
        student = nnx.merge(
            self.graphdef, train_step.model_params(state.params, state.base), self.rest
        )
        for context in self.contexts:
            result = evaluation.evaluate(
                student,
                self.samples,
                self.tokenizer,
                options=self.options,
                context=context,
                max_new_tokens=config.eval_max_new_tokens or config.sample_max_new_tokens,
                do_sample=False,
                batch_size=config.eval_batch_size,
                max_image_skips=config.sample_max_image_skips,
                seed=config.global_seed,
                mesh=self.mesh,
                sampler_layout=self.rollout.layout,
                prompt_buckets=config.sample_prompt_buckets,
                cache_dtype=self.rollout.cache_dtype,
            )
            prefix = "eval" if context == "student" else f"eval_{context}"
            scalars.update(result.scalars(prefix))
            summary.add_eval(step, context, result.summary, result.records)
            overall, datasets = result.summary["overall"], result.summary["datasets"]
            logger.log_note(
                step,
                f"held-out accuracy, {context} context "
                f"({'without' if context == 'student' else 'with'} VT): "
                f"{overall['accuracy']:.1%} of {overall['num_samples']} samples ("
                + ", ".join(f"{name} {m['accuracy']:.1%}" for name, m in datasets.items())
                + ")",
            )
            if distributed.is_main():
                eval_dir = os.path.join(config.results_dir, EVAL_DIR)
                with disk_errors.naming(eval_dir):
                    evaluation.save_results(result, eval_dir, name=eval_name(step, context))
        return scalars
