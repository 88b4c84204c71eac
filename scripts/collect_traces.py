"""Offline Visual-OPSD, step 1: run the teacher once over the training data and cache it.

    python scripts/collect_traces.py --config configs/offline_tiny.py [--config.key=value ...]
        [--process_index=I --process_count=N] [--max_samples=M]

Writes to `offline_cache_dir`, per training sample: the teacher's top-`offline_top_k` log-probs
and ids at every target token of the teacher view (its context with the VT images; the target
is `offline_target`'s, docs/offline.md), and the VT-sensitivity weight
KL(teacher with VT || the same model on the text-only view); then train with the same config
(`mode='offline'`). The model, data, prompt and `max_forward_tokens` come from that config, so
the cache matches what the trainer packs; the teacher is the student's starting weights, or with
`teacher_mode='checkpoint'` the model of `teacher_path` (checked against the student's tokenizer
and shapes), or with `teacher_by_source` each dataset's own (`self` or a checkpoint's
directory). The manifest records the digest of every teacher's weights, the starting weights'
too (model_path's, or resume_from's with resume_model_only), and the image transform: a rerun
refuses to resume into a cache of other weights or settings, and training refuses the cache
under another teacher; `rows_per_micro_batch` rows of
`samples_per_micro_batch` samples go through each forward.

Resumable: run the same command again after a kill and it continues with the samples not yet
committed (each exactly once). Several processes (e.g. one per host, each on its own devices,
no communication) split the rows with --process_index / --process_count and write their own
shards into the same directory. The format is in opsd_jax/training/offline/cache.py.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
from absl import app, flags, logging

from opsd_jax import run_config
from opsd_jax.io import hf_load, init_weights, teacher_checkpoint
from opsd_jax.parallel import distributed
from opsd_jax.parallel import mesh as mesh_lib
from opsd_jax.toy import assets as toy_assets
from opsd_jax.training.offline import cache as offline_cache
from opsd_jax.training.offline import checks as offline_checks
from opsd_jax.training.offline import collect as offline_collect

_PROCESS_INDEX = flags.DEFINE_integer("process_index", 0, "this process's share of the rows")
_PROCESS_COUNT = flags.DEFINE_integer("process_count", 1, "processes collecting together")
_MAX_SAMPLES = flags.DEFINE_integer("max_samples", None, "stop after this many new samples")


@dataclasses.dataclass
class _Teacher:
    graphdef: Any
    params: Any
    rest: Any
    model_config: Any
    tokenizer: Any  # the student's (a checkpoint teacher's is checked equal)
    source: str  # where its weights came from
    identity: dict  # of the weights it runs with (weights_digest.identity, checks.*_identity)


def load_teacher(config, mesh, config_changes, path: str = "", student=None) -> _Teacher:
    """A model a cache is collected from: `path`, a checkpoint teacher's directory (checked
    against the student's tokenizer and shapes, read from model_path without its weights), or
    '' for the student's starting weights (the PyTorch collector loads the model file;
    weights='ema' caches the EMA weights instead)."""
    if not path:
        split = run_config.TrainedSplit.of_config(config)
        start = init_weights.load(config, mesh, split=split, config_changes=config_changes)
        return _Teacher(
            start.graphdef,
            start.params,
            start.rest,
            start.model_config,
            start.tokenizer,
            config.model_path,
            # Recorded as a checkpoint teacher's: a collection resumed from other starting
            # weights (another resume_from) is refused, not mixed into the cache.
            offline_checks.teacher_identity(config, split.lora),
        )
    _, student_config, tokenizer = student or student_shapes(config, mesh, config_changes)
    try:
        teacher = teacher_checkpoint.load(
            path,
            mesh,
            student_config=student_config,
            student_tokenizer=tokenizer,
            config_changes=config_changes,
        )
    except teacher_checkpoint.TeacherMismatch as e:
        run_config.config_error(e)
    return _Teacher(
        teacher.graphdef,
        teacher.params,
        teacher.rest,
        teacher.model_config,
        tokenizer,
        path,
        teacher.identity,
    )


def student_shapes(config, mesh, config_changes):
    """(graphdef, model config, tokenizer) of model_path, no weights read."""
    return hf_load.load_hf(
        config.model_path, mesh=mesh, config_changes=config_changes, read_params=False
    )


def load_teachers(config, mesh, config_changes, student) -> dict[str, _Teacher]:
    """Each data source's teacher, by dataset name (one model loaded per distinct teacher), or
    {'': the one teacher} without teacher_by_source. `student`: student_shapes' (read once)."""
    split = run_config.TrainedSplit.of_config(config)
    if not split.cache_teacher_by_source:
        path = split.cache_teacher_path
        return {"": load_teacher(config, mesh, config_changes, path, student)}
    loaded = {}
    for name, teacher in split.cache_teacher_by_source:
        path = "" if teacher == "self" else teacher
        if path not in loaded:
            loaded[path] = load_teacher(config, mesh, config_changes, path, student)
        loaded[name] = loaded[path]
    return {name: loaded[name] for name, _ in split.cache_teacher_by_source}


def main(argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # as train.py: orbax's and jax's INFO lines are noise
    config = run_config.config_flag_value()
    index, count = _PROCESS_INDEX.value, _PROCESS_COUNT.value
    if not 0 <= index < count:
        run_config.config_error(f"--process_index={index} must be in [0, --process_count={count})")
    given = (["distributed=True"] if config.distributed else []) + (
        distributed.settings_without_distributed(config)
    )
    if given:  # each would be ignored here: N collectors would each write process 0's shards
        run_config.config_error(
            f"{', '.join(given)}: the collection runs without JAX's distributed runtime; give "
            "each host's process --process_index=I --process_count=N instead (and drop these)"
        )
    run_config.resolve_paths(config)
    devices = jax.local_devices()  # each process collects alone, on its own devices
    try:
        run_config.validate(config, len(devices), need_cache=False)
    except run_config.ConfigError as e:
        run_config.config_error(e)
    if config.toy_data:
        toy_assets.write_toy_assets(config)

    mesh = mesh_lib.make_mesh(*run_config.mesh_shape(config, len(devices)), devices=devices)
    runtime = run_config.model_runtime(config)
    t0 = time.perf_counter()
    # The student's config and tokenizer (no weights), read once for the checkpoint teachers'
    # checks and a per-source manifest; a cache of model_path's weights alone needs none.
    split = run_config.TrainedSplit.of_config(config)
    student = None
    if split.cache_teacher_by_source or split.cache_teacher_path:
        student = student_shapes(config, mesh, {"llm": runtime})
    teachers = load_teachers(config, mesh, {"llm": runtime}, student)
    by_source = "" not in teachers
    sources = {id(t): t.source for t in teachers.values()}
    print(
        f"[p{index}] teacher {', '.join(sources.values())} loaded in "
        f"{time.perf_counter() - t0:.1f}s; mesh {dict(mesh.shape)}",
        flush=True,
    )
    teacher = next(iter(teachers.values()))
    tokenizer = teacher.tokenizer
    # With a teacher per source the packs and the manifest are the student's (each teacher
    # reads them as the student does: checked where it is loaded).
    model_config = student[1] if by_source else None
    data_config = run_config.data_config(config).for_model(model_config or teacher.model_config)
    options = run_config.prompt_options(config)
    data = offline_checks.data_settings(data_config)  # the image transform too
    manifest = offline_cache.make_manifest(
        model_config or teacher.model_config,
        tokenizer,
        options,
        top_k=config.offline_top_k,
        logprob_dtype=config.offline_logprob_dtype,
        max_forward_tokens=config.max_forward_tokens,
        data=data,
        model_path=config.model_path if by_source else teacher.source,
        teacher=None if by_source else teacher.identity,
        teachers_by_source={n: t.identity for n, t in teachers.items()} if by_source else None,
    )
    # One collect step per distinct teacher; sources sharing a teacher share its batches.
    steps = {}
    for t in teachers.values():
        if id(t) not in steps:
            step = offline_collect.make_collect_step(
                t.graphdef, t.rest, top_k=config.offline_top_k, vocab_limit=tokenizer.vocab_length
            )
            steps[id(t)] = (step, t.params)
    per_source = {n: steps[id(t)] for n, t in teachers.items()} if by_source else None
    step = steps[id(teacher)][0]
    try:
        summary = offline_collect.collect(
            collect_step=step,
            params=teacher.params,
            tokenizer=tokenizer,
            data_config=data_config,
            options=options,
            mesh=mesh,
            directory=config.offline_cache_dir,
            manifest=manifest,
            samples_per_batch=config.samples_per_micro_batch,
            rows_per_batch=config.rows_per_micro_batch,
            max_forward_tokens=config.max_forward_tokens,
            shard_samples=config.offline_shard_samples,
            process_index=index,
            process_count=count,
            max_samples=_MAX_SAMPLES.value,
            log=lambda line: print(line, flush=True),
            by_source=per_source,
        )
    except offline_cache.CacheError as e:
        run_config.config_error(e)
    total, samples = offline_cache.cache_bytes(config.offline_cache_dir)
    print(
        f"[p{index}] done: {summary.written} samples written, {summary.already_done} were "
        f"cached before, skipped {summary.skipped or 'none'}, {summary.seconds:.1f}s; cache "
        f"{config.offline_cache_dir}: {samples} samples, {total / 1e6:.1f} MB "
        f"({total / max(samples, 1) / 1e3:.1f} kB per sample)",
        flush=True,
    )


if __name__ == "__main__":
    app.run(main, flags_parser=run_config.parse_flags)
