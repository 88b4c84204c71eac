"""SFT baseline packs: plain cross-entropy on the reference text-only reasoning and answer.

    context  [system?] [problem image] [question + instruction_suffix]          (student view)
         or  the teacher view with the VT images (a `vt_fraction` share of samples)
    target   [<|im_start|> <think>thought</think><answer>answer</answer> <|im_end|>]   (CE)

Why: the SFT baseline of issue #8 shares the data, packing, step and checkpoint code with
Visual-OPSD, so the two are compared on equal terms. The target is the ThinkMorph output format
(docs/opsd_loss.md §c.2) with the curated text-only chain of thought (`full_text_only_thought`,
§c.1) in place of the interleaved thought/VT/thought, because the model is trained to write text
only. A sample without `full_text_only_thought` falls back to its text thoughts joined with a
space; a sample with neither gets just `<answer>...</answer>`.

The VT context is for training a model that reads VT images (stage 1 of the toy experiment,
scripts/toy_experiment.py); which samples get it is drawn per (seed, step), so a sample is seen in
both contexts over the epochs and a resumed run draws the same choices.

A sample whose context plus target exceeds `max_forward_tokens` is dropped, not truncated: a cut
target would lose the answer and teach `<|im_end|>` where the reasoning stops mid-way; so is one
that fits in no row of the fixed shape (opsd_jax/data/pack_shapes.py, the 'sft' shapes). Without
shapes (tests) the sizes are fitted to the content, rounded up to powers of two.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from models.pack import Pack
from opsd_jax.data.opsd_packs import (
    Encode,
    PromptOptions,
    assign_rows,
    bucket,
    loss_entries_of,
    patches_of,
    per_row_max,
    prompt_items,
    shaped_pack,
    teacher_context_items,
)
from opsd_jax.data.pack_shapes import PackShape, choose_bucket
from opsd_jax.data.packing import SpecialTokens, Text, sample_length
from opsd_jax.data.pipeline import reference_completion


def choose_vt(num: int, fraction: float, seed: int, step: int) -> list[bool]:
    """Which of `num` samples get the VT (teacher) context: a seeded draw per (seed, step)."""
    if fraction <= 0.0:
        return [False] * num
    if fraction >= 1.0:
        return [True] * num
    return (np.random.default_rng([seed, step, 0x5F7]).random(num) < fraction).tolist()


@dataclasses.dataclass(frozen=True)
class SFTPacks:
    pack: Pack
    kept: list[int]  # indices of the samples in the pack (over-long ones are dropped)
    targets: list[list[int]]  # the encoded target of every kept sample
    with_vt: list[bool]  # per kept sample: trained in the VT context
    num_dropped: int
    padding_fraction: float  # share of padding tokens in the pack
    bucket: int = 0  # the length bucket of the fixed shapes used (0 without shapes)


def build_sft_packs(
    samples,
    encode: Encode,
    options: PromptOptions,
    special: SpecialTokens,
    *,
    num_rows: int,
    max_forward_tokens: int,
    use_vt: Sequence[bool] | None = None,
    shapes: list[PackShape] | None = None,
) -> SFTPacks:
    """One CE pack of `samples` in `num_rows` rows; `use_vt[i]` picks sample i's context;
    `shapes` (a PackShape per length bucket) fixes the pack's sizes."""
    use_vt = [False] * len(samples) if use_vt is None else list(use_vt)
    if len(use_vt) != len(samples):
        raise ValueError(f"{len(samples)} samples but {len(use_vt)} use_vt flags")
    items, kept, targets, with_vt = [], [], [], []
    for index, (sample, vt) in enumerate(zip(samples, use_vt)):
        context = (teacher_context_items if vt else prompt_items)(sample, encode, options)
        target = encode(reference_completion(sample))
        sample_items = context + [Text(target, loss=True)]
        if sample_length(sample_items) > max_forward_tokens:
            continue
        items.append(sample_items)
        kept.append(index)
        targets.append(target)
        with_vt.append(vt)
    if not kept and shapes is None:  # fixed shapes: an empty (all padding) pack, all dropped
        raise ValueError(f"no sample fits max_forward_tokens={max_forward_tokens}")

    bucket_index = 0
    if shapes is None:
        rows_of = assign_rows([sample_length(i) for i in items], num_rows)
        shape = PackShape(
            *(
                bucket(per_row_max(items, rows_of, num_rows, count))
                for count in (sample_length, patches_of, loss_entries_of)
            )
        )
    else:
        needs = [[sample_length(i), patches_of(i), loss_entries_of(i)] for i in items]
        capacities = [np.array(dataclasses.astuple(s)) for s in shapes]
        rows = []
        if needs:
            bucket_index, rows, _ = choose_bucket(needs, capacities, num_rows)  # no cuts: drops
        # A sample that fits no row is dropped and counted, never the run (a micro-batch of
        # one long sample: an all-padding pack, loss 0).
        keep = [i for i, row in enumerate(rows) if row is not None]
        items, kept = [items[i] for i in keep], [kept[i] for i in keep]
        targets, with_vt = [targets[i] for i in keep], [with_vt[i] for i in keep]
        rows_of, shape = [rows[i] for i in keep], shapes[bucket_index]
    pack = shaped_pack(items, shape, num_rows, special, rows_of, fixed=shapes is not None)
    padding = float(1.0 - (pack.segment_ids > 0).mean())
    return SFTPacks(pack, kept, targets, with_vt, len(samples) - len(kept), padding, bucket_index)
