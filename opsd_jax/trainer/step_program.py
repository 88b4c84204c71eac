"""The train step a run compiles: this process's share of each step, the mode's micro-batches
and the one donated step, compiled for every length bucket before step 1 (nothing compiles in
the loop).

Micro-batches are laid out process-major (opsd_jax/parallel/distributed.py): this process packs
samples [sample_offset, sample_offset + local_per_micro) of each, in `local_rows` rows. The
mode's micro-batches (OPSD, SFT or offline) come through one interface,
opsd_jax/training/step_batches.py; offline mode's cached teacher is checked against the model
here, before anything compiles.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from opsd_jax import run_config
from opsd_jax.data import pack_shapes
from opsd_jax.io import teacher_checkpoint
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.training import step_compiler_flags, train_step
from opsd_jax.training.offline import cache as offline_cache
from opsd_jax.training.offline import checks as offline_checks
from opsd_jax.training.step_batches import StepBatches, step_batches_for


@dataclasses.dataclass
class StepProgram:
    """The compiled step of each length bucket and what feeds it."""

    batches: StepBatches  # the mode's micro-batches: pack(step, samples, completions)
    compiled: list  # bucket -> the compiled step: (state, batch) -> (state, metrics)
    local_per_micro: int  # this process's samples of each micro-batch
    sample_offset: int  # where they start in it
    local_to_global: np.ndarray  # this process's sample j of a step -> its row among all
    shapes: dict  # pack name -> its shape in each length bucket


def offline_cache_reader(config, model_config, tokenizer, options, say: Callable, reader):
    """`reader` (check_offline_cache_files': the cache opened, its files and its coverage of
    the run's data checked before the model loads), refused if the cache was made for another
    model, teacher (a checkpoint teacher's cache holds its model config; a `self` one's, the
    digest of the starting weights) or image transform (offline/checks.py); None if the mode is
    not offline."""
    if config.mode != "offline":
        return None
    split = run_config.TrainedSplit.of_config(config)
    data_config = run_config.data_config(config)
    teacher_path, teacher = split.cache_teacher_path, None
    if teacher_path:
        runtime = {"llm": run_config.model_runtime(config)}
        model_config = teacher_checkpoint.model_config_of(teacher_path, runtime)[0]
        teacher = teacher_checkpoint.identity(teacher_path)
    elif not split.cache_teacher_by_source:
        teacher = offline_checks.teacher_identity(config, split.lora)  # the starting weights'
    # A teacher per data source (the manifest then holds the student's model config): each
    # distinct checkpoint's digest read once, 'self' the starting weights'.
    paths = {t for _, t in split.cache_teacher_by_source}
    identities = {
        path: offline_checks.teacher_identity(config, split.lora)
        if path == "self"
        else teacher_checkpoint.identity(path)
        for path in paths
    }
    by_source = {name: identities[t] for name, t in split.cache_teacher_by_source}
    transform = offline_checks.data_settings(data_config)["image_transform"]
    try:
        offline_cache.check_manifest(
            config.offline_cache_dir,
            model_config,
            tokenizer,
            options,
            teacher,
            by_source,
            image_transform=transform,
        )
    except offline_cache.CacheError as e:
        run_config.config_error(e)
    say(
        f"offline teacher cache {config.offline_cache_dir}: {len(reader)} samples, "
        f"top-{reader.top_k} {reader.logprob_dtype}"
    )
    return reader


def check_offline_cache_files(config, data_config):
    """Before the model loads (offline mode): the teacher cache opened (its reader, returned),
    its files whole and every training sample of the run's data in it (a damaged or
    unfinished collection: CacheError); its model, teacher and prompt are checked once the
    model's config and tokenizer are there (offline_cache_reader). None if not offline."""
    if config.mode != "offline":
        return None
    manifest = offline_cache.read_manifest(config.offline_cache_dir)  # each raises CacheError
    reader = offline_cache.CacheReader(config.offline_cache_dir, manifest)
    offline_checks.check_covers(config.offline_cache_dir, data_config, manifest)
    return reader


def compile_steps(
    config,
    mesh,
    start: Any,
    options,
    cache_counter,
    say: Callable,
    num_processes: int,
    cache_reader=None,
) -> StepProgram:
    """The mode's micro-batches and the train step compiled for each length bucket (each
    compile's line says its shapes, its time and whether the compilation cache gave it).
    `cache_reader`: offline mode's, opened by check_offline_cache_files."""
    tokenizer = start.tokenizer
    special = tokenizer.special_tokens()
    settings = run_config.loss_settings(config, vocab_limit=tokenizer.vocab_length)
    cache_reader = offline_cache_reader(
        config, start.model_config, tokenizer, options, say, cache_reader
    )
    teachers = start.step_teachers()
    loss_fn = train_step.make_loss(
        config.mode,
        start.graphdef,
        start.rest,
        settings,
        teachers,
        source_names=start.split.source_names,
    )
    step_fn = run_config.train_step_for(
        config, loss_fn, start.optimizer, start.abstract_state, start.frozen, teachers
    )
    per_micro, accum = config.samples_per_micro_batch, config.gradient_accumulation_steps
    local_per_micro = per_micro // num_processes
    local_rows = config.rows_per_micro_batch // num_processes
    sample_offset = jax.process_index() * local_per_micro
    local_to_global = np.array(
        [
            (j // local_per_micro) * per_micro + sample_offset + j % local_per_micro
            for j in range(accum * local_per_micro)
        ]
    )
    shapes = pack_shapes.pack_shapes(config)  # pack name -> its shape in each length bucket
    batches = step_batches_for(
        config.mode,
        config,
        shapes,
        tokenizer.encode,
        options,
        special,
        mesh,
        cache_reader=cache_reader,
        sources=start.split.source_names,
        local_samples=local_per_micro,
        local_rows=local_rows,
        sample_offset=sample_offset,
    )
    compiled = []
    options = step_compiler_flags.step_compiler_options(
        config.step_compiler_flags, start.model_config
    )
    for bucket in range(config.pack_length_buckets):
        t0, read_before = time.perf_counter(), cache_counter.read
        with mesh_lib.use_mesh(mesh):
            lowered = step_fn.lower(start.abstract_state, batches.abstract_batch(bucket))
            compiled.append(lowered.compile(compiler_options=options))
        cached = " (read from the compilation cache)" if cache_counter.read > read_before else ""
        say(
            f"compiling the train step for {accum} x {config.rows_per_micro_batch} rows x "
            f"({batches.describe(bucket)}), {shapes[batches.pack_names[0]][bucket].loss_entries} "
            f"loss entries per row: {time.perf_counter() - t0:.1f} s{cached}"
        )
    return StepProgram(batches, compiled, local_per_micro, sample_offset, local_to_global, shapes)
