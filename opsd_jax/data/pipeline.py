"""The grain input pipeline: a weighted mixture of datasets -> decoded, ViT-ready samples.

What: per dataset `MapDataset.source -> shuffle(seed) -> slice[process_index::process_count] ->
repeat()`, then `MapDataset.mix(weights)`, then one `.map` that decodes the row and runs the ViT
image transform (patches + r*G+c position ids, G the model's ViT grid), then `to_iter_dataset`
with a few read threads.
`DataIterator` wraps the grain iterator: it drops bad rows, counts them per reason, and exposes a
small JSON-able state (`get_state` / `set_state`) for our checkpoints.

Why this order: shuffling before the per-process slice gives every host a disjoint shard of one
global permutation; repeating before the mix keeps the mixture infinite (grain's mix stops at the
shortest input) and reshuffles each epoch; mixing `MapDataset`s keeps the whole pipeline random
access, so the iterator state is one integer (`next_index`) and restoring it is exact.

Why the skip counting lives in the consumer: decode runs in grain's read threads (and could run in
worker processes with `mp_prefetch`), where a counter would also count prefetched-but-unconsumed
rows and would not survive a restore. Instead a bad row becomes a `Skipped(reason)` element, and
`DataIterator.__next__` (the main thread) counts and drops it; the counts are part of the state.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import grain

from opsd_jax.data.data_config import DataConfig
from opsd_jax.data.image_transform import VitImageInputs, prepare_vit_image
from opsd_jax.data.sources import (
    BAD_IMAGE,
    DECODE_ERROR,
    SKIP_REASONS,
    DataError,
    RawSample,
    Skipped,
    decode_row,
    open_source,
)

log = logging.getLogger(__name__)
_MAX_LOGGED_SKIPS_PER_REASON = 5
_MAX_CONSECUTIVE_SKIPS = 10_000


@dataclasses.dataclass
class Sample:
    """A training/eval element: the raw text fields plus ViT-ready images.

    `problem_image` and each of `vt_images` are `VitImageInputs` (float32 patches [N, 588] in
    [-1, 1], int32 position ids [N], grid_h, grid_w), ready for `opsd_jax.data.packing`.
    """

    pid: str
    dataset: str
    question: str
    answer: str
    problem_image: VitImageInputs
    vt_images: list[VitImageInputs]
    thoughts: list[str]
    full_text_only_thought: str | None


def reference_completion(sample: Sample) -> str:
    """The reference solution as the model should write it, in ThinkMorph's output tags: the
    text-only thought if the sample has one (else its thoughts joined), then the answer. SFT
    trains on it; the K_gen diagnostic scores it."""
    thought = sample.full_text_only_thought or " ".join(t.strip() for t in sample.thoughts if t)
    answer = f"<answer>{sample.answer}</answer>"
    return f"<think>{thought}</think>{answer}" if thought.strip() else answer


def prepare_sample(raw: RawSample, config: DataConfig) -> Sample | Skipped:
    """Run the ViT transform on every image of a decoded row (a failure skips the row), with
    the model's patch size and position grid."""
    vit = dict(
        patch_size=config.vit_patch_size, max_patches_per_side=config.vit_max_patches_per_side
    )
    try:
        problem = prepare_vit_image(raw.problem_image, config.image_transform, **vit)
        vts = [prepare_vit_image(image, config.image_transform, **vit) for image in raw.vt_images]
    except (ValueError, OSError) as e:  # e.g. a truncated image that decodes lazily, odd modes
        return Skipped(BAD_IMAGE, raw.dataset, raw.pid, f"transform: {type(e).__name__}: {e}")
    return Sample(
        pid=raw.pid,
        dataset=raw.dataset,
        question=raw.question,
        answer=raw.answer,
        problem_image=problem,
        vt_images=vts,
        thoughts=raw.thoughts,
        full_text_only_thought=raw.full_text_only_thought,
    )


@dataclasses.dataclass(frozen=True)
class _DecodeAndTransform:
    """The pipeline's map function (a picklable object, so `mp_prefetch` could be used)."""

    dataset_names: tuple[str, ...]
    config: DataConfig

    def __call__(self, tagged: tuple[int, dict[str, Any]]) -> Sample | Skipped:
        dataset_idx, record = tagged
        name = self.dataset_names[dataset_idx]
        cfg = self.config
        try:
            raw = decode_row(
                record,
                name,
                max_reference_rounds=cfg.max_reference_rounds,
                max_question_chars=cfg.max_question_chars,
                require_vt=cfg.require_vt,
            )
            if isinstance(raw, Skipped):
                return raw
            return prepare_sample(raw, cfg)
        except Exception as e:  # noqa: BLE001 — a bad row must never stop training
            pid = record.get("pid") if isinstance(record, dict) else None
            return Skipped(DECODE_ERROR, name, pid, f"{type(e).__name__}: {e}")


@dataclasses.dataclass(frozen=True)
class _Tag:
    """Pairs a row with its dataset index, so one map function serves the whole mixture."""

    dataset_idx: int

    def __call__(self, record: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return self.dataset_idx, record


def _process_info(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    if process_index is None or process_count is None:
        import jax  # deferred: the rest of the data code is numpy/PIL only

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    return process_index, process_count


@dataclasses.dataclass(frozen=True)
class _GlobalRow:
    """Local element k of process p -> the global row it stands for (see build_dataset)."""

    rows: grain.MapDataset
    index: int
    count: int
    block: int

    def __call__(self, k: int) -> tuple[int, dict[str, Any]]:
        turn, offset = divmod(k, self.block)
        return self.rows[(turn * self.count + self.index) * self.block + offset]


def _process_blocks(ds: grain.MapDataset, index: int, count: int, block: int) -> grain.MapDataset:
    # Selecting before the decode map: a process never reads or decodes another's rows' images.
    turns, rest = divmod(len(ds), count * block)
    local = turns * block + min(max(rest - index * block, 0), block)
    return grain.MapDataset.range(local).map(_GlobalRow(ds, index, count, block))


def check_split_sizes(config: DataConfig, process_count: int, *, evaluates: bool) -> None:
    """Before a run loads its model: each dataset's train split has a row for every process
    and, when the run evaluates, its held-out split has a row at all. A DataError names the
    dataset, the split and the keys that decide it (later, the iterators would raise after
    the model load and the compiles)."""
    for spec in config.datasets:
        splits = [("train", process_count)] + ([("eval", 1)] if evaluates else [])
        for split, needed in splits:
            rows = len(
                open_source(
                    spec,
                    split,
                    heldout_fraction=config.heldout_fraction,
                    max_reference_rounds=config.max_reference_rounds,
                    row_group_cache=config.row_group_cache,
                )
            )
            if rows >= needed:
                continue
            where = f"dataset {spec.name!r} ({spec.path})"
            if split == "eval":
                raise DataError(
                    f"{where}: its held-out split is empty (data.heldout_fraction="
                    f"{config.heldout_fraction}, and no file besides train-*): raise "
                    "data.heldout_fraction, add a test file, or set eval_every=0"
                )
            raise DataError(
                f"{where}: its train split has {rows} rows, fewer than the {needed} "
                f"processes reading it (data.heldout_fraction={config.heldout_fraction} holds "
                "the rest out)"
            )


def build_dataset(
    config: DataConfig,
    split: str = "train",
    *,
    shuffle: bool | None = None,
    repeat: bool | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
    process_block: int = 1,
) -> tuple[grain.IterDataset, dict[str, Any]]:
    """The grain IterDataset of `Sample | Skipped` elements, and a fingerprint of its layout.

    Defaults: `split="train"` shuffles and repeats forever (datasets mixed by weight); other
    splits read every row once, dataset after dataset, in file order.
    `process_index` / `process_count` default to jax's. All processes agree on one global
    stream of rows (same shuffle and mix); process p reads and decodes only its blocks of it:
    blocks of `process_block` rows dealt round-robin (rows [p*b, (p+1)*b), then
    [(P+p)*b, (P+p+1)*b), ...). The trainer sets b = samples per micro-batch / P, so the global
    micro-batch is the same samples, in the same order, whatever the number of processes.
    """
    shuffle = (split == "train") if shuffle is None else shuffle
    repeat = (split == "train") if repeat is None else repeat
    process_index, process_count = _process_info(process_index, process_count)
    if process_block < 1:
        raise ValueError(f"process_block must be >= 1, got {process_block}")

    parts, sizes = [], []
    for i, spec in enumerate(config.datasets):
        source = open_source(
            spec,
            split,
            heldout_fraction=config.heldout_fraction,
            max_reference_rounds=config.max_reference_rounds,
            row_group_cache=config.row_group_cache,
        )
        if len(source) < process_count:
            raise ValueError(
                f"dataset {spec.name!r} ({spec.path}, split={split}) has {len(source)} rows, "
                f"fewer than the {process_count} processes reading it"
            )
        ds = grain.MapDataset.source(source)
        if shuffle:
            # Distinct, fixed seeds per dataset: the same config gives the same order everywhere.
            ds = ds.shuffle(seed=config.seed * 1_000_003 + i)
        ds = ds.map(_Tag(i))
        if repeat:
            ds = ds.repeat()  # reseeds the shuffle each epoch
        parts.append(ds)
        sizes.append(len(source))

    if len(parts) == 1:
        ds = parts[0]
    elif repeat:
        ds = grain.MapDataset.mix(parts, weights=[spec.weight for spec in config.datasets])
    else:
        # A single pass (evaluation) reads every row once; mixing would stop at the shortest
        # dataset, and weights mean nothing for a full pass.
        ds = grain.MapDataset.concatenate(parts)
    if process_count > 1:
        ds = _process_blocks(ds, process_index, process_count, process_block)
    ds = ds.map(_DecodeAndTransform(tuple(d.name for d in config.datasets), config))
    read_options = grain.ReadOptions(
        num_threads=config.num_threads, prefetch_buffer_size=config.prefetch_buffer_size
    )
    fingerprint = {
        "split": split,
        "datasets": [d.name for d in config.datasets],
        "sizes": sizes,
        "seed": config.seed,
        "process": [process_index, process_count, process_block],
    }
    return ds.to_iter_dataset(read_options), fingerprint


class DataIterator:
    """Iterator of `Sample`s that drops bad rows, counts them, and checkpoints as a small dict.

    `skipped` -> {reason: count} (all reasons, zeros included); `num_yielded` -> samples returned.
    `get_state()` -> {"grain": {...}, "skipped": {...}, "num_yielded": n, "fingerprint": {...}}
    (JSON-able); `set_state(state)` continues with exactly the samples that would have followed.
    """

    def __init__(self, dataset: grain.IterDataset, fingerprint: dict[str, Any] | None = None):
        self._iter = iter(dataset)
        self._fingerprint = fingerprint or {}
        self.skipped: dict[str, int] = {r: 0 for r in SKIP_REASONS}
        self.num_yielded = 0

    def __iter__(self) -> Iterator[Sample]:
        return self

    def __next__(self) -> Sample:
        consecutive = 0
        while True:
            element = next(self._iter)  # StopIteration ends a non-repeating pass
            if not isinstance(element, Skipped):
                self.num_yielded += 1
                return element
            count = self.skipped.get(element.reason, 0) + 1
            self.skipped[element.reason] = count
            consecutive += 1
            if consecutive > _MAX_CONSECUTIVE_SKIPS:
                # A repeating pipeline whose rows are all bad would otherwise spin forever.
                raise RuntimeError(f"{consecutive} bad rows in a row, none usable: {self.skipped}")
            if count <= _MAX_LOGGED_SKIPS_PER_REASON:
                log.warning(
                    "skipping row %s of %s: %s %s%s",
                    element.pid,
                    element.dataset,
                    element.reason,
                    element.detail,
                    " (further skips for this reason are only counted)"
                    if count == _MAX_LOGGED_SKIPS_PER_REASON
                    else "",
                )

    def take(self, n: int) -> list[Sample]:
        """The next n samples (fewer at the end of a non-repeating pass)."""
        out = []
        for sample in self:
            out.append(sample)
            if len(out) == n:
                break
        return out

    def metrics(self) -> dict[str, int]:
        """Flat counters for the metrics logger: data/num_yielded, data/skipped/<reason>."""
        out = {"data/num_yielded": self.num_yielded}
        out.update({f"data/skipped/{r}": n for r, n in self.skipped.items()})
        return out

    def get_state(self) -> dict[str, Any]:
        return {
            "grain": self._iter.get_state(),
            "skipped": dict(self.skipped),
            "num_yielded": self.num_yielded,
            "fingerprint": dict(self._fingerprint),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        saved = state.get("fingerprint")
        if saved and self._fingerprint and saved != self._fingerprint:
            # Not fatal (e.g. a deliberate data change), but the resumed order is then not the
            # continuation of the saved one.
            log.warning(
                "data iterator state from a different pipeline: saved %s, now %s",
                saved,
                self._fingerprint,
            )
        self._iter.set_state(state["grain"])
        self.skipped.update(state.get("skipped", {}))
        self.num_yielded = int(state.get("num_yielded", 0))


def make_iterator(
    config: DataConfig,
    split: str = "train",
    **kwargs: Any,
) -> DataIterator:
    """`DataIterator` over `build_dataset(config, split, **kwargs)`."""
    dataset, fingerprint = build_dataset(config, split, **kwargs)
    return DataIterator(dataset, fingerprint)
