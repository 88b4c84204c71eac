"""opsd-jax: Visual-OPSD training.  python train.py --config configs/<name>.py [--config.key=value]

One readable sequence (big_vision style):
config check -> distributed init -> mesh -> model + tokenizer -> data -> train state -> resume
-> loop [sample completions -> student/teacher packs -> grad steps -> update -> log -> save]
-> final checkpoint.

Why one long `main()` (over the ~400 lines a module should keep to): it *is* that sequence, each
stage a few calls into opsd_jax, so a reader follows a run top to bottom without jumping; the
stages share the mesh, config and state, which helpers would only pass around. What differs by
mode lives in the package: the config in opsd_jax/run_config, the loss in
training/train_step.make_loss, each step's micro-batches in training/step_batches.py (OPSD, SFT,
offline: one interface). A dispatched step is a `DispatchedStep` until it is logged; the run's
end is a `RunEnd`, its closing lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import os
import sys
import time
from typing import Any, NoReturn

import jax
import numpy as np
from absl import app, flags, logging
from flax import nnx

from models import pack as pack_lib
from opsd_jax import run_config
from opsd_jax.data import pack_shapes, sources
from opsd_jax.data.opsd_packs import (
    build_prompt_pack,
    prompt_shape_bound,
)
from opsd_jax.data.pipeline import make_iterator
from opsd_jax.evaluation import evaluate as evaluation
from opsd_jax.evaluation.run_summary import EVAL_DIR, RunSummary, eval_name
from opsd_jax.io import checkpoint as checkpoint_lib
from opsd_jax.io import compile_cache, disk_errors, hf_load, init_weights, run_lock, weights_digest
from opsd_jax.io.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointWriteError,
    abstract_like,
)
from opsd_jax.io.hf_layout import HFCheckpointError
from opsd_jax.io.hf_load import load_hf, read_config
from opsd_jax.io.safetensors_io import SafetensorsError
from opsd_jax.parallel import device_memory, distributed
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.run_config import preflight
from opsd_jax.sampling import decode_copy, layout_choice, sampler
from opsd_jax.toy import assets as toy_assets
from opsd_jax.toy import tasks as toy_tasks
from opsd_jax.training import resume_changes, train_step
from opsd_jax.training.metrics import MetricsLogger, wandb_run_id
from opsd_jax.training.offline import cache as offline_cache
from opsd_jax.training.step_batches import step_batches_for
from opsd_jax.training.stop_request import StopRequest

_COMPILE_ONLY = flags.DEFINE_string(
    "compile_only",
    None,
    "TARGET:DEVICES (e.g. h100:8): compile every program of the run for that many compile-only "
    "GPUs, print each one's peak memory per device and exit 0 if all leave 15% free, else 1; "
    "no GPU, weights or data are needed (opsd_jax/run_config/preflight.py)",
)


def say(*args) -> None:
    """Console output from the main process only."""
    if distributed.is_main():
        print(*args, flush=True)


def main(argv, opened: OpenedCheckpoints | None = None):
    del argv
    opened = OpenedCheckpoints() if opened is None else opened
    logging.set_verbosity(logging.WARNING)  # jax's backend probing is noise here
    config = run_config.config_flag_value()

    # ---- config check: every bad value named before anything compiles ------------------------
    run_config.resolve_paths(config)
    try:
        # Values only: no device may be touched before the init (a preflight reads no file).
        run_config.validate(config, check_files=not _COMPILE_ONLY.value)
    except run_config.ConfigError as e:
        run_config.config_error(e)

    # ---- or only ask the compiler: does the run fit that GPU? (nothing runs, nothing is read) --
    if _COMPILE_ONLY.value:
        try:
            sys.exit(preflight.run(config, _COMPILE_ONLY.value))
        except (preflight.PreflightError, run_config.ConfigError) as e:
            run_config.config_error(e)

    # ---- distributed init (one process per host), then the checks that need the devices -------
    distributed.initialize(config)
    # JAX's persistent compilation cache, before anything compiles.
    cache_dir = compile_cache.resolve(config.compilation_cache_dir)
    if cache_dir:
        compile_cache.enable(cache_dir, every_program=jax.process_count() == 1)
    cache_counter = compile_cache.CacheCounter()
    try:
        run_config.validate(config, jax.device_count(), jax.process_count())
    except run_config.ConfigError as e:
        run_config.config_error(e)
    num_processes, process_index = jax.process_count(), jax.process_index()
    if num_processes > 1:
        say(f"{num_processes} processes, {jax.local_device_count()} devices each")

    # ---- one run per directory: a second run on the same results_dir refuses here -----------
    checkpoint_dir = config.checkpoint_dir or os.path.join(config.results_dir, "checkpoints")
    held = [config.results_dir]  # and checkpoint_dir where it lies outside results_dir
    if os.path.relpath(
        os.path.abspath(checkpoint_dir), os.path.abspath(config.results_dir)
    ).startswith(os.pardir):
        held.append(checkpoint_dir)
    try:
        run_lock.acquire_for_run(held, say=say)
    except run_lock.RunLockError as e:
        run_config.config_error(e)
    if config.toy_data:
        toy_assets.prepare_toy_assets(config)
    # Every data file opens and has the required columns, before anything is loaded or compiled.
    data_check = run_config.data_config(config)
    try:
        for spec in data_check.datasets:
            sources.check_dataset(spec, require_vt=data_check.require_vt)
    except (sources.DataError, FileNotFoundError) as e:
        run_config.config_error(e)
    if config.lora_rank:  # the adapters' targets against the model's projections (shapes only)
        try:
            run_config.lora_target_paths(config, read_config(config.model_path))
        except ValueError as e:
            run_config.config_error(e)

    # ---- mesh ----------------------------------------------------------------------------------
    data_size, fsdp_size, tensor_size = run_config.mesh_shape(config, jax.device_count())
    mesh = mesh_lib.make_mesh(data_size, fsdp_size, tensor_size)
    say(f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} device(s)")
    say(f"compilation cache: {cache_dir or 'off (compilation_cache_dir)'}")

    # ---- checkpoints: is this a resume? (then the state comes from there, not the HF files) ---
    # A save the disk refuses ends the run with one line (run()), not orbax's hundred.
    disk_errors.quiet_abandoned_saves()
    checkpointer = Checkpointer(
        checkpoint_dir, save_every=config.save_every, max_to_keep=config.max_checkpoints
    )
    opened.checkpointer, opened.auto_resume = checkpointer, config.auto_resume
    resumed = None
    if config.auto_resume and checkpointer.latest_step() is not None:
        resumed = checkpoint_dir
    elif config.resume_from and not config.resume_model_only:
        resumed = config.resume_from
    saved_teacher = None
    if resumed:  # every changed key said (saved -> now); one that contradicts the state refused
        try:
            for line in resume_changes.check(
                checkpoint_lib.saved_config(resumed), config.to_dict(), resumed
            ):
                say(line)
        except resume_changes.ResumeConfigError as e:
            run_config.config_error(e)
        saved_teacher = checkpoint_lib.saved_teacher_mode(resumed)
        if config.lora_rank:  # the adapters apply to the base they were trained on, only
            saved_base = checkpoint_lib.saved_lora_base(resumed)
            now_base = init_weights.base_identity(config, full_resume=True)
            if saved_base is None or saved_base["digest"] != now_base["digest"]:
                run_config.config_error(
                    f"resume from {resumed}: its LoRA adapters were trained on "
                    + (
                        weights_digest.describe(saved_base)
                        if saved_base
                        else "no recorded base (a full fine-tuning checkpoint)"
                    )
                    + f", but model_path gives {weights_digest.describe(now_base)}; give the "
                    "base they were trained on as model_path, or start a new run"
                )

    # ---- model, tokenizer and starting weights (student, EMA / fixed teacher) ----------------
    t0 = time.perf_counter()
    runtime = run_config.model_runtime(config)  # "auto" attention -> this machine's backend
    say(
        f"attention backend {runtime['attention_backend']}"
        + (" (auto)" if config.attention_backend == "auto" else "")
    )
    lora_base = None  # LoRA: the base weights' identity, recorded in every checkpoint
    if resumed and not config.lora_rank and config.weights != hf_load.RANDOM_WEIGHTS:
        # The state comes from the checkpoint, restored straight into its shards: the HF
        # weights are not read at all (params stay abstract), so no second copy ever exists.
        model, model_config, tokenizer = load_hf(
            config.model_path, mesh=mesh, config_changes={"llm": runtime}, read_params=False
        )
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        del model
        teacher_source, description = None, None
    else:  # (a LoRA resume reads its frozen base here: the checkpoint holds adapters only)
        start = init_weights.load(
            config, mesh, config_changes={"llm": runtime}, full_resume=bool(resumed)
        )
        graphdef, params, rest, tokenizer = (
            start.graphdef,
            start.params,
            start.rest,
            start.tokenizer,
        )
        model_config, teacher_source, description = (
            start.model_config,
            start.teacher_source,
            start.description,
        )
        lora_base = start.base
        del start
    special = tokenizer.special_tokens()
    num_params = sum(x.size for x in jax.tree.leaves(params))
    say(
        f"model {config.model_path}: {num_params:,} parameters (LM, ViT, connector), "
        f"{tokenizer.vocab_length} tokenizer ids, loaded in {time.perf_counter() - t0:.1f}s"
        + (" (weights not read: a checkpoint gives them)" if resumed and not lora_base else "")
    )
    if config.lora_rank:  # adapters on the loaded weights, which become the frozen base
        graphdef, params, rest = run_config.with_adapters(graphdef, params, rest, config, mesh)
        adapters = nnx.split_state(params, nnx.LoRAParam, ...)[0]
        say(
            f"LoRA: {sum(x.size for x in jax.tree.leaves(adapters)):,} trainable adapter "
            f"parameters (rank {config.lora_rank}, alpha {config.lora_alpha}) on "
            f"{len(run_config.lora_target_paths(config, model_config))} projections matching "
            f"{config.lora_targets!r}; the base frozen in {config.compute_dtype}"
        )
    if description:
        say(f"starting weights: {description}")

    # ---- data ------------------------------------------------------------------------------------
    # The model's ViT patch size and position grid decide the images' patches and position ids.
    data_config = data_check.for_model(model_config)  # the config checked before the load
    # Each process reads its own blocks of the global sample stream (see data/pipeline.py).
    per_micro, accum = config.samples_per_micro_batch, config.gradient_accumulation_steps
    local_per_micro = per_micro // num_processes
    data = make_iterator(data_config, "train", process_block=local_per_micro)
    options = run_config.prompt_options(config)  # the same wording everywhere
    encode = tokenizer.encode

    # ---- train state ----------------------------------------------------------------------------
    abstract_params = abstract_like(params)
    optimizer, frozen, abstract_state = run_config.abstract_train_state(config, abstract_params)
    if not resumed:
        # Jitted into exactly the layout the step is compiled for (the params are donated, so
        # not copied; the optimizer state and scalars are made in place on every process).
        init = jax.jit(
            lambda params, source: run_config.init_train_state(
                config, optimizer, frozen, params, source
            ),
            out_shardings=train_step.shardings_of(abstract_state),
            donate_argnums=(0,),
        )
        with mesh_lib.use_mesh(mesh):
            state = init(params, teacher_source)
    elif config.lora_rank:  # the restore target holds the frozen base, read from model_path
        take_base = jax.jit(
            lambda params: run_config.split_for_training(params, config)[1],
            out_shardings=train_step.shardings_of(abstract_state.base),
        )
        with mesh_lib.use_mesh(mesh):
            abstract_state = abstract_state.replace(base=take_base(params))
    del params, teacher_source

    # ---- resume ----------------------------------------------------------------------------------
    saved_config = None
    if resumed:  # into the abstract state: peak memory is one state
        # A checkpoint of a 'self'-teacher run keeps no teacher: one allowed to become 'ema' or
        # 'fixed' (resume_changes) restores without it and starts the teacher from the student.
        no_saved_teacher = saved_teacher == "self" and abstract_state.teacher_params is not None
        target = abstract_state.replace(teacher_params=None) if no_saved_teacher else abstract_state
        state, data_state, saved_config = checkpointer.restore(target, directory=resumed)
        if config.lora_rank:  # the base's arrays go to the step (donated): the target keeps shapes
            abstract_state = abstract_state.replace(base=abstract_like(state.base))
        if no_saved_teacher:
            start_teacher = jax.jit(
                lambda p: (
                    train_step.init_state(
                        p,
                        optimizer,
                        config.teacher_mode,
                        None,
                        fixed_teacher_dtype=config.fixed_teacher_dtype,
                    ).teacher_params
                ),
                out_shardings=train_step.shardings_of(abstract_state).teacher_params,
            )
            with mesh_lib.use_mesh(mesh):
                state = state.replace(teacher_params=start_teacher(state.params))
        if data_state:
            data.set_state(data_state)
        say(f"resumed from {resumed} at step {int(distributed.to_host(state.step))}")
    start_step = int(distributed.to_host(state.step))
    if config.wandb_project:
        # One W&B run across restarts: the id goes into every checkpoint's config and a resume
        # of this run (its own checkpoint_dir, not another run's) reads it back.
        own = saved_config if resumed == checkpoint_dir else None
        config.wandb_runid = wandb_run_id(config.wandb_runid, own)

    # ---- the compiled train step ---------------------------------------------------------------
    sft, offline = config.mode == "sft", config.mode == "offline"
    settings = run_config.loss_settings(config, vocab_limit=tokenizer.vocab_length)
    cache_reader = None
    if offline:  # the cached teacher, refused if made for another model
        try:
            manifest = offline_cache.check_manifest(
                config.offline_cache_dir, model_config, tokenizer, options
            )
        except offline_cache.CacheError as e:
            run_config.config_error(e)
        cache_reader = offline_cache.CacheReader(config.offline_cache_dir, manifest)
        say(
            f"offline teacher cache {config.offline_cache_dir}: {len(cache_reader)} samples, "
            f"top-{cache_reader.top_k} {cache_reader.logprob_dtype}"
        )
    loss_fn = train_step.make_loss(config.mode, graphdef, rest, settings, config.teacher_mode)
    step_fn = run_config.train_step_for(config, loss_fn, optimizer, abstract_state, frozen)
    # This process's share of each micro-batch: samples [offset, offset + local_per_micro) of
    # it, in `local_rows` rows (micro-batches are laid out process-major, see distributed.py).
    local_rows = config.rows_per_micro_batch // num_processes
    sample_offset = process_index * local_per_micro
    local_to_global = np.array(
        [
            (j // local_per_micro) * per_micro + sample_offset + j % local_per_micro
            for j in range(accum * local_per_micro)
        ]
    )
    shapes = pack_shapes.pack_shapes(config)  # pack name -> its shape in each length bucket
    # The mode's micro-batches (OPSD, SFT or offline), one interface: opsd_jax/training/step_batches.py
    batches = step_batches_for(
        config.mode,
        config,
        shapes,
        encode,
        options,
        special,
        mesh,
        cache_reader=cache_reader,
        local_samples=local_per_micro,
        local_rows=local_rows,
        sample_offset=sample_offset,
    )
    # Every length bucket compiled ahead of time, before step 1: nothing compiles in the loop.
    compiled_steps = []
    for bucket in range(config.pack_length_buckets):
        t0, read_before = time.perf_counter(), cache_counter.read
        with mesh_lib.use_mesh(mesh):
            compiled_steps.append(
                step_fn.lower(abstract_state, batches.abstract_batch(bucket)).compile()
            )
        cached = " (read from the compilation cache)" if cache_counter.read > read_before else ""
        say(
            f"compiling the train step for {accum} x {config.rows_per_micro_batch} rows x "
            f"({batches.describe(bucket)}), {shapes[batches.pack_names[0]][bucket].loss_entries} "
            f"loss entries per row: {time.perf_counter() - t0:.1f} s{cached}"
        )

    def on_mesh(pack):
        return distributed.put_rows(pack, mesh, sample_offset=sample_offset)

    logger = MetricsLogger(
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
    )
    recipe = (
        f"SFT, VT context for {config.sft_vt_fraction:.0%} of samples"
        if sft
        else f"offline: cached teacher, kd_weight {config.kd_weight}, kd_temperature "
        f"{config.kd_temperature}"
        if config.mode == "offline"
        else f"teacher '{config.teacher_mode}', loss '{config.jsd_loss_kind}'"
    )
    say(
        f"training steps {start_step}..{config.total_steps}: {accum} x {per_micro} samples "
        f"per step, {recipe}"
    )

    # ---- the sampler's decode layout ('auto': the least projected rollout time that fits) -----
    decode_layout = config.sampler_layout
    if decode_layout == "auto":
        choice = decode_copy.choose_layout(
            model_config,
            nnx.merge_state(abstract_params, rest),
            mesh,
            config.compute_dtype,
            run_config.rollout_cache_bytes(config, model_config, shapes),
        )
        decode_layout = choice.layout
        if config.mode == "opsd" or config.eval_every:
            say(choice.describe(config.sample_max_new_tokens))

    # ---- held-out evaluation (every eval_every steps, greedy, on the live student) ------------
    eval_samples, eval_contexts = [], [c for c in config.eval_contexts.split(",") if c]
    summary = RunSummary()  # every evaluation and logged loss, for the end-of-run summary
    if resumed == checkpoint_dir and distributed.is_main():
        # This run's own earlier launches, from the files they left: the summary is the whole
        # run's, from step 0 (what they logged past start_step is trained and logged again).
        summary.add_history(config.results_dir, up_to_step=start_step)
    if config.eval_every:
        eval_samples = evaluation.load_eval_samples(
            data_config, "eval", max_per_dataset=config.eval_samples_per_dataset
        )
        say(
            f"evaluation every {config.eval_every} steps on {len(eval_samples)} held-out "
            f"samples, context(s) {', '.join(eval_contexts)}"
        )

    def run_evaluation(step, state) -> dict:
        scalars = {}
        student = nnx.merge(graphdef, train_step.model_params(state.params, state.base), rest)
        for context in eval_contexts:
            result = evaluation.evaluate(
                student,
                eval_samples,
                tokenizer,
                options=options,
                context=context,
                max_new_tokens=config.eval_max_new_tokens or config.sample_max_new_tokens,
                do_sample=False,
                batch_size=config.eval_batch_size,
                max_image_skips=config.sample_max_image_skips,
                seed=config.global_seed,
                mesh=mesh,
                sampler_layout=decode_layout,
                prompt_buckets=config.sample_prompt_buckets,
                cache_dtype=run_config.cache_dtype_for(config.compute_dtype),
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

    # ---- sampler: a decode copy of the student per step, prompts in fixed shapes ---------------
    prompt_shapes = set()  # (row length, patches) the sampler has compiled for
    if config.mode == "opsd":  # SFT and offline sample nothing
        heads = layout_choice.head_counts(model_config)
        decode_mesh = mesh_lib.decode_mesh(mesh, decode_layout, heads=heads)  # checks it fits
        say(
            f"sampler: '{decode_layout}' decode copy ({config.compute_dtype}) on "
            f"{dict(decode_mesh.shape)}; {accum * per_micro} prompt rows, lengths bucketed to "
            f"{list(config.sample_prompt_buckets)}: at most "
            f"{prompt_shape_bound(config.sample_prompt_buckets)} compiled prompt shapes"
        )

    # ---- loop ----------------------------------------------------------------------------------
    stop, stopped_at = StopRequest(), None
    if start_step >= config.total_steps:
        say(f"nothing left to train: step {start_step} >= total_steps={config.total_steps}")
    last_good_step = start_step
    unreported = {"samples": 0, "pack/truncated": 0.0, "pack/dropped": 0.0}

    def report_cut_samples(step: int, scalars: dict, logged) -> None:
        """On logging steps, say how many samples the fixed pack rows cut or dropped since the
        last report, and which sizes to raise (otherwise it shows only in the metrics)."""
        unreported["samples"] += accum * local_per_micro
        for key in ("pack/truncated", "pack/dropped"):
            unreported[key] += scalars.get(key, 0.0)
        cut, dropped = int(unreported["pack/truncated"]), int(unreported["pack/dropped"])
        if logged is None or not (cut or dropped):
            return
        for line in pack_shapes.cut_report(
            cut, dropped, unreported["samples"], batches.largest_shapes()
        ):
            logger.log_note(step, line)
        unreported.update({"samples": 0, "pack/truncated": 0.0, "pack/dropped": 0.0})

    def save(done: DispatchedStep, state) -> None:
        checkpointer.save(
            done.step,
            state,
            data_state=done.data_state,
            config=config.to_dict(),
            force=True,
            lora_base=lora_base,
        )

    def finish(done: DispatchedStep, state) -> None:
        """Log a dispatched step once the next one runs (the host never waits on the step it
        just dispatched). Past max_consecutive_bad_steps non-finite steps in a row: save, then
        stop. The step after this one was dispatched already, but it changed nothing (the
        compiled step halts past the limit, step counter included), so `state` is still that of
        the last good step: saving it loses no good training."""
        nonlocal last_good_step
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
                save(done, state)
                checkpointer.wait_until_finished()
                raise TooManyBadSteps(
                    bad_steps,
                    config.max_consecutive_bad_steps,
                    done.step,
                    checkpoint_dir,
                    last_good_step,
                )
        else:
            last_good_step = done.step
        scalars = dict(done.scalars, **done.eval_scalars, **metrics)
        logged = logger.log_step(done.step, scalars, samples=accum * per_micro, tokens=done.tokens)
        report_cut_samples(done.step, scalars, logged)
        if logged is not None:
            summary.add_logged(done.step, logged)
        if logged is not None and done.completion is not None:
            logger.log_text(done.step, "completion", tokenizer.decode(done.completion))

    if eval_samples and config.eval_at_start and start_step == 0:  # the baseline of every curve
        with logger.phase("eval"):
            logger.log_scalars(0, run_evaluation(0, state))
    pending = None  # the step dispatched last, finished (logged) after the next dispatch
    for step in range(start_step, config.total_steps):
        with logger.phase("data"):
            samples = data.take(accum * local_per_micro)
        completions, own_completions = None, None  # SFT and offline sample nothing
        if config.mode == "opsd":
            with logger.phase("sample"):  # while the previous step still runs on the devices
                prompt_pack = build_prompt_pack(
                    samples, encode, options, special, buckets=config.sample_prompt_buckets
                )
                # One prompt per row. Rows go on the mesh when they divide over it (always with
                # several processes: validate() checks), else the sampler takes host arrays.
                prompt_pack = on_mesh(prompt_pack)
                first_row = (
                    distributed.local_row_offset(prompt_pack.tokens)
                    if isinstance(prompt_pack.tokens, jax.Array)
                    else 0
                )
                row_ids = distributed.all_processes(local_to_global).reshape(-1)
                shape = pack_lib.pack_sizes(prompt_pack)[:2]
                if shape not in prompt_shapes:
                    prompt_shapes.add(shape)
                    say(
                        f"sampler: compiling for prompt length {shape[0]}, {shape[1]} patches "
                        f"({len(prompt_shapes)} of at most "
                        f"{prompt_shape_bound(config.sample_prompt_buckets)} shapes)"
                    )
            with logger.phase("step"):
                # The sampler needs the previous step's params: its device time counts here.
                jax.block_until_ready(state.params)
            with logger.phase("sample"):
                # Decode on a compute-dtype copy of the updated student in the decode layout
                # (one all-gather on device), freed right after: no per-token weight gathers,
                # and never two copies alive.
                student = decode_copy.make_decode_copy(
                    graphdef,
                    train_step.model_params(state.params, state.base),  # adapters merged there
                    rest,
                    layout=decode_layout,
                    mesh=mesh,
                    dtype=config.compute_dtype,
                    model_config=model_config,
                )
                completions = sampler.sample(
                    student,
                    prompt_pack,
                    jax.random.fold_in(state.rng, step),
                    special=special,
                    vocab_limit=tokenizer.vocab_length,
                    max_new_tokens=config.sample_max_new_tokens,
                    temperature=config.sample_temperature,
                    do_sample=config.sample_do_sample,
                    max_image_skips=config.sample_max_image_skips,
                    decode_text=tokenizer.decode,
                    row_ids=row_ids + step * accum * per_micro,  # global sample ids
                )
                student.delete()
                own_completions = [completions.row(first_row + j) for j in range(len(samples))]
        with logger.phase("pack"):  # offline: the cache read too
            packed = batches.pack(step, samples, own_completions)
        with logger.phase("step"):  # dispatched, not awaited
            state, metrics = compiled_steps[packed.bucket](state, packed.batch)
        scalars = dict(packed.scalars, **data.metrics())
        if completions is not None:
            scalars["completion_length"] = float(completions.lengths.mean())
            scalars["completion_finished"] = float(completions.finished.mean())
            scalars["image_skip_rounds"] = float((completions.rounds - 1).mean())
        done = DispatchedStep(
            step=step + 1,
            metrics=metrics,
            scalars=scalars,
            pids=[s.pid for s in samples],
            tokens=int(distributed.all_processes(packed.tokens).sum()),
            data_state=data.get_state(),
            completion=None if completions is None else completions.row(0),
        )
        if pending is not None:
            finish(pending, state)
        pending = done
        if eval_samples and ((step + 1) % config.eval_every == 0 or step + 1 == config.total_steps):
            with logger.phase("eval"):  # logged with the step, when it is finished
                done.eval_scalars.update(run_evaluation(step + 1, state))
        stopping = stop.requested()
        if checkpointer.should_save(step + 1) or step + 1 == config.total_steps or stopping:
            save(done, state)
        if stopping:
            checkpointer.wait_until_finished()
            finish(pending, state)
            pending = None
            say(
                f"stopped by {stop.signal_name or 'a signal to another process'} after step "
                f"{step + 1}: checkpoint saved in {checkpoint_dir}; run the same command to resume"
            )
            stopped_at = step + 1
            break
    if pending is not None:
        finish(pending, state)

    # ---- finish -----------------------------------------------------------------------------------
    checkpointer.wait_until_finished()
    checkpointer.close()
    logger.close()
    counts = distributed.all_processes([data.num_yielded, *data.skipped.values()]).sum(axis=0)
    end = RunEnd(
        first_step=start_step,
        last_step=stopped_at or config.total_steps,
        stopped=stopped_at is not None,
        samples_used=int(counts[0]),
        skipped_rows={r: int(n) for r, n in zip(data.skipped, counts[1:]) if n},
    )
    if cache_dir:
        say(cache_counter.describe(cache_dir))
    peak = device_memory.allocator_peak()
    if peak is not None:  # a GPU's allocator (bench/gpu_check.py reads this line)
        say(
            f"device memory: peak {peak[0] / 2**30:.2f} GiB in use of {peak[1] / 2**30:.2f} GiB "
            f"on {jax.local_devices()[0].device_kind}"
        )
    for line in end.lines(config, checkpoint_dir, summary):
        say(line)
    if distributed.is_main() and (summary.evals or summary.losses):
        png = os.path.join(config.results_dir, "summary.png")
        recorded_from = summary.first_step()  # a resumed run's: its earlier launches' first
        first = end.first_step if recorded_from is None else min(end.first_step, recorded_from)
        summary.plot(
            png,
            title=f"{config.results_dir}: {config.mode}, steps {first}..{end.last_step}",
            chance=chance_of(config),
        )
        say(f"accuracy and loss over the steps: {png}")
    say(next_commands(config, checkpoint_dir))


@dataclasses.dataclass
class DispatchedStep:
    """A step dispatched to the devices and not yet logged (its metrics are still device
    arrays): `finish` logs it once the next step is dispatched."""

    step: int  # the step number it completes (1-based)
    metrics: dict  # the compiled step's metrics (device scalars)
    scalars: dict  # host-side figures: packing, data, completions
    pids: list  # the samples it trained on (named when the step is non-finite)
    tokens: int  # real tokens packed, over all processes
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


@dataclasses.dataclass(frozen=True)
class RunEnd:
    """How a run ended: its closing lines come from here."""

    first_step: int  # where this run started (0, or the step it resumed at)
    last_step: int  # where it ended: total_steps, or the step a signal stopped it after
    stopped: bool  # stopped early by a signal (a checkpoint of last_step was saved)
    samples_used: int  # over all processes
    skipped_rows: dict  # reason -> rows the data pipeline skipped

    def lines(self, config, checkpoint_dir: str, summary: RunSummary) -> list[str]:
        skipped = ", ".join(f"{r} {n}" for r, n in self.skipped_rows.items()) or "none"
        lines = [f"data: {self.samples_used} samples used; skipped rows: {skipped}"]
        if not self.stopped:
            lines.append(
                f"done: {config.total_steps} steps; checkpoints in {checkpoint_dir}, "
                f"logs in {config.results_dir}"
            )
        return lines + list(summary.lines(chance_of(config)))


def chance_of(config) -> float | None:
    """The toy tasks' chance accuracy (a toy run's summary shows it), else None."""
    if not config.toy_data:
        return None
    return toy_tasks.chance_accuracy([s["name"] for s in config.data.datasets])


def next_commands(config, checkpoint_dir: str) -> str:
    """What a user runs on a finished (or stopped) run: evaluate, plot, export."""
    run, quote = config.results_dir, lambda path: path if " " not in path else f"'{path}'"  # noqa: E731
    lines = [
        f"python scripts/evaluate.py --checkpoint {quote(run)}    # held-out accuracy, no VT",
        f"python scripts/evaluate.py --checkpoint {quote(run)} --context teacher    # with VT",
        f"python scripts/plot_run.py {quote(run)}    # curves -> {os.path.join(run, 'plots')}",
    ]
    if config.model_path:
        lines.append(
            f"python scripts/convert_hf.py jax-to-hf --ckpt {quote(checkpoint_dir)} "
            f"--source {quote(config.model_path)} --out "
            f"{quote(os.path.join(run, 'hf'))}    # the BAGEL HF layout"
        )
    return "next:\n  " + "\n  ".join(lines)


@dataclasses.dataclass
class OpenedCheckpoints:
    """The run's checkpointer, once main has opened it: the line a disk error ends the run with
    names its last complete step (and how to resume from it)."""

    checkpointer: Checkpointer | None = None
    auto_resume: bool = True  # the same command resumes (else resume_from is needed)


# Errors in what the user gave (files, directories, checkpoints): one line, no traceback. A
# traceback is kept for anything else, which is a bug to report.
USER_ERRORS = (
    HFCheckpointError,
    SafetensorsError,
    CheckpointError,
    sources.DataError,
    offline_cache.CacheError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)


def one_line_error(error: Exception, opened: OpenedCheckpoints) -> str | None:
    """The line `error` ends the run with, or None for a bug (its traceback is kept): an error
    in what the user gave, in the project's words; an error the OS reported (a full disk, a
    read-only or vanished mount), however orbax wrapped it, as `disk_error_line`."""
    if isinstance(error, USER_ERRORS) and getattr(error, "errno", None) is None:
        return str(error)
    disk_error = disk_errors.os_error_in(error)
    return None if disk_error is None else disk_error_line(disk_error, opened)


def disk_error_line(error: OSError, opened: OpenedCheckpoints) -> str:
    """`<file>: <reason>`, the checkpoint step it was saving if it was one, and the last
    complete checkpoint to resume from, read from the disk once the save in flight (if any)
    has finished or failed. A half-written step is never restored, so nothing saved is lost."""
    line = f"{error.filename or 'a file of the run'}: {error.strerror or error}"
    if isinstance(error, CheckpointWriteError) and error.step is not None:
        line += f", saving checkpoint step {error.step} (left incomplete: never restored)"
    checkpointer = opened.checkpointer
    if checkpointer is None:  # before the run opened its checkpoints: nothing to resume
        return line
    with contextlib.suppress(OSError):  # that save failed too: the disk says what is complete
        checkpointer.wait_until_finished()
    steps = checkpointer.all_steps()
    fix = "free space" if error.errno in (errno.ENOSPC, errno.EDQUOT) else "fix that"
    if not steps:
        return (
            f"{line}. No complete checkpoint in {checkpointer.directory} yet; {fix} and run the "
            f"same command to start again"
        )
    last = checkpointer.directory / str(steps[-1])
    resume = (
        "run the same command to resume from it"
        if opened.auto_resume
        else f"resume from it with --config.resume_from={last}"
    )
    return f"{line}. Last complete checkpoint: step {steps[-1]}, {last}; {fix} and {resume}"


def exit_with_one_line(line: str, code: int) -> NoReturn:
    """Print the run's last line on stderr and exit with `code`; nothing else reaches stderr
    from here on. After a failed save, orbax's abandoned threads and write coroutines are torn
    down when the process ends, and each repeats the error in a traceback or a warning (even a
    garbage collection that an allocation here sets off can print one): stderr is sent to
    /dev/null first, garbage collection stopped, and the line written to a copy of it."""
    gc.disable()
    sys.stdout.flush()
    sys.stderr.flush()
    stderr = os.dup(2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    os.write(stderr, (line + "\n").encode())
    sys.exit(code)


def run(argv) -> None:
    opened = OpenedCheckpoints()
    try:
        main(argv, opened)
    except Exception as e:
        line = one_line_error(e, opened)
        if line is None:
            raise  # a bug: its traceback, to report
        exit_with_one_line(f"train.py: error: {line}", 1)
    except KeyboardInterrupt:  # Ctrl-C before the loop (a compile), or a second one in it
        print(
            "train.py: interrupted; nothing more was saved (the same command resumes from the "
            "newest complete checkpoint, if there is one)",
            file=sys.stderr,
        )
        sys.exit(130)


if __name__ == "__main__":
    app.run(run, flags_parser=run_config.parse_flags)
