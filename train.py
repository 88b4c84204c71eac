"""opsd-jax: Visual-OPSD training.  python train.py --config configs/<name>.py [--config.key=value]

One readable sequence (big_vision style):
config check -> distributed init -> mesh -> model + tokenizer -> data -> train state -> resume
-> loop [sample completions -> student/teacher packs -> grad steps -> update -> log -> save]
-> final checkpoint.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx
from ml_collections import config_flags

from opsd_jax import mesh as mesh_lib
from opsd_jax import sampler, train_config, train_step
from opsd_jax.checkpoint import Checkpointer, restore_model_params
from opsd_jax.data.pipeline import make_iterator
from opsd_jax.data.sources import DataConfig
from opsd_jax.hf import load_hf
from opsd_jax.metrics import MetricsLogger
from opsd_jax.opsd_packs import (
    DEFAULT_REFERENCE_INTRO,
    DEFAULT_SYSTEM_PROMPT,
    DEFAULT_TRANSITION_PROMPT,
    PromptOptions,
    build_prompt_pack,
    build_training_packs,
)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.")
flags.mark_flags_as_required(["config"])


# ---- toy assets (tiny configs) ---------------------------------------------------------------


def prepare_toy_assets(config) -> None:
    """Write the toy data and the toy model under results_dir the first time (then reuse)."""
    from scripts import make_toy_data, make_toy_model  # only tiny configs need them

    root = os.path.join(config.results_dir, "toy")
    data_dir = os.path.join(root, "data")
    if not os.path.isdir(data_dir):
        print(f"writing the toy data set to {data_dir}")
        make_toy_data.write_toy_data(data_dir, seed=config.global_seed)
    with config.unlocked():
        config.data.datasets = [
            dict(spec, path=os.path.join(data_dir, spec["name"])) for spec in config.data.datasets
        ]
    if not config.model_path:
        model_dir = os.path.join(root, "model")
        if not os.path.isfile(os.path.join(model_dir, "llm_config.json")):
            print(f"writing the toy model (BAGEL layout) to {model_dir}")
            corpus = make_toy_data.toy_corpus_text(seed=config.global_seed).splitlines()
            make_toy_model.write_toy_model(model_dir, seed=config.global_seed, corpus=corpus)
        with config.unlocked():
            config.model_path = model_dir


def prompt_options(config) -> PromptOptions:
    return PromptOptions(
        use_system_prompt=config.use_system_prompt,
        system_prompt=config.system_prompt or DEFAULT_SYSTEM_PROMPT,
        use_reference_intro=config.use_reference_intro,
        reference_intro=config.reference_intro or DEFAULT_REFERENCE_INTRO,
        use_transition_prompt=config.use_transition_prompt,
        transition_prompt=config.transition_prompt or DEFAULT_TRANSITION_PROMPT,
        instruction_suffix=config.instruction_suffix,
        privileged_thoughts=config.privileged_thoughts,
        privileged_answer=config.privileged_answer,
        noise_vt=config.noise_vt,
        max_reference_rounds=config.max_reference_rounds,
        noise_seed=config.global_seed,
    )


def loss_settings(config) -> train_step.LossSettings:
    return train_step.LossSettings(
        jsd_weight=config.jsd_weight,
        ce_weight=config.ce_weight,
        jsd_loss_kind=config.jsd_loss_kind,
        jsd_beta=config.jsd_beta,
        jsd_temperature=config.jsd_temperature,
        jsd_top_k=config.jsd_top_k,
        jsd_token_clip=config.jsd_token_clip,
        jsd_clip_mode=config.jsd_clip_mode,
        reduction=config.loss_reduction,
        num_samples=config.samples_per_micro_batch,
    )


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # jax's backend probing is noise here
    config = _CONFIG.value

    # ---- config check: every bad value named before anything compiles ------------------------
    train_config.resolve_dataset_paths(config)
    train_config.validate(config, jax.device_count())
    if config.toy_data:
        prepare_toy_assets(config)
    if jax.process_count() > 1 and jax.process_index() == 0:
        print(f"{jax.process_count()} processes")

    # ---- mesh ----------------------------------------------------------------------------------
    data_size, fsdp_size, tensor_size = train_config.mesh_shape(config, jax.device_count())
    mesh = mesh_lib.make_mesh(data_size, fsdp_size, tensor_size)
    print(f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} device(s)")

    # ---- model and tokenizer --------------------------------------------------------------------
    t0 = time.perf_counter()
    runtime = dict(compute_dtype=config.compute_dtype, attention_backend=config.attention_backend,
                   remat=config.remat)  # fmt: skip
    model, model_config, tokenizer = load_hf(
        config.model_path, mesh=mesh, config_changes={"llm": runtime},
        weights=config.weights or None,
    )  # fmt: skip
    special = tokenizer.special_tokens()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    del model
    num_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"model {config.model_path}: {num_params:,} parameters, "
          f"{tokenizer.vocab_length} tokenizer ids, loaded in {time.perf_counter() - t0:.1f}s")  # fmt: skip

    # ---- data ------------------------------------------------------------------------------------
    data_config = DataConfig.from_dict(
        dict(config.data.to_dict(), max_reference_rounds=config.max_reference_rounds,
             seed=config.global_seed)
    )  # fmt: skip
    data = make_iterator(data_config, "train")
    options = prompt_options(config)
    encode = tokenizer.encode

    # ---- train state -----------------------------------------------------------------------------
    optimizer = train_step.make_optimizer(config, params)
    teacher_source = None
    if config.resume_from and config.resume_model_only:
        abstract_params = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)  # fmt: skip
        params = restore_model_params(config.resume_from, abstract_params, which="params")
        if config.finetune_from_ema:
            teacher_source = restore_model_params(config.resume_from, abstract_params,
                                                  which="ema_params")  # fmt: skip
    with jax.set_mesh(mesh):
        state = train_step.init_state(
            params, optimizer, config.teacher_mode, jax.random.key(config.global_seed),
            fixed_teacher_dtype=config.fixed_teacher_dtype, teacher_source=teacher_source,
        )  # fmt: skip
    del params, teacher_source

    # ---- resume ----------------------------------------------------------------------------------
    checkpoint_dir = config.checkpoint_dir or os.path.join(config.results_dir, "checkpoints")
    checkpointer = Checkpointer(checkpoint_dir, save_every=config.save_every,
                                max_to_keep=config.max_checkpoints)  # fmt: skip
    abstract_state = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)  # fmt: skip
    resumed = None
    if config.auto_resume and checkpointer.latest_step() is not None:
        resumed = checkpoint_dir
    elif config.resume_from and not config.resume_model_only:
        resumed = config.resume_from
    if resumed:
        state, data_state, _ = checkpointer.restore(abstract_state, directory=resumed)
        if data_state:
            data.set_state(data_state)
        print(f"resumed from {resumed} at step {int(state.step)}")
    start_step = int(state.step)

    # ---- jitted pieces -------------------------------------------------------------------------
    settings = loss_settings(config)
    grad_step = train_step.make_grad_step(graphdef, rest, settings, config.teacher_mode)
    apply_update = train_step.make_apply_update(optimizer, config.teacher_mode, config.ema_decay)
    add_grads = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=(0,))
    schedule = train_step.learning_rate_schedule(config)
    rows_sharding = lambda x: mesh_lib.batch_sharding(mesh, x.ndim)  # noqa: E731

    def on_mesh(pack):
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(rows_sharding(x), x),
                            pack)  # fmt: skip

    logger = MetricsLogger(
        config.results_dir, total_steps=config.total_steps, log_every=config.log_every,
        start_step=start_step, progress_bar=config.progress_bar,
        wandb=(dict(project=config.wandb_project, name=config.wandb_name or None,
                    mode=config.wandb_mode) if config.wandb_project else None),
        config=config.to_dict(),
    )  # fmt: skip
    per_micro, accum = config.samples_per_micro_batch, config.gradient_accumulation_steps
    print(f"training steps {start_step}..{config.total_steps}: {accum} x {per_micro} samples "
          f"per step, teacher '{config.teacher_mode}', loss '{config.jsd_loss_kind}'")  # fmt: skip

    # ---- loop ----------------------------------------------------------------------------------
    for step in range(start_step, config.total_steps):
        with logger.phase("data"):
            samples = data.take(accum * per_micro)
        with logger.phase("sample"):
            prompt_pack = build_prompt_pack(samples, encode, options, special)
            divisible = prompt_pack.num_rows % (data_size * fsdp_size) == 0
            student = nnx.merge(graphdef, state.params, rest)
            with jax.set_mesh(mesh):
                completions = sampler.sample(
                    student, on_mesh(prompt_pack) if divisible else prompt_pack,
                    jax.random.fold_in(state.rng, step), special=special,
                    vocab_limit=tokenizer.vocab_length,
                    max_new_tokens=config.sample_max_new_tokens,
                    temperature=config.sample_temperature, do_sample=config.sample_do_sample,
                    max_image_skips=config.sample_max_image_skips, decode_text=tokenizer.decode,
                    row_ids=np.arange(len(samples)) + step * len(samples),
                )  # fmt: skip
            del student
        grads, sums, tokens = None, {}, 0
        for micro in range(accum):
            chunk = slice(micro * per_micro, (micro + 1) * per_micro)
            with logger.phase("pack"):
                packs = build_training_packs(
                    samples[chunk], [completions.row(i) for i in range(len(samples))[chunk]],
                    encode, options, special, num_rows=config.rows_per_micro_batch,
                    max_forward_tokens=config.max_forward_tokens,
                )  # fmt: skip
                tokens += int((packs.student.segment_ids > 0).sum())
                tokens += int((packs.teacher.segment_ids > 0).sum())
                for name, fraction in packs.padding_fraction.items():
                    key = f"pack/{name}_padding"
                    sums[key] = sums.get(key, 0.0) + fraction / accum
                sums["pack/truncated"] = sums.get("pack/truncated", 0.0) + packs.num_truncated
            with logger.phase("step"), jax.set_mesh(mesh):
                micro_grads, metrics = grad_step(state.params, state.teacher_params,
                                                 on_mesh(packs.student), on_mesh(packs.teacher))  # fmt: skip
                grads = micro_grads if grads is None else add_grads(grads, micro_grads)
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value / accum
        with logger.phase("step"), jax.set_mesh(mesh):
            state, update_metrics = apply_update(state, grads, accum)
        scalars = dict(sums, **update_metrics, **data.metrics())
        scalars["lr"] = schedule(step)
        scalars["completion_length"] = float(completions.lengths.mean())
        scalars["completion_finished"] = float(completions.finished.mean())
        scalars["image_skip_rounds"] = float((completions.rounds - 1).mean())
        logged = logger.log_step(step + 1, scalars, samples=len(samples), tokens=tokens)
        if logged is not None:
            logger.log_text(step + 1, "completion", tokenizer.decode(completions.row(0)))
        if checkpointer.should_save(step + 1) or step + 1 == config.total_steps:
            checkpointer.save(step + 1, state, data_state=data.get_state(),
                              config=config.to_dict(), force=True)  # fmt: skip

    # ---- finish -----------------------------------------------------------------------------------
    checkpointer.wait_until_finished()
    checkpointer.close()
    logger.close()
    print(f"done: {config.total_steps} steps; checkpoints in {checkpoint_dir}, logs in "
          f"{config.results_dir}")  # fmt: skip


if __name__ == "__main__":
    app.run(main)
