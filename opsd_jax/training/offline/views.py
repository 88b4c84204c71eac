"""Offline mode's two views of a sample (the teacher view with its VT images, the text-only view)
and the text-only micro-batches the trainer packs from them with the cached teacher. What the
views hold, for each `offline_target`, is cache.py's docstring.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from models.pack import Pack
from opsd_jax.data.opsd_packs import (
    Encode,
    PromptOptions,
    assign_rows,
    bucket,
    patches_of,
    per_row_max,
    prompt_items,
    shaped_pack,
    teacher_context_items,
)
from opsd_jax.data.pack_shapes import PackShape, choose_bucket
from opsd_jax.data.packing import Image, SpecialTokens, Text, pack_samples, sample_length
from opsd_jax.data.pipeline import reference_completion
from opsd_jax.training.offline.cache import OFFLINE_TARGETS, CacheError, CacheReader, cache_key

# ---- the two views ------------------------------------------------------------------------------


def target_segments(sample, max_reference_rounds: int) -> list[str]:
    """The target text blocks, split where the VT images go (one more block than images)."""
    rounds = min(len(sample.vt_images), max_reference_rounds)
    thoughts = list(sample.thoughts)
    segments = []
    for k in range(rounds):
        head = "<image_end>" if k else ""
        thought = f"<think>{thoughts[k]}</think>" if k < len(thoughts) and thoughts[k] else ""
        segments.append(f"{head}{thought}<image_start>")
    rest = "".join(f"<think>{t}</think>" for t in thoughts[rounds:] if t)
    segments.append(("<image_end>" if rounds else "") + rest + f"<answer>{sample.answer}</answer>")
    return segments


def view_items(sample, encode: Encode, options: PromptOptions, *, with_vt: bool) -> list:
    """The teacher view (with_vt) or the text-only view of `sample`, target blocks scored.

    `options.offline_target` 'text_only': the target is the reference completion (as SFT trains
    on it), after the student prompt or, in the teacher view, the OPSD teacher's context with
    its VT images; 'interleaved': ThinkMorph's output with the VT images between its blocks."""
    if options.offline_target == "text_only":
        context = (teacher_context_items if with_vt else prompt_items)(sample, encode, options)
        return context + [Text(encode(reference_completion(sample)), loss=True)]
    if options.offline_target != "interleaved":
        raise ValueError(
            f"offline_target={options.offline_target!r}; allowed: "
            f"{', '.join(map(repr, OFFLINE_TARGETS))}"
        )
    items = prompt_items(sample, encode, options)
    segments = target_segments(sample, options.max_reference_rounds)
    for k, text in enumerate(segments):
        items.append(Text(encode(text), loss=True))
        if with_vt and k < len(segments) - 1:
            vt = sample.vt_images[k]
            items.append(Image(vt.patches, vt.position_ids))
    return items


def _loss_entries(items) -> int:
    return sum(len(it.ids) + 1 for it in items if isinstance(it, Text) and it.loss)


@dataclasses.dataclass(frozen=True)
class OfflinePacks:
    student: Pack  # the text-only view
    teacher: Pack | None  # the VT view (collection only), rows and loss entries as `student`
    kept: list[int]  # indices of the packed samples (pack sample id j = kept[j])
    dropped: list[int]  # indices of samples over max_forward_tokens or fitting in no row
    padding_fraction: float  # share of padding tokens in the student pack
    bucket: int = 0  # the length bucket of the fixed shapes used (0 without shapes)


def build_offline_packs(
    samples,
    encode: Encode,
    options: PromptOptions,
    special: SpecialTokens,
    *,
    num_rows: int,
    max_forward_tokens: int,
    with_teacher: bool,
    shapes: list[PackShape] | None = None,
) -> OfflinePacks:
    """Text-only (and, `with_teacher`, VT-view) packs of `samples`, loss entries aligned.

    A sample whose longest packed view exceeds `max_forward_tokens` is dropped, not truncated
    (as in SFT: a cut target would lose the answer). `shapes` (training: the 'offline' shape of
    each length bucket, pack_shapes.pack_shapes) fixes the text-only pack's sizes, so the train
    step compiles once per bucket; a sample that fits in no row of the largest is dropped too.
    Without shapes (collection, tests) the sizes are fitted to the content (powers of two)."""
    if shapes is not None and with_teacher:
        raise ValueError("fixed shapes are for the training (text-only) pack only")
    student_items, teacher_items, kept, dropped = [], [], [], []
    for index, sample in enumerate(samples):
        student = view_items(sample, encode, options, with_vt=False)
        teacher = view_items(sample, encode, options, with_vt=True) if with_teacher else student
        if sample_length(teacher) > max_forward_tokens:
            dropped.append(index)
            continue
        kept.append(index)
        student_items.append(student)
        teacher_items.append(teacher)
    if shapes is not None and kept:
        needs = [[sample_length(i), patches_of(i), _loss_entries(i)] for i in student_items]
        capacities = [np.array(dataclasses.astuple(s)) for s in shapes]
        bucket_index, rows, _ = choose_bucket(needs, capacities, num_rows)  # no cuts: drops
        dropped = sorted(dropped + [kept[i] for i, row in enumerate(rows) if row is None])
        keep = [i for i, row in enumerate(rows) if row is not None]
        kept, student_items = [kept[i] for i in keep], [student_items[i] for i in keep]
        if kept:
            pack = shaped_pack(
                student_items,
                shapes[bucket_index],
                num_rows,
                special,
                [rows[i] for i in keep],
                fixed=True,
            )
            padding = float(1.0 - (pack.segment_ids > 0).mean())
            return OfflinePacks(pack, None, kept, dropped, padding, bucket_index)
    if not kept:
        return OfflinePacks(None, None, kept, dropped, 1.0)
    # The longer view decides the rows; both packs then list their entries in the same order.
    rows_of = assign_rows([sample_length(i) for i in teacher_items], num_rows)
    entries = bucket(per_row_max(student_items, rows_of, num_rows, _loss_entries))

    def pack(items):
        return pack_samples(
            items,
            row_length=bucket(per_row_max(items, rows_of, num_rows, sample_length)),
            num_rows=num_rows,
            max_patches=bucket(per_row_max(items, rows_of, num_rows, patches_of)),
            max_loss_entries=entries,
            special=special,
            rows_of=rows_of,
        )

    student_pack = pack(student_items)
    teacher_pack = pack(teacher_items) if with_teacher else None
    padding = float(1.0 - (student_pack.segment_ids > 0).mean())
    return OfflinePacks(student_pack, teacher_pack, kept, dropped, padding)


def sample_entries(pack: Pack, j: int) -> tuple[int, np.ndarray]:
    """(row, entry columns) of packed sample j's loss entries, in target order."""
    entries = np.asarray(pack.loss_mask) & (np.asarray(pack.loss_sample) == j)
    row = int(np.argmax(entries.any(axis=1)))
    return row, np.nonzero(entries[row])[0]


# ---- training: one micro-batch's pack and cached teacher ------------------------------------


@dataclasses.dataclass(frozen=True)
class OfflineBatch:
    pack: Pack  # the text-only view
    cache: dict  # top_logprobs [R, C, k] f32, top_ids [R, C, k] i32, vt_weights [R, C] f32
    num_dropped: int  # samples skipped at collection, over max_forward_tokens or fitting no row
    padding_fraction: float
    bucket: int = 0  # the length bucket of the fixed shapes used (0 without shapes)
    packed: tuple = ()  # the packed samples, by pack sample id


def empty_cache(num_rows: int, loss_entries: int, top_k: int) -> dict:
    """Zero cache arrays for `num_rows` rows of `loss_entries` entries: what `offline_batch`
    fills (entries without a target keep these zeros; the loss masks them out)."""
    return dict(
        top_logprobs=np.zeros((num_rows, loss_entries, top_k), np.float32),
        top_ids=np.zeros((num_rows, loss_entries, top_k), np.int32),
        vt_weights=np.zeros((num_rows, loss_entries), np.float32),
    )


def offline_batch(
    samples,
    reader: CacheReader,
    encode: Encode,
    options: PromptOptions,
    special: SpecialTokens,
    *,
    num_rows: int,
    max_forward_tokens: int,
    shapes: list[PackShape] | None = None,
) -> OfflineBatch:
    """The student pack of `samples` and the cached teacher at each of its loss entries.

    Samples the collector skipped (too long for its max_forward_tokens) are dropped; a sample
    that is neither cached nor skipped, or whose cached target differs from this run's
    (another tokenizer, prompt or data), is an error naming it. `shapes` fixes the pack's
    sizes (see `build_offline_packs`), and with them the cache arrays' [rows, entries, k]; a
    micro-batch of which no sample is usable is then an all-padding pack at the first shape
    with an empty cache (loss 0), every sample counted in `num_dropped`."""
    usable = [s for s in samples if cache_key(s) not in reader.skipped]
    for sample in usable:
        if cache_key(sample) not in reader:
            reader.lookup(cache_key(sample))  # raises the CacheError that names it
    packs = build_offline_packs(
        usable,
        encode,
        options,
        special,
        num_rows=num_rows,
        max_forward_tokens=max_forward_tokens,
        with_teacher=False,
        shapes=shapes,
    )
    if not packs.kept:
        if shapes is None:  # sizes fitted to the content: nothing to fit them to
            raise ValueError(
                f"no sample of the micro-batch is usable (max_forward_tokens="
                f"{max_forward_tokens}, {len(samples) - len(usable)} skipped by the collector)"
            )
        # At fixed shapes, as SFT and OPSD: every sample dropped and counted, never the run
        # (one sample a micro-batch and one long sample): an all-padding pack, loss 0.
        pack = shaped_pack([], shapes[0], num_rows, special, [], fixed=True)
        cache = empty_cache(*pack.loss_mask.shape, reader.top_k)
        return OfflineBatch(pack, cache, len(samples), 1.0, 0, ())
    pack = packs.student
    cache = empty_cache(*pack.loss_mask.shape, reader.top_k)
    for j, index in enumerate(packs.kept):
        key = cache_key(usable[index])
        cached = reader.lookup(key)
        row, cols = sample_entries(pack, j)
        if not np.array_equal(pack.loss_targets[row, cols], cached.target_ids):
            raise CacheError(
                f"sample {key!r}: the cached target ({len(cached.target_ids)} "
                f"tokens) differs from this run's ({len(cols)} tokens); the cache "
                f"{reader.directory} was made with another tokenizer, prompt or "
                "data"
            )
        cache["top_logprobs"][row, cols] = cached.top_logprobs
        cache["top_ids"][row, cols] = cached.top_ids
        cache["vt_weights"][row, cols] = cached.vt_weights
    return OfflineBatch(
        pack,
        cache,
        len(samples) - len(packs.kept),
        packs.padding_fraction,
        packs.bucket,
        tuple(usable[i] for i in packs.kept),
    )
