"""Visual-OPSD's three views of a sample, as Packs: the sampler prompt, the student, the teacher.

    prompt   [system?] [problem image] [question + instruction_suffix]
    student  prompt + [<|im_start|> completion <|im_end|>]
    teacher  [system?] [problem image] [question + instruction_suffix] [reference intro?]
             [VT image]+ [transition?] [<|im_start|> completion <|im_end|>]

The privileged channel is visual only by default (the paper's recipe); `privileged_thoughts`
and `privileged_answer` add the reference text thoughts / the answer as ablations. With
`noise_vt` every VT image's pixels are replaced by seeded Gaussian noise of the same shape (the
paper's control). The prefix [system, image, question] is token- and position-identical in
the student and the teacher.

Loss entries: the outputs at the completion's `<|im_start|>` and at each completion token,
predicting the completion tokens and the closing `<|im_end|>`. The teacher pack decides the
row of every sample (it is the longer view) and the student pack uses the same rows, so the
[R, C] loss arrays of the two packs align entry for entry.

If a teacher sample is longer than `max_forward_tokens`, its completion is truncated so it fits,
and both packs use the truncated completion. Training packs take the fixed shapes of
opsd_jax/data/pack_shapes.py (several samples per row where they fit; a sample that fits in no row
loses the end of its completion, in both packs); without shapes (tests, diagnostics) the sizes
are fitted to the content and rounded up to powers of two.
Sampler prompts are rounded up to a fixed list of lengths instead (config
`sample_prompt_buckets`), which bounds how often a run compiles the sampler.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import numpy as np

from models.pack import Pack, pad_pack
from opsd_jax.data.pack_shapes import PackShape, choose_bucket
from opsd_jax.data.packing import Image, SpecialTokens, Text, pack_samples, sample_length

# Our own wording. A checkpoint answers best with the system prompt it was trained with, so
# every text here can be replaced from the config.
DEFAULT_SYSTEM_PROMPT = (
    "You are a careful visual reasoner. Think step by step inside <think></think>. When a "
    "picture would help, you may think visually between <image_start> and <image_end>. Give "
    "the final answer inside <answer></answer>."
)
DEFAULT_REFERENCE_INTRO = (
    "The images that follow are privileged reference material: intermediate visual steps "
    "toward the correct solution. Use them silently; do not mention or describe them."
)
DEFAULT_TRANSITION_PROMPT = (
    "Now solve the problem above with your own independent reasoning, step by step."
)


@dataclasses.dataclass(frozen=True)
class PromptOptions:
    """The prompt wording and views, made from a run config by opsd_jax/run_config
    (`prompt_options`, where the defaults are; an empty text there is the wording above)."""

    use_system_prompt: bool
    system_prompt: str
    use_reference_intro: bool
    reference_intro: str
    use_transition_prompt: bool
    transition_prompt: str
    instruction_suffix: str
    privileged_thoughts: bool  # ablation: put the reference text thoughts in the teacher
    privileged_answer: bool  # ablation: put the reference answer in the teacher
    noise_vt: bool
    max_reference_rounds: int
    noise_seed: int
    # Offline mode's cached target (opsd_jax/training/offline/cache.py): 'text_only' = the reference completion
    # (text-only thought, answer) after the student prompt / the teacher context, as SFT and
    # OPSD see it; 'interleaved' = ThinkMorph's output split at the VT images.
    offline_target: str


Encode = Callable[[str], list[int]]


def _image(vit) -> Image:
    return Image(vit.patches, vit.position_ids)


def prompt_items(sample, encode: Encode, options: PromptOptions) -> list:
    """[system?] [problem image] [question + suffix]: what the student sees before answering."""
    items = []
    if options.use_system_prompt:
        items.append(Text(encode(options.system_prompt)))
    items.append(_image(sample.problem_image))
    items.append(Text(encode(sample.question + options.instruction_suffix)))
    return items


def _noise_like(patches: np.ndarray, seed: int, pid: str, index: int) -> np.ndarray:
    # Seeded per (run seed, sample, image), so the control is reproducible and resumable.
    key = [seed, index] + list(pid.encode("utf-8"))
    return np.random.default_rng(key).standard_normal(patches.shape).astype(patches.dtype)


def teacher_context_items(
    sample, encode: Encode, options: PromptOptions, prompt: list | None = None
) -> list:
    """The teacher's view up to (not including) the completion; it starts with the student's
    prompt (`prompt`: `prompt_items` of the sample, when the caller has them already)."""
    items = list(prompt_items(sample, encode, options) if prompt is None else prompt)
    if options.use_reference_intro:
        items.append(Text(encode(options.reference_intro)))
    rounds = min(len(sample.vt_images), options.max_reference_rounds)
    for k in range(rounds):
        if options.privileged_thoughts and k < len(sample.thoughts):
            items.append(Text(encode(sample.thoughts[k])))
        vt = sample.vt_images[k]
        patches = (
            _noise_like(vt.patches, options.noise_seed, sample.pid, k)
            if options.noise_vt
            else vt.patches
        )
        items.append(Image(patches, vt.position_ids))
    if options.privileged_thoughts and len(sample.thoughts) > rounds:
        items.extend(Text(encode(t)) for t in sample.thoughts[rounds:])
    if options.privileged_answer:
        items.append(Text(encode(f"The correct answer is {sample.answer}.")))
    if options.use_transition_prompt:
        items.append(Text(encode(options.transition_prompt)))
    return items


def bucket(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()


def bucket_in(n: int, buckets: Sequence[int]) -> int:
    """The smallest of `buckets` (ascending) >= n; an error naming the config key if none is."""
    for size in buckets:
        if size >= n:
            return int(size)
    raise ValueError(
        f"a sampler prompt needs {n} slots, more than the largest of "
        f"sample_prompt_buckets={tuple(buckets)}: add a larger bucket"
    )


def prompt_shape_bound(buckets: Sequence[int]) -> int:
    """How many (row length, patches) shapes prompts bucketed by `buckets` can take: a row's
    patches fit in its length, so the patch bucket is at most the length bucket (or absent)."""
    n = len(buckets)
    return n * (n + 1) // 2 + n


def build_prompt_pack(
    samples,
    encode: Encode,
    options: PromptOptions,
    special: SpecialTokens,
    num_rows: int | None = None,
    buckets: Sequence[int] | None = None,
) -> Pack:
    """One prompt per row (the sampler's input); row length and patches rounded up to one of
    `buckets` (default: powers of two)."""
    items = [prompt_items(s, encode, options) for s in samples]
    return prompt_pack_of(items, special, num_rows, buckets)


def build_teacher_prompt_pack(
    samples,
    encode: Encode,
    options: PromptOptions,
    special: SpecialTokens,
    num_rows: int | None = None,
    buckets: Sequence[int] | None = None,
) -> Pack:
    """The teacher's context (VT images included) as sampler prompts, one per row (evaluation
    of the with-VT model)."""
    items = [teacher_context_items(s, encode, options) for s in samples]
    return prompt_pack_of(items, special, num_rows, buckets)


def prompt_pack_of(
    items, special: SpecialTokens, num_rows: int | None = None, buckets=None
) -> Pack:
    """Sampler prompts from each row's items (Text / Image), one row each, the row length and
    patches rounded up to one of `buckets` (default: powers of two)."""
    round_up = bucket if buckets is None else (lambda n: bucket_in(n, buckets))
    longest = max(sample_length(i) for i in items)
    patches = max(sum(len(it.patches) for it in i if isinstance(it, Image)) for i in items)
    return pack_samples(
        items,
        row_length=round_up(longest),
        num_rows=num_rows,
        max_patches=round_up(patches),
        special=special,
        one_sample_per_row=True,
    )


@dataclasses.dataclass(frozen=True)
class TrainingPacks:
    student: Pack
    teacher: Pack
    kept: list[int]  # indices of the samples in the packs (a sample whose context alone
    # exceeds max_forward_tokens, or that fits in no row of the fixed shape, is dropped)
    completions: list[list[int]]  # the completions as packed (after truncation)
    num_truncated: int
    padding_fraction: dict[str, float]  # share of padding tokens per pack
    num_dropped: int = 0
    bucket: int = 0  # the length bucket of the fixed shapes used (0 without shapes)


def sampled_logprobs(
    packs: TrainingPacks, logprobs: Sequence[np.ndarray] | None, out: np.ndarray | None = None
) -> np.ndarray:
    """[rows, C] float32, the student pack's loss entries: at each completion token's entry,
    the log-prob the rollout drew it with (`logprobs[i]`: sample i's, one per completion token
    as sampled, before any cut); NaN at the closing <|im_end|> (its draw is not recorded), at
    empty entries, and everywhere without `logprobs`. The train step compares them with the
    student's own log-probs of the same tokens (the rollout's mismatch with the policy). `out`:
    an array to write them into (opsd_jax/training/pack_memory.py), else a new one."""
    student = packs.student
    drawn = np.empty(student.loss_mask.shape, np.float32) if out is None else out
    drawn[...] = np.nan
    if logprobs is None:
        return drawn
    for k, (index, completion) in enumerate(zip(packs.kept, packs.completions)):
        # A sample's entries lie in one row, in sequence order: its completion, then <|im_end|>.
        rows, cols = np.nonzero((student.loss_sample == k) & student.loss_mask)
        values = np.asarray(logprobs[index], np.float32)[: len(completion)]
        drawn[rows[: len(values)], cols[: len(values)]] = values
    return drawn


def entry_sources(
    pack: Pack,
    packed: Sequence,
    source_index: Mapping[str, int],
    out: np.ndarray | None = None,
) -> np.ndarray:
    """[rows, C] int32 over `pack`'s loss entries (an OPSD teacher pack's are the student's):
    each entry's data source, `source_index[sample.dataset]` of the sample it belongs to
    (`packed[j]`: the sample of pack sample id j); -1 at empty entries. The train step scores
    each entry with its source's teacher by it and logs each source's loss
    (opsd_jax/training/step_teachers.py). `out`: an array to write into, else a new one."""
    sources = np.empty(pack.loss_mask.shape, np.int32) if out is None else out
    sources[...] = -1
    for j, sample in enumerate(packed):
        sources[(pack.loss_sample == j) & pack.loss_mask] = source_index[sample.dataset]
    return sources


def build_training_packs(
    samples,
    completions: Sequence[Sequence[int]],
    encode: Encode,
    options: PromptOptions,
    special: SpecialTokens,
    *,
    num_rows: int,
    max_forward_tokens: int,
    shapes: dict[str, list[PackShape]] | None = None,
    out: Callable[[int], dict[str, Pack] | None] | None = None,
) -> TrainingPacks:
    """Student and teacher packs of the same samples and completions, rows shared, entries aligned.

    `shapes` ({'student', 'teacher'} -> a PackShape per length bucket, pack_shapes.pack_shapes)
    fixes the packs' sizes; None fits them to the content (powers of two). `out` (with
    `shapes`): the index of the bucket chosen -> empty arrays to write each pack into
    (pack_samples' `out`), or None for new ones."""
    if len(samples) != len(completions):
        raise ValueError(f"{len(samples)} samples but {len(completions)} completions")
    contexts, prompts, kept, packed_completions = [], [], [], []
    truncated = []  # per kept sample: its completion was cut
    for index, (sample, completion) in enumerate(zip(samples, completions)):
        prompt = prompt_items(sample, encode, options)
        context = teacher_context_items(sample, encode, options, prompt)
        room = max_forward_tokens - sample_length(context) - 2  # completion's two markers
        if room < 0:
            continue
        completion = list(completion)
        truncated.append(len(completion) > room)
        completion = completion[:room]
        kept.append(index)
        contexts.append(context)
        prompts.append(prompt)
        packed_completions.append(completion)
    if not kept and shapes is None:  # fixed shapes: an empty (all padding) pack, all dropped
        raise ValueError(f"no sample fits max_forward_tokens={max_forward_tokens}")

    def items(completion_list):
        answers = [Text(c, loss=True) for c in completion_list]
        return (
            [p + [a] for p, a in zip(prompts, answers)],
            [c + [a] for c, a in zip(contexts, answers)],
        )

    student_items, teacher_items = items(packed_completions)
    bucket_index = 0
    if shapes is None:
        rows_of = assign_rows([sample_length(i) for i in teacher_items], num_rows)
        loss_entries = bucket(per_row_max(student_items, rows_of, num_rows, loss_entries_of))
        sizes = {
            name: PackShape(
                bucket(per_row_max(its, rows_of, num_rows, sample_length)),
                bucket(per_row_max(its, rows_of, num_rows, patches_of)),
                loss_entries,
            )
            for name, its in (("student", student_items), ("teacher", teacher_items))
        }
    else:
        # Per sample: teacher tokens, teacher patches, student tokens, student patches, loss
        # entries; cutting one completion token shrinks the tokens and the loss entries.
        needs = [
            [sample_length(t), patches_of(t), sample_length(s), patches_of(s), loss_entries_of(s)]
            for s, t in zip(student_items, teacher_items)
        ]
        capacities = [
            np.array([t.row_length, t.patches, s.row_length, s.patches, t.loss_entries])
            for s, t in zip(shapes["student"], shapes["teacher"])
        ]
        bucket_index, rows, cuts = 0, [], []
        if needs:
            bucket_index, rows, cuts = choose_bucket(
                needs,
                capacities,
                num_rows,
                cuttable=[len(c) for c in packed_completions],
                cut_dims=np.array([True, False, True, False, True]),
            )
        # A sample that fits no row is dropped and counted, never the run: with one sample a
        # micro-batch (the one-GPU recipe) a long one leaves an all-padding pack, loss 0.
        keep = [i for i, row in enumerate(rows) if row is not None]
        truncated = [truncated[i] or cuts[i] > 0 for i in keep]
        kept = [kept[i] for i in keep]
        prompts, contexts = [prompts[i] for i in keep], [contexts[i] for i in keep]
        packed_completions = [
            packed_completions[i][: len(packed_completions[i]) - cuts[i]] for i in keep
        ]
        student_items, teacher_items = items(packed_completions)
        rows_of = [rows[i] for i in keep]
        sizes = {name: shapes[name][bucket_index] for name in ("student", "teacher")}
    pack_items = {"student": student_items, "teacher": teacher_items}
    given = (out(bucket_index) if out is not None and shapes is not None else None) or {}
    packs = {
        name: shaped_pack(
            pack_items[name],
            size,
            num_rows,
            special,
            rows_of,
            fixed=shapes is not None,
            out=given.get(name),
        )
        for name, size in sizes.items()
    }
    padding = {name: float(1.0 - (pack.segment_ids > 0).mean()) for name, pack in packs.items()}
    return TrainingPacks(
        packs["student"],
        packs["teacher"],
        kept,
        packed_completions,
        sum(truncated),
        padding,
        len(samples) - len(kept),  # over max_forward_tokens, or fitting no row
        bucket_index,
    )


def shaped_pack(
    items,
    shape: PackShape,
    num_rows: int,
    special: SpecialTokens,
    rows_of,
    *,
    fixed: bool,
    out: Pack | None = None,
) -> Pack:
    """pack_samples at `shape` (into `out`'s arrays if given); `fixed`: the ViT fields too even
    without images (zero-filled), so every pack of a fixed shape has the same arrays (one
    compiled step)."""
    pack = pack_samples(
        items,
        row_length=shape.row_length,
        num_rows=num_rows,
        max_patches=shape.patches,
        max_loss_entries=shape.loss_entries,
        special=special,
        rows_of=rows_of,
        out=out,
    )
    return pad_pack(pack, *dataclasses.astuple(shape)) if fixed else pack


def assign_rows(lengths: list[int], num_rows: int) -> list[int]:
    """Each sample's row: first fit, longest first, into rows of a bucketed length that doubles
    until the samples fit in `num_rows` rows."""
    if num_rows < 1:
        raise ValueError(f"num_rows must be >= 1, got {num_rows}")
    row_length = bucket(max(lengths))
    # Every sample fits one row (row_length >= the longest), so doubling always ends.
    while (rows_of := _first_fit_rows(lengths, row_length, num_rows)) is None:
        row_length *= 2
    return rows_of


def per_row_max(items, rows_of: list[int], num_rows: int, count) -> int:
    """The largest per-row total of `count(item)` over the rows the items are assigned to."""
    totals = np.zeros(num_rows, np.int64)
    for row, item in zip(rows_of, items):
        totals[row] += count(item)
    return int(totals.max())


def patches_of(item) -> int:
    return sum(len(it.patches) for it in item if isinstance(it, Image))


def loss_entries_of(item) -> int:
    """Loss entries of a sample whose last item is its target text (+1: the closing EOS)."""
    return len(item[-1].ids) + 1


def _first_fit_rows(lengths: list[int], row_length: int, num_rows: int) -> list[int] | None:
    free = [row_length] * num_rows
    rows = []
    # Longest first packs tighter; the row of each sample is recorded in input order.
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r in range(num_rows) if free[r] >= lengths[index]), None)
        if row is None:
            return None
        free[row] -= lengths[index]
        rows.append((index, row))
    return [row for _, row in sorted(rows)]
