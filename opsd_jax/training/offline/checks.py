"""What a cache is checked against beyond its model config, tokenizer and prompt (cache.py's
`check_manifest`): the weights its teacher ran with, the data settings that shape the views, and
whether it covers every training sample of the run.

* `teacher_identity`: the identity (io/weights_digest.py) of the weights a `self` teacher runs
  with, the student's starting weights: model_path's weights file, or with `resume_from` and
  `resume_model_only` the checkpoint's params item (`checkpoint_identity`). The manifest records
  it, as a checkpoint teacher's, so a collection resumed from other weights is refused instead
  of mixing two teachers in one cache, and so is a trainer whose teacher is another.
* `data_settings`: the data section of the manifest (datasets, split, image transform); the
  image transform shapes both views (their patches), so a cache of another is refused by name.
* `check_covers`: every train-split sample key of the run's data is cached or recorded as
  skipped, checked when the trainer opens the cache, not at the first step that needs a missing
  one. A collection that went through all its rows records it (`finished` in its progress
  file); when every process of one collection did and the data settings are the cache's, the
  rows are not read again.
"""

from __future__ import annotations

import dataclasses
import os

from opsd_jax.io import weights_digest
from opsd_jax.training.offline.cache import CacheError, done_keys, finished_processes


def checkpoint_identity(path: str, item: str) -> dict:
    """weights_digest.checkpoint_item_identity of a checkpoint's `item` ('params' or
    'ema_params'): of a step directory, a params-only export, or a checkpoints root's latest
    complete step."""
    from opsd_jax.io import saved_items

    source = os.path.abspath(path)
    if os.path.isdir(os.path.join(source, item)):
        item_dir = os.path.join(source, item)
    else:
        item_dir = os.path.join(saved_items.step_dir_of(source), item)
        if not os.path.isdir(item_dir):
            raise CacheError(f"resume_from={path!r}: {item_dir} does not exist")
    return weights_digest.checkpoint_item_identity(item_dir)


def teacher_identity(config, lora: bool) -> dict:
    """The identity of the weights a `self` teacher runs with: what init_weights.load starts
    the student from (`lora`, the config's TrainedSplit's: its base; weights='random': the
    seed)."""
    from opsd_jax.io import init_weights
    from opsd_jax.io.checkpoint_format import EMA_PARAMS, PARAMS

    if config.resume_from and config.resume_model_only and not lora:
        item = EMA_PARAMS if config.finetune_from_ema else PARAMS
        return checkpoint_identity(config.resume_from, item)
    return init_weights.base_identity(config)


def data_settings(data_config) -> dict:
    """The manifest's `data`: which rows (datasets, split) and the image transform."""
    return dict(
        datasets=[
            dict(name=d.name, path=d.path, num_used_data=d.num_used_data)
            for d in data_config.datasets
        ],
        heldout_fraction=data_config.heldout_fraction,
        image_transform=dataclasses.asdict(data_config.image_transform),
    )


def check_covers(directory: str, data_config, manifest: dict) -> None:
    """A CacheError unless every train-split sample of `data_config` is in the cache (listed or
    recorded as skipped), saying how many are missing and how to finish the collection."""
    from opsd_jax.training.offline.collect import rows_of_process, sample_key

    finished, counts = finished_processes(directory)
    whole = [c for c in counts if all(finished.get(i) == c for i in range(c))]
    if whole and manifest.get("data") == data_settings(data_config):
        return  # every process of one collection went through all the rows of this data
    done = done_keys(directory)
    keys = {sample_key(name, source[r]) for _, name, source, r in rows_of_process(data_config)}
    missing = sorted(keys - done)
    if not missing:
        return
    if whole:
        why = "its collection finished, so it was made over other data than this run's"
    elif counts:
        count = max(counts)
        left = [i for i in range(count) if finished.get(i) != count]
        why = (
            f"process(es) {', '.join(map(str, left))} of --process_count={count} did not "
            "finish (each reruns with its own --process_index)"
        )
    else:
        why = "no process finished its collection (stopped, or --max_samples)"
    raise CacheError(
        f"offline cache {directory}: {len(missing)} of the run's {len(keys)} training samples "
        f"are neither cached nor recorded as skipped (e.g. {missing[0]!r}): {why}; finish it by "
        "running scripts/collect_traces.py again with this run's config"
    )
