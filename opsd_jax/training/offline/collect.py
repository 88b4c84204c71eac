"""Collecting the offline teacher cache: the model run once over the data on the mesh, batched,
both views of every sample, the teacher's top-k and the VT weights written to the cache
(cache.py) in committed shards, resumable after a kill. scripts/collect_traces.py is
its command line.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping

import numpy as np

from opsd_jax.data.opsd_packs import PromptOptions
from opsd_jax.training.offline.cache import (
    DUPLICATE,
    MANIFEST,
    TOO_LONG,
    CacheError,
    ShardWriter,
    create_json,
    differences,
    done_keys,
    read_manifest,
)
from opsd_jax.training.offline.views import build_offline_packs, sample_entries

# ---- collection ----------------------------------------------------------------------------------


def make_collect_step(graphdef, rest, *, top_k: int, vocab_limit: int | None):
    """jit(params, teacher_pack, text_pack) -> (top_logprobs, top_ids, vt_kl) per loss entry."""
    import jax
    from flax import nnx

    from opsd_jax.training import losses

    @jax.jit
    def collect_step(params, teacher_pack, text_pack):
        model = nnx.merge(graphdef, params, rest)
        teacher = model.logits_at(model(teacher_pack), teacher_pack.loss_rows)
        text_only = model.logits_at(model(text_pack), text_pack.loss_rows)
        return losses.teacher_cache_entries(
            teacher, text_only, teacher_pack.loss_mask, top_k, vocab_limit=vocab_limit
        )

    return collect_step


def rows_of_process(data_config, process_index: int = 0, process_count: int = 1):
    """(global index, dataset name, source, row) of every train row this process collects
    (all of them with the defaults)."""
    from opsd_jax.data.sources import open_source

    offset = 0
    for spec in data_config.datasets:
        source = open_source(
            spec,
            "train",
            heldout_fraction=data_config.heldout_fraction,
            max_reference_rounds=data_config.max_reference_rounds,
        )
        for r in range(len(source)):
            if (offset + r) % process_count == process_index:
                yield offset + r, spec.name, source, r
        offset += len(source)


def sample_key(dataset: str, record) -> str:
    """A raw row's cache key, as cache_key(sample) (decode_row keeps str(pid))."""
    return f"{dataset}/{record.get('pid')}"


def _eta(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


@dataclasses.dataclass
class CollectSummary:
    written: int
    skipped: dict
    already_done: int
    seconds: float


def collect(
    *,
    collect_step,
    params,
    tokenizer,
    data_config,
    options: PromptOptions,
    mesh,
    directory: str,
    manifest: dict,
    samples_per_batch: int,
    rows_per_batch: int,
    max_forward_tokens: int,
    shard_samples: int,
    process_index: int = 0,
    process_count: int = 1,
    max_samples: int | None = None,
    log: Callable[[str], None] = print,
    log_every_s: float = 10.0,
    on_commit: Callable[[str], None] | None = None,
    by_source: Mapping[str, tuple[Callable, object]] | None = None,
) -> CollectSummary:
    """Run the teacher over this process's rows in batches and commit shards as they fill.
    `by_source`: dataset name -> (collect_step, params) of the teacher that scores it (a
    teacher per data source); a dataset not named is scored by `collect_step` / `params`.
    A batch holds one teacher's samples.

    Resumable: rows whose key a previous run listed (or recorded as skipped) are not read
    again. `max_samples` stops after that many new samples (tests, dry runs). Progress (done /
    total, rate, ETA) is logged at most every `log_every_s` seconds, and at the end."""
    import jax

    from opsd_jax.data.pipeline import prepare_sample
    from opsd_jax.data.sources import Skipped, decode_row
    from opsd_jax.parallel import distributed
    from opsd_jax.parallel import mesh as mesh_lib

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, MANIFEST)
    # Processes starting together on a new directory: one writes the manifest, and every one
    # (the writer too) compares what is there with its own settings.
    if not os.path.exists(path):
        create_json(path, manifest)
    problems = differences(read_manifest(directory), manifest)
    if problems:
        raise CacheError(
            f"{path}: this cache was made with other settings; use another "
            "directory or the same settings:\n  " + "\n  ".join(problems)
        )
    writer = ShardWriter(
        directory, process_index, manifest["logprob_dtype"], shard_samples, on_commit
    )
    done = done_keys(directory)
    todo = [row for row in rows_of_process(data_config, process_index, process_count)]
    start, written, already, skipped = time.perf_counter(), 0, 0, {}
    last_log = start
    special = tokenizer.special_tokens()

    def skip(key, reason):
        writer.skip(key, reason)
        skipped[reason] = skipped.get(reason, 0) + 1

    def report(final=False):
        nonlocal last_log
        now = time.perf_counter()
        if not final and now - last_log < log_every_s:
            return
        last_log = now
        left = len(todo) - already - written - sum(skipped.values())
        rate = written / max(now - start, 1e-9)
        log(
            f"[p{process_index}] {written + already + sum(skipped.values())}/{len(todo)} samples "
            f"({already} cached before, {sum(skipped.values())} skipped), {rate:.2f} samples/s, "
            f"ETA {_eta(left / rate) if rate > 0 else '?'}"
        )

    def run(batch, teacher):
        nonlocal written
        step, weights = teacher
        packs = build_offline_packs(
            [s for _, s in batch],
            tokenizer.encode,
            options,
            special,
            num_rows=rows_per_batch,
            max_forward_tokens=max_forward_tokens,
            with_teacher=True,
        )
        for index in packs.dropped:
            skip(batch[index][0], TOO_LONG)
        if packs.kept:
            with mesh_lib.use_mesh(mesh):
                outputs = step(
                    weights,
                    distributed.put_rows(packs.teacher, mesh),
                    distributed.put_rows(packs.student, mesh),
                )
            top_logprobs, top_ids, kl = (np.asarray(jax.device_get(x)) for x in outputs)
            for j, index in enumerate(packs.kept):
                row, cols = sample_entries(packs.teacher, j)
                targets = packs.teacher.loss_targets[row, cols]
                writer.add(
                    batch[index][0],
                    targets,
                    top_ids[row, cols],
                    top_logprobs[row, cols],
                    kl[row, cols],
                )
                written += 1
        report()

    teachers, default = dict(by_source or {}), (collect_step, params)
    batches: dict[int, tuple[list, tuple]] = {}  # a teacher's id -> (its batch, the teacher)
    seen, stopped = set(), False
    for _, name, source, r in todo:
        pending = sum(len(b) for b, _ in batches.values())
        if max_samples is not None and written + pending >= max_samples:
            stopped = True
            break
        record = source[r]
        key = sample_key(name, record)
        if key in done:
            already += 1
            continue
        if key in seen:  # a repeated dataset/pid: the first row is the one cached
            skipped[DUPLICATE] = skipped.get(DUPLICATE, 0) + 1
            continue
        seen.add(key)
        raw = decode_row(
            record,
            name,
            max_reference_rounds=data_config.max_reference_rounds,
            max_question_chars=data_config.max_question_chars,
            require_vt=data_config.require_vt,
        )
        sample = raw if isinstance(raw, Skipped) else prepare_sample(raw, data_config)
        if isinstance(sample, Skipped):
            skip(key, sample.reason)
            continue
        teacher = teachers.get(name, default)
        batch, _ = batches.setdefault(id(teacher), ([], teacher))
        batch.append((key, sample))
        if len(batch) == samples_per_batch:
            run(batch, teacher)
            batch.clear()
    for batch, teacher in batches.values():
        if batch:
            run(batch, teacher)
    if stopped:
        writer.commit()
    else:  # every row of this process is cached or skipped: the trainer need not read them
        writer.finish(process_count)
    report(final=True)
    return CollectSummary(written, skipped, already, time.perf_counter() - start)
