"""The rollout: everything the run samples with, in one object that train.py only calls.

`Rollout` owns
- the decode layout: the config's, or for 'auto' the one with the least projected rollout time
  that fits (opsd_jax/sampling/layout_choice.py), chosen once; the held-out evaluation decodes
  in it too;
- the KV cache's dtype: the compute dtype's (float32 for float32 compute, else bfloat16), one
  rule for the rollout and the evaluation;
- the decode copy: each step a compute-dtype copy of the updated student in the decode layout
  (one all-gather on device, freed right after: no per-token weight gathers, and never two
  copies alive);
- the prompts: packed in fixed shapes (lengths bucketed by sample_prompt_buckets; a new shape
  compiles once, and says so);
- the engine (opsd_jax/sampling/engine.py): one slot per prompt row of the step, so by default
  a step trains on completions sampled entirely with its own weights (exactly on-policy);
- the lookahead (rollout_lookahead = k > 0): the engine lives across steps, and the next k
  steps' prompts (read early, trainer/step_samples.py) take the slots a step's finished rows
  free; a row unfinished when its step is done stays in its slot, paused, and continues with
  the next weights. Every token carries the policy version it was drawn with, and no step
  trains on a token more than k versions old (`check_staleness`, every step).

SFT and offline runs get a rollout that samples nothing (`samples_nothing`): the same calls,
no completions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from models import pack as pack_lib
from opsd_jax import run_config
from opsd_jax.data.opsd_packs import build_prompt_pack, prompt_shape_bound
from opsd_jax.parallel import distributed
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.sampling import decode_copy, layout_choice
from opsd_jax.sampling import engine as engine_lib
from opsd_jax.sampling.sampler import Completions
from opsd_jax.training import train_step


@dataclasses.dataclass(frozen=True)
class StepCompletions:
    """A step's rollout: every row's completions (None when nothing is sampled), this process's
    samples' own (what the packs train on) with the log-prob each token was drawn with, and
    the step's rollout scalars for the log."""

    every: Completions | None = None
    own: list[list[int]] | None = None
    scalars: dict[str, float] = dataclasses.field(default_factory=dict)
    own_logprobs: list[np.ndarray] | None = None

    def first(self) -> list[int] | None:
        """The first row's completion (the step log shows it), or None."""
        return None if self.every is None else self.every.row(0)


class StaleRolloutError(RuntimeError):
    """A step would train on tokens older than rollout_lookahead allows (a bug, never data)."""


def completion_scalars(completions: Completions) -> dict:
    """A step's completions in the step log: mean length, the share that ended on <|im_end|>,
    the mean image skips, and the share that is empty. An empty completion (the student's first
    token is <|im_end|>) is trained as it is, its one <|im_end|> row scored against the teacher
    (the PyTorch seed draws another sample up to 3 times first: docs/opsd_loss.md §a.5); its
    share says how often that happens."""
    return {
        "completion_length": float(completions.lengths.mean()),
        "completion_finished": float(completions.finished.mean()),
        "completion_empty": float((completions.lengths == 0).mean()),
        "image_skip_rounds": float((completions.rounds - 1).mean()),
    }


def check_staleness(versions: np.ndarray, step: int, lookahead: int) -> tuple[float, int]:
    """(the share of completion tokens drawn with weights older than `step`'s, the most updates
    any token is behind) for step `step`'s token versions (-1: past a completion's end); a
    `StaleRolloutError` if a token is more than `lookahead` updates behind."""
    drawn = versions >= 0
    if not drawn.any():
        return 0.0, 0
    behind = step - versions[drawn]
    fraction, most = float((behind > 0).mean()), int(behind.max())
    if most > lookahead or behind.min() < 0:
        raise StaleRolloutError(
            f"step {step} would train on tokens drawn with policy versions "
            f"{int(versions[drawn].min())}..{int(versions[drawn].max())}; rollout_lookahead="
            f"{lookahead} allows {step - lookahead}..{step}"
        )
    return fraction, most


class Rollout:
    """A step's completions from the live student (OPSD), or none (SFT, offline)."""

    def __init__(self, config, mesh, start, options, program, logger, say: Callable):
        self.config, self.mesh, self.start, self.options = config, mesh, start, options
        self.program, self.logger, self.say = program, logger, say
        self.samples_nothing = config.mode != "opsd"
        self.lookahead = 0 if self.samples_nothing else config.rollout_lookahead
        self.engine: engine_lib.Engine | None = None  # made at the first step, kept
        self._submitted: dict[int, tuple[engine_lib.Batch, int]] = {}  # step -> batch, first row
        self.cache_dtype = run_config.cache_dtype_for(config.compute_dtype)
        self.layout = self._choose_layout(program.shapes)
        self.special = start.tokenizer.special_tokens()
        self.rows = config.gradient_accumulation_steps * config.samples_per_micro_batch
        self.prompt_shapes = set()  # (row length, patches) the prompts have taken
        self.decode_mesh = None
        if not self.samples_nothing:
            heads = layout_choice.head_counts(start.model_config)
            self.decode_mesh = mesh_lib.decode_mesh(mesh, self.layout, heads=heads)  # it fits
            say(self.describe())

    def _choose_layout(self, shapes: dict) -> str:
        """The config's layout, or for 'auto' the least projected rollout time that fits (its
        projections said when anything decodes: the rollout or the evaluation)."""
        config, start = self.config, self.start
        if config.sampler_layout != "auto":
            return config.sampler_layout
        choice = decode_copy.choose_layout(
            start.model_config,
            nnx.merge_state(start.abstract_params, start.rest),
            self.mesh,
            config.compute_dtype,
            run_config.rollout_cache_bytes(config, start.model_config, shapes),
        )
        if not self.samples_nothing or config.eval_every:
            self.say(choice.describe(config.sample_max_new_tokens))
        return choice.layout

    def describe(self) -> str:
        config = self.config
        return (
            f"sampler: '{self.layout}' decode copy ({config.compute_dtype}, KV cache "
            f"{self.cache_dtype}) on {dict(self.decode_mesh.shape)}; {self.rows} prompt rows "
            f"in an engine of {self.rows} slots"
            + (
                f", prefilled {config.rollout_prefill_rows} at a time"
                if 0 < config.rollout_prefill_rows < self.rows
                else ""
            )
            + f", lengths bucketed to {list(config.sample_prompt_buckets)}: at most "
            f"{prompt_shape_bound(config.sample_prompt_buckets)} compiled prompt shapes; "
            + (
                f"lookahead {self.lookahead}: the next {self.lookahead} step(s)' prompts take "
                f"freed slots, no token trained on more than {self.lookahead} update(s) old"
                if self.lookahead
                else "exactly on-policy (rollout_lookahead 0)"
            )
        )

    def _prompts(self, samples):
        """(the prompt pack, this process's first row in it, the global sample id of each row)."""
        config, program = self.config, self.program
        prompt_pack = build_prompt_pack(
            samples,
            self.start.tokenizer.encode,
            self.options,
            self.special,
            buckets=config.sample_prompt_buckets,
        )
        # One prompt per row. Rows go on the mesh when they divide over it (always with
        # several processes: validate() checks), else they stay on the host.
        prompt_pack = distributed.put_rows(
            prompt_pack, self.mesh, sample_offset=program.sample_offset
        )
        first_row = (
            distributed.local_row_offset(prompt_pack.tokens)
            if isinstance(prompt_pack.tokens, jax.Array)
            else 0
        )
        row_ids = distributed.all_processes(program.local_to_global).reshape(-1)
        shape = pack_lib.pack_sizes(prompt_pack)[:2]
        if shape not in self.prompt_shapes:
            self.prompt_shapes.add(shape)
            self.say(
                f"sampler: compiling for prompt length {shape[0]}, {shape[1]} patches "
                f"({len(self.prompt_shapes)} of at most "
                f"{prompt_shape_bound(config.sample_prompt_buckets)} shapes)"
            )
        return prompt_pack, first_row, row_ids

    def sample(self, state, taken, upcoming=()) -> StepCompletions:
        """The completions of `taken`'s step (a `StepSamples`) from `state`'s student (none for
        SFT or offline); `upcoming`: the next steps' samples, started early with lookahead. The
        prompts are packed while the previous step still runs on the devices."""
        if self.samples_nothing:
            return StepCompletions()
        config, start, logger, step = self.config, self.start, self.logger, taken.step
        with logger.phase("sample"):
            wanted = [taken] + [u for u in upcoming if u.step <= step + self.lookahead]
            packed = {
                t.step: self._prompts(t.samples) for t in wanted if t.step not in self._submitted
            }
        with logger.phase("step"):
            # The sampler needs the previous step's params: its device time counts here.
            jax.block_until_ready(state.params)
        with logger.phase("sample"):
            student = decode_copy.make_decode_copy(
                start.graphdef,
                train_step.model_params(state.params, state.base),  # adapters merged there
                start.rest,
                layout=self.layout,
                mesh=self.mesh,
                dtype=config.compute_dtype,
                model_config=start.model_config,
            )
            try:
                engine = self._engine_for(student)
                steps_before, busy_before = engine.decode_steps, engine.busy_slot_steps
                for at, (prompt_pack, first_row, row_ids) in sorted(packed.items()):
                    batch = engine.submit(
                        prompt_pack,
                        jax.random.fold_in(state.rng, at),
                        row_ids=row_ids + at * self.rows,  # global sample ids
                    )
                    self._submitted[at] = batch, first_row
                batch, first_row = self._submitted.pop(step)
                engine.finish(batch, version=step)
            finally:
                student.delete()
            completions = batch.out
            rows = range(first_row, first_row + len(taken.samples))
            own = [completions.row(b) for b in rows]
            drawn = [completions.logprobs[b, : completions.lengths[b]] for b in rows]
            steps = engine.decode_steps - steps_before
            busy = engine.busy_slot_steps - busy_before
        scalars = self._scalars(batch, step, steps, busy)
        return StepCompletions(completions, own, scalars, own_logprobs=drawn)

    def _engine_for(self, student) -> engine_lib.Engine:
        """The run's engine, decoding with `student` from now on (made at the first step)."""
        if self.engine is not None:
            self.engine.swap(student)
            return self.engine
        config = self.config
        self.engine = engine_lib.Engine(
            student,
            pool_size=self.rows,
            prompt_buckets=config.sample_prompt_buckets,
            prefill_rows=config.rollout_prefill_rows or None,
            **engine_lib.settings_for(
                self.start.tokenizer,
                config.sample_max_new_tokens,
                config.sample_do_sample,
                config.sample_temperature,
                config.sample_max_image_skips,
                self.cache_dtype,
            ),
        )
        return self.engine

    def _scalars(self, batch: engine_lib.Batch, step: int, steps: int, busy: int) -> dict:
        completions = batch.out
        stale_fraction, stale_max = check_staleness(batch.versions, step, self.lookahead)
        return {
            **completion_scalars(completions),
            # The share of the pool's slot-steps in this step's decode that drew a token.
            "rollout/slot_occupancy": busy / max(steps * self.rows, 1),
            "rollout/stale_token_fraction": stale_fraction,
            "rollout/staleness_max": float(stale_max),
        }
