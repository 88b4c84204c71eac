"""The rollout: the student's completions for a step's prompts (OPSD; SFT and offline sample
nothing, and have no `Rollout`).

Each step the prompts are packed in fixed shapes (lengths bucketed by sample_prompt_buckets:
a new shape compiles the sampler once, and says so), a compute-dtype copy of the updated
student is made in the decode layout (one all-gather on device, freed right after: no per-token
weight gathers, and never two copies alive), and it samples a completion per prompt. The decode
layout ('auto': the least projected rollout time that fits, opsd_jax/sampling/layout_choice.py)
is chosen once, before the evaluation, which decodes in it too.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from models import pack as pack_lib
from opsd_jax import run_config
from opsd_jax.data.opsd_packs import build_prompt_pack, prompt_shape_bound
from opsd_jax.parallel import distributed
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.sampling import decode_copy, layout_choice, sampler
from opsd_jax.training import train_step


def choose_decode_layout(config, start, mesh, shapes: dict, say: Callable) -> str:
    """The sampler's decode layout: the config's, or for 'auto' the one with the least
    projected rollout time that fits (its projections said where anything decodes)."""
    if config.sampler_layout != "auto":
        return config.sampler_layout
    choice = decode_copy.choose_layout(
        start.model_config,
        nnx.merge_state(start.abstract_params, start.rest),
        mesh,
        config.compute_dtype,
        run_config.rollout_cache_bytes(config, start.model_config, shapes),
    )
    if config.mode == "opsd" or config.eval_every:
        say(choice.describe(config.sample_max_new_tokens))
    return choice.layout


class Rollout:
    """A step's completions from the live student, in the decode layout."""

    def __init__(self, config, mesh, start, options, program, layout: str, logger, say):
        self.config, self.mesh, self.start, self.options = config, mesh, start, options
        self.program, self.layout, self.logger, self.say = program, layout, logger, say
        self.special = start.tokenizer.special_tokens()
        heads = layout_choice.head_counts(start.model_config)
        self.decode_mesh = mesh_lib.decode_mesh(mesh, layout, heads=heads)  # checks it fits
        self.prompt_shapes = set()  # (row length, patches) the sampler has compiled for
        # The KV cache's dtype: the held-out evaluation's rule (float32 for float32 compute), so
        # a float32 run samples its rollouts exactly as it evaluates.
        self.cache_dtype = run_config.cache_dtype_for(config.compute_dtype)

    def describe(self) -> str:
        config = self.config
        rows = config.gradient_accumulation_steps * config.samples_per_micro_batch
        return (
            f"sampler: '{self.layout}' decode copy ({config.compute_dtype}, KV cache "
            f"{self.cache_dtype}) on {dict(self.decode_mesh.shape)}; {rows} prompt rows, lengths bucketed to "
            f"{list(config.sample_prompt_buckets)}: at most "
            f"{prompt_shape_bound(config.sample_prompt_buckets)} compiled prompt shapes"
        )

    def prompts(self, samples):
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
        # several processes: validate() checks), else the sampler takes host arrays.
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

    def sample(self, state, samples, step: int):
        """(the completions of every row, this process's samples' own) at `step`."""
        config, start, logger = self.config, self.start, self.logger
        with logger.phase("sample"):  # while the previous step still runs on the devices
            prompt_pack, first_row, row_ids = self.prompts(samples)
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
            rows_per_step = config.gradient_accumulation_steps * config.samples_per_micro_batch
            completions = sampler.sample(
                student,
                prompt_pack,
                jax.random.fold_in(state.rng, step),
                special=self.special,
                vocab_limit=start.tokenizer.vocab_length,
                max_new_tokens=config.sample_max_new_tokens,
                temperature=config.sample_temperature,
                do_sample=config.sample_do_sample,
                max_image_skips=config.sample_max_image_skips,
                decode_text=start.tokenizer.decode,
                cache_dtype=self.cache_dtype,
                row_ids=row_ids + step * rows_per_step,  # global sample ids
            )
            student.delete()
            own = [completions.row(first_row + j) for j in range(len(samples))]
        return completions, own
